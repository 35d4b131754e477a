"""``gpusteward doctor`` against the sandbox (passes) and against a broken set-up (names each
fault): the embedded broker, the API-server double answering access reviews from the RBAC
of deploy/'s manifests, a real HTTP exporter serving the recorded dcgm-exporter page, a real
unix socket, the policy loader."""

from __future__ import annotations

import asyncio
import copy
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from gpusteward import kafka
from gpusteward.broker import free_port
from gpusteward.cli import app
from gpusteward.cli.doctor import (
    COLLECTOR_NAMESPACE,
    COMPONENTS,
    NAMESPACE,
    Check,
    check_collectors,
    check_kafka,
    check_rbac,
    diagnose,
    kube_client,
    service_account_user,
)
from gpusteward.sandbox.kube_api import ACCESS_REVIEWS, SUBJECT_ACCESS_REVIEWS, KubeApiServer
from gpusteward.settings import Settings
from tests.collectors.conftest import RESEARCH, FakeExporter
from tests.collectors.test_dcgm import STOCK_MISSING, with_every_family
from tests.deploy.conftest import Rendered

ROOT = Path(__file__).resolve().parents[1]
STOCK_PAGE = (RESEARCH / "dcgm_exporter_metrics.txt").read_text()
BASE_RBAC = ROOT / "deploy" / "base" / "rbac.yaml"
EXECUTE_RBAC = ROOT / "deploy" / "components" / "remediation-execute" / "rbac.yaml"
REMEDIATION_USER, _ = service_account_user(NAMESPACE, "gpusteward-remediation")
COLLECTOR_DAEMONSET = next(
    doc for doc in yaml.safe_load_all((ROOT / "deploy" / "base" / "collector-nvml.yaml")
                                      .read_text()) if doc and doc["kind"] == "DaemonSet")


def gpu_node(name: str, gpus: int = 8, labels: dict[str, str] | None = None,
             taints: list[dict[str, str]] | None = None, gfd: bool = True) -> dict[str, Any]:
    """A node as the device plugin and (``gfd``) GPU Feature Discovery leave it."""
    present = {"nvidia.com/gpu.present": "true"} if gpus and gfd else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        **present, **(labels or {})}},
        "spec": {"taints": taints or []},
        "status": {"capacity": {"cpu": "96", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}}}


def collector_pod(node: str, ready: bool = True, waiting: str | None = None
                  ) -> dict[str, Any]:
    """The DaemonSet's pod on ``node``, running (ready or not, ``waiting`` for a reason)."""
    status: dict[str, Any] = {"name": "collector", "ready": ready, "state": (
        {"waiting": {"reason": waiting}} if waiting else {"running": {}})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"gpusteward-collector-{node}", "namespace": COLLECTOR_NAMESPACE,
        "labels": COLLECTOR_DAEMONSET["spec"]["template"]["metadata"]["labels"]},
        "spec": {"nodeName": node}, "status": {"phase": "Running",
                                               "containerStatuses": [status]}}


def grant_as_deployed(api: KubeApiServer, *manifests: Path,
                      leave_out: Iterable[tuple[str, str, str]] = ()) -> None:
    """Let the double's SubjectAccessReviews answer what these RBAC manifests bind to each
    service account, less ``leave_out`` ((group, resource, verb))."""
    objects = [doc for path in manifests for doc in yaml.safe_load_all(path.read_text()) if doc]
    for account, granted in Rendered("manifests", objects).grants().items():
        user, _ = service_account_user(NAMESPACE, account)
        for group, resource, verb in granted - set(leave_out):
            api.grant(user, verb, resource, group)


def subject_reviews(api: KubeApiServer) -> list[dict[str, Any]]:
    return [r.body["spec"] for r in api.requests if r.path == SUBJECT_ACCESS_REVIEWS]


@pytest.fixture
def kubelet_socket(tmp_path: Path) -> Iterator[str]:
    """A listening unix socket where the kubelet's PodResources socket would be."""
    path = tmp_path / "kubelet.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()
        yield str(path)


def exporter(page: str) -> Iterator[FakeExporter]:
    served = FakeExporter(page).start()
    yield served
    served.stop()


@pytest.fixture
def full_exporter() -> Iterator[FakeExporter]:
    yield from exporter(with_every_family(STOCK_PAGE))


