"""Publishing samples and events to their topics, keyed by node, through outages.

Collectors call a :class:`Publisher`. :class:`KafkaPublisher` encodes the
msgspec payloads as JSON and hands them to one sender task through a
:class:`~gpusteward.collectors.transport.spool.Spool`, an ordered queue bounded in
bytes (in memory, or on disk with ``buffer_dir``):

- the sender takes up to ``batch_max_records`` from the head, gives them to
  aiokafka (which batches per partition and compresses, lz4 by default) and
  waits for the broker's acknowledgements; only then are they removed;
- a failed or timed-out flight stays at the head and is retried with
  exponential back-off, so while Kafka is unreachable records pile up in
  the spool, and when it returns they go out in the order they came in
  (hence in order per node: one node's records share a key and partition);
- a full spool drops its oldest records, counted and logged.

Delivery is at-least-once: a flight the broker wrote but did not
acknowledge in time is sent again. An acknowledgement is not the end of it:
a broker that restarted without its data (the memory-only embedded one, a
rebuilt cluster) acknowledges records to partitions it no longer has and
keeps nothing. So acknowledged records are held a little longer, until a
metadata check at most ``VERIFY_INTERVAL_S`` later (and at every
:meth:`~KafkaPublisher.flush`) finds the publisher's topics still there; a topic
gone, or a partition whose offsets start again
(its log reset) makes the publisher say so (an error in the log and
``gpusteward_collect_topics_lost_total``), create the topics again and send
those records again before anything newer, so they keep their order. The
sender never starts a new flight while an earlier one is unresolved, which
keeps repeats to the records of that one flight, after their first copy.

While Kafka is healthy, ``sample()`` and friends wait when the spool holds
more than a few flights, so a fast producer such as the simulator is paced
by the broker instead of filling memory; while it is not, they never wait:
a collector keeps its tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from typing import Protocol

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka import codec as aiokafka_codec

from gpusteward import kafka, topics
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.settings import CollectSettings, Compression
from gpusteward.collectors.transport.spool import DiskSpool, MemorySpool, Record, Spool
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent
from gpusteward.settings import Settings

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.2
VERIFY_INTERVAL_S = 5.0
"""Seconds between two checks that the topics still hold what the broker acknowledged."""
UNVERIFIED_MAX_RECORDS = 200_000
"""Most acknowledged records held for a resend; beyond it the oldest are let go unchecked."""


class Publisher(Protocol):
    """Where a collector sends what it sees."""

    async def sample(self, sample: NodeSample) -> None: ...

    async def hw_event(self, event: HwEvent) -> None: ...

    async def allocation(self, event: AllocationEvent) -> None: ...

    async def queue(self, event: QueueEvent) -> None: ...

    async def flush(self) -> None: ...


def compression_type(choice: Compression) -> str | None:
    """aiokafka's ``compression_type`` for a setting; 'auto' is lz4 where cramjam is present."""
    if choice == "none":
        return None
    if choice == "auto":
        return "lz4" if aiokafka_codec.has_lz4() else "gzip"
    available = {"gzip": aiokafka_codec.has_gzip, "lz4": aiokafka_codec.has_lz4,
                 "zstd": aiokafka_codec.has_zstd, "snappy": aiokafka_codec.has_snappy}
    if not available[choice]():
        raise ValueError(f"compression {choice!r} needs the cramjam package (pip install cramjam)")
    return choice


