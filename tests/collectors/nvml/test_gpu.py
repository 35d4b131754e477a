"""The NVML collector on real hardware (marker ``gpu``): real pynvml, real driver.

Skipped where NVML cannot be initialised (no library, no driver, no GPU).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pynvml
import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.attribution import PodResourcesClient
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.collectors.nvml.events import EventListener
from gpusteward.collectors.podresources import api_pb2
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import Finding, NodeSample, PodAllocation, PodRef
from gpusteward.settings import Settings
from tests.e2e.records import decoded

from .conftest import Kubelet, container, kubelet_pod, run_collect_nvml, serve_kubelet

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu_count() -> Iterator[int]:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:  # LibraryNotFound, DriverNotLoaded, ...
        pytest.skip(f"no usable NVIDIA driver here: {e}")
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        pytest.skip("NVML finds no GPU")
    yield count


def _source_errors(collector: NvmlCollector) -> dict[str, float]:
    """The collector's counted NVML failures, by the call that failed."""
    return {sample.labels["reason"]: sample.value
            for metric in collector.metrics.registry.collect()
            if metric.name == "gpusteward_collect_source_errors"
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.value}


def test_real_gpus_are_sampled(gpu_count, publisher):
    collector = NvmlCollector(pynvml, "gpu-test", publisher, interval_s=0.2, event_wait_ms=200)

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(collector.run(stop))
        await publisher.wait_for(lambda p: len(p.samples) >= 3, timeout_s=30)
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    # A healthy GPU answers every call the reader makes, or says the reading does not
    # exist here (NotSupported, FunctionNotFound): nothing is counted as a failure.
    assert _source_errors(collector) == {}
    sample = publisher.samples[-1]
    gpus = [d for d in sample.devices if d.kind == "gpu"]
    assert len(gpus) == gpu_count
    for gpu in gpus:
        assert gpu.uuid.startswith("GPU-")
        assert gpu.mem_total_bytes and gpu.mem_total_bytes > 1 << 30
        assert gpu.temp_c is not None and 0 < gpu.temp_c < 120
        assert gpu.sm_clock_mhz is not None
    for mig in (d for d in sample.devices if d.kind == "mig"):
        assert mig.uuid.startswith("MIG-") and mig.parent_uuid in {g.uuid for g in gpus}
        assert mig.mig_profile and "g." in mig.mig_profile
    assert not [e for e in publisher.events if e.kind == "gpu_lost"]


def test_the_real_driver_accepts_event_registration(gpu_count, publisher):
    """XIDs, double-bit ECC and clock events arrive through an event set: every GPU must
    accept registration for the events it supports, or faults go unwatched."""
    errors: list[tuple[str, BaseException]] = []
    collector = NvmlCollector(pynvml, "gpu-test", publisher)
    collector.open()
    try:
        listener = EventListener(pynvml, collector.reader.gpus, 100, deliver=lambda raw: None,
                                 on_error=lambda where, e, gpu: errors.append((where, e)))
        listener.start()
        assert listener.ready.wait(30)
        listener.stop(5)
    finally:
        collector.close()
    assert errors == []
    assert sorted(listener.registered.values()) == sorted(g.uuid for g in collector.reader.gpus)


def test_real_per_process_calls_answer_in_the_shapes_the_reader_expects(gpu_count):
    """The process calls on the real driver: lists of pynvml's process objects, and the
    utilisation samples or NotFound (no sample since the timestamp), as the fake models."""
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for call in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                     pynvml.nvmlDeviceGetMPSComputeRunningProcesses):
            try:
                processes = call(handle)
            except pynvml.NVMLError_NotSupported:
                continue
            for process in processes:
                assert process.pid > 0
                assert process.usedGpuMemory is None or process.usedGpuMemory >= 0
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_NotSupported):
            samples = []
        for sample in samples:
            assert 0 <= sample.smUtil <= 100 and sample.timeStamp > 0
    finally:
        pynvml.nvmlShutdown()


def test_the_collector_reads_real_processes_with_the_host_proc(gpu_count, publisher):
    """On a node (or a container with the host's /proc at /proc): per-process attribution
    runs against the real driver without errors; holders appear where pods run."""
    async def scenario():
        collector = NvmlCollector(pynvml, "gpu-test", publisher, interval_s=1,
                                  event_wait_ms=200, proc_root="/proc")
        collector.open()
        try:
            return await collector.tick(), collector
        finally:
            collector.close()

    sample, collector = asyncio.run(scenario())
    assert len([d for d in sample.devices if d.kind == "gpu"]) == gpu_count
    errors = collector.metrics.registry.get_sample_value(
        "gpusteward_collect_source_errors_total",
        {"source": "nvml", "reason": "nvmlDeviceGetProcessUtilization"})
    assert not errors


