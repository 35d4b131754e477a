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

On a node group whose GPUs go through Dynamic Resource Allocation
(``allocation: dra``) the objects are NVIDIA's DRA driver's: a ResourceSlice
per node publishes its GPUs and MIG devices (no ``nvidia.com/gpu`` capacity);
a pod asks through a claim template, the resourceclaim controller's claim
(``<pod>-gpu-<suffix>``) is created with it and named in its status; the
scheduler allocates the claim to the simulator's devices and reserves it for
the pod before binding; the claim is released once the pod is done and
deleted with it. On a DRA node group whose one GPU is shared (``replicas``),
its pods name one claim made beforehand (``<node group>-gpu``), as NVIDIA's
driver time-slices a GPU among a claim's pods: allocated with the first pod,
reserved for each pod as it is bound, released by each as it ends.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.rules.mig import geometry
from gpusteward.sandbox.kube_api import DRA_GROUP, KubeApiServer
from gpusteward.sandbox.kube_objects import (
    allocate,
    claim_pod,
    dra_gpu,
    dra_mig,
    gpu_node,
    gpu_pod,
    resource_claim,
    resource_claim_template,
    resource_slice,
    rfc3339,
)
from gpusteward.schema import (
    AllocationEvent,
    HwEvent,
    NodeInventory,
    NodeSample,
    PodAllocation,
    QueueEvent,
)

if TYPE_CHECKING:
    from gpusteward.sandbox.simulator.engine import SimGpu, SimNode, SimulatedCluster, Workload

_OWNERS = {"notebook": ("StatefulSet", "notebook-name"), "batch": ("Job", "job-name"),
           "inference": ("ReplicaSet", "pod-template-hash")}
_HASH = "5d8f9c"
_TRAINING_JOBS = ("TFJob", "JAXJob", "PyTorchJob")
"""Kubeflow training jobs a batch workload may run under (``WorkloadGroup.owner``); their
controller is not served by the API double: the pod names it, as a Job's does."""


JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


def dra_claim_name(pod: str) -> str:
    """The claim the resourceclaim controller makes for a pod's ``gpu`` claim template:
    ``<pod>-gpu-<5 random characters>`` (here derived from the pod's name)."""
    suffix = hashlib.sha1(pod.encode()).hexdigest()[:5]
    return f"{pod}-gpu-{suffix}"


def mig_placements(gpu: SimGpu) -> dict[str, tuple[int | None, int, int]]:
    """MIG uuid -> (GPU-instance profile id, placement start, size) of a simulated GPU's MIG
    devices, laid out in order from memory slice 0: what NVML's ``nvmlGpuInstanceGetInfo``
    reports and NVIDIA's DRA driver names the device by. The profile id is None where the
    geometry file has none (B200's)."""
    if not gpu.mig:
        return {}
    found = geometry.find(geometry.load(), gpu.model)
    if found is None:
        raise ValueError(f"no MIG geometry for {gpu.model!r}")
    placements: dict[str, tuple[int | None, int, int]] = {}
    start = 0
    for mig in gpu.mig:
        profile = found.profile(mig.profile)
        placements[mig.uuid] = (profile.gi_profile_id, start, profile.size)
        start += profile.size
    return placements


def dra_device_names(node: SimNode) -> dict[str, str]:
    """GPU or MIG uuid -> its DRA device name, as NVIDIA's driver (v25.3, v25.8) names
    them: ``gpu-<minor>``, ``gpu-<minor>-mig-<GI profile id>-<placement start>-<size>``
    (a simulated GPU's minor is its index)."""
    names: dict[str, str] = {}
    for gpu in node.gpus:
        names[gpu.uuid] = f"gpu-{gpu.index}"
        for uuid, (profile_id, start, size) in mig_placements(gpu).items():
            names[uuid] = f"gpu-{gpu.index}-mig-{profile_id}-{start}-{size}"
    return names


