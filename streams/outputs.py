"""What the worker's agents publish: findings, actions, node summaries, rollups, dead letters.

Both the node join and the fleet agent publish the same payloads with the
same keys (findings by fingerprint, actions by subject, summaries and
rollups by node, dead letters by source topic), so they share this one writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from gpusteward import topics
from gpusteward.schema import Action, DeadLetter, Finding, NodeSummary, Rollup, Subject
from gpusteward.settings import Settings

log = logging.getLogger(__name__)


def raw_topic(app: Any, *names: str, partitions: int) -> Any:
    """A Faust topic of raw bytes: payloads are msgspec JSON, decoded by the agents."""
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw",
                     value_serializer="raw", partitions=partitions)


def subject_key(target: Subject) -> str:
    """The key of an action: its node, else its pod, else its queue."""
    if target.node:
        return target.node
    if target.pod:
        return f"{target.pod.namespace}/{target.pod.name}"
    return target.queue or ""


class OutputTopics:
    """The output topics of one worker app."""

    def __init__(self, app: Any, settings: Settings) -> None:
        def topic(spec: topics.TopicSpec) -> Any:
            return raw_topic(app, spec.name(settings), partitions=spec.partition_count(settings))

        self._findings = topic(topics.FINDINGS)
        self._actions = topic(topics.ACTIONS)
        self._summaries = topic(topics.NODE_SUMMARIES)
        self._rollups = topic(topics.ROLLUPS)
        self._deadletter = topic(topics.DEADLETTER)
        self._encode = msgspec.json.Encoder().encode

    async def publish(self, outputs: Sequence[Finding | Action | NodeSummary | Rollup]
                      ) -> None:
        for output in outputs:
            value = self._encode(output)
            if isinstance(output, NodeSummary):
                await self._summaries.send(key=output.node.encode(), value=value)
            elif isinstance(output, Rollup):
                await self._rollups.send(key=output.node.encode(), value=value)
            elif isinstance(output, Finding):
                await self._findings.send(key=output.fingerprint.encode(), value=value)
            else:
                await self._actions.send(key=subject_key(output.target).encode(), value=value)

    async def dead_letter(self, event: Any, error: Exception) -> None:
        """Keep a record that could not be processed, whole, with the reason and position."""
        message = event.message
        reason = f"{type(error).__name__}: {str(error)[:500]}"
        log.warning("dead-lettered %s[%d]@%d: %s", message.topic, message.partition,
                    message.offset, reason)
        record = DeadLetter(source_topic=message.topic, partition=message.partition,
                            offset=message.offset, error=reason, ts=time.time(),
                            key=message.key, value=message.value)
        await self._deadletter.send(key=message.topic.encode(), value=self._encode(record))
