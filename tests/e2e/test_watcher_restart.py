"""Objects deleted while no watcher ran are reported gone by the next watcher, end to end.

The watcher and the worker run as ``deploy/overlays/local`` declares them
(:mod:`gpusteward.sandbox.deployment`), the watcher on the API-server double. A first
watcher publishes two nodes, their pods, a pending pod and two pending Kueue workloads,
then stops (a Deployment's pod replaced, a crash). While no watcher runs, a pod on
``n1``, the node ``n2`` with its pod, the pending pod and a workload are deleted. A new
watcher starts: its lists no longer have them, and before the read-back nothing ever said
they were gone (a relist diffs against what its own process delivered): the worker kept
the pod's 4 GPUs used on ``n1`` and ``n2`` in the fleet, and the fleet agent kept the
workload waiting past its SLO, for ever.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpusteward import health, kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.kubernetes.roster import FOUND_GONE
from gpusteward.rules import queue as queue_rules
from gpusteward.sandbox import deployment
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, start, workload
from gpusteward.schema import (
    AllocationEvent,
    Finding,
    NodeInventory,
    NodeSummary,
    PodAllocation,
    QueueEvent,
)
from gpusteward.settings import Settings
from tests.e2e.records import decoded

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "overlays" / "local"


def _world() -> list[dict[str, Any]]:
    def running(name: str, node: str, gpus: int) -> dict[str, Any]:
        pod = gpu_pod(name, node=node, resources={"nvidia.com/gpu": str(gpus)},
                      owner=("Job", name))
        start(pod)
        return pod

    return [gpu_node("n1", gpus=8), gpu_node("n2", gpus=4),
            running("stays", "n1", 2), running("goes", "n1", 4), running("on-n2", "n2", 2),
            gpu_pod("waits-goes", owner=("Job", "waits-goes")),
            workload("wl-stays", queue="prod-lq"), workload("wl-goes", queue="prod-lq")]


def _deletion(event: AllocationEvent) -> bool:
    if isinstance(event, NodeInventory):
        return event.deleted
    return event.phase == "deleted"


def _metric(launch: deployment.Launch, name: str, **labels: str) -> float:
    port = launch.env[deployment.METRICS_PORT]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        page = answer.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(page)
               for sample in family.samples if sample.name == name
               and all(sample.labels.get(k) == v for k, v in labels.items()))


async def _until(what: str, check: Callable[[], Any], processes: list[deployment.Process],
                 timeout_s: float = 60.0) -> None:
    async def poll() -> None:
        deadline = time.monotonic() + timeout_s
        while not await check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.3)

    await deployment.while_alive(processes, poll())


@dataclass
class Run:
    allocations: list[AllocationEvent]
    """Everything the watchers published on the allocations topic, in order."""
    queue: list[QueueEvent]
    summaries: list[NodeSummary]
    findings: list[Finding]
    restarted_at: float
    found_gone: dict[str, float]
    """The second watcher's gpusteward_watch_found_gone_total, by resource."""


async def _run(broker: EmbeddedBroker, workdir: Path) -> Run:
    manifests = deployment.Manifests.from_overlay(OVERLAY)
    local = deployment.Local(broker.bootstrap, workdir, topic_prefix="watcher-restart",
                             kubeconfig=workdir / "kubeconfig")
    settings = manifests.launch("worker", local).settings()
    await kafka.ensure_topics(settings)

    async def published() -> tuple[list[AllocationEvent], list[QueueEvent]]:
        return (await decoded(settings, topics.ALLOCATIONS, AllocationEvent),
                await decoded(settings, topics.QUEUE, QueueEvent))

    with KubeApiServer(bookmark_interval_s=0.2) as api:
        api.load(_world())
        api.write_kubeconfig(workdir / "kubeconfig")
        worker, first = deployment.start(manifests, ["worker", "watcher"], local)
        running = [worker, first]
        second: deployment.Process | None = None
        try:
            await deployment.wait_ready(running, 90)

            async def first_published() -> bool:
                allocations, queue = await published()
                return len(allocations) >= 5 and len(queue) >= 3

            await _until("the first watcher's events", first_published, running)
            first.stop()
            running = [worker]
            # While no watcher runs.
            api.delete("Pod", "goes", "team-a")
            api.delete("Pod", "on-n2", "team-a")
            api.delete("Node", "n2")
            api.delete("Pod", "waits-goes", "team-a")
            api.delete("Workload", "wl-goes", "team-a", group="kueue.x-k8s.io")
            restarted_at = time.time()  # the watchers' clock
            launch = manifests.launch("watcher", local, instance="1")
            second = deployment.Process(launch, workdir / "watcher-1.log").start()
            running = [worker, second]

            async def gone_reported() -> bool:
                now_allocations, now_queue = await published()
                ended = [e for e in now_allocations if _deletion(e)]
                left = [e for e in now_queue if e.state == "deleted"]
                return len(ended) >= 3 and len(left) >= 2

            await _until("the deletions", gone_reported, running)
            await deployment.drain(settings, [worker])
            found = {resource: _metric(launch, "gpusteward_watch_found_gone_total",
                                       resource=resource)
                     for resource in ("pods", "nodes", "workloads")}
            assert second.alive, second.log_tail()
        finally:
            for process in (worker, first, *([second] if second else [])):
                process.stop()
    all_allocations, all_queue = await published()
    return Run(all_allocations, all_queue,
               await decoded(settings, topics.NODE_SUMMARIES, NodeSummary),
               await decoded(settings, topics.FINDINGS, Finding),
               restarted_at, found)


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("watcher-restart")))


