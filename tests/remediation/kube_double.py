"""A minimal Kubernetes API-server double for the remediation backend's tests.

It serves the few endpoints the backend uses, with objects in upstream API
JSON shape, on a free loopback port, so the real ``kubernetes`` client talks
to it through an ordinary kubeconfig:

- nodes: list, get, patch (merge and strategic-merge patch; a JSON patch
  with an object body is a 400, as on a real server; a ``resourceVersion``
  in the patch is a precondition, 409 on mismatch);
- pods: list (all namespaces, ``fieldSelector=spec.nodeName=...``), get,
  patch, delete, and the ``eviction`` subresource, which answers 429 while
  a matching PodDisruptionBudget has ``status.disruptionsAllowed`` 0;
- Kueue workloads (custom objects): get, list, merge patch; deactivating an
  admitted workload evicts it (condition ``Evicted``/``Deactivated``) the
  way Kueue's controller would, reactivating adds ``Requeued``/``Reactivated``;
- core/v1 events: create.

Strategic merge patches are applied as JSON merge patches: the backend only
sends maps and whole-list replacements (taints carry no patch strategy), for
which the two agree. Evicted pods disappear at once (no graceful
termination). Every request is recorded in ``requests`` for assertions.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

Object = dict[str, Any]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def node(name: str, *, gpus: int = 8, labels: dict[str, str] | None = None) -> Object:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}",
                     "labels": {"kubernetes.io/hostname": name,
                                **({"nvidia.com/gpu.present": "true"} if gpus else {}),
                                **(labels or {})}},
        "spec": {},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi",
                                   **({"nvidia.com/gpu": str(gpus)} if gpus else {})}},
    }


def pod(namespace: str, name: str, node_name: str, *, owner_kind: str | None = "ReplicaSet",
        owner_name: str = "owner", labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None, phase: str = "Running") -> Object:
    meta: Object = {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                    "labels": labels or {}, "annotations": annotations or {}}
    if owner_kind:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind,
                                    "name": owner_name, "uid": f"uid-{owner_name}",
                                    "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node_name, "containers": [{"name": "main", "image": "x"}]},
            "status": {"phase": phase}}


def pdb(namespace: str, name: str, match_labels: dict[str, str], allowed: int) -> Object:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": match_labels}, "minAvailable": 1},
            "status": {"disruptionsAllowed": allowed}}


def workload(namespace: str, name: str, *, admitted: bool = True) -> Object:
    status: Object = {"conditions": []}
    if admitted:
        status["admission"] = {"clusterQueue": "research", "podSetAssignments": []}
        status["conditions"] = [{"type": "Admitted", "status": "True", "reason": "Admitted"}]
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-wl-{name}"},
            "spec": {"active": True, "queueName": "research", "podSets": []},
            "status": status}


@dataclass
class ClusterState:
    nodes: dict[str, Object] = field(default_factory=dict)
    pods: dict[tuple[str, str], Object] = field(default_factory=dict)
    pdbs: list[Object] = field(default_factory=list)
    workloads: dict[tuple[str, str], Object] = field(default_factory=dict)
    events: list[Object] = field(default_factory=list)
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    """(method, path, content type) of every request."""
    evictions: list[tuple[str, str, int]] = field(default_factory=list)
    """(namespace, pod, HTTP status) of every eviction request."""
    workload_patches: list[tuple[str, bool]] = field(default_factory=list)
    """(workload, spec.active) of every workload patch, in order."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    _versions: itertools.count = field(default_factory=lambda: itertools.count(100))

    def bump(self, obj: Object) -> Object:
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
        return obj

    def add(self, *objects: Object) -> None:
        with self.lock:
            for obj in objects:
                self.bump(obj)
                meta = obj["metadata"]
                kind = obj["kind"]
                if kind == "Node":
                    self.nodes[meta["name"]] = obj
                elif kind == "Pod":
                    self.pods[(meta["namespace"], meta["name"])] = obj
                elif kind == "PodDisruptionBudget":
                    self.pdbs.append(obj)
                elif kind == "Workload":
                    self.workloads[(meta["namespace"], meta["name"])] = obj
                else:
                    raise ValueError(kind)

    def cordoned(self) -> list[str]:
        return sorted(n for n, o in self.nodes.items() if o["spec"].get("unschedulable"))


def status(code: int, reason: str, message: str, **extra: Any) -> Object:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code, **extra}


