"""Idle GPU holders: a pod holds a GPU or MIG device and does not use it.

The rule fires when the device's activity stays below ``threshold_pct`` for
``window_s`` of event time, counted from the later of the first idle sample
and the end of the pod's start-up grace. MIG devices are judged by their
graphics-engine activity (GPU utilisation is not reported for them).

Defaults differ per workload kind (``kinds``: notebook, batch, inference),
and pods can be exempted by namespace, label or annotation. An open episode
climbs a ladder while the device stays idle: the first finding notifies the
owner; ``warn_after_s`` later the finding is re-issued at severity warning
with a second notice; ``remind_before_s`` before the reclaim is due the owner is told a
last time (a Kubernetes Event lives an hour, the API server's ``--event-ttl``, and the
warning's was gone hours before the reclaim); ``reclaim_after_s`` after the warning the
rule asks to reclaim the GPU (verb ``requeue`` on the pod with ``params.reason``
``idle-reclaim``, a dry run unless ``reclaim_execute``; the Kubernetes
backend reclaims per owner kind, reversibly). Each step has its own
idempotency key.

A pod annotated ``gpusteward.io/keep-until: <RFC 3339 time>`` is left alone
until then, at most ``keep_until_max_s`` after its idle episode began: the
finding is raised and says so, but the owner is not notified and the ladder
does not climb while the hold lasts. The rule sees the annotation through the
watcher's allocation events; since the owner may add it after the rule asked
to reclaim, the reclaim action carries the episode start and the maximum, and
the backend checks the live pod again before it acts (:func:`kept_until` is
the one reading of the annotation both use).

The owner is told in the same words wherever they look: :func:`owner_notice` builds the text
from the finding (what was seen, since when, the ladder's next step and when, how to keep the
GPU), the notify action carries it as its reason (the Kubernetes Event), and the chat and
Alertmanager sinks build it again from the finding they receive.

On a device several pods hold, the node join runs the rule once per holder
on its share (``per_holder``): with per-process attribution each holder is
judged on its own activity, so the idle notebook beside a busy one is found
and only it; where the source cannot split the device (attribution
``shared``), a busy device says nothing about any one holder (no observation:
neither idle nor active), and an idle device is idle for all of them.

The idle run is tracked per device from the samples alone, so an allocation
event that arrives after the first idle samples does not delay detection.
Samples at or before the last one seen (duplicates, late arrivals) are
ignored; a gap longer than ``max_gap_s`` restarts the run, because a window
with no observations is not evidence of idleness.

It stays one module: the rule, its ladder, keep-until and the owner notice read the same
episode state; the notice text must say what the ladder will do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.registry import DeviceRunner, own_settings
from gpusteward.rules.values import WorkloadKind
from gpusteward.schema import Action, DeviceSample, Evidence, Finding, PodRef, Subject

KIND = "idle_holder"
KEEP_UNTIL_ANNOTATION = "gpusteward.io/keep-until"
"""Pod annotation: an RFC 3339 time until which the rule leaves an idle pod alone."""
RECLAIM_REASON = "idle-reclaim"
"""``params.reason`` of the ladder's reclaim action, which tells the backend to reclaim by
owner kind rather than requeue."""

RUNBOOK = (
    "The pod holds a GPU it has not used for the whole window. Ask the owner to release it "
    "(stop the notebook, scale the deployment to zero) or to add the exemption label if the "
    "hold is intended."
)


class IdleKindSettings(BaseModel):
    """Overrides of the idle settings for one workload kind; unset fields keep the rule's."""

    model_config = ConfigDict(extra="forbid")

    threshold_pct: float | None = Field(None, ge=0, le=100, description="See threshold_pct.")
    window_s: float | None = Field(None, gt=0, description="See window_s.")
    grace_s: float | None = Field(None, ge=0, description="See grace_s.")
    warn_after_s: float | None = Field(None, gt=0, description="See warn_after_s.")
    reclaim_after_s: float | None = Field(
        None, gt=0, description="See reclaim_after_s; 0 is not allowed, use reclaim: false.")
    reclaim: bool | None = Field(None, description="See reclaim.")


