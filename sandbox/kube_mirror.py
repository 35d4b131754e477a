"""Mirror a simulated fleet into the API-server double, so the watcher can replace its feed.

The simulator publishes its own allocation and queue events. To run the
pipeline on the Kubernetes watcher instead (the demo and e2e tests), wrap the
real publisher in :class:`KubeMirrorPublisher`: samples and hardware events
pass through; allocation and queue events are not published but written into
a :class:`~gpusteward.sandbox.kube_api.KubeApiServer` as the Nodes and Pods a
real cluster would hold (pending pod, bound and running with its start time,
Succeeded, deleted; cordoned node). A :class:`~gpusteward.collectors.kubernetes.KubeWatcher`
on the double then publishes the allocation and queue events, read from the
API as in production. Give the watcher ``clock=lambda: cluster.now`` so its
event times are the simulation's.

Pod uids are the simulator's, so sample attribution (which names pods by
uid) and the watcher's events agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, rfc3339
from gpusteward.schema import (
    AllocationEvent,
    HwEvent,
    NodeInventory,
    NodeSample,
    PodAllocation,
    QueueEvent,
)

if TYPE_CHECKING:
    from gpusteward.sandbox.simulator.engine import SimulatedCluster, Workload

_OWNERS = {"notebook": ("StatefulSet", "notebook-name"), "batch": ("Job", "job-name"),
           "inference": ("ReplicaSet", "pod-template-hash")}
_HASH = "5d8f9c"


def pod_for(workload: Workload, cluster_queue: str) -> dict[str, Any]:
    """The pod a controller would create for a simulated workload (pending, no node)."""
    kind, label = _OWNERS[workload.spec.kind]
    owner_name = f"{workload.name}-{_HASH}" if kind == "ReplicaSet" else workload.name
    return gpu_pod(workload.name, workload.namespace,
                   resources={"nvidia.com/gpu": str(workload.spec.gpus)},
                   labels={label: _HASH if kind == "ReplicaSet" else workload.name,
                           "kueue.x-k8s.io/cluster-queue-name": cluster_queue},
                   owner=(kind, owner_name), uid=workload.uid, created=rfc3339(workload.arrive))


def node_for(event: NodeInventory) -> dict[str, Any]:
    """The Node the GPU Operator would label for a simulated node's inventory."""
    labels = {"nvidia.com/gpu.count": str(event.gpu_count), "nvidia.com/mig.strategy": "none"}
    if event.gpu_product:
        labels["nvidia.com/gpu.product"] = event.gpu_product.replace(" ", "-")
    if event.spot:
        labels["karpenter.sh/capacity-type"] = "spot"
    node = gpu_node(event.node, event.gpu_count, labels=labels)
    if event.unschedulable:
        node["spec"]["unschedulable"] = True
    return node


def bind_and_start(pod: dict[str, Any], event: PodAllocation) -> None:
    """Apply a simulated pod event: bound to its node, started, Succeeded when finished."""
    pod["spec"]["nodeName"] = event.node
    status = pod["status"]
    status["conditions"] = [{"type": "PodScheduled", "status": "True",
                             "lastTransitionTime": rfc3339(event.ts)}]
    if event.started_at is not None:
        status["startTime"] = rfc3339(event.started_at)
    status["phase"] = {"running": "Running", "finished": "Succeeded"}.get(event.phase, "Pending")


def placement_objects(cluster: SimulatedCluster) -> list[dict[str, Any]]:
    """The Nodes and Pods a real cluster would hold for a simulator's current placement.

    Built from the payloads the simulator itself would publish now (its
    ``_inventory`` and ``_pod_event``), so the objects say exactly what its
    feed says.
    """
    objects = [node_for(cluster._inventory(node)) for node in cluster.nodes.values()]
    for workload in (*cluster.running, *cluster.finished):
        pod = pod_for(workload, cluster.scenario.cluster_queue)
        phase = "finished" if workload.ended_at is not None else "running"
        bind_and_start(pod, cluster._pod_event(workload, phase, cluster.now))
        objects.append(pod)
    return objects


class KubeMirrorPublisher:
    """A :class:`Publisher` that writes allocation and queue events into the API double."""

    def __init__(self, inner: Publisher, api: KubeApiServer, cluster: SimulatedCluster) -> None:
        self.inner = inner
        self.api = api
        self.cluster = cluster

    def _workload(self, namespace: str, name: str) -> Workload:
        cluster = self.cluster
        for workload in (*cluster.queue, *cluster.running, *cluster.finished, *cluster.workloads):
            if (workload.namespace, workload.name) == (namespace, name):
                return workload
        raise KeyError(f"{namespace}/{name} is not a simulated workload")

    async def sample(self, sample: NodeSample) -> None:
        await self.inner.sample(sample)

    async def hw_event(self, event: HwEvent) -> None:
        await self.inner.hw_event(event)

    async def flush(self) -> None:
        await self.inner.flush()

    async def queue(self, event: QueueEvent) -> None:
        if event.state == "pending":
            workload = self._workload(event.namespace, event.name)
            self.api.create(pod_for(workload, event.cluster_queue))
        # "admitted" needs no write: the allocation event that follows binds the pod.

    async def allocation(self, event: AllocationEvent) -> None:
        if isinstance(event, NodeInventory):
            self._node(event)
        else:
            self._pod(event)

    def _node(self, event: NodeInventory) -> None:
        node = node_for(event)
        try:
            current = self.api.get("Node", event.node)
        except KeyError:
            self.api.create(node)
            return
        node["metadata"] = {**current["metadata"], "labels": node["metadata"]["labels"]}
        self.api.update(node)

    def _pod(self, event: PodAllocation) -> None:
        name, namespace = event.pod.name, event.pod.namespace
        if event.phase == "deleted":
            self.api.delete("Pod", name, namespace=namespace)
            return
        try:
            self.api.mutate("Pod", name, lambda pod: bind_and_start(pod, event),
                            namespace=namespace)
        except KeyError:
            pod = pod_for(self._workload(namespace, name), self.cluster.scenario.cluster_queue)
            bind_and_start(pod, event)
            self.api.create(pod)
