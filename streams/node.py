"""The per-node join: samples, hardware events and allocations of one node, and its rules.

:class:`NodeState` is everything the worker knows about one node: the pods
holding its devices (from allocation events) and each device's rule state.
It lives in a Faust table keyed by node, backed by a changelog topic, so a
restarted worker resumes where the last one stopped. :class:`NodeJoin`
folds one decoded record into a node's state and returns what to publish;
it does no I/O, so it is tested without a broker.

Rule settings come from the policy (:mod:`gpusteward.rules.policy`),
resolved per node pool for the hardware rules and per (namespace, queue,
node pool) for the idle rule; the policy caches each resolution, so a
sample pays dict lookups, not validation. Per-device rule state is made of
msgspec Structs inside :class:`DeviceState`, so it rides the changelog with
the rest of the node's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gpusteward.rules import ecc, hardware, idle
from gpusteward.rules import policy as policies
from gpusteward.rules import xid as xid_rule
from gpusteward.schema import (
    Action,
    AllocationEvent,
    DeviceSample,
    Finding,
    HwEvent,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
)


class Holding(msgspec.Struct):
    """A pod's hold on devices of the node, from its allocation events."""

    pod: PodRef
    started_at: float
    devices: list[str]
    gpus: int = 0
    mig: dict[str, int] = {}
    workload_kind: str | None = None
    queue: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class DeviceState(msgspec.Struct):
    idle: idle.IdleTrack = msgspec.field(default_factory=idle.IdleTrack)
    ecc: ecc.EccTrack = msgspec.field(default_factory=ecc.EccTrack)
    hw: hardware.HwTrack = msgspec.field(default_factory=hardware.HwTrack)
    attributed: PodRef | None = None
    """The pod the collector last attributed the device to."""
    attributed_since: float | None = None


class NodeState(msgspec.Struct):
    """What the worker knows about one node."""

    devices: dict[str, DeviceState] = {}
    pods: dict[str, Holding] = {}
    gpu_model: str | None = None
    gpu_count: int = 0
    cordoned: bool = False
    spot: bool = False
    mig_allocatable: dict[str, int] = {}
    """MIG devices the node offers, by profile (from ``nvidia.com/mig-*`` allocatable)."""
    pool: str | None = None
    """The node's pool: the value of the policy's node-pool label on the node."""
    last_summary_ts: float | None = None
    summary_dirty: bool = True


Output = Finding | Action | NodeSummary


@dataclass
class RuleSettings:
    """The settings of the node join itself; the rules' own come from the policy."""

    policy: policies.Policy | None = None
    """The rule policy; None loads the file named by GPUSTEWARD_POLICY_FILE, or the shipped
    defaults when that is unset."""
    summary_interval_s: float = 60.0
    """Event-time seconds between two summaries of an unchanged node."""
    checkpoint_interval_s: float = 30.0
    """Event-time seconds between two changelog writes of a node whose samples changed
    nothing that matters; anything a rule emits is written at once. Lower means less
    re-learning after a crash, higher means less changelog traffic (one record per node
    per interval instead of one per sample)."""


def _pod_key(pod: PodRef) -> str:
    return pod.uid or f"{pod.namespace}/{pod.name}"


