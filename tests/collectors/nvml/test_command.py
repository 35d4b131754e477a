"""``gpusteward collect nvml`` as the DaemonSet runs it: a real process, a kubelet, Kafka.

The command once handed its ``CollectSettings`` to a runner that wanted other
settings and crashed at start; only running the real command catches that.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.schema import NodeSample, PodRef
from gpusteward.settings import Settings

from ..conftest import metric_value
from .conftest import KUBELET_LIST, MIG_1, MIG_PARENT, WHOLE, Kubelet, serve_kubelet


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            return str(answer.read().decode())
    except OSError:  # not serving yet
        return ""


def run_collect_nvml(settings: Settings, socket_path: Path, kubelet: Kubelet, node: str,
                     *source: str) -> tuple[list[NodeSample], str]:
    """Run ``gpusteward collect nvml`` (``source``: ``--fake-nvml PATH``, or nothing for the
    driver) with ``kubelet`` on ``socket_path`` until it has sent three samples, stop it with
    SIGTERM as the kubelet does, and return what reached Kafka and its last /metrics page."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "gpusteward"), "collect", "nvml", *source,
               "--node", node, "--interval", "0.2", "--metrics-port", str(port),
               "--bootstrap", settings.kafka.bootstrap_servers, "--loglevel", "warning"]
    # The NVML collector's own settings by the names the DaemonSet uses.
    env = {**os.environ, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
           "GPUSTEWARD_COLLECT__NVML__POD_RESOURCES_SOCKET": str(socket_path),
           "GPUSTEWARD_COLLECT__NVML__EVENT_WAIT_MS": "100",
           "GPUSTEWARD_COLLECT__METRICS_ADDR": "127.0.0.1"}
    sent = f'gpusteward_collect_records_sent_total{{topic="{topics.SAMPLES.suffix}"}}'

    async def scenario() -> tuple[list[NodeSample], str]:
        await kafka.ensure_topics(settings, [topics.SAMPLES, topics.HW_EVENTS])
        server = await serve_kubelet(kubelet, socket_path)
        process = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        try:
            # Kafka is read once the process has stopped: a live collector never lets
            # read_all's quiet period pass.
            deadline = time.monotonic() + 30
            metrics = ""
            while metric_value(metrics, sent) < 3:
                if process.returncode is not None or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
                metrics = await asyncio.to_thread(_metrics, port)
            running = process.returncode is None
            if running:
                process.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(process.wait(), 20)
            output = (await process.stdout.read()).decode()  # type: ignore[union-attr]
            assert running and code == 0, output
            records = await kafka.read_all(settings, topics.SAMPLES.name(settings))
            return [msgspec.json.decode(r.value or b"", type=NodeSample)
                    for r in records], metrics
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await server.stop(None)

    return asyncio.run(scenario())


@pytest.mark.e2e
def test_collect_nvml_process_publishes_pod_attributed_samples(
        settings: Settings, nvml_data: Path, socket_path: Path) -> None:
    collected = 'gpusteward_collect_samples_total{source="nvml"}'
    kubelet = Kubelet(KUBELET_LIST)
    samples, metrics = run_collect_nvml(settings, socket_path, kubelet, "gpu-node-03",
                                        "--fake-nvml", str(nvml_data / "mixed-node.yaml"))
    assert len(samples) >= 3
    assert metric_value(metrics, collected) >= 3  # the shared collector metric names
    assert {(s.node, s.source) for s in samples} == {("gpu-node-03", "nvml")}
    assert kubelet.calls >= 1
    last = samples[-1]
    assert len(last.devices) == 4
    pods = {d.uuid: d.pod for d in last.devices}
    assert pods[WHOLE] == PodRef(namespace="ml", name="train-0", container="trainer")
    assert pods[MIG_PARENT] is None
    assert pods[MIG_1] == PodRef(namespace="research", name="notebook-7", container="jupyter")
