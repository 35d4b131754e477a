"""The worker's node states over its changelog table: what a failing record rolls back."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpusteward.edge import Rejected
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    NodeInventory,
    NodeSample,
    PodAllocation,
    PodRef,
    Rollup,
)
from gpusteward.streams.app import NodeStates
from gpusteward.streams.node import NodeJoin, NodeState, Output
from gpusteward.streams.outputs import Departures, salvage

T0 = 1_763_683_200.0
POD = PodRef("ml", "train-0", uid="uid-1")


def _sample(ts: float) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="t", devices=[
        DeviceSample(uuid="GPU-0", index=0, model="NVIDIA H100 80GB HBM3", util_pct=50.0)])


def _page(node: str, ts: float, dbe: int = 0) -> NodeSample:
    """A one-GPU node's sample (``dbe`` double-bit ECC errors so far)."""
    return NodeSample(ts=ts, node=node, source="t", devices=[
        DeviceSample(uuid=f"GPU-{node}", index=0, model="NVIDIA H100 80GB HBM3",
                     util_pct=50.0, temp_c=60.0, ecc_dbe_volatile=dbe)])


def _partition_batch(states: NodeStates, join: NodeJoin, partition: int,
                     *records: NodeSample | NodeInventory) -> list[Output]:
    """One batch of records of ``partition`` through the join, its sweep, and the states
    written to the table as the batch's checkpoint writes them."""
    writes: dict[bytes, bytes] = {}
    out: list[Output] = []
    for record in records:
        handler = join.on_sample if isinstance(record, NodeSample) else join.on_allocation
        out += states.apply(writes, handler, record, partition)
    out += states.sweep(set(), [partition])
    states.table.update(writes)
    return out


def _live_batch(states: NodeStates, join: NodeJoin, wall: list[float],
                *records: NodeSample) -> list[Output]:
    """One batch of a live worker (samples of any partitions, then its quiet-partition
    pass, the states written); its clock moves 30 s, a batch of samples every 30 s."""
    departures = states.departures
    assert departures is not None
    writes: dict[bytes, bytes] = {}
    out: list[Output] = []
    for record in records:
        out += states.apply(writes, join.on_sample, record,
                            departures.partition_of(record.node.encode()))
    out += states.quiet(writes, {departures.partition_of(r.node.encode()) for r in records})
    states.table.update(writes)
    wall[0] += 30.0
    return out


def _breaks(state: NodeState, record: NodeSample) -> list[Output]:
    state.gpu_model = "half-changed"
    raise ZeroDivisionError("a rule's bug")


def test_a_record_that_breaks_keeps_what_earlier_records_of_its_batch_did() -> None:
    """A batch [allocation, sample whose rule raises] of one node: the sample is
    dead-lettered and the allocation, acknowledged with the batch, stays in the node's state
    and in the batch's checkpoint. It used to be dropped with the half-changed state, and
    nothing ever applied it again."""
    join, table = NodeJoin(), {b"n1": msgspec.msgpack.encode(NodeState())}
    states = NodeStates(table, checkpoint_s=30.0)
    writes: dict[bytes, bytes] = {}
    states.apply(writes, join.on_allocation, PodAllocation(
        ts=T0, node="n1", pod=POD, phase="running", gpus=1, device_ids=["GPU-0"],
        started_at=T0))
    with pytest.raises(ZeroDivisionError):
        states.apply(writes, _breaks, _sample(T0 + 1))
    for state in (states.live[b"n1"][0],
                  msgspec.msgpack.decode(writes[b"n1"], type=NodeState)):
        assert list(state.pods) == ["uid-1"] and state.gpu_model is None
    states.apply(writes, join.on_sample, _sample(T0 + 2))
    assert list(states.live[b"n1"][0].pods) == ["uid-1"]


