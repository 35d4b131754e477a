"""The executor dead-letters an action it cannot handle instead of crashing on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gpusteward.remediation.executor import Executor, NoBackend
from gpusteward.schema import DeadLetter
from gpusteward.settings import Settings


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
