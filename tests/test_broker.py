"""The embedded broker: answers metadata, creates the topics, stops cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker, PortInUse, free_port
from gpusteward.settings import KafkaSettings, Settings


def test_topics_are_created_once(settings: Settings) -> None:
    async def main() -> tuple[list[str], list[str], list[str]]:
        first = await kafka.ensure_topics(settings)
        second = await kafka.ensure_topics(settings)
        admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
        await admin.start()
        try:
            return first, second, await admin.list_topics()
        finally:
            await admin.close()

    first, second, existing = asyncio.run(main())
    names = {spec.name(settings) for spec in topics.ALL}
    assert set(first) == names and second == [] and names <= set(existing)


async def _create_topic(settings: Settings, name: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


def test_true_end_offsets_count_every_record_of_the_last_batch(settings: Settings) -> None:
    """The embedded broker reports the last batch's base offset plus one as the high
    watermark; table recovery needs the offset after the last record."""

    async def main() -> tuple[int, int, int]:
        name = f"{settings.topic_prefix}.ends"
        await _create_topic(settings, name, partitions=1)
        producer = kafka.producer(settings, linger_ms=100)
        await producer.start()
        try:
            sent = [await producer.send(name, b"v", key=b"k") for _ in range(10)]
            await producer.flush()
            await asyncio.gather(*sent)
        finally:
            await producer.stop()
        tp = TopicPartition(name, 0)
        reader = kafka.consumer(settings, group_id=None)
        await reader.start()
        try:
            reported = (await reader.end_offsets([tp]))[tp]
            true_end = (await kafka.true_end_offsets(reader, [tp]))[tp]
        finally:
            await reader.stop()
        return reported, true_end, len(await kafka.read_all(settings, name))

    reported, true_end, count = asyncio.run(main())
    assert true_end == count == 10
    assert reported <= true_end  # 1 on the embedded broker (one batch of ten), 10 on Kafka


def test_a_fetch_reports_the_end_after_the_last_batch_where_list_offsets_trails(
        settings: Settings) -> None:
    """The fleet agent takes the queue for read to its end when the last applied offset
    reaches the high watermark of the consumer's last fetch (``streams/fleet.py``,
    ``queue_caught_up``). That watermark is the end after the last record, on the
    embedded broker too: there only ListOffsets (``end_offsets``) answers the last batch's
    base offset plus one. Batches of 2-6 records are written while a reader fetches; no
    fetch may report an end inside a batch."""

    async def main() -> tuple[int, int]:
        name = f"{settings.topic_prefix}.fetch-ends"
        await _create_topic(settings, name, partitions=1)
        tp = TopicPartition(name, 0)
        producer = kafka.producer(settings, linger_ms=10)
        reader = kafka.consumer(settings, group_id=None, fetch_max_wait_ms=40)
        await producer.start()
        await reader.start()
        inside: set[int] = set()
        try:
            await producer.send_and_wait(name, b"v", partition=0)
            reader.assign([tp])
            await reader.seek_to_beginning(tp)

            async def write() -> None:
                for i in range(60):
                    sent = [await producer.send(name, b"v", partition=0)
                            for _ in range(2 + i % 5)]
                    offsets = [m.offset for m in await asyncio.gather(*sent)]
                    inside.update(offsets[1:])  # an end there leaves the batch's rest out

            writing = asyncio.create_task(write())
            fetched = []
            while not writing.done():
                await reader.getmany(tp, timeout_ms=20)
                fetched.append(reader.highwater(tp))
            await writing
        finally:
            await reader.stop()
            await producer.stop()
        return sum(end in inside for end in fetched), len(fetched)

    fetch_inside, fetches = asyncio.run(main())
    assert fetches > 10
    assert fetch_inside == 0


def test_a_partition_is_handed_on_once_its_fetched_records_are_all_handed_out(
        settings: Settings) -> None:
    """What the worker's samples wait for (``streams/app.py``, ``_getmany``): their node's
    allocations partition fetched, and every record it fetched handed out."""

    async def main() -> list[bool]:
        name = f"{settings.topic_prefix}.handed-on"
        await _create_topic(settings, name, partitions=1)
        tp = TopicPartition(name, 0)
        producer = kafka.producer(settings)
        reader = kafka.consumer(settings, group_id=None)
        await producer.start()
        await reader.start()
        seen = []
        try:
            for _ in range(5):
                await producer.send_and_wait(name, b"v", partition=0)
            reader.assign([tp])
            await reader.seek_to_beginning(tp)
            seen.append(kafka.handed_on(reader, tp))  # not fetched yet
            assert len((await reader.getmany(tp, timeout_ms=5000, max_records=2))[tp]) == 2
            seen.append(kafka.handed_on(reader, tp))  # three fetched, not handed out
            await reader.getmany(tp, timeout_ms=5000)
            seen.append(kafka.handed_on(reader, tp))
            await producer.send_and_wait(name, b"v", partition=0)
            await reader.getmany(tp, timeout_ms=5000)
            seen.append(kafka.handed_on(reader, tp))  # the new record handed out too
        finally:
            await reader.stop()
            await producer.stop()
        return seen

    assert asyncio.run(main()) == [False, False, True, True]


def test_read_all_reads_to_the_end_through_slow_fetches(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A history read on start (the executor's keys and breaker) once stopped at the first
    fetch that came back empty within 300 ms: a slow broker cut it short. Here every other
    fetch of the reader comes back empty, as a slow one's would."""
    name = f"{settings.topic_prefix}.slow"

    async def publish() -> None:
        await _create_topic(settings, name, partitions=2)
        producer = kafka.producer(settings)
        await producer.start()
        try:
            for i in range(40):
                await producer.send_and_wait(name, b"v", key=str(i).encode())
        finally:
            await producer.stop()

    asyncio.run(publish())
    fetches = 0
    getmany = AIOKafkaConsumer.getmany

    async def slow(self: AIOKafkaConsumer, *partitions: TopicPartition, timeout_ms: int = 0,
                   max_records: int | None = None) -> dict[TopicPartition, list[object]]:
        nonlocal fetches
        fetches += 1
        if fetches % 2:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        return await getmany(self, *partitions, timeout_ms=timeout_ms,
                             max_records=max_records)

    monkeypatch.setattr(AIOKafkaConsumer, "getmany", slow)
    assert len(asyncio.run(kafka.read_all(settings, name, quiet_ms=50))) == 40