def node_slice(node: SimNode) -> dict[str, Any]:
    """The ResourceSlice NVIDIA's DRA driver publishes for a node: its whole GPUs, and
    the MIG devices of its partitioned ones."""
    names = dra_device_names(node)
    devices = []
    for gpu in node.gpus:
        if not gpu.mig:
            devices.append(dra_gpu(gpu.index, gpu.uuid, gpu.model))
        for mig in gpu.mig:
            _, _, profile_id, start, size = names[mig.uuid].rsplit("-", 4)
            devices.append(dra_mig(gpu.index, gpu.uuid, mig.uuid, mig.profile,
                                   int(profile_id), int(start), int(size), gpu.model))
    return resource_slice(node.name, devices)


def pod_for(workload: Workload, cluster_queue: str, dra: bool = False,
            shared_claim: str | None = None) -> dict[str, Any]:
    """The pod a controller would create for a simulated workload (pending, no node).

    A gang member is a pod of its JobSet's Job (``<jobset>-workers-0``), labelled with
    the JobSet's name as the JobSet controller labels it; the scenario's pod labels (a
    team) are carried as they are. With ``dra`` it asks for its GPUs through a claim
    template (named in its status, as the resourceclaim controller does at once), or
    through ``shared_claim``, made beforehand, where given.
    """
    kind, label = _OWNERS[workload.spec.kind]
    owner_name = f"{workload.name}-{_HASH}" if kind == "ReplicaSet" else workload.name
    labels = {**workload.spec.labels, label: _HASH if kind == "ReplicaSet" else workload.name,
              "kueue.x-k8s.io/cluster-queue-name": cluster_queue}
    if workload.spec.kind == "batch":
        kind = workload.spec.owner
    if workload.spec.gang and workload.spec.elastic_min is not None:
        kind, owner_name = "PyTorchJob", workload.spec.group
        labels = {**workload.spec.labels, "training.kubeflow.org/job-name": workload.spec.group,
                  "training.kubeflow.org/replica-type": "worker",
                  "kueue.x-k8s.io/cluster-queue-name": cluster_queue}
    elif workload.spec.gang:
        kind, owner_name = "Job", f"{workload.spec.group}-workers-0"
        labels = {**workload.spec.labels, JOBSET_LABEL: workload.spec.group,
                  "kueue.x-k8s.io/cluster-queue-name": cluster_queue}
    pod = gpu_pod(workload.name, workload.namespace,
                  resources=_resources(workload),
                  labels=labels, owner=(kind, owner_name), uid=workload.uid,
                  created=rfc3339(workload.arrive))
    if workload.spec.image:
        pod["spec"]["containers"][0]["image"] = workload.spec.image
    if workload.spec.env:
        pod["spec"]["containers"][0]["env"] = [{"name": name, "value": value}
                                               for name, value in workload.spec.env.items()]
    if kind != "Job":  # the pod's controller is one of owners_for's objects
        (reference,) = pod["metadata"]["ownerReferences"]
        reference.update(apiVersion="kubeflow.org/v1" if kind in _TRAINING_JOBS else "apps/v1",
                         uid=f"{kind.lower()}-{owner_name}")
    if dra and shared_claim is not None:
        claim_pod(pod, {"gpu": shared_claim}, from_template=False)
    elif dra:
        claim_pod(pod, {"gpu": dra_claim_name(workload.name)},
                  templates={"gpu": dra_template_name(workload.name)})
    return pod


def dra_shared_claim_name(node_group: str) -> str:
    """The claim the pods sharing a DRA node group's one GPU all name."""
    return f"{node_group}-gpu"


def dra_template_name(workload: str) -> str:
    """The ResourceClaimTemplate a workload's pod names (its owner's, in a real cluster)."""
    return f"{workload}-gpu"


def _dra_request(workload: Workload) -> dict[str, Any]:
    """What the workload's claim asks for: MIG devices of its profile (NVIDIA's
    ``mig.nvidia.com`` class, the profile chosen by a selector), else whole GPUs."""
    mig = workload.spec.mig
    if len(mig) > 1:
        raise ValueError(f"{workload.name}: one MIG profile per DRA claim here, not {mig}")
    profile = next(iter(mig), None)
    return {"device_class": "mig.nvidia.com" if mig else "gpu.nvidia.com",
            "count": sum(mig.values()) if mig else workload.spec.gpus, "profile": profile}


