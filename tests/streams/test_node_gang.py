"""One member of a gang idle while the rest works: its owner is told, its GPU is never
reclaimed on its own (under the shipped policy), since reclaiming one member stops the whole
gang, the busy members on other nodes too; a pod that works alone, a gang of one included,
climbs the whole ladder to its reclaim as before."""

from __future__ import annotations

from pathlib import Path

import msgspec

from gpusteward.rules import idle
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
)
from gpusteward.streams.node import NodeJoin, NodeState, Output, RuleSettings
from gpusteward.streams.policy_file import load_policy

REPO = Path(__file__).resolve().parents[2]
T0 = 1_000_000.0
POD = PodRef(namespace="ml", name="train-worker-3", uid="u-worker-3")


def _idle_for(hours: float, *, gang: str | None, gang_size: int | None,
              learnt_size: int | None = None) -> list[Output]:
    """A JobSet worker's pod (one GPU) idle for ``hours``, samples every 30 s; with
    ``learnt_size``, its allocation is sent again with that size after a minute, as the
    watcher does once it reads the gang's object after the pod."""
    join = NodeJoin(RuleSettings(policy=load_policy(REPO / "deploy" / "base" / "policy.yaml")))
    state = NodeState()
    allocation = PodAllocation(
        ts=T0, node="n1", pod=POD, phase="running", gpus=1, device_ids=["GPU-0"],
        started_at=T0 - 3600, workload_kind="batch", owner_kind="Job",
        owner_name="train-worker", gang=gang, gang_size=gang_size)
    out = join.on_allocation(state, allocation)
    ts = T0
    while ts < T0 + hours * 3600:
        if learnt_size is not None and ts == T0 + 60:
            out += join.on_allocation(state, msgspec.structs.replace(
                allocation, ts=ts, gang_size=learnt_size))
        out += join.on_sample(state, NodeSample(ts=ts, node="n1", source="test", devices=[
            DeviceSample(uuid="GPU-0", index=0, model="NVIDIA H100 80GB HBM3", util_pct=0.0,
                         temp_c=40.0, pod=POD)]))
        ts += 30
    return out


def _actions(out: list[Output], verb: str) -> list[Action]:
    return [o for o in out if isinstance(o, Action) and o.verb == verb]


def test_a_gang_member_idle_is_told_but_never_reclaimed_on_its_own() -> None:
    out = _idle_for(8, gang="JobSet/train", gang_size=4)
    steps = [f for f in out if isinstance(f, Finding) and f.kind == idle.KIND]
    assert [int(f.evidence.values["ladder_step"]) for f in steps if f.evidence] == [1, 2]
    assert all(f.labels["reclaim"] == "gang" and f.labels["gang"] == "JobSet/train"
               for f in steps)
    notices = _actions(out, "notify_owner")
    assert len(notices) == 2 and _actions(out, "requeue") == []
    assert "which is never reclaimed for one idle member" in notices[0].reason
    assert "then a reclaim" not in notices[0].reason
    # Not offered to waiting work either: demand-aware reclaim would stop the gang too.
    summaries = [o for o in out if isinstance(o, NodeSummary)]
    assert summaries and summaries[-1].idle == []


def test_a_pod_that_works_alone_is_reclaimed_at_the_end_of_its_ladder() -> None:
    # Alone, a gang of one, and a gang of one whose size the watcher learnt after the pod.
    for gang, size, learnt in ((None, None, None), ("JobSet/solo", 1, None),
                               ("JobSet/solo", None, 1)):
        out = _idle_for(8, gang=gang, gang_size=size, learnt_size=learnt)
        (reclaim,) = _actions(out, "requeue")
        assert reclaim.params["reason"] == idle.RECLAIM_REASON
        summaries = [o for o in out if isinstance(o, NodeSummary)]
        assert [h.pod for h in summaries[-1].idle] == [POD]
