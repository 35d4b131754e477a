"""Waiting, end to end: gangs half placed, reclaim for waiting work, team budgets.

Each scenario is published by the simulator as fast as it goes; a real worker process
(``gpusteward worker``: the node join and the fleet agents, with the policy the deployment
mounts, given by GPUSTEWARD_POLICY_FILE) consumes it; the findings and actions topics are
then read whole and compared with what the simulator did.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from gpusteward.broker import EmbeddedBroker
from gpusteward.rules import budget, demand, eta, gang
from gpusteward.rules.idle import RECLAIM_REASON
from gpusteward.settings import Settings

from .test_fleet import Run, run_scenario

pytestmark = pytest.mark.e2e

BUDGET_GPU_H = 100.0


def _fresh(broker: EmbeddedBroker, name: str) -> Settings:
    return broker.settings().model_copy(update={"topic_prefix": name})


@pytest.fixture(scope="module")
def gang_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    log = tmp_path_factory.mktemp("gang") / "worker.log"
    return asyncio.run(run_scenario(_fresh(broker, "e2e-gang"), "gang-half-placed", log))


@pytest.fixture(scope="module")
def waiting_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    log = tmp_path_factory.mktemp("waiting") / "worker.log"
    return asyncio.run(run_scenario(_fresh(broker, "e2e-waiting"), "idle-notebooks-waiting",
                                    log))


@pytest.fixture(scope="module")
def budget_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("budget")
    policy = folder / "policy.yaml"
    # The replay runs five hours of event time in seconds: the node join may read one node's
    # partition hours of event time after another's, so the watermark waits that long.
    policy.write_text(f"rules:\n  {budget.KIND}:\n    budgets_gpu_h: "
                      f"{{llm: {BUDGET_GPU_H}, vision: {BUDGET_GPU_H}}}\n"
                      "    watermark_lag_s: 86400\n")
    with pytest.MonkeyPatch.context() as patch:
        # The worker process reads its policy file as the deployment mounts it.
        patch.setitem(os.environ, "GPUSTEWARD_POLICY_FILE", str(policy))
        return asyncio.run(run_scenario(_fresh(broker, "e2e-budget"), "team-budget",
                                        folder / "worker.log"))


def _firing(run: Run, kind: str) -> list:
    return [f for f in run.findings if f.kind == kind and f.state == "firing"]


def test_half_placed_gang_found_within_its_window_and_never_a_whole_one(gang_run: Run) -> None:
    truth = gang_run.truth
    assert truth.gangs == {"ml-pretrain/pretrain": 8, "ml-finetune/finetune": 4}
    starts: dict[str, list[float]] = {}
    for pod in truth.pods:
        if pod.gang:
            starts.setdefault(pod.gang, []).append(pod.started_at)
    window = gang.GangSettings().window_s
    # From the truth: a gang placed in part for longer than the window must be found, one
    # placed whole at once never.
    stuck = {key for key, placed in starts.items()
             if len(placed) == truth.gangs[key] and max(placed) - min(placed) > window + 120}
    whole = {key for key, placed in starts.items() if max(placed) == min(placed)}
    assert stuck == {"ml-pretrain/pretrain"} and whole == {"ml-finetune/finetune"}
    firing = _firing(gang_run, gang.KIND)
    assert [f"{f.subject.pod.namespace}/{f.labels['gang'].split('/')[-1]}"
            for f in firing] == ["ml-pretrain/pretrain"]
    (finding,) = firing
    first = min(starts["ml-pretrain/pretrain"])
    assert finding.starts_at == first
    # Within the window, plus one evaluation interval and a summary interval of slack.
    assert first + window <= finding.ts <= first + window + 90
    held = [p for p in truth.pods if p.gang == "ml-pretrain/pretrain" and p.started_at == first]
    assert finding.evidence is not None
    assert finding.evidence.values["gpus_held"] == sum(p.gpus for p in held) == 6
    hours = finding.evidence.values["gpu_hours_held"]
    assert hours == pytest.approx(6 * (finding.ts - first) / 3600)
    (requeue,) = [a for a in gang_run.actions if a.rule == gang.KIND]
    assert requeue.verb == "requeue" and requeue.dry_run
    assert [f.state for f in gang_run.findings if f.kind == gang.KIND] == ["firing",
                                                                           "resolved"]


def test_idle_notebooks_reclaimed_on_the_short_ladder_while_the_job_waits(
        waiting_run: Run) -> None:
    truth = waiting_run.truth
    assert truth.pending == ["ml-dia/train-dia"], "no reclaim is executed: the job still waits"
    idle = {f"{p.namespace}/{p.pod}": p for p in truth.pods if p.idle}
    assert set(idle) == {"ml-ana/nb-ana", "ml-ben/nb-ben"}
    settings = demand.DemandReclaimSettings()
    reclaims = [a for a in waiting_run.actions
                if a.rule == demand.KIND and a.verb == "requeue"]
    assert sorted(f"{a.target.pod.namespace}/{a.target.pod.name}" for a in reclaims
                  if a.target.pod) == sorted(idle), _demand_story(waiting_run)
    for action in reclaims:
        assert action.params["reason"] == RECLAIM_REASON and action.dry_run
        idle_since = float(action.params["idle_since"])
        # The idle episode counts from the end of the start-up grace of the notebook.
        pod = idle[f"{action.target.pod.namespace}/{action.target.pod.name}"]  # type: ignore[union-attr]
        assert idle_since == pod.started_at + 600
        assert idle_since + settings.reclaim_after_s <= action.ts <= \
            idle_since + settings.reclaim_after_s + 90
    notices = [a for a in waiting_run.actions
               if a.rule == demand.KIND and a.verb == "notify_owner"]
    assert len(notices) == 2
    for finding in _firing(waiting_run, demand.KIND):
        assert finding.labels["waiting"] == "ml-dia/train-dia"
        assert "ml-dia/train-dia" in finding.summary
    # The busy notebook is never named, and the usual ladder has not reached its reclaim.
    assert not any(a.target.pod and a.target.pod.name == "busy-nb-cai"
                   for a in waiting_run.actions)
    assert not [a for a in waiting_run.actions
                if a.verb == "requeue" and a.rule != demand.KIND]


def _demand_story(run: Run) -> str:
    """What the pipeline said about the waiting world: its demand findings and, per node,
    when its summaries carried idle holds (first, last, the holds' idle_since)."""
    lines = [f"{f.ts - run.truth.start_ts:.0f} s {f.state} {f.summary}"
             for f in run.findings if f.kind == demand.KIND]
    holds: dict[str, list[float]] = {}
    for summary in run.summaries:
        for hold in summary.idle:
            holds.setdefault(f"{summary.node} {hold.pod.name} idle since "
                             f"{hold.idle_since - run.truth.start_ts:.0f}",
                             []).append(summary.ts - run.truth.start_ts)
    lines += [f"{key}: in {len(ts)} summaries, {min(ts):.0f}-{max(ts):.0f} s"
              for key, ts in holds.items()]
    return "\n".join(lines or ["no demand finding, no idle hold in any summary"])


def test_budget_projected_then_crossed_for_the_team_that_burns_it(budget_run: Run) -> None:
    truth = budget_run.truth
    # The truth's GPU-hours of team llm over time: the moment its use reaches the budget.
    llm = [p for p in truth.pods if p.team == "llm"]
    assert len(llm) == 4 and all(p.gpus == 8 for p in llm)
    starts = sorted(p.started_at for p in llm)
    held_from = starts[0]
    assert starts[-1] == held_from, "the four workers start together"
    crossing = held_from + BUDGET_GPU_H / 32 * 3600
    # One projection, re-issued under its id if its crossing moved; a user sees the last.
    projections = _firing(budget_run, budget.PROJECTED_KIND)
    assert len({f.id for f in projections}) == 1
    projected = projections[-1]
    assert projected.labels["team"] == "llm"
    assert held_from <= projected.starts_at <= held_from + 180
    assert projected.evidence is not None
    assert abs(projected.evidence.values["crossing_ts"] - crossing) <= 180
    crossed = [f for f in _firing(budget_run, budget.KIND) if f.severity == "warning"]
    (spent,) = crossed
    assert spent.labels["team"] == "llm"
    assert crossing <= spent.ts <= crossing + 180
    # Vision holds one GPU for five hours: far from its budget, nothing about it.
    assert not [f for f in budget_run.findings if f.labels.get("team") == "vision"]


@pytest.fixture(scope="module")
def queue_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    log = tmp_path_factory.mktemp("eta") / "worker.log"
    # Paced as a live cluster (three hours in 18 s), not replayed at once: an estimate needs
    # the node summaries of its time, and a replay lets the agent read the whole queue
    # before the first summary.
    return asyncio.run(run_scenario(_fresh(broker, "e2e-eta"), "queue-pressure", log,
                                    acceleration=600.0))


def test_start_etas_published_through_the_worker_and_closed_with_their_error(
        queue_run: Run) -> None:
    """The estimates' accuracy is measured in tests/streams/test_eta_accuracy.py; here, that
    the deployed worker publishes them and closes each with the truth's start."""
    truth = queue_run.truth
    started = {f"{p.namespace}/{p.pod}": p.started_at for p in truth.pods}
    closed = [f for f in queue_run.findings if f.kind == eta.KIND and f.state == "resolved"
              and f.evidence and "started_ts" in f.evidence.values]
    # The worker starts while the simulation already runs (a few wall seconds are an hour
    # of event time at this pace): workloads that waited before it saw the fleet get none.
    assert len(closed) >= 4
    for finding in closed:
        assert finding.subject.pod is not None and finding.evidence is not None
        values = finding.evidence.values
        key = f"{finding.subject.pod.namespace}/{finding.subject.pod.name}"
        assert values["started_ts"] == started[key]
        assert values["eta_error_s"] == values["eta_ts"] - started[key]
    firing = [f for f in queue_run.findings if f.kind == eta.KIND and f.state == "firing"]
    assert {f.id for f in closed} <= {f.id for f in firing}
