"""The shared metrics module: one registry per process, a server that also takes probes."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpusteward.collectors.metrics import CollectorMetrics, WatcherMetrics
from gpusteward.metrics import OpenFindings, PipelineMetrics, metric_names, observe_many, serve


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_each_process_has_its_own_registry():
    one, two = PipelineMetrics(), PipelineMetrics()
    one.records_in.labels("t").inc(3)
    assert one.registry.get_sample_value("gpusteward_records_in_total", {"topic": "t"}) == 3
    assert two.registry.get_sample_value("gpusteward_records_in_total", {"topic": "t"}) is None


def test_server_serves_metrics_and_extra_paths_and_stops():
    metrics = PipelineMetrics()
    metrics.actions.labels("cordon", "dry_run").inc(2)
    ready = {"ok": False}
    server = serve(metrics.registry, 0, "127.0.0.1", extra={
        "/readyz": lambda: (200, b"ok") if ready["ok"] else (503, b"not yet")})
    try:
        status, text = _get(server.port, "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        (sample,) = [s for s in families["gpusteward_actions"].samples
                     if s.name == "gpusteward_actions_total"]
        assert sample.labels == {"verb": "cordon", "outcome": "dry_run"} and sample.value == 2
        assert _get(server.port, "/readyz") == (503, "not yet")
        ready["ok"] = True
        assert _get(server.port, "/readyz") == (200, "ok")
    finally:
        server.stop()
    with socket.socket() as probe, pytest.raises(OSError):
        probe.settimeout(1)
        probe.connect(("127.0.0.1", server.port))


def test_open_findings_follow_firing_and_resolved_once_per_id():
    metrics = PipelineMetrics()
    gauge = OpenFindings(metrics)
    gauge.observe("a", "xid", "critical", "firing")
    gauge.observe("a", "xid", "critical", "firing")  # a redelivery counts once
    gauge.observe("b", "idle_holder", "warning", "firing")
    gauge.observe("b", "idle_holder", "critical", "firing")  # escalated: moves severity
    gauge.observe("a", "xid", "critical", "resolved")
    gauge.observe("c", "gpu_lost", "critical", "firing", ts=200.0)
    gauge.observe("c", "gpu_lost", "info", "resolved", ts=100.0)  # older: changes nothing

    def value(kind: str, severity: str) -> float | None:
        return metrics.registry.get_sample_value(
            "gpusteward_findings_open", {"kind": kind, "severity": severity})

    assert value("xid", "critical") == 0
    assert value("idle_holder", "warning") == 0
    assert value("idle_holder", "critical") == 1
    assert value("gpu_lost", "critical") == 1


def test_metric_names_follow_the_conventions():
    names = metric_names([PipelineMetrics().registry])
    assert "gpusteward_records_in_total" in names
    assert "gpusteward_processing_seconds_bucket" in names
    assert "gpusteward_consumer_lag_records" in names
    for name in names:
        assert name.startswith("gpusteward_")


@pytest.mark.parametrize("value", [0.0, 1e-4, 0.003, 7.0, 1e6])  # a bound, between, +Inf
def test_observe_many_records_what_as_many_observations_record(value: float):
    one_by_one, at_once = PipelineMetrics(), PipelineMetrics()
    for _ in range(7):
        one_by_one.processing.labels("node_join").observe(value)
    observe_many(at_once.processing.labels("node_join"), value, 7)

    def samples(metrics: PipelineMetrics) -> dict[tuple[str, str], float]:
        return {(sample.name, sample.labels.get("le", "")): sample.value
                for family in metrics.registry.collect()
                if family.name == "gpusteward_processing_seconds"
                for sample in family.samples if not sample.name.endswith("_created")}

    expected = samples(one_by_one)
    assert expected[("gpusteward_processing_seconds_count", "")] == 7
    assert samples(at_once) == pytest.approx(expected)



def test_a_collector_exports_its_process_and_a_zero_before_its_first_delivery():
    """The fleet dashboard reads the collectors' resident memory, and
    GpustewardCollectorSilent a collector's acknowledged samples: both exist from the
    start, before anything was delivered (the watcher's for the topics it publishes)."""
    collector = CollectorMetrics().registry
    assert (collector.get_sample_value("process_resident_memory_bytes", {}) or 0) > 0
    sent = "gpusteward_collect_records_sent_total"
    assert collector.get_sample_value(sent, {"topic": "samples.v1"}) == 0
    watcher = WatcherMetrics().registry
    assert (watcher.get_sample_value("process_resident_memory_bytes", {}) or 0) > 0
    assert watcher.get_sample_value(sent, {"topic": "allocations.v1"}) == 0
    assert watcher.get_sample_value(sent, {"topic": "samples.v1"}) is None
