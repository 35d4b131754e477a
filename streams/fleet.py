"""The fleet agent: fragmentation, stranded demand, queue SLOs and spot interruptions.

Two Faust agents, added to the worker app by :func:`register_fleet_agent`:

- ``fleet`` reads the node summaries and the queue events. Both topics have
  one partition, and Faust's assignor gives the same partition number of
  every subscribed topic to one worker, so exactly one worker in the group
  sees the whole fleet and the whole queue: the rules that compare nodes
  with each other and with pending demand (FGD fragmentation, stranded
  demand, queue SLOs) need that global view. The latest summary per node is
  a one-partition table (one changelog record per node and batch); the rest
  of its state (the queue rules' state, the open episodes) is one msgpack
  value in another, written with every batch holding a queue event and
  whenever a rule emits something, and otherwise every
  ``checkpoint_interval_s`` of event time; its per-workload maps in chunks,
  of which a write sends those that changed (:mod:`.stored`). All of it is
  written after the findings and actions of the records it holds are delivered.
  A restarted worker resumes with every queue event it applied and at most
  that much of summaries to re-learn (re-processing republishes the same
  ids, which consumers deduplicate).
- ``fleet-spot`` reads the allocation topic. Spot requeue is global in
  intent but local in data: a termination taint on node N requeues the pods
  on node N, and both the node's inventory and its pods' events are keyed
  by N and land in N's partition. So the agent is partitioned like the node
  join, each worker handling the nodes of its partitions, and the table it
  keeps (one value per node) has the allocation topic's partition count.
  Reading all allocation partitions on the single fleet agent instead would
  put every pod event of the fleet through one consumer for a per-node
  rule, and Faust has no way to subscribe one agent to all partitions of a
  topic outside the group's assignment anyway.

The ``fleet`` agent also advises MIG layouts: every ``mig_advice_interval_s``
of event time it plans each GPU-model pool's layouts for the MIG demand the
queue showed over a trailing window (:mod:`gpusteward.rules.mig.observed`
says what is derived and what has to be guessed) and publishes one info
finding per pool whose plan changes a node. The search runs in a thread,
once an interval; the per-record cost is a few dictionary updates.

The fleet-wide rules are the registry's fleet runners (:mod:`gpusteward.rules`):
every evaluation builds one view of the fleet (the nodes' latest summaries,
the demand pending in the queue) and runs each runner on it; queue events
feed the queue rule's state, which that view reads. A runner may also follow
every queue event (gangs and start ETAs track members and run times the
pending demand does not hold) and every node summary (team budgets integrate
each node's own summaries, exact however the nodes interleave). Every rule's
settings come from the policy by the rule's name.

The logic lives in :class:`FleetEvaluator` and :class:`SpotJoin`, which do no
I/O and are tested without a broker. Fleet rules are evaluated on the event
time carried by the records (the latest seen), at most every
``evaluate_interval_s`` of it or of the summaries' own clock (which a queue read
ahead leaves behind): evaluating FGD on every one of 1,250 summaries a
minute would be wasted work, since the measure changes slowly.

It stays one module: the fleet agent's state, its single partition and the order in
which fleet rules see summaries and queue events belong together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import faust
import msgspec
from faust.types import TP

from gpusteward import topics
from gpusteward.edge import Edge, Limits, Rejected
from gpusteward.rules import REGISTRY, Registry
from gpusteward.rules import fragmentation as frag
from gpusteward.rules import queue as queue_rules
from gpusteward.rules import spot as spot_rules
from gpusteward.rules.mig import advice as mig_advice
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.rules.mig import layout as mig_layout
from gpusteward.rules.mig import observed as mig_observed
from gpusteward.rules.policy import Policy
from gpusteward.rules.registry import FleetRunner, state_in
from gpusteward.schema import (
    Action,
    AllocationEvent,
    Finding,
    NodeInventory,
    NodeSummary,
    QueueEvent,
    summary_follows,
)
from gpusteward.settings import Settings
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
from gpusteward.streams.stored import in_chunks, joined

log = logging.getLogger(__name__)

FleetOutput = Finding | Action


@dataclass
class FleetSettings:
    """The fleet agents' own settings; the rules' come from the policy."""

    policy: Policy | None = None
    """The rule policy, resolved fleet-wide (no pool, queue or namespace layer); None: every
    rule's defaults."""
    evaluate_interval_s: float = 30.0
    """Event-time seconds between two evaluations of the fleet-wide rules: fragmentation
    and queue SLOs move on the scale of minutes, and 30 s keeps detection within one
    sample interval of the usual collectors."""
    node_stale_s: float = 600.0
    """A node not heard from while the summaries moved on this far (event-time seconds, the
    newest summary's) has left the fleet: ten summary intervals of the node join's default."""
    checkpoint_interval_s: float = 30.0
    """Event-time seconds between two changelog writes of the fleet state when nothing
    was emitted."""
    spot_forget_deleted_s: float = 3600.0
    """Event-time seconds after a node's deletion that the ``fleet-spot`` agent keeps its
    track, measured on the allocation records of the node's partition (other nodes':
    a deleted node's own stop with its pods' deletions); then the track is removed from
    the table and its changelog. 1 h, as the node join's ``forget_deleted_s``: a late pod
    event of the node (the pod garbage collector's, seconds after the node) finds its
    track; one read later would start a track afresh."""


