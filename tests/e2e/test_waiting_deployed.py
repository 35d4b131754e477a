"""Waiting, through the deployed system: reclaim for a waiting job, gangs, team budgets.

Each world runs under the processes ``deploy/overlays/local`` declares (the worker, and
for the reclaim the alert sink and the executor on the API-server double), read by the
production NVML collectors and watcher (:mod:`gpusteward.sandbox.world`): gangs, their
sizes and teams reach the worker only as a cluster states them (a JobSet's label on its
pods and the JobSet object, the pods' team label). ``tests/e2e/test_waiting.py`` runs
the same scenarios with the simulator publishing straight to the worker.

``idle-notebooks-waiting`` (two idle notebooks hold the two GPUs of a node, a 2-GPU job
arrives at 20 min and waits for them, a busy notebook holds the other node) runs paced,
under the shipped policy with one change an operator would make after a week of dry
runs: demand-aware reclaims are carried out (``idle_blocking_demand.reclaim_execute``,
and the rule enabled in the executor). The usual idle ladder stays at its shipped half
day, so only the short one can act in the four simulated hours. The executor's Notebook
stop reaches the simulated cluster through the API (the world's write-back), which frees
the GPUs; the ground truth says when the notebooks were reclaimed and the job started.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import budget, demand, gang, idle
from gpusteward.sandbox import deployment
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.world import World
from gpusteward.schema import ActionResult, Finding

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "overlays" / "local"
DURATION_S = 4 * 3600.0
"""Long enough for the short ladder (2 h of idleness) and the job's start after it."""
WALL_S = 30.0
"""Paced: the executor's reclaim must reach the simulated cluster while the day runs."""
JOB = "ml-dia/train-dia"
BUDGET_GPU_H = 100.0


@dataclass
class Run:
    truth: GroundTruth
    findings: list[Finding]
    results: list[ActionResult]


async def _run(broker: EmbeddedBroker, workdir: Path, scenario: str, *, policy: str,
               processes: list[str], wall_s: float = 0.0, duration_s: float | None = None,
               enabled: list[str] | None = None) -> Run:
    policy_file = workdir / "policy.yaml"
    policy_file.write_text(policy)
    manifests = deployment.Manifests.from_overlay(OVERLAY)
    local = deployment.Local(broker.bootstrap, workdir, topic_prefix=f"deployed-{scenario}",
                             kubeconfig=workdir / "kubeconfig", extra_env={
                                 "GPUSTEWARD_POLICY_FILE": str(policy_file),
                                 "GPUSTEWARD_REMEDIATION__ENABLED_RULES":
                                     json.dumps(enabled or [])})
    spec = scenarios.load(scenario)
    duration = duration_s or spec.duration_s
    cluster = SimulatedCluster(spec.model_copy(update={
        "duration_s": duration, "acceleration": duration / wall_s if wall_s else 0.0}))
    settings = manifests.launch("collector", local).settings()
    await kafka.ensure_topics(settings)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    started: list[deployment.Process] = []
    try:
        world = World(cluster, publisher, workdir)
        started = list(deployment.start(manifests, processes, local))
        await deployment.wait_ready(started)
        async with world:
            truth = await cluster.run(world)
            await world.settle()
            await deployment.drain(settings, started)
    finally:
        for process in started:
            process.stop()
        await publisher.stop()
    findings = msgspec.json.Decoder(Finding).decode
    results = msgspec.json.Decoder(ActionResult).decode
    return Run(
        truth,
        [findings(r.value) for r in await kafka.read_all(settings, topics.FINDINGS.name(settings))],
        [results(r.value) for r in
         await kafka.read_all(settings, topics.ACTION_RESULTS.name(settings))])


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(
        broker, tmp_path_factory.mktemp("waiting-deployed"), "idle-notebooks-waiting",
        policy=f"rules:\n  {demand.KIND}:\n    reclaim_execute: true\n",
        processes=["worker", "alerts", "remediation"], wall_s=WALL_S, duration_s=DURATION_S,
        enabled=[demand.KIND]))