class KafkaPublisher:
    """A :class:`Publisher` onto the gpusteward topics; see the module doc for the guarantees."""

    def __init__(self, settings: Settings, producer: AIOKafkaProducer | None = None, *,
                 collect: CollectSettings | None = None,
                 metrics: CollectorMetrics | None = None,
                 spool: Spool | None = None) -> None:
        options = collect or CollectSettings()
        self._delivery_timeout_s = options.delivery_timeout_s
        compression = compression_type(options.compression)

        def make_producer() -> AIOKafkaProducer:
            return kafka.producer(
                settings, compression_type=compression,
                # aiokafka fails a batch after this long (its TTL is the same value), so a
                # hung broker resolves every flight within about twice this.
                request_timeout_ms=int(options.delivery_timeout_s * 1000),
                max_batch_size=kafka.BATCH_BYTES,
            )

        self._make_producer = make_producer
        self._producer = producer
        self._producer_ready = False
        if spool is None:
            spool = (DiskSpool(options.buffer_dir, options.buffer_max_bytes)
                     if options.buffer_dir else MemorySpool(options.buffer_max_bytes))
        self._spool = spool
        self.metrics = metrics or CollectorMetrics()
        self._batch_max = options.batch_max_records
        self._backoff_max_s = options.retry_backoff_max_s
        self._encoder = msgspec.json.Encoder()
        self._samples = topics.SAMPLES.name(settings)
        self._hw = topics.HW_EVENTS.name(settings)
        self._allocations = topics.ALLOCATIONS.name(settings)
        self._queue = topics.QUEUE.name(settings)
        self._prefix = f"{settings.topic_prefix}."
        self._settings = settings
        self._unverified: deque[Record] = deque(maxlen=UNVERIFIED_MAX_RECORDS)
        """Acknowledged records not yet seen safe by a metadata check, oldest first."""
        self._resend: list[Record] = []
        """Records the broker lost, to be sent again before the spool's head."""
        self._offsets: dict[tuple[str, int], int] = {}
        """The last acknowledged offset per partition: one that goes back is a reset log."""
        self._reset_seen = False
        self._verify_at = time.monotonic() + VERIFY_INTERVAL_S
        self._verify_asked = False
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._healthy = True
        self._buffered_upto = 0
        """Highest seq already counted in records_buffered."""
        self._dropped_since_log = 0
        self.sent = 0
        """Records the broker acknowledged."""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start delivering. Does not wait for Kafka: records queue until it answers."""
        if self._spool.records:
            log.info("delivering %d records (%d bytes) left from an earlier run",
                     self._spool.records, self._spool.size_bytes)
        self._sender = asyncio.create_task(self._deliver_forever(), name="publisher-sender")
        self._sender.add_done_callback(self._sender_ended)
        self._wake.set()
        self._update_gauges()

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Deliver what is queued (for at most ``drain_timeout_s``), then stop.

        By default waits up to twice the delivery timeout. What is still
        queued then stays in a disk spool for the next start; a memory spool
        loses it, and says so.
        """
        timeout = 2 * self._delivery_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self._sender is not None and not self._sender.done():
            with contextlib.suppress(TimeoutError):
                await self.flush(timeout)
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
            self._sender = None
        if self._spool.records:
            where = ("kept on disk for the next start" if isinstance(self._spool, DiskSpool)
                     else "LOST (no buffer_dir)")
            log.warning("stopping with %d undelivered records: %s", self._spool.records, where)
        if self._producer is not None and self._producer_ready:
            await self._producer.stop()
        self._spool.close()

    # -- the Publisher interface ---------------------------------------------------------------

    async def sample(self, sample: NodeSample) -> None:
        await self._enqueue(self._samples, sample.node, sample)

    async def hw_event(self, event: HwEvent) -> None:
        await self._enqueue(self._hw, event.node, event)

    async def allocation(self, event: AllocationEvent) -> None:
        await self._enqueue(self._allocations, topics.allocation_key(event), event)

    async def queue(self, event: QueueEvent) -> None:
        await self._enqueue(self._queue, event.cluster_queue, event)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued record is acknowledged and then seen kept by the broker
        (its topics still there: see the module doc); TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while self._spool.records or self._resend or self._unverified:
                if not self._spool.records and not self._resend:
                    self._verify_asked = True
                    self._wake.set()
                if self._sender is None or self._sender.done():
                    raise RuntimeError(
                        "the publisher is not running (not started, or its sender failed)")
                self._progress.clear()
                await self._progress.wait()

    @property
    def backlog(self) -> int:
        """Records accepted and not yet acknowledged (or acknowledged and then lost)."""
        return self._spool.records + len(self._resend)

    @property
    def healthy(self) -> bool:
        """False from a failed delivery attempt until the next successful one."""
        return self._healthy

    # -- inside ------------------------------------------------------------------------------

    def _sender_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the publisher's sender failed; records are no longer delivered",
                      exc_info=task.exception())
        self._progress.set()  # wake anyone waiting on it, so they see it has ended

    def _topic_label(self, topic: str) -> str:
        return topic.removeprefix(self._prefix)

    async def _enqueue(self, topic: str, key: str, value: msgspec.Struct) -> None:
        # Pace a fast producer by the broker while it keeps up (see module doc).
        while (self._healthy and self._sender is not None and not self._sender.done()
               and self._spool.records >= 4 * self._batch_max):
            self._progress.clear()
            await self._progress.wait()
        seq, dropped = self._spool.append(topic, key.encode(), self._encoder.encode(value))
        if not self._healthy:
            self._buffered_upto = seq
            self.metrics.records_buffered.labels(self._topic_label(topic)).inc()
        if dropped:
            self._count_dropped(dropped)
        self._update_gauges()
        self._wake.set()

    def _count_dropped(self, dropped: list[Record]) -> None:
        for record in dropped:
            self.metrics.records_dropped.labels(self._topic_label(record.topic)).inc()
        if self._dropped_since_log == 0:
            log.warning("buffer full (%d bytes): dropping the oldest records; first dropped "
                        "seq %d", self._spool.max_bytes, dropped[0].seq)
        self._dropped_since_log += len(dropped)

    def _update_gauges(self) -> None:
        self.metrics.buffer_records.set(self._spool.records)
        self.metrics.buffer_bytes.set(self._spool.size_bytes)

    async def _deliver_forever(self) -> None:
        backoff = BACKOFF_START_S
        while True:
            if self._unverified and (self._reset_seen or self._verify_asked
                                     or time.monotonic() >= self._verify_at):
                await self._verify()
            resending = bool(self._resend)
            batch = self._resend[:self._batch_max] if resending else self._spool.peek(
                self._batch_max)
            if not batch:
                self._wake.clear()
                self._progress.set()
                if self._unverified:  # idle: wake in time for the next check
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(
                                max(0.0, self._verify_at - time.monotonic())):
                            await self._wake.wait()
                else:
                    await self._wake.wait()
                continue
            delivered = await self._deliver(batch) if await self._ensure_producer() else 0
            if delivered:
                if resending:
                    del self._resend[:delivered]
                else:
                    self._spool.ack(batch[delivered - 1].seq)
                self._unverified.extend(batch[:delivered])
                self.sent += delivered
                for record in batch[:delivered]:
                    self.metrics.records_sent.labels(self._topic_label(record.topic)).inc()
            self._update_gauges()
            self._progress.set()
            if delivered == len(batch):
                if not self._healthy:
                    log.warning("Kafka accepts records again; %d still queued",
                                self._spool.records)
                    if self._dropped_since_log:
                        log.warning("%d records were dropped during the outage",
                                    self._dropped_since_log)
                self._healthy = True
                self._dropped_since_log = 0
                backoff = BACKOFF_START_S
                continue
            self.metrics.delivery_failures.inc()
            if self._healthy:
                log.warning("Kafka delivery failed; holding records (%d queued) and retrying",
                            self._spool.records)
                self._count_buffered()
            self._healthy = False
            # Jitter so a fleet of collectors does not return to the broker in step.
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self._backoff_max_s)

    async def _verify(self) -> None:
        """Let go of the acknowledged records if the broker still has their topics;
        otherwise say so, create the topics again and queue those records for a resend.

        A check that gets no answer keeps them for the next one.
        """
        assert self._producer is not None  # records were acknowledged, so it runs
        try:
            async with asyncio.timeout(self._delivery_timeout_s):
                await self._producer.client.force_metadata_update()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.debug("checking the topics failed: %r", error)
            self._verify_at = time.monotonic() + VERIFY_INTERVAL_S
            return
        cluster = self._producer.client.cluster
        # The client's metadata covers the topics it sends to: those of the records held.
        broken = sorted({record.topic for record in self._unverified} - cluster.topics())
        self._verify_at = time.monotonic() + VERIFY_INTERVAL_S
        self._verify_asked = False
        if not broken and not self._reset_seen:
            self._unverified.clear()
            return
        why = (f"topics gone: {', '.join(broken)}" if broken
               else "a partition's offsets started again")
        log.error("the broker lost records it had acknowledged (%s; restarted without its "
                  "data?): creating the topics again and sending the last %d records again",
                  why, len(self._unverified))
        self.metrics.topics_lost.inc()
        try:
            await kafka.ensure_topics(self._settings)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.error("creating the topics again failed: %r", error)
        for record in self._unverified:
            self.metrics.records_resent.labels(self._topic_label(record.topic)).inc()
        self._resend = [*self._unverified, *self._resend]
        self._unverified.clear()
        self._offsets.clear()
        self._reset_seen = False

    def _count_buffered(self) -> None:
        """Count, once each, the queued records a failed attempt held back.

        Called when Kafka turns unhealthy (records appended while it is
        unhealthy are counted as they come), so the full scan runs once per
        outage, not once per retry.
        """
        for topic, count in self._spool.topics_after(self._buffered_upto).items():
            self.metrics.records_buffered.labels(self._topic_label(topic)).inc(count)
        tail = self._spool.last_seq()
        if tail is not None:
            self._buffered_upto = max(self._buffered_upto, tail)

    async def _ensure_producer(self) -> bool:
        """Start the producer if it is not; False (logged once per outage) when Kafka is away."""
        if self._producer_ready:
            return True
        producer = self._producer or self._make_producer()
        try:
            async with asyncio.timeout(2 * self._delivery_timeout_s):
                await producer.start()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.log(logging.WARNING if self._healthy else logging.DEBUG,
                    "cannot reach Kafka: %r", error)
            with contextlib.suppress(Exception):
                await producer.stop()
            # A producer whose start failed is not restarted; the next attempt makes a new one.
            self._producer = None
            return False
        self._producer = producer
        self._producer_ready = True
        return True

    def _note_offset(self, metadata: object) -> None:
        """Remember the partition's acknowledged offset; one at or below the last means
        the partition's log started again (see :meth:`_verify`)."""
        partition = (getattr(metadata, "topic", ""), getattr(metadata, "partition", -1))
        offset = getattr(metadata, "offset", -1)
        last = self._offsets.get(partition)
        if last is not None and offset <= last:
            self._reset_seen = True
        self._offsets[partition] = offset

    async def _deliver(self, batch: list[Record]) -> int:
        """Send ``batch``; return how many records from its start the broker acknowledged."""
        assert self._producer is not None
        futures: list[asyncio.Future[object]] = []
        try:
            async with asyncio.timeout(self._delivery_timeout_s):
                for record in batch:
                    futures.append(await self._producer.send(
                        record.topic, record.value, key=record.key))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # Whatever stopped the enqueueing (timeout, closed connection), the records not
            # handed over stay at the head of the spool for the next attempt.
            log.debug("enqueueing a flight failed after %d records: %r", len(futures), error)
        if not futures:
            return 0
        # aiokafka resolves every future within about twice its request timeout; the cap
        # only guards against a future that never resolves.
        await asyncio.wait(futures, timeout=2 * self._delivery_timeout_s + 1)
        delivered = 0
        for future in futures:
            if not future.done() or future.cancelled() or future.exception() is not None:
                break
            self._note_offset(future.result())
            delivered += 1
        if delivered < len(futures):
            failed = futures[delivered]
            reason = (failed.exception() if failed.done() and not failed.cancelled()
                      else "no acknowledgement in time")
            log.debug("flight of %d records: %d acknowledged, then %r",
                      len(futures), delivered, reason)
        return delivered