def _default_kinds() -> dict[str, IdleKindSettings]:
    return {
        "notebook": IdleKindSettings(),
        # A batch pod idle for long is usually stuck (a hung collective, a dead data loader):
        # reclaim sooner.
        "batch": IdleKindSettings(warn_after_s=3600, reclaim_after_s=3600),
        # Serving pods idle at night are doing their job (waiting for traffic): a window of a
        # whole day, longer than any night's trough (8 to 14 h without requests is common),
        # so only a server unused around the clock is flagged; never reclaimed
        # (scale-to-zero belongs to the autoscaler).
        "inference": IdleKindSettings(window_s=24 * 3600, reclaim=False),
    }


@dataclass(frozen=True, slots=True)
class Effective:
    """The idle settings that apply to one workload kind, resolved."""

    threshold_pct: float
    window_s: float
    grace_s: float
    warn_after_s: float
    reclaim_after_s: float
    reclaim: bool


class IdleSettings(BaseModel):
    """Settings of the idle-holder rule."""

    model_config = ConfigDict(extra="forbid")

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
    warn_after_s: float = Field(
        4 * 3600, gt=0,
        description="Seconds after the first notice, still idle, before the finding is raised "
        "to severity warning and the owner is told again (4 h: a working day's chance to act).",
    )
    reclaim_after_s: float = Field(
        8 * 3600, gt=0,
        description="Seconds after the warning, still idle, before the rule asks to reclaim "
        "the GPU (verb requeue on the pod).",
    )
    remind_before_s: float = Field(
        3600, ge=0,
        description="Seconds before a reclaim is due at which the owner is told once more "
        "(a notify_owner action, so a fresh Kubernetes Event): the API server deletes Events "
        "after its --event-ttl, 1 h by default, so the warning's Event is gone long before "
        "the reclaim 8 h later. 1 h: the reminder's Event lasts until the reclaim, and "
        "leaves an hour to keep or release the GPU. No reminder is sent when the wait from the "
        "warning to the reclaim is no longer than this (the warning's Event still stands); "
        "0: never.",
    )
    reclaim: bool = Field(True, description="Ask to reclaim at the last step of the ladder.")
    reclaim_execute: bool = Field(
        False, description="False marks the reclaim action dry_run: it is audited, never "
        "carried out. Set true only where owners have agreed to it.",
    )
    reclaim_bare_pods: bool = Field(
        False, description="Whether reclaiming may delete a pod that no controller owns: the "
        "one reclaim that cannot be undone (notebooks are stopped, Deployments and "
        "StatefulSets scaled to zero, Jobs and Kueue workloads requeued).",
    )
    keep_until_max_s: float = Field(
        14 * 86400, ge=0,
        description="Longest hold a gpusteward.io/keep-until pod annotation buys, seconds "
        "from the start of the idle episode (14 days: a conference trip or a holiday, not a "
        "permanent reservation). 0 ignores the annotation.",
    )
    kinds: dict[WorkloadKind, IdleKindSettings] = Field(
        default_factory=_default_kinds,
        description="Overrides per workload kind (notebook, batch, inference, from the pod's "
        "labels or owner chain; no other name is accepted); a pod of no known kind uses the "
        "rule's values.",
    )
    exempt_namespaces: list[str] = Field(
        default_factory=list, description="Namespaces whose pods are never flagged.")
    exempt_labels: dict[str, str] = Field(
        default_factory=lambda: {"gpusteward.io/idle-exempt": "true"},
        description="Pod labels that exempt a pod (key: value; value '*' matches any value).",
    )
    exempt_annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Pod annotations that exempt a pod (key: value; '*' matches any value).",
    )

    @functools.cached_property
    def effective_by_kind(self) -> dict[str | None, Effective]:
        """:meth:`effective` of every kind, computed once: a plain instance attribute, since
        pydantic's private attributes cost about a microsecond per access on this hot path."""
        return {kind: self._resolve(kind) for kind in (None, *self.kinds)}

    def effective(self, kind: str | None) -> Effective:
        """The settings for workload ``kind`` (runs on every sample)."""
        table = self.effective_by_kind
        found = table.get(kind)
        return found if found is not None else table[None]

    def _resolve(self, kind: str | None) -> Effective:
        over = self.kinds.get(kind) if kind is not None else None
        over = over or IdleKindSettings()
        return Effective(
            threshold_pct=_pick(over.threshold_pct, self.threshold_pct),
            window_s=_pick(over.window_s, self.window_s),
            grace_s=_pick(over.grace_s, self.grace_s),
            warn_after_s=_pick(over.warn_after_s, self.warn_after_s),
            reclaim_after_s=_pick(over.reclaim_after_s, self.reclaim_after_s),
            reclaim=self.reclaim if over.reclaim is None else over.reclaim,
        )

    def exempt(self, holder: Holder) -> bool:
        """True when the holder's namespace, labels or annotations exempt it."""
        return self.exemption(holder) is not None

    def exemption(self, holder: Holder) -> str | None:
        """What exempts the holder (its namespace, a label or an annotation), or None."""
        return exemption(self.exempt_params, holder.pod.namespace, holder.labels,
                         holder.annotations)

    @functools.cached_property
    def exempt_params(self) -> dict[str, Any]:
        """The exemptions as the reclaim action carries them (``params.exempt``, JSON), for
        the backend to check the live pod again before it acts."""
        return {"namespaces": self.exempt_namespaces, "labels": self.exempt_labels,
                "annotations": self.exempt_annotations}


