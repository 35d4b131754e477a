"""Hardware faults read from device samples and urgent events, one finding per episode.

The families here share one shape: a condition on one GPU opens an episode
(one firing finding, with the window of evidence, and at most one action
per verb) and a later observation closes it (one resolved finding with the
same id). Repeated samples inside an episode emit nothing.

- **Error-counter bursts** (``ecc_sbe_rate``, ``pcie_replay``,
  ``nvlink_errors``, ``nvlink_crc_errors``): the counters are cumulative since the driver
  loaded; an episode opens when their increments within ``window_s`` reach
  ``threshold`` and closes after ``clear_s`` with no burst (no window at the threshold
  again; 30 min, 1 h for the SBE rate: longer than the pause between a flaky link's
  recurring bursts, so such a link is one episode, not one per burst, while a trickle
  below the threshold does not hold it open). A counter
  that goes down was reset with the GPU: it is the new baseline. NVLink replay and
  recovery errors (``nvlink_errors``) are the link's real trouble; its CRC errors are routine
  on a healthy link (link training, a slow trickle) and count only at DCGM's failing rate,
  so they are their own counter with their own threshold.
- **Row remapping** (``remap_failure``: cordon, critical; ``remap_pending``:
  taint the node ``gpusteward.io/gpu-reset-required`` since a reset makes
  the remap take effect): open while the flag reads true, close when it
  reads false.
- **Page retirement** (Turing, Volta and older; Ampere and newer remap rows instead):
  ``retired_pages_pending`` is ``remap_pending``'s twin: a page waits for retirement,
  which takes effect at the next GPU reset, so the node is tainted
  ``gpusteward.io/gpu-reset-required`` while the flag reads true, and the episode closes
  when it reads false. ``retired_pages``: the pages retired for single- and double-bit
  errors together reach ``threshold``; a finding that recommends replacing the GPU (no
  action: the GPU still works), closed if the count reads below the threshold again.
- **GPU lost** (``gpu_lost``, from the urgent event or Xid 79, which the
  XID rule leaves to it): drain the node (a GPU off the bus needs a host
  restart); closes when the GPU reports again: a sample with a reading no
  lost GPU gives (:func:`answers`), not one a source filled with zeros.
- **GPU recovery action** (``gpu_recovery_action``): the driver's own
  verdict (NVML field 230, the same news as Xid 154): GPU reset, drain and
  reset or bus reset -> taint for a reset; node or system reboot -> drain.
  Open while the field reads non-zero, closed when it reads 0 (none).
- **Thermal slowdown** (``thermal_slowdown``): the GPU is at or above its
  model's slowdown temperature, or its clock-event reasons carry HW thermal
  slowdown (0x40), at every sample for ``window_s``; closes after ``clear_s``
  without either. SW thermal slowdown (0x20) alone is not counted: it is the
  GPU trimming its clocks to stay at its max operating temperature (NVML's
  definition of the bit), which a busy GPU reaches by design (an H100 SXM at
  87 °C under full load), below the slowdown temperature where HW protection
  engages.

Everything runs per device on every sample, so :func:`observe_sample` takes
a fast path when nothing is open and no counter moved: a few comparisons.
Samples at or before the last one seen for the device are ignored
(duplicates, late arrivals): the counters are cumulative and the newest
reading already holds them. A sample without a counter, or without both the
temperature and the clock-event reasons, is no reading of it: the next
reading's gap is measured from the last real one, so an exporter that leaves a
field out for an hour cannot make the increase of that hour look like a burst,
nor two hot readings an hour apart look like an hour of throttling.

It stays one module: the twelve hardware rules share one per-GPU state and one call per
sample (measured: split, the node join cost a third more).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules import xid as xid_rule
from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.idle import Holder
from gpusteward.rules.registry import DeviceRunner
from gpusteward.schema import Action, ActionVerb, DeviceSample, Evidence, Finding, HwEvent, Subject

SBE_KIND = "ecc_sbe_rate"
PCIE_KIND = "pcie_replay"
NVLINK_KIND = "nvlink_errors"
NVLINK_CRC_KIND = "nvlink_crc_errors"
REMAP_FAILURE_KIND = "remap_failure"
REMAP_PENDING_KIND = "remap_pending"
GPU_LOST_KIND = "gpu_lost"
THERMAL_KIND = "thermal_slowdown"
RECOVERY_KIND = "gpu_recovery_action"
RETIRED_PENDING_KIND = "retired_pages_pending"
RETIRED_PAGES_KIND = "retired_pages"

RECOVERY_ACTIONS: dict[int, tuple[str, ActionVerb | None]] = {
    1: ("GPU reset required", "taint"), 2: ("node reboot required", "drain"),
    3: ("drain peer-to-peer work", None), 4: ("drain and reset", "taint"),
    5: ("recover the IMEX domain", None), 6: ("bus reset", "taint"),
    7: ("system reboot", "drain"),
}
"""NVML ``NVML_GPU_RECOVERY_ACTION_*`` values -> (meaning, the node action they ask for)."""

THERMAL_REASONS = 0x40
"""NVML clock-event reason HwThermalSlowdown: the hardware's protection clamping the clocks.
SwThermalSlowdown (0x20) is left out: the driver optimises the clocks so that the GPU stays at
its max operating temperature (NVML), the steady state of a busy GPU in a warm rack; NVIDIA's
NVSentinel (ADR-042) likewise takes the HW slowdown line, not SW thermal capping, as the
actionable boundary. The rollups still count both as throttled minutes."""

RUNBOOKS = {
    SBE_KIND: "Correctable (single-bit) ECC errors are arriving fast on this GPU. They do not "
    "corrupt data, but a burst often precedes row remapping or an uncorrectable error. Check "
    "`nvidia-smi -q -d ECC,ROW_REMAPPER`; plan a GPU reset at the next idle moment and watch "
    "whether the rate comes back.",
    PCIE_KIND: "PCIe replays (link-level retransmissions) are bursting: the link to this GPU is "
    "marginal. Expect slower transfers and Xid 32/79 later. Check `nvidia-smi -q -d PCIE` link "
    "width and generation, reseat the card or riser at the next maintenance window.",
    NVLINK_KIND: "NVLink replay or recovery errors are bursting on this GPU; multi-GPU jobs will "
    "slow down or fail (Xid 74). Check `nvidia-smi nvlink -e`; reset the GPU, and if the errors "
    "return, the remote end or the baseboard needs service.",
    NVLINK_CRC_KIND: "NVLink CRC errors are arriving at about 100 per second or more, the rate "
    "at which DCGM's health check fails a link (a few at boot or a slow trickle are normal and "
    "raise nothing): the link is degrading and replays will follow. Check `nvidia-smi nvlink "
    "-e` for the link; reset the GPU, and if the rate returns, the remote end or the "
    "baseboard needs service.",
    REMAP_FAILURE_KIND: "Row remapping failed: the GPU ran out of spare rows for an "
    "uncorrectable memory error. The node is cordoned. Drain it and open an RMA; the GPU cannot "
    "be repaired in the field.",
    REMAP_PENDING_KIND: "A memory row is marked for remapping and takes effect only after a GPU "
    "reset. The node is tainted gpusteward.io/gpu-reset-required:NoSchedule. Reset the GPU "
    "(`nvidia-smi -r -i <index>`) when its pods are done, then remove the taint.",
    RETIRED_PENDING_KIND: "A framebuffer page is marked for retirement (dynamic page retirement, "
    "Xid 63) and is retired only at the next GPU reset or driver reload; until then the bad "
    "page can still be handed out. The node is tainted gpusteward.io/gpu-reset-required:"
    "NoSchedule. Reset the GPU (`nvidia-smi -r -i <index>`) or reboot the node when its pods "
    "are done, then remove the taint; `nvidia-smi -q -d PAGE_RETIREMENT` shows the pages.",
    RETIRED_PAGES_KIND: "This GPU has retired many framebuffer pages for ECC errors (dynamic "
    "page retirement). Each retired page is memory lost for good, and a board that keeps "
    "retiring pages is failing: NVIDIA's guidance is to replace a GPU that reaches its "
    "retirement limit. Check `nvidia-smi -q -d PAGE_RETIREMENT`, plan to drain the node and "
    "open an RMA for the GPU.",
    GPU_LOST_KIND: "The GPU fell off the bus (NVML cannot reach it; Xid 79). The node is drained. "
    "Reboot it; if the GPU is still missing, check power and seating and open an RMA.",
    RECOVERY_KIND: "The driver says this GPU needs a recovery action (NVML GPU recovery action, "
    "also logged as Xid 154). A reset: the node is tainted gpusteward.io/gpu-reset-required; "
    "stop the GPU's pods and run `nvidia-smi -r -i <index>`. A reboot: the node is drained; "
    "reboot it. The finding resolves when the driver reports no action needed.",
    THERMAL_KIND: "The GPU has been thermally throttled for the whole window: it runs at reduced "
    "clocks, so every job on it is slow. Check the node's fans, airflow and inlet temperature, "
    "and the GPU's `nvidia-smi -q -d TEMPERATURE,PERFORMANCE`.",
}


class CounterBurstSettings(BaseModel):
    """A burst of a cumulative error counter on one GPU."""

    model_config = ConfigDict(extra="forbid")

    threshold: int = Field(100, ge=1, description="Counter increments within window_s that "
                           "open an episode.")
    window_s: float = Field(3600, gt=0, description="Sliding window, seconds of event time.")
    clear_s: float = Field(1800, ge=0, description="Seconds without a burst (the counter's "
                           "window at the threshold again) that close an open episode; a "
                           "trickle below the threshold does not hold it open (hysteresis: a "
                           "counter bursting again and again is one episode, not one per "
                           "burst). 30 min, six times the 5-min windows: a marginal link "
                           "bursts every few minutes (every 10 under a job's "
                           "periodic all-reduce); when the quiet time was window_s such a link "
                           "opened and closed an episode per burst, ten in two hours, each a "
                           "chat message and an alert firing and resolving.")


class SbeRateSettings(CounterBurstSettings):
    """Settings of the single-bit ECC rate rule (``ecc_sbe_volatile``)."""

    threshold: int = Field(100, ge=1, description="Correctable ECC errors within window_s that "
                           "open an episode (100 per hour: far above the background rate of a "
                           "healthy GPU, which is near zero).")
    window_s: float = Field(3600, gt=0, description="Sliding window, seconds (1 h).")
    clear_s: float = Field(3600, ge=0, description="Seconds without the threshold's rate of "
                           "correctable errors that close an open episode. 1 h, the window: "
                           "errors bursting again within the hour are one episode already.")


class PcieReplaySettings(CounterBurstSettings):
    """Settings of the PCIe replay burst rule (``pcie_replay``)."""

    threshold: int = Field(100, ge=1, description="PCIe replays within window_s that open an "
                           "episode (a healthy link replays rarely; a hundred in five minutes "
                           "is a marginal link).")
    window_s: float = Field(300, gt=0, description="Sliding window, seconds (5 min).")


class NvlinkErrorSettings(CounterBurstSettings):
    """Settings of the NVLink error burst rule (``nvlink_errors``)."""

    threshold: int = Field(10, ge=1, description="NVLink replay + recovery errors (summed by "
                           "the collector) within window_s that open an episode. CRC errors are "
                           "not in it: nvlink_crc_errors judges them. A collector older than "
                           "that split sends CRC + replay + recovery here, judged as before.")
    window_s: float = Field(300, gt=0, description="Sliding window, seconds (5 min).")


class NvlinkCrcSettings(CounterBurstSettings):
    """Settings of the NVLink CRC error rate rule (``nvlink_crc_errors``)."""

    threshold: int = Field(30_000, ge=1, description="NVLink CRC errors (flit + data) within "
                           "window_s that open an episode. 30000 per 300 s is 100 per second, "
                           "DCGM's own line (DCGM_LIMIT_MAX_NVLINK_CRC_ERROR: its NVLink health "
                           "watch fails a link at 100 CRC errors/s and only warns below): a "
                           "healthy link counts CRC errors at link training and in a slow "
                           "trickle.")
    window_s: float = Field(300, gt=0, description="Sliding window, seconds (5 min: DCGM "
                            "judges the rate over 1 min, but a collector reading every 60 s "
                            "would put a single reading in that window; five minutes hold "
                            "several).")


class RemapFailureSettings(BaseModel):
    """Settings of the row-remap failure rule."""

    model_config = ConfigDict(extra="forbid")

    cordon: bool = Field(True, description="Ask to cordon the node on a remap failure (the GPU "
                         "needs an RMA; no new work should land there).")


class RemapPendingSettings(BaseModel):
    """Settings of the pending row-remap rule."""

    model_config = ConfigDict(extra="forbid")

    taint: bool = Field(True, description="Ask to taint the node "
                        "gpusteward.io/gpu-reset-required:NoSchedule while a remap waits for "
                        "a GPU reset.")


class RetiredPagesPendingSettings(BaseModel):
    """Settings of the pending page-retirement rule (pre-Ampere GPUs)."""

    model_config = ConfigDict(extra="forbid")

    taint: bool = Field(True, description="Ask to taint the node "
                        "gpusteward.io/gpu-reset-required:NoSchedule while a page waits for "
                        "retirement (it takes effect at the next GPU reset).")


class RetiredPagesSettings(BaseModel):
    """Settings of the retired-page count rule (pre-Ampere GPUs)."""

    model_config = ConfigDict(extra="forbid")

    threshold: int = Field(60, ge=1, description="Retired pages (single- and double-bit causes "
                           "together) at or above which the GPU is reported for replacement. "
                           "60: NVIDIA's dynamic page retirement guidance treats a board that "
                           "has retired about this many pages as due for replacement (the "
                           "InfoROM holds 64 on many boards); set your vendor's RMA figure.")


class GpuLostSettings(BaseModel):
    """Settings of the GPU-lost rule."""

    model_config = ConfigDict(extra="forbid")

    drain: bool = Field(True, description="Ask to drain the node when a GPU falls off the bus "
                        "(NVIDIA: restart the host).")


class RecoveryActionSettings(BaseModel):
    """Settings of the GPU recovery-action rule (NVML field 230 / Xid 154)."""

    model_config = ConfigDict(extra="forbid")

    act: bool = Field(True, description="Ask for the node action the driver's recovery action "
                      "implies (taint for a reset, drain for a reboot); false: finding only.")


DEFAULT_SLOWDOWN_C = {"A100": 89.0, "H100": 89.0, "H200": 89.0, "A30": 89.0, "L4": 90.0,
                      "T4": 93.0, "A10": 91.0}


class ThermalSettings(BaseModel):
    """Settings of the sustained thermal slowdown rule."""

    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(300, gt=0, description="Seconds the GPU must stay thermally "
                            "throttled, at every sample, before the rule fires (5 min: a "
                            "transient spike under a burst of load does not count).")
    clear_s: float = Field(600, ge=0, description="Seconds without thermal throttling that close "
                           "an open episode (hysteresis: a GPU hovering at its limit gives one "
                           "episode, not one per crossing). 10 min, twice window_s: a job whose "
                           "load dips for a few minutes (eval, checkpoints) cools the GPU that "
                           "long; at 2 min such a GPU opened and closed an episode every cycle, "
                           "each a chat message and an alert firing and resolving.")
    max_gap_s: float = Field(150, gt=0, description="A gap between samples longer than this "
                             "restarts the run: no observations means no evidence. 150 s: one "
                             "missed reading of a collector polling every 60 s is no gap.")
    slowdown_c: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_SLOWDOWN_C),
        description="Slowdown temperature (°C) per GPU model, matched as a substring of the "
        "model name (longest match wins), for samples that do not carry the GPU's own "
        "(dcgm-exporter, Prometheus; the NVML collector reads each GPU's). Typical "
        "`nvidia-smi -q` 'GPU Slowdown Temp' values; set yours from "
        "nvmlDeviceGetTemperatureThreshold(SLOWDOWN).",
    )
    default_slowdown_c: float = Field(
        90.0, description="Slowdown temperature for a model not listed in slowdown_c.")

    @functools.cached_property
    def threshold_by_model(self) -> dict[str, float]:
        """Model name -> slowdown temperature, filled as models are seen (a plain instance
        attribute: pydantic's private attributes are slow on this per-sample path)."""
        return {}

    @functools.cached_property
    def coolest_c(self) -> float:
        """The lowest slowdown temperature of any model: a reading below it is below every
        model's, so the per-sample check needs no lookup by model name."""
        return min(self.default_slowdown_c, *self.slowdown_c.values())

    def slowdown_of(self, device: DeviceSample) -> float:
        """The slowdown temperature of ``device``: its own where the source read it (NVML),
        else its model's (:meth:`threshold_for`): the table's, matched on the name, or the
        default. A table cannot know every board (an L40S matches the L4 entry)."""
        own = device.slowdown_temp_c
        return own if own is not None else self.threshold_for(device.model)

    def threshold_for(self, model: str) -> float:
        """The slowdown temperature of ``model`` (cached per model name)."""
        table = self.threshold_by_model
        cached = table.get(model)
        if cached is None:
            matches = [k for k in self.slowdown_c if k in model]
            cached = self.slowdown_c[max(matches, key=len)] if matches \
                else self.default_slowdown_c
            table[model] = cached
        return cached


class HardwareSettings(BaseModel):
    """The hardware rules' settings, grouped for the family's one runner (each is its own rule
    in the registry, with its own policy section)."""

    sbe: SbeRateSettings = Field(default_factory=SbeRateSettings)
    pcie: PcieReplaySettings = Field(default_factory=PcieReplaySettings)
    nvlink: NvlinkErrorSettings = Field(default_factory=NvlinkErrorSettings)
    nvlink_crc: NvlinkCrcSettings = Field(default_factory=NvlinkCrcSettings)
    remap_failure: RemapFailureSettings = Field(default_factory=RemapFailureSettings)
    remap_pending: RemapPendingSettings = Field(default_factory=RemapPendingSettings)
    retired_pending: RetiredPagesPendingSettings = Field(
        default_factory=RetiredPagesPendingSettings)
    retired_pages: RetiredPagesSettings = Field(default_factory=RetiredPagesSettings)
    gpu_lost: GpuLostSettings = Field(default_factory=GpuLostSettings)
    recovery: RecoveryActionSettings = Field(default_factory=RecoveryActionSettings)
    thermal: ThermalSettings = Field(default_factory=ThermalSettings)
    xid: xid_rule.XidSettings = Field(default_factory=xid_rule.XidSettings)

    @classmethod
    def from_rules(cls, rules: Mapping[str, BaseModel]) -> HardwareSettings:
        """The group from every rule's resolved settings (already validated)."""
        return cls.model_validate({attr: rules[name] for name, attr in _MEMBERS.items()})


_MEMBERS = {
    SBE_KIND: "sbe", PCIE_KIND: "pcie", NVLINK_KIND: "nvlink", NVLINK_CRC_KIND: "nvlink_crc",
    REMAP_FAILURE_KIND: "remap_failure", REMAP_PENDING_KIND: "remap_pending",
    GPU_LOST_KIND: "gpu_lost", THERMAL_KIND: "thermal", xid_rule.KIND: "xid",
    RECOVERY_KIND: "recovery", RETIRED_PENDING_KIND: "retired_pending",
    RETIRED_PAGES_KIND: "retired_pages",
}
"""Rule name -> field of :class:`HardwareSettings`: the rules this family's runner serves."""


class Episode(msgspec.Struct):
    id: str
    fingerprint: str
    since: float


class CounterTrack(msgspec.Struct, omit_defaults=True):
    last: int | None = None
    increments: list[tuple[float, int]] = []
    """(time of the reading before, increase) of each increase in the window: an increase is
    seen at a reading but happened at some time since the one before, so its span starts
    there (a burst of 500 between readings 15 s apart is 500 in 15 s, not in 0 s)."""
    last_increment_ts: float | None = None
    open: Episode | None = None
    read_until: float | None = None
    """When a sample last carried the counter, while the samples since have not (a reading
    the exporter or NVML did not give): the next reading's increase spans the whole time."""
    read_ts: float | None = None
    """When a sample last carried the counter, kept at every reading instead (the CRC
    counter's way): a sample without the counter then costs one test and no bookkeeping."""


class ThermalTrack(msgspec.Struct, omit_defaults=True):
    seen_ts: float | None = None
    """The last sample with a temperature or clock-event reasons: a gap is measured from it,
    so samples without either do not hide one."""
    hot_since: float | None = None
    hot_samples: int = 0
    max_temp_c: float = 0.0
    reasons: int = 0
    cool_since: float | None = None
    open: Episode | None = None


class HwTrack(msgspec.Struct, omit_defaults=True):
    """Per-device state of every hardware rule but ECC DBE (its own module)."""

    last_ts: float | None = None
    sbe: CounterTrack = msgspec.field(default_factory=CounterTrack)
    pcie: CounterTrack = msgspec.field(default_factory=CounterTrack)
    nvlink: CounterTrack = msgspec.field(default_factory=CounterTrack)
    nvlink_crc: CounterTrack = msgspec.field(default_factory=CounterTrack)
    remap_failure: Episode | None = None
    remap_pending: Episode | None = None
    lost: Episode | None = None
    recovery: Episode | None = None
    recovery_value: int = 0
    retired_pending: Episode | None = None
    retired_pages: Episode | None = None
    thermal: ThermalTrack = msgspec.field(default_factory=ThermalTrack)
    xid: xid_rule.XidTrack = msgspec.field(default_factory=xid_rule.XidTrack)
    calm: tuple[int | None, int | None, int | None, int | None] | None = None
    """The SBE, PCIe replay, NVLink and NVLink CRC counters' last readings, kept while
    nothing the rules above follow is under way (no episode open on a counter, the
    temperature or an XID class, no run of hot samples, no counter unread since its last
    reading): a sample with these readings, no flag raised, no heat and retired pages (if
    read) below the threshold then changes nothing but ``last_ts`` (and the CRC counter's
    ``read_ts``), and :func:`observe_sample` touches no other object of the track. None: to
    be worked out at the next sample."""

    def unhealthy(self) -> bool:
        """True while an episode that takes the GPU out of service is open."""
        # ``bool(open) and``: no generator for the empty map of almost every GPU (every node
        # summary asks every GPU).
        return (self.remap_failure is not None or self.lost is not None
                or self.recovery is not None
                or (bool(self.xid.open) and any(c != "restart_app" for c in self.xid.open)))


Out = list[Finding | Action]


def _finding(kind: str, severity: Literal["info", "warning", "critical"], node: str, uuid: str,
             start: float, ts: float, summary: str, samples: int,
             values: dict[str, float]) -> Finding:
    fp = fingerprint(kind, node, uuid)
    return Finding(
        id=finding_id(fp, start), fingerprint=fp, kind=kind, severity=severity, state="firing",
        subject=Subject(node=node, device=uuid), summary=summary, starts_at=start, ts=ts,
        evidence=Evidence(window_start=start, window_end=ts, samples=samples, values=values),
        runbook=RUNBOOKS[kind],
    )


def _act(finding: Finding, verb: ActionVerb, node: str,
         params: dict[str, str] | None = None) -> Action:
    action = action_for(finding, verb, Subject(node=node), finding.summary)
    if params:
        action.params = params
    return action


def _close(episode: Episode, kind: str, node: str, uuid: str, ts: float, why: str) -> Finding:
    return resolved(episode.id, episode.fingerprint, kind, Subject(node=node, device=uuid),
                    f"{uuid} on {node}: {why}", episode.since, ts)


def _counter(track: CounterTrack, value: int, kind: str, node: str, uuid: str, ts: float,
             settings: CounterBurstSettings, out: Out, since_last: float | None) -> None:
    last = track.last
    track.last = value
    if track.read_until is not None:  # samples came without the counter: no readings
        since_last, track.read_until = ts - track.read_until, None
    if since_last is not None and since_last > settings.window_s and track.open is None:
        # Samples stopped for longer than the window: the increase may be spread over all of
        # it, so it is no evidence of a burst. It becomes the new baseline.
        last = None
    if last is not None and value > last:
        # Kept for the window only (each increase >= 1: with no episode open, fewer than
        # `threshold` are kept; with one open, the readings of one window at most).
        track.increments.append((ts - (since_last or 0.0), value - last))
        horizon = ts - settings.window_s
        if track.increments[0][0] <= horizon:
            track.increments = [i for i in track.increments if i[0] > horizon]
        total = sum(i[1] for i in track.increments)
        if track.open is None:
            track.last_increment_ts = ts
            if total >= settings.threshold:
                start = track.increments[0][0]
                finding = _finding(
                    kind, "warning", node, uuid, start, ts,
                    f"{kind.replace('_', ' ')} on {uuid} ({node}): {total} in "
                    f"{ts - start:.0f} s (threshold {settings.threshold} per "
                    f"{settings.window_s:g} s)", len(track.increments),
                    {"increase": float(total), "threshold": float(settings.threshold)})
                track.open = Episode(finding.id, finding.fingerprint, start)
                out.append(finding)
            return
        if total >= settings.threshold:
            # The episode goes on while the counter still bursts (its window at the
            # threshold again); a trickle below it, routine for CRC errors on a healthy
            # link, does not hold it open: clear_s counts from the last burst.
            track.last_increment_ts = ts
            return
    if last is not None and value < last:
        track.increments = []  # the GPU was reset: a new baseline
    if track.open is not None and (track.last_increment_ts is None
                                   or ts - track.last_increment_ts >= settings.clear_s):
        out.append(_close(track.open, kind, node, uuid, ts,
                          f"no {kind.replace('_', ' ')} burst for {settings.clear_s:g} s"))
        track.open = None
        track.increments = []


def _unread(track: CounterTrack, last_ts: float | None) -> None:
    """A sample without the counter: its next reading is measured from the last one that
    had it (``last_ts``, the sample before this one)."""
    if track.last is not None and track.read_until is None:
        track.read_until = last_ts


def _thermal(track: ThermalTrack, device: DeviceSample, node: str, ts: float,
             settings: ThermalSettings, out: Out) -> None:
    temp, reasons = device.temp_c, device.clock_event_reasons
    if temp is None and reasons is None:
        return  # no reading: neither evidence nor the end of a gap
    gap = track.seen_ts is not None and ts - track.seen_ts > settings.max_gap_s
    track.seen_ts = ts
    hot_reasons = (reasons or 0) & THERMAL_REASONS
    hot = bool(hot_reasons) or (temp is not None and temp >= settings.slowdown_of(device))
    if not hot:
        track.hot_since = None
        if track.open is not None:
            if track.cool_since is None:
                track.cool_since = ts
            if ts - track.cool_since >= settings.clear_s:
                out.append(_close(track.open, THERMAL_KIND, node, device.uuid, ts,
                                  "no thermal slowdown any more"))
                track.open = track.cool_since = None
        return
    track.cool_since = None
    if track.hot_since is None or gap:
        track.hot_since, track.hot_samples, track.max_temp_c, track.reasons = ts, 0, 0.0, 0
    track.hot_samples += 1
    track.reasons |= hot_reasons
    if temp is not None:
        track.max_temp_c = max(track.max_temp_c, temp)
    if track.open is None and ts - track.hot_since >= settings.window_s:
        threshold = settings.slowdown_of(device)
        finding = _finding(
            THERMAL_KIND, "warning", node, device.uuid, track.hot_since, ts,
            f"{device.uuid} ({node}) thermally throttled for {(ts - track.hot_since) / 60:.0f} min "
            f"(max {track.max_temp_c:g} °C, slowdown at {threshold:g} °C, reasons "
            f"{track.reasons:#x})", track.hot_samples,
            {"max_temp_c": track.max_temp_c, "slowdown_c": threshold,
             "thermal_reasons": float(track.reasons)})
        track.open = Episode(finding.id, finding.fingerprint, track.hot_since)
        out.append(finding)


_FLAG_NEWS = {
    REMAP_FAILURE_KIND: "row remapping failed",
    REMAP_PENDING_KIND: "a row remap is pending a GPU reset",
    RETIRED_PENDING_KIND: "a page retirement is pending a GPU reset",
}


def _flag(episode: Episode | None, flag: bool, kind: str, node: str, uuid: str, ts: float,
          out: Out, *, act: bool) -> Episode | None:
    if flag and episode is None:
        severity: Literal["warning", "critical"] = ("critical" if kind == REMAP_FAILURE_KIND
                                                    else "warning")
        what = _FLAG_NEWS[kind]
        finding = _finding(kind, severity, node, uuid, ts, ts, f"{uuid} ({node}): {what}", 1,
                           {kind: 1.0})
        out.append(finding)
        if act:
            if kind == REMAP_FAILURE_KIND:
                out.append(_act(finding, "cordon", node))
            else:
                out.append(_act(finding, "taint", node, dict(xid_rule.RESET_TAINT)))
        return Episode(finding.id, finding.fingerprint, ts)
    # A sample taken before the episode opened (read late, behind the urgent event that
    # opened it, when a worker drains a backlog) says nothing about whether it is over.
    if not flag and episode is not None and ts > episode.since:
        out.append(_close(episode, kind, node, uuid, ts, "the flag cleared (GPU reset)"))
        return None
    return episode


def _recovery(track: HwTrack, value: int, node: str, uuid: str, ts: float,
              settings: RecoveryActionSettings, out: Out) -> None:
    track.recovery_value = value
    if track.recovery is not None:
        # The action changed (or cleared): close the episode; a new non-zero one reopens.
        out.append(_close(track.recovery, RECOVERY_KIND, node, uuid, ts,
                          "the driver reports no recovery action needed" if value == 0
                          else f"recovery action changed to {value}"))
        track.recovery = None
    if value == 0:
        return
    meaning, verb = RECOVERY_ACTIONS.get(value, (f"recovery action {value}", None))
    finding = _finding(RECOVERY_KIND, "critical" if verb else "warning", node, uuid, ts, ts,
                       f"{uuid} ({node}): the driver asks for {meaning}", 1,
                       {"recovery_action": float(value)})
    # Keep episodes of different actions apart: the id carries the value.
    finding.fingerprint = fingerprint(RECOVERY_KIND, node, uuid, str(value))
    finding.id = finding_id(finding.fingerprint, ts)
    out.append(finding)
    track.recovery = Episode(finding.id, finding.fingerprint, ts)
    if settings.act and verb is not None:
        params = dict(xid_rule.RESET_TAINT) if verb == "taint" else None
        out.append(_act(finding, verb, node, params))


def _retired(track: HwTrack, device: DeviceSample, node: str, ts: float,
             settings: RetiredPagesSettings, out: Out) -> None:
    sbe, dbe = device.retired_pages_sbe or 0, device.retired_pages_dbe or 0
    over = sbe + dbe >= settings.threshold
    if over and track.retired_pages is None:
        finding = _finding(
            RETIRED_PAGES_KIND, "warning", node, device.uuid, ts, ts,
            f"{device.uuid} ({node}) has retired {sbe + dbe} memory pages ({sbe} for single-bit, "
            f"{dbe} for double-bit errors; threshold {settings.threshold}): replace the GPU", 1,
            {"retired_pages": float(sbe + dbe), "retired_pages_sbe": float(sbe),
             "retired_pages_dbe": float(dbe), "threshold": float(settings.threshold)})
        track.retired_pages = Episode(finding.id, finding.fingerprint, ts)
        out.append(finding)
    elif not over and track.retired_pages is not None and ts > track.retired_pages.since:
        out.append(_close(track.retired_pages, RETIRED_PAGES_KIND, node, device.uuid, ts,
                          f"{sbe + dbe} retired pages, below {settings.threshold}"))
        track.retired_pages = None


def observe_sample(track: HwTrack, node: str, device: DeviceSample, ts: float,
                   settings: HardwareSettings, holder: object = None) -> Out:
    """Fold one device sample into ``track``; return the findings and actions it causes.
    (``holder``, unused, makes it the registry's sample hook as it is.)"""
    last_ts = track.last_ts
    if last_ts is not None and ts <= last_ts:
        return []
    track.last_ts = ts
    calm = track.calm
    # The path of almost every sample of a healthy GPU: the state of every rule above is
    # one object read, not seven (each a cache miss on a fleet's worth of state).
    if (calm is not None and device.ecc_sbe_volatile == calm[0]
            and device.pcie_replay == calm[1] and device.nvlink_errors == calm[2]
            and track.lost is None and not device.remap_failure
            and track.remap_failure is None and not device.remap_pending
            and track.remap_pending is None and not device.retired_pages_pending
            and track.retired_pending is None
            and ((device.retired_pages_sbe is None and device.retired_pages_dbe is None)
                 or _few_retired(track, device, settings))
            and (device.recovery_action is None
                 or device.recovery_action == track.recovery_value)
            and not _heat(device, settings.thermal)):
        crc = device.nvlink_crc_errors
        if crc is None:
            return []
        if crc == calm[3]:
            track.nvlink_crc.read_ts = ts
            return []
    out: Out = []
    uuid = device.uuid
    since_last = None if last_ts is None else ts - last_ts
    # A counter a sample lacks is no reading: its next reading is measured from the last one.
    counter, value = track.sbe, device.ecc_sbe_volatile
    if value is None:
        _unread(counter, last_ts)
    elif value != counter.last or counter.open is not None or counter.read_until is not None:
        _counter(counter, value, SBE_KIND, node, uuid, ts, settings.sbe, out, since_last)
    counter, value = track.pcie, device.pcie_replay
    if value is None:
        _unread(counter, last_ts)
    elif value != counter.last or counter.open is not None or counter.read_until is not None:
        _counter(counter, value, PCIE_KIND, node, uuid, ts, settings.pcie, out, since_last)
    counter, value = track.nvlink, device.nvlink_errors
    if value is None:
        _unread(counter, last_ts)
    elif value != counter.last or counter.open is not None or counter.read_until is not None:
        _counter(counter, value, NVLINK_KIND, node, uuid, ts, settings.nvlink, out, since_last)
    # Absent on most GPUs (no NVLink, an older collector): one test, no bookkeeping; the gap
    # since the last reading is the counter's own.
    value = device.nvlink_crc_errors
    if value is not None:
        counter = track.nvlink_crc
        read_ts, counter.read_ts = counter.read_ts, ts
        if value != counter.last or counter.open is not None:
            _counter(counter, value, NVLINK_CRC_KIND, node, uuid, ts, settings.nvlink_crc, out,
                     None if read_ts is None else ts - read_ts)
    flag = device.remap_failure
    if flag is not None and flag != (track.remap_failure is not None):
        track.remap_failure = _flag(track.remap_failure, flag, REMAP_FAILURE_KIND, node, uuid,
                                    ts, out, act=settings.remap_failure.cordon)
    flag = device.remap_pending
    if flag is not None and flag != (track.remap_pending is not None):
        track.remap_pending = _flag(track.remap_pending, flag, REMAP_PENDING_KIND, node, uuid,
                                    ts, out, act=settings.remap_pending.taint)
    flag = device.retired_pages_pending
    if flag is not None and flag != (track.retired_pending is not None):
        track.retired_pending = _flag(track.retired_pending, flag, RETIRED_PENDING_KIND, node,
                                      uuid, ts, out, act=settings.retired_pending.taint)
    if device.retired_pages_sbe is not None or device.retired_pages_dbe is not None:
        _retired(track, device, node, ts, settings.retired_pages, out)
    value = device.recovery_action
    if value is not None and value != track.recovery_value:
        _recovery(track, value, node, uuid, ts, settings.recovery, out)
    thermal = track.thermal
    if (thermal.open is not None or thermal.hot_since is not None
            or _heat(device, settings.thermal)):
        _thermal(thermal, device, node, ts, settings.thermal, out)
    if track.lost is not None and ts > track.lost.since and answers(device):
        out.append(_close(track.lost, GPU_LOST_KIND, node, uuid, ts, "the GPU reports again"))
        track.lost = None
    if track.xid.open:
        out += xid_rule.expire(track.xid, node=node, uuid=uuid, ts=ts, settings=settings.xid)
    track.calm = _calm(track)
    return out


def _few_retired(track: HwTrack, device: DeviceSample, settings: HardwareSettings) -> bool:
    """Whether the retired pages a sample read (pre-Ampere GPUs) leave ``track`` as it is:
    fewer than the threshold, with no episode open."""
    return (track.retired_pages is None
            and (device.retired_pages_sbe or 0) + (device.retired_pages_dbe or 0)
            < settings.retired_pages.threshold)


def _heat(device: DeviceSample, settings: ThermalSettings) -> bool:
    """Whether ``device`` reads as hot: HW thermal slowdown, or at its slowdown
    temperature."""
    temp = device.temp_c
    return bool((device.clock_event_reasons or 0) & THERMAL_REASONS) or (
        temp is not None and temp >= (device.slowdown_temp_c or settings.coolest_c)
        and temp >= settings.slowdown_of(device))


def _calm(track: HwTrack) -> tuple[int | None, int | None, int | None, int | None] | None:
    """:attr:`HwTrack.calm` of ``track`` as a sample left it."""
    counters = (track.sbe, track.pcie, track.nvlink, track.nvlink_crc)
    thermal = track.thermal
    if (thermal.open is not None or thermal.hot_since is not None or track.xid.open
            or any(c.open is not None or c.read_until is not None for c in counters)):
        return None
    return track.sbe.last, track.pcie.last, track.nvlink.last, track.nvlink_crc.last


def answers(device: DeviceSample) -> bool:
    """Whether a sample shows the GPU answering again: a temperature, a framebuffer size,
    memory in use or activity above zero. NVML reads none of them from a lost GPU (the call
    fails with GPU_IS_LOST and the collector sends no sample of it), and dcgm-exporter leaves
    the series out; a source that fills a lost GPU's fields with zeros shows no GPU, so a
    bare ``util 0`` is no sign of life. A live GPU reads a temperature above 0 °C and its
    framebuffer size in every real shape (NVML, dcgm-exporter's GPU_TEMP and FB_* fields)."""
    return ((device.temp_c or 0.0) > 0 or (device.mem_total_bytes or 0) > 0
            or (device.mem_used_bytes or 0) > 0 or (device.util_pct or 0.0) > 0)


def lost_over(track: HwTrack, *, node: str, uuid: str, ts: float, why: str) -> Out:
    """Close the ``gpu_lost`` episode of ``track`` (opened before ``ts``) for ``why``: how a
    loss filed without a UUID (``GPU-unknown``, no sample of its own to answer) ends once the
    node join sees its GPU back among the node's samples."""
    lost = track.lost
    if lost is None or ts <= lost.since:
        return []
    track.lost = None
    return [_close(lost, GPU_LOST_KIND, node, uuid, ts, why)]


def observe_lost(track: HwTrack, *, node: str, uuid: str, ts: float, detail: str,
                 settings: HardwareSettings) -> Out:
    """A GPU-lost event: open an episode (drain the node) unless one is open."""
    if track.lost is not None or (track.last_ts is not None and ts <= track.last_ts):
        # A sample after the event showed the GPU alive: the event is stale.
        return []
    finding = _finding(GPU_LOST_KIND, "critical", node, uuid, ts, ts,
                       f"{uuid} ({node}) fell off the bus: {detail or 'GPU unavailable'}", 1,
                       {"gpu_lost": 1.0})
    track.lost = Episode(finding.id, finding.fingerprint, ts)
    out: Out = [finding]
    if settings.gpu_lost.drain:
        out.append(_act(finding, "drain", node))
    return out


def observe_remap_failure_event(track: HwTrack, *, node: str, uuid: str, ts: float,
                                settings: HardwareSettings) -> Out:
    """The urgent remap-failure event: open the episode now, without waiting for the tick."""
    out: Out = []
    if track.last_ts is not None and ts <= track.last_ts:
        return out
    track.remap_failure = _flag(track.remap_failure, True, REMAP_FAILURE_KIND, node, uuid, ts,
                                out, act=settings.remap_failure.cordon)
    return out


def _on_xid(track: HwTrack, event: HwEvent, uuid: str, settings: HardwareSettings,
            holder: Holder | None = None) -> Out:
    if event.xid is None:
        return []
    track.calm = None  # an XID episode may open
    out = xid_rule.observe_event(track.xid, node=event.node, uuid=uuid, xid=event.xid,
                                 ts=event.ts, settings=settings.xid, holder=holder)
    if event.xid == xid_rule.XID_OFF_THE_BUS and settings.xid.hands_off(event.xid):
        # The same fault as NVML's GPU-unavailable event, whichever arrives first: one
        # gpu_lost episode, one drain (a source that sends only XIDs still drains).
        detail = f"Xid {event.xid}" + (f": {event.detail}" if event.detail else "")
        out += observe_lost(track, node=event.node, uuid=uuid, ts=event.ts, detail=detail,
                            settings=settings)
    return out


def _on_lost(track: HwTrack, event: HwEvent, uuid: str, settings: HardwareSettings,
             holder: Holder | None = None) -> Out:
    return observe_lost(track, node=event.node, uuid=uuid, ts=event.ts, detail=event.detail,
                        settings=settings)


def _on_remap_failure(track: HwTrack, event: HwEvent, uuid: str,
                      settings: HardwareSettings, holder: Holder | None = None) -> Out:
    return observe_remap_failure_event(track, node=event.node, uuid=uuid, ts=event.ts,
                                       settings=settings)


def clock_step(track: HwTrack, step: float) -> None:
    """The node's clock went back ``step`` s: the counters' windows and the thermal run start
    over on the new clock, as after a gap (a counter's next reading is its new baseline);
    open episodes go on, their times moved back by the step, and close when the samples
    say so. XIDs keep their windows, moved back by the step."""
    track.last_ts = track.calm = None
    for counter in (track.sbe, track.pcie, track.nvlink, track.nvlink_crc):
        counter.increments, counter.read_until, counter.read_ts = [], None, None
        if counter.open is None:
            counter.last = None
        else:
            counter.open.since -= step
        if counter.last_increment_ts is not None:
            counter.last_increment_ts -= step
    thermal = track.thermal
    thermal.seen_ts = thermal.hot_since = thermal.cool_since = None
    thermal.hot_samples, thermal.max_temp_c, thermal.reasons = 0, 0.0, 0
    for episode in (thermal.open, track.remap_failure, track.remap_pending, track.lost,
                    track.recovery, track.retired_pending, track.retired_pages):
        if episode is not None:
            episode.since -= step
    xid_rule.clock_step(track.xid, step)


RUNNER = DeviceRunner(
    state="hw", state_type=HwTrack, settings_from=HardwareSettings.from_rules,
    on_sample=observe_sample, on_clock_step=clock_step, gpu_only=True,
    events={"xid": _on_xid, "gpu_lost": _on_lost, "remap_failure": _on_remap_failure},
    # A GPU lost before the collector could read its UUID is still a node problem.
    events_without_uuid=frozenset({"gpu_lost"}), unhealthy=HwTrack.unhealthy,
)
"""The one runner of every rule in :data:`_MEMBERS`: one state per GPU, one call per sample.
Hardware health belongs to the physical GPU: a MIG device repeating its parent's
temperature or counters would open a second episode, hence ``gpu_only``. Throttle and SBE
events are left to the samples: those rules need the whole window of readings."""
