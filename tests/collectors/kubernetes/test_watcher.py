"""The watcher against the API-server double: exact event streams through lifecycles and faults."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from kubernetes import client

from gpusteward.collectors.kubernetes import KubeWatchSettings
from gpusteward.collectors.kubernetes.reflector import Delta, Gone, Reflector, node_key
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import bind, gpu_node, gpu_pod, set_condition, start, workload
from gpusteward.schema import NodeInventory, PodAllocation, PodRef, QueueEvent, Taint

from .conftest import CLOCK, RunningWatcher, WatcherFactory, wait_until


def brief(event: Any) -> tuple[Any, ...]:
    """The parts of an event a stream assertion is about."""
    if isinstance(event, PodAllocation):
        return ("pod", event.node, f"{event.pod.namespace}/{event.pod.name}", event.phase,
                event.gpus, event.mig)
    if isinstance(event, NodeInventory):
        return ("node", event.node, event.unschedulable, event.mig_config, event.deleted)
    assert isinstance(event, QueueEvent)
    return ("queue", event.cluster_queue, f"{event.namespace}/{event.name}", event.state,
            event.kind)


def test_first_list_reports_fleet_as_the_gpu_operator_labels_it(
        kube_api_loaded: KubeApiServer, start_watcher: WatcherFactory) -> None:
    watcher = start_watcher()
    by_node = {e.node: e for e in watcher.events if isinstance(e, NodeInventory)}
    pods = {e.pod.name: e for e in watcher.events if isinstance(e, PodAllocation)}
    queued = [e for e in watcher.events if isinstance(e, QueueEvent)]

    assert set(by_node) == {"a100-mixed-1", "h100-single-1", "a100-spot-1", "gke-l4-spot-1",
                            "aks-t4spot-1", "cpu-1"}
    mixed = by_node["a100-mixed-1"]
    assert (mixed.mig_strategy, mixed.mig_config, mixed.mig_config_state, mixed.gpu_count) == (
        "mixed", "custom-2-balanced", "success", 6)
    assert mixed.allocatable == {"nvidia.com/gpu": 6, "nvidia.com/mig-1g.10gb": 4,
                                 "nvidia.com/mig-2g.20gb": 2, "nvidia.com/mig-3g.40gb": 2}
    assert mixed.gpu_memory_mib == 81920 and mixed.mig_capable is True and not mixed.spot
    single = by_node["h100-single-1"]
    assert (single.gpu_count, single.capacity) == (0, {"nvidia.com/gpu": 56})
    assert {n for n, e in by_node.items() if e.spot} == {"a100-spot-1", "aks-t4spot-1",
                                                          "gke-l4-spot-1"}
    assert Taint("cloud.google.com/gke-spot", "NoSchedule", "true") in by_node[
        "gke-l4-spot-1"].taints

    # The CPU-only coredns pod is not a GPU holder: nothing is published for it.
    assert set(pods) == {"train-llm-0-abcde", "pretrain-workers-0-0-xk2l9",
                         "rayjob-sweep-raycluster-7x2k-gpu-group-worker-4hf8s", "alice-nb-0",
                         "llm-api-6d9f7c8b5d-q7w2x", "render-28850400-9kq2m"}
    train = pods["train-llm-0-abcde"]
    assert train == PodAllocation(
        ts=CLOCK, node="a100-spot-1",
        pod=PodRef("team-a", "train-llm-0-abcde", "11111111-0000-0000-0000-000000000001"),
        phase="running", gpus=4, started_at=1795165200.0, owner_kind="Job",
        owner_name="train-llm", workload_kind="batch", queue="team-a-lq",
        priority_class="batch-low", labels=train.labels, annotations={"team": "llm"},
        spot_tolerant=True, images=["nvcr.io/nvidia/pytorch:25.01-py3"],
    )
    owners = {name: (e.owner_kind, e.owner_name, e.workload_kind) for name, e in pods.items()}
    assert owners == {
        "train-llm-0-abcde": ("Job", "train-llm", "batch"),
        "pretrain-workers-0-0-xk2l9": ("JobSet", "pretrain", "batch"),
        "rayjob-sweep-raycluster-7x2k-gpu-group-worker-4hf8s": ("RayJob", "rayjob-sweep",
                                                                "batch"),
        "alice-nb-0": ("Notebook", "alice-nb", "notebook"),
        "llm-api-6d9f7c8b5d-q7w2x": ("Deployment", "llm-api", "inference"),
        "render-28850400-9kq2m": ("Job", "render-28850400", "batch"),
    }
    assert pods["render-28850400-9kq2m"].phase == "finished"
    assert pods["render-28850400-9kq2m"].spot_tolerant
    assert all(e.device_ids == [] for e in pods.values())

    assert [brief(e) for e in queued] == [
        ("queue", "gpu-cq", "team-a/eval-1-qq8zt", "pending", "pod"),
        # A JobSet's pod is a gang member: the queue topic follows it even when first seen
        # bound, so the fleet agent sees every member of the gang in one place.
        ("queue", "default", "team-a/pretrain-workers-0-0-xk2l9", "admitted", "pod"),
        ("queue", "gpu-cq", "team-a/job-eval-2-3f1c2", "pending", "workload"),
        ("queue", "gpu-cq", "team-a/job-train-llm-9a8b7", "admitted", "workload"),
    ]
    member = queued[1]
    assert (member.gang, member.gang_size) == ("JobSet/pretrain", None)
    assert (pods["pretrain-workers-0-0-xk2l9"].gang, pods["train-llm-0-abcde"].gang) == (
        "JobSet/pretrain", None)
    pending_workload = queued[2]
    assert (pending_workload.gpus, pending_workload.priority, pending_workload.priority_class,
            pending_workload.reason) == (8, 100, "batch-low", "WaitingForQuota")
    # Nodes come first: pods are interpreted with their node's MIG strategy.
    first_pod = next(i for i, e in enumerate(watcher.events) if not isinstance(e, NodeInventory))
    assert all(isinstance(e, NodeInventory) for e in watcher.events[:first_pod])
    assert first_pod == 6


def test_pod_lifecycle_is_one_event_per_change_of_holding(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_node("n1"))
    watcher = start_watcher()
    mark = len(watcher.events)
    pod = kube_api.create(gpu_pod("p1", labels={"kueue.x-k8s.io/queue-name": "lq"}))

    def step(change: Any) -> None:
        kube_api.mutate("Pod", "p1", change, namespace="team-a")

    step(lambda p: bind(p, "n1"))
    step(start)
    # Status churn that does not change the holding publishes nothing.
    step(lambda p: p["status"].update(podIP="10.1.2.3"))
    step(lambda p: set_condition(p, "Ready", "True", "PodReady"))
    step(lambda p: p["status"].update(phase="Succeeded"))
    kube_api.delete("Pod", "p1", namespace="team-a")

    events = watcher.new_events(mark)
    assert [brief(e) for e in events] == [
        ("queue", "lq", "team-a/p1", "pending", "pod"),
        ("queue", "lq", "team-a/p1", "admitted", "pod"),
        ("pod", "n1", "team-a/p1", "bound", 1, {}),
        ("pod", "n1", "team-a/p1", "running", 1, {}),
        # A pod that waited is followed on the queue topic to its end (the ETAs' history).
        ("queue", "lq", "team-a/p1", "finished", "pod"),
        ("pod", "n1", "team-a/p1", "finished", 1, {}),
        ("queue", "lq", "team-a/p1", "deleted", "pod"),
        ("pod", "n1", "team-a/p1", "deleted", 1, {}),
    ]
    assert events[1].admitted_at == 1795168860.0  # PodScheduled's transition time
    assert events[3].started_at == 1795168865.0
    assert {e.pod.uid for e in events if isinstance(e, PodAllocation)} == {
        pod["metadata"]["uid"]}


def test_deletions_during_a_dropped_watch_are_resumed_not_relisted(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_node("n1"))
    for name in ("a", "b", "c"):
        kube_api.create(gpu_pod(name, node="n1", phase="Running"))
    watcher = start_watcher()
    mark = len(watcher.events)
    watches_before = kube_api.watch_count()

    with kube_api.outage():
        kube_api.delete("Pod", "a", namespace="team-a")
        kube_api.delete("Pod", "b", namespace="team-a")
        kube_api.patch("Node", "n1", {"metadata": {"labels": {"team": "llm"}}})
        kube_api.create(gpu_pod("d", node="n1", phase="Running"))

    events = watcher.new_events(mark)
    assert sorted(brief(e) for e in events) == sorted([
        ("pod", "n1", "team-a/a", "deleted", 1, {}),
        ("pod", "n1", "team-a/b", "deleted", 1, {}),
        ("node", "n1", False, None, False),
        ("pod", "n1", "team-a/d", "running", 1, {}),
    ])
    pods = watcher.watcher.reflectors["pods"]
    # History was still there: the watch resumed from its resourceVersion, no relist.
    assert pods.stats.lists == 1 and pods.stats.gone == 0
    assert kube_api.watch_count() > watches_before


@pytest.mark.parametrize("gone_as_http_status", [False, True],
                         ids=["error-event", "http-status"])
def test_410_gone_relists_and_emits_only_the_difference(
        kube_api: KubeApiServer, start_watcher: WatcherFactory,
        gone_as_http_status: bool) -> None:
    kube_api.gone_as_http_status = gone_as_http_status
    kube_api.create(gpu_node("n1"))
    kube_api.create(gpu_node("n2"))
    for name in ("keep", "gone", "grow"):
        kube_api.create(gpu_pod(name, node="n1", phase="Running"))
    watcher = start_watcher()
    mark = len(watcher.events)

    with kube_api.outage():
        kube_api.delete("Pod", "gone", namespace="team-a")
        kube_api.mutate("Pod", "grow", lambda p: p["status"].update(phase="Succeeded"),
                        namespace="team-a")
        kube_api.create(gpu_pod("new", node="n2", phase="Running"))
        kube_api.delete("Node", "n2")
        kube_api.compact()

    events = watcher.new_events(mark)
    assert sorted(brief(e) for e in events) == sorted([
        ("pod", "n1", "team-a/gone", "deleted", 1, {}),
        ("pod", "n1", "team-a/grow", "finished", 1, {}),
        ("pod", "n2", "team-a/new", "running", 1, {}),
        ("node", "n2", False, None, True),
    ])
    for name in ("pods", "nodes"):
        stats = watcher.watcher.reflectors[name].stats
        assert stats.gone >= 1 and stats.lists == 2, (name, stats)
    # The unchanged pod and node were in the relist and were not published again.
    assert watcher.watcher.reflectors["pods"].stats.duplicates_skipped >= 1


def test_watch_resumes_from_the_last_bookmark(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_pod("p", node="n1", phase="Running"))
    watcher = start_watcher(resources=["pods", "nodes"])
    for i in range(3):  # node changes advance the pods watch only through bookmarks
        kube_api.create(gpu_node(f"n{i}"))
    watcher.settle()
    bookmark_rv = watcher.watcher.reflectors["pods"].resource_version
    assert bookmark_rv == str(kube_api.resource_version)

    kube_api.drop_watches()

    def resumed() -> bool:
        return any(r.path == "/api/v1/pods" and r.query.get("watch")
                   and r.query.get("resourceVersion") == bookmark_rv
                   and r is not first_watch for r in kube_api.requests)

    first_watch = next(r for r in kube_api.requests if r.path == "/api/v1/pods"
                       and r.query.get("watch"))
    assert first_watch.query["resourceVersion"] != bookmark_rv
    wait_until(resumed, 10, "the pods watch to resume from the bookmark's resourceVersion")
    assert watcher.watcher.reflectors["pods"].stats.lists == 1


def test_errors_back_off_and_recover(kube_api: KubeApiServer,
                                     start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_node("n1"))
    watcher = start_watcher(resources=["nodes"], backoff_initial_s=0.1, backoff_max_s=0.4)
    import time

    with kube_api.outage():
        before = len(kube_api.requests)
        time.sleep(1.2)
        refused = len(kube_api.requests) - before
    # 0.1 + 0.2 + 0.4 + 0.4 ... : about 4 attempts in 1.2 s, not a hot loop.
    assert 2 <= refused <= 8, refused
    assert watcher.watcher.reflectors["nodes"].stats.errors >= 2
    kube_api.patch("Node", "n1", {"spec": {"unschedulable": True}})
    assert [brief(e) for e in watcher.new_events(1)] == [("node", "n1", True, None, False)]


def test_watches_cut_short_back_off_and_lose_nothing(kube_api: KubeApiServer,
                                                    start_watcher: WatcherFactory) -> None:
    """A proxy that ends every stream at once, or a server going down, answers each watch
    with a clean, empty 200: asking again at once would hammer the API server (client-go
    calls it a very short watch and backs off)."""
    kube_api.create(gpu_node("n1"))
    watcher = start_watcher(resources=["nodes"], backoff_initial_s=0.1, backoff_max_s=0.4)
    import time

    kube_api.end_watches_at_once = True
    before = kube_api.watch_count()
    kube_api.drop_watches()  # the watch open since the start
    time.sleep(1.2)
    cut_short = kube_api.watch_count() - before
    # 0.1 + 0.2 + 0.4 + 0.4 ... : about 4 attempts in 1.2 s, not a hot loop.
    assert 2 <= cut_short <= 8, cut_short
    kube_api.patch("Node", "n1", {"spec": {"unschedulable": True}})
    kube_api.end_watches_at_once = False
    assert [brief(e) for e in watcher.new_events(1)] == [("node", "n1", True, None, False)]


def test_periodic_resync_relists_without_publishing_duplicates(
        kube_api_loaded: KubeApiServer, start_watcher: WatcherFactory) -> None:
    watcher = start_watcher(resync_period_s=0.3)
    count = len(watcher.events)
    wait_until(lambda: watcher.watcher.reflectors["pods"].stats.lists >= 3, 10, "resyncs")
    watcher.settle()
    assert len(watcher.events) == count


def test_mig_under_mixed_and_single_strategies(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_node("mixed", labels={"nvidia.com/mig.strategy": "mixed"}, resources={
        "nvidia.com/gpu": "4", "nvidia.com/mig-1g.10gb": "7", "nvidia.com/mig-1g.10gb.me": "1",
        "nvidia.com/mig-3g.40gb": "2"}))
    kube_api.create(gpu_node("single", labels={
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb"},
        resources={"nvidia.com/gpu": "16"}))
    watcher = start_watcher()
    mark = len(watcher.events)
    kube_api.create(gpu_pod("m1", node="mixed", phase="Running", resources={
        "nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-1g.10gb.me": "1"}))
    kube_api.create(gpu_pod("m2", node="mixed", phase="Running", resources={
        "nvidia.com/mig-3g.40gb": "1", "nvidia.com/gpu": "1"}))
    kube_api.create(gpu_pod("s1", node="single", phase="Running",
                            resources={"nvidia.com/gpu": "2"}))
    assert [brief(e) for e in watcher.new_events(mark)] == [
        ("pod", "mixed", "team-a/m1", "running", 0, {"1g.10gb": 2, "1g.10gb+me": 1}),
        ("pod", "mixed", "team-a/m2", "running", 1, {"3g.40gb": 1}),
        ("pod", "single", "team-a/s1", "running", 0, {"3g.40gb": 2}),
    ]
    nodes = {e.node: e for e in watcher.events[:mark]}
    assert nodes["single"].gpu_count == 0 and nodes["mixed"].gpu_count == 4
    assert nodes["mixed"].allocatable["nvidia.com/mig-1g.10gb.me"] == 1


def test_kueue_workload_pending_admitted_evicted_requeued_finished(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                     "metadata": {"name": "team-a-lq", "namespace": "team-a"},
                     "spec": {"clusterQueue": "gpu-cq"}})
    watcher = start_watcher()
    assert watcher.watcher.kueue_version == "v1beta2"
    kube_api.create(workload("wl", gpus=4, count=2))

    def step(change: Any) -> None:
        kube_api.mutate("Workload", "wl", change, namespace="team-a", group="kueue.x-k8s.io")

    def admit(w: Any, at: str) -> None:
        w["status"]["admission"] = {"clusterQueue": "gpu-cq", "podSetAssignments": [
            {"name": "main", "flavors": {"nvidia.com/gpu": "a100"}, "count": 2}]}
        set_condition(w, "QuotaReserved", "True", "QuotaReserved", at)
        set_condition(w, "Admitted", "True", "Admitted", at)

    def evict(w: Any) -> None:
        w["status"].pop("admission")
        set_condition(w, "QuotaReserved", "False", "Pending")
        set_condition(w, "Admitted", "False", "NoReservation")
        set_condition(w, "Evicted", "True", "Preempted")
        set_condition(w, "Preempted", "True", "InClusterQueue")
        set_condition(w, "Requeued", "False", "Preempted")

    step(lambda w: admit(w, "2026-11-20T10:02:00Z"))
    step(evict)
    step(lambda w: set_condition(w, "Requeued", "True", "BackoffFinished"))
    step(lambda w: admit(w, "2026-11-20T10:09:00Z"))
    step(lambda w: set_condition(w, "Finished", "True", "Succeeded"))
    kube_api.delete("Workload", "wl", namespace="team-a", group="kueue.x-k8s.io")

    events = watcher.new_events(0)
    assert [(e.state, e.reason, e.admitted_at) for e in events] == [
        ("pending", "WaitingForQuota", None),
        ("admitted", "Admitted", 1795168920.0),
        ("evicted", "Preempted/InClusterQueue", None),
        ("requeued", "BackoffFinished", None),
        ("admitted", "Admitted", 1795169340.0),
        ("finished", "Succeeded", 1795169340.0),
        ("deleted", None, 1795169340.0),
    ]
    # Keyed by the cluster queue even before admission (through the LocalQueue).
    assert {e.cluster_queue for e in events} == {"gpu-cq"}
    assert {(e.gpus, e.queue, e.priority) for e in events} == {(8, "team-a-lq", 100)}


def test_workload_deactivated_through_the_client(
        kube_api: KubeApiServer, kubeconfig: Any, start_watcher: WatcherFactory) -> None:
    kube_api.create(workload("wl"))
    watcher = start_watcher()
    custom = client.CustomObjectsApi(watcher.watcher.client)
    custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "team-a", "workloads",
                                          "wl", {"spec": {"active": False}})
    events = watcher.new_events(0)
    assert [(e.state, e.active) for e in events] == [("pending", True), ("pending", False)]


def test_runs_without_kueue() -> None:
    with KubeApiServer(kueue=False, bookmark_interval_s=0.05) as api:
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = api.write_kubeconfig(Path(tmp) / "kubeconfig")
            api.create(gpu_node("n1"))
            api.create(gpu_pod("p", node="n1", phase="Running"))
            watcher = RunningWatcher(api, kubeconfig, KubeWatchSettings(
                kubeconfig=str(kubeconfig))).start()
            try:
                assert watcher.watcher.kueue_version is None
                # No Kueue reflector; the gang and DRA resources the double serves are
                # watched.
                assert set(watcher.watcher.reflectors) == {
                    "nodes", "pods", "resourceslices", "resourceclaimtemplates",
                    "resourceclaims",
                    *watcher.watcher.gang_versions}
                assert not any("kueue" in name for name in watcher.watcher.reflectors)
                assert [brief(e) for e in watcher.events] == [
                    ("node", "n1", False, None, False), ("pod", "n1", "team-a/p", "running", 1, {})]
            finally:
                watcher.stop()


def test_node_cordoned_and_relabelled_with_a_new_mig_config(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_node("n1", labels={"nvidia.com/mig.strategy": "mixed",
                                           "nvidia.com/mig.config": "all-disabled",
                                           "nvidia.com/mig.config.state": "success"}))
    watcher = start_watcher()
    core = client.CoreV1Api(watcher.watcher.client)
    core.patch_node("n1", {"spec": {"unschedulable": True}})  # what kubectl cordon sends
    core.patch_node("n1", {"metadata": {"labels": {"nvidia.com/mig.config": "all-3g.40gb"}}})
    kube_api.patch("Node", "n1", {"metadata": {"labels": {
        "nvidia.com/mig.config.state": "pending"}}})  # mig-manager picks it up
    kube_api.patch("Node", "n1", {"status": {"capacity": {"nvidia.com/gpu": "0",
                                                          "nvidia.com/mig-3g.40gb": "16"}}})
    events = watcher.new_events(1)
    assert [(e.unschedulable, e.mig_config, e.mig_config_state, e.capacity) for e in events] == [
        (True, "all-disabled", "success", {"nvidia.com/gpu": 8}),
        (True, "all-3g.40gb", "success", {"nvidia.com/gpu": 8}),
        (True, "all-3g.40gb", "pending", {"nvidia.com/gpu": 8}),
        (True, "all-3g.40gb", "pending", {"nvidia.com/gpu": 0, "nvidia.com/mig-3g.40gb": 16}),
    ]
    assert events[0].taints == [Taint("node.kubernetes.io/unschedulable", "NoSchedule")]
    patches = [r for r in kube_api.requests if r.method == "PATCH"]
    assert {r.content_type for r in patches} <= {"application/strategic-merge-patch+json",
                                                 "application/merge-patch+json",
                                                 "application/json-patch+json"}


def test_kueue_v1beta1_only_server(tmp_path: Any) -> None:
    """Kueue before 0.15 serves only v1beta1, with spec.priorityClassName."""
    with KubeApiServer(kueue_versions=("v1beta1",), bookmark_interval_s=0.05) as api:
        old = workload("wl")
        old["apiVersion"] = "kueue.x-k8s.io/v1beta1"
        old["spec"]["priorityClassName"] = "batch-high"
        old["spec"]["priorityClassSource"] = "kueue.x-k8s.io/workloadpriorityclass"
        api.create(old)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        watcher = RunningWatcher(api, kubeconfig, KubeWatchSettings(
            kubeconfig=str(kubeconfig))).start()
        try:
            assert watcher.watcher.kueue_version == "v1beta1"
            [event] = watcher.events
            assert (event.name, event.state, event.priority_class, event.cluster_queue) == (
                "wl", "pending", "batch-high", "team-a-lq")
        finally:
            watcher.stop()


def test_pod_seen_before_its_single_strategy_node_is_reinterpreted(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_pod("early", node="late-node", phase="Running",
                            resources={"nvidia.com/gpu": "3"}))
    watcher = start_watcher()
    kube_api.create(gpu_node("late-node", labels={
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"},
        resources={"nvidia.com/gpu": "56"}))
    assert [brief(e) for e in watcher.new_events(0)] == [
        ("pod", "late-node", "team-a/early", "running", 3, {}),
        ("node", "late-node", False, None, False),
        ("pod", "late-node", "team-a/early", "running", 0, {"1g.10gb": 3}),
    ]


def test_a_publisher_error_ends_the_watcher_with_that_error(
        kube_api: KubeApiServer, kubeconfig: Any) -> None:
    import asyncio

    from gpusteward.collectors.kubernetes import KubeWatcher, api_client

    from .conftest import RecordingPublisher

    class Broken(RecordingPublisher):
        async def allocation(self, event: Any) -> None:
            if isinstance(event, PodAllocation):
                raise ConnectionError("kafka is gone")
            await super().allocation(event)

    kube_api.create(gpu_node("n1"))
    settings = KubeWatchSettings(kubeconfig=str(kubeconfig), resources=["nodes", "pods"])
    watcher = KubeWatcher(api_client(settings), Broken(), settings)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.run(stop))
        await asyncio.wait_for(watcher.synced.wait(), 10)
        kube_api.create(gpu_pod("p", node="n1", phase="Running"))
        await asyncio.wait_for(task, 10)

    with pytest.raises(ConnectionError, match="kafka is gone"):
        asyncio.run(main())
    assert not any(t.is_alive() for t in watcher._threads)


def test_objects_that_cannot_be_translated_are_skipped_and_counted(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A node claiming 2**70 GPUs and a pod whose containers are no list would crash the
    translator or make the worker refuse the record: each is skipped, counted once per
    kind, and the objects after them are published as usual."""
    watcher = start_watcher()
    mark = len(watcher.events)
    kube_api.create(gpu_node("huge", resources={"nvidia.com/gpu": str(2**70)}))
    broken = gpu_pod("broken")
    broken["spec"]["containers"] = "not a list"
    kube_api.create(broken)
    kube_api.create(gpu_node("n1"))
    events = watcher.new_events(mark)
    assert [brief(e) for e in events] == [("node", "n1", False, None, False)]
    assert watcher.watcher.refusals.count == 2
    assert set(watcher.watcher.refusals.by_kind) == {"nodes invalid", "pods AttributeError"}


