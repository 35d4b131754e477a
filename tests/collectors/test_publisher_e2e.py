"""The publisher through broker outages, on its own embedded broker (not the session's).

A hung broker is a SIGSTOPped one (EmbeddedBroker.freeze): connections stay
open and nothing answers, the hardest case for a producer. These tests own
their broker because freezing the session broker would stall every other
test's traffic.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker, free_port
from gpusteward.collectors.dcgm import DcgmSource
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.settings import CollectSettings
from gpusteward.collectors.source import run_source
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent
from gpusteward.settings import Settings

pytestmark = pytest.mark.e2e

FREEZE_S = 12.0
"""Six delivery timeouts (the test's 2 s): as long a hang, for the publisher, as any longer
one, which only adds to the backlog (make chaos freezes the broker under the whole
pipeline)."""
NODES = ("node-a", "node-b")


class Tee:
    """Forwards to the real publisher and remembers, per node, what it was given."""

    def __init__(self, publisher: KafkaPublisher) -> None:
        self.publisher = publisher
        self.given: dict[str, list[float]] = {node: [] for node in NODES}

    async def sample(self, sample: NodeSample) -> None:
        self.given[sample.node].append(sample.ts)
        await self.publisher.sample(sample)

    async def hw_event(self, event: HwEvent) -> None:
        await self.publisher.hw_event(event)

    async def allocation(self, event: AllocationEvent) -> None:
        await self.publisher.allocation(event)

    async def queue(self, event: QueueEvent) -> None:
        await self.publisher.queue(event)

    async def flush(self) -> None:
        await self.publisher.flush()


async def received_per_node(settings: Settings) -> dict[str, list[float]]:
    received: dict[str, list[float]] = {node: [] for node in NODES}
    for record in await kafka.read_all(settings, topics.SAMPLES.name(settings)):
        key, value = record.key, record.value
        assert value is not None
        sample = msgspec.json.decode(value, type=NodeSample)
        assert key == sample.node.encode()
        received[sample.node].append(sample.ts)
    return received


def first_occurrences(values: list[float]) -> list[float]:
    seen: set[float] = set()
    return [v for v in values if not (v in seen or seen.add(v))]  # type: ignore[func-returns-value]


def counter(metrics: CollectorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_hung_broker_loses_no_sample_and_keeps_order(
        tmp_path: Path, exporter) -> None:
    metrics = CollectorMetrics()
    collect = CollectSettings(node_name="unused", interval_s=0.25, buffer_dir=tmp_path / "buffer",
                              delivery_timeout_s=2.0, retry_backoff_max_s=1.0)
    with EmbeddedBroker(log_path=tmp_path / "tansu.log") as broker:
        settings = broker.settings().model_copy(update={"topic_prefix": "freeze"})

        async def scenario() -> tuple[Tee, dict[str, list[float]], float]:
            await kafka.ensure_topics(settings, [topics.SAMPLES, topics.HW_EVENTS])
            publisher = KafkaPublisher(settings, collect=collect, metrics=metrics)
            tee = Tee(publisher)
            await publisher.start()
            stop = asyncio.Event()
            async with aiohttp.ClientSession() as session:
                loops = [asyncio.create_task(run_source(
                    DcgmSource(exporter.url, node, session), tee, stop, collect.interval_s,
                    metrics)) for node in NODES]
                await asyncio.sleep(1.5)
                assert publisher.sent > 0, "delivery works before the freeze"
                broker.freeze()
                try:
                    await asyncio.sleep(FREEZE_S)
                    assert not publisher.healthy
                    held_at_thaw = publisher.backlog
                finally:
                    broker.thaw()
                thawed = time.monotonic()
                async with asyncio.timeout(30):
                    while publisher.backlog > len(NODES):  # noqa: ASYNC110 - no event for it
                        await asyncio.sleep(0.05)
                caught_up_s = time.monotonic() - thawed
                await asyncio.sleep(0.5)  # collection goes on after the catch-up
                stop.set()
                await asyncio.gather(*loops)
            await publisher.flush(timeout_s=30)
            await publisher.stop()
            assert held_at_thaw >= len(NODES) * (FREEZE_S / collect.interval_s) * 0.8
            return tee, await received_per_node(settings), caught_up_s

        tee, received, caught_up_s = asyncio.run(scenario())

    for node in NODES:
        given = tee.given[node]
        assert len(given) >= (FREEZE_S + 2) / collect.interval_s * 0.8
        # No loss and the order of first deliveries is the order of collection; any repeat
        # (at-least-once) comes after its first copy and only for records sent when it hung.
        assert first_occurrences(received[node]) == given, node
        repeats = len(received[node]) - len(given)
        assert repeats <= collect.batch_max_records
        print(f"{node}: {len(given)} collected, {len(received[node])} received "
              f"({repeats} repeats); caught up {caught_up_s:.2f} s after the thaw")
    assert counter(metrics, "gpusteward_collect_records_buffered_total",
                   topic="samples.v1") > 0
    assert counter(metrics, "gpusteward_collect_records_dropped_total", topic="samples.v1") == 0
    assert caught_up_s < 10


def test_kafka_down_at_start_then_up_delivers_everything(tmp_path: Path) -> None:
    port = free_port()
    broker = EmbeddedBroker(port=port, log_path=tmp_path / "tansu.log")
    settings = broker.settings().model_copy(update={"topic_prefix": "late"})
    collect = CollectSettings(node_name="node-a", buffer_dir=tmp_path / "buffer",
                              delivery_timeout_s=1.0, retry_backoff_max_s=0.5)

    async def publish_while_down() -> None:
        publisher = KafkaPublisher(settings, collect=collect)
        await publisher.start()
        for seq in range(20):
            await publisher.sample(NodeSample(ts=float(seq), node="node-a", source="t",
                                              devices=[]))
        await publisher.stop(drain_timeout_s=0.5)  # the records stay on disk

    async def restart_and_deliver() -> dict[str, list[float]]:
        await kafka.ensure_topics(settings, [topics.SAMPLES])
        publisher = KafkaPublisher(settings, collect=collect)
        assert publisher.backlog == 20
        await publisher.start()
        await publisher.flush(timeout_s=30)
        await publisher.stop()
        return await received_per_node(settings)

    asyncio.run(publish_while_down())
    with broker:
        received = asyncio.run(restart_and_deliver())
    assert received["node-a"] == [float(s) for s in range(20)]


def test_a_broker_back_empty_is_noticed_and_what_it_lost_is_sent_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The memory-only broker, restarted on its port, acknowledges records to partitions it
    no longer has and keeps none of them (seen: the simulator's samples vanished while its
    publisher counted them delivered). The publisher must notice, say so, create the topics
    again and send what it cannot be sure landed, in order."""

    def sample(ts: float, node: str) -> NodeSample:
        return NodeSample(ts=ts, node=node, source="test", devices=[])

    async def run(broker: EmbeddedBroker) -> None:
        settings = broker.settings().model_copy(update={"topic_prefix": "empty"})
        await kafka.ensure_topics(settings)
        metrics = CollectorMetrics()
        publisher = KafkaPublisher(settings, metrics=metrics)
        await publisher.start()
        try:
            for before in range(5):
                await publisher.sample(sample(1.7e9 + before, NODES[before % 2]))
            await publisher.flush(30)
            broker.kill()
            await asyncio.to_thread(broker.start)  # the same port, no topics
            after = [1.7e9 + 100 + ts for ts in range(10)]
            for ts in after:
                await publisher.sample(sample(ts, NODES[int(ts) % 2]))
            await publisher.flush(30)
        finally:
            await publisher.stop(5)
        assert counter(metrics, "gpusteward_collect_topics_lost_total") >= 1
        assert counter(metrics, "gpusteward_collect_records_resent_total",
                       topic="samples.v1") >= len(after)
        received = await received_per_node(settings)
        for node in NODES:
            sent = [ts for ts in after if NODES[int(ts) % 2] == node]
            assert first_occurrences(received[node]) == sent, node

    with caplog.at_level("ERROR", logger="gpusteward.collectors.transport.publisher"), \
            EmbeddedBroker(log_path=tmp_path / "tansu.log") as broker:
        asyncio.run(run(broker))
    assert "the broker lost records it had acknowledged" in caplog.text