def test_a_record_that_breaks_with_nothing_encoded_goes_back_to_the_table() -> None:
    join = NodeJoin()
    stored = NodeState(gpu_model="from the table")
    states = NodeStates({b"n1": msgspec.msgpack.encode(stored)}, 30.0)
    writes: dict[bytes, bytes] = {}
    states.apply(writes, join.on_sample, _sample(T0))  # the first sample of n1: due, encoded
    writes.clear()  # a later batch, with nothing of n1 encoded yet
    with pytest.raises(ZeroDivisionError):
        states.apply(writes, _breaks, _sample(T0 + 1))
    assert b"n1" not in states.live and writes == {}


def _undecodable_states() -> dict[str, bytes]:
    newer = msgspec.msgpack.encode({"devices": {}, "gpu_count": "eight"})  # a type changed
    return {"newer release": newer, "corrupt": b"\xc1\x00\xff"}


@pytest.mark.parametrize("how", ["newer release", "corrupt"])
def test_a_state_this_build_cannot_decode_is_dropped_and_the_node_goes_on(how: str) -> None:
    """A changelog value written by a newer release (read after a rollback) or corrupt: the
    node starts afresh (nothing of either that matters decodes on its own), the value is
    kept for the caller to report, and the fresh state is encoded for the checkpoint that
    replaces it. Raised, it dead-lettered every later record
    of the node, for ever: its detection stopped."""
    bad = _undecodable_states()[how]
    join, table = NodeJoin(), {b"n1": bad}
    states = NodeStates(table, checkpoint_s=30.0)
    writes: dict[bytes, bytes] = {}
    states.apply(writes, join.on_allocation, PodAllocation(
        ts=T0, node="n1", pod=POD, phase="running", gpus=1, device_ids=["GPU-0"],
        started_at=T0))
    assert [(d.key, d.value) for d in states.dropped] == [(b"n1", bad)]
    assert isinstance(states.dropped[0].error, msgspec.DecodeError)
    assert list(msgspec.msgpack.decode(writes[b"n1"], type=NodeState).pods) == ["uid-1"]
    states.dropped.clear()
    states.live.clear()  # a rebalance: the table is the truth again
    table.update(writes)
    states.apply(writes, join.on_sample, _sample(T0 + 1))
    assert states.dropped == [] and list(states.live[b"n1"][0].pods) == ["uid-1"]


OLD_STATES = Path(__file__).parents[1] / "data" / "changelog"
MODEL = "NVIDIA H100 80GB HBM3"


def scenario_sample(tick: int) -> NodeSample:
    """A sample of the scenario the recorded states were written in (data/changelog): both
    GPUs idle until tick 600, busy from then on."""
    util = 80.0 if tick >= 600 else 0.0
    return NodeSample(ts=T0 + tick * 10, node="n1", source="t", devices=[
        DeviceSample(uuid="GPU-0", index=0, model=MODEL, util_pct=util, pod=POD),
        DeviceSample(uuid="GPU-1", index=1, model=MODEL, util_pct=util, ecc_dbe_volatile=1,
                     temp_c=70.0, pod=POD)])


@pytest.mark.parametrize("release", ["2026-11-21", "2026-11-25"])
def test_a_state_an_earlier_release_wrote_goes_on_where_it_stopped(release: str) -> None:
    """An upgrade: the node's state as an earlier release checkpointed it, its XID, ECC and
    idle findings open. This build decodes it and goes on: the idle findings resolve once
    the GPUs are busy, under the ids they fired with, and nothing fires again."""
    raw = (OLD_STATES / f"node-state-{release}.msgpack").read_bytes()
    states = NodeStates({b"n1": raw}, checkpoint_s=30.0)
    join, writes = NodeJoin(), dict[bytes, bytes]()
    outputs: list[Output] = []
    for tick in range(500, 700):
        outputs += states.apply(writes, join.on_sample, scenario_sample(tick))
    assert states.dropped == []
    findings = [(o.kind, o.state, o.id) for o in outputs if isinstance(o, Finding)]
    assert sorted(findings) == [
        ("idle_holder", "resolved", "68b72b48cd577d1b-1763683800000"),
        ("idle_holder", "resolved", "bf1c618619b5d536-1763683800000")]


