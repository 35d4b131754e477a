"""What the worker's agents publish: findings, actions, node summaries, rollups, dead letters.

Both the node join and the fleet agent publish the same payloads with the
same keys (findings by fingerprint, actions by subject, summaries and
rollups by node, dead letters by source topic), so they share this one writer.

It is also where the agents' error policy lives: :meth:`OutputTopics.guarded`
runs one record's processing and turns whatever that record breaks (the
edge refusing it, a rule, the state encoder) into a dead letter, so that no
single record can stop an agent. Faust would restart a crashed agent on the
same record, forever. A state a table holds that this build cannot decode (a
newer release's, read after a rollback, or a corrupt one) is the same kind
of failure, of every record of its key: :func:`restore` keeps of it what decodes
(:func:`salvage`), starting the rest afresh, and :meth:`OutputTopics.drop_states`
keeps the bytes as a dead letter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar, get_args, get_origin

import faust
import msgspec

from gpusteward import edge, kafka, topics
from gpusteward.metrics import observe_many
from gpusteward.schema import Action, Finding, NodeSummary, Rollup, Subject
from gpusteward.settings import Settings
from gpusteward.streams.metrics import worker_metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)
"""A table's state: a msgspec Struct."""


class Undecodable(NamedTuple):
    """A table value this build could not decode, dropped for a fresh state in whole or in
    part."""

    key: bytes
    value: bytes
    error: Exception
    lost: tuple[str, ...] | None = None
    """The parts of the value dropped while the rest was kept (:func:`salvage`), e.g.
    ``devices['GPU-1']``; None: the whole value was dropped."""


def restore(decode: Callable[[bytes], S], key: bytes, stored: bytes | None,
            dropped: list[Undecodable], loose: type[S] | None = None) -> S | None:
    """The state ``stored`` under ``key`` in a table, decoded; None when there is none, or when
    it cannot be decoded, which is then noted in ``dropped`` for the caller to report
    (:meth:`OutputTopics.drop_states`) once it knows the record that found it.

    A value written by a newer release (read after a rollback) or corrupt fails on every
    read: raised, it dead-lettered every record of its key for ever (the node's detection,
    or the whole fleet agent's, stopped); the key starts afresh instead, and its next
    checkpoint replaces the value on the changelog. With ``loose`` (the msgpack Struct that
    ``decode`` reads), what of the value decodes on its own is kept (:func:`salvage`) and
    only the rest starts afresh: dropped whole, a node's state lost the findings its
    devices held open, never to be resolved. Tried only once ``decode`` has failed: the
    reads that succeed pay nothing for it.
    """
    if stored is None:
        return None
    try:
        return decode(stored)
    except msgspec.DecodeError as error:  # ValidationError included
        salvaged = None if loose is None else salvage(loose, stored)
        if salvaged is None:
            dropped.append(Undecodable(key, stored, error))
            return None
        state, lost = salvaged
        dropped.append(Undecodable(key, stored, error, lost))
        return state


def salvage(state_type: type[S], stored: bytes) -> tuple[S, tuple[str, ...]] | None:
    """What of the msgpack value ``stored`` decodes as a ``state_type`` part by part, and the
    names of the parts that do not; None when nothing does (not msgpack, not a map, no field
    that decodes): the value is garbage, not another release's state.

    The parts are the Struct's fields and, for a field mapping names to Structs (a node's
    devices, its pod holdings), each entry of it: one device in another release's shape
    costs that device's state, not its neighbours' open findings. A part that is absent
    takes its default, as in a strict decode. Deeper than that nothing is taken apart: a
    device's rule tracks, or a rollup's minutes, are one state and kept or dropped as one.
    """
    try:
        raw = msgspec.msgpack.decode(stored)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict):
        return None
    kept: dict[str, Any] = {}
    lost: list[str] = []
    for field in msgspec.structs.fields(state_type):
        if field.encode_name not in raw:
            continue
        value = raw[field.encode_name]
        try:
            kept[field.name] = msgspec.convert(value, field.type)
            continue
        except msgspec.ValidationError:
            pass
        entry_type = _struct_values(field.type)
        if entry_type is None or not isinstance(value, dict):
            lost.append(field.name)
            continue
        entries: dict[str, Any] = {}
        for name, entry in value.items():
            try:
                if not isinstance(name, str):
                    raise msgspec.ValidationError(f"a key of {type(name).__name__}")
                entries[name] = msgspec.convert(entry, entry_type)
            except msgspec.ValidationError:
                lost.append(f"{field.name}[{name!r}]")
        if entries:
            kept[field.name] = entries
    if not kept:
        return None
    return state_type(**kept), tuple(lost)


