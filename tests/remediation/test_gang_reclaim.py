"""Suspending a whole idle gang, and resuming it: the fleet rule's gang reclaim.

Through the real ``kubernetes`` client against the API-server double
(sandbox/kube_api.py), with gangs in their upstream shapes: a JobSet's pod
(Pod -> Job -> JobSet, the label ``jobset.sigs.k8s.io/jobset-name``), a
PyTorchJob's pod, a JobSet admitted by Kueue (its Workload owned by the JobSet,
the pod naming the Workload), and pod groups. The action is the contract the
rule sends: ``requeue`` of one placed member pod with ``params.reason
idle-reclaim`` and ``params.gang``, and no ``params.workload``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.rules.idle import rfc3339
from gpusteward.sandbox.kube_api import (
    KUEUE_GROUP,
    TRAINER_GROUP,
    KubeApiServer,
    kueue_deactivation,
    trainjob_suspension,
)
from gpusteward.schema import Action, PodRef, Subject
from gpusteward.settings import Settings

NS = "ml-alice"
JOBSET = "jobset.x-k8s.io"
KUBEFLOW = "kubeflow.org"
TRAINER = TRAINER_GROUP
Obj = dict[str, Any]


# -- upstream-shaped gangs -------------------------------------------------------------------


def _ref(owner: Obj) -> Obj:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"],
            "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _member(api: KubeApiServer, name: str, owner: Obj | None, labels: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None) -> str:
    meta: Obj = {"name": name, "namespace": NS, "labels": labels or {},
                 "annotations": annotations or {}}
    if owner is not None:
        meta["ownerReferences"] = [_ref(owner)]
    api.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"nodeName": "gpu-1", "containers": [{
                    "name": "train", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
                "status": {"phase": "Running"}})
    return name


def jobset(api: KubeApiServer, labels: dict[str, str] | None = None,
           annotations: dict[str, str] | None = None) -> str:
    """JobSet ``train`` (2 workers of 8 GPUs); returns its first member pod."""
    owner = api.create({
        "apiVersion": f"{JOBSET}/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "train", "namespace": NS, "labels": labels or {}},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2, "template": {
            "spec": {"parallelism": 1, "template": {"spec": {"containers": [{
                "name": "train", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}}}}]}})
    job = api.create({"apiVersion": "batch/v1", "kind": "Job",
                      "metadata": {"name": "train-workers-0", "namespace": NS,
                                   "ownerReferences": [_ref(owner)]},
                      "spec": {"template": {"spec": {"containers": [{"name": "train"}]}}},
                      "status": {"active": 1}})
    return _member(api, "train-workers-0-0-x7k2p", job,
                   {"jobset.sigs.k8s.io/jobset-name": "train"}, annotations)


def pytorchjob(api: KubeApiServer) -> str:
    owner = api.create({
        "apiVersion": f"{KUBEFLOW}/v1", "kind": "PyTorchJob",
        "metadata": {"name": "ddp", "namespace": NS},
        "spec": {"runPolicy": {"cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "template": {"spec": {
                     "containers": [{"name": "pytorch"}]}}}}}})
    return _member(api, "ddp-worker-0", owner, {"training.kubeflow.org/replica-type": "worker"})


def kueue_jobset(api: KubeApiServer) -> str:
    """JobSet ``train`` queued by Kueue and admitted: its Workload, owned by the JobSet."""
    pod = jobset(api, labels={"kueue.x-k8s.io/queue-name": "research"},
                 annotations={"kueue.x-k8s.io/workload": "jobset-train-1a2b3"})
    owner = api.get("JobSet", "train", NS, JOBSET)
    api.create({"apiVersion": f"{KUEUE_GROUP}/v1beta1", "kind": "Workload",
                "metadata": {"name": "jobset-train-1a2b3", "namespace": NS,
                             "ownerReferences": [_ref(owner)]},
                "spec": {"active": True, "queueName": "research", "podSets": []},
                "status": {"admission": {"clusterQueue": "research", "podSetAssignments": []},
                           "conditions": [{"type": "Admitted", "status": "True"}]}})
    return pod


# -- helpers ---------------------------------------------------------------------------------


def reclaim(pod: str, gang: str, key: str = "g1/requeue/train", **params: str) -> Action:
    return Action(
        idempotency_key=key, verb="requeue",
        target=Subject(queue="research", pod=PodRef(NS, pod)),
        reason=f"every pod of {gang} has held its GPUs idle for 12 h: reclaiming the gang",
        rule="gang_idle", finding_ids=["g1"], ts=time.time(),
        params={"reason": "idle-reclaim", "gang": gang,
                "idle_since": repr(time.time() - 12 * 3600), **params})


@pytest.fixture
def backend(kube_api: KubeApiServer, kubeconfig: Path) -> KubernetesBackend:
    kube_api.add_controller("Workload", kueue_deactivation, group=KUEUE_GROUP)
    return KubernetesBackend(KubeSettings(kubeconfig=str(kubeconfig), requeue_timeout_s=2))


def act(backend: KubernetesBackend, action: Action) -> tuple[str, str]:
    return asyncio.run(backend.requeue(action))


def restore(backend: KubernetesBackend, target: str) -> tuple[str, str]:
    kind, namespace, name = target.split("/")
    return asyncio.run(backend.restore(kind, namespace, name))


def writes(api: KubeApiServer) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in api.requests if r.method in ("POST", "PATCH", "DELETE")]


def patches(api: KubeApiServer, plural: str) -> list[Obj]:
    return [r.body for r in api.requests if r.method == "PATCH" and f"/{plural}/" in r.path]


def events_about(api: KubeApiServer, kind: str, name: str) -> list[Obj]:
    return [e for e in api.objects("Event") if e["involvedObject"]["kind"] == kind
            and e["involvedObject"]["name"] == name]


def gpusteward_annotations(obj: Obj) -> dict[str, str]:
    return {k: v for k, v in (obj["metadata"].get("annotations") or {}).items()
            if k.startswith("gpusteward.io/")}


# -- suspend and resume ----------------------------------------------------------------------


def test_an_idle_jobset_is_suspended_whole_and_restore_resumes_it(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    pod = jobset(kube_api)
    outcome, detail = act(backend, reclaim(pod, "JobSet/train"))
    assert outcome == "executed", detail
    undo = f"gpusteward act --restore JobSet/{NS}/train"
    assert "suspended JobSet/train whole (spec.suspend=true)" in detail and undo in detail
    live = kube_api.get("JobSet", "train", NS, JOBSET)
    assert live["spec"]["suspend"] is True
    assert gpusteward_annotations(live)["gpusteward.io/suspended-by"] == "g1/requeue/train"
    assert {"gpusteward.io/reclaimed-at", "gpusteward.io/reclaim-reason"} <= set(
        gpusteward_annotations(live))
    # The JobSet controller deletes the pods of a suspended JobSet; gpusteward deletes none.
    assert [p["metadata"]["name"] for p in kube_api.objects("Pod")] == [pod]
    (event,) = events_about(kube_api, "JobSet", "train")
    assert event["reason"] == "GpuStewardReclaimed" and event["type"] == "Warning"
    assert "idle" in event["message"] and f"Resume it with `{undo}`" in event["message"]

    outcome, detail = restore(backend, f"JobSet/{NS}/train")
    assert (outcome, detail) == ("executed", f"resumed JobSet {NS}/train (spec.suspend=false)")
    live = kube_api.get("JobSet", "train", NS, JOBSET)
    assert live["spec"]["suspend"] is False and not gpusteward_annotations(live)
    assert [e["reason"] for e in events_about(kube_api, "JobSet", "train")] == [
        "GpuStewardReclaimed", "GpuStewardRestored"]
    # Nothing left to restore: restore resumes only what gpusteward suspended.
    outcome, detail = restore(backend, f"JobSet/{NS}/train")
    assert outcome == "refused" and "not suspended by gpusteward" in detail


def test_an_idle_pytorchjob_is_suspended_by_its_run_policy(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    pod = pytorchjob(kube_api)
    outcome, detail = act(backend, reclaim(pod, "PyTorchJob/ddp"))
    assert outcome == "executed", detail
    assert "(spec.runPolicy.suspend=true)" in detail
    live = kube_api.get("PyTorchJob", "ddp", NS, KUBEFLOW)
    # A merge patch: the rest of the run policy is kept.
    assert live["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "suspend": True}
    (event,) = events_about(kube_api, "PyTorchJob", "ddp")
    assert f"gpusteward act --restore PyTorchJob/{NS}/ddp" in event["message"]
    assert restore(backend, f"PyTorchJob/{NS}/ddp")[0] == "executed"
    live = kube_api.get("PyTorchJob", "ddp", NS, KUBEFLOW)
    assert live["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "suspend": False}
    assert not gpusteward_annotations(live)


def test_a_kueue_admitted_gang_is_stopped_through_its_workload_left_inactive(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """A requeue would reactivate the Workload at once and Kueue admit the gang again: the
    GPUs given back for seconds. The gang's Workload stays inactive until restored."""
    pod = kueue_jobset(kube_api)
    outcome, detail = act(backend, reclaim(pod, "JobSet/train"))
    assert outcome == "executed", detail
    undo = f"gpusteward act --restore Workload/{NS}/jobset-train-1a2b3"
    assert undo in detail and "left it inactive (spec.active=false)" in detail
    workload = kube_api.get("Workload", "jobset-train-1a2b3", NS, KUEUE_GROUP)
    assert workload["spec"]["active"] is False
    assert [c["reason"] for c in workload["status"]["conditions"]] == ["Deactivated"]
    assert [b["spec"]["active"] for b in patches(kube_api, "workloads")] == [False]
    assert gpusteward_annotations(workload)["gpusteward.io/suspended-by"] == "g1/requeue/train"
    # Kueue suspends the JobSet; gpusteward does not touch it behind Kueue's back.
    assert patches(kube_api, "jobsets") == []
    # The owner is told on the JobSet they look at, with the command that undoes it.
    (event,) = events_about(kube_api, "JobSet", "train")
    assert event["reason"] == "GpuStewardReclaimed" and undo in event["message"]

    assert restore(backend, f"Workload/{NS}/jobset-train-1a2b3")[0] == "executed"
    workload = kube_api.get("Workload", "jobset-train-1a2b3", NS, KUEUE_GROUP)
    assert workload["spec"]["active"] is True and not gpusteward_annotations(workload)
    assert [e["reason"] for e in events_about(kube_api, "JobSet", "train")] == [
        "GpuStewardReclaimed", "GpuStewardRestored"]


