"""Idle GPU holders: a pod holds a GPU or MIG device and does not use it.

The rule fires when the device's activity stays below ``threshold_pct`` for
``window_s`` of event time, counted from the later of the first idle sample
and the end of the pod's start-up grace. MIG devices are judged by their
graphics-engine activity (GPU utilisation is not reported for them).

The idle run is tracked per device from the samples alone, so an allocation
event that arrives after the first idle samples does not delay detection.
Samples at or before the last one seen (duplicates, late arrivals) are
ignored; a gap longer than ``max_gap_s`` restarts the run, because a window
with no observations is not evidence of idleness.
"""

from __future__ import annotations

import msgspec
from pydantic import BaseModel, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.schema import Action, DeviceSample, Evidence, Finding, PodRef, Subject

KIND = "idle_holder"

RUNBOOK = (
    "The pod holds a GPU it has not used for the whole window. Ask the owner to release it "
    "(stop the notebook, scale the deployment to zero) or to add the exemption label if the "
    "hold is intended."
)


class IdleSettings(BaseModel):
    """Settings of the idle-holder rule."""

    threshold_pct: float = Field(
        5.0, ge=0, le=100,
        description="Activity (GPU utilisation or MIG engine activity, percent) below which a "
        "sample counts as idle. 5 % separates a kernel-less process from real work.",
    )
    window_s: float = Field(
        1800, gt=0,
        description="Seconds of uninterrupted idleness before the rule fires (30 min: long "
        "enough that a pause between epochs or a coffee break does not count).",
    )
    grace_s: float = Field(
        600, ge=0,
        description="Seconds after the pod starts during which idleness is not counted "
        "(10 min for image pulls, data loading and compilation).",
    )
    max_gap_s: float = Field(
        300, gt=0,
        description="A gap between two samples longer than this (seconds) restarts the idle "
        "run: no observations means no evidence.",
    )


class Holder(msgspec.Struct, frozen=True):
    """The pod that holds a device, and since when."""

    pod: PodRef
    started_at: float
    workload_kind: str | None = None


class IdleTrack(msgspec.Struct):
    """Per-device state of the rule."""

    last_ts: float | None = None
    below_since: float | None = None
    below_samples: int = 0
    below_max_pct: float = 0.0
    open_id: str | None = None
    open_fingerprint: str | None = None
    open_since: float | None = None
    open_pod: PodRef | None = None


def activity_pct(sample: DeviceSample) -> float | None:
    """The activity measure of a device: engine activity on MIG, GPU utilisation otherwise."""
    if sample.kind == "mig":
        return sample.engine_active_pct
    return sample.util_pct if sample.util_pct is not None else sample.engine_active_pct


def _subject(node: str, uuid: str, pod: PodRef) -> Subject:
    return Subject(node=node, device=uuid, pod=pod)


def observe(
    track: IdleTrack,
    *,
    node: str,
    sample: DeviceSample,
    holder: Holder | None,
    ts: float,
    settings: IdleSettings,
) -> list[Finding | Action]:
    """Fold one device sample into ``track``; return the findings and actions it causes."""
    if track.last_ts is not None and ts <= track.last_ts:
        return []
    activity = activity_pct(sample)
    gap = track.last_ts is not None and ts - track.last_ts > settings.max_gap_s
    track.last_ts = ts
    if activity is None:
        return []
    out: list[Finding | Action] = []
    if activity >= settings.threshold_pct:
        track.below_since, track.below_samples, track.below_max_pct = None, 0, 0.0
        if track.open_id is not None:
            out.append(_close(track, node, sample.uuid, ts, "the pod is using the GPU again"))
        return out
    if track.below_since is None or gap:
        track.below_since, track.below_samples, track.below_max_pct = ts, 0, 0.0
    track.below_samples += 1
    track.below_max_pct = max(track.below_max_pct, activity)
    if holder is None or track.open_id is not None:
        return out
    counted_from = max(track.below_since, holder.started_at + settings.grace_s)
    if ts - counted_from < settings.window_s:
        return out
    fp = fingerprint(KIND, node, sample.uuid, holder.pod.namespace, holder.pod.name)
    fid = finding_id(fp, counted_from)
    subject = _subject(node, sample.uuid, holder.pod)
    idle_min = (ts - counted_from) / 60
    finding = Finding(
        id=fid, fingerprint=fp, kind=KIND, severity="warning", state="firing",
        subject=subject,
        summary=f"{holder.pod.namespace}/{holder.pod.name} has held {sample.uuid} on {node} "
        f"for {idle_min:.0f} min below {settings.threshold_pct:g} % activity",
        starts_at=counted_from, ts=ts,
        evidence=Evidence(
            window_start=counted_from, window_end=ts, samples=track.below_samples,
            values={"max_activity_pct": track.below_max_pct,
                    "threshold_pct": settings.threshold_pct},
        ),
        runbook=RUNBOOK,
        labels={"workload_kind": holder.workload_kind or "unknown", "model": sample.model},
    )
    track.open_id, track.open_fingerprint = fid, fp
    track.open_since, track.open_pod = counted_from, holder.pod
    out.append(finding)
    out.append(action_for(finding, "notify_owner", subject, finding.summary))
    return out


def release(track: IdleTrack, *, node: str, uuid: str, ts: float) -> list[Finding | Action]:
    """The holder let the device go: close an open episode and forget the idle run."""
    track.below_since, track.below_samples, track.below_max_pct = None, 0, 0.0
    if track.open_id is None:
        return []
    return [_close(track, node, uuid, ts, "the pod released the GPU")]


def _close(track: IdleTrack, node: str, uuid: str, ts: float, why: str) -> Finding:
    assert track.open_id and track.open_fingerprint and track.open_pod and track.open_since
    finding = resolved(
        track.open_id, track.open_fingerprint, KIND, _subject(node, uuid, track.open_pod),
        f"{track.open_pod.namespace}/{track.open_pod.name}: {why}", track.open_since, ts,
    )
    track.open_id = track.open_fingerprint = None
    track.open_since = track.open_pod = None
    return finding
