"""API objects -> the contract's events: pure, no I/O, no clock of its own.

:class:`Translator` turns each delta the reflectors deliver into
:class:`PodAllocation` and :class:`NodeInventory` keyed by node, and
:class:`QueueEvent` keyed by cluster queue for Kueue workloads and for GPU
pods still waiting for a node. It emits only when the event's content
changes (a pod's status churns far more often than its GPU holding), so a
relist or a status heartbeat costs nothing downstream.

Longer than ~400 lines on purpose: the helpers below (owner chain, workload
kind, GPU requests, MIG names, spot, Kueue states) are each used by one
branch of the Translator, and together they are the one mapping of API
objects onto the contract; split apart, a reader would chase one mapping
across files.

Workload kind rule (``PodAllocation.workload_kind``): the pod label named by
``workload_kind_label`` (``gpusteward.io/workload-kind``) wins when it says
notebook, batch or inference; otherwise a notebook is a pod of a Kubeflow
Notebook (label ``notebook-name``) or a JupyterHub single-user server
(``component=singleuser-server``); inference is a pod of a Deployment, a
KServe InferenceService, a Knative Service or a LeaderWorkerSet, or a plain
StatefulSet; batch is a pod under a Job, CronJob, JobSet, RayJob,
RayCluster or a Kubeflow training job (PyTorchJob, MPIJob, TFJob, ...).
A bare pod has no kind (``None``).

Owner chain: the top owner is resolved from the pod's controller reference
and the labels the controllers stamp on their pods (``pod-template-hash``
for Deployment -> ReplicaSet, ``jobset.sigs.k8s.io/jobset-name`` for
JobSet -> Job, ``ray.io/originated-from-crd``/``-cr-name`` for RayJob ->
RayCluster, ``notebook-name`` for Notebook -> StatefulSet), so no GET of
ReplicaSets or Jobs is needed. A CronJob's Job is reported as the Job.

Gangs (``gang``, ``gang_size`` on pod and queue events): pods that only work
together. A pod's gang is its Kueue pod group (label
``kueue.x-k8s.io/pod-group-name``, size from the annotation
``kueue.x-k8s.io/pod-group-total-count``), its coscheduling PodGroup (label
``scheduling.x-k8s.io/pod-group``) or Volcano PodGroup (annotation
``scheduling.k8s.io/group-name``), else its top owner when that is a JobSet
or a Kubeflow training job. Sizes come from the objects that state them: a
Kueue Workload's pod sets (the gang of its owner), a PodGroup's
``minMember``, a JobSet's replicated jobs and a training job's replica specs
(GPU replicas only: a launcher without a GPU never shows up as a member; an elastic
PyTorchJob's workers count up to its ``elasticPolicy.minReplicas``, the workers
torchrun needs to train, not the most it may scale to). A
gang member pod is reported on the queue topic through its whole life, so the
fleet agent sees every member in one place; a size learnt after its members
were reported is sent again with their latest events. A pod that waited for
a node is followed the same way once bound (admitted, finished, deleted).

Dynamic Resource Allocation (:mod:`.dra`): a bound pod's ResourceClaims of
the watched drivers add their GPUs and MIG devices to what it holds, named by
uuid in ``device_ids``; a pod (or a Kueue workload's pod set) waiting for DRA
devices asks for what its claims' device requests (or their templates') ask, as
if it requested ``nvidia.com/gpu`` or ``nvidia.com/mig-<profile>``; a node
advertising no GPU resource counts what its ResourceSlices publish.

MIG: under the ``mixed`` strategy a pod's ``nvidia.com/mig-<profile>``
requests become ``mig={profile: count}``; under ``single`` the node
advertises MIG devices as ``nvidia.com/gpu`` and labels
``nvidia.com/gpu.product=<model>-MIG-<profile>``, so a pod's
``nvidia.com/gpu`` on such a node is reported as ``mig={profile: count}``
with ``gpus=0``, and the node's ``gpu_count`` is 0 (no whole GPUs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import datetime

import msgspec

from gpusteward.collectors.kubernetes.dra import DRA_RESOURCES, DraIndex, Held, pod_claims
from gpusteward.collectors.kubernetes.reflector import Delta, Obj
from gpusteward.collectors.kubernetes.settings import KubeWatchSettings
from gpusteward.owners import pod_gang, quantity, top_owner
from gpusteward.schema import (
    KUEUE_GATED,
    MIG_RESOURCE_PREFIX,
    WORKLOAD_KINDS,
    AllocationEvent,
    NodeInventory,
    PodAllocation,
    PodPhase,
    PodRef,
    PodSet,
    QueueEvent,
    Taint,
    WorkloadState,
    mig_resource_profile,
)
from gpusteward.schema import single_strategy_profile as product_profile

GPU = "nvidia.com/gpu"
MIG_PREFIX = MIG_RESOURCE_PREFIX
KUEUE_GROUP = "kueue.x-k8s.io"
LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_COUNT = "nvidia.com/gpu.count"
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_REPLICAS = "nvidia.com/gpu.replicas"
LABEL_SHARING = "nvidia.com/gpu.sharing-strategy"
LABEL_MIG_CAPABLE = "nvidia.com/mig.capable"
LABEL_MIG_CONFIG = "nvidia.com/mig.config"
LABEL_MIG_CONFIG_STATE = "nvidia.com/mig.config.state"
LABEL_MIG_STRATEGY = "nvidia.com/mig.strategy"
LABEL_CLUSTER_QUEUE = "kueue.x-k8s.io/cluster-queue-name"
LABEL_LOCAL_QUEUE = "kueue.x-k8s.io/local-queue-name"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"
"""The scheduling gate Kueue puts on the pods it manages until their Workload is admitted."""

SPOT_NODE_LABELS: dict[str, tuple[str, ...]] = {
    "karpenter.sh/capacity-type": ("spot",),
    "eks.amazonaws.com/capacityType": ("SPOT",),
    "cloud.google.com/gke-spot": ("true",),
    "cloud.google.com/gke-preemptible": ("true",),
    "kubernetes.azure.com/scalesetpriority": ("spot",),
}
"""Node labels that mark spot capacity (Karpenter, EKS managed node groups, GKE, AKS)."""

SPOT_TAINT_KEYS = frozenset({
    "kubernetes.azure.com/scalesetpriority",
    "cloud.google.com/gke-spot",
    "cloud.google.com/gke-preemptible",
    "karpenter.sh/capacity-type",
    "aws-node-termination-handler/spot-itn",
    "karpenter.sh/disrupted",
    "cloud.google.com/impending-node-termination",
})
"""Taint keys whose toleration marks a pod as willing to run on (and be interrupted on) spot."""

DROPPED_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)
"""Annotations too large and too useless to carry on every event."""

BATCH_OWNERS = frozenset({"Job", "CronJob", "JobSet", "RayJob", "RayCluster", "PyTorchJob",
                          "MPIJob", "TFJob", "XGBoostJob", "PaddleJob", "JAXJob", "TrainJob",
                          "Workflow"})
INFERENCE_OWNERS = frozenset({"Deployment", "StatefulSet", "InferenceService",
                              "KnativeService", "LeaderWorkerSet"})

GANG_RESOURCES = frozenset({"podgroups", "jobsets", "pytorchjobs", "mpijobs", "tfjobs"})
"""Resources whose objects state a gang's size (see :func:`gang_size_of`)."""


