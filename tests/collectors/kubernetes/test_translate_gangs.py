"""Gang identity and size in the watcher's translation: every source the fleet rule reads."""

from __future__ import annotations

from typing import Any

import pytest

from gpusteward.collectors.kubernetes import translate as kube
from gpusteward.collectors.kubernetes.reflector import Delta
from gpusteward.schema import PodAllocation, QueueEvent

GPU = {"resources": {"limits": {"nvidia.com/gpu": "8"}}}


def pod(name: str, *, node: str | None = None, phase: str = "Pending",
        labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        owner: tuple[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "uid": f"uid-{name}",
                            "labels": labels or {}, "annotations": annotations or {}}
    if owner:
        meta["ownerReferences"] = [{"kind": owner[0], "name": owner[1], "controller": True}]
    spec: dict[str, Any] = {"containers": [GPU]}
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


@pytest.mark.parametrize(("labels", "annotations", "owner", "expected"), [
    ({"kueue.x-k8s.io/pod-group-name": "grp"}, {"kueue.x-k8s.io/pod-group-total-count": "4"},
     None, ("PodGroup/grp", 4)),
    ({"scheduling.x-k8s.io/pod-group": "pg"}, {}, None, ("PodGroup/pg", None)),
    ({"pod-group.scheduling.sigs.k8s.io": "old"}, {}, None, ("PodGroup/old", None)),
    ({}, {"scheduling.k8s.io/group-name": "vc"}, ("Job", "x"), ("PodGroup/vc", None)),
    ({"jobset.sigs.k8s.io/jobset-name": "pt"}, {}, ("Job", "pt-w-0"), ("JobSet/pt", None)),
    ({}, {}, ("PyTorchJob", "llm"), ("PyTorchJob/llm", None)),
    ({}, {}, ("MPIJob", "hpc"), ("MPIJob/hpc", None)),
    # A plain Job's pods and a Deployment's are no gang.
    ({}, {}, ("Job", "one"), (None, None)),
    ({}, {}, None, (None, None)),
])
def test_pod_gang(labels: dict[str, str], annotations: dict[str, str],
                  owner: tuple[str, str] | None,
                  expected: tuple[str | None, int | None]) -> None:
    meta = pod("p", labels=labels, annotations=annotations, owner=owner)["metadata"]
    assert kube.pod_gang(meta, *kube.top_owner(meta)) == expected


def _template(gpu: bool) -> dict[str, Any]:
    return {"spec": {"containers": [GPU if gpu else {"resources": {}}]}}


def test_sizes_count_gpu_members_only() -> None:
    pytorch = {"kind": "PyTorchJob", "metadata": {"name": "llm"}, "spec": {
        "pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": _template(True)},
                                "Worker": {"replicas": 7, "template": _template(True)}}}}
    assert kube.gang_size_of("pytorchjobs", pytorch) == ("PyTorchJob/llm", 8)
    # An elastic one (torchrun --nnodes=2:6) trains once 2 workers have joined.
    elastic = {"kind": "PyTorchJob", "metadata": {"name": "el"}, "spec": {
        "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 6},
        "pytorchReplicaSpecs": {"Worker": {"replicas": 6, "template": _template(True)}}}}
    assert kube.gang_size_of("pytorchjobs", elastic) == ("PyTorchJob/el", 2)
    # An MPIJob's launcher asks for no GPU: it never shows up as a member.
    mpi = {"kind": "MPIJob", "metadata": {"name": "hpc"}, "spec": {
        "mpiReplicaSpecs": {"Launcher": {"replicas": 1, "template": _template(False)},
                            "Worker": {"replicas": 4, "template": _template(True)}}}}
    assert kube.gang_size_of("mpijobs", mpi) == ("MPIJob/hpc", 4)
    jobset = {"metadata": {"name": "pt"}, "spec": {"replicatedJobs": [
        {"name": "w", "replicas": 2, "template": {"spec": {"parallelism": 4,
                                                            "template": _template(True)}}},
        {"name": "driver", "template": {"spec": {"template": _template(False)}}}]}}
    assert kube.gang_size_of("jobsets", jobset) == ("JobSet/pt", 8)
    group = {"metadata": {"name": "pg"}, "spec": {"minMember": 3}}
    assert kube.gang_size_of("podgroups", group) == ("PodGroup/pg", 3)
    workload = {"metadata": {"name": "wl", "ownerReferences": [
        {"kind": "JobSet", "name": "pt", "controller": True}]},
        "spec": {"podSets": [{"name": "w", "count": 8, "template": _template(True)},
                             {"name": "d", "count": 1, "template": _template(False)}]}}
    assert kube.workload_gang(workload) == ("JobSet/pt", 8)
    # Kueue admits a TrainJob, whose pods run in the JobSet of its name and name that.
    trainjob = {"metadata": {"name": "wl", "ownerReferences": [
        {"kind": "TrainJob", "name": "tj", "controller": True}]},
        "spec": {"podSets": [{"name": "node", "count": 2, "template": _template(True)}]}}
    assert kube.workload_gang(trainjob) == ("JobSet/tj", 2)
    single = {"metadata": {"name": "wl", "ownerReferences": [
        {"kind": "Job", "name": "j", "controller": True}]},
        "spec": {"podSets": [{"name": "main", "count": 1, "template": _template(True)}]}}
    assert kube.workload_gang(single) == (None, None)


