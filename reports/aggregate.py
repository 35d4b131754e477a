"""Samples to per-device per-minute rollups: the pure fold the stream worker runs.

:class:`MinuteRollups` keeps, per device, the open minutes of event time
and the pods known from allocation events (for owner, team and queue). A
minute is emitted once the node's newest sample is ``lateness_s`` past the
minute's end; a sample for a minute already emitted is counted in
``late_dropped`` and otherwise ignored, because the rollup downstream is
final. No I/O and no clock: the worker (or a replay, or a test) feeds it and
publishes what it returns; :func:`rollups` is the one-shot form.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.schema import (
    AllocationEvent,
    DeviceSample,
    HwEvent,
    NodeSample,
    PodAllocation,
    Rollup,
)

MINUTE = 60
THROTTLE_MASK = 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock-event reasons that mean the GPU was held back: HW slowdown, SW thermal,
HW thermal, HW power brake (not idle or application clocks)."""
DEFAULT_TEAM_LABELS = ("team", "gpusteward.io/team", "app.kubernetes.io/part-of")
_COMPUTE = re.compile(r"^(?:\d+c\.)?(\d+)g\.")


@dataclass
class _Open:
    """One device's open minute."""

    first: DeviceSample
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
    pod_ns: str | None = None
    pod_name: str | None = None


@dataclass
class _Node:
    watermark: float = float("-inf")
    closed_before: float = float("-inf")
    minutes: dict[tuple[str, float], _Open] = field(default_factory=dict)