def parse_time(value: str | None) -> float | None:
    """RFC 3339 -> Unix seconds; None stays None."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def mig_profile(resource: str) -> str | None:
    """The MIG profile of a resource name (:func:`gpusteward.schema.mig_resource_profile`)."""
    return mig_resource_profile(resource)


def _container_gpus(container: Obj) -> dict[str, int]:
    """The GPU and MIG resources one container names (a limit stands for a missing
    request, as the API server defaults it)."""
    resources = container.get("resources") or {}
    merged = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    return {k: quantity(v) for k, v in merged.items() if k == GPU or k.startswith(MIG_PREFIX)}


def gpu_resources(spec: Obj) -> dict[str, int]:
    """The effective GPU and MIG requests of a pod spec, as the scheduler computes them
    (``PodRequests`` in k8s.io/component-helpers): the app containers' sum plus every
    sidecar's (an init container with ``restartPolicy: Always`` runs beside them), or more
    when an init container needs more, counted with the sidecars started before it."""
    of = _container_gpus

    def add(into: dict[str, int], more: dict[str, int]) -> None:
        for name, count in more.items():
            into[name] = into.get(name, 0) + count

    total: dict[str, int] = {}
    for container in spec.get("containers") or []:
        add(total, of(container))
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for init in spec.get("initContainers") or []:
        needs = of(init)
        if init.get("restartPolicy") == "Always":
            add(total, needs)
            add(sidecars, needs)
            needs = dict(sidecars)
        else:
            add(needs, sidecars)
        for name, count in needs.items():
            init_peak[name] = max(init_peak.get(name, 0), count)
    for name, count in init_peak.items():
        total[name] = max(total.get(name, 0), count)
    return {k: v for k, v in total.items() if v > 0}


def _gpu_containers(spec: Obj) -> list[Obj]:
    """A pod spec's containers that ask for GPUs or MIG devices (sidecars included), in
    order; every app container where none does (a pod whose GPUs come from a resource
    claim)."""
    containers = (spec.get("containers") or []) + [
        init for init in spec.get("initContainers") or []
        if init.get("restartPolicy") == "Always"]
    return [c for c in containers if _container_gpus(c)] or spec.get("containers") or []


def gpu_images(spec: Obj) -> list[str]:
    """The images of a pod spec's GPU containers (:func:`_gpu_containers`), once each."""
    return list(dict.fromkeys(str(c["image"]) for c in _gpu_containers(spec)
                              if c.get("image")))[:64]


