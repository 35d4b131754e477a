"""The watcher reports what the simulator's allocation feed reports, for the same placement.

The stream worker's join reads node, pod (namespace, name, uid), phase, GPUs,
start time and workload kind from PodAllocation, and GPU count, cordon and
spot from NodeInventory. If the watcher, reading the same placement through
the Kubernetes API, yields the same values, the pipeline finds the same
things with either source.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_mirror import placement_objects
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.schema import NodeInventory, PodAllocation

from .conftest import RecordingPublisher, WatcherFactory


def _join_view(events: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The latest join-relevant fields per pod and per node."""
    pods: dict[str, Any] = {}
    nodes: dict[str, Any] = {}
    for e in events:
        if isinstance(e, PodAllocation):
            pods[e.pod.uid or e.pod.name] = (e.node, e.pod.namespace, e.pod.name, e.pod.uid,
                                             e.phase, e.gpus, e.mig, e.started_at,
                                             e.workload_kind)
        elif isinstance(e, NodeInventory):
            nodes[e.node] = (e.gpu_count, e.unschedulable, e.spot)
    return pods, nodes


def test_watcher_matches_the_simulator_feed(kube_api: KubeApiServer,
                                            start_watcher: WatcherFactory) -> None:
    spec = scenarios.load("eight-a100").model_copy(update={"acceleration": 0.0,
                                                           "duration_s": 10800})
    cluster = SimulatedCluster(spec)
    cluster.request_cordon("a100-3", "test")
    simulated = RecordingPublisher()
    asyncio.run(cluster.run(simulated))
    sim_pods, sim_nodes = _join_view(simulated.events)
    assert len(sim_pods) >= 6 and sim_nodes["a100-3"][1] is True
    assert {p[4] for p in sim_pods.values()} == {"running", "finished"}

    kube_api.load(placement_objects(cluster))
    watcher = start_watcher()
    kube_pods, kube_nodes = _join_view(watcher.events)

    assert kube_nodes == sim_nodes
    assert kube_pods == sim_pods
    products = {e.gpu_product for e in watcher.events if isinstance(e, NodeInventory)}
    # The GPU Operator's label writes the model with dashes where NVML has spaces.
    assert products == {"NVIDIA-A100-SXM4-80GB"}


def test_watcher_on_a_mirrored_simulation_matches_the_feed_through_time(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """Tick by tick: the simulator writes its fleet into the double, the watcher reads it."""
    from gpusteward.sandbox.kube_mirror import KubeMirrorPublisher

    spec = scenarios.load("eight-a100").model_copy(update={"acceleration": 0.0,
                                                           "duration_s": 10800})
    feed = SimulatedCluster(spec)
    feed_events = RecordingPublisher()
    asyncio.run(feed.run(feed_events))

    mirrored = SimulatedCluster(spec)
    passthrough = RecordingPublisher()
    mirror = KubeMirrorPublisher(passthrough, kube_api, mirrored)
    watcher = start_watcher()
    asyncio.run(mirrored.run(mirror))
    watcher.settle()

    # Samples pass through unchanged; allocations come from the watcher instead.
    assert len(passthrough.others) == len(feed_events.others)
    assert not passthrough.events
    feed_pods, feed_nodes = _join_view(feed_events.events)
    kube_pods, kube_nodes = _join_view(watcher.events)
    assert kube_pods == feed_pods and kube_nodes == feed_nodes

    def lifecycle(events: list[Any]) -> list[tuple[str, str]]:
        return [(e.pod.name, e.phase) for e in events if isinstance(e, PodAllocation)]

    # The same transitions in the same order (the watcher adds "bound" before "running").
    assert [t for t in lifecycle(watcher.events) if t[1] != "bound"] == lifecycle(
        feed_events.events)
    queue_feed = [(e.name, e.state) for e in feed_events.events if not isinstance(
        e, PodAllocation | NodeInventory)]
    queue_kube = [(e.name, e.state) for e in watcher.events if not isinstance(
        e, PodAllocation | NodeInventory)]
    assert sorted(queue_kube) == sorted(queue_feed)
