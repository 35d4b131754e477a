"""Every GPUSTEWARD_* variable a container or compose service is given is read by its process.

Per process, not merely by some model somewhere: a variable set on the worker
that only the report reads changes nothing, as surely as a misspelt one
(:mod:`tests.deploy.reads` says how a command's names are found). The values
are validated in test_config_files.py.
"""

from __future__ import annotations

import ast
import copy
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from gpusteward.collectors.settings import CollectSettings
from gpusteward.settings import Settings
from tests.deploy.conftest import DEMO_VARIANTS, REPO, VARIANTS, Rendered
from tests.deploy.reads import (
    READS,
    Model,
    compose_processes,
    kubernetes_processes,
    read_by,
    unread,
)

pytestmark = pytest.mark.deploy

ROOMS = ("gpusteward", "collectors", "streams", "rules", "alerting", "remediation", "reports",
         "sandbox")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return document


@pytest.mark.parametrize("variant", sorted({**VARIANTS, **DEMO_VARIANTS}))
def test_every_variable_a_container_sees_is_read_by_its_process(render, variant):
    processes = list(kubernetes_processes(render(variant)))
    assert len([p for p in processes if p.argv is not None]) >= 9, variant
    problems = unread(processes)
    assert not problems, "\n".join(problems)


def test_every_variable_a_compose_service_sees_is_read_by_its_process(compose):
    processes = list(compose_processes(compose))
    assert len([p for p in processes if p.argv is not None]) >= 9
    problems = unread(processes)
    assert not problems, "\n".join(problems)


def test_a_misspelt_or_misplaced_variable_is_reported(render, compose):
    """Controls: a typo, a variable on a process that does not read it, a field its process
    never uses, a typo in a shared ConfigMap, a shared key one consumer does not read, a
    typo in compose."""
    rendered = render("production")
    assert not unread(kubernetes_processes(rendered))
    broken = Rendered("planted", copy.deepcopy(rendered.objects))
    worker = broken.pod_spec(broken.component("worker"))["containers"][0]
    worker["env"].append({"name": "GPUSTEWARD_KAFKA__FETCH_MAX_WAIT", "value": "500"})
    # The report's idle threshold, set on the worker (whose idle rule reads the policy).
    worker["env"].append({"name": "GPUSTEWARD_REPORT__IDLE_THRESHOLD_PCT", "value": "5"})
    collector = broken.pod_spec(broken.component("collector"))["containers"][0]
    collector["env"].append({"name": "GPUSTEWARD_COLLECT__DCGM_URL", "value": "http://x"})
    (kafka,) = [c for c in broken.kind("ConfigMap")
                if c["metadata"]["name"].startswith("gpusteward-kafka")
                and c["metadata"]["namespace"] == "gpusteward"]
    kafka["data"]["GPUSTEWARD_KAFKA__REBALANCE_TIMEOUT"] = "30"
    # A key only some of the ConfigMap's consumers read: the worker reads the policy file,
    # alerts does not.
    kafka["data"]["GPUSTEWARD_POLICY_FILE"] = "/etc/gpusteward/policy.yaml"
    problems = "\n".join(unread(kubernetes_processes(broken)))
    assert "GPUSTEWARD_KAFKA__FETCH_MAX_WAIT is read by nothing" in problems
    assert "GPUSTEWARD_REPORT__IDLE_THRESHOLD_PCT is read by nothing" in problems
    # The NVML collector builds CollectSettings but never uses dcgm_url.
    assert "GPUSTEWARD_COLLECT__DCGM_URL is read by nothing" in problems
    assert "GPUSTEWARD_KAFKA__REBALANCE_TIMEOUT is read by nothing" in problems
    assert ("container alerts (gpusteward alerts): GPUSTEWARD_POLICY_FILE is read by nothing"
            in problems)

    assert not unread(compose_processes(compose))
    planted = copy.deepcopy(compose)
    planted["services"]["alerts"]["environment"]["GPUSTEWARD_ALERTMANAGER__URL"] = "http://x"
    (problem,) = unread(compose_processes(planted))
    assert "compose service alerts" in problem and "GPUSTEWARD_ALERTMANAGER__URL" in problem


def test_the_names_are_the_ones_pydantic_settings_reads(monkeypatch):
    names = read_by(["collect", "nvml"])
    for name in ("GPUSTEWARD_KAFKA__FETCH_MAX_WAIT_MS", "GPUSTEWARD_COLLECT__NVML__PROC_ROOT",
                 "GPUSTEWARD_COLLECT__INTERVAL_S", "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS",
                 "gpusteward_collect__interval_s"):
        assert name in names
    assert "GPUSTEWARD_HEALTH_PORT" not in names and "GPUSTEWARD_METRICS__PORT" not in names
    assert "GPUSTEWARD_COLLECT__DCGM_URL" not in names
    assert "GPUSTEWARD_REPORT__GPU_MODELS__H100__HOURLY_USD" in read_by(["report"])
    assert "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS" not in read_by(["report"])
    assert "GPUSTEWARD_ALERTMANAGER_URL" in read_by(["alerts"])  # a click option's envvar
    assert "GPUSTEWARD_POLICY_FILE" in read_by(["sink", "rollups"])
    assert "GPUSTEWARD_POLICY_FILE" not in read_by(["sink", "queue"])
    assert "GPUSTEWARD_KUBE__RESYNC_PERIOD_S" in read_by(["watch"])
    with pytest.raises(AssertionError, match="not a command READS knows"):
        read_by(["status"])
    # What the walk says a model reads, pydantic-settings does read.
    monkeypatch.setenv("GPUSTEWARD_COLLECT__NVML__PROC_ROOT", "/elsewhere")
    monkeypatch.setenv("GPUSTEWARD_KAFKA__FETCH_MAX_WAIT_MS", "321")
    assert CollectSettings().nvml.proc_root == "/elsewhere"
    assert Settings().kafka.fetch_max_wait_ms == 321
    # A field left out of a model must be one it has.
    for reads in READS.values():
        for read in reads:
            if isinstance(read, Model):
                for dotted in read.unused:
                    assert dotted.split(".")[0] in read.settings.model_fields, dotted


def test_every_settings_model_is_in_the_table():
    """A settings model added to the code must be added to READS, or the variables of a
    command that builds it would be reported as read by nothing."""
    defined = set()
    for room in ROOMS:
        for path in (REPO / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        "BaseSettings" in ast.unparse(base) for base in node.bases):
                    defined.add(node.name)
    tabled = {r.settings.__name__ for reads in READS.values() for r in reads
              if isinstance(r, Model)}
    assert defined == tabled
    assert all(issubclass(r.settings, BaseSettings)
               for reads in READS.values() for r in reads if isinstance(r, Model))