class FleetState(msgspec.Struct):
    """Everything the fleet agent knows."""

    nodes: dict[str, NodeSummary] = {}
    """The latest summary per node. Kept in a table of its own (one record per node), not
    in the checkpointed value, which stays small however large the fleet."""
    departed: list[str] = []
    """Nodes dropped as stale since the caller last looked (to delete from that table)."""
    heard: dict[str, float] = {}
    """The summaries' clock when each node's latest summary came, as the staleness of a node
    is judged: a node join behind on some partitions (a worker catching up) sends its nodes'
    summaries late, and those nodes are still there. Not checkpointed: after a restart, a node
    not heard from yet counts as heard at its summary's own time."""
    queue: queue_rules.QueueState = msgspec.field(default_factory=queue_rules.QueueState)
    stranded: frag.StrandedTrack = msgspec.field(default_factory=frag.StrandedTrack)
    fragmentation: frag.FragmentationTrack = msgspec.field(
        default_factory=frag.FragmentationTrack)
    shape_counts: dict[str, int] = {}
    """Observed request shapes ('<gpus>x<milli>'), one count per workload that queued."""
    clock: float | None = None
    """Event time the fleet rules have been evaluated up to; never goes back."""
    summary_clock: float | None = None
    queue_clock: float | None = None
    last_evaluation: float | None = None
    seen_at_evaluation: float | None = None
    """The summaries' clock at the last evaluation: while the queue is read ahead of the
    summaries (a node join catching up), they make an evaluation due as they advance."""
    queue_offset: int = -1
    """Offset of the last queue record applied; checkpointed with the rest so that a
    restarted worker knows whether it has read the queue as far as the state says."""
    mig: mig_observed.MigObservation = msgspec.field(
        default_factory=mig_observed.MigObservation)
    """MIG demand and layouts seen, for the periodic layout advice."""
    tracks: dict[str, Any] = {}
    """State of the fleet runners that name no field above, by the runner's state name
    (plain data after a restart, turned back into the runner's type on first use)."""


_TYPED_TRACKS = frozenset({"queue", "fragmentation", "stranded"})
"""Fleet runner state names that are typed fields of :class:`FleetState`."""


def _track(state: FleetState, runner: FleetRunner) -> Any:
    name = runner.state
    if name in _TYPED_TRACKS:
        return getattr(state, name)
    return state_in(state.tracks, name, runner.state_type)


