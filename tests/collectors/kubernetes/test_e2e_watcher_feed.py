"""The whole join on the watcher's feed: simulator -> API double -> watcher -> Kafka -> worker.

The simulator's own allocation feed is replaced: it writes its fleet into the
API double (KubeMirrorPublisher) and the Kubernetes watcher publishes the
allocation events read from the API. The stream worker must then find the
idle holders and the ECC fault the simulator injected, as it does on the
simulator's feed (the demo's own check against the ground truth).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.demo import _expected_idle_pods
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_mirror import KubeMirrorPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.schema import Finding
from gpusteward.settings import Settings
from gpusteward.topics import worker_group


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_worker_finds_the_same_on_the_watcher_feed(settings: Settings, tmp_path: Path) -> None:
    spec = scenarios.load("eight-a100").model_copy(update={"duration_s": 4 * 3600,
                                                           "acceleration": 720.0})
    cluster = SimulatedCluster(spec)

    async def main() -> list[Finding]:
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()
        stop = asyncio.Event()
        try:
            with KubeApiServer(bookmark_interval_s=0.2) as api:
                kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))
                watcher = KubeWatcher(api_client(kube), publisher, kube, clock=lambda: cluster.now)
                watching = asyncio.create_task(watcher.run(stop))
                await asyncio.wait_for(watcher.synced.wait(), 30)
                await cluster.run(KubeMirrorPublisher(publisher, api, cluster))
                await asyncio.sleep(1.0)  # the watcher's last deltas
                stop.set()
                await watching
            await publisher.flush()
            node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS,
                                                       topics.ALLOCATIONS)]
            await kafka.wait_consumed(settings, worker_group(settings), node_topics, 120)
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]
            records = await kafka.read_all(settings, topics.FINDINGS.name(settings))
            return [msgspec.json.decode(r.value or b"", type=Finding) for r in records]
        finally:
            await publisher.stop()
            worker.stop()

    findings = asyncio.run(main())
    truth = cluster.finish_truth()
    idle = {f"{f.subject.pod.namespace}/{f.subject.pod.name}" for f in findings
            if f.kind == "idle_holder" and f.state == "firing" and f.subject.pod}
    assert idle == _expected_idle_pods(truth)
    faulty = {f.subject.device for f in findings if f.kind == "ecc_dbe" and f.state == "firing"}
    assert faulty == {fault.device for fault in truth.faults}