# -- what is left alone ----------------------------------------------------------------------


@pytest.mark.parametrize("group_label", ["scheduling.x-k8s.io/pod-group",
                                         "kueue.x-k8s.io/pod-group-name"])
def test_a_pod_group_gang_is_refused(group_label: str, kube_api: KubeApiServer,
                                     backend: KubernetesBackend) -> None:
    """A pod group's pods are started again by nothing once stopped (Kueue deletes the pods
    of an evicted pod group): suspending it would end its work for good."""
    kube_api.create({"apiVersion": f"{KUEUE_GROUP}/v1beta1", "kind": "Workload",
                     "metadata": {"name": "pg-1", "namespace": NS},
                     "spec": {"active": True, "podSets": []},
                     "status": {"admission": {"clusterQueue": "research"}}})
    for index in range(2):
        pod = _member(kube_api, f"pg-{index}", None, {group_label: "pg"},
                      {"kueue.x-k8s.io/workload": "pg-1"})
    outcome, detail = act(backend, reclaim(pod, "PodGroup/pg"))
    assert outcome == "refused"
    assert detail.startswith("gang PodGroup/pg in ml-alice is a PodGroup, which gpusteward "
                             "cannot suspend: nothing would start its pods again")
    assert detail.endswith("Ask its owner to stop it")
    assert writes(kube_api) == []


