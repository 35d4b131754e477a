"""The objects the remediation verbs act on, in upstream JSON shape, and what to read back.

Thin wrappers of :mod:`gpusteward.sandbox.kube_objects` with the fields the
verbs read (owner kinds, annotations, PodDisruptionBudgets, admitted workloads).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gpusteward import kafka, topics
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, workload
from gpusteward.schema import Action
from gpusteward.settings import Settings
from gpusteward.streams.outputs import subject_key

Obj = dict[str, Any]


def node(name: str, *, gpus: int = 8, labels: dict[str, str] | None = None) -> Obj:
    """A node; ``gpus=0`` is a CPU node (no GPU resources, no GPU-present label)."""
    obj = gpu_node(name, gpus, labels=labels, resources={} if gpus == 0 else None)
    if gpus:
        obj["metadata"]["labels"]["nvidia.com/gpu.present"] = "true"
    return obj


def pod(namespace: str, name: str, node_name: str, *, owner_kind: str | None = "ReplicaSet",
        owner_name: str = "owner", labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None, phase: str = "Running") -> Obj:
    obj = gpu_pod(name, namespace, node=node_name, labels=labels, phase=phase,
                  owner=(owner_kind, owner_name) if owner_kind else None,
                  uid=f"uid-{namespace}-{name}")
    obj["metadata"]["annotations"] = dict(annotations or {})
    return obj


def job(namespace: str, name: str, **spec: Any) -> Obj:
    """A running Job (backoffLimit 6 unless ``spec`` says otherwise), whose pods a requeue
    deletes."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace, "uid": f"owner-{name}"},
            "spec": {"template": {"spec": {"containers": [{"name": name}]}}, **spec},
            "status": {"active": 1}}


def pdb(namespace: str, name: str, match_labels: dict[str, str], allowed: int) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": match_labels}, "minAvailable": 1},
            "status": {"disruptionsAllowed": allowed}}


def admitted_workload(namespace: str, name: str) -> Obj:
    """A Kueue workload that holds quota and runs (admitted to the ``research`` queue)."""
    obj = workload(name, namespace, queue="research")
    obj["status"] = {"admission": {"clusterQueue": "research", "podSetAssignments": []},
                     "conditions": [{"type": "Admitted", "status": "True",
                                     "reason": "Admitted"}]}
    return obj


def cordoned(api: KubeApiServer) -> list[str]:
    return sorted(n["metadata"]["name"] for n in api.objects("Node")
                  if n["spec"].get("unschedulable"))


def pods(api: KubeApiServer) -> set[tuple[str, str]]:
    return {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in api.objects("Pod")}


def writes(api: KubeApiServer) -> list[tuple[str, str, str]]:
    """(method, path, content type) of every request that may change something."""
    return [(r.method, r.path, r.content_type) for r in api.requests
            if r.method in ("PATCH", "POST", "PUT", "DELETE")]


async def publish_actions(settings: Settings, *actions: Action) -> None:
    """Put ``actions`` on the actions topic, keyed by their subject as the worker does."""
    producer = kafka.producer(settings)
    await producer.start()
    try:
        for action in actions:
            await producer.send_and_wait(topics.ACTIONS.name(settings),
                                         msgspec.json.encode(action),
                                         key=subject_key(action.target).encode())
    finally:
        await producer.stop()
