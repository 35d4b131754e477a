"""The watcher onto the embedded broker: records keyed by node and by cluster queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.publisher import KafkaPublisher
from gpusteward.schema import AllocationEvent, NodeInventory, PodAllocation, QueueEvent
from gpusteward.settings import Settings
from gpusteward.testing.kube_api import KubeApiServer

from .conftest import FIXTURES


@pytest.mark.e2e
def test_watcher_publishes_to_kafka_keyed_for_the_join(settings: Settings,
                                                       tmp_path: Path) -> None:
    with KubeApiServer(bookmark_interval_s=0.1) as api:
        api.load_dir(FIXTURES)
        kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))

        async def main() -> tuple[list[tuple[bytes | None, bytes | None]], ...]:
            await kafka.ensure_topics(settings)
            publisher = KafkaPublisher(settings)
            await publisher.start()
            stop = asyncio.Event()
            watcher = KubeWatcher(api_client(kube), publisher, kube)
            task = asyncio.create_task(watcher.run(stop))
            try:
                await asyncio.wait_for(watcher.synced.wait(), 20)
            finally:
                stop.set()
                await task
                await publisher.stop()
            return (await kafka.read_all(settings, topics.ALLOCATIONS.name(settings)),
                    await kafka.read_all(settings, topics.QUEUE.name(settings)))

        allocations, queue = asyncio.run(main())

    decoder = msgspec.json.Decoder(AllocationEvent)
    decoded = [(key, decoder.decode(value or b"")) for key, value in allocations]
    assert len(decoded) == 12
    assert all(key == e.node.encode() for key, e in decoded)
    assert sum(isinstance(e, NodeInventory) for _, e in decoded) == 6
    assert sum(isinstance(e, PodAllocation) for _, e in decoded) == 6
    queue_events = [(key, msgspec.json.decode(value or b"", type=QueueEvent))
                    for key, value in queue]
    assert [(key, e.name, e.state) for key, e in queue_events] == [
        (b"gpu-cq", "eval-1-qq8zt", "pending"),
        (b"gpu-cq", "job-eval-2-3f1c2", "pending"),
        (b"gpu-cq", "job-train-llm-9a8b7", "admitted"),
    ]
