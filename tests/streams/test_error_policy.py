"""The worker's error policy: what one record breaks becomes that record's dead letter.

``OutputTopics.guarded`` is the one place the worker's agents turn a failure
into a dead letter. The topics here are recording doubles of Faust's (the
writer only calls ``send``): the broker path is covered by
``tests/e2e/test_poison.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from faust.types.tuples import Message as FaustMessage

from gpusteward.schema import Action, DeadLetter, Finding, HwEvent, Subject
from gpusteward.settings import Settings
from gpusteward.streams.app import NodeStates, join_batch
from gpusteward.streams.fleet import fleet_batch
from gpusteward.streams.node import NodeJoin, Output
from gpusteward.streams.outputs import OutputTopics


@dataclass
class RecordingTopic:
    name: str
    sent: list[tuple[bytes, bytes]] = field(default_factory=list)

    async def send(self, key: bytes, value: bytes) -> asyncio.Future[None]:
        self.sent.append((key, value))
        delivered = asyncio.get_running_loop().create_future()
        delivered.set_result(None)
        return delivered

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


def _held_dead_letters(app: RecordingApp) -> list[asyncio.Future[None]]:
    """Make the dead-letter topic's deliveries wait: each send's delivery is left pending
    in the returned list, for the test to complete or fail."""
    held: list[asyncio.Future[None]] = []

    async def send(key: bytes, value: bytes) -> asyncio.Future[None]:
        held.append(asyncio.get_running_loop().create_future())
        return held[-1]

    app.topic("gpusteward.deadletter.v1").send = send  # type: ignore[method-assign]
    return held


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


def test_a_batch_returns_once_its_dead_letters_are_delivered() -> None:
    """The batch's records are acknowledged after it: a dead letter the broker has not
    taken yet (or never takes: the delivery fails) must hold them, or the record is lost."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())
    deliveries = _held_dead_letters(app)

    def process(event: Any) -> list[Any]:
        raise ValueError("a rule's bug")

    async def main() -> None:
        batch = asyncio.create_task(outputs.guarded_each([Event()], "node-join", process))
        await asyncio.sleep(0.05)
        assert not batch.done()
        deliveries[0].set_exception(RuntimeError("KafkaTimeoutError"))
        with pytest.raises(RuntimeError):
            await batch

    asyncio.run(main())


def test_a_record_s_dead_letter_is_delivered_before_it_returns_or_handed_to_its_batch() -> None:
    """One record at a time (the fleet agent), a dead letter is awaited, or, given the
    batch's list, left there for the batch to await before it acknowledges its records:
    then the batch's dead letters go to the broker together."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())
    pending = _held_dead_letters(app)

    async def broken_rule(event: Any) -> list[Any]:
        raise ZeroDivisionError("a rule's bug")

    async def main() -> None:
        alone = asyncio.create_task(outputs.guarded(Event(), "fleet", broken_rule))
        await asyncio.sleep(0.05)
        assert not alone.done()
        pending[0].set_result(None)
        assert await alone is None
        batch: list[Any] = []
        assert await outputs.guarded(Event(), "fleet", broken_rule, batch) is None
        assert batch == [pending[1]] and not pending[1].done()

    asyncio.run(main())


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
        app.topics["gpusteward.findings.v1"].send = send  # type: ignore[method-assign]
        emitting = asyncio.create_task(outputs.emit_then_checkpoint([finding], None))
        await asyncio.sleep(0.05)
        waited = not emitting.done()
        assert delivered is not None
        delivered.set_result(None)
        await asyncio.wait_for(emitting, 1.0)
        return waited, emitting.done()

    assert asyncio.run(main()) == (True, True)


@dataclass
class JoinEvent:
    """A node-join event as the stream hands it over: a Faust message the conductor took a
    reference on for the stream."""

    message: Any

    def ack(self) -> None:
        self.message.ack(None)


def _xids(*offsets: int, one_device: bool = True) -> list[FaustMessage]:
    """XID events of node n1 at those offsets of a hardware-events partition, fetched by the
    consumer's generation 1, each with the conductor's reference for the stream."""
    messages = [FaustMessage("gpusteward.hw-events.v1", 0, offset, 0.0, 0, [], b"n1",
                             msgspec.json.encode(HwEvent(
                                 ts=1_763_683_200.0 + offset, node="n1", kind="xid",
                                 uuid="GPU-0" if one_device else f"GPU-{offset}", xid=79)),
                             None, generation_id=1) for offset in offsets]
    for message in messages:
        message.incref()
    return messages


def _hw_apply(states: NodeStates, join: NodeJoin) -> Callable[[dict[bytes, bytes], Any],
                                                                list[Output]]:
    """The node join's apply for hardware events."""
    def apply(writes: dict[bytes, bytes], event: JoinEvent) -> list[Output]:
        return states.apply(writes, join.on_hw_event,
                            msgspec.json.decode(event.message.value, type=HwEvent))
    return apply


