"""Every policy and setting that deploy/ (and docker-compose.yml) hands a process loads.

A process reads two kinds of configuration: the rule policy file
(``GPUSTEWARD_POLICY_FILE``, checked with the real ``gpusteward rules check``)
and ``GPUSTEWARD_*`` environment variables, read by pydantic settings models
with ``extra="ignore"`` and by typer options. Ignoring unknown variables keeps
one ConfigMap shareable between components, but it also means a misspelt or
renamed variable is silently dropped: test_environment.py checks that every
name is read by the process it is given to; here each model must validate the
values.

The deployed policy is the shipped ``rules/policy.yaml``, byte for byte:
kustomize reads no file outside its root, so deploy/base holds a copy, and
this is the test that keeps it one source.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings
from typer.testing import CliRunner

from gpusteward.cli import app
from gpusteward.streams.policy_file import POLICY_ENV
from tests.deploy.conftest import DEPLOY, REPO, Rendered
from tests.deploy.reads import READS, Model

pytestmark = pytest.mark.deploy

SHIPPED_POLICY = REPO / "rules" / "policy.yaml"
DEPLOYED_POLICY = DEPLOY / "base" / "policy.yaml"
COMPOSE = REPO / "docker-compose.yml"

SETTINGS_MODELS: tuple[type[BaseSettings], ...] = tuple(dict.fromkeys(
    read.settings for reads in READS.values() for read in reads if isinstance(read, Model)))
"""Every settings model a gpusteward process reads from the environment."""


def load_every_model(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Validate ``env`` with every settings model, as a process started with it would."""
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("GPUSTEWARD_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        for model in SETTINGS_MODELS:
            model()


def rules_check(text: str, path: Path) -> tuple[int, str]:
    """``gpusteward rules check`` on ``text`` written to ``path``: (exit code, output)."""
    path.write_text(text)
    result = CliRunner().invoke(app, ["rules", "check", str(path)])
    return result.exit_code, result.output


# -- the deployed policy ---------------------------------------------------------------


def test_deployed_policy_is_the_shipped_policy():
    assert DEPLOYED_POLICY.read_text() == SHIPPED_POLICY.read_text(), (
        "deploy/base/policy.yaml differs from rules/policy.yaml: "
        "cp rules/policy.yaml deploy/base/policy.yaml")


def _mounted_policies(rendered: Rendered) -> Iterator[tuple[str, str]]:
    """(where, text) of the policy file every gpusteward container is pointed at."""
    for workload in rendered.workloads():
        pod = rendered.pod_spec(workload)
        for container in pod["containers"]:
            env = container_env(rendered, workload, container)
            if POLICY_ENV not in env:
                continue  # reads no policy (tests/deploy/test_environment.py)
            (mount,) = [m for m in container.get("volumeMounts", [])
                        if m["mountPath"] == env[POLICY_ENV]]
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            data = rendered.config_map(workload, volume["configMap"]["name"])["data"]
            yield f"{workload['metadata']['name']}/{container['name']}", data[mount["subPath"]]


def test_every_mounted_policy_is_the_shipped_policy_and_loads(rendered, tmp_path):
    mounted = dict(_mounted_policies(rendered))
    # The processes that read the policy, and no other.
    assert {w.split("/")[0] for w in mounted} == {
        "gpusteward-worker", "gpusteward-rollup-sink", "gpusteward-report"}
    for where, text in mounted.items():
        assert text == SHIPPED_POLICY.read_text(), f"{rendered.variant}: {where}"
        code, output = rules_check(text, tmp_path / "policy.yaml")
        assert code == 0, f"{rendered.variant}: {where}: {output}"


def test_every_policy_file_under_deploy_loads(tmp_path):
    files = sorted(DEPLOY.rglob("*policy*.yaml"))
    assert DEPLOYED_POLICY in files
    for path in files:
        code, output = rules_check(path.read_text(), tmp_path / path.name)
        assert code == 0, f"{path.relative_to(REPO)}: {output}"


def test_rules_check_rejects_the_old_policy_format(tmp_path):
    # The shape deploy/base/policy.yaml had before it became the shipped file:
    # the worker refused to start on it. The check above must catch it.
    old = "idle:\n  threshold_pct: 5\n  window_s: 1800\necc_dbe:\n  cordon: true\n"
    code, output = rules_check(old, tmp_path / "policy.yaml")
    assert code == 1
    assert "idle: Extra inputs are not permitted" in output


# -- environment settings --------------------------------------------------------------


def container_env(rendered: Rendered, workload: dict[str, Any],
                  container: dict[str, Any]) -> dict[str, str]:
    """The variables a container of ``workload`` starts with; a Secret's value is a
    placeholder."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(rendered.config_map(workload, source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = "from-a-secret"
        elif "fieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = "from-the-downward-api"
    return env


def _gpusteward_containers(
        rendered: Rendered) -> Iterator[tuple[str, tuple[dict[str, Any], dict[str, Any]]]]:
    for workload in rendered.workloads():
        for container in rendered.pod_spec(workload)["containers"]:
            image = container.get("image", "")
            if "gpusteward" in image.split("/")[-1]:
                yield f"{workload['metadata']['name']}/{container['name']}", (workload, container)


def test_every_setting_in_the_manifests_is_valid(rendered, monkeypatch):
    containers = dict(_gpusteward_containers(rendered))
    assert len(containers) >= 6, rendered.variant
    for workload, container in containers.values():
        load_every_model(container_env(rendered, workload, container), monkeypatch)


def _compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return {n: s for n, s in services.items() if s.get("image", "").startswith("gpusteward")}


def test_every_setting_in_docker_compose_is_valid(monkeypatch):
    services = _compose_services()
    assert {"worker", "alerts", "remediation", "collector"} <= set(services)
    for service in services.values():
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        # ${VAR:-default} is Compose interpolation: what the process sees is the default.
        env = {k: v.split(":-", 1)[1].rstrip("}") if v.startswith("${") else v
               for k, v in env.items()}
        load_every_model(env, monkeypatch)
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if target == env.get(POLICY_ENV):
                assert (REPO / source).resolve() == DEPLOYED_POLICY


def test_an_invalid_setting_is_caught(monkeypatch):
    # A misspelt name is test_environment.py's business.
    load_every_model({"GPUSTEWARD_COLLECT__INTERVAL_S": "5"}, monkeypatch)
    with pytest.raises(ValueError):
        load_every_model({"GPUSTEWARD_COLLECT__INTERVAL_S": "0"}, monkeypatch)
