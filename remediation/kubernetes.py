"""The Kubernetes backend of the remediation executor: the one module that changes a cluster.

Each verb is an async method taking the :class:`~gpusteward.schema.Action`
and returning (outcome, detail), as :class:`~gpusteward.remediation.executor.Executor`
expects. The official ``kubernetes`` client is synchronous, so every API
call runs in a worker thread (``asyncio.to_thread``); the event loop keeps
serving Kafka while a drain waits on a PodDisruptionBudget.

Every verb reads before it writes and reports ``skipped`` when the effect is
already there, so a replay after a crash between the write and the audit
record changes nothing; the node verbs (cordon, taint, set_mig_config) and the
Kueue requeue write the action's idempotency key beside their effect and report
a replay that finds its own key ``executed``, so the audit says what happened
and the circuit breaker counts the node. Patches name their content type: this client
version defaults ``patch_node`` to ``application/json-patch+json``, which
the API server rejects for an object body. Nodes and pods get a strategic
merge patch (as kubectl sends), custom objects a JSON merge patch.

What each verb does, and the API permissions it needs:

- ``cordon``: ``spec.unschedulable=true`` plus annotations with the reason
  and the action's idempotency key (get, patch nodes); a node that carries the key
  but was uncordoned since is refused (someone undid this action: a retry or re-ask
  must not undo their decision), and so is a drain's, and a taint someone removed;
- ``taint``: adds ``gpusteward.io/<key>`` with NoSchedule or NoExecute and
  the action's idempotency key in ``gpusteward.io/tainted-by``, so a replay
  reports its own taint ``executed`` as cordon does (get, patch nodes); the
  list is replaced with the node's resourceVersion as a precondition, so a
  concurrent change makes it retry, not clobber;
- ``drain``: cordon, then evict each pod through the Eviction API (create
  pods/eviction; list pods): DaemonSet pods, mirror (static) pods, finished
  pods and pods in denied namespaces are left, and, as ``kubectl drain``
  without ``--force`` / ``--delete-emptydir-data``, pods without a
  controller (evicting one deletes it for good) unless ``drain_bare_pods``
  and pods with emptyDir volumes unless ``drain_emptydir_pods``; every pod
  left is named in the detail, and leaving pods alone does not fail the
  drain. A 429 (a PodDisruptionBudget forbids it now), and any other
  temporary error of an eviction but a 500 (a 503, a timeout: the API server
  restarting), is retried with backoff until ``drain_timeout_s``, after which
  the drain reports ``failed`` with the pods left and why, and each pod a budget kept
  gets a Warning Event telling its owner (create events); a 500 (several
  budgets select the pod, a misconfiguration) is reported at once. Pods are
  never deleted directly;
- ``requeue``: a Kueue workload is deactivated (``spec.active=false``, the
  action's key in an annotation), then reactivated once Kueue has evicted it
  (get, patch workloads); retries that run out in between fail it saying the
  workload is left inactive and how to resume it; one found inactive by someone
  else is left so; the pod
  of a plain Job is deleted so the Job controller recreates it (delete
  pods; get jobs): not when the Job is gone, suspended or finished since (skipped: nothing
  would recreate it), nor when one more failure passes its backoffLimit (refused: the Job
  would fail for good); a pod without a controller is refused, deleting it would lose it;
- ``requeue`` with ``params.reason`` ``idle-reclaim`` (the idle rule's last
  ladder step) reclaims the GPUs of an idle pod by its owner, reversibly,
  after reading the live pod again (get pods): a ``gpusteward.io/keep-until``
  annotation still in force (capped by ``params.keep_until_max_s`` from
  ``params.idle_since``) refuses it. A Kubeflow Notebook (Pod -> StatefulSet
  -> Notebook) is stopped with its ``kubeflow-resource-stopped`` annotation
  (get, patch notebooks.kubeflow.org); a Deployment (Pod -> ReplicaSet ->
  Deployment; get replicasets) or a StatefulSet is scaled to zero with its
  replicas kept in ``gpusteward.io/reclaimed-replicas``, in one patch with a
  resourceVersion precondition (get, patch deployments/statefulsets), unless a KEDA
  ScaledObject keeps it above zero and would undo it (refused; list scaledobjects); a Job's
  pod or a Kueue workload is requeued as above; a pod without a controller
  is deleted only when ``params.delete_bare_pod`` is true. Each reclaim
  leaves a Warning Event on the object, saying how to undo it;
  :meth:`KubernetesBackend.restore` (``gpusteward act --restore
  KIND/NAMESPACE/NAME``) undoes the first two;
- ``requeue`` with ``params.reason`` ``idle-reclaim`` and ``params.gang`` (the fleet rule's
  reclaim of a gang every member of which is idle, sent on one member pod) suspends the
  whole gang, before ``params.workload`` or the pod's Kueue annotation is read (a requeue
  would start it again at once): the live pod is read (get pods) and must still be a
  member of that gang (:func:`gpusteward.owners.pod_gang`), not kept or exempt; a gang
  admitted by Kueue (``params.gang_workload``, the Workload the watcher saw own it, else the
  one the pod names) has that Workload, once it is checked to belong to the gang,
  deactivated and left inactive (get, patch workloads),
  so Kueue evicts it and suspends its job; otherwise a JobSet gets ``spec.suspend=true``
  (get, patch jobsets.jobset.x-k8s.io), a Kubeflow training job
  ``spec.runPolicy.suspend=true`` (get, patch pytorchjobs, tfjobs, mpijobs, xgboostjobs,
  paddlejobs, jaxjobs.kubeflow.org), each with the action's key in
  ``gpusteward.io/suspended-by``; a pod group is refused (nothing would start its pods
  again). A Warning Event on the JobSet or job says how to undo it: :meth:`restore` resumes
  only what carries that key;
- ``notify_owner``: a Warning Event on the pod (create events) and a
  ``gpusteward.io/notice`` annotation (patch pods), both the action's reason: for an idle
  holder, the rule's owner notice (``rules.idle.owner_notice``), the words the chat message
  and the alert carry too. Only a notice on the pod counts as delivered: a pod that does
  not exist is ``failed``, not ``skipped``, so no reclaim follows it;
- ``requeue``, its idle reclaim and ``notify_owner`` refuse a pod whose live uid is not
  the one the action names (``target.pod.uid``): a StatefulSet or Notebook recreated it
  under the same name since, and its owner was told nothing; a pod named without a uid is
  matched by name;
- ``set_mig_config``: the ``nvidia.com/mig.config`` label, which the GPU
  Operator's MIG manager applies, and the action's key in
  ``gpusteward.io/mig-config-by`` (get, patch nodes); the executor only lets it
  through when policy allows.
- the node verbs refuse a node created after their action was asked for, with
  ``refuse_newer_nodes`` (the CLI's default where event time is the clock): one deleted
  and re-created under the same name since is another machine;
- the breaker's fleet size: list nodes.

Every API call goes through :meth:`KubernetesBackend._call`, which turns the
client's exceptions into :mod:`gpusteward.errors`: 404, 409 and 422 are
permanent (``NotFound``, ``Conflict``, ``Invalid``); 429, 5xx, timeouts and
refused connections are temporary, with the server's ``Retry-After`` as the
delay. A verb lets temporary errors out, and the executor tries the whole
verb again after a backoff; that is safe because each verb reads first.

It stays one module on purpose: it is the one writer of the Kubernetes API
(tests/test_architecture.py checks it), every verb and its RBAC in one place.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field
from urllib3.exceptions import HTTPError as TransportError
from urllib3.exceptions import MaxRetryError
from urllib3.exceptions import TimeoutError as TransportTimeout

from gpusteward.errors import (
    ApiError,
    ApiTemporaryError,
    ApiTimeout,
    ApiUnreachable,
    ConfigError,
    Conflict,
    NotFound,
    PermanentError,
    TemporaryError,
    TooManyRequests,
    api_error,
    cut,
)
from gpusteward.owners import pod_gang, top_owner
from gpusteward.remediation.executor import matches
from gpusteward.rules.idle import (
    KEEP_UNTIL_ANNOTATION,
    RECLAIM_REASON,
    exemption,
    kept_until,
    rfc3339,
)
from gpusteward.schema import Action, Outcome, PodRef

log = logging.getLogger(__name__)

TAINT_PREFIX = "gpusteward.io/"
DEFAULT_TAINT_KEY = "gpusteward.io/unhealthy"
"""The key of a taint action that names none."""
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
NOTICE_ANNOTATION = "gpusteward.io/notice"
CORDON_ANNOTATION = "gpusteward.io/cordon-reason"
CORDONED_BY = "gpusteward.io/cordoned-by"
"""The idempotency key of the action that cordoned the node."""
TAINTED_BY = "gpusteward.io/tainted-by"
"""The idempotency key of the action that last tainted the node."""
MIG_CONFIG_BY = "gpusteward.io/mig-config-by"
"""The idempotency key of the action that last set the node's MIG config label."""
REQUEUE_ANNOTATION = "gpusteward.io/requeued-by"
"""The idempotency key of the action that requeued a Kueue workload."""
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
NODE_CLOCK_SLACK_S = 60.0
"""How much later than an action's event time its node may have been created and still be
the node it is about (a collector's clock a little behind the API server's); a node of the
same name created later is another one (``KubeSettings.refuse_newer_nodes``)."""
KUEUE_GROUP = "kueue.x-k8s.io"
KUBEFLOW_GROUP = "kubeflow.org"
NOTEBOOK_GROUP = KUBEFLOW_GROUP
KEDA_GROUP = "keda.sh"
KEDA_PAUSED_REPLICAS = "autoscaling.keda.sh/paused-replicas"
NOTEBOOK_STOPPED = "kubeflow-resource-stopped"
"""Kubeflow's notebook controller scales a Notebook's StatefulSet to zero while it is set."""
RECLAIMED_REPLICAS = "gpusteward.io/reclaimed-replicas"
RECLAIMED_AT = "gpusteward.io/reclaimed-at"
RECLAIMED_BECAUSE = "gpusteward.io/reclaim-reason"
SUSPENDED_BY = "gpusteward.io/suspended-by"
"""The idempotency key of the gang reclaim that suspended a JobSet or training job, or left
its Kueue workload inactive: ``restore`` resumes only what carries it."""
KUEUE_WORKLOAD = "kueue.x-k8s.io/workload"
"""The annotation (or label) naming the Kueue Workload that admitted a pod."""
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


