"""The Grafana dashboards are well-formed, every query is valid PromQL and names real series.

Each panel query, with the dashboard's constant variables (and Grafana's
``$__range``) substituted, is wrapped in a recording rule and parsed by
`promtool check rules` (Debian package `prometheus`, installed by
.ci/system-deps; skipped without it). Every ``gpusteward_*`` series a query
names must be one some gpusteward process exports (the registries of
gpusteward/metrics.py and collectors/metrics.py, the watcher's included); the
others must come from the exporters the dashboards are drawn for (dcgm-exporter,
Kafka exporter, Prometheus's own ``up``/``process_*``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpusteward.collectors.metrics import CollectorMetrics, WatcherMetrics
from gpusteward.metrics import PipelineMetrics, metric_names

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "deploy/base/dashboards").glob("*.json"))
DASHBOARD = REPO / "deploy/base/dashboards/gpusteward.json"
GRAFANA_BUILTINS = {"$__range": "1d", "$__rate_interval": "5m", "$__interval": "1m"}
OURS = re.compile(r"\bgpusteward_\w+")
EXTERNAL = re.compile(r"\b(DCGM_FI_\w+|kafka_\w+|up|process_\w+)\b")


@pytest.fixture(scope="module", params=DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(request.param.read_text())
    return document


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
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
            for name, value in GRAFANA_BUILTINS.items():
                expr = expr.replace(name, value)
            found.append((panel["title"], expr))
    return found


def test_each_dashboard_has_its_own_uid_and_title():
    """Grafana keys dashboards by uid: two files with one uid leave one of them unloaded.
    The uid is the file's name, and the title names the dashboard, not one of its panels."""
    documents = {path.stem: load(path) for path in DASHBOARDS}
    assert {stem: d["uid"] for stem, d in documents.items()} == {s: s for s in documents}
    titles = [d["title"] for d in documents.values()]
    assert len(set(titles)) == len(titles)
    for document in documents.values():
        assert document["title"].startswith("gpusteward")
        assert document["title"] not in {p["title"] for p in document["panels"]}


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


def test_dashboard_covers_the_fleet_and_the_pipeline():
    text = " ".join(expr for _, expr in queries(load(DASHBOARD)))
    for metric in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                   "DCGM_FI_DEV_XID_ERRORS", "kafka_consumergroup_lag",
                   "gpusteward.findings.v1", "gpusteward.deadletter.v1"):
        assert metric.replace(".", "\\\\.") in text or metric in text, metric


def test_fleet_and_pipeline_dashboards_draw_the_processes_own_series():
    fleet = " ".join(e for _, e in queries(load(DASHBOARD.with_name("gpusteward-fleet.json"))))
    for metric in ("gpusteward_gpu_seconds_total", "gpusteward_gpu_idle_cost_usd_total",
                   "gpusteward_findings_open", "gpusteward_actions_total"):
        assert metric in fleet, metric
    pipeline = " ".join(e for _, e in queries(load(DASHBOARD.with_name(
        "gpusteward-pipeline.json"))))
    for metric in ("gpusteward_consumer_lag_records", "gpusteward_records_in_total",
                   "gpusteward_dead_letters_total", "gpusteward_breaker_open",
                   "gpusteward_watch_last_event_timestamp_seconds",
                   "gpusteward_watch_events_published_total"):
        assert metric in pipeline, metric


def test_every_query_names_a_series_some_process_exports(dashboard):
    exported = metric_names([PipelineMetrics().registry, CollectorMetrics().registry,
                             WatcherMetrics().registry])
    for title, expr in queries(dashboard):
        ours = set(OURS.findall(expr))
        assert ours <= exported, f"{title}: {sorted(ours - exported)} exported by no process"
        assert ours or EXTERNAL.search(expr), f"{title}: names no known series: {expr}"


PROCESS = re.compile(r"\bprocess_\w+")


def test_process_series_are_exported_by_the_process_they_are_read_from(dashboard):
    """prometheus-client's ``process_*`` series exist only where a registry carries a
    ProcessCollector: the collectors' does, the pipeline processes' does not."""
    registries = {"collector": CollectorMetrics().registry,
                  "watcher": WatcherMetrics().registry}
    for title, expr in queries(dashboard):
        named = set(PROCESS.findall(expr))
        if not named:
            continue
        container = re.search(r'container="(\w+)"', expr)
        assert container is not None, f"{title}: process_* of no one container: {expr}"
        registry = registries.get(container[1], PipelineMetrics().registry)
        exported = metric_names([registry])
        assert named <= exported, f"{title}: {container[1]} exports no {named - exported}"


def test_the_name_check_catches_a_misspelt_series():
    exported = metric_names([PipelineMetrics().registry])
    assert "gpusteward_records_in_total" in exported
    assert "gpusteward_record_in_total" not in exported


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


def test_dashboards_ship_as_a_grafana_sidecar_configmap(render):
    (configmap,) = [c for c in render("production").kind("ConfigMap")
                    if c["metadata"]["name"] == "gpusteward-dashboards"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(configmap["data"]) == {p.name for p in DASHBOARDS}
    for path in DASHBOARDS:
        assert json.loads(configmap["data"][path.name]) == load(path)


MATCHER = re.compile(r'\b(namespace|container)(=~|=)"([^"]*)"')


def selects(matchers: list[tuple[str, str, str]], label: str, value: str) -> bool:
    """Whether a query's ``label`` matchers (``=`` and ``=~``; none: any) accept ``value``."""
    return all(value == want if op == "=" else re.fullmatch(want, value) is not None
               for name, op, want in matchers if name == label)


def test_a_panel_finds_each_process_in_the_namespace_it_runs_in(dashboard, render):
    """The collectors run in a namespace of their own (gpusteward-node), everything else
    in gpusteward: a panel that reads the collectors' series with the pipeline's namespace
    draws nothing (the watcher exports gpusteward_collect_* too, so it draws only it)."""
    rendered = render("production")
    namespaces = {c["name"]: w["metadata"]["namespace"] for w in rendered.workloads()
                  for c in rendered.pod_spec(w)["containers"]}
    assert namespaces["collector"] == "gpusteward-node" and namespaces["worker"] == "gpusteward"
    for title, expr in queries(dashboard):
        matchers = MATCHER.findall(expr)
        if not any(name == "namespace" for name, _, _ in matchers):
            continue
        if any(name == "container" for name, _, _ in matchers):
            containers = {c for c in namespaces if selects(matchers, "container", c)}
        else:  # by the series: the collectors' set, or the pipeline processes'
            containers = {"collector" if "gpusteward_collect_" in expr else "worker"}
        for container in containers:
            assert selects(matchers, "namespace", namespaces[container]), (
                f"{title}: {container} runs in {namespaces[container]}: {expr}")
