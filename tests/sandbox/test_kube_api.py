"""The API-server double, driven through the official client the way the remediation code will."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from gpusteward.sandbox.kube_api import KubeApiServer, kueue_deactivation
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, workload
from tests.collectors.kubernetes.conftest import FIXTURES


@pytest.fixture
def api_client(kube_api: KubeApiServer, kubeconfig: Path) -> client.ApiClient:
    kube_api.load_dir(FIXTURES)
    return config.new_client_from_config(config_file=str(kubeconfig))


def test_eviction_respects_pod_disruption_budgets(kube_api: KubeApiServer,
                                                  api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name="llm-api-6d9f7c8b5d-q7w2x",
                                                          namespace="serving"))
    with pytest.raises(ApiException) as blocked:
        core.create_namespaced_pod_eviction("llm-api-6d9f7c8b5d-q7w2x", "serving", body)
    assert blocked.value.status == 429
    assert "disruption budget" in json.loads(blocked.value.body or "{}")["message"]
    assert kube_api.get("Pod", "llm-api-6d9f7c8b5d-q7w2x", "serving")

    kube_api.patch("PodDisruptionBudget", "llm-api", {"status": {"disruptionsAllowed": 1}},
                   namespace="serving", group="policy")
    core.create_namespaced_pod_eviction("llm-api-6d9f7c8b5d-q7w2x", "serving", body)
    with pytest.raises(KeyError):
        kube_api.get("Pod", "llm-api-6d9f7c8b5d-q7w2x", "serving")
    pdb = kube_api.get("PodDisruptionBudget", "llm-api", "serving", group="policy")
    assert pdb["status"]["disruptionsAllowed"] == 0

    # A pod no budget selects is evicted at once; an unknown pod is 404.
    core.create_namespaced_pod_eviction("alice-nb-0", "team-b", client.V1Eviction(
        metadata=client.V1ObjectMeta(name="alice-nb-0", namespace="team-b")))
    with pytest.raises(ApiException) as missing:
        core.create_namespaced_pod_eviction("alice-nb-0", "team-b", body)
    assert missing.value.status == 404
    evictions = [r for r in kube_api.requests if r.path.endswith("/eviction")]
    assert [r.status for r in evictions] == [429, 201, 201, 404]


def test_two_budgets_selecting_a_pod_is_a_server_error(kube_api: KubeApiServer,
                                                       api_client: client.ApiClient) -> None:
    second = kube_api.get("PodDisruptionBudget", "llm-api", "serving", group="policy")
    second["metadata"] = {"name": "llm-api-2", "namespace": "serving"}
    kube_api.create(second)
    with pytest.raises(ApiException) as error:
        core: Any = client.CoreV1Api(api_client)
        # A plain dict body, as some callers send it.
        core.create_namespaced_pod_eviction("llm-api-6d9f7c8b5d-q7w2x", "serving", {
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": "llm-api-6d9f7c8b5d-q7w2x", "namespace": "serving"}})
    assert error.value.status == 500


def test_node_patches_cordon_label_and_taint(kube_api: KubeApiServer,
                                             api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)
    core.patch_node("a100-spot-1", {"spec": {"unschedulable": True}})
    node = kube_api.get("Node", "a100-spot-1")
    assert node["spec"]["unschedulable"] is True
    assert {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}.items() <= \
        node["spec"]["taints"][0].items()

    taint = {"key": "gpusteward.io/ecc-dbe", "value": "GPU-1", "effect": "NoSchedule"}
    core.patch_node("a100-spot-1", [{"op": "add", "path": "/spec/taints/-", "value": taint}])
    core.patch_node("a100-spot-1", {"metadata": {"labels": {
        "nvidia.com/mig.config": "all-1g.10gb", "karpenter.sh/nodepool": None}}},
        _content_type="application/merge-patch+json")
    node = kube_api.get("Node", "a100-spot-1")
    assert [t["key"] for t in node["spec"]["taints"]] == [
        "node.kubernetes.io/unschedulable", "gpusteward.io/ecc-dbe"]
    assert node["metadata"]["labels"]["nvidia.com/mig.config"] == "all-1g.10gb"
    assert "karpenter.sh/nodepool" not in node["metadata"]["labels"]

    core.patch_node("a100-spot-1", {"spec": {"unschedulable": False}})
    node = kube_api.get("Node", "a100-spot-1")
    assert [t["key"] for t in node["spec"]["taints"]] == ["gpusteward.io/ecc-dbe"]
    content_types = [r.content_type for r in kube_api.requests if r.method == "PATCH"]
    assert content_types == ["application/strategic-merge-patch+json",
                             "application/json-patch+json", "application/merge-patch+json",
                             "application/strategic-merge-patch+json"]


def test_stale_resource_version_conflicts(kube_api: KubeApiServer,
                                          api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)
    node = core.read_node("cpu-1")
    kube_api.patch("Node", "cpu-1", {"metadata": {"labels": {"touched": "yes"}}})
    node.spec.unschedulable = True
    with pytest.raises(ApiException) as conflict:
        core.replace_node("cpu-1", node)
    assert conflict.value.status == 409
    fresh = core.read_node("cpu-1")
    fresh.spec.unschedulable = True
    assert core.replace_node("cpu-1", fresh).spec.unschedulable is True


def test_kueue_workload_deactivation_and_events(kube_api: KubeApiServer,
                                                api_client: client.ApiClient) -> None:
    custom: Any = client.CustomObjectsApi(api_client)
    custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "team-a", "workloads",
                                          "job-train-llm-9a8b7", {"spec": {"active": False}})
    assert kube_api.get("Workload", "job-train-llm-9a8b7", "team-a",
                        group="kueue.x-k8s.io")["spec"]["active"] is False
    served_v1beta1 = custom.get_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta1", "team-a", "workloads", "job-train-llm-9a8b7")
    assert (served_v1beta1["apiVersion"], served_v1beta1["spec"]["active"]) == (
        "kueue.x-k8s.io/v1beta1", False)

    core: Any = client.CoreV1Api(api_client)
    core.create_namespaced_event("team-a", client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="gpusteward-"),
        involved_object=client.V1ObjectReference(kind="Workload", name="job-train-llm-9a8b7",
                                                  namespace="team-a"),
        reason="Requeued", message="requeued by gpusteward: spot node interrupted",
        type="Normal"))
    events = kube_api.objects("Event")
    assert [(e["reason"], e["involvedObject"]["name"]) for e in events] == [
        ("Requeued", "job-train-llm-9a8b7")]
    assert events[0]["metadata"]["name"].startswith("gpusteward-")


def test_delete_pod_and_missing_objects(kube_api: KubeApiServer,
                                        api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)
    core.delete_namespaced_pod("alice-nb-0", "team-b")
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("alice-nb-0", "team-b")
    assert missing.value.status == 404


def test_paged_list_with_selectors(kube_api: KubeApiServer,
                                   api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)
    first = core.list_pod_for_all_namespaces(limit=3)
    assert len(first.items) == 3 and first.metadata._continue
    rest = core.list_pod_for_all_namespaces(limit=100, _continue=first.metadata._continue)
    assert len(first.items) + len(rest.items) == 8
    assert first.metadata.resource_version == rest.metadata.resource_version
    on_node = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=a100-mixed-1")
    assert sorted(p.metadata.name for p in on_node.items) == [
        "alice-nb-0", "pretrain-workers-0-0-xk2l9",
        "rayjob-sweep-raycluster-7x2k-gpu-group-worker-4hf8s"]
    unscheduled = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=")
    assert [p.metadata.name for p in unscheduled.items] == ["eval-1-qq8zt"]
    labelled = core.list_pod_for_all_namespaces(label_selector="kueue.x-k8s.io/queue-name,"
                                                "job-name!=train-llm")
    assert [p.metadata.name for p in labelled.items] == ["eval-1-qq8zt"]

    kube_api.compact()
    page = core.list_pod_for_all_namespaces(limit=2)
    kube_api.compact()
    with pytest.raises(ApiException) as expired:
        core.list_pod_for_all_namespaces(limit=2, _continue=page.metadata._continue)
    assert expired.value.status == 410


def test_watch_protocol(kube_api: KubeApiServer, api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)

    def watch(rv: str, timeout: int = 1) -> list[dict[str, object]]:
        response = core.list_node(watch=True, resource_version=rv, timeout_seconds=timeout,
                                  allow_watch_bookmarks=True, _preload_content=False)
        return [json.loads(line) for line in response.data.splitlines() if line.strip()]

    listed = core.list_node().metadata.resource_version
    kube_api.create(gpu_node("new-node"))
    kube_api.delete("Node", "cpu-1")
    events = watch(listed)
    kinds = [(e["type"], e["object"]["metadata"].get("name")) for e in events]  # type: ignore[index]
    assert kinds[:2] == [("ADDED", "new-node"), ("DELETED", "cpu-1")]
    assert {k for k, _ in kinds[2:]} <= {"BOOKMARK"}
    # Without a resourceVersion a watch starts with the current state.
    assert {e["object"]["metadata"]["name"] for e in watch("0")  # type: ignore[index]
            if e["type"] == "ADDED"} >= {"new-node", "a100-spot-1"}
    kube_api.compact()
    gone = watch(listed)
    assert gone[0]["type"] == "ERROR" and gone[0]["object"]["code"] == 410  # type: ignore[index]


def test_kueue_absent_is_404(tmp_path: Path) -> None:
    with KubeApiServer(kueue=False) as api:
        api.create(gpu_pod("p"))
        api_client = config.new_client_from_config(
            config_file=str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        custom: Any = client.CustomObjectsApi(api_client)
        with pytest.raises(ApiException) as missing:
            custom.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloads")
        assert missing.value.status == 404
        groups = client.ApisApi(api_client).get_api_versions()
        assert "kueue.x-k8s.io" not in {g.name for g in groups.groups}
        with pytest.raises(ValueError):
            api.create(workload("w") | {"apiVersion": "example.com/v1"})


def test_open_watch_behind_a_compaction_ends_with_410(kube_api: KubeApiServer,
                                                      api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)
    response = core.list_node(watch=True, resource_version=str(kube_api.resource_version),
                              timeout_seconds=10, _preload_content=False)
    with kube_api._cond:  # the change and the compaction before the watch can send it
        kube_api.create(gpu_node("missed"))
        kube_api.compact()
    events = [json.loads(line) for line in response.data.splitlines() if line.strip()]
    assert [(e["type"], e["object"].get("code")) for e in events] == [("ERROR", 410)]


def test_injected_failures_answer_the_next_calls_then_serve_again(
        kube_api: KubeApiServer, api_client: client.ApiClient) -> None:
    core: Any = client.CoreV1Api(api_client)
    fault = kube_api.fail("PATCH", 2, status=429, retry_after=3, path="/nodes/cpu-1$")
    kube_api.fail("GET", status=503)
    with pytest.raises(ApiException) as unavailable:
        core.read_node("cpu-1")
    assert unavailable.value.status == 503
    for _ in range(2):
        with pytest.raises(ApiException) as throttled:
            core.patch_node("cpu-1", {"spec": {"unschedulable": True}})
        assert throttled.value.status == 429
        assert (throttled.value.headers or {})["Retry-After"] == "3"
    assert fault.remaining == 0
    assert kube_api.get("Node", "cpu-1")["spec"].get("unschedulable") is None  # not served
    core.patch_node("cpu-1", {"spec": {"unschedulable": True}})
    assert core.read_node("cpu-1").spec.unschedulable is True


def test_a_hung_request_times_out_in_the_client_and_changes_nothing(
        kube_api: KubeApiServer, api_client: client.ApiClient) -> None:
    from urllib3.exceptions import ReadTimeoutError

    core: Any = client.CoreV1Api(api_client)
    kube_api.fail("PATCH", hang_s=2.0)
    with pytest.raises(ReadTimeoutError):
        core.patch_node("cpu-1", {"spec": {"unschedulable": True}}, _request_timeout=0.2)
    assert kube_api.get("Node", "cpu-1")["spec"].get("unschedulable") is None


def test_the_kueue_controller_hook_evicts_a_deactivated_workload(
        kube_api: KubeApiServer, api_client: client.ApiClient) -> None:
    custom: Any = client.CustomObjectsApi(api_client)

    def admitted(name: str) -> dict[str, Any]:
        return workload(name) | {"status": {
            "admission": {"clusterQueue": "research"},
            "conditions": [{"type": "Admitted", "status": "True", "reason": "Admitted"}]}}

    def set_active(name: str, active: bool) -> dict[str, Any]:
        custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", "team-a",
                                              "workloads", name, {"spec": {"active": active}})
        return kube_api.get("Workload", name, "team-a", group="kueue.x-k8s.io")

    # Without the hook nothing reacts: the workload stays admitted while inactive.
    kube_api.create(admitted("wl-0"))
    assert set_active("wl-0", False)["status"]["admission"] == {"clusterQueue": "research"}

    kube_api.add_controller("Workload", kueue_deactivation, group="kueue.x-k8s.io")
    kube_api.create(admitted("wl-1"))
    evicted = set_active("wl-1", False)
    assert "admission" not in evicted["status"]
    assert [(c["type"], c["reason"]) for c in evicted["status"]["conditions"]] == [
        ("Evicted", "Deactivated")]
    requeued = set_active("wl-1", True)
    assert [(c["type"], c["reason"]) for c in requeued["status"]["conditions"]] == [
        ("Requeued", "Reactivated")]


def test_subject_access_reviews_answer_from_the_granted_table(
        kube_api: KubeApiServer, api_client: client.ApiClient) -> None:
    authz: Any = client.AuthorizationV1Api(api_client)

    def allowed(user: str, groups: list[str], verb: str, resource: str,
                subresource: str | None = None) -> bool:
        review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=user, groups=groups, resource_attributes=client.V1ResourceAttributes(
                verb=verb, resource=resource, group="", subresource=subresource)))
        return bool(authz.create_subject_access_review(review).status.allowed)

    account = "system:serviceaccount:gpusteward:gpusteward-remediation"
    kube_api.grant(account, "create", "pods/eviction")
    kube_api.grant("system:serviceaccounts:ops", "list", "nodes")
    assert allowed(account, [], "create", "pods", "eviction")
    assert not allowed(account, [], "delete", "pods")  # nothing granted is denied
    assert not allowed("someone-else", [], "create", "pods", "eviction")
    assert allowed("system:serviceaccount:ops:any", ["system:serviceaccounts:ops"],
                   "list", "nodes")  # through a group
    # The caller's own reviews are a separate table.
    kube_api.deny("create", "pods/eviction")
    assert allowed(account, [], "create", "pods", "eviction")
    kube_api.deny("create", "subjectaccessreviews", "authorization.k8s.io")
    with pytest.raises(ApiException) as forbidden:
        allowed(account, [], "create", "pods", "eviction")
    assert forbidden.value.status == 403
