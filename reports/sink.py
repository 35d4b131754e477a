"""The rollup sink: the rollups topic into the Parquet store the weekly report reads.

The same sink, given the queue topic, keeps the queue events the report's
wait-time section reads (:func:`queue_sink`); given the findings topic, the
findings its idle-holder and findings sections read (:func:`findings_sink`); given
the executor's audit topic, the results that say whether a reclaim was carried
out (:func:`results_sink`).

Rows are buffered and written as one file per day folder when the buffer
holds ``flush_rows`` rows, when ``flush_interval_s`` has passed, and on
stop. Offsets are committed only after the file is in place, so a crash
replays the unwritten records (at-least-once). Repeats are dropped twice
over: the sink skips a record whose name it has seen in the last
``dedup_window_s`` of event time (a rollup is named by device, minute,
holding pod and the node's clock: a shared GPU has a row per holder, and a node
whose clock stepped back names minutes again on its new clock; a
queue event by workload, state and time: the worker re-publishes the same
names after a crash), and the store's readers keep one row per name, which
covers a sink restarted in between. A record refused at the edge
(:mod:`gpusteward.edge`: not the payload, out of bounds) goes to the
dead-letter topic with the reason, never silently away: one such row would
otherwise fail every Parquet write. Writing runs in a thread so the consumer
keeps heart-beating while Parquet compresses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import msgspec
import polars as pl
from aiokafka import AIOKafkaProducer

from gpusteward import edge, kafka, topics
from gpusteward.metrics import PipelineMetrics, lag_followed, serve
from gpusteward.reports import compute, findings, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.schema import ActionResult, Finding, QueueEvent, Rollup
from gpusteward.settings import Settings

log = logging.getLogger(__name__)


class RollupSink:
    """Consumes ``rollups.v1`` (or another topic) and appends it to a Parquet store."""

    def __init__(self, settings: Settings, report: ReportSettings | None = None,
                 directory: Path | None = None, group_id: str = "gpusteward-rollup-sink",
                 spec: topics.TopicSpec = topics.ROLLUPS, payload: type[Any] = Rollup,
                 to_frame: Callable[[list[Any]], pl.DataFrame] = store.frame,
                 schema: dict[str, Any] | None = None,
                 name: Callable[[Any], Hashable] = lambda r: (r.uuid, r.ts, r.namespace,
                                                              r.pod, r.clock),
                 dedup_window_s: float = 3600.0) -> None:
        self.settings = settings
        self.report = report or ReportSettings()
        self.directory = directory or self.report.rollup_dir
        self.group_id = group_id
        self.spec = spec
        self.to_frame = to_frame
        self.schema = schema or store.STORED
        self.buffer: list[Any] = []
        self.files_written = 0
        self.rows_written = 0
        self.dead_lettered = 0
        self.duplicates = 0
        self.name = name
        self.dedup_window_s = dedup_window_s
        self._seen: dict[Hashable, float] = {}
        """Names of the records taken in the dedup window, with their event time."""
        self.refusals = edge.Refusals(log)
        """Records dead-lettered, by kind."""
        self._decode = edge.Edge[Any](payload)
        self._encode = msgspec.json.Encoder().encode
        self.metrics = PipelineMetrics()
        self._prices: dict[str, float] = {}
        self._geometries: dict[str, mig_geometry.Geometry] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        topic = self.spec.name(self.settings)
        consumer = kafka.consumer(self.settings, topic, group_id=self.group_id)
        producer = kafka.producer(self.settings)
        port = self.settings.metrics.port
        server = serve(self.metrics.registry, port, self.settings.metrics.addr) if port else None
        records_in = self.metrics.records_in.labels(topic)
        await consumer.start()
        await producer.start()
        last_flush = time.monotonic()
        try:
            async with lag_followed(self.metrics, self.settings, self.group_id, [topic]):
                while not stop.is_set():
                    batch = await consumer.getmany(timeout_ms=200)
                    for messages in batch.values():
                        for message in messages:
                            records_in.inc()
                            try:
                                self._take(self._decode(message.value, message.key))
                            except edge.Rejected as error:
                                self.refusals.note(edge.kind_of(error),
                                                   "record at %s[%d]@%d is refused: %s",
                                                   message.topic, message.partition,
                                                   message.offset, error)
                                await self._dead_letter(producer, message.topic,
                                                        message.partition, message.offset,
                                                        message.key, message.value, error)
                    due = time.monotonic() - last_flush >= self.report.flush_interval_s
                    flushed = False
                    if len(self.buffer) >= self.report.flush_rows or (due and self.buffer):
                        await self._flush()
                        last_flush, flushed = time.monotonic(), True
                    # Commit only what is on disk: with rows still buffered, wait for their file.
                    if (batch or flushed) and not self.buffer:
                        await consumer.commit()
            if self.buffer:
                await self._flush()
                await consumer.commit()
        finally:
            if server is not None:
                server.stop()
            await producer.stop()
            await consumer.stop()

    def _take(self, record: Any) -> None:
        name = self.name(record)
        if name in self._seen:
            self.duplicates += 1
            return
        self._seen[name] = record.ts
        self.buffer.append(record)

    def _forget_before(self, ts: float) -> None:
        self._seen = {name: seen for name, seen in self._seen.items() if seen >= ts}

    async def _flush(self) -> None:
        rows, self.buffer = self.buffer, []
        newest = max(r.ts for r in rows)
        try:
            written = await asyncio.to_thread(store.write, self.directory, self.to_frame(rows),
                                              self.schema)
        except BaseException:
            self.buffer = rows + self.buffer  # nothing lost: retried at the next flush
            raise
        self.files_written += len(written)
        self.rows_written += len(rows)
        self._forget_before(newest - self.dedup_window_s)
        topic = self.spec.name(self.settings)
        self.metrics.sink_rows.labels(topic).inc(len(rows))
        self.metrics.sink_bytes.labels(topic).inc(sum(path.stat().st_size for path in written))
        self._count_gpu_time(rows)
        removed = await asyncio.to_thread(store.apply_retention, self.directory,
                                          self.report.retention_days, newest)
        if removed:
            log.info("retention removed %s", ", ".join(p.name for p in removed))

    def _count_gpu_time(self, rows: list[Any]) -> None:
        """GPU-seconds allocated, busy and idle per pool and team, and the idle time's cost.

        A rollup is one device-minute; a pod on it makes it allocated, and its peak
        activity below the report's idle threshold makes it idle (the report's own test).
        """
        for row in rows:
            if not isinstance(row, Rollup) or row.pod is None:
                continue
            seconds = 60.0 * row.gpu_fraction
            team = row.team or row.namespace or "unknown"
            idle = row.util_max is not None and row.util_max < self.report.idle_threshold_pct
            self.metrics.gpu_seconds.labels(row.model, team, "allocated").inc(seconds)
            self.metrics.gpu_seconds.labels(row.model, team, "idle" if idle else "busy"
                                            ).inc(seconds)
            if idle:
                self.metrics.idle_cost.labels(row.model, team).inc(
                    self._hourly_usd(row.model) * seconds / 3600)

    def _hourly_usd(self, model: str) -> float:
        """The report's price of ``model`` (driver names mapped as the report maps them)."""
        price = self._prices.get(model)
        if price is None:
            if self._geometries is None:
                self._geometries = mig_geometry.load()
            canonical = compute.canonical_models([model], self.report, self._geometries)[model]
            price = self._prices[model] = self.report.hourly_usd(canonical)
        return price

    async def _dead_letter(self, producer: AIOKafkaProducer, topic: str, partition: int,
                           offset: int, key: bytes | None, value: bytes | None,
                           error: edge.Rejected) -> None:
        record = edge.dead_letter(topic, partition, offset, key, value, str(error))
        await producer.send_and_wait(
            topics.DEADLETTER.name(self.settings), self._encode(record), key=topic.encode())
        self.dead_lettered += 1
        self.metrics.dead_letters.labels(topic, edge.kind_of(error)).inc()


