"""What a node holds and offers, as the API server states it, through the watcher and the join.

Each test writes pods and nodes as the kubelet, the scheduler and the device
plugin leave them into the API-server double, lets the real watcher (the
``kubernetes`` client) read them, and folds its events into the worker's node
join, whose node summaries say how many GPUs a node has free for the fleet's
rules (fragmentation, waiting work, start ETAs).
"""

from __future__ import annotations

from typing import Any

import pytest

from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod
from gpusteward.schema import NodeInventory, NodeSummary, PodAllocation
from gpusteward.streams.node import NodeJoin, NodeState

from .conftest import RunningWatcher, WatcherFactory


def free_gpus(watcher: RunningWatcher, node: str) -> int:
    """GPUs the worker's node join says ``node`` has free after the watcher's events."""
    join, state = NodeJoin(), NodeState()
    summaries: list[NodeSummary] = []
    for event in watcher.events:
        if isinstance(event, (PodAllocation, NodeInventory)) and event.node == node:
            summaries += [o for o in join.on_allocation(state, event)
                          if isinstance(o, NodeSummary)]
    return summaries[-1].gpus_free


def container(name: str, gpus: int, **extra: Any) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)}
    return {"name": name, "image": "pytorch:25.01", **extra,
            "resources": {"limits": limits, "requests": dict(limits)}}


def test_a_sidecar_holding_a_gpu_counts_beside_the_app_containers(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A sidecar (an init container with restartPolicy Always) runs beside the app
    containers for the pod's whole life: the scheduler adds its GPUs to theirs
    (k8s.io/component-helpers ``PodRequests``), and so must what the pod is said to hold."""
    kube_api.create(gpu_node("n1", gpus=8))
    pod = gpu_pod("serve", node="n1", phase="Running")
    pod["spec"]["initContainers"] = [
        container("fetch-weights", 1),  # a plain init container: done before the rest start
        container("profiler", 1, restartPolicy="Always"),
    ]
    pod["spec"]["containers"] = [container("main", 2)]
    kube_api.create(pod)
    # An init container after the sidecar runs while the sidecar holds its GPU.
    late = gpu_pod("warmup", node="n1", phase="Running")
    late["spec"]["initContainers"] = [container("agent", 1, restartPolicy="Always"),
                                      container("burn-in", 3)]
    late["spec"]["containers"] = [container("main", 1)]
    kube_api.create(late)
    watcher = start_watcher()

    held = {e.pod.name: e.gpus for e in watcher.events if isinstance(e, PodAllocation)}
    assert held == {"serve": 3, "warmup": 4}  # 2 + sidecar 1; max(1 + 1, sidecar 1 + 3)
    assert free_gpus(watcher, "n1") == 1


def test_a_pods_gpu_container_images_reach_the_rules_that_know_frameworks_by_them(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A Triton server running TensorRT-LLM beside a metrics exporter: the allocation names
    the image of the container that holds the GPU, not the exporter's, and the node join
    hands it to the rules (the low-free rule leaves that server's reserve alone)."""
    kube_api.create(gpu_node("n1", gpus=8))
    pod = gpu_pod("llm", node="n1", phase="Running")
    triton = "nvcr.io/nvidia/tritonserver:24.08-trtllm-python-py3"
    pod["spec"]["containers"] = [
        {**container("server", 1), "image": triton},
        {"name": "metrics", "image": "quay.io/prometheus/node-exporter:v1.8.2"},
    ]
    kube_api.create(pod)
    watcher = start_watcher()

    [allocation] = [e for e in watcher.events if isinstance(e, PodAllocation)]
    assert allocation.images == [triton]
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation)
    [holding] = state.pods.values()
    assert holding.images == [triton]
    assert not allocation.memory_grows and not holding.memory_grows


def test_a_gpu_containers_memory_growth_reaches_the_high_memory_rule(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """TensorFlow told to grow its memory (TF_FORCE_GPU_ALLOW_GROWTH=true in the GPU
    container's spec): the allocation and the holding say so, so its image does not exempt
    it from the high-memory rule."""
    kube_api.create(gpu_node("n1", gpus=8))
    pod = gpu_pod("tf", node="n1", phase="Running")
    pod["spec"]["containers"] = [{**container("trainer", 1),
                                  "image": "tensorflow/tensorflow:2.17.0-gpu",
                                  "env": [{"name": "TF_FORCE_GPU_ALLOW_GROWTH",
                                           "value": "true"}]}]
    kube_api.create(pod)
    watcher = start_watcher()

    [allocation] = [e for e in watcher.events if isinstance(e, PodAllocation)]
    assert allocation.memory_grows
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation)
    [holding] = state.pods.values()
    assert holding.memory_grows


