"""The alert sink sends what is no valid finding to the dead-letter topic, with the reason and
where it was read, and goes on; it commits past such a record only once its dead letter is
on the broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError

from gpusteward import kafka, topics
from gpusteward.alerting import consumer as consumer_module
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.schema import DeadLetter, Finding, Subject
from gpusteward.settings import Settings

T0 = 1_763_683_200.0


def finding(finding_id: str) -> Finding:
    return Finding(id=finding_id, fingerprint="f", kind="ecc_dbe", severity="critical",
                   state="firing", subject=Subject(node="n1"), summary="x",
                   starts_at=T0, ts=T0)


@dataclass
class RecordingProducer:
    sent: list[tuple[str, bytes | None, bytes]] = field(default_factory=list)

    async def send(self, topic: str, value: bytes, key: bytes | None = None
                   ) -> asyncio.Future[None]:
        self.sent.append((topic, key, value))
        delivered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        delivered.set_result(None)
        return delivered


def test_every_kind_of_bad_record_is_dead_lettered_with_its_reason() -> None:
    delivered: list[Finding] = []
    consumer = FindingsConsumer(Settings(), [], on_finding=delivered.append)
    producer = RecordingProducer()
    valid = msgspec.json.encode(finding("f-1"))
    bad = [b"", b"{", valid.replace(b'"schema":1', b'"schema":99'),
           b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}"]

    async def main() -> None:
        for offset, raw in enumerate([*bad, valid]):
            await consumer._handle(producer, raw, b"f", topic="gpusteward.findings.v1",
                                   partition=0, offset=offset)

    asyncio.run(main())
    assert delivered == [finding("f-1")]
    assert consumer.refusals.count == 4
    assert {(topic, key) for topic, key, _ in producer.sent} == {
        ("gpusteward.deadletter.v1", b"gpusteward.findings.v1")}
    letters = [msgspec.json.decode(value, type=DeadLetter) for _, _, value in producer.sent]
    assert [(letter.offset, letter.value, letter.key) for letter in letters] == [
        (offset, raw, b"f") for offset, raw in enumerate(bad)]
    assert [letter.error.split(":")[0] for letter in letters] == [
        "empty value", "malformed", "invalid", "JSON nests deeper than 64 levels"]
    assert "unknown schema version" in letters[2].error


async def publish(settings: Settings, values: list[bytes]) -> None:
    producer = kafka.producer(settings)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topics.FINDINGS.name(settings), value, key=b"f")
    finally:
        await producer.stop()


async def consume_all(consumer: FindingsConsumer) -> None:
    """Run ``consumer`` until its group has committed past every record of the findings
    topic, then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await kafka.wait_consumed(consumer.settings, consumer.group_id,
                                  [topics.FINDINGS.name(consumer.settings)], timeout_s=60)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@pytest.mark.e2e
def test_the_alert_sink_dead_letters_what_is_no_finding_and_goes_on(settings: Settings
                                                                     ) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    not_json, wrong_shape = b"{not json", b'{"id":"f-3","state":"firing"}'
    asyncio.run(publish(settings, [msgspec.json.encode(finding("f-1")), not_json, wrong_shape,
                                   msgspec.json.encode(finding("f-2"))]))
    delivered: list[Finding] = []
    consumer = FindingsConsumer(settings, [], on_finding=delivered.append)
    asyncio.run(consume_all(consumer))

    assert delivered == [finding("f-1"), finding("f-2")]
    source = topics.FINDINGS.name(settings)
    records = asyncio.run(kafka.read_all(settings, topics.DEADLETTER.name(settings)))
    assert [record.key for record in records] == [source.encode()] * 2
    letters = [msgspec.json.decode(record.value or b"", type=DeadLetter) for record in records]
    assert [(letter.source_topic, letter.partition, letter.offset, letter.value)
            for letter in letters] == [(source, 0, 1, not_json), (source, 0, 2, wrong_shape)]
    assert letters[0].error.startswith("malformed: JSON is malformed")
    assert letters[1].error.startswith("invalid: Object missing required field")
    registry = consumer.metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("gpusteward_records_in_total", topic=source) == 4
    assert value("gpusteward_dead_letters_total", topic=source, reason="malformed") == 1
    assert value("gpusteward_dead_letters_total", topic=source, reason="invalid") == 1


@pytest.mark.e2e
def test_a_bad_record_is_committed_past_only_once_its_dead_letter_is_delivered(
        settings: Settings, monkeypatch: pytest.MonkeyPatch,
        broker_refuses_records: Callable[[str], None]) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    asyncio.run(publish(settings, [b"{not json", msgspec.json.encode(finding("f-1"))]))
    group = f"{settings.topic_prefix}-alerts"
    partition = TopicPartition(topics.FINDINGS.name(settings), 0)
    broker_refuses_records("the dead letter")
    with pytest.raises(KafkaTimeoutError):
        asyncio.run(asyncio.wait_for(FindingsConsumer(settings, []).run(asyncio.Event()), 60))
    assert asyncio.run(kafka.committed(settings, group, [partition])) == {partition: -1}

    monkeypatch.undo()
    delivered: list[Finding] = []
    asyncio.run(consume_all(FindingsConsumer(settings, [], on_finding=delivered.append)))
    assert delivered == [finding("f-1")]
    [record] = asyncio.run(kafka.read_all(settings, topics.DEADLETTER.name(settings)))
    letter = msgspec.json.decode(record.value or b"", type=DeadLetter)
    assert (letter.offset, letter.value) == (0, b"{not json")


def test_findings_older_than_the_topic_keeps_are_forgotten_and_the_rest_still_delivered_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-running alerts process remembers only what redelivery can bring back: the
    findings of the topic's retention (30 days), and every finding still open."""
    monkeypatch.setattr(consumer_module, "FORGET_EVERY", 1)  # a pass per new finding
    delivered: list[Finding] = []
    consumer = FindingsConsumer(Settings(), [], on_finding=delivered.append)
    day = 86_400.0

    def at(finding_id: str, ts: float, state: str = "firing") -> bytes:
        return msgspec.json.encode(msgspec.structs.replace(
            finding(finding_id), ts=ts, state=state))

    records = [at("old-closed", T0), at("old-closed", T0 + 60, "resolved"),
               at("old-open", T0), at("recent", T0 + 20 * day),
               at("new", T0 + 40 * day), at("recent", T0 + 20 * day)]  # redelivered

    async def main() -> None:
        for offset, raw in enumerate(records):
            await consumer._handle(RecordingProducer(), raw, b"f",
                                   topic="gpusteward.findings.v1", partition=0, offset=offset)

    asyncio.run(main())
    assert [(f.id, f.state) for f in delivered] == [
        ("old-closed", "firing"), ("old-closed", "resolved"), ("old-open", "firing"),
        ("recent", "firing"), ("new", "firing")]
    assert {key[:2] for key in consumer.seen} == {("recent", "firing"), ("new", "firing")}
    assert set(consumer._open.newest) == {"old-open", "recent", "new"}
    assert set(consumer._open.open) == {"old-open", "recent", "new"}