def queue_sink(settings: Settings, report: ReportSettings | None = None,
               directory: Path | None = None) -> RollupSink:
    """A sink of the queue topic into the queue-event store."""
    report = report or ReportSettings()
    return RollupSink(settings, report, directory=directory or report.queue_dir,
                      group_id=f"{settings.topic_prefix}-queue-sink", spec=topics.QUEUE,
                      payload=QueueEvent, to_frame=store.queue_frame, schema=store.QUEUE_SCHEMA,
                      name=lambda e: (e.namespace, e.name, e.state, e.ts))


def rollup_sink(settings: Settings, report: ReportSettings | None = None,
                directory: Path | None = None) -> RollupSink:
    """A sink of the rollups topic into the rollup store."""
    return RollupSink(settings, report, directory=directory,
                      group_id=f"{settings.topic_prefix}-rollup-sink")


def findings_sink(settings: Settings, report: ReportSettings | None = None,
                  directory: Path | None = None) -> RollupSink:
    """A sink of the findings topic into the findings store.

    A finding's id names its episode; each ladder step and the resolution is a new
    record of it at a new time, so (id, state, ts) names one record.
    """
    report = report or ReportSettings()
    return RollupSink(settings, report, directory=directory or report.findings_dir,
                      group_id=f"{settings.topic_prefix}-findings-sink", spec=topics.FINDINGS,
                      payload=Finding, to_frame=findings.frame, schema=findings.SCHEMA,
                      name=lambda f: (f.id, f.state, f.ts))


def results_sink(settings: Settings, report: ReportSettings | None = None,
                 directory: Path | None = None) -> RollupSink:
    """A sink of the executor's audit topic into the action-result store.

    Every decision and every retried attempt is a record of its action's idempotency
    key, so (key, outcome, attempt, ts) names one record.
    """
    report = report or ReportSettings()
    return RollupSink(settings, report, directory=directory or report.results_dir,
                      group_id=f"{settings.topic_prefix}-results-sink",
                      spec=topics.ACTION_RESULTS, payload=ActionResult,
                      to_frame=findings.result_frame, schema=findings.RESULT_SCHEMA,
                      name=lambda r: (r.idempotency_key, r.outcome, r.attempt, r.ts))
