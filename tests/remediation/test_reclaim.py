"""Reclaiming an idle pod's GPUs by owner kind, restoring them, and keep-until.

Through the real ``kubernetes`` client against the API-server double
(sandbox/kube_api.py), with owner objects in their upstream shapes: Pod ->
ReplicaSet -> Deployment, Pod -> StatefulSet, Pod -> StatefulSet -> Kubeflow
Notebook, Pod -> Job, a pod of a Kueue workload and a bare pod. The last test
holds the execute component's RBAC to exactly the requests these made.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from gpusteward import kafka, topics
from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.remediation.kubernetes import (
    SUSPENDABLE_GANGS,
    KubernetesBackend,
    KubeSettings,
)
from gpusteward.reports import findings
from gpusteward.rules.idle import IdleSettings, rfc3339
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.schema import Action, ActionResult, PodRef, Subject
from gpusteward.settings import Settings

REPO = Path(__file__).resolve().parents[2]
GPUSTEWARD = Path(sys.executable).parent / "gpusteward"
NS = "ml-alice"
Obj = dict[str, Any]


# -- upstream-shaped objects -----------------------------------------------------------------


def _template(labels: dict[str, str]) -> Obj:
    return {"metadata": {"labels": labels},
            "spec": {"containers": [{"name": "main", "image": "jupyter/scipy-notebook",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def _owner_ref(owner: Obj) -> Obj:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"],
            "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _apps(kind: str, name: str, replicas: int, owner: Obj | None = None) -> Obj:
    labels = {"app": name}
    spec: Obj = {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": _template(labels)}
    if kind == "StatefulSet":
        spec["serviceName"] = name
    meta: Obj = {"name": name, "namespace": NS, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [_owner_ref(owner)]
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": meta, "spec": spec,
            "status": {"replicas": replicas, "readyReplicas": replicas}}


def _pod(name: str, owner: Obj | None, annotations: dict[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name, "namespace": NS, "labels": {}, "annotations": annotations or {}}
    if owner is not None:
        meta["ownerReferences"] = [_owner_ref(owner)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": "gpu-1", **_template({})["spec"]},
            "status": {"phase": "Running", "startTime": "2026-11-23T08:00:00Z"}}


@dataclass
class Owned:
    """A pod and the object a reclaim acts on."""

    pod: str
    kind: str
    name: str

    @property
    def target(self) -> str:
        return f"{self.kind}/{NS}/{self.name}"


def deployment(api: KubeApiServer, annotations: dict[str, str] | None = None) -> Owned:
    owner = api.create(_apps("Deployment", "serve-alice", 2))
    replica_set = _apps("ReplicaSet", "serve-alice-6d4cf56db6", 2, owner)
    replica_set["metadata"]["labels"]["pod-template-hash"] = "6d4cf56db6"
    rs = api.create(replica_set)
    api.create(_pod("serve-alice-6d4cf56db6-x7k2p", rs, annotations))
    return Owned("serve-alice-6d4cf56db6-x7k2p", "Deployment", "serve-alice")


def statefulset(api: KubeApiServer, annotations: dict[str, str] | None = None) -> Owned:
    owner = api.create(_apps("StatefulSet", "vllm-alice", 1))
    api.create(_pod("vllm-alice-0", owner, annotations))
    return Owned("vllm-alice-0", "StatefulSet", "vllm-alice")


def notebook(api: KubeApiServer, annotations: dict[str, str] | None = None) -> Owned:
    nb = api.create({"apiVersion": "kubeflow.org/v1", "kind": "Notebook",
                     "metadata": {"name": "nb-alice", "namespace": NS,
                                  "labels": {"app": "nb-alice"}},
                     "spec": {"template": _template({})}})
    # The notebook controller's StatefulSet, named after the Notebook and owned by it.
    sts = api.create(_apps("StatefulSet", "nb-alice", 1, nb))
    api.create(_pod("nb-alice-0", sts, annotations))
    return Owned("nb-alice-0", "Notebook", "nb-alice")


RESTORABLE: dict[str, Callable[..., Owned]] = {
    "Deployment": deployment, "StatefulSet": statefulset, "Notebook": notebook}


def job(api: KubeApiServer, annotations: dict[str, str] | None = None) -> Owned:
    # The backend reads the Job (running, not at its backoffLimit) before deleting its pod.
    owner = api.create({"apiVersion": "batch/v1", "kind": "Job",
                        "metadata": {"name": "train-alice", "namespace": NS,
                                     "uid": "uid-job-train-alice"},
                        "spec": {"template": {"spec": {"containers": [{"name": "train"}]}}},
                        "status": {"active": 1}})
    api.create(_pod("train-alice-5hq9v", owner, annotations))
    return Owned("train-alice-5hq9v", "Job", "train-alice")


# -- helpers ---------------------------------------------------------------------------------


def reclaim(pod: str, *, idle_since: float | None = None, uid: str | None = None,
            **params: str) -> Action:
    return Action(
        idempotency_key=f"f1/requeue/{pod}", verb="requeue",
        target=Subject(node="gpu-1", device="GPU-1", pod=PodRef(NS, pod, uid=uid)),
        reason="ml-alice/pod has held GPU-1 idle for 12.5 h: reclaiming it", rule="idle_holder",
        finding_ids=["f1"], ts=time.time(),
        params={"reason": "idle-reclaim",
                "idle_since": repr(idle_since if idle_since is not None else time.time() - 3600),
                "keep_until_max_s": "1209600.0", "delete_bare_pod": "false", **params})


@pytest.fixture
def backend(kube_api: KubeApiServer, kubeconfig: Path) -> KubernetesBackend:
    return KubernetesBackend(KubeSettings(kubeconfig=str(kubeconfig), requeue_timeout_s=5))


def act(backend: KubernetesBackend, action: Action) -> tuple[str, str]:
    return asyncio.run(backend.requeue(action))


def writes(api: KubeApiServer) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in api.requests if r.method in ("POST", "PATCH", "DELETE")]


def replicas(api: KubeApiServer, owned: Owned) -> int:
    return int(api.get(owned.kind, owned.name, NS, "apps")["spec"]["replicas"])


def annotations_of(api: KubeApiServer, kind: str, name: str) -> dict[str, str]:
    group = {"Notebook": "kubeflow.org", "Deployment": "apps", "StatefulSet": "apps"}[kind]
    found: dict[str, str] = api.get(kind, name, NS, group)["metadata"].get("annotations") or {}
    return found


def events_about(api: KubeApiServer, kind: str, name: str) -> list[Obj]:
    return [e for e in api.objects("Event") if e["involvedObject"]["kind"] == kind
            and e["involvedObject"]["name"] == name]


# -- reclaim and restore, per owner kind -----------------------------------------------------


@pytest.mark.parametrize("kind", sorted(RESTORABLE))
def test_reclaim_stops_the_owner_and_restore_starts_it_again(
        kind: str, kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    owned = RESTORABLE[kind](kube_api)
    outcome, detail = act(backend, reclaim(owned.pod))
    assert outcome == "executed", detail
    assert f"gpusteward act --restore {owned.target}" in detail
    if kind == "Notebook":
        assert "kubeflow-resource-stopped" in annotations_of(kube_api, kind, owned.name)
        # The notebook controller scales its StatefulSet; gpusteward leaves it alone.
        assert kube_api.get("StatefulSet", "nb-alice", NS, "apps")["spec"]["replicas"] == 1
    else:
        assert replicas(kube_api, owned) == 0
        assert annotations_of(kube_api, kind, owned.name)["gpusteward.io/reclaimed-replicas"] == (
            "2" if kind == "Deployment" else "1")
    (event,) = events_about(kube_api, kind, owned.name)
    assert event["reason"] == "GpuStewardReclaimed" and "idle" in event["message"]
    assert f"gpusteward act --restore {owned.target}" in event["message"]

    # A redelivered reclaim finds it done.
    assert act(backend, reclaim(owned.pod))[0] == "skipped"

    outcome, detail = asyncio.run(backend.restore(owned.kind, NS, owned.name))
    assert outcome == "executed", detail
    left = annotations_of(kube_api, kind, owned.name)
    assert not [k for k in left if k.startswith("gpusteward.io/") or k.startswith("kubeflow-")]
    if kind != "Notebook":
        assert replicas(kube_api, owned) == (2 if kind == "Deployment" else 1)
    # Nothing left to restore, and restore never touches what gpusteward did not stop.
    assert asyncio.run(backend.restore(owned.kind, NS, owned.name))[0] == "refused"


def test_a_deployment_keda_keeps_above_zero_is_not_scaled_down_to_a_fight(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """KEDA's operator scales its target back to minReplicaCount within its polling
    interval: the reclaim was audited executed and the owner told their GPUs were taken,
    while a new pod held them again at once (and its next idle episode climbed the ladder
    again). An autoscaler that lets it rest at zero is no fight."""
    owned = deployment(kube_api)
    for name, target in (("other", "serve-bob"), ("serve-alice", "serve-alice")):
        kube_api.create({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                         "metadata": {"name": name, "namespace": NS},
                         "spec": {"scaleTargetRef": {"name": target}, "minReplicaCount": 1}})
    outcome, detail = act(backend, reclaim(owned.pod))
    assert outcome == "refused", detail
    assert "KEDA ScaledObject serve-alice (minReplicaCount 1)" in detail
    assert replicas(kube_api, owned) == 2 and not events_about(kube_api, "Deployment",
                                                                 owned.name)
    kube_api.patch("ScaledObject", "serve-alice", {"spec": {"minReplicaCount": 0}}, NS,
                   "keda.sh")
    assert act(backend, reclaim(owned.pod))[0] == "executed"
    assert replicas(kube_api, owned) == 0


@pytest.mark.parametrize(("make", "manager"), [
    (deployment, ("serving.kserve.io/v1beta1", "InferenceService", "llm")),
    (statefulset, ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "vllm")),
], ids=["deployment-of-an-inferenceservice", "statefulset-of-a-leaderworkerset"])
def test_an_owner_another_controller_manages_is_not_scaled_down(
        kube_api: KubeApiServer, backend: KubernetesBackend,
        make: Callable[[KubeApiServer], Owned], manager: tuple[str, str, str]) -> None:
    """A KServe InferenceService (or a Knative Revision, a LeaderWorkerSet) owns its
    Deployment or StatefulSet and keeps its replicas: a scale to zero would be set back, the
    GPUs held again at once and the owner told they were given back. Refused, nothing
    written; the same object on its own is scaled down."""
    owned = make(kube_api)
    before = replicas(kube_api, owned)
    api_version, kind, name = manager
    kube_api.mutate(owned.kind, owned.name, lambda obj: obj["metadata"].update(
        ownerReferences=[{"apiVersion": api_version, "kind": kind, "name": name,
                          "uid": f"uid-{name}", "controller": True}]), NS, "apps")
    outcome, detail = act(backend, reclaim(owned.pod))
    assert (outcome, detail) == ("refused", (
        f"{owned.kind} {NS}/{owned.name} is managed by {kind} {name}, whose controller "
        f"may undo a scale-down: ask its owner to scale the {kind} down"))
    assert replicas(kube_api, owned) == before and writes(kube_api) == []
    kube_api.mutate(owned.kind, owned.name,
                    lambda obj: obj["metadata"].pop("ownerReferences"), NS, "apps")
    assert act(backend, reclaim(owned.pod))[0] == "executed"
    assert replicas(kube_api, owned) == 0


def test_restore_keeps_a_scale_someone_made_since(kube_api: KubeApiServer,
                                                  backend: KubernetesBackend) -> None:
    owned = deployment(kube_api)
    assert act(backend, reclaim(owned.pod))[0] == "executed"
    kube_api.patch("Deployment", owned.name, {"spec": {"replicas": 1}}, NS, "apps")
    outcome, detail = asyncio.run(backend.restore("Deployment", NS, owned.name))
    assert outcome == "skipped" and "already scaled to 1" in detail
    assert replicas(kube_api, owned) == 1
    assert "gpusteward.io/reclaimed-replicas" not in annotations_of(kube_api, "Deployment",
                                                                  owned.name)


def test_the_executor_reclaims_only_min_notice_s_after_the_owner_was_told(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """An idle episode's notice and reclaim replayed back to back (a backlog after an
    outage): the owner gets the notice, the notebook keeps running; from min_notice_s after
    the notice was delivered the reclaim stops it."""
    owned = notebook(kube_api)
    clock = [time.time()]
    executor = Executor(Settings(), backend, execute=True, clock=lambda: clock[0],
                        remediation=RemediationSettings(enabled_rules={"idle_holder"}))
    told = Action(idempotency_key="f1/notify_owner", verb="notify_owner",
                  target=Subject(node="gpu-1", device="GPU-1", pod=PodRef(NS, owned.pod)),
                  reason="idle for 30 min", rule="idle_holder", finding_ids=["f1"],
                  ts=clock[0])
    assert asyncio.run(executor.decide(told)).outcome == "executed"
    assert [e["reason"] for e in events_about(kube_api, "Pod", owned.pod)] == [
        "GpuStewardNotice"]

    early = asyncio.run(executor.decide(reclaim(owned.pod)))
    assert early.outcome == "refused" and "min_notice_s=1800 s" in early.detail
    assert "kubeflow-resource-stopped" not in annotations_of(kube_api, "Notebook", owned.name)

    clock[0] += 1800
    later = msgspec.structs.replace(reclaim(owned.pod), ts=clock[0])
    result = asyncio.run(executor.decide(later))
    assert result.outcome == "executed", result.detail
    assert "kubeflow-resource-stopped" in annotations_of(kube_api, "Notebook", owned.name)


def test_a_notice_the_namespace_forbids_says_so_and_no_reclaim_follows(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """A namespace where RBAC keeps the executor from creating Events (403): the notice is
    audited ``failed`` saying what it costs (no reclaim follows, which grant is missing),
    not only the API's words; the reclaim after it is refused, the notebook keeps running."""
    owned = notebook(kube_api)
    executor = Executor(Settings(), backend, execute=True,
                        remediation=RemediationSettings(enabled_rules={"idle_holder"},
                                                        min_notice_s=None))
    kube_api.fail("POST", status=403, path=f"/namespaces/{NS}/events")
    told = Action(idempotency_key="f1/notify_owner", verb="notify_owner",
                  target=Subject(node="gpu-1", device="GPU-1", pod=PodRef(NS, owned.pod)),
                  reason="idle for 30 min", rule="idle_holder", finding_ids=["f1"],
                  ts=time.time())
    notice = asyncio.run(executor.decide(told))
    assert notice.outcome == "failed"
    assert f"may not create Events in namespace {NS} (403" in notice.detail
    assert "no reclaim of this pod will follow; grant create events" in notice.detail
    refused = asyncio.run(executor.decide(reclaim(owned.pod)))
    assert refused.outcome == "refused" and "the owner was not told first" in refused.detail
    assert "kubeflow-resource-stopped" not in annotations_of(kube_api, "Notebook", owned.name)


