"""The Kubernetes watcher at fleet scale: 10,000 GPU pods on 1,250 nodes in the API double.

Figures:
- first sync: paged LIST of nodes and pods, translated and published (events/s);
- watch: every pod goes from bound to running, one MODIFIED each (events/s from
  the first change to the last event published; includes the double's own
  cost of writing and serving the changes, in the same process);
- relist after 410 Gone (one pod changed while disconnected): its duration,
  and the events it published (1: the unchanged 9,999 pods publish nothing);
- memory the watcher holds per pod after the first sync (tracemalloc, counting
  allocations made in collectors/kubernetes/: the reflectors' resourceVersion
  maps and the translator's last event per object; nodes included).

Events go to a publisher that only counts them, so Kafka is not measured here.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from figures import Figure

from gpusteward.collectors import kubernetes as kube
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod

NODES = 1_250
GPUS_PER_NODE = 8
PODS = NODES * GPUS_PER_NODE


class CountingPublisher:
    def __init__(self) -> None:
        self.count = 0
        self.last_at = 0.0

    async def sample(self, sample: Any) -> None:
        raise AssertionError

    async def hw_event(self, event: Any) -> None:
        raise AssertionError

    async def allocation(self, event: Any) -> None:
        self.count += 1
        self.last_at = time.perf_counter()

    async def queue(self, event: Any) -> None:
        self.count += 1
        self.last_at = time.perf_counter()

    async def flush(self) -> None:
        pass


def _fleet(api: KubeApiServer) -> None:
    api.record_requests = False
    for n in range(NODES):
        api.create(gpu_node(f"gpu-node-{n:04d}", GPUS_PER_NODE))
    for p in range(PODS):
        node = f"gpu-node-{p // GPUS_PER_NODE:04d}"
        pod = gpu_pod(f"train-{p:05d}-x7k2q", f"team-{p % 40}", node=node,
                      owner=("Job", f"train-{p:05d}"),
                      labels={"batch.kubernetes.io/job-name": f"train-{p:05d}",
                              "kueue.x-k8s.io/queue-name": "research"})
        pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True",
                                        "lastTransitionTime": "2026-11-20T10:00:00Z"}]
        api.create(pod)


class _Running:
    def __init__(self, api: KubeApiServer, kubeconfig: Path) -> None:
        settings = kube.KubeWatchSettings(kubeconfig=str(kubeconfig), resources=["nodes", "pods"],
                                          backoff_initial_s=0.05)
        self.publisher = CountingPublisher()
        self.watcher = kube.KubeWatcher(kube.api_client(settings), self.publisher, settings)
        self.loop = asyncio.new_event_loop()
        self.stop_event = asyncio.Event()
        self.thread = threading.Thread(
            target=lambda: self.loop.run_until_complete(self.watcher.run(self.stop_event)),
            daemon=True)
        self.api = api

    def start(self) -> float:
        started = time.perf_counter()
        self.thread.start()
        _wait(self.watcher.synced.is_set, 600)
        return time.perf_counter() - started

    def settled(self) -> bool:
        reflectors = self.watcher.reflectors.values()
        return all(r.resource_version == str(self.api.resource_version) for r in reflectors) \
            and sum(r.stats.deltas for r in reflectors) == self.watcher.processed

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)


def _wait(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the watcher did not catch up")
        time.sleep(0.005)


def _throughput(directory: Path) -> list[Figure]:
    with KubeApiServer(bookmark_interval_s=0.2) as api:
        _fleet(api)
        running = _Running(api, api.write_kubeconfig(directory / "kubeconfig"))
        sync_s = running.start()
        first_sync_events = running.publisher.count
        assert first_sync_events == NODES + PODS, first_sync_events

        started = time.perf_counter()
        for p in range(PODS):
            api.mutate("Pod", f"train-{p:05d}-x7k2q", _start, namespace=f"team-{p % 40}")
        _wait(running.settled, 600)
        watch_events = running.publisher.count - first_sync_events
        watch_s = running.publisher.last_at - started
        assert watch_events == PODS, watch_events

        before = running.publisher.count
        relists = running.watcher.reflectors["pods"].stats.lists
        started = time.perf_counter()
        with api.outage():
            # One change while disconnected, then history is lost: the watch must relist.
            api.patch("Pod", "train-00000-x7k2q", {"metadata": {"labels": {"touched": "1"}}},
                      namespace="team-0")
            api.compact()
        _wait(lambda: running.watcher.reflectors["pods"].stats.lists > relists, 600)
        _wait(running.settled, 600)
        relist_s = time.perf_counter() - started
        relist_events = running.publisher.count - before
        running.stop()
    return [
        Figure("first sync, 1,250 nodes + 10,000 pods", sync_s, "s"),
        Figure("first sync throughput", first_sync_events / sync_s, "events/s"),
        Figure("watch throughput (10,000 pod changes)", watch_events / watch_s, "events/s"),
        Figure("relist after 410 Gone, 10,000 pods", relist_s, "s"),
        Figure("events published by that relist (1 pod changed)", relist_events, "events"),
    ]


def _start(pod: dict[str, Any]) -> None:
    pod["status"]["phase"] = "Running"
    pod["status"]["startTime"] = "2026-11-20T10:00:05Z"


def _memory(directory: Path) -> list[Figure]:
    with KubeApiServer(bookmark_interval_s=0.5) as api:
        _fleet(api)
        kubeconfig = api.write_kubeconfig(directory / "kubeconfig")
        gc.collect()
        tracemalloc.start()
        running = _Running(api, kubeconfig)
        running.start()
        _wait(running.settled, 600)
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
        tracemalloc.stop()
        held = sum(stat.size for stat in snapshot.filter_traces(
            [tracemalloc.Filter(True, kube.__file__)]).statistics("filename"))
        running.stop()
    return [Figure("watcher memory per pod (tracemalloc)", held / PODS, "bytes")]


def run() -> list[Figure]:
    # The generated client's API module takes seconds to import; a process pays that once,
    # so it is reported on its own and kept out of the sync figures.
    started = time.perf_counter()
    from kubernetes.client import CoreV1Api, CustomObjectsApi  # noqa: F401

    imported_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        return [Figure("kubernetes client import (once per process)", imported_s, "s"),
                *_throughput(Path(tmp)), *_memory(Path(tmp))]


if __name__ == "__main__":
    for figure in run():
        print(f"{figure.name}: {figure.value:,.2f} {figure.unit}")