class FleetEvaluator:
    """Folds node summaries and queue events into :class:`FleetState` and runs the rules."""

    def __init__(self, settings: FleetSettings | None = None,
                 geometries: dict[str, mig_geometry.Geometry] | None = None,
                 registry: Registry = REGISTRY) -> None:
        self.settings = settings or FleetSettings()
        policy = self.settings.policy or Policy(registry=registry)
        registry = policy.registry
        self.rules = policy.resolve()
        self.queue_settings = self.rules.of(queue_rules.WAIT_KIND, queue_rules.QueueSloSettings)
        self.mig_advice_settings = self.rules.of(mig_advice.KIND, mig_advice.MigAdviceSettings)
        self._runners = [(runner, self.rules[rule.name]) for rule in registry.in_scope("fleet")
                         for runner in rule.fleet]
        """Every fleet runner of the registry, in its order, with its rule's settings."""
        self._queue_runners = [(r, s) for r, s in self._runners if r.on_queue is not None]
        """The runners that follow every queue event."""
        self._summary_runners = [(r, s) for r, s in self._runners if r.on_summary is not None]
        """The runners that follow every node summary."""
        self._geometries = geometries

    @property
    def geometries(self) -> dict[str, mig_geometry.Geometry]:
        """The shipped MIG geometries, read on first use (the advice is their only user)."""
        if self._geometries is None:
            self._geometries = mig_geometry.load()
        return self._geometries

    def on_summary(self, state: FleetState, summary: NodeSummary, *,
                   queue_caught_up: bool = True) -> list[FleetOutput]:
        """Fold a node summary in. ``queue_caught_up``: every queue event published so far
        has been applied, so the queue state is true up to the summaries' time too."""
        known = state.nodes.get(summary.node)
        if known is None or summary_follows(summary, known.ts, known.clock_steps):
            # A deleted node's tombstone is kept as its latest summary, out of every view
            # (:func:`live_nodes`), so that an older summary redelivered after it does
            # not bring the node back; it goes as any node does, once stale.
            state.nodes[summary.node] = summary
            state.heard[summary.node] = max(summary.ts, state.summary_clock or summary.ts)
        if state.nodes[summary.node].deleted:
            state.mig.instances.pop(summary.node, None)
        else:
            mig_observed.on_summary(state.mig, summary)
        out: list[FleetOutput] = []
        for runner, settings in self._summary_runners:
            assert runner.on_summary is not None
            out += runner.on_summary(_track(state, runner), summary, settings)
        state.summary_clock = max(summary.ts, state.summary_clock or summary.ts)
        return out + self._advance(state, queue_caught_up)

    def on_queue(self, state: FleetState, event: QueueEvent, *,
                 queue_caught_up: bool = True) -> list[FleetOutput]:
        key = queue_rules.workload_key(event)
        was_waiting = key in state.queue.waiting
        last = state.queue.last_event.get(key)
        out: list[FleetOutput] = list(queue_rules.on_event(state.queue, event,
                                                           self.queue_settings))
        if state.queue.last_event.get(key) != last:
            # Only events the queue rules applied: a late duplicate of a pending event must
            # not bring a finished workload's demand back.
            mig_observed.on_queue(state.mig, key, event)
        if not was_waiting and key in state.queue.waiting and event.gpus > 0:
            shape = f"{event.gpus}x{frag.WHOLE}"
            state.shape_counts[shape] = state.shape_counts.get(shape, 0) + 1
        for runner, settings in self._queue_runners:
            assert runner.on_queue is not None
            out += runner.on_queue(_track(state, runner), event, settings)
        state.queue_clock = max(event.ts, state.queue_clock or event.ts)
        return out + self._advance(state, queue_caught_up)

    def _advance(self, state: FleetState, queue_caught_up: bool) -> list[FleetOutput]:
        # The queue rules may only judge a time the queue stream has been read up to: with
        # the queue behind (a worker catching up), a workload that looks pending may have
        # been admitted in a record not read yet. So the clock follows the queue's event
        # time, and moves on with the summaries' only when the queue is caught up.
        clocks = [c for c in (state.queue_clock, state.summary_clock if queue_caught_up
                              else None) if c is not None]
        if not clocks:
            return []
        if state.clock is None or max(clocks) > state.clock:
            state.clock = max(clocks)
        if not queue_caught_up and (state.queue_clock is None
                                    or state.queue_clock < state.clock):
            # The summaries moved the clock on while the queue was read to its end, and
            # queue records have come since, not all applied yet, perhaps from before the
            # clock: the queue state is not known true at the clock until they are (a
            # job's admission in the next record must not leave its pending judged
            # minutes late). The evaluation waits for them, a batch or so; due stays due.
            return []
        interval = self.settings.evaluate_interval_s
        # Also as the summaries advance behind a queue read ahead, at the same ``now``: the
        # fleet's view (and the episodes it times by ``seen``) moves on with them, not only
        # once they pass the queue's last event.
        due = (state.last_evaluation is None or state.clock - state.last_evaluation >= interval
               or (state.summary_clock is not None
                   and (state.seen_at_evaluation is None
                        or state.summary_clock - state.seen_at_evaluation >= interval)))
        return self.evaluate(state, state.clock) if due else []

    def fragmentation(self, state: FleetState) -> frag.FragmentationReport:
        settings = self.rules.of(frag.KIND, frag.FragmentationSettings)
        return frag.cluster_fragmentation((frag.free_milli(s) for s in live_nodes(state)),
                                          frag.shapes(state.shape_counts, settings))

    def evaluate(self, state: FleetState, now: float) -> list[FleetOutput]:
        """Run every fleet runner of the registry at event time ``now``."""
        state.last_evaluation, state.seen_at_evaluation = now, state.summary_clock
        # Staleness is judged on the summaries' own clock, not the queue's: a node join
        # behind the queue (catching up) has not lost the fleet's nodes.
        seen = now if state.summary_clock is None else state.summary_clock
        horizon = seen - self.settings.node_stale_s
        for node in [n for n, s in state.nodes.items()
                     if state.heard.get(n, s.ts) < horizon]:
            del state.nodes[node]
            state.heard.pop(node, None)
            state.departed.append(node)
        fleet = frag.FleetView(
            nodes=live_nodes(state),
            pending={key: frag.Demand(key=key, queue=w.queue, gpus=w.gpus, mig=w.mig,
                                      since=w.pending_since, pod_sets=tuple(w.pod_sets))
                     for key, w in state.queue.waiting.items()},
            shape_counts=state.shape_counts, seen=state.summary_clock)
        out: list[FleetOutput] = []
        for runner, settings in self._runners:
            out += runner.evaluate(_track(state, runner), fleet, now, settings)
        return out

    def mig_advice_due(self, state: FleetState) -> float | None:
        """The start of an advice interval the clock has entered and nobody advised yet.

        The first interval seen only starts the observation (recorded in ``state``): its
        demand and layouts are partial. Cheap, to call after every record;
        :meth:`mig_advice` is the costly part.
        """
        if state.clock is None:
            return None
        slot = mig_observed.slot_of(state.clock, self.mig_advice_settings.interval_s)
        if state.mig.last_slot is None:
            state.mig.last_slot = slot
            return None
        return slot if slot > state.mig.last_slot else None

    def mig_advice(self, state: FleetState, slot: float) -> list[FleetOutput]:
        """The MIG layout advice at the start of interval ``slot``, as findings.

        Their time is ``slot`` and their id derives from the window's start, so a worker
        that re-runs the same interval (a restart) publishes the same ids. The interval's
        observed layouts are then re-learnt from scratch (see :mod:`..rules.mig.observed`).
        """
        window_s = self.mig_advice_settings.window_s
        try:
            advice = mig_observed.advise(self.geometries, live_nodes(state), state.mig,
                                         now=slot, window_s=window_s)
            out: list[FleetOutput] = list(mig_observed.supersede(
                state.mig, mig_layout.advice_findings(
                    advice, ts=slot, window_start=slot - window_s,
                    period=_period(window_s), source="the weekly report"), slot))
        except (mig_geometry.GeometryError, RuntimeError) as error:
            # A failed search must not stop the fleet rules: say so, try next interval.
            log.warning("MIG layout advice at %.0f failed: %s", slot, error)
            out = []
        mig_observed.restart_interval(state.mig, slot, live_nodes(state),
                                      forget_before=slot - window_s)
        return out


