"""Per-device per-minute rollups: the pure fold the stream worker runs and the replay reuses.

A node's open minutes live in a :class:`RollupTrack`, a msgspec Struct, so
the worker keeps it inside the node's state and it rides the changelog with
the rules' state; the offline replay (:mod:`gpusteward.reports.aggregate`)
keeps one per node in memory. :class:`MinuteFold` holds what is shared and
constant (lateness, MIG geometry): no I/O, no clock.

Event time decides. A minute is emitted once the node's newest sample is
``lateness_s`` past the minute's end; a sample for a minute already emitted
is late: counted in ``RollupTrack.late`` and otherwise ignored, because a
rollup downstream is final. A sample at or before the last one a device's
minute has counted (a redelivery after a crash, a duplicate) is not counted
again. A rollup is named by (device uuid, minute start, holding pod, the
node's clock): a redelivered one is equal to or a partial copy of the first,
and the store keeps one per name. After a node's collector clock steps back
and the caller takes the new clock (:meth:`MinuteFold.new_clock`), a minute
already named on the old clock may be named again: it is another minute the
device was read, told apart by ``clock``, and the store keeps both.

Who held the device comes from the caller as an :class:`Attribution` (the
worker's node join knows the pod's owner, labels and queue from the
watcher's allocations); the last attribution seen in a minute is the
minute's. The per-sample work is a handful of additions per device: the
worker folds every sample of the fleet.

A device several pods hold (time-slicing or MPS replicas) gives one row per
holder (:meth:`MinuteFold.add_share`), so the report credits each pod with
its share and not the first pod with the whole GPU: ``gpu_fraction`` is the
holder's share of the device (the device's fraction split evenly between
the pods holding it that minute: allocated GPU-hours still add up to the
physical GPU), memory is the holder's own where the source split it, and
``util_*`` is the holder's activity relative to its share. With per-process
attribution that is its own SM utilisation times the holders (a notebook
using 30 % of a GPU shared four ways reads 120 %: it used more than its
quarter, as time-slicing lets it), so used GPU-hours (share x util) are its
own; where the source cannot split, each holder reads the device's
activity, so the device's used GPU-hours are spread evenly. Rows are named
by (device, minute, pod).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import msgspec

from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.schema import DeviceHolder, DeviceSample, PodRef, Rollup

MINUTE = 60
THROTTLE_MASK = 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock-event reasons that mean the GPU was held back: HW slowdown, SW thermal,
HW thermal, HW power brake (not idle or application clocks)."""
DEFAULT_TEAM_LABELS = ("team", "gpusteward.io/team", "app.kubernetes.io/part-of")
"""Pod labels naming the owning team, first match wins; else the namespace."""
ROLLUP_FIELDS = (
    "ts", "node", "uuid", "model", "samples", "kind", "index", "parent_uuid", "mig_profile",
    "gpu_fraction", "util_min", "util_mean", "util_max", "mem_used_mean", "mem_used_max",
    "mem_total_bytes", "power_mean", "power_max", "temp_max", "throttled_samples",
    "ecc_dbe_new", "xid_count", "namespace", "pod", "owner_kind", "owner_name", "team",
    "workload_kind", "queue", "clock",
)
"""The Rollup fields :meth:`MinuteFold._rollup` fills, in the schema's order."""
_COMPUTE = re.compile(r"^(?:\d+c\.)?(\d+)g\.")


class Attribution(msgspec.Struct, frozen=True, array_like=True):
    """Who held a device: the rollup's pod columns."""

    namespace: str
    pod: str
    team: str
    owner_kind: str | None = None
    owner_name: str | None = None
    workload_kind: str | None = None
    queue: str | None = None
    allocated: bool = True
    """False when made from the collector's attribution alone: no allocation matched yet."""


