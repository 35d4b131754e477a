"""A local Kubernetes API-server double that speaks the real list/watch protocol.

No real API server can run here (no etcd, no container engine), yet the
watcher's correctness lives in protocol details: resourceVersions, bookmarks,
410 Gone after compaction, dropped connections, paged lists. So the double
is an HTTP server (``http.server`` in a thread, so the synchronous official
``kubernetes`` client reaches it through an ordinary kubeconfig) serving
object JSON that follows the upstream API types.

What it serves (``/api/v1`` and ``/apis/<group>/<version>``): pods, nodes,
events, PodDisruptionBudgets, Kueue's workloads and queues, ``apps/v1``
Deployments, ReplicaSets and StatefulSets, Kubeflow Notebooks, and what states
a gang's size (coscheduling and Volcano PodGroups, JobSets, PyTorchJobs,
MPIJobs, TFJobs), and Dynamic Resource Allocation's ResourceClaims and
ResourceSlices (``resource.k8s.io/v1``); ``absent`` leaves out any of them, as a
cluster without its CRD (or, for DRA, before Kubernetes 1.34) would; for each:

- ``GET`` list (``limit``/``continue`` paging, ``labelSelector``,
  ``fieldSelector`` on ``metadata.name``, ``metadata.namespace``,
  ``spec.nodeName``, ``status.phase``) and watch (``watch=1``: chunked JSON
  lines ``{"type", "object"}``; ``resourceVersion`` to resume; none or ``0``
  starts with synthetic ``ADDED`` events; ``allowWatchBookmarks``;
  ``timeoutSeconds``; an ``ERROR`` event with a 410 Status when the
  resourceVersion is older than the last compaction, or when an open watch
  falls behind one; HTTP 410 instead with ``gone_as_http_status``), ``GET``
  of one object, discovery of ``/apis``, ``/apis/<group>`` and
  ``/apis/<group>/<version>`` (404 for Kueue when ``kueue=False``;
  ``kueue_versions`` picks the served versions);
- ``POST`` create (Events, any kind), ``PUT`` replace (409 on a stale
  ``metadata.resourceVersion``), ``DELETE``;
- ``PATCH`` with ``application/merge-patch+json``,
  ``application/strategic-merge-patch+json`` (merge-patch semantics: the
  fields remediation touches, ``spec.unschedulable``, labels, annotations,
  ``spec.taints`` and Kueue's ``spec.active``, have no list merge keys, so the
  two agree on them) and ``application/json-patch+json``; on the object or
  its ``status`` subresource;
- ``POST .../pods/<name>/eviction``: 429 when a PodDisruptionBudget that
  selects the pod allows no disruption, 500 when several select it, else the
  PDB's ``status.disruptionsAllowed`` goes down by one and the pod is deleted.
- ``POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`` (what
  ``kubectl auth can-i`` asks about the caller): 201 with the review and its
  ``status``; every request is allowed unless :meth:`KubeApiServer.deny`
  named its verb on its resource, as an RBAC authorizer answers (denied:
  ``allowed`` false, a ``reason``; nothing is stored).
- ``POST /apis/authorization.k8s.io/v1/subjectaccessreviews`` (what
  ``kubectl auth can-i --as`` asks about another user): allowed only what
  :meth:`KubeApiServer.grant` granted to the review's ``user`` or one of its
  ``groups`` (RBAC denies what no rule allows); 403 Forbidden when the caller
  is denied ``create subjectaccessreviews`` (``deny("create",
  "subjectaccessreviews", "authorization.k8s.io")``), as RBAC answers a caller
  without that grant.

With ``event_ttl_s`` Events expire as the API server's ``--event-ttl`` (1 h by default)
has them expire: each write of an Event (create or update) gives it that long from then,
by the double's ``clock``, and an expired Event is deleted (a ``DELETED`` watch event)
before the next request is answered or :meth:`KubeApiServer.objects` is read.

Selectors filter watch events on the object's new state (a real watch cache
also sends DELETED when an object stops matching). Deliberate
simplifications: deletion is immediate (no graceful
``deletionTimestamp`` phase); cordoning adds the
``node.kubernetes.io/unschedulable`` taint in the same write (the node
lifecycle controller does it a moment later in a real cluster); one object
store serves every version of a group.

Test hooks: :meth:`KubeApiServer.create`, :meth:`~KubeApiServer.update`,
:meth:`~KubeApiServer.mutate`, :meth:`~KubeApiServer.patch`,
:meth:`~KubeApiServer.delete` (each bumps the resourceVersion and emits a
watch event), :meth:`~KubeApiServer.drop_watches` (breaks every open watch
connection mid-stream), :meth:`~KubeApiServer.outage` (a context in which
every request fails with 503 and watches are dropped),
:meth:`~KubeApiServer.compact` (older resourceVersions then get 410),
:attr:`~KubeApiServer.end_watches_at_once` (every watch ends, cleanly, right after
its headers),
:meth:`~KubeApiServer.fail` (the next N requests of a method answer an error
status, optionally with ``Retry-After``, or hang and are dropped, so that a
client's timeout fires), :meth:`~KubeApiServer.add_controller` (a function run
after every write of a kind, standing in for the controller that reacts to it,
such as :func:`kueue_deactivation`), and :attr:`~KubeApiServer.requests` (every
request received, for assertions).

Usage::

    with KubeApiServer() as api:
        api.load_dir(Path("tests/data/kube"))
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        # kubernetes.config.new_client_from_config(str(kubeconfig)) talks to it
"""

from __future__ import annotations

import base64
import copy
import json
import re
import socket
import sys
import threading
import time
import uuid as uuidlib
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec

Obj = dict[str, Any]

