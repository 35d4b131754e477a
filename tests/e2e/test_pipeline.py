"""The whole loop on the embedded broker, checked against the simulator's ground truth.

The simulator publishes the ``eight-a100`` scenario; the real stream worker
runs as a child process; the remediation executor runs in-process against
the simulated cluster. What the pipeline finds and does is compared with
what the simulator injected.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.rules.idle import IdleSettings
from gpusteward.sandbox.backend import SimulatorBackend
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import Action, ActionResult, DeadLetter, Finding
from gpusteward.settings import Settings
from gpusteward.topics import worker_group

pytestmark = pytest.mark.e2e

IDLE = IdleSettings()
NODE_KINDS = {"idle_holder", "ecc_dbe", "idle_blocking_demand"}
"""Findings about a pod's own use of its device (demand-aware reclaim names idle holders)."""
FLEET_KINDS = {"fragmentation", "stranded_capacity", "queue_wait_slo", "queue_p95_slo",
               "queue_projected_breach", "spot_interruption", "queue_start_eta"}
NODE_TOPICS = (topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS)


@dataclass
class Run:
    truth: GroundTruth
    findings: list[Finding]
    actions: list[Action]
    results: list[ActionResult]
    deadletters: list[DeadLetter]
    worker_alive: bool


async def _read(settings: Settings, spec: topics.TopicSpec, kind: type) -> list:
    decode = msgspec.json.Decoder(kind).decode  # type: ignore[var-annotated]
    return [decode(r.value) for r in await kafka.read_all(settings, spec.name(settings))]


async def run_pipeline(settings: Settings, log_dir: Path, *, acceleration: float,
                       kill_after_cordon: bool = False, poison: bytes | None = None) -> Run:
    await kafka.ensure_topics(settings)
    spec = scenarios.load("eight-a100").model_copy(update={"acceleration": acceleration})
    cluster = SimulatedCluster(spec)
    cordon_seen = asyncio.Event()

    def on_result(action: Action, result: ActionResult) -> None:
        if action.verb == "cordon":
            cordon_seen.set()

    # The simulation runs hours a minute, or as fast as it can: no clock the executor keeps
    # tells an action's age in its event time, so the time guards are off, as in the demo's
    # overlay (deploy/overlays/local).
    untimed = RemediationSettings(max_action_age_s=None, min_notice_s=None)
    executor = Executor(settings, SimulatorBackend(cluster), execute=True, on_result=on_result,
                        remediation=untimed)
    stop = asyncio.Event()
    executing = asyncio.create_task(executor.run(stop))
    publisher = KafkaPublisher(settings)
    await publisher.start()
    worker = WorkerProcess(settings, log_dir / "worker.log", loglevel="info")
    worker.start()
    try:
        if poison is not None:
            producer = kafka.producer(settings)
            await producer.start()
            await producer.send_and_wait(topics.SAMPLES.name(settings), poison, key=b"a100-1")
            await producer.stop()
        simulating = asyncio.create_task(cluster.run(publisher))
        if kill_after_cordon:
            await asyncio.wait_for(cordon_seen.wait(), timeout=120)
            worker.kill()
            worker.start()
        truth = await simulating
        names = [t.name(settings) for t in NODE_TOPICS]
        await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=180)
        await kafka.wait_consumed(settings, executor.group_id, [topics.ACTIONS.name(settings)])
        alive = worker.alive
    finally:
        worker.stop()
        stop.set()
        await executing
        await publisher.stop()
    return Run(
        truth=truth,
        findings=await _read(settings, topics.FINDINGS, Finding),
        actions=await _read(settings, topics.ACTIONS, Action),
        results=await _read(settings, topics.ACTION_RESULTS, ActionResult),
        deadletters=await _read(settings, topics.DEADLETTER, DeadLetter),
        worker_alive=alive,
    )


def _fresh(broker: EmbeddedBroker, name: str) -> Settings:
    return broker.settings().model_copy(update={"topic_prefix": name})


@pytest.fixture(scope="module")
def full_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    settings = _fresh(broker, "e2e-full")
    log_dir = tmp_path_factory.mktemp("full")
    return asyncio.run(run_pipeline(settings, log_dir, acceleration=0.0,
                                    poison=b'{"ts": "not a number", "node": 7}'))