@pytest.fixture(scope="module")
def gang_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The gang scenario as fast as it goes, its gangs known only through the watcher."""
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("gang-deployed"),
                            "gang-half-placed", policy="rules: {}\n", processes=["worker"]))


def test_idle_notebooks_reclaimed_on_the_short_ladder_then_the_job_starts(run: Run) -> None:
    truth = run.truth
    idle_notebooks = {f"{p.namespace}/{p.pod}": p for p in truth.pods if p.idle}
    assert set(idle_notebooks) == {"ml-ana/nb-ana", "ml-ben/nb-ben"}
    reclaimed = {f"{r.namespace}/{r.pod}": r for r in truth.reclaims}
    # Exactly the two idle notebooks the job needs, never the busy one.
    assert set(reclaimed) == set(idle_notebooks)
    settings = demand.DemandReclaimSettings()
    for key, record in reclaimed.items():
        idle_since = idle_notebooks[key].started_at + idle.IdleSettings().grace_s
        # The short ladder (2 h of idleness), not the usual half day; the executor acts
        # within minutes of event time of the worker's action (paced at 480x).
        assert idle_since + settings.reclaim_after_s <= record.ts <= \
            idle_since + settings.reclaim_after_s + 900, key
        assert record.gpu_hours_given_back > 0
    # The job waited for them and started once both were gone, on their node.
    (job,) = [p for p in truth.pods if f"{p.namespace}/{p.pod}" == JOB]
    assert job.queued_at is not None
    assert max(r.ts for r in reclaimed.values()) <= job.started_at <= \
        max(r.ts for r in reclaimed.values()) + 300
    assert job.node == {r.node for r in reclaimed.values()}.pop()
    assert JOB not in truth.pending


def test_the_reclaims_were_executed_through_the_api_for_the_waiting_job(run: Run) -> None:
    executed = [r for r in run.results if r.verb == "requeue" and r.outcome == "executed"]
    assert sorted(f"{r.target.pod.namespace}/{r.target.pod.name}" for r in executed
                  if r.target.pod) == ["ml-ana/nb-ana", "ml-ben/nb-ben"]
    firing = [f for f in run.findings if f.kind == demand.KIND and f.state == "firing"]
    job = next(p for p in run.truth.pods if f"{p.namespace}/{p.pod}" == JOB)
    assert job.queued_at is not None
    min_wait = demand.DemandReclaimSettings().min_wait_s
    for finding in firing:
        # Only while the job waits: no episode before it had waited min_wait_s, each names it.
        assert finding.labels["waiting"] == JOB
        assert finding.starts_at >= job.queued_at + min_wait
        assert finding.ts < job.started_at
    # Once the job runs nobody waits: every episode is resolved, none fires after.
    resolved = {f.id for f in run.findings if f.kind == demand.KIND and f.state == "resolved"}
    assert {f.id for f in firing} == resolved


def test_a_half_placed_gang_known_through_the_watcher_is_found_in_its_window(
        gang_run: Run) -> None:
    """The gang and its size reach the worker only as a real cluster states them: the
    members' JobSet label and the JobSet object, listed and watched by the watcher."""
    truth = gang_run.truth
    starts: dict[str, list[float]] = {}
    for pod in truth.pods:
        if pod.gang:
            starts.setdefault(pod.gang, []).append(pod.started_at)
    window = gang.GangSettings().window_s
    stuck = {key for key, placed in starts.items() if max(placed) - min(placed) > window + 120}
    whole = {key for key, placed in starts.items() if max(placed) == min(placed)}
    assert stuck == {"ml-pretrain/pretrain"} and whole == {"ml-finetune/finetune"}
    firing = [f for f in gang_run.findings if f.kind == gang.KIND and f.state == "firing"]
    (finding,) = firing  # never the whole gang
    assert finding.subject.pod is not None
    assert (finding.subject.pod.namespace, finding.labels["gang"]) == ("ml-pretrain",
                                                                        "JobSet/pretrain")
    first = min(starts["ml-pretrain/pretrain"])
    assert finding.starts_at == first
    assert first + window <= finding.ts <= first + window + 90
    assert finding.evidence is not None
    assert finding.evidence.values["gang_size"] == truth.gangs["ml-pretrain/pretrain"] == 8
    assert finding.evidence.values["gpus_held"] == 6


