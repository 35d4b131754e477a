"""Publishing samples and events to their topics, keyed by node.

Collectors call a :class:`Publisher`; :class:`KafkaPublisher` encodes the
msgspec payloads as JSON and sends them with aiokafka, whose producer
batches per partition (``linger_ms``). Records of one node share a key, so
they land in one partition and keep their order.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from aiokafka import AIOKafkaProducer

from gpusteward import kafka, topics
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent
from gpusteward.settings import Settings


class Publisher(Protocol):
    """Where a collector sends what it sees."""

    async def sample(self, sample: NodeSample) -> None: ...

    async def hw_event(self, event: HwEvent) -> None: ...

    async def allocation(self, event: AllocationEvent) -> None: ...

    async def queue(self, event: QueueEvent) -> None: ...

    async def flush(self) -> None: ...


class KafkaPublisher:
    """A :class:`Publisher` onto the gpusteward topics."""

    def __init__(self, settings: Settings, producer: AIOKafkaProducer | None = None) -> None:
        self._producer = producer or kafka.producer(settings)
        self._encoder = msgspec.json.Encoder()
        self._samples = topics.SAMPLES.name(settings)
        self._hw = topics.HW_EVENTS.name(settings)
        self._allocations = topics.ALLOCATIONS.name(settings)
        self._queue = topics.QUEUE.name(settings)
        self.sent = 0

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def _send(self, topic: str, key: str, value: msgspec.Struct) -> None:
        # send() only enqueues into the producer's batch; delivery is awaited in flush().
        await self._producer.send(topic, self._encoder.encode(value), key=key.encode())
        self.sent += 1

    async def sample(self, sample: NodeSample) -> None:
        await self._send(self._samples, sample.node, sample)

    async def hw_event(self, event: HwEvent) -> None:
        await self._send(self._hw, event.node, event)

    async def allocation(self, event: AllocationEvent) -> None:
        await self._send(self._allocations, event.node, event)

    async def queue(self, event: QueueEvent) -> None:
        await self._send(self._queue, event.cluster_queue, event)

    async def flush(self) -> None:
        await self._producer.flush()
