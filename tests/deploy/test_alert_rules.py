"""The pipeline's Prometheus alert rules: valid, on real series, and firing when they should.

The rules ship as a PrometheusRule in the monitoring component; its
``spec`` is a Prometheus rules file, checked by `promtool check rules` and
exercised by `promtool test rules` on synthetic series (Debian package
`prometheus`, installed by .ci/system-deps; skipped without it).
"""

from __future__ import annotations

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
RULE = REPO / "deploy/components/monitoring/prometheusrule.yaml"
LABELS = 'namespace="gpusteward", pod="p-0"'



def _described(alert: str, summary: str) -> dict[str, str]:
    """The expected annotations: ``summary`` as rendered, and the rule's fixed description."""
    for group in yaml.safe_load(RULE.read_text())["spec"]["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                return {"summary": summary, "description": rule["annotations"]["description"]}
    raise KeyError(alert)


# Each case: the series, then the alerts expected at given times. promtool compares the
# full label set and annotations of what fires, so a wrong `by` or template fails here.
UNIT_TESTS: list[dict[str, Any]] = [
    {
        # Lag in time, whatever the fleet's size. The worker group (two replicas, each
        # reporting the whole group) stops committing one topic at 5m; the sink commits
        # once per file, every 5 minutes; the alert sink is idle and caught up.
        "interval": "1m",
        "input_series": [
            *[{"series": f'gpusteward_consumer_caught_up_timestamp_seconds{{'
                         f'namespace="gpusteward", pod="{pod}", group="g-worker", '
                         f'topic="{topic}"}}', "values": values}
              for pod in ("w-0", "w-1")
              for topic, values in (("samples", "0+60x5 300x25"), ("allocations", "0+60x30"))],
            {"series": f'gpusteward_consumer_caught_up_timestamp_seconds{{{LABELS}, '
                       'group="g-sink", topic="rollups"}', "values": "0x5 300x5 600x5 900x5 "
                                                                     "1200x5 1500x4"},
            {"series": f'gpusteward_consumer_caught_up_timestamp_seconds{{{LABELS}, '
                       'group="g-alerts", topic="findings"}', "values": "0+60x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "GpustewardConsumerBehind", "exp_alerts": []},
            {"eval_time": "17m", "alertname": "GpustewardConsumerBehind", "exp_alerts": []},
            *[{"eval_time": eval_time, "alertname": "GpustewardConsumerBehind", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "gpusteward",
                               "group": "g-worker"},
                "exp_annotations": _described(
                    "GpustewardConsumerBehind",
                    f"g-worker has not consumed records written {behind} ago")}]}
              for eval_time, behind in (("18m", "13m 0s"), ("30m", "25m 0s"))],
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            {"series": f'gpusteward_dead_letters_total{{{LABELS}, topic="s", '
                       'reason="DecodeError"}', "values": "0 0 0 1 1 1 1 1 1 1"},
            {"series": f'gpusteward_breaker_open{{{LABELS}, group="g-remediation"}}',
             "values": "0 0 1 1 1 1 1 1 1 1"},
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "GpustewardDeadLetters", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "GpustewardDeadLetters", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "gpusteward", "topic": "s",
                               "reason": "DecodeError"},
                "exp_annotations": _described(
                    "GpustewardDeadLetters", "records from s were dead-lettered (DecodeError)")}]},
            {"eval_time": "2m", "alertname": "GpustewardRemediationBreakerOpen",
             "exp_alerts": []},
            {"eval_time": "4m", "alertname": "GpustewardRemediationBreakerOpen",
             "exp_alerts": [{"exp_labels": {"severity": "critical", "namespace": "gpusteward",
                                            "group": "g-remediation"},
                             "exp_annotations": _described(
                                 "GpustewardRemediationBreakerOpen",
                                 "the remediation circuit breaker is open")}]},
        ],
    },
    {
        # One cordon refused as stale at 3m: warned for the hour after it, then not.
        "interval": "1m",
        "input_series": [
            {"series": f'gpusteward_actions_stale_total{{{LABELS}, verb="cordon", '
                       'rule="ecc_dbe"}', "values": "_ _ _ 1x90"},
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "GpustewardActionsStale", "exp_alerts": []},
            *[{"eval_time": eval_time, "alertname": "GpustewardActionsStale", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "gpusteward",
                               "verb": "cordon", "rule": "ecc_dbe"},
                "exp_annotations": _described(
                    "GpustewardActionsStale", "cordon actions of ecc_dbe were refused as "
                    "stale and not carried out")}]} for eval_time in ("3m", "60m")],
            {"eval_time": "70m", "alertname": "GpustewardActionsStale", "exp_alerts": []},
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            {"series": 'up{namespace="gpusteward", pod="w-0", container="worker"}',
             "values": "1 1 0 0 0 0 0 0 0 0"},
            {"series": 'up{namespace="gpusteward", pod="c-1", container="collector"}',
             "values": "1x30"},
            {"series": 'gpusteward_collect_records_sent_total{namespace="gpusteward", '
                       'pod="c-1", topic="s"}', "values": "0+10x5 50x25"},
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "GpustewardProcessDown", "exp_alerts": []},
            {"eval_time": "8m", "alertname": "GpustewardProcessDown", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "namespace": "gpusteward",
                               "pod": "w-0", "container": "worker"},
                "exp_annotations": {
                    "summary": "worker in gpusteward cannot be scraped",
                    "description": "w-0 has not answered on /metrics for 5 minutes: it is down, "
                                   "restarting, or its port is blocked."}}]},
            {"eval_time": "10m", "alertname": "GpustewardCollectorSilent", "exp_alerts": []},
            {"eval_time": "26m", "alertname": "GpustewardCollectorSilent", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "gpusteward",
                               "pod": "c-1"},
                "exp_annotations": _described(
                    "GpustewardCollectorSilent",
                    "collector c-1 has published nothing for 10 minutes")}]},
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            # The pods watch hears every minute until 20m, then nothing; nodes keep going.
            {"series": 'gpusteward_watch_last_event_timestamp_seconds{namespace="gpusteward", '
                       'pod="wa-1", resource="pods"}', "values": "0+60x20 1200x40"},
            {"series": 'gpusteward_watch_last_event_timestamp_seconds{namespace="gpusteward", '
                       'pod="wa-1", resource="nodes"}', "values": "0+60x60"},
            {"series": 'up{namespace="gpusteward", pod="wa-1", container="watcher"}',
             "values": "1x20 0x10"},
        ],
        "alert_rule_test": [
            {"eval_time": "52m", "alertname": "GpustewardWatcherSilent", "exp_alerts": []},
            {"eval_time": "56m", "alertname": "GpustewardWatcherSilent", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "gpusteward",
                               "pod": "wa-1", "resource": "pods"},
                "exp_annotations": _described(
                    "GpustewardWatcherSilent",
                    "watcher wa-1 has heard nothing about pods for 36m 0s")}]},
            {"eval_time": "27m", "alertname": "GpustewardProcessDown", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "namespace": "gpusteward",
                               "pod": "wa-1", "container": "watcher"},
                "exp_annotations": {
                    "summary": "watcher in gpusteward cannot be scraped",
                    "description": "wa-1 has not answered on /metrics for 5 minutes: it is "
                                   "down, restarting, or its port is blocked."}}]},
        ],
    },
    {
        # The first burst of a (topic, reason) in a process: its series is created at 40,
        # and increase() alone saw nothing in a series that begins inside its window.
        "interval": "30s",
        "input_series": [
            {"series": f'gpusteward_dead_letters_total{{{LABELS}, topic="f", '
                       'reason="ValidationError"}', "values": "_x10 40x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "GpustewardDeadLetters", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "GpustewardDeadLetters", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "gpusteward", "topic": "f",
                               "reason": "ValidationError"},
                "exp_annotations": _described(
                    "GpustewardDeadLetters",
                    "records from f were dead-lettered (ValidationError)")}]},
            # Nothing new for 15 minutes after the burst: quiet again.
            {"eval_time": "21m", "alertname": "GpustewardDeadLetters", "exp_alerts": []},
        ],
    },
    {
        # Collectors up for an hour that never delivered: one whose samples series sits
        # at its initial 0 (collectors/metrics.py creates it), one with no series at all;
        # a third delivering all along is not silent.
        "interval": "1m",
        "input_series": [
            {"series": 'up{namespace="gpusteward", pod="c-0", container="collector"}',
             "values": "1x60"},
            {"series": 'gpusteward_collect_records_sent_total{namespace="gpusteward", '
                       'pod="c-0", topic="samples.v1"}', "values": "0x60"},
            {"series": 'up{namespace="gpusteward", pod="c-2", container="collector"}',
             "values": "1x60"},
            {"series": 'up{namespace="gpusteward", pod="c-3", container="collector"}',
             "values": "1x60"},
            {"series": 'gpusteward_collect_records_sent_total{namespace="gpusteward", '
                       'pod="c-3", topic="samples.v1"}', "values": "0+10x60"},
        ],
        "alert_rule_test": [
            {"eval_time": "60m", "alertname": "GpustewardCollectorSilent", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "gpusteward", "pod": pod},
                 "exp_annotations": _described(
                     "GpustewardCollectorSilent",
                     f"collector {pod} has published nothing for 10 minutes")}
                for pod in ("c-0", "c-2")]},
        ],
    },
    {
        # A collector crash-looping (a scrape answered every fifth minute) and one up all
        # along: only the first is down for most of a quarter hour.
        "interval": "1m",
        "input_series": [
            {"series": 'up{namespace="gpusteward-node", pod="c-9", container="collector"}',
             "values": "1x10 0 0 0 0 1 0 0 0 0 1 0 0 0 0 1 0 0 0 0 1 0 0 0 0 1"},
            {"series": 'up{namespace="gpusteward-node", pod="c-8", container="collector"}',
             "values": "1x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "GpustewardCollectorDown", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "GpustewardCollectorDown", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "gpusteward-node",
                               "pod": "c-9", "container": "collector"},
                "exp_annotations": _described(
                    "GpustewardCollectorDown",
                    "collector c-9 has been down for most of 15 minutes")}]},
            {"eval_time": "30m", "alertname": "GpustewardProcessDown", "exp_alerts": []},
        ],
    },
    {
        # A sink down (container "sink", deploy/base/sinks.yaml) for half an hour.
        "interval": "1m",
        "input_series": [
            {"series": 'up{namespace="gpusteward", pod="gpusteward-rollup-sink-x", '
                       'container="sink"}', "values": "0x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "GpustewardProcessDown", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "namespace": "gpusteward",
                               "pod": "gpusteward-rollup-sink-x", "container": "sink"},
                "exp_annotations": {
                    "summary": "sink in gpusteward cannot be scraped",
                    "description": "gpusteward-rollup-sink-x has not answered on /metrics for "
                                   "5 minutes: it is down, restarting, or its port is "
                                   "blocked."}}]},
        ],
    },
]


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package prometheus; see .ci/system-deps)")
    return path


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    document = yaml.safe_load(RULE.read_text())
    path = tmp_path_factory.mktemp("rules") / "gpusteward.rules.yml"
    path.write_text(yaml.safe_dump(document["spec"]))
    return path


