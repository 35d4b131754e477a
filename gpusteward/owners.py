"""A pod's owner chain and gang, read from its metadata alone: no API call, no clock.

The watcher (collectors/kubernetes/translate.py) reports each pod's top owner and gang on
the contract's events, and the remediation backend checks, before it suspends a gang,
that the live pod is still one of its members; both must read a pod the same way, and
remediation may not import the collectors (docs/architecture.md), so the one reading
lives here, in the core.

Gangs: a pod's Kueue pod group (label ``kueue.x-k8s.io/pod-group-name``, size from the
annotation ``kueue.x-k8s.io/pod-group-total-count``), its coscheduling PodGroup (label
``scheduling.x-k8s.io/pod-group``) or Volcano PodGroup (annotation
``scheduling.k8s.io/group-name``), else its top owner when that is a JobSet or a Kubeflow
training job, named ``<Kind>/<name>`` (``JobSet/train``, ``PodGroup/g1``).
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

LABEL_KUEUE_POD_GROUP = "kueue.x-k8s.io/pod-group-name"
ANNOTATION_KUEUE_POD_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"
POD_GROUP_LABELS = ("scheduling.x-k8s.io/pod-group", "pod-group.scheduling.sigs.k8s.io")
"""Labels of the scheduler-plugins coscheduling PodGroup (current and legacy)."""
ANNOTATION_VOLCANO_GROUP = "scheduling.k8s.io/group-name"
GANG_OWNERS = frozenset({"JobSet", "PyTorchJob", "MPIJob", "TFJob", "XGBoostJob", "PaddleJob",
                         "JAXJob", "TrainJob"})
"""Top owners whose GPU pods form a gang (all-or-nothing distributed training)."""


def quantity(value: object) -> int:
    """An extended-resource quantity (always an integer count) as int."""
    try:
        return int(str(value))
    except ValueError:
        return int(float(str(value)))


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


def pod_gang(meta: Obj, owner_kind: str | None, owner_name: str | None
             ) -> tuple[str | None, int | None]:
    """(gang, size stated on the pod) of a pod, or (None, None) when it is no gang member."""
    labels: dict[str, str] = meta.get("labels") or {}
    annotations: dict[str, str] = meta.get("annotations") or {}
    if group := labels.get(LABEL_KUEUE_POD_GROUP):
        count = annotations.get(ANNOTATION_KUEUE_POD_GROUP_COUNT)
        return f"PodGroup/{group}", quantity(count) if count else None
    group = next((labels[k] for k in POD_GROUP_LABELS if labels.get(k)), None) or \
        annotations.get(ANNOTATION_VOLCANO_GROUP)
    if group:
        return f"PodGroup/{group}", None
    if owner_kind in GANG_OWNERS and owner_name:
        return f"{owner_kind}/{owner_name}", None
    return None, None

