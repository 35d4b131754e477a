"""The worker's error policy: what one record breaks becomes that record's dead letter.

``OutputTopics.guarded`` is the one place the worker's agents turn a failure
into a dead letter. The topics here are recording doubles of Faust's (the
writer only calls ``send``): the broker path is covered by
``tests/e2e/test_poison.py``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from gpusteward.schema import DeadLetter, Finding, Subject
from gpusteward.settings import Settings
from gpusteward.streams.outputs import OutputTopics


@dataclass
class RecordingTopic:
    name: str
    sent: list[tuple[bytes, bytes]] = field(default_factory=list)

    async def send(self, key: bytes, value: bytes) -> None:
        self.sent.append((key, value))

    def get_topic_name(self) -> str:
        return self.name


class RecordingApp:
    """What the one writer uses of a Faust app: topics, the app id, the rebalance signal."""

    def __init__(self) -> None:
        self.topics: dict[str, RecordingTopic] = {}
        self.conf = SimpleNamespace(id="test-worker")
        self.on_partitions_assigned = SimpleNamespace(connect=lambda receiver: None)

    def topic(self, name: str, **options: Any) -> RecordingTopic:
        return self.topics.setdefault(name, RecordingTopic(name))


@dataclass
class Message:
    topic: str = "gpusteward.samples.v1"
    partition: int = 3
    offset: int = 41
    key: bytes | None = b"n1"
    value: bytes | None = b'{"ts": 1}'


@dataclass
class Event:
    message: Message = field(default_factory=Message)


def _dead(app: RecordingApp) -> list[DeadLetter]:
    return [msgspec.json.decode(value, type=DeadLetter)
            for _, value in app.topics["gpusteward.deadletter.v1"].sent]


def test_a_failure_in_processing_dead_letters_the_record_and_the_agent_goes_on() -> None:
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())

    async def broken_rule(event: Any) -> list[Any]:
        raise ZeroDivisionError("a rule's bug")

    async def fine(event: Any) -> list[Any]:
        return ["ok"]

    async def main() -> list[Any]:
        return [await outputs.guarded(Event(), "node-join", broken_rule),
                await outputs.guarded(Event(Message(offset=42)), "node-join", fine)]

    assert asyncio.run(main()) == [None, ["ok"]]
    (letter,) = _dead(app)
    assert (letter.source_topic, letter.partition, letter.offset) == \
        ("gpusteward.samples.v1", 3, 41)
    assert letter.error == "node-join: ZeroDivisionError: a rule's bug"
    assert letter.key == b"n1" and letter.value == b'{"ts": 1}'
    assert outputs.refusals.count == 1


def test_cancellation_is_never_taken_for_a_bad_record() -> None:
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())

    async def cancelled(event: Any) -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(outputs.guarded(Event(), "fleet", cancelled))
    assert _dead(app) == []


def test_a_batch_dead_letters_only_its_failing_records_and_keeps_the_others_in_order() -> None:
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())

    def process(event: Any) -> list[Any]:
        if event.message.offset == 42:
            raise ValueError("a rule's bug")
        return [event.message.offset]

    events = [Event(Message(offset=offset)) for offset in (41, 42, 43)]
    assert asyncio.run(outputs.guarded_each(events, "node-join", process)) == [41, 43]
    (letter,) = _dead(app)
    assert letter.offset == 42 and letter.error == "node-join: ValueError: a rule's bug"


def test_a_batch_lets_cancellation_through() -> None:
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())

    def cancelled(event: Any) -> list[Any]:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(outputs.guarded_each([Event()], "node-join", cancelled))
    assert _dead(app) == []


def test_findings_are_delivered_before_the_batch_goes_on_even_with_no_checkpoint() -> None:
    """A batch's records are acknowledged once ``emit_then_checkpoint`` returns: it waits for
    its findings' delivery whether or not a node state is to be written (a batch whose
    other record failed and took its node's checkpoint with it once returned at once)."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())
    delivered: asyncio.Future[None] | None = None

    async def send(key: bytes, value: bytes) -> asyncio.Future[None]:
        nonlocal delivered
        delivered = asyncio.get_running_loop().create_future()
        return delivered

    finding = Finding(id="f1", fingerprint="fp", kind="xid", severity="critical",
                      state="firing", subject=Subject(node="n1"), summary="XID 79",
                      starts_at=1.0, ts=1.0)

    async def main() -> tuple[bool, bool]:
        app.topics["gpusteward.findings.v1"].send = send  # type: ignore[method-assign,assignment]
        emitting = asyncio.create_task(outputs.emit_then_checkpoint([finding], None))
        await asyncio.sleep(0.05)
        waited = not emitting.done()
        assert delivered is not None
        delivered.set_result(None)
        await asyncio.wait_for(emitting, 1.0)
        return waited, emitting.done()

    assert asyncio.run(main()) == (True, True)