@pytest.mark.parametrize("release", ["2026-11-21", "2026-11-25"])
def test_a_loose_read_of_a_state_this_build_reads_is_the_strict_read(release: str) -> None:
    """The part-by-part read that keeps what it can of an undecodable state (after a
    rollback) reads a whole state as the strict decoder does, and drops nothing: what it
    keeps is the state, not an approximation of it."""
    raw = (OLD_STATES / f"node-state-{release}.msgpack").read_bytes()
    assert salvage(NodeState, raw) == (msgspec.msgpack.decode(raw, type=NodeState), ())


def test_a_sample_from_a_clock_gone_back_is_refused_without_a_rollback() -> None:
    """A collector's clock stepped back an hour: each of its samples is refused (a dead
    letter naming the jump), and the node keeps what its samples since the last checkpoint
    taught it; rolled back per refused sample, the node would forget them, acknowledged."""
    join = NodeJoin()
    states = NodeStates({}, checkpoint_s=30.0)
    writes: dict[bytes, bytes] = {}
    states.apply(writes, join.on_sample, _sample(T0))  # the first sample: checkpointed
    writes.clear()
    states.apply(writes, join.on_sample, _sample(T0 + 10))  # not yet due: not written
    assert writes == {}
    with pytest.raises(Rejected, match="clock went back"):
        states.apply(writes, join.on_sample, _sample(T0 - 3600))
    state = states.live[b"n1"][0]
    assert state.rollups.watermark == T0 + 10 and state.devices["GPU-0"].idle.last_ts == T0 + 10


def test_a_node_restored_from_the_table_takes_its_stepped_back_clock_and_is_written() -> None:
    """The worker restarted: the node's state comes from the table, and its collector's
    clock has stepped back an hour. The refused samples' count is kept between records (not
    re-read from the table at each), the new clock is taken after clock_step_after_s, and
    the node is checkpointed on it at once, not once its clock passes the old checkpoint."""
    join = NodeJoin(on_clock_step=lambda node, step: steps.append((node, step)))
    steps: list[tuple[str, float]] = []
    states = NodeStates({}, checkpoint_s=30.0)
    writes: dict[bytes, bytes] = {}
    for i in range(11):
        states.apply(writes, join.on_sample, _sample(T0 + i * 30))
    restarted = NodeStates(dict(writes), checkpoint_s=30.0)
    writes.clear()
    back = T0 + 300 - 3600 + 30
    for i in range(10):
        with pytest.raises(Rejected, match="clock went back"):
            restarted.apply(writes, join.on_sample, _sample(back + i * 30))
    assert writes == {} and steps == []
    restarted.apply(writes, join.on_sample, _sample(back + 300))
    assert steps == [("n1", 3570.0)]
    written = msgspec.msgpack.decode(writes[b"n1"], type=NodeState)
    assert written.rollups.watermark == back + 300 and written.behind_since is None
    writes.clear()
    restarted.apply(writes, join.on_sample, _sample(back + 330))
    restarted.apply(writes, join.on_sample, _sample(back + 360))  # 30 s on: due again
    assert b"n1" in writes


