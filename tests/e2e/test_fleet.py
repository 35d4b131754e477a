"""The fleet families end to end on the embedded broker, against the simulator's truth.

Each scenario is published by the simulator as fast as it goes; a real
worker process (the node join plus the fleet agents) consumes it; then the
findings and actions topics are read whole and compared with what the
simulator did: every expected finding present, nothing else of the family.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import fragmentation as frag
from gpusteward.rules import queue as queue_rules
from gpusteward.rules import spot as spot_rules
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import Action, Finding, NodeSummary
from gpusteward.settings import Settings
from gpusteward.topics import worker_group

pytestmark = pytest.mark.e2e

QUEUE = queue_rules.QueueSloSettings()


@dataclass
class Run:
    truth: GroundTruth
    findings: list[Finding]
    actions: list[Action]
    summaries: list[NodeSummary]


async def _read(settings: Settings, spec: topics.TopicSpec, kind: type) -> list:
    decode = msgspec.json.Decoder(kind).decode  # type: ignore[var-annotated]
    return [decode(r.value) for r in await kafka.read_all(settings, spec.name(settings))]


async def run_scenario(settings: Settings, name: str, log: Path, *,
                       acceleration: float = 0.0, crash_after_s: float | None = None) -> Run:
    """Run scenario ``name`` through a fleet worker; with ``crash_after_s``, SIGKILL the
    worker that many wall seconds in and start a fresh one, which recovers from the
    changelogs and the committed offsets."""
    await kafka.ensure_topics(settings)
    spec = scenarios.load(name).model_copy(update={"acceleration": acceleration})
    cluster = SimulatedCluster(spec)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    worker = WorkerProcess(settings, log)
    worker.start()
    try:
        # A paced run is a live cluster the worker already watches: started before it is
        # ready, a slow host's worker misses hours of event time (the queue's early waits).
        await asyncio.to_thread(worker.wait_ready)
        simulating = asyncio.create_task(cluster.run(publisher))
        if crash_after_s is not None:
            await asyncio.sleep(crash_after_s)
            worker.kill()
            worker.start()
        truth = await simulating
        group = worker_group(settings)
        node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.ALLOCATIONS)]
        await kafka.wait_consumed(settings, group, node_topics, timeout_s=180)
        fleet_topics = [t.name(settings) for t in (topics.NODE_SUMMARIES, topics.QUEUE)]
        await kafka.wait_consumed(settings, group, fleet_topics, timeout_s=120)
        assert worker.alive, f"the worker died; its log is {log}"
    finally:
        worker.stop()
        await publisher.stop()
    return Run(truth=truth, findings=await _read(settings, topics.FINDINGS, Finding),
               actions=await _read(settings, topics.ACTIONS, Action),
               summaries=await _read(settings, topics.NODE_SUMMARIES, NodeSummary))


def _fresh(broker: EmbeddedBroker, name: str) -> Settings:
    return broker.settings().model_copy(update={"topic_prefix": name})


@pytest.fixture(scope="module")
def spot_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    log = tmp_path_factory.mktemp("spot") / "worker.log"
    return asyncio.run(run_scenario(_fresh(broker, "e2e-spot"), "spot-batch", log))


@pytest.fixture(scope="module")
def queue_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    log = tmp_path_factory.mktemp("queue") / "worker.log"
    return asyncio.run(run_scenario(_fresh(broker, "e2e-queue"), "queue-pressure", log))


@pytest.fixture(scope="module")
def mig_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    log = tmp_path_factory.mktemp("mig") / "worker.log"
    return asyncio.run(run_scenario(_fresh(broker, "e2e-mig"), "mig-inference", log))


def _firing(run: Run, kind: str) -> list[Finding]:
    return [f for f in run.findings if f.kind == kind and f.state == "firing"]


def test_each_reclaimed_spot_node_gets_one_finding(spot_run: Run) -> None:
    interruptions = spot_run.truth.interruptions
    assert len(interruptions) == 2
    firing = _firing(spot_run, spot_rules.KIND)
    assert sorted(f.subject.node or "" for f in firing) == sorted(i.node for i in interruptions)
    assert len({f.id for f in firing}) == len(firing)
    for record in interruptions:
        (finding,) = [f for f in firing if f.subject.node == record.node]
        assert finding.starts_at == record.ts
        assert finding.labels["taint"] == record.taint
        assert record.reclaimed_at is not None and finding.ts < record.reclaimed_at


def test_restartable_pods_requeued_before_the_node_goes_and_nothing_else(spot_run: Run) -> None:
    expected = {(i.node, pod) for i in spot_run.truth.interruptions
                for pod, owner in i.pods.items() if owner == "Job"}
    assert expected, "the scenario has batch jobs on the reclaimed nodes"
    assert any(owner == "Notebook" for i in spot_run.truth.interruptions
               for owner in i.pods.values()), "and a notebook, which must not be requeued"
    requeues = [a for a in spot_run.actions if a.verb == "requeue"]
    got = {(a.target.node, f"{a.target.pod.namespace}/{a.target.pod.name}")
           for a in requeues if a.target.pod}
    assert got == expected
    assert len({a.idempotency_key for a in requeues}) == len(expected)
    reclaimed = {i.node: i.reclaimed_at for i in spot_run.truth.interruptions}
    for action in requeues:
        assert action.target.node is not None
        assert action.ts < (reclaimed[action.target.node] or 0)


def test_spot_requeues_once_per_pod_across_a_worker_crash(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    # 7,200 simulated seconds in about 16 s; the crash falls between the two reclaims.
    run = asyncio.run(run_scenario(_fresh(broker, "e2e-spot-crash"), "spot-batch",
                                   tmp_path / "worker.log", acceleration=450.0,
                                   crash_after_s=6.0))
    expected = {(i.node, pod) for i in run.truth.interruptions
                for pod, owner in i.pods.items() if owner == "Job"}
    requeues = [a for a in run.actions if a.verb == "requeue"]
    got = {(a.target.node, f"{a.target.pod.namespace}/{a.target.pod.name}")
           for a in requeues if a.target.pod}
    assert got == expected
    # Redelivery may republish, but never under a new key: executors deduplicate on it.
    assert len({a.idempotency_key for a in requeues}) == len(expected)
    firing = _firing(run, spot_rules.KIND)
    assert len({f.id for f in firing}) == len(run.truth.interruptions)


def _waits(truth: GroundTruth) -> dict[str, float]:
    waits = {f"{p.namespace}/{p.pod}": p.started_at - (p.queued_at or p.started_at)
             for p in truth.pods}
    waits.update({key: truth.end_ts - since for key, since in truth.pending_since.items()})
    return waits


def test_every_workload_past_its_slo_found_once_and_no_other(queue_run: Run) -> None:
    slo = QUEUE.slo_for("prod-training")
    assert slo == 600
    waits = _waits(queue_run.truth)
    # Detection runs on the summaries' clock (a summary per node per minute at most, fleet
    # evaluation every 30 s): a wait more than two minutes past the SLO must be found, one
    # within the SLO must never be.
    must = {key for key, wait in waits.items() if wait > slo + 120}
    never = {key for key, wait in waits.items() if wait <= slo}
    assert len(must) >= 8 and never
    assert len(must) + len(never) == len(waits), "no wait falls in the ambiguous margin"
    firing = _firing(queue_run, queue_rules.WAIT_KIND)
    found = [f"{f.subject.pod.namespace}/{f.subject.pod.name}" for f in firing if f.subject.pod]
    assert sorted(found) == sorted(must)
    for finding in firing:
        assert finding.evidence is not None and finding.evidence.values["wait_s"] > slo


def test_queue_p95_breach_reported(queue_run: Run) -> None:
    (p95,) = _firing(queue_run, queue_rules.P95_KIND)
    assert p95.subject.queue == "prod-training"
    assert p95.evidence is not None
    assert 600 < p95.evidence.values["p95_wait_s"] <= max(_waits(queue_run.truth).values())


def test_unplaceable_ddp_job_is_stranded_and_nothing_else(queue_run: Run) -> None:
    firing = _firing(queue_run, frag.STRANDED_KIND)
    stranded = {f"{f.subject.pod.namespace}/{f.subject.pod.name}" for f in firing
                if f.subject.pod}
    assert stranded == set(queue_run.truth.pending_since) == {"ml-wes/ddp-wes"}
    (finding,) = firing
    assert finding.evidence is not None
    # No node has three GPUs at all: it is told as never placeable, however much is free.
    assert finding.evidence.values == {"requested_gpus_per_pod": 3, "largest_node_gpus": 2}
    assert "so it can never start as it is" in finding.summary
    # Judged from its arrival: the nodes stay in the fleet's view while the node join is
    # behind the queue (it reads hours of samples while the queue's day is read at once).
    arrived = queue_run.truth.pending_since["ml-wes/ddp-wes"]
    assert arrived <= finding.starts_at <= arrived + 120


def test_mig_demand_no_layout_offers_is_stranded_and_nothing_else(mig_run: Run) -> None:
    if not any(s.mig_free for s in mig_run.summaries):
        pytest.skip("the node join's summaries carry no mig_free yet (streams/node.py must "
                    "fill NodeSummary.mig_free from the inventory's nvidia.com/mig-* "
                    "allocatable minus the pods' MIG holdings)")
    spec = scenarios.load("mig-inference")
    offered = {p for g in spec.nodes for p in g.mig_layout}
    # Workloads are handed to users round-robin, as the simulator does.
    groups = [w for w in spec.workloads for _ in range(w.count)]
    users = [spec.users[i % len(spec.users)] for i in range(len(groups))]
    unoffered = {f"ml-{user}/{w.group}-{user}" for w, user in zip(groups, users, strict=True)
                 if set(w.mig) - offered}
    assert set(mig_run.truth.pending_since) == unoffered == {"ml-svc-a/rerank-svc-a"}
    firing = _firing(mig_run, frag.STRANDED_KIND)
    assert {f"{f.subject.pod.namespace}/{f.subject.pod.name}" for f in firing
            if f.subject.pod} == unoffered
    (finding,) = firing
    assert finding.evidence is not None
    # No node's layout offers the profile at all: told as never placeable until a layout
    # changes, with the slices free meanwhile for the advice.
    values = finding.evidence.values
    assert (values["requested_mig_devices_per_pod"], values["offered_mig_2g.20gb"]) == (1, 0)
    assert sum(v for k, v in values.items() if k.startswith("free_mig_")) >= 1
    assert "no node's MIG layout offers it" in finding.summary
    assert finding.labels["shape"] == "1x 2g.20gb"
    arrived = mig_run.truth.pending_since["ml-svc-a/rerank-svc-a"]
    assert arrived <= finding.starts_at <= arrived + 120
    # Every other workload was placed within a tick: no wait or stranded finding names it.
    placed = {f"{p.namespace}/{p.pod}" for p in mig_run.truth.pods}
    named = {f"{f.subject.pod.namespace}/{f.subject.pod.name}" for f in mig_run.findings
             if f.subject.pod and f.kind in (frag.STRANDED_KIND, queue_rules.WAIT_KIND)}
    assert not named & placed
