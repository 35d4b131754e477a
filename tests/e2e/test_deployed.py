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
injected, and the DBE node must be cordoned in the API, exactly once.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox import deployment
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.world import World
from gpusteward.schema import Action, ActionResult, Finding
from gpusteward.streams.app import worker_group
from tests.e2e.test_faulty_fleet import _expected, _key

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "overlays" / "local"
PROCESSES = ["worker", "alerts", "remediation"]


@dataclass
class Run:
    truth: GroundTruth
    findings: list[Finding]
    actions: list[Action]
    results: list[ActionResult]
    cordoned: set[str]
    alerts_log: str
    metrics: dict[str, str]
    """Component -> its /metrics page, scraped on the port its manifest declares."""


async def _while_alive(processes: list[deployment.Process], waiting: Awaitable[None]) -> None:
    """Await ``waiting``; fail at once, with its log, when a deployed process dies."""
    task = asyncio.ensure_future(waiting)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            for process in processes:
                if not process.alive:
                    raise AssertionError(f"{process.launch.component} exited "
                                         f"({process.returncode}):\n{process.log_tail()}")
        task.result()
    finally:
        task.cancel()


async def _run(broker: EmbeddedBroker, workdir: Path) -> Run:
    manifests = deployment.Manifests.from_overlay(OVERLAY)
    spec = scenarios.load("faulty-fleet").model_copy(update={"acceleration": 0.0})
    cluster = SimulatedCluster(spec)
    local = deployment.Local(broker.bootstrap, workdir, topic_prefix="deployed",
                             kubeconfig=workdir / "kubeconfig")
    settings = manifests.launch("collector", local).settings()
    await kafka.ensure_topics(settings)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    processes: list[deployment.Process] = []
    try:
        async with World(cluster, publisher, workdir) as world:
            assert world.kubeconfig == local.kubeconfig
            processes = list(deployment.start(manifests, PROCESSES, local))
            truth = await cluster.run(world)
            await world.settle()
            node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS,
                                                      topics.ALLOCATIONS)]
            await _while_alive(processes, kafka.wait_consumed(
                settings, worker_group(settings), node_topics, 180))
            await _while_alive(processes, kafka.wait_consumed(
                settings, f"{settings.topic_prefix}-remediation",
                [topics.ACTIONS.name(settings)], 120))
            await _while_alive(processes, kafka.wait_consumed(
                settings, f"{settings.topic_prefix}-alerts", [topics.FINDINGS.name(settings)],
                120))
            cordoned = {n["metadata"]["name"] for n in world.api.objects("Node")
                        if n["spec"].get("unschedulable")}
            metrics = {process.launch.component: _scrape(process.launch) for process in processes}
    finally:
        for process in processes:
            process.stop()
        await publisher.stop()

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
        cordoned, alerts_log, metrics)


def _scrape(launch: deployment.Launch) -> str:
    port = launch.env[deployment.METRICS_PORT]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("deployed")))


def test_findings_equal_the_ground_truth(run: Run) -> None:
    expected = _expected(run.truth)
    firing = [f for f in run.findings if f.state == "firing"]
    assert set(Counter(_key(f) for f in firing)) == set(expected)
    ids: dict[tuple[str, str, str], set[str]] = {}
    for finding in firing:
        ids.setdefault(_key(finding), set()).add(finding.id)
    assert all(len(v) == 1 for v in ids.values()), ids


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
