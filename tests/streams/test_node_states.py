"""The worker's node states over its changelog table: what a failing record rolls back."""

from __future__ import annotations

import msgspec
import pytest

from gpusteward.schema import DeviceSample, NodeSample, PodAllocation, PodRef
from gpusteward.streams.app import NodeStates
from gpusteward.streams.node import NodeJoin, NodeState, Output

T0 = 1_763_683_200.0
POD = PodRef("ml", "train-0", uid="uid-1")


def _sample(ts: float) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="t", devices=[
        DeviceSample(uuid="GPU-0", index=0, model="NVIDIA H100 80GB HBM3", util_pct=50.0)])


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
