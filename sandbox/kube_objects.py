"""Builders of upstream-shaped Kubernetes objects (pods, GPU nodes, Kueue workloads) for tests.

They fill only the fields the watcher and the remediation consumer read, with
the shapes of core/v1 and kueue.x-k8s.io/v1beta2; fixtures with every field
live in ``tests/data/kube/``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
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



# --- Dynamic Resource Allocation (resource.k8s.io/v1) --------------------------------------

NVIDIA_DRA_DRIVER = "gpu.nvidia.com"


def dra_gpu(index: int, uuid: str, product: str) -> Obj:
    """A whole GPU as NVIDIA's DRA driver publishes it (``gpu-<minor>``, its attributes
    and memory capacity; cmd/gpu-kubelet-plugin/deviceinfo.go)."""
    return {"name": f"gpu-{index}", "attributes": {
        "type": {"string": "gpu"}, "uuid": {"string": uuid}, "index": {"int": index},
        "minor": {"int": index}, "productName": {"string": product},
        "brand": {"string": "Nvidia"}, "architecture": {"string": "Ampere"},
        "cudaComputeCapability": {"version": "8.0.0"},
        "driverVersion": {"version": "570.158.1"}, "cudaDriverVersion": {"version": "12.8.0"},
        "pcieBusID": {"string": f"0000:{0x18 + index:02x}:00.0"}},
        "capacity": {"memory": {"value": "80Gi"}}}


def dra_mig(parent_index: int, parent_uuid: str, uuid: str, profile: str, profile_id: int,
            start: int, size: int, product: str) -> Obj:
    """A MIG device as NVIDIA's DRA driver publishes it
    (``gpu-<minor>-mig-<GI profile id>-<placement start>-<size>``)."""
    return {"name": f"gpu-{parent_index}-mig-{profile_id}-{start}-{size}", "attributes": {
        "type": {"string": "mig"}, "uuid": {"string": uuid},
        "parentUUID": {"string": parent_uuid}, "profile": {"string": profile},
        "productName": {"string": product}, "brand": {"string": "Nvidia"},
        "architecture": {"string": "Ampere"}}, "capacity": {
        f"memorySlice{i}": {"value": "1"} for i in range(start, start + size)}}


def resource_slice(node: str, devices: list[Obj], driver: str = NVIDIA_DRA_DRIVER,
                   generation: int = 1) -> Obj:
    """A driver's ResourceSlice of one node: one pool named after the node."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}-x8k2p", "uid": f"slice-{node}-{driver}"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": devices}}


def device_requests(device_class: str = NVIDIA_DRA_DRIVER, count: int = 1,
                    profile: str | None = None) -> Obj:
    """A claim's ``spec.devices``: ``count`` devices of ``device_class``, MIG devices of
    ``profile`` chosen by a CEL selector as NVIDIA's examples do."""
    exactly: Obj = {"deviceClassName": device_class, "allocationMode": "ExactCount",
                    "count": count}
    if profile is not None:
        exactly["selectors"] = [{"cel": {"expression": f"device.attributes["
                                         f"'{NVIDIA_DRA_DRIVER}'].profile == '{profile}'"}}]
    return {"requests": [{"name": "gpu", "exactly": exactly}]}


def resource_claim_template(name: str, namespace: str, *,
                            device_class: str = NVIDIA_DRA_DRIVER, count: int = 1,
                            profile: str | None = None) -> Obj:
    """A ResourceClaimTemplate: the claim the resourceclaim controller makes for each pod
    naming it."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace,
                         "uid": f"template-{namespace}-{name}",
                         "creationTimestamp": "2026-11-20T09:00:00Z"},
            "spec": {"spec": {"devices": device_requests(device_class, count, profile)}}}


def resource_claim(name: str, namespace: str, *, device_class: str = NVIDIA_DRA_DRIVER,
                   count: int = 1, owner: Obj | None = None,
                   profile: str | None = None) -> Obj:
    """A ResourceClaim, unallocated; from a template when ``owner`` (its pod) is given, as
    the resourceclaim controller makes it (``<pod>-<claim>-<suffix>``, owned by the pod)."""
    meta: Obj = {"name": name, "namespace": namespace, "uid": f"claim-{namespace}-{name}",
                 "creationTimestamp": "2026-11-20T10:00:00Z"}
    if owner is not None:
        meta["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod",
                                    "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"].get("uid", ""),
                                    "controller": True, "blockOwnerDeletion": True}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta,
            "spec": {"devices": device_requests(device_class, count, profile)},
            "status": {}}


def allocate(claim: Obj, node: str, devices: list[str], pods: list[Obj],
             driver: str = NVIDIA_DRA_DRIVER, admin_access: bool = False) -> None:
    """What the scheduler writes into a claim it allocates on ``node`` and reserves for
    ``pods``: one result per device, the node selector, the consumers."""
    results: list[Obj] = [{"request": "gpu", "driver": driver, "pool": node, "device": device}
                          for device in devices]
    if admin_access:
        for result in results:
            result["adminAccess"] = True
    claim["status"] = {
        "allocation": {
            "devices": {"results": results},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            "allocationTimestamp": "2026-11-20T10:01:00Z"},
        "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"],
                         "uid": pod["metadata"].get("uid", "")} for pod in pods]}


def claim_pod(pod: Obj, claims: Mapping[str, str | None], from_template: bool = True,
              templates: dict[str, str] | None = None) -> Obj:
    """``pod`` asking for its devices through DRA claims (``{claim name in the pod: the
    ResourceClaim's name}``) instead of extended resources: from templates (``templates``:
    claim name in the pod -> template, ``<claim name>-template`` by default), named in its
    status by the resourceclaim controller (not yet where the name is None), or
    (``from_template=False``) claims made beforehand, named in its spec."""
    spec = pod["spec"]
    spec["resourceClaims"] = [
        {"name": entry, "resourceClaimTemplateName": (templates or {}).get(
            entry, f"{entry}-template")} if from_template
        else {"name": entry, "resourceClaimName": made} for entry, made in claims.items()]
    for container in spec["containers"]:
        container["resources"] = {"claims": [{"name": entry} for entry in claims]}
    made_claims = [{"name": entry, "resourceClaimName": made}
                   for entry, made in claims.items() if made is not None]
    if from_template and made_claims:
        pod["status"]["resourceClaimStatuses"] = made_claims
    return pod
