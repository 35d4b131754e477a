"""The Kubernetes backend of the remediation executor: the one module that changes a cluster.

Each verb is an async method taking the :class:`~gpusteward.schema.Action`
and returning (outcome, detail), as :class:`~gpusteward.remediation.executor.Executor`
expects. The official ``kubernetes`` client is synchronous, so every API
call runs in a worker thread (``asyncio.to_thread``); the event loop keeps
serving Kafka while a drain waits on a PodDisruptionBudget.

Every verb reads before it writes and reports ``skipped`` when the effect is
already there, so a replay after a crash between the write and the audit
record changes nothing. Patches name their content type: this client
version defaults ``patch_node`` to ``application/json-patch+json``, which
the API server rejects for an object body. Nodes and pods get a strategic
merge patch (as kubectl sends), custom objects a JSON merge patch.

What each verb does, and the API permissions it needs:

- ``cordon``: ``spec.unschedulable=true`` plus a reason annotation
  (get, patch nodes);
- ``taint``: adds ``gpusteward.io/<key>`` with NoSchedule or NoExecute
  (get, patch nodes); the list is replaced with the node's resourceVersion
  as a precondition, so a concurrent change makes it retry, not clobber;
- ``drain``: cordon, then evict each pod through the Eviction API (create
  pods/eviction; list pods): DaemonSet pods, mirror (static) pods, finished
  pods and pods in denied namespaces are left; a 429 (a PodDisruptionBudget
  forbids it now) is retried with backoff until ``drain_timeout_s``, after
  which the drain reports ``failed`` with the pods left. Pods are never
  deleted directly;
- ``requeue``: a Kueue workload is deactivated (``spec.active=false``),
  then reactivated once Kueue has evicted it (get, patch workloads); the pod
  of a plain Job is deleted so the Job controller recreates it (delete
  pods); a pod without a controller is refused, deleting it would lose it;
- ``notify_owner``: a Warning Event on the pod (create events) and a
  ``gpusteward.io/notice`` annotation (patch pods);
- ``set_mig_config``: the ``nvidia.com/mig.config`` label, which the GPU
  Operator's MIG manager applies (patch nodes); the executor only lets it
  through when policy allows.
- the breaker's fleet size: list nodes.

Every API call goes through :meth:`KubernetesBackend._call`, which turns the
client's exceptions into :mod:`gpusteward.errors`: 404, 409 and 422 are
permanent (``NotFound``, ``Conflict``, ``Invalid``); 429, 5xx, timeouts and
refused connections are temporary, with the server's ``Retry-After`` as the
delay. A verb lets temporary errors out, and the executor tries the whole
verb again after a backoff; that is safe because each verb reads first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field
from urllib3.exceptions import HTTPError as TransportError
from urllib3.exceptions import MaxRetryError
from urllib3.exceptions import TimeoutError as TransportTimeout

from gpusteward.errors import (
    ApiError,
    ApiTimeout,
    ApiUnreachable,
    Conflict,
    NotFound,
    PermanentError,
    TooManyRequests,
    api_error,
    cut,
)
from gpusteward.schema import Action, Outcome, PodRef

log = logging.getLogger(__name__)

TAINT_PREFIX = "gpusteward.io/"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
NOTICE_ANNOTATION = "gpusteward.io/notice"
CORDON_ANNOTATION = "gpusteward.io/cordon-reason"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
KUEUE_GROUP = "kueue.x-k8s.io"
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
    kueue_version: str = Field(
        "v1beta1", description="Kueue API version: v1beta1 is served by every Kueue release "
        "(deprecated from 0.15, where v1beta2 is the storage version).")
    deny_namespaces: set[str] = Field(
        default_factory=lambda: {"kube-system"},
        description="Namespaces whose pods a drain leaves in place.")
    request_timeout_s: float = Field(30.0, gt=0, description="Per API request, seconds.")


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
        self.custom = k8s.CustomObjectsApi(api_client)
        self._sleep = sleep

    def _load_client(self) -> k8s.ApiClient:
        if self.settings.kubeconfig is None:
            try:
                k8s_config.load_incluster_config()
                return k8s.ApiClient()
            except k8s_config.ConfigException:
                pass
        return k8s_config.new_client_from_config(config_file=self.settings.kubeconfig,
                                                 context=self.settings.context)

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
        node = _require(action.target.node, "cordon needs a node")
        if (await self._node(node)).get("spec", {}).get("unschedulable"):
            return "skipped", f"{node} is already cordoned"
        await self._patch_node(node, {
            "metadata": {"annotations": {CORDON_ANNOTATION: action.reason[:250]}},
            "spec": {"unschedulable": True},
        })
        return "executed", f"cordoned {node}: no new pods will be scheduled there"

    async def taint(self, action: Action) -> tuple[Outcome, str]:
        node = _require(action.target.node, "taint needs a node")
        key = action.params.get("key", "gpusteward.io/unhealthy")
        if not key.startswith(TAINT_PREFIX):
            key = TAINT_PREFIX + key
        effect = action.params.get("effect", "NoSchedule")
        if effect not in ("NoSchedule", "NoExecute"):
            return "refused", f"taint effect must be NoSchedule or NoExecute, not {effect!r}"
        value = action.params.get("value", action.rule)
        for _attempt in range(5):
            current = await self._node(node)
            taints = list(current.get("spec", {}).get("taints") or [])
            if any(t.get("key") == key and t.get("effect") == effect for t in taints):
                return "skipped", f"{node} already has taint {key}:{effect}"
            taints.append({"key": key, "value": value, "effect": effect,
                           "timeAdded": _now_rfc3339()})
            version = current.get("metadata", {}).get("resourceVersion")
            try:
                await self._patch_node(node, {"metadata": {"resourceVersion": version},
                                              "spec": {"taints": taints}})
            except Conflict:  # someone changed the node meanwhile: read again
                continue
            return "executed", f"tainted {node} with {key}={value}:{effect}"
        return "failed", f"{node} kept changing under the taint patch (5 conflicts)"

    async def set_mig_config(self, action: Action) -> tuple[Outcome, str]:
        node = _require(action.target.node, "set_mig_config needs a node")
        config = action.params.get("config")
        if not config:
            return "failed", "set_mig_config needs params.config (a mig-parted config name)"
        labels = (await self._node(node)).get("metadata", {}).get("labels") or {}
        if labels.get(MIG_CONFIG_LABEL) == config:
            return "skipped", f"{node} already has {MIG_CONFIG_LABEL}={config}"
        await self._patch_node(node, {"metadata": {"labels": {MIG_CONFIG_LABEL: config}}})
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
        if meta.get("namespace") in self.settings.deny_namespaces:
            return "denied namespace"
        return None

    async def _evict(self, namespace: str, name: str) -> tuple[str, str]:
        """One eviction attempt: ('evicted'|'gone'|'blocked'|'error', message)."""
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
        except ApiError as error:
            return "error", str(error)
        return "evicted", ""

    async def drain(self, action: Action) -> tuple[Outcome, str]:
        node = _require(action.target.node, "drain needs a node")
        cordon_outcome, _ = await self.cordon(action)
        left: list[str] = []
        to_evict: list[tuple[str, str]] = []
        for pod in await self._pods_on(node):
            meta = pod["metadata"]
            why = self._leave_reason(pod)
            if why:
                left.append(f"{meta['namespace']}/{meta['name']} ({why})")
            else:
                to_evict.append((meta["namespace"], meta["name"]))
        deadline = time.monotonic() + self.settings.drain_timeout_s
        backoff = self.settings.eviction_backoff_s
        evicted: list[str] = []
        blocked: dict[str, str] = {}
        errors: dict[str, str] = {}
        pending = list(to_evict)
        while pending:
            retry: list[tuple[str, str]] = []
            for namespace, name in pending:
                state, message = await self._evict(namespace, name)
                ref = f"{namespace}/{name}"
                if state in ("evicted", "gone"):
                    evicted.append(ref)
                    blocked.pop(ref, None)
                elif state == "blocked":
                    blocked[ref] = message
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
        if blocked or errors:
            problems = [f"{ref} blocked by a PodDisruptionBudget ({why})"
                        for ref, why in blocked.items()]
            problems += [f"{ref}: {why}" for ref, why in errors.items()]
            timed = (f" after {self.settings.drain_timeout_s:g} s" if blocked else "")
            return "failed", f"drain incomplete{timed}: {summary}; not evicted: " + "; ".join(
                problems)
        return "executed", summary

    # -- pods: requeue, notify -------------------------------------------------------------

    async def _pod(self, pod: PodRef) -> dict[str, Any]:
        return await self._json(self.core.read_namespaced_pod, pod.name, pod.namespace)

    async def _workload(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._json(
            self.custom.get_namespaced_custom_object, KUEUE_GROUP,
            self.settings.kueue_version, namespace, "workloads", name)

    async def _set_active(self, namespace: str, name: str, active: bool) -> None:
        await self._call(self.custom.patch_namespaced_custom_object, KUEUE_GROUP,
                         self.settings.kueue_version, namespace, "workloads", name,
                         {"spec": {"active": active}}, _content_type=MERGE)

    async def requeue(self, action: Action) -> tuple[Outcome, str]:
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
            labels = pod["metadata"].get("labels") or {}
            annotations = pod["metadata"].get("annotations") or {}
            workload = (annotations.get("kueue.x-k8s.io/workload")
                        or labels.get("kueue.x-k8s.io/workload"))
        if workload:
            return await self._requeue_workload(namespace, workload)
        assert pod is not None and pod_ref is not None
        return await self._requeue_job_pod(pod, pod_ref)

    async def _requeue_workload(self, namespace: str, name: str) -> tuple[Outcome, str]:
        current = await self._workload(namespace, name)
        if current.get("spec", {}).get("active", True) is False:
            # A crash between the two patches left it inactive: finish the requeue.
            await self._set_active(namespace, name, True)
            return "executed", f"reactivated Kueue workload {namespace}/{name} (was inactive)"
        await self._set_active(namespace, name, False)
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
        try:
            await self._call(self.core.delete_namespaced_pod, ref.name, ref.namespace,
                             _preload_content=False)
        except NotFound:
            return "skipped", f"pod {ref.namespace}/{ref.name} is already gone"
        return "executed", (f"deleted pod {ref.namespace}/{ref.name}; Job "
                            f"{controller.get('name')} recreates it elsewhere")

    async def notify_owner(self, action: Action) -> tuple[Outcome, str]:
        ref = action.target.pod
        if ref is None:
            return "failed", "notify_owner needs a pod"
        try:
            pod = await self._pod(ref)
        except NotFound:
            return "skipped", f"pod {ref.namespace}/{ref.name} is gone"
        annotations = pod["metadata"].get("annotations") or {}
        notice = action.reason[:1000]
        if annotations.get(NOTICE_ANNOTATION) == notice:
            return "skipped", f"{ref.namespace}/{ref.name} already carries this notice"
        now = _now_rfc3339()
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{ref.name}.gpusteward-",
                                      namespace=ref.namespace),
            involved_object=k8s.V1ObjectReference(
                api_version="v1", kind="Pod", name=ref.name, namespace=ref.namespace,
                uid=pod["metadata"].get("uid")),
            reason="GpuStewardNotice", message=notice, type="Warning",
            source=k8s.V1EventSource(component="gpusteward"),
            first_timestamp=datetime.now(UTC), last_timestamp=datetime.now(UTC), count=1,
            reporting_component="gpusteward", reporting_instance="gpusteward-executor",
        )
        await self._call(self.core.create_namespaced_event, ref.namespace, event,
                         _preload_content=False)
        await self._call(self.core.patch_namespaced_pod, ref.name, ref.namespace,
                         {"metadata": {"annotations": {NOTICE_ANNOTATION: notice,
                                                       f"{NOTICE_ANNOTATION}-at": now}}},
                         _content_type=STRATEGIC, _preload_content=False)
        return "executed", (f"notified the owner of {ref.namespace}/{ref.name}: Warning event "
                            f"GpuStewardNotice and annotation {NOTICE_ANNOTATION}")


def _require(value: str | None, message: str) -> str:
    if not value:
        raise PermanentError(message)
    return value


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
