"""Shared GPUs end to end: the NVML collector's per-process attribution through the real worker.

A node of the fake NVML (tests/data/nvml/shared-node.yaml) carries a GPU
time-sliced between a busy and an idle notebook, a training GPU, and a GPU
shared through MPS by two inference servers, one of which leaks memory. The
production collector reads it with the kubelet's PodResources served over
gRPC and the host's /proc faked under tests/data/proc, and publishes on the
embedded broker beside the allocations the watcher would send; the stream
worker runs as a child process with the shipped policy. The idle notebook is
found and only it, the leak is found with its projected exhaustion time
within 10 % of the truth, and no memory finding touches the steady pods.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.attribution import PodResourcesClient
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.kubelet import Assignment, KubeletPodResources
from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import Finding, PodAllocation, PodRef
from gpusteward.topics import worker_group

pytestmark = pytest.mark.e2e

DATA = Path(__file__).resolve().parents[1] / "data"
GIB = 1 << 30
T0 = 1_763_683_200.0  # in the past: the worker refuses event time 15 min ahead of its clock
TICK_S = 30.0
TICKS = 80  # 40 min: past the idle window (30 min) and the leak window (30 min)
LEAK_GIB_PER_H = 6.0
UID = "0f1e2d3c-0000-4000-8000-00000000000{}".format
SHARED, TRAIN_GPU, MPS = (f"GPU-5a5a5a5a-0000-4000-8000-00000000000{i}" for i in range(3))
# pod -> (uid, workload kind, device id the device plugin gave it)
PODS = {
    PodRef(namespace="nb", name="busy"): (UID(1), "notebook", f"{SHARED}::0"),
    PodRef(namespace="nb", name="idle"): (UID(2), "notebook", f"{SHARED}::1"),
    PodRef(namespace="ml", name="train-0"): (UID(6), "batch", TRAIN_GPU),
    PodRef(namespace="serve", name="leaky"): (UID(3), "inference", f"{MPS}::0"),
    PodRef(namespace="serve", name="steady"): (UID(4), "inference", f"{MPS}::1"),
}


@dataclass
class Run:
    findings: list[Finding]
    leak_rate_bytes_per_s: float
    mps_used_at: dict[float, int]
    """Device memory of the MPS GPU at each tick: the truth the projection is judged by."""


async def _run(broker: EmbeddedBroker, log_dir: Path, socket_dir: Path) -> Run:
    settings = broker.settings().model_copy(update={"topic_prefix": "e2e-shared"})
    await kafka.ensure_topics(settings)
    kubelet = KubeletPodResources(socket_dir / "kubelet.sock", lambda: [
        Assignment(pod.namespace, pod.name, "main", "nvidia.com/gpu", device)
        for pod, (_uid, _kind, device) in PODS.items()])
    await kubelet.start()
    nvml = FakeNvml.from_yaml(DATA / "nvml" / "shared-node.yaml")
    now = [T0]
    publisher = KafkaPublisher(settings)
    await publisher.start()
    collector = NvmlCollector(
        nvml, "shared-node", publisher, interval_s=TICK_S, event_wait_ms=50,
        pod_resources=PodResourcesClient(str(kubelet.socket_path), timeout_s=5),
        proc_root=str(DATA / "proc"), clock=lambda: now[0])
    worker = WorkerProcess(settings, log_dir / "worker.log")
    worker.start()
    leaky = next(p for p in nvml.gpu(2).processes if p.pid == 4103)
    rate = LEAK_GIB_PER_H * GIB / 3600
    mps_used: dict[float, int] = {}
    try:
        for pod, (uid, kind, device) in PODS.items():
            await publisher.allocation(PodAllocation(
                ts=T0 - 1, node="shared-node", pod=PodRef(pod.namespace, pod.name, uid=uid),
                phase="running", gpus=1, device_ids=[device.split("::")[0]],
                started_at=T0 - 3600, workload_kind=kind))
        collector.open()
        base_leaky, base_device = leaky.mem_used, nvml.gpu(2).mem_used
        assert base_leaky is not None
        for i in range(TICKS):
            now[0] = T0 + i * TICK_S
            grown = int(rate * i * TICK_S)
            leaky.mem_used = base_leaky + grown
            nvml.gpu(2).mem_used = base_device + grown
            mps_used[now[0]] = nvml.gpu(2).mem_used
            await collector.tick()
        await publisher.flush()
        names = [t.name(settings) for t in (topics.SAMPLES, topics.ALLOCATIONS)]
        await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=120)
        assert worker.alive
    finally:
        collector.close()
        worker.stop()
        await publisher.stop()
        assert collector.pod_resources is not None
        await collector.pod_resources.close()
        await kubelet.stop()
    decode = msgspec.json.Decoder(Finding).decode
    records = await kafka.read_all(settings, topics.FINDINGS.name(settings))
    return Run([decode(r.value) for r in records], rate, mps_used)


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    # A unix socket path must stay under ~107 bytes: pytest's tmp_path can be longer.
    socket_dir = Path(tempfile.mkdtemp(prefix="kl-"))
    try:
        return asyncio.run(_run(broker, tmp_path_factory.mktemp("shared"), socket_dir))
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


def _firing(run: Run, kind: str) -> list[Finding]:
    return [f for f in run.findings if f.kind == kind and f.state == "firing"]


def test_the_idle_notebook_beside_a_busy_one_is_found_and_only_it(run: Run) -> None:
    idle = _firing(run, "idle_holder")
    assert [(f.subject.pod, f.subject.device) for f in idle] == [
        (PodRef(namespace="nb", name="idle", uid=UID(2)), SHARED)]


def test_the_leak_is_found_with_its_projected_exhaustion_time(run: Run) -> None:
    (leak,) = _firing(run, "gpu_memory_leak")
    assert leak.subject.pod == PodRef(namespace="serve", name="leaky", uid=UID(3))
    assert leak.subject.device == MPS
    values = leak.evidence.values  # type: ignore[union-attr]
    truth_s = (80 * GIB - run.mps_used_at[leak.ts]) / run.leak_rate_bytes_per_s
    assert abs(values["projected_exhaustion_s"] - truth_s) / truth_s < 0.10


def test_no_memory_finding_on_the_steady_pods(run: Run) -> None:
    memory = [f for f in run.findings if f.kind.startswith("gpu_memory_")]
    assert {f.kind for f in memory} == {"gpu_memory_leak"}
    assert {f.subject.pod.name for f in memory if f.subject.pod} == {"leaky"}
