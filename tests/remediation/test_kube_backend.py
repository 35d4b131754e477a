"""Every verb of the Kubernetes backend, through the real client, against the API double."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec

from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.rules import idle, spot
from gpusteward.sandbox.kube_api import KUEUE_GROUP, KubeApiServer
from gpusteward.schema import (
    Action,
    ActionVerb,
    DeviceSample,
    Finding,
    NodeInventory,
    PodAllocation,
    PodRef,
    Subject,
    Taint,
)
from gpusteward.settings import Settings
from tests.remediation.cluster import admitted_workload, job, node, pdb, pod, pods, writes
from tests.remediation.test_executor_edge import RecordingProducer
from tests.remediation.test_reclaim import REPO, granted, rbac_triples


def action(verb: ActionVerb, *, node_name: str | None = None, pod_ref: PodRef | None = None,
           **params: str) -> Action:
    return Action(idempotency_key=f"f1/{verb}", verb=verb,
                  target=Subject(node=node_name, pod=pod_ref), reason="ECC DBE on GPU-1",
                  rule="ecc_dbe", finding_ids=["f1"], ts=1000.0, params=params)


def run(backend: KubernetesBackend, act: Action) -> tuple[str, str]:
    return asyncio.run(getattr(backend, act.verb)(act))


def evictions(kube: KubeApiServer) -> list[tuple[str, str, int]]:
    """(namespace, pod, HTTP status) of every eviction request."""
    return [(r.path.split("/")[4], r.path.split("/")[6], r.status) for r in kube.requests
            if r.path.endswith("/eviction")]


def test_cordon_sets_unschedulable_with_a_strategic_merge_patch_once(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load(node("gpu-1"))
    backend = KubernetesBackend(kube_settings)
    assert run(backend, action("cordon", node_name="gpu-1"))[0] == "executed"
    stored = kube.get("Node", "gpu-1")
    assert stored["spec"]["unschedulable"] is True
    assert stored["metadata"]["annotations"]["gpusteward.io/cordon-reason"] == "ECC DBE on GPU-1"
    assert writes(kube) == [("PATCH", "/api/v1/nodes/gpu-1",
                              "application/strategic-merge-patch+json")]
    assert stored["metadata"]["annotations"]["gpusteward.io/cordoned-by"] == "f1/cordon"
    # The same action again (a retry, a replay after a crash) did it; another one did not.
    assert run(backend, action("cordon", node_name="gpu-1")) == (
        "executed", "cordoned gpu-1 (by an earlier try of this action)")
    other = msgspec.structs.replace(action("cordon", node_name="gpu-1"),
                                    idempotency_key="f2/cordon")
    assert run(backend, other) == ("skipped", "gpu-1 is already cordoned")
    assert len(writes(kube)) == 1


def test_taint_adds_a_gpusteward_taint_and_keeps_the_others(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    existing = node("gpu-1")
    existing["spec"]["taints"] = [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    kube.load(existing)
    backend = KubernetesBackend(kube_settings)
    taint = action("taint", node_name="gpu-1", key="xid-79", effect="NoExecute")
    assert run(backend, taint)[0] == "executed"
    taints = kube.get("Node", "gpu-1")["spec"]["taints"]
    assert [(t["key"], t["effect"]) for t in taints] == [
        ("nvidia.com/gpu", "NoSchedule"), ("gpusteward.io/xid-79", "NoExecute")]
    assert taints[1]["value"] == "ecc_dbe"
    assert run(backend, action("taint", node_name="gpu-1", effect="PreferNoSchedule"))[0] == \
        "refused"
    assert len(kube.get("Node", "gpu-1")["spec"]["taints"]) == 2


def test_a_taint_names_its_action_so_a_replay_counts_and_another_taint_does_not(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """As a cordon: the same action again (a retry after a lost reply, a replay after a
    crash before the audit record) finds its own key and reports the taint executed, so the
    circuit breaker counts the node; the same taint set by another action or by hand is
    someone else's, skipped."""
    by_hand = node("gpu-2")
    by_hand["spec"]["taints"] = [{"key": "gpusteward.io/xid-79", "effect": "NoExecute"}]
    kube.load([node("gpu-1"), by_hand])
    backend = KubernetesBackend(kube_settings)
    taint = action("taint", node_name="gpu-1", key="xid-79", effect="NoExecute")
    assert run(backend, taint)[0] == "executed"
    stored = kube.get("Node", "gpu-1")
    assert stored["metadata"]["annotations"]["gpusteward.io/tainted-by"] == "f1/taint"
    assert run(backend, taint) == (
        "executed", "tainted gpu-1 with gpusteward.io/xid-79:NoExecute (by an earlier try of "
        "this action)")
    other = msgspec.structs.replace(taint, idempotency_key="f2/taint")
    assert run(backend, other) == ("skipped", "gpu-1 already has taint "
                                   "gpusteward.io/xid-79:NoExecute")
    assert run(backend, msgspec.structs.replace(taint, target=Subject(node="gpu-2")))[0] == \
        "skipped"
    assert len(kube.get("Node", "gpu-1")["spec"]["taints"]) == 1
    assert len(writes(kube)) == 1