@pytest.mark.parametrize("release", ["2026-11-21", "2026-11-25"])
def test_a_node_an_earlier_release_checkpointed_is_deleted_and_created_again_afresh(
        release: str) -> None:
    """The node's state as an earlier release checkpointed it (XID, ECC and idle findings
    open), then the node is deleted. That release kept no record of its open findings, so
    those are not resolved (docs/detection.md says so); findings opened since the upgrade
    are. Its rules' state goes all the same: the node created again under its name, its DBE
    still there, opens a new episode, and nothing of the old ones resolves late."""
    raw = (OLD_STATES / f"node-state-{release}.msgpack").read_bytes()
    states = NodeStates({b"n1": raw}, checkpoint_s=30.0)
    join, writes = NodeJoin(), dict[bytes, bytes]()
    states.apply(writes, join.on_sample, scenario_sample(500))
    failing = NodeSample(ts=T0 + 5010, node="n1", source="t", devices=[
        DeviceSample(uuid="GPU-0", index=0, model=MODEL, util_pct=0.0, pod=POD),
        DeviceSample(uuid="GPU-1", index=1, model=MODEL, util_pct=0.0, ecc_dbe_volatile=1,
                     temp_c=70.0, pod=POD, remap_failure=True)])
    opened = [o for o in states.apply(writes, join.on_sample, failing)
              if isinstance(o, Finding)]
    assert [(f.kind, f.state) for f in opened] == [("remap_failure", "firing")]
    gone = states.apply(writes, join.on_allocation,
                        NodeInventory(ts=T0 + 5020, node="n1", deleted=True))
    assert [(o.kind, o.state, o.id) for o in gone if isinstance(o, Finding)] == [
        ("remap_failure", "resolved", opened[0].id)]
    states.apply(writes, join.on_allocation, NodeInventory(ts=T0 + 6000, node="n1",
                                                           gpu_count=2))
    again: list[Output] = []
    for tick in range(600, 700):
        again += states.apply(writes, join.on_sample, scenario_sample(tick))
    assert [(o.kind, o.state) for o in again if isinstance(o, Finding)] == [
        ("ecc_dbe", "firing")]


def test_deleted_nodes_leave_once_their_partitions_samples_pass_the_grace() -> None:
    """Two nodes of one partition deleted, one of them created again within the grace, and
    a third of the partition sending samples: past the grace (measured on those samples),
    the sweep removes the node still deleted (a tombstone on the changelog), with
    its open rollup minutes, and keeps the one created again; before it, nothing goes, and a
    late sample of the deleted node is folded as a deleted node's."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"gone")
    kept, driver = [name for name in (f"n{i}" for i in range(1000))
                    if departures.partition_of(name.encode()) == partition][:2]
    join = NodeJoin()
    table: dict[bytes, bytes] = {}
    states = NodeStates(table, 30.0, departures, join.forget)

    def batch(*records: NodeSample | NodeInventory) -> tuple[list[Output], set[bytes]]:
        writes: dict[bytes, bytes] = {}
        gone: set[bytes] = set()
        out: list[Output] = []
        for record in records:
            handler = join.on_sample if isinstance(record, NodeSample) else join.on_allocation
            out += states.apply(writes, handler, record, partition)
        out += states.sweep(gone, [partition])
        table.update(writes)  # as the batch's checkpoint writes them
        for node in gone:
            del table[node]
        return out, gone

    batch(*(_page(node, T0 + 30 * i) for i in range(3) for node in ("gone", kept, driver)))
    batch(NodeInventory(ts=T0 + 90, node="gone", deleted=True),
          NodeInventory(ts=T0 + 90, node=kept, deleted=True))
    batch(NodeInventory(ts=T0 + 120, node=kept))
    late, _ = batch(_page("gone", T0 + 80))  # read after its deletion: folded, not judged
    assert not [o for o in late if isinstance(o, Finding)]
    _, gone = batch(_page(driver, T0 + 90 + 3599))
    assert not gone and b"gone" in table  # within the grace
    out, gone = batch(_page(driver, T0 + 90 + 3600))
    assert gone == {b"gone"} and b"gone" not in table and b"gone" not in states.live
    assert {kept.encode(), driver.encode()} <= set(table)
    last = {(o.ts, o.samples) for o in out if isinstance(o, Rollup) and o.node == "gone"}
    assert last == {(T0, 2), (T0 + 60, 2)}, last  # its open minutes, the late sample in one
    # A worker that restarts (the index rebuilt from the table) finds nothing more to remove.
    restarted = NodeStates(dict(table), 30.0, Departures(3600.0, 8), join.forget)
    assert restarted.sweep(set(), [partition]) == []
    assert restarted.departures is not None and not restarted.departures.left.get(partition)


def test_a_silent_nodes_cordon_is_asked_again_by_its_partitions_samples() -> None:
    """A node with a double-bit ECC error sends no sample after it (its driver hung, its
    collector with it), while its kubelet still takes pods. Its cordon, which the executor
    may have refused (its breaker open, its API call failed), is asked for again every
    reask_s of its partition's clock, the other nodes' samples, under its key and with its
    state written. A worker restarted with the index read from the table does the same; the
    node's own samples, back, go on from there without asking twice; once the node is
    cordoned, nothing is asked. Before, a silent node was asked nothing more."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"silent")
    driver = next(name for name in (f"n{i}" for i in range(1000))
                  if departures.partition_of(name.encode()) == partition)
    join = NodeJoin()
    table: dict[bytes, bytes] = {}
    states = NodeStates(table, 30.0, departures, join.forget, join.reask_due)

    def batch(states: NodeStates, *records: NodeSample | NodeInventory) -> list[Action]:
        return [o for o in _partition_batch(states, join, partition, *records)
                if isinstance(o, Action) and o.verb == "cordon"]

    def driven(states: NodeStates, start: float, end: float) -> list[Action]:
        return [a for ts in range(int(start), int(end) + 1, 30)
                for a in batch(states, _page(driver, T0 + ts))]

    batch(states, _page("silent", T0), _page(driver, T0))
    [first] = batch(states, _page("silent", T0 + 30, dbe=1), _page(driver, T0 + 30))
    assert first.reask == 0 and first.target.node == "silent"
    assert not driven(states, 60, 600)  # within reask_s of the ask
    again = driven(states, 630, 1200)
    assert [(a.reask, a.ts, a.idempotency_key) for a in again] == [
        (1, T0 + 630, first.idempotency_key)]
    assert msgspec.msgpack.decode(table[b"silent"], type=NodeState).asks_due == T0 + 1230

    # A worker restarted: its index comes from the table, read at the end of its first
    # batch (at 1200 s), so a later one asks.
    restarted = NodeStates(dict(table), 30.0, Departures(3600.0, 8), join.forget,
                           join.reask_due)
    table = restarted.table
    assert [(a.reask, a.ts) for a in driven(restarted, 1200, 1260)] == [(2, T0 + 1230)]
    # The node's own samples again: the next ask is due 600 s after the last.
    assert not batch(restarted, _page("silent", T0 + 1235, dbe=1))
    assert [(a.reask, a.ts) for a in batch(restarted, _page("silent", T0 + 1830, dbe=1))] == [
        (3, T0 + 1830)]
    # Cordoned (the executor carried it out): silent again, it is asked nothing more.
    batch(restarted, NodeInventory(ts=T0 + 1840, node="silent", gpu_count=1,
                                   unschedulable=True))
    assert not driven(restarted, 1860, 4000)