class _Response:
    """What the client's ``_preload_content=False`` calls return: a body, or a stream."""

    def __init__(self, body: bytes) -> None:
        self.data = body

    def stream(self, amt: Any = None, decode_content: bool = False) -> Any:
        return iter([self.data])

    def release_conn(self) -> None:
        pass


def test_a_reflector_skips_malformed_objects_and_watch_lines() -> None:
    """An object without metadata in a list, and a watch line that is no JSON or no event,
    are skipped and counted; the reflector carries on with the rest instead of relisting
    the same broken page for ever."""
    node = gpu_node("n1")
    node["metadata"]["resourceVersion"] = "5"
    later = gpu_node("n2")
    later["metadata"]["resourceVersion"] = "7"
    page = json.dumps({"metadata": {"resourceVersion": "5"},
                       "items": [{"kind": "Node"}, node, {"metadata": "x"}]}).encode()
    watch = b"\n".join([b"{not json", json.dumps({"type": "ADDED"}).encode(),
                        json.dumps({"type": "ADDED", "object": later}).encode()]) + b"\n"
    delivered: list[Delta] = []
    stop = threading.Event()

    def list_call(**kwargs: Any) -> _Response:
        return _Response(watch if kwargs.get("watch") else page)

    reflector = Reflector("nodes", list_call, delivered.extend, KubeWatchSettings(), stop,
                          key_of=node_key)
    reflector.relist()
    reflector.watch()
    assert [(d.type, d.key) for d in delivered] == [("ADDED", "n1"), ("ADDED", "n2")]
    assert reflector.stats.malformed == 4 and reflector.resource_version == "7"