def attribution(pod: PodRef, *, labels: Mapping[str, str] | None = None,
                owner_kind: str | None = None, owner_name: str | None = None,
                workload_kind: str | None = None, queue: str | None = None,
                team_labels: Sequence[str] = DEFAULT_TEAM_LABELS,
                allocated: bool = True) -> Attribution:
    """The attribution of ``pod``: its team from the first team label set (else its
    namespace), its owner (else the pod itself)."""
    labels = labels or {}
    team = next((labels[k] for k in team_labels if labels.get(k)), pod.namespace)
    return Attribution(pod.namespace, pod.name, team, owner_kind, owner_name or pod.name,
                       workload_kind, queue, allocated)


def reattribute(track: RollupTrack, who: Attribution) -> None:
    """Give the open minutes of ``who``'s pod, attributed by name alone so far, its
    allocation's attribution.

    Samples and allocations travel on different topics: a worker catching up on a
    backlog may fold a pod's first samples before its allocation. Minutes still open
    take the owner, team and queue then; minutes already emitted keep the namespace.
    """
    for bucket in track.minutes.values():
        for minute in bucket.values():
            held = minute.who
            if (held is not None and not held.allocated and held.pod == who.pod
                    and held.namespace == who.namespace):
                minute.who = who


class _Nobody(msgspec.Struct, frozen=True):
    """The attribution of an unheld device: every pod column empty."""

    namespace: None = None
    pod: None = None
    team: None = None
    owner_kind: None = None
    owner_name: None = None
    workload_kind: None = None
    queue: None = None


_NOBODY = _Nobody()


class Minute(msgspec.Struct, array_like=True):
    """One device's open minute: running sums, extremes and the last attribution."""

    first: DeviceSample
    last_ts: float | None = None
    samples: int = 0
    util_n: int = 0
    util_sum: float = 0.0
    util_min: float | None = None
    util_max: float | None = None
    mem_n: int = 0
    mem_sum: float = 0.0
    mem_max: int | None = None
    power_n: int = 0
    power_sum: float = 0.0
    power_max: float | None = None
    temp_max: float | None = None
    throttled: int = 0
    dbe_max: int | None = None
    xids: int = 0
    who: Attribution | None = None
    holders: int = 1
    """Pods sharing the device at the latest reading (a holder's row: its share is 1/n)."""
    split: bool = False
    """The readings are the holder's own (per-process attribution): its activity is scaled
    to its share."""
    xid_last_ts: float | None = None
    """Event time of the last XID counted: one read again (at least once) is not counted
    twice."""


class RollupTrack(msgspec.Struct):
    """One node's open minutes (minute start -> device uuid -> minute) and counters."""

    minutes: dict[float, dict[str, Minute]] = {}
    watermark: float | None = None
    """The newest sample time seen on the node."""
    closed_before: float | None = None
    """Minutes starting before this are emitted: a sample for one is late."""
    last_dbe: dict[str, int] = {}
    """Per device, the highest double-bit ECC count seen: the baseline of ``ecc_dbe_new``."""
    late: int = 0
    """Device readings dropped because their minute was already emitted."""
    clock: int = 0
    """The node's clock, as ``Rollup.clock``: one more each time the caller takes a
    stepped-back clock (:meth:`MinuteFold.new_clock`)."""


