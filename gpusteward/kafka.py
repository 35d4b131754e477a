"""Kafka plumbing shared by collectors, consumers and tools.

Thin wrappers over aiokafka that apply :class:`KafkaSettings` everywhere, so
no process builds its own client config. Producers never ask for
idempotence or transactions: the embedded broker has neither, and the
pipeline is designed for at-least-once delivery with idempotent effects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError

from gpusteward import topics
from gpusteward.settings import Settings

log = logging.getLogger(__name__)


async def ensure_topics(
    settings: Settings, specs: Iterable[topics.TopicSpec] = topics.ALL
) -> list[str]:
    """Create the topics in ``specs`` that do not exist yet; return the names created."""
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(
                name=spec.name(settings),
                num_partitions=spec.partition_count(settings),
                replication_factor=settings.kafka.replication_factor,
                topic_configs=spec.config(),
            )
            for spec in specs
            if spec.name(settings) not in existing
        ]
        if missing:
            response = await admin.create_topics(missing)
            for name, code, *_ in response.topic_errors:
                # 36 = TOPIC_ALREADY_EXISTS: another process won the race; that is fine.
                if code not in (0, 36):
                    raise KafkaError(f"creating topic {name} failed with error code {code}")
            log.info("created topics: %s", ", ".join(t.name for t in missing))
        return [t.name for t in missing]
    finally:
        await admin.close()


async def wait_for_broker(settings: Settings, timeout_s: float = 30.0) -> None:
    """Return once the broker answers a metadata request; raise TimeoutError otherwise."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last_error: Exception | None = None
    while asyncio.get_running_loop().time() < deadline:
        admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config(), request_timeout_ms=2000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except (KafkaConnectionError, KafkaError, OSError) as error:
            last_error = error
            await asyncio.sleep(0.1)
        finally:
            await admin.close()
    raise TimeoutError(
        f"Kafka at {settings.kafka.bootstrap_servers} did not answer within {timeout_s}s: "
        f"{last_error}"
    )


def producer(settings: Settings, **overrides: object) -> AIOKafkaProducer:
    """A producer with leader acks and a short linger; no idempotence (see module doc)."""
    options: dict[str, object] = {"acks": 1, "linger_ms": 5, "enable_idempotence": False}
    options.update(overrides)
    return AIOKafkaProducer(**settings.kafka.aiokafka_config(), **options)


def consumer(
    settings: Settings, *topic_names: str, group_id: str | None, **overrides: object
) -> AIOKafkaConsumer:
    """A consumer with the configured fetch wait, reading from the earliest offset by default."""
    options: dict[str, object] = {
        "group_id": group_id,
        "auto_offset_reset": "earliest",
        "enable_auto_commit": False,
        "fetch_max_wait_ms": settings.kafka.fetch_max_wait_ms,
        "rebalance_timeout_ms": int(settings.kafka.rebalance_timeout_s * 1000),
        "session_timeout_ms": 10_000,
        "heartbeat_interval_ms": 1_000,
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topic_names, **settings.kafka.aiokafka_config(), **options)


async def read_all(settings: Settings, topic: str) -> list[tuple[bytes | None, bytes | None]]:
    """Every record (key, value) of ``topic`` from its start to its current end.

    Used to rebuild small derived state on start, such as the executor's
    set of completed idempotency keys from the audit topic.
    """
    from aiokafka import TopicPartition

    reader = consumer(settings, group_id=None, enable_auto_commit=False)
    await reader.start()
    try:
        partitions = reader.partitions_for_topic(topic) or set()
        if not partitions:
            await reader._client.force_metadata_update()
            partitions = reader.partitions_for_topic(topic) or set()
        assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not assigned:
            return []
        reader.assign(assigned)
        await reader.seek_to_beginning(*assigned)
        end = await reader.end_offsets(assigned)
        records: list[tuple[bytes | None, bytes | None]] = []
        remaining = {tp for tp in assigned if end[tp] > 0}
        while remaining:
            batch = await reader.getmany(timeout_ms=500)
            for tp, messages in batch.items():
                records.extend((m.key, m.value) for m in messages)
                if messages and messages[-1].offset + 1 >= end[tp]:
                    remaining.discard(tp)
            for tp in list(remaining):
                if await reader.position(tp) >= end[tp]:
                    remaining.discard(tp)
        return records
    finally:
        await reader.stop()