def _paged(objects: list[dict[str, Any]], page_size: int, fetched: list[str | None],
           expire_after: int | None = None) -> Any:
    """A list call serving ``objects`` in pages of ``page_size`` (resourceVersion "9"),
    recording each page's continue token in ``fetched``; the continue token of page
    ``expire_after`` (counting from 1) answers 410 once."""
    expired = [False]

    def list_call(**kwargs: Any) -> _Response:
        token = kwargs.get("_continue")
        fetched.append(token)
        start = int(token or 0)
        if expire_after is not None and start == expire_after * page_size and not expired[0]:
            expired[0] = True
            raise client.ApiException(status=410, reason="Expired")
        rest = objects[start + page_size:]
        meta: dict[str, Any] = {"resourceVersion": "9"}
        if rest:
            meta["continue"] = str(start + page_size)
        return _Response(json.dumps({"metadata": meta,
                                     "items": objects[start:start + page_size]}).encode())

    return list_call


def _nodes(count: int, version: str = "5") -> list[dict[str, Any]]:
    nodes = [gpu_node(f"n{i}") for i in range(count)]
    for node in nodes:
        node["metadata"]["resourceVersion"] = version
    return nodes


def test_a_relist_delivers_each_page_before_fetching_the_next() -> None:
    """A relist of 20,000 pods held whole before its diff took the watcher past its
    memory limit: each page's changes go out as the page arrives."""
    fetched: list[str | None] = []
    deliveries: list[tuple[int, list[str]]] = []

    def deliver(deltas: list[Delta]) -> None:
        deliveries.append((len(fetched), [d.key for d in deltas]))

    reflector = Reflector("nodes", _paged(_nodes(5), 2, fetched), deliver,
                          KubeWatchSettings(page_size=2), threading.Event(), key_of=node_key)
    reflector.relist()
    # (pages fetched when delivered, what was delivered)
    assert deliveries == [(1, ["n0", "n1"]), (2, ["n2", "n3"]), (3, ["n4"])]
    assert reflector.resource_version == "9" and reflector.synced.is_set()


