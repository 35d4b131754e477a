"""The node join when a node's clock is wrong: skewed against the watcher's, or stepped back.

Event time comes from the collector on each node; the node's rules and rollups never go
back in it. A clock stepped back (an NTP correction, a VM restored from a snapshot) makes
the node's samples older than what the join has seen, for as long as the step: they are
refused, each a dead letter naming the jump, so the blindness is counted and seen.
"""

from __future__ import annotations

import pytest

from gpusteward.edge import Rejected
from gpusteward.schema import Finding, Rollup
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