@pytest.fixture
def stock_exporter() -> Iterator[FakeExporter]:
    yield from exporter(STOCK_PAGE)


def failed(checks: list[Check]) -> dict[str, str]:
    return {c.name: c.detail for c in checks if not c.ok}


def test_doctor_passes_against_the_sandbox(
        settings: Settings, kubeconfig: Path, kube_api: KubeApiServer,
        full_exporter: FakeExporter, kubelet_socket: str) -> None:
    before = asyncio.run(check_kafka(settings, 5))
    assert before[0].ok and before[1].name == "kafka topics" and not before[1].ok
    assert f"{settings.topic_prefix}.findings" in before[1].detail
    asyncio.run(kafka.ensure_topics(settings))
    grant_as_deployed(kube_api, BASE_RBAC)
    kube_api.load([gpu_node("gpu-1"), gpu_node("gpu-2"), gpu_node("cpu-1", gpus=0),
                   COLLECTOR_DAEMONSET, collector_pod("gpu-1"), collector_pod("gpu-2")])
    checks = asyncio.run(diagnose(
        settings, kubeconfig=str(kubeconfig), dcgm_url=full_exporter.url,
        kubelet_socket=kubelet_socket, policy=str(ROOT / "rules" / "policy.yaml")))
    assert failed(checks) == {}
    dcgm_check = next(c for c in checks if c.name == "dcgm-exporter")
    assert "gpu_recovery_action needs the NVML collector" in dcgm_check.detail, \
        "no DCGM field feeds it: the check must not claim it is covered"
    assert [c.name for c in checks] == [
        "kafka", "kafka topics", "kafka segments", "kubernetes", "rbac watcher", "rbac remediation",
        "collectors", "dcgm-exporter", "kubelet socket", "policy"]
    assert checks[6].detail == "a collector is ready on each of the 2 GPU nodes"
    # Asked about each component's account (with the groups its token carries), never
    # about the caller.
    asked = subject_reviews(kube_api)
    dry_run = COMPONENTS["remediation"]
    assert not dry_run.needs and dry_run.must_lack
    assert len(asked) == len(COMPONENTS["watcher"].needs) + len(dry_run.must_lack)
    remediation = next(c for c in checks if c.name == "rbac remediation")
    assert remediation.detail == (f"none of the {len(dry_run.must_lack)} verbs that change "
                                  f"the cluster allowed to {REMEDIATION_USER}")
    assert {(spec["user"], tuple(spec["groups"])) for spec in asked} == {
        (f"system:serviceaccount:gpusteward:gpusteward-{name}",
         ("system:serviceaccounts", "system:serviceaccounts:gpusteward"))
        for name in ("watcher", "remediation")}
    assert not [r for r in kube_api.requests if r.path == ACCESS_REVIEWS]