def test_a_running_member_read_before_its_gang_gets_its_allocation_sent_again() -> None:
    """A first list reads the pods before the JobSets and training jobs: a member already
    running is reported without its gang's size, so the node join could not tell a gang
    of one (reclaimed as a lone pod) from a member (never reclaimed on its own). The
    allocation is sent again once the size is learnt; an ended one is not."""
    translator = kube.Translator()
    owner = ("PyTorchJob", "solo")
    first = translator.apply(Delta("pods", "ADDED", "s0",
                                   pod("s0", owner=owner, node="n1", phase="Running")), 1.0)
    [held] = [e for e in first if isinstance(e, PodAllocation)]
    assert (held.gang, held.gang_size) == ("PyTorchJob/solo", None)
    job: dict[str, Any] = {
        "kind": "PyTorchJob", "metadata": {"name": "solo", "namespace": "ml"}, "spec": {
            "pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": _template(True)}}}}
    resent = translator.apply(Delta("pytorchjobs", "ADDED", "ml/solo", job), 2.0)
    [again] = [e for e in resent if isinstance(e, PodAllocation)]
    assert (again.pod, again.phase, again.gang, again.gang_size, again.ts) == (
        held.pod, "running", "PyTorchJob/solo", 1, 2.0)
    # Finished, then the size changes: the ended allocation is not sent again.
    translator.apply(Delta("pods", "MODIFIED", "s0",
                           pod("s0", owner=owner, node="n1", phase="Succeeded")), 3.0)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 2
    later = translator.apply(Delta("pytorchjobs", "MODIFIED", "ml/solo", job), 4.0)
    assert [e for e in later if isinstance(e, PodAllocation)] == []


def test_member_is_followed_on_the_queue_and_gets_the_size_learnt_later() -> None:
    translator = kube.Translator()
    owner = ("PyTorchJob", "llm")
    [pending] = translator.apply(Delta("pods", "ADDED", "w0", pod("w0", owner=owner)), 1.0)
    assert isinstance(pending, QueueEvent)
    assert (pending.state, pending.gang, pending.gang_size) == ("pending", "PyTorchJob/llm",
                                                                None)
    # The training job arrives: the member's event is sent again with the size.
    job = {"kind": "PyTorchJob", "metadata": {"name": "llm", "namespace": "ml"}, "spec": {
        "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "template": _template(True)}}}}
    [resent] = translator.apply(Delta("pytorchjobs", "ADDED", "ml/llm", job), 2.0)
    assert isinstance(resent, QueueEvent) and (resent.name, resent.gang_size) == ("w0", 2)
    # Bound: admitted on the queue topic, and the allocation carries the gang too.
    bound = translator.apply(Delta("pods", "MODIFIED", "w0",
                                   pod("w0", owner=owner, node="n1", phase="Running")), 3.0)
    queued = [e for e in bound if isinstance(e, QueueEvent)]
    held = [e for e in bound if isinstance(e, PodAllocation)]
    assert [(e.state, e.gang_size) for e in queued] == [("admitted", 2)]
    assert [(e.gang, e.gang_size) for e in held] == [("PyTorchJob/llm", 2)]
    # A member first seen bound is reported too; unchanged updates are not repeated.
    first = translator.apply(Delta("pods", "ADDED", "w1",
                                   pod("w1", owner=owner, node="n2", phase="Running")), 4.0)
    assert [(e.name, e.state) for e in first if isinstance(e, QueueEvent)] == [
        ("w1", "admitted")]
    again = translator.apply(Delta("pods", "MODIFIED", "w1",
                                   pod("w1", owner=owner, node="n2", phase="Running")), 5.0)
    assert again == []
    done = translator.apply(Delta("pods", "MODIFIED", "w1",
                                  pod("w1", owner=owner, node="n2", phase="Succeeded")), 6.0)
    assert [e.state for e in done if isinstance(e, QueueEvent)] == ["finished"]
    gone = translator.apply(Delta("pods", "DELETED", "w0", None), 7.0)
    assert [e.state for e in gone if isinstance(e, QueueEvent)] == ["deleted"]


def test_a_pod_that_waited_is_followed_to_its_end_and_one_seen_bound_is_not() -> None:
    translator = kube.Translator()
    translator.apply(Delta("pods", "ADDED", "j", pod("j", owner=("Job", "j"))), 1.0)
    bound = translator.apply(Delta("pods", "MODIFIED", "j",
                                   pod("j", owner=("Job", "j"), node="n1",
                                       phase="Running")), 2.0)
    assert [e.state for e in bound if isinstance(e, QueueEvent)] == ["admitted"]
    same = translator.apply(Delta("pods", "MODIFIED", "j",
                                  pod("j", owner=("Job", "j"), node="n1",
                                      phase="Running")), 2.5)
    assert same == []
    later = translator.apply(Delta("pods", "MODIFIED", "j",
                                   pod("j", owner=("Job", "j"), node="n1",
                                       phase="Succeeded")), 3.0)
    assert [(e.state, e.admitted_at) for e in later if isinstance(e, QueueEvent)] == [
        ("finished", 2.0)]
    seen_bound = translator.apply(Delta("pods", "ADDED", "k", pod(
        "k", owner=("Job", "k"), node="n1", phase="Running")), 4.0)
    assert [e for e in seen_bound if isinstance(e, QueueEvent)] == []