@pytest.mark.e2e
def test_collect_nvml_process_on_the_real_driver(gpu_count, settings: Settings,
                                                 socket_path: Path) -> None:
    """The DaemonSet's command on a GPU node: the real driver, a kubelet that gives GPU 0
    to a pod, Kafka. Every GPU reaches the samples topic, GPU 0 attributed to its pod."""
    pynvml.nvmlInit()
    try:
        uuids = [str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
                 for i in range(gpu_count)]
    finally:
        pynvml.nvmlShutdown()
    kubelet = Kubelet(api_pb2.ListPodResourcesResponse(pod_resources=[
        kubelet_pod("ml", "train-0", container("trainer", "nvidia.com/gpu", uuids[0]))]))
    samples, _metrics = run_collect_nvml(settings, socket_path, kubelet, "gpu-node-real")
    assert len(samples) >= 3
    gpus = {d.uuid: d for d in samples[-1].devices if d.kind == "gpu"}
    assert sorted(gpus) == sorted(uuids)
    assert gpus[uuids[0]].pod == PodRef(namespace="ml", name="train-0", container="trainer")
    assert all(gpus[uuid].pod is None for uuid in uuids[1:])


CGROUP_ROOT = Path("/sys/fs/cgroup")
GIB = 1 << 30
CUDA_PROGRAM = """
import sys, time, torch
held = torch.empty(int(sys.argv[2]) << 20, dtype=torch.uint8, device="cuda")
a = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    if sys.argv[1] == "busy":
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    else:
        time.sleep(0.2)
"""