def test_a_silent_node_alone_in_its_partition_is_asked_by_the_workers_other_partitions() -> None:
    """A small cluster: the silent node is its partition's only node, so no neighbour's
    sample passes its due. Once no batch has had a record of its partition for
    quiet_s of the process's clock, its cordon is asked for again by the newest
    sample of the worker's other partitions. A partition merely behind is read at every
    batch and never taken for quiet; one the worker no longer holds is left to its new
    owner."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"silent")
    driver = next(name for name in (f"n{i}" for i in range(1000))
                  if departures.partition_of(name.encode()) != partition)
    join = NodeJoin()
    held = {partition, departures.partition_of(driver.encode())}
    wall = [0.0]
    states = NodeStates({}, 30.0, departures, join.forget, join.reask_due,
                        held=lambda: held, monotonic=lambda: wall[0])

    def batch(*records: NodeSample) -> list[Action]:
        return [o for o in _live_batch(states, join, wall, *records)
                if isinstance(o, Action) and o.verb == "cordon"]

    [first] = batch(_page("silent", T0, dbe=1), _page(driver, T0))
    assert first.reask == 0
    asked = [(a.reask, a.ts) for ts in range(30, 1300, 30) for a in batch(_page(driver, T0 + ts))]
    assert asked == [(1, T0 + 600), (2, T0 + 1200)]
    assert msgspec.msgpack.decode(states.table[b"silent"], type=NodeState).asks_due \
        == T0 + 1800
    # Taken by another worker: asked nothing here.
    held.discard(partition)
    assert not [a for ts in range(1300, 2500, 30) for a in batch(_page(driver, T0 + ts))]
    # Held again, its node's samples back but far behind the other partition's: read in
    # every batch, the partition is not quiet, and its node's own clock asks.
    held.add(partition)
    again = [(a.reask, a.ts) for k in range(40) for a in batch(
        _page("silent", T0 + 1230 + 30 * k, dbe=1), _page(driver, T0 + 2500 + 30 * k))]
    assert again == [(3, T0 + 1800), (4, T0 + 2400)]


def _silent_findings(out: list[Output]) -> list[tuple[str, str, float]]:
    return [(o.subject.node or "", o.state, o.ts) for o in out
            if isinstance(o, Finding) and o.kind == "node_silent"]


def test_a_node_whose_samples_stop_or_never_come_is_told_by_its_partitions_clock() -> None:
    """Four nodes of one partition, each with a GPU in its inventory: ``driver`` sends
    samples every 30 s; ``stops`` sends until 300 s (its collector crashed); ``never`` has
    had no collector (left out by the DaemonSet); ``cordoned`` sends nothing either but
    takes no pods. By the partition's clock, ``stops`` is told once 600 s after its last
    sample and ``never`` 600 s after its inventory, each once, with the state written (a
    restarted worker does not tell them again); ``cordoned`` never. ``stops``'s sample back
    resolves its finding under the same id. Before, nothing said a node had gone silent."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"stops")
    names = iter(name for name in (f"n{i}" for i in range(1000))
                 if departures.partition_of(name.encode()) == partition)
    driver, never, cordoned = next(names), next(names), next(names)
    join = NodeJoin()
    table: dict[bytes, bytes] = {}

    def batch(states: NodeStates, *records: NodeSample | NodeInventory) -> list[Output]:
        return _partition_batch(states, join, partition, *records)

    states = NodeStates(table, 30.0, departures, join.forget, join.reask_due, join.silence)
    batch(states, *(NodeInventory(ts=T0, node=n, gpu_count=1, unschedulable=n == cordoned)
                    for n in (driver, "stops", never, cordoned)))
    told: list[tuple[str, str, float]] = []
    for ts in range(0, 1200, 30):
        told += _silent_findings(batch(states, _page(driver, T0 + ts),
                                       *([_page("stops", T0 + ts)] if ts <= 300 else [])))
    assert told == [(never, "firing", T0 + 600), ("stops", "firing", T0 + 900)]
    stored = msgspec.msgpack.decode(table[b"stops"], type=NodeState)
    assert stored.silent is not None and stored.silent.since == T0 + 300

    restarted = NodeStates(dict(table), 30.0, Departures(3600.0, 8), join.forget,
                           join.reask_due, join.silence)
    table = restarted.table
    again = [f for ts in range(1200, 2400, 30)
             for f in _silent_findings(batch(restarted, _page(driver, T0 + ts)))]
    assert again == []
    back = batch(restarted, _page("stops", T0 + 2400))
    [closed] = [o for o in back if isinstance(o, Finding) and o.kind == "node_silent"]
    assert closed.state == "resolved" and closed.id == stored.silent.id
    assert msgspec.msgpack.decode(table[b"stops"], type=NodeState).silent is None