def exemption(exempt: Mapping[str, Any], namespace: str, labels: Mapping[str, str],
              annotations: Mapping[str, str]) -> str | None:
    """What in ``exempt`` (:meth:`IdleSettings.exempt_params`) exempts a pod of
    ``namespace`` with these labels and annotations from idle detection, or None."""
    if namespace in exempt.get("namespaces", ()):
        return f"namespace {namespace}"
    for what, wanted, have in (("label", exempt.get("labels") or {}, labels),
                               ("annotation", exempt.get("annotations") or {}, annotations)):
        for key, value in wanted.items():
            if key in have and value in ("*", have[key]):
                return f"{what} {key}={have[key]}"
    return None


def _pick(override: float | None, base: float) -> float:
    return base if override is None else override


def kept_until(annotations: Mapping[str, str], idle_since: float, max_s: float
               ) -> float | None:
    """Until when a ``gpusteward.io/keep-until`` annotation keeps the pod (Unix seconds).

    Capped at ``idle_since + max_s``; None without the annotation, with an unreadable
    time (no time zone counts as unreadable: it would be read in the reader's zone), or
    when ``max_s`` is 0.
    """
    value = annotations.get(KEEP_UNTIL_ANNOTATION)
    if not value or max_s <= 0:
        return None
    try:
        until = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if until.tzinfo is None:
        return None
    return min(until.timestamp(), idle_since + max_s)


def rfc3339(ts: float) -> str:
    """Unix seconds as an RFC 3339 UTC time, for messages."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _held(until: float) -> str:
    return f"left alone until {rfc3339(until)} ({KEEP_UNTIL_ANNOTATION})"


def owner_notice(finding: Finding) -> str | None:
    """What the owner of an idle pod is told, from the finding alone; None for other findings.

    The one text of the Kubernetes Event, the chat message and the Alertmanager description,
    so the owner reads the same words wherever they look: what was seen, since when, what
    happens next and when, and how to keep the GPU. Pure, so every carrier builds it again
    from the finding it has rather than passing words around.
    """
    pod, values = finding.subject.pod, finding.evidence.values if finding.evidence else {}
    if finding.kind != KIND or finding.state != "firing" or pod is None:
        return None
    devices = int(values.get("devices", 1))
    where = (f"GPU {finding.subject.device}" if devices == 1 else
             f"all {devices} of its GPUs ({finding.subject.device} and {devices - 1} more)")
    where += f" on node {finding.subject.node}"
    peak = values.get("max_activity_pct")
    seen = (f"Pod {pod.namespace}/{pod.name} has held {where} below "
            f"{values.get('threshold_pct', 0):g} % activity"
            + (f" (peak {peak:g} %)" if peak is not None else "")
            + f" since {rfc3339(finding.starts_at)}.")
    step = int(values.get("ladder_step", 1))
    reclaim = finding.labels.get("reclaim", "execute")
    next_at = values.get("next_step_at")
    if step >= 3:
        then = f"Reclaim now: {_reclaim_effect(finding, reclaim)}."
    elif next_at is None:
        then = (f"Next: nothing more; {_never_reclaimed(finding, reclaim)}, and the notice "
                "stays until the GPU is used or released.")
    elif step == 1:
        after = (_never_reclaimed(finding, reclaim) if reclaim in ("off", "gang") else
                 f"then a reclaim: {_reclaim_effect(finding, reclaim)}")
        then = f"Next: if it stays idle, a warning at {rfc3339(next_at)}; {after}."
    else:
        then = (f"Next: if it stays idle, a reclaim at {rfc3339(next_at)}: "
                f"{_reclaim_effect(finding, reclaim)}.")
    if "kept_until" in values:
        then = (f"Left alone until {rfc3339(values['kept_until'])} as its "
                f"{KEEP_UNTIL_ANNOTATION} annotation asks. After that: {then}")
    limit = values.get("keep_until_limit")
    keep = ("To keep the GPU: kubectl annotate pod -n "
            f"{pod.namespace} {pod.name} {KEEP_UNTIL_ANNOTATION}=<RFC 3339 time>"
            + (f" (honoured up to {rfc3339(limit)}, the policy maximum)." if limit is not None
               else " has no effect here: policy ignores it (keep_until_max_s is 0).")
            + " Or release it: stop the notebook or scale the workload to zero.")
    return f"{seen} {then} {keep}"


def _never_reclaimed(finding: Finding, reclaim: str) -> str:
    """Why the ladder of the finding's holder ends without a reclaim."""
    if reclaim == "gang":
        gang = finding.labels.get("gang", "its gang")
        return (f"the pod is one member of {gang}, which is never reclaimed for one idle "
                "member (that would stop the whole gang) but judged as a whole once every "
                "member is idle (gang_idle)")
    return "this workload kind is never reclaimed"


