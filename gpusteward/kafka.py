"""Kafka plumbing shared by collectors, consumers and tools.

Thin wrappers over aiokafka that apply :class:`KafkaSettings` everywhere, so
no process builds its own client config. Producers never ask for
idempotence or transactions: the embedded broker has neither, and the
pipeline is designed for at-least-once delivery with idempotent effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.protocol.admin import ApiVersionRequest

from gpusteward import topics
from gpusteward.errors import ConfigError
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


async def list_topics(settings: Settings) -> list[str]:
    """The names of the topics the broker has now."""
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


async def topic_configs(settings: Settings, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """Each topic's configuration as the broker describes it: a Kafka broker gives every
    setting (its defaults too), the embedded broker those the topic was created with."""
    names = list(names)
    if not names:
        return {}
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in names])
    finally:
        await admin.close()
    return {name: {entry[0]: entry[1] for entry in entries if entry[1] is not None}
            for response in responses
            for _, _, _, name, entries in response.resources}


async def wait_for_broker(settings: Settings, timeout_s: float = 30.0) -> None:
    """Return once the broker answers a metadata request; raise TimeoutError otherwise."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    # Refused connections are expected while a broker starts: keep them out of the log.
    client_log = logging.getLogger("aiokafka")
    previous_level = client_log.level
    client_log.setLevel(logging.CRITICAL)
    try:
        error = await _poll_metadata(settings, deadline)
    finally:
        client_log.setLevel(previous_level)
    if error is not None:
        raise TimeoutError(
            f"Kafka at {settings.kafka.bootstrap_servers} did not answer within {timeout_s}s: "
            f"{error}"
        )


async def _poll_metadata(settings: Settings, deadline: float) -> Exception | None:
    """None once the broker answers; the last error if the deadline passes first; a
    :class:`ConfigError` at once when the broker answers but refuses this client's TLS or
    SASL settings (see :func:`refusal`)."""
    last_error: Exception = TimeoutError("no answer")
    while asyncio.get_running_loop().time() < deadline:
        admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config(), request_timeout_ms=2000)
        try:
            await admin.start()
            await admin.list_topics()
            return None
        # KeyError, ValueError: aiokafka's SCRAM client on a server message it cannot read.
        except (KafkaConnectionError, KafkaError, OSError, KeyError, ValueError) as error:
            last_error = error
            # Bounded by the time left: a broker that hangs is asked twice, not for longer.
            left = deadline - asyncio.get_running_loop().time()
            refused = await refusal(settings, timeout_s=max(0.1, min(2.0, left)))
            if refused is not None:
                raise refused from error
            await asyncio.sleep(0.1)
        finally:
            await admin.close()
    return last_error


