"""The Faust stream worker.

One agent reads the three node-keyed topics (samples, hardware events,
allocations). They have the same partition count and the same key, so
Faust's assignor gives a worker the same partition number of each: the join
is local, with no repartition hop. Per-node state is a Faust table backed by
a changelog topic; a restarted worker recovers it before it processes.

Values are read as raw bytes and decoded with msgspec (far cheaper than
Faust records) at the edge (:mod:`gpusteward.edge`: bounds, key, depth). A
record refused there, or one that breaks anything further in, goes to the
dead-letter topic with the reason and its position, and the worker carries
on (:meth:`OutputTopics.guarded`).

Processing is at-least-once: after a crash the last records may be
processed again, which republishes findings and actions with the same ids
and idempotency keys; consumers deduplicate on them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from functools import partial
from typing import Any, cast

import faust
import msgspec
from aiokafka import AIOKafkaConsumer
from faust.tables import TableManager
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, Message

from gpusteward import health, kafka, topics
from gpusteward.edge import Edge, Limits, Rejected
from gpusteward.health import Health
from gpusteward.kafka import BATCH_BYTES
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, NodeSummary, Rollup
from gpusteward.settings import Settings
from gpusteward.streams.fleet import FleetSettings, register_fleet_agent
from gpusteward.streams.node import (
    NodeDeletion,
    NodeJoin,
    NodeState,
    Output,
    RuleSettings,
    deleted_since,
)
from gpusteward.streams.outputs import (
    Departures,
    OutputTopics,
    Undecodable,
    crash_unread,
    each_batch,
    raw_topic,
    restore,
    still_current,
)
from gpusteward.streams.policy_file import policy_from_env
from gpusteward.topics import worker_group


def _transport_for(settings: Settings) -> type[faust_aiokafka.Transport]:
    """Faust's aiokafka transport with a configurable fetch wait and a true high watermark.

    The driver hard-codes ``fetch_max_wait_ms=1500``; the embedded broker holds
    every fetch for up to half of it, which would put 750 ms on every hop.

    Table recovery reads each changelog partition up to its high watermark
    and refuses to start when a standby has read past it (ConsistencyError).
    The embedded broker reports the base offset of the last batch plus one,
    so a worker that took over a dead one's partitions stopped recovery a
    batch short (the latest node states missing) and crashed on the standby
    check. The watermark Faust asks for is read instead
    (:func:`gpusteward.kafka.true_end_offsets`), with a reader of its own so
    the group consumer's assignment is untouched.
    """

    # A topic whose partitions wait for the same partitions of another, its lead.
    allocations, queue = topics.ALLOCATIONS.name(settings), topics.QUEUE.name(settings)
    leads = {topics.SAMPLES.name(settings): allocations, topics.HW_EVENTS.name(settings):
             allocations, topics.NODE_SUMMARIES.name(settings): queue}

    class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
        _end_reader: AIOKafkaConsumer | None = None

        def _create_worker_consumer(self, transport: Any) -> Any:
            consumer = super()._create_worker_consumer(transport)
            consumer._fetch_max_wait_ms = settings.kafka.fetch_max_wait_ms
            return consumer

        async def _highwaters(self, partitions: list[TP]) -> Mapping[TP, int]:
            if self.consumer.in_transaction:  # never: the app uses no transactions
                return await super()._highwaters(partitions)
            if self._end_reader is None:
                self._end_reader = kafka.consumer(settings, group_id=None)
                await self._end_reader.start()
            ends = await kafka.true_end_offsets(self._end_reader, partitions)
            return {TP(tp.topic, tp.partition): end for tp, end in ends.items()}

        async def on_thread_stop(self) -> None:
            await super().on_thread_stop()
            if self._end_reader is not None:
                await self._end_reader.stop()

    class Consumer(faust_aiokafka.Consumer):
        """Faust's consumer, with no fetched batch delivered across a seek to committed.

        When a rebalance ends, Faust resumes the stream partitions and then seeks
        them to their committed offsets while its fetcher runs. A batch fetched
        before the seek went on being delivered after it and moved each partition's
        read offset past the records the seek brings back, which Faust then dropped
        unseen ("DROPPED MESSAGE", at its dev log level): never processed again,
        never acked. A record of that range whose ack was lost in the race stayed a
        hole below the acked offsets, and Faust never commits past a hole there; the
        partition went on being processed, its committed offset stood still, and
        nothing was logged. A batch that overlaps a seek is cut short here and the
        partitions are sought to their committed offsets again, so that position and
        read offset agree; the records are delivered again (at least once).
        """

        _seeks = 0
        """Counts the starts and ends of seeks: odd while one runs."""

        def _new_consumer_thread(self) -> Any:
            return ConsumerThread(self, loop=self.loop, beacon=self.beacon)

        # Faust calls it with a timeout; its signature is not ours to change.
        async def _getmany(self, active_partitions: set[TP] | None, timeout: float  # noqa: ASYNC109
                           ) -> Mapping[TP, list[Any]]:
            """Faust's fetch, less the partitions that must wait for their lead's records.

            A node's samples and hardware events are judged with its allocations, and the
            fleet's node summaries with the queue: a partition of the first kind is left
            out of a fetch while the same partition of its lead topic has records fetched
            and not yet handed on, or has not been fetched yet. Without it a worker on a
            backlog judged an hour of a node's samples before reading the allocations
            that name their pods (the embedded broker can fill a fetch response with about
            5 MB of one partition and leave the others out of several fetches in a row).
            Applying allocations and queue records ahead of the samples is what their
            rules expect: a pod holds its devices from its start, and its holding
            outlives its end until the node's samples pass it.
            """
            if active_partitions:
                active_partitions = active_partitions - self._waiting_for_lead(active_partitions)
            return cast(Mapping[TP, list[Any]],
                        await super()._getmany(active_partitions, timeout))

        def _waiting_for_lead(self, active: set[TP]) -> set[TP]:
            """The ``active`` partitions whose lead is active here and not handed on (a lead
            paused or not assigned here holds nothing back)."""
            fetcher = self._thread._ensure_consumer()
            follows = {tp: TP(leads[tp.topic], tp.partition) for tp in active
                       if tp.topic in leads}
            behind = {lead for lead in set(follows.values())
                      if lead in active and not kafka.handed_on(fetcher, lead)}
            return {tp for tp, lead in follows.items() if lead in behind}

        async def perform_seek(self) -> None:
            self._seeks += 1
            try:
                await super().perform_seek()
            finally:
                self._seeks += 1

        # Faust calls it with a timeout; its signature is not ours to change.
        async def getmany(self, timeout: float) -> AsyncIterator[tuple[TP, Message]]:  # noqa: ASYNC109
            seeks = self._seeks
            batch = cast(AsyncGenerator[tuple[TP, Message], None], super().getmany(timeout))
            overlapped = seeks % 2 == 1  # fetched while a seek ran: before or after it?
            delivered = False
            try:
                async for tp, message in batch:
                    if self._seeks != seeks:
                        overlapped = True
                        break
                    delivered = True
                    yield tp, message
            finally:
                await batch.aclose()
            # A seek that lands while the batch's last record is handled is past the check
            # above, and that record's read offset is set after it: ahead of the records
            # the seek brings back, which would be dropped as read.
            if overlapped or (delivered and self._seeks != seeks):
                # Records it fetched after the seek moved the fetch position past them;
                # records from before it moved the read offset. Both go back. A seek
                # that fails here is in a new rebalance, whose end seeks again (as
                # Faust's own seek from the fetcher, it is logged, not raised).
                try:
                    await self._seek_back()
                except Exception as exc:
                    self.log.warning("seek to committed offsets after a batch failed: %r", exc)

        async def _drain_messages(self, fetcher: Any) -> None:
            """Faust's delivery loop, without four tasks per record.

            Faust races each record's delivery against the flow being suspended
            (``wait_first``: a task for the delivery, the suspension, the stop and the
            crash, and an ``asyncio.wait``), which cost more than the node join's work
            on a record and kept the agent from ever finding more than one record
            waiting. Here a record is delivered directly while the flow runs, and
            raced as Faust does while it is suspended. A delivery the suspension
            catches waiting (its queue full) completes when the flow resumes, with the
            old generation, which the stream and :func:`.outputs.ready_events` skip: the
            same outcome as Faust's, whose cancelled delivery is also read again after the
            rebalance's seek. Otherwise this is Faust 0.15's loop.
            """
            callback = self.callback
            should_stop = self._stopped.is_set
            fetcher_should_stop = fetcher._stopped.is_set
            get_read_offset = self._read_offset.__getitem__
            set_read_offset = self._read_offset.__setitem__
            acks_enabled_for = self.app.topics.acks_enabled_for
            suspended = self.suspend_flow.is_set
            commit_every = self._commit_every
            since_yield = 0
            try:
                while not (should_stop() or fetcher_should_stop()):
                    self.diag.set_flag(faust_consumer.CONSUMER_FETCHING)
                    batch = self.getmany(timeout=1.0)
                    await self.sleep(0)
                    if not self.should_stop:
                        async for tp, message in batch:
                            since_yield += 1
                            if since_yield > 100:
                                await self.sleep(0)
                                since_yield = 0
                            offset = message.offset
                            read = get_read_offset(tp)
                            if read is None or offset >= read:
                                gap = offset - (read or 0)
                                if gap > 1 and read and acks_enabled_for(message.topic):
                                    await self._add_gap(tp, read + 1, offset)
                                if commit_every is not None and self._n_acked >= commit_every:
                                    self._n_acked = 0
                                    await self.commit()
                                if suspended():
                                    await self.wait_first(callback(message),
                                                          self.suspend_flow.wait())
                                else:
                                    await callback(message)
                                set_read_offset(tp, offset)
                        self.diag.unset_flag(faust_consumer.CONSUMER_FETCHING)
            except self.consumer_stopped_errors:
                if self.transport.app.should_stop:
                    return
                raise
            finally:
                self.diag.unset_flag(faust_consumer.CONSUMER_FETCHING)

        async def _seek_back(self) -> None:
            """Every stream partition to its committed offset, or to its start if none.

            aiokafka's seek to committed leaves a partition without a commit (or
            committed at 0) where it is, which a cut batch may have moved on; the
            worker reads those from the earliest offset (``consumer_auto_offset_reset``).
            """
            await self.perform_seek()
            uncommitted = [tp for tp in self.assignment()
                           if not self._is_changelog_tp(tp) and not self._committed_offset.get(tp)]
            if uncommitted:
                # Offset 0, or the earliest there is where retention removed it.
                await self.seek_wait({tp: 0 for tp in uncommitted})

    class Transport(faust_aiokafka.Transport):
        pass

    Transport.Consumer = Consumer
    return Transport


class LeanMonitor(faust.Monitor):
    """Faust's monitor without its per-record bookkeeping.

    The stock monitor updates several dicts and deques for every record in
    and out; at tens of thousands of GPU samples per second that is a
    measurable share of the worker. Rebalance, commit and send statistics
    are kept.
    """

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        return None

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        return None

    def on_stream_event_out(self, tp: Any, offset: int, stream: Any, event: Any,
                            state: Any = None) -> None:
        return None

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        return None

    def on_table_get(self, table: Any, key: Any) -> None:
        return None

    def on_table_set(self, table: Any, key: Any, value: Any) -> None:
        return None


class PromptTableManager(TableManager):
    """Faust's table manager without its one-second nap before recovery starts.

    Faust sleeps 1 s at start so that tables defined late can still register; this
    worker defines every table in :func:`create_app`, before the app starts, so the
    nap was only a second added to every restart.
    """

    async def on_start(self) -> None:
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()


PRODUCER_BUFFER_MAX = 4096
"""Changelog writes Faust's producer buffer holds before the delivery of records waits for
it to drain (Faust's own bound is 100). A batch checkpoints up to :data:`.outputs.BATCH_MAX`
node states at once, and each of the two agents checkpoints its own batches: at 100 the
worker draining ``make bench``'s backlog stopped delivering records 30-38 times a run,
0.6-1.3 s in all (at 1,024, once: a restarted worker checkpoints every node it reads
first). A commit flushes the buffer first either way, so no committed offset passes a state
not written. The price is memory while the broker is slow: up to 4,096 states waiting,
about 90 MiB at a busy 8-GPU node's 22 KiB, against the manifests' 2 GiB limit."""


class WorkerApp(faust.App):
    """A Faust app whose transport honours gpusteward's Kafka settings.

    It also keeps the worker's :class:`Health`: ready once a rebalance has
    ended (partitions assigned, tables recovered, streams resumed), not ready
    while one is under way, and live while its loop beats and its topics exist.

    Faust starts ``@app.task`` and ``@app.timer`` only once the first table
    recovery has completed (``App.on_started``), which replaying a long
    changelog can take minutes; a heartbeat there would fail liveness for all
    that time and the kubelet would restart the worker into the same replay.
    What must run from the start (the heartbeat, the ``/metrics`` server, the
    topic watch) is registered with :meth:`early_task` instead.
    """

    gpusteward_settings: Settings
    health: Health

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._early_tasks: list[Callable[[], Awaitable[None]]] = []

    def early_task(self, task: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """Run ``task`` on the app's loop from the app's start, table recovery included
        (a decorator, like ``@app.task``); it is cancelled when the app stops."""
        self._early_tasks.append(task)
        return task

    async def on_start(self) -> None:
        await super().on_start()
        for task in self._early_tasks:
            self.add_future(task())

    def _new_transport(self) -> Any:
        transport = _transport_for(self.gpusteward_settings)
        return transport(self.conf.broker_consumer, self)

    def _new_producer(self) -> Any:
        producer = super()._new_producer()
        producer.buffer.max_messages = PRODUCER_BUFFER_MAX
        return producer

    def on_rebalance_start(self) -> None:
        super().on_rebalance_start()
        self.health.set_ready(False, "rebalancing")

    def on_rebalance_end(self) -> None:
        super().on_rebalance_end()
        self.health.set_ready(True, "partitions assigned and tables recovered")


def _broker_url(settings: Settings) -> list[str]:
    return [f"kafka://{server.strip()}" for server in settings.kafka.bootstrap_servers.split(",")]


def create_app(
    settings: Settings,
    rules: RuleSettings | None = None,
    *,
    app_id: str | None = None,
    datadir: str | None = None,
    web_port: int | None = None,
) -> WorkerApp:
    """The worker app with its topics, table and agent wired.

    Its id (the consumer group, and the prefix of its changelog topics) is
    ``<topic prefix>-worker`` unless given, so two pipelines on one cluster
    never share a group.
    """
    app_id = app_id or worker_group(settings)
    kafka = settings.kafka
    app = WorkerApp(
        app_id,
        broker=_broker_url(settings),
        broker_credentials=kafka.faust_credentials(),
        store="memory://",
        topic_partitions=kafka.node_partitions,
        topic_replication_factor=kafka.replication_factor,
        consumer_auto_offset_reset="earliest",
        broker_rebalance_timeout=kafka.rebalance_timeout_s,
        broker_session_timeout=kafka.session_timeout_s,
        consumer_group_instance_id=kafka.group_instance_id,
        broker_heartbeat_interval=min(1.0, kafka.session_timeout_s / 4),
        broker_commit_every=1000,
        broker_commit_interval=0.5,
        # No linger: the node join publishes a batch's outputs without yielding, so they
        # leave in one request anyway; a linger would only delay an urgent action.
        producer_linger=0.0,
        # A broker refuses a batch over its message.max.bytes, not only a record.
        producer_max_batch_size=min(BATCH_BYTES, kafka.max_message_bytes),
        producer_max_request_size=kafka.max_message_bytes,
        web_enabled=web_port is not None,
        web_port=web_port or 6066,
        datadir=datadir or f"/tmp/{app_id}-data",
        table_cleanup_interval=3600.0,
        # No standby replicas: with the memory store they buy nothing. A partition that
        # becomes active is replayed from the start of its changelog anyway (the store
        # persists no offset), and the store drops standby keys at every recovery's end,
        # so standbys only made every worker read every other worker's changelogs.
        table_standby_replicas=0,
        stream_wait_empty=False,
        key_serializer="raw",
        value_serializer="raw",
        Monitor=LeanMonitor,
        TableManager=PromptTableManager,
    )
    app.gpusteward_settings = settings
    app.health = Health()
    _watch_health(app, settings)
    policy = rules.policy if rules is not None and rules.policy else policy_from_env()
    samples_name = topics.SAMPLES.name(settings)
    hw_name = topics.HW_EVENTS.name(settings)
    alloc_name = topics.ALLOCATIONS.name(settings)

    outputs_to = OutputTopics(app, settings)
    clock_steps = outputs_to.metrics.clock_steps
    join = NodeJoin(rules, policy=policy, on_clock_step=lambda node, step: clock_steps.inc())

    # Values are msgpack-encoded NodeState bytes: the changelog carries exactly these.
    # The changelog partition of a node comes from its key, as its input records' does
    # (the same murmur2 of the node name), rather than from the event being processed:
    # a batch writes the states of nodes of several partitions at its end.
    state_table = app.Table(
        "node-state", partitions=kafka.node_partitions, key_type=bytes, value_type=bytes,
        use_partitioner=True, extra_topic_configs=topics.COMPACTED_SEGMENTS,
    )
    # A deleted node's state leaves the table once its partition's samples are
    # forget_deleted_s past the deletion (NodeStates.sweep), and a silent node's node
    # actions are asked for again by them (NodeStates._reask) and its silence told
    # (NodeStates._silences).
    departures = Departures(join.settings.forget_deleted_s, kafka.node_partitions)
    states = NodeStates(state_table, join.settings.checkpoint_interval_s, departures,
                        join.forget, join.reask_due, join.silence, held=lambda: {
                            tp.partition for tp in app.consumer.assignment()
                            if tp.topic == samples_name},
                        quiet_s=settings.quiet_partition_s)

    def forget_live_states(sender: Any, *args: Any, **kwargs: Any) -> None:
        states.forget_live()
        departures.forget()

    # mode's signal type asks for a positional-only sender that no def can spell here.
    app.on_partitions_revoked.connect(forget_live_states)  # type: ignore[arg-type]
    app.on_partitions_assigned.connect(forget_live_states)  # type: ignore[arg-type]

    # Each topic's edge (bounds, key, depth: gpusteward.edge) and the join's handler for it.
    # Event time only moves forward in a node's state: a record from a clock far ahead is
    # refused here, before it makes its node's later records look late.
    limits = Limits(max_future_s=settings.max_event_ahead_s)
    by_topic: dict[str, tuple[Edge[Any], Any]] = {
        samples_name: (Edge[NodeSample](NodeSample, key_of=_node, limits=limits),
                       join.on_sample),
        hw_name: (Edge[HwEvent](HwEvent, key_of=_node, limits=limits), join.on_hw_event),
        alloc_name: (Edge[AllocationEvent](AllocationEvent, key_of=topics.allocation_key,
                                           limits=limits),
                     join.on_allocation),
    }

    # One batch at a time across the two agents below: they share the nodes' states, and a
    # batch's checkpoint must never land after a later batch's one of the same node.
    one_batch = asyncio.Lock()

    def apply(to_write: dict[bytes, bytes], event: Any) -> list[Output]:
        message = event.message
        decode, handler = by_topic[message.topic]
        try:
            return states.apply(to_write, handler, decode(event.value, event.key),
                                message.partition,
                                message.offset if message.topic == samples_name else None)
        finally:
            if states.dropped:
                outputs_to.drop_states(state_table, message.partition, states.dropped)

    async def node_join(stream: Any) -> None:
        # Records are handled in batches, each record still validated and, if it fails,
        # dead-lettered on its own; a node's state is written to the changelog once per
        # batch, after the batch's findings and actions are delivered and before any offset
        # of the batch is acknowledged (at least once).
        current = partial(still_current, app)
        await each_batch(app, stream, lambda events: join_batch(
            events, outputs_to, states, apply, one_batch, current))

    # Hardware events have an agent of their own, on the same partitions (Faust assigns
    # topics of one partition count together) and the same node states: an urgent event
    # (a double-bit ECC error, an XID the driver reports at once) waits for at most the
    # batch being handled, never behind the second of samples fetched before it. The
    # rules order by event time, so an event handled before older samples of its node
    # means the same as after them.
    app.agent(raw_topic(app, samples_name, alloc_name, partitions=kafka.node_partitions),
              name="node-join")(node_join)
    app.agent(raw_topic(app, hw_name, partitions=kafka.node_partitions),
              name="node-join-hw")(node_join)

    @app.timer(interval=max(1.0, settings.quiet_partition_s / 4))
    async def quiet_partitions() -> None:
        await quiet_pass(app, outputs_to, states, one_batch)

    register_fleet_agent(app, settings, FleetSettings(policy=policy))
    return app


def _replayed(state: NodeState, sample: NodeSample, partition: int, offset: int) -> bool:
    """Whether ``sample`` (at ``offset`` of ``partition``) is one ``state`` has applied: read
    again from the last committed offset after a rebalance or a restart, while the state was
    written after it. Applied again, a catch-up's replay of one node's samples, far behind its
    newest, was refused as a clock gone back (dead letters) until the join took it for a new
    clock (its episodes moved back). Its event time must be no newer than the node's newest
    sample too, so a samples topic created again (offsets from 0) is read as new. Otherwise
    the sample's place is noted as the newest applied."""
    if partition == state.sample_partition and offset <= state.sample_offset:
        newest = state.rollups.watermark
        if newest is not None and sample.ts <= newest:
            return True
    state.sample_partition, state.sample_offset = partition, offset
    return False


SILENCE_CHECK_S = 60.0
"""Seconds of a partition's event time between its looks for silent nodes (a look reads
every node of the partition: 156 of a 1,250-node fleet's 8 partitions)."""


class NodeStates:
    """The worker's node states: those of its nodes decoded, over the changelog-backed table
    (msgpack-encoded :class:`NodeState` bytes by node name: the changelog carries exactly
    these).

    With ``departures``, the states of nodes deleted from the cluster are indexed as they
    are applied, and :meth:`sweep` removes them once their partition's samples are past the
    grace, after ``forget`` (the join's) gave what is due before (the node's last rollup
    minutes). So are the nodes with node actions to ask for again: a sample past one's due
    asks for it (``reask``, the join's), for a node whose own samples stopped
    (:meth:`_reask`); in a partition no node of which sends anything, the newest sample of
    the worker's other partitions does (:meth:`quiet`). The same clocks tell the nodes of
    the partition whose own samples stopped or never came (``silence``, the join's), every
    :data:`SILENCE_CHECK_S` of it (:meth:`_silences`), and a node at each of its
    inventories."""

    def __init__(self, table: Any, checkpoint_s: float,
                 departures: Departures | None = None,
                 forget: Callable[[NodeState, str], list[Output]] | None = None,
                 reask: Callable[[NodeState, str, float], list[Output]] | None = None,
                 silence: Callable[[NodeState, str, float], list[Output]] | None = None,
                 held: Callable[[], Collection[int]] | None = None,
                 quiet_s: float = 120.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.checkpoint_s = checkpoint_s
        self.departures = departures
        self.forget = forget
        self.reask = reask
        self.silence = silence
        self.held = held
        """The node topics' partitions this worker holds now (:meth:`quiet`); None:
        every partition it indexed."""
        self.quiet_s = quiet_s
        """Seconds of ``monotonic`` without a record after which a partition is quiet
        (``Settings.quiet_partition_s``)."""
        self.monotonic = monotonic
        self.heard: dict[int, float] = {}
        """By partition, when (``monotonic``) a batch last held a record of it."""
        self.started = monotonic()
        self.live: dict[bytes, tuple[NodeState, float]] = {}
        """Decoded states of this worker's nodes, with the event time of their last
        checkpoint. Cleared at every rebalance, when the table is the truth."""
        self.asking: dict[int, dict[bytes, float]] = {}
        """By partition, the nodes with node actions to ask for again and when the next is
        due, as last seen (each state says for sure): what :meth:`_reask` looks at. Cleared
        at every rebalance with :attr:`live`, and filled again from the table with the
        index of deleted nodes (:meth:`sweep`)."""
        self.first_due: dict[int, float] = {}
        """By partition, the earliest due of :attr:`asking` (or earlier): one test per
        sample."""
        self.members: dict[int, set[bytes]] = {}
        """By partition, the nodes with a state: those in the table after a rebalance
        (:meth:`sweep`), and those applied since. What :meth:`_silences` looks at."""
        self.look_due: dict[int, float] = {}
        """By partition, the event time of its next look for silent nodes."""
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(NodeState).decode
        self._decode_deletion = msgspec.msgpack.Decoder(NodeDeletion).decode
        self.dropped: list[Undecodable] = []
        """Table values this build could not decode, dropped for a fresh state in whole or
        in part (:func:`.outputs.restore`), until the caller reports them."""

    def apply(self, to_write: dict[bytes, bytes],
              handler: Callable[[NodeState, Any], list[Output]],
              record: Any, partition: int | None = None,
              offset: int | None = None) -> list[Output]:
        """Apply one decoded record to its node; nodes due for a checkpoint go to
        ``to_write``, encoded (written once the batch's findings and actions are delivered).
        ``partition``: the record's, for the index of deleted nodes (none without).
        ``offset``: a sample's, in the samples topic: one the state has applied already is
        skipped (:attr:`.NodeState.sample_offset`)."""
        node = record.node.encode()
        entry = self.live.get(node)
        if entry is None:
            if partition is not None:
                self.members.setdefault(partition, set()).add(node)
            stored = restore(self._decode, node, self.table.get(node), self.dropped,
                             NodeState)
            entry = (stored if stored is not None else NodeState(), -1.0)
        state, checkpointed_at = entry
        if offset is not None and partition is not None and _replayed(state, record,
                                                                       partition, offset):
            self.live[node] = (state, checkpointed_at)
            return []
        try:
            outputs = handler(state, record)
            # Write the changelog when the state matters for recovery (a rule emitted a
            # finding or action, the allocations changed) and otherwise every checkpoint_s
            # of event time. A worker that crashes between checkpoints recovers a state at
            # most that old; re-processing then republishes the same ids, which consumers
            # deduplicate. A node summary alone does not count: the next one replaces it; nor
            # does a rollup: one re-emitted after a crash has the same (device, minute) name,
            # and the store keeps one per name.
            # Either way: a node whose clock stepped back, its new clock taken, is written
            # again at once, not once its clock passes the last checkpoint again.
            due = abs(record.ts - checkpointed_at) >= self.checkpoint_s
            decisive = bool(outputs) and any(not isinstance(output, NodeSummary | Rollup)
                                             for output in outputs)
            if decisive or due or not isinstance(record, NodeSample):
                # Encoded here, so that a state the encoder refuses dead-letters the record.
                to_write[node] = self._encode(state)
                checkpointed_at = record.ts
        except Rejected:
            # Refused before it changed the state, but for the node's count of samples from a
            # clock gone back (how long they have kept to it), which is kept.
            self.live[node] = (state, checkpointed_at)
            raise
        except Exception:
            # The record may have half-changed the state: the node goes back to its last
            # checkpoint, as after a crash (a copy per record to roll back to would cost
            # more than the join itself): the one this batch encoded, if any, else the
            # table's. So what an earlier record of the batch changed that counts (an
            # allocation, a finding) stays, as those records are acknowledged; samples since
            # are re-learned.
            encoded = to_write.get(node)
            if encoded is None:
                self.live.pop(node, None)
            else:
                self.live[node] = (self._decode(encoded), checkpointed_at)
            raise
        self.live[node] = (state, checkpointed_at)
        departures = self.departures
        if departures is not None and partition is not None:
            if isinstance(record, NodeSample):  # a sample: one check unless its node is gone
                departures.advance(partition, record.ts)
                if state.deleted:
                    departures.note(partition, node, deleted_since(state))
            else:  # an inventory may delete the node, or create it again
                departures.note(partition, node, deleted_since(state))
                # Judged at once on its partition's clock: an inventory read after that
                # clock passed its silence (the watcher behind the collectors) might have no
                # later sample of the partition to look by.
                clock = departures.newest.get(partition)
                if clock is not None:
                    outputs = outputs + self._told_silent(to_write, node, state, clock)
            if state.asks_due is not None:  # almost never: a node action still asked for
                self._asking(partition, node, state.asks_due)
            if isinstance(record, NodeSample):
                first = self.first_due.get(partition)
                if first is not None and record.ts >= first:
                    outputs = outputs + self._reask(to_write, partition, record.ts)
                look = self.look_due.get(partition)
                if look is None or record.ts >= look:  # every SILENCE_CHECK_S of the partition
                    outputs = outputs + self._silences(to_write, partition, record.ts)
        return outputs

    def forget_live(self) -> None:
        """At a rebalance: what is known of the worker's nodes goes, the table is the truth."""
        self.live.clear()
        self.asking.clear()
        self.first_due.clear()
        self.members.clear()
        self.look_due.clear()

    def _asking(self, partition: int, node: bytes, due: float) -> None:
        self.asking.setdefault(partition, {})[node] = due
        first = self.first_due.get(partition)
        if first is None or due < first:
            self.first_due[partition] = due

    def sweep(self, to_remove: set[bytes], partitions: Iterable[int]) -> list[Output]:
        """Remove the states of the nodes of ``partitions`` deleted at least the grace ago
        (:class:`.outputs.Departures`): each goes to ``to_remove``, removed from the table (a
        tombstone on the changelog, so no restart or recovery brings it back) as the batch's
        states are written, once the outputs returned here (its open rollup minutes) are
        published.
        ``partitions``: of records this worker holds (still of its generation)."""
        departures, forget = self.departures, self.forget
        if departures is None or forget is None:
            return []
        if not departures.known:  # after a rebalance: the table is recovered by now
            departures.rebuild(self._index(self.table.items()))
        out: list[Output] = []
        for partition in partitions:
            for node in departures.due(partition):
                self.members.get(partition, set()).discard(node)
                state = self._state(node)
                if state is not None:
                    if deleted_since(state) is None:
                        continue  # created again: kept
                    out += forget(state, node.decode())
                self.live.pop(node, None)
                to_remove.add(node)
        return out

    def _reask(self, to_write: dict[bytes, bytes], partition: int, clock: float
               ) -> list[Output]:
        """The node actions of ``partition``'s nodes due by ``clock``, a sample of any of its
        nodes, asked for again (:meth:`.NodeJoin.reask_due`). A node's own samples ask for its
        actions (:meth:`.NodeJoin.on_sample`); this asks for those of a node whose samples
        stopped while its fault holds (its driver hung, its collector crashed), as long as
        another node of its partition sends samples. Per sample, not per batch, so a
        catch-up asks as often as a live worker. The index is a hint, each state says
        when its asks are due: a node re-asked keeps its index entry until it is looked at
        again, so one whose batch failed (its state unwritten) is asked for again."""
        asking = self.asking[partition]
        out: list[Output] = []
        for node in [node for node, due in asking.items() if due <= clock]:
            state = self._state(node)
            if state is None or state.asks_due is None:
                del asking[node]
                continue
            entry = self.live.get(node)
            asked = self.reask(state, node.decode(), clock) if self.reask is not None else []
            if asked:
                out += asked
                to_write[node] = self._encode(state)
                self.live[node] = (state, clock)
            else:
                self.live[node] = (state, entry[1] if entry is not None else -1.0)
                if state.asks_due is not None:
                    asking[node] = state.asks_due
        first = min(asking.values(), default=None)
        if first is None:
            del self.first_due[partition]
        else:
            self.first_due[partition] = first if first > clock else clock + 1.0
        return out

    def quiet(self, to_write: dict[bytes, bytes], partitions: Iterable[int]) -> list[Output]:
        """After a batch holding records of ``partitions``, and between batches (``()``, the
        worker's timer): in the partitions this worker holds that no batch has had a record
        of for ``quiet_s`` (of the process's clock, not event time: nothing arrives from
        them at all), the node actions due asked for again and the silent nodes told, by
        :meth:`clock`. A silent node alone in its partition (a small cluster) has no
        neighbour's sample to go by, and a worker whose every partition is quiet has no
        batch. A worker catching up reads every partition it holds, so this waits for a
        partition that is quiet, not behind."""
        now = self.monotonic()
        for partition in partitions:
            self.heard[partition] = now
        if self.departures is None:
            return []
        held = self.held() if self.held is not None else None
        quiet = [partition for partition in self.first_due.keys() | self.members.keys()
                 if (held is None or partition in held)
                 and now - self.heard.get(partition, self.started) > self.quiet_s]
        clock = self.clock(now, quiet) if quiet else None
        if clock is None:
            return []
        out: list[Output] = []
        for partition in quiet:
            first = self.first_due.get(partition)
            if first is not None and first <= clock:
                out += self._reask(to_write, partition, clock)
            look = self.look_due.get(partition)
            if look is None or look <= clock:
                out += self._silences(to_write, partition, clock)
        return out

    def clock(self, now: float, quiet: Iterable[int] = ()) -> float | None:
        """The event time now, as this worker can tell: the newest sample of each partition
        moved on by the process's time since a batch last held a record of it (collectors
        sample in real time), the latest of them; for a ``quiet`` partition with no sample
        since the rebalance, the newest its nodes' states hold, moved on since the worker
        started. A partition read in this batch counts as it is. None: nothing known."""
        departures = self.departures
        assert departures is not None
        known = dict(departures.newest)
        for partition in quiet:
            if partition not in known:
                stored = [state.rollups.watermark for node in self.members.get(partition, ())
                          if (state := self._state(node)) is not None
                          and state.rollups.watermark is not None]
                if stored:
                    known[partition] = max(stored)
        return max((ts + max(0.0, now - self.heard.get(partition, self.started))
                    for partition, ts in known.items()), default=None)

    def _silences(self, to_write: dict[bytes, bytes], partition: int, clock: float
                  ) -> list[Output]:
        """The nodes of ``partition`` silent by ``clock`` (a sample of any of its nodes, or
        of the worker's other partitions when none of its nodes sends anything), told once
        each (:meth:`.NodeJoin.silence`); the next look :data:`SILENCE_CHECK_S` later."""
        self.look_due[partition] = clock + SILENCE_CHECK_S
        if self.silence is None:
            return []
        nodes = self.members.get(partition, set())
        out: list[Output] = []
        for node in list(nodes):
            entry = self.live.get(node)
            state = entry[0] if entry is not None else self._state(node)
            if state is None:
                nodes.discard(node)
                continue
            told = self._told_silent(to_write, node, state, clock)
            if told:
                out += told
            elif entry is None:
                self.live[node] = (state, -1.0)
        return out

    def _told_silent(self, to_write: dict[bytes, bytes], node: bytes, state: NodeState,
                     clock: float) -> list[Output]:
        """The node's silence by ``clock``, if it is to be told now (:meth:`.NodeJoin.silence`),
        its state then written."""
        told = self.silence(state, node.decode(), clock) if self.silence is not None else []
        if told:
            to_write[node] = self._encode(state)
            self.live[node] = (state, clock)
        return told

    def _state(self, node: bytes) -> NodeState | None:
        """The node's state, live or from the table (None: not in it, or undecodable)."""
        entry = self.live.get(node)
        if entry is not None:
            return entry[0]
        return restore(self._decode, node, self.table.get(node), self.dropped, NodeState)

    def _index(self, items: Iterable[tuple[bytes, bytes]]
               ) -> Iterator[tuple[bytes, float | None]]:
        """Each stored state's node and when it was deleted (None: it was not, or the state
        does not decode: its next record reports it), noting on the way those with node
        actions to ask for again (:attr:`asking`; what this batch applied stays)."""
        departures = self.departures
        assert departures is not None
        for key, stored in items:
            try:
                fields = self._decode_deletion(stored)
            except msgspec.DecodeError:
                yield key, None
                continue
            when = deleted_since(fields)
            self.members.setdefault(departures.partition_of(key), set()).add(key)
            if fields.asks_due is not None and when is None:
                partition = departures.partition_of(key)
                if key not in self.asking.get(partition, {}):  # what this batch applied stays
                    self._asking(partition, key, fields.asks_due)
            yield key, when


async def join_batch(events: list[Any], outputs_to: OutputTopics, states: NodeStates,
                     apply: Callable[[dict[bytes, bytes], Any], list[Output]],
                     one_batch: asyncio.Lock,
                     current: Callable[[Sequence[Any]], list[Any]]) -> None:
    """One batch of the node join: apply each event (dead-lettering those that fail),
    publish the outputs, write the states due once the findings and actions are delivered,
    then acknowledge the events (the stream acknowledges the first as it moves on).

    Stopped part-way (cancelled) or failed (a delivery, a changelog write), it writes nothing
    and keeps the first event from being acknowledged (one more reference to its message, so
    the stream's acknowledgement is not the last): what the batch had not handed to the
    producer dies with the process, and the next worker reads the whole batch again from
    the last checkpoint, emitting what it had emitted again under the same ids. Writing
    the states then, as this did until 2026-11-26, recorded findings as reported that a
    publish blocked on a full producer buffer never sent; acknowledging the first event
    lost it when the stop came before it was applied (waiting for the other agent's batch).

    Only the events still ``current`` once the other agent's batch is done are applied: a
    rebalance while this one waited for it takes the others back (its seek delivers them
    again, perhaps to another worker, which owns their nodes' states now), and they are
    left unacknowledged, the first one too. A rebalance while the batch publishes takes the
    whole batch back the same way, its states unwritten: written, they could land on the
    changelog after the new owner of their nodes had restored them.
    """
    started = outputs_to.consumed_each(events)
    writes: dict[bytes, bytes] = {}
    gone: set[bytes] = set()
    todo: list[Any] = []
    try:
        async with one_batch:
            todo = current(events)
            outputs = await outputs_to.guarded_each(todo, "node-join", partial(apply, writes))
            # Nodes deleted long enough ago, of the partitions this batch shows held.
            partitions = {event.message.partition for event in todo}
            outputs += states.sweep(gone, partitions)
            if todo:
                outputs += states.quiet(writes, partitions)
            await outputs_to.emit_then_checkpoint(outputs, None)
            if len(current(todo)) < len(todo):
                # A rebalance came while the batch published: the same, written nowhere.
                # Its seek delivers the batch again, and its findings go out again under
                # the same ids.
                todo = []
                for node in writes:
                    states.live.pop(node, None)
            elif writes or gone:
                _checkpoint(states.table, writes, gone)
    except BaseException:
        # Stopped, or a delivery or a changelog write failed (a record's own failure is its
        # dead letter): nothing of the batch is acknowledged, the first event included.
        events[0].message.incref()
        for node in writes:  # not checkpointed: re-processing starts from the last
            states.live.pop(node, None)
        if states.departures is not None:  # the nodes swept are still in the table
            states.departures.known = False
        raise
    first = events[0]
    if not todo or todo[0] is not first:
        first.message.incref()  # not applied: the stream's acknowledgement must not count
    for event in todo:
        if event is not first:  # the stream acknowledges the first
            event.ack()
    if todo:
        outputs_to.processed(started, len(todo))


async def quiet_pass(app: Any, outputs_to: OutputTopics, states: NodeStates,
                     one_batch: asyncio.Lock) -> None:
    """Between batches, every ``quiet_partition_s / 4``: what :meth:`NodeStates.quiet` asks
    for in the partitions no record came from. A worker none of whose partitions sends
    anything (a small cluster whose one node of this worker's went silent, as many workers
    as partitions) has no batch to do it after. Its outputs are published and the states
    they changed written as a batch's are; a rebalance meanwhile writes nothing (the
    partitions' new owner asks again)."""
    if not app.flow_control.is_active():
        return
    generation = app.consumer_generation_id
    writes: dict[bytes, bytes] = {}
    async with one_batch:
        states.sweep(set(), ())  # after a rebalance: the index of the table's nodes
        outputs = states.quiet(writes, ())
        if not outputs:
            return
        try:
            await outputs_to.emit_then_checkpoint(outputs, None)
        except Exception as error:
            for node in writes:
                states.live.pop(node, None)
            await crash_unread(app, error)
            raise
        if app.flow_control.is_active() and app.consumer_generation_id == generation:
            _checkpoint(states.table, writes)
        else:
            for node in writes:
                states.live.pop(node, None)


def _checkpoint(table: Any, writes: dict[bytes, bytes], gone: Iterable[bytes] = ()) -> None:
    """Write the batch's encoded node states to the changelog-backed table, and remove the
    ``gone`` nodes' (a tombstone on the changelog)."""
    for node, state in writes.items():
        table[node] = state
    for node in gone:
        table.pop(node, None)


def _node(record: NodeSample | HwEvent) -> str:
    """The key a node's samples and hardware events are published under."""
    return record.node


def _watch_health(app: WorkerApp, settings: Settings) -> None:
    """Beat while the loop turns; stop the worker, non-zero, when its topics disappear.

    Both run from the app's start, through the table recovery
    (:meth:`WorkerApp.early_task`): live means the process's loop turns, whatever it is
    busy with. Faust retries UnknownTopicOrPartition forever (a broker restarted empty);
    crashing the app makes ``gpusteward worker`` exit with an error, and its
    supervisor's restart creates the topics and the group again.
    """
    inputs = [spec.name(settings) for spec in (topics.SAMPLES, topics.HW_EVENTS,
                                                topics.ALLOCATIONS)]

    @app.early_task
    async def beat() -> None:
        await health.heartbeat(app.health)

    @app.early_task
    async def watch_topics() -> None:
        reason = await health.watch_topics(app.health, inputs,
                                           lambda: kafka.list_topics(settings))
        await app.crash(RuntimeError(reason))

