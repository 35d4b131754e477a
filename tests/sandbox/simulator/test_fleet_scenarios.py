"""The simulator's spot reclaims and MIG layouts, which the fleet scenarios rely on."""

from __future__ import annotations

import asyncio

import msgspec

from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import AllocationEvent, NodeInventory, NodeSample, PodAllocation
from tests.sandbox.simulator.test_simulator import Recorder


def run(name: str) -> tuple[Recorder, GroundTruth]:
    spec = scenarios.load(name).model_copy(update={"acceleration": 0.0})
    recorder = Recorder()
    return recorder, asyncio.run(SimulatedCluster(spec).run(recorder))


def _allocations(recorder: Recorder) -> list[AllocationEvent]:
    decode = msgspec.json.Decoder(AllocationEvent).decode
    return [decode(raw) for topic, raw in recorder.records if topic == "alloc"]


def test_spot_node_tainted_then_reclaimed_with_its_pods() -> None:
    recorder, truth = run("spot-batch")
    events = _allocations(recorder)
    for record in truth.interruptions:
        assert record.reclaimed_at is not None
        assert record.reclaimed_at - record.ts >= 120
        inventories = [e for e in events if isinstance(e, NodeInventory) and e.node == record.node]
        tainted = [e for e in inventories if any(t.key == record.taint for t in e.taints)]
        assert tainted[0].ts == record.ts and tainted[0].spot
        assert inventories[-1].deleted and inventories[-1].ts == record.reclaimed_at
        # Its pods are deleted at the reclaim; nothing new is placed on it after the taint.
        deleted = {f"{e.pod.namespace}/{e.pod.name}" for e in events
                   if isinstance(e, PodAllocation) and e.node == record.node
                   and e.phase == "deleted"}
        assert deleted == set(record.pods)
        late = [p for p in truth.pods if p.node == record.node and p.started_at > record.ts]
        assert late == []
        samples = [msgspec.json.decode(raw, type=NodeSample) for topic, raw in recorder.records
                   if topic == "samples"]
        assert not [s for s in samples if s.node == record.node and s.ts > record.reclaimed_at]


def test_mig_layout_advertised_and_only_matching_profiles_placed() -> None:
    recorder, truth = run("mig-inference")
    events = _allocations(recorder)
    first = next(e for e in events if isinstance(e, NodeInventory) and e.node == "a100-1g-1")
    assert first.allocatable == {"nvidia.com/gpu": 0, "nvidia.com/mig-1g.10gb": 14}
    assert first.mig_strategy == "mixed" and first.gpu_count == 0
    pods = {e.pod.name: e for e in events if isinstance(e, PodAllocation)}
    assert pods["embed-svc-k"].node == "a100-3g-1" and pods["embed-svc-k"].gpus == 0
    assert pods["embed-svc-k"].mig == {"3g.40gb": 1}
    assert all(uuid.startswith("MIG-") for e in pods.values() for uuid in e.device_ids)
    assert truth.pending == ["ml-svc-a/rerank-svc-a"]
    sample = next(msgspec.json.decode(raw, type=NodeSample) for topic, raw in recorder.records
                  if topic == "samples")
    assert {d.kind for d in sample.devices} == {"mig"}
    assert all(d.util_pct is None and d.engine_active_pct is not None for d in sample.devices)