def _struct_values(field_type: Any) -> type | None:
    """The Struct a ``dict[str, Struct]`` field maps to; None for any other type."""
    args = get_args(field_type)
    if get_origin(field_type) is dict and len(args) == 2 and args[0] is str \
            and isinstance(args[1], type) and issubclass(args[1], msgspec.Struct):
        return args[1]
    return None


class Departures:
    """The keys of a node-keyed table whose node was deleted from the cluster, by partition,
    with the event time of the deletion: what :meth:`due` says to remove once the
    partition's own records are ``grace_s`` past it.

    A deleted node sends no more records, so its removal is driven by the records of the
    other nodes of its partition (:meth:`advance`): they were published after the deleted
    node's last ones, on the same partition, so once they are that far past the deletion
    the node's late records have been read. And only the partitions of records the caller
    holds are swept, so the worker removes keys of its own partitions only, through the same
    write as its states (after the batch's outputs are delivered).

    Kept in memory only: cleared at every rebalance (:meth:`forget`), and rebuilt from the
    table (:meth:`rebuild`) before the next sweep, once the table is recovered.
    """

    def __init__(self, grace_s: float, partitions: int) -> None:
        self.grace_s = grace_s
        self.partitions = list(range(partitions))
        self.left: dict[int, dict[bytes, float]] = {}
        """By partition, the deleted nodes' keys and when they were deleted."""
        self.newest: dict[int, float] = {}
        """By partition, the newest event time of the records that drive the sweep."""
        self.known = False
        """Whether :attr:`left` holds every deleted node of the table (rebuilt since the
        last rebalance)."""

    def partition_of(self, key: bytes) -> int:
        """The partition of a node's key: that of its records and its changelog record."""
        return kafka.node_partitioner(key, self.partitions, self.partitions)

    def note(self, partition: int, key: bytes, deleted_at: float | None) -> None:
        """``key``'s node was deleted at ``deleted_at``; None: it exists (again)."""
        if deleted_at is not None:
            self.left.setdefault(partition, {})[key] = deleted_at
        elif partition in self.left:
            self.left[partition].pop(key, None)

    def advance(self, partition: int, ts: float) -> None:
        newest = self.newest.get(partition)
        if newest is None or ts > newest:
            self.newest[partition] = ts

    def due(self, partition: int) -> list[bytes]:
        """The keys of ``partition`` deleted at least ``grace_s`` before its newest record,
        taken out of the index (the caller removes them from the table)."""
        left, newest = self.left.get(partition), self.newest.get(partition)
        if not left or newest is None:
            return []
        horizon = newest - self.grace_s
        gone = [key for key, deleted_at in left.items() if deleted_at <= horizon]
        for key in gone:
            del left[key]
        return gone

    def rebuild(self, deletions: Iterable[tuple[bytes, float | None]]) -> None:
        """Index the deleted nodes of a table from each of its keys and when its stored value
        says the node was deleted (None: it exists, or the value does not decode, which its
        next record reports)."""
        self.left.clear()
        for key, when in deletions:
            if when is not None:
                self.note(self.partition_of(key), key, when)
        self.known = True

    def forget(self) -> None:
        """A rebalance: the table is the truth again, and the partitions may be others."""
        self.left.clear()
        self.newest.clear()
        self.known = False