def test_a_group_s_offsets_are_read_again_and_again_over_the_same_two_clients(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process reads its lag every 15 s: each reading opened a consumer and an admin
    client (connections, metadata, on a secured Kafka TLS and SASL handshakes) until they are
    kept. A reading that fails closes them, and the next one opens them again."""
    name = f"{settings.topic_prefix}.lagged"
    started: list[str] = []
    for client in (AIOKafkaConsumer, AIOKafkaAdminClient):
        def counted(self: object, start: object = client.start) -> object:
            started.append(type(self).__name__)
            return start(self)  # type: ignore[operator]
        monkeypatch.setattr(client, "start", counted)
    end_offsets = AIOKafkaConsumer.end_offsets
    fail = [False]

    async def flaky(self: AIOKafkaConsumer, partitions: list[TopicPartition]) -> object:
        if fail[0]:
            fail[0] = False
            raise ConnectionError("broker gone")
        return await end_offsets(self, partitions)

    monkeypatch.setattr(AIOKafkaConsumer, "end_offsets", flaky)

    async def main() -> tuple[list[dict[TopicPartition, tuple[int, int]]], int, int]:
        await _create_topic(settings, name, partitions=2)
        started.clear()
        readings = []
        async with kafka.GroupOffsets(settings, "g", [name]) as read:
            readings += [await read(), await read(), await read()]
            opened = len(started)
            fail[0] = True
            with pytest.raises(ConnectionError):
                await read()
            readings.append(await read())
        return readings, opened, len(started)

    readings, opened, opened_in_all = asyncio.run(main())
    idle = {TopicPartition(name, p): (0, 0) for p in (0, 1)}
    assert readings == [idle] * 4
    assert opened == 2  # one consumer and one admin client, three readings
    assert opened_in_all - opened == 2  # opened again after the failed reading only


def test_gpusteward_broker_command_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-P", "-m", "gpusteward.cli", "broker",
                                "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert f"127.0.0.1:{port}" in line
        settings = Settings(kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}"))
        asyncio.run(kafka.wait_for_broker(settings, timeout_s=5))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        # The broker child went with it: nothing listens on the port any more.
        time.sleep(0.2)
        with pytest.raises(TimeoutError):
            asyncio.run(kafka.wait_for_broker(settings, timeout_s=1))
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)


def test_gpusteward_broker_refuses_a_port_in_use() -> None:
    """Another broker (or any server) on the port: no "ready" for a broker that is not
    this one, and a non-zero exit naming the flag."""
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = subprocess.run([sys.executable, "-P", "-m", "gpusteward.cli", "broker",
                                 "--port", str(port)], capture_output=True, text=True,
                                timeout=30, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 2
    assert "ready" not in result.stdout
    output = " ".join(result.stderr.split())
    assert "Invalid value for --port" in output and f"127.0.0.1:{port} is in use" in output
    assert "Traceback" not in output


def test_an_embedded_broker_never_starts_on_a_taken_port() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port} is in use"):
            EmbeddedBroker(port).start()


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens on a port until its server starts: two containers of one demo given
    the same one would have the second fail with "address already in use"."""
    first, second = _unused_ports(2)  # fixed numbers might be taken on the machine
    draws = iter([first, first, second])
    monkeypatch.setattr("gpusteward.broker.random.randrange", lambda *_: next(draws))
    monkeypatch.setattr("gpusteward.broker._given", set())
    assert [free_port(), free_port()] == [first, second]


def _unused_ports(count: int) -> list[int]:
    """Ports nothing listens on now (the kernel's choice, each held until all are chosen)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
