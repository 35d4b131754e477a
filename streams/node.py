"""The per-node join: samples, hardware events and allocations of one node, and its rules.

:class:`NodeState` is everything the worker knows about one node: the pods
holding its devices (from allocation events) and each device's rule state.
It lives in a Faust table keyed by node, backed by a changelog topic, so a
restarted worker resumes where the last one stopped. :class:`NodeJoin`
folds one decoded record into a node's state and returns what to publish;
it does no I/O, so it is tested without a broker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from gpusteward.rules import ecc, idle
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


class DeviceState(msgspec.Struct):
    idle: idle.IdleTrack = msgspec.field(default_factory=idle.IdleTrack)
    ecc: ecc.EccTrack = msgspec.field(default_factory=ecc.EccTrack)
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
    last_summary_ts: float | None = None
    summary_dirty: bool = True


Output = Finding | Action | NodeSummary


@dataclass
class RuleSettings:
    """The settings of the rules the node join runs."""

    idle: idle.IdleSettings = field(default_factory=idle.IdleSettings)
    ecc: ecc.EccSettings = field(default_factory=ecc.EccSettings)
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

    def __init__(self, settings: RuleSettings | None = None) -> None:
        self.settings = settings or RuleSettings()

    def on_sample(self, state: NodeState, sample: NodeSample) -> list[Output]:
        out: list[Output] = []
        holders = self._holders_by_device(state)
        for device in sample.devices:
            dev = state.devices.get(device.uuid)
            if dev is None:
                dev = state.devices[device.uuid] = DeviceState()
            holder = self._holder(state, dev, device, holders, sample.ts)
            out += idle.observe(dev.idle, node=sample.node, sample=device, holder=holder,
                                ts=sample.ts, settings=self.settings.idle)
            out += ecc.observe(dev.ecc, node=sample.node, uuid=device.uuid,
                               dbe_count=device.ecc_dbe_volatile, ts=sample.ts,
                               settings=self.settings.ecc)
        if state.gpu_model is None and sample.devices:
            state.gpu_model = sample.devices[0].model
            state.gpu_count = state.gpu_count or sum(d.kind == "gpu" for d in sample.devices)
        return out + self._maybe_summary(state, sample.node, sample.ts)

    def on_hw_event(self, state: NodeState, event: HwEvent) -> list[Output]:
        if event.kind != "ecc_dbe" or event.uuid is None:
            return []
        dev = state.devices.get(event.uuid)
        if dev is None:
            dev = state.devices[event.uuid] = DeviceState()
        out: list[Output] = []
        out += ecc.observe(dev.ecc, node=event.node, uuid=event.uuid,
                           dbe_count=event.count if event.count is not None else 1,
                           ts=event.ts, settings=self.settings.ecc, from_sample=False)
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
                workload_kind=event.workload_kind,
            )
            state.summary_dirty = True
        return out + self._maybe_summary(state, event.node, event.ts)

    @staticmethod
    def _holders_by_device(state: NodeState) -> dict[str, Holding]:
        return {uuid: h for h in state.pods.values() for uuid in h.devices}

    @staticmethod
    def _holder(state: NodeState, dev: DeviceState, device: DeviceSample,
                holders: dict[str, Holding], ts: float) -> idle.Holder | None:
        """Who holds the device: the allocation's view first, the collector's attribution next."""
        if device.pod != dev.attributed:
            dev.attributed, dev.attributed_since = device.pod, ts
        holding = holders.get(device.uuid)
        if holding is None and device.pod is not None:
            holding = state.pods.get(_pod_key(device.pod))
        if holding is not None:
            return idle.Holder(holding.pod, holding.started_at, holding.workload_kind)
        if device.pod is not None and dev.attributed_since is not None:
            # Attributed by the collector but no allocation seen yet: count from first sight.
            return idle.Holder(device.pod, dev.attributed_since)
        return None

    def _maybe_summary(self, state: NodeState, node: str, ts: float) -> list[Output]:
        due = (state.last_summary_ts is None
               or ts - state.last_summary_ts >= self.settings.summary_interval_s)
        if not (state.summary_dirty or due):
            return []
        state.last_summary_ts, state.summary_dirty = ts, False
        used = sum(h.gpus for h in state.pods.values())
        healthy = all(d.ecc.open_id is None for d in state.devices.values())
        return [NodeSummary(
            ts=ts, node=node, gpu_model=state.gpu_model, gpus_total=state.gpu_count,
            gpus_free=max(0, state.gpu_count - used), healthy=healthy,
            cordoned=state.cordoned, spot=state.spot,
        )]