@contextmanager
def pod_process(uid: str, mode: str, mib: int) -> Iterator[subprocess.Popen[str]]:
    """A CUDA program (``busy``: matrix products without pause; ``idle``: holding ``mib`` MiB
    and its context, no work) running in a cgroup named as the kubelet's systemd driver names a
    pod's container, under a slice of the test's own (never the node's kubepods.slice)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch (with CUDA) to run a program on the GPU")
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        pytest.skip(f"no cgroup v2 at {CGROUP_ROOT} to run a process in a pod's cgroup")
    pod = (CGROUP_ROOT / "gpusteward-test.slice" / "kubepods.slice"
           / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice")
    scope = pod / f"cri-containerd-{secrets.token_hex(32)}.scope"
    try:
        scope.mkdir(parents=True)
    except OSError as e:
        pytest.skip(f"cannot make a pod's cgroup here: {e}")
    procs = scope / "cgroup.procs"
    process = subprocess.Popen(
        [sys.executable, "-c", CUDA_PROGRAM, mode, str(mib)], stdout=subprocess.PIPE,
        text=True, preexec_fn=lambda: procs.write_text(str(os.getpid())))
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield process
    finally:
        process.kill()
        process.wait()
        for directory in (scope, pod, pod.parent, pod.parent.parent):
            try:
                directory.rmdir()
            except OSError:  # another pod's cgroup is still in it
                break


def _first_gpu() -> str:
    pynvml.nvmlInit()
    try:
        return str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))
    finally:
        pynvml.nvmlShutdown()


def _time_slicing_kubelet(gpu: str) -> Kubelet:
    """The kubelet of a node whose GPU ``gpu`` is time-sliced: one replica each to two
    notebooks, ``nb/busy`` and ``nb/idle``."""
    return Kubelet(api_pb2.ListPodResourcesResponse(pod_resources=[
        kubelet_pod("nb", "busy", container("jupyter", "nvidia.com/gpu", f"{gpu}::0")),
        kubelet_pod("nb", "idle", container("jupyter", "nvidia.com/gpu", f"{gpu}::1"))]))


def test_a_time_sliced_real_gpu_is_split_between_the_pods_running_on_it(
        gpu_count, publisher, socket_path: Path) -> None:
    """Two pods time-slicing GPU 0, each a real CUDA process in its pod's cgroup: the busy one
    and the idle one are told apart by the driver's per-process readings, each with its own
    activity and memory, as the idle rule needs to find the idle pod and only it."""
    gpu = _first_gpu()
    busy_uid, idle_uid = str(uuid.uuid4()), str(uuid.uuid4())
    kubelet = _time_slicing_kubelet(gpu)

    async def scenario() -> tuple[list[NodeSample], NvmlCollector]:
        server = await serve_kubelet(kubelet, socket_path)
        collector = NvmlCollector(
            pynvml, "gpu-test", publisher, interval_s=1, event_wait_ms=200, proc_root="/proc",
            pod_resources=PodResourcesClient(str(socket_path), timeout_s=2))
        collector.open()
        try:
            samples = []
            for _ in range(3):
                await asyncio.sleep(1)
                samples.append(await collector.tick())
            return samples, collector
        finally:
            collector.close()
            assert collector.pod_resources is not None
            await collector.pod_resources.close()
            await server.stop(None)

    with ExitStack() as pods:
        pods.enter_context(pod_process(busy_uid, "busy", 2048))
        pods.enter_context(pod_process(idle_uid, "idle", 1024))
        samples, collector = asyncio.run(scenario())
    device = next(d for d in samples[-1].devices if d.uuid == gpu)
    assert device.attribution == "process"
    holders = {h.pod_uid: h for h in device.holders}
    assert set(holders) == {busy_uid, idle_uid}
    busy, idle = holders[busy_uid], holders[idle_uid]
    assert (busy.processes, idle.processes) == (1, 1)
    assert busy.activity_pct is not None and busy.activity_pct > 30
    assert idle.activity_pct is not None and idle.activity_pct < 5
    assert busy.mem_used_bytes is not None and busy.mem_used_bytes >= 2 * GIB
    assert idle.mem_used_bytes is not None and GIB <= idle.mem_used_bytes < 2 * GIB
    assert _source_errors(collector) == {}


@pytest.mark.e2e
def test_an_idle_pod_on_a_real_gpu_is_found_by_the_deployed_worker(
        gpu_count, settings: Settings, socket_path: Path, tmp_path: Path) -> None:
    """The deployed path on a real GPU: ``gpusteward collect nvml`` as the DaemonSet runs it
    (the real driver, the host's /proc, a kubelet double) and ``gpusteward worker`` (a
    policy file whose idle window is 15 s) on the embedded broker, with the watcher's
    allocation records for two notebooks time-slicing GPU 0, each a real CUDA program in its
    pod's cgroup: the idle one is found idle, under its name, and the busy one is not."""
    gpu, node = _first_gpu(), "gpu-node-real"
    uids = {"busy": str(uuid.uuid4()), "idle": str(uuid.uuid4())}
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  idle_holder:\n    window_s: 15\n    grace_s: 0\n")
    kubelet = _time_slicing_kubelet(gpu)
    env = {**os.environ, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
           "GPUSTEWARD_COLLECT__NVML__POD_RESOURCES_SOCKET": str(socket_path),
           "GPUSTEWARD_COLLECT__NVML__PROC_ROOT": "/proc"}
    command = [str(Path(sys.executable).parent / "gpusteward"), "collect", "nvml",
               "--node", node, "--interval", "1", "--metrics-port", "0",
               "--bootstrap", settings.kafka.bootstrap_servers, "--loglevel", "warning"]

    def idle_found(findings: list[Finding]) -> list[Finding]:
        return [f for f in findings if f.kind == "idle_holder" and f.state == "firing"]

    async def publish_allocations() -> None:
        await kafka.ensure_topics(settings)
        publisher = KafkaPublisher(settings)
        await publisher.start()
        try:
            now = time.time()
            for name, uid in uids.items():
                await publisher.allocation(PodAllocation(
                    ts=now, node=node, pod=PodRef(namespace="nb", name=name, uid=uid),
                    phase="running", gpus=1, started_at=now - 3600, workload_kind="notebook",
                    owner_kind="StatefulSet", owner_name=name))
            await publisher.flush()
        finally:
            await publisher.stop()

    async def collect_until_found() -> list[Finding]:
        server = await serve_kubelet(kubelet, socket_path)
        collector = await asyncio.create_subprocess_exec(*command, env=env)
        try:
            deadline = time.monotonic() + 90
            findings: list[Finding] = []
            while time.monotonic() < deadline and not idle_found(findings):
                await asyncio.sleep(2)
                assert collector.returncode is None, "the collector exited"
                findings = await decoded(settings, topics.FINDINGS, Finding)
            await asyncio.sleep(10)  # time for the busy pod to be found too, were it wrongly
            return await decoded(settings, topics.FINDINGS, Finding)
        finally:
            collector.terminate()
            await collector.wait()
            await server.stop(None)

    asyncio.run(publish_allocations())
    with ExitStack() as running:
        running.enter_context(pod_process(uids["busy"], "busy", 2048))
        running.enter_context(pod_process(uids["idle"], "idle", 1024))
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(os.environ, "GPUSTEWARD_POLICY_FILE", str(policy))
            worker = WorkerProcess(settings, tmp_path / "worker.log")
            worker.start()
        try:
            worker.wait_ready(120)
            findings = asyncio.run(collect_until_found())
        finally:
            worker.stop()
    found = idle_found(findings)
    assert [(f.subject.pod.namespace, f.subject.pod.name, f.subject.device)
            for f in found if f.subject.pod is not None] == [("nb", "idle", gpu)], findings
    assert all(f.subject.pod is not None for f in found)
