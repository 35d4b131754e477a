"""The Kubernetes watcher: pods, nodes and Kueue workloads as allocation and queue events.

The join needs the truth about who holds which GPU, so this module is the
one place gpusteward reads the Kubernetes API for it. It is shaped in two
halves:

- :class:`Reflector` (one per resource, in its own thread, because the
  official ``kubernetes`` client is synchronous) does list+watch with the
  semantics client-go's reflector has: a paged list, then a watch from the
  list's resourceVersion with bookmarks; a broken stream resumes from the
  last resourceVersion seen; 410 Gone (as an HTTP status or as an ``ERROR``
  event) and every ``resync_period_s`` start a relist that is diffed against
  what was already delivered, so deletions missed while disconnected come
  out as deletions and unchanged objects come out not at all. It remembers
  the resourceVersion delivered per object and never delivers the same one
  twice. Errors back off exponentially, with jitter, up to a cap. It reads
  raw JSON (``_preload_content=False``): the client's model classes cost
  milliseconds per pod, which a 10,000-pod relist cannot afford.
- :class:`Translator` (pure, no I/O, no clock of its own) turns each
  delivered object into the contract's events: :class:`PodAllocation` and
  :class:`NodeInventory` keyed by node, :class:`QueueEvent` keyed by cluster
  queue for Kueue workloads and for GPU pods still waiting for a node. It
  emits only when the event's content changes (a pod's status churns far
  more often than its GPU holding), so a relist or a status heartbeat costs
  nothing downstream.

:class:`KubeWatcher` wires the two onto an asyncio loop and a
:class:`~gpusteward.collectors.publisher.Publisher`.

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

MIG: under the ``mixed`` strategy a pod's ``nvidia.com/mig-<profile>``
requests become ``mig={profile: count}``; under ``single`` the node
advertises MIG devices as ``nvidia.com/gpu`` and labels
``nvidia.com/gpu.product=<model>-MIG-<profile>``, so a pod's
``nvidia.com/gpu`` on such a node is reported as ``mig={profile: count}``
with ``gpus=0``, and the node's ``gpu_count`` is 0 (no whole GPUs).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, Field

from gpusteward import edge
from gpusteward.collectors.publisher import Publisher
from gpusteward.errors import TemporaryError
from gpusteward.schema import (
    AllocationEvent,
    NodeInventory,
    PodAllocation,
    PodPhase,
    PodRef,
    QueueEvent,
    Taint,
    WorkloadState,
)

log = logging.getLogger(__name__)

Obj = dict[str, Any]
ResourceName = Literal["pods", "nodes", "workloads"]

GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
KUEUE_GROUP = "kueue.x-k8s.io"
LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_COUNT = "nvidia.com/gpu.count"
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_MIG_CAPABLE = "nvidia.com/mig.capable"
LABEL_MIG_CONFIG = "nvidia.com/mig.config"
LABEL_MIG_CONFIG_STATE = "nvidia.com/mig.config.state"
LABEL_MIG_STRATEGY = "nvidia.com/mig.strategy"
LABEL_CLUSTER_QUEUE = "kueue.x-k8s.io/cluster-queue-name"
LABEL_LOCAL_QUEUE = "kueue.x-k8s.io/local-queue-name"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"

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
WORKLOAD_KINDS = ("notebook", "batch", "inference")


class KubeWatchSettings(BaseModel):
    """What the watcher watches and how it talks to the API server."""

    kubeconfig: str | None = Field(
        None, description="Kubeconfig file. None: in-cluster config when running in a pod "
        "(KUBERNETES_SERVICE_HOST set), else the default kubeconfig (~/.kube/config).")
    context: str | None = Field(None, description="Kubeconfig context; None: the current one.")
    resources: list[ResourceName] = Field(
        ["nodes", "pods", "workloads"],
        description="Which resources to watch. Workloads are watched only where Kueue serves "
        "them; the watcher runs without Kueue and picks it up when it appears.")
    resync_period_s: float = Field(
        600.0, gt=0, description="Seconds between two full relists diffed against what was "
        "delivered. A relist costs one paged LIST; 10 min bounds how long a lost update "
        "(a bug anywhere on the path) can stay wrong.")
    watch_timeout_s: int = Field(
        300, ge=1, description="Server-side timeoutSeconds of one watch request. The watch "
        "is renewed from the last resourceVersion, so this only bounds a silent stall.")
    request_timeout_s: float = Field(
        30.0, gt=0, description="Connect and read timeout of LIST requests, seconds; a watch's "
        "read timeout is watch_timeout_s plus this.")
    page_size: int = Field(
        500, ge=1, description="Items per LIST page; 500 is client-go's default.")
    backoff_initial_s: float = Field(0.5, gt=0, description="First retry delay after an error.")
    backoff_max_s: float = Field(
        30.0, gt=0, description="Retry delay cap; delays double per consecutive failure.")
    kueue_versions: list[str] = Field(
        ["v1beta2", "v1beta1"], description="Kueue API versions in order of preference; the "
        "first one the server serves is used.")
    default_cluster_queue: str = Field(
        "default", description="Queue key of a pending pod that names no Kueue queue.")
    workload_kind_label: str = Field(
        "gpusteward.io/workload-kind", description="Pod label that states the workload kind "
        "(notebook, batch, inference) and overrides the owner-based rule.")


# -- reflector (thread side) -------------------------------------------------------------------


@dataclass(frozen=True)
class Delta:
    """One change of one object, as the reflector delivers it."""

    resource: str
    type: Literal["ADDED", "MODIFIED", "DELETED"]
    key: str
    obj: Obj | None
    """The object; None for a deletion found by a relist (the object is gone)."""


class Gone(TemporaryError):
    """The resourceVersion is too old (410): relist."""


class WatchError(TemporaryError):
    """The server ended a watch with an error other than 410."""


ListCall = Callable[..., Any]
"""A client ``list_*`` method (or a partial of one) that accepts list and watch arguments."""


@dataclass
class ReflectorStats:
    lists: int = 0
    watches: int = 0
    errors: int = 0
    gone: int = 0
    deltas: int = 0
    duplicates_skipped: int = 0
    malformed: int = 0
    """Objects or watch lines skipped as unreadable (no metadata, no name, no JSON)."""


def object_key(obj: Obj) -> str:
    """uid when present (a recreated pod is a different pod), else namespace/name."""
    meta = obj["metadata"]
    return meta.get("uid") or f"{meta.get('namespace', '')}/{meta['name']}"


def node_key(obj: Obj) -> str:
    """Nodes are keyed by name: the join and the topics know a node by its name only."""
    return str(obj["metadata"]["name"])


_decoder = msgspec.json.Decoder()


class Reflector:
    """List+watch of one resource in a thread; delivers :class:`Delta` lists in order."""

    def __init__(self, resource: str, list_call: ListCall,
                 deliver: Callable[[list[Delta]], None], settings: KubeWatchSettings,
                 stop: threading.Event, *, key_of: Callable[[Obj], str] = object_key,
                 sleep: Callable[[float], bool] | None = None) -> None:
        self.resource = resource
        self._key_of = key_of
        self._list_call = list_call
        self._deliver = deliver
        self._settings = settings
        self._stop = stop
        self._sleep = sleep or stop.wait
        self.known: dict[str, str] = {}
        """key -> the resourceVersion last delivered."""
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self.stats = ReflectorStats()
        self._response: Any = None
        self._next_resync = 0.0
        self.refusals = edge.Refusals(log)

    def run(self) -> None:
        delay = self._settings.backoff_initial_s
        while not self._stop.is_set():
            try:
                if self.resource_version is None or time.monotonic() >= self._next_resync:
                    self.relist()
                self.watch()
                delay = self._settings.backoff_initial_s
            except Gone:
                self.stats.gone += 1
                log.info("%s: resourceVersion %s expired, relisting", self.resource,
                         self.resource_version)
                self.resource_version = None
            except Exception as e:
                if self._stop.is_set():
                    return
                self.stats.errors += 1
                pause = delay * random.uniform(0.8, 1.2)
                log.warning("%s: %s; retrying in %.1f s", self.resource, _brief(e), pause)
                self._sleep(pause)
                delay = min(delay * 2, self._settings.backoff_max_s)

    def stop(self) -> None:
        """Unblock a watch read at once (the stop event must be set first)."""
        response = self._response
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def relist(self) -> None:
        """A full paged LIST diffed against what was delivered."""
        settings = self._settings
        items: list[Obj] = []
        token: str | None = None
        list_rv = ""
        while True:
            try:
                response = self._list_call(
                    limit=settings.page_size, _continue=token, _preload_content=False,
                    _request_timeout=(settings.request_timeout_s, settings.request_timeout_s))
            except Exception as e:
                if getattr(e, "status", None) == 410:
                    raise Gone() from e  # the continue token expired: start over
                raise
            page = _decoder.decode(_body(response))
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            list_rv = list_rv or meta.get("resourceVersion", "")
            token = meta.get("continue") or None
            if token is None:
                break
        self.stats.lists += 1
        seen: dict[str, str] = {}
        deltas: list[Delta] = []
        for obj in items:
            try:
                key = self._key_of(obj)
                version = str(obj["metadata"].get("resourceVersion", ""))
            except (KeyError, TypeError, AttributeError) as e:
                self._malformed(e, obj)
                continue
            seen[key] = version
            previous = self.known.get(key)
            if previous == version:
                self.stats.duplicates_skipped += 1
                continue
            deltas.append(Delta(self.resource, "ADDED" if previous is None else "MODIFIED",
                                key, obj))
        deltas += [Delta(self.resource, "DELETED", key, None)
                   for key in self.known.keys() - seen.keys()]
        self.known = seen
        self._next_resync = time.monotonic() + settings.resync_period_s
        # Counted and delivered before the resourceVersion moves on, so that an observer
        # that sees the new resourceVersion also sees these deltas as outstanding.
        self.stats.deltas += len(deltas)
        self._deliver(deltas)
        self.resource_version = list_rv
        self.synced.set()

    def watch(self) -> None:
        """One watch request from the current resourceVersion, until it ends or resync is due."""
        settings = self._settings
        try:
            response = self._list_call(
                watch=True, resource_version=self.resource_version, allow_watch_bookmarks=True,
                timeout_seconds=settings.watch_timeout_s, _preload_content=False,
                _request_timeout=(settings.request_timeout_s,
                                  settings.watch_timeout_s + settings.request_timeout_s))
        except Exception as e:
            # Most servers say 410 in an ERROR event, some (and proxies) as the HTTP status.
            if getattr(e, "status", None) == 410:
                raise Gone() from e
            raise
        self._response = response
        self.stats.watches += 1
        try:
            for line in _lines(response):
                if self._stop.is_set():
                    return
                try:
                    event = _decoder.decode(line)
                    self._on_event(event["type"], event["object"])
                except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as e:
                    # Skipped, not retried: the same watch would send it again. The next
                    # relist (resync_period_s) brings the object's state back.
                    self._malformed(e, line)
                if time.monotonic() >= self._next_resync:
                    return
        finally:
            self._response = None
            response.release_conn()

    def _malformed(self, error: BaseException, what: object) -> None:
        """Count one unreadable object or line and log it (once per kind at warning level)."""
        self.stats.malformed += 1
        self.refusals.note(type(error).__name__, "%s: skipping a malformed object (%s): %.200r",
                           self.resource, _brief(error), what)

    def _on_event(self, kind: str, obj: Obj) -> None:
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise WatchError(f"{obj.get('code')} {obj.get('reason')}: "
                             f"{str(obj.get('message'))[:200]}")
        version = obj["metadata"]["resourceVersion"]
        if kind == "BOOKMARK":
            self.resource_version = version
            return
        key = self._key_of(obj)
        if kind == "DELETED":
            if self.known.pop(key, None) is None:
                self.stats.duplicates_skipped += 1  # a relist already reported it gone
            else:
                self.stats.deltas += 1
                self._deliver([Delta(self.resource, "DELETED", key, obj)])
        elif self.known.get(key) == version:
            self.stats.duplicates_skipped += 1
        else:
            typ: Literal["ADDED", "MODIFIED"] = "ADDED" if key not in self.known else "MODIFIED"
            self.known[key] = version
            self.stats.deltas += 1
            self._deliver([Delta(self.resource, typ, key, obj)])
        self.resource_version = version


def _body(response: Any) -> bytes:
    data = response.data
    return data if isinstance(data, bytes) else bytes(data)


def _lines(response: Any) -> Iterator[bytes]:
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


def _brief(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:300] + "..."


# -- translation (pure) ------------------------------------------------------------------------


def parse_time(value: str | None) -> float | None:
    """RFC 3339 -> Unix seconds; None stays None."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def quantity(value: object) -> int:
    """An extended-resource quantity (always an integer count) as int."""
    try:
        return int(str(value))
    except ValueError:
        return int(float(str(value)))


