"""Alerting: findings become notifications.

A consumer of the findings topic hands each finding to its sinks once per
(id, state): a redelivered firing finding is not announced twice. The first
sink prints to the console; Alertmanager (``alertmanager.py``) and webhooks
(``webhook.py``) plug in the same way. A sink may also have ``refresh()``,
called about every poll to re-send what must be kept alive or retried, and
``close()``, called when the consumer stops.

A record that is not a valid finding (:mod:`gpusteward.edge` says why) is
counted and skipped, logged once per kind of fault: it would fail again on
every redelivery, and the worker that wrote it dead-letters its own inputs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

from rich.console import Console

from gpusteward import edge, kafka, topics
from gpusteward.metrics import OpenFindings, PipelineMetrics, observe_lag, serve
from gpusteward.schema import Finding
from gpusteward.settings import Settings

log = logging.getLogger(__name__)


class AlertSink(Protocol):
    async def deliver(self, finding: Finding) -> None: ...


@runtime_checkable
class RefreshingSink(Protocol):
    """A sink that keeps state alive (Alertmanager) or retries (webhook) between findings."""

    async def refresh(self, force: bool = False) -> None: ...

    async def close(self) -> None: ...


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


class FindingsConsumer:
    """Reads the findings topic and delivers each (id, state) once to every sink."""

    def __init__(self, settings: Settings, sinks: Sequence[AlertSink],
                 group_id: str | None = None,
                 on_finding: Callable[[Finding], None] | None = None) -> None:
        self.settings = settings
        self.sinks = list(sinks)
        self.group_id = group_id or f"{settings.topic_prefix}-alerts"
        self.on_finding = on_finding
        self.seen: set[tuple[str, str]] = set()
        self._decode = edge.Edge[Finding](Finding)
        self.refusals = edge.Refusals(log)
        """Records that were no valid finding."""
        self.metrics = PipelineMetrics()
        self._open = OpenFindings(self.metrics)

    async def run(self, stop: asyncio.Event) -> None:
        topic = topics.FINDINGS.name(self.settings)
        consumer = kafka.consumer(self.settings, topic, group_id=self.group_id)
        port = self.settings.metrics.port
        server = serve(self.metrics.registry, port, self.settings.metrics.addr) if port else None
        records_in = self.metrics.records_in.labels(topic)
        processing = self.metrics.processing.labels("alerting")
        await consumer.start()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for messages in batch.values():
                    for message in messages:
                        started = time.perf_counter()
                        records_in.inc()
                        await self._handle(message.value, message.key)
                        processing.observe(time.perf_counter() - started)
                if batch:
                    await consumer.commit()
                await observe_lag(self.metrics, consumer, self.group_id)
                for sink in self.sinks:
                    if isinstance(sink, RefreshingSink):
                        await sink.refresh()
        finally:
            if server is not None:
                server.stop()
            await consumer.stop()
            for sink in self.sinks:
                if isinstance(sink, RefreshingSink):
                    await sink.close()

    async def _handle(self, raw: bytes | None, record_key: bytes | None = None) -> None:
        try:
            finding = self._decode(raw, record_key)
        except edge.Rejected as error:
            self.refusals.note(edge.kind_of(error), "skipping a record that is no finding: %s",
                               edge.reason(error))
            return
        key = (finding.id, finding.state)
        if key in self.seen:
            return
        self.seen.add(key)
        self.metrics.findings.labels(finding.kind, finding.severity, finding.state).inc()
        self._open.observe(finding.id, finding.kind, finding.severity, finding.state,
                           finding.ts)
        if self.on_finding:
            self.on_finding(finding)
        for sink in self.sinks:
            await sink.deliver(finding)