async def refusal(settings: Settings, timeout_s: float = 2.0) -> ConfigError | None:
    """Why the brokers refuse this client for good (an untrusted certificate, a TLS
    handshake that fails, a SASL login refused), naming the settings to correct; None when
    a broker accepts it or none answers yet (an outage passes, a refusal does not).

    aiokafka's clients log the cause and raise "Unable to bootstrap" without it, and every
    process retried that for its whole start timeout and then said the broker "did not
    answer": so one connection is opened here, as the clients open theirs, to see it.
    The message never holds the password.
    """
    kafka = settings.kafka
    config = kafka.aiokafka_config()
    sasl = {key: value for key, value in config.items() if key.startswith("sasl_")}
    refused: ConfigError | None = None
    for host, port, _ in collect_hosts(kafka.bootstrap_servers):
        where = f"{host}:{port}"
        try:
            connection = await create_conn(
                host, port, request_timeout_ms=int(timeout_s * 1000),
                security_protocol=kafka.security_protocol,
                ssl_context=config.get("ssl_context"), **sasl)
        except ssl.SSLCertVerificationError as error:
            trusted = (f"GPUSTEWARD_KAFKA__SSL_CAFILE={kafka.ssl_cafile}" if kafka.ssl_cafile
                       else "the system's CAs (GPUSTEWARD_KAFKA__SSL_CAFILE is unset)")
            refused = ConfigError(
                f"Kafka at {where}: its TLS certificate is not trusted "
                f"({error.verify_message}): {trusted} must hold the CA that signed the "
                "brokers' certificates (Strimzi: the cluster CA's ca.crt)")
        except ssl.SSLError as error:
            refused = ConfigError(
                f"Kafka at {where}: the TLS handshake failed ({error.reason or error}): check "
                f"GPUSTEWARD_KAFKA__SECURITY_PROTOCOL={kafka.security_protocol} against the "
                "listener, and GPUSTEWARD_KAFKA__SSL_CERTFILE/SSL_KEYFILE where it asks for "
                "a client certificate")
        except (SaslAuthenticationFailed, AuthenticationFailedError, UnsupportedSaslMechanismError,
                IllegalSaslStateError, KeyError, ValueError) as error:
            if not sasl:  # KeyError, ValueError: only aiokafka's SCRAM client is expected
                raise
            # A SCRAM server message aiokafka cannot read (KeyError 'v') is a refusal too.
            reason = str(error) if isinstance(error, KafkaError) else "login refused"
            refused = ConfigError(
                f"Kafka at {where} refused the SASL login ({reason}): check "
                f"GPUSTEWARD_KAFKA__SASL_USERNAME={kafka.sasl_username}, "
                "GPUSTEWARD_KAFKA__SASL_PASSWORD (from the Secret) and "
                f"GPUSTEWARD_KAFKA__SASL_MECHANISM={kafka.sasl_mechanism}")
        except (KafkaError, OSError, TimeoutError) as error:
            # Not answering (yet): an outage, not a refusal; unless the broker ended the
            # session with a TLS alert after the handshake (under TLS 1.3, a listener that
            # wants a client certificate), which aiokafka reports as a closed connection.
            alert = error.__cause__
            if isinstance(alert, ssl.SSLError):
                refused = ConfigError(
                    f"Kafka at {where} ended the TLS session ({alert.reason or alert}): "
                    "where the listener asks for a client certificate (mutual TLS), set "
                    "GPUSTEWARD_KAFKA__SSL_CERTFILE and GPUSTEWARD_KAFKA__SSL_KEYFILE to one "
                    "its CA signed")
            elif "SSL" not in kafka.security_protocol and await _speaks_tls(host, port,
                                                                           timeout_s):
                refused = _plaintext_on_tls(where, kafka.security_protocol)
            continue
        else:
            try:
                if "SSL" not in kafka.security_protocol:
                    # A TCP connection is no answer: a TLS listener takes one too, and then
                    # drops the request as a malformed handshake.
                    await connection.send(ApiVersionRequest())
            except (KafkaError, OSError, TimeoutError):
                if await _speaks_tls(host, port, timeout_s):
                    refused = _plaintext_on_tls(where, kafka.security_protocol)
                continue
            finally:
                connection.close()
            return None
    return refused


def _plaintext_on_tls(where: str, protocol: str) -> ConfigError:
    wanted = "SASL_SSL" if protocol == "SASL_PLAINTEXT" else "SSL"
    return ConfigError(
        f"Kafka at {where} speaks TLS on this port, and GPUSTEWARD_KAFKA__SECURITY_PROTOCOL="
        f"{protocol} does not: set it to {wanted}, and GPUSTEWARD_KAFKA__SSL_CAFILE to the CA "
        "that signed the brokers' certificates (Strimzi: the cluster CA's ca.crt), or point "
        "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS at the plaintext listener")