def test_a_relist_cut_short_starts_over_without_delivering_anything_twice() -> None:
    """The continue token expires after the first page was delivered: the relist starts
    over, delivers only what its first attempt had not, and still finds the deletions."""
    fetched: list[str | None] = []
    delivered: list[Delta] = []
    settings = KubeWatchSettings(page_size=2)
    reflector = Reflector("nodes", _paged(_nodes(5), 2, fetched), delivered.extend, settings,
                          threading.Event(), key_of=node_key)
    reflector.relist()
    delivered.clear()
    # Since: n0 and n1 changed, n4 was deleted.
    changed = _nodes(2, version="8") + _nodes(4)[2:]
    reflector._list_call = _paged(changed, 2, fetched, expire_after=1)
    with pytest.raises(Gone):
        reflector.relist()
    assert [(d.type, d.key) for d in delivered] == [("MODIFIED", "n0"), ("MODIFIED", "n1")]
    reflector.relist()
    assert [(d.type, d.key) for d in delivered] == [
        ("MODIFIED", "n0"), ("MODIFIED", "n1"), ("DELETED", "n4")]
    assert reflector.known == {"n0": "8", "n1": "8", "n2": "5", "n3": "5"}


def test_reflectors_wait_while_two_pages_are_not_published(
        kube_api: KubeApiServer, kubeconfig: Any) -> None:
    """A publisher that stalls holds the reflectors back: at most two pages of deltas
    (and the page in hand) wait for it, not the whole list."""
    import asyncio

    from gpusteward.collectors.kubernetes import KubeWatcher, api_client

    from .conftest import RecordingPublisher

    gate = threading.Event()

    class Stalled(RecordingPublisher):
        async def allocation(self, event: Any) -> None:
            await asyncio.to_thread(gate.wait)
            await super().allocation(event)

    for i in range(30):
        kube_api.create(gpu_node(f"n{i:02d}"))
    settings = KubeWatchSettings(kubeconfig=str(kubeconfig), resources=["nodes"], page_size=3)
    publisher = Stalled()
    watcher = KubeWatcher(api_client(settings), publisher, settings)
    backlog: list[float] = []

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.run(stop))
        await asyncio.sleep(1.0)
        backlog.append(watcher._backlog())
        gate.set()
        await asyncio.wait_for(watcher.synced.wait(), 10)
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert 0 < backlog[0] <= 3 * 3, backlog
    assert [brief(e)[1] for e in publisher.events] == [f"n{i:02d}" for i in range(30)]
