"""A worker catching up reads a notebook's end before its last samples, end to end:
collector records -> Kafka -> the deployed stream worker -> findings and summaries.

The allocations topic is small and read ahead of the samples after an outage: the worker
reads the notebook's start and its deletion 3 h later (and, on ``next``, the pod that took
its GPU) before the samples of those hours. The notebook's last idle hours, read after its
release, opened its idle episode with nothing left to close it: the alert fired for ever,
the node's summaries listed the GPU as an idle hold (demand-aware reclaim's input), and on
``next`` the ladder climbed with the next pod's name. Now it resolves at the first sample
past the end.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodPhase,
    PodRef,
)
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.e2e.records import decoded

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the notebooks start
END = T0 + 3 * 3600  # and are deleted
STEP_S = 30.0


def notebook(node: str) -> PodRef:
    return PodRef(namespace="ml-nb", name=f"nb-{node}", uid=f"uid-nb-{node}")


NEXT = PodRef(namespace="ml-train", name="train-next", uid="uid-next")


def holds(node: str, pod: PodRef, phase: PodPhase, ts: float, started: float,
          kind: str = "notebook") -> PodAllocation:
    return PodAllocation(ts=ts, node=node, pod=pod, phase=phase, gpus=1,
                         device_ids=[f"GPU-{node}"], started_at=started, workload_kind=kind)


def page(node: str, ts: float, pod: PodRef | None) -> NodeSample:
    return NodeSample(ts=ts, node=node, source="nvml", devices=[DeviceSample(
        uuid=f"GPU-{node}", index=0, model="NVIDIA A100-SXM4-80GB", util_pct=0.0,
        temp_c=40.0, mem_used_bytes=1 << 30, mem_total_bytes=80 << 30, pod=pod)])


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_an_idle_episode_read_after_its_pods_end_resolves(settings: Settings,
                                                          tmp_path: Path) -> None:
    node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS,
                                               topics.ALLOCATIONS)]
    nodes = ("alone", "next")

    async def main() -> tuple[list[Finding], list[Action], list[NodeSummary]]:
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()
        try:
            for node in nodes:
                await publisher.allocation(holds(node, notebook(node), "running", T0, T0))
                await publisher.allocation(holds(node, notebook(node), "deleted", END, T0))
            await publisher.allocation(holds("next", NEXT, "running", END + 30, END + 30,
                                             kind="batch"))
            await publisher.flush()
            await kafka.wait_consumed(settings, worker_group(settings), node_topics, 90)
            ts = T0
            while ts < END + 2 * 3600:
                for node in nodes:
                    holder = notebook(node) if ts < END else NEXT if node == "next" else None
                    await publisher.sample(page(node, ts, holder))
                ts += STEP_S
            await publisher.flush()
            await kafka.wait_consumed(settings, worker_group(settings), node_topics, 90)
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]

            return (await decoded(settings, topics.FINDINGS, Finding),
                    await decoded(settings, topics.ACTIONS, Action),
                    await decoded(settings, topics.NODE_SUMMARIES, NodeSummary))
        finally:
            await publisher.stop()
            worker.stop()

    findings, actions, summaries = asyncio.run(main())
    for node in nodes:
        episode = [(f.state, f.ts) for f in findings
                   if f.kind == "idle_holder" and f.subject.pod == notebook(node)]
        assert episode[0] == ("firing", T0 + 2400), node  # 10 min grace, 30 min window
        # At the first sample past the end: it attributes the GPU to the next pod, or none.
        assert episode[-1] == ("resolved", END), node
        assert {state for state, _ in episode[1:-1]} <= {"firing"}  # its ladder's steps
        # Nothing asked of the notebook after its end, nor of the next pod on its episode.
        assert all(a.ts < END for a in actions if a.target.pod == notebook(node))
    assert not [a for a in actions if a.target.pod == NEXT and a.ts < END + 30 + 2400]
    last = {s.node: s for s in summaries}
    assert [hold.pod.name for hold in last["alone"].idle] == []