def test_rules_pass_promtool_check(rules_file):
    result = subprocess.run([_promtool(), "check", "rules", str(rules_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_fire_as_their_unit_tests_expect(rules_file, tmp_path):
    tests = tmp_path / "tests.yml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(rules_file)],
                                     "evaluation_interval": "1m", "tests": UNIT_TESTS}))
    result = subprocess.run([_promtool(), "test", "rules", str(tests)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_can_fail(rules_file, tmp_path):
    broken = [dict(UNIT_TESTS[1], alert_rule_test=[
        {"eval_time": "1m", "alertname": "GpustewardRemediationBreakerOpen",
         "exp_alerts": [{"exp_labels": {"severity": "critical"}}]}])]
    tests = tmp_path / "tests.yml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(rules_file)], "tests": broken}))
    result = subprocess.run([_promtool(), "test", "rules", str(tests)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0


def test_every_rule_names_series_some_process_exports():
    exported = metric_names([PipelineMetrics().registry, CollectorMetrics().registry,
                             WatcherMetrics().registry])
    groups = yaml.safe_load(RULE.read_text())["spec"]["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"]}
    assert {"GpustewardConsumerBehind", "GpustewardDeadLetters",
            "GpustewardRemediationBreakerOpen", "GpustewardActionsStale", "GpustewardProcessDown",
            "GpustewardCollectorSilent", "GpustewardCollectorDown",
            "GpustewardWatcherSilent"} <= alerts
    for group in groups:
        for rule in group["rules"]:
            named = set(re.findall(r"\bgpusteward_\w+", rule["expr"]))
            assert named <= exported, (rule["alert"], named - exported)


def test_every_scraped_process_is_watched_for_being_down(render):
    """Each long-running container that serves /metrics (GPUSTEWARD_METRICS__PORT) is in
    GpustewardProcessDown's regex and in the pipeline dashboard's "Processes up"."""
    import json

    served = set()
    for workload in render("production").workloads():
        if workload["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if any(e["name"] == "GPUSTEWARD_METRICS__PORT" for e in container.get("env", [])):
                served.add(container["name"])
    assert {"worker", "alerts", "remediation", "watcher", "sink"} <= served
    rules = {rule["alert"]: rule for group in yaml.safe_load(RULE.read_text())["spec"]["groups"]
             for rule in group["rules"]}
    down = re.search(r'container=~"([^"]+)"', rules["GpustewardProcessDown"]["expr"])
    assert down is not None and served <= set(down[1].split("|"))
    pipeline = json.loads((REPO / "deploy/base/dashboards/gpusteward-pipeline.json").read_text())
    panel = next(p for p in pipeline["panels"] if p.get("title") == "Processes up")
    up = re.search(r'container=~\\"([^"\\]+)\\"', json.dumps(panel["targets"]))
    assert up is not None and served <= set(up[1].split("|")), up
