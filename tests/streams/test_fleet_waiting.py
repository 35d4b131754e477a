"""The waiting side of the fleet agent without a broker: gangs, demand-aware reclaim, ETAs,
budgets, and what the node join tells it in its summaries."""

from __future__ import annotations

import msgspec

from gpusteward.rules import budget, demand, eta, gang
from gpusteward.rules.idle import RECLAIM_REASON
from gpusteward.rules.policy import Policy
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    IdleHold,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    QueueEvent,
)
from gpusteward.streams.fleet import FleetEvaluator, FleetOutput, FleetSettings, FleetState
from gpusteward.streams.node import NodeJoin, NodeState

T0 = 1_763_683_200.0


def findings(outputs: list[FleetOutput], kind: str) -> list[Finding]:
    return [o for o in outputs if isinstance(o, Finding) and o.kind == kind]


def summary(node: str, ts: float, free: int, total: int = 2,
            idle: list[IdleHold] | None = None,
            held: dict[str, float] | None = None) -> NodeSummary:
    return NodeSummary(ts=ts, node=node, gpu_model="L40S", gpus_total=total, gpus_free=free,
                       idle=idle or [], held_by_team=held or {})


def notebook(i: int, idle_since: float) -> IdleHold:
    return IdleHold(device=f"GPU-{i}", pod=PodRef("ml-nb", f"nb-{i}"), idle_since=idle_since,
                    gpus=1, workload_kind="notebook")


def test_gang_half_placed_through_the_evaluator_and_its_state_survives_a_checkpoint() -> None:
    evaluator, state = FleetEvaluator(), FleetState()
    out: list[FleetOutput] = []
    for i in range(8):
        out += evaluator.on_queue(state, QueueEvent(
            ts=T0, name=f"w-{i}", namespace="ml", cluster_queue="train", state="pending",
            created_at=T0, gpus=1, kind="pod", gang="PyTorchJob/llm", gang_size=8))
    for i in range(6):
        out += evaluator.on_queue(state, QueueEvent(
            ts=T0 + 60, name=f"w-{i}", namespace="ml", cluster_queue="train",
            state="admitted", admitted_at=T0 + 60, gpus=1, kind="pod", gang="PyTorchJob/llm",
            gang_size=8))
    # A restart between: the state goes through the changelog encoding.
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=FleetState)
    for t in range(0, 1800, 30):
        out += evaluator.on_summary(state, summary("n0", T0 + t, free=0))
    (finding,) = findings(out, gang.KIND)
    assert finding.evidence is not None and finding.evidence.values["gpus_held"] == 6
    (requeue,) = [o for o in out if isinstance(o, Action) and o.rule == gang.KIND]
    assert requeue.dry_run and requeue.verb == "requeue"


def test_idle_notebooks_reclaimed_on_the_short_ladder_only_while_the_job_waits() -> None:
    evaluator, state = FleetEvaluator(), FleetState()
    out: list[FleetOutput] = []
    out += evaluator.on_queue(state, QueueEvent(
        ts=T0, name="train-2gpu", namespace="ml", cluster_queue="research", state="pending",
        created_at=T0, gpus=2))
    holds = [notebook(0, T0 - 1800), notebook(1, T0 - 1800)]
    for t in range(0, 2 * 3600, 30):
        out += evaluator.on_summary(state, summary("nb-node", T0 + t, free=0, idle=holds))
    actions = [o for o in out if isinstance(o, Action) and o.rule == demand.KIND]
    notices = [a for a in actions if a.verb == "notify_owner"]
    reclaims = [a for a in actions if a.verb == "requeue"]
    # The workload counts as demand after min_wait_s; both notebooks were idle long enough.
    assert len(notices) == 2 and all(a.ts <= T0 + 300 + 30 for a in notices)
    assert len(reclaims) == 2
    assert all(a.params["reason"] == RECLAIM_REASON for a in reclaims)
    assert all(T0 + 5400 <= a.ts <= T0 + 5400 + 30 for a in reclaims)
    assert "ml/train-2gpu" in findings(out, demand.KIND)[0].summary
    # The job starts: the episodes resolve, and nothing more is asked.
    later = evaluator.on_queue(state, QueueEvent(
        ts=T0 + 7300, name="train-2gpu", namespace="ml", cluster_queue="research",
        state="admitted", admitted_at=T0 + 7300, gpus=2))
    later += evaluator.on_summary(state, summary("nb-node", T0 + 7400, free=0, idle=holds))
    assert [f.state for f in findings(later, demand.KIND)] == ["resolved", "resolved"]


def test_no_one_waiting_leaves_idle_holders_to_the_usual_ladder() -> None:
    evaluator, state = FleetEvaluator(), FleetState()
    out: list[FleetOutput] = []
    for t in range(0, 4 * 3600, 60):
        out += evaluator.on_summary(state, summary(
            "nb-node", T0 + t, free=0, idle=[notebook(0, T0 - 1800)]))
    assert findings(out, demand.KIND) == []