def _expected_idle(truth: GroundTruth) -> dict[tuple[str, str], float]:
    """(pod, device) -> the event time from which idleness counts, for every holder that
    stayed idle for the whole window before the scenario or the pod ended."""
    expected: dict[tuple[str, str], float] = {}
    for period in truth.idle_periods:
        counted_from = max(period.start, period.pod_started_at + IDLE.grace_s)
        if period.end - counted_from >= IDLE.window_s + truth.sample_interval_s:
            key = (f"{period.namespace}/{period.pod}", period.device)
            expected.setdefault(key, counted_from)
    return expected


def _idle_firing(run: Run) -> dict[tuple[str, str], list[Finding]]:
    found: dict[tuple[str, str], list[Finding]] = {}
    for f in run.findings:
        if f.kind == "idle_holder" and f.state == "firing":
            assert f.subject.pod and f.subject.device
            key = (f"{f.subject.pod.namespace}/{f.subject.pod.name}", f.subject.device)
            found.setdefault(key, []).append(f)
    return found


def test_every_idle_holder_found_within_one_sample_interval(full_run: Run) -> None:
    expected = _expected_idle(full_run.truth)
    found = _idle_firing(full_run)
    assert expected, "the scenario injects idle notebooks"
    assert set(found) == set(expected)
    interval = full_run.truth.sample_interval_s
    for key, counted_from in expected.items():
        first = min(found[key], key=lambda f: f.ts)
        assert counted_from <= first.starts_at <= counted_from + interval, key
        assert first.ts <= counted_from + IDLE.window_s + interval, key
        assert first.evidence is not None
        assert first.evidence.window_end - first.evidence.window_start >= IDLE.window_s


def test_no_finding_on_busy_pods(full_run: Run) -> None:
    idle_pods = {pod for pod, _ in _expected_idle(full_run.truth)}
    busy = {f"{p.namespace}/{p.pod}" for p in full_run.truth.pods} - idle_pods
    # Per-node families only: the queue rules rightly name busy pods that waited past
    # their queue's SLO before they started (tests/e2e/test_fleet.py checks those).
    flagged = {f"{f.subject.pod.namespace}/{f.subject.pod.name}"
               for f in full_run.findings if f.subject.pod and f.kind in NODE_KINDS}
    assert busy, "the scenario has busy pods"
    assert not flagged & busy
    kinds = Counter(f.kind for f in full_run.findings)
    assert set(kinds) <= NODE_KINDS | FLEET_KINDS


def test_dbe_gpu_gets_one_finding_and_one_cordon(full_run: Run) -> None:
    (fault,) = full_run.truth.faults
    dbe = [f for f in full_run.findings if f.kind == "ecc_dbe" and f.state == "firing"]
    assert {f.id for f in dbe} == {dbe[0].id}
    assert dbe[0].subject.node == fault.node and dbe[0].subject.device == fault.device
    executed = [r for r in full_run.results if r.verb == "cordon" and r.outcome == "executed"]
    assert [r.target.node for r in executed] == [fault.node]


def test_malformed_record_is_dead_lettered_and_the_worker_goes_on(full_run: Run) -> None:
    (letter,) = full_run.deadletters
    assert letter.source_topic.endswith("samples.v1")
    assert letter.value == b'{"ts": "not a number", "node": 7}'
    assert "Expected `float`" in letter.error
    assert full_run.worker_alive
    assert _idle_firing(full_run), "records after the bad one were processed"


def test_dbe_node_cordoned_once_when_worker_is_killed_and_restarted(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    settings = _fresh(broker, "e2e-restart")
    run = asyncio.run(run_pipeline(settings, tmp_path, acceleration=21600 / 25,
                                   kill_after_cordon=True))
    (fault,) = run.truth.faults
    cordons = [r for r in run.results if r.verb == "cordon"]
    executed = [r for r in cordons if r.outcome == "executed"]
    assert [r.target.node for r in executed] == [fault.node]
    assert all(r.outcome == "skipped" for r in cordons if r not in executed)
    assert [c.node for c in run.truth.cordons] == [fault.node]
    # The simulated scheduler placed nothing new on the node once it was cordoned.
    cordoned_at = run.truth.cordons[0].ts
    late = [p for p in run.truth.pods if p.node == fault.node and p.started_at > cordoned_at]
    assert late == []
    assert set(_idle_firing(run)) == set(_expected_idle(run.truth))