def test_a_node_whose_inventory_comes_after_its_partitions_last_sample_is_told_at_once(
        ) -> None:
    """The watcher behind the collectors: the partition's samples have run two hours past
    the inventory of a node that never sends, and no sample of the partition comes after
    the inventory is read. The node is told at its inventory, once, by the partition's
    clock, its state written. Before, nothing told it until a later sample of the
    partition."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"late")
    driver = next(name for name in (f"n{i}" for i in range(1000))
                  if departures.partition_of(name.encode()) == partition)
    join = NodeJoin()
    states = NodeStates({}, 30.0, departures, join.forget, join.reask_due, join.silence)
    for ts in range(0, 7200, 30):
        _partition_batch(states, join, partition, _page(driver, T0 + ts))
    inventory = NodeInventory(ts=T0, node="late", gpu_count=1)
    assert _silent_findings(_partition_batch(states, join, partition, inventory)) == [
        ("late", "firing", T0 + 7170)]
    assert msgspec.msgpack.decode(states.table[b"late"], type=NodeState).silent is not None
    assert not _silent_findings(_partition_batch(states, join, partition, inventory))
    # Its inventory read in time: told by the partition's clock, not at it.
    assert not _silent_findings(_partition_batch(
        states, join, partition, NodeInventory(ts=T0 + 7180, node="early", gpu_count=1)))


def test_a_node_let_take_pods_again_is_given_the_whole_grace() -> None:
    """A node cordoned for two hours without a collector (a repair), then uncordoned: it is
    told only silent_after_s after the uncordon, not at once for the two hours; so is one
    out of a MIG reconfiguration. A deleted node's open silence resolves."""
    join = NodeJoin()
    state = NodeState()
    join.on_allocation(state, NodeInventory(ts=T0, node="n1", gpu_count=8, unschedulable=True))
    assert not join.silence(state, "n1", T0 + 7200)
    join.on_allocation(state, NodeInventory(ts=T0 + 7200, node="n1", gpu_count=8))
    assert not join.silence(state, "n1", T0 + 7200 + 599)
    [told] = join.silence(state, "n1", T0 + 7200 + 600)
    assert isinstance(told, Finding) and told.starts_at == T0 + 7200
    assert "8 GPUs" in told.summary and told.labels["sampled_before"] == "false"
    assert not join.silence(state, "n1", T0 + 7200 + 900)  # told once

    gone = join.on_allocation(state, NodeInventory(ts=T0 + 8000, node="n1", deleted=True))
    assert [(f.id, f.state) for f in gone if isinstance(f, Finding)] == [(told.id, "resolved")]

    mig = NodeState()
    join.on_allocation(mig, NodeInventory(ts=T0, node="n2", gpu_count=8,
                                          mig_config_state="pending"))
    assert not join.silence(mig, "n2", T0 + 3600)
    join.on_allocation(mig, NodeInventory(ts=T0 + 3600, node="n2", gpu_count=8,
                                          mig_config_state="success"))
    assert not join.silence(mig, "n2", T0 + 3600 + 599)
    assert join.silence(mig, "n2", T0 + 3600 + 600)


