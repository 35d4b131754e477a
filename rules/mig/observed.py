"""MIG demand and layouts as the fleet agent sees them: from the queue and node summaries.

The weekly report plans MIG layouts from a week of device samples; the fleet
agent plans them from what streams past it, which is less: queue events
(workload, state, requested MIG profiles) and node summaries (GPU model, GPU
count, *free* MIG devices by profile). This module turns those into the
arguments of :func:`gpusteward.rules.mig.layout.advise`, and what it has to
guess is said here once:

- Demand: one entry per MIG device a workload requests, its profile being
  the one requested (a request names its profile, so it is the smallest that
  fits by the workload's own account), its share the part of the trailing
  window the workload spent pending or admitted. Whole-GPU requests are left
  out: a queue event does not say which GPU model a workload wants, and a
  GPU the plan does not partition runs with MIG off, which is what whole-GPU
  work needs anyway.
- Pool: the nodes of one GPU model (as the report does; split by GPU count
  per node where that differs, since a plan gives every node of a pool the
  same number of GPUs). A requested profile
  goes to the largest pool whose nodes offered it during the interval, else
  to the largest pool whose model has it at all (most room to re-partition);
  none: it cannot be served anywhere and is left out. A workload is not
  split across pools by what it actually ran on, which the queue does not say.
- Layouts today: a summary lists only the MIG devices still free, so a
  node's instances are taken as the most of each profile it showed free at
  once since the last advice, packed onto its GPUs first-fit. A node whose
  MIG devices were all in use at every summary of the interval looks less
  partitioned than it is (possibly not at all), and the advice may then list
  a change for a node that already has the planned layout. Its GPU count
  suffers too: under the device plugin's ``mixed`` strategy a partitioned
  GPU is not counted in ``gpus_total``, so a fully partitioned node counts
  the GPUs its seen instances need, and is left out when none were seen.
  Both would be exact if the summary carried the node's MIG allocatable
  (the node join has it) and not only what is free. The node's
  ``nvidia.com/mig.config`` label is not in the summaries either, so changes
  carry no "before" config name.
- Cordoned and unhealthy nodes (as the latest summary says) are in no pool, as
  the other fleet rules count none of their room: a plan that serves demand
  on a node the scheduler will not use serves nobody. Their free devices
  still tell their layout, for when they come back, and their GPU count still
  splits their model's pools, so a pool's name (and its advice's id) does not
  change while one is out.
- A pool with no MIG demand in the window gets no advice (not "switch MIG
  off"): the queue may simply not report the MIG requests.

The state is a msgspec struct that the fleet agent checkpoints with the rest
of its state; it holds one entry per MIG-requesting workload of the window
and one small map per MIG node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import msgspec

from gpusteward.rules.findings import resolved
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.rules.mig import layout
from gpusteward.rules.mig.geometry import Geometry, GeometryError, Layout
from gpusteward.schema import Finding, NodeSummary, QueueEvent, Subject


class MigWorkload(msgspec.Struct, array_like=True):
    """A workload that asked for MIG devices: what, and when it wanted them.

    Encoded as an array: the checkpoint holds one per MIG workload of the window and is
    written on every queue event, so field names would be a third of its size.
    """

    profiles: dict[str, int]
    since: float
    until: float | None = None
    """When it finished or was deleted; None while it still wants its devices."""


class Advised(msgspec.Struct):
    """A pool's advice finding, open until :func:`supersede` resolves it."""

    id: str
    fingerprint: str
    since: float


class MigObservation(msgspec.Struct):
    """What the fleet agent has seen of MIG demand and layouts."""

    workloads: dict[str, MigWorkload] = {}
    instances: dict[str, dict[str, int]] = {}
    """node -> profile -> the most free devices of it seen at once since the last advice."""
    last_slot: float | None = None
    """Start of the advice interval last advised (or the first one seen)."""
    touched: list[str] = []
    """Workloads whose entry changed or was dropped since the caller last looked: the
    fleet agent keeps workloads in a table of their own (one record per workload), not in
    its checkpoint, which is written on every queue event."""
    advised: dict[str, Advised] = {}
    """Pool -> its last advice finding, while open."""


