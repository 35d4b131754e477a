"""Alerting: findings become notifications.

A consumer of the findings topic hands each finding to its sinks once per
(id, state): a redelivered firing finding is not announced twice. The first
sink prints to the console; Alertmanager (``alertmanager.py``) and webhooks
(``webhook.py``) plug in the same way. A sink may also have ``refresh()``,
called about every poll to re-send what must be kept alive or retried, and
``close()``, called when the consumer stops.

A record that is not a valid finding (:mod:`gpusteward.edge` says why) goes to
the dead-letter topic with the reason and its topic, partition and offset, as
every consumer's bad records do, and the consumer goes on with the next; the
refusal is counted and logged once per kind of fault. Offsets are committed
only once the batch's dead letters are on the broker: a dead letter the broker
never took fails the batch uncommitted, and it is read again (at least once).

A sink that keeps what it could not send yet (the webhook through a chat outage,
:class:`HoldingSink`) holds the commit back: each partition is committed no further than
the oldest record of a finding it still holds, so a restart reads those records again and
their messages are sent then (at least once). The consumer itself reads on, so the other
sinks (Alertmanager) get every finding as it comes; the commit moves on as soon as the
kept messages are sent, new records or not, so a restart after the outage sends nothing
twice.

``gpusteward_findings_open`` is rebuilt on start: the consumer resumes from its
committed offsets, so before it consumes it reads the whole findings topic
with a group-less reader (:func:`gpusteward.kafka.read_all`, as the executor
rebuilds its breaker) and folds it into the gauge, latest event time per id as
``gpusteward status`` folds, one fetch at a time. Nothing is delivered from that
read (the records after the committed offsets are delivered when the consumer reaches
them), but the findings it leaves open are handed to the sinks that keep alerts alive
(``restore``): the Alertmanager sink re-posts them with its next refresh, so a restart
does not let their alerts lapse.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

import msgspec
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from rich.console import Console

from gpusteward import edge, kafka, topics
from gpusteward.metrics import OpenFindings, PipelineMetrics, lag_followed, serve
from gpusteward.schema import Finding
from gpusteward.settings import Settings

log = logging.getLogger(__name__)


class AlertSink(Protocol):
    async def deliver(self, finding: Finding) -> None: ...


@runtime_checkable
class BatchingSink(Protocol):
    """A sink that takes the new findings of one consumer batch at once (one request)."""

    async def deliver_many(self, findings: list[Finding]) -> None: ...


@runtime_checkable
class RefreshingSink(Protocol):
    """A sink that keeps state alive (Alertmanager) or retries (webhook) between findings."""

    async def refresh(self, force: bool = False) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class RestoringSink(Protocol):
    """A sink that keeps open findings alive and takes them back after a restart."""

    def restore(self, findings: list[Finding]) -> None: ...


News = tuple[str, str, str]
"""What makes a finding record news to the sinks (:func:`news`)."""


def news(finding: Finding) -> News:
    """A finding record is news to the sinks once per episode (its id), state and severity:
    a redelivery is not, but an episode re-issued at another severity is (the idle rule's
    warning after its first notice: Alertmanager routes and chat are told of the
    escalation, not only of the notice)."""
    return (finding.id, finding.state, finding.severity)


@runtime_checkable
class HoldingSink(Protocol):
    """A sink that keeps findings it could not send yet (the webhook, through an outage)."""

    def holding(self) -> set[News]:
        """:func:`news` of each finding handed over and not sent yet."""
        ...


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")


class ConsoleSink:
    """Prints each finding as one line."""

    STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()

    async def deliver(self, finding: Finding) -> None:
        if finding.state == "resolved":
            self.console.print(f"[green]RESOLVED[/] {_clock(finding.ts)} {finding.kind}: "
                               f"{finding.summary}")
            return
        style = self.STYLE[finding.severity]
        self.console.print(f"[{style}]FIRING {finding.severity}[/] {_clock(finding.ts)} "
                           f"{finding.kind}: {finding.summary}")

FORGET_EVERY = 10_000
"""New findings between two passes that forget those older than the topic's retention."""