def test_a_gpu_that_leaves_allocatable_is_not_offered_as_free(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """The device plugin reports a failed GPU unhealthy: the kubelet keeps it in
    capacity and takes it out of allocatable, so the scheduler places nothing on it. A
    device plugin restart takes every GPU out of allocatable until it registers again."""
    kube_api.create(gpu_node("n1", gpus=8))
    kube_api.create(gpu_pod("train", node="n1", phase="Running",
                            resources={"nvidia.com/gpu": "2"}))
    watcher = start_watcher()
    assert free_gpus(watcher, "n1") == 6

    mark = len(watcher.events)
    kube_api.mutate("Node", "n1", lambda n: n["status"]["allocatable"].update(
        {"nvidia.com/gpu": "7"}))
    (inventory,) = watcher.new_events(mark)
    assert (inventory.gpu_count, inventory.allocatable) == (8, {"nvidia.com/gpu": 7})
    assert free_gpus(watcher, "n1") == 5

    kube_api.mutate("Node", "n1", lambda n: n["status"]["allocatable"].update(
        {"nvidia.com/gpu": "0"}))
    watcher.settle()
    assert free_gpus(watcher, "n1") == 0

    kube_api.mutate("Node", "n1", lambda n: n["status"]["allocatable"].update(
        {"nvidia.com/gpu": "8"}))
    watcher.settle()
    assert free_gpus(watcher, "n1") == 6


def test_a_deleted_node_offers_nothing_and_its_name_comes_back_as_a_new_node(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A node scaled down (or replaced under the same name, as cloud node pools do) is
    deleted: its GPUs must stop counting as free capacity at once, not only once its last
    summary goes stale in the fleet's view."""
    kube_api.create(gpu_node("n1", gpus=8))
    watcher = start_watcher()
    assert free_gpus(watcher, "n1") == 8

    mark = len(watcher.events)
    kube_api.delete("Node", "n1")
    (gone,) = watcher.new_events(mark)
    assert isinstance(gone, NodeInventory) and gone.deleted
    assert free_gpus(watcher, "n1") == 0

    kube_api.create(gpu_node("n1", gpus=4))
    watcher.settle()
    assert free_gpus(watcher, "n1") == 4



@pytest.mark.parametrize("resource", ["zero", "gone"])
def test_a_node_that_loses_its_gpus_counts_none(kube_api: KubeApiServer,
                                                start_watcher: WatcherFactory,
                                                resource: str) -> None:
    """The GPU Operator taken off a node: its labels go and the kubelet reports the device
    plugin's resource as 0 ("zero"), or, after a kubelet restart, not at all ("gone"). The
    node has no GPU for the fleet's rules: before, it kept its 8 in every total, and with
    the resource gone it offered all 8 as free."""
    kube_api.create(gpu_node("n1", gpus=8))
    watcher = start_watcher(resources=["nodes"])

    def ungpu(node: dict[str, Any]) -> None:
        labels = node["metadata"]["labels"]
        for key in [k for k in labels if k.startswith("nvidia.com/")]:
            del labels[key]
        for part in ("capacity", "allocatable"):
            if resource == "zero":
                node["status"][part]["nvidia.com/gpu"] = "0"
            else:
                del node["status"][part]["nvidia.com/gpu"]

    def last_summary() -> tuple[int, int]:
        join, state = NodeJoin(), NodeState()
        summaries = [o for e in watcher.events for o in join.on_allocation(state, e)
                     if isinstance(o, NodeSummary)]
        return summaries[-1].gpus_total, summaries[-1].gpus_free

    watcher.settle()
    assert last_summary() == (8, 8)
    kube_api.mutate("Node", "n1", ungpu)
    watcher.settle()
    assert len(watcher.events) == 2
    assert last_summary() == (0, 0)
