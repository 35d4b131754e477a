"""``gpusteward doctor`` against the sandbox (passes) and against a broken set-up (names each
fault): the embedded broker, the API-server double answering access reviews, a real HTTP
exporter serving the recorded dcgm-exporter page, a real unix socket, the policy loader."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gpusteward import kafka
from gpusteward.broker import free_port
from gpusteward.cli import app
from gpusteward.cli.doctor import NEEDS, Check, check_kafka, diagnose
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.settings import Settings
from tests.collectors.conftest import RESEARCH, FakeExporter
from tests.collectors.test_dcgm import STOCK_MISSING, with_every_family

ROOT = Path(__file__).resolve().parents[1]
STOCK_PAGE = (RESEARCH / "dcgm_exporter_metrics.txt").read_text()


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
    checks = asyncio.run(diagnose(
        settings, kubeconfig=str(kubeconfig), dcgm_url=full_exporter.url,
        kubelet_socket=kubelet_socket, policy=str(ROOT / "rules" / "policy.yaml")))
    assert failed(checks) == {}
    assert [c.name for c in checks] == [
        "kafka", "kafka topics", "kubernetes", "rbac watcher", "rbac remediation",
        "dcgm-exporter", "kubelet socket", "policy"]
    reviews = [r for r in kube_api.requests if r.path.endswith("selfsubjectaccessreviews")]
    assert len(reviews) == sum(len(needs) for needs in NEEDS.values())


def test_doctor_names_each_fault_of_a_broken_setup(
        settings: Settings, kubeconfig: Path, kube_api: KubeApiServer,
        stock_exporter: FakeExporter, tmp_path: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    wrong = settings.model_copy(update={"kafka": settings.kafka.model_copy(
        update={"bootstrap_servers": nowhere})})
    kube_api.deny("create", "pods/eviction")
    bad_policy = tmp_path / "policy.yaml"
    bad_policy.write_text("rules:\n  idle_holder:\n    window_s: -1\n")
    checks = asyncio.run(diagnose(
        wrong, kubeconfig=str(kubeconfig), dcgm_url=stock_exporter.url,
        kubelet_socket=str(tmp_path / "absent.sock"), policy=str(bad_policy), timeout_s=1))
    faults = failed(checks)
    assert set(faults) == {"kafka", "rbac remediation", "dcgm-exporter", "kubelet socket",
                           "policy"}
    assert f"no broker answers at {nowhere}" in faults["kafka"]
    assert faults["rbac remediation"].startswith("denied: create pods/eviction;")
    assert faults["dcgm-exporter"].startswith("counters off: ")
    for family in STOCK_MISSING:
        assert f"{family} (" in faults["dcgm-exporter"], family
    assert "absent.sock: No such file or directory" in faults["kubelet socket"]
    assert "window_s" in faults["policy"]


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


def test_the_rbac_it_checks_is_what_deploy_grants() -> None:
    roles = {"gpusteward-watcher": "watcher", "gpusteward-remediation": "remediation",
             "gpusteward-remediation-execute": "remediation"}
    granted: dict[str, set[str]] = {"watcher": set(), "remediation": set()}
    for path in (ROOT / "deploy" / "base" / "rbac.yaml",
                 ROOT / "deploy" / "components" / "remediation-execute" / "rbac.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "ClusterRole":
                for rule in doc["rules"]:
                    granted[roles[doc["metadata"]["name"]]] |= {
                        f"{verb} {resource}" + (f".{group}" if group else "")
                        for verb in rule["verbs"] for resource in rule["resources"]
                        for group in rule["apiGroups"]}
    assert {name: {str(p) for p in needs} for name, needs in NEEDS.items()} == granted
