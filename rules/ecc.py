"""ECC double-bit errors: an uncorrectable memory error makes a GPU unsafe for new work.

The volatile DBE counter counts since the driver loaded, so any value above
zero means the GPU has had an uncorrectable error since its last reset. An
episode opens on the first observation (a sample, the urgent ``ecc_dbe``
event, or Xid 48, which the XID rule leaves to this rule) and closes when a
sample reads zero again (the GPU was reset). One episode gives one finding
and one cordon action, however many samples, events and XIDs repeat it.

A source that reads no DBE counter (it sends only XIDs) can never read the
zero: there the episode closes after the quiet window of Xid 48's class in
the XID rule (24 h by default) with no DBE event or Xid 48, as that rule's
episode did before this rule took the XID.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules import xid as xid_rule
from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.idle import Holder
from gpusteward.rules.registry import DeviceRunner
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


@dataclass(frozen=True)
class EccRun:
    """What the rule's runner needs: its settings and the XID rule's word on Xid 48."""

    ecc: EccSettings
    takes_xid: bool
    """The XID rule leaves Xid 48 to this rule (:meth:`XidSettings.hands_off`)."""
    quiet_s: float
    """Seconds without a DBE event or Xid 48 that close an episode on a GPU whose DBE
    counter no sample carries (the window of Xid 48's class)."""

    @classmethod
    def from_rules(cls, rules: Mapping[str, BaseModel]) -> EccRun:
        ecc = rules[KIND]
        xids = rules[xid_rule.KIND]
        assert isinstance(ecc, EccSettings) and isinstance(xids, xid_rule.XidSettings)
        policy = xids.classes.get(xids.classify(xid_rule.XID_DBE)[0])
        return cls(ecc, xids.hands_off(xid_rule.XID_DBE),
                   policy.window_s if policy is not None else xids.rma_window_s)


class EccTrack(msgspec.Struct, omit_defaults=True):
    """Per-device state of the rule."""

    last_sample_ts: float | None = None
    open_id: str | None = None
    open_fingerprint: str | None = None
    open_since: float | None = None
    counter_read: bool = False
    """A sample has carried the DBE counter: its zero, not a quiet time, closes episodes."""
    last_event_ts: float | None = None
    """The last DBE event or Xid 48 of the open episode."""


def observe(
    track: EccTrack,
    *,
    node: str,
    uuid: str,
    dbe_count: int | None,
    ts: float,
    settings: EccSettings,
    from_sample: bool = True,
    xid: int | None = None,
) -> list[Finding | Action]:
    """Fold one DBE reading into ``track``; ``from_sample`` is False for an urgent event,
    ``xid`` the XID that reported it (no count of its own)."""
    if from_sample:
        if track.last_sample_ts is not None and ts <= track.last_sample_ts:
            return []
        track.last_sample_ts = ts
    else:
        track.last_event_ts = max(ts, track.last_event_ts or ts)
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
        summary=f"uncorrectable ECC error on {uuid} ({node}): "
        + (f"Xid {xid}" if xid is not None else f"{dbe_count} volatile DBE"),
        starts_at=ts, ts=ts,
        evidence=Evidence(window_start=ts, window_end=ts, samples=1,
                          values={"xid": float(xid)} if xid is not None
                          else {"ecc_dbe_volatile": float(dbe_count)}),
        runbook=RUNBOOK,
        labels={"xids": str(xid)} if xid is not None else {},
    )
    track.last_event_ts = None if from_sample else ts
    track.open_id, track.open_fingerprint, track.open_since = fid, fp, ts
    out: list[Finding | Action] = [finding]
    if settings.cordon:
        out.append(action_for(finding, "cordon", Subject(node=node), finding.summary))
    return out


def observe_sample(track: EccTrack, node: str, device: DeviceSample, ts: float,
                   settings: EccRun, holder: object = None) -> list[Finding | Action]:
    """The registry's sample hook: the sample's volatile DBE count. A zero count with no
    episode open, the reading of almost every sample, returns at once."""
    last = track.last_sample_ts
    if last is not None and ts <= last:
        return []
    dbe = device.ecc_dbe_volatile
    if not dbe and track.open_id is None:
        track.last_sample_ts = ts
        if dbe is not None and not track.counter_read:
            track.counter_read = True
        return []
    if dbe is None:
        track.last_sample_ts = ts
        return _quiet(track, node, device.uuid, ts, settings)
    track.counter_read = True
    return observe(track, node=node, uuid=device.uuid, dbe_count=dbe, ts=ts,
                   settings=settings.ecc)


def _quiet(track: EccTrack, node: str, uuid: str, ts: float,
           settings: EccRun) -> list[Finding | Action]:
    """Close an episode that no counter can close once its events have stopped long enough."""
    if (track.open_id is None or track.counter_read or track.last_event_ts is None
            or ts - track.last_event_ts < settings.quiet_s):
        return []
    assert track.open_fingerprint and track.open_since is not None
    closing = resolved(track.open_id, track.open_fingerprint, KIND,
                       Subject(node=node, device=uuid),
                       f"{uuid} on {node}: no DBE event or Xid 48 for "
                       f"{settings.quiet_s / 3600:g} h (no DBE counter to read)",
                       track.open_since, ts)
    track.open_id = track.open_fingerprint = track.open_since = track.last_event_ts = None
    return [closing]


def observe_dbe_event(track: EccTrack, event: HwEvent, uuid: str, settings: EccRun,
                      holder: Holder | None = None) -> list[Finding | Action]:
    """The urgent ``ecc_dbe`` event: one DBE unless it says how many."""
    return observe(track, node=event.node, uuid=uuid,
                   dbe_count=event.count if event.count is not None else 1, ts=event.ts,
                   settings=settings.ecc, from_sample=False)


def observe_xid_event(track: EccTrack, event: HwEvent, uuid: str, settings: EccRun,
                      holder: Holder | None = None) -> list[Finding | Action]:
    """Xid 48, which the XID rule leaves to this rule: one DBE, at once."""
    if event.xid != xid_rule.XID_DBE or not settings.takes_xid:
        return []
    return observe(track, node=event.node, uuid=uuid, dbe_count=1, ts=event.ts,
                   settings=settings.ecc, from_sample=False, xid=event.xid)


def _unhealthy(track: EccTrack) -> bool:
    return track.open_id is not None


def clock_step(track: EccTrack, step: float) -> None:
    """The node's clock went back ``step`` s: samples count from the new clock on; an open
    episode goes on, its start and its last event moved back by the step (a zero count
    after it closes it, or, with no counter read, a quiet class window)."""
    track.last_sample_ts = None
    if track.open_since is not None:
        track.open_since -= step
    if track.last_event_ts is not None:
        track.last_event_ts -= step


RUNNER = DeviceRunner(state="ecc", state_type=EccTrack, settings_from=EccRun.from_rules,
                      on_sample=observe_sample,
                      events={"ecc_dbe": observe_dbe_event, "xid": observe_xid_event},
                      on_clock_step=clock_step, unhealthy=_unhealthy)
"""How the node join runs the rule: every device sample, the urgent DBE event and Xid 48."""