def test_a_silent_node_alone_in_its_partition_is_told_by_the_workers_other_partitions() -> None:
    """The silent node is its partition's only node: once no batch has had a record of the
    partition for quiet_s of the process's clock, the newest sample of the worker's other
    partitions tells it; not while the partition is merely behind."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"silent")
    driver = next(name for name in (f"n{i}" for i in range(1000))
                  if departures.partition_of(name.encode()) != partition)
    join = NodeJoin()
    wall = [0.0]
    states = NodeStates({}, 30.0, departures, join.forget, join.reask_due, join.silence,
                        monotonic=lambda: wall[0])

    def batch(*records: NodeSample) -> list[Output]:
        return _live_batch(states, join, wall, *records)

    batch(_page("silent", T0), _page(driver, T0))
    # Behind: its samples still come, an hour older than the other partition's.
    assert not [f for k in range(1, 40) for f in _silent_findings(batch(
        _page("silent", T0 + 30 * k), _page(driver, T0 + 3600 + 30 * k)))]
    told = [f for ts in range(4800, 6000, 30) for f in _silent_findings(batch(
        _page(driver, T0 + ts)))]
    assert len(told) == 1 and told[0][:2] == ("silent", "firing")


def test_a_worker_whose_every_partition_is_quiet_goes_by_its_own_clock() -> None:
    """A small cluster: the worker's one node, alone in the one partition it holds, gets a
    double-bit ECC error and its collector stops. No batch comes to the worker at all, so
    its timer (``quiet`` between batches) goes by the partition's newest sample moved on by
    the process's time: the cordon is asked again at reask_s, the node told at
    silent_after_s, each once. Restarted, with nothing read since, the worker starts from
    the newest sample its nodes' states hold. Before, such a worker never asked again."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"alone")
    join = NodeJoin()
    wall = [0.0]
    table: dict[bytes, bytes] = {}

    def states_now() -> NodeStates:
        return NodeStates(table, 30.0, Departures(3600.0, 8), join.forget, join.reask_due,
                          join.silence, held=lambda: {partition}, monotonic=lambda: wall[0])

    def timer(states: NodeStates, until_s: float) -> list[tuple[str, float]]:
        """Timer passes every 30 s of the process's clock, as quiet_pass runs them."""
        seen: list[tuple[str, float]] = []
        while wall[0] < until_s:
            wall[0] += 30.0
            writes: dict[bytes, bytes] = {}
            states.sweep(set(), ())
            out = states.quiet(writes, ())
            table.update(writes)
            seen += [(o.verb, o.ts) for o in out if isinstance(o, Action)]
            seen += [(o.kind, o.ts) for o in out if isinstance(o, Finding)]
        return seen

    states = states_now()
    for ts, dbe in ((T0, 0), (T0 + 30, 1)):
        writes: dict[bytes, bytes] = {}
        states.apply(writes, join.on_sample, _page("alone", ts, dbe), partition)
        states.quiet(writes, {partition})
        table.update(writes)
    assert timer(states, 100.0) == []  # not quiet yet
    assert timer(states, 1000.0) == [("cordon", T0 + 630), ("node_silent", T0 + 660)]
    assert timer(states, 1300.0) == [("cordon", T0 + 1230)]

    # Its newest sample is at T0 + 30 and the next ask due at T0 + 1830: it has no better
    # clock than that sample, so it asks 1,800 s of its own time after it started.
    restarted = states_now()
    assert timer(restarted, 1300.0 + 1770.0) == []
    assert timer(restarted, 1300.0 + 1800.0) == [("cordon", T0 + 1830)]