def test_objects_deleted_while_no_watcher_ran_are_reported_gone(run: Run) -> None:
    # Read partition by partition: the second watcher's records are those stamped after it
    # started (the watchers' clock is this machine's).
    after = [e for e in run.allocations if e.ts >= run.restarted_at]
    deleted_pods = {e.pod.name: e for e in after
                    if isinstance(e, PodAllocation) and e.phase == "deleted"}
    deleted_nodes = {e.node: e for e in after if isinstance(e, NodeInventory) and e.deleted}
    # The event a watched DELETE sends: the pod's last allocation (its GPUs, its node),
    # stamped when the new watcher found it gone; never one for what still exists.
    assert set(deleted_pods) == {"goes", "on-n2"}
    assert (deleted_pods["goes"].node, deleted_pods["goes"].gpus) == ("n1", 4)
    assert set(deleted_nodes) == {"n2"}
    assert deleted_nodes["n2"].gpu_count == 4
    assert all(e.ts <= run.restarted_at + 60 for e in deleted_pods.values())
    assert all(e.ts <= run.restarted_at + 60 for e in deleted_nodes.values())
    assert not [e for e in run.allocations if e.ts < run.restarted_at and _deletion(e)]
    left = {e.name: e for e in run.queue if e.state == "deleted"}
    assert set(left) == {"wl-goes", "waits-goes"}
    assert {e.kind for e in left.values()} == {"workload", "pod"}
    assert all(e.reason == FOUND_GONE and e.ts >= run.restarted_at for e in left.values())
    assert run.found_gone == {"pods": 3, "nodes": 1, "workloads": 1}


def test_the_worker_frees_the_gpus_and_the_fleet_agent_ends_the_wait(run: Run) -> None:
    n1 = [s for s in run.summaries if s.node == "n1"]
    assert n1[-1].gpus_free == 6  # 8 less the 2 of the pod that stays
    assert [s for s in n1 if s.gpus_free == 2]  # before: the deleted pod's 4 held too
    n2 = [s for s in run.summaries if s.node == "n2"]
    assert n2[-1].deleted and n2[-1].gpus_total == 0
    ends = {f.subject.pod.name: f.state for f in run.findings
            if f.kind == queue_rules.WAIT_KIND and f.subject.pod is not None}
    opened = {f.subject.pod.name for f in run.findings if f.kind == queue_rules.WAIT_KIND
              and f.state == "firing" and f.subject.pod is not None}
    # Both deleted waits had breached their SLO (created a week before); their breaches
    # are resolved. The workload still waiting is never said to have left.
    assert opened >= {"wl-goes", "waits-goes"}
    assert ends["wl-goes"] == ends["waits-goes"] == "resolved"
    assert ends.get("wl-stays", "firing") == "firing"


async def _unread(broker: EmbeddedBroker, workdir: Path) -> tuple[dict[str, float], bool,
                                                                 list[AllocationEvent]]:
    """A watcher whose read-back cannot finish (its broker too slow for the time it is
    given): it logs and counts that, and watches and publishes as before."""
    manifests = deployment.Manifests.from_overlay(OVERLAY)
    local = deployment.Local(broker.bootstrap, workdir, topic_prefix="watcher-unread",
                             kubeconfig=workdir / "kubeconfig", extra_env={
                                 "GPUSTEWARD_KUBE__READBACK_TIMEOUT_S": "0.001"})
    settings: Settings = manifests.launch("watcher", local).settings()
    with KubeApiServer(bookmark_interval_s=0.2) as api:
        api.load([gpu_node("n1", gpus=8)])
        api.write_kubeconfig(workdir / "kubeconfig")
        (watcher,) = deployment.start(manifests, ["watcher"], local)
        try:
            await deployment.wait_ready([watcher], 60)
            launch = watcher.launch

            async def counted() -> bool:
                return _metric(launch, "gpusteward_watch_readback_failures_total") > 0

            await _until("the read-back failure", counted, [watcher])
            pod = gpu_pod("later", node="n1", owner=("Job", "later"))
            start(pod)
            api.create(pod)

            async def published() -> bool:
                return any(isinstance(e, PodAllocation) and e.pod.name == "later" for e in
                           await decoded(settings, topics.ALLOCATIONS, AllocationEvent))

            await _until("the pod's allocation", published, [watcher])
            metrics = {name: _metric(launch, name) for name in (
                "gpusteward_watch_readback_failures_total", "gpusteward_watch_readback_objects",
                "gpusteward_watch_found_gone_total")}
            metrics["timeouts"] = _metric(launch, "gpusteward_watch_readback_failures_total",
                                          reason="TimeoutError")
            ready = health.probe(int(launch.env[deployment.HEALTH_PORT])) == 200
            assert watcher.alive, watcher.log_tail()
            log = watcher.log_path.read_text()
        finally:
            watcher.stop()
    assert "reading back what the watcher published failed" in log
    return metrics, ready, await decoded(settings, topics.ALLOCATIONS, AllocationEvent)


def test_a_read_back_that_fails_leaves_the_watcher_watching(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    metrics, ready, published = asyncio.run(_unread(broker, tmp_path))
    assert metrics == {"gpusteward_watch_readback_failures_total": 1,
                       "timeouts": 1, "gpusteward_watch_readback_objects": -1,
                       "gpusteward_watch_found_gone_total": 0}
    assert ready
    assert {e.node for e in published if isinstance(e, NodeInventory)} == {"n1"}