class Suspension(NamedTuple):
    """Where a kind keeps the switch that stops all its pods at once, reversibly."""

    group: str
    versions: tuple[str, ...]
    """API versions to read it at, in order (a cluster serves one of them)."""
    plural: str
    field: tuple[str, ...]
    """The switch's path under ``spec``."""
    stopped: bool
    """The switch's value that stops the pods (its default is the other)."""

    @property
    def path(self) -> str:
        return ".".join(("spec", *self.field))


JOBSET_GROUP = "jobset.x-k8s.io"
TRAINER_GROUP = "trainer.kubeflow.org"
TRAINING_JOBS = ("PyTorchJob", "TFJob", "MPIJob", "XGBoostJob", "PaddleJob", "JAXJob")
"""Kubeflow training-operator jobs (kubeflow.org/v1), suspended by ``spec.runPolicy.suspend``."""
SUSPENDABLE_GANGS: dict[str, Suspension] = {
    "JobSet": Suspension(JOBSET_GROUP, ("v1alpha2",), "jobsets", ("suspend",), True),
    # Kubeflow Trainer's TrainJob runs as a JobSet it owns and keeps in step with its own
    # spec.suspend: its JobSet is suspended through it (_suspend, _resume).
    "TrainJob": Suspension(TRAINER_GROUP, ("v1alpha1",), "trainjobs", ("suspend",), True),
    **{kind: Suspension(KUBEFLOW_GROUP,
                        # The standalone MPI operator serves MPIJob at v2beta1 only.
                        ("v1", "v2beta1") if kind == "MPIJob" else ("v1",),
                        f"{kind.lower()}s", ("runPolicy", "suspend"), True)
       for kind in TRAINING_JOBS},
}
"""Gang kinds a gang reclaim suspends whole; their controllers delete the pods of a
suspended job and create them again once it is resumed."""
RESTORABLE = ("Notebook", "Deployment", "StatefulSet", *SUSPENDABLE_GANGS, "Workload")
"""Owner kinds a reclaim stops reversibly, and ``restore`` starts again."""
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


class KubeSettings(BaseModel):
    """How the Kubernetes backend reaches the cluster and paces its verbs."""

    kubeconfig: str | None = Field(
        None, description="Kubeconfig file; None uses the in-cluster service account, then "
        "~/.kube/config.")
    context: str | None = Field(None, description="Kubeconfig context; None uses the current.")
    drain_timeout_s: float = Field(
        240.0, gt=0, description="How long a drain keeps retrying evictions blocked by a "
        "PodDisruptionBudget before it reports the pods left, seconds. Below the Kafka "
        "consumer's max poll interval (5 min), so a long drain does not cost the executor its "
        "partition.")
    eviction_backoff_s: float = Field(
        2.0, gt=0, description="First wait after a 429 on an eviction; doubles up to "
        "eviction_backoff_max_s. kubectl drain waits 5 s between tries.")
    eviction_backoff_max_s: float = Field(30.0, gt=0)
    eviction_grace_period_s: int | None = Field(
        None, ge=0, description="Grace period passed with each eviction; None keeps each "
        "pod's terminationGracePeriodSeconds.")
    requeue_timeout_s: float = Field(
        60.0, gt=0, description="How long requeue waits for Kueue to evict a deactivated "
        "workload before reactivating it, seconds.")
    notebook_version: str = Field(
        "v1", description="Kubeflow Notebook API version (v1 is served by current Kubeflow "
        "releases, beside the older v1beta1).")
    kueue_version: str = Field(
        "v1beta1", description="Kueue API version: v1beta1 is served by every Kueue release "
        "(deprecated from 0.15, where v1beta2 is the storage version).")
    deny_namespaces: set[str] = Field(
        default_factory=lambda: {"kube-system"},
        description="Namespaces (glob patterns, as the executor's) whose pods a drain leaves "
        "in place.")
    drain_bare_pods: bool = Field(
        False, description="Whether a drain evicts pods without a controller. Off, as "
        "`kubectl drain` without --force: nothing recreates such a pod, so evicting it deletes "
        "it for good; the drain leaves it and names it in its detail.")
    drain_emptydir_pods: bool = Field(
        False, description="Whether a drain evicts pods with emptyDir volumes. Off, as "
        "`kubectl drain` without --delete-emptydir-data: the volume's data is lost with the "
        "pod; the drain leaves it and names it in its detail.")
    request_timeout_s: float = Field(30.0, gt=0, description="Per API request, seconds.")
    refuse_newer_nodes: bool = Field(
        False, description="Whether cordon, taint, drain and set_mig_config refuse a node "
        "created after their action was asked for (Action.ts, with NODE_CLOCK_SLACK_S of "
        "slack): the node was deleted and re-created under the same name since, another "
        "machine (or the same one repaired) than the one whose fault asked. Needs event time "
        "on the cluster's clock, so `gpusteward act` switches it on unless max_action_age_s "
        "is null (a simulation whose event time is no wall clock).")


def _mapped(error: Exception) -> ApiError:
    """The :mod:`gpusteward.errors` error for an exception of the client or its transport."""
    if isinstance(error, ApiException):
        headers = error.headers or {}
        return api_error(error.status or 0, error.body, reason=str(error.reason or ""),
                         retry_after_header=headers.get("Retry-After"))
    cause = error.reason if isinstance(error, MaxRetryError) else error
    if isinstance(cause, TransportTimeout):
        return ApiTimeout(0, "Timeout", cut(str(cause)))
    return ApiUnreachable(0, "Unreachable", cut(str(cause)))


