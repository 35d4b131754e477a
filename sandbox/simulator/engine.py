"""The simulated fleet: a small scheduler, workloads with utilisation profiles, faults.

It publishes exactly what the real collectors publish (one NodeSample per
node per tick with per-pod attribution, pod and node allocation events,
queue events, urgent hardware events) and keeps its own ground truth: which
pod was placed where and when, the idle stretches it injected, the faults,
and the cordons it received. Tests compare the pipeline's findings with it.

Time is simulated: every tick advances ``sample_interval_s`` of event time
and waits ``sample_interval_s / acceleration`` of wall time (no wait at
acceleration 0). A cordon asked for by the remediation executor takes effect
at the next tick: the scheduler places nothing new on a cordoned node.

It stays one module: the simulated cluster's step (cordons, reclaims, ends, arrivals,
faults, scheduling, samples) is one ordered loop over one state.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid as uuidlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from gpusteward.collectors.kubernetes.translate import memory_grows
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.rules.budget import mig_gpus
from gpusteward.sandbox.simulator.scenario import Fault, Phase, Scenario, WorkloadGroup
from gpusteward.schema import (
    DeviceHolder,
    DeviceSample,
    HwEvent,
    NodeInventory,
    NodeSample,
    PodAllocation,
    PodRef,
    QueueEvent,
    Taint,
)

IDLE_TRUTH_PCT = 5.0
"""A phase whose activity never reaches this (percent) is injected idleness."""

HOT_TEMP_C = 94.0
"""Temperature of a GPU under a thermal fault: above every model's slowdown threshold."""
THERMAL_REASONS = 0x20 | 0x40
"""NVML clock-event bits SwThermalSlowdown | HwThermalSlowdown."""
TARGET_TEMP_C = 87.0
"""Temperature of a GPU at its thermal target: an H100 SXM's max operating temperature, 2 °C
below its slowdown temperature (89 °C)."""
SW_THERMAL = 0x20
"""NVML clock-event bit SwThermalSlowdown: the clocks trimmed to hold the thermal target."""

GIB = 1 << 30
CONTEXT_BYTES = 500 << 20
"""What a GPU a process opened but runs nothing on holds: its CUDA context."""


class IdlePeriod(msgspec.Struct):
    """An injected idle stretch of a pod that held a device."""

    namespace: str
    pod: str
    kind: str
    node: str
    device: str
    pod_started_at: float
    start: float
    end: float


class PodRecord(msgspec.Struct):
    namespace: str
    pod: str
    kind: str
    node: str
    devices: list[str]
    started_at: float
    ended_at: float | None
    idle: bool
    """True if any of its phases is injected idleness."""
    queued_at: float | None = None
    """When it arrived in the queue."""
    gang: str | None = None
    """``namespace/JobSet name`` of the gang it is a member of."""
    team: str | None = None
    gpus: float = 0.0
    """GPUs it held (whole-GPU equivalents), for GPU-hours."""


class FaultRecord(msgspec.Struct):
    """An injected fault: one record per fault (an xid fault: one per event sent)."""

    kind: str
    node: str
    device: str
    ts: float
    end: float | None = None
    """When a burst or thermal fault stopped (None: it lasted to the end, or was instant)."""
    xid: int | None = None
    count: int = 0
    """Counter increase per sample of a burst fault."""
    workload: str | None = None
    """An xid fault: the workload whose pod held the GPU then (``namespace/OwnerKind/owner``,
    as the watcher names a pod's top owner); None: no pod held it."""


class InterruptionRecord(msgspec.Struct):
    """A spot node told it is being reclaimed, and the pods it held then."""

    node: str
    ts: float
    taint: str
    pods: dict[str, str]
    """namespace/name -> owner kind of every pod on the node at the taint."""
    reclaimed_at: float | None = None


class CordonRecord(msgspec.Struct):
    node: str
    ts: float
    reason: str


class ReclaimRecord(msgspec.Struct):
    """A running pod whose GPUs were taken back (its owner stopped or scaled to zero)."""

    namespace: str
    pod: str
    node: str
    ts: float
    gpus: int
    would_hold_until: float
    """When it would have let its GPUs go otherwise: its end, or the scenario's."""
    reason: str

    @property
    def gpu_hours_given_back(self) -> float:
        return self.gpus * max(0.0, self.would_hold_until - self.ts) / 3600


class LeakRecord(msgspec.Struct):
    """A pod whose GPU memory grows steadily, and when its device runs out at that rate."""

    namespace: str
    pod: str
    node: str
    device: str
    growth_bytes_per_s: float
    exhausted_at: float
    """When the device's used memory reaches its total at this growth, the other holders'
    memory staying on its trend (Unix seconds; readings jitter around it): a finding at
    ``ts`` projects ``exhausted_at - ts``."""