MEMORY_GROWS = {"TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
"""Environment values with which TensorFlow or JAX take GPU memory as they need it instead
of reserving a pool at start (compared without case)."""


def memory_grows(spec: Obj) -> bool:
    """Whether a GPU container's environment (its literal values) turns its framework's
    memory pool off (:data:`MEMORY_GROWS`)."""
    return any(str(env.get("value", "")).strip().lower() == MEMORY_GROWS[env.get("name", "")]
               for container in _gpu_containers(spec)
               for env in container.get("env") or []
               if env.get("name") in MEMORY_GROWS)


@dataclass
class NodeView:
    """What the translator keeps of a node to interpret the pods on it."""

    strategy: str | None
    single_profile: str | None


def single_strategy_profile(labels: dict[str, str]) -> str | None:
    """The MIG profile a ``single``-strategy node advertises as ``nvidia.com/gpu``."""
    if labels.get(LABEL_MIG_STRATEGY) != "single":
        return None
    return product_profile(labels.get(LABEL_PRODUCT))


def workload_kind(labels: dict[str, str], owner_kind: str | None, label: str) -> str | None:
    stated = labels.get(label)
    if stated in WORKLOAD_KINDS:
        return stated
    if owner_kind == "Notebook" or "notebook-name" in labels or \
            labels.get("component") == "singleuser-server":
        return "notebook"
    if "serving.kserve.io/inferenceservice" in labels or "serving.knative.dev/service" in labels:
        return "inference"
    if owner_kind in BATCH_OWNERS:
        return "batch"
    if owner_kind in INFERENCE_OWNERS:
        return "inference"
    return None


def _interned(labels: dict[str, str]) -> dict[str, str]:
    """A copy with interned keys: thousands of pods share a handful of label keys."""
    return {sys.intern(k): v for k, v in labels.items()}


def spot_tolerant(spec: Obj) -> bool:
    for toleration in spec.get("tolerations") or []:
        key = toleration.get("key")
        if key in SPOT_TAINT_KEYS or (not key and toleration.get("operator") == "Exists"):
            return True
    return False


def _conditions(status: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in status.get("conditions") or [] if "type" in c}


def _true(conditions: dict[str, Obj], kind: str) -> bool:
    return conditions.get(kind, {}).get("status") == "True"


def workload_state(conditions: dict[str, Obj]) -> tuple[WorkloadState, str | None]:
    """A Kueue Workload's state and the reason of the condition that decided it."""
    for kind, state in (("Finished", "finished"), ("Admitted", "admitted")):
        if _true(conditions, kind):
            return state, conditions[kind].get("reason")  # type: ignore[return-value]
    if _true(conditions, "Evicted"):
        if _true(conditions, "Requeued"):
            return "requeued", conditions["Requeued"].get("reason")
        reason = conditions["Evicted"].get("reason")
        if _true(conditions, "Preempted"):
            reason = f"Preempted/{conditions['Preempted'].get('reason')}"
        return "evicted", reason
    if _true(conditions, "Requeued"):
        return "requeued", conditions["Requeued"].get("reason")
    reserved = conditions.get("QuotaReserved", {})
    return "pending", reserved.get("reason")


def _gpu_template(template: Obj | None) -> bool:
    """Whether a pod template requests GPUs or MIG devices."""
    return bool(gpu_resources(((template or {}).get("spec")) or {}))


def gang_size_of(resource: str, obj: Obj) -> tuple[str, int] | None:
    """(gang, members it needs) stated by a PodGroup, JobSet or training job; None when the
    object states none (or has no GPU members)."""
    meta, spec = obj["metadata"], obj.get("spec") or {}
    name = meta["name"]
    if resource == "podgroups":
        min_member = spec.get("minMember")
        return (f"PodGroup/{name}", int(min_member)) if min_member else None
    if resource == "jobsets":
        size = 0
        for replicated in spec.get("replicatedJobs") or []:
            job = ((replicated.get("template") or {}).get("spec")) or {}
            if _gpu_template(job.get("template")):
                size += int(replicated.get("replicas", 1)) * int(job.get("parallelism", 1))
        return (f"JobSet/{name}", size) if size else None
    kind = obj.get("kind") or ""
    # An elastic PyTorchJob (elasticPolicy.minReplicas) runs torchrun --nnodes=min:max: it
    # trains once minReplicas of its workers have joined, so those are all it needs.
    elastic_min = (spec.get("elasticPolicy") or {}).get("minReplicas")
    size = sum(min(int(replica.get("replicas", 1)), int(elastic_min))
               if role == "Worker" and elastic_min is not None
               else int(replica.get("replicas", 1))
               for key, replicas in spec.items() if key.endswith("ReplicaSpecs")
               for role, replica in (replicas or {}).items()
               if _gpu_template(replica.get("template")))
    return (f"{kind}/{name}", size) if kind and size else None


def workload_gang(workload: Obj) -> tuple[str | None, int | None]:
    """A Kueue Workload's gang (its owner) and the GPU pods it needs, when more than one."""
    meta, spec = workload["metadata"], workload.get("spec") or {}
    refs = meta.get("ownerReferences") or []
    owner = next((r for r in refs if r.get("controller")), refs[0] if refs else None)
    size = sum(int(pod_set.get("minCount") or pod_set.get("count", 1))
               for pod_set in spec.get("podSets") or []
               if _gpu_template(pod_set.get("template")))
    if owner is None or size < 2:
        return None, None
    if owner.get("kind") == "TrainJob":
        # Kubeflow Trainer runs a TrainJob as the JobSet of its name, whose pods name the
        # JobSet (pod_gang): that is the gang this Workload admits.
        return f"JobSet/{owner.get('name')}", size
    return f"{owner.get('kind')}/{owner.get('name')}", size


@dataclass
class _PodMemo:
    last: PodAllocation | None = None
    queued: QueueEvent | None = None
    """The open pending-pod queue event, while the pod waits for a node."""
    resources: dict[str, int] = field(default_factory=dict)
    """The pod's GPU and MIG requests as the API states them (before the node's MIG view)."""
    member: QueueEvent | None = None
    """The last queue event, once bound, of a pod that waited or of a gang member
    (admitted, then finished)."""
    gang: str | None = None
    """``namespace/gang`` of a gang member."""
    ungated_at: float | None = None
    """When a pod seen held at Kueue's admission gate was first seen without it."""
    gated: bool = False
    dra: _DraMemo | None = None
    """A bound pod with DRA claims: what the translator keeps of them. None for the many
    pods without: their memo carries nothing more."""


@dataclass
class _DraMemo:
    base: PodAllocation
    """The pod's allocation before its DRA devices, to add them to when a claim or a
    slice resolves later."""
    claims: list[str] = field(default_factory=list)
    """``namespace/name`` of the claims the pod names (see :mod:`.dra`)."""
    held: dict[str, Held] = field(default_factory=dict)
    """What each resolved claim gives the pod: kept for the pod's life, as a claim reserved
    for a pod keeps its allocation until the pod is done (its release after the pod's end
    must not look like the pod letting go of its GPUs while it runs)."""
    said: bool = False
    """Whether a claim the watcher cannot resolve was reported for it."""


Emitted = AllocationEvent | QueueEvent


def _unindex(index: dict[str, dict[str, None]], name: str, key: str) -> None:
    keys = index.get(name)
    if keys is not None:
        keys.pop(key, None)
        if not keys:
            del index[name]


@dataclass
class Translator:
    """Turns deltas into contract events; emits only what changed. No I/O, no clock."""

    settings: KubeWatchSettings = field(default_factory=KubeWatchSettings)
    nodes: dict[str, NodeView] = field(default_factory=dict)
    node_events: dict[str, NodeInventory] = field(default_factory=dict)
    node_stated: dict[str, NodeInventory] = field(default_factory=dict)
    """A node's inventory as the Node object states it, before its DRA slices' devices."""
    pods: dict[str, _PodMemo] = field(default_factory=dict)
    workloads: dict[str, QueueEvent] = field(default_factory=dict)
    local_queues: dict[str, str] = field(default_factory=dict)
    """namespace/name of a LocalQueue -> its ClusterQueue."""
    local_queue_names: dict[str, str] = field(default_factory=dict)
    """A LocalQueue's object key -> its namespace/name (a relist reports deletions by key)."""
    gang_sizes: dict[str, int] = field(default_factory=dict)
    """``namespace/gang`` -> members it needs, from the objects that state it."""
    gang_objects: dict[str, str] = field(default_factory=dict)
    """``resource/key`` of an object that states a gang's size -> the gang: its deletion
    forgets the size (a relist reports deletions by key). Without it the watcher kept the
    size of every gang it ever saw."""
    gang_pods: dict[str, dict[str, None]] = field(default_factory=dict)
    """``namespace/gang`` -> the keys of its members' pods (in the order first seen)."""
    node_pods: dict[str, dict[str, None]] = field(default_factory=dict)
    """Node -> the keys of the pods last seen bound to it. With ``gang_pods``, what a node's
    or a gang's news touches is found without a scan of every pod: on a first list of
    1,250 nodes and 20,000 pods, each node's first sight had looked at every pod."""
    dra: DraIndex = field(init=False)
    dra_watched: bool = False
    """Whether claims and slices are watched (resource.k8s.io/v1 served); set by the watcher
    before it lists pods. Without them a pod's claims cannot be resolved."""
    claim_pods: dict[str, dict[str, None]] = field(default_factory=dict)
    """``namespace/name`` of a claim -> the keys of the bound pods naming it."""
    dra_waiting: dict[str, None] = field(default_factory=dict)
    """Keys of the bound pods with a claim not resolved yet: what a claim's or a slice's
    news may complete."""
    dra_unread: dict[str, Obj] = field(default_factory=dict)
    """Pods waiting with a claim or template not seen yet, by key: read again when one
    comes. Usually empty (claims and templates are listed before pods, and made before
    their pods)."""
    dra_unresolved: list[tuple[str, str, list[str]]] = field(default_factory=list)
    """(namespace, pod, reasons) of the pods with a claim the watcher cannot resolve, once
    per pod, for the watcher to report (and clear)."""

    def __post_init__(self) -> None:
        self.dra = DraIndex(frozenset(self.settings.dra_drivers))

    def apply(self, delta: Delta, ts: float) -> list[Emitted]:
        if delta.resource == "nodes":
            return self._node(delta, ts)
        if delta.resource == "pods":
            return self._pod(delta, ts)
        if delta.resource == "workloads":
            return self._workload(delta, ts)
        if delta.resource == "localqueues":
            self._local_queue(delta)
        if delta.resource in DRA_RESOURCES:
            if delta.resource == "resourceslices":
                out: list[Emitted] = []
                for node in sorted(self.dra.on_slice(delta)):
                    inventory = self.node_stated.get(node)
                    if inventory is not None:
                        out += self._node_event(msgspec.structs.replace(inventory, ts=ts))
                return out + self._dra_refresh(list(self.dra_waiting), ts)
            if delta.resource == "resourceclaimtemplates":
                self.dra.on_template(delta)
                return self._dra_reread(ts)
            claim = self.dra.on_claim(delta)
            return self._dra_reread(ts) + self._dra_refresh(
                [key for key in self.claim_pods.get(claim or "", ())
                 if key in self.dra_waiting], ts)
        # A gang resource's reflector is named plural.group (two groups serve podgroups).
        plural = delta.resource.partition(".")[0]
        if plural in GANG_RESOURCES:
            source = f"{delta.resource}/{delta.key}"
            if delta.type == "DELETED":
                gang = self.gang_objects.pop(source, None)
                if gang is not None and gang not in self.gang_objects.values():
                    self.gang_sizes.pop(gang, None)  # no other object states it
                return []
            stated = gang_size_of(plural, delta.obj) if delta.obj is not None else None
            if delta.obj is not None and stated is not None:
                namespace = delta.obj["metadata"].get("namespace", "")
                gang = self.gang_objects[source] = f"{namespace}/{stated[0]}"
                return self._gang_size(gang, stated[1], ts)
        return []

    def _gang_size(self, gang: str, size: int, ts: float) -> list[Emitted]:
        """Learn a gang's size; send its members' latest queue events and the allocations
        of those holding GPUs again with it (the node join tells a gang of one, reclaimed
        as a lone pod, from a member, reclaimed only with its gang: a first list reads the
        pods before the objects that state the sizes)."""
        if self.gang_sizes.get(gang) == size:
            return []
        self.gang_sizes[gang] = size
        out: list[Emitted] = []
        for key in self.gang_pods.get(gang, ()):
            memo = self.pods[key]
            for attr in ("queued", "member", "last"):
                event = getattr(memo, attr)
                if event is None or event.gang_size == size or (
                        isinstance(event, PodAllocation)
                        and event.phase not in ("bound", "running")):
                    continue  # an allocation that ended holds nothing: not sent again
                event = msgspec.structs.replace(event, ts=ts, gang_size=size)
                setattr(memo, attr, event)
                out.append(event)
        return out

    # nodes

    def _node(self, delta: Delta, ts: float) -> list[Emitted]:
        name = delta.key
        if delta.type == "DELETED":
            self.nodes.pop(name, None)
            self.node_stated.pop(name, None)
            last = self.node_events.pop(name, None)
            if last is None:
                return []
            return [msgspec.structs.replace(last, ts=ts, deleted=True)]
        assert delta.obj is not None
        event = self.node_inventory(delta.obj, ts)
        last = self.node_stated.get(name)
        if last is not None and GPU in last.capacity and GPU not in event.capacity:
            # Its GPUs left the node's status altogether (a kubelet restarted after the
            # device plugin went): say 0, or the worker, reading an inventory that states
            # nothing, kept the node's last count and offered it all as free.
            event = msgspec.structs.replace(event, capacity={**event.capacity, GPU: 0},
                                            allocatable={**event.allocatable, GPU: 0})
        labels = event.labels
        view = NodeView(labels.get(LABEL_MIG_STRATEGY), single_strategy_profile(labels))
        previous_view = self.nodes.get(name)
        self.nodes[name] = view
        self.node_stated[name] = event
        out = self._node_event(event)
        if previous_view != view:
            out += self._reinterpret_pods(name, ts)
        return out

    def _node_event(self, stated: NodeInventory) -> list[Emitted]:
        """The node's inventory, with its DRA devices where no device plugin advertises
        GPUs, when it changed."""
        event = stated
        published = self.dra.node_capacity(stated.node)
        if published and not any(stated.capacity.values()):
            # A DRA node (no device plugin advertises a GPU, or one no longer does): its
            # slices say what it has, as a device plugin's capacity would (whole GPUs, MIG
            # devices by profile); GFD's gpu.count label counts MIG-partitioned GPUs too.
            event = msgspec.structs.replace(stated, capacity=published,
                                            allocatable=dict(published),
                                            gpu_count=published.get(GPU, 0))
        last = self.node_events.get(stated.node)
        self.node_events[stated.node] = event
        if last is None or msgspec.structs.replace(last, ts=event.ts) != event:
            return [event]
        return []

    def _reinterpret_pods(self, node: str, ts: float) -> list[Emitted]:
        """Pods seen before their node, or across a MIG strategy change, in the node's view."""
        out: list[Emitted] = []
        for key in self.node_pods.get(node, ()):
            memo = self.pods[key]
            assert memo.last is not None  # indexed with it
            gpus, mig, _ = self._holding(memo, node)
            if (gpus, mig) != (memo.last.gpus, memo.last.mig):
                memo.last = msgspec.structs.replace(memo.last, ts=ts, gpus=gpus, mig=mig)
                out.append(memo.last)
        return out

    def node_inventory(self, node: Obj, ts: float) -> NodeInventory:
        meta, spec = node["metadata"], node.get("spec") or {}
        status = node.get("status") or {}
        labels: dict[str, str] = meta.get("labels") or {}

        def gpu_part(resources: Obj | None) -> dict[str, int]:
            return {k: quantity(v) for k, v in (resources or {}).items()
                    if k == GPU or k.startswith(MIG_PREFIX)}

        allocatable = gpu_part(status.get("allocatable"))
        capacity = gpu_part(status.get("capacity"))
        single = labels.get(LABEL_MIG_STRATEGY) == "single" and \
            single_strategy_profile(labels) is not None
        memory = labels.get(LABEL_MEMORY)
        capable = labels.get(LABEL_MIG_CAPABLE)
        # Time-slicing and MPS advertise each GPU as several nvidia.com/gpu: capacity counts
        # replicas, and the physical GPUs are capacity / replicas (GFD labels both).
        replicas = max(1, quantity(labels.get(LABEL_REPLICAS, 1)))
        advertised = capacity.get(GPU)
        physical = (quantity(labels.get(LABEL_COUNT, 0)) if advertised is None
                    else advertised // replicas)
        return NodeInventory(
            ts=ts, node=meta["name"], gpu_product=labels.get(LABEL_PRODUCT),
            gpu_count=0 if single else physical,
            gpu_replicas=replicas, gpu_sharing=labels.get(LABEL_SHARING),
            mig_strategy=labels.get(LABEL_MIG_STRATEGY), mig_config=labels.get(LABEL_MIG_CONFIG),
            allocatable=allocatable, labels=_interned(labels),
            taints=[Taint(t["key"], t.get("effect", ""), t.get("value"))
                    for t in spec.get("taints") or []],
            unschedulable=bool(spec.get("unschedulable")),
            spot=any(labels.get(k) in values for k, values in SPOT_NODE_LABELS.items()),
            capacity=capacity,
            gpu_memory_mib=quantity(memory) if memory else None,
            mig_capable=None if capable is None else capable == "true",
            mig_config_state=labels.get(LABEL_MIG_CONFIG_STATE),
        )

    # pods

    def _pod(self, delta: Delta, ts: float) -> list[Emitted]:
        memo = self.pods.get(delta.key)
        if delta.type == "DELETED":
            self.pods.pop(delta.key, None)
            if memo is None:
                return []
            if memo.gang is not None:
                _unindex(self.gang_pods, memo.gang, delta.key)
            if memo.last is not None:
                _unindex(self.node_pods, memo.last.node, delta.key)
            for claim in memo.dra.claims if memo.dra is not None else ():
                _unindex(self.claim_pods, claim, delta.key)
            self.dra_waiting.pop(delta.key, None)
            self.dra_unread.pop(delta.key, None)
            out: list[Emitted] = []
            last_queued = memo.queued or memo.member
            if last_queued is not None:
                out.append(msgspec.structs.replace(last_queued, ts=ts, state="deleted"))
            if memo.last is not None:
                out.append(msgspec.structs.replace(memo.last, ts=ts, phase="deleted"))
            return out
        assert delta.obj is not None
        pod = delta.obj
        spec = pod.get("spec") or {}
        resources = gpu_resources(spec)
        node = spec.get("nodeName")
        claimed = bool(spec.get("resourceClaims"))
        # What it waits for: its extended resources and what its DRA claims ask for (their
        # requests, or their templates' while no claim is made), read like them. A bound
        # pod's DRA holding is its claims' allocation instead (below).
        asked = resources
        self.dra_unread.pop(delta.key, None)
        if claimed:
            namespace = pod["metadata"].get("namespace", "")
            dra_asked = self.dra.asked(namespace, spec, pod.get("status"))
            if dra_asked is None and not node and self.dra_watched:
                self.dra_unread[delta.key] = pod  # until its claim or template is seen
            if dra_asked:
                asked = dict(resources)
                for resource, count in dra_asked.items():
                    asked[resource] = asked.get(resource, 0) + count
        # Not a GPU pod (nothing of it concerns the fleet); a bound pod with claims may hold
        # GPUs through them whatever they asked.
        if not asked and not (claimed and node):
            return []
        if memo is None:
            memo = self.pods[delta.key] = _PodMemo()
            gang, _ = pod_gang(pod["metadata"], *top_owner(pod["metadata"]))
            if gang is not None:
                memo.gang = f"{pod['metadata'].get('namespace', '')}/{gang}"
                self.gang_pods.setdefault(memo.gang, {})[delta.key] = None
        memo.resources = resources
        status = pod.get("status") or {}
        phase = status.get("phase", "Pending")
        out = []
        if not node:
            state: WorkloadState = "finished" if phase in ("Succeeded", "Failed") else "pending"
            queued = self._pending_pod(pod, asked, ts, state)
            # A pod Kueue holds at its admission gate waits as its Workload, which reports
            # it; once let through, its own wait for a node starts then, not at creation.
            if any(g.get("name") == KUEUE_ADMISSION_GATE for g in spec.get("schedulingGates")
                   or []):
                memo.gated = True
                queued = msgspec.structs.replace(queued, reason=KUEUE_GATED)
            elif memo.gated:
                memo.ungated_at = memo.ungated_at or ts
                queued = msgspec.structs.replace(queued, waiting_since=memo.ungated_at)
            if memo.queued is None or msgspec.structs.replace(memo.queued, ts=ts) != queued:
                out.append(queued)
            memo.queued = queued
            return out
        if asked and (memo.queued is not None or memo.member is not None
                      or memo.gang is not None):
            # A pod that waited is followed on the queue topic to its end (how long work
            # runs is the history the start ETAs need), and so is a gang member even when
            # first seen already bound (the gang rule needs every member).
            scheduled = _conditions(status).get("PodScheduled", {})
            base = memo.queued or memo.member or self._pending_pod(pod, asked, ts,
                                                                   "admitted")
            left: WorkloadState = "finished" if phase in ("Succeeded", "Failed") \
                else "admitted"
            event = msgspec.structs.replace(
                base, ts=ts, state=left, reason=None,
                admitted_at=base.admitted_at or parse_time(
                    scheduled.get("lastTransitionTime")) or ts)
            if memo.queued is not None or memo.member is None or \
                    msgspec.structs.replace(memo.member, ts=ts) != event:
                out.append(event)
            memo.member, memo.queued = event, None
        allocation: PodAllocation | None = self._allocation(pod, node, resources, phase, ts)
        if claimed:
            assert allocation is not None
            if memo.dra is None:
                memo.dra = _DraMemo(allocation)
            memo.dra.base = allocation
            for claim in pod_claims(pod):
                if claim not in memo.dra.claims:
                    memo.dra.claims.append(claim)
                    self.claim_pods.setdefault(claim, {})[delta.key] = None
            allocation = self._with_dra(delta.key, memo, allocation)
        return out + self._emitted(delta.key, memo, allocation)

    def _emitted(self, key: str, memo: _PodMemo, allocation: PodAllocation | None
                 ) -> list[Emitted]:
        """The pod's allocation when it changed (none yet for a pod holding no GPU)."""
        if allocation is None:
            return []
        out: list[Emitted] = []
        if memo.last is None or msgspec.structs.replace(memo.last, ts=allocation.ts) != \
                allocation:
            out.append(allocation)
        if memo.last is None or memo.last.node != allocation.node:
            if memo.last is not None:
                _unindex(self.node_pods, memo.last.node, key)
            self.node_pods.setdefault(allocation.node, {})[key] = None
        memo.last = allocation
        return out

    def _holding(self, memo: _PodMemo, node: str | None
                 ) -> tuple[int, dict[str, int], list[str]]:
        """(GPUs, MIG devices by profile, device uuids) a pod holds: its extended resources
        in its node's view, and its resolved DRA claims."""
        gpus, mig = self._gpus_and_mig(memo.resources, node)
        device_ids: list[str] = []
        for held in memo.dra.held.values() if memo.dra is not None else ():
            gpus += held.gpus
            for profile, count in held.mig:
                mig[profile] = mig.get(profile, 0) + count
            device_ids += held.device_ids
        return gpus, mig, device_ids

    def _with_dra(self, key: str, memo: _PodMemo, base: PodAllocation
                  ) -> PodAllocation | None:
        """A bound pod's allocation with its DRA devices; None while it holds no GPU."""
        reasons: list[str] = []
        if not self.dra_watched:
            reasons.append("ResourceClaims are not read: resource.k8s.io/v1 is not served "
                           "(Kubernetes before 1.34) or claims are not among the resources "
                           "watched")
        dra = memo.dra
        assert dra is not None
        for claim in dra.claims:
            if claim not in dra.held:
                held, reason = self.dra.resolve(claim, base.pod.uid, base.pod.name)
                if held is not None:
                    dra.held[claim] = held
                if reason is not None:
                    reasons.append(reason)
        if base.phase == "finished" or len(dra.held) == len(dra.claims):
            self.dra_waiting.pop(key, None)
        else:
            self.dra_waiting[key] = None
        if reasons and not dra.said:
            dra.said = True
            self.dra_unresolved.append((base.pod.namespace, base.pod.name, reasons))
        gpus, mig, device_ids = self._holding(memo, base.node)
        if not gpus and not mig and memo.last is None and not any(
                held.share for held in dra.held.values()):
            return None
        return msgspec.structs.replace(base, gpus=gpus, mig=mig, device_ids=device_ids)

    def _dra_refresh(self, keys: list[str], ts: float) -> list[Emitted]:
        """The allocations of waiting pods that a claim's or a slice's news completes."""
        out: list[Emitted] = []
        for key in keys:
            memo = self.pods.get(key)
            if memo is None or memo.dra is None:
                continue
            base = msgspec.structs.replace(memo.dra.base, ts=ts)
            out += self._emitted(key, memo, self._with_dra(key, memo, base))
        return out

    def _dra_reread(self, ts: float) -> list[Emitted]:
        """Waiting pods whose claims' requests were not known, read again now that a claim
        or a template came (a pod seen before its claim: they are watched apart)."""
        out: list[Emitted] = []
        for key, pod in list(self.dra_unread.items()):
            out += self._pod(Delta("pods", "MODIFIED", key, pod), ts)
        return out

    def _gpus_and_mig(self, resources: dict[str, int], node: str | None
                      ) -> tuple[int, dict[str, int]]:
        mig = {p: c for r, c in resources.items() if (p := mig_profile(r)) is not None}
        gpus = resources.get(GPU, 0)
        view = self.nodes.get(node or "")
        if gpus and view is not None and view.single_profile is not None:
            mig[view.single_profile] = mig.get(view.single_profile, 0) + gpus
            gpus = 0
        return gpus, mig

    def _allocation(self, pod: Obj, node: str, resources: dict[str, int], phase: str,
                    ts: float) -> PodAllocation:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        labels: dict[str, str] = meta.get("labels") or {}
        owner_kind, owner_name = top_owner(meta)
        gpus, mig = self._gpus_and_mig(resources, node)
        # Unknown (the node stopped reporting) still holds the devices as far as the API knows.
        our_phase: PodPhase = {"Running": "running", "Unknown": "running", "Succeeded": "finished",
                               "Failed": "finished"}.get(phase, "bound")  # type: ignore[assignment]
        annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                       if k not in DROPPED_ANNOTATIONS}
        gang, gang_size = self._gang_of(meta)
        return PodAllocation(
            ts=ts, node=node,
            pod=PodRef(namespace=meta.get("namespace", ""), name=meta["name"],
                       uid=meta.get("uid")),
            phase=our_phase, gpus=gpus, mig=mig,
            started_at=parse_time((pod.get("status") or {}).get("startTime")),
            owner_kind=owner_kind, owner_name=owner_name,
            workload_kind=workload_kind(labels, owner_kind, self.settings.workload_kind_label),
            queue=labels.get(LABEL_LOCAL_QUEUE) or labels.get(LABEL_QUEUE),
            priority_class=spec.get("priorityClassName"),
            labels=_interned(labels), annotations=annotations,
            spot_tolerant=spot_tolerant(spec), gang=gang, gang_size=gang_size,
            images=gpu_images(spec), memory_grows=memory_grows(spec),
        )

    def _pending_pod(self, pod: Obj, resources: dict[str, int], ts: float,
                     state: WorkloadState) -> QueueEvent:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        labels: dict[str, str] = meta.get("labels") or {}
        local = labels.get(LABEL_LOCAL_QUEUE) or labels.get(LABEL_QUEUE)
        namespace = meta.get("namespace", "")
        cluster_queue = labels.get(LABEL_CLUSTER_QUEUE) or (
            self.local_queues.get(f"{namespace}/{local}") if local else None
        ) or local or self.settings.default_cluster_queue
        gpus, mig = self._gpus_and_mig(resources, None)
        gang, size = self._gang_of(meta)
        return QueueEvent(
            ts=ts, name=meta["name"], namespace=namespace, cluster_queue=cluster_queue,
            state=state, queue=local, created_at=parse_time(meta.get("creationTimestamp")),
            gpus=gpus, mig=mig, priority=spec.get("priority"), kind="pod", uid=meta.get("uid"),
            priority_class=spec.get("priorityClassName"), gang=gang, gang_size=size,
        )

    def _gang_of(self, meta: Obj) -> tuple[str | None, int | None]:
        """A pod's gang and its size: stated on the pod, else learnt from its objects."""
        gang, size = pod_gang(meta, *top_owner(meta))
        if gang is None:
            return None, None
        return gang, size or self.gang_sizes.get(f"{meta.get('namespace', '')}/{gang}")

    # Kueue

    def _local_queue(self, delta: Delta) -> None:
        if delta.type == "DELETED":
            name = self.local_queue_names.pop(delta.key, None)
            if name is not None:
                self.local_queues.pop(name, None)
            return
        assert delta.obj is not None
        meta = delta.obj["metadata"]
        name = f"{meta.get('namespace', '')}/{meta['name']}"
        self.local_queue_names[delta.key] = name
        self.local_queues[name] = (delta.obj.get("spec") or {}).get("clusterQueue", "")

    def _workload(self, delta: Delta, ts: float) -> list[Emitted]:
        last = self.workloads.get(delta.key)
        if delta.type == "DELETED":
            self.workloads.pop(delta.key, None)
            if last is None:
                return []
            return [msgspec.structs.replace(last, ts=ts, state="deleted", reason=None)]
        assert delta.obj is not None
        event = self.workload_event(delta.obj, ts)
        self.workloads[delta.key] = event
        out: list[Emitted] = []
        if last is None or msgspec.structs.replace(last, ts=ts) != event:
            out.append(event)
        if event.gang is not None and event.gang_size is not None:
            out += self._gang_size(f"{event.namespace}/{event.gang}", event.gang_size, ts)
        return out

    def workload_event(self, workload: Obj, ts: float) -> QueueEvent:
        meta, spec = workload["metadata"], workload.get("spec") or {}
        status = workload.get("status") or {}
        conditions = _conditions(status)
        state, reason = workload_state(conditions)
        namespace = meta.get("namespace", "")
        local = spec.get("queueName")
        cluster_queue = (status.get("admission") or {}).get("clusterQueue") or (
            self.local_queues.get(f"{namespace}/{local}") if local else None
        ) or local or self.settings.default_cluster_queue
        resources: dict[str, int] = {}
        pod_sets: list[PodSet] = []
        for pod_set in spec.get("podSets") or []:
            count = int(pod_set.get("count", 1))
            template = (pod_set.get("template") or {}).get("spec") or {}
            per_pod = gpu_resources(template)
            if template.get("resourceClaims"):
                for name, value in (self.dra.asked(namespace, template) or {}).items():
                    per_pod[name] = per_pod.get(name, 0) + value
            if not per_pod or count < 1:
                continue
            for name, value in per_pod.items():
                resources[name] = resources.get(name, 0) + value * count
            pod_gpus, pod_mig = self._gpus_and_mig(per_pod, None)
            pod_sets.append(PodSet(count=count, gpus=pod_gpus, mig=pod_mig))
        gpus, mig = self._gpus_and_mig(resources, None)
        admitted = conditions.get("Admitted", {})
        # Back in the queue after an eviction: the wait counts from the requeue (as Kueue's
        # admission wait does), else the eviction, not from when the watcher saw it.
        back = conditions.get("Requeued") if _true(conditions, "Requeued") else \
            conditions.get("Evicted") if _true(conditions, "Evicted") else None
        priority_class = spec.get("priorityClassName") or (
            spec.get("priorityClassRef") or {}).get("name")
        gang, gang_size = workload_gang(workload)
        return QueueEvent(
            ts=ts, name=meta["name"], namespace=namespace, cluster_queue=cluster_queue,
            state=state, queue=local, created_at=parse_time(meta.get("creationTimestamp")),
            admitted_at=parse_time(admitted.get("lastTransitionTime"))
            if admitted.get("status") == "True" else None,
            gpus=gpus, mig=mig, priority=spec.get("priority"), kind="workload",
            uid=meta.get("uid"), priority_class=priority_class, reason=reason,
            active=spec.get("active", True), gang=gang, gang_size=gang_size,
            pod_sets=pod_sets,
            waiting_since=parse_time(back.get("lastTransitionTime"))
            if back is not None and state in ("evicted", "requeued") else None,
        )
