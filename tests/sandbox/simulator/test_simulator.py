"""The fleet simulator: deterministic, faithful to the contract, honest ground truth."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GIB, GroundTruth, SimulatedCluster
from gpusteward.schema import (
    AllocationEvent,
    Finding,
    HwEvent,
    NodeInventory,
    NodeSample,
    QueueEvent,
)
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings
from gpusteward.streams.policy_file import load_policy


class Recorder:
    """A Publisher that keeps what it is given, encoded as it would go on the wire."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes]] = []

    async def sample(self, sample: NodeSample) -> None:
        self.records.append(("samples", msgspec.json.encode(sample)))

    async def hw_event(self, event: HwEvent) -> None:
        self.records.append(("hw", msgspec.json.encode(event)))

    async def allocation(self, event: AllocationEvent) -> None:
        self.records.append(("alloc", msgspec.json.encode(event)))

    async def queue(self, event: QueueEvent) -> None:
        self.records.append(("queue", msgspec.json.encode(event)))

    async def flush(self) -> None:
        pass


def run(seed: int | None = None) -> tuple[Recorder, GroundTruth]:
    spec = scenarios.load("eight-a100").model_copy(update={"acceleration": 0.0})
    if seed is not None:
        spec = spec.model_copy(update={"seed": seed})
    recorder = Recorder()
    truth = asyncio.run(SimulatedCluster(spec).run(recorder))
    return recorder, truth


def test_same_seed_same_output_other_seed_other_output() -> None:
    first, truth1 = run()
    second, truth2 = run()
    assert first.records == second.records and truth1 == truth2
    third, _ = run(seed=99)
    assert third.records != first.records


def test_eight_a100_tells_its_story() -> None:
    recorder, truth = run()
    samples = [msgspec.json.decode(r, type=NodeSample) for t, r in recorder.records
               if t == "samples"]
    assert {s.node for s in samples} == {f"a100-{i}" for i in range(1, 9)}
    assert all(len(s.devices) == 1 and "A100" in s.devices[0].model for s in samples)
    ticks = sorted({s.ts for s in samples})
    assert ticks[1] - ticks[0] == 30 and len(ticks) == 721
    assert len({p.pod.split("-")[-1] for p in truth.pods} | {
        p.split("-")[-1] for p in truth.pending}) >= 25, "about thirty users"
    assert [f.node for f in truth.faults] == ["a100-5"]
    assert "ml-ivan/ddp-ivan" in truth.pending  # the 2-GPU job never fits
    idle_notebooks = {p.pod for p in truth.idle_periods if p.kind == "notebook"}
    assert len(idle_notebooks) >= 3
    # Attribution is in the samples, as the NVML collector gives it.
    held = [d for s in samples for d in s.devices if d.pod is not None]
    assert held and all(d.util_pct is not None for d in held)
    hw = [msgspec.json.decode(r, type=HwEvent) for t, r in recorder.records if t == "hw"]
    assert [(e.kind, e.node) for e in hw] == [("ecc_dbe", "a100-5")]


def test_cordon_stops_new_placements() -> None:
    spec = scenarios.load("eight-a100").model_copy(update={"acceleration": 0.0})
    cluster = SimulatedCluster(spec)
    assert cluster.request_cordon("a100-1", "test")
    assert not cluster.request_cordon("nope", "test")
    truth = asyncio.run(cluster.run(Recorder()))
    assert [(c.node, c.ts) for c in truth.cordons] == [("a100-1", spec.start_ts)]
    assert all(p.node != "a100-1" for p in truth.pods)


def test_bad_scenario_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nduration_s: -5\nnodes: []\nusers: [a]\n")
    with pytest.raises(scenarios.ScenarioError) as error:
        scenarios.load(str(path))
    assert "duration_s" in str(error.value) and "bad.yaml" in str(error.value)


def test_unknown_builtin_lists_the_known_ones() -> None:
    with pytest.raises(scenarios.ScenarioError, match="eight-a100"):
        scenarios.load("no-such-scenario")