class GroundTruth(msgspec.Struct):
    """What the simulator did, for tests and the demo summary."""

    scenario: str
    seed: int
    start_ts: float
    end_ts: float
    sample_interval_s: float
    pods: list[PodRecord] = []
    idle_periods: list[IdlePeriod] = []
    faults: list[FaultRecord] = []
    cordons: list[CordonRecord] = []
    pending: list[str] = []
    notified: list[str] = []
    interruptions: list[InterruptionRecord] = []
    pending_since: dict[str, float] = {}
    """namespace/name -> arrival of every workload still pending at the end."""
    unplaceable: list[str] = []
    """namespace/name of every workload still pending at the end that asks for more whole
    GPUs than any node of the scenario has, or for MIG devices no node's layout offers
    together: it could never start."""
    reclaims: list[ReclaimRecord] = []
    gangs: dict[str, int] = {}
    """namespace/JobSet name -> members, of every gang in the scenario (its members are the
    pods whose ``gang`` names it)."""
    leaks: list[LeakRecord] = []
    """Pods whose memory grows (``mem_growth_gib_per_h``), on a single device each."""


def _uuid(seed: int, *parts: object) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, "/".join(map(str, (seed, *parts)))))


@dataclass
class SimMig:
    """A MIG device of a partitioned GPU (the node group's ``mig_layout``)."""

    uuid: str
    profile: str
    gpu_instance_id: int
    holder: Workload | None = None

    def take(self, workload: Workload) -> None:
        self.holder = workload

    def release(self, workload: Workload) -> None:
        if self.holder is workload:
            self.holder = None


@dataclass
class SimGpu:
    uuid: str
    index: int
    model: str
    mem_total: int
    holder: Workload | None = None
    dbe: int = 0
    last_util: float = 0.0
    sbe: int = 0
    pcie_replay: int = 0
    nvlink_errors: int = 0
    nvlink_crc_errors: int = 0
    hot: bool = False
    at_target: bool = False
    lost: bool = False
    remap_failure: bool = False
    mig: list[SimMig] = field(default_factory=list)
    """Its MIG devices; a partitioned GPU is never handed out whole."""
    replicas: int = 1
    """Pods it is advertised to (time-slicing or MPS replicas); above 1 its pods are
    ``sharers``, never ``holder``."""
    sharers: list[Workload] = field(default_factory=list)
    """The pods holding a replica of a shared GPU, in placement order."""

    def take(self, workload: Workload) -> None:
        if self.replicas > 1:
            self.sharers.append(workload)
        else:
            self.holder = workload

    def release(self, workload: Workload) -> None:
        if workload in self.sharers:
            self.sharers.remove(workload)
        if self.holder is workload:
            self.holder = None


@dataclass
class SimNode:
    name: str
    gpus: list[SimGpu]
    spot: bool
    group: str = ""
    """The node group's prefix (a workload's ``node_group`` selects it)."""
    sharing: str | None = None
    """time-slicing or mps when its GPUs have replicas."""
    dra: bool = False
    """Its GPUs are handed out by NVIDIA's DRA driver, not the device plugin."""
    cordoned: bool = False
    taints: list[Taint] = field(default_factory=list)
    gone: bool = False
    """Reclaimed (spot): no samples, no scheduling."""

    def free(self) -> list[SimGpu]:
        """Whole GPUs with a free replica (a GPU that is not shared has one)."""
        return [g for g in self.gpus
                if g.holder is None and not g.mig and len(g.sharers) < g.replicas]

    def free_mig(self, profile: str) -> list[SimMig]:
        return [m for g in self.gpus for m in g.mig if m.holder is None and m.profile == profile]