def supersede(observation: MigObservation, advice: list[Finding], ts: float
              ) -> list[Finding]:
    """The pools' advice ``advice`` (one interval's, at ``ts``) preceded by the resolution
    of each pool's earlier advice it does not repeat: superseded by the pool's new one, or
    no longer advised. An interval's advice is a finding of its own (its id from the
    window's start) that nothing else resolves: the last one of a pool whose layout was
    applied, or whose demand left, fired for ever. A resolution goes before the firing of
    the same pool's new advice, so a consumer batch holding both nets them to the new one
    (the alerting sinks keep one alert per fingerprint, which is the pool's)."""
    advised = observation.advised
    now = {finding.labels.get("pool", ""): finding for finding in advice}
    out: list[Finding] = []
    for pool, last in list(advised.items()):
        new = now.get(pool)
        if new is not None and new.id == last.id:
            continue  # the same interval advised again (a restart re-ran it)
        why = ("superseded by the advice of the next interval" if new is not None
               else "no MIG layout change advised any more")
        out.append(resolved(last.id, last.fingerprint, layout.KIND, Subject(node=None),
                            f"pool {pool}: {why}", last.since, max(ts, last.since)))
        del advised[pool]
    for pool, finding in now.items():
        advised[pool] = Advised(finding.id, finding.fingerprint, finding.starts_at)
    return out + advice


def on_queue(observation: MigObservation, key: str, event: QueueEvent) -> None:
    """Fold a queue event in (``key``: the workload, as the queue rules name it)."""
    profiles = {p: n for p, n in event.mig.items() if n > 0}
    known = observation.workloads.get(key)
    # It wants its devices while admitted or waiting (an evicted one is requeued); a
    # deactivated one wants nothing until it is resumed.
    if event.state == "admitted" or event.waiting:
        if known is None:
            if not profiles:
                return
            observation.workloads[key] = MigWorkload(profiles=profiles, since=event.ts)
        else:
            before = msgspec.structs.astuple(known)
            # Back in the queue after finishing (a re-run under the same name): the gap
            # counts as wanted, a slight over-estimate of its share.
            known.until = None
            known.since = min(known.since, event.ts)
            if profiles:
                known.profiles = profiles
            if msgspec.structs.astuple(known) == before:
                return
    elif known is not None and known.until is None:
        known.until = max(known.since, event.ts)
    else:
        return
    observation.touched.append(key)


def on_summary(observation: MigObservation, summary: NodeSummary) -> None:
    seen = observation.instances.setdefault(summary.node, {})
    for profile, count in summary.mig_free.items():
        if count > seen.get(profile, 0):
            seen[profile] = count


def restart_interval(observation: MigObservation, slot: float,
                     latest: Iterable[NodeSummary], forget_before: float) -> None:
    """Begin a new advice interval at ``slot``: layouts are re-learnt from the latest
    summaries, workloads that stopped before ``forget_before`` are dropped."""
    observation.last_slot = slot
    observation.instances = {s.node: dict(s.mig_free) for s in latest if s.mig_free}
    for key in [k for k, w in observation.workloads.items()
                if w.until is not None and w.until < forget_before]:
        del observation.workloads[key]
        observation.touched.append(key)


def share(workload: MigWorkload, start: float, end: float) -> float:
    """The part of ``[start, end]`` the workload wanted its devices, 0-1."""
    if end <= start:
        return 0.0
    stop = end if workload.until is None else min(end, workload.until)
    return max(0.0, stop - max(start, workload.since)) / (end - start)


def pools(geometries: Mapping[str, Geometry], summaries: Iterable[NodeSummary],
          instances: Mapping[str, Mapping[str, int]] | None = None) -> list[layout.Pool]:
    """One pool per MIG-capable GPU model, named by the geometry's model, nodes sorted;
    cordoned and unhealthy nodes are left out (the scheduler will not use them).

    A node's GPUs: its summary's count, or the GPUs its ``instances`` need if more.
    Under the device plugin's ``mixed`` strategy a partitioned GPU is not an
    ``nvidia.com/gpu``, so a fully partitioned node reports none; one whose instances
    were never seen free is then left out. A pool plans the same number of GPUs on
    each node, so a model whose nodes differ in GPU count is split into one pool per
    count, named ``<model>/<n>gpu``. The split counts the cordoned and unhealthy nodes
    too: a pool keeps its name (and its advice its id) while one of them is out.
    """
    instances = instances or {}
    members: dict[tuple[str, int], list[str]] = {}
    shapes: set[tuple[str, int]] = set()
    for summary in summaries:
        if not summary.gpu_model:
            continue
        found = mig_geometry.find(geometries, summary.gpu_model)
        if found is None:
            continue
        held = instances.get(summary.node, {})
        gpus = max(summary.gpus_total,
                   sum(1 for g in gpu_layouts(found, held, sum(held.values())) if g))
        if gpus <= 0:
            continue
        shapes.add((found.model, gpus))
        if not summary.cordoned and summary.healthy:
            members.setdefault((found.model, gpus), []).append(summary.node)
    counts: dict[str, int] = {}
    for model, _ in shapes:
        counts[model] = counts.get(model, 0) + 1
    return [layout.Pool(name=model if counts[model] == 1 else f"{model}/{gpus}gpu",
                        model=model, nodes=tuple(sorted(nodes)), gpus_per_node=gpus)
            for (model, gpus), nodes in sorted(members.items())]