def _reclaim_effect(finding: Finding, reclaim: str) -> str:
    """What the reclaim step does to this holder, per owner kind (as the backend does it)."""
    if reclaim == "dry_run":
        return "only recorded as a dry run, since policy does not carry reclaims out"
    if reclaim == "refused":
        return "refused: the pod has no controller and policy does not allow deleting it"
    if reclaim == "off":
        return "never done for this workload kind"
    owner_kind, _, owner_name = finding.labels.get("owner", "").partition("/")
    if not owner_name:
        return "the pod is deleted (no controller owns it)"
    if owner_kind == "Notebook":
        return f"Notebook {owner_name} is stopped (kubeflow-resource-stopped)"
    if owner_kind in ("Deployment", "StatefulSet"):
        return f"{owner_kind} {owner_name} is scaled to zero, its replicas kept to restore"
    if owner_kind in ("Job", "JobSet"):
        if "queue" in finding.labels:
            return f"its Kueue workload ({owner_kind} {owner_name}) is requeued"
        return f"the pod is deleted and {owner_kind} {owner_name} recreates it"
    return (f"refused: the pod is owned by {owner_kind} {owner_name}, and gpusteward reclaims "
            "only Notebooks, Deployments, StatefulSets, Jobs and Kueue workloads")


class Holder(msgspec.Struct, frozen=True):
    """The pod that holds a device, and since when."""

    pod: PodRef
    started_at: float
    workload_kind: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    queue: str | None = None
    owner_kind: str | None = None
    owner_name: str | None = None
    exempt: str | None = None
    """What exempts the pod under the settings its device is judged with (a namespace, a
    label, an annotation: :meth:`IdleSettings.exemption`), worked out once per holding by
    the node join, so that an open episode checks it per sample for the price of an
    attribute; None: not exempt (or not worked out, for a holder made elsewhere)."""
    gang: str | None = None
    """The gang the pod is one member of (``<Kind>/<name>`` in its namespace: a JobSet, a
    PyTorchJob, a PodGroup, a Kueue pod group; the watcher's ``PodAllocation.gang``), or
    None. A gang member is told as any holder but never reclaimed on its own: the reclaim
    of one pod (a Kueue workload requeued, a JobSet's pod deleted) stops every member,
    the busy ones on other nodes too, and this node's join sees only its own members."""
    images: tuple[str, ...] = ()
    """The images of the pod's GPU containers (``PodAllocation.images``): what the memory
    rules' ``exempt_images`` match."""
    memory_grows: bool = False
    """Its framework takes memory as it needs it (``PodAllocation.memory_grows``): no pool
    to exempt."""
    siblings: Any = None
    """For a pod holding several devices of the node: ``siblings(uuid)``, the node join's
    ``[(uuid, IdleTrack)]`` of the pod's devices other than ``uuid``. The pod is idle only
    while every one of them is (one busy GPU of a training job is work, not an idle hold,
    and reclaiming the pod would stop that work), and its episode is one, on the device
    that first saw the whole pod idle. None: the pod holds one device (or its others are
    not known here)."""


