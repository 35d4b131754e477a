"""The node join when a node's clock is wrong: skewed against the watcher's, or stepped back.

Event time comes from the collector on each node; the node's rules and rollups never go
back in it. A clock stepped back (an NTP correction, a VM restored from a snapshot) makes
the node's samples older than what the join has seen, for as long as the step: they are
refused, each a dead letter naming the jump, until they have kept to their new clock for
clock_step_after_s; then the join takes it: runs start over, open episodes go on.
"""

from __future__ import annotations

import pytest

from gpusteward.edge import Rejected
from gpusteward.schema import DeviceSample, Finding, HwEvent, NodeSample, NodeSummary, Rollup
from gpusteward.streams.fleet import FleetEvaluator, FleetState
from gpusteward.streams.node import NodeJoin, NodeState
from tests.streams.test_node_join import T0, allocation, findings, node_sample


def test_a_collector_clock_stepped_back_an_hour_is_refused_naming_the_jump() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    for i in range(10):
        join.on_sample(state, node_sample(T0 + i * 30, 90.0))
    newest = T0 + 270
    with pytest.raises(Rejected, match=r"is 3600 s before node n1's newest sample .*"
                                       r"its collector's clock went back"):
        join.on_sample(state, node_sample(newest - 3600, 0.0))
    # A straggler or a redelivered duplicate within clock_back_s is no jump: ignored, as ever.
    assert not findings(join.on_sample(state, node_sample(newest - 60, 0.0)))


def test_a_refused_sample_leaves_the_node_as_it_was() -> None:
    """Nothing of the refused sample lands: the idle run, the rollups' minutes and the
    holdings are those of the samples before it, and detection goes on from them."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    out: list = []
    for i in range(60):
        out += join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    before = (state.devices["GPU-1"].idle.below_samples, state.rollups.watermark,
              sorted(state.rollups.minutes))
    with pytest.raises(Rejected):
        join.on_sample(state, node_sample(T0 - 7200, 0.0))
    assert (state.devices["GPU-1"].idle.below_samples, state.rollups.watermark,
            sorted(state.rollups.minutes)) == before
    for i in range(60, 100):
        out += join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    (firing,) = findings(out)
    assert firing.starts_at == T0 + 600 and firing.ts == T0 + 2400
    assert any(isinstance(o, Rollup) for o in out) and not state.rollups.late


def test_a_collector_ahead_of_the_watcher_moves_the_grace_by_its_skew_only() -> None:
    """The pod started at the watcher's T0; the node's samples say T0 + 600. The grace
    (10 min from the pod's start) is read against the node's clock, so the finding comes up
    to the skew early, never more, and it is the pod's."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    out: list = []
    for i in range(80):
        out += join.on_sample(state, node_sample(T0 + 600 + i * 30, 0.0))
    (firing,) = [f for f in findings(out) if isinstance(f, Finding)]
    assert firing.subject.pod is not None and firing.subject.pod.name == "nb-a"
    assert firing.starts_at == T0 + 600  # the node's first idle sample; grace already over
    assert firing.ts == T0 + 600 + 1800  # 30 min of the node's samples: 10 min early, no more


STEP = 3600.0
"""The collector's clock steps back an hour."""


def feed(join: NodeJoin, state: NodeState, samples: list) -> tuple[list, int]:
    """Every sample through the join: the outputs, and how many were refused."""
    out: list = []
    refused = 0
    for sample in samples:
        try:
            out += join.on_sample(state, sample)
        except Rejected:
            refused += 1
    return out, refused


def test_a_node_whose_clock_stepped_back_an_hour_finds_an_idle_holder_again() -> None:
    """Busy for two hours, then the clock steps back an hour and the pod goes idle: after
    clock_step_after_s (300 s) of refused samples the node's new clock is taken, the idle
    run starts there, and the finding comes one window (30 min) later, not an hour later."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    before, _ = feed(join, state, [node_sample(T0 + i * 30, 90.0) for i in range(241)])
    assert not findings(before)
    newest = T0 + 7200
    back = newest - STEP + 30  # the first sample on the new clock
    out, refused = feed(join, state, [node_sample(back + i * 30, 0.0) for i in range(80)])
    assert refused == 10  # 300 s of samples on the new clock, each a dead letter
    taken = back + 300
    (firing,) = findings(out)
    assert firing.state == "firing" and firing.kind == "idle_holder"
    assert firing.starts_at == taken and firing.ts == taken + 1800
    # The rollups go on on the new clock: its minutes are emitted, none is counted late.
    assert any(isinstance(o, Rollup) and o.ts >= taken for o in out)
    assert not state.rollups.late


def test_an_idle_episode_open_before_the_step_goes_on_under_its_id() -> None:
    """The step neither resolves the open episode nor finds it again under a new id; the
    pod's first busy sample on the new clock resolves it, same id."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    before, _ = feed(join, state, [node_sample(T0 + i * 30, 0.0) for i in range(121)])
    (firing,) = findings(before)
    back = T0 + 3600 - STEP + 30
    idle, refused = feed(join, state, [node_sample(back + i * 30, 0.0) for i in range(200)])
    assert refused == 10
    assert {(f.id, f.state) for f in findings(idle)} <= {(firing.id, "firing")}
    busy, refused = feed(join, state, [node_sample(back + 200 * 30, 90.0)])
    (resolved,) = findings(busy)
    assert not refused and resolved.state == "resolved" and resolved.id == firing.id
    assert resolved.ends_at is not None and resolved.ends_at >= resolved.starts_at


def _hot(ts: float, temp: float) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-1", index=0, model="NVIDIA H100 80GB HBM3", util_pct=90.0,
                     temp_c=temp)])


