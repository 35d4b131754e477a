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


JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


def pod_for(workload: Workload, cluster_queue: str) -> dict[str, Any]:
    """The pod a controller would create for a simulated workload (pending, no node).

    A gang member is a pod of its JobSet's Job (``<jobset>-workers-0``), labelled with
    the JobSet's name as the JobSet controller labels it; the scenario's pod labels (a
    team) are carried as they are.
    """
    kind, label = _OWNERS[workload.spec.kind]
    owner_name = f"{workload.name}-{_HASH}" if kind == "ReplicaSet" else workload.name
    labels = {**workload.spec.labels, label: _HASH if kind == "ReplicaSet" else workload.name,
              "kueue.x-k8s.io/cluster-queue-name": cluster_queue}
    if workload.spec.gang:
        kind, owner_name = "Job", f"{workload.spec.group}-workers-0"
        labels = {**workload.spec.labels, JOBSET_LABEL: workload.spec.group,
                  "kueue.x-k8s.io/cluster-queue-name": cluster_queue}
    pod = gpu_pod(workload.name, workload.namespace,
                  resources=_resources(workload),
                  labels=labels, owner=(kind, owner_name), uid=workload.uid,
                  created=rfc3339(workload.arrive))
    if kind != "Job":  # the pod's controller is one of owners_for's objects
        (reference,) = pod["metadata"]["ownerReferences"]
        reference.update(apiVersion="apps/v1", uid=f"{kind.lower()}-{owner_name}")
    return pod


def _resources(workload: Workload) -> dict[str, str]:
    """What the pod requests: its MIG devices as the device plugin names them under
    ``mixed`` (a profile's ``+`` written ``.``), else whole GPUs."""
    if workload.spec.mig:
        return {f"nvidia.com/mig-{profile.replace('+', '.')}": str(count)
                for profile, count in workload.spec.mig.items()}
    return {"nvidia.com/gpu": str(workload.spec.gpus)}


def _owned(kind: str, api_version: str, name: str, namespace: str, owner: dict[str, Any] | None,
           spec: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"{kind.lower()}-{name}"}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                    "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True}]
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, "spec": spec,
            "status": {}}


def owners_for(workload: Workload, gang_size: int = 0) -> list[dict[str, Any]]:
    """The objects above a simulated workload's pod, as its controllers would have made them.

    A notebook is a Kubeflow Notebook whose controller runs a one-replica StatefulSet;
    an inference server a Deployment with its ReplicaSet. Reclaim acts on these (stop
    the Notebook, scale the Deployment to zero), so they must exist. A batch pod's Job
    is not served by the double: the pod names it, and Job reclaim deletes the pod. A
    gang member's JobSet states the gang's size (``gang_size`` workers of one GPU
    shape), which is how the watcher learns it.
    """
    name, namespace = workload.name, workload.namespace
    if workload.spec.gang:
        template = {"spec": {"containers": [{"name": "worker", "resources": {"limits": {
            "nvidia.com/gpu": str(workload.spec.gpus)}}}]}}
        return [_owned("JobSet", "jobset.x-k8s.io/v1alpha2", workload.spec.group, namespace,
                       None, {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {
                           "spec": {"parallelism": gang_size, "completions": gang_size,
                                    "template": template}}}]})]
    if workload.spec.kind == "notebook":
        notebook = _owned("Notebook", "kubeflow.org/v1", name, namespace, None,
                          {"template": {"spec": {"containers": [{"name": name}]}}})
        return [notebook, _owned("StatefulSet", "apps/v1", name, namespace, notebook,
                                 {"replicas": 1, "serviceName": name})]
    if workload.spec.kind == "inference":
        deployment = _owned("Deployment", "apps/v1", name, namespace, None, {"replicas": 1})
        return [deployment, _owned("ReplicaSet", "apps/v1", f"{name}-{_HASH}", namespace,
                                   deployment, {"replicas": 1})]
    return []


def node_for(event: NodeInventory) -> dict[str, Any]:
    """The Node the GPU Operator would label for a simulated node's inventory."""
    labels = {"nvidia.com/gpu.count": str(event.gpu_count),
              "nvidia.com/mig.strategy": event.mig_strategy or "none"}
    if event.gpu_product:
        labels["nvidia.com/gpu.product"] = event.gpu_product.replace(" ", "-")
    if event.spot:
        labels["karpenter.sh/capacity-type"] = "spot"
    if event.gpu_replicas > 1:
        # As the GPU Operator labels a node whose device plugin shares its GPUs; the
        # capacity is then the replicas, gpu.count the physical GPUs.
        labels["nvidia.com/gpu.replicas"] = str(event.gpu_replicas)
        labels["nvidia.com/gpu.sharing-strategy"] = event.gpu_sharing or "time-slicing"
    # MIG devices as the device plugin advertises them under ``mixed`` (the simulator
    # already spells them so: nvidia.com/mig-1g.10gb.me).
    resources = {"nvidia.com/gpu": str(event.gpu_count * event.gpu_replicas),
                 **{k: str(v) for k, v in event.allocatable.items()
                    if k.startswith("nvidia.com/mig-")}}
    node = gpu_node(event.node, event.gpu_count * event.gpu_replicas, labels=labels,
                    resources=resources)
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
            self._create_owners(workload)
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
            workload = self._workload(namespace, name)
            self._create_owners(workload)
            pod = pod_for(workload, self.cluster.scenario.cluster_queue)
            bind_and_start(pod, event)
            self.api.create(pod)

    def _create_owners(self, workload: Workload) -> None:
        size = self.cluster.gangs.get(f"{workload.namespace}/{workload.spec.group}", 0)
        for owner in owners_for(workload, size):
            try:
                self.api.get(owner["kind"], owner["metadata"]["name"],
                             namespace=workload.namespace,
                             group=owner["apiVersion"].rpartition("/")[0])
            except KeyError:
                self.api.create(owner)