def _finding_labels(holder: Holder, sample: DeviceSample, settings: IdleSettings,
                    eff: Effective) -> dict[str, str]:
    """What the finding says about the holder, for routing and the owner's notice.

    ``reclaim`` says what the ladder's last step will do with this holder, so the notice can
    tell the owner: ``execute``, ``dry_run`` (audited only), ``off`` (never for this kind),
    ``gang`` (one member of a gang, never reclaimed on its own; ``gang`` names it) or
    ``refused`` (a pod no controller owns, which policy does not let the backend delete).
    It does not change within an episode, so it is safe among the alert's identifying labels.
    """
    labels = {"workload_kind": holder.workload_kind or "unknown", "model": sample.model}
    if holder.queue:
        labels["queue"] = holder.queue
    if holder.owner_name:
        labels["owner"] = f"{holder.owner_kind or 'Pod'}/{holder.owner_name}"
    if not eff.reclaim:
        labels["reclaim"] = "off"
    elif holder.gang is not None:
        labels["reclaim"], labels["gang"] = "gang", holder.gang
    elif not settings.reclaim_execute:
        labels["reclaim"] = "dry_run"
    elif holder.owner_name is None and not settings.reclaim_bare_pods:
        labels["reclaim"] = "refused"
    else:
        labels["reclaim"] = "execute"
    return labels


def _ladder_values(max_activity_pct: float, eff: Effective, step: int, step_ts: float,
                   held: float | None, idle_since: float, settings: IdleSettings,
                   devices: int = 1, reclaims: bool = True) -> dict[str, float]:
    """The evidence values of a ladder finding, with what the owner's notice needs.

    ``next_step_at``: when the ladder's next step is due if the device stays idle (absent
    when none follows); a hold moves it to the hold's end at the earliest, since the ladder
    climbs on the first sample after it. ``keep_until_limit``: the latest time a
    keep-until annotation is honoured for this episode (absent when annotations are
    ignored). ``devices``: how many devices of the node the idle pod holds, when more
    than one (its episode is one, on one of them). ``reclaims``: whether the ladder ends
    in a reclaim for this holder (:func:`_reclaims`)."""
    values = {"max_activity_pct": max_activity_pct, "threshold_pct": eff.threshold_pct,
              "ladder_step": float(step)}
    if devices > 1:
        values["devices"] = float(devices)
    wait = eff.warn_after_s if step == 1 else eff.reclaim_after_s if (
        step == 2 and reclaims) else None
    if wait is not None:
        values["next_step_at"] = max(step_ts + wait, held or 0.0)
    if held is not None:
        values["kept_until"] = held
    if settings.keep_until_max_s > 0:
        values["keep_until_limit"] = idle_since + settings.keep_until_max_s
    return values


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
    stage: int = 0
    """Ladder step of the open episode: 1 notified, 2 warned, 3 reclaim asked."""
    stage_ts: float | None = None
    held_until: float | None = None
    """The keep-until time last reported on the open episode, so a hold is said once."""
    reminded: bool = False
    """Whether the owner was reminded of the coming reclaim (``remind_before_s``)."""


def activity_pct(sample: DeviceSample) -> float | None:
    """The activity measure of a device: engine activity on MIG, GPU utilisation otherwise."""
    if sample.kind == "mig":
        return sample.engine_active_pct
    return sample.util_pct if sample.util_pct is not None else sample.engine_active_pct


def same_pod(a: PodRef, b: PodRef) -> bool:
    """One pod: by uid where both have one (a pod restarted under its name is another),
    else by namespace and name (the collector's attribution carries no uid)."""
    if a.uid is not None and b.uid is not None:
        return a.uid == b.uid
    return (a.namespace, a.name) == (b.namespace, b.name)


def _subject(node: str, uuid: str, pod: PodRef) -> Subject:
    return Subject(node=node, device=uuid, pod=pod)