def test_shared_gpus_tell_their_story() -> None:
    """Replicas of one GPU hold several pods, each with its own activity and memory; the
    node advertises replicas and counts physical GPUs; a leak's truth is its exhaustion."""
    spec = scenarios.load("shared-gpus").model_copy(update={"acceleration": 0.0})
    recorder = Recorder()
    truth = asyncio.run(SimulatedCluster(spec).run(recorder))
    decoded = [(t, r) for t, r in recorder.records if t in ("samples", "alloc")]
    samples = [msgspec.json.decode(r, type=NodeSample) for t, r in decoded if t == "samples"]
    inventory = {i.node: i for i in (msgspec.json.decode(r, type=AllocationEvent)
                                     for t, r in decoded if t == "alloc")
                 if isinstance(i, NodeInventory)}
    sliced = inventory["ts-1"]
    assert (sliced.gpu_count, sliced.allocatable["nvidia.com/gpu"], sliced.gpu_replicas,
            sliced.gpu_sharing) == (2, 8, 4, "time-slicing")
    assert inventory["mps-1"].gpu_sharing == "mps"
    last = {s.node: s for s in samples}
    first_gpu = last["ts-1"].devices[0]
    assert len(first_gpu.holders) == 4 and first_gpu.attribution == "process"
    assert first_gpu.util_pct == pytest.approx(
        min(100.0, sum(h.activity_pct or 0 for h in first_gpu.holders)), abs=0.1)
    assert first_gpu.mem_used_bytes == sum(h.mem_used_bytes or 0 for h in first_gpu.holders)
    assert all(h.mps for h in last["mps-1"].devices[0].holders)
    shares = {p.pod: p.gpus for p in truth.pods}
    assert set(shares.values()) == {0.25}
    (leak,) = truth.leaks
    leaky = [h for s in samples if s.node == "mps-1" for d in s.devices for h in d.holders
             if h.pod is not None and h.pod.name == leak.pod]
    # Readings jitter around the trend (the scenario's mem_jitter_gib), so the truth holds
    # within the jitter: 0.3 GiB for the leaky pod, 0.3 + 2 x 0.5 GiB for its GPU.
    growth = (leaky[-1].mem_used_bytes or 0) - (leaky[0].mem_used_bytes or 0)
    assert growth == pytest.approx(leak.growth_bytes_per_s * (len(leaky) - 1) * 30,
                                   abs=0.6 * GIB)
    device = last["mps-1"].devices[0]
    assert device.mem_total_bytes is not None and device.mem_used_bytes is not None
    left_s = (device.mem_total_bytes - device.mem_used_bytes) / leak.growth_bytes_per_s
    assert leak.exhausted_at - last["mps-1"].ts == pytest.approx(
        left_s, abs=1.3 * GIB / leak.growth_bytes_per_s)
    steady = [h.mem_used_bytes or 0 for s in samples if s.node == "mps-1" for d in s.devices
              for h in d.holders if h.pod is not None and h.pod.name == "serve-steady-cai"]
    assert len(set(steady)) > 1 and max(steady) - min(steady) <= GIB


def test_simulated_nvlink_crc_errors_reach_the_node_join_apart_from_replays() -> None:
    """The simulator's CRC counter: a jump at link training and a trickle of 2 a minute
    (routine) raise nothing under the shipped policy; 200 a second (DCGM fails a link at
    100) fires nvlink_crc_errors; replays still fire nvlink_errors."""
    faults = [scenarios.Fault(kind="nvlink_crc_errors", node="a100-1", at_s=300, count=412,
                              for_s=30),
              scenarios.Fault(kind="nvlink_crc_errors", node="a100-1", at_s=600, count=1,
                              for_s=7200),
              scenarios.Fault(kind="nvlink_crc_errors", node="a100-2", at_s=600, count=6000,
                              for_s=300),
              scenarios.Fault(kind="nvlink_errors", node="a100-3", at_s=600, count=4,
                              for_s=120)]
    spec = scenarios.load("eight-a100").model_copy(update={"acceleration": 0.0,
                                                           "faults": faults})
    recorder = Recorder()
    asyncio.run(SimulatedCluster(spec).run(recorder))
    policy = load_policy(Path(__file__).resolve().parents[3] / "deploy" / "base" / "policy.yaml")
    join, states = NodeJoin(RuleSettings(policy=policy)), dict[str, NodeState]()
    fired: set[tuple[str, str]] = set()
    for topic, record in recorder.records:
        if topic == "samples":
            sample = msgspec.json.decode(record, type=NodeSample)
            state = states.setdefault(sample.node, NodeState())
            fired |= {(o.kind, sample.node) for o in join.on_sample(state, sample)
                      if isinstance(o, Finding) and o.kind.startswith("nvlink")
                      and o.state == "firing"}
    assert fired == {("nvlink_crc_errors", "a100-2"), ("nvlink_errors", "a100-3")}


@pytest.mark.parametrize("name", scenarios.builtin_names())
def test_no_two_workloads_share_a_pod_identity(name: str) -> None:
    """A group of more workloads than users went round the users again under the same
    names: spot-batch ran two ml-bob/train-bob pods with one uid, which the demo's API
    double refused (a pod of that name already existed) and a real cluster would too."""
    workloads = SimulatedCluster(scenarios.load(name)).workloads
    assert len({(w.namespace, w.name) for w in workloads}) == len(workloads)
    assert len({w.uid for w in workloads}) == len(workloads)