@pytest.fixture(scope="module")
def elastic_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The elastic-gang scenario as fast as it goes, its gangs known only through the
    watcher (the PyTorchJob and JobSet objects and their pods' owners and labels)."""
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("elastic-deployed"),
                            "elastic-gang", policy="rules: {}\n", processes=["worker"]))


def test_an_elastic_job_running_above_its_minimum_is_no_half_placed_gang(
        elastic_run: Run) -> None:
    """An elastic PyTorchJob (minReplicas 2 of 6) trains with the four workers that found
    room for 40 minutes while two wait: no finding, no requeue asked (the rule once took the
    six replicas for the gang's size). The rigid JobSet beside it, two of its four workers
    holding their GPUs for 20 minutes, is still found."""
    truth = elastic_run.truth
    starts: dict[str, list[float]] = {}
    for pod in truth.pods:
        if pod.gang:
            starts.setdefault(pod.gang, []).append(pod.started_at)
    window = gang.GangSettings().window_s
    elastic, rigid = sorted(starts["ml-elastic/elastic"]), sorted(starts["ml-rigid/rigid"])
    assert elastic[3] == elastic[0] and elastic[4] - elastic[0] > window + 600
    assert rigid[1] == rigid[0] and rigid[2] - rigid[0] > window + 120
    firing = [f for f in elastic_run.findings if f.kind == gang.KIND and f.state == "firing"]
    assert len(firing) == 1, [(f.id, f.ts, f.summary) for f in firing]
    (finding,) = firing
    assert finding.labels["gang"] == "JobSet/rigid"
    assert finding.evidence is not None and finding.evidence.values["gang_size"] == 4
    # The waiting workers get their start estimates (info), nothing else names the job.
    assert {f.kind for f in elastic_run.findings if f.subject.pod is not None
            and f.subject.pod.namespace == "ml-elastic"} <= {"queue_start_eta"}


@pytest.fixture(scope="module")
def budget_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Five hours in 10 s; the team comes from the pods' labels in the API."""
    # Paced, as a live fleet arrives: replayed as fast as it goes, the worker read a node's
    # samples of some minutes before the allocation events of the job that started then
    # (another topic), so those minutes' summaries held nothing for the team and the
    # projection came 5 minutes late (seen once). One node's partition may still be read
    # some event time after another's: the watermark waits (as in test_waiting.py).
    policy = (f"rules:\n  {budget.KIND}:\n    budgets_gpu_h: "
              f"{{llm: {BUDGET_GPU_H}, vision: {BUDGET_GPU_H}}}\n    watermark_lag_s: 86400\n")
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("budget-deployed"), "team-budget",
                            policy=policy, processes=["worker"], wall_s=10.0))


def test_the_budget_crossing_projected_then_found_for_the_team_in_the_pod_labels(
        budget_run: Run) -> None:
    llm = [p for p in budget_run.truth.pods if p.team == "llm"]
    assert len(llm) == 4 and all(p.gpus == 8 for p in llm)
    held_from = min(p.started_at for p in llm)
    assert max(p.started_at for p in llm) == held_from
    crossing = held_from + BUDGET_GPU_H / 32 * 3600
    firing = [f for f in budget_run.findings if f.state == "firing"]
    # One projection, re-issued under its id if its crossing moved (a node's summaries read
    # after the others'); what a user sees is its last issue.
    projections = [f for f in firing if f.kind == budget.PROJECTED_KIND]
    assert len({f.id for f in projections}) == 1
    projected = projections[-1]
    assert projected.labels["team"] == "llm"
    assert held_from <= projected.starts_at <= held_from + 180
    assert projected.evidence is not None
    assert abs(projected.evidence.values["crossing_ts"] - crossing) <= 180
    (spent,) = [f for f in firing if f.kind == budget.KIND and f.severity == "warning"]
    assert spent.labels["team"] == "llm"
    assert crossing <= spent.ts <= crossing + 180
    assert not [f for f in budget_run.findings if f.labels.get("team") == "vision"]