class Consumer:
    """The consumer's generation, as a batch's ``current`` sees it."""

    def __init__(self) -> None:
        self.generation = 1

    def rebalance(self) -> None:
        self.generation += 1

    def current(self, events: Sequence[Any]) -> list[Any]:
        return [event for event in events if event.message.generation_id == self.generation]


def test_a_batch_stopped_mid_publish_writes_no_state_and_leaves_its_first_event_unread() -> None:
    """A worker stopped while its findings wait for room in the producer used to write the
    batch's node states anyway: they recorded an XID finding as reported that was never
    sent, and the restarted worker, reading the unacknowledged records again from those
    states, emitted nothing. Now nothing is written, and the first event (which the stream
    acknowledges as it stops) keeps a reference, so its offset is not committed either."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())
    room = asyncio.Event()

    async def full(key: bytes, value: bytes) -> None:
        await room.wait()  # the producer's buffer never frees up: the worker is stopping

    table: dict[bytes, bytes] = {}
    states, join = NodeStates(table, checkpoint_s=30.0), NodeJoin()
    (message,) = _xids(7)
    apply = _hw_apply(states, join)

    async def main() -> None:
        app.topics["gpusteward.findings.v1"].send = full  # type: ignore[method-assign,assignment]
        batch = asyncio.create_task(join_batch([JoinEvent(message)], outputs, states, apply,
                                               asyncio.Lock(), list))
        await asyncio.sleep(0.05)
        assert not batch.done()
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch

    asyncio.run(main())
    assert table == {}, "no node state says the XID finding was reported"
    JoinEvent(message).ack()  # the stream's acknowledgement as it stops
    assert not message.acked, "the first event is read again by the next worker"


def test_a_batch_a_rebalance_took_back_while_it_waited_is_left_to_the_seek() -> None:
    """The hardware agent gathers its batch, then waits for the sample agent's: a rebalance
    in between takes the events back (the seek delivers them again, perhaps to the worker
    that owns their nodes now). They are neither applied, nor written, nor acknowledged."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())
    table: dict[bytes, bytes] = {}
    states, join = NodeStates(table, checkpoint_s=30.0), NodeJoin()
    messages, consumer = _xids(7, 8), Consumer()

    async def main() -> None:
        other_agents_batch = asyncio.Lock()
        await other_agents_batch.acquire()
        batch = asyncio.create_task(join_batch([JoinEvent(m) for m in messages], outputs,
                                               states, _hw_apply(states, join),
                                               other_agents_batch, consumer.current))
        await asyncio.sleep(0.05)
        consumer.rebalance()
        other_agents_batch.release()
        await asyncio.wait_for(batch, 1.0)

    asyncio.run(main())
    assert table == {} and states.live == {}
    assert app.topics["gpusteward.findings.v1"].sent == []
    JoinEvent(messages[0]).ack()  # the stream's acknowledgement of the first
    assert not any(message.acked for message in messages)