class NodeJoin:
    """Folds records into :class:`NodeState` and runs the per-node rules."""

    def __init__(self, settings: RuleSettings | None = None,
                 policy: policies.Policy | None = None) -> None:
        self.settings = settings or RuleSettings()
        self.policy = policy or self.settings.policy or policies.policy_from_env()

    def on_sample(self, state: NodeState, sample: NodeSample) -> list[Output]:
        out: list[Output] = []
        holders = self._holders_by_device(state)
        resolve = self.policy.resolve
        pool = state.pool
        node_rules = resolve(None, None, pool)
        hw_settings, ecc_settings = node_rules.hardware, node_rules.ecc
        node, ts = sample.node, sample.ts
        for device in sample.devices:
            dev = state.devices.get(device.uuid)
            if dev is None:
                dev = state.devices[device.uuid] = DeviceState()
            holding = self._holding(state, dev, device, holders, ts)
            if holding is not None:
                idle_settings = resolve(holding.pod.namespace, holding.queue, pool).idle
                holder: idle.Holder | None = idle.Holder(
                    holding.pod, holding.started_at, holding.workload_kind, holding.labels,
                    holding.annotations)
            elif device.pod is not None and dev.attributed_since is not None:
                # Attributed by the collector but no allocation seen yet: count from first sight.
                idle_settings = resolve(device.pod.namespace, None, pool).idle
                holder = idle.Holder(device.pod, dev.attributed_since)
            else:
                idle_settings, holder = node_rules.idle, None
            out += idle.observe(dev.idle, node=node, sample=device, holder=holder,
                                ts=ts, settings=idle_settings)
            out += ecc.observe(dev.ecc, node=node, uuid=device.uuid,
                               dbe_count=device.ecc_dbe_volatile, ts=ts,
                               settings=ecc_settings)
            if device.kind == "gpu":
                # Hardware health belongs to the physical GPU: a MIG device repeating its
                # parent's temperature or counters would open a second episode.
                out += hardware.observe_sample(dev.hw, node=node, device=device, ts=ts,
                                               settings=hw_settings)
        if state.gpu_model is None and sample.devices:
            state.gpu_model = sample.devices[0].model
            state.gpu_count = state.gpu_count or sum(d.kind == "gpu" for d in sample.devices)
        return out + self._maybe_summary(state, sample.node, sample.ts)

    def on_hw_event(self, state: NodeState, event: HwEvent) -> list[Output]:
        # throttle_start/stop and ecc_sbe are left to the samples: the thermal and SBE rules
        # need the whole window of readings, which the samples carry.
        kind = event.kind
        if kind not in ("ecc_dbe", "xid", "gpu_lost", "remap_failure"):
            return []
        # A GPU lost before the collector could read its UUID is still a node problem.
        uuid = event.uuid or "GPU-unknown"
        if kind != "gpu_lost" and event.uuid is None:
            return []
        dev = state.devices.get(uuid)
        if dev is None:
            dev = state.devices[uuid] = DeviceState()
        rules = self.policy.resolve(None, None, state.pool)
        out: list[Output] = []
        if kind == "ecc_dbe":
            out += ecc.observe(dev.ecc, node=event.node, uuid=uuid,
                               dbe_count=event.count if event.count is not None else 1,
                               ts=event.ts, settings=rules.ecc, from_sample=False)
        elif kind == "xid":
            if event.xid is None:
                return []
            out += xid_rule.observe_event(dev.hw.xid, node=event.node, uuid=uuid, xid=event.xid,
                                          ts=event.ts, settings=rules.hardware.xid)
        elif kind == "gpu_lost":
            out += hardware.observe_lost(dev.hw, node=event.node, uuid=uuid, ts=event.ts,
                                         detail=event.detail, settings=rules.hardware)
        else:
            out += hardware.observe_remap_failure_event(dev.hw, node=event.node, uuid=uuid,
                                                        ts=event.ts, settings=rules.hardware)
        if out:
            state.summary_dirty = True
            out += self._maybe_summary(state, event.node, event.ts)
        return out

    def on_allocation(self, state: NodeState, event: AllocationEvent) -> list[Output]:
        if isinstance(event, NodeInventory):
            return self._on_inventory(state, event)
        return self._on_pod(state, event)

    def _on_inventory(self, state: NodeState, event: NodeInventory) -> list[Output]:
        state.gpu_model = event.gpu_product or state.gpu_model
        state.gpu_count = event.gpu_count or state.gpu_count
        state.cordoned = event.unschedulable
        state.spot = event.spot
        state.pool = event.labels.get(self.policy.node_pool_label)
        prefix = "nvidia.com/mig-"
        state.mig_allocatable = {key.removeprefix(prefix): count
                                 for key, count in event.allocatable.items()
                                 if key.startswith(prefix)}
        state.summary_dirty = True
        return self._maybe_summary(state, event.node, event.ts)

    def _on_pod(self, state: NodeState, event: PodAllocation) -> list[Output]:
        key = _pod_key(event.pod)
        out: list[Output] = []
        if event.phase in ("finished", "deleted"):
            holding = state.pods.pop(key, None)
            if holding is not None:
                for uuid in holding.devices:
                    dev = state.devices.get(uuid)
                    if dev is not None:
                        out += idle.release(dev.idle, node=event.node, uuid=uuid, ts=event.ts)
                state.summary_dirty = True
        elif event.phase in ("bound", "running"):
            state.pods[key] = Holding(
                pod=event.pod, started_at=event.started_at or event.ts,
                devices=list(event.device_ids), gpus=event.gpus, mig=dict(event.mig),
                workload_kind=event.workload_kind, queue=event.queue,
                labels=dict(event.labels), annotations=dict(event.annotations),
            )
            state.summary_dirty = True
        return out + self._maybe_summary(state, event.node, event.ts)

    @staticmethod
    def _holders_by_device(state: NodeState) -> dict[str, Holding]:
        return {uuid: h for h in state.pods.values() for uuid in h.devices}

    @staticmethod
    def _holding(state: NodeState, dev: DeviceState, device: DeviceSample,
                 holders: dict[str, Holding], ts: float) -> Holding | None:
        """The allocation holding the device, by its device ids or the collector's attribution."""
        if device.pod != dev.attributed:
            dev.attributed, dev.attributed_since = device.pod, ts
        holding = holders.get(device.uuid)
        if holding is None and device.pod is not None:
            holding = state.pods.get(_pod_key(device.pod))
        return holding

    def _maybe_summary(self, state: NodeState, node: str, ts: float) -> list[Output]:
        due = (state.last_summary_ts is None
               or ts - state.last_summary_ts >= self.settings.summary_interval_s)
        if not (state.summary_dirty or due):
            return []
        state.last_summary_ts, state.summary_dirty = ts, False
        used = sum(h.gpus for h in state.pods.values())
        healthy = all(d.ecc.open_id is None and not d.hw.unhealthy()
                      for d in state.devices.values())
        mig_free = dict(state.mig_allocatable)
        for holding in state.pods.values():
            for profile, count in holding.mig.items():
                mig_free[profile] = mig_free.get(profile, 0) - count
        return [NodeSummary(
            ts=ts, node=node, gpu_model=state.gpu_model, gpus_total=state.gpu_count,
            gpus_free=max(0, state.gpu_count - used), healthy=healthy,
            cordoned=state.cordoned, spot=state.spot,
            mig_free={profile: n for profile, n in mig_free.items() if n > 0},
        )]