def mig_profile(resource: str) -> str | None:
    """The MIG profile of a resource name, or None when it is not a MIG resource.

    ``nvidia.com/mig-1g.10gb`` -> ``1g.10gb``; ``nvidia.com/mig-1g.10gb.me`` ->
    ``1g.10gb+me`` (the device plugin writes a profile's ``+`` as ``.``).
    """
    if not resource.startswith(MIG_PREFIX):
        return None
    name = resource[len(MIG_PREFIX):]
    match = re.fullmatch(r"(\d+g\.\d+gb)\.(\w+)", name)
    return f"{match[1]}+{match[2]}" if match else name


def gpu_resources(spec: Obj) -> dict[str, int]:
    """The effective GPU and MIG requests of a pod spec (Kubernetes' init-container rule)."""

    def of(container: Obj) -> dict[str, int]:
        resources = container.get("resources") or {}
        merged = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        return {k: quantity(v) for k, v in merged.items()
                if k == GPU or k.startswith(MIG_PREFIX)}

    total: dict[str, int] = {}
    for container in spec.get("containers") or []:
        for name, count in of(container).items():
            total[name] = total.get(name, 0) + count
    for init in spec.get("initContainers") or []:
        for name, count in of(init).items():
            total[name] = max(total.get(name, 0), count)
    return {k: v for k, v in total.items() if v > 0}