def test_a_batch_a_rebalance_took_back_while_it_published_writes_no_state() -> None:
    """A rebalance while the batch's findings are on their way: the seek delivers the batch
    again, perhaps to the worker that owns its node now, which restored the node's state
    from the changelog. Written after that, this worker's state could overwrite the new
    owner's; so nothing is written or acknowledged, and the re-read batch publishes the
    same finding again under its id."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())
    table: dict[bytes, bytes] = {}
    states, join = NodeStates(table, checkpoint_s=30.0), NodeJoin()
    (message,), consumer = _xids(7), Consumer()
    findings = app.topic("gpusteward.findings.v1")
    send = findings.send

    async def send_then_rebalance(key: bytes, value: bytes) -> asyncio.Future[None]:
        consumer.rebalance()
        return await send(key, value)

    findings.send = send_then_rebalance  # type: ignore[method-assign]
    asyncio.run(join_batch([JoinEvent(message)], outputs, states, _hw_apply(states, join),
                           asyncio.Lock(), consumer.current))
    assert len(findings.sent) == 1, "published before the rebalance was known"
    assert table == {} and states.live == {}
    JoinEvent(message).ack()  # the stream's acknowledgement of the first
    assert not message.acked


def test_a_batch_whose_findings_are_not_delivered_leaves_everything_to_be_read_again() -> None:
    """A delivery that fails (the broker never takes the finding) ends the batch with an
    error: no node state says the finding was reported, no event of the batch is
    acknowledged (the first was, by the stream, and so lost), and the worker stops so that
    its restart reads them again (``crash_unread``, in the agent)."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())

    async def lost(key: bytes, value: bytes) -> asyncio.Future[None]:
        delivery = asyncio.get_running_loop().create_future()
        delivery.set_exception(RuntimeError("KafkaTimeoutError"))
        return delivery

    table: dict[bytes, bytes] = {}
    states, join = NodeStates(table, checkpoint_s=30.0), NodeJoin()
    messages = _xids(7, 8, one_device=False)

    async def main() -> None:
        app.topics["gpusteward.findings.v1"].send = lost  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await join_batch([JoinEvent(m) for m in messages], outputs, states,
                             _hw_apply(states, join), asyncio.Lock(), list)

    asyncio.run(main())
    assert table == {} and b"n1" not in states.live
    JoinEvent(messages[0]).ack()  # the stream's acknowledgement of the first
    assert not any(message.acked for message in messages)


def _fleet_batch_run(rebalance_at: str | None) -> tuple[list[str], list[Any], RecordingApp]:
    """A fleet batch of three queue records whose second gives a finding, with a rebalance
    (the consumer's generation moves on) while the first record is applied ("apply") or
    while the finding is published ("publish"), or none. Returns what the batch did to the
    fleet's tables (checkpoint, forget), its messages and the app."""
    app = RecordingApp()
    outputs = OutputTopics(app, Settings())
    messages = [FaustMessage("gpusteward.queue.v1", 0, offset, 0.0, 0, [], b"prod", b"{}",
                             None, generation_id=1) for offset in (7, 8, 9)]
    for message in messages:
        message.incref()
    consumer = Consumer()
    did: list[str] = []
    finding = Finding(id="f1", fingerprint="fp", kind="queue_slo_breach", severity="warning",
                      state="firing", subject=Subject(), summary="late", starts_at=1.0, ts=2.0)
    findings = app.topic("gpusteward.findings.v1")
    send = findings.send

    async def send_then_rebalance(key: bytes, value: bytes) -> asyncio.Future[None]:
        if rebalance_at == "publish":
            consumer.rebalance()
        return await send(key, value)

    findings.send = send_then_rebalance  # type: ignore[method-assign]

    async def apply(event: JoinEvent) -> list[Finding | Action]:
        did.append(f"apply {event.message.offset}")
        if rebalance_at == "apply":
            consumer.rebalance()
        return [finding] if event.message.offset == 8 else []

    asyncio.run(fleet_batch([JoinEvent(m) for m in messages], outputs, apply,
                            lambda: did.append("checkpoint"), lambda: did.append("forget"),
                            consumer.current))
    JoinEvent(messages[0]).ack()  # the stream's acknowledgement of the first
    return did, messages, app


def test_a_fleet_batch_checkpoints_after_a_finding_and_at_its_end() -> None:
    did, messages, app = _fleet_batch_run(None)
    assert did == ["apply 7", "apply 8", "checkpoint", "apply 9", "checkpoint"]
    assert all(message.acked for message in messages)
    assert len(app.topics["gpusteward.findings.v1"].sent) == 1


@pytest.mark.parametrize("rebalance_at", ["apply", "publish"])
def test_a_fleet_batch_a_rebalance_takes_back_writes_nothing_more(rebalance_at: str) -> None:
    """The fleet agent used to stage its state at a rebalance and write it with the end of
    its batch, after the new owner of the fleet partition had restored the tables from the
    changelog. Now the batch stops where the rebalance found it, forgets what it changed,
    and leaves its records (the first too) to the rebalance's seek."""
    did, messages, app = _fleet_batch_run(rebalance_at)
    if rebalance_at == "apply":
        assert did == ["apply 7", "forget"]
    else:
        assert did == ["apply 7", "apply 8", "forget"]
        assert len(app.topics["gpusteward.findings.v1"].sent) == 1
    assert not any(message.acked for message in messages)