def live_nodes(state: FleetState) -> list[NodeSummary]:
    """The latest summary of every node in the fleet: the deleted nodes' tombstones left
    out."""
    return [s for s in state.nodes.values() if not s.deleted]


def _period(seconds: float) -> str:
    """What a share of a window of ``seconds`` is a share of, in words."""
    for name, length in (("week", 7 * 86400.0), ("day", 86400.0), ("hour", 3600.0)):
        if seconds == length:
            return name
    return f"{seconds / 3600:g}h-window"


class SpotJoin:
    """Folds one node's allocation events into its spot track."""

    def __init__(self, settings: spot_rules.SpotSettings | None = None) -> None:
        self.settings = settings or spot_rules.SpotSettings()

    def on_allocation(self, track: spot_rules.SpotNodeTrack,
                      event: AllocationEvent) -> list[FleetOutput]:
        if isinstance(event, NodeInventory):
            out = spot_rules.on_inventory(track, event, self.settings)
            # Inventories arrive every few minutes: a good moment to forget old pods.
            spot_rules.forget_finished_pods(track, event.ts - 3600)
            return out
        return spot_rules.on_pod(track, event, self.settings)


class _SpotDeletion(msgspec.Struct):
    """Of a stored spot track, when its node was deleted: read for every track of the table
    after a rebalance, the rest skipped."""

    deleted_at: float | None = None