def test_a_jobset_queued_by_kueue_whose_pod_names_no_workload_is_not_suspended(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """Kueue owns a queued JobSet's spec.suspend: one suspended behind its back would be
    started again, the owner told their GPUs were given back while they were not."""
    pod = jobset(kube_api, labels={"kueue.x-k8s.io/queue-name": "research"})
    outcome, detail = act(backend, reclaim(pod, "JobSet/train"))
    assert outcome == "refused" and "is queued by Kueue (LocalQueue research)" in detail
    assert writes(kube_api) == []


def test_a_kueue_gang_whose_pods_name_no_workload_is_stopped_through_the_one_watched(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """Kueue's JobSet pods carry its queue labels, not the Workload's name: the rule names
    the Workload the watcher saw own the gang (``params.gang_workload``), and the backend
    leaves that one inactive once it checks the Workload belongs to the gang."""
    pod = kueue_jobset(kube_api)
    kube_api.patch("Pod", pod, {"metadata": {"annotations": {
        "kueue.x-k8s.io/workload": None}}}, NS)
    outcome, detail = act(backend, reclaim(pod, "JobSet/train",
                                           gang_workload="jobset-train-1a2b3"))
    assert outcome == "executed", detail
    assert [b["spec"]["active"] for b in patches(kube_api, "workloads")] == [False]
    assert patches(kube_api, "jobsets") == []
    # A Workload of another job, named by mistake, is left alone.
    other = kube_api.create({
        "apiVersion": f"{JOBSET}/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "eval", "namespace": NS}, "spec": {}})
    kube_api.create({"apiVersion": f"{KUEUE_GROUP}/v1beta1", "kind": "Workload",
                     "metadata": {"name": "jobset-eval-9z8y7", "namespace": NS,
                                  "ownerReferences": [_ref(other)]},
                     "spec": {"active": True, "queueName": "research", "podSets": []}})
    outcome, detail = act(backend, reclaim(pod, "JobSet/train", key="g2/requeue/train",
                                           gang_workload="jobset-eval-9z8y7"))
    assert outcome == "refused" and "belongs to JobSet eval, not to JobSet/train" in detail
    assert len(patches(kube_api, "workloads")) == 1


def trainjob(api: KubeApiServer) -> str:
    """Kubeflow Trainer's TrainJob ``tj``, run as the JobSet ``tj`` it owns (2 nodes of 8
    GPUs), with the trainer's controller keeping the JobSet's suspend at the TrainJob's;
    returns its first member pod (a gang ``JobSet/tj`` to the watcher)."""
    api.add_controller("TrainJob", trainjob_suspension, group=TRAINER)
    api.add_controller("JobSet", trainjob_suspension, group=JOBSET)
    owner = api.create({"apiVersion": f"{TRAINER}/v1alpha1", "kind": "TrainJob",
                        "metadata": {"name": "tj", "namespace": NS},
                        "spec": {"runtimeRef": {"name": "torch-distributed"},
                                 "trainer": {"numNodes": 2}}})
    runs_as = api.create({
        "apiVersion": f"{JOBSET}/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "tj", "namespace": NS, "ownerReferences": [_ref(owner)]},
        "spec": {"replicatedJobs": [{"name": "node", "replicas": 2}]}})
    job = api.create({"apiVersion": "batch/v1", "kind": "Job",
                      "metadata": {"name": "tj-node-0", "namespace": NS,
                                   "ownerReferences": [_ref(runs_as)]},
                      "spec": {"template": {"spec": {"containers": [{"name": "node"}]}}},
                      "status": {"active": 1}})
    return _member(api, "tj-node-0-0-q4w8e", job, {"jobset.sigs.k8s.io/jobset-name": "tj"})


def test_a_trainjobs_gang_is_suspended_through_its_trainjob(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """The trainer keeps its JobSet's spec.suspend at the TrainJob's: a JobSet suspended
    alone is set running again, its gang started anew, and no GPU given back. The gang (a
    JobSet to the watcher, whose pods name it) is suspended through its TrainJob, and the
    restore the owner's notice names (the JobSet) resumes the TrainJob. Before, the JobSet
    was patched."""
    pod = trainjob(kube_api)
    outcome, detail = act(backend, reclaim(pod, "JobSet/tj"))
    assert outcome == "executed", detail
    undo = f"gpusteward act --restore TrainJob/{NS}/tj"
    assert detail == (f"suspended TrainJob {NS}/tj of JobSet/tj whole (spec.suspend=true); "
                      f"undo with `{undo}`")
    assert patches(kube_api, "jobsets") == []
    live = kube_api.get("TrainJob", "tj", NS, TRAINER)
    assert live["spec"]["suspend"] is True
    assert gpusteward_annotations(live)["gpusteward.io/suspended-by"] == "g1/requeue/train"
    assert kube_api.get("JobSet", "tj", NS, JOBSET)["spec"]["suspend"] is True  # the trainer's
    (event,) = events_about(kube_api, "TrainJob", "tj")
    assert f"Resume it with `{undo}`" in event["message"]
    # A replay patches nothing more.
    assert act(backend, reclaim(pod, "JobSet/tj"))[0] == "executed"
    assert len(patches(kube_api, "trainjobs")) == 1

    outcome, detail = restore(backend, f"JobSet/{NS}/tj")
    assert (outcome, detail) == ("executed", f"resumed TrainJob {NS}/tj (spec.suspend=false)")
    assert kube_api.get("JobSet", "tj", NS, JOBSET)["spec"]["suspend"] is False
    assert not gpusteward_annotations(kube_api.get("TrainJob", "tj", NS, TRAINER))


def test_a_kueue_admitted_trainjobs_gang_is_stopped_through_its_workload(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """Kueue admits a TrainJob through a Workload the TrainJob owns; its pods name the
    JobSet it runs as. The watcher hands the Workload over with the gang (``gang_workload``),
    and the Workload, owned by the TrainJob of the JobSet's name, is left inactive: Kueue
    suspends the TrainJob. Nothing else is patched."""
    pod = trainjob(kube_api)
    owner = kube_api.get("TrainJob", "tj", NS, TRAINER)
    kube_api.create({"apiVersion": f"{KUEUE_GROUP}/v1beta1", "kind": "Workload",
                     "metadata": {"name": "trainjob-tj-5c6d7", "namespace": NS,
                                  "ownerReferences": [_ref(owner)]},
                     "spec": {"active": True, "queueName": "research", "podSets": []},
                     "status": {"admission": {"clusterQueue": "research",
                                              "podSetAssignments": []},
                                "conditions": [{"type": "Admitted", "status": "True"}]}})
    outcome, detail = act(backend, reclaim(pod, "JobSet/tj", gang_workload="trainjob-tj-5c6d7"))
    assert outcome == "executed", detail
    assert "left it inactive (spec.active=false)" in detail
    assert kube_api.get("Workload", "trainjob-tj-5c6d7", NS, KUEUE_GROUP)["spec"]["active"] \
        is False
    assert patches(kube_api, "trainjobs") == [] and patches(kube_api, "jobsets") == []
    (event,) = events_about(kube_api, "TrainJob", "tj")
    assert f"gpusteward act --restore Workload/{NS}/trainjob-tj-5c6d7" in event["message"]


def test_a_jobset_another_controller_manages_is_refused(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    pod = jobset(kube_api)
    kube_api.mutate("JobSet", "train", lambda obj: obj["metadata"].update(ownerReferences=[{
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "nightly",
        "uid": "uid-wf", "controller": True}]), NS, JOBSET)
    outcome, detail = act(backend, reclaim(pod, "JobSet/train"))
    assert outcome == "refused"
    assert detail.startswith(f"JobSet {NS}/train (JobSet/train) is managed by Workflow nightly")
    assert writes(kube_api) == []


def test_a_pod_no_longer_in_the_gang_is_refused(kube_api: KubeApiServer,
                                                backend: KubernetesBackend) -> None:
    pod = jobset(kube_api)
    outcome, detail = act(backend, reclaim(pod, "JobSet/train-v1"))
    assert (outcome, detail) == ("refused", f"pod {NS}/{pod} is no longer a member of "
                                 "JobSet/train-v1 (its gang is now JobSet/train): the gang "
                                 "found idle is not the one this pod is in")
    assert writes(kube_api) == []
    assert "suspend" not in kube_api.get("JobSet", "train", NS, JOBSET)["spec"]


def test_keep_until_on_the_member_leaves_the_gang_running(kube_api: KubeApiServer,
                                                          backend: KubernetesBackend) -> None:
    hold = rfc3339(time.time() + 86400)
    pod = jobset(kube_api, annotations={"gpusteward.io/keep-until": hold})
    outcome, detail = act(backend, reclaim(pod, "JobSet/train"))
    assert outcome == "refused" and f"left alone until {hold}" in detail
    assert writes(kube_api) == []
    # Once the owner lifts it, the gang is suspended.
    kube_api.patch("Pod", pod, {"metadata": {"annotations": {
        "gpusteward.io/keep-until": None}}}, NS)
    assert act(backend, reclaim(pod, "JobSet/train"))[0] == "executed"
    assert kube_api.get("JobSet", "train", NS, JOBSET)["spec"]["suspend"] is True


def test_a_replay_never_suspends_twice_nor_undoes_a_resume(kube_api: KubeApiServer,
                                                           backend: KubernetesBackend) -> None:
    pod = jobset(kube_api)
    action = reclaim(pod, "JobSet/train")
    assert act(backend, action)[0] == "executed"
    # Redelivered after a crash that lost its audit record: done, by this very action.
    outcome, detail = act(backend, action)
    assert outcome == "executed" and "earlier try of this action" in detail
    assert len(patches(kube_api, "jobsets")) == 1
    # Another action (a later episode) finds it suspended by the first.
    outcome, detail = act(backend, reclaim(pod, "JobSet/train", key="g2/requeue/train"))
    assert (outcome, detail) == ("skipped", f"JobSet {NS}/train is already suspended "
                                 "(spec.suspend), by gpusteward action g1/requeue/train: left so")
    # The owner resumed it by hand: a retry of the action must not stop it again.
    kube_api.patch("JobSet", "train", {"spec": {"suspend": False}}, NS, JOBSET)
    outcome, detail = act(backend, action)
    assert outcome == "refused" and "resumed since" in detail
    assert len(patches(kube_api, "jobsets")) == 1
    assert len(events_about(kube_api, "JobSet", "train")) == 1


def test_a_kueue_workload_replay_is_not_a_second_deactivation(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    pod = kueue_jobset(kube_api)
    action = reclaim(pod, "JobSet/train")
    assert act(backend, action)[0] == "executed"
    outcome, detail = act(backend, action)
    assert outcome == "executed" and "earlier try of this action" in detail
    # Someone else's deactivation is theirs.
    kube_api.patch("Workload", "jobset-train-1a2b3", {"metadata": {"annotations": {
        "gpusteward.io/suspended-by": None}}}, NS, KUEUE_GROUP)
    outcome, detail = act(backend, action)
    assert outcome == "skipped" and "not by gpusteward" in detail
    assert [b["spec"]["active"] for b in patches(kube_api, "workloads")] == [False]
    assert restore(backend, f"Workload/{NS}/jobset-train-1a2b3")[0] == "refused"


def test_the_executor_suspends_a_gang_only_after_its_owner_was_told(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """The gang reclaim is an idle reclaim to the executor: the notice on a member pod comes
    first, and the reclaims breaker counts it."""
    pod = jobset(kube_api)
    clock = [time.time()]
    executor = Executor(Settings(), backend, execute=True, clock=lambda: clock[0],
                        remediation=RemediationSettings(enabled_rules={"gang_idle"}))
    refused = asyncio.run(executor.decide(reclaim(pod, "JobSet/train")))
    assert refused.outcome == "refused" and "the owner was not told first" in refused.detail
    assert "suspend" not in kube_api.get("JobSet", "train", NS, JOBSET)["spec"]
    told = Action(idempotency_key="g1/notify_owner", verb="notify_owner",
                  target=Subject(queue="research", pod=PodRef(NS, pod)),
                  reason="every pod of JobSet/train idle for 30 min", rule="gang_idle",
                  finding_ids=["g1"], ts=clock[0])
    assert asyncio.run(executor.decide(told)).outcome == "executed"
    clock[0] += 1800
    later = msgspec.structs.replace(reclaim(pod, "JobSet/train", key="g1/requeue/train/2"),
                                    ts=clock[0])
    result = asyncio.run(executor.decide(later))
    assert result.outcome == "executed", result.detail
    assert kube_api.get("JobSet", "train", NS, JOBSET)["spec"]["suspend"] is True
    assert list(executor.breaker.reclaimed) == ["g1/requeue/train/2"]
