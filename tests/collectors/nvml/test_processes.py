"""Per-process attribution: cgroup paths to pods, the fake NVML's process calls, and the
collector splitting a shared GPU between its pods (fake /proc under tests/data/proc)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pynvml
import pytest

from gpusteward.collectors.attribution import (
    PodResourcesClient,
    ProcCgroups,
    ProcessShare,
    attribute,
    container_of,
)
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.collectors.podresources import api_pb2
from gpusteward.schema import DeviceHolder, PodRef

from .conftest import Kubelet, container, kubelet_pod, serve_kubelet, tick_beside_kubelet

PROC = Path(__file__).resolve().parents[2] / "data" / "proc"
GIB = 1 << 30
UID = "0f1e2d3c-0000-4000-8000-00000000000{}".format
SHARED, EXCLUSIVE, MPS = (f"GPU-5a5a5a5a-0000-4000-8000-00000000000{i}" for i in range(3))


@pytest.mark.parametrize(("pid", "uid", "container_id"), [
    (4101, UID(1), "a" * 64),   # containerd, systemd driver, cgroup v2
    (4102, UID(2), "b" * 64),   # containerd, cgroupfs, v1 with several controllers
    (4103, UID(3), "c" * 64),   # CRI-O, systemd, v2
    (4104, UID(4), "d" * 64),   # CRI-O, cgroupfs, v1
    (4106, UID(6), "e" * 64),   # Guaranteed QoS: no qos slice
    (4107, UID(7), None),       # the pod's own cgroup
    (4108, UID(3), None),       # CRI-O's conmon: the pod's, but no container
])
def test_cgroup_paths_name_pod_and_container(pid, uid, container_id):
    where = ProcCgroups(PROC).container_of(pid)
    assert where is not None
    assert (where.pod_uid, where.container_id) == (uid, container_id)


@pytest.mark.parametrize("pid", [4105, 99999])  # a host daemon; a process gone
def test_processes_outside_pods_have_no_pod(pid):
    assert ProcCgroups(PROC).container_of(pid) is None


def test_a_pod_like_word_outside_kubepods_is_no_pod():
    assert container_of("0::/user.slice/pod0f1e2d3c-0000-4000-8000-000000000001/x\n") is None


def _share(pid: int, mem_gib: float | None, sm: float | None, mps: bool = False
           ) -> ProcessShare:
    return ProcessShare(pid, None if mem_gib is None else int(mem_gib * GIB), sm, mps)


def test_one_listed_pod_alone_on_the_device_is_named_with_its_container():
    pod = PodRef(namespace="ml", name="train-0", container="trainer")
    found = attribute([_share(4106, 70, 95), _share(4105, 0.5, 0)], [pod], ProcCgroups(PROC))
    assert found.holders == [DeviceHolder(
        pod=PodRef(namespace="ml", name="train-0", uid=UID(6), container="trainer"),
        processes=1, activity_pct=95.0, mem_used_bytes=70 * GIB)]
    assert (found.outside_pods, found.unallocated_pods) == (1, 0)


def test_a_shared_device_splits_by_pod_uid_each_with_its_own_activity_and_memory():
    listed = [PodRef(namespace="nb", name="busy", container="jupyter"),
              PodRef(namespace="nb", name="idle", container="jupyter")]
    found = attribute([_share(4101, 10, 80), _share(4102, 4, 0)], listed, ProcCgroups(PROC))
    by_uid = {h.pod_uid: h for h in found.holders}
    assert set(by_uid) == {UID(1), UID(2)}  # PodResources has no uid: the worker joins them
    assert (by_uid[UID(1)].activity_pct, by_uid[UID(1)].mem_used_bytes) == (80.0, 10 * GIB)
    assert (by_uid[UID(2)].activity_pct, by_uid[UID(2)].mem_used_bytes) == (0.0, 4 * GIB)
    assert all(h.pod is None for h in found.holders)
    assert found.unallocated_pods == 0


def test_pods_beyond_those_listed_are_counted_and_unknown_readings_stay_absent():
    found = attribute([_share(4101, None, None), _share(4103, 2, None, mps=True)],
                      [PodRef(namespace="nb", name="busy")], ProcCgroups(PROC))
    assert found.unallocated_pods == 1
    first, second = found.holders
    assert (first.activity_pct, first.mem_used_bytes, first.mps) == (None, None, False)
    assert (second.mem_used_bytes, second.mps) == (2 * GIB, True)


def test_fake_process_calls_have_pynvml_shapes_and_errors(fake_nvml):
    nvml = fake_nvml("shared-node")
    nvml.nvmlInit()
    shared = nvml.nvmlDeviceGetHandleByIndex(0)
    procs = nvml.nvmlDeviceGetComputeRunningProcesses(shared)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [
        (4101, 10 * GIB), (4102, 4 * GIB), (4105, GIB // 2)]
    assert procs[0].gpuInstanceId == 0xFFFFFFFF
    samples = nvml.nvmlDeviceGetProcessUtilization(shared, 0)
    assert isinstance(samples[0], pynvml.c_nvmlProcessUtilizationSample_t)
    assert {s.pid: s.smUtil for s in samples} == {4101: 80, 4102: 0, 4105: 0}
    newest = max(s.timeStamp for s in samples)
    for process in nvml.gpu(0).processes:
        process.sm_util = None
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetProcessUtilization(shared, newest)
    mps = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(mps) == []
    assert [p.pid for p in nvml.nvmlDeviceGetMPSComputeRunningProcesses(mps)] == [4103, 4104]


def test_the_collector_splits_time_sliced_and_mps_gpus_between_their_pods(
        socket_path, fake_nvml, publisher):
    # Time-slicing replicas (GPU::0, GPU::1) to two notebooks, the whole GPU 1 to a trainer,
    # GPU 2 to two MPS inference clients.
    kubelet = Kubelet(api_pb2.ListPodResourcesResponse(pod_resources=[
        kubelet_pod("nb", "busy", container("jupyter", "nvidia.com/gpu", f"{SHARED}::0")),
        kubelet_pod("nb", "idle", container("jupyter", "nvidia.com/gpu", f"{SHARED}::1")),
        kubelet_pod("ml", "train-0", container("trainer", "nvidia.com/gpu", EXCLUSIVE)),
        kubelet_pod("serve", "a", container("server", "nvidia.com/gpu", f"{MPS}::0")),
        kubelet_pod("serve", "b", container("server", "nvidia.com/gpu", f"{MPS}::1")),
    ]))

    async def scenario():
        server = await serve_kubelet(kubelet, socket_path)
        collector = NvmlCollector(
            fake_nvml("shared-node"), "node-a", publisher, interval_s=60, event_wait_ms=50,
            pod_resources=PodResourcesClient(str(socket_path), timeout_s=2),
            proc_root=str(PROC))
        collector.open()
        try:
            return await collector.tick(), collector
        finally:
            collector.close()
            assert collector.pod_resources is not None
            await collector.pod_resources.close()
            await server.stop(None)

    sample, collector = asyncio.run(scenario())
    devices = {d.uuid: d for d in sample.devices}
    shared = devices[SHARED]
    assert shared.attribution == "process"
    assert [(h.pod_uid, h.activity_pct, h.mem_used_bytes) for h in shared.holders] == [
        (UID(1), 80.0, 10 * GIB), (UID(2), 0.0, 4 * GIB)]
    assert shared.pod == PodRef(namespace="nb", name="busy", container="jupyter")  # old field
    exclusive = devices[EXCLUSIVE]
    assert exclusive.holders[0].pod == PodRef(namespace="ml", name="train-0", uid=UID(6),
                                              container="trainer")
    assert exclusive.pod == exclusive.holders[0].pod
    mps = devices[MPS]
    assert [(h.pod_uid, h.mps, h.activity_pct) for h in mps.holders] == [
        (UID(3), True, 45.0), (UID(4), True, 15.0)]
    outside = collector.metrics.registry.get_sample_value(
        "gpusteward_collect_source_errors_total",
        {"source": "nvml", "reason": "process_outside_pods"})
    assert outside == 1  # the host process on GPU 0


def test_without_host_proc_a_shared_gpu_is_marked_shared(socket_path, fake_nvml, publisher):
    kubelet = Kubelet(api_pb2.ListPodResourcesResponse(pod_resources=[
        kubelet_pod("nb", "busy", container("jupyter", "nvidia.com/gpu", f"{SHARED}::0")),
        kubelet_pod("nb", "idle", container("jupyter", "nvidia.com/gpu", f"{SHARED}::1")),
        kubelet_pod("ml", "train-0", container("trainer", "nvidia.com/gpu", EXCLUSIVE)),
    ]))

    sample = tick_beside_kubelet(fake_nvml("shared-node"), kubelet, socket_path, publisher,
                                 interval_s=60, event_wait_ms=50)
    devices = {d.uuid: d for d in sample.devices}
    assert devices[SHARED].attribution == "shared"
    assert [h.pod for h in devices[SHARED].holders] == [
        PodRef(namespace="nb", name="busy"), PodRef(namespace="nb", name="idle")]
    assert all(h.activity_pct is None for h in devices[SHARED].holders)
    assert (devices[EXCLUSIVE].attribution, devices[EXCLUSIVE].holders) == ("device", [])
    assert devices[MPS].attribution is None


def test_mig_devices_split_memory_by_process_but_have_no_per_process_activity(publisher):
    from gpusteward.sandbox.nvml_fake import FakeNvml

    mig_uuid = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
    nvml = FakeNvml({"gpus": [{
        "uuid": "GPU-66666666-7777-4888-9999-aaaaaaaaaaaa", "name": "NVIDIA H100 80GB HBM3",
        "gpm": True,
        # The parent's aggregate lists the instance's processes too: not read on MIG GPUs.
        "processes": [{"pid": 4101, "mem_used": "8 GiB", "sm_util": 50}],
        "mig": {"devices": [{
            "uuid": mig_uuid, "profile": "3g.40gb", "profile_id": 9, "gpu_instance_id": 1,
            "mem_total": "39.5 GiB", "mem_used": "12 GiB", "engine_active": 30.0,
            "processes": [{"pid": 4101, "mem_used": "8 GiB"},
                          {"pid": 4102, "mem_used": "4 GiB"}]}]}}]})
    collector = NvmlCollector(nvml, "node-a", publisher, interval_s=60, event_wait_ms=50,
                              proc_root=str(PROC))
    collector.open()
    try:
        sample = asyncio.run(collector.tick())
    finally:
        collector.close()
    devices = {d.uuid: d for d in sample.devices}
    assert devices["GPU-66666666-7777-4888-9999-aaaaaaaaaaaa"].holders == []
    mig = devices[mig_uuid]
    assert [(h.pod_uid, h.mem_used_bytes, h.activity_pct) for h in mig.holders] == [
        (UID(1), 8 * GIB, None), (UID(2), 4 * GIB, None)]
