"""ECC double-bit errors: an uncorrectable memory error makes a GPU unsafe for new work.

The volatile DBE counter counts since the driver loaded, so any value above
zero means the GPU has had an uncorrectable error since its last reset. An
episode opens on the first observation (a sample or an urgent hardware
event) and closes when a sample reads zero again (the GPU was reset). One
episode gives one finding and one cordon action, however many samples
repeat the count.
"""

from __future__ import annotations

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.registry import DeviceRunner, own_settings
from gpusteward.schema import Action, DeviceSample, Evidence, Finding, HwEvent, Subject

KIND = "ecc_dbe"

RUNBOOK = (
    "An uncorrectable (double-bit) ECC error hit this GPU. The node is cordoned so no new work "
    "lands there. Drain the running pods, reset the GPU (or reboot the node) and check "
    "remapped rows; if the error recurs after a reset, open an RMA."
)


class EccSettings(BaseModel):
    """Settings of the ECC double-bit rule."""

    model_config = ConfigDict(extra="forbid")

    cordon: bool = Field(
        True,
        description="Ask to cordon the node when a DBE is seen. Whether the cordon is carried "
        "out is the remediation executor's decision (dry-run by default).",
    )


class EccTrack(msgspec.Struct):
    """Per-device state of the rule."""

    last_sample_ts: float | None = None
    open_id: str | None = None
    open_fingerprint: str | None = None
    open_since: float | None = None


def observe(
    track: EccTrack,
    *,
    node: str,
    uuid: str,
    dbe_count: int | None,
    ts: float,
    settings: EccSettings,
    from_sample: bool = True,
) -> list[Finding | Action]:
    """Fold one DBE reading into ``track``; ``from_sample`` is False for an urgent event."""
    if from_sample:
        if track.last_sample_ts is not None and ts <= track.last_sample_ts:
            return []
        track.last_sample_ts = ts
    if dbe_count is None:
        return []
    subject = Subject(node=node, device=uuid)
    if dbe_count == 0:
        if track.open_id is None or not from_sample or ts <= (track.open_since or 0):
            return []
        assert track.open_fingerprint and track.open_since is not None
        closing = resolved(track.open_id, track.open_fingerprint, KIND, subject,
                           f"{uuid} on {node}: DBE counter back to 0 (GPU reset)",
                           track.open_since, ts)
        track.open_id = track.open_fingerprint = track.open_since = None
        return [closing]
    if track.open_id is not None:
        return []
    fp = fingerprint(KIND, node, uuid)
    fid = finding_id(fp, ts)
    finding = Finding(
        id=fid, fingerprint=fp, kind=KIND, severity="critical", state="firing",
        subject=subject,
        summary=f"uncorrectable ECC error on {uuid} ({node}): {dbe_count} volatile DBE",
        starts_at=ts, ts=ts,
        evidence=Evidence(window_start=ts, window_end=ts, samples=1,
                          values={"ecc_dbe_volatile": float(dbe_count)}),
        runbook=RUNBOOK,
    )
    track.open_id, track.open_fingerprint, track.open_since = fid, fp, ts
    out: list[Finding | Action] = [finding]
    if settings.cordon:
        out.append(action_for(finding, "cordon", Subject(node=node), finding.summary))
    return out


def observe_sample(track: EccTrack, node: str, device: DeviceSample, ts: float,
                   settings: EccSettings, holder: object = None) -> list[Finding | Action]:
    """The registry's sample hook: the sample's volatile DBE count. A zero count with no
    episode open, the reading of almost every sample, returns at once."""
    last = track.last_sample_ts
    if last is not None and ts <= last:
        return []
    dbe = device.ecc_dbe_volatile
    if not dbe and track.open_id is None:
        track.last_sample_ts = ts
        return []
    return observe(track, node=node, uuid=device.uuid, dbe_count=device.ecc_dbe_volatile,
                   ts=ts, settings=settings)


def observe_dbe_event(track: EccTrack, event: HwEvent, uuid: str,
                      settings: EccSettings) -> list[Finding | Action]:
    """The urgent ``ecc_dbe`` event: one DBE unless it says how many."""
    return observe(track, node=event.node, uuid=uuid,
                   dbe_count=event.count if event.count is not None else 1, ts=event.ts,
                   settings=settings, from_sample=False)


def _unhealthy(track: EccTrack) -> bool:
    return track.open_id is not None


def clock_step(track: EccTrack, step: float) -> None:
    """The node's clock went back ``step`` s: samples count from the new clock on; an open
    episode goes on, its start moved back by the step (a zero count after it closes it)."""
    track.last_sample_ts = None
    if track.open_since is not None:
        track.open_since -= step


RUNNER = DeviceRunner(state="ecc", state_type=EccTrack, settings_from=own_settings(KIND),
                      on_sample=observe_sample, events={"ecc_dbe": observe_dbe_event},
                      on_clock_step=clock_step, unhealthy=_unhealthy)
"""How the node join runs the rule: every device sample and the urgent DBE event."""