class _Snapshot:
    """Whether the fleet agent's live state holds records due a checkpoint that are not
    written yet."""

    __slots__ = ("due",)

    def __init__(self) -> None:
        self.due = False


async def fleet_batch(events: list[Any], outputs_to: OutputTopics,
                      apply: Callable[[Any], Awaitable[list[FleetOutput]]],
                      checkpoint: Callable[[], None], forget: Callable[[], None],
                      current: Callable[[Sequence[Any]], list[Any]]) -> None:
    """One batch of the fleet agent, as the node join's: apply each event (dead-lettering
    those that fail), then one ``checkpoint`` and the events acknowledged (the stream
    acknowledges the first as it moves on).

    A record whose rules emitted findings or actions checkpoints once they are delivered:
    the state says they were reported, and written first, a crash between the two writes
    would lose them (recovery trusts the changelog and re-processing emits nothing).

    A batch that cannot finish writes nothing more and leaves its records unacknowledged,
    the first one too (one more reference to its message), for them to be read again from
    the last checkpoint: stopped part-way (writing then recorded as reported the findings of
    a record whose publish the stop cut short), a delivery failed (raised, for the worker to
    stop), or a rebalance took the batch back (its seek delivers the records again, perhaps
    to another worker, which restored the tables from the changelog: written after that,
    this worker's state would land on the changelog behind the new owner's).
    """
    first = events[0]
    dead_letters: list[Awaitable[Any]] = []
    taken_back = False
    try:
        for event in events:
            if not current([event]):
                taken_back = True
                break
            outputs = await outputs_to.guarded(event, "fleet", apply, dead_letters)
            if outputs:
                await outputs_to.emit_then_checkpoint(outputs, None)
            if not current([event]):  # a rebalance while it was applied or published
                taken_back = True
                break
            if outputs:
                checkpoint()
        await asyncio.gather(*dead_letters)
    except BaseException:
        forget()
        first.message.incref()
        raise
    if taken_back or len(current(events)) < len(events):
        forget()
        first.message.incref()
        return
    checkpoint()
    for event in events[1:]:
        event.ack()