def test_a_replay_of_samples_the_state_applied_is_skipped() -> None:
    """One node's backlog read fast (10 s of event time per sample): the state is written
    after sample 99, the offsets are committed later, and a rebalance reads the partition
    again from offset 0. Those samples, applied already, are skipped: before, the first 30
    (over clock_back_s behind the node's newest) were refused as a clock gone back, dead
    letters, until the join took them for a new clock and moved the node's episodes back.
    A samples topic created again (offsets from 0, newer event times) is read as new."""
    departures = Departures(grace_s=3600.0, partitions=8)
    partition = departures.partition_of(b"n1")
    join = NodeJoin()
    table: dict[bytes, bytes] = {}

    def read(states: NodeStates, ticks: range, first_offset: int = 0) -> list[Output]:
        writes: dict[bytes, bytes] = {}
        out: list[Output] = []
        for offset, tick in enumerate(ticks, start=first_offset):
            out += states.apply(writes, join.on_sample, scenario_sample(tick), partition,
                                offset)
        table.update(writes)
        return out

    first = NodeStates(table, 30.0, departures, join.forget)
    read(first, range(500, 600))
    # The rebalance: a new generation of the worker's states, from the table.
    again = NodeStates(table, 30.0, Departures(3600.0, 8), join.forget)
    assert read(again, range(500, 600)) == []
    state = again.live[b"n1"][0]
    assert state.clock_steps == 0 and (state.sample_partition, state.sample_offset) == (
        partition, 99)
    # On from where it was.
    read(again, range(600, 620), 100)
    assert again.live[b"n1"][0].rollups.watermark == scenario_sample(619).ts
    # The topic created again: offset 0, but a newer sample: applied.
    read(again, range(700, 701))
    state = again.live[b"n1"][0]
    assert state.sample_offset == 0 and state.rollups.watermark == scenario_sample(700).ts