def test_a_thermal_episode_goes_on_across_the_step_and_a_new_one_is_found_after_it() -> None:
    join, state = NodeJoin(), NodeState()
    before, _ = feed(join, state, [_hot(T0 + i * 30, 95.0) for i in range(60)])
    (firing,) = findings(before)
    back = T0 + 1770 - STEP + 30
    hot, refused = feed(join, state, [_hot(back + i * 30, 95.0) for i in range(40)])
    assert refused == 10 and not findings(hot)  # still hot: the same episode, unresolved
    cool, _ = feed(join, state, [_hot(back + 1200 + i * 30, 50.0) for i in range(21)])
    (resolved,) = findings(cool)  # clear_s (600 s) of cool samples on the new clock
    assert resolved.state == "resolved" and resolved.id == firing.id
    again, _ = feed(join, state, [_hot(back + 1900 + i * 30, 95.0) for i in range(11)])
    (second,) = findings(again)  # window_s (300 s) of hot samples: a new episode
    assert second.state == "firing" and second.id != firing.id
    assert second.starts_at == back + 1900


def test_a_hardware_event_from_a_clock_stepped_back_is_refused_naming_the_jump() -> None:
    """An XID stamped an hour back is a dead letter, as a sample is, not counted late or
    skipped unseen; once the node's new clock is taken its XIDs count again."""
    join, state = NodeJoin(), NodeState()
    feed(join, state, [_hot(T0 + i * 30, 50.0) for i in range(11)])
    newest = T0 + 300
    _, refused = feed(join, state, [_hot(newest - STEP + 30, 50.0)])  # the step shows
    assert refused == 1
    xid = HwEvent(ts=newest - STEP, node="n1", kind="xid", uuid="GPU-1", xid=119)
    with pytest.raises(Rejected, match=r"xid event is 3600 s before node n1's newest sample"):
        join.on_hw_event(state, xid)
    assert not state.devices["GPU-1"].hw.xid.recent
    _, refused = feed(join, state, [_hot(newest - STEP + 30 + i * 30, 50.0)
                                     for i in range(1, 12)])
    assert refused == 9
    out = join.on_hw_event(state, HwEvent(ts=newest - STEP + 360, node="n1", kind="xid",
                                          uuid="GPU-1", xid=119))
    (finding,) = findings(out)
    assert finding.state == "firing" and finding.starts_at == newest - STEP + 360


def test_a_late_hardware_event_is_judged_while_the_node_keeps_its_clock() -> None:
    """An XID read an hour behind the samples (the worker catching up on the hardware
    events after an outage), with no sample stepping back: a fact, late, not a clock."""
    join, state = NodeJoin(), NodeState()
    feed(join, state, [_hot(T0 + 3600 + i * 30, 50.0) for i in range(11)])
    out = join.on_hw_event(state, HwEvent(ts=T0 + 60, node="n1", kind="xid", uuid="GPU-1",
                                          xid=119))
    (finding,) = findings(out)
    assert finding.state == "firing" and finding.starts_at == T0 + 60


def test_samples_back_in_the_old_range_keep_the_node_on_its_clock() -> None:
    """A run of samples too far back broken by ones in range (a replay beside live ones) is
    never taken as a new clock: only a clock kept to for clock_step_after_s is."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    feed(join, state, [node_sample(T0 + i * 30, 90.0) for i in range(21)])
    mixed = []
    for i in range(40):
        mixed.append(node_sample(T0 - STEP + i * 30, 0.0))
        mixed.append(node_sample(T0 + 630 + i * 30, 90.0))
    _, refused = feed(join, state, mixed)
    assert refused == 40 and state.rollups.watermark == T0 + 630 + 39 * 30


def test_the_fleet_agent_takes_the_node_s_summaries_on_its_new_clock() -> None:
    """After the join takes the stepped-back clock, the node's summaries are an hour before
    its last one: the fleet agent takes them at once (not when the new clock passes the old
    one, nor after dropping the node as stale), and still ignores a redelivered summary of
    the old clock, or a late one of the new."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    before, _ = feed(join, state, [node_sample(T0 + i * 30, 90.0) for i in range(241)])
    back = T0 + 7200 - STEP + 30
    after, _ = feed(join, state, [node_sample(back + i * 30, 0.0) for i in range(80)])
    old = [o for o in before if isinstance(o, NodeSummary)]
    new = [o for o in after if isinstance(o, NodeSummary)]
    assert old and len(new) > 2 and new[0].ts < old[-1].ts - STEP / 2
    fleet, fleet_state = FleetEvaluator(), FleetState()
    for summary in [*old, *new]:
        fleet.on_summary(fleet_state, summary)
        assert fleet_state.nodes["n1"] == summary
    fleet.on_summary(fleet_state, old[-1])
    fleet.on_summary(fleet_state, new[-2])
    assert fleet_state.nodes["n1"] == new[-1]