KUEUE_GROUP = "kueue.x-k8s.io"
KUBEFLOW_GROUP = "kubeflow.org"
NOTEBOOK_GROUP = KUBEFLOW_GROUP
DRA_GROUP = "resource.k8s.io"


@dataclass(frozen=True)
class Resource:
    """One served resource type."""

    group: str
    """API group; ``""`` for the core group."""
    plural: str
    kind: str
    namespaced: bool
    versions: tuple[str, ...]


RESOURCES: tuple[Resource, ...] = (
    Resource("", "pods", "Pod", True, ("v1",)),
    Resource("", "nodes", "Node", False, ("v1",)),
    Resource("", "events", "Event", True, ("v1",)),
    Resource("events.k8s.io", "events", "Event", True, ("v1",)),
    Resource("policy", "poddisruptionbudgets", "PodDisruptionBudget", True, ("v1",)),
    Resource(KUEUE_GROUP, "workloads", "Workload", True, ("v1beta1", "v1beta2")),
    Resource(KUEUE_GROUP, "localqueues", "LocalQueue", True, ("v1beta1", "v1beta2")),
    Resource(KUEUE_GROUP, "clusterqueues", "ClusterQueue", False, ("v1beta1", "v1beta2")),
    # The owners an idle pod's reclaim acts on: Pod -> ReplicaSet -> Deployment,
    # Pod -> StatefulSet (-> Kubeflow Notebook, whose controller owns the StatefulSet).
    Resource("apps", "deployments", "Deployment", True, ("v1",)),
    Resource("apps", "replicasets", "ReplicaSet", True, ("v1",)),
    Resource("apps", "statefulsets", "StatefulSet", True, ("v1",)),
    # The collector's DaemonSet, which ``doctor`` reads for why a GPU node has no collector.
    Resource("apps", "daemonsets", "DaemonSet", True, ("v1",)),
    # A Job's pod is requeued by deleting it; the backend reads the Job first (gone,
    # suspended, finished, or at its backoffLimit: no requeue).
    Resource("batch", "jobs", "Job", True, ("v1",)),
    Resource(NOTEBOOK_GROUP, "notebooks", "Notebook", True, ("v1beta1", "v1")),
    # KEDA's autoscaler of a Deployment or StatefulSet, which a reclaim's scale to zero
    # would fight when it keeps replicas above zero.
    Resource("keda.sh", "scaledobjects", "ScaledObject", True, ("v1alpha1",)),
    # The objects that state a gang's size (the watcher's optional resources): the
    # coscheduling plugin's and Volcano's PodGroups, JobSets, Kubeflow training jobs.
    Resource("scheduling.x-k8s.io", "podgroups", "PodGroup", True, ("v1alpha1",)),
    Resource("scheduling.volcano.sh", "podgroups", "PodGroup", True, ("v1beta1",)),
    Resource("jobset.x-k8s.io", "jobsets", "JobSet", True, ("v1alpha2",)),
    Resource(KUBEFLOW_GROUP, "pytorchjobs", "PyTorchJob", True, ("v1",)),
    Resource(KUBEFLOW_GROUP, "mpijobs", "MPIJob", True, ("v1", "v2beta1")),
    Resource(KUBEFLOW_GROUP, "tfjobs", "TFJob", True, ("v1",)),
    # Training jobs that state no gang size the watcher reads, but that a gang reclaim
    # suspends (spec.runPolicy.suspend) as it does the three above.
    Resource(KUBEFLOW_GROUP, "xgboostjobs", "XGBoostJob", True, ("v1",)),
    Resource(KUBEFLOW_GROUP, "paddlejobs", "PaddleJob", True, ("v1",)),
    Resource(KUBEFLOW_GROUP, "jaxjobs", "JAXJob", True, ("v1",)),
    # Kubeflow Trainer's TrainJob, which owns the JobSet its pods run in.
    Resource("trainer.kubeflow.org", "trainjobs", "TrainJob", True, ("v1alpha1",)),
    # Dynamic Resource Allocation, GA in Kubernetes 1.34: the claims that hand pods their
    # devices and the drivers' slices that publish them. A cluster before 1.34 serves no
    # resource.k8s.io/v1: ``absent`` leaves both out.
    Resource(DRA_GROUP, "resourceclaims", "ResourceClaim", True, ("v1",)),
    Resource(DRA_GROUP, "resourceclaimtemplates", "ResourceClaimTemplate", True, ("v1",)),
    Resource(DRA_GROUP, "resourceslices", "ResourceSlice", False, ("v1",)),
)
_BY_KIND = {(r.group, r.kind): r for r in RESOURCES}
AUTHORIZATION_GROUP = "authorization.k8s.io"
ACCESS_REVIEWS = f"/apis/{AUTHORIZATION_GROUP}/v1/selfsubjectaccessreviews"
SUBJECT_ACCESS_REVIEWS = f"/apis/{AUTHORIZATION_GROUP}/v1/subjectaccessreviews"
_BY_PLURAL = {(r.group, r.plural): r for r in RESOURCES}

_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


class ApiError(Exception):
    """An error answered as a Kubernetes ``Status`` object.

    The simulated server's answer, not an error of gpusteward's: the client side
    sees it as the status it carries (``gpusteward.errors`` maps those).
    """

    def __init__(self, code: int, reason: str, message: str,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.retry_after = retry_after

    def status(self) -> Obj:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}


