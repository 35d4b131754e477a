"""Uid-less attribution and the rollup path, through the real worker and the real sink command.

The simulator attributes pods the way the kubelet's PodResources API does
(namespace/name, no uid) and its pod allocations carry no device ids, as the
watcher's do: the production shape of the join's inputs. The stream worker
and ``gpusteward sink rollups`` run as child processes on the embedded
broker; the weekly report is built from the sink's store.

What must hold: the exempt inference pod gets no idle finding (before the
join matched names it was flagged at 40 minutes as ``workload_kind=unknown``);
the idle notebooks' findings carry their kind, queue and owner; and the
report's allocated, used and idle GPU-hours per team equal what the
simulated GPUs read, within one minute of data.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.children import die_with_parent, stop_child
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.reports import build, compute
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.idle import IdleSettings
from gpusteward.sandbox.pipeline import WorkerProcess, settings_env
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.schema import AllocationEvent, Finding, HwEvent, NodeSample, QueueEvent
from gpusteward.settings import Settings
from gpusteward.topics import worker_group

pytestmark = pytest.mark.e2e

LATENESS_S = 60.0  # the worker's default rollup lateness
IDLE_PCT = ReportSettings().idle_threshold_pct
SCENARIO = Scenario.model_validate({
    "name": "kubelet-attribution", "seed": 5, "duration_s": 5400, "sample_interval_s": 30,
    "acceleration": 600, "cluster_queue": "research", "attribution": "kubelet",
    "nodes": [{"prefix": "a100", "count": 2, "gpus": 4}],
    "users": ["ana", "ben"],
    "workloads": [
        # Serving that waits for traffic all run long: exempt by label.
        {"group": "serve", "count": 1, "kind": "inference", "gpus": 1,
         "labels": {"gpusteward.io/idle-exempt": "true", "team": "serving"},
         "phases": [{"util": [0, 1]}]},
        # Notebooks busy for ten minutes, then left holding their GPU.
        {"group": "nb", "count": 2, "kind": "notebook", "gpus": 1,
         "labels": {"team": "research"},
         "phases": [{"for_s": [600, 600], "util": [40, 80]}, {"util": [0, 2]}]},
        # Training that ends half-way; its GPUs then stay free.
        {"group": "train", "count": 1, "kind": "batch", "gpus": 2, "arrive_s": [300, 300],
         "duration_s": [2400, 2400], "labels": {"team": "vision"},
         "phases": [{"util": [60, 95]}]},
    ],
})


class Recording:
    """Publishes to Kafka and keeps every sample: the simulated GPUs' readings."""

    def __init__(self, inner: KafkaPublisher) -> None:
        self.inner = inner
        self.samples: list[NodeSample] = []

    async def sample(self, sample: NodeSample) -> None:
        self.samples.append(sample)
        await self.inner.sample(sample)

    async def hw_event(self, event: HwEvent) -> None:
        await self.inner.hw_event(event)

    async def allocation(self, event: AllocationEvent) -> None:
        await self.inner.allocation(event)

    async def queue(self, event: QueueEvent) -> None:
        await self.inner.queue(event)

    async def flush(self) -> None:
        await self.inner.flush()


@dataclass
class Run:
    truth: GroundTruth
    samples: list[NodeSample]
    findings: list[Finding]
    report: dict


def _sink(settings: Settings, store: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **settings_env(settings),
           "GPUSTEWARD_REPORT__ROLLUP_DIR": str(store),
           # Write (and commit) every second, so the test sees the sink caught up.
           "GPUSTEWARD_REPORT__FLUSH_INTERVAL_S": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "gpusteward.cli", "sink", "rollups"],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent)


async def _run(broker: EmbeddedBroker, work: Path, scenario: Scenario = SCENARIO,
               prefix: str = "e2e-identity") -> Run:
    """``scenario`` through the worker and the rollup sink, and the report of its week."""
    settings = broker.settings().model_copy(update={"topic_prefix": prefix})
    await kafka.ensure_topics(settings)
    cluster = SimulatedCluster(scenario)
    publisher = Recording(KafkaPublisher(settings))
    await publisher.inner.start()
    store = work / "rollups"
    worker = WorkerProcess(settings, work / "worker.log")
    worker.start()
    sink = _sink(settings, store, work / "sink.log")
    try:
        # The world is paced, a live cluster the worker already watches (as test_fleet's
        # run_scenario): a worker on a backlog is tests/streams/test_lead_partitions.py's
        # subject (once, before the worker's samples waited for their allocations, one
        # started with this world judged an hour of its samples before its allocations).
        await asyncio.to_thread(worker.wait_ready)
        truth = await cluster.run(publisher)
        node_topics = [t.name(settings) for t in
                       (topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS)]
        await kafka.wait_consumed(settings, worker_group(settings), node_topics, timeout_s=120)
        await kafka.wait_consumed(settings, f"{settings.topic_prefix}-rollup-sink",
                                  [topics.ROLLUPS.name(settings)], timeout_s=60)
        assert worker.alive and sink.poll() is None
    finally:
        stop_child(sink, 30)
        worker.stop()
        await publisher.inner.stop()
    assert sink.returncode == 0, (work / "sink.log").read_text()[-2000:]
    decode = msgspec.json.Decoder(Finding).decode
    findings = [decode(r.value) for r in
                await kafka.read_all(settings, topics.FINDINGS.name(settings))]
    week = compute.week_of(scenario.start_ts)
    report = build.build(store, week, ReportSettings()).data
    return Run(truth, publisher.samples, findings, report)


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("identity")))


