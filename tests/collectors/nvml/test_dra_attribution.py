"""GPUs and MIG devices held through Dynamic Resource Allocation, credited to their pods by
the NVML collector from the kubelet's ``dynamic_resources``.

The kubelet is the sandbox's double (``sandbox/kubelet.py``), a real gRPC server on a unix
socket answering DRA devices as a kubelet does (claim, driver, pool, the driver's device
name and CDI id: no uuid); the GPUs are the fake NVML's. NVIDIA's DRA driver names a GPU
by its minor number and a MIG device by its GPU instance's profile id and placement.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from gpusteward.collectors import attribution
from gpusteward.collectors.attribution import PodResourcesClient
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.sandbox.kubelet import Assignment, KubeletPodResources
from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.schema import NodeSample, PodRef

PROC = Path(__file__).resolve().parents[2] / "data" / "proc"
UID = "0f1e2d3c-0000-4000-8000-00000000000{}".format
GPU = "GPU-d7a00000-0000-4000-8000-00000000000{}".format
MIG_LOW, MIG_HIGH = (f"MIG-d7a00000-0000-4000-8000-00000000010{i}" for i in range(2))
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(("name", "key"), [
    ("gpu-3", "nvidia3"),                          # a whole GPU, by its minor number
    ("gpu-1-mig-9-4-4", "mig:1/9/4"),              # v25.3, v25.8: profile id, start, size
    ("gpu-0-mig-3g40gb-9-4", "mig:0/9/4"),         # v25.12: profile name, id, start
    ("gpu-2-mig-1g10gb-me-19-6", "mig:2/19/6"),    # a profile name with a dash (1g.10gb+me)
    ("gpu-vfio-0", None),                          # passed through to a VM: no NVML device
    ("gpu-0-mig-x", None),
    ("nic-0", None),
])
def test_nvidia_dra_device_names(name, key):
    assert attribution.dra_device_key(name) == key


def _node() -> FakeNvml:
    """Four H100s whose minor numbers are not their NVML indices: GPU 0 (minor 1) whole,
    GPU 1 (minor 0) split into two 3g.40gb at memory slices 0 and 4, GPU 2 (minor 3) given
    by the device plugin, GPU 3 (minor 2) shared by two pods."""
    return FakeNvml({"gpus": [
        {"uuid": GPU(0), "name": H100, "minor": 1, "util_gpu": 90,
         "processes": [{"pid": 4106, "mem_used": "70 GiB", "sm_util": 90}]},
        {"uuid": GPU(1), "name": H100, "minor": 0, "gpm": True, "mig": {"devices": [
            {"uuid": MIG_LOW, "profile": "3g.40gb", "profile_id": 9, "gpu_instance_id": 2,
             "placement_start": 0, "placement_size": 4},
            {"uuid": MIG_HIGH, "profile": "3g.40gb", "profile_id": 9, "gpu_instance_id": 1,
             "placement_start": 4, "placement_size": 4}]}},
        {"uuid": GPU(2), "name": H100, "minor": 3, "util_gpu": 50},
        {"uuid": GPU(3), "name": H100, "minor": 2, "util_gpu": 80,
         "processes": [{"pid": 4101, "mem_used": "10 GiB", "sm_util": 80},
                       {"pid": 4102, "mem_used": "4 GiB", "sm_util": 0}]},
    ]})


def _claim(namespace: str, pod: str, container: str, device: str, claim: str,
           driver: str = "gpu.nvidia.com") -> Assignment:
    return Assignment(namespace, pod, container, "", device, claim=claim, driver=driver,
                      pool="node-a")


KUBELET = [
    _claim("ml", "train-dra", "trainer", "gpu-1", "train-dra-gpu-7fk2q"),
    _claim("nb", "mig-a", "jupyter", "gpu-0-mig-9-0-4", "mig-a-gpu-p2x8d"),
    _claim("nb", "mig-b", "jupyter", "gpu-0-mig-3g40gb-9-4", "mig-b-gpu-q9w1z"),
    Assignment("ml", "plugin-pod", "main", "nvidia.com/gpu", GPU(2)),
    _claim("nb", "busy", "jupyter", "gpu-2", "shared-gpu"),
    _claim("nb", "idle", "jupyter", "gpu-2", "shared-gpu"),
    # Another driver's device of the same name is not a GPU; a VFIO GPU is no NVML device.
    _claim("net", "rdma", "main", "gpu-1", "nic", driver="rdma.example.com"),
    _claim("vm", "guest", "compute", "gpu-vfio-0", "vm-gpu"),
    _claim("odd", "job", "main", "gpu-7-renamed", "odd-gpu"),
]


def _tick(assignments: list[Assignment], socket_path: Path, publisher, **options
          ) -> tuple[NodeSample, NvmlCollector]:
    kubelet = KubeletPodResources(socket_path, lambda: assignments)

    async def scenario() -> tuple[NodeSample, NvmlCollector]:
        await kubelet.start()
        collector = NvmlCollector(_node(), "node-a", publisher, interval_s=60,
                                  event_wait_ms=50,
                                  pod_resources=PodResourcesClient(str(socket_path)),
                                  **options)
        collector.open()
        try:
            return await collector.tick(), collector
        finally:
            collector.close()
            assert collector.pod_resources is not None
            await collector.pod_resources.close()
            await kubelet.stop()

    return asyncio.run(scenario())


def test_dra_devices_are_credited_to_their_pods(socket_path, publisher, caplog):
    caplog.set_level(logging.WARNING, "gpusteward.collectors.nvml")
    sample, collector = _tick(KUBELET, socket_path, publisher)
    devices = {d.uuid: d for d in sample.devices}

    assert (devices[GPU(0)].pod, devices[GPU(0)].attribution) == (
        PodRef(namespace="ml", name="train-dra", container="trainer"), "device")
    assert devices[GPU(1)].pod is None  # its MIG devices are held, not the GPU
    assert devices[MIG_LOW].pod == PodRef(namespace="nb", name="mig-a", container="jupyter")
    assert devices[MIG_HIGH].pod == PodRef(namespace="nb", name="mig-b", container="jupyter")
    assert devices[GPU(2)].pod == PodRef(namespace="ml", name="plugin-pod", container="main")
    shared = devices[GPU(3)]
    assert shared.attribution == "shared"
    assert [h.pod for h in shared.holders] == [PodRef(namespace="nb", name="busy"),
                                               PodRef(namespace="nb", name="idle")]

    unnamed = collector.metrics.registry.get_sample_value(
        "gpusteward_collect_source_errors_total", {"source": "nvml", "reason": "dra_device_name"})
    assert unnamed == 1
    warned = [r.getMessage() for r in caplog.records]
    assert any("gpu.nvidia.com node-a/gpu-7-renamed" in line for line in warned)
    assert not any("vfio" in line or "rdma" in line for line in warned)


def test_dra_holders_are_split_by_their_processes(socket_path, publisher):
    """With the host's /proc, a DRA GPU's processes name their pods: one pod alone on its
    GPU is named with its uid, a GPU shared through one claim is split by pod uid, each
    holder with its own activity, but the device stays ``shared``: the claim is one
    allocation, given back only once both pods are done, so the idle pod is not idle on a
    GPU its neighbour keeps busy (the worker judges a shared device idle for all its
    holders or for none)."""
    sample, _ = _tick(KUBELET, socket_path, publisher, proc_root=str(PROC))
    devices = {d.uuid: d for d in sample.devices}

    whole = devices[GPU(0)]
    assert (whole.attribution, whole.holders[0].pod) == ("process", PodRef(
        namespace="ml", name="train-dra", uid=UID(6), container="trainer"))
    shared = devices[GPU(3)]
    assert shared.attribution == "shared"
    assert [(h.pod_uid, h.activity_pct) for h in shared.holders] == [(UID(1), 80.0),
                                                                      (UID(2), 0.0)]
    assert shared.pod == PodRef(namespace="nb", name="busy", container="jupyter")


def test_dra_drivers_setting_limits_the_drivers_read(socket_path, publisher):
    assignments = [_claim("ml", "train-dra", "trainer", "gpu-1", "c"),
                   _claim("ml", "other", "main", "gpu-3", "d", driver="gpu.example.com")]

    async def owners(drivers: list[str]):
        kubelet = KubeletPodResources(socket_path, lambda: assignments)
        await kubelet.start()
        client = PodResourcesClient(str(socket_path), dra_drivers=drivers)
        try:
            return await client.owners()
        finally:
            await client.close()
            await kubelet.stop()

    default = asyncio.run(owners(["gpu.nvidia.com"]))
    assert default.gpu(GPU(0), 0, minor=1) == PodRef(namespace="ml", name="train-dra",
                                                     container="trainer")
    assert default.gpu(GPU(2), 2, minor=3) is None
    other = asyncio.run(owners(["gpu.example.com"]))
    assert other.gpu(GPU(0), 0, minor=1) is None
    assert other.gpu(GPU(2), 2, minor=3).name == "other"