class _Handler(BaseHTTPRequestHandler):
    state: ClusterState

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        return

    def _send(self, code: int, body: Object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"null")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        content_type = self.headers.get("Content-Type", "")
        with self.state.lock:
            self.state.requests.append((method, url.path, content_type))
            try:
                code, body = self._route(method, url.path, query, content_type)
            except KeyError as missing:
                code, body = 404, status(404, "NotFound", f"{missing} not found")
        self._send(code, body)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _route(self, method: str, path: str, query: dict[str, list[str]],
               content_type: str) -> tuple[int, Object]:
        state = self.state
        if path == "/api/v1/nodes" and method == "GET":
            return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {},
                         "items": list(state.nodes.values())}
        if match := re.fullmatch(r"/api/v1/nodes/([^/]+)", path):
            name = match[1]
            if name not in state.nodes:
                raise KeyError(f"nodes {name!r}")
            if method == "GET":
                return 200, state.nodes[name]
            if method == "PATCH":
                return self._patch(state.nodes, name, content_type)
        if path == "/api/v1/pods" and method == "GET":
            selector = (query.get("fieldSelector") or [""])[0]
            items = list(state.pods.values())
            if selector.startswith("spec.nodeName="):
                wanted = selector.split("=", 1)[1]
                items = [p for p in items if p["spec"].get("nodeName") == wanted]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if match := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)(/eviction)?", path):
            key = (match[1], match[2])
            if match[3]:
                return self._evict(key)
            if key not in state.pods:
                raise KeyError(f'pods "{key[1]}"')
            if method == "GET":
                return 200, state.pods[key]
            if method == "PATCH":
                return self._patch(state.pods, key, content_type)
            if method == "DELETE":
                return 200, state.pods.pop(key)
        if match := re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path):
            if method == "POST":
                event = self._body()
                meta = event.setdefault("metadata", {})
                if not meta.get("name"):
                    meta["name"] = f"{meta.get('generateName', 'event-')}{len(state.events)}"
                state.events.append(state.bump(event))
                return 201, event
        if match := re.fullmatch(r"/apis/kueue\.x-k8s\.io/(v1beta[12])/namespaces/([^/]+)"
                                 r"/workloads(?:/([^/]+))?", path):
            namespace, name = match[2], match[3]
            if name is None and method == "GET":
                items = [w for (ns, _), w in state.workloads.items() if ns == namespace]
                return 200, {"kind": "WorkloadList", "apiVersion": f"kueue.x-k8s.io/{match[1]}",
                             "metadata": {}, "items": items}
            key = (namespace, name or "")
            if key not in state.workloads:
                raise KeyError(f'workloads.kueue.x-k8s.io "{name}"')
            if method == "GET":
                return 200, state.workloads[key]
            if method == "PATCH":
                return self._patch_workload(key, content_type)
        return 404, status(404, "NotFound", f"the double does not serve {method} {path}")

    def _patch(self, table: dict[Any, Object], key: Any, content_type: str
               ) -> tuple[int, Object]:
        patch = self._body()
        if content_type.startswith("application/json-patch+json") and not isinstance(patch,
                                                                                      list):
            return 400, status(400, "BadRequest", "json: cannot unmarshal object into Go value "
                               "of type jsonpatch.Patch")
        if not content_type.startswith(("application/merge-patch+json",
                                        "application/strategic-merge-patch+json")):
            return 415, status(415, "UnsupportedMediaType", f"the double cannot {content_type}")
        current = table[key]
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
            return 409, status(409, "Conflict", "the object has been modified; please apply "
                               "your changes to the latest version and try again")
        table[key] = self.state.bump(merge_patch(current, patch))
        return 200, table[key]

    def _patch_workload(self, key: tuple[str, str], content_type: str) -> tuple[int, Object]:
        state = self.state
        before = state.workloads[key]["spec"].get("active", True)
        code, body = self._patch(state.workloads, key, content_type)
        if code != 200:
            return code, body
        after = body["spec"].get("active", True)
        state.workload_patches.append((key[1], after))
        status_ = body.setdefault("status", {})
        conditions = status_.setdefault("conditions", [])
        if before and not after and status_.get("admission"):
            status_.pop("admission")
            conditions[:] = [c for c in conditions if c["type"] != "Admitted"]
            conditions.append({"type": "Evicted", "status": "True", "reason": "Deactivated"})
        elif not before and after:
            conditions[:] = [c for c in conditions if c["type"] != "Evicted"]
            conditions.append({"type": "Requeued", "status": "True", "reason": "Reactivated"})
        return code, body

    def _evict(self, key: tuple[str, str]) -> tuple[int, Object]:
        state = self.state
        body = self._body()
        if (body or {}).get("kind") != "Eviction":
            return 400, status(400, "BadRequest", "expected an Eviction")
        if key not in state.pods:
            state.evictions.append((*key, 404))
            raise KeyError(f'pods "{key[1]}"')
        labels = state.pods[key]["metadata"].get("labels") or {}
        for budget in state.pdbs:
            if budget["metadata"]["namespace"] != key[0]:
                continue
            selector = budget["spec"]["selector"]["matchLabels"]
            if all(labels.get(k) == v for k, v in selector.items()):
                if budget["status"]["disruptionsAllowed"] <= 0:
                    state.evictions.append((*key, 429))
                    return 429, status(
                        429, "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        details={"causes": [{"reason": "DisruptionBudget", "message":
                                             f"The disruption budget {budget['metadata']['name']}"
                                             " needs 1 healthy pods and has 1 currently"}]})
                budget["status"]["disruptionsAllowed"] -= 1
        state.evictions.append((*key, 201))
        del state.pods[key]
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                     "status": "Success", "code": 201}


class KubeDouble:
    """The double's HTTP server on a free loopback port, and a kubeconfig pointing at it."""

    def __init__(self, directory: Path) -> None:
        self.state = ClusterState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "double",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "not-checked"}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "tester"}}],
        }))
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> KubeDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