@dataclass
class NodeView:
    """What the translator keeps of a node to interpret the pods on it."""

    strategy: str | None
    single_profile: str | None


def single_strategy_profile(labels: dict[str, str]) -> str | None:
    """The MIG profile a ``single``-strategy node advertises as ``nvidia.com/gpu``."""
    if labels.get(LABEL_MIG_STRATEGY) != "single":
        return None
    product = labels.get(LABEL_PRODUCT, "")
    _, sep, profile = product.rpartition("-MIG-")
    return profile if sep and profile != "INVALID" else None


def top_owner(meta: Obj) -> tuple[str | None, str | None]:
    """(kind, name) of the top of a pod's owner chain, from its controller ref and labels."""
    labels = meta.get("labels") or {}
    refs = meta.get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), refs[0] if refs else None)
    if ref is None:
        return None, None
    kind, name = ref.get("kind"), ref.get("name")
    if kind == "ReplicaSet" and (hash_ := labels.get("pod-template-hash")) and \
            name.endswith("-" + hash_):
        return "Deployment", name[: -len(hash_) - 1]
    if kind == "Job" and (jobset := labels.get("jobset.sigs.k8s.io/jobset-name")):
        return "JobSet", jobset
    if kind == "RayCluster" and labels.get("ray.io/originated-from-crd") == "RayJob":
        return "RayJob", labels.get("ray.io/originated-from-cr-name", name)
    if kind == "StatefulSet" and (notebook := labels.get("notebook-name")):
        return "Notebook", notebook
    return kind, name


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