class KubernetesBackend:
    """Carries out remediation verbs against a Kubernetes API server."""

    name = "kubernetes"

    def __init__(self, settings: KubeSettings | None = None,
                 api_client: k8s.ApiClient | None = None,
                 sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        self.settings = settings or KubeSettings()
        if api_client is None:
            api_client = self._load_client()
        self.api_client = api_client
        self.core = k8s.CoreV1Api(api_client)
        self.apps = k8s.AppsV1Api(api_client)
        self.batch = k8s.BatchV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)
        self._sleep = sleep
        self._left_inactive: set[str] = set()
        """Keys of requeues that deactivated a Kueue workload and have not reactivated it."""

    def _load_client(self) -> k8s.ApiClient:
        if self.settings.kubeconfig is None:
            try:
                k8s_config.load_incluster_config()
                return k8s.ApiClient()
            except k8s_config.ConfigException:
                pass
        try:
            return k8s_config.new_client_from_config(config_file=self.settings.kubeconfig,
                                                     context=self.settings.context)
        except (k8s_config.ConfigException, OSError) as error:  # no such file, no context
            where = self.settings.kubeconfig or "~/.kube/config"
            raise ConfigError(f"cannot load the Kubernetes configuration from {where}: "
                              f"{error}") from error

    async def _call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call in a worker thread, with the request timeout; errors mapped."""
        kwargs.setdefault("_request_timeout", self.settings.request_timeout_s)
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        except (ApiException, TransportError, OSError) as error:
            raise _mapped(error) from error

    async def _json(self, function: Callable[..., Any], *args: Any, **kwargs: Any
                    ) -> dict[str, Any]:
        """An API call's response as upstream JSON, not the client's typed models.

        Reading raw JSON keeps every field the server sent (the typed models drop
        unknown ones) and avoids the models' strict validation of partial objects.
        """
        response = await self._call(function, *args, _preload_content=False, **kwargs)
        return json.loads(response.data)

    # -- nodes -----------------------------------------------------------------------------

    async def _node(self, name: str) -> dict[str, Any]:
        return await self._json(self.core.read_node, name)

    async def _patch_node(self, name: str, body: dict[str, Any]) -> None:
        await self._call(self.core.patch_node, name, body, _content_type=STRATEGIC,
                         _preload_content=False)

    def _newer_node(self, current: dict[str, Any], action: Action) -> str | None:
        """Why ``current`` is not the node ``action`` is about (created after it was asked
        for), or None."""
        created = current.get("metadata", {}).get("creationTimestamp")
        if not self.settings.refuse_newer_nodes or not created:
            return None
        created_at = datetime.fromisoformat(created).timestamp()
        if created_at <= action.ts + NODE_CLOCK_SLACK_S:
            return None
        return (f"node {current['metadata'].get('name')} was created at {created}, after this "
                f"action was asked for ({rfc3339(action.ts)}): it was deleted and re-created "
                "under the same name since, another machine or one repaired, not the one whose "
                "fault asked. Left alone; its own faults will ask afresh")

    async def gpu_node_count(self) -> int | None:
        """Nodes with GPUs: allocatable ``nvidia.com/gpu`` or the GPU feature-discovery label."""
        count = 0
        for node in (await self._json(self.core.list_node)).get("items", []):
            labels = node.get("metadata", {}).get("labels") or {}
            allocatable = node.get("status", {}).get("allocatable") or {}
            if labels.get("nvidia.com/gpu.present") == "true" or any(
                    k.startswith("nvidia.com/gpu") or k.startswith("nvidia.com/mig-")
                    for k in allocatable):
                count += 1
        return count or None

    async def cordon(self, action: Action) -> tuple[Outcome, str]:
        """Cordon the node, naming the action on it: a try of the same action that finds the
        node cordoned (a retry after a lost reply, a replay after a crash before the audit
        record) reports it executed, so the circuit breaker counts the node it disrupted."""
        node = _require(action.target.node, "cordon needs a node")
        current = await self._node(node)
        newer = self._newer_node(current, action)
        if newer:
            return "refused", newer
        ours = _annotations(current).get(CORDONED_BY) == action.idempotency_key
        if current.get("spec", {}).get("unschedulable"):
            if ours:
                return "executed", f"cordoned {node} (by an earlier try of this action)"
            return "skipped", f"{node} is already cordoned"
        if ours:
            # `kubectl uncordon` keeps the annotations: someone undid this very action (an
            # admin after a repair, or who judged the node fit), and a re-ask or a retry of
            # a drain that failed must not undo their decision.
            return "refused", (f"{node} was cordoned by this action ({CORDONED_BY}) and "
                               "uncordoned since by someone else: left schedulable. Cordon "
                               "it by hand if it should be out of service")
        await self._patch_node(node, {
            "metadata": {"annotations": {CORDON_ANNOTATION: action.reason[:250],
                                         CORDONED_BY: action.idempotency_key}},
            "spec": {"unschedulable": True},
        })
        return "executed", f"cordoned {node}: no new pods will be scheduled there"

    async def taint(self, action: Action) -> tuple[Outcome, str]:
        """Taint the node, naming the action on it (``gpusteward.io/tainted-by``): a try of the
        same action that finds its taint reports it executed, as a cordon does; a taint
        someone else set is skipped."""
        node = _require(action.target.node, "taint needs a node")
        key = action.params.get("key", DEFAULT_TAINT_KEY)
        if not key.startswith(TAINT_PREFIX):
            key = TAINT_PREFIX + key
        effect = action.params.get("effect", "NoSchedule")
        if effect not in ("NoSchedule", "NoExecute"):
            return "refused", f"taint effect must be NoSchedule or NoExecute, not {effect!r}"
        value = action.params.get("value", action.rule)
        for _attempt in range(5):
            current = await self._node(node)
            newer = self._newer_node(current, action)
            if newer:
                return "refused", newer
            taints = list(current.get("spec", {}).get("taints") or [])
            ours = _annotations(current).get(TAINTED_BY) == action.idempotency_key
            if any(t.get("key") == key and t.get("effect") == effect for t in taints):
                if ours:
                    return "executed", (f"tainted {node} with {key}:{effect} (by an earlier "
                                        "try of this action)")
                return "skipped", f"{node} already has taint {key}:{effect}"
            if ours:  # as a cordon undone: someone removed this action's taint since
                return "refused", (f"{node} was tainted {key}:{effect} by this action "
                                   f"({TAINTED_BY}) and the taint was removed since by someone "
                                   "else: left untainted. Taint it by hand if it should be")
            taints.append({"key": key, "value": value, "effect": effect,
                           "timeAdded": _now_rfc3339()})
            version = current.get("metadata", {}).get("resourceVersion")
            try:
                await self._patch_node(node, {
                    "metadata": {"resourceVersion": version,
                                 "annotations": {TAINTED_BY: action.idempotency_key}},
                    "spec": {"taints": taints}})
            except Conflict:  # someone changed the node meanwhile: read again
                continue
            return "executed", f"tainted {node} with {key}={value}:{effect}"
        return "failed", f"{node} kept changing under the taint patch (5 conflicts)"

    async def set_mig_config(self, action: Action) -> tuple[Outcome, str]:
        """Set the node's MIG config label, naming the action on it
        (``gpusteward.io/mig-config-by``): a try of the same action that finds its label
        reports it executed, as a cordon does; a label someone else set is skipped."""
        node = _require(action.target.node, "set_mig_config needs a node")
        config = action.params.get("config")
        if not config:
            return "failed", "set_mig_config needs params.config (a mig-parted config name)"
        current = await self._node(node)
        newer = self._newer_node(current, action)
        if newer:
            return "refused", newer
        labels = current.get("metadata", {}).get("labels") or {}
        if labels.get(MIG_CONFIG_LABEL) == config:
            if _annotations(current).get(MIG_CONFIG_BY) == action.idempotency_key:
                return "executed", (f"set {MIG_CONFIG_LABEL}={config} on {node} (by an "
                                    "earlier try of this action)")
            return "skipped", f"{node} already has {MIG_CONFIG_LABEL}={config}"
        await self._patch_node(node, {"metadata": {
            "labels": {MIG_CONFIG_LABEL: config},
            "annotations": {MIG_CONFIG_BY: action.idempotency_key}}})
        return "executed", (f"set {MIG_CONFIG_LABEL}={config} on {node} (was "
                            f"{labels.get(MIG_CONFIG_LABEL, 'unset')}); the MIG manager "
                            "applies it")

    # -- drain -----------------------------------------------------------------------------

    async def _pods_on(self, node: str) -> list[dict[str, Any]]:
        pods = await self._json(self.core.list_pod_for_all_namespaces,
                                field_selector=f"spec.nodeName={node}")
        return list(pods.get("items", []))

    def _leave_reason(self, pod: dict[str, Any]) -> str | None:
        """Why a drain leaves ``pod`` in place, or None to evict it."""
        meta = pod.get("metadata", {})
        if MIRROR_ANNOTATION in (meta.get("annotations") or {}):
            return "mirror pod"
        if any(ref.get("kind") == "DaemonSet" and ref.get("controller")
               for ref in meta.get("ownerReferences") or []):
            return "DaemonSet pod"
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return "finished"
        if matches(meta.get("namespace"), self.settings.deny_namespaces):
            return "denied namespace"
        if _controller(pod) is None and not self.settings.drain_bare_pods:
            return ("no controller: evicting it would delete it for good; "
                    "drain_bare_pods allows it")
        if not self.settings.drain_emptydir_pods and any(
                "emptyDir" in volume for volume in pod.get("spec", {}).get("volumes") or []):
            return ("emptyDir volume: its data would be lost; "
                    "drain_emptydir_pods allows it")
        return None

    async def _evict(self, namespace: str, name: str) -> tuple[str, str]:
        """One eviction attempt: ('evicted'|'gone'|'blocked'|'unavailable'|'error', message).

        'blocked' (a 429: a PodDisruptionBudget) and 'unavailable' (another temporary error:
        a 503 or a timeout while the API server restarts) are tried again until the drain's
        deadline; a 500 is the Eviction API's answer to a misconfiguration (several budgets
        select the pod), which no retry mends, so it is an 'error' reported at once."""
        delete_options = None
        if self.settings.eviction_grace_period_s is not None:
            delete_options = k8s.V1DeleteOptions(
                grace_period_seconds=self.settings.eviction_grace_period_s)
        body = k8s.V1Eviction(
            api_version="policy/v1", kind="Eviction",
            metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=delete_options,
        )
        try:
            await self._call(self.core.create_namespaced_pod_eviction, name, namespace, body,
                             _preload_content=False)
        except NotFound:
            return "gone", "already gone"
        except TooManyRequests as error:  # a PodDisruptionBudget forbids it now
            return "blocked", error.message
        except ApiTemporaryError as error:
            if error.status != 500:
                return "unavailable", str(error)
            return "error", str(error)
        except ApiError as error:
            return "error", str(error)
        return "evicted", ""

    async def drain(self, action: Action) -> tuple[Outcome, str]:
        node = _require(action.target.node, "drain needs a node")
        cordon_outcome, cordon_detail = await self.cordon(action)
        if cordon_outcome == "refused":  # uncordoned since this drain cordoned it, or new
            return "refused", f"{cordon_detail}; no pod evicted"
        left: list[str] = []
        to_evict: list[tuple[str, str]] = []
        uids: dict[str, str | None] = {}
        for pod in await self._pods_on(node):
            meta = pod["metadata"]
            why = self._leave_reason(pod)
            if why:
                left.append(f"{meta['namespace']}/{meta['name']} ({why})")
            else:
                to_evict.append((meta["namespace"], meta["name"]))
                uids[f"{meta['namespace']}/{meta['name']}"] = meta.get("uid")
        deadline = time.monotonic() + self.settings.drain_timeout_s
        backoff = self.settings.eviction_backoff_s
        evicted: list[str] = []
        blocked: dict[str, str] = {}
        errors: dict[str, str] = {}
        unavailable: dict[str, str] = {}
        """Pods whose last eviction met a temporary error other than a budget's 429."""
        pending = list(to_evict)
        while pending:
            retry: list[tuple[str, str]] = []
            for namespace, name in pending:
                state, message = await self._evict(namespace, name)
                ref = f"{namespace}/{name}"
                blocked.pop(ref, None)
                unavailable.pop(ref, None)
                if state in ("evicted", "gone"):
                    evicted.append(ref)
                elif state == "blocked":
                    blocked[ref] = message
                    retry.append((namespace, name))
                elif state == "unavailable":
                    unavailable[ref] = message
                    retry.append((namespace, name))
                else:
                    errors[ref] = message
            pending = retry
            if not pending or time.monotonic() + backoff > deadline:
                break
            await self._sleep(backoff)
            backoff = min(backoff * 2, self.settings.eviction_backoff_max_s)
        cordon_note = "already cordoned" if cordon_outcome == "skipped" else "cordoned"
        summary = (f"{node} {cordon_note}; evicted {len(evicted)} pod(s)"
                   + (f"; left {len(left)}: {', '.join(left)}" if left else ""))
        errors.update(unavailable)
        if blocked or errors:
            problems = [f"{ref} blocked by a PodDisruptionBudget ({why})"
                        for ref, why in blocked.items()]
            problems += [f"{ref}: {why}" for ref, why in errors.items()]
            timed = (f" after {self.settings.drain_timeout_s:g} s"
                     if blocked or unavailable else "")
            if blocked:
                told = await self._tell_blocked(node, action, blocked, uids)
                problems.append(f"told the owners of {told} of {len(blocked)} blocked pod(s) "
                                "(Warning event GpuStewardDrainBlocked)")
            return "failed", f"drain incomplete{timed}: {summary}; not evicted: " + "; ".join(
                problems)
        return "executed", summary

    async def _tell_blocked(self, node: str, action: Action, blocked: dict[str, str],
                            uids: dict[str, str | None]) -> int:
        """A Warning Event on each pod a PodDisruptionBudget kept on the draining node, so
        its owner learns why the node is drained and that the drain waits on their budget
        (``kubectl describe pod``); how many were told. An Event that cannot be made is
        logged, and does not change the drain's outcome."""
        told = 0
        for ref, why in blocked.items():
            namespace, name = ref.split("/", 1)
            try:
                await self._event(namespace, k8s.V1ObjectReference(
                    api_version="v1", kind="Pod", name=name, namespace=namespace,
                    uid=uids.get(ref)), "GpuStewardDrainBlocked",
                    f"Node {node} is being drained by gpusteward ({action.reason[:300]}); this "
                    f"pod's PodDisruptionBudget allows no eviction now ({why[:200]}). The node "
                    "takes no new pods; the drain is tried again while the fault lasts. Let "
                    "the budget allow a disruption (another replica elsewhere) or move the "
                    "work off the node.")
                told += 1
            except ApiError as error:
                log.warning("cannot tell the owner of %s that its budget blocks the drain of "
                            "%s: %s", ref, node, error)
        return told

    # -- pods: requeue, notify -------------------------------------------------------------

    async def _pod(self, pod: PodRef) -> dict[str, Any]:
        return await self._json(self.core.read_namespaced_pod, pod.name, pod.namespace)

    async def _workload(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._json(
            self.custom.get_namespaced_custom_object, KUEUE_GROUP,
            self.settings.kueue_version, namespace, "workloads", name)

    async def _set_active(self, namespace: str, name: str, active: bool,
                          by: str | None = None) -> None:
        body: dict[str, Any] = {"spec": {"active": active}}
        if by is not None:
            body["metadata"] = {"annotations": {REQUEUE_ANNOTATION: by}}
        await self._call(self.custom.patch_namespaced_custom_object, KUEUE_GROUP,
                         self.settings.kueue_version, namespace, "workloads", name,
                         body, _content_type=MERGE)

    async def requeue(self, action: Action) -> tuple[Outcome, str]:
        if action.params.get("gang") and action.params.get("reason") == RECLAIM_REASON:
            # Before params.workload or the pod's Kueue annotation is read: a gang's
            # reclaim stops it, where a requeue would start it again at once.
            return await self._suspend_gang(action)
        pod_ref = action.target.pod
        workload = action.params.get("workload")
        if pod_ref is None and workload is None:
            return "failed", "requeue needs a pod or params.workload"
        namespace = action.params.get("namespace") or (pod_ref.namespace if pod_ref else "")
        pod: dict[str, Any] | None = None
        if workload is None and pod_ref is not None:
            try:
                pod = await self._pod(pod_ref)
            except NotFound:
                return "skipped", f"pod {pod_ref.namespace}/{pod_ref.name} is already gone"
            replaced = _replaced(pod, pod_ref)
            if replaced:
                return "refused", replaced
            workload = _kueue_workload(pod["metadata"])
        if pod is not None and pod_ref is not None and (
                action.params.get("reason") == RECLAIM_REASON):
            kept = _keep_until_refusal(pod, action) or _exempt_refusal(pod, action)
            if kept:
                return "refused", kept
        if workload:
            return await self._requeue_workload(namespace, workload, action.idempotency_key)
        assert pod is not None and pod_ref is not None
        if action.params.get("reason") == RECLAIM_REASON:
            return await self._reclaim(pod, pod_ref, action)
        return await self._requeue_job_pod(pod, pod_ref)

    async def _requeue_workload(self, namespace: str, name: str, key: str
                                ) -> tuple[Outcome, str]:
        """Deactivate, wait for Kueue's eviction, reactivate. The deactivation names the
        action (``gpusteward.io/requeued-by``), so that a replay of it after a crash, which
        finds a requeued workload looking like one never touched, does not requeue it twice,
        and one found inactive is reactivated only when this action left it so.

        A temporary error between the two patches leaves the job stopped until a retry
        reactivates it; should the retries run out, the error says so first, and how to
        resume it, since Kueue never admits an inactive workload again by itself."""
        try:
            outcome = await self._requeue_workload_once(namespace, name, key)
        except TemporaryError as error:
            if key not in self._left_inactive:
                raise
            raise TemporaryError(
                f"Kueue workload {namespace}/{name} is left inactive (spec.active=false) by "
                f"this action until a retry reactivates it; if none does, resume it with "
                f"`kueuectl resume workload {name} -n {namespace}`: {error}",
                delay=error.delay) from error
        self._left_inactive.discard(key)
        return outcome

    async def _requeue_workload_once(self, namespace: str, name: str, key: str
                                     ) -> tuple[Outcome, str]:
        current = await self._workload(namespace, name)
        ours = (current.get("metadata", {}).get("annotations") or {}).get(
            REQUEUE_ANNOTATION) == key
        if current.get("spec", {}).get("active", True) is False:
            if not ours:
                return "skipped", (f"Kueue workload {namespace}/{name} is inactive, not by "
                                   "this action: left as it is")
            # A crash between the two patches left it inactive: finish the requeue.
            await self._set_active(namespace, name, True)
            return "executed", f"reactivated Kueue workload {namespace}/{name} (was inactive)"
        if ours:
            return "executed", (f"Kueue workload {namespace}/{name} was requeued by an earlier "
                                "try of this action (its audit record was lost)")
        await self._set_active(namespace, name, False, by=key)
        self._left_inactive.add(key)
        deadline = time.monotonic() + self.settings.requeue_timeout_s
        evicted = False
        while time.monotonic() < deadline:
            status = (await self._workload(namespace, name)).get("status", {})
            evicted = any(c.get("type") == "Evicted" and c.get("status") == "True"
                          for c in status.get("conditions") or []) or not status.get("admission")
            if evicted:
                break
            await self._sleep(1.0)
        await self._set_active(namespace, name, True)
        if not evicted:
            return "failed", (f"Kueue did not evict workload {namespace}/{name} within "
                              f"{self.settings.requeue_timeout_s:g} s; reactivated it")
        return "executed", (f"requeued Kueue workload {namespace}/{name}: deactivated, evicted "
                            "by Kueue, reactivated")

    async def _requeue_job_pod(self, pod: dict[str, Any], ref: PodRef) -> tuple[Outcome, str]:
        owners = pod["metadata"].get("ownerReferences") or []
        controller = next((o for o in owners if o.get("controller")), None)
        if controller is None or controller.get("kind") != "Job":
            kind = controller.get("kind") if controller else "no controller"
            return "refused", (f"{ref.namespace}/{ref.name} is not a Kueue workload or a Job's "
                               f"pod ({kind}); deleting it could lose the work")
        job_name = controller.get("name", "")
        stays = await self._job_refusal(ref, job_name)
        if stays:
            return stays
        try:
            await self._call(self.core.delete_namespaced_pod, ref.name, ref.namespace,
                             _preload_content=False)
        except NotFound:
            return "skipped", f"pod {ref.namespace}/{ref.name} is already gone"
        return "executed", (f"deleted pod {ref.namespace}/{ref.name}; Job "
                            f"{job_name} recreates it elsewhere")

    async def _job_refusal(self, ref: PodRef, job_name: str) -> tuple[Outcome, str] | None:
        """Why deleting a Job's pod would not requeue it, as the Job is now, or None.

        The Job controller recreates a deleted pod only while the Job runs: one deleted or
        suspended since the rule asked stops its pods itself and starts none, and one whose
        failures reached its backoffLimit fails for good at one more (a deleted running pod
        counts as failed): a requeue that kills the job is no requeue."""
        where = f"Job {ref.namespace}/{job_name}"
        try:
            job = await self._json(self.batch.read_namespaced_job, job_name, ref.namespace)
        except NotFound:
            return "skipped", (f"{where} is gone: nothing would recreate pod {ref.name}; left "
                               "to the garbage collector")
        if job["metadata"].get("deletionTimestamp"):
            return "skipped", (f"{where} is being deleted: nothing would recreate pod "
                               f"{ref.name}; left to the garbage collector")
        spec, status = job.get("spec", {}), job.get("status", {})
        if spec.get("suspend"):
            return "skipped", (f"{where} is suspended: its controller stops its pods and "
                               "starts none until it is resumed; left as it is")
        if any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in status.get("conditions") or []):
            return "skipped", f"{where} has finished: nothing would recreate pod {ref.name}"
        limit, failed = spec.get("backoffLimit", 6), status.get("failed", 0)
        if spec.get("backoffLimitPerIndex") is None and failed + 1 > limit:
            return "refused", (f"{where} has failed {failed} time(s) and its backoffLimit is "
                               f"{limit}: deleting pod {ref.name} counts as one more failure, "
                               "and the Job would fail for good instead of running it again")
        return None

    # -- reclaim by owner kind, and restore ----------------------------------------------

    async def _reclaim(self, pod: dict[str, Any], ref: PodRef, action: Action
                       ) -> tuple[Outcome, str]:
        """Give back an idle pod's GPUs through the object that owns it."""
        controller = _controller(pod)
        if controller is None:
            if action.params.get("delete_bare_pod") != "true":
                return "refused", (f"{ref.namespace}/{ref.name} has no controller: deleting it "
                                   "cannot be undone, and policy does not allow it "
                                   "(idle_holder.reclaim_bare_pods)")
            try:
                await self._call(self.core.delete_namespaced_pod, ref.name, ref.namespace,
                                 _preload_content=False)
            except NotFound:
                return "skipped", f"pod {ref.namespace}/{ref.name} is already gone"
            return "executed", (f"deleted bare pod {ref.namespace}/{ref.name} (policy allows "
                                "deleting pods without a controller)")
        kind, name = controller["kind"], controller["name"]
        if kind == "Job":
            return await self._requeue_job_pod(pod, ref)
        if kind in ("ReplicaSet", "StatefulSet"):
            owner = await self._json(self._read(kind), name, ref.namespace)
            parent = _controller(owner)
            if kind == "ReplicaSet":
                if parent is None or parent["kind"] != "Deployment":
                    return "refused", (f"{ref.namespace}/{ref.name} belongs to ReplicaSet {name}, "
                                       "which no Deployment owns; scaling it down would be "
                                       "undone by nothing and restored by no one")
                kind, name = "Deployment", parent["name"]
            elif parent is not None and parent["kind"] == "Notebook":
                return await self._stop_notebook(ref.namespace, parent["name"], action.reason)
            # A Deployment or StatefulSet another controller owns is refused there.
            return await self._scale_to_zero(kind, ref.namespace, name, action.reason)
        return "refused", (f"{ref.namespace}/{ref.name} is owned by {kind} {name}: gpusteward "
                           "reclaims Notebooks, Deployments, StatefulSets, Jobs and Kueue "
                           "workloads only")

    def _read(self, kind: str) -> Callable[..., Any]:
        return {"ReplicaSet": self.apps.read_namespaced_replica_set,
                "Deployment": self.apps.read_namespaced_deployment,
                "StatefulSet": self.apps.read_namespaced_stateful_set}[kind]

    def _patcher(self, kind: str) -> Callable[..., Any]:
        return {"Deployment": self.apps.patch_namespaced_deployment,
                "StatefulSet": self.apps.patch_namespaced_stateful_set}[kind]

    async def _notebook(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._json(self.custom.get_namespaced_custom_object, NOTEBOOK_GROUP,
                                self.settings.notebook_version, namespace, "notebooks", name)

    async def _patch_notebook(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        await self._call(self.custom.patch_namespaced_custom_object, NOTEBOOK_GROUP,
                         self.settings.notebook_version, namespace, "notebooks", name, body,
                         _content_type=MERGE)

    async def _stop_notebook(self, namespace: str, name: str, reason: str
                             ) -> tuple[Outcome, str]:
        notebook = await self._notebook(namespace, name)
        if NOTEBOOK_STOPPED in (notebook["metadata"].get("annotations") or {}):
            return "skipped", f"Notebook {namespace}/{name} is already stopped"
        now = _now_rfc3339()
        await self._patch_notebook(namespace, name, {"metadata": {"annotations": {
            NOTEBOOK_STOPPED: now, RECLAIMED_AT: now, RECLAIMED_BECAUSE: reason[:250]}}})
        undo = f"gpusteward act --restore Notebook/{namespace}/{name}"
        await self._owner_event(notebook, "GpuStewardReclaimed",
                                f"Stopped to give back its idle GPUs: {reason[:500]}. Start it "
                                f"again from the Kubeflow dashboard or with `{undo}`.")
        return "executed", (f"stopped Notebook {namespace}/{name} ({NOTEBOOK_STOPPED}); its "
                            f"volumes are kept; undo with `{undo}`")

    async def _autoscaler_floor(self, kind: str, namespace: str, name: str) -> str | None:
        """Why an autoscaler would undo a scale of ``kind``/``name`` to zero, or None.

        KEDA's operator scales its target back up to ``minReplicaCount`` (or to its
        paused-replicas annotation) within its polling interval: the GPUs would not be
        given back, the owner told of a reclaim that did not last, and the next idle
        episode would climb the ladder again. A HorizontalPodAutoscaler does not scale a
        target at zero replicas, so it is no fight; a cluster without KEDA serves no
        ScaledObjects (404)."""
        try:
            found = await self._json(self.custom.list_namespaced_custom_object, KEDA_GROUP,
                                     "v1alpha1", namespace, "scaledobjects")
        except NotFound:
            return None
        for scaled in found.get("items", []):
            target = scaled.get("spec", {}).get("scaleTargetRef") or {}
            if target.get("name") != name or target.get("kind", "Deployment") != kind:
                continue
            paused = _annotations(scaled).get(KEDA_PAUSED_REPLICAS)
            floor = paused if paused is not None else str(
                scaled.get("spec", {}).get("minReplicaCount", 0))
            if floor.strip() not in ("0", ""):
                which = (f"{KEDA_PAUSED_REPLICAS}={paused}" if paused is not None
                         else f"minReplicaCount {floor}")
                return (f"{kind} {namespace}/{name} is scaled by KEDA ScaledObject "
                        f"{scaled['metadata']['name']} ({which}), which would scale it back "
                        "up at once: the GPUs would not be given back. Set its minReplicaCount "
                        "to 0, or exempt the workload from idle detection")
        return None

    async def _scale_to_zero(self, kind: str, namespace: str, name: str, reason: str
                             ) -> tuple[Outcome, str]:
        fight = await self._autoscaler_floor(kind, namespace, name)
        if fight:
            return "refused", fight
        for _attempt in range(5):
            owner = await self._json(self._read(kind), name, namespace)
            manager = _controller(owner)
            if manager is not None:
                # A KServe InferenceService, a Knative Revision, a LeaderWorkerSet or an
                # operator of one's own keeps its replicas: a scale-down would be set back,
                # the GPUs held again, and the owner told they were given back.
                return "refused", (f"{kind} {namespace}/{name} is managed by "
                                   f"{manager.get('kind')} {manager.get('name')}, whose "
                                   "controller may undo a scale-down: ask its owner to scale "
                                   f"the {manager.get('kind')} down")
            replicas = owner.get("spec", {}).get("replicas", 1)
            if replicas == 0:
                return "skipped", f"{kind} {namespace}/{name} is already scaled to 0"
            now = _now_rfc3339()
            # One patch, so the replicas to restore are never lost between two writes; the
            # resourceVersion makes a concurrent scale a conflict, not a silent overwrite.
            try:
                await self._call(self._patcher(kind), name, namespace, {
                    "metadata": {"resourceVersion": owner["metadata"].get("resourceVersion"),
                                 "annotations": {RECLAIMED_REPLICAS: str(replicas),
                                                 RECLAIMED_AT: now,
                                                 RECLAIMED_BECAUSE: reason[:250]}},
                    "spec": {"replicas": 0}}, _content_type=MERGE, _preload_content=False)
            except Conflict:
                continue
            undo = f"gpusteward act --restore {kind}/{namespace}/{name}"
            await self._owner_event(owner, "GpuStewardReclaimed",
                                    f"Scaled from {replicas} to 0 to give back its idle GPUs: "
                                    f"{reason[:500]}. Scale back with `{undo}`.")
            return "executed", (f"scaled {kind} {namespace}/{name} from {replicas} to 0 "
                                f"({RECLAIMED_REPLICAS}={replicas}); undo with `{undo}`")
        return "failed", f"{kind} {namespace}/{name} kept changing under the scale-down"

    async def restore(self, kind: str, namespace: str, name: str) -> tuple[Outcome, str]:
        """Undo a reclaim: start a stopped Notebook, scale a Deployment/StatefulSet back,
        resume a suspended gang (its JobSet or training job, or its Kueue Workload)."""
        if kind not in RESTORABLE:
            return "refused", f"cannot restore a {kind}: one of {', '.join(RESTORABLE)}"
        try:
            if kind == "Notebook":
                return await self._restore_notebook(namespace, name)
            if kind in SUSPENDABLE_GANGS or kind == "Workload":
                return await self._resume(kind, namespace, name)
            return await self._restore_replicas(kind, namespace, name)
        except NotFound:
            return "failed", f"{kind} {namespace}/{name} does not exist"

    async def _restore_notebook(self, namespace: str, name: str) -> tuple[Outcome, str]:
        notebook = await self._notebook(namespace, name)
        annotations = notebook["metadata"].get("annotations") or {}
        if RECLAIMED_AT not in annotations:
            return "refused", (f"Notebook {namespace}/{name} was not stopped by gpusteward "
                               f"(no {RECLAIMED_AT}); start it from the Kubeflow dashboard")
        started = NOTEBOOK_STOPPED in annotations
        await self._patch_notebook(namespace, name, {"metadata": {"annotations": {
            NOTEBOOK_STOPPED: None, RECLAIMED_AT: None, RECLAIMED_BECAUSE: None}}})
        if not started:
            return "skipped", (f"Notebook {namespace}/{name} was already started again; "
                               "removed gpusteward's annotations")
        await self._owner_event(notebook, "GpuStewardRestored", "Started again by gpusteward "
                                "act --restore.")
        return "executed", f"started Notebook {namespace}/{name} again"

    async def _restore_replicas(self, kind: str, namespace: str, name: str
                                ) -> tuple[Outcome, str]:
        owner = await self._json(self._read(kind), name, namespace)
        annotations = owner["metadata"].get("annotations") or {}
        kept = annotations.get(RECLAIMED_REPLICAS)
        if kept is None:
            return "refused", (f"{kind} {namespace}/{name} has no {RECLAIMED_REPLICAS}: "
                               "gpusteward did not scale it down")
        replicas = owner.get("spec", {}).get("replicas", 1)
        forget = {RECLAIMED_REPLICAS: None, RECLAIMED_AT: None, RECLAIMED_BECAUSE: None}
        body: dict[str, Any] = {"metadata": {
            "resourceVersion": owner["metadata"].get("resourceVersion"), "annotations": forget}}
        if replicas == 0:
            body["spec"] = {"replicas": int(kept)}
        await self._call(self._patcher(kind), name, namespace, body, _content_type=MERGE,
                         _preload_content=False)
        if replicas != 0:
            return "skipped", (f"{kind} {namespace}/{name} was already scaled to {replicas}; "
                               f"removed {RECLAIMED_REPLICAS}")
        await self._owner_event(owner, "GpuStewardRestored",
                                f"Scaled back to {kept} by gpusteward act --restore.")
        return "executed", f"scaled {kind} {namespace}/{name} back to {kept}"

    # -- gangs: suspend a whole idle gang, and resume it -----------------------------------

    async def _suspend_gang(self, action: Action) -> tuple[Outcome, str]:
        """Give back the GPUs of a gang every member of which is idle, by suspending it whole.

        One member's reclaim would stop the gang anyway (its peers wait on it), so the
        fleet rule asks for the gang through one placed member pod; that pod is read again
        first, as a single pod's reclaim reads it. A gang admitted by Kueue is stopped
        through its Workload, left inactive (``spec.active=false``): Kueue evicts it and
        suspends its JobSet or job, and would unsuspend one suspended behind its back.
        Otherwise a JobSet gets ``spec.suspend``, a Kubeflow training job
        ``spec.runPolicy.suspend``; their controllers delete the pods and create them
        again on resume. A pod group has no such switch: its pods, once deleted, are
        started again by nothing, so it is refused."""
        ref = action.target.pod
        gang = action.params.get("gang", "")
        if ref is None:
            return "failed", f"a reclaim of gang {gang} needs one of its member pods"
        try:
            pod = await self._pod(ref)
        except NotFound:
            return "skipped", f"pod {ref.namespace}/{ref.name} is already gone"
        meta = pod["metadata"]
        live, _size = pod_gang(meta, *top_owner(meta))
        stays = _replaced(pod, ref) or (
            None if live == gang else
            f"pod {ref.namespace}/{ref.name} is no longer a member of {gang} (its gang is now "
            f"{live or 'none'}): the gang found idle is not the one this pod is in") or (
            _keep_until_refusal(pod, action) or _exempt_refusal(pod, action))
        if stays:
            return "refused", stays
        kind, _, name = gang.partition("/")
        if kind not in SUSPENDABLE_GANGS:
            why = ("nothing would start its pods again once stopped, so stopping them would "
                   "end its work for good" if kind == "PodGroup" else
                   f"gpusteward knows no switch of a {kind} that stops it reversibly")
            return "refused", (
                f"gang {gang} in {ref.namespace} is a {kind}, which gpusteward cannot suspend: "
                f"{why}; it suspends a JobSet or a Kubeflow training job "
                f"({', '.join(TRAINING_JOBS)}) only. Ask its owner to stop it")
        # The Workload the watcher saw admit the gang (its owner reference names the gang's
        # object: Kueue's pods need not name it), else the one the pod names.
        workload = action.params.get("gang_workload") or _kueue_workload(meta)
        if workload:
            return await self._suspend(
                "Workload", ref.namespace, workload, action,
                f"Kueue workload {ref.namespace}/{workload} of {gang}")
        return await self._suspend(kind, ref.namespace, name, action, gang)

    def _suspension(self, kind: str) -> Suspension:
        if kind == "Workload":
            return Suspension(KUEUE_GROUP, (self.settings.kueue_version,), "workloads",
                              ("active",), False)
        return SUSPENDABLE_GANGS[kind]

    async def _suspendable(self, kind: str, namespace: str, name: str
                           ) -> tuple[dict[str, Any], str]:
        """The object and the API version it was read at (the first one served)."""
        how = self._suspension(kind)
        for version in how.versions[:-1]:
            try:
                return await self._json(self.custom.get_namespaced_custom_object, how.group,
                                        version, namespace, how.plural, name), version
            except NotFound:
                continue
        version = how.versions[-1]
        return await self._json(self.custom.get_namespaced_custom_object, how.group, version,
                                namespace, how.plural, name), version

    async def _patch_suspendable(self, kind: str, version: str, namespace: str, name: str,
                                 body: dict[str, Any]) -> None:
        how = self._suspension(kind)
        await self._call(self.custom.patch_namespaced_custom_object, how.group, version,
                         namespace, how.plural, name, body, _content_type=MERGE)

    async def _suspend(self, kind: str, namespace: str, name: str, action: Action, what: str
                       ) -> tuple[Outcome, str]:
        """Flip ``kind``'s switch to stopped, naming the action beside it; what restore needs.

        The action's key (``gpusteward.io/suspended-by``) makes a replay after a crash
        between the patch and its audit record ``executed``, not a second patch; one found
        stopped by anyone else is left so, and one this action stopped that runs again was
        resumed by someone since, whose decision a retry must not undo. The patch carries
        the resourceVersion read, so a concurrent change is a conflict, read again."""
        how, key = self._suspension(kind), action.idempotency_key
        where = f"{kind} {namespace}/{name}"
        undo = f"gpusteward act --restore {kind}/{namespace}/{name}"
        for _attempt in range(5):
            try:
                obj, version = await self._suspendable(kind, namespace, name)
            except NotFound:
                return "skipped", f"{where} ({what}) is already gone"
            by = _annotations(obj).get(SUSPENDED_BY)
            if kind == "JobSet" and (manager := _controller(obj)) is not None:
                return await self._suspend_managed(obj, manager, action, what)
            owner = _controller(obj) if kind == "Workload" else None
            gang = action.params.get("gang")
            if owner is not None and not _admits(owner, gang):
                return "refused", (f"{where} belongs to {owner.get('kind')} "
                                   f"{owner.get('name')}, not to {gang}: another job's "
                                   "workload is left alone")
            if _switch(obj, how) == how.stopped:
                if by == key:
                    return "executed", (f"{where} was suspended by an earlier try of this action "
                                        f"(its audit record was lost); undo with `{undo}`")
                whom = f"by gpusteward action {by}" if by else "not by gpusteward"
                return "skipped", f"{where} is already suspended ({how.path}), {whom}: left so"
            if by == key:
                return "refused", (f"{where} was suspended by this action and resumed since: a "
                                   "retry must not undo that")
            queue = (obj["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL)
            if kind != "Workload" and queue:
                return "refused", (f"{where} is queued by Kueue (LocalQueue {queue}), but its "
                                   "pod names no Workload: Kueue would undo a suspension made "
                                   "behind its back; stop its Workload instead (`kueuectl "
                                   "stop workload`)")
            try:
                await self._patch_suspendable(kind, version, namespace, name, {
                    "metadata": {"resourceVersion": obj["metadata"].get("resourceVersion"),
                                 "annotations": {SUSPENDED_BY: key,
                                                 RECLAIMED_AT: _now_rfc3339(),
                                                 RECLAIMED_BECAUSE: action.reason[:250]}},
                    "spec": _switched(how, how.stopped)})
            except Conflict:
                continue
            switched = f"{how.path}={json.dumps(how.stopped)}"
            done = (f"deactivated {what} and left it inactive ({switched}): Kueue evicts it "
                    "and suspends its pods") if kind == "Workload" else (
                f"suspended {what} whole ({switched})")
            await self._owner_event(_told(obj), "GpuStewardReclaimed",
                                    f"Suspended to give back idle GPUs, every pod of "
                                    f"{action.params.get('gang')} being idle: {done}. "
                                    f"{action.reason[:500]}. Resume it with `{undo}`.")
            return "executed", f"{done}; undo with `{undo}`"
        return "failed", f"{where} kept changing under the suspension"

    async def _suspend_managed(self, jobset: dict[str, Any], manager: dict[str, Any],
                               action: Action, what: str) -> tuple[Outcome, str]:
        """A JobSet another controller owns: a TrainJob's is suspended through the TrainJob,
        whose controller sets its JobSet's ``spec.suspend`` from its own (one set on the
        JobSet alone would be set back, and the gang started again); any other owner's is
        refused, its controller being free to undo a suspension it did not make."""
        meta = jobset["metadata"]
        namespace = meta.get("namespace", "")
        trainjob = _trainjob_of(jobset)
        if trainjob is not None:
            return await self._suspend("TrainJob", namespace, trainjob, action,
                                       f"TrainJob {namespace}/{trainjob} of {what}")
        kind, name = manager.get("kind", ""), manager.get("name", "")
        return "refused", (f"JobSet {namespace}/{meta.get('name')} ({what}) is managed by "
                           f"{kind} {name}, whose controller may undo a suspension of the "
                           f"JobSet behind its back: gpusteward suspends a JobSet only "
                           "alone or under a TrainJob. Ask its owner to stop it")

    async def _resume(self, kind: str, namespace: str, name: str) -> tuple[Outcome, str]:
        """Undo a gang reclaim: flip the switch back on what gpusteward suspended only (a
        TrainJob's JobSet: on the TrainJob, as it was suspended)."""
        how = self._suspension(kind)
        where = f"{kind} {namespace}/{name}"
        obj, version = await self._suspendable(kind, namespace, name)
        trainjob = _trainjob_of(obj) if kind == "JobSet" else None
        if trainjob is not None and SUSPENDED_BY not in _annotations(obj):
            return await self._resume("TrainJob", namespace, trainjob)
        if SUSPENDED_BY not in _annotations(obj):
            return "refused", (f"{where} was not suspended by gpusteward (no {SUSPENDED_BY}): "
                               "left as it is")
        stopped = _switch(obj, how) == how.stopped
        body: dict[str, Any] = {"metadata": {
            "resourceVersion": obj["metadata"].get("resourceVersion"),
            "annotations": {SUSPENDED_BY: None, RECLAIMED_AT: None, RECLAIMED_BECAUSE: None}}}
        if stopped:
            body["spec"] = _switched(how, not how.stopped)
        await self._patch_suspendable(kind, version, namespace, name, body)
        if not stopped:
            return "skipped", f"{where} was already resumed; removed {SUSPENDED_BY}"
        await self._owner_event(_told(obj), "GpuStewardRestored",
                                "Resumed by gpusteward act --restore.")
        return "executed", f"resumed {where} ({how.path}={json.dumps(not how.stopped)})"

    async def _owner_event(self, obj: dict[str, Any], reason: str, message: str) -> None:
        """A Warning Event on ``obj``, where its owner looks (kubectl describe)."""
        meta = obj["metadata"]
        await self._event(meta["namespace"], k8s.V1ObjectReference(
            api_version=obj.get("apiVersion"), kind=obj.get("kind"), name=meta["name"],
            namespace=meta["namespace"], uid=meta.get("uid")), reason, message)

    async def _event(self, namespace: str, involved: k8s.V1ObjectReference, reason: str,
                     message: str) -> None:
        now = datetime.now(UTC)
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{involved.name}.gpusteward-",
                                      namespace=namespace),
            involved_object=involved, reason=reason, message=message, type="Warning",
            source=k8s.V1EventSource(component="gpusteward"),
            first_timestamp=now, last_timestamp=now, count=1,
            reporting_component="gpusteward", reporting_instance="gpusteward-executor",
        )
        await self._call(self.core.create_namespaced_event, namespace, event,
                         _preload_content=False)

    async def notify_owner(self, action: Action) -> tuple[Outcome, str]:
        ref = action.target.pod
        if ref is None:
            return "failed", "notify_owner needs a pod"
        try:
            pod = await self._pod(ref)
        except NotFound:
            # Not delivered: a pod recreated under this name (a StatefulSet's, a Notebook's)
            # would otherwise be reclaimed with its owner never told.
            return "failed", (f"pod {ref.namespace}/{ref.name} does not exist: no notice was "
                              "delivered")
        replaced = _replaced(pod, ref)
        if replaced:
            return "refused", f"{replaced}; no notice was delivered"
        annotations = pod["metadata"].get("annotations") or {}
        notice = action.reason[:1000]
        if annotations.get(NOTICE_ANNOTATION) == notice:
            return "skipped", f"{ref.namespace}/{ref.name} already carries this notice"
        now = _now_rfc3339()
        try:
            await self._event(ref.namespace, k8s.V1ObjectReference(
                api_version="v1", kind="Pod", name=ref.name, namespace=ref.namespace,
                uid=pod["metadata"].get("uid")), "GpuStewardNotice", notice)
        except ApiError as error:
            if error.status != 403:
                raise
            # RBAC (or an admission policy) keeps Events out of this namespace: say what it
            # costs, not only the API's words; the reclaim refused later names no cause.
            return "failed", (f"may not create Events in namespace {ref.namespace} "
                              f"({error.status} {error.reason}: {error.message}): no notice "
                              "was delivered, so no reclaim of this pod will follow; grant "
                              "create events there (deploy/components/remediation-execute)")
        await self._call(self.core.patch_namespaced_pod, ref.name, ref.namespace,
                         {"metadata": {"annotations": {NOTICE_ANNOTATION: notice,
                                                       f"{NOTICE_ANNOTATION}-at": now}}},
                         _content_type=STRATEGIC, _preload_content=False)
        return "executed", (f"notified the owner of {ref.namespace}/{ref.name}: Warning event "
                            f"GpuStewardNotice and annotation {NOTICE_ANNOTATION}")


def _annotations(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


def _kueue_workload(meta: dict[str, Any]) -> str | None:
    """The Kueue Workload a pod names (annotation, or label), if any."""
    return ((meta.get("annotations") or {}).get(KUEUE_WORKLOAD)
            or (meta.get("labels") or {}).get(KUEUE_WORKLOAD))


def _switch(obj: dict[str, Any], how: Suspension) -> bool:
    """The value of ``obj``'s suspend (or active) switch, its default where unset."""
    value: Any = obj.get("spec") or {}
    for part in how.field:
        value = value.get(part) if isinstance(value, dict) else None
    return (not how.stopped) if value is None else bool(value)


def _switched(how: Suspension, value: bool) -> dict[str, Any]:
    """The ``spec`` of a merge patch that sets ``how``'s switch to ``value``."""
    body: dict[str, Any] = {how.field[-1]: value}
    for part in reversed(how.field[:-1]):
        body = {part: body}
    return body


def _trainjob_of(jobset: dict[str, Any]) -> str | None:
    """The TrainJob (Kubeflow Trainer's) a JobSet runs, when one controls it."""
    manager = _controller(jobset)
    if manager is None or manager.get("kind") != "TrainJob" or not str(
            manager.get("apiVersion", "")).startswith(f"{TRAINER_GROUP}/"):
        return None
    return str(manager.get("name", ""))


def _admits(owner: dict[str, Any], gang: str | None) -> bool:
    """Whether a Kueue Workload of this controller admits ``gang``: its own object, or, for a
    TrainJob, the JobSet of its name its pods run in (the watcher's name for the gang)."""
    kind, name = owner.get("kind"), owner.get("name")
    return gang in (f"{kind}/{name}", f"JobSet/{name}" if kind == "TrainJob" else None)


def _told(obj: dict[str, Any]) -> dict[str, Any]:
    """Where a suspension's owner looks: a Kueue Workload's JobSet or job (its controller,
    for which Kueue made it), any other object itself."""
    owner = _controller(obj) if obj.get("kind") == "Workload" else None
    if owner is None:
        return obj
    return {"apiVersion": owner.get("apiVersion"), "kind": owner.get("kind"),
            "metadata": {"name": owner.get("name"), "namespace": obj["metadata"]["namespace"],
                         "uid": owner.get("uid")}}


def _replaced(pod: dict[str, Any], ref: PodRef) -> str | None:
    """Why the live ``pod`` is not the one ``ref`` names (another uid), or None.

    A StatefulSet or a Notebook recreates its pod under the same name: an action about
    the old one must not reach the new one, whose owner was told nothing. A ref without a
    uid (a pod known by name only, as the kubelet reports it) matches by name.
    """
    live = pod.get("metadata", {}).get("uid")
    if ref.uid is None or live == ref.uid:
        return None
    return (f"pod {ref.namespace}/{ref.name} was replaced: the live pod's uid is {live}, "
            f"the action names {ref.uid}")


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference marked ``controller``, or None."""
    owners = obj.get("metadata", {}).get("ownerReferences") or []
    return next((o for o in owners if o.get("controller")), None)


def _keep_until_refusal(pod: dict[str, Any], action: Action) -> str | None:
    """Why the live pod's keep-until annotation forbids reclaiming it now, or None."""
    annotations = pod["metadata"].get("annotations") or {}
    try:
        idle_since = float(action.params.get("idle_since", action.ts))
        max_s = float(action.params.get("keep_until_max_s", 14 * 86400))
    except ValueError:
        idle_since, max_s = action.ts, 14 * 86400
    until = kept_until(annotations, idle_since, max_s)
    if until is None or until <= time.time():
        return None
    return (f"{pod['metadata'].get('namespace')}/{pod['metadata']['name']} is left alone until "
            f"{rfc3339(until)} ({KEEP_UNTIL_ANNOTATION}: {annotations[KEEP_UNTIL_ANNOTATION]})")


def _exempt_refusal(pod: dict[str, Any], action: Action) -> str | None:
    """Why the live pod is exempt from idle detection now (the owner labelled it after the
    rule asked to reclaim it), by the exemptions the action carries; None if it is not."""
    try:
        exempt = json.loads(action.params.get("exempt") or "{}")
    except ValueError:
        return None
    if not isinstance(exempt, dict):
        return None
    meta = pod["metadata"]
    why = exemption(exempt, meta.get("namespace", ""), meta.get("labels") or {},
                    meta.get("annotations") or {})
    return None if why is None else (
        f"{meta.get('namespace')}/{meta['name']} is exempt from idle detection ({why})")


def _require(value: str | None, message: str) -> str:
    if not value:
        raise PermanentError(message)
    return value


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