@pytest.mark.parametrize("kind", [*sorted(RESTORABLE), "Job", "Workload", "bare"])
def test_keep_until_in_force_leaves_every_owner_kind_alone(
        kind: str, kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    hold = {"gpusteward.io/keep-until": rfc3339(time.time() + 86400)}
    if kind == "Workload":
        pod = _pod("wl-pod", None, {**hold, "kueue.x-k8s.io/workload": "wl-alice"})
        kube_api.create(pod)
        name = "wl-pod"
    elif kind == "bare":
        kube_api.create(_pod("bare-pod", None, hold))
        name = "bare-pod"
    else:
        name = {**RESTORABLE, "Job": job}[kind](kube_api, hold).pod
    before = len(writes(kube_api))
    outcome, detail = act(backend, reclaim(name, delete_bare_pod="true"))
    assert outcome == "refused"
    assert f"left alone until {hold['gpusteward.io/keep-until']}" in detail
    assert len(writes(kube_api)) == before


def test_keep_until_past_or_beyond_the_policy_maximum_does_not_hold(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    past = deployment(kube_api, {"gpusteward.io/keep-until": rfc3339(time.time() - 60)})
    assert act(backend, reclaim(past.pod))[0] == "executed"
    far = statefulset(kube_api, {"gpusteward.io/keep-until": "2099-01-01T00:00:00Z"})
    # Idle for 15 days: the 14-day maximum has run out.
    outcome, detail = act(backend, reclaim(far.pod, idle_since=time.time() - 15 * 86400))
    assert outcome == "executed", detail
    held = job(kube_api, {"gpusteward.io/keep-until": "2099-01-01T00:00:00Z"})
    outcome, detail = act(backend, reclaim(held.pod, idle_since=time.time() - 86400))
    assert outcome == "refused"
    assert f"left alone until {rfc3339(time.time() - 86400 + 1209600)[:13]}" in detail


def test_a_pod_labelled_exempt_after_the_reclaim_was_asked_is_left_alone(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    # The owner did as the idle notice says (the exemption label) while the reclaim was on its
    # way: the live pod is checked against the exemptions the action carries.
    exempt = json.dumps(IdleSettings().exempt_params, sort_keys=True)
    owned = deployment(kube_api)
    kube_api.patch("Pod", owned.pod, {"metadata": {"labels": {"gpusteward.io/idle-exempt":
                                                              "true"}}}, NS)
    before = len(writes(kube_api))
    outcome, detail = act(backend, reclaim(owned.pod, exempt=exempt))
    assert (outcome, detail) == ("refused", f"{NS}/{owned.pod} is exempt from idle detection "
                                 "(label gpusteward.io/idle-exempt=true)")
    assert len(writes(kube_api)) == before
    # Without the label (or with an exemption the policy does not list) it is reclaimed.
    other = statefulset(kube_api, None)
    outcome, _ = act(backend, reclaim(other.pod, exempt=exempt))
    assert outcome == "executed"


def test_a_jobs_pod_is_requeued_as_before(kube_api: KubeApiServer,
                                          backend: KubernetesBackend) -> None:
    owned = job(kube_api)
    outcome, detail = act(backend, reclaim(owned.pod))
    assert outcome == "executed" and "Job train-alice recreates it" in detail
    assert not [p for p in kube_api.objects("Pod") if p["metadata"]["name"] == owned.pod]


@pytest.fixture
def kueue_controller(kube_api: KubeApiServer) -> Iterator[None]:
    """Kueue's part: a deactivated admitted workload is evicted (what the backend waits for)."""
    stop = threading.Event()

    def evict(obj: Obj) -> None:
        obj["status"].pop("admission", None)
        obj["status"]["conditions"] = [{"type": "Evicted", "status": "True",
                                        "reason": "Deactivated"}]

    def run() -> None:
        while not stop.wait(0.02):
            for workload in kube_api.objects("Workload", "kueue.x-k8s.io"):
                if workload["spec"].get("active") is False and workload["status"].get(
                        "admission"):
                    kube_api.mutate("Workload", workload["metadata"]["name"], evict, NS,
                                    "kueue.x-k8s.io")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


def test_a_kueue_workload_is_requeued_as_before(kube_api: KubeApiServer,
                                                backend: KubernetesBackend,
                                                kueue_controller: None) -> None:
    kube_api.create({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
                     "metadata": {"name": "wl-alice", "namespace": NS},
                     "spec": {"active": True, "queueName": "research", "podSets": []},
                     "status": {"admission": {"clusterQueue": "research",
                                              "podSetAssignments": []},
                                "conditions": [{"type": "Admitted", "status": "True"}]}})
    kube_api.create(_pod("wl-pod", None, {"kueue.x-k8s.io/workload": "wl-alice"}))
    outcome, detail = act(backend, reclaim("wl-pod"))
    assert outcome == "executed", detail
    patches = [r.body["spec"]["active"] for r in kube_api.requests
               if r.method == "PATCH" and r.path.endswith("/workloads/wl-alice")]
    assert patches == [False, True]


def test_a_bare_pod_is_deleted_only_when_policy_allows(kube_api: KubeApiServer,
                                                       backend: KubernetesBackend) -> None:
    kube_api.create(_pod("bare-pod", None))
    outcome, detail = act(backend, reclaim("bare-pod"))
    assert outcome == "refused" and "idle_holder.reclaim_bare_pods" in detail
    assert writes(kube_api) == []
    assert act(backend, reclaim("bare-pod", delete_bare_pod="true"))[0] == "executed"
    assert kube_api.objects("Pod") == []


def test_a_pod_recreated_under_its_name_is_not_reclaimed_unannounced(
        kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    """A StatefulSet's pod restarting when the notice is sent, then recreated (a new uid)
    when the reclaim comes: the notice reached no one, so it is not delivered, and the
    reclaim, which names the old pod, is refused by the executor and by the backend."""
    owned = statefulset(kube_api)
    old_uid = kube_api.get("Pod", owned.pod, NS)["metadata"]["uid"]
    kube_api.delete("Pod", owned.pod, NS)
    executor = Executor(Settings(), backend, execute=True,
                        remediation=RemediationSettings(enabled_rules={"idle_holder"}))
    notice = Action(idempotency_key="f1/notify_owner", verb="notify_owner",
                    target=Subject(node="gpu-1", pod=PodRef(NS, owned.pod, uid=old_uid)),
                    reason="idle notice", rule="idle_holder", finding_ids=["f1"],
                    ts=time.time())
    result = asyncio.run(executor.decide(notice))
    assert (result.outcome, result.detail) == (
        "failed", f"pod {NS}/{owned.pod} does not exist: no notice was delivered")
    assert executor.notified == {}

    kube_api.create(_pod(owned.pod, kube_api.get("StatefulSet", owned.name, NS, "apps")))
    new_uid = kube_api.get("Pod", owned.pod, NS)["metadata"]["uid"]
    assert new_uid != old_uid
    result = asyncio.run(executor.decide(reclaim(owned.pod, uid=old_uid)))
    assert result.outcome == "refused" and "owner was not told first" in result.detail
    # The backend refuses it too, whoever asks: the live pod is another one.
    outcome, detail = act(backend, reclaim(owned.pod, uid=old_uid))
    assert (outcome, detail) == ("refused", f"pod {NS}/{owned.pod} was replaced: the live "
                                 f"pod's uid is {new_uid}, the action names {old_uid}")
    stale = asyncio.run(backend.notify_owner(notice))
    assert stale[0] == "refused" and "was replaced" in stale[1]
    assert replicas(kube_api, owned) == 1
    assert kube_api.objects("Event") == []
    # The pod as it is now can be told, then reclaimed.
    told = msgspec.structs.replace(notice, target=Subject(
        node="gpu-1", pod=PodRef(NS, owned.pod, uid=new_uid)))
    assert asyncio.run(executor.decide(told)).outcome == "executed"
    assert act(backend, reclaim(owned.pod, uid=new_uid))[0] == "executed"
    assert replicas(kube_api, owned) == 0


def test_other_owners_are_refused(kube_api: KubeApiServer, backend: KubernetesBackend) -> None:
    lone = kube_api.create(_apps("ReplicaSet", "lone-rs", 1))
    kube_api.create(_pod("lone-rs-abcde", lone))
    outcome, detail = act(backend, reclaim("lone-rs-abcde"))
    assert outcome == "refused" and "no Deployment owns" in detail
    assert writes(kube_api) == []
    assert asyncio.run(backend.restore("Job", NS, "x"))[0] == "refused"
    assert asyncio.run(backend.restore("Deployment", NS, "missing"))[0] == "failed"


# -- RBAC: exactly what these verbs use -------------------------------------------------------

_PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/[^/]+)?"
                   r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")
_VERB = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}


def rbac_triples(api: KubeApiServer) -> set[tuple[str, str, str]]:
    """The (group, resource, verb) each request the backend made needs."""
    used = set()
    for request in api.requests:
        match = _PATH.match(request.path)
        assert match, request.path
        resource = match["plural"] + (f"/{match['sub']}" if match["sub"] else "")
        verb = _VERB.get(request.method) or ("get" if match["name"] else "list")
        used.add((match["group"] or "", resource, verb))
    return used


def granted(path: Path, role: str | None = None) -> set[tuple[str, str, str]]:
    """What the ClusterRoles in ``path`` grant (only the one named ``role``, if given)."""
    return {(group, resource, verb)
            for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "ClusterRole"
            and role in (None, doc["metadata"]["name"])
            for rule in doc["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_the_execute_component_grants_what_reclaim_and_restore_use(
        kube_api: KubeApiServer, backend: KubernetesBackend, kueue_controller: None) -> None:
    for kind, make in RESTORABLE.items():
        owned = make(kube_api)
        assert act(backend, reclaim(owned.pod))[0] == "executed", kind
        assert asyncio.run(backend.restore(owned.kind, NS, owned.name))[0] == "executed"
        kube_api.delete("Pod", owned.pod, NS)
    assert act(backend, reclaim(job(kube_api).pod))[0] == "executed"
    kube_api.create(_pod("bare-pod", None))
    assert act(backend, reclaim("bare-pod", delete_bare_pod="true"))[0] == "executed"
    for kind in SUSPENDABLE_GANGS:  # a whole idle gang suspended, and resumed
        how = SUSPENDABLE_GANGS[kind]
        gang = kube_api.create({"apiVersion": f"{how.group}/{how.versions[0]}", "kind": kind,
                                "metadata": {"name": f"{how.plural}-1", "namespace": NS},
                                "spec": {}})
        kube_api.create(_pod(f"{how.plural}-1-0", gang))
        assert act(backend, reclaim(f"{how.plural}-1-0", gang=f"{kind}/{how.plural}-1"))[
            0] == "executed", kind
        assert asyncio.run(backend.restore(kind, NS, f"{how.plural}-1"))[0] == "executed"
    used = rbac_triples(kube_api)
    execute = granted(REPO / "deploy/components/remediation-execute/rbac.yaml")
    assert used <= execute, used - execute
    # Every grant on the owner kinds is used by these verbs, and only the execute
    # component gives them to the executor: a dry-run executor cannot scale or stop
    # anything (the watcher's read-only grants on gang kinds are its own role's).
    owner_groups = {"apps", "kubeflow.org", "keda.sh", "batch", "jobset.x-k8s.io"}
    assert {t for t in execute if t[0] in owner_groups} == {t for t in used
                                                             if t[0] in owner_groups}
    # The shipped dry run's account holds no role at all.
    assert not granted(REPO / "deploy/base/rbac.yaml", "gpusteward-remediation")
    watcher = granted(REPO / "deploy/base/rbac.yaml", "gpusteward-watcher")
    assert {t[2] for t in watcher if t[0] in owner_groups} <= {"get", "list", "watch"}


# -- the command ------------------------------------------------------------------------------


def test_act_restore_scales_back_and_audits(settings: Settings, kube_api: KubeApiServer,
                                            kubeconfig: Path, backend: KubernetesBackend
                                            ) -> None:
    owned = deployment(kube_api)
    assert act(backend, reclaim(owned.pod))[0] == "executed"
    asyncio.run(kafka.ensure_topics(settings))
    env = {**os.environ, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
           "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers}
    command = [str(GPUSTEWARD), "act", "--backend", "kubernetes", "--kubeconfig",
               str(kubeconfig), "--operator", "alice", "--restore", owned.target]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "EXECUTED: restore Deployment/ml-alice/serve-alice by alice: scaled Deployment " \
           "ml-alice/serve-alice back to 2" in done.stdout
    assert replicas(kube_api, owned) == 2
    records = asyncio.run(kafka.read_all(settings, topics.ACTION_RESULTS.name(settings)))
    (audit,) = [msgspec.json.decode(r.value, type=ActionResult) for r in records]
    assert audit.idempotency_key.startswith("restore/Deployment/ml-alice/serve-alice/")
    assert audit.outcome == "executed" and audit.actor == "alice/kubernetes"
    # The weekly report reads the owner and the operator back from this very record.
    (undone,) = findings.restores(findings.result_frame([audit])).iter_rows(named=True)
    assert (undone["owner"], undone["restored_by"]) == (owned.target, "alice")
    # Again: nothing to restore, said so, exit 1.
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and again.stdout.startswith("REFUSED")
