"""The watcher onto the embedded broker: records keyed by node and by cluster queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from aiokafka import ConsumerRecord

from gpusteward import kafka, topics
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.schema import AllocationEvent, NodeInventory, PodAllocation, QueueEvent
from gpusteward.settings import Settings

from .conftest import FIXTURES


@pytest.mark.e2e
def test_watcher_publishes_to_kafka_keyed_for_the_join(settings: Settings,
                                                       tmp_path: Path) -> None:
    with KubeApiServer(bookmark_interval_s=0.1) as api:
        api.load_dir(FIXTURES)
        kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))

        async def main() -> tuple[list[ConsumerRecord], ...]:
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
    decoded = [(r.key, decoder.decode(r.value or b"")) for r in allocations]
    assert len(decoded) == 12
    # Compaction keys: the node for its inventory, node/pod/<uid> for a pod; the node part
    # picks the partition, so a node's pods share its samples' partition.
    assert all(key == e.node.encode() for key, e in decoded if isinstance(e, NodeInventory))
    assert all(key is not None and key.startswith(e.node.encode() + b"/pod/")
               for key, e in decoded if not isinstance(e, NodeInventory))
    partitions: dict[str, set[int]] = {e.node: set() for _, e in decoded}
    for record, (_, e) in zip(allocations, decoded, strict=True):
        partitions[e.node].add(record.partition)
    assert all(len(p) == 1 for p in partitions.values())
    assert sum(isinstance(e, NodeInventory) for _, e in decoded) == 6
    assert sum(isinstance(e, PodAllocation) for _, e in decoded) == 6
    queue_events = [(r.key, msgspec.json.decode(r.value or b"", type=QueueEvent))
                    for r in queue]
    assert [(key, e.name, e.state) for key, e in queue_events] == [
        (b"gpu-cq", "eval-1-qq8zt", "pending"),
        # A JobSet's pod is a gang member: followed on the queue topic even when bound.
        (b"default", "pretrain-workers-0-0-xk2l9", "admitted"),
        (b"gpu-cq", "job-eval-2-3f1c2", "pending"),
        (b"gpu-cq", "job-train-llm-9a8b7", "admitted"),
    ]
