"""``gpusteward collect``: settings from flags and environment, and a real collector process."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.cli import app
from gpusteward.cli import collect as collect_cli
from gpusteward.collectors.settings import CollectSettings
from gpusteward.schema import NodeSample
from gpusteward.settings import Settings

from .conftest import metric_value


def test_settings_come_from_the_environment_and_flags_override_them(monkeypatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-42")
    monkeypatch.setenv("GPUSTEWARD_COLLECT__INTERVAL_S", "3")
    monkeypatch.setenv("GPUSTEWARD_COLLECT__PROMETHEUS_NODES", '["a", "b"]')
    monkeypatch.setenv("GPUSTEWARD_COLLECT__BUFFER_DIR", "/var/lib/gpusteward")
    monkeypatch.setenv("GPUSTEWARD_COLLECT__NVML__EVENT_WAIT_MS", "250")

    from_env = CollectSettings()
    assert from_env.node_name == "gpu-node-42"
    assert from_env.interval_s == 3.0
    assert from_env.prometheus_nodes == ["a", "b"]
    assert from_env.buffer_dir == Path("/var/lib/gpusteward")
    assert from_env.metrics_port == 9401, "not dcgm-exporter's 9400"
    assert from_env.nvml.event_wait_ms == 250
    assert from_env.nvml.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"

    flagged = collect_cli._settings(interval_s=0.5, node_name=None, dcgm_url="http://x/metrics")
    assert (flagged.interval_s, flagged.node_name) == (0.5, "gpu-node-42")
    assert flagged.dcgm_url == "http://x/metrics"


def test_collect_lists_its_sources() -> None:
    result = CliRunner().invoke(app, ["collect", "--help"])
    assert result.exit_code == 0
    for name in ("nvml", "dcgm", "prometheus"):
        assert re.search(rf"^\W*{name}\s", result.output, re.MULTILINE), name


@pytest.mark.skipif(importlib.util.find_spec("gpusteward.collectors.nvml") is not None,
                    reason="the NVML collector is present in this build")
def test_nvml_without_its_module_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["collect", "nvml"])
    assert result.exit_code == 2
    assert "NVML collector is not available" in result.output


@pytest.mark.e2e
def test_dcgm_collector_process_publishes_and_serves_metrics(
        settings: Settings, exporter, tmp_path: Path) -> None:
    asyncio.run(kafka.ensure_topics(settings, [topics.SAMPLES, topics.HW_EVENTS]))
    port = free_port()
    command = [str(Path(sys.executable).parent / "gpusteward"), "collect", "dcgm",
               "--url", exporter.url, "--node", "gpu-node-07", "--interval", "0.2",
               "--metrics-port", str(port), "--buffer-dir", str(tmp_path / "buffer"),
               "--bootstrap", settings.kafka.bootstrap_servers, "--loglevel", "warning"]
    env = {**os.environ, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
           "GPUSTEWARD_COLLECT__METRICS_ADDR": "127.0.0.1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    sent_line = 'gpusteward_collect_records_sent_total{topic="samples.v1"}'
    try:
        deadline = time.monotonic() + 30
        sent = 0.0
        while sent < 3:
            assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no samples sent within 30 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    sent = metric_value(r.read().decode(), sent_line)
            except OSError:
                pass
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    records = asyncio.run(kafka.read_all(settings, topics.SAMPLES.name(settings)))
    samples = [msgspec.json.decode(r.value or b"", type=NodeSample) for r in records]
    assert len(samples) >= 3
    assert {s.node for s in samples} == {"gpu-node-07"}
    assert all(len(s.devices) == 4 for s in samples)  # 2 GPUs, 2 MIG instances
    assert [s.ts for s in samples] == sorted(s.ts for s in samples)
    hw = asyncio.run(kafka.read_all(settings, topics.HW_EVENTS.name(settings)))
    assert len(hw) == 1, "the XID of the page is reported once, not at every tick"