def gpu_layouts(geometry: Geometry, instances: Mapping[str, int], gpus: int
                ) -> list[Layout | None]:
    """Instances packed onto ``gpus`` GPUs, largest first, each onto the first GPU that can
    still hold it (None: a GPU with none, MIG off). Instances that fit nowhere, or of a
    profile the model lacks, are dropped."""
    per_gpu: list[dict[str, int]] = [{} for _ in range(gpus)]
    known = [(geometry.profile(p), n) for p, n in instances.items()
             if n > 0 and p in {q.name for q in geometry.profiles}]
    for profile, count in sorted(known, key=lambda item: (-item[0].compute_slices,
                                                          -item[0].memory_slices,
                                                          item[0].name)):
        for _ in range(count):
            for target in per_gpu:
                grown = {**target, profile.name: target.get(profile.name, 0) + 1}
                if geometry.is_valid(grown):
                    target[profile.name] = grown[profile.name]
                    break
    return [g or None for g in per_gpu]


def demand(geometries: Mapping[str, Geometry], pool_list: Iterable[layout.Pool],
           observation: MigObservation, now: float, window_s: float
           ) -> dict[str, list[layout.Demand]]:
    """Per pool name, one :class:`~layout.Demand` per MIG device requested in the window."""
    pool_list = list(pool_list)
    offered: dict[str, set[str]] = {}
    for pool in pool_list:
        offered[pool.name] = {p for node in pool.nodes
                              for p, n in observation.instances.get(node, {}).items() if n}
    out: dict[str, list[layout.Demand]] = {}
    start = now - window_s
    for key in sorted(observation.workloads):
        workload = observation.workloads[key]
        weight = share(workload, start, now)
        if weight <= 0:
            continue
        devices = [(p, i) for p, n in sorted(workload.profiles.items()) for i in range(n)]
        for profile, i in devices:
            target = _pool_for(geometries, pool_list, offered, profile)
            if target is None:
                continue
            name = key if len(devices) == 1 else f"{key}#{profile}#{i}"
            out.setdefault(target, []).append(layout.Demand(name, profile, weight))
    return out


def _pool_for(geometries: Mapping[str, Geometry], pool_list: list[layout.Pool],
              offered: Mapping[str, set[str]], profile: str) -> str | None:
    able = sorted((p for p in pool_list if _has(geometries[p.model], profile)),
                  key=lambda p: (-p.gpus, p.name))
    return next((p.name for p in able if profile in offered[p.name]),
                able[0].name if able else None)


def _has(geometry: Geometry, profile: str) -> bool:
    try:
        geometry.profile(profile)
    except GeometryError:
        return False
    return True


def advise(geometries: Mapping[str, Geometry], summaries: Iterable[NodeSummary],
           observation: MigObservation, now: float, window_s: float) -> layout.Advice:
    """The layout advice for the fleet the summaries describe and the window's demand."""
    summaries = list(summaries)
    every_pool = pools(geometries, summaries, observation.instances)
    wanted = demand(geometries, every_pool, observation, now, window_s)
    # A pool nobody asked MIG devices of is left alone: "switch MIG off" on the strength
    # of a queue that may not report MIG requests at all would be a false alarm.
    pool_list = [p for p in every_pool if wanted.get(p.name)]
    current: dict[str, list[Layout | None]] = {}
    for pool in pool_list:
        geometry = geometries[pool.model]
        for node in pool.nodes:
            current[node] = gpu_layouts(geometry, observation.instances.get(node, {}),
                                        pool.gpus_per_node)
    return layout.advise(geometries, pool_list, wanted, current=current)


def slot_of(ts: float, interval_s: float) -> float:
    """Start of the advice interval holding event time ``ts`` (aligned on the epoch, so
    every worker and every restart cuts the same intervals)."""
    return math.floor(ts / interval_s) * interval_s
