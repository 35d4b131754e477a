"""Shared GPUs in the simulated world, through the production collectors and the worker.

The ``shared-gpus`` scenario (a node of L4s time-sliced four ways, an A100
shared through MPS by three inference servers, one of them leaking) runs in
:class:`~gpusteward.sandbox.world.World`: per node a fake NVML whose
processes are the pods' (each with its ``/proc/<pid>/cgroup`` under the
world's host /proc), the kubelet's PodResources over gRPC with one replica
id per pod, and the production NVML collector reading both with per-process
attribution; the API-server double is read by the production watcher. The
stream worker runs as a child process with the shipped policy.

What must hold, against the simulator's ground truth: each pod of a shared
GPU has its own activity and memory in the published samples; the idle
notebook among active ones is found, and only it; the leak is found with
its projected exhaustion within 10 % of the truth; no memory finding names
a steady pod; the time-sliced node's summary counts its physical GPUs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from gpusteward.broker import EmbeddedBroker
from gpusteward.sandbox.simulator.engine import GroundTruth
from gpusteward.sandbox.world import World
from gpusteward.schema import (
    AllocationEvent,
    Finding,
    HwEvent,
    NodeSample,
    NodeSummary,
    QueueEvent,
)
from tests.e2e.world_run import WorldRun, run_in_world

pytestmark = pytest.mark.e2e


class _Recording:
    """The simulator's publisher: keeps its samples (the truth of each reading) and hands
    everything to the world."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.samples: list[NodeSample] = []

    async def sample(self, sample: NodeSample) -> None:
        self.samples.append(sample)
        await self.world.sample(sample)

    async def hw_event(self, event: HwEvent) -> None:
        await self.world.hw_event(event)

    async def allocation(self, event: AllocationEvent) -> None:
        await self.world.allocation(event)

    async def queue(self, event: QueueEvent) -> None:
        await self.world.queue(event)

    async def flush(self) -> None:
        await self.world.flush()


@dataclass
class Run:
    world: WorldRun
    uids: dict[str, str]
    """Pod uid -> namespace/name."""
    simulated: list[NodeSample]
    """What the simulator published: the truth of each reading."""

    @property
    def truth(self) -> GroundTruth:
        return self.world.truth

    @property
    def published(self) -> list[NodeSample]:
        return self.world.samples

    @property
    def findings(self) -> list[Finding]:
        return self.world.findings

    @property
    def summaries(self) -> list[NodeSummary]:
        return self.world.summaries


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    recordings: list[_Recording] = []

    def recording(world: World) -> _Recording:
        recordings.append(_Recording(world))
        return recordings[-1]

    world = asyncio.run(run_in_world(broker, "shared-gpus",
                                     tmp_path_factory.mktemp("shared-world"), recording))
    cluster = world.cluster
    uids = {w.uid: f"{w.namespace}/{w.name}" for w in (*cluster.running, *cluster.finished)}
    return Run(world, uids, recordings[0].samples)


def _firing(run: Run, kind: str) -> list[Finding]:
    return [f for f in run.findings if f.kind == kind and f.state == "firing"]


def test_each_pod_of_a_shared_gpu_has_its_own_activity_and_memory(run: Run) -> None:
    published = {(s.node, s.ts): s for s in run.published if s.source == "nvml"}
    compared = 0
    for simulated in run.simulated:
        sample = published[(simulated.node, simulated.ts)]
        devices = {d.uuid: d for d in sample.devices}
        for truth in simulated.devices:
            if len(truth.holders) < 2:
                continue
            device = devices[truth.uuid]
            assert device.attribution == "process"
            # Several pods on the device: PodResources names no uid, so each holder goes by
            # the uid its processes' cgroup names.
            got = {run.uids[h.pod_uid]: (h.activity_pct, h.mem_used_bytes, h.mps)
                   for h in device.holders if h.pod_uid is not None}
            want = {f"{h.pod.namespace}/{h.pod.name}": (
                        float(round(h.activity_pct or 0)), h.mem_used_bytes, h.mps)
                    for h in truth.holders if h.pod is not None}
            assert got == want
            compared += 1
    # Every tick from the first placement: four holders on one L4, two on the other, three
    # MPS clients on the A100.
    assert compared >= 3 * (len(run.simulated) // 2 - 2)
    mps = [h for s in run.published for d in s.devices for h in d.holders if h.mps]
    assert {run.uids[h.pod_uid] for h in mps if h.pod_uid} == {
        "ml-ana/serve-leaky-ana", "ml-cai/serve-steady-cai", "ml-dia/serve-steady-dia"}


def test_the_idle_notebook_among_active_ones_is_found_and_only_it(run: Run) -> None:
    idle = [p for p in run.truth.pods if p.idle]
    assert [(p.namespace, p.pod) for p in idle] == [("ml-dia", "nb-idle-dia")]
    found = _firing(run, "idle_holder")
    assert found, "the idle notebook was not found"
    assert {(f.subject.pod.namespace, f.subject.pod.name, f.subject.device)
            for f in found if f.subject.pod} == {(idle[0].namespace, idle[0].pod,
                                                  idle[0].devices[0])}
    assert all(f.subject.pod is not None for f in found)
    # its GPU was busy the whole time: the device itself is not idle
    busy = [d.util_pct or 0 for s in run.published for d in s.devices
            if d.uuid == idle[0].devices[0] and d.holders]
    assert min(busy) > 40


def test_the_leak_is_found_with_its_projected_exhaustion_within_ten_percent(run: Run) -> None:
    (leak,) = run.truth.leaks
    (finding,) = _firing(run, "gpu_memory_leak")
    assert finding.subject.pod is not None
    assert (finding.subject.pod.namespace, finding.subject.pod.name) == (leak.namespace,
                                                                         leak.pod)
    assert finding.subject.device == leak.device
    values = finding.evidence.values  # type: ignore[union-attr]
    truth_s = leak.exhausted_at - finding.ts
    assert abs(values["projected_exhaustion_s"] - truth_s) / truth_s < 0.10
    assert values["growth_bytes_per_s"] == pytest.approx(leak.growth_bytes_per_s, rel=0.05)


def test_no_memory_finding_on_the_steady_pods(run: Run) -> None:
    memory = [f for f in run.findings if f.kind.startswith("gpu_memory_")]
    assert {f.kind for f in memory} == {"gpu_memory_leak"}
    assert {f.subject.pod.name for f in memory if f.subject.pod} == {"serve-leaky-ana"}


def test_the_time_sliced_node_counts_its_physical_gpus(run: Run) -> None:
    last = {s.node: s for s in run.summaries}
    time_sliced, mps = last["ts-1"], last["mps-1"]
    assert (time_sliced.gpus_total, time_sliced.gpu_replicas) == (2, 4)
    assert time_sliced.gpus_free == 0  # both GPUs have holders
    assert (mps.gpus_total, mps.gpu_replicas) == (1, 4)
