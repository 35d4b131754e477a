"""The system as deployed, end to end, on the ``faulty-fleet`` world.

The processes are the ones ``deploy/overlays/local`` declares (the shipped
base plus the remediation-execute component), started with their commands,
environment and mounted ConfigMaps (:mod:`gpusteward.sandbox.deployment`):
the worker, the alert sink and the executor acting on the Kubernetes API
(the sandbox's API-server double). The simulated world is read by the
production edges: the NVML collector per node (fake NVML, a real kubelet
PodResources socket that names pods without uids) and the Kubernetes
watcher. Doubles stand only where a GPU and an API server would be.

What the deployed system finds is compared with what the simulator
injected, and the DBE node must be cordoned in the API, exactly once. The
rollup sink writes the store; the report CronJob's own command (last ISO week,
so the world runs in last week) then writes a report whose GPU-hours per team
equal what the GPUs read, held by whom the simulator placed there.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.reports import compute
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox import deployment
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.world import World
from gpusteward.schema import Action, ActionResult, Finding, NodeSample
from tests.e2e import readings
from tests.e2e.test_faulty_fleet import _expected, _key

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "overlays" / "local"
PROCESSES = ["worker", "alerts", "remediation", "rollup-sink", "findings-sink",
             "results-sink"]


@dataclass
class Run:
    truth: GroundTruth
    findings: list[Finding]
    actions: list[Action]
    results: list[ActionResult]
    cordoned: set[str]
    alerts_log: str
    samples: list[NodeSample]
    report: dict
    metrics: dict[str, str]
    """Component -> its /metrics page, scraped on the port its manifest declares."""


async def _run(broker: EmbeddedBroker, workdir: Path) -> Run:
    manifests = deployment.Manifests.from_overlay(OVERLAY)
    # The report CronJob reports on the last ISO week: the world runs on its Wednesday.
    last_week = compute.week_of(time.time() - 7 * 86400)
    spec = scenarios.load("faulty-fleet").model_copy(
        update={"acceleration": 0.0, "start_ts": last_week.start + 2 * 86400})
    cluster = SimulatedCluster(spec)
    local = deployment.Local(broker.bootstrap, workdir, topic_prefix="deployed",
                             kubeconfig=workdir / "kubeconfig",
                             # the sink writes (and commits) every second, not every 5 min
                             extra_env={"GPUSTEWARD_REPORT__FLUSH_INTERVAL_S": "1"})
    settings = manifests.launch("collector", local).settings()
    await kafka.ensure_topics(settings)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    processes: list[deployment.Process] = []
    try:
        world = World(cluster, publisher, workdir)
        assert world.kubeconfig == local.kubeconfig
        processes = list(deployment.start(manifests, PROCESSES, local))
        await deployment.wait_ready(processes)
        async with world:
            truth = await cluster.run(world)
            await world.settle()
            await deployment.drain(settings, processes)
            cordoned = {n["metadata"]["name"] for n in world.api.objects("Node")
                        if n["spec"].get("unschedulable")}
            metrics = {process.launch.component: _scrape(process.launch) for process in processes}
    finally:
        for process in processes:
            process.stop()
        await publisher.stop()
    (report_job,) = deployment.start(manifests, ["report"], local)
    assert report_job.wait(180) == 0, report_job.log_tail()
    report = json.loads((report_job.launch.mounts["/reports"] / "report.json").read_text())

    findings = msgspec.json.Decoder(Finding).decode
    actions = msgspec.json.Decoder(Action).decode
    results = msgspec.json.Decoder(ActionResult).decode
    alerts_log = (workdir / "alerts-0.log").read_text(errors="replace")
    return Run(
        truth,
        [findings(r.value) for r in await kafka.read_all(settings, topics.FINDINGS.name(settings))],
        [actions(r.value) for r in await kafka.read_all(settings, topics.ACTIONS.name(settings))],
        [results(r.value) for r in
         await kafka.read_all(settings, topics.ACTION_RESULTS.name(settings))],
        cordoned, alerts_log,
        [msgspec.json.decode(r.value, type=NodeSample)
         for r in await kafka.read_all(settings, topics.SAMPLES.name(settings))],
        report, metrics)


def _scrape(launch: deployment.Launch) -> str:
    port = launch.env[deployment.METRICS_PORT]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("deployed")))


def test_findings_equal_the_ground_truth(run: Run) -> None:
    expected = _expected(run.truth)
    firing = [f for f in run.findings if f.state == "firing" and f.kind != "queue_start_eta"]
    assert set(Counter(_key(f) for f in firing)) == set(expected)
    ids: dict[tuple[str, str, str], set[str]] = {}
    for finding in firing:
        ids.setdefault(_key(finding), set()).add(finding.id)
    assert all(len(v) == 1 for v in ids.values()), ids


def test_start_estimates_are_only_for_workloads_that_waited(run: Run) -> None:
    """Here the remediation acts on the world: its cordons and taints take nodes out of
    scheduling, so a workload arriving later may wait, and whether it still waits when the
    fleet agent looks depends on timing. So a start estimate may or may not appear (most
    runs have none); one for a workload that never waited would be a false alarm."""
    waited = {f"{p.namespace}/{p.pod}" for p in run.truth.pods
              if p.queued_at is not None and p.started_at > p.queued_at}
    waited |= set(run.truth.pending)
    estimated = {f"{f.subject.pod.namespace}/{f.subject.pod.name}" for f in run.findings
                 if f.kind == "queue_start_eta" and f.subject.pod is not None}
    assert estimated <= waited, estimated - waited


def test_the_dbe_node_is_cordoned_through_the_api_exactly_once(run: Run) -> None:
    dbe_nodes = {f.node for f in run.truth.faults if f.kind == "ecc_dbe"}
    assert dbe_nodes
    executed = Counter(r.target.node for r in run.results
                       if r.verb == "cordon" and r.outcome == "executed")
    for node in dbe_nodes:
        assert node in run.cordoned
        assert executed[node] == 1


def test_the_deployed_alert_sink_printed_every_firing_finding(run: Run) -> None:
    for finding in (f for f in run.findings if f.state == "firing"):
        assert finding.subject.node and finding.subject.node in run.alerts_log


def _hours_by_team(run: Run) -> dict[str, dict[str, float]]:
    """Per team (namespace: the scenario labels no team), allocated, used and idle GPU-hours
    from what the GPUs read and whom the simulator placed on them, over the minutes the
    worker could close."""
    threshold = ReportSettings().idle_threshold_pct
    out: dict[str, dict[str, float]] = {}
    for utils, holder in readings.held_minutes(run.truth, run.samples).values():
        if holder is not None:
            hours = out.setdefault(holder.namespace,
                                   {"allocated": 0.0, "used": 0.0, "idle": 0.0})
            hours["allocated"] += 1 / 60
            hours["used"] += sum(utils) / len(utils) / 100 / 60
            hours["idle"] += 1 / 60 if max(utils) < threshold else 0.0
    return out


def test_the_report_cronjob_reports_the_gpu_hours_per_team_the_gpus_read(run: Run) -> None:
    expected = _hours_by_team(run)
    assert len(expected) == 12  # one namespace per user, every one placed
    got = {t["team"]: {"allocated": t["allocated_gpu_hours"], "used": t["used_gpu_hours"],
                       "idle": t["idle_gpu_hours"]} for t in run.report["teams"]}
    assert set(got) == set(expected)
    for team, hours in expected.items():
        for measure, value in hours.items():
            assert got[team][measure] == pytest.approx(value, abs=1 / 60), (team, measure)
def test_every_deployed_process_serves_its_metrics(run: Run) -> None:
    """The port and setting the manifests declare reach each process; the counts match."""
    def total(component: str, name: str, **labels: str) -> float:
        return sum(sample.value for family in text_string_to_metric_families(
            run.metrics[component]) for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items())

    assert set(run.metrics) == set(PROCESSES)
    assert total("worker", "gpusteward_findings_total") == len(
        [f for f in run.findings if f.kind != "remediation_breaker"])
    decided = [r for r in run.results if not r.idempotency_key.startswith("breaker/")]
    assert total("remediation", "gpusteward_actions_total") == len(decided)
    assert total("remediation", "gpusteward_actions_total", verb="cordon",
                 outcome="executed") == sum(1 for r in decided if r.verb == "cordon"
                                            and r.outcome == "executed")
    assert total("alerts", "gpusteward_records_in_total") == len(run.findings)
    assert total("findings-sink", "gpusteward_records_in_total") == len(run.findings)
    assert total("results-sink", "gpusteward_records_in_total") == len(run.results)


def test_the_report_counts_the_findings_the_deployed_sink_kept(run: Run) -> None:
    """The CronJob's report reads the findings store the deployed findings sink wrote:
    per rule, the episodes the pipeline raised. The scenario's jobs are all busy, so no
    pod is named an idle holder and no idle finding was raised."""
    episodes: dict[str, set[str]] = {}
    for finding in run.findings:
        episodes.setdefault(finding.kind, set()).add(finding.id)
    assert run.report["findings"]["stored"] is True
    assert {r["kind"]: r["episodes"] for r in run.report["findings"]["by_kind"]} == {
        kind: len(ids) for kind, ids in episodes.items()}
    assert "idle_holder" not in episodes and run.report["idle_holders"] == []
