"""The rollup sink: the rollups topic into the Parquet store the weekly report reads.

The same sink, given the queue topic, keeps the queue events the report's
wait-time section reads (:func:`queue_sink`).

Rows are buffered and written as one file per day folder when the buffer
holds ``flush_rows`` rows, when ``flush_interval_s`` has passed, and on
stop. Offsets are committed only after the file is in place, so a crash
replays the unwritten records (at-least-once; the store's readers drop the
repeats). A record refused at the edge (:mod:`gpusteward.edge`: not the
payload, out of bounds) goes to the dead-letter topic with the reason, never
silently away: one such row would otherwise fail every Parquet write.
Writing runs in a thread so the consumer keeps heart-beating while Parquet
compresses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import polars as pl

from gpusteward import edge, kafka, topics
from gpusteward.reports import store
from gpusteward.reports.settings import ReportSettings
from gpusteward.schema import QueueEvent, Rollup
from gpusteward.settings import Settings

log = logging.getLogger(__name__)


class RollupSink:
    """Consumes ``rollups.v1`` (or another topic) and appends it to a Parquet store."""

    def __init__(self, settings: Settings, report: ReportSettings | None = None,
                 directory: Path | None = None, group_id: str = "gpusteward-rollup-sink",
                 spec: topics.TopicSpec = topics.ROLLUPS, payload: type[Any] = Rollup,
                 to_frame: Callable[[list[Any]], pl.DataFrame] = store.frame,
                 schema: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.report = report or ReportSettings()
        self.directory = directory or self.report.rollup_dir
        self.group_id = group_id
        self.spec = spec
        self.to_frame = to_frame
        self.schema = schema or store.SCHEMA
        self.buffer: list[Any] = []
        self.files_written = 0
        self.rows_written = 0
        self.refusals = edge.Refusals(log)
        """Records dead-lettered, by kind."""
        self._decode = edge.Edge[Any](payload)
        self._encode = msgspec.json.Encoder().encode

    async def run(self, stop: asyncio.Event) -> None:
        topic = self.spec.name(self.settings)
        consumer = kafka.consumer(self.settings, topic, group_id=self.group_id)
        producer = kafka.producer(self.settings)
        await consumer.start()
        await producer.start()
        last_flush = time.monotonic()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for messages in batch.values():
                    for message in messages:
                        try:
                            self.buffer.append(self._decode(message.value, message.key))
                        except edge.Rejected as error:
                            self.refusals.note(edge.kind_of(error),
                                               "record at %s[%d]@%d is refused: %s",
                                               message.topic, message.partition,
                                               message.offset, error)
                            letter = edge.dead_letter(message.topic, message.partition,
                                                      message.offset, message.key,
                                                      message.value, str(error))
                            await producer.send_and_wait(
                                topics.DEADLETTER.name(self.settings), self._encode(letter),
                                key=message.topic.encode())
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
            await producer.stop()
            await consumer.stop()

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
        removed = await asyncio.to_thread(store.apply_retention, self.directory,
                                          self.report.retention_days, newest)
        if removed:
            log.info("retention removed %s", ", ".join(p.name for p in removed))

def queue_sink(settings: Settings, report: ReportSettings | None = None,
               directory: Path | None = None) -> RollupSink:
    """A sink of the queue topic into the queue-event store."""
    report = report or ReportSettings()
    return RollupSink(settings, report, directory=directory or report.queue_dir,
                      group_id="gpusteward-queue-sink", spec=topics.QUEUE, payload=QueueEvent,
                      to_frame=store.queue_frame, schema=store.QUEUE_SCHEMA)
