"""``gpusteward status`` and the processes' ``/metrics`` after a faulty-fleet run.

The simulator publishes the ``faulty-fleet`` scenario; the stream worker
runs as a child process serving ``/metrics``; the alerting consumer and the
remediation executor (dry run) run in-process serving theirs. Then the real
``gpusteward status --json`` command reads the topics, and each process's
metrics are compared with what the topics hold: records in, findings by
kind, open findings, actions by verb and outcome.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpusteward import kafka, metrics, topics
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.broker import EmbeddedBroker, free_port
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.remediation.executor import Executor, NoBackend
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import ActionResult, Finding
from gpusteward.settings import MetricsSettings, Settings
from gpusteward.status import FleetStatus
from gpusteward.topics import worker_group
from tests.e2e.test_faulty_fleet import _expected

pytestmark = pytest.mark.e2e

NODE_TOPICS = (topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _by(samples: Samples, name: str, *labels: str) -> Counter[tuple[str, ...]]:
    out: Counter[tuple[str, ...]] = Counter()
    for (sample, pairs), value in samples.items():
        if sample == name and value:
            found = dict(pairs)
            out[tuple(found[label] for label in labels)] += int(value)
    return out


def _sample(samples: Samples, name: str, labels: dict[str, str]) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@dataclass
class Run:
    truth: GroundTruth
    settings: Settings
    status: FleetStatus
    worker: Samples
    alerting: Samples
    remediation: Samples
    findings: list[Finding]
    results: list[ActionResult]
    consumed: Counter[str]


async def _run(broker: EmbeddedBroker, log_dir: Path) -> Run:
    settings = broker.settings().model_copy(update={"topic_prefix": "e2e-status"})
    await kafka.ensure_topics(settings)
    spec = scenarios.load("faulty-fleet").model_copy(update={"acceleration": 0.0})
    publisher = KafkaPublisher(settings)
    await publisher.start()
    worker_port = free_port()
    os.environ["GPUSTEWARD_METRICS__PORT"] = str(worker_port)
    worker = WorkerProcess(settings, log_dir / "worker.log")
    try:
        worker.start()
    finally:
        del os.environ["GPUSTEWARD_METRICS__PORT"]

    def served(port: int) -> Settings:
        return settings.model_copy(update={"metrics": MetricsSettings(port=port,
                                                                      addr="127.0.0.1")})

    alerting_port, remediation_port = free_port(), free_port()
    alerting = FindingsConsumer(served(alerting_port), [])
    remediation = Executor(served(remediation_port), NoBackend())
    stop = asyncio.Event()
    consumers = [asyncio.create_task(alerting.run(stop)),
                 asyncio.create_task(remediation.run(stop))]
    try:
        truth = await SimulatedCluster(spec).run(publisher)
        names = [t.name(settings) for t in NODE_TOPICS]
        await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=180)
        await kafka.wait_consumed(settings, alerting.group_id,
                                  [topics.FINDINGS.name(settings)], timeout_s=60)
        await kafka.wait_consumed(settings, remediation.group_id,
                                  [topics.ACTIONS.name(settings)], timeout_s=60)
        assert worker.alive
        await asyncio.sleep(1.0)  # a lag reading after the last commit (LAG_INTERVAL_S below)
        worker_metrics = _scrape(worker_port)
        alerting_metrics = _scrape(alerting_port)
        remediation_metrics = _scrape(remediation_port)
        command = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "gpusteward.cli", "status", "--json",
            "--bootstrap", settings.kafka.bootstrap_servers,
            env={**os.environ, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(command.communicate(), timeout=60)
        assert command.returncode == 0, err.decode()
    finally:
        stop.set()
        await asyncio.gather(*consumers)
        worker.stop()
        await publisher.stop()
    consumed: Counter[str] = Counter()
    for name in names:
        consumed[name] = len(await kafka.read_all(settings, name))
    decode_finding = msgspec.json.Decoder(Finding).decode
    decode_result = msgspec.json.Decoder(ActionResult).decode
    return Run(
        truth, settings, msgspec.json.decode(out, type=FleetStatus),
        worker_metrics, alerting_metrics, remediation_metrics,
        [decode_finding(r.value)
         for r in await kafka.read_all(settings, topics.FINDINGS.name(settings))],
        [decode_result(r.value)
         for r in await kafka.read_all(settings, topics.ACTION_RESULTS.name(settings))],
        consumed)


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics, "LAG_INTERVAL_S", 0.2)  # the in-process consumers' readings
        return asyncio.run(_run(broker, tmp_path_factory.mktemp("status")))


# Finding kinds of faults that stop (bursts, thermal): their findings resolve once the fault
# has ended; the others (XID, ECC DBE, remap failure, GPU lost) stay open until repaired.
ENDING = {"ecc_sbe_rate": "sbe_burst", "pcie_replay": "pcie_replay",
          "nvlink_errors": "nvlink_errors", "thermal_slowdown": "thermal"}


def _open_at_end(truth: GroundTruth) -> set[tuple[str, str]]:
    """(finding kind, device) the ground truth says are still open when the run ends."""
    ended = {(f.kind, f.device) for f in truth.faults if f.end is not None}
    return {(kind, device) for kind, device, _ in _expected(truth)
            if kind not in ENDING or (ENDING[kind], device) not in ended}


def test_status_lists_the_open_findings_the_ground_truth_expects(run: Run):
    devices = _open_at_end(run.truth)
    expected = Counter(kind for kind, _ in devices)
    expected["remediation_breaker"] += sum(
        1 for r in run.results if r.idempotency_key.startswith("breaker/trip/"))
    assert +Counter(f.kind for f in run.status.findings) == +expected
    assert len(run.status.findings) == len({f.id for f in run.status.findings})
    # A finding naming a pod (one workload's application XIDs) is shown by the pod.
    holders = {(kind, f"{p.namespace}/{p.pod} on {p.node}")
               for kind, device in devices for p in run.truth.pods if device in p.devices}
    for finding in run.status.findings:
        if finding.kind != "remediation_breaker":
            assert any(finding.subject.endswith("/" + device) and kind == finding.kind
                       for kind, device in devices) \
                or (finding.kind, finding.subject) in holders, finding


def test_status_shows_pools_actions_and_lag(run: Run):
    nodes = sum(group.count for group in scenarios.load("faulty-fleet").nodes)
    assert sum(p.nodes for p in run.status.pools) == nodes
    assert not run.status.pending_actions, "the executor decided every action"
    finals = [r for r in run.results if r.outcome != "retrying"
              and not r.idempotency_key.startswith("breaker/")]
    assert len(run.status.recent_actions) == min(20, len({r.idempotency_key for r in finals}))
    worker_lag = run.status.lag[worker_group(run.settings)]
    assert set(worker_lag) >= {t.name(run.settings) for t in NODE_TOPICS}
    assert sum(worker_lag[t.name(run.settings)] for t in NODE_TOPICS) == 0


def test_worker_metrics_match_the_topics(run: Run):
    assert _by(run.worker, "gpusteward_records_in_total", "topic") == Counter(
        {(topic,): count for topic, count in run.consumed.items()})
    firing = Counter((f.kind, f.severity, f.state) for f in run.findings
                     if f.kind != "remediation_breaker")
    assert _by(run.worker, "gpusteward_findings_total", "kind", "severity", "state") == firing
    out = _by(run.worker, "gpusteward_records_out_total", "topic")
    assert out[(topics.FINDINGS.name(run.settings),)] == sum(firing.values())
    assert _by(run.worker, "gpusteward_processing_seconds_count", "stage") == Counter(
        {("node_join",): sum(run.consumed.values())})
    assert _by(run.worker, "gpusteward_rebalances_total", "group")[
        (worker_group(run.settings),)] >= 1


def test_alerting_and_remediation_metrics_match_the_topics(run: Run):
    open_now = Counter((f.kind, f.severity) for f in run.status.findings)
    assert _by(run.alerting, "gpusteward_findings_open", "kind", "severity") == open_now
    decided = Counter((r.verb, r.outcome) for r in run.results
                      if not r.idempotency_key.startswith("breaker/"))
    assert _by(run.remediation, "gpusteward_actions_total", "verb", "outcome") == decided
    # Read from the group's commits beside the loop: present, and nothing left behind.
    lag = {"group": f"{run.settings.topic_prefix}-remediation",
           "topic": topics.ACTIONS.name(run.settings)}
    assert _sample(run.remediation, "gpusteward_consumer_lag_records", lag) == 0
    caught_up = _sample(run.remediation, "gpusteward_consumer_caught_up_timestamp_seconds", lag)
    assert caught_up is not None and caught_up > time.time() - 60
