"""The executor dead-letters an action it cannot handle instead of crashing on it, and what it
says of an action never stops it."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError
from rich.console import Console

from gpusteward import kafka, topics
from gpusteward.edge import Edge
from gpusteward.remediation.executor import FORGET_EVERY, Executor, NoBackend, ReviewPrinter
from gpusteward.schema import TEXT_MAX, Action, ActionResult, DeadLetter, Subject
from gpusteward.settings import Settings
from tests.remediation.cluster import publish_actions


@dataclass
class RecordingProducer:
    sent: list[tuple[str, bytes]] = field(default_factory=list)

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.sent.append((topic, value))


def test_the_executor_dead_letters_an_action_whose_handling_raises() -> None:
    executor = Executor(Settings(), NoBackend())

    async def decide(action: Any, on_attempt: Any = None) -> Any:
        raise KeyError("a bug in deciding")

    executor.decide = decide  # type: ignore[method-assign]
    producer = RecordingProducer()
    action = (b'{"idempotency_key":"k","verb":"cordon","target":{"node":"n1"},"reason":"r",'
              b'"rule":"ecc","finding_ids":["f"],"ts":1763683200.0}')
    result = asyncio.run(executor._handle(producer, action, key=b"n1", partition=0, offset=5,
                                          topic="gpusteward.actions.v1"))
    assert result is None
    ((topic, value),) = producer.sent
    letter = msgspec.json.decode(value, type=DeadLetter)
    assert topic == "gpusteward.deadletter.v1" and letter.offset == 5
    assert letter.error == "executor: KeyError: 'a bug in deciding'"


def test_an_action_whose_names_read_as_markup_is_audited_and_shown() -> None:
    """The review printer once put the rule into Rich markup unescaped: a rule named ``x[/]``
    raised after the audit record was sent and before the offset was committed, so the
    executor crashed on the same action after every restart."""
    shown = io.StringIO()
    executor = Executor(Settings(), NoBackend(),
                        on_result=ReviewPrinter(Console(file=shown, width=200)))
    producer = RecordingProducer()
    action = (b'{"idempotency_key":"k","verb":"cordon","target":{"node":"n[/]1"},'
              b'"reason":"r","rule":"x[/]","finding_ids":["f"],"ts":1763683200.0}')
    result = asyncio.run(executor._handle(producer, action, key=b"n1", partition=0, offset=5,
                                          topic="gpusteward.actions.v1"))
    assert result is not None and result.outcome == "dry_run"
    assert [topic for topic, _ in producer.sent] == ["gpusteward.action-results.v1"]
    assert "rule=x[/]" in shown.getvalue() and "n[/]1" in shown.getvalue()

    def broken(_action: Action, _result: ActionResult) -> None:
        raise RuntimeError("a terminal gone")

    executor.on_result = broken
    again = asyncio.run(executor._handle(producer, action, key=b"n1", partition=0, offset=6,
                                         topic="gpusteward.actions.v1"))
    assert again is not None, "a display that fails does not stop the executor"


def test_an_audit_record_of_the_longest_reason_stays_readable() -> None:
    """A dry run's detail is the action's reason in words: with a reason at the schema's
    limit it passed the limit, and every reader of the audit topic (the executor's own
    history, status, the report) refused the record as if the decision were unaudited."""
    executor = Executor(Settings(), NoBackend())
    action = Action(idempotency_key="k", verb="cordon", target=Subject(node="n1"),
                    reason="r" * TEXT_MAX, rule="ecc_dbe", finding_ids=["f"], ts=1.0)
    result = asyncio.run(executor.decide(action))
    assert result.outcome == "dry_run" and result.detail.endswith("more characters)")
    read_back = Edge[ActionResult](ActionResult)(msgspec.json.encode(result), b"k")
    assert read_back == result


@pytest.mark.e2e
def test_an_action_is_committed_past_only_once_its_audit_record_is_delivered(
        settings: Settings, monkeypatch: pytest.MonkeyPatch,
        broker_refuses_records: Callable[[str], None]) -> None:
    """aiokafka's ``flush()`` does not raise for a record the broker never took: the
    executor once committed past an action whose audit record was lost that way, so the
    decision was neither audited nor taken again."""
    asyncio.run(kafka.ensure_topics(settings))
    action = Action(idempotency_key="f1/cordon", verb="cordon", target=Subject(node="gpu-1"),
                    reason="ECC DBE on GPU-1", rule="ecc_dbe", finding_ids=["f1"], ts=1000.0)

    asyncio.run(publish_actions(settings, action))
    broker_refuses_records("the audit record")
    with pytest.raises(KafkaTimeoutError):
        asyncio.run(asyncio.wait_for(
            Executor(settings, NoBackend(), group_id="executor").run(asyncio.Event()), 60))
    partition = TopicPartition(topics.ACTIONS.name(settings), 0)
    assert asyncio.run(kafka.committed(settings, "executor", [partition])) == {partition: -1}

    monkeypatch.undo()
    stop = asyncio.Event()
    decided: list[ActionResult] = []

    def on_result(_action: Action, result: ActionResult) -> None:
        decided.append(result)
        stop.set()

    asyncio.run(asyncio.wait_for(Executor(settings, NoBackend(), group_id="executor",
                                          on_result=on_result).run(stop), 60))
    assert [result.idempotency_key for result in decided] == ["f1/cordon"]
    [record] = asyncio.run(kafka.read_all(settings, topics.ACTION_RESULTS.name(settings)))
    audited = msgspec.json.decode(record.value or b"", type=ActionResult)
    assert (audited.idempotency_key, audited.outcome) == ("f1/cordon", "dry_run")


def test_a_long_running_executor_remembers_the_keys_its_audit_topic_keeps_not_more() -> None:
    """An executor up for years held every idempotency key it ever decided (about 215
    bytes each); a restarted one knows what the audit topic keeps (a year). It forgets
    what the topic no longer keeps, and still skips a redelivery of any key it keeps."""
    executor = Executor(Settings(), NoBackend())
    hour, decisions = 3600.0, 3 * 365 * 24  # one executed cordon an hour for three years
    for n in range(decisions):
        executor.apply_audit(ActionResult(
            idempotency_key=f"finding-{n}/cordon", verb="cordon",
            target=Subject(node=f"n{n % 100}"), outcome="executed", detail="", actor="x",
            ts=n * hour))
    year = topics.ACTION_RESULTS.retention_ms / 1000 / hour
    assert len(executor.executed_keys) <= year + FORGET_EVERY
    assert len(executor.decided) <= year + FORGET_EVERY
    last = Action(idempotency_key=f"finding-{decisions - 1}/cordon", verb="cordon",
                  target=Subject(node="n1"), reason="r", rule="ecc_dbe", finding_ids=["f"],
                  ts=decisions * hour)
    assert executor.verdict(last, now=decisions * hour) == (
        "skipped", "already executed (redelivered action)")
