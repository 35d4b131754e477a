"""Samples to per-device per-minute rollups, offline: the replay's use of the worker's fold.

The fold itself is :mod:`gpusteward.rules.rollup`, which the stream worker
runs on every sample. Offline there is no node join, so
:class:`MinuteRollups` keeps the pods it learns from allocation events (by
namespace/name: the samples' attribution may carry no uid) and one track per
node; :func:`rollups` is the one-shot form.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpusteward.rules import rollup as fold
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.schema import (
    AllocationEvent,
    HwEvent,
    NodeSample,
    PodAllocation,
    PodRef,
    Rollup,
)


class MinuteRollups:
    """Folds samples, hardware events and allocations into per-minute rollups."""

    def __init__(self, lateness_s: float = 60.0,
                 team_labels: Sequence[str] = fold.DEFAULT_TEAM_LABELS,
                 geometries: Mapping[str, mig_geometry.Geometry] | None = None) -> None:
        self.fold = fold.MinuteFold(lateness_s, geometries)
        self.team_labels = tuple(team_labels)
        self.pods: dict[tuple[str, str], fold.Attribution] = {}
        self.uids: dict[str, fold.Attribution] = {}
        """Pod uid -> its attribution: the holders of a shared device the collector found by
        their processes' cgroup go by uid alone."""
        self.nodes: dict[str, fold.RollupTrack] = {}

    @property
    def late_dropped(self) -> int:
        return sum(track.late for track in self.nodes.values())

    def allocation(self, event: AllocationEvent) -> None:
        """Remember a pod's owner, labels and queue (node events carry none of that)."""
        if isinstance(event, PodAllocation):
            key = (event.pod.namespace, event.pod.name)
            if event.phase == "deleted":
                self.pods.pop(key, None)
                self.uids.pop(event.pod.uid or "", None)
            else:
                who = self.pods[key] = fold.attribution(
                    event.pod, labels=event.labels, owner_kind=event.owner_kind,
                    owner_name=event.owner_name, workload_kind=event.workload_kind,
                    queue=event.queue, team_labels=self.team_labels)
                if event.pod.uid:
                    self.uids[event.pod.uid] = who

    def _who(self, pod: PodRef | None) -> fold.Attribution | None:
        if pod is None:
            return None
        known = self.pods.get((pod.namespace, pod.name))
        return known or fold.attribution(pod, team_labels=self.team_labels)

    def sample(self, sample: NodeSample) -> list[Rollup]:
        track = self.nodes.setdefault(sample.node, fold.RollupTrack())
        bucket = self.fold.bucket(track, sample.ts)
        if bucket is None:
            self.fold.late(track, len(sample.devices))
            return []
        for device in sample.devices:
            if len(device.holders) > 1:  # shared: a row per holder, each with its share
                for share in device.holders:
                    who = (self._who(share.pod) if share.pod is not None
                           else self.uids.get(share.pod_uid or ""))
                    self.fold.add_share(bucket, device, share, sample.ts, who)
                continue
            self.fold.add(bucket, device, sample.ts, self._who(device.pod))
        return self.fold.advance(track, sample.node, sample.ts)

    def hw_event(self, event: HwEvent) -> list[Rollup]:
        """Count an XID against the device's minute (other kinds show in the samples)."""
        if event.kind == "xid" and event.uuid is not None:
            track = self.nodes.setdefault(event.node, fold.RollupTrack())
            self.fold.count_xid(track, event.uuid, event.ts)
        return []

    def flush(self) -> list[Rollup]:
        """Emit every open minute (at the end of a replay or on shutdown)."""
        out: list[Rollup] = []
        for name, track in self.nodes.items():
            out.extend(self.fold.flush(track, name))
        return out


def rollups(samples: Iterable[NodeSample], allocations: Iterable[AllocationEvent] = (),
            hw_events: Iterable[HwEvent] = (), lateness_s: float = 60.0) -> list[Rollup]:
    """The rollups of a finite set of records (allocations are applied first)."""
    minutes = MinuteRollups(lateness_s=lateness_s)
    for event in allocations:
        minutes.allocation(event)
    out: list[Rollup] = []
    for hw in hw_events:
        minutes.hw_event(hw)
    for sample in sorted(samples, key=lambda s: s.ts):
        out.extend(minutes.sample(sample))
    out.extend(minutes.flush())
    return out