def register_fleet_agent(app: faust.App, settings: Settings,
                         rules: FleetSettings | None = None) -> None:
    """Add the ``fleet`` and ``fleet-spot`` agents and their tables to the worker ``app``."""
    evaluator = FleetEvaluator(rules)
    spot_join = SpotJoin(evaluator.rules.of(spot_rules.KIND, spot_rules.SpotSettings))
    checkpoint_s = evaluator.settings.checkpoint_interval_s
    kafka = settings.kafka

    summaries_name = topics.NODE_SUMMARIES.name(settings)
    queue_name = topics.QUEUE.name(settings)
    fleet_topics = raw_topic(app, summaries_name, queue_name, partitions=1)
    allocations = raw_topic(app, topics.ALLOCATIONS.name(settings),
                            partitions=topics.ALLOCATIONS.partition_count(settings))
    outputs_to = OutputTopics(app, settings)

    changelogged = partial(app.Table, key_type=bytes, value_type=bytes,
                           extra_topic_configs=topics.COMPACTED_SEGMENTS)
    fleet_table = changelogged("fleet-state", partitions=1)
    nodes_table = changelogged("fleet-nodes", partitions=1)
    mig_table = changelogged("fleet-mig-workloads", partitions=1)
    spot_table = changelogged("fleet-spot", partitions=kafka.node_partitions)
    encode_msgpack = msgspec.msgpack.Encoder().encode
    decode_fleet = msgspec.msgpack.Decoder(FleetState).decode
    decode_track = msgspec.msgpack.Decoder(spot_rules.SpotNodeTrack).decode
    decode_mig_workload = msgspec.msgpack.Decoder(mig_observed.MigWorkload).decode
    decode_summary = msgspec.json.Decoder(NodeSummary).decode

    def stored_state(state: FleetState) -> FleetState:
        """What of the fleet state its changelog value holds: not the nodes' summaries and
        the MIG workloads, which have tables of their own (one record per key), nor when
        each node was heard from."""
        return msgspec.structs.replace(
            state, nodes={}, departed=[], heard={}, mig=msgspec.structs.replace(
                state.mig, workloads={}, touched=[]))

    # The edges of the fleet's inputs (bounds, key, depth: gpusteward.edge).
    limits = Limits(max_future_s=settings.max_event_ahead_s)
    summary_edge = Edge[NodeSummary](NodeSummary, key_of=lambda s: s.node, limits=limits)
    queue_edge = Edge[QueueEvent](QueueEvent, key_of=lambda q: q.cluster_queue, limits=limits)
    alloc_edge = Edge[AllocationEvent](AllocationEvent, key_of=topics.allocation_key,
                                       limits=limits)
    state_key = b"fleet"
    # The fleet state's records stay well under the largest the brokers take: its value
    # grows with the workloads the queue follows (about 1 MB at 7,000 running GPU pods).
    part_bytes = kafka.max_message_bytes // 2
    dropped: list[Undecodable] = []
    """Table values this build could not decode, until reported (:func:`.outputs.restore`)."""
    # The decoded fleet state and the event time of its last checkpoint; dropped on every
    # rebalance, when the table becomes the truth again.
    live: dict[bytes, tuple[FleetState, float]] = {}

    # What the records folded since the last write changed in the three tables, by table
    # and key (None: a deletion), written together once per batch before its records are
    # acknowledged, and after every record with findings or actions once they are
    # delivered. The three are one snapshot of the fleet: the state after the records
    # folded so far, the latest summary per node, the MIG workloads. Written as they came,
    # a worker killed before a record's findings were delivered (or a delivery that failed)
    # left tables holding summaries from after the record the fleet state is at, and
    # re-processing judged the fleet with a view of its future. Written per batch, a batch
    # also writes one changelog record per key: one per queue event put every admission's
    # whole queue state (about 100 KB on a 10,000-GPU fleet) on the changelog.
    recent: dict[tuple[Any, bytes], bytes | None] = {}

    # The fleet state itself is encoded when it is written, not after each record due a
    # checkpoint: with 2,600 workloads it is about 120 KB and 200 µs to encode, and a
    # catch-up brings thousands of queue events, every one due. A record that fails
    # part-way has half-changed the live state; it is rolled back by folding the records
    # since the last write again onto the tables (`since_written`: the event, and whether
    # the queue was caught up when it was folded, so the second fold judges as the first
    # did; their table writes go to `recent` again).
    since_written: list[tuple[Any, bool]] = []
    snapshot = _Snapshot()

    def write_checkpoint() -> None:
        """Write what the records folded since the last write changed: their table writes,
        and the fleet state if any of them was due a checkpoint."""
        writes: dict[tuple[Any, bytes], bytes | None] = {}
        if snapshot.due and state_key in live:
            for key, value in in_chunks(state_key, stored_state(live[state_key][0]),
                                        fleet_table.keys(), part_bytes):
                writes[fleet_table, key] = value
        writes.update(recent)
        for (table, key), value in writes.items():
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value
        recent.clear()
        snapshot.due = False
        since_written.clear()

    def forget_unwritten() -> None:
        """Drop the live state and what the records since the last write changed: the
        state goes back to the tables, as after a crash, and those records are read again
        (they are not acknowledged), by this worker or the partition's new owner."""
        live.pop(state_key, None)
        since_written.clear()
        recent.clear()
        snapshot.due = False

    # Deleted nodes' spot tracks, removed once their partition's allocation records are
    # spot_forget_deleted_s past the deletion (as the node join's states).
    spot_departures = Departures(evaluator.settings.spot_forget_deleted_s,
                                 kafka.node_partitions)
    decode_spot_deletion = msgspec.msgpack.Decoder(_SpotDeletion).decode

    def spot_deleted_at(stored: bytes) -> float | None:
        try:
            return decode_spot_deletion(stored).deleted_at
        except msgspec.DecodeError:  # its next record reports it
            return None

    def forget_live_state(sender: Any, *args: Any, **kwargs: Any) -> None:
        # A rebalance: what was not written belongs to records not acknowledged, which its
        # seek delivers again, perhaps to another worker that restores the tables from the
        # changelog. Kept and written with the batch's end, as this did until 2026-11-26,
        # it reached the changelog after the new owner had read it.
        forget_unwritten()
        spot_departures.forget()

    # mode's signal type asks for a positional-only sender that no def can spell here.
    app.on_partitions_revoked.connect(forget_live_state)  # type: ignore[arg-type]
    app.on_partitions_assigned.connect(forget_live_state)  # type: ignore[arg-type]

    def load_state(event: Any) -> FleetState:
        """The fleet state as the tables hold it. A value this build cannot decode (a newer
        release's, or corrupt) is dropped and reported (:func:`.outputs.restore`), and
        deleted with the next write: a node waits for its next summary, a MIG workload is
        forgotten; the fleet state and a node's spot track keep each of their fields that
        decodes on its own (the queue, the fragmentation episodes, a rule's track) and start
        the others afresh. ``event``: the record being processed, whose partition the
        reports name."""
        def restored(table: Any, decode: Callable[[bytes], Any],
                     values: Iterable[tuple[bytes, bytes]],
                     loose: type | None = None) -> dict[str, Any]:
            kept: dict[str, Any] = {}
            for key, value in values:
                decoded = restore(decode, key, value, dropped, loose)
                if decoded is not None:
                    kept[key.decode()] = decoded
            if table is not fleet_table:  # the fleet state's fresh value replaces its own
                for gone in dropped:
                    recent[table, gone.key] = None
            if dropped:
                outputs_to.drop_states(table, event.message.partition, dropped)
            return kept

        stored = fleet_table.get(state_key)
        try:
            stored = joined(state_key, stored, fleet_table.get)
        except msgspec.DecodeError as error:
            dropped.append(Undecodable(state_key, stored or b"", error))
            stored = None
        fleet_values = [] if stored is None else [(state_key, stored)]
        loaded = (restored(fleet_table, decode_fleet, fleet_values, FleetState)
                  .get(state_key.decode()) or FleetState())
        loaded.nodes = restored(nodes_table, decode_summary, nodes_table.items())
        loaded.mig.workloads = restored(mig_table, decode_mig_workload, mig_table.items())
        return loaded

    queue_tp = TP(queue_name, 0)

    def queue_caught_up(state: FleetState) -> bool:
        """True when every queue event published so far has been applied."""
        highwater = app.consumer.highwater(queue_tp)
        return highwater is not None and state.queue_offset + 1 >= highwater

    def decode(event: Any, state: FleetState) -> NodeSummary | QueueEvent:
        if event.message.topic == queue_name:
            # A queue record read counts as applied, refused or not: a refused one at the
            # tail must not keep the queue "behind" (queue_caught_up) for ever. So it makes
            # the state due a checkpoint as a valid one does: a refused record alone in its
            # batch, its offset never written, came back after a rebalance or a restart as
            # a queue "behind" until the next valid queue event, and node summaries stopped
            # moving the fleet's clock meanwhile.
            state.queue_offset = max(state.queue_offset, event.message.offset)
            snapshot.due = True
            return queue_edge(event.value, event.key)
        return summary_edge(event.value, event.key)

    async def apply_fleet(event: Any) -> list[FleetOutput]:
        entry = live.get(state_key)
        if entry is None:
            entry = live[state_key] = (load_state(event), -1.0)
        state, checkpointed_at = entry
        record = decode(event, state)  # a refused record changes nothing but the offset
        caught_up = queue_caught_up(state)
        try:
            outputs = await fold(event, record, state, checkpointed_at, caught_up)
        except Exception:
            # The record may have half-changed the state: back to the state after the last
            # whole record, rebuilt from the tables and the records since the last write.
            await roll_back(event)
            raise
        since_written.append((event, caught_up))
        return outputs

    async def roll_back(event: Any) -> None:
        folded = list(since_written)
        forget_unwritten()  # a MIG advice that failed too: its thread has ended
        live[state_key] = (load_state(event), -1.0)
        try:
            for event, caught_up in folded:
                state, checkpointed_at = live[state_key]
                if await fold(event, decode(event, state), state, checkpointed_at, caught_up):
                    # Records with outputs are checkpointed at once, so none is folded
                    # again; one that has some now did not the first time.
                    log.warning("a fleet record folded again after a failed one gave "
                                "outputs it had not given; they are not published")
                since_written.append((event, caught_up))
        except Exception:
            # Folded once without failing, it failed now: back to the last write, as
            # after a crash (the records since are not in the fleet state).
            log.exception("the fleet state could not be rebuilt after a failed record; "
                          "back to its last snapshot, %d records not in it", len(folded))
            forget_unwritten()

    async def fold(event: Any, record: NodeSummary | QueueEvent, state: FleetState,
                   checkpointed_at: float, caught_up: bool) -> list[FleetOutput]:
        # The record's table writes, kept only once it has been folded whole: a record
        # that fails part-way leaves nothing for a checkpoint to write.
        writes: dict[tuple[Any, bytes], bytes | None] = {}
        if isinstance(record, NodeSummary):
            outputs = evaluator.on_summary(state, record, queue_caught_up=caught_up)
            if state.nodes.get(record.node) is record:
                writes[nodes_table, record.node.encode()] = event.value
        else:
            outputs = evaluator.on_queue(state, record, queue_caught_up=caught_up)
        slot = evaluator.mig_advice_due(state)
        if slot is not None:
            # Seconds of solver time on a large fleet: off the event loop, so the
            # consumer keeps heart-beating. Nothing else touches this state meanwhile:
            # this agent awaits it before taking the next record. A stop or a rebalance
            # meanwhile drops the batch, this record with it (fleet_batch).
            outputs += await asyncio.to_thread(evaluator.mig_advice, state, slot)
        for node in state.departed:
            writes[nodes_table, node.encode()] = None
        for key in state.mig.touched:
            workload = state.mig.workloads.get(key)
            writes[mig_table, key.encode()] = (
                None if workload is None else encode_msgpack(workload))
        # Queue events are checkpointed with their batch, before it is acknowledged (a lost
        # admission would leave a phantom pending workload after a restart); summaries only
        # every checkpoint_s, since the next summary of a node replaces a lost one.
        if (outputs or isinstance(record, QueueEvent)
                or record.ts - checkpointed_at >= checkpoint_s):
            snapshot.due = True
            checkpointed_at = record.ts
        state.departed = []
        state.mig.touched = []
        recent.update(writes)
        live[state_key] = (state, checkpointed_at)
        return outputs

    @app.agent(fleet_topics, name="fleet")
    async def fleet(stream: Any) -> None:
        current = partial(still_current, app)
        await each_batch(app, stream, lambda events: fleet_batch(
            events, outputs_to, apply_fleet, write_checkpoint, forget_unwritten, current))

    async def apply_spot(event: Any) -> tuple[list[FleetOutput], bytes, bytes,
                                              spot_rules.SpotNodeTrack, float] | None:
        """What to publish, and the node's track to write once it is delivered (encoded and
        as it is), and the record's event time."""
        try:
            alloc = alloc_edge(event.value, event.key)
        except Rejected:
            # The node join dead-letters the same record; once is enough.
            return None
        node = alloc.node.encode()
        track = restore(decode_track, node, spot_table.get(node), dropped,
                        spot_rules.SpotNodeTrack)
        if dropped:
            outputs_to.drop_states(spot_table, event.message.partition, dropped)
        if track is None:
            track = spot_rules.SpotNodeTrack()
        # A failure leaves the table as it was: the track is written only when whole.
        outputs = spot_join.on_allocation(track, alloc)
        return outputs, node, encode_msgpack(track), track, alloc.ts

    def sweep_spot(partition: int, node: bytes, deleted_at: float | None, ts: float) -> None:
        """Note the record's node and time in the index of deleted nodes, and remove the
        tracks of its partition (held: the record is still of this worker's generation)
        deleted long enough ago; the table writes them to the changelog partition of the
        record being handled, theirs."""
        if not spot_departures.known:  # after a rebalance: the table is recovered by now
            spot_departures.rebuild((key, spot_deleted_at(stored))
                                    for key, stored in spot_table.items())
        spot_departures.note(partition, node, deleted_at)
        spot_departures.advance(partition, ts)
        for gone in spot_departures.due(partition):
            spot_table.pop(gone, None)

    @app.agent(allocations, name="fleet-spot")
    async def fleet_spot(stream: Any) -> None:
        async for event in stream.events():
            try:
                applied = await outputs_to.guarded(event, "fleet-spot", apply_spot)
                if applied is not None:
                    outputs, node, encoded, track, ts = applied
                    # The track says what was reported: written once its findings are
                    # delivered, unless a rebalance took the record back meanwhile (its
                    # seek delivers it again, perhaps to the node's new owner).
                    await outputs_to.emit_then_checkpoint(outputs, None)
                    if still_current(app, [event]):
                        spot_table[node] = encoded
                        sweep_spot(event.message.partition, node, track.deleted_at, ts)
                    else:
                        event.message.incref()  # the stream's acknowledgement must not count
            except Exception as error:  # a delivery failed: read it again after a restart
                event.message.incref()
                await crash_unread(app, error)
                raise
