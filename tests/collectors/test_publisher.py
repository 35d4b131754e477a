"""The publisher: ordered bounded spools, delivery, compression, its own /metrics."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import msgspec
import pytest
from aiokafka import ConsumerRecord

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.settings import CollectSettings
from gpusteward.collectors.transport.publisher import KafkaPublisher, compression_type
from gpusteward.collectors.transport.spool import DiskSpool, MemorySpool, Spool
from gpusteward.schema import DeviceSample, HwEvent, NodeSample
from gpusteward.settings import KafkaSettings, Settings


def sample(node: str, seq: int) -> NodeSample:
    return NodeSample(ts=float(seq), node=node, source="test", devices=[
        DeviceSample(uuid=f"GPU-{node}-0", index=0, model="NVIDIA H100 80GB HBM3",
                     util_pct=float(seq % 100))])


def sent(metrics: CollectorMetrics, name: str, topic: str = "samples.v1") -> float:
    return metrics.registry.get_sample_value(name, {"topic": topic}) or 0.0


@pytest.fixture(params=["memory", "disk"])
def make_spool(request, tmp_path: Path):
    def make(max_bytes: int) -> Spool:
        if request.param == "memory":
            return MemorySpool(max_bytes)
        return DiskSpool(tmp_path / "spool", max_bytes)
    return make


def test_spool_is_fifo_with_ack_and_drops_oldest_when_full(make_spool) -> None:
    spool = make_spool(max_bytes=100)
    seqs = [spool.append("t", b"k", bytes([i]) * 9)[0] for i in range(5)]  # 10 bytes each
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert [r.value[0] for r in spool.peek(3)] == [0, 1, 2]
    spool.ack(seqs[1])
    assert (spool.records, spool.size_bytes) == (3, 30)
    assert [r.value[0] for r in spool.peek(10)] == [2, 3, 4]

    for i in range(5, 12):
        _, dropped = spool.append("t", b"k", bytes([i]) * 9)
    assert spool.size_bytes <= 100
    assert [r.value[0] for r in spool.peek(20)] == list(range(2, 12))
    _, dropped = spool.append("t", b"k", bytes([12]) * 29)  # 30 bytes: three must go
    assert [r.value[0] for r in dropped] == [2, 3, 4]
    assert spool.peek(1)[0].value[0] == 5
    spool.close()


def test_disk_spool_survives_a_restart(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=1 << 20)
    first = [spool.append("topic-a", f"node-{i % 2}".encode(), f"v{i}".encode())[0]
             for i in range(4)]
    spool.ack(first[0])
    spool.close()

    reopened = DiskSpool(tmp_path, max_bytes=1 << 20)
    assert (reopened.records, reopened.size_bytes) == (3, 3 * (6 + 2))
    later, _ = reopened.append("topic-a", b"node-0", b"v4")
    assert later > first[-1], "sequence numbers never go back, so order holds across restarts"
    assert [r.value for r in reopened.peek(10)] == [b"v1", b"v2", b"v3", b"v4"]
    reopened.close()


def test_compression_choice() -> None:
    assert compression_type("auto") == "lz4"  # cramjam comes with aiokafka[lz4]
    assert compression_type("none") is None
    assert compression_type("gzip") == "gzip"


@pytest.mark.parametrize("compression", ["lz4", "gzip"])
def test_samples_are_delivered_in_order_per_node(settings: Settings, compression) -> None:
    metrics = CollectorMetrics()
    collect = CollectSettings(node_name="x", compression=compression, batch_max_records=7)

    async def scenario() -> list[ConsumerRecord]:
        await kafka.ensure_topics(settings, [topics.SAMPLES, topics.HW_EVENTS])
        publisher = KafkaPublisher(settings, collect=collect, metrics=metrics)
        await publisher.start()
        try:
            for seq in range(30):
                await publisher.sample(sample(f"node-{seq % 3}", seq))
            await publisher.hw_event(HwEvent(ts=1.0, node="node-0", kind="xid", xid=79))
            await publisher.flush(timeout_s=20)
            assert publisher.backlog == 0 and publisher.sent == 31
        finally:
            await publisher.stop()
        return await kafka.read_all(settings, topics.SAMPLES.name(settings))

    records = asyncio.run(scenario())
    decoder = msgspec.json.Decoder(NodeSample)
    received: dict[str, list[float]] = {}
    for record in records:
        key, value = record.key, record.value
        assert value is not None
        decoded = decoder.decode(value)
        assert key == decoded.node.encode()
        received.setdefault(decoded.node, []).append(decoded.ts)
    assert received == {f"node-{n}": [float(s) for s in range(n, 30, 3)] for n in range(3)}
    assert sent(metrics, "gpusteward_collect_records_sent_total") == 30
    assert sent(metrics, "gpusteward_collect_records_sent_total", "hw-events.v1") == 1
    assert metrics.registry.get_sample_value("gpusteward_collect_buffer_records") == 0


def test_unreachable_kafka_buffers_on_disk_and_drops_oldest_when_full(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    unreachable = Settings(kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}"))
    record_size = len(b"node-a") + len(msgspec.json.encode(sample("node-a", 10)))
    collect = CollectSettings(node_name="node-a", buffer_dir=tmp_path, delivery_timeout_s=0.5,
                              buffer_max_bytes=max(1024, 10 * record_size))
    metrics = CollectorMetrics()

    async def scenario() -> KafkaPublisher:
        publisher = KafkaPublisher(unreachable, collect=collect, metrics=metrics)
        await publisher.start()
        for seq in range(3):
            await publisher.sample(sample("node-a", seq))
        async with asyncio.timeout(10):
            while publisher.healthy:  # noqa: ASYNC110 - the state has no event to wait on
                await asyncio.sleep(0.05)
        for seq in range(3, 40):  # never blocks while Kafka is away
            await publisher.sample(sample("node-a", seq))
        await publisher.stop(drain_timeout_s=0)
        return publisher

    asyncio.run(scenario())
    kept = collect.buffer_max_bytes // record_size
    assert sent(metrics, "gpusteward_collect_records_buffered_total") == 40
    assert sent(metrics, "gpusteward_collect_records_dropped_total") == 40 - kept
    assert (metrics.registry.get_sample_value("gpusteward_collect_delivery_failures_total")
            or 0) >= 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("dropping the oldest" in m for m in warnings) == 1, "one line per outage"
    assert any("stopping with" in m and "kept on disk" in m for m in warnings)
    spool = DiskSpool(tmp_path, collect.buffer_max_bytes)
    left = [msgspec.json.decode(r.value, type=NodeSample).ts for r in spool.peek(100)]
    spool.close()
    assert left == [float(s) for s in range(40 - kept, 40)], "the newest are kept, in order"


def test_metrics_are_served_from_the_collectors_own_registry() -> None:
    metrics = CollectorMetrics()
    metrics.source_errors.labels("dcgm", "unreachable").inc()
    port = free_port()
    server = metrics.serve(port, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    finally:
        server.shutdown()
    assert 'gpusteward_collect_source_errors_total{reason="unreachable",source="dcgm"} 1.0' in text
    for name in ("records_sent_total", "records_buffered_total", "records_dropped_total"):
        assert f"# HELP gpusteward_collect_{name} " in text
    assert "python_gc_objects_collected_total" not in text, "not the global registry"
