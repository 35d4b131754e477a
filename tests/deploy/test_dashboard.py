"""The Grafana dashboard is well-formed and every query is valid PromQL.

Each panel query, with the dashboard's constant variables substituted, is
wrapped in a recording rule and parsed by `promtool check rules` (Debian
package `prometheus`, installed by .ci/system-deps; skipped without it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy/base/dashboards/gpusteward.json"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    constants = {
        v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "constant"
    }
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in constants.items():
                expr = expr.replace("${" + name + "}", value)
            found.append((panel["title"], expr))
    return found


def test_panels_are_laid_out_and_use_the_datasource_variable(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in variables
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_dashboard_covers_the_fleet_and_the_pipeline(dashboard):
    text = " ".join(expr for _, expr in queries(dashboard))
    for metric in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                   "DCGM_FI_DEV_XID_ERRORS", "kafka_consumergroup_lag",
                   "gpusteward.findings.v1", "gpusteward.deadletter.v1"):
        assert metric.replace(".", "\\\\.") in text or metric in text, metric


def test_every_query_is_valid_promql(dashboard, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; see .ci/system-deps)")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr}
        for i, (_, expr) in enumerate(queries(dashboard))
    ]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_ships_as_a_grafana_sidecar_configmap(render):
    (configmap,) = [c for c in render("production").kind("ConfigMap")
                    if c["metadata"]["name"] == "gpusteward-dashboards"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["gpusteward.json"]) == json.loads(DASHBOARD.read_text())
