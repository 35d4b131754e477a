"""``gpusteward demo``, checked as the demo checks itself.

The demo's own run (``demo._run``: the processes of deploy/overlays/local —
worker, alert sink, executor on the Kubernetes API — against the simulated
world read by the production NVML collectors and watcher) on the session
broker, as fast as it goes; its summary must match the simulator's ground
truth, which is what makes ``gpusteward demo`` exit 0. What reached the
allocations and queue topics came through the watcher (node labels, pod
queue events), and the executor's cordon reached the simulated cluster
through the API. The overlay's rollup, findings and results sinks run beside
them, and the report CronJob's own command (the day runs in the last ISO
week) then names the idle holders the GPUs showed, in order of idle
GPU-hours, "reclaimed" exactly for the notebooks the executor stopped. A
cancelled run (what Ctrl-C does to ``asyncio.run``) must leave no collector,
watcher thread, API double or deployed process behind.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console

from gpusteward import kafka, topics
from gpusteward.reports import compute
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox import demo, deployment
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import AllocationEvent, NodeInventory, NodeSample, QueueEvent
from gpusteward.settings import Settings
from tests.e2e import readings

pytestmark = pytest.mark.e2e


WALL_S = 30.0
"""Six simulated hours in this many wall seconds: paced, so that what the deployed executor
does (notices, reclaims) reaches the simulated cluster while the day still runs."""


SINKS = ["rollup-sink", "findings-sink", "results-sink"]
"""The overlay's sinks the report reads, started beside the demo's processes."""


def _cluster() -> SimulatedCluster:
    scenario = scenarios.load("eight-a100")
    # The report CronJob reports on the last ISO week: the day runs on its Wednesday.
    last_week = compute.week_of(time.time() - 7 * 86400)
    return SimulatedCluster(scenario.model_copy(
        update={"acceleration": scenario.duration_s / WALL_S,
                "start_ts": last_week.start + 2 * 86400}))


async def _topic(settings: Settings, spec: topics.TopicSpec, kind: Any) -> list:
    records = await kafka.read_all(settings, spec.name(settings))
    return [msgspec.json.decode(r.value or b"", type=kind) for r in records]


@pytest.mark.timeout(300)
def test_demo_summary_matches_ground_truth(settings: Settings, tmp_path: Path) -> None:
    cluster = _cluster()
    console = Console(record=True, width=120)
    # The sinks write (and commit) every second, so the run drains without waiting 5 min.
    env = {"GPUSTEWARD_REPORT__FLUSH_INTERVAL_S": "1"}

    async def main() -> tuple[list[AllocationEvent], list[QueueEvent], list[NodeSample]]:
        truth, state = await demo._run(settings, cluster, console, False, tmp_path,
                                       [*demo.DEPLOYED, *SINKS], env)
        baseline = await demo.unattended(cluster)
        assert demo.summarize(console, truth, state, baseline), console.export_text()[-3000:]
        # The whole story: idle notebooks told, then stopped through the API, their GPUs
        # going to waiting pods, so the queue waits less than the same day unattended.
        reclaimed = {f"{r.namespace}/{r.pod}" for r in truth.reclaims}
        assert reclaimed and reclaimed <= set(truth.notified)
        assert sum(r.gpu_hours_given_back for r in truth.reclaims) > 0
        assert demo.QueueWait.of(truth).mean_min < demo.QueueWait.of(baseline).mean_min
        # Each reclaimed notebook's alert resolves as the pod letting its GPU go (the job that
        # got the GPU is busy on it), not as the notebook "using the GPU again".
        for name in reclaimed:
            namespace, _, pod = name.partition("/")
            closed = [f.summary for f in state.findings
                      if f.kind == "idle_holder" and f.state == "resolved" and f.subject.pod
                      and (f.subject.pod.namespace, f.subject.pod.name) == (namespace, pod)]
            assert closed and all(s.endswith("the pod released the GPU") for s in closed), (
                name, closed)
        return (await _topic(settings, topics.ALLOCATIONS, AllocationEvent),
                await _topic(settings, topics.QUEUE, QueueEvent),
                await _topic(settings, topics.SAMPLES, NodeSample))

    allocations, queue, samples = asyncio.run(main())
    inventories = [e for e in allocations if isinstance(e, NodeInventory)]
    assert inventories and queue
    truth = cluster.finish_truth()
    faulty = {fault.node for fault in truth.faults}
    assert faulty, "the scenario injects a faulty GPU"
    # The cordon the executor wrote into the API reached the cluster and the watcher.
    assert {e.node for e in inventories if e.unschedulable} == faulty
    assert all("nvidia.com/gpu.count" in e.labels for e in inventories)
    assert all(q.kind == "pod" for q in queue)
    # The console wraps long lines (a longer list of reclaimed notebooks moves the break).
    text = " ".join(console.export_text().split())
    assert "queue wait, with gpusteward acting" in text and "GPU-hours given back" in text

    # The report CronJob's command over the stores the deployed sinks wrote.
    manifests = deployment.Manifests.from_overlay(demo.overlay_path())
    (job,) = deployment.start(manifests, ["report"], demo.local_for(settings, tmp_path, env))
    assert job.wait(180) == 0, job.log_tail()
    report = json.loads((job.launch.mounts["/reports"] / "report.json").read_text())
    _check_idle_holders(report["idle_holders"], truth, samples)


def _idle_gpu_hours(truth: GroundTruth, samples: list[NodeSample]) -> dict[str, float]:
    """Per pod, the GPU-hours of closed minutes its GPU read below the idle threshold."""
    threshold = ReportSettings().idle_threshold_pct
    hours: dict[str, float] = {}
    for utils, holder in readings.held_minutes(truth, samples).values():
        if holder is not None and max(utils) < threshold:
            name = f"{holder.namespace}/{holder.pod}"
            hours[name] = hours.get(name, 0.0) + 1 / 60
    return hours


def _check_idle_holders(holders: list[dict[str, Any]], truth: GroundTruth,
                        samples: list[NodeSample]) -> None:
    """Named as the GPUs showed, in order of idle GPU-hours, reclaimed as the cluster saw."""
    minute = 1 / 60 + 1e-9  # a holder's minute at the edge of a reclaim may fall either way
    expected = _idle_gpu_hours(truth, samples)
    injected = {f"{p.namespace}/{p.pod}" for p in truth.idle_periods}
    named = [f"{h['namespace']}/{h['pod']}" for h in holders]
    # Every injected idle holder and nobody else; fewer than the table shows.
    assert set(expected) == injected and len(injected) < ReportSettings().idle_holders_shown
    assert len(named) == len(set(named)) and set(named) == injected, (named, sorted(injected))
    for holder, name in zip(holders, named, strict=True):
        assert holder["idle_gpu_hours"] == pytest.approx(expected[name], abs=minute), name
    # Biggest first, as the GPUs read them (a pair within two minutes may swap).
    for a, b in itertools.pairwise(named):
        assert expected[a] >= expected[b] - 2 * minute, (a, b, expected)
    # "reclaimed" exactly for the pods whose GPUs the cluster got back.
    reclaimed = {f"{r.namespace}/{r.pod}" for r in truth.reclaims}
    assert reclaimed
    assert {n for h, n in zip(holders, named, strict=True)
            if h["status"] == "reclaimed"} == reclaimed, holders
    assert all(h["reclaim_outcome"] == "executed" for h, n in zip(holders, named, strict=True)
               if n in reclaimed)


def _world_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.is_alive() and (t.name.startswith("reflector-") or t.name == "kube-api-double")]


@pytest.mark.timeout(120)
def test_interrupted_demo_stops_everything(settings: Settings, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[deployment.Process] = []
    original = deployment.Process.start

    def remember(self: deployment.Process) -> deployment.Process:
        started.append(self)
        return original(self)

    monkeypatch.setattr(deployment.Process, "start", remember)
    scenario = scenarios.load("eight-a100")
    cluster = SimulatedCluster(scenario.model_copy(update={"acceleration": 360.0}))
    seen_running: list[str] = []
    stopping_s: list[float] = []

    async def main() -> None:
        run = asyncio.create_task(demo._run(settings, cluster, Console(quiet=True), False,
                                            tmp_path))
        # Interrupt in the middle of the scenario, the world and the processes busy.
        deadline = time.monotonic() + 60
        while cluster.now < cluster.start + 1200 and not run.done():
            assert time.monotonic() < deadline, "the demo did not get going"
            await asyncio.sleep(0.1)
        seen_running.extend(_world_threads())
        run.cancel()  # what asyncio.run does to its main task on the first Ctrl-C
        cancelled = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await run  # not a normal return: it was stopped in the middle
        stopping_s.append(time.monotonic() - cancelled)

    asyncio.run(main())
    assert stopping_s[0] < 20, f"stopping took {stopping_s[0]:.1f} s"
    assert "kube-api-double" in seen_running and any(
        name.startswith("reflector-") for name in seen_running)
    assert _world_threads() == []
    assert {p.launch.component for p in started} == set(demo.DEPLOYED)
    assert not [p for p in started if p.alive]