async def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` answers a TLS handshake (its certificate unchecked: only the
    protocol is in question). Asked only after a plaintext client got no answer there, so
    a plaintext broker never sees the handshake."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context),
                                           timeout_s)
    except ssl.SSLError as error:
        # The server's alert (it wants a client certificate, under TLS 1.2) is TLS too.
        return "ALERT" in str(error.reason or "")
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()
    return True


def node_partitioner(key: bytes | None, all_partitions: list[int],
                     available: list[int]) -> int:
    """Kafka's default partitioner applied to the node part of a key.

    A key ``node/anything`` lands where the key ``node`` lands, so per-entity
    keys (one pod of a node on the compacted allocations topic) stay
    co-partitioned with the node-keyed samples. Node names never hold a
    ``/`` (they are DNS subdomains), and keys without one hash as they are.
    """
    if key is not None:
        key = key.split(b"/", 1)[0]
    return int(DefaultPartitioner()(key, all_partitions, available))


BATCH_BYTES = 256 * 1024
"""Most bytes a high-volume producer (a collector's publisher, the stream worker) gathers
for one partition between two requests; aiokafka's default is 16 KiB. aiokafka keeps one
request in flight per broker, and a send to a partition whose batch is full waits until that
request is answered: at 16 KiB the worker draining a backlog waited so about 3,700 times a
run, 3 s in all (``make bench``'s worker). A real Kafka takes a batch of up to its
``message.max.bytes`` (1 MiB by default)."""


def producer(settings: Settings, **overrides: object) -> AIOKafkaProducer:
    """A producer with leader acks and no linger; no idempotence (see module doc).

    Every caller hands a whole batch over without yielding (a publisher's flight, an
    executor's audit records) and then waits for it, so aiokafka batches them anyway;
    a linger would only add its length to every hop, the urgent ones included.
    """
    options: dict[str, object] = {"acks": 1, "linger_ms": 0, "enable_idempotence": False,
                                  "partitioner": node_partitioner}
    options.update(overrides)
    return AIOKafkaProducer(**settings.kafka.aiokafka_config(), **options)


class Sender(Protocol):
    """What a consumer's record handling sends through: :class:`Deliveries` (or a test's
    recorder)."""

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> object: ...


class Deliveries:
    """Records a consumer sends for a batch, whose delivery it awaits before it commits past
    the batch. ``producer.flush()`` waits for the batches sent but does not raise when one
    was refused or timed out, so a commit after it could move past a record whose audit
    record or dead letter never reached the broker."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._pending: list[asyncio.Future[object]] = []

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self._pending.append(await self.producer.send(topic, value, key=key))

    async def delivered(self) -> None:
        """Wait for every record sent since the last call; raise the first failure."""
        pending, self._pending = self._pending, []
        await asyncio.gather(*pending)


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
        "session_timeout_ms": int(settings.kafka.session_timeout_s * 1000),
        "heartbeat_interval_ms": 1_000,
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topic_names, **settings.kafka.aiokafka_config(), **options)


async def topic_partitions(reader: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The partitions of ``topic``, asking the broker again if the reader's metadata does not
    know it yet (a topic created after the reader started); empty if it does not exist."""
    partitions = reader.partitions_for_topic(topic)
    if not partitions:
        await reader._client.force_metadata_update()
        partitions = reader.partitions_for_topic(topic) or set()
    return [TopicPartition(topic, p) for p in sorted(partitions)]


READ_ALL_DEADLINE_S = 60.0
"""How long :func:`read_all` waits for the records up to a topic's end before it gives up."""
READ_ALL_FETCH_WAIT_MS = 500
"""The fetch wait of :func:`read_all` (at least): the embedded broker waits half of it
and answers empty when the fetch is not served by then. At the pipeline's 20 ms it read
3,000 to 4,000 of the 50,040 dead letters of ``make chaos``'s bad-input run in 60 s,
at 100 % of a core, and answered most fetches empty; at 500 ms it read all of them in
2.6 s. The cost is at most one wait once the end is reached."""


async def read_all(settings: Settings, topic: str, quiet_ms: int = 300) -> list[ConsumerRecord]:
    """Every record of ``topic`` (:func:`read_each`), as one list: for small topics."""
    records: list[ConsumerRecord] = []
    await read_each(settings, topic, records.extend, quiet_ms)
    return records


async def read_each(settings: Settings, topic: str,
                    fold: Callable[[list[ConsumerRecord]], object],
                    quiet_ms: int = 300) -> int:
    """Every record of ``topic`` from its start to its end as it was at the call, and any
    that follow until none arrive for ``quiet_ms``.

    Each fetched batch is handed to ``fold`` and not kept, so a large topic is read in
    the memory of one fetch; returns how many records were read.

    Used to rebuild derived state on start (the executor's completed idempotency
    keys and its circuit breaker) and by tests. It reads up to the true end offsets
    (:func:`true_end_offsets`: the embedded broker's ListOffsets answer can trail the last
    batch) rather than stopping at the first quiet fetch, which a slow broker would have
    turned into a history cut short: a tripped breaker read as closed. Raises TimeoutError
    when the end is not reached within ``READ_ALL_DEADLINE_S``.
    """
    reader = consumer(settings, group_id=None, fetch_max_wait_ms=max(
        settings.kafka.fetch_max_wait_ms, READ_ALL_FETCH_WAIT_MS))
    await reader.start()
    try:
        assigned = await topic_partitions(reader, topic)
        if not assigned:
            return 0
        ends = await true_end_offsets(reader, assigned)
        reader.assign(assigned)
        await reader.seek_to_beginning(*assigned)
        read = 0
        deadline = time.monotonic() + READ_ALL_DEADLINE_S
        while True:
            batch = await reader.getmany(timeout_ms=quiet_ms)
            for messages in batch.values():
                fold(messages)
                read += len(messages)
            if batch:
                continue
            short = [tp for tp in assigned if await reader.position(tp) < ends[tp]]
            if not short:
                return read
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: not read to its end within "
                                   f"{READ_ALL_DEADLINE_S:g} s (partitions "
                                   f"{', '.join(str(tp.partition) for tp in short)})")
    finally:
        await reader.stop()


async def read_to_end(settings: Settings, topic_names: Iterable[str],
                      fold: Callable[[list[ConsumerRecord]], object],
                      timeout_s: float) -> int:
    """Every record of ``topic_names`` from their start up to their end offsets as found at
    the call (:func:`true_end_offsets`), and none after: a topic its caller writes to
    meanwhile is read to where it stood, however busy. A topic that does not exist reads
    as empty.

    Each fetched batch is handed to ``fold`` and not kept. Raises TimeoutError when the
    whole read (connecting included) takes longer than ``timeout_s``; returns how many
    records were read. :func:`read_each` reads on until the topic is quiet instead.
    """
    reader = consumer(settings, group_id=None, fetch_max_wait_ms=max(
        settings.kafka.fetch_max_wait_ms, READ_ALL_FETCH_WAIT_MS))
    try:
        async with asyncio.timeout(timeout_s):
            await reader.start()
            assigned: list[TopicPartition] = []
            for name in topic_names:
                assigned += await topic_partitions(reader, name)
            if not assigned:
                return 0
            ends = await true_end_offsets(reader, assigned)
            left = {tp for tp in assigned if ends[tp] > 0}
            if not left:
                return 0
            reader.assign(sorted(left))
            await reader.seek_to_beginning(*left)
            read = 0
            while left:
                batch = await reader.getmany(*left, timeout_ms=300)
                for tp, messages in batch.items():
                    kept = [m for m in messages if m.offset < ends[tp]]
                    if kept:
                        fold(kept)
                        read += len(kept)
                    if messages and messages[-1].offset + 1 >= ends[tp]:
                        left.discard(tp)
                if not batch:  # an end compacted away leaves nothing to fetch up to it
                    left = {tp for tp in left if await reader.position(tp) < ends[tp]}
            return read
    finally:
        await reader.stop()


def handed_on(consumer: AIOKafkaConsumer, tp: TopicPartition) -> bool:
    """Whether ``consumer`` has handed out every record of ``tp`` up to the end its last
    fetch reported: False before the partition's first fetch, or while records fetched are
    buffered. Two integers of the fetcher's state, with no await: Faust's worker reads
    them from its own loop, as it reads ``highwater``."""
    subscription = consumer._subscription.subscription
    state = subscription.assignment.state_value(tp) if subscription is not None else None
    return (state is not None and state.highwater is not None
            and state.has_valid_position and state.position >= state.highwater)


async def true_end_offsets(reader: AIOKafkaConsumer,
                           partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
    """The offset after the last record of each partition, read rather than trusted.

    The embedded broker answers ListOffsets(latest) with the base offset of
    the last batch plus one, so a batch of ten records reports a high
    watermark nine short. Fetching from one before the reported end returns
    that batch (or, on Kafka, the last record) and the true end is after its
    last record: on a real broker this is one small fetch that confirms the
    answer. ``reader`` is a started consumer; its assignment is replaced.
    """
    # Faust's TP is a namedtuple of the same shape that aiokafka's asserts reject.
    wanted = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
    reported = await reader.end_offsets(wanted)
    ends = dict(reported)
    probe = [tp for tp in wanted if reported[tp] > 0]
    if not probe:
        return ends
    reader.assign(probe)
    for tp in probe:
        reader.seek(tp, reported[tp] - 1)
    pending = set(probe)
    while pending:
        batch = await reader.getmany(*pending, timeout_ms=500)
        if not batch:
            break  # nothing past the reported end (compacted away on Kafka): trust it
        for tp, records in batch.items():
            if records:
                ends[tp] = max(ends[tp], records[-1].offset + 1)
            # Stop at the first fetch: records after it were written after the question.
            pending.discard(tp)
    return ends


async def committed(settings: Settings, group_id: str,
                    partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
    """The offsets ``group_id`` has committed (-1 where it has none)."""
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
    await admin.start()
    try:
        return await _committed(admin, group_id, list(partitions))
    finally:
        await admin.close()


async def _committed(admin: AIOKafkaAdminClient, group_id: str,
                     wanted: list[TopicPartition]) -> dict[TopicPartition, int]:
    offsets = await admin.list_consumer_group_offsets(group_id, partitions=wanted)
    return {tp: offsets[tp].offset if tp in offsets else -1 for tp in wanted}


class GroupOffsets:
    """Reads (end offset, committed offset) of each partition of ``topic_names`` for
    ``group_id``, as often as it is called, over one consumer and one admin client: opened
    at the first reading, kept open, closed by :meth:`close` (or ``async with``).

    Read from the broker, not from a consumer of the group: the figure holds while the
    group's own loop is stuck. A partition with no commit has committed offset 0 (groups
    read from the earliest offset). The embedded broker's end offsets may trail the last
    batch (see :func:`read_all`), so there the end can be briefly low, never high.
    A process reading its lag every 15 s opened two clients per reading until 2026-11-27:
    two connections, their metadata requests (and on a secured Kafka their TLS and SASL
    handshakes) per reading, on every broker the clients met. A reading that fails closes
    both; the next one opens them again.
    """

    def __init__(self, settings: Settings, group_id: str, topic_names: Iterable[str]) -> None:
        self.settings = settings
        self.group_id = group_id
        self.topic_names = list(topic_names)
        self._reader: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None

    async def __aenter__(self) -> GroupOffsets:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def __call__(self) -> dict[TopicPartition, tuple[int, int]]:
        try:
            if self._reader is None:
                self._reader = consumer(self.settings, group_id=None)
                await self._reader.start()
            if self._admin is None:
                self._admin = AIOKafkaAdminClient(**self.settings.kafka.aiokafka_config())
                await self._admin.start()
            wanted: list[TopicPartition] = []
            for name in self.topic_names:
                wanted += await topic_partitions(self._reader, name)
            if not wanted:
                return {}
            ends = await self._reader.end_offsets(wanted)
            done = await _committed(self._admin, self.group_id, wanted)
        except BaseException:
            await self.close()
            raise
        return {tp: (ends[tp], max(done[tp], 0)) for tp in wanted}

    async def close(self) -> None:
        reader, admin, self._reader, self._admin = self._reader, self._admin, None, None
        if reader is not None:
            await reader.stop()
        if admin is not None:
            await admin.close()


async def group_offsets(settings: Settings, group_id: str, topic_names: Iterable[str]
                        ) -> dict[TopicPartition, tuple[int, int]]:
    """One reading of :class:`GroupOffsets`, its clients closed after it."""
    async with GroupOffsets(settings, group_id, topic_names) as read:
        return await read()


async def group_lag(settings: Settings, group_id: str,
                    topic_names: Iterable[str]) -> dict[str, int]:
    """Records in ``topic_names`` that ``group_id`` has not committed yet, per topic
    (:func:`group_offsets`)."""
    lag: dict[str, int] = {}
    for tp, (end, done) in (await group_offsets(settings, group_id, topic_names)).items():
        lag[tp.topic] = lag.get(tp.topic, 0) + max(0, end - done)
    return lag


async def wait_consumed(settings: Settings, group_id: str, topic_names: Iterable[str],
                        timeout_s: float = 120.0) -> None:
    """Wait until ``group_id`` has committed past every record now in ``topic_names``."""
    ends: dict[TopicPartition, int] = {}
    for name in topic_names:
        for record in await read_all(settings, name):
            tp = TopicPartition(record.topic, record.partition)
            ends[tp] = max(ends.get(tp, 0), record.offset + 1)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        done = await committed(settings, group_id, ends)
        behind = {tp: ends[tp] - done[tp] for tp in ends if done[tp] < ends[tp]}
        if not behind:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{group_id} still behind after {timeout_s}s: {behind}")
        await asyncio.sleep(0.25)