def _recent(track: IdleTrack, ts: float, settings: IdleSettings) -> bool:
    """Whether the device's last reading is recent enough to say anything (a gap longer than
    ``max_gap_s`` is no evidence either way)."""
    return track.last_ts is not None and ts - track.last_ts <= settings.max_gap_s


def _busy_sibling(track: IdleTrack, others: list[tuple[str, IdleTrack]], ts: float,
                  settings: IdleSettings) -> str | None:
    """The first of a pod's other devices whose last reading was busy, or None; their idle
    peaks are folded into ``track``'s, the peak the pod's episode reports."""
    for uuid, other in others:
        if not _recent(other, ts, settings):
            continue
        if other.below_since is None:
            return uuid
        if other.below_max_pct > track.below_max_pct:
            track.below_max_pct = other.below_max_pct
    return None


def observe(
    track: IdleTrack,
    node: str,
    sample: DeviceSample,
    ts: float,
    settings: IdleSettings,
    holder: Holder | None,
) -> list[Finding | Action]:
    """Fold one device sample into ``track``; return the findings and actions it causes.

    The node join calls it positionally (the registry's sample hook: track, node, sample,
    ts, settings, holder), so it needs no wrapper on the hot path."""
    if track.last_ts is not None and ts <= track.last_ts:
        return []
    activity = activity_pct(sample)
    if activity is None:
        # No reading is no observation: it must neither extend an idle run nor hide the gap
        # before the next real reading.
        return []
    eff = settings.effective(holder.workload_kind if holder is not None else None)
    if sample.attribution == "shared" and activity >= eff.threshold_pct:
        # Some holder of the shared device is busy, and nothing says which: crediting the
        # work to this one would hide its idleness, calling it idle might be wrong.
        return []
    gap = track.last_ts is not None and ts - track.last_ts > settings.max_gap_s
    track.last_ts = ts
    out: list[Finding | Action] = []
    if activity >= eff.threshold_pct:
        track.below_since, track.below_samples, track.below_max_pct = None, 0, 0.0
        if track.open_id is not None:
            # Busy under another pod (the episode's pod stopped, its GPU given to waiting
            # work before its end was read): that pod did not use it again, it let it go.
            moved = (holder is not None and track.open_pod is not None
                     and not same_pod(holder.pod, track.open_pod))
            out.append(_close(track, node, sample.uuid, ts,
                              "the pod released the GPU" if moved
                              else "the pod is using the GPU again"))
        return out
    if track.below_since is None or gap:
        track.below_since, track.below_samples, track.below_max_pct = ts, 0, 0.0
    track.below_samples += 1
    if activity > track.below_max_pct:  # not max(): a builtin call per idle device sample
        track.below_max_pct = activity
    if holder is None:
        return out
    if track.open_id is not None:
        assert track.open_pod is not None
        if not same_pod(holder.pod, track.open_pod):
            # Another pod holds the device: the episode's pod let it go, though its end was
            # read ahead of the samples that opened the episode (a worker catching up). Its
            # ladder must not climb with the next pod's name.
            return [_close(track, node, sample.uuid, ts, "the pod released the GPU")]
        # The owner may exempt the pod as the notice says (a label), or the policy its
        # namespace, while the episode is open: it closes, and the ladder climbs no further.
        if holder.exempt is not None:
            return [_close(track, node, sample.uuid, ts,
                           f"exempt from idle detection ({holder.exempt})")]
        devices = 1
        if holder.siblings is not None:
            others = holder.siblings(sample.uuid)
            busy = _busy_sibling(track, others, ts, settings)
            if busy is not None:
                return [_close(track, node, sample.uuid, ts,
                               f"the pod is using {busy}, another of its devices")]
            devices += len(others)
        return _climb(track, node, sample, holder, ts, settings, eff, devices)
    counted_from = max(track.below_since, holder.started_at + eff.grace_s)
    if ts - counted_from < eff.window_s or settings.exempt(holder):
        return out
    pod_devices = [sample.uuid]
    if holder.siblings is not None:  # a pod of several devices: idle only if all of them are
        others = holder.siblings(sample.uuid)
        if _busy_sibling(track, others, ts, settings) is not None:
            return out
        for _, other in others:
            if other.open_id is not None and other.open_pod is not None and same_pod(
                    other.open_pod, holder.pod):
                return out  # the pod's episode is open on another of its devices
            if other.below_since is not None and _recent(other, ts, settings):
                counted_from = max(counted_from, other.below_since)  # its shortest idle run
        if ts - counted_from < eff.window_s:
            return out
        pod_devices += sorted(uuid for uuid, _ in others)
    fp = fingerprint(KIND, node, sample.uuid, holder.pod.namespace, holder.pod.name)
    fid = finding_id(fp, counted_from)
    subject = _subject(node, sample.uuid, holder.pod)
    idle_min = (ts - counted_from) / 60
    held = kept_until(holder.annotations, counted_from, settings.keep_until_max_s)
    held = held if held is not None and held > ts else None
    values = _ladder_values(track.below_max_pct, eff, 1, ts, held, counted_from, settings,
                            len(pod_devices), _reclaims(eff, holder))
    what = (sample.uuid if len(pod_devices) == 1 else
            f"{len(pod_devices)} devices ({', '.join(pod_devices)})")
    finding = Finding(
        id=fid, fingerprint=fp, kind=KIND, severity="info", state="firing",
        subject=subject,
        summary=f"{holder.pod.namespace}/{holder.pod.name} has held {what} on {node} "
        f"for {idle_min:.0f} min below {eff.threshold_pct:g} % activity"
        + (f"; {_held(held)}" if held is not None else ""),
        starts_at=counted_from, ts=ts,
        evidence=Evidence(
            window_start=counted_from, window_end=ts, samples=track.below_samples,
            values=values,
        ),
        runbook=RUNBOOK,
        labels=_finding_labels(holder, sample, settings, eff),
    )
    track.open_id, track.open_fingerprint = fid, fp
    track.open_since, track.open_pod = counted_from, holder.pod
    track.stage, track.stage_ts = 1, ts
    track.held_until = held
    out.append(finding)
    if held is None:  # the owner asked to be left alone: no notice while the hold lasts
        out.append(action_for(finding, "notify_owner", subject,
                              owner_notice(finding) or finding.summary))
    return out