def test_compacted_topics_an_earlier_release_created_are_named_with_the_fix(
        settings: Settings) -> None:
    """Kafka never compacts the active segment, 7 days or 1 GiB of it by default: a worker's
    restart replays all of it. Releases before 2026-11-28 created their topics so. Another
    pipeline's changelogs on the cluster (a prefix that starts with this one's) are its own
    business, not named."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from gpusteward import topics

    async def created_as_before() -> None:
        admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
        await admin.start()
        try:
            await admin.create_topics([NewTopic(
                name, 1, 1, topic_configs={"cleanup.policy": "compact"}) for name in (
                    topics.ALLOCATIONS.name(settings),
                    f"{settings.topic_prefix}-worker-node-state-changelog",
                    f"{settings.topic_prefix}x-worker-node-state-changelog")])
        finally:
            await admin.close()

    asyncio.run(created_as_before())
    asyncio.run(kafka.ensure_topics(settings))  # the others, as this release does
    segments = asyncio.run(check_kafka(settings, 5))[2]
    assert segments.name == "kafka segments" and not segments.ok
    named = segments.detail.split(" keep a segment")[0].split(", ")
    assert sorted(named) == sorted([topics.ALLOCATIONS.name(settings),
                                    f"{settings.topic_prefix}-worker-node-state-changelog"])
    assert "--add-config segment.ms=600000,segment.bytes=67108864" in segments.detail


def test_doctor_names_each_fault_of_a_broken_setup(
        settings: Settings, kubeconfig: Path, kube_api: KubeApiServer,
        stock_exporter: FakeExporter, tmp_path: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    wrong = settings.model_copy(update={"kafka": settings.kafka.model_copy(
        update={"bootstrap_servers": nowhere})})
    grant_as_deployed(kube_api, BASE_RBAC, leave_out={("", "pods", "watch")})
    # The dry run's account bound to a role that lets it cordon (as deploy/ once shipped).
    kube_api.grant(REMEDIATION_USER, "patch", "nodes")
    bad_policy = tmp_path / "policy.yaml"
    bad_policy.write_text("rules:\n  idle_holder:\n    window_s: -1\n")
    checks = asyncio.run(diagnose(
        wrong, kubeconfig=str(kubeconfig), dcgm_url=stock_exporter.url,
        kubelet_socket=str(tmp_path / "absent.sock"), policy=str(bad_policy), timeout_s=1))
    faults = failed(checks)
    assert set(faults) == {"kafka", "rbac watcher", "rbac remediation", "dcgm-exporter",
                           "kubelet socket", "policy"}
    assert f"no broker answers at {nowhere}" in faults["kafka"]
    assert faults["rbac watcher"] == (
        "denied to system:serviceaccount:gpusteward:gpusteward-watcher: watch pods; grant "
        "them to gpusteward-watcher in gpusteward (deploy/base/rbac.yaml)")
    assert faults["rbac remediation"].startswith(
        f"allowed to {REMEDIATION_USER}, and must not be: patch nodes; a dry run calls no "
        "Kubernetes API, and an account that may change the cluster leaves the dry run to a "
        "flag; remove the binding")
    assert faults["dcgm-exporter"].startswith("counters off: ")
    for family in STOCK_MISSING:
        assert f"{family} (" in faults["dcgm-exporter"], family
    assert "absent.sock: No such file or directory" in faults["kubelet socket"]
    assert "window_s" in faults["policy"]


def test_the_service_accounts_permissions_decide_not_the_callers(
        kubeconfig: Path, kube_api: KubeApiServer) -> None:
    client = kube_client(str(kubeconfig))
    # A caller allowed everything (an admin's laptop) learns what the account lacks.
    grant_as_deployed(kube_api, BASE_RBAC, EXECUTE_RBAC,
                      leave_out={("kueue.x-k8s.io", "workloads", "patch")})
    lacking = check_rbac(client, "remediation-execute", 5)
    assert not lacking.ok
    assert lacking.detail.startswith(f"denied to {REMEDIATION_USER}: patch "
                                     "workloads.kueue.x-k8s.io;")
    # A caller denied everything still sees the account's grants.
    for need in COMPONENTS["watcher"].needs:
        kube_api.deny(need.verb, need.resource, need.group)
    watcher = check_rbac(client, "watcher", 5)
    assert watcher.ok, watcher.detail
    assert watcher.detail == (f"all {len(COMPONENTS['watcher'].needs)} verbs allowed to "
                              "system:serviceaccount:gpusteward:gpusteward-watcher")


def test_the_shipped_dry_run_lacks_what_acting_needs(
        kubeconfig: Path, kube_api: KubeApiServer) -> None:
    client = kube_client(str(kubeconfig))
    grant_as_deployed(kube_api, BASE_RBAC)
    assert check_rbac(client, "remediation", 5).ok
    execute = check_rbac(client, "remediation-execute", 5)
    assert not execute.ok
    denied = execute.detail.split(": ", 1)[1].split("; ")[0].split(", ")
    # The base grants the dry run's account nothing, not even a cordon.
    assert denied == [str(p) for p in COMPONENTS["remediation-execute"].needs]
    assert denied[:3] == ["patch nodes", "create pods/eviction",
                          "patch workloads.kueue.x-k8s.io"]
    assert execute.detail.endswith("(deploy/components/remediation-execute)")
    grant_as_deployed(kube_api, BASE_RBAC, EXECUTE_RBAC)
    assert check_rbac(client, "remediation-execute", 5).ok
    # Once it may act, the same account is no dry run any more, and doctor says so.
    dry_run = check_rbac(client, "remediation", 5)
    assert not dry_run.ok
    assert dry_run.detail.startswith(f"allowed to {REMEDIATION_USER}, and must not be: patch "
                                     "nodes, create pods/eviction, ")
    assert dry_run.detail.endswith("check --component remediation-execute")


def test_a_caller_that_may_not_ask_about_others_is_told_it_checked_itself(
        kubeconfig: Path, kube_api: KubeApiServer) -> None:
    """In the component's own pod: its account may not create SubjectAccessReviews, so doctor
    says so and checks the caller (that account) by SelfSubjectAccessReview."""
    kube_api.deny("create", "subjectaccessreviews", "authorization.k8s.io")
    kube_api.deny("create", "pods/eviction")
    client = kube_client(str(kubeconfig))
    said = (f"you may not create subjectaccessreviews.authorization.k8s.io to ask about "
            f"{REMEDIATION_USER}, so this checked your own permissions "
            "(SelfSubjectAccessReview), which are its only when run as it: ")
    remediation = check_rbac(client, "remediation", 5)
    assert not remediation.ok
    assert remediation.detail.startswith(
        f"{said}allowed to you, and must not be: patch nodes, patch workloads.kueue.x-k8s.io, ")
    kube_api.requests.clear()
    execute = check_rbac(client, "remediation-execute", 5)
    assert not execute.ok and "denied to you: create pods/eviction; " in execute.detail
    reviews = [r for r in kube_api.requests if r.path == ACCESS_REVIEWS]
    assert len(reviews) == len(COMPONENTS["remediation-execute"].needs)
    watcher = check_rbac(client, "watcher", 5)
    assert watcher.ok and watcher.detail.endswith("verbs allowed to you")


def test_the_command_checks_the_accounts_of_the_namespace_given(
        kubeconfig: Path, kube_api: KubeApiServer) -> None:
    result = CliRunner().invoke(app, [
        "doctor", "--skip", "kafka", "--skip", "policy", "--kubeconfig", str(kubeconfig),
        "--namespace", "team-gpu", "--component", "remediation-execute"])
    assert result.exit_code == 1, result.output
    assert ("FAIL  rbac remediation-execute: denied to "
            "system:serviceaccount:team-gpu:gpusteward-remediation: patch nodes, ") in (
                result.output)
    assert "grant them to gpusteward-remediation in team-gpu" in result.output
    assert {tuple(spec["groups"]) for spec in subject_reviews(kube_api)} == {
        ("system:serviceaccounts", "system:serviceaccounts:team-gpu")}
    unknown = CliRunner().invoke(app, ["doctor", "--component", "remediation-dry-run"])
    assert unknown.exit_code == 2
    said = " ".join(unknown.output.replace("│", " ").split())  # unwrapped from its box
    assert ("unknown: remediation-dry-run (components: watcher, remediation, "
            "remediation-execute;") in said


def test_the_command_exits_non_zero_and_says_what_to_fix(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, [
        "doctor", "--bootstrap", f"127.0.0.1:{free_port()}", "--skip", "kube",
        "--kubelet-socket", str(tmp_path / "absent.sock"), "--timeout", "1"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("FAIL  kafka: no broker answers at 127.0.0.1:")
    assert lines[1].startswith("FAIL  kubelet socket: ")
    assert lines[2] == "ok    policy: no file named: the defaults"
    assert "2 fault(s): kafka, kubelet socket" in result.output


def test_a_kubeconfig_that_is_not_there_is_named(tmp_path: Path) -> None:
    """A mistyped path, or a kubeconfig volume not mounted: the client reads a missing file as
    an empty configuration ("No configuration found"), so doctor names the file itself."""
    missing = tmp_path / "kubeconfig"
    result = CliRunner().invoke(app, ["doctor", "--skip", "kafka", "--skip", "policy"],
                                env={"GPUSTEWARD_KUBE__KUBECONFIG": str(missing)})
    assert result.exit_code == 1, result.output
    assert result.output.splitlines()[0] == (
        f"FAIL  kubernetes: cannot load the Kubernetes configuration from {missing} (no such "
        "file); correct --kubeconfig or GPUSTEWARD_KUBE__KUBECONFIG")


def test_gpu_nodes_without_a_ready_collector_are_named_with_why(
        kubeconfig: Path, kube_api: KubeApiServer) -> None:
    """A GPU node no collector runs on sends no sample: every rule is blind to it. Doctor
    names each, with what keeps the shipped DaemonSet's pod off it or what its pod is
    doing; a cordoned node and the GPU Operator's taint are no fault (the DaemonSet
    controller and the manifest tolerate them)."""
    client = kube_client(str(kubeconfig))
    empty = check_collectors(client, 5)
    assert empty.ok and empty.detail.endswith("nothing to collect yet")
    kube_api.load([
        gpu_node("ok-1"), collector_pod("ok-1"),
        gpu_node("cordoned", taints=[{"key": "node.kubernetes.io/unschedulable",
                                       "effect": "NoSchedule"}]), collector_pod("cordoned"),
        gpu_node("operator-taint", taints=[{"key": "nvidia.com/gpu", "value": "present",
                                             "effect": "NoSchedule"}]),
        collector_pod("operator-taint"),
        # A device plugin without GPU Feature Discovery (GKE's, EKS's plain plugin).
        gpu_node("gke-1", labels={"cloud.google.com/gke-accelerator": "nvidia-l4"}, gfd=False),
        gpu_node("dedicated", taints=[{"key": "dedicated", "value": "ml",
                                       "effect": "NoSchedule"}]),
        gpu_node("crashing"), collector_pod("crashing", ready=False,
                                            waiting="CrashLoopBackOff"),
        gpu_node("cpu-1", gpus=0)])
    absent = check_collectors(client, 5)
    assert not absent.ok and absent.detail.startswith(
        f"no collector DaemonSet in {COLLECTOR_NAMESPACE} (labels ")
    assert "for the 6 GPU nodes" in absent.detail and "--skip collectors" in absent.detail

    kube_api.load(COLLECTOR_DAEMONSET)
    found = check_collectors(client, 5)
    assert not found.ok
    assert found.detail == (
        "3 of 6 GPU nodes run no ready collector, so no rule sees their GPUs: "
        "crashing (pod gpusteward-collector-crashing Running/CrashLoopBackOff); "
        "dedicated (taint dedicated=ml:NoSchedule not tolerated by the DaemonSet); "
        "gke-1 (lacks the label nvidia.com/gpu.present=true the DaemonSet selects). Fix the "
        "DaemonSet's nodeSelector or tolerations (a patch of deploy/base/collector-nvml.yaml), "
        "or the pod (its logs)")

    result = CliRunner().invoke(app, [
        "doctor", "--skip", "kafka", "--skip", "policy", "--kubeconfig", str(kubeconfig)])
    assert "FAIL  collectors: 3 of 6 GPU nodes run no ready collector" in result.output
    skipped = CliRunner().invoke(app, [
        "doctor", "--skip", "kafka", "--skip", "policy", "--skip", "collectors",
        "--kubeconfig", str(kubeconfig)])
    assert "collectors" not in skipped.output


def test_each_collector_daemonset_is_asked_why_a_node_has_none(
        kubeconfig: Path, kube_api: KubeApiServer) -> None:
    """A fleet may run a collector DaemonSet per node pool (a second for dedicated H100s, its
    own selector and tolerations). A node is explained by all of them: one that would place
    a pod there means no pod yet, not the first DaemonSet's taint or label."""
    h100 = copy.deepcopy(COLLECTOR_DAEMONSET)
    h100["metadata"]["name"] = "gpusteward-collector-h100"
    h100["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "h100"}
    h100["spec"]["template"]["spec"]["tolerations"] = [{"key": "dedicated",
                                                        "operator": "Exists"}]
    dedicated = [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]
    kube_api.load([COLLECTOR_DAEMONSET, h100,
                   gpu_node("ml-1", taints=dedicated),
                   gpu_node("h100-1", labels={"pool": "h100"}, taints=dedicated)])
    found = check_collectors(kube_client(str(kubeconfig)), 5)
    assert found.detail.startswith(
        "2 of 2 GPU nodes run no ready collector, so no rule sees their GPUs: "
        "h100-1 (no pod yet (a rollout under way, or node affinity)); "
        "ml-1 (taint dedicated=ml:NoSchedule not tolerated by DaemonSet "
        "gpusteward-collector; lacks the label pool=h100 DaemonSet gpusteward-collector-h100 "
        "selects). "), found.detail