class RawSchema(faust.Schema):
    """Faust's schema of bytes keys and values (the ``raw`` codec), with a shorter decode.

    Faust's compiled decode runs each key and value through its serializer registry
    (codec lookup, type dispatch, ``want_bytes``) only to hand the same bytes back: a
    few microseconds per record on the node join's hot path. This one makes the event
    of the message's own bytes (None stays None), which is what that returns; encoding
    is Faust's own. The event's class is read from the app's settings once (what
    ``App.create_event`` does per record, through Faust's settings registry: about a
    microsecond each time).
    """

    def compile(self, app: Any, *, on_key_decode_error: Any = None,
                on_value_decode_error: Any = None, default_propagate: bool = False) -> Any:
        event_type = app.conf.Event

        async def decode(message: Any, *, propagate: bool = default_propagate) -> Any:
            return event_type(app, message.key, message.value, message.headers, message)

        return decode


def raw_topic(app: Any, *names: str, partitions: int) -> Any:
    """A Faust topic of raw bytes: payloads are msgspec JSON, decoded by the agents."""
    return app.topic(*names, schema=RawSchema(), key_type=bytes, value_type=bytes,
                     key_serializer="raw", value_serializer="raw", partitions=partitions)


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
        # The one writer counts what goes out; the agents count what comes in.
        self.metrics = worker_metrics(app, settings)
        self._sent = {name: self.metrics.records_out.labels(topic.get_topic_name())
                      for name, topic in (("summaries", self._summaries),
                                          ("findings", self._findings),
                                          ("actions", self._actions),
                                          ("rollups", self._rollups))}
        self._read: dict[str, Any] = {}
        self._processing = self.metrics.processing.labels("node_join")
        self.refusals = edge.Refusals(log)
        """Records dead-lettered, by kind; the first of each kind is logged as a warning."""

    def consumed_each(self, events: Sequence[Any]) -> float:
        """Count a batch's records read, per topic; returns the time to pass to
        :meth:`processed`."""
        topic, count = events[0].message.topic, 0
        for event in events:
            if event.message.topic != topic:
                self._count_read(topic, count)
                topic, count = event.message.topic, 0
            count += 1
        self._count_read(topic, count)
        return time.perf_counter()

    def _count_read(self, topic: str, count: int) -> None:
        counter = self._read.get(topic)
        if counter is None:
            counter = self._read[topic] = self.metrics.records_in.labels(topic)
        counter.inc(count)

    def processed(self, started: float, records: int = 1) -> None:
        """Observe one record's handling time (decode, rules, publish) since ``started``.

        For a batch of ``records``, the batch's mean, once per record (the count stays
        the records handled)."""
        observe_many(self._processing, (time.perf_counter() - started) / records, records)

    async def publish(self, outputs: Sequence[Finding | Action | NodeSummary | Rollup]
                      ) -> list[Awaitable[Any]]:
        """Send ``outputs``; returns the delivery of each finding and action among them.

        Sending only queues a record in the producer; awaiting a returned delivery
        waits until the broker has acknowledged it (see :meth:`emit_then_checkpoint`).
        """
        deliveries: list[Awaitable[Any]] = []
        for output in outputs:
            value = self._encode(output)
            if isinstance(output, NodeSummary):
                await self._summaries.send(key=output.node.encode(), value=value)
                self._sent["summaries"].inc()
            elif isinstance(output, Rollup):
                await self._rollups.send(key=output.node.encode(), value=value)
                self._sent["rollups"].inc()
            elif isinstance(output, Finding):
                deliveries.append(await self._findings.send(
                    key=output.fingerprint.encode(), value=value))
                self._sent["findings"].inc()
                self.metrics.findings.labels(output.kind, output.severity, output.state).inc()
            else:
                deliveries.append(await self._actions.send(
                    key=subject_key(output.target).encode(), value=value))
                self._sent["actions"].inc()
        return deliveries

    async def emit_then_checkpoint(
            self, outputs: Sequence[Finding | Action | NodeSummary | Rollup],
            checkpoint: Callable[[], object] | None) -> None:
        """Publish ``outputs``, then, once their findings and actions are delivered, checkpoint.

        The checkpoint writes the state that says those findings and actions were
        emitted (a rule's "already reported"). Written first, a crash between the two
        writes left a changelog that recovery trusts and no finding on the topic: the
        re-processed record emits nothing, and the finding is lost (the scale-out chaos
        experiment lost two XID findings that way). In this order a crash between them
        re-processes the record from the older state and emits the same ids again, which
        consumers deduplicate: at least once. Only records with findings or actions wait
        for the broker; summaries and rollups are replaced or named by their next one.
        A delivery that fails raises, and the caller must roll the state back. The
        deliveries are awaited with no checkpoint too: the batch's records are acknowledged
        after this returns.
        """
        deliveries = await self.publish(outputs)
        if deliveries:
            await asyncio.gather(*deliveries)
        if checkpoint is not None:
            checkpoint()

    async def guarded(self, event: Any, agent: str,
                      process: Callable[[Any], Awaitable[T]],
                      deliveries: list[Awaitable[Any]] | None = None) -> T | None:
        """``process(event)``'s result, or None once the record is dead-lettered because it failed.

        Any exception but cancellation counts: past the edge, a failure on one record is
        that record's (a rule's bug shows in the reason, with the record to replay). The
        caller restores what the record may have half-changed. The dead letter is delivered
        before this returns, or, given ``deliveries``, its delivery is added there for the
        caller to await before it acknowledges the record: a batch of records then sends
        its dead letters together, not one produce round trip each.
        """
        try:
            return await process(event)
        except Exception as error:  # CancelledError is a BaseException: it goes through
            delivery = await self.dead_letter(event, error, agent)
            if deliveries is None:
                await delivery
            else:
                deliveries.append(delivery)
            return None

    async def guarded_each(self, events: Sequence[Any], agent: str,
                           process: Callable[[Any], list[T]]) -> list[T]:
        """The outputs of ``process(event)`` for each of ``events``, in order.

        The batch form of :meth:`guarded`: an event whose processing raises is
        dead-lettered and the others go on; the dead letters are delivered before it
        returns. ``process`` is synchronous, so a batch costs no await per record.
        """
        out: list[T] = []
        failed: list[tuple[Any, Exception]] = []
        for event in events:
            try:
                out += process(event)
            except Exception as error:  # CancelledError is a BaseException: it goes through
                failed.append((event, error))
        if failed:
            await asyncio.gather(*[await self.dead_letter(event, failure, agent)
                                   for event, failure in failed])
        return out

    def drop_states(self, table: Any, partition: int, dropped: list[Undecodable]) -> None:
        """Report the states of ``table`` that :func:`restore` dropped: a warning naming the
        key and, where the rest was kept, the parts dropped; ``gpusteward_dead_letters_total``
        counted under the table's changelog topic; and the whole bytes kept as a dead letter
        (offset -1: a table value, whose changelog offset the store does not keep;
        ``partition``: that of the record that read it, which is the key's). Sent without
        waiting for the broker: the state is gone whatever happens to the dead letter, and
        the next read of a value not yet replaced reports it again."""
        topic = table.changelog_topic.get_topic_name()
        for key, value, error, lost in dropped:
            name = key.decode(errors="replace")
            if lost is None:
                what = f"undecodable state of {name!r} dropped, it starts afresh"
            else:
                what = (f"undecodable state of {name!r} dropped in part: "
                        f"{', '.join(lost) or 'nothing'}, the rest kept")
            why = f"{what} (written by another release, or corrupt): {edge.reason(error)}"
            log.warning("%s[%d]: %s", topic, partition, why)
            record = edge.dead_letter(topic, partition, -1, key, value, why)
            self._deadletter.send_soon(key=topic.encode(), value=self._encode(record))
            self.metrics.dead_letters.labels(topic, "undecodable_state").inc()
        dropped.clear()

    async def dead_letter(self, event: Any, error: BaseException, agent: str = ""
                          ) -> Awaitable[Any]:
        """Keep a record that could not be processed, with the reason and position; returns
        its delivery, which the caller awaits before the record is acknowledged (a dead
        letter the broker never took would lose the record: Faust's commit flushes the
        producer but does not look at what failed)."""
        message = event.message
        why = edge.reason(error, "" if isinstance(error, edge.Rejected) else agent)
        self.refusals.note(f"{message.topic} {agent} {edge.kind_of(error)}",
                           "dead-lettered %s[%d]@%d: %s", message.topic, message.partition,
                           message.offset, why)
        record = edge.dead_letter(message.topic, message.partition, message.offset,
                                  message.key, message.value, why)
        delivery = await self._deadletter.send(key=message.topic.encode(),
                                               value=self._encode(record))
        self.metrics.dead_letters.labels(message.topic, edge.kind_of(error)).inc()
        return delivery


