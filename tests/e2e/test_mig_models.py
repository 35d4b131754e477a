"""MIG on an H200 with a media-extension slice, through the watcher, the worker and its
fleet agent: simulator -> API double -> watcher -> Kafka -> worker.

The node is labelled as the GPU Operator labels an H200 SXM (``nvidia.com/gpu.product:
NVIDIA-H200``: the driver names it plain ``NVIDIA H200``) and runs the ``mixed``
strategy with one ``1g.18gb+me`` slice beside six ``1g.18gb``; the device plugin
advertises the media slice as ``nvidia.com/mig-1g.18gb.me``, and a video pod asks for
it so. A reranker asks for a ``2g.35gb`` slice the layout lacks. What must hold:

- the node's summaries never offer the media slice while the video pod holds it (by
  either spelling), and offer the 1g.18gb slices its chats leave;
- after one advice interval the fleet agent advises a layout for the H200 pool, with
  the caveat that H200 placements are inferred.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules.mig import layout
from gpusteward.rules.mig.advice import MigAdviceSettings
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_mirror import KubeMirrorPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.schema import Finding, NodeSummary
from gpusteward.settings import Settings
from gpusteward.topics import worker_group

pytestmark = pytest.mark.e2e

H200_MEDIA = ["1g.18gb+me"] + ["1g.18gb"] * 6


def _spec() -> scenarios.Scenario:
    base = scenarios.load("mig-inference")
    node = scenarios.NodeGroup(prefix="h200-me", count=1, gpu_model="NVIDIA H200", gpus=1,
                               mem_gib=141.0, mig_layout=H200_MEDIA)
    phases = [scenarios.Phase(util=(30.0, 70.0))]
    workloads = [
        scenarios.WorkloadGroup(group="video", kind="inference", mig={"1g.18gb+me": 1},
                                mem_gib=(4.0, 12.0), phases=phases),
        scenarios.WorkloadGroup(group="chat", count=2, kind="inference",
                                mig={"1g.18gb": 1}, mem_gib=(4.0, 12.0), phases=phases),
        scenarios.WorkloadGroup(group="rerank", kind="inference", mig={"2g.35gb": 1},
                                arrive_s=(900.0, 900.0), mem_gib=(8.0, 20.0), phases=phases),
    ]
    return base.model_copy(update={
        "name": "h200-media", "nodes": [node], "users": ["svc-a", "svc-b"],
        # 2,000x, not as fast as it goes: the watcher reads the API double as it changes
        # and stamps it with the simulation's clock, so it must keep up.
        "workloads": workloads, "acceleration": 2000.0, "sample_interval_s": 60.0,
        "duration_s": MigAdviceSettings().interval_s + 600})


@pytest.mark.timeout(300)
def test_h200_media_slice_counted_and_pool_advised(settings: Settings, tmp_path: Path) -> None:
    spec = _spec()
    cluster = SimulatedCluster(spec)

    async def main() -> tuple[list[NodeSummary], list[Finding]]:
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()
        stop = asyncio.Event()
        try:
            with KubeApiServer(bookmark_interval_s=0.2) as api:
                kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))
                watcher = KubeWatcher(api_client(kube), publisher, kube,
                                      clock=lambda: cluster.now)
                watching = asyncio.create_task(watcher.run(stop))
                await asyncio.wait_for(watcher.synced.wait(), 30)
                await cluster.run(KubeMirrorPublisher(publisher, api, cluster))
                await asyncio.sleep(1.0)  # the watcher's last deltas
                stop.set()
                await watching
            await publisher.flush()
            group = worker_group(settings)
            await kafka.wait_consumed(settings, group, [t.name(settings) for t in (
                topics.SAMPLES, topics.ALLOCATIONS)], timeout_s=180)
            await kafka.wait_consumed(settings, group, [t.name(settings) for t in (
                topics.NODE_SUMMARIES, topics.QUEUE)], timeout_s=120)
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]

            async def read(topic: topics.TopicSpec) -> list[bytes]:
                return [r.value or b"" for r in await kafka.read_all(settings,
                                                                     topic.name(settings))]

            return ([msgspec.json.decode(v, type=NodeSummary)
                     for v in await read(topics.NODE_SUMMARIES)],
                    [msgspec.json.decode(v, type=Finding) for v in await read(topics.FINDINGS)])
        finally:
            await publisher.stop()
            worker.stop()

    summaries, findings = asyncio.run(main())
    video_running = [w for w in cluster.running if w.spec.group == "video"]
    assert video_running, "the video pod should hold the media slice to the end"
    # The node's last summary follows the last of its pods.
    last = [s for s in summaries if s.node == "h200-me-1"][-1]  # one partition: in order
    assert last.held_by_team, last
    # The media slice is held: free under neither spelling; six 1g.18gb less two chats.
    assert last.mig_free == {"1g.18gb": 4}, last

    advice = [f for f in findings if f.kind == layout.KIND]
    assert [f.labels["pool"] for f in advice] == ["H200-141GB"]
    (finding,) = advice
    assert finding.labels["placement_verified"] == "false"
    configs = [json.loads(v) for k, v in finding.labels.items() if k.startswith("config.")]
    assert any(entry.get("mig-devices", {}).get("2g.35gb") for entries in configs
               for entry in entries)
