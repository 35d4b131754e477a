"""The node join without a broker: allocations, samples and events of one node."""

from __future__ import annotations

import msgspec

from gpusteward.schema import (
    DeviceSample,
    Finding,
    HwEvent,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
)
from gpusteward.streams.node import NodeJoin, NodeState

POD = PodRef(namespace="ml-a", name="nb-a", uid="uid-a")
T0 = 1_000_000.0


def node_sample(ts: float, util: float, pod: PodRef | None = POD, dbe: int = 0) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=util, pod=pod,
                     ecc_dbe_volatile=dbe),
        DeviceSample(uuid="GPU-2", index=1, model="A100", util_pct=90.0),
    ])


def allocation(phase: str, ts: float) -> PodAllocation:
    return PodAllocation(ts=ts, node="n1", pod=POD, phase=phase, gpus=1,  # type: ignore[arg-type]
                         device_ids=["GPU-1"], started_at=T0, workload_kind="notebook")


def findings(outputs: list) -> list[Finding]:
    return [o for o in outputs if isinstance(o, Finding)]


def test_idle_holder_from_allocation_and_resolution_on_release() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    out = []
    for i in range(0, 100):
        out += join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    (firing,) = findings(out)
    assert firing.labels["workload_kind"] == "notebook"
    (resolved,) = findings(join.on_allocation(state, allocation("finished", T0 + 3100)))
    assert resolved.state == "resolved" and resolved.id == firing.id


def test_samples_before_the_allocation_still_count() -> None:
    """Cross-topic order is not guaranteed: a late allocation must not delay detection."""
    join, state = NodeJoin(), NodeState()
    out = []
    for i in range(0, 81):
        if i == 50:
            join.on_allocation(state, allocation("running", T0 + i * 30))
        out += join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    (firing,) = findings(out)
    assert firing.starts_at == T0 + 600  # started_at from the allocation plus the grace
    assert firing.ts == T0 + 600 + 1800  # as soon as the window is full, at tick 80


def test_urgent_dbe_event_fires_once_with_the_sample() -> None:
    join, state = NodeJoin(), NodeState()
    event = HwEvent(ts=T0, node="n1", kind="ecc_dbe", uuid="GPU-1", count=1)
    first = join.on_hw_event(state, event)
    later = join.on_sample(state, node_sample(T0, 50.0, dbe=1))
    assert [f.kind for f in findings(first)] == ["ecc_dbe"] and findings(later) == []


def test_summary_reports_free_gpus_health_and_cordon() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, NodeInventory(ts=T0, node="n1", gpu_product="A100", gpu_count=2))
    join.on_allocation(state, allocation("running", T0 + 1))
    out = join.on_sample(state, node_sample(T0 + 2, 50.0, dbe=1))
    out += join.on_allocation(state, NodeInventory(ts=T0 + 3, node="n1", gpu_product="A100",
                                                   gpu_count=2, unschedulable=True))
    last = [o for o in out if isinstance(o, NodeSummary)][-1]
    assert (last.gpus_total, last.gpus_free, last.healthy, last.cordoned) == (2, 1, False, True)


def test_state_survives_the_changelog_encoding() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    for i in range(0, 30):
        join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=NodeState)
    assert restored == state
    out = []
    for i in range(30, 100):
        out += join.on_sample(restored, node_sample(T0 + i * 30, 0.0))
    assert len(findings(out)) == 1