def test_eta_published_for_a_pending_workload_and_closed_when_it_starts() -> None:
    evaluator, state = FleetEvaluator(), FleetState()
    out: list[FleetOutput] = []
    events = [("old", "pending", T0), ("old", "admitted", T0), ("old", "finished", T0 + 1200),
              ("run", "pending", T0 + 1200), ("run", "admitted", T0 + 1200),
              ("wait", "pending", T0 + 1300)]
    for name, st, ts in events:
        out += evaluator.on_queue(state, QueueEvent(
            ts=ts, name=name, namespace="ml", cluster_queue="q", state=st,  # type: ignore[arg-type]
            created_at=ts, admitted_at=ts if st == "admitted" else None, gpus=1))
    out += evaluator.on_summary(state, summary("n0", T0 + 1400, free=0, total=1))
    issued = [f for f in findings(out, eta.KIND) if f.state == "firing"
              and f.subject.pod is not None and f.subject.pod.name == "wait"]
    # None before the first node summary: the queue was read ahead of the fleet.
    (published,) = issued
    assert published.evidence is not None
    assert published.evidence.values["eta_ts"] == T0 + 2400  # run's peer ran 20 min
    closed = evaluator.on_queue(state, QueueEvent(
        ts=T0 + 2450, name="wait", namespace="ml", cluster_queue="q", state="admitted",
        admitted_at=T0 + 2450, gpus=1))
    (resolved,) = findings(closed, eta.KIND)
    assert resolved.evidence is not None and resolved.evidence.values["eta_error_s"] == -50


def test_team_budget_from_the_policy_and_the_summaries() -> None:
    policy = Policy(rules={budget.KIND: {"budgets_gpu_h": {"llm": 50}}})
    evaluator, state = FleetEvaluator(FleetSettings(policy=policy)), FleetState()
    out: list[FleetOutput] = []
    for t in range(0, 3 * 3600, 60):
        out += evaluator.on_summary(state, summary("n0", T0 + t, free=0, total=32,
                                                   held={"llm": 32, "vision": 8}))
    assert [(f.labels["team"], f.state) for f in findings(out, budget.PROJECTED_KIND)] == [
        ("llm", "firing"), ("llm", "resolved")]
    crossed = [f for f in findings(out, budget.KIND) if f.severity == "warning"]
    assert len(crossed) == 1 and abs(crossed[0].ts - (T0 + 50 / 32 * 3600)) <= 120


def test_node_summary_lists_idle_holds_and_team_holdings() -> None:
    pod = PodRef(namespace="ml-ana", name="nb", uid="u1")
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, PodAllocation(
        ts=T0, node="n1", pod=pod, phase="running", gpus=1, device_ids=["GPU-1"],
        started_at=T0, workload_kind="notebook", labels={"team": "vision"}))
    out: list = []
    for i in range(0, 100):
        out += join.on_sample(state, NodeSample(ts=T0 + i * 30, node="n1", source="t", devices=[
            DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=0.0, pod=pod)]))
    last = [o for o in out if isinstance(o, NodeSummary)][-1]
    assert last.held_by_team == {"vision": 1.0}
    (hold,) = last.idle
    assert (hold.device, hold.pod, hold.gpus, hold.ladder_step) == ("GPU-1", pod, 1, 1)
    # Idle counted from the end of the start-up grace.
    assert hold.idle_since == T0 + 600


def test_a_team_budget_removed_from_the_policy_resolves_its_findings() -> None:
    """Team llm crossed its budget (and its projection was open for vision's): the policy
    the worker restarts with sets neither team a budget any more (every budget gone, or
    another team's only). Nothing evaluated those teams again, so their findings fired for
    ever, past every week's end. They resolve at the first evaluation under that policy,
    saying why."""
    for left in ({}, {"other": 1000}):
        before = Policy(rules={budget.KIND: {"budgets_gpu_h": {"llm": 50, "vision": 300}}})
        evaluator, state = FleetEvaluator(FleetSettings(policy=before)), FleetState()
        out: list[FleetOutput] = []
        t = 0
        while t < 3 * 3600:
            out += evaluator.on_summary(state, summary("n0", T0 + t, free=0, total=64,
                                                       held={"llm": 32, "vision": 32}))
            t += 60
        opened = {(f.kind, f.labels["team"]) for f in out
                  if isinstance(f, Finding) and f.state == "firing"}
        assert {(budget.KIND, "llm"), (budget.PROJECTED_KIND, "vision")} <= opened
        state = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=FleetState)
        after = Policy(rules={budget.KIND: {"budgets_gpu_h": left}})
        evaluator = FleetEvaluator(FleetSettings(policy=after))
        restarted = T0 + t
        out = []
        while t < 9 * 86400:  # past the week's end
            out += evaluator.on_summary(state, summary("n0", T0 + t, free=0, total=64,
                                                       held={"llm": 32, "vision": 32}))
            t += 600
        closed = [f for f in out if isinstance(f, Finding) and f.labels.get("team") != "other"]
        assert sorted((f.kind, f.labels["team"], f.state, f.ts) for f in closed) == sorted(
            [(budget.KIND, "llm", "resolved", restarted)] * 2  # 75 % (info) and 100 %
            + [(budget.PROJECTED_KIND, "vision", "resolved", restarted)]), left
        assert {f.summary for f in closed} == {"team llm: no weekly budget set any more",
                                               "team vision: no weekly budget set any more"}
