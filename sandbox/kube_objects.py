"""Builders of upstream-shaped Kubernetes objects (pods, GPU nodes, Kueue workloads) for tests.

They fill only the fields the watcher and the remediation consumer read, with
the shapes of core/v1 and kueue.x-k8s.io/v1beta2; fixtures with every field
live in ``tests/data/kube/``.
"""

from __future__ import annotations

import copy
from typing import Any

Obj = dict[str, Any]


def gpu_pod(name: str, namespace: str = "team-a", *, node: str | None = None,
            resources: dict[str, str] | None = None, labels: dict[str, str] | None = None,
            owner: tuple[str, str] | None = ("Job", "train"), uid: str | None = None,
            phase: str = "Pending", created: str = "2026-11-20T10:00:00Z") -> Obj:
    """A pod as a Job controller creates it, optionally already bound to ``node``."""
    requests = resources if resources is not None else {"nvidia.com/gpu": "1"}
    meta: Obj = {"name": name, "namespace": namespace, "creationTimestamp": created,
                 "labels": dict(labels or {})}
    if uid:
        meta["uid"] = uid
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": owner[0],
                                    "name": owner[1], "uid": f"owner-{owner[1]}",
                                    "controller": True}]
    spec: Obj = {"containers": [{"name": "main", "image": "pytorch:25.01",
                                 "resources": {"limits": dict(requests),
                                               "requests": dict(requests)}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec,
            "status": {"phase": phase}}


def bind(pod: Obj, node: str, at: str = "2026-11-20T10:01:00Z") -> None:
    pod["spec"]["nodeName"] = node
    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True",
                                    "lastTransitionTime": at}]


def start(pod: Obj, at: str = "2026-11-20T10:01:05Z") -> None:
    pod["status"]["phase"] = "Running"
    pod["status"]["startTime"] = at


def gpu_node(name: str, gpus: int = 8, labels: dict[str, str] | None = None,
             resources: dict[str, str] | None = None) -> Obj:
    capacity = resources if resources is not None else {"nvidia.com/gpu": str(gpus)}
    all_labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                  "nvidia.com/gpu.count": str(gpus), "nvidia.com/mig.strategy": "none",
                  **(labels or {})}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": all_labels}, "spec": {},
            "status": {"capacity": {"cpu": "96", **capacity},
                       "allocatable": {"cpu": "95", **copy.deepcopy(capacity)}}}


def workload(name: str, namespace: str = "team-a", *, queue: str = "team-a-lq",
             gpus: int = 4, count: int = 1, priority: int = 100) -> Obj:
    request = {"nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace,
                     "creationTimestamp": "2026-11-20T10:00:00Z"},
        "spec": {"queueName": queue, "priority": priority, "active": True, "podSets": [{
            "name": "main", "count": count, "template": {"spec": {"containers": [{
                "name": "main", "image": "pytorch:25.01",
                "resources": {"requests": request, "limits": request}}]}}}]},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False",
                                   "reason": "WaitingForQuota",
                                   "lastTransitionTime": "2026-11-20T10:00:01Z"}]},
    }


def set_condition(obj: Obj, kind: str, status: str, reason: str,
                  at: str = "2026-11-20T10:05:00Z") -> None:
    conditions = [c for c in obj["status"].get("conditions", []) if c["type"] != kind]
    conditions.append({"type": kind, "status": status, "reason": reason,
                       "lastTransitionTime": at})
    obj["status"]["conditions"] = conditions


def rfc3339(ts: float) -> str:
    """Unix seconds as the API's RFC 3339 timestamp (whole seconds, as the API keeps them)."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

