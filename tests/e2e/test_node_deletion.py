"""A deleted node leaves the fleet's view, end to end: API double -> Kubernetes watcher ->
Kafka -> stream worker (node join and fleet agent) -> findings and node summaries.

Three A100 nodes, ``big`` with 8 GPUs and ``s1``, ``s2`` with 4, all free. ``big`` is
deleted; then a pod asking for 8 GPUs on one node is created and waits. With ``big``
gone no node can ever hold it: the fleet has 8 GPUs free but at most 4 on a node, so
it is stranded, and it gets no start estimate. Then ``big`` is created again under its
name, and counts again: the pod now fits it and gets an estimate.

Before the node join sent tombstones, ``big``'s last summary (8 GPUs, none free) stayed
in the fleet agent's view until it went stale (``node_stale_s``, 10 min of event time)
and in ``gpusteward status`` for good (the summaries topic is compacted): the agent
promised the pod a start "now" on a node that no longer existed, and the status counted
8 allocated GPUs in the pool.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import eta
from gpusteward.rules import fragmentation as frag
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, rfc3339
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import DeviceSample, Finding, NodeSample, NodeSummary
from gpusteward.settings import Settings
from gpusteward.status import StatusFold
from gpusteward.streams.app import worker_group
from gpusteward.streams.fleet import fleet_group

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
STEP_S = 30.0
MODEL = "NVIDIA A100-SXM4-80GB"
GPUS = {"big": 8, "s1": 4, "s2": 4}
WIDE = "team-a/wide"
"""The pod asking for 8 GPUs on one node."""


def _page(node: str, ts: float) -> NodeSample:
    return NodeSample(ts=ts, node=node, source="dcgm", devices=[
        DeviceSample(uuid=f"GPU-{node}-{i}", index=i, model=MODEL, util_pct=0.0, temp_c=40.0,
                     mem_total_bytes=80 << 30) for i in range(GPUS[node])])


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_deleted_node_leaves_the_fleet_and_counts_again_when_re_added(
        settings: Settings, tmp_path: Path) -> None:
    now = T0
    phases: dict[str, float] = {}

    async def main() -> tuple[list[Finding], list[NodeSummary]]:
        nonlocal now
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()
        stop = asyncio.Event()
        node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.ALLOCATIONS)]
        try:
            with KubeApiServer(bookmark_interval_s=0.2) as api:
                api.load([gpu_node(node, gpus=gpus) for node, gpus in GPUS.items()])
                kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))
                watcher = KubeWatcher(api_client(kube), publisher, kube, clock=lambda: now)
                watching = asyncio.create_task(watcher.run(stop))
                await asyncio.wait_for(watcher.synced.wait(), 30)

                async def caught_up() -> None:
                    """Everything the watcher and the collectors sent, read by the worker."""
                    latest = str(api.resource_version)
                    for _ in range(500):
                        reflectors = list(watcher.reflectors.values())
                        if all(r.resource_version == latest for r in reflectors) and (
                                sum(r.stats.deltas for r in reflectors) == watcher.processed):
                            break
                        await asyncio.sleep(0.02)
                    else:
                        raise AssertionError("the watcher did not catch up in 10 s")
                    await publisher.flush()
                    await kafka.wait_consumed(settings, worker_group(settings), node_topics, 90)

                async def pages(nodes: tuple[str, ...], steps: int) -> None:
                    nonlocal now
                    for _ in range(steps):
                        for node in nodes:
                            await publisher.sample(_page(node, now))
                        now += STEP_S
                    await caught_up()

                await pages(tuple(GPUS), 6)
                phases["deleted"] = now
                api.delete("Node", "big")  # its collector goes with it
                await caught_up()
                now += STEP_S
                api.create(gpu_pod("wide", node=None, resources={"nvidia.com/gpu": "8"},
                                   uid="uid-wide", created=rfc3339(now)))
                await caught_up()
                await pages(("s1", "s2"), 14)  # 7 min: stranded, and under node_stale_s
                phases["re-added"] = now
                api.create(gpu_node("big", gpus=GPUS["big"]))
                await caught_up()
                await pages(tuple(GPUS), 6)
                stop.set()
                await watching
                await publisher.flush()
            await kafka.wait_consumed(settings, fleet_group(settings), [
                t.name(settings) for t in (topics.NODE_SUMMARIES, topics.QUEUE)], 120)
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]

            async def read(spec: topics.TopicSpec, kind: Any) -> list[Any]:
                records = await kafka.read_all(settings, spec.name(settings))
                return [msgspec.json.decode(r.value or b"", type=kind) for r in records]

            return await read(topics.FINDINGS, Finding), await read(topics.NODE_SUMMARIES,
                                                                   NodeSummary)
        finally:
            await publisher.stop()
            worker.stop()

    findings, summaries = asyncio.run(main())
    deleted, re_added = phases["deleted"], phases["re-added"]
    big = [s for s in summaries if s.node == "big"]
    gone = [s for s in big if deleted <= s.ts < re_added]
    # The node join's tombstones: the node offers and holds nothing, and says it is gone.
    assert gone and all(s.deleted and s.gpus_total == 0 and s.gpus_free == 0 for s in gone), \
        [(s.ts, s.deleted, s.gpus_total) for s in gone]
    back = [s for s in big if s.ts >= re_added]
    assert back and not any(s.deleted for s in back) and back[-1].gpus_free == 8

    def about_wide(kind: str) -> list[Finding]:
        return [f for f in findings if f.kind == kind and f.subject.pod is not None
                and f"{f.subject.pod.namespace}/{f.subject.pod.name}" == WIDE]

    # While big is gone: stranded (8 free, 4 at most on a node), and no start promised.
    stranded = about_wide(frag.STRANDED_KIND)
    assert [f.state for f in stranded] == ["firing", "resolved"], stranded
    assert stranded[0].ts < re_added <= stranded[1].ts
    estimates = about_wide(eta.KIND)
    assert not [f for f in estimates if f.ts < re_added], \
        [(f.ts - deleted, f.summary) for f in estimates]
    # Created again, big counts again: the pod fits it.
    assert [f for f in estimates if f.ts >= re_added and f.state == "firing"], estimates

    # gpusteward status over the summaries sent while big was gone: two nodes, 8 GPUs.
    fold = StatusFold()
    for summary in summaries:
        if summary.ts < re_added:
            fold.summary(summary)
    pools = fold.snapshot(re_added).pools
    assert [(p.nodes, p.gpus, p.allocated) for p in pools] == [(2, 8, 0)], pools