def test_samples_carry_no_uid_and_allocations_no_device_ids(run: Run) -> None:
    """The control: the join had only names to go by."""
    attributed = [d.pod for s in run.samples for d in s.devices if d.pod is not None]
    assert attributed and all(pod.uid is None for pod in attributed)


def test_exempt_inference_pod_gets_no_idle_finding(run: Run) -> None:
    idle = [f for f in run.findings if f.kind == "idle_holder"]
    assert not [f for f in idle if f.subject.pod and f.subject.pod.name.startswith("serve-")]
    # It was idle the whole run: only its exemption and kind keep it quiet.
    (serve,) = [p for p in run.truth.pods if p.kind == "inference"]
    assert serve.idle and run.truth.end_ts - serve.started_at > 40 * 60


def test_idle_notebooks_are_found_with_kind_queue_and_owner(run: Run) -> None:
    firing = [f for f in run.findings if f.kind == "idle_holder" and f.state == "firing"]
    notebooks = {f"{p.namespace}/{p.pod}" for p in run.truth.pods if p.kind == "notebook"}
    found = {f"{f.subject.pod.namespace}/{f.subject.pod.name}": f for f in firing
             if f.subject.pod}
    assert set(found) == notebooks
    window = IdleSettings().effective("notebook")
    for name, finding in found.items():
        assert finding.labels["workload_kind"] == "notebook"
        assert finding.labels["queue"] == "research"
        assert finding.labels["owner"] == f"Notebook/{name.split('/')[1]}"
        assert finding.subject.pod is not None and finding.subject.pod.uid  # the watcher's
        (pod,) = [p for p in run.truth.pods if f"{p.namespace}/{p.pod}" == name]
        # Idle from the end of its busy phase (also the end of its grace).
        assert finding.ts - (pod.started_at + 600) == pytest.approx(window.window_s, abs=30)


def _truth_by_team(run: Run) -> dict[str, dict[str, float]]:
    """Per team, GPU-hours from the simulated readings, over the minutes the worker could
    close (a minute closes one lateness after its end, so the last ones stay open)."""
    teams = {f"{p.namespace}/{p.pod}": team for p in run.truth.pods
             for team in [next(w.labels["team"] for w in SCENARIO.workloads
                               if p.pod.startswith(w.group + "-"))]}
    last = max(s.ts for s in run.samples)
    minutes: dict[tuple[str, float], tuple[list[float], str | None]] = {}
    for sample in run.samples:
        minute = sample.ts - sample.ts % 60
        if minute + 60 + LATENESS_S > last:
            continue
        for device in sample.devices:
            utils, holder = minutes.setdefault((device.uuid, minute), ([], None))
            assert device.util_pct is not None
            utils.append(device.util_pct)
            if device.pod is not None:
                holder = teams[f"{device.pod.namespace}/{device.pod.name}"]
            minutes[(device.uuid, minute)] = (utils, holder)
    out: dict[str, dict[str, float]] = {}
    for utils, team in minutes.values():
        if team is None:
            continue
        hours = out.setdefault(team, {"allocated": 0.0, "used": 0.0, "idle": 0.0})
        hours["allocated"] += 1 / 60
        hours["used"] += sum(utils) / len(utils) / 100 / 60
        hours["idle"] += (1 / 60) if max(utils) < IDLE_PCT else 0.0
    return out


def test_report_gpu_hours_per_team_equal_the_simulated_readings(run: Run) -> None:
    expected = _truth_by_team(run)
    assert set(expected) == {"serving", "research", "vision"}
    got = {t["team"]: {"allocated": t["allocated_gpu_hours"], "used": t["used_gpu_hours"],
                       "idle": t["idle_gpu_hours"]} for t in run.report["teams"]}
    assert set(got) == set(expected)
    one_minute = 1 / 60
    for team, hours in expected.items():
        for measure, value in hours.items():
            assert got[team][measure] == pytest.approx(value, abs=one_minute), (team, measure)
    # Not vacuous: hours of each kind were there to count.
    assert expected["research"]["idle"] > 1 and expected["vision"]["used"] > 0.5