def template_for(workload: Workload) -> dict[str, Any]:
    """The ResourceClaimTemplate the workload's pod names, made before the pod."""
    return resource_claim_template(dra_template_name(workload.name), workload.namespace,
                                   **_dra_request(workload))


def claim_for(workload: Workload, pod: dict[str, Any]) -> dict[str, Any]:
    """The claim the resourceclaim controller makes from the pod's template."""
    return resource_claim(dra_claim_name(workload.name), workload.namespace, owner=pod,
                          **_dra_request(workload))


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

    An elastic gang's is a PyTorchJob with its elasticPolicy.
    A notebook is a Kubeflow Notebook whose controller runs a one-replica StatefulSet;
    an inference server a Deployment with its ReplicaSet. Reclaim acts on these (stop
    the Notebook, scale the Deployment to zero), so they must exist. A batch pod's Job
    is a Job, which a requeue reads before it deletes the pod (a Kubeflow training job's
    controller is not served: the pod names it). A gang member's JobSet states the
    gang's size (``gang_size`` workers of one GPU shape), which is how the watcher learns
    it; its pods' Job is the JobSet's child.
    """
    name, namespace = workload.name, workload.namespace
    if workload.spec.gang:
        template = {"spec": {"containers": [{"name": "worker", "resources": {"limits": {
            "nvidia.com/gpu": str(workload.spec.gpus)}}}]}}
        if workload.spec.elastic_min is not None:
            return [_owned("PyTorchJob", "kubeflow.org/v1", workload.spec.group, namespace,
                           None, {"elasticPolicy": {
                               "rdzvBackend": "c10d", "minReplicas": workload.spec.elastic_min,
                               "maxReplicas": gang_size},
                               "pytorchReplicaSpecs": {"Worker": {
                                   "replicas": gang_size, "template": template}}})]
        jobset = _owned("JobSet", "jobset.x-k8s.io/v1alpha2", workload.spec.group, namespace,
                        None, {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {
                            "spec": {"parallelism": gang_size, "completions": gang_size,
                                     "template": template}}}]})
        return [jobset, _owned("Job", "batch/v1", f"{workload.spec.group}-workers-0",
                               namespace, jobset, {"parallelism": gang_size,
                                                   "completions": gang_size,
                                                   "template": template})]
    if workload.spec.kind == "notebook":
        notebook = _owned("Notebook", "kubeflow.org/v1", name, namespace, None,
                          {"template": {"spec": {"containers": [{"name": name}]}}})
        return [notebook, _owned("StatefulSet", "apps/v1", name, namespace, notebook,
                                 {"replicas": 1, "serviceName": name})]
    if workload.spec.kind == "batch" and workload.spec.owner == "Job":
        return [_owned("Job", "batch/v1", name, namespace, None, {"template": {
            "spec": {"containers": [{"name": name}]}}})]
    if workload.spec.kind == "inference":
        deployment = _owned("Deployment", "apps/v1", name, namespace, None, {"replicas": 1})
        return [deployment, _owned("ReplicaSet", "apps/v1", f"{name}-{_HASH}", namespace,
                                   deployment, {"replicas": 1})]
    return []


def node_for(event: NodeInventory, dra: bool = False) -> dict[str, Any]:
    """The Node the GPU Operator would label for a simulated node's inventory; with
    ``dra``, one whose GPUs NVIDIA's DRA driver hands out: GPU feature discovery labels
    it, and no device plugin advertises ``nvidia.com/gpu`` or MIG resources."""
    labels = {"nvidia.com/gpu.count": str(event.gpu_count),
              "nvidia.com/mig.strategy": event.mig_strategy or "none"}
    if event.gpu_product:
        labels["nvidia.com/gpu.product"] = event.gpu_product.replace(" ", "-")
    if event.spot:
        labels["karpenter.sh/capacity-type"] = "spot"
    if event.gpu_replicas > 1 and not dra:
        # As the GPU Operator labels a node whose device plugin shares its GPUs; the
        # capacity is then the replicas, gpu.count the physical GPUs. NVIDIA's DRA driver
        # shares a GPU among the pods of one claim instead: no replicas are advertised.
        labels["nvidia.com/gpu.replicas"] = str(event.gpu_replicas)
        labels["nvidia.com/gpu.sharing-strategy"] = event.gpu_sharing or "time-slicing"
    # MIG devices as the device plugin advertises them under ``mixed`` (the simulator
    # already spells them so: nvidia.com/mig-1g.10gb.me).
    resources = {"nvidia.com/gpu": str(event.gpu_count * event.gpu_replicas),
                 **{k: str(v) for k, v in event.allocatable.items()
                    if k.startswith("nvidia.com/mig-")}}
    node = gpu_node(event.node, event.gpu_count * event.gpu_replicas, labels=labels,
                    resources={} if dra else resources)
    if event.unschedulable:
        node["spec"]["unschedulable"] = True
    if event.taints:  # a spot node's termination notice, a cordon's taint
        node["spec"]["taints"] = [{"key": t.key, "effect": t.effect,
                                   **({"value": t.value} if t.value is not None else {})}
                                  for t in event.taints]
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
        self._any_dra = any(g.allocation == "dra" for g in cluster.scenario.nodes)

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
            self._create_pod(self._workload(event.namespace, event.name), event.cluster_queue)
        # "admitted" needs no write: the allocation event that follows binds the pod.

    async def allocation(self, event: AllocationEvent) -> None:
        if isinstance(event, NodeInventory):
            self._node(event)
        else:
            self._pod(event)

    def _node(self, event: NodeInventory) -> None:
        simulated = self.cluster.nodes.get(event.node)
        dra = simulated is not None and simulated.dra
        node = node_for(event, dra)
        try:
            current = self.api.get("Node", event.node)
        except KeyError:
            if event.deleted:
                return
            self.api.create(node)
            if dra:  # the DRA driver's kubelet plugin publishes the node's devices
                assert simulated is not None
                self.api.create(node_slice(simulated))
            return
        if event.deleted:  # a reclaimed spot node: the cloud took it, Karpenter deletes it
            self.api.delete("Node", event.node)
            return
        # What the executor wrote stays (a cordon, its gpusteward.io/ taints): the simulated
        # cluster learns of it at its next tick, and an inventory sent before must not undo it.
        spec, kept = node["spec"], current.get("spec") or {}
        if kept.get("unschedulable"):
            spec["unschedulable"] = True
        ours = [t for t in kept.get("taints") or [] if t["key"].startswith("gpusteward.io/")]
        if ours:
            spec["taints"] = [*spec.get("taints", []), *ours]
        node["metadata"] = {**current["metadata"], "labels": node["metadata"]["labels"]}
        self.api.update(node)

    def _pod(self, event: PodAllocation) -> None:
        name, namespace = event.pod.name, event.pod.namespace
        # Looked up only in a world with DRA nodes: it scans every simulated workload.
        workload = self._workload(namespace, name) if self._any_dra else None
        dra = workload is not None and self.cluster.scenario.asks_through_dra(workload.spec)
        shared = self._shared_claim(workload) if dra and workload is not None else None
        if event.phase == "deleted":
            self.api.delete("Pod", name, namespace=namespace)
            if shared is not None:
                self._release(shared, namespace, name)
            elif dra:  # owned by the pod: the garbage collector deletes it
                self.api.delete("ResourceClaim", dra_claim_name(name), namespace, DRA_GROUP)
            return
        try:
            pod = self.api.get("Pod", name, namespace=namespace)
        except KeyError:  # first seen placed: created, bound and started at once
            workload = workload or self._workload(namespace, name)
            pod = pod_for(workload, self.cluster.scenario.cluster_queue, dra, shared)
            self._create_owners(workload)
            if dra:
                self._make_claim(workload, pod, shared)
            if dra and event.phase in ("bound", "running"):
                self._allocate(workload, pod)
            bind_and_start(pod, event)
            self.api.create(pod)
            return
        if dra and event.phase in ("bound", "running"):
            assert workload is not None
            self._allocate(workload, pod)  # the scheduler, before it binds the pod
        self.api.mutate("Pod", name, lambda pod: bind_and_start(pod, event),
                        namespace=namespace)
        if shared is not None and event.phase == "finished":
            self._release(shared, namespace, name)
        elif dra and event.phase == "finished":
            # The resourceclaim controller releases the claim of a pod that is done.
            self.api.mutate("ResourceClaim", dra_claim_name(name),
                            lambda claim: claim.update(status={}), namespace, DRA_GROUP)

    def _shared_claim(self, workload: Workload) -> str | None:
        group = self.cluster.scenario.shared_dra_group(workload.spec)
        return None if group is None else dra_shared_claim_name(group)

    def _make_claim(self, workload: Workload, pod: dict[str, Any],
                    shared: str | None) -> None:
        """The pod's claim: the shared one, made once, or the resourceclaim controller's
        from the pod's template."""
        if shared is None:
            self.api.create(template_for(workload))
            self.api.create(claim_for(workload, pod))
            return
        try:
            self.api.get("ResourceClaim", shared, workload.namespace, DRA_GROUP)
        except KeyError:
            self.api.create(resource_claim(shared, workload.namespace))

    def _release(self, claim: str, namespace: str, pod: str) -> None:
        """The scheduler's reservation of a shared claim for ``pod`` ends; the claim is
        deallocated once it is reserved for no pod."""
        def release(obj: dict[str, Any]) -> None:
            status = obj.get("status") or {}
            kept = [c for c in status.get("reservedFor") or [] if c.get("name") != pod]
            obj["status"] = {**status, "reservedFor": kept} if kept else {}

        self.api.mutate("ResourceClaim", claim, release, namespace, DRA_GROUP)

    def _create_pod(self, workload: Workload, cluster_queue: str) -> None:
        self._create_owners(workload)
        dra = self.cluster.scenario.asks_through_dra(workload.spec)
        shared = self._shared_claim(workload) if dra else None
        pod = pod_for(workload, cluster_queue, dra, shared)
        if dra:  # the resourceclaim controller makes the pod's claim from its template
            self._make_claim(workload, pod, shared)
        self.api.create(pod)

    def _allocate(self, workload: Workload, pod: dict[str, Any]) -> None:
        """Allocate the pod's claim to the devices the simulator placed it on (a shared
        claim once, then reserved for each of its pods too)."""
        assert workload.node is not None
        node = workload.node
        names = dra_device_names(node)
        shared = self._shared_claim(workload)
        claim = shared or dra_claim_name(workload.name)
        status = self.api.get("ResourceClaim", claim, workload.namespace,
                              DRA_GROUP)["status"]
        if status.get("allocation"):
            reserved = status.get("reservedFor") or []
            if shared is not None and all(c.get("name") != workload.name for c in reserved):
                consumer = {"resource": "pods", "name": workload.name,
                            "uid": pod["metadata"].get("uid", "")}
                self.api.mutate("ResourceClaim", claim, lambda c: c["status"].update(
                    reservedFor=[*c["status"].get("reservedFor", []), consumer]),
                    workload.namespace, DRA_GROUP)
            return
        self.api.mutate("ResourceClaim", claim, lambda c: allocate(
            c, node.name, [names[d.uuid] for d in workload.devices], [pod]),
            workload.namespace, DRA_GROUP)

    def _create_owners(self, workload: Workload) -> None:
        size = self.cluster.gangs.get(f"{workload.namespace}/{workload.spec.group}", 0)
        for owner in owners_for(workload, size):
            try:
                self.api.get(owner["kind"], owner["metadata"]["name"],
                             namespace=workload.namespace,
                             group=owner["apiVersion"].rpartition("/")[0])
            except KeyError:
                self.api.create(owner)
