"""The watcher's own metrics against the API-server double: they move with what it did.

A platform engineer reads from Prometheus whether the watcher is alive and keeping
up: events published by kind, lists by reason, watch restarts and errors, the last
time each resource was heard from, and (through the process, on the registry the
publisher shares) what reached Kafka.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpusteward.broker import free_port
from gpusteward.metrics import serve
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod
from gpusteward.schema import NodeInventory, PodAllocation, QueueEvent
from gpusteward.settings import Settings
from tests.conftest import metrics_page

from .conftest import FIXTURES, RunningWatcher, WatcherFactory, wait_until


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value; 0 for a labelled child that was never touched."""
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def published(watcher: RunningWatcher) -> dict[str, float]:
    registry = watcher.watcher.metrics.registry
    return {kind: value(registry, "gpusteward_watch_events_published_total", kind=kind)
            for kind in ("pod_allocation", "node_inventory", "queue")}


def recorded(watcher: RunningWatcher) -> dict[str, float]:
    """The events the recording publisher was handed, counted the way the metric labels them."""
    kinds = Counter("queue" if isinstance(e, QueueEvent) else
                    "node_inventory" if isinstance(e, NodeInventory) else "pod_allocation"
                    for e in watcher.events)
    assert all(isinstance(e, (QueueEvent, NodeInventory, PodAllocation)) for e in watcher.events)
    return {kind: float(kinds[kind]) for kind in ("pod_allocation", "node_inventory", "queue")}


def test_events_lists_and_watches_are_counted_and_served(
        kube_api_loaded: KubeApiServer, start_watcher: WatcherFactory) -> None:
    started = time.time()
    watcher = start_watcher()
    registry = watcher.watcher.metrics.registry
    # The fixtures' first list: 6 nodes, 6 GPU pods, 2 queued pods and 2 Kueue workloads.
    assert published(watcher) == recorded(watcher) == {
        "pod_allocation": 6, "node_inventory": 6, "queue": 4}
    for resource in ("nodes", "pods", "workloads", "localqueues"):
        assert value(registry, "gpusteward_watch_lists_total", resource=resource,
                     reason="first") == 1, resource
        heard = value(registry, "gpusteward_watch_last_event_timestamp_seconds",
                      resource=resource)
        assert started <= heard <= time.time(), resource
    wait_until(lambda: value(registry, "gpusteward_watch_requests_total", resource="pods") >= 1,
               10, "the pods watch")

    mark = len(watcher.events)
    kube_api_loaded.create(gpu_node("n-new"))
    kube_api_loaded.create(gpu_pod("p-new", node="n-new", phase="Running"))
    assert len(watcher.new_events(mark)) == 2  # settles: both are published
    assert published(watcher) == recorded(watcher) == {
        "pod_allocation": 7, "node_inventory": 7, "queue": 4}
    assert value(registry, "gpusteward_watch_backlog_deltas") == 0
    assert value(registry, "gpusteward_watch_errors_total", resource="pods",
                 reason="http_503") == 0

    server = serve(registry, 0, "127.0.0.1")
    try:
        page = metrics_page(server.port)
    finally:
        server.stop()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(page) for s in family.samples}
    assert samples[("gpusteward_watch_events_published_total",
                    (("kind", "pod_allocation"),))] == 7
    assert samples[("gpusteward_watch_lists_total",
                    (("reason", "first"), ("resource", "nodes")))] == 1
    assert samples[("gpusteward_watch_last_event_timestamp_seconds",
                    (("resource", "pods"),))] >= started
    assert ("gpusteward_watch_backlog_deltas", ()) in samples


def test_an_outage_and_a_410_count_as_errors_and_a_relist(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_node("n1"))
    kube_api.create(gpu_pod("a", node="n1", phase="Running"))
    watcher = start_watcher(resources=["nodes", "pods"], backoff_initial_s=0.05,
                            backoff_max_s=0.1)
    registry = watcher.watcher.metrics.registry
    wait_until(lambda: value(registry, "gpusteward_watch_requests_total", resource="pods") >= 1,
               10, "the pods watch")
    watches_before = value(registry, "gpusteward_watch_requests_total", resource="pods")
    mark = len(watcher.events)
    with kube_api.outage():
        wait_until(lambda: value(registry, "gpusteward_watch_errors_total", resource="pods",
                                 reason="http_503") >= 2, 10, "refused watches to count")
        heard_during = value(registry, "gpusteward_watch_last_event_timestamp_seconds",
                             resource="pods")
        kube_api.delete("Pod", "a", namespace="team-a")
        kube_api.compact()

    wait_until(lambda: value(registry, "gpusteward_watch_lists_total", resource="pods",
                             reason="gone") == 1, 10, "the relist after 410")
    watcher.settle()
    assert len(watcher.events) == mark + 1  # the deletion the relist found
    assert value(registry, "gpusteward_watch_errors_total", resource="pods",
                 reason="gone") >= 1
    assert value(registry, "gpusteward_watch_lists_total", resource="pods",
                 reason="first") == 1
    assert value(registry, "gpusteward_watch_requests_total", resource="pods") > watches_before
    assert value(registry, "gpusteward_watch_last_event_timestamp_seconds",
                 resource="pods") > heard_during
    assert published(watcher) == recorded(watcher)


def test_resyncs_are_counted_and_publish_nothing_new(
        kube_api_loaded: KubeApiServer, start_watcher: WatcherFactory) -> None:
    watcher = start_watcher(resync_period_s=0.3)
    registry = watcher.watcher.metrics.registry
    before = published(watcher)
    wait_until(lambda: value(registry, "gpusteward_watch_lists_total", resource="pods",
                             reason="resync") >= 2, 10, "resyncs")
    watcher.settle()
    assert published(watcher) == before
    assert value(registry, "gpusteward_watch_lists_total", resource="pods", reason="first") == 1


@pytest.mark.e2e
def test_the_watch_process_serves_its_and_its_publishers_metrics(
        settings: Settings, tmp_path: Path) -> None:
    """``gpusteward watch`` to Kafka serves one registry on GPUSTEWARD_METRICS__PORT: the
    watcher's families and the publisher's acknowledged records."""
    executable = Path(sys.executable).parent / "gpusteward"
    port = free_port()
    with KubeApiServer(bookmark_interval_s=0.1) as api:
        api.load_dir(FIXTURES)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        process = subprocess.Popen(
            [str(executable), "watch", "--kubeconfig", str(kubeconfig),
             "--resources", "nodes,pods", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS":
                 settings.kafka.bootstrap_servers,
                 "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
                 "GPUSTEWARD_METRICS__PORT": str(port)})
        sent = 'gpusteward_collect_records_sent_total{topic="allocations.v1"} 12.0'
        try:
            deadline = time.monotonic() + 60
            page = ""
            while sent not in page and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                page = metrics_page(port)
        finally:
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=30)
    assert sent in page, stderr.decode()[-2000:]
    assert 'gpusteward_watch_events_published_total{kind="node_inventory"} 6.0' in page
    assert 'gpusteward_watch_events_published_total{kind="pod_allocation"} 6.0' in page
    assert 'gpusteward_watch_lists_total{reason="first",resource="pods"} 1.0' in page
    assert "gpusteward_collect_delivery_failures_total 0.0" in page