BATCH_MAX = 200
"""Most records an agent handles between two awaits: enough to spread the per-await
cost of the framework thin, few enough (a few ms of work) that an urgent hardware event,
whose agent runs between two batches, is not held up."""


def still_current(app: Any, events: Sequence[Any]) -> list[Any]:
    """Those of ``events`` no rebalance has taken back since they were fetched: of the
    consumer's current generation, while its flow runs (:func:`ready_events` skips the
    others as it gathers a batch; an agent that then waits asks again)."""
    if not app.flow_control.is_active():
        return []
    generation = app.consumer_generation_id
    return [event for event in events if event.message.generation_id == generation]


def ready_events(app: Any, queue: Any, limit: int) -> list[Any]:
    """Up to ``limit`` events already waiting in an agent's channel queue, without waiting.

    For each it does what Faust's stream iterator does for the events it yields: an
    event fetched before a rebalance (an older consumer generation, or flow stopped) is
    skipped unprocessed and unacknowledged, since the rebalance's seek delivers it again;
    the others are tracked as pending acknowledgement, so that no offset is committed
    past them before the caller acknowledges them.
    """
    events: list[Any] = []
    consumer = app.consumer
    acking = app.topics.acking_topics
    # Read once: nothing here awaits, so no rebalance can change them within the call.
    active, generation = app.flow_control.is_active(), app.consumer_generation_id
    while len(events) < limit and not queue.empty():
        event = queue.get_nowait()
        message = event.message
        if not active or message.generation_id != generation:
            continue
        if message.topic in acking and not message.tracked:
            message.tracked = True
            consumer.track_message(message)
        events.append(event)
    return events


async def crash_unread(app: Any, error: Exception) -> None:
    """Stop the worker with ``error`` after a batch it could not finish.

    Faust restarts a crashed agent in the process on the records after its batch: the
    batch's records, left unacknowledged, would neither be read again nor let the
    partition's committed offset pass them until the next rebalance. A restarted worker
    reads them again from the committed offsets (at least once), and its supervisor (a
    StatefulSet, compose) starts it again, as when its topics disappear.
    """
    await app.crash(RuntimeError(f"a batch could not be finished, its records are read "
                                 f"again after a restart: {error!r}"))


async def each_batch(app: Any, stream: Any,
                     handle: Callable[[list[Any]], Awaitable[None]]) -> None:
    """Hand ``handle`` each batch of an agent's ``stream``: the event the stream yields and
    those already delivered behind it (:func:`ready_events`, up to :data:`BATCH_MAX`), with
    no await per record. A batch ``handle`` cannot finish stops the worker
    (:func:`crash_unread`)."""
    queue = stream.channel.queue
    async for first in stream.events():
        try:
            await handle([first, *ready_events(app, queue, BATCH_MAX - 1)])
        except Exception as error:
            await crash_unread(app, error)
            raise