class MinuteFold:
    """Folds device samples into per-minute rollups; the state is the caller's track."""

    def __init__(self, lateness_s: float = 60.0,
                 geometries: Mapping[str, mig_geometry.Geometry] | None = None) -> None:
        self.lateness_s = lateness_s
        # Loaded at the first MIG device: a fleet of whole GPUs never parses the catalog.
        self._geometries = geometries
        self._fraction: dict[tuple[str, str], float] = {}

    def bucket(self, track: RollupTrack, ts: float) -> dict[str, Minute] | None:
        """The open minute of ``ts`` on the node (device uuid -> minute); None when that
        minute was already emitted (the caller counts the sample late with :meth:`late`)."""
        minute = ts - ts % MINUTE
        if track.closed_before is not None and minute < track.closed_before:
            return None
        found = track.minutes.get(minute)
        if found is None:
            found = track.minutes[minute] = {}
        return found

    @staticmethod
    def late(track: RollupTrack, readings: int) -> None:
        track.late += readings

    def add_share(self, bucket: dict[str, Minute], device: DeviceSample, share: DeviceHolder,
                  ts: float, who: Attribution | None) -> bool:
        """Count one holder's share of a device several pods hold, in a row of its own."""
        # A holder's own readings where the source split them, whether or not the device is
        # judged as one (pods sharing a DRA claim: ``shared`` with their own readings).
        split = share.activity_pct is not None
        first = share is device.holders[0]
        own = msgspec.structs.replace(
            device, pod=share.pod, holders=[],
            # The device's throttling is counted once, on its first holder's row.
            clock_event_reasons=device.clock_event_reasons if first else None,
            util_pct=share.activity_pct if split else device.util_pct,
            engine_active_pct=None if split else device.engine_active_pct,
            mem_used_bytes=(share.mem_used_bytes if share.mem_used_bytes is not None
                            else device.mem_used_bytes))
        pod = (f"{who.namespace}/{who.pod}" if who is not None
               else share.pod_uid or "unnamed")
        key = f"{device.uuid}|{pod}"
        counted = self.add(bucket, own, ts, who, key)
        minute = bucket[key]
        minute.holders, minute.split = max(1, len(device.holders)), split
        return counted

    @staticmethod
    def add(bucket: dict[str, Minute], device: DeviceSample, ts: float,
            who: Attribution | None, key: str | None = None) -> bool:
        """Count one device reading in its minute (under ``key``, default the device's uuid);
        False for a duplicate (not counted)."""
        if key is None:
            key = device.uuid
        open_ = bucket.get(key)
        if open_ is None:
            open_ = bucket[key] = Minute(device)
        elif open_.last_ts is not None and ts <= open_.last_ts:
            return False
        elif not open_.samples:
            # An XID opened the minute before any sample did. (Its count, not its first
            # reading, says so: this runs for every device of every sample, and the first
            # reading is an object the rest of the minute never touches.)
            open_.first = device
        open_.last_ts = ts
        open_.samples += 1
        # Locals and one comparison per extreme: this runs for every device of every sample.
        util = device.engine_active_pct if device.kind == "mig" else device.util_pct
        if util is None:
            util = device.util_pct if device.util_pct is not None else device.engine_active_pct
        if util is not None:
            open_.util_n += 1
            open_.util_sum += util
            low = open_.util_min
            if low is None:
                open_.util_min = open_.util_max = util
            elif util < low:
                open_.util_min = util
            elif util > open_.util_max:  # type: ignore[operator]
                open_.util_max = util
        mem = device.mem_used_bytes
        if mem is not None:
            open_.mem_n += 1
            open_.mem_sum += mem
            top = open_.mem_max
            if top is None or mem > top:
                open_.mem_max = mem
        power = device.power_w
        if power is not None:
            open_.power_n += 1
            open_.power_sum += power
            peak = open_.power_max
            if peak is None or power > peak:
                open_.power_max = power
        temp = device.temp_c
        if temp is not None:
            hottest = open_.temp_max
            if hottest is None or temp > hottest:
                open_.temp_max = temp
        reasons = device.clock_event_reasons
        if reasons and reasons & THROTTLE_MASK:
            open_.throttled += 1
        dbe = device.ecc_dbe_volatile
        if dbe is not None:
            most = open_.dbe_max
            if most is None or dbe > most:
                open_.dbe_max = dbe
        if who is not None:
            open_.who = who
        return True

    def count_xid(self, track: RollupTrack, uuid: str, ts: float) -> None:
        """Count an XID against the device's minute (a late one counts as late)."""
        bucket = self.bucket(track, ts)
        if bucket is None:
            track.late += 1
            return
        open_ = bucket.get(uuid)
        if open_ is None:  # a shared device: its first holder's row counts it
            open_ = next((m for k, m in sorted(bucket.items())
                          if k.startswith(f"{uuid}|")), None)
        if open_ is None:
            open_ = bucket[uuid] = Minute(DeviceSample(uuid=uuid, index=0, model=""))
        # A device's XIDs come in order on one partition: one at or before the last counted
        # is a redelivery (after a crash or a rebalance's seek), or another XID of the same
        # instant, which this undercounts by one.
        if open_.xid_last_ts is not None and ts <= open_.xid_last_ts:
            return
        open_.xid_last_ts = ts
        open_.xids += 1

    def advance(self, track: RollupTrack, node: str, ts: float) -> list[Rollup]:
        """Move the node's event-time watermark to ``ts``; return the minutes it closes."""
        if track.watermark is None or ts > track.watermark:
            track.watermark = ts
        return self._close(track, node, track.watermark - self.lateness_s)

    def flush(self, track: RollupTrack, node: str) -> list[Rollup]:
        """Emit every open minute (at the end of a replay)."""
        return self._close(track, node, float("inf"))

    def new_clock(self, track: RollupTrack, node: str) -> list[Rollup]:
        """The node's clock stepped back and the caller takes the new one: emit the open
        minutes of the old clock and start the new one. Its minutes may be named again
        (the same minute start), and each is a minute of its own, so they carry the next
        ``clock``: the store keeps both."""
        out = self.flush(track, node)
        track.watermark = track.closed_before = None
        track.clock += 1
        return out

    def _close(self, track: RollupTrack, node: str, before: float) -> list[Rollup]:
        minutes = track.minutes
        done = [m for m in minutes if m + MINUTE <= before]
        if not done:
            return []
        out: list[Rollup] = []
        for minute in sorted(done):
            bucket = minutes.pop(minute)
            end = minute + MINUTE
            if track.closed_before is None or end > track.closed_before:
                track.closed_before = end
            for key in sorted(bucket):
                open_ = bucket[key]
                if open_.samples or open_.xids:
                    out.append(self._rollup(track, node, minute, open_))
        return out

    def _rollup(self, track: RollupTrack, node: str, minute: float, open_: Minute) -> Rollup:
        device = open_.first
        dbe_new = 0
        if open_.dbe_max is not None:
            before = track.last_dbe.get(device.uuid)
            # The first reading of a device is its baseline: old errors are not new faults.
            dbe_new = max(0, open_.dbe_max - before) if before is not None else 0
            track.last_dbe[device.uuid] = max(open_.dbe_max, before or 0)
        who = open_.who or _NOBODY
        util_min, util_max = open_.util_min, open_.util_max
        util_mean = open_.util_sum / open_.util_n if open_.util_n else None
        if open_.split and open_.holders > 1:
            # Its own activity of the whole device, relative to its share of it.
            scale = open_.holders
            util_min = None if util_min is None else util_min * scale
            util_max = None if util_max is None else util_max * scale
            util_mean = None if util_mean is None else util_mean * scale
        # Positional, in ROLLUP_FIELDS order: eight times cheaper than 29 keywords, and it
        # runs for every device every minute (tests/rules/test_rollup.py checks the order).
        return Rollup(
            minute, node, device.uuid, device.model, open_.samples, device.kind, device.index,
            device.parent_uuid, device.mig_profile,
            self._gpu_fraction(device) / open_.holders,
            util_min, util_mean,
            util_max, open_.mem_sum / open_.mem_n if open_.mem_n else None,
            open_.mem_max, device.mem_total_bytes,
            open_.power_sum / open_.power_n if open_.power_n else None, open_.power_max,
            open_.temp_max, open_.throttled, dbe_new, open_.xids,
            who.namespace, who.pod, who.owner_kind, who.owner_name, who.team,
            who.workload_kind, who.queue, track.clock,
        )

    def _gpu_fraction(self, device: DeviceSample) -> float:
        if device.kind != "mig" or not device.mig_profile:
            return 1.0
        key = (device.model, device.mig_profile)
        fraction = self._fraction.get(key)
        if fraction is None:
            match = _COMPUTE.match(device.mig_profile)
            if self._geometries is None:
                self._geometries = mig_geometry.load()
            found = mig_geometry.find(self._geometries, device.model)
            total = found.total_compute_slices if found else 7
            fraction = min(1.0, int(match.group(1)) / total) if match else 1.0
            self._fraction[key] = fraction
        return fraction
