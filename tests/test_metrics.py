"""The shared metrics module: one registry per process, a server that also takes probes."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpusteward.collectors.metrics import CollectorMetrics, WatcherMetrics
from gpusteward.metrics import (
    LagClock,
    OpenFindings,
    PipelineMetrics,
    follow_lag,
    metric_names,
    observe_many,
    serve,
)


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


class _TP(tuple[str, int]):
    """A TopicPartition-like key: the lag clock needs only ``topic``."""

    @property
    def topic(self) -> str:
        return self[0]


def test_lag_clock_reads_a_stalled_group_behind_by_the_time_since_its_commit_was_the_end():
    clock = LagClock()
    p0 = _TP(("s", 0))
    assert clock.caught_up_at(p0, end=100, committed=100, now=1000.0) == 1000.0
    # The group stops committing at 100 while records keep arriving.
    assert clock.caught_up_at(p0, end=120, committed=100, now=1015.0) == 1000.0
    assert clock.caught_up_at(p0, end=140, committed=100, now=1030.0) == 1000.0
    # It moves on to 120: caught up to the reading that saw the end there.
    assert clock.caught_up_at(p0, end=160, committed=120, now=1045.0) == 1015.0
    assert clock.caught_up_at(p0, end=160, committed=160, now=1060.0) == 1060.0


def test_lag_clock_counts_a_rare_record_from_the_last_reading_before_it():
    """One finding an hour, read between its write and its commit: seconds behind, not an
    hour (the end stood still at the commit until the reading before)."""
    clock = LagClock()
    p0 = _TP(("findings", 0))
    for minute in range(60):
        assert clock.caught_up_at(p0, 7, 7, 60.0 * minute) == 60.0 * minute
    assert clock.caught_up_at(p0, end=8, committed=7, now=3600.0) == 3540.0
    # Stuck on that record (a dead Alertmanager): the lag grows with the clock.
    assert clock.caught_up_at(p0, end=8, committed=7, now=4200.0) == 3540.0


def test_lag_clock_bounds_a_group_behind_since_before_its_first_reading():
    clock = LagClock(history=3)
    p0 = _TP(("s", 0))
    assert clock.caught_up_at(p0, end=500, committed=0, now=10.0) == 10.0
    assert clock.caught_up_at(p0, end=600, committed=0, now=25.0) == 10.0
    for now, end in ((40.0, 700), (55.0, 800), (70.0, 900)):
        clock.caught_up_at(p0, end=end, committed=0, now=now)
    # Only three ends kept: behind since the oldest of them at least.
    assert clock.caught_up_at(p0, end=900, committed=0, now=85.0) == 40.0
    # A topic made again (its end moved back) starts over.
    assert clock.caught_up_at(p0, end=3, committed=0, now=100.0) == 100.0


def test_lag_clock_sets_records_summed_and_the_topic_caught_up_to_its_slowest_partition():
    metrics, clock = PipelineMetrics(), LagClock()
    p0, p1 = _TP(("s", 0)), _TP(("s", 1))
    clock.observe(metrics, "g", {p0: (10, 10), p1: (10, 10)}, 100.0)
    clock.observe(metrics, "g", {p0: (30, 30), p1: (25, 10)}, 115.0)
    labels = {"group": "g", "topic": "s"}
    value = metrics.registry.get_sample_value
    assert value("gpusteward_consumer_lag_records", labels) == 15
    assert value("gpusteward_consumer_caught_up_timestamp_seconds", labels) == 100.0


def test_follow_lag_reads_beside_the_loop_and_keeps_the_time_when_a_reading_fails(caplog):
    metrics = PipelineMetrics()
    readings: list[dict[Any, tuple[int, int]] | Exception] = [
        {_TP(("s", 0)): (5, 5)}, RuntimeError("broker away"), {_TP(("s", 0)): (9, 5)}]
    times = iter([100.0, 130.0])

    async def read() -> dict[Any, tuple[int, int]]:
        reading = readings.pop(0) if readings else {_TP(("s", 0)): (9, 5)}
        if isinstance(reading, Exception):
            raise reading
        return reading

    async def main() -> None:
        task = asyncio.create_task(follow_lag(metrics, "g", read, 0.001,
                                              clock=lambda: next(times, 130.0)))
        await asyncio.sleep(0.2)  # a hundred readings at most, three of them scripted
        assert not readings
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    labels = {"group": "g", "topic": "s"}
    assert metrics.registry.get_sample_value("gpusteward_consumer_lag_records", labels) == 4
    assert metrics.registry.get_sample_value(
        "gpusteward_consumer_caught_up_timestamp_seconds", labels) == 100.0
    assert "cannot read the lag of g: broker away" in caplog.text