def _climb(track: IdleTrack, node: str, sample: DeviceSample, holder: Holder, ts: float,
           settings: IdleSettings, eff: Effective, devices: int = 1
           ) -> list[Finding | Action]:
    """The next ladder step of an open episode, once its wait has passed with no break."""
    stage_ts = track.stage_ts
    if stage_ts is None or track.stage >= 3 or track.below_since is None:
        return []
    if track.stage == 1:
        wait, step, severity = eff.warn_after_s, "warn", "warning"
    elif _reclaims(eff, holder):
        wait, step, severity = eff.reclaim_after_s, "reclaim", "warning"
    else:
        return []
    assert track.open_id and track.open_fingerprint and track.open_since is not None
    held = kept_until(holder.annotations, track.open_since, settings.keep_until_max_s)
    idle_h = (ts - track.open_since) / 3600
    what = sample.uuid if devices == 1 else f"{sample.uuid} and {devices - 1} more devices"
    summary = (f"{holder.pod.namespace}/{holder.pod.name} has held {what} on {node} "
               f"idle for {idle_h:.1f} h")
    if held is not None and held > ts:
        # Left alone while the hold lasts: no notice, no reclaim. The next step comes once
        # it ends and its wait has passed; the finding says so once per hold.
        if track.held_until == held:
            return []
        track.held_until = held
        current = "info" if track.stage == 1 else "warning"
        assert track.stage_ts is not None
        return [_ladder_finding(track, node, sample, holder, ts, settings, eff, current,
                                f"{summary}; {_held(held)}", track.stage, track.stage_ts, held,
                                devices)]
    # A gap since the last step restarted the idle run: the wait counts from its new start.
    waited_from = max(stage_ts, track.below_since)
    if ts - waited_from < wait:
        if step == "reclaim" and not track.reminded and (
                0 < settings.remind_before_s < wait
                and ts >= waited_from + wait - settings.remind_before_s):
            track.reminded = True
            return [_reminder(track, node, sample, holder, ts, settings, eff, waited_from,
                              summary, devices)]
        return []
    if step == "reclaim":
        summary += ": reclaiming it"
    finding = _ladder_finding(track, node, sample, holder, ts, settings, eff, severity,
                              summary, track.stage + 1, ts, None, devices)
    subject = finding.subject
    track.stage, track.stage_ts = track.stage + 1, ts
    if step == "warn":
        action = action_for(finding, "notify_owner", subject,
                              owner_notice(finding) or finding.summary)
        action.idempotency_key = f"{finding.id}/notify_owner/warn"
    else:
        action = action_for(finding, "requeue", subject, summary)
        action.dry_run = not settings.reclaim_execute
        # What the backend needs to reclaim safely: the hold's cap, to check the live pod's
        # keep-until again, and whether a bare pod may be deleted.
        action.params = {"reason": RECLAIM_REASON, "idle_since": repr(track.open_since),
                         "keep_until_max_s": repr(settings.keep_until_max_s),
                         "delete_bare_pod": str(settings.reclaim_bare_pods).lower(),
                         "exempt": json.dumps(settings.exempt_params, sort_keys=True)}
    return [finding, action]