class FindingsConsumer:
    """Reads the findings topic and delivers each (id, state) once to every sink."""

    def __init__(self, settings: Settings, sinks: Sequence[AlertSink],
                 group_id: str | None = None,
                 on_finding: Callable[[Finding], None] | None = None) -> None:
        self.settings = settings
        self.sinks = list(sinks)
        self.group_id = group_id or f"{settings.topic_prefix}-alerts"
        self.on_finding = on_finding
        self.seen: dict[News, float] = {}
        """(id, state) of each finding delivered, with its event time; forgotten once older
        than the topic's retention (:meth:`_forget_old`)."""
        self._forget_at = FORGET_EVERY
        self._decode = edge.Edge[Finding](Finding)
        self._encode = msgspec.json.Encoder().encode
        self.refusals = edge.Refusals(log)
        """Records that were no valid finding: each went to the dead-letter topic."""
        self.metrics = PipelineMetrics()
        self._open = OpenFindings(self.metrics)
        self._read_at: dict[News, tuple[TopicPartition, int]] = {}
        """Where each finding handed to the sinks was read, while a :class:`HoldingSink`
        still holds it: the commit stops there."""
        self._committed: dict[TopicPartition, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        topic = topics.FINDINGS.name(self.settings)
        consumer = kafka.consumer(self.settings, topic, group_id=self.group_id)
        producer = kafka.producer(self.settings)
        port = self.settings.metrics.port
        server = serve(self.metrics.registry, port, self.settings.metrics.addr) if port else None
        records_in = self.metrics.records_in.labels(topic)
        processing = self.metrics.processing.labels("alerting")
        deliveries = kafka.Deliveries(producer)
        await self.rebuild_open(topic)
        await producer.start()
        await consumer.start()
        try:
            async with lag_followed(self.metrics, self.settings, self.group_id, [topic]):
                while not stop.is_set():
                    batch = await consumer.getmany(timeout_ms=200)
                    new: list[Finding] = []
                    for messages in batch.values():
                        for message in messages:
                            started = time.perf_counter()
                            records_in.inc()
                            await self._handle(deliveries, message.value, message.key,
                                               topic=message.topic,
                                               partition=message.partition,
                                               offset=message.offset, batch=new)
                            processing.observe(time.perf_counter() - started)
                    await self._deliver(new)
                    # The dead letters are on the broker before the offsets move past
                    # their records; one the broker refused raises here and nothing is
                    # committed.
                    await deliveries.delivered()
                    for sink in self.sinks:
                        if isinstance(sink, RefreshingSink):
                            await sink.refresh()
                    await self._commit(consumer)
        finally:
            if server is not None:
                server.stop()
            await consumer.stop()
            await producer.stop()
            for sink in self.sinks:
                if isinstance(sink, RefreshingSink):
                    await sink.close()

    async def _commit(self, consumer: AIOKafkaConsumer) -> None:
        """Commit what was read, but no further on a partition than the oldest record of a
        finding a sink still holds; only when that moved (a batch read, a kept message sent).
        """
        held: set[News] = set()
        for sink in self.sinks:
            if isinstance(sink, HoldingSink):
                held |= sink.holding()
        self._read_at = {key: at for key, at in self._read_at.items() if key in held}
        offsets = {tp: await consumer.position(tp) for tp in consumer.assignment()}
        for tp, offset in self._read_at.values():
            if tp in offsets:
                offsets[tp] = min(offsets[tp], offset)
        if offsets and offsets != self._committed:
            await consumer.commit(offsets)
            self._committed = offsets

    async def rebuild_open(self, topic: str) -> int:
        """Fold every finding on ``topic`` into the open-findings gauge; how many records.

        The topic is folded as it is read, never held (30 days of a large fleet's findings
        are hundreds of thousands of records). Then every sink that keeps alerts alive
        (:class:`RestoringSink`) is given the findings still open: the consumer resumes
        after them, and without it their alerts would lapse at Alertmanager a few minutes
        after a restart, announced as resolved while the problem lasts.

        A record that is no finding is skipped here (the consumer dead-letters it when it
        reaches it). A topic that cannot be read to its end leaves the gauge as far as it
        got, with a warning, and restores nothing: alerting matters more than the gauge.
        """
        decode = msgspec.json.Decoder(Finding).decode
        still_open: dict[str, Finding] = {}

        def fold(records: list[ConsumerRecord]) -> None:
            for record in records:
                try:
                    finding = decode(record.value or b"")
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                self._open.observe(finding.id, finding.kind, finding.severity, finding.state,
                                   finding.ts)
                if self._open.newest.get(finding.id) != finding.ts:
                    continue  # older than a record already folded for its id
                if finding.id in self._open.open:
                    still_open[finding.id] = finding
                else:
                    still_open.pop(finding.id, None)

        try:
            read = await kafka.read_each(self.settings, topic, fold)
        except TimeoutError as error:
            log.warning("open findings not rebuilt, the gauge counts from now on: %s", error)
            return 0
        for sink in self.sinks:
            if isinstance(sink, RestoringSink):
                sink.restore(list(still_open.values()))
        return read

    def _forget_old(self, now: float) -> None:
        """Forget the findings heard of longer ago than the findings topic keeps records: no
        redelivery can bring them back, and a process running for months remembered every
        finding ever seen (about 20 MB per 100,000)."""
        cutoff = now - topics.FINDINGS.retention_ms / 1000
        self.seen = {key: ts for key, ts in self.seen.items() if ts >= cutoff}
        self._open.forget_before(cutoff)
        self._forget_at = len(self.seen) + FORGET_EVERY

    async def _handle(self, producer: kafka.Sender, raw: bytes | None,
                      record_key: bytes | None = None, *, topic: str | None = None,
                      partition: int = -1, offset: int = -1,
                      batch: list[Finding] | None = None) -> None:
        """Deliver the finding of one record to every sink (or, with ``batch``, add it
        there for :meth:`_deliver`), or send the record to the dead-letter topic when it
        is no valid finding (the caller awaits its delivery before it commits past the
        record)."""
        try:
            finding = self._decode(raw, record_key)
        except edge.Rejected as error:
            source = topic or topics.FINDINGS.name(self.settings)
            why = edge.reason(error)
            self.refusals.note(edge.kind_of(error),
                               "record at %s[%d]@%d is no finding, to the dead-letter topic: %s",
                               source, partition, offset, why)
            letter = edge.dead_letter(source, partition, offset, record_key, raw, why)
            await producer.send(topics.DEADLETTER.name(self.settings), self._encode(letter),
                                key=source.encode())
            self.metrics.dead_letters.labels(source, edge.kind_of(error)).inc()
            return
        key = news(finding)
        if key in self.seen:
            return
        self.seen[key] = finding.ts
        if len(self.seen) >= self._forget_at:
            self._forget_old(finding.ts)
        self.metrics.findings.labels(finding.kind, finding.severity, finding.state).inc()
        self._open.observe(finding.id, finding.kind, finding.severity, finding.state,
                           finding.ts)
        if self.on_finding:
            self.on_finding(finding)
        if topic is not None and partition >= 0:
            self._read_at[key] = (TopicPartition(topic, partition), offset)
        if batch is not None:
            batch.append(finding)
            return
        await self._deliver([finding])

    async def _deliver(self, findings: list[Finding]) -> None:
        """Hand new findings to every sink: all at once to a :class:`BatchingSink`
        (Alertmanager: one request for a burst), one by one to the others."""
        if not findings:
            return
        for sink in self.sinks:
            if isinstance(sink, BatchingSink):
                await sink.deliver_many(findings)
                continue
            for finding in findings:
                await sink.deliver(finding)