@dataclass
class _PodMemo:
    last: PodAllocation | None = None
    queued: QueueEvent | None = None
    """The open pending-pod queue event, while the pod waits for a node."""
    resources: dict[str, int] = field(default_factory=dict)
    """The pod's GPU and MIG requests as the API states them (before the node's MIG view)."""


Emitted = AllocationEvent | QueueEvent


@dataclass
class Translator:
    """Turns deltas into contract events; emits only what changed. No I/O, no clock."""

    settings: KubeWatchSettings = field(default_factory=KubeWatchSettings)
    nodes: dict[str, NodeView] = field(default_factory=dict)
    node_events: dict[str, NodeInventory] = field(default_factory=dict)
    pods: dict[str, _PodMemo] = field(default_factory=dict)
    workloads: dict[str, QueueEvent] = field(default_factory=dict)
    local_queues: dict[str, str] = field(default_factory=dict)
    """namespace/name of a LocalQueue -> its ClusterQueue."""
    local_queue_names: dict[str, str] = field(default_factory=dict)
    """A LocalQueue's object key -> its namespace/name (a relist reports deletions by key)."""

    def apply(self, delta: Delta, ts: float) -> list[Emitted]:
        if delta.resource == "nodes":
            return self._node(delta, ts)
        if delta.resource == "pods":
            return self._pod(delta, ts)
        if delta.resource == "workloads":
            return self._workload(delta, ts)
        if delta.resource == "localqueues":
            self._local_queue(delta)
        return []

    # nodes

    def _node(self, delta: Delta, ts: float) -> list[Emitted]:
        name = delta.key
        if delta.type == "DELETED":
            self.nodes.pop(name, None)
            last = self.node_events.pop(name, None)
            if last is None:
                return []
            return [msgspec.structs.replace(last, ts=ts, deleted=True)]
        assert delta.obj is not None
        event = self.node_inventory(delta.obj, ts)
        labels = event.labels
        view = NodeView(labels.get(LABEL_MIG_STRATEGY), single_strategy_profile(labels))
        previous_view = self.nodes.get(name)
        self.nodes[name] = view
        last = self.node_events.get(name)
        self.node_events[name] = event
        out: list[Emitted] = []
        if last is None or msgspec.structs.replace(last, ts=ts) != event:
            out.append(event)
        if previous_view != view:
            out += self._reinterpret_pods(name, ts)
        return out

    def _reinterpret_pods(self, node: str, ts: float) -> list[Emitted]:
        """Pods seen before their node, or across a MIG strategy change, in the node's view."""
        out: list[Emitted] = []
        for memo in self.pods.values():
            if memo.last is None or memo.last.node != node:
                continue
            gpus, mig = self._gpus_and_mig(memo.resources, node)
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
        return NodeInventory(
            ts=ts, node=meta["name"], gpu_product=labels.get(LABEL_PRODUCT),
            gpu_count=0 if single else capacity.get(GPU, quantity(labels.get(LABEL_COUNT, 0))),
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
            out: list[Emitted] = []
            if memo.queued is not None:
                out.append(msgspec.structs.replace(memo.queued, ts=ts, state="deleted"))
            if memo.last is not None:
                out.append(msgspec.structs.replace(memo.last, ts=ts, phase="deleted"))
            return out
        assert delta.obj is not None
        pod = delta.obj
        spec = pod.get("spec") or {}
        resources = gpu_resources(spec)
        if not resources:
            return []  # not a GPU pod: nothing of it concerns the fleet
        if memo is None:
            memo = self.pods[delta.key] = _PodMemo()
        memo.resources = resources
        status = pod.get("status") or {}
        phase = status.get("phase", "Pending")
        node = spec.get("nodeName")
        out = []
        if not node:
            state: WorkloadState = "finished" if phase in ("Succeeded", "Failed") else "pending"
            queued = self._pending_pod(pod, resources, ts, state)
            if memo.queued is None or msgspec.structs.replace(memo.queued, ts=ts) != queued:
                out.append(queued)
            memo.queued = queued
            return out
        if memo.queued is not None:
            scheduled = _conditions(status).get("PodScheduled", {})
            out.append(msgspec.structs.replace(
                memo.queued, ts=ts, state="admitted",
                admitted_at=parse_time(scheduled.get("lastTransitionTime")) or ts))
            memo.queued = None
        allocation = self._allocation(pod, node, resources, phase, ts)
        if memo.last is None or msgspec.structs.replace(memo.last, ts=ts) != allocation:
            out.append(allocation)
        memo.last = allocation
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
            spot_tolerant=spot_tolerant(spec),
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
        return QueueEvent(
            ts=ts, name=meta["name"], namespace=namespace, cluster_queue=cluster_queue,
            state=state, queue=local, created_at=parse_time(meta.get("creationTimestamp")),
            gpus=gpus, mig=mig, priority=spec.get("priority"), kind="pod", uid=meta.get("uid"),
            priority_class=spec.get("priorityClassName"),
        )

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
        if last is not None and msgspec.structs.replace(last, ts=ts) == event:
            return []
        return [event]

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
        for pod_set in spec.get("podSets") or []:
            count = int(pod_set.get("count", 1))
            for name, value in gpu_resources((pod_set.get("template") or {}).get("spec") or {}
                                             ).items():
                resources[name] = resources.get(name, 0) + value * count
        gpus, mig = self._gpus_and_mig(resources, None)
        admitted = conditions.get("Admitted", {})
        priority_class = spec.get("priorityClassName") or (
            spec.get("priorityClassRef") or {}).get("name")
        return QueueEvent(
            ts=ts, name=meta["name"], namespace=namespace, cluster_queue=cluster_queue,
            state=state, queue=local, created_at=parse_time(meta.get("creationTimestamp")),
            admitted_at=parse_time(admitted.get("lastTransitionTime"))
            if admitted.get("status") == "True" else None,
            gpus=gpus, mig=mig, priority=spec.get("priority"), kind="workload",
            uid=meta.get("uid"), priority_class=priority_class, reason=reason,
            active=spec.get("active", True),
        )


# -- the watcher (asyncio side) ----------------------------------------------------------------


def api_client(settings: KubeWatchSettings) -> Any:
    """A ``kubernetes`` ApiClient from a kubeconfig or the in-cluster service account."""
    import os

    from kubernetes import client, config

    if settings.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return config.new_client_from_config(config_file=settings.kubeconfig,
                                         context=settings.context)


class KubeWatcher:
    """Runs the reflectors and publishes what the translator makes of their deltas."""

    def __init__(self, client: Any, publisher: Publisher,
                 settings: KubeWatchSettings | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.publisher = publisher
        self.settings = settings or KubeWatchSettings()
        self.clock = clock
        self.refusals = edge.Refusals(log)
        """Deltas skipped as untranslatable, by resource and kind of fault."""
        self.translator = Translator(self.settings)
        self.reflectors: dict[str, Reflector] = {}
        self.synced = asyncio.Event()
        """Set once every started reflector's first list has been published."""
        self.published = 0
        """Events handed to the publisher."""
        self.processed = 0
        """Deltas translated (and their events published)."""
        self.kueue_version: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._consumer: asyncio.Task[None]

    def _list_calls(self) -> dict[str, ListCall]:
        from kubernetes import client

        core = client.CoreV1Api(self.client)
        calls: dict[str, ListCall] = {}
        if "nodes" in self.settings.resources:
            calls["nodes"] = core.list_node
        if "pods" in self.settings.resources:
            calls["pods"] = core.list_pod_for_all_namespaces
        return calls

    def discover_kueue(self) -> str | None:
        """The preferred Kueue API version the server serves, or None without Kueue."""
        from kubernetes import client

        groups = client.ApisApi(self.client).get_api_versions(
            _request_timeout=self.settings.request_timeout_s)
        served = {v.version for g in groups.groups or [] if g.name == KUEUE_GROUP
                  for v in g.versions or []}
        return next((v for v in self.settings.kueue_versions if v in served), None)

    def _kueue_calls(self, version: str) -> dict[str, ListCall]:
        from kubernetes import client

        custom = client.CustomObjectsApi(self.client)

        def lister(plural: str) -> ListCall:
            def call(**kwargs: Any) -> Any:
                return custom.list_cluster_custom_object(KUEUE_GROUP, version, plural, **kwargs)
            return call

        return {"localqueues": lister("localqueues"), "workloads": lister("workloads")}

    async def run(self, stop: asyncio.Event) -> None:
        """Watch and publish until ``stop`` is set; a publisher error ends it (and is raised).

        A watcher runs once: make a new one to watch again.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[Delta]] = asyncio.Queue()

        def deliver(deltas: list[Delta]) -> None:
            if deltas:
                loop.call_soon_threadsafe(queue.put_nowait, deltas)

        def start(name: str, call: ListCall) -> Reflector:
            reflector = Reflector(name, call, deliver, self.settings, self._stop,
                                  key_of=node_key if name == "nodes" else object_key)
            self.reflectors[name] = reflector
            thread = threading.Thread(target=reflector.run, name=f"reflector-{name}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
            return reflector

        consumer = self._consumer = asyncio.create_task(self._consume(queue))
        try:
            # Order matters for the first pass: pods need their node's MIG strategy and
            # workloads their LocalQueue's ClusterQueue.
            for name, call in self._list_calls().items():
                reflector = start(name, call)
                await self._await_synced(reflector, queue, stop)
            if "workloads" in self.settings.resources:
                await self._start_kueue(start, queue, stop)
            await self._drain(queue)
            self.synced.set()
            kueue_check = loop.time() + self.settings.resync_period_s
            stopped = asyncio.ensure_future(stop.wait())
            try:
                while not stop.is_set():
                    await asyncio.wait({consumer, stopped}, timeout=1.0,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if consumer.done():
                        consumer.result()  # the publisher failed: raise its error
                    if ("workloads" in self.settings.resources and self.kueue_version is None
                            and loop.time() >= kueue_check):
                        kueue_check = loop.time() + self.settings.resync_period_s
                        await self._start_kueue(start, queue, stop)
            finally:
                stopped.cancel()
        finally:
            self._stop.set()
            for reflector in self.reflectors.values():
                reflector.stop()
            for thread in self._threads:
                await asyncio.to_thread(thread.join, 5.0)
            failed = consumer.done()  # it only ends by itself when the publisher raised
            if not failed:
                await self._drain(queue)
            consumer.cancel()
            # The consumer's own CancelledError is expected; a cancellation of run() itself
            # still propagates out of gather.
            await asyncio.gather(consumer, return_exceptions=True)
            if not failed:
                await self.publisher.flush()

    async def _start_kueue(self, start: Callable[[str, ListCall], Reflector],
                           queue: asyncio.Queue[list[Delta]], stop: asyncio.Event) -> None:
        try:
            version = await asyncio.to_thread(self.discover_kueue)
        except Exception as e:
            log.warning("Kueue discovery failed (%s); retrying at the next resync", _brief(e))
            return
        if version is None:
            log.info("Kueue is not served; watching without workloads")
            return
        self.kueue_version = version
        for name, call in self._kueue_calls(version).items():
            reflector = start(name, call)
            await self._await_synced(reflector, queue, stop)

    async def _await_synced(self, reflector: Reflector, queue: asyncio.Queue[list[Delta]],
                            stop: asyncio.Event) -> None:
        # The first list may take long (or retry forever while the API is down): wait in
        # short slices so a stop request is honoured.
        while not stop.is_set():
            if await asyncio.to_thread(reflector.synced.wait, 0.2):
                break
        await self._drain(queue)

    async def _drain(self, queue: asyncio.Queue[list[Delta]]) -> None:
        """Wait until every delta delivered so far is published (raise if publishing failed)."""
        joined = asyncio.ensure_future(queue.join())
        await asyncio.wait({joined, self._consumer}, return_when=asyncio.FIRST_COMPLETED)
        if not joined.done():
            joined.cancel()
            self._consumer.result()

    async def _consume(self, queue: asyncio.Queue[list[Delta]]) -> None:
        while True:
            # A helper per batch, so that no local keeps the last batch (up to a whole
            # relist of decoded objects) alive while waiting for the next one.
            await self._publish(await queue.get(), queue)

    def _translated(self, delta: Delta) -> list[Emitted]:
        """The events of one delta, or none when its object cannot be read or translates
        into something out of the schema's bounds (counted, logged once per kind): one
        odd object must not stop the watcher, nor make the worker refuse its record."""
        try:
            return [edge.conforming(event) for event in self.translator.apply(delta, self.clock())]
        except Exception as error:  # an object the translator cannot read is that object's
            self.refusals.note(f"{delta.resource} {edge.kind_of(error)}",
                               "skipping %s %s %s: %s", delta.resource, delta.type, delta.key,
                               edge.reason(error))
            return []

    async def _publish(self, deltas: list[Delta], queue: asyncio.Queue[list[Delta]]) -> None:
        try:
            for delta in deltas:
                for event in self._translated(delta):
                    if isinstance(event, QueueEvent):
                        await self.publisher.queue(event)
                    else:
                        await self.publisher.allocation(event)
                    self.published += 1
                self.processed += 1
            if queue.empty():
                await self.publisher.flush()
        finally:
            queue.task_done()
