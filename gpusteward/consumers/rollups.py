"""The rollup sink: the rollups topic into the Parquet store the weekly report reads.

Rows are buffered and written as one file per day folder when the buffer
holds ``flush_rows`` rows, when ``flush_interval_s`` has passed, and on
stop. Offsets are committed only after the file is in place, so a crash
replays the unwritten records (at-least-once; the store's readers drop the
repeats). A record that does not decode goes to the dead-letter topic with
the reason, never silently away. Writing runs in a thread so the consumer
keeps heart-beating while Parquet compresses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaProducer

from gpusteward import kafka, topics
from gpusteward.report import store
from gpusteward.report.settings import ReportSettings
from gpusteward.schema import DeadLetter, Rollup
from gpusteward.settings import Settings

log = logging.getLogger(__name__)


class RollupSink:
    """Consumes ``rollups.v1`` and appends it to the Parquet store."""

    def __init__(self, settings: Settings, report: ReportSettings | None = None,
                 directory: Path | None = None, group_id: str = "gpusteward-rollup-sink"
                 ) -> None:
        self.settings = settings
        self.report = report or ReportSettings()
        self.directory = directory or self.report.rollup_dir
        self.group_id = group_id
        self.buffer: list[Rollup] = []
        self.files_written = 0
        self.rows_written = 0
        self.dead_lettered = 0
        self._decode = msgspec.json.Decoder(Rollup).decode
        self._encode = msgspec.json.Encoder().encode

    async def run(self, stop: asyncio.Event) -> None:
        topic = topics.ROLLUPS.name(self.settings)
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
                            self.buffer.append(self._decode(message.value or b""))
                        except (msgspec.DecodeError, msgspec.ValidationError) as error:
                            log.warning("rollup at %s[%d]@%d does not decode: %s", message.topic,
                                        message.partition, message.offset, error)
                            await self._dead_letter(producer, message.topic, message.partition,
                                                    message.offset, message.key,
                                                    message.value, str(error))
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
            written = await asyncio.to_thread(store.write, self.directory, store.frame(rows))
        except BaseException:
            self.buffer = rows + self.buffer  # nothing lost: retried at the next flush
            raise
        self.files_written += len(written)
        self.rows_written += len(rows)
        removed = await asyncio.to_thread(store.apply_retention, self.directory,
                                          self.report.retention_days, newest)
        if removed:
            log.info("retention removed %s", ", ".join(p.name for p in removed))

    async def _dead_letter(self, producer: AIOKafkaProducer, topic: str, partition: int,
                           offset: int, key: bytes | None, value: bytes | None, error: str
                           ) -> None:
        record = DeadLetter(source_topic=topic, partition=partition, offset=offset,
                            error=error, ts=time.time(), key=key, value=value)
        await producer.send_and_wait(
            topics.DEADLETTER.name(self.settings), self._encode(record), key=topic.encode())
        self.dead_lettered += 1