def _reminder(track: IdleTrack, node: str, sample: DeviceSample, holder: Holder, ts: float,
              settings: IdleSettings, eff: Effective, waited_from: float,
              summary: str, devices: int) -> Action:
    """The owner's last notice before the reclaim: the warning's words, the reclaim time
    as it now stands, under a key of its own (one Event per episode, whatever redelivers
    it)."""
    warned = _ladder_finding(track, node, sample, holder, ts, settings, eff, "warning",
                             summary, 2, waited_from, None, devices)
    action = action_for(warned, "notify_owner", warned.subject,
                        f"Reminder: {owner_notice(warned) or warned.summary}")
    action.idempotency_key = f"{warned.id}/notify_owner/remind"
    return action


def _reclaims(eff: Effective, holder: Holder) -> bool:
    """Whether the ladder ends in a reclaim for ``holder``: not for a kind never reclaimed,
    nor for one member of a gang (:attr:`Holder.gang`)."""
    return eff.reclaim and holder.gang is None


def _ladder_finding(track: IdleTrack, node: str, sample: DeviceSample, holder: Holder,
                    ts: float, settings: IdleSettings, eff: Effective, severity: str,
                    summary: str, step: int, step_ts: float, held: float | None,
                    devices: int) -> Finding:
    """The open episode's finding, re-issued at ladder ``step`` (reached at ``step_ts``)."""
    assert track.open_id and track.open_fingerprint and track.open_since is not None
    assert track.below_since is not None
    values = _ladder_values(track.below_max_pct, eff, step, step_ts, held, track.open_since,
                            settings, devices, _reclaims(eff, holder))
    return Finding(
        id=track.open_id, fingerprint=track.open_fingerprint, kind=KIND,
        severity=severity,  # type: ignore[arg-type]
        state="firing", subject=_subject(node, sample.uuid, holder.pod), summary=summary,
        starts_at=track.open_since, ts=ts,
        # The evidence is the unbroken idle run, which a gap may have restarted since.
        evidence=Evidence(window_start=max(track.open_since, track.below_since), window_end=ts,
                          samples=track.below_samples, values=values),
        runbook=RUNBOOK,
        labels=_finding_labels(holder, sample, settings, eff),
    )


def release(track: IdleTrack, node: str, uuid: str, ts: float) -> list[Finding | Action]:
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
    track.stage, track.stage_ts = 0, None
    track.reminded = False
    return finding


def clock_step(track: IdleTrack, step: float) -> None:
    """The node's clock went back ``step`` s: the idle run starts over on the new clock, as
    after a gap; an open episode goes on (its start and its ladder step moved back by the
    step), so idle samples keep it open under its id, its next step waits out its wait from
    the new run's start, and a busy sample closes it."""
    track.last_ts = None
    track.below_since, track.below_samples, track.below_max_pct = None, 0, 0.0
    if track.open_since is not None:
        track.open_since -= step
    if track.stage_ts is not None:
        track.stage_ts -= step


RUNNER = DeviceRunner(state="idle", state_type=IdleTrack, settings_from=own_settings(KIND),
                      on_sample=observe, on_release=release, on_clock_step=clock_step,
                      per_holder=True)
"""How the node join runs the rule: on every device sample, and when a holder lets go."""