class MinuteRollups:
    """Folds samples, hardware events and allocations into per-minute rollups."""

    def __init__(self, lateness_s: float = 60.0,
                 team_labels: Sequence[str] = DEFAULT_TEAM_LABELS,
                 geometries: Mapping[str, mig_geometry.Geometry] | None = None) -> None:
        self.lateness_s = lateness_s
        self.team_labels = tuple(team_labels)
        self.geometries = mig_geometry.load() if geometries is None else geometries
        self.pods: dict[tuple[str, str], PodAllocation] = {}
        self.nodes: dict[str, _Node] = {}
        self.last_dbe: dict[str, int] = {}
        self.late_dropped = 0
        self._fraction: dict[tuple[str, str], float] = {}

    def allocation(self, event: AllocationEvent) -> None:
        """Remember a pod's owner, labels and queue (node events carry none of that)."""
        if isinstance(event, PodAllocation):
            key = (event.pod.namespace, event.pod.name)
            if event.phase == "deleted":
                self.pods.pop(key, None)
            else:
                self.pods[key] = event

    def sample(self, sample: NodeSample) -> list[Rollup]:
        node = self.nodes.setdefault(sample.node, _Node())
        minute = sample.ts - sample.ts % MINUTE
        if minute < node.closed_before:
            self.late_dropped += len(sample.devices)
            return []
        for device in sample.devices:
            self._add(node, minute, device)
        node.watermark = max(node.watermark, sample.ts)
        return self._close(sample.node, node, node.watermark - self.lateness_s)

    def hw_event(self, event: HwEvent) -> list[Rollup]:
        """Count an XID against the device's minute (other kinds show in the samples)."""
        if event.kind != "xid" or event.uuid is None:
            return []
        node = self.nodes.setdefault(event.node, _Node())
        minute = event.ts - event.ts % MINUTE
        open_ = node.minutes.get((event.uuid, minute))
        if open_ is not None:
            open_.xids += 1
        elif minute >= node.closed_before:
            placeholder = DeviceSample(uuid=event.uuid, index=0, model="")
            self._add(node, minute, placeholder, counts=False).xids += 1
        else:
            self.late_dropped += 1
        return []

    def flush(self) -> list[Rollup]:
        """Emit every open minute (at the end of a replay or on shutdown)."""
        out: list[Rollup] = []
        for name, node in self.nodes.items():
            out.extend(self._close(name, node, float("inf")))
        return out

    def _add(self, node: _Node, minute: float, device: DeviceSample,
             counts: bool = True) -> _Open:
        key = (device.uuid, minute)
        open_ = node.minutes.get(key)
        if open_ is None:
            open_ = node.minutes[key] = _Open(first=device)
        elif not open_.first.model and device.model:
            open_.first = device  # an XID opened the minute before any sample did
        if not counts:
            return open_
        open_.samples += 1
        util = device.engine_active_pct if device.kind == "mig" else device.util_pct
        if util is None:
            util = device.util_pct if device.util_pct is not None else device.engine_active_pct
        if util is not None:
            open_.util_n += 1
            open_.util_sum += util
            open_.util_min = util if open_.util_min is None else min(open_.util_min, util)
            open_.util_max = util if open_.util_max is None else max(open_.util_max, util)
        if device.mem_used_bytes is not None:
            open_.mem_n += 1
            open_.mem_sum += device.mem_used_bytes
            open_.mem_max = max(open_.mem_max or 0, device.mem_used_bytes)
        if device.power_w is not None:
            open_.power_n += 1
            open_.power_sum += device.power_w
            open_.power_max = max(open_.power_max or 0.0, device.power_w)
        if device.temp_c is not None:
            open_.temp_max = max(open_.temp_max or float("-inf"), device.temp_c)
        if device.clock_event_reasons and device.clock_event_reasons & THROTTLE_MASK:
            open_.throttled += 1
        if device.ecc_dbe_volatile is not None:
            open_.dbe_max = max(open_.dbe_max or 0, device.ecc_dbe_volatile)
        if device.pod is not None:
            open_.pod_ns, open_.pod_name = device.pod.namespace, device.pod.name
        return open_

    def _close(self, node_name: str, node: _Node, before: float) -> list[Rollup]:
        done = sorted(k for k in node.minutes if k[1] + MINUTE <= before)
        out: list[Rollup] = []
        for key in done:
            open_ = node.minutes.pop(key)
            node.closed_before = max(node.closed_before, key[1] + MINUTE)
            if open_.samples or open_.xids:
                out.append(self._rollup(node_name, key[1], open_))
        return out

    def _rollup(self, node: str, minute: float, open_: _Open) -> Rollup:
        device = open_.first
        dbe_new = 0
        if open_.dbe_max is not None:
            before = self.last_dbe.get(device.uuid)
            # The first reading of a device is its baseline: old errors are not new faults.
            dbe_new = max(0, open_.dbe_max - before) if before is not None else 0
            self.last_dbe[device.uuid] = max(open_.dbe_max, before or 0)
        rollup = Rollup(
            ts=minute, node=node, uuid=device.uuid, model=device.model,
            samples=open_.samples, kind=device.kind, index=device.index,
            parent_uuid=device.parent_uuid, mig_profile=device.mig_profile,
            gpu_fraction=self._gpu_fraction(device),
            util_min=open_.util_min, util_max=open_.util_max,
            util_mean=open_.util_sum / open_.util_n if open_.util_n else None,
            mem_used_mean=open_.mem_sum / open_.mem_n if open_.mem_n else None,
            mem_used_max=open_.mem_max, mem_total_bytes=device.mem_total_bytes,
            power_mean=open_.power_sum / open_.power_n if open_.power_n else None,
            power_max=open_.power_max, temp_max=open_.temp_max,
            throttled_samples=open_.throttled, ecc_dbe_new=dbe_new, xid_count=open_.xids,
        )
        if open_.pod_name is not None and open_.pod_ns is not None:
            self._attribute(rollup, open_.pod_ns, open_.pod_name)
        return rollup

    def _attribute(self, rollup: Rollup, namespace: str, pod: str) -> None:
        rollup.namespace, rollup.pod = namespace, pod
        allocation = self.pods.get((namespace, pod))
        labels = allocation.labels if allocation else {}
        rollup.team = next((labels[k] for k in self.team_labels if labels.get(k)), namespace)
        if allocation is not None:
            rollup.owner_kind = allocation.owner_kind
            rollup.owner_name = allocation.owner_name
            rollup.workload_kind = allocation.workload_kind
            rollup.queue = allocation.queue
        if rollup.owner_name is None:
            rollup.owner_name = pod

    def _gpu_fraction(self, device: DeviceSample) -> float:
        if device.kind != "mig" or not device.mig_profile:
            return 1.0
        key = (device.model, device.mig_profile)
        if key not in self._fraction:
            match = _COMPUTE.match(device.mig_profile)
            found = mig_geometry.find(self.geometries, device.model)
            total = found.total_compute_slices if found else 7
            self._fraction[key] = min(1.0, int(match.group(1)) / total) if match else 1.0
        return self._fraction[key]


def rollups(samples: Iterable[NodeSample], allocations: Iterable[AllocationEvent] = (),
            hw_events: Iterable[HwEvent] = (), lateness_s: float = 60.0) -> list[Rollup]:
    """The rollups of a finite set of records (allocations are applied first)."""
    fold = MinuteRollups(lateness_s=lateness_s)
    for event in allocations:
        fold.allocation(event)
    out: list[Rollup] = []
    for hw in hw_events:
        fold.hw_event(hw)
    for sample in sorted(samples, key=lambda s: s.ts):
        out.extend(fold.sample(sample))
    out.extend(fold.flush())
    return out