_REASONS = {429: "TooManyRequests", 500: "InternalError", 502: "BadGateway",
            503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class Fault:
    """Failures the double answers instead of serving matching requests."""

    method: str
    """The HTTP method it applies to (``GET``, ``PATCH``, ...)."""
    remaining: int
    """Matching requests still to fail; the fault is spent at 0."""
    status: int = 503
    path: str = ""
    """A regular expression searched in the request path; empty matches every path."""
    query: str = ""
    """A regular expression searched in the request's query string (``continue=``,
    ``watch=true``); empty matches every query."""
    retry_after: float | None = None
    """Seconds sent as ``Retry-After``; None sends no header."""
    hang_s: float = 0.0
    """When above 0: hold the request this long, then drop the connection unanswered and
    unserved (a client whose timeout is shorter sees a read timeout)."""


Controller = Callable[["KubeApiServer", Obj | None, Obj], None]
"""Runs after a write of the kind it watches, with the object before (None when created)
and after; it may write through the server's test hooks, as a controller would."""


TRAINER_GROUP = "trainer.kubeflow.org"


def trainjob_suspension(api: KubeApiServer, before: Obj | None, after: Obj) -> None:
    """What Kubeflow Trainer's TrainJob controller does with the JobSet it runs as (same
    name, owned by the TrainJob): it keeps the JobSet's ``spec.suspend`` at the TrainJob's
    own (default false), after a write of either. Add it for both kinds."""
    meta = after["metadata"]
    namespace = meta.get("namespace", "")
    if after.get("kind") == "TrainJob":
        trainjob, name = after, meta["name"]
    else:
        owner = next((o for o in meta.get("ownerReferences") or []
                      if o.get("controller") and o.get("kind") == "TrainJob"), None)
        if owner is None:
            return
        name = owner["name"]
        try:
            trainjob = api.get("TrainJob", name, namespace, TRAINER_GROUP)
        except KeyError:
            return
    wanted = bool(trainjob.get("spec", {}).get("suspend", False))
    try:
        jobset = api.get("JobSet", name, namespace, "jobset.x-k8s.io")
    except KeyError:
        return
    if bool(jobset.get("spec", {}).get("suspend", False)) != wanted:
        api.mutate("JobSet", name, lambda obj: obj.setdefault("spec", {}).update(
            suspend=wanted), namespace, "jobset.x-k8s.io")


def kueue_deactivation(api: KubeApiServer, before: Obj | None, after: Obj) -> None:
    """What Kueue's workload controller does when ``spec.active`` changes.

    Deactivating an admitted workload evicts it (its admission is released and an
    ``Evicted`` condition with reason ``Deactivated`` is set); reactivating it drops
    that condition and adds ``Requeued``/``Reactivated``, so it queues again.
    """
    was_active = (before or {}).get("spec", {}).get("active", True)
    active = after.get("spec", {}).get("active", True)
    meta = after["metadata"]
    if was_active and not active and after.get("status", {}).get("admission"):
        def evict(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            status.pop("admission", None)
            conditions = [c for c in status.get("conditions", [])
                          if c["type"] not in ("Admitted", "QuotaReserved", "Evicted")]
            status["conditions"] = [*conditions, {
                "type": "Evicted", "status": "True", "reason": "Deactivated",
                "lastTransitionTime": now_rfc3339()}]

        api.mutate("Workload", meta["name"], evict, meta.get("namespace", ""), KUEUE_GROUP)
    elif before is not None and not was_active and active:
        def requeue(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            conditions = [c for c in status.get("conditions", []) if c["type"] != "Evicted"]
            status["conditions"] = [*conditions, {
                "type": "Requeued", "status": "True", "reason": "Reactivated",
                "lastTransitionTime": now_rfc3339()}]

        api.mutate("Workload", meta["name"], requeue, meta.get("namespace", ""), KUEUE_GROUP)


@dataclass
class _Change:
    rv: int
    resource: Resource
    type: str
    obj: Obj


@dataclass
class RecordedRequest:
    """A request the double received."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    status: int = 0
    at: float = field(default_factory=time.monotonic)
    """When it arrived (``time.monotonic``), for assertions on the pace of retries."""


@dataclass
class _Store:
    objects: dict[tuple[str, str, str, str], Obj] = field(default_factory=dict)
    """(group, plural, namespace, name) -> the current object (never mutated in place)."""
    history: list[_Change] = field(default_factory=list)
    rv: int = 1
    compacted_rv: int = 0
    """Watches and continue tokens from a resourceVersion below this get 410."""


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _resource_of(obj: Obj) -> Resource:
    api_version = obj.get("apiVersion", "v1")
    group = api_version.split("/")[0] if "/" in api_version else ""
    try:
        return _BY_KIND[(group, obj["kind"])]
    except KeyError as e:
        raise ValueError(f"the double does not serve {api_version} {obj.get('kind')}") from e


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (returns a new value)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # strategic-merge directives: not needed for the fields served here
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Obj, operations: list[Obj]) -> Obj:
    """RFC 6902 JSON patch: add, remove, replace and test."""
    doc = copy.deepcopy(target)
    for op in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, op["value"])
            elif kind == "remove":
                parent.pop(index)
            elif kind == "replace":
                parent[index] = op["value"]
            elif kind == "test" and parent[index] != op["value"]:
                raise ApiError(422, "Invalid", f"test failed at {op['path']}")
        elif kind in ("add", "replace"):
            parent[last] = op["value"]
        elif kind == "remove":
            del parent[last]
        elif kind == "test" and parent.get(last) != op["value"]:
            raise ApiError(422, "Invalid", f"test failed at {op['path']}")
    return doc


def _label_match(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


_FIELDS: dict[str, Callable[[Obj], str]] = {
    "metadata.name": lambda o: o["metadata"].get("name", ""),
    "metadata.namespace": lambda o: o["metadata"].get("namespace", ""),
    "spec.nodeName": lambda o: o.get("spec", {}).get("nodeName", ""),
    "status.phase": lambda o: o.get("status", {}).get("phase", ""),
}


def _field_match(obj: Obj, selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, value = term.split("!=" if negate else "=", 1)
        key = key.rstrip("=")
        if key not in _FIELDS:
            raise ApiError(400, "BadRequest", f"field label not supported: {key}")
        if (_FIELDS[key](obj) == value) == negate:
            return False
    return True


def _selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels."""
    if selector is None:
        return False
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


class _QuietServer(ThreadingHTTPServer):
    """A client that drops its keep-alive connection (a process stopping, a pool closing)
    is ordinary for a server; socketserver would print a traceback for each one."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError):
            super().handle_error(request, client_address)


class KubeApiServer:
    """The API-server double; see the module docstring for what it serves."""

    def __init__(self, *, kueue: bool = True, kueue_versions: tuple[str, ...] = (
                 "v1beta1", "v1beta2"), bookmark_interval_s: float = 1.0, port: int = 0,
                 absent: Iterable[str] = (), event_ttl_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.kueue = kueue
        """Whether the Kueue API group is served (False: as if Kueue were not installed)."""
        self.absent = frozenset(absent)
        """``plural.group`` of resources not served, as if their CRD were not installed
        (``pytorchjobs.kubeflow.org``): 404 on every request, left out of discovery."""
        self.kueue_versions = kueue_versions
        """Kueue versions served (Kueue before 0.15 serves only v1beta1)."""
        self.gone_as_http_status = False
        """Answer a watch from a compacted resourceVersion with HTTP 410 instead of an
        ``ERROR`` event in a 200 stream (what some proxies and older servers do)."""
        self.bookmark_interval_s = bookmark_interval_s
        self.event_ttl_s = event_ttl_s
        """Seconds an Event lives after its last write (the API server's ``--event-ttl``);
        None: for ever."""
        self.clock = clock
        """What the Event TTL is measured by (seconds): tests move it along."""
        self._event_expiry: dict[tuple[str, str, str, str], float] = {}
        self.end_watches_at_once = False
        """End every watch right after its headers, cleanly and without an event (a
        proxy that cuts streams short, a server going down): the client must back off
        rather than ask again at once."""
        self.requests: list[RecordedRequest] = []
        self.record_requests = True
        self._store = _Store()
        self._cond = threading.Condition()
        self._drop_generation = 0
        self._refusing = False
        self._faults: list[Fault] = []
        self._controllers: dict[tuple[str, str], list[Controller]] = {}
        self._continues: dict[str, tuple[int, list[Obj]]] = {}
        self.denied: set[tuple[str, str, str]] = set()
        """(verb, group, resource[/subresource]) that the caller's own access reviews answer
        as not allowed."""
        self.granted: dict[str, set[tuple[str, str, str]]] = {}
        """User or group name -> (verb, group, resource[/subresource]) that
        SubjectAccessReviews about it answer as allowed; nothing else is."""
        self._server = _QuietServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> KubeApiServer:
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kube-api-double", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> KubeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig whose current context points at this double."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "double",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "double", "user": {"token": "double-token"}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "double"}}],
        }
        path.write_text(json.dumps(config))
        return path

    # -- loading and test hooks ----------------------------------------------------------

    def deny(self, verb: str, resource: str, group: str = "") -> None:
        """Answer access reviews of ``verb`` on ``resource`` (``pods/eviction`` for a
        subresource) in ``group`` as not allowed, as if RBAC lacked the rule."""
        self.denied.add((verb, group, resource))

    def grant(self, subject: str, verb: str, resource: str, group: str = "") -> None:
        """Answer SubjectAccessReviews of ``verb`` on ``resource`` (``pods/eviction`` for a
        subresource) in ``group`` about ``subject`` (a user name such as
        ``system:serviceaccount:<namespace>:<name>``, or a group) as allowed, as an RBAC
        binding of that rule to it would."""
        self.granted.setdefault(subject, set()).add((verb, group, resource))

    @staticmethod
    def _asked(review: Obj) -> tuple[str, str, str]:
        attributes = review.get("spec", {}).get("resourceAttributes") or {}
        resource = attributes.get("resource", "")
        if attributes.get("subresource"):
            resource = f"{resource}/{attributes['subresource']}"
        return attributes.get("verb", ""), attributes.get("group", ""), resource

    @staticmethod
    def _answer(review: Obj, kind: str, allowed: bool) -> Obj:
        status: Obj = {"allowed": allowed}
        if not allowed:
            status["reason"] = "no RBAC rule of the double allows it"
        return {**review, "apiVersion": f"{AUTHORIZATION_GROUP}/v1", "kind": kind,
                "metadata": {**review.get("metadata", {}), "creationTimestamp": None},
                "status": status}

    def review_access(self, review: Obj) -> Obj:
        """A SelfSubjectAccessReview with its ``status`` filled in, as the API server sends."""
        return self._answer(review, "SelfSubjectAccessReview",
                            self._asked(review) not in self.denied)

    def review_subject_access(self, review: Obj) -> Obj:
        """A SubjectAccessReview with its ``status`` filled in from :attr:`granted`."""
        if ("create", AUTHORIZATION_GROUP, "subjectaccessreviews") in self.denied:
            raise ApiError(403, "Forbidden", 'subjectaccessreviews.authorization.k8s.io is '
                           'forbidden: User "double" cannot create resource '
                           '"subjectaccessreviews" in API group "authorization.k8s.io" at the '
                           "cluster scope")
        spec = review.get("spec", {})
        subjects = [spec.get("user", ""), *(spec.get("groups") or [])]
        asked = self._asked(review)
        return self._answer(review, "SubjectAccessReview",
                            any(asked in self.granted.get(s, ()) for s in subjects))

    def load_dir(self, directory: Path) -> int:
        """Create every object of every ``*.json`` file (an object or a ``List``)."""
        count = 0
        for path in sorted(directory.glob("*.json")):
            count += self.load(json.loads(path.read_text()))
        return count

    def load(self, document: Obj | Iterable[Obj]) -> int:
        """Create an object, a ``*List`` document's items, or an iterable of objects."""
        if isinstance(document, dict):
            items = document["items"] if document.get("kind", "").endswith("List") else [document]
        else:
            items = list(document)
        for obj in items:
            self.create(obj)
        return len(items)

    @property
    def resource_version(self) -> int:
        """The newest resourceVersion."""
        return self._store.rv

    def latest_change(self, plural: str) -> int:
        """The resourceVersion of the newest change to a resource (``pods``, or
        ``podgroups.scheduling.x-k8s.io`` where a plural names several), 0 for none.

        A watcher that has seen it has seen everything of that resource, without
        waiting for a bookmark to move it past changes to other resources.
        """
        with self._cond:
            for change in reversed(self._store.history):
                resource = change.resource
                if plural in (resource.plural, f"{resource.plural}.{resource.group}"):
                    return change.rv
        return 0

    def get(self, kind: str, name: str, namespace: str = "", group: str = "") -> Obj:
        """A copy of the current object; KeyError when absent."""
        resource = _BY_KIND[(group, kind)]
        return copy.deepcopy(self._store.objects[self._key(resource, namespace, name)])

    def objects(self, kind: str, group: str = "") -> list[Obj]:
        """Copies of every stored object of a kind."""
        resource = _BY_KIND[(group, kind)]
        with self._cond:
            self._expire_events()
            return [copy.deepcopy(o) for k, o in self._store.objects.items()
                    if k[:2] == (resource.group, resource.plural)]

    def create(self, obj: Obj) -> Obj:
        resource = _resource_of(obj)
        with self._cond:
            return self._write(resource, copy.deepcopy(obj), "ADDED")

    def update(self, obj: Obj) -> Obj:
        """Replace an object as a controller would (no resourceVersion check)."""
        resource = _resource_of(obj)
        with self._cond:
            return self._write(resource, copy.deepcopy(obj), "MODIFIED")

    def mutate(self, kind: str, name: str, change: Callable[[Obj], None], namespace: str = "",
               group: str = "") -> Obj:
        """Apply ``change`` to a copy of the object and store it as a new version."""
        resource = _BY_KIND[(group, kind)]
        with self._cond:
            obj = copy.deepcopy(self._store.objects[self._key(resource, namespace, name)])
            change(obj)
            return self._write(resource, obj, "MODIFIED")

    def patch(self, kind: str, name: str, patch: Obj, namespace: str = "",
              group: str = "") -> Obj:
        """Merge-patch an object."""
        def change(obj: Obj) -> None:
            patched = merge_patch(obj, patch)
            obj.clear()
            obj.update(patched)

        return self.mutate(kind, name, change, namespace, group)

    def delete(self, kind: str, name: str, namespace: str = "", group: str = "") -> Obj:
        resource = _BY_KIND[(group, kind)]
        with self._cond:
            return self._delete(resource, namespace, name)

    def drop_watches(self) -> None:
        """Break every open watch connection, as a load balancer or apiserver restart does."""
        with self._cond:
            self._drop_generation += 1
            self._cond.notify_all()

    @contextmanager
    def outage(self) -> Iterator[None]:
        """Inside: open watches break and every request gets 503."""
        with self._cond:
            self._refusing = True
        self.drop_watches()
        try:
            yield
        finally:
            with self._cond:
                self._refusing = False

    def fail(self, method: str, count: int = 1, *, status: int = 503, path: str = "",
             retry_after: float | None = None, hang_s: float = 0.0, query: str = "") -> Fault:
        """Make the next ``count`` ``method`` requests (whose path matches ``path`` and query
        string ``query``) fail.

        They answer ``status`` (with ``Retry-After`` when given) without being
        served, or with ``hang_s`` are held and dropped unanswered. Faults added
        earlier are used up first. Returns the fault, whose ``remaining`` counts down.
        """
        fault = Fault(method.upper(), count, status, path, query, retry_after, hang_s)
        with self._cond:
            self._faults.append(fault)
        return fault

    def _take_fault(self, method: str, path: str, query: str = "") -> Fault | None:
        with self._cond:
            for fault in self._faults:
                if fault.remaining > 0 and fault.method == method and re.search(
                        fault.path, path) and re.search(fault.query, query):
                    fault.remaining -= 1
                    return fault
        return None

    def add_controller(self, kind: str, controller: Controller, group: str = "") -> None:
        """Run ``controller`` after every write of ``kind`` (see :data:`Controller`)."""
        self._controllers.setdefault((group, kind), []).append(controller)

    def compact(self) -> int:
        """Forget history: a watch or continue from an older resourceVersion then gets 410."""
        with self._cond:
            self._store.compacted_rv = self._store.rv
            self._store.history.clear()
            self._continues.clear()
            return self._store.rv

    def watch_count(self) -> int:
        """Watch requests received so far (each reconnect counts)."""
        return sum(1 for r in self.requests if r.method == "GET" and
                   r.query.get("watch") in ("1", "true", "True"))

    # -- store internals (hold self._cond) -----------------------------------------------

    @staticmethod
    def _key(resource: Resource, namespace: str, name: str) -> tuple[str, str, str, str]:
        return (resource.group, resource.plural, namespace if resource.namespaced else "", name)

    def _write(self, resource: Resource, obj: Obj, event: str, *, check_rv: bool = False
               ) -> Obj:
        meta = obj.setdefault("metadata", {})
        if "name" not in meta:
            if "generateName" not in meta:
                raise ApiError(422, "Invalid", "metadata.name is required")
            meta["name"] = meta["generateName"] + uuidlib.uuid4().hex[:5]
        key = self._key(resource, meta.get("namespace", ""), meta["name"])
        current = self._store.objects.get(key)
        if event == "ADDED" and current is not None:
            raise ApiError(409, "AlreadyExists", f"{resource.plural} \"{meta['name']}\" already "
                           "exists")
        if event == "MODIFIED":
            if current is None:
                raise ApiError(404, "NotFound", f"{resource.plural} \"{meta['name']}\" not found")
            if check_rv and meta.get("resourceVersion") not in (
                    None, "", current["metadata"]["resourceVersion"]):
                raise ApiError(409, "Conflict", "the object has been modified; please apply "
                               "your changes to the latest version and try again")
            meta["uid"] = current["metadata"]["uid"]
            meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]
        else:
            meta.setdefault("uid", str(uuidlib.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339())
        if resource.plural == "nodes":
            self._cordon_taint(obj)
        self._store.rv += 1
        meta["resourceVersion"] = str(self._store.rv)
        self._store.objects[key] = obj
        if resource.kind == "Event" and self.event_ttl_s is not None:
            self._event_expiry[key] = self.clock() + self.event_ttl_s
        self._store.history.append(_Change(self._store.rv, resource, event, obj))
        self._cond.notify_all()
        written = copy.deepcopy(obj)
        for controller in self._controllers.get((resource.group, resource.kind), ()):
            controller(self, copy.deepcopy(current) if current else None, copy.deepcopy(obj))
        return written

    def _expire_events(self) -> None:
        """Delete the Events whose TTL has run out, as etcd's lease does on a cluster."""
        now = self.clock()
        for key, expiry in list(self._event_expiry.items()):
            if expiry <= now:
                del self._event_expiry[key]
                if key in self._store.objects:
                    self._delete(_BY_KIND[(key[0], "Event")], key[2], key[3])

    @staticmethod
    def _cordon_taint(node: Obj) -> None:
        """What the node lifecycle controller does on (un)cordon, in the same write."""
        spec = node.setdefault("spec", {})
        key = "node.kubernetes.io/unschedulable"
        taints = spec.get("taints", [])
        has = any(t.get("key") == key for t in taints)
        if spec.get("unschedulable") and not has:
            spec["taints"] = [*taints, {"key": key, "effect": "NoSchedule",
                                        "timeAdded": now_rfc3339()}]
        elif not spec.get("unschedulable") and has:
            spec["taints"] = [t for t in taints if t.get("key") != key]
            if not spec["taints"]:
                del spec["taints"]

    def _delete(self, resource: Resource, namespace: str, name: str) -> Obj:
        key = self._key(resource, namespace, name)
        current = self._store.objects.pop(key, None)
        if current is None:
            raise ApiError(404, "NotFound", f"{resource.plural} \"{name}\" not found")
        obj = copy.deepcopy(current)
        self._store.rv += 1
        obj["metadata"]["resourceVersion"] = str(self._store.rv)
        self._store.history.append(_Change(self._store.rv, resource, "DELETED", obj))
        self._cond.notify_all()
        return obj

    def _evict(self, namespace: str, name: str) -> Obj:
        pods = _BY_KIND[("", "Pod")]
        pod = self._store.objects.get(self._key(pods, namespace, name))
        if pod is None:
            raise ApiError(404, "NotFound", f"pods \"{name}\" not found")
        labels = pod["metadata"].get("labels", {})
        pdbs = [o for k, o in self._store.objects.items()
                if k[:3] == ("policy", "poddisruptionbudgets", namespace)
                and _selects(o.get("spec", {}).get("selector"), labels)]
        if len(pdbs) > 1:
            raise ApiError(500, "InternalError", "This pod has more than one "
                           "PodDisruptionBudget, which the eviction subresource does not support.")
        if pdbs:
            pdb = pdbs[0]
            allowed = int(pdb.get("status", {}).get("disruptionsAllowed", 0))
            if allowed < 1:
                raise ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate "
                               f"the pod's disruption budget {pdb['metadata']['name']}.")
            updated = copy.deepcopy(pdb)
            updated.setdefault("status", {})["disruptionsAllowed"] = allowed - 1
            self._write(_BY_KIND[("policy", "PodDisruptionBudget")], updated, "MODIFIED")
        self._delete(pods, namespace, name)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "code": 201}

    def _resource(self, group: str, version: str, plural: str) -> Resource:
        resource = _BY_PLURAL.get((group, plural))
        if resource is None or version not in self.served_versions(resource):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return resource

    def served_versions(self, resource: Resource) -> tuple[str, ...]:
        """The versions a resource is served at; none when its CRD is not installed."""
        if f"{resource.plural}.{resource.group}" in self.absent:
            return ()
        if resource.group == KUEUE_GROUP:
            return self.kueue_versions if self.kueue else ()
        return resource.versions

    def _matching(self, resource: Resource, namespace: str | None, query: dict[str, str],
                  obj: Obj) -> bool:
        meta = obj["metadata"]
        if namespace is not None and meta.get("namespace", "") != namespace:
            return False
        if "labelSelector" in query and not _label_match(meta.get("labels", {}),
                                                         query["labelSelector"]):
            return False
        return "fieldSelector" not in query or _field_match(obj, query["fieldSelector"])

    def _snapshot(self, resource: Resource, namespace: str | None, query: dict[str, str]
                  ) -> list[Obj]:
        items = [o for k, o in self._store.objects.items()
                 if k[:2] == (resource.group, resource.plural)
                 and self._matching(resource, namespace, query, o)]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return items

    def _list(self, resource: Resource, version: str, namespace: str | None,
              query: dict[str, str]) -> bytes:
        limit = int(query.get("limit", "0") or 0)
        with self._cond:
            if "continue" in query:
                token = query["continue"]
                if token not in self._continues:
                    raise ApiError(410, "Expired", "The provided continue parameter is too old "
                                   "to display a consistent list result.")
                list_rv, items = self._continues.pop(token)
            else:
                list_rv, items = self._store.rv, self._snapshot(resource, namespace, query)
            page, rest = (items[:limit], items[limit:]) if limit else (items, [])
            meta: Obj = {"resourceVersion": str(list_rv)}
            if rest:
                token = base64.urlsafe_b64encode(uuidlib.uuid4().bytes).decode()
                self._continues[token] = (list_rv, rest)
                meta["continue"] = token
                meta["remainingItemCount"] = len(rest)
        api_version = f"{resource.group}/{version}" if resource.group else version
        head = msgspec.json.encode({"kind": f"{resource.kind}List", "apiVersion": api_version,
                                    "metadata": meta})
        body = b",".join(msgspec.json.encode(_as_version(o, resource, version)) for o in page)
        return head[:-1] + b',"items":[' + body + b"]}"

    # -- HTTP ----------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(_Handler):
            api = server

        return Handler


class _Handler(BaseHTTPRequestHandler):
    api: KubeApiServer
    protocol_version = "HTTP/1.1"
    generation = 0
    """The double's :meth:`~KubeApiServer.drop_watches` count when this request came."""

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read :attr:`KubeApiServer.requests` instead."""

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _send(self, code: int, body: bytes, retry_after: float | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        if retry_after is not None:
            self.send_header("Retry-After", f"{retry_after:g}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        content_type = (self.headers.get("Content-Type") or "").split(";")[0]
        request = RecordedRequest(method, parts.path, query, content_type,
                                  json.loads(raw) if raw else None)
        api = self.api
        # A watch breaks at a drop that comes after its request did, even one that comes
        # before the stream starts, as a connection open at the drop would.
        self.generation = api._drop_generation
        if api.record_requests:
            with api._cond:
                api.requests.append(request)
        retry_after: float | None = None
        try:
            if api._refusing:
                raise ApiError(503, "ServiceUnavailable", "the double is in an outage")
            fault = api._take_fault(method, parts.path, parts.query)
            if fault is not None and fault.hang_s > 0:
                with api._cond:
                    api._cond.wait_for(lambda: api._closed, timeout=fault.hang_s)
                self._abort()
                return
            if fault is not None:
                raise ApiError(fault.status, _REASONS.get(fault.status, "Failure"),
                               f"injected failure of {method} {parts.path}",
                               retry_after=fault.retry_after)
            with api._cond:
                api._expire_events()
            code, body = self._route(method, parts.path, query, request)
        except ApiError as e:
            code, body = e.code, msgspec.json.encode(e.status())
            retry_after = e.retry_after
        except (KeyError, ValueError, TypeError, IndexError) as e:
            code = 400
            body = msgspec.json.encode(ApiError(400, "BadRequest", repr(e)).status())
        request.status = code
        if body is not None:
            self._send(code, body, retry_after)

    def _route(self, method: str, path: str, query: dict[str, str], request: RecordedRequest
               ) -> tuple[int, bytes | None]:
        api = self.api
        path = path.rstrip("/") or "/"
        if path in ("/api", "/apis", "/version") or (path.startswith("/apis/") and (
                path.count("/") in (2, 3))):
            return self._discovery(path)
        if method == "POST" and path == ACCESS_REVIEWS:
            return 201, msgspec.json.encode(api.review_access(request.body or {}))
        if method == "POST" and path == SUBJECT_ACCESS_REVIEWS:
            return 201, msgspec.json.encode(api.review_subject_access(request.body or {}))
        match = _PATH.match(path)
        if match is None:
            raise ApiError(404, "NotFound", f"no route for {path}")
        group = match["group"] or ""
        version = match["core"] or match["version"]
        resource = api._resource(group, version, match["plural"])
        namespace, name, sub = match["ns"], match["name"], match["sub"]
        if method == "GET" and name is None:
            if query.get("watch") in ("1", "true", "True"):
                self._watch(resource, version, namespace, query)
                return 200, None
            return 200, api._list(resource, version, namespace, query)
        if method == "POST" and name is None:
            obj = dict(request.body)
            obj.setdefault("metadata", {})
            if namespace:
                obj["metadata"].setdefault("namespace", namespace)
            with api._cond:
                return 201, msgspec.json.encode(api._write(resource, obj, "ADDED"))
        if name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} on a collection")
        ns = namespace or ""
        with api._cond:
            if method == "POST" and sub == "eviction" and resource.plural == "pods":
                return 201, msgspec.json.encode(api._evict(ns, name))
            current = api._store.objects.get(api._key(resource, ns, name))
            if current is None:
                raise ApiError(404, "NotFound", f"{resource.plural} \"{name}\" not found")
            if method == "GET":
                return 200, msgspec.json.encode(_as_version(current, resource, version))
            if method == "DELETE":
                return 200, msgspec.json.encode(api._delete(resource, ns, name))
            if method == "PUT":
                return 200, msgspec.json.encode(api._write(resource, dict(request.body),
                                                           "MODIFIED", check_rv=True))
            if method == "PATCH":
                if request.content_type == "application/json-patch+json":
                    updated = json_patch(current, request.body)
                elif request.content_type in ("application/merge-patch+json",
                                              "application/strategic-merge-patch+json"):
                    updated = merge_patch(current, request.body)
                else:
                    raise ApiError(415, "UnsupportedMediaType",
                                   f"patch type {request.content_type} not supported")
                return 200, msgspec.json.encode(api._write(resource, updated, "MODIFIED",
                                                           check_rv=True))
        raise ApiError(405, "MethodNotAllowed", f"{method} {path}")

    def _discovery(self, path: str) -> tuple[int, bytes]:
        if path == "/version":
            return 200, msgspec.json.encode({"major": "1", "minor": "34",
                                             "gitVersion": "v1.34.0-double"})
        if path == "/api":
            return 200, msgspec.json.encode({"kind": "APIVersions", "versions": ["v1"]})
        served = {resource: versions for resource in RESOURCES if resource.group
                  and (versions := self.api.served_versions(resource))}
        groups: dict[str, tuple[str, ...]] = {}
        for resource, versions in served.items():
            known = groups.get(resource.group, ())
            groups[resource.group] = known + tuple(v for v in versions if v not in known)
        if path == "/apis":
            return 200, msgspec.json.encode({"kind": "APIGroupList", "apiVersion": "v1",
                                             "groups": [_group(g, v) for g, v in groups.items()]})
        _, _, group, *version = path.split("/")
        if group not in groups or (version and version[0] not in groups[group]):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not version:
            return 200, msgspec.json.encode({"kind": "APIGroup", "apiVersion": "v1",
                                             **_group(group, groups[group])})
        # /apis/<group>/<version>: the resources served at it (what get_api_resources reads)
        listed = [{"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                   "kind": r.kind, "verbs": ["create", "delete", "get", "list", "patch",
                                             "update", "watch"]}
                  for r, versions in served.items() if r.group == group and version[0] in versions]
        return 200, msgspec.json.encode({"kind": "APIResourceList", "apiVersion": "v1",
                                         "groupVersion": f"{group}/{version[0]}",
                                         "resources": listed})

    # -- watch ---------------------------------------------------------------------------

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _watch(self, resource: Resource, version: str, namespace: str | None,
               query: dict[str, str]) -> None:
        api = self.api
        store = api._store
        api_version = f"{resource.group}/{version}" if resource.group else version
        timeout = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        bookmarks = query.get("allowWatchBookmarks") in ("1", "true", "True")
        requested = query.get("resourceVersion", "")
        if api.gone_as_http_status and requested not in ("", "0") and (
                int(requested) < store.compacted_rv):
            raise ApiError(410, "Expired", f"too old resource version: {requested}")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if api.end_watches_at_once:
            self._chunk(b"")
            return
        initial: list[bytes] = []
        with api._cond:
            generation = self.generation
            requested = query.get("resourceVersion", "")
            if requested in ("", "0"):
                since = store.rv
                initial = [_event("ADDED", o, api_version)
                           for o in api._snapshot(resource, namespace, query)]
            else:
                since = int(requested)
                if since < store.compacted_rv:
                    initial = [msgspec.json.encode({"type": "ERROR", "object": ApiError(
                        410, "Expired", f"too old resource version: {since} "
                        f"({store.compacted_rv})").status()}) + b"\n"]
                    since = -1
        try:
            if initial:
                self._chunk(b"".join(initial))
            if since < 0:
                self._chunk(b"")
                return
            next_bookmark = time.monotonic() + api.bookmark_interval_s
            while True:
                expired = False
                pending = []
                with api._cond:
                    while True:
                        if api._drop_generation != generation or api._closed:
                            self._abort()
                            return
                        if since < store.compacted_rv:
                            # Compacted under a watch that had not caught up: etcd cancels
                            # such a watcher and the apiserver ends the stream with 410.
                            expired = True
                            break
                        position = bisect_right(store.history, since, key=_rv)
                        pending = store.history[position:]
                        now = time.monotonic()
                        if pending or now >= deadline or (bookmarks and now >= next_bookmark):
                            break
                        api._cond.wait(min(deadline, next_bookmark) - now)
                    if expired:
                        gone = ApiError(410, "Expired", f"too old resource version: {since} "
                                        f"({store.compacted_rv})").status()
                    lines = [_event(c.type, c.obj, api_version) for c in pending
                             if c.resource is resource
                             and api._matching(resource, namespace, query, c.obj)]
                    if pending:
                        since = pending[-1].rv
                    latest = store.rv
                if expired:
                    self._chunk(msgspec.json.encode({"type": "ERROR", "object": gone}) + b"\n")
                    self._chunk(b"")
                    return
                if lines:
                    self._chunk(b"".join(lines))
                now = time.monotonic()
                if bookmarks and now >= next_bookmark:
                    self._chunk(msgspec.json.encode({"type": "BOOKMARK", "object": {
                        "kind": resource.kind, "apiVersion": api_version,
                        "metadata": {"resourceVersion": str(max(since, latest))}}}) + b"\n")
                    since = max(since, latest)
                    next_bookmark = now + api.bookmark_interval_s
                if now >= deadline:
                    self._chunk(b"")
                    return
        except (BrokenPipeError, ConnectionResetError):
            return

    def _abort(self) -> None:
        """Break the connection mid-stream, without the closing chunk."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _as_version(obj: Obj, resource: Resource, version: str) -> Obj:
    """The object as served at ``version`` (one store serves every version of a group)."""
    api_version = f"{resource.group}/{version}" if resource.group else version
    return obj if obj.get("apiVersion") == api_version else {**obj, "apiVersion": api_version}


def _rv(change: _Change) -> int:
    return change.rv


def _group(name: str, versions: tuple[str, ...]) -> Obj:
    listed = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": listed, "preferredVersion": listed[-1]}


def _event(kind: str, obj: Obj, api_version: str) -> bytes:
    if obj.get("apiVersion") != api_version:
        obj = {**obj, "apiVersion": api_version}
    return msgspec.json.encode({"type": kind, "object": obj}) + b"\n"
