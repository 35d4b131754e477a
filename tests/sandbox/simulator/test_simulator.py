"""The fleet simulator: deterministic, faithful to the contract, honest ground truth."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent


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