@dataclass
class Workload:
    name: str
    namespace: str
    uid: str
    spec: WorkloadGroup
    arrive: float
    duration: float | None
    mem_bytes: int
    timeline: list[tuple[float, float | None, Phase]]
    """Phases as (offset from start, length or None, phase); cycled when ``spec.repeat``."""
    rng: random.Random
    node: SimNode | None = None
    devices: list[SimGpu | SimMig] = field(default_factory=list)
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def ref(self) -> PodRef:
        return PodRef(namespace=self.namespace, name=self.name, uid=self.uid)

    @property
    def kubelet_ref(self) -> PodRef:
        """The pod as the kubelet's PodResources API names it: no uid."""
        return PodRef(namespace=self.namespace, name=self.name)

    def phase_at(self, since_start: float) -> Phase:
        cycle = self.timeline[-1][0] + (self.timeline[-1][1] or 0.0)
        if self.spec.repeat and cycle > 0:
            since_start %= cycle
        for offset, length, phase in self.timeline:
            if length is None or since_start < offset + length:
                return phase
        return self.timeline[-1][2]

    def utilisation(self, since_start: float) -> float:
        low, high = self.phase_at(since_start).util
        return round(self.rng.uniform(low, high), 1)

    @property
    def growth_bytes_per_s(self) -> float:
        return self.spec.mem_growth_gib_per_h * GIB / 3600

    def memory(self, since_start: float) -> int:
        """GPU memory it uses ``since_start`` seconds after it started, on its trend (bytes)."""
        return self.mem_bytes + int(self.growth_bytes_per_s * since_start)

    def memory_reading(self, since_start: float) -> int:
        """One reading of its memory: the trend, off by the group's jitter."""
        jitter = self.spec.mem_jitter_gib
        if not jitter:  # no draw: scenarios without jitter keep their random sequence
            return self.memory(since_start)
        return max(0, self.memory(since_start) + int(self.rng.uniform(-jitter, jitter) * GIB))


def _draw(rng: random.Random, bounds: tuple[float, float]) -> float:
    return rng.uniform(*bounds) if bounds[0] != bounds[1] else bounds[0]