def drainable_node(kube: KubeApiServer, budget_allowed: int) -> None:
    kube.load([
        node("gpu-1"),
        pod("ml-alice", "notebook-0", "gpu-1"),
        pod("ml-bob", "serve-0", "gpu-1", labels={"app": "serve"}),
        pod("gpu-operator", "dcgm-exporter-x", "gpu-1", owner_kind="DaemonSet"),
        pod("kube-node", "static-proxy-gpu-1", "gpu-1", owner_kind="Node",
            annotations={"kubernetes.io/config.mirror": "abc"}),
        pod("ml-carol", "done-0", "gpu-1", phase="Succeeded"),
        pod("kube-system", "coredns-1", "gpu-1"),
        pod("ml-alice", "elsewhere", "gpu-2"),
        pdb("ml-bob", "serve-pdb", {"app": "serve"}, allowed=budget_allowed),
    ])


def test_drain_evicts_through_the_eviction_api_and_leaves_daemonset_and_mirror_pods(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    drainable_node(kube, budget_allowed=1)
    outcome, detail = run(KubernetesBackend(kube_settings), action("drain", node_name="gpu-1"))
    assert outcome == "executed", detail
    assert kube.get("Node", "gpu-1")["spec"]["unschedulable"] is True
    assert sorted((ns, name) for ns, name, code in evictions(kube) if code == 201) == [
        ("ml-alice", "notebook-0"), ("ml-bob", "serve-0")]
    left = {name for _, name in pods(kube)}
    assert left == {"dcgm-exporter-x", "static-proxy-gpu-1", "done-0", "coredns-1", "elsewhere"}
    assert not [r for r in kube.requests if r.method == "DELETE"]
    assert "DaemonSet pod" in detail and "mirror pod" in detail


def test_a_pdb_that_blocks_an_eviction_is_retried_then_reported_never_forced(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    drainable_node(kube, budget_allowed=0)
    outcome, detail = run(KubernetesBackend(kube_settings), action("drain", node_name="gpu-1"))
    assert outcome == "failed"
    assert "drain incomplete after 0.5 s" in detail
    assert "ml-bob/serve-0 blocked by a PodDisruptionBudget" in detail
    assert "violate the pod's disruption budget" in detail
    blocked = [code for ns, name, code in evictions(kube) if name == "serve-0"]
    assert len(blocked) >= 3 and set(blocked) == {429}  # retried with backoff, never forced
    assert ("ml-bob", "serve-0") in pods(kube)
    assert ("ml-alice", "notebook-0") not in pods(kube)
    assert not [r for r in kube.requests if r.method == "DELETE"]


def test_the_owner_of_a_pod_whose_budget_blocks_a_drain_is_told(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """The drain failed and was tried again every re-ask while the fault lasted, the node
    cordoned under the pod: the audit said so, but the pod's owner, the one who can let the
    budget allow an eviction, heard nothing."""
    drainable_node(kube, budget_allowed=0)
    outcome, detail = run(KubernetesBackend(kube_settings), action("drain", node_name="gpu-1"))
    assert outcome == "failed" and "told the owners of 1 of 1 blocked pod(s)" in detail
    (event,) = [e for e in kube.objects("Event") if e["reason"] == "GpuStewardDrainBlocked"]
    assert event["type"] == "Warning"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "serve-0",
                                       "namespace": "ml-bob", "uid": "uid-ml-bob-serve-0"}
    assert event["message"].startswith("Node gpu-1 is being drained by gpusteward (ECC DBE on "
                                       "GPU-1); this pod's PodDisruptionBudget allows no "
                                       "eviction now")


def test_a_drain_goes_on_once_the_pdb_allows_it(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    drainable_node(kube, budget_allowed=0)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:  # the replacement replica became ready elsewhere
            kube.patch("PodDisruptionBudget", "serve-pdb", {"status": {"disruptionsAllowed": 1}},
                       namespace="ml-bob", group="policy")

    backend = KubernetesBackend(kube_settings, sleep=sleep)
    outcome, detail = run(backend, action("drain", node_name="gpu-1"))
    assert outcome == "executed", detail
    assert ("ml-bob", "serve-0") not in pods(kube)
    assert waits == [0.01, 0.02]  # exponential backoff between 429s


def unsafe_to_evict(kube: KubeApiServer) -> None:
    """A node with a pod nothing recreates, a pod with scratch data, and one safe to evict."""
    scratch = pod("ml-bob", "scratch-0", "gpu-1")
    scratch["spec"]["volumes"] = [{"name": "cache", "emptyDir": {}},
                                  {"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]
    kube.load([node("gpu-1"), pod("ml-alice", "interactive", "gpu-1", owner_kind=None),
               scratch, pod("ml-carol", "serve-0", "gpu-1")])


def test_a_drain_leaves_pods_without_a_controller_or_with_emptydir_volumes(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """As ``kubectl drain`` without --force / --delete-emptydir-data: evicting a bare pod
    deletes it for good and an emptyDir's data goes with its pod. Left pods are named, as
    denied-namespace pods are, and do not fail the drain."""
    unsafe_to_evict(kube)
    outcome, detail = run(KubernetesBackend(kube_settings), action("drain", node_name="gpu-1"))
    assert outcome == "executed", detail
    assert kube.get("Node", "gpu-1")["spec"]["unschedulable"] is True
    assert [(ns, name) for ns, name, _ in evictions(kube)] == [("ml-carol", "serve-0")]
    assert {("ml-alice", "interactive"), ("ml-bob", "scratch-0")} <= pods(kube)
    assert "evicted 1 pod(s); left 2" in detail
    assert ("ml-alice/interactive (no controller: evicting it would delete it for good; "
            "drain_bare_pods allows it)") in detail
    assert ("ml-bob/scratch-0 (emptyDir volume: its data would be lost; drain_emptydir_pods "
            "allows it)") in detail


def test_a_drain_evicts_bare_and_emptydir_pods_only_when_each_is_allowed(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    unsafe_to_evict(kube)
    bare_only = kube_settings.model_copy(update={"drain_bare_pods": True})
    outcome, detail = run(KubernetesBackend(bare_only), action("drain", node_name="gpu-1"))
    assert outcome == "executed", detail
    assert {name for _, name, _ in evictions(kube)} == {"interactive", "serve-0"}
    assert ("ml-bob", "scratch-0") in pods(kube)
    both = bare_only.model_copy(update={"drain_emptydir_pods": True})
    outcome, detail = run(KubernetesBackend(both), action("drain", node_name="gpu-1"))
    assert outcome == "executed" and "left" not in detail, detail
    assert pods(kube) == set()
    assert not [r for r in kube.requests if r.method == "DELETE"]  # evicted, never deleted


def test_requeue_deactivates_then_reactivates_a_kueue_workload(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load([
        pod("ml-dave", "train-0", "gpu-1", owner_kind="Job",
            annotations={"kueue.x-k8s.io/workload": "job-train-abc12"}),
        admitted_workload("ml-dave", "job-train-abc12"),
    ])
    outcome, detail = run(KubernetesBackend(kube_settings),
                          action("requeue", pod_ref=PodRef("ml-dave", "train-0")))
    assert outcome == "executed", detail
    assert [(r.path.rsplit("/", 1)[1], r.body["spec"]["active"]) for r in kube.requests
            if r.method == "PATCH"] == [("job-train-abc12", False), ("job-train-abc12", True)]
    stored = kube.get("Workload", "job-train-abc12", "ml-dave", group=KUEUE_GROUP)
    assert stored["spec"]["active"] is True
    assert {c["reason"] for c in stored["status"]["conditions"]} >= {"Reactivated"}
    assert all(r.content_type == "application/merge-patch+json" for r in kube.requests
               if r.method == "PATCH")
    assert ("ml-dave", "train-0") in pods(kube)  # Kueue, not us, stops the pods


def test_a_kueue_workload_inactive_by_someone_else_is_left_so(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """Reactivating a workload found inactive finishes only this action's own requeue: one an
    operator or Kueue deactivated stays inactive."""
    parked = admitted_workload("ml-dave", "job-train-abc12")
    parked["spec"]["active"] = False
    kube.load([pod("ml-dave", "train-0", "gpu-1", owner_kind="Job",
                   annotations={"kueue.x-k8s.io/workload": "job-train-abc12"}), parked])
    outcome, detail = run(KubernetesBackend(kube_settings),
                          action("requeue", pod_ref=PodRef("ml-dave", "train-0")))
    assert (outcome, detail) == ("skipped", "Kueue workload ml-dave/job-train-abc12 is "
                                 "inactive, not by this action: left as it is")
    assert writes(kube) == []


def test_a_spot_interruptions_requeue_reaches_its_kueue_workload(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """The spot rule's action as the rule makes it, carried out: its params name the
    workload and its namespace the way the backend reads them."""
    track = spot.SpotNodeTrack()
    spot.on_pod(track, PodAllocation(
        ts=1.0, node="spot-1", pod=PodRef("ml-dave", "train-0", uid="u1"), phase="running",
        gpus=1, owner_kind="Workload", owner_name="job-train-abc12", queue="batch"),
        spot.SpotSettings())
    _, requeue = spot.on_inventory(track, NodeInventory(
        ts=10.0, node="spot-1", gpu_count=8, spot=True,
        taints=[Taint("aws-node-termination-handler/spot-itn", "NoSchedule", "evt-1")]),
        spot.SpotSettings())
    assert isinstance(requeue, Action)
    kube.load([node("spot-1"),
               pod("ml-dave", "train-0", "spot-1", owner_kind="Job",
                   annotations={"kueue.x-k8s.io/workload": "job-train-abc12"}),
               admitted_workload("ml-dave", "job-train-abc12")])
    outcome, detail = run(KubernetesBackend(kube_settings), requeue)
    assert outcome == "executed", detail
    assert detail.startswith("requeued Kueue workload ml-dave/job-train-abc12")


def test_every_requeue_the_spot_rule_asks_for_the_backend_carries_out(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """One pod of each default restartable owner on a reclaimed spot node, each with the
    controller it has on a real cluster: the rule asks only for requeues the backend does
    (no refusal), and the pods of Kubeflow training operators and Ray are left alone."""
    settings = spot.SpotSettings()
    # top owner (as the collector reports it) -> the live pod's controller kind
    live_controller = {"Job": "Job", "JobSet": "Job", "TrainJob": "Job",
                       "PyTorchJob": "PyTorchJob", "TFJob": "TFJob", "MPIJob": "MPIJob",
                       "JAXJob": "JAXJob", "XGBoostJob": "XGBoostJob", "PaddleJob": "PaddleJob",
                       "RayJob": "RayCluster", "RayCluster": "RayCluster"}
    assert set(live_controller) | {"Workload"} == set(settings.restartable_owners)
    track = spot.SpotNodeTrack()
    live = [node("spot-1")]
    for owner, controller in live_controller.items():
        name = owner.lower() + "-0"
        spot.on_pod(track, PodAllocation(
            ts=1.0, node="spot-1", pod=PodRef("ml", name, uid=f"uid-ml-{name}"),
            phase="running", gpus=1, owner_kind=owner, owner_name=owner.lower()), settings)
        live.append(pod("ml", name, "spot-1", owner_kind=controller, owner_name=owner.lower()))
        if controller == "Job":
            live.append(job("ml", owner.lower()))
    kube.load(live)
    finding, *requeues = spot.on_inventory(track, NodeInventory(
        ts=10.0, node="spot-1", gpu_count=8, spot=True,
        taints=[Taint("aws-node-termination-handler/spot-itn", "NoSchedule", "evt-1")]),
        settings)
    assert isinstance(finding, Finding)
    backend = KubernetesBackend(kube_settings)
    outcomes = {}
    for requeue in requeues:
        assert isinstance(requeue, Action) and requeue.target.pod
        outcomes[requeue.target.pod.name] = run(backend, requeue)[0]
    assert outcomes == {"job-0": "executed", "jobset-0": "executed", "trainjob-0": "executed"}
    left = {f"ml/{o.lower()}-0" for o in live_controller if live_controller[o] != "Job"}
    assert set(finding.labels["left_to_controller"].split(",")) == left
    assert {("ml", n.split("/")[1]) for n in left} <= pods(kube)
    assert ("3 to requeue, 8 left to their controller to recreate (JAXJob ml/jaxjob, "
            "MPIJob ml/mpijob, PaddleJob ml/paddlejob, PyTorchJob ml/pytorchjob, RayCluster "
            "ml/raycluster and 3 more), 0 need a decision") in finding.summary


def test_a_drain_leaves_the_pods_of_namespaces_the_deny_patterns_match(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """The deny-list holds glob patterns, in the drain as in the executor's guard."""
    drainable_node(kube, budget_allowed=1)
    settings = kube_settings.model_copy(update={"deny_namespaces": {"kube-*", "ml-b?b"}})
    outcome, detail = run(KubernetesBackend(settings), action("drain", node_name="gpu-1"))
    assert outcome == "executed", detail
    assert {("kube-system", "coredns-1"), ("ml-bob", "serve-0")} <= pods(kube)
    assert ("ml-alice", "notebook-0") not in pods(kube)
    assert "kube-system/coredns-1 (denied namespace)" in detail


def test_requeue_of_a_plain_job_pod_deletes_it_and_a_bare_pod_is_refused(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load([pod("ml-erin", "job-x-1", "gpu-1", owner_kind="Job", owner_name="job-x"),
               job("ml-erin", "job-x"),
               pod("ml-erin", "bare", "gpu-1", owner_kind=None)])
    backend = KubernetesBackend(kube_settings)
    outcome, detail = run(backend, action("requeue", pod_ref=PodRef("ml-erin", "job-x-1")))
    assert outcome == "executed" and "Job job-x recreates it" in detail
    assert ("ml-erin", "job-x-1") not in pods(kube)
    outcome, _ = run(backend, action("requeue", pod_ref=PodRef("ml-erin", "bare")))
    assert outcome == "refused"
    assert ("ml-erin", "bare") in pods(kube)
    assert run(backend, action("requeue", pod_ref=PodRef("ml-erin", "job-x-1")))[0] == "skipped"


def test_notify_owner_creates_an_event_and_annotates_the_pod_once(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load(pod("ml-alice", "notebook-0", "gpu-1"))
    backend = KubernetesBackend(kube_settings)
    notify = action("notify_owner", pod_ref=PodRef("ml-alice", "notebook-0"))
    assert run(backend, notify)[0] == "executed"
    [event] = kube.objects("Event")
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "notebook-0",
                                       "namespace": "ml-alice", "uid": "uid-ml-alice-notebook-0"}
    assert (event["reason"], event["type"], event["message"]) == (
        "GpuStewardNotice", "Warning", "ECC DBE on GPU-1")
    annotations = kube.get("Pod", "notebook-0", "ml-alice")["metadata"]["annotations"]
    assert annotations["gpusteward.io/notice"] == "ECC DBE on GPU-1"
    assert run(backend, notify)[0] == "skipped"
    assert len(kube.objects("Event")) == 1


def test_a_notice_to_a_pod_that_does_not_exist_is_not_delivered(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """``skipped`` would count as delivered, and let a reclaim of a pod recreated under the
    same name go ahead with its owner never told."""
    notify = action("notify_owner", pod_ref=PodRef("ml-alice", "notebook-0"))
    assert run(KubernetesBackend(kube_settings), notify) == (
        "failed", "pod ml-alice/notebook-0 does not exist: no notice was delivered")
    assert writes(kube) == []


def test_a_notice_to_a_pod_replaced_under_the_same_name_is_refused(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load(pod("ml-alice", "notebook-0", "gpu-1"))  # uid-ml-alice-notebook-0
    backend = KubernetesBackend(kube_settings)
    stale = action("notify_owner", pod_ref=PodRef("ml-alice", "notebook-0", uid="uid-old"))
    assert run(backend, stale) == (
        "refused", "pod ml-alice/notebook-0 was replaced: the live pod's uid is "
        "uid-ml-alice-notebook-0, the action names uid-old; no notice was delivered")
    assert writes(kube) == []
    live = action("notify_owner",
                  pod_ref=PodRef("ml-alice", "notebook-0", uid="uid-ml-alice-notebook-0"))
    assert run(backend, live)[0] == "executed"


def test_a_job_pod_is_requeued_only_while_its_job_would_run_it_again(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """The spot rule or the idle ladder asked to requeue a Job's pod; since, the owner
    suspended the Job or deleted it, or it finished, and nothing would recreate the pod;
    or the Job has used its retries, and a deleted running pod counts as one more
    failure: a training Job with backoffLimit 0 (a JobSet's child, whose failure fails the
    JobSet) was failed for good by a "requeue" that said "Job recreates it elsewhere"."""
    cases = {"suspended": (job("ml", "suspended", suspend=True), "skipped", "is suspended"),
             "last-try": (job("ml", "last-try", backoffLimit=0), "refused",
                          "has failed 0 time(s) and its backoffLimit is 0"),
             "gone": (None, "skipped", "is gone: nothing would recreate pod gone-0"),
             "running": (job("ml", "running"), "executed", "Job running recreates it")}
    for name, (owner, _, _) in cases.items():
        kube.load(pod("ml", f"{name}-0", "spot-1", owner_kind="Job", owner_name=name))
        if owner is not None:
            kube.load(owner)
    backend = KubernetesBackend(kube_settings)
    for name, (_, outcome, words) in cases.items():
        done, detail = run(backend, action("requeue", pod_ref=PodRef("ml", f"{name}-0")))
        assert (done, words in detail) == (outcome, True), (name, detail)
    assert {n for _, n in pods(kube)} == {"suspended-0", "last-try-0", "gone-0"}


def test_a_requeue_of_a_pod_replaced_under_the_same_name_is_refused(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load([pod("ml-erin", "job-x-1", "gpu-1", owner_kind="Job", owner_name="job-x"),
               job("ml-erin", "job-x"),
               pod("ml-dave", "train-0", "gpu-1", owner_kind="Job",
                   annotations={"kueue.x-k8s.io/workload": "job-train-abc12"}),
               admitted_workload("ml-dave", "job-train-abc12")])
    backend = KubernetesBackend(kube_settings)
    for ref in (PodRef("ml-erin", "job-x-1", uid="uid-old"),
                PodRef("ml-dave", "train-0", uid="uid-old")):
        outcome, detail = run(backend, action("requeue", pod_ref=ref))
        assert (outcome, detail.split(":")[0]) == (
            "refused", f"pod {ref.namespace}/{ref.name} was replaced"), detail
    assert writes(kube) == []
    live = PodRef("ml-erin", "job-x-1", uid="uid-ml-erin-job-x-1")
    assert run(backend, action("requeue", pod_ref=live))[0] == "executed"


def test_set_mig_config_labels_the_node(kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load(node("gpu-1", labels={"nvidia.com/mig.config": "all-disabled"}))
    backend = KubernetesBackend(kube_settings)
    relabel = action("set_mig_config", node_name="gpu-1", config="all-3g.40gb")
    outcome, detail = run(backend, relabel)
    assert outcome == "executed" and "was all-disabled" in detail
    stored = kube.get("Node", "gpu-1")["metadata"]
    assert stored["labels"]["nvidia.com/mig.config"] == "all-3g.40gb"
    assert stored["annotations"]["gpusteward.io/mig-config-by"] == "f1/set_mig_config"
    # The same action again finds its own label: executed, so the breaker counts the node;
    # another action that asks for the label the node has is skipped.
    assert run(backend, relabel) == (
        "executed", "set nvidia.com/mig.config=all-3g.40gb on gpu-1 (by an earlier try of "
        "this action)")
    other = msgspec.structs.replace(relabel, idempotency_key="f2/set_mig_config")
    assert run(backend, other) == (
        "skipped", "gpu-1 already has nvidia.com/mig.config=all-3g.40gb")
    assert len(writes(kube)) == 1


def test_set_mig_config_skips_a_label_someone_else_set(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load(node("gpu-1", labels={"nvidia.com/mig.config": "all-3g.40gb"}))
    relabel = action("set_mig_config", node_name="gpu-1", config="all-3g.40gb")
    assert run(KubernetesBackend(kube_settings), relabel)[0] == "skipped"
    assert writes(kube) == []


def test_gpu_node_count_counts_only_gpu_nodes(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load([node("gpu-1"), node("gpu-2"), node("cpu-1", gpus=0)])
    count: Any = asyncio.run(KubernetesBackend(kube_settings).gpu_node_count())
    assert count == 2


def test_an_idle_pods_event_is_the_owner_notice(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load(pod("ml-alice", "notebook-0", "gpu-1"))
    holder = idle.Holder(PodRef("ml-alice", "notebook-0"), 1000.0, "notebook")
    sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=0.0)
    track, ts = idle.IdleTrack(), 1000.0
    out: list[Finding | Action] = []
    while not out:
        out = idle.observe(track, "gpu-1", sample, ts, idle.IdleSettings(), holder)
        ts += 60
    finding, notify = out
    assert isinstance(finding, Finding) and isinstance(notify, Action)
    assert run(KubernetesBackend(kube_settings), notify)[0] == "executed"
    [event] = kube.objects("Event")
    assert event["message"] == idle.owner_notice(finding)
    assert "gpusteward.io/keep-until=<RFC 3339 time>" in event["message"]


def test_every_request_of_the_node_pod_and_kueue_verbs_is_granted_to_the_executor(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """Sent by the real verbs, not copied from their code: a request the execute component's
    role does not grant is a 403 on a cluster (test_reclaim.py does the same for reclaim and
    restore)."""
    drainable_node(kube, budget_allowed=1)
    kube.load([node("gpu-2"),
               pod("ml-dave", "train-0", "gpu-2", owner_kind="Job",
                   annotations={"kueue.x-k8s.io/workload": "job-train-abc12"}),
               admitted_workload("ml-dave", "job-train-abc12"),
               pod("ml-erin", "job-x-1", "gpu-2", owner_kind="Job", owner_name="job-x"),
               job("ml-erin", "job-x")])
    backend = KubernetesBackend(kube_settings)
    done = [run(backend, action("drain", node_name="gpu-1")),
            run(backend, action("taint", node_name="gpu-2", key="xid-79")),
            run(backend, action("set_mig_config", node_name="gpu-2", config="all-1g.10gb")),
            run(backend, action("requeue", pod_ref=PodRef("ml-dave", "train-0"))),
            run(backend, action("requeue", pod_ref=PodRef("ml-erin", "job-x-1"))),
            run(backend, action("notify_owner", pod_ref=PodRef("ml-alice", "elsewhere")))]
    assert [outcome for outcome, _ in done] == ["executed"] * len(done), done
    assert asyncio.run(backend.gpu_node_count()) == 2
    sent = rbac_triples(kube)
    execute = granted(REPO / "deploy/components/remediation-execute/rbac.yaml")
    assert sent <= execute, sent - execute
    # Every write the role grants on nodes, pods and Kueue is one of these verbs'.
    assert {t for t in execute if t[0] in ("", KUEUE_GROUP) and t[2] not in ("get", "list")
            } <= sent


def _idle_ladder(workload_kind: str) -> list[Action]:
    """The actions the idle rule asks for, one sample a minute, a pod idle from its start
    (1000) until its reclaim."""
    holder = idle.Holder(PodRef("ml-alice", "notebook-0", uid="uid-ml-alice-notebook-0"),
                         1000.0, workload_kind)
    sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=0.0)
    track, ts = idle.IdleTrack(), 1000.0
    asked: list[Action] = []
    while not any(a.verb == "requeue" for a in asked):
        asked += [out for out in idle.observe(track, "gpu-1", sample, ts, idle.IdleSettings(),
                                              holder) if isinstance(out, Action)]
        ts += 60
        assert ts < 100_000
    return asked


def test_the_owner_finds_the_notice_event_in_the_hour_before_the_reclaim(
        tmp_path: Path) -> None:
    """The API server deletes Events after its --event-ttl (1 h by default), and the default
    ladder reclaims 8 h after the warning: the owner who ran `kubectl describe pod` in the
    hour before the reclaim found no Event. The rule now reminds them `remind_before_s` (1 h)
    before it is due, a fresh Event that says when; redelivered it is still one Event, and
    a dry run makes none."""
    now = [0.0]
    asked = _idle_ladder("notebook")
    reclaim, notices_asked = asked[-1], [a for a in asked if a.verb == "notify_owner"]
    with KubeApiServer(event_ttl_s=3600, clock=lambda: now[0]) as kube:
        kube.load(pod("ml-alice", "notebook-0", "gpu-1"))
        backend = KubernetesBackend(KubeSettings(
            kubeconfig=str(kube.write_kubeconfig(tmp_path / "kubeconfig"))))

        def executor(execute: bool = True) -> Executor:
            return Executor(Settings(), backend, execute=execute, clock=lambda: now[0],
                            remediation=RemediationSettings(enabled_rules=["idle_holder"]))

        def notices(at: float) -> list[dict[str, Any]]:
            """The notice Events on the pod when its owner looks at ``at``."""
            now[0] = at
            return [e for e in kube.objects("Event") if e["reason"] == "GpuStewardNotice"
                    and e["involvedObject"]["name"] == "notebook-0"]

        def decide(by: Executor, act: Action) -> str:
            now[0] = act.ts  # the executor acts as the action arrives
            return asyncio.run(by.decide(act)).outcome

        executing, dry_run = executor(), executor(execute=False)
        first, warn = notices_asked[:2]
        assert [decide(executing, a) for a in (first, warn)] == ["executed"] * 2
        assert notices(warn.ts + 3600 + 60) == []  # the warning's Event has expired
        for later in notices_asked[2:]:
            assert decide(dry_run, later) == "dry_run"
            assert notices(later.ts) == []
            assert decide(executing, later) == "executed"
        for looked in (reclaim.ts - 3000, reclaim.ts - 60):
            [event] = notices(looked)
            assert f"a reclaim at {idle.rfc3339(reclaim.ts)}" in event["message"]
            assert event["type"] == "Warning"
        remind = notices_asked[-1]
        assert event["message"] == remind.reason[:1000]
        assert remind.reason.startswith("Reminder: ")
        assert reclaim.ts - 3600 <= remind.ts < reclaim.ts - 3540
        # Redelivered: skipped by its key, and by a restarted executor that has not read the
        # audit back, because the pod already carries the notice: still one Event.
        assert decide(executing, remind) == "skipped"
        assert decide(executor(), remind) == "skipped"
        assert len(notices(remind.ts)) == 1
        annotations = kube.get("Pod", "notebook-0", "ml-alice")["metadata"]["annotations"]
        assert annotations["gpusteward.io/notice"] == remind.reason[:1000]


def test_no_reminder_where_the_warnings_event_lasts_until_the_reclaim() -> None:
    """A batch pod is reclaimed an hour after its warning: the warning's Event still stands,
    and a reminder would be a second Event for nothing."""
    assert [a.verb for a in _idle_ladder("batch")] == ["notify_owner", "notify_owner",
                                                       "requeue"]


def test_a_node_an_admin_uncordoned_is_not_cordoned_or_drained_again_by_a_re_ask(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """A drain blocked by a PodDisruptionBudget fails with its node cordoned; the worker asks
    again every reask_s while the fault's finding stays open, and a failed key is tried
    again. An admin who looked at the node and uncordoned it (``kubectl uncordon``: the
    annotations stay) had that undone by the next re-ask, which cordoned it and evicted what
    had been scheduled there since. The same for a cordon or taint asked again after the
    executor forgot its key (the audit topic's retention) and replayed after a crash."""
    drainable_node(kube, budget_allowed=0)
    executor = Executor(Settings(), KubernetesBackend(kube_settings), execute=True,
                        remediation=RemediationSettings(enabled_rules={"ecc_dbe"},
                                                        max_action_age_s=None))
    producer = RecordingProducer()
    drain = action("drain", node_name="gpu-1")

    def handle(asked: Action) -> Any:
        return asyncio.run(executor._handle(producer, msgspec.json.encode(asked), key=b"gpu-1"))

    assert handle(drain).outcome == "failed"  # serve-0's budget allows no disruption
    kube.patch("Node", "gpu-1", {"spec": {"unschedulable": False}})  # kubectl uncordon
    kube.load(pod("ml-dave", "train-1", "gpu-1"))  # scheduled there since
    evicted = len(evictions(kube))
    again = handle(msgspec.structs.replace(drain, reask=1, ts=1600.0))
    assert again.outcome == "refused", again.detail
    assert "uncordoned since by someone else: left schedulable" in again.detail
    assert not kube.get("Node", "gpu-1")["spec"].get("unschedulable")
    assert len(evictions(kube)) == evicted and ("ml-dave", "train-1") in pods(kube)

    backend = KubernetesBackend(kube_settings)
    kube.load(node("gpu-2"))
    assert run(backend, action("cordon", node_name="gpu-2"))[0] == "executed"
    kube.patch("Node", "gpu-2", {"spec": {"unschedulable": False}})
    assert run(backend, action("cordon", node_name="gpu-2"))[0] == "refused"
    assert not kube.get("Node", "gpu-2")["spec"].get("unschedulable")
    taint = action("taint", node_name="gpu-2", key="gpu-reset-required")
    assert run(backend, taint)[0] == "executed"
    kube.patch("Node", "gpu-2", {"spec": {"taints": []}})  # kubectl taint ... -
    outcome, detail = run(backend, taint)
    assert outcome == "refused" and "the taint was removed since by someone else" in detail
    assert kube.get("Node", "gpu-2")["spec"]["taints"] == []


def test_a_node_re_created_under_the_same_name_since_the_action_is_left_alone(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """A cordon and a drain asked for gpu-1's double-bit ECC error ten minutes ago wait in
    the actions topic (the executor was down); meanwhile the faulty machine's Node was
    deleted and a repaired or new one joined under the same name (bare metal keeps host
    names). The finding resolved with the deletion, but the backlog cordoned and drained
    the new machine, evicting the work just scheduled there."""
    faulty, older = node("gpu-1"), node("gpu-2")
    for obj in (faulty, older):
        obj["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    kube.load([faulty, older])
    kube.delete("Node", "gpu-1")
    kube.load([node("gpu-1"), pod("ml-bob", "serve-0", "gpu-1")])  # joined again just now
    backend = KubernetesBackend(kube_settings.model_copy(update={"refuse_newer_nodes": True}))
    asked_at = time.time() - 600
    for verb in ("cordon", "drain", "taint"):
        outcome, detail = run(backend, msgspec.structs.replace(
            action(verb, node_name="gpu-1"), ts=asked_at))
        assert outcome == "refused", (verb, detail)
        assert "deleted and re-created under the same name since" in detail
    assert not kube.get("Node", "gpu-1")["spec"].get("unschedulable")
    assert evictions(kube) == [] and ("ml-bob", "serve-0") in pods(kube)
    # A node older than the action is the one it is about: acted on as ever.
    assert run(backend, msgspec.structs.replace(
        action("cordon", node_name="gpu-2"), ts=asked_at))[0] == "executed"