class SimulatedCluster:
    """The fleet of one scenario, stepped tick by tick."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.start = scenario.start_ts
        self.end = scenario.start_ts + scenario.duration_s
        self.now = self.start
        self.nodes: dict[str, SimNode] = {}
        for group in scenario.nodes:
            for i in range(1, group.count + 1):
                name = f"{group.prefix}-{i}"
                gpus = [
                    SimGpu("GPU-" + _uuid(scenario.seed, name, g), g, group.gpu_model,
                           int(group.mem_gib * GIB),
                           mig=[SimMig("MIG-" + _uuid(scenario.seed, name, g, i), profile, i + 1)
                                for i, profile in enumerate(group.mig_layout)],
                           replicas=group.replicas)
                    for g in range(group.gpus)
                ]
                self.nodes[name] = SimNode(
                    name, gpus, group.spot, group=group.prefix,
                    sharing=group.sharing if group.replicas > 1 else None,
                    dra=group.allocation == "dra")
        self.gangs: dict[str, int] = {}
        """namespace/JobSet name -> members, for the gangs' events and the truth."""
        self.silent_from = {
            fault.node: (self.start + fault.at_s,
                         self.start + fault.at_s + fault.for_s if fault.for_s else math.inf)
            for fault in scenario.faults if fault.kind == "collector_down"}
        """Node -> when its collector stops sending and when it sends again
        (``collector_down``)."""
        self.workloads = self._make_workloads()
        self.queue: list[Workload] = []
        self.running: list[Workload] = []
        self.finished: list[Workload] = []
        self.truth = GroundTruth(
            scenario=scenario.name, seed=scenario.seed, start_ts=self.start, end_ts=self.end,
            sample_interval_s=scenario.sample_interval_s, gangs=dict(self.gangs),
        )
        self._cordon_requests: list[tuple[str, str]] = []
        self._reclaim_requests: list[tuple[str, str, str]] = []
        self._by_uid = scenario.attribution == "uid"
        self.on_tick: Callable[[SimulatedCluster], None] | None = None

    def _make_workloads(self) -> list[Workload]:
        scenario = self.scenario
        users = scenario.users
        made: list[Workload] = []
        next_user = 0
        for spec in scenario.workloads:
            for number in range(spec.count):
                user = users[next_user % len(users)]
                next_user += 1
                # A group of more workloads than users goes round the users again: its
                # second round is "<group>-<user>-2", so no two pods share a name and uid.
                again = number // len(users)
                name = f"{spec.group}-{user}" + (f"-{again + 1}" if again else "")
                rng = random.Random(f"{scenario.seed}:{name}")
                timeline: list[tuple[float, float | None, Phase]] = []
                offset = 0.0
                for phase in spec.phases:
                    length = _draw(rng, phase.for_s) if phase.for_s else None
                    timeline.append((offset, length, phase))
                    offset += length or 0.0
                namespace = spec.namespace or (f"ml-{spec.group}" if spec.gang else f"ml-{user}")
                made.append(Workload(
                    name=name, namespace=namespace, uid=_uuid(scenario.seed, "pod", name),
                    spec=spec, arrive=self.start + _draw(rng, spec.arrive_s),
                    duration=_draw(rng, spec.duration_s) if spec.duration_s else None,
                    mem_bytes=int(_draw(rng, spec.mem_gib) * GIB), timeline=timeline, rng=rng,
                ))
                if spec.gang:
                    key = f"{namespace}/{spec.group}"
                    self.gangs[key] = self.gangs.get(key, 0) + 1
        made.sort(key=lambda w: (w.arrive, w.name))
        return made

    # -- control surface used by the remediation backend -------------------------------------

    def request_cordon(self, node: str, reason: str) -> bool:
        """Cordon ``node`` at the next tick; False if there is no such node."""
        if node not in self.nodes:
            return False
        self._cordon_requests.append((node, reason))
        return True

    def request_reclaim(self, namespace: str, name: str, reason: str) -> None:
        """End the running pod ``namespace/name`` at the next tick: its owner gave it up."""
        self._reclaim_requests.append((namespace, name, reason))

    def pod_uid(self, namespace: str, name: str) -> str:
        """The uid of a placed pod (the world writes it into its processes' cgroups)."""
        for workload in (*self.running, *self.finished):
            if (workload.namespace, workload.name) == (namespace, name):
                return workload.uid
        raise KeyError(f"{namespace}/{name} is not a placed pod")

    def notify(self, pod: PodRef, message: str) -> None:
        self.truth.notified.append(f"{pod.namespace}/{pod.name}")

    # -- one tick ----------------------------------------------------------------------------

    async def step(self, publisher: Publisher) -> None:
        now = self.now
        for name, reason in self._cordon_requests:
            node = self.nodes[name]
            if not node.cordoned:
                node.cordoned = True
                self.truth.cordons.append(CordonRecord(name, now, reason))
                await publisher.allocation(self._inventory(node))
        self._cordon_requests.clear()
        await self._reclaim(publisher, now)
        await self._finish(publisher, now)
        await self._arrive(publisher, now)
        await self._inject_faults(publisher, now)
        await self._reclaim_spot_nodes(publisher, now)
        await self._schedule(publisher, now)
        for node in self.nodes.values():
            if not node.gone and not self._silent(node.name, now):
                await publisher.sample(self._sample(node, now))
        if self.on_tick:
            self.on_tick(self)

    async def _reclaim(self, publisher: Publisher, now: float) -> None:
        requests, self._reclaim_requests = self._reclaim_requests, []
        for namespace, name, reason in requests:
            workload = next((w for w in self.running
                             if (w.namespace, w.name) == (namespace, name)), None)
            if workload is None or workload.node is None:
                continue  # already gone: a repeated request
            until = self.end if workload.duration is None or workload.started_at is None else \
                min(self.end, workload.started_at + workload.duration)
            self.truth.reclaims.append(ReclaimRecord(
                namespace=namespace, pod=name, node=workload.node.name, ts=now,
                gpus=len(workload.devices), would_hold_until=until, reason=reason))
            await self._end(publisher, workload, "deleted", now)

    async def _finish(self, publisher: Publisher, now: float) -> None:
        for workload in list(self.running):
            if workload.duration is None or workload.started_at is None:
                continue
            if workload.started_at + workload.duration > now:
                continue
            await self._end(publisher, workload, "finished", now)

    async def _end(self, publisher: Publisher, workload: Workload, phase: str,
                   now: float) -> None:
        """A running pod ends (finished, or deleted with its node): its GPUs are free."""
        workload.ended_at = now
        for gpu in workload.devices:
            gpu.release(workload)
        self.running.remove(workload)
        self.finished.append(workload)
        await publisher.allocation(self._pod_event(workload, phase, now))
        # As the watcher does: a pod that waited in the queue (all of the simulator's) is
        # followed on the queue topic to its end.
        await publisher.queue(self._queue_event(
                workload, "finished" if phase == "finished" else "deleted", now))

    async def _arrive(self, publisher: Publisher, now: float) -> None:
        while self.workloads and self.workloads[0].arrive <= now:
            workload = self.workloads.pop(0)
            self.queue.append(workload)
            await publisher.queue(self._queue_event(workload, "pending", now))

    async def _inject_faults(self, publisher: Publisher, now: float) -> None:
        interval = self.scenario.sample_interval_s
        for node in self.nodes.values():
            for sim_gpu in node.gpus:
                sim_gpu.hot = sim_gpu.at_target = False  # thermal faults active at this
                # tick set them again
        for fault in self.scenario.faults:
            fault_ts = self.start + fault.at_s
            starts_now = now - interval < fault_ts <= now
            if fault.kind == "spot_termination":
                if starts_now:
                    await self._spot_notice(publisher, fault.node, fault.taint, now)
                continue
            if fault.kind == "collector_down":
                continue  # step() sends nothing of the node from then on
            gpu = self.nodes[fault.node].gpus[fault.gpu]
            if fault.kind == "ecc_dbe":
                if not starts_now:
                    continue
                gpu.dbe += 1
                self.truth.faults.append(FaultRecord(fault.kind, fault.node, gpu.uuid, now))
                if not fault.urgent_event:
                    continue
                await self._hw_event(publisher, HwEvent(
                    ts=now, node=fault.node, kind="ecc_dbe", uuid=gpu.uuid, count=gpu.dbe,
                    detail="volatile double-bit ECC error", source="simulator",
                ))
            elif fault.kind == "xid":
                await self._xid(publisher, fault, gpu, now, interval)
            elif fault.kind in ("gpu_lost", "remap_failure"):
                if not starts_now:
                    continue
                if fault.kind == "gpu_lost":
                    gpu.lost = True
                else:
                    gpu.remap_failure = True
                self.truth.faults.append(FaultRecord(fault.kind, fault.node, gpu.uuid, now))
                if fault.urgent_event:
                    await self._hw_event(publisher, HwEvent(
                        ts=now, node=fault.node, kind=fault.kind,
                        uuid=gpu.uuid, detail=f"simulated {fault.kind}", source="simulator"))
            else:
                self._ongoing(fault, gpu, fault_ts, now)

    def collector_absent(self, node: str) -> bool:
        """No collector runs on ``node`` for the whole world (``collector_down`` from the start
        to the end: a DaemonSet that leaves the node out)."""
        silent = self.silent_from.get(node)
        return silent is not None and silent[0] <= self.start and silent[1] == math.inf

    def _silent(self, node: str, now: float) -> bool:
        silent = self.silent_from.get(node)
        return silent is not None and silent[0] <= now < silent[1]

    async def _hw_event(self, publisher: Publisher, event: HwEvent) -> None:
        """Send an urgent hardware event, as the node's collector does unless it is down."""
        if not self._silent(event.node, event.ts):
            await publisher.hw_event(event)

    async def _xid(self, publisher: Publisher, fault: Fault, gpu: SimGpu, now: float,
                   interval: float) -> None:
        assert fault.xid is not None
        for n in range(fault.count):
            event_ts = self.start + fault.at_s + n * fault.every_s
            if now - interval < event_ts <= now:
                # What the GPU does beside its XID, as a real one: Xid 79 is the GPU fallen
                # off the bus (no readings until it is reset), Xid 48 a double-bit ECC error
                # (the volatile DBE counter moves).
                if fault.xid == 79:
                    gpu.lost = True
                elif fault.xid == 48:
                    gpu.dbe += 1
                holder = gpu.holder
                self.truth.faults.append(FaultRecord(
                    "xid", fault.node, gpu.uuid, event_ts, xid=fault.xid,
                    workload=None if holder is None else "/".join(
                        (holder.namespace, self._owner_kind(holder), self._owner_name(holder)))))
                await self._hw_event(publisher, HwEvent(
                    ts=event_ts, node=fault.node, kind="xid", uuid=gpu.uuid, xid=fault.xid,
                    detail=f"Xid {fault.xid} (simulated)", source="simulator"))

    def _ongoing(self, fault: Fault, gpu: SimGpu, fault_ts: float, now: float) -> None:
        """A burst or thermal fault: applies to every sample in [at_s, at_s + for_s)."""
        active = fault_ts <= now < fault_ts + fault.for_s
        if fault.kind == "thermal":
            gpu.hot = gpu.hot or active
        elif fault.kind == "thermal_target":
            gpu.at_target = gpu.at_target or active
        elif active:
            if fault.kind == "sbe_burst":
                gpu.sbe += fault.count
            elif fault.kind == "pcie_replay":
                gpu.pcie_replay += fault.count
            elif fault.kind == "nvlink_crc_errors":
                gpu.nvlink_crc_errors += fault.count
            else:
                gpu.nvlink_errors += fault.count
        if active and not any(r.kind == fault.kind and r.device == gpu.uuid
                              and r.ts == fault_ts for r in self.truth.faults):
            self.truth.faults.append(FaultRecord(fault.kind, fault.node, gpu.uuid, fault_ts,
                                                 end=fault_ts + fault.for_s, count=fault.count))

    async def _spot_notice(self, publisher: Publisher, name: str, taint: str, now: float) -> None:
        node = self.nodes[name]
        node.taints.append(Taint(taint, "NoSchedule", "simulated-interruption"))
        pods = {f"{w.namespace}/{w.name}": self._owner_kind(w)
                for w in self.running if w.node is node}
        self.truth.interruptions.append(InterruptionRecord(name, now, taint, pods))
        await publisher.allocation(self._inventory(node))

    async def _reclaim_spot_nodes(self, publisher: Publisher, now: float) -> None:
        """The cloud takes a tainted spot node back: its pods die, the node leaves."""
        for record in self.truth.interruptions:
            fault = next(f for f in self.scenario.faults
                         if f.kind == "spot_termination" and f.node == record.node)
            node = self.nodes[record.node]
            if node.gone or now < record.ts + fault.reclaim_after_s:
                continue
            node.gone, record.reclaimed_at = True, now
            for workload in [w for w in self.running if w.node is node]:
                await self._end(publisher, workload, "deleted", now)
            await publisher.allocation(self._inventory(node))

    @staticmethod
    def _owner_kind(workload: Workload) -> str:
        if workload.spec.gang:
            return "JobSet" if workload.spec.elastic_min is None else "PyTorchJob"
        if workload.spec.kind == "notebook":
            return "Notebook"
        return workload.spec.owner if workload.spec.kind == "batch" else "Job"

    @staticmethod
    def _owner_name(workload: Workload) -> str:
        return workload.spec.group if workload.spec.gang else workload.name

    def _gang(self, workload: Workload) -> tuple[str | None, int | None]:
        """The gang fields of a workload's events, as the watcher reports a JobSet's pods
        (all its members needed) or an elastic PyTorchJob's (its minReplicas)."""
        if not workload.spec.gang:
            return None, None
        members = self.gangs[f"{workload.namespace}/{workload.spec.group}"]
        return (f"{self._owner_kind(workload)}/{workload.spec.group}",
                min(members, workload.spec.elastic_min or members))

    async def _schedule(self, publisher: Publisher, now: float) -> None:
        for workload in list(self.queue):
            for node in self.nodes.values():
                wanted = workload.spec.node_group
                if wanted is not None and node.group != wanted:
                    continue
                devices = self._fit(node, workload.spec)
                if node.cordoned or node.taints or node.gone or devices is None:
                    continue
                workload.node, workload.devices = node, devices
                workload.started_at = now
                for gpu in workload.devices:
                    gpu.take(workload)
                self.queue.remove(workload)
                self.running.append(workload)
                await publisher.queue(self._queue_event(workload, "admitted", now))
                await publisher.allocation(self._pod_event(workload, "running", now))
                break

    @staticmethod
    def _fit(node: SimNode, spec: WorkloadGroup) -> list[SimGpu | SimMig] | None:
        """The devices of ``node`` the workload would get, or None if it does not fit."""
        if spec.mig:
            taken: list[SimGpu | SimMig] = []
            for profile, count in sorted(spec.mig.items()):
                free_mig = node.free_mig(profile)
                if len(free_mig) < count:
                    return None
                taken += free_mig[:count]
            return taken
        free = node.free()
        return list(free[: spec.gpus]) if len(free) >= spec.gpus else None

    # -- payloads ----------------------------------------------------------------------------

    def _inventory(self, node: SimNode) -> NodeInventory:
        # As the device plugin's mixed strategy advertises them: partitioned GPUs only as
        # their MIG devices, by profile.
        whole = sum(1 for g in node.gpus if not g.mig)
        replicas = node.gpus[0].replicas
        # Shared GPUs are advertised once per replica; gpu_count stays the physical GPUs.
        allocatable = {"nvidia.com/gpu": whole * replicas}
        for mig in (m for g in node.gpus for m in g.mig):
            # The device plugin writes a profile's "+" as "." (nvidia.com/mig-1g.10gb.me).
            resource = f"nvidia.com/mig-{mig.profile.replace('+', '.')}"
            allocatable[resource] = allocatable.get(resource, 0) + 1
        return NodeInventory(
            ts=self.now, node=node.name, gpu_product=node.gpus[0].model,
            gpu_count=whole, allocatable=allocatable, gpu_replicas=replicas,
            gpu_sharing=node.sharing,
            mig_strategy="mixed" if whole < len(node.gpus) else None,
            unschedulable=node.cordoned, spot=node.spot, deleted=node.gone,
            taints=([Taint("node.kubernetes.io/unschedulable", "NoSchedule")] if node.cordoned
                    else []) + node.taints,
        )

    def _pod_event(self, workload: Workload, phase: str, now: float) -> PodAllocation:
        assert workload.node is not None
        gang, size = self._gang(workload)
        return PodAllocation(
            ts=now, node=workload.node.name, pod=workload.ref, phase=phase,  # type: ignore[arg-type]
            gpus=0 if workload.spec.mig else workload.spec.gpus, mig=dict(workload.spec.mig),
            device_ids=[g.uuid for g in workload.devices] if self._by_uid else [],
            started_at=workload.started_at, workload_kind=workload.spec.kind,
            owner_kind=self._owner_kind(workload),
            owner_name=self._owner_name(workload),
            queue=self.scenario.cluster_queue, labels=dict(workload.spec.labels),
            gang=gang, gang_size=size,
            images=[workload.spec.image] if workload.spec.image else [],
            memory_grows=memory_grows({"containers": [{"env": [
                {"name": name, "value": value} for name, value in workload.spec.env.items()]}]}),
        )

    def _queue_event(self, workload: Workload, state: str, now: float) -> QueueEvent:
        gang, size = self._gang(workload)
        return QueueEvent(
            ts=now, name=workload.name, namespace=workload.namespace,
            cluster_queue=self.scenario.cluster_queue, state=state,  # type: ignore[arg-type]
            created_at=workload.arrive, admitted_at=workload.started_at,
            gpus=0 if workload.spec.mig else workload.spec.gpus, mig=dict(workload.spec.mig),
            kind="pod" if gang else None, gang=gang, gang_size=size,
        )

    def _sample(self, node: SimNode, now: float) -> NodeSample:
        devices = []
        for gpu in node.gpus:
            if gpu.lost:
                continue  # as the NVML collector does: a lost GPU leaves the sample
            if gpu.mig:
                devices += [self._mig_sample(gpu, mig, now) for mig in gpu.mig]
                continue
            holder = gpu.holder
            holders: list[DeviceHolder] = []
            if gpu.replicas > 1:
                holders = self._shares(node, gpu, now)
                util = min(100.0, round(sum(h.activity_pct or 0.0 for h in holders), 1))
                mem = sum(h.mem_used_bytes or 0 for h in holders)
                holder = gpu.sharers[0] if gpu.sharers else None
            elif holder is not None and holder.started_at is not None:
                util = holder.utilisation(now - holder.started_at)
                mem = holder.memory_reading(now - holder.started_at)
                used = holder.spec.gpus_used
                if used is not None and gpu not in holder.devices[:used]:
                    util, mem = 0.0, CONTEXT_BYTES  # asked for, never used by its code
            else:
                util, mem = 0.0, 0
            gpu.last_util = util
            temp, reasons = round(32 + util * 0.4, 1), 0 if util else 1
            if gpu.hot:
                temp, reasons = HOT_TEMP_C, reasons | THERMAL_REASONS
            elif gpu.at_target and util:
                temp, reasons = TARGET_TEMP_C, reasons | SW_THERMAL
            devices.append(DeviceSample(
                uuid=gpu.uuid, index=gpu.index, model=gpu.model, util_pct=util,
                mem_used_bytes=mem, mem_total_bytes=gpu.mem_total,
                temp_c=temp, power_w=round(60 + util * 3.3, 1),
                sm_clock_mhz=1410 if util > 0 else 210, clock_event_reasons=reasons,
                ecc_sbe_volatile=gpu.sbe, ecc_dbe_volatile=gpu.dbe, pcie_replay=gpu.pcie_replay,
                nvlink_errors=gpu.nvlink_errors, nvlink_crc_errors=gpu.nvlink_crc_errors,
                remap_failure=gpu.remap_failure,
                remap_pending=False, remapped_rows_correctable=0, remapped_rows_uncorrectable=0,
                pod=self._attributed(holder), holders=holders,
                attribution="process" if holders else None,
            ))
        return NodeSample(ts=now, node=node.name, source="simulator", devices=devices)

    def _shares(self, node: SimNode, gpu: SimGpu, now: float) -> list[DeviceHolder]:
        """Each pod's own activity and memory on a shared GPU, as per-process attribution
        reads them (one process per pod)."""
        return [DeviceHolder(pod=self._attributed(pod), processes=1,
                             activity_pct=pod.utilisation(now - pod.started_at),
                             mem_used_bytes=pod.memory_reading(now - pod.started_at),
                             mps=node.sharing == "mps")
                for pod in gpu.sharers if pod.started_at is not None]

    def _attributed(self, holder: Workload | None) -> PodRef | None:
        if holder is None:
            return None
        return holder.ref if self._by_uid else holder.kubelet_ref

    def _mig_sample(self, gpu: SimGpu, mig: SimMig, now: float) -> DeviceSample:
        """A MIG device reads engine activity, not GPU utilisation (not reported on MIG)."""
        holder = mig.holder
        if holder is not None and holder.started_at is not None:
            activity = holder.utilisation(now - holder.started_at)
            mem = holder.memory_reading(now - holder.started_at)
        else:
            activity, mem = 0.0, 0
        return DeviceSample(
            uuid=mig.uuid, index=gpu.index, model=gpu.model, kind="mig", parent_uuid=gpu.uuid,
            mig_profile=mig.profile, gpu_instance_id=mig.gpu_instance_id,
            engine_active_pct=activity, mem_used_bytes=mem, pod=self._attributed(holder),
        )

    # -- the whole run -----------------------------------------------------------------------

    async def run(self, publisher: Publisher, stop: asyncio.Event | None = None) -> GroundTruth:
        """Step through the scenario, pacing by its acceleration; return the ground truth."""
        for node in self.nodes.values():
            await publisher.allocation(self._inventory(node))
        interval = self.scenario.sample_interval_s
        acceleration = self.scenario.acceleration
        wall_start = time.monotonic()
        ticks = int(self.scenario.duration_s // interval)
        for tick in range(ticks + 1):
            if stop is not None and stop.is_set():
                break
            self.now = self.start + tick * interval
            await self.step(publisher)
            if acceleration > 0:
                due = wall_start + (tick + 1) * interval / acceleration
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            elif tick % 50 == 0:
                await asyncio.sleep(0)
        await publisher.flush()
        return self.finish_truth()

    def finish_truth(self) -> GroundTruth:
        """Close the books: every placed pod, its idle stretches, what is still pending."""
        truth = self.truth
        truth.end_ts = self.now
        placed = self.running + self.finished
        truth.pods, truth.idle_periods = [], []
        for workload in sorted(placed, key=lambda w: w.name):
            assert workload.node is not None and workload.started_at is not None
            end = workload.ended_at if workload.ended_at is not None else self.now
            periods = list(self._idle_periods(workload, end))
            truth.idle_periods.extend(periods)
            truth.pods.append(PodRecord(
                namespace=workload.namespace, pod=workload.name, kind=workload.spec.kind,
                node=workload.node.name, devices=[g.uuid for g in workload.devices],
                started_at=workload.started_at, ended_at=workload.ended_at,
                idle=any(p.util[1] < IDLE_TRUTH_PCT for p in workload.spec.phases),
                queued_at=workload.arrive,
                gang=(f"{workload.namespace}/{workload.spec.group}" if workload.spec.gang
                      else None),
                team=workload.spec.labels.get("team"),
                gpus=(mig_gpus(workload.spec.mig) if workload.spec.mig
                      else workload.spec.gpus / workload.node.gpus[0].replicas),
            ))
        truth.leaks = [self._leak(w) for w in sorted(placed, key=lambda w: w.name)
                       if w.spec.mem_growth_gib_per_h > 0 and len(w.devices) == 1
                       and isinstance(w.devices[0], SimGpu)]
        truth.pending = sorted(f"{w.namespace}/{w.name}" for w in self.queue)
        truth.pending_since = {f"{w.namespace}/{w.name}": w.arrive for w in self.queue}
        largest = max(sum(not g.mig for g in node.gpus) for node in self.nodes.values())
        layouts = [Counter(m.profile for g in node.gpus for m in g.mig)
                   for node in self.nodes.values()]
        truth.unplaceable = sorted(
            f"{w.namespace}/{w.name}" for w in self.queue
            if (not any(all(layout[p] >= n for p, n in w.spec.mig.items())
                        for layout in layouts) if w.spec.mig else w.spec.gpus > largest))
        return truth

    def _leak(self, workload: Workload) -> LeakRecord:
        """When the leaking pod's device fills up: its neighbours' memory as at the end."""
        assert workload.node is not None and workload.started_at is not None
        (device,) = workload.devices
        assert isinstance(device, SimGpu)
        others = sum(w.memory(self.now - w.started_at) for w in device.sharers
                     if w is not workload and w.started_at is not None)
        total = device.mem_total
        rate = workload.growth_bytes_per_s
        return LeakRecord(
            namespace=workload.namespace, pod=workload.name, node=workload.node.name,
            device=device.uuid, growth_bytes_per_s=rate,
            exhausted_at=workload.started_at + (total - others - workload.mem_bytes) / rate)

    def _idle_periods(self, workload: Workload, end: float) -> list[IdlePeriod]:
        assert workload.node is not None and workload.started_at is not None
        start = workload.started_at
        out: list[IdlePeriod] = []
        cycle = workload.timeline[-1][0] + (workload.timeline[-1][1] or 0.0)
        base = 0.0
        while start + base < end:
            for offset, length, phase in workload.timeline:
                if phase.util[1] >= IDLE_TRUTH_PCT:
                    continue
                a = start + base + offset
                b = end if length is None else min(end, a + length)
                if a < b:
                    for gpu in workload.devices:
                        out.append(IdlePeriod(
                            namespace=workload.namespace, pod=workload.name,
                            kind=workload.spec.kind, node=workload.node.name, device=gpu.uuid,
                            pod_started_at=start, start=a, end=b,
                        ))
            if not workload.spec.repeat or cycle <= 0:
                break
            base += cycle
        return out
