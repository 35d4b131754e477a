"""Per-pod attribution from a real gRPC PodResources server on a unix socket."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gpusteward.collectors.attribution import (
    PodResourcesClient,
    PodResourcesError,
    device_keys,
    owners_from_response,
)
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.collectors.podresources import api_pb2
from gpusteward.schema import PodRef

from .conftest import (
    KUBELET_LIST,
    MIG_1,
    MIG_PARENT,
    WHOLE,
    Kubelet,
    container,
    kubelet_pod,
    serve_kubelet,
    tick_beside_kubelet,
)


def test_client_reads_the_kubelet_over_its_unix_socket(socket_path):
    kubelet = Kubelet(KUBELET_LIST)

    async def scenario():
        server = await serve_kubelet(kubelet, socket_path)
        client = PodResourcesClient(str(socket_path), timeout_s=2)
        try:
            return await client.owners()
        finally:
            await client.close()
            await server.stop(None)

    owners = asyncio.run(scenario())
    assert kubelet.calls == 1
    assert owners.gpu(WHOLE, 0) == PodRef(namespace="ml", name="train-0", container="trainer")
    assert owners.mig(MIG_1, parent_uuid=MIG_PARENT, parent_index=1, gpu_instance_id=1) == \
        PodRef(namespace="research", name="notebook-7", container="jupyter")
    assert owners.mig("MIG-other", parent_uuid=MIG_PARENT, parent_index=1,
                      gpu_instance_id=2).name == "llm-1"
    assert owners.gpu("GPU-not-really", 3) is None  # not an NVIDIA resource


def test_collector_attributes_gpus_and_mig_devices_to_pods(socket_path, fake_nvml, publisher):
    kubelet = Kubelet(KUBELET_LIST)

    sample = tick_beside_kubelet(fake_nvml("mixed-node"), kubelet, socket_path, publisher)
    pods = {d.uuid: d.pod for d in sample.devices}
    assert pods[WHOLE] == PodRef(namespace="ml", name="train-0", container="trainer")
    assert pods[MIG_PARENT] is None  # the MIG devices are held, not the parent GPU
    assert pods[MIG_1] == PodRef(namespace="research", name="notebook-7", container="jupyter")
    assert pods["MIG-aaaaaaaa-0000-4000-8000-000000000002"] == PodRef(
        namespace="serving", name="llm-1", container="server")


def test_a_failing_kubelet_keeps_sampling_then_drops_stale_attribution(
        socket_path, fake_nvml, publisher):
    kubelet = Kubelet(KUBELET_LIST)
    now = [1000.0]

    async def scenario():
        server = await serve_kubelet(kubelet, socket_path)
        collector = NvmlCollector(
            fake_nvml("mixed-node"), "node-a", publisher,
            pod_resources=PodResourcesClient(str(socket_path), timeout_s=2),
            pod_resources_refresh_s=5, pod_resources_max_age_s=30, clock=lambda: now[0])
        collector.open()
        try:
            fresh = await collector.tick()
            kubelet.fail = grpc.StatusCode.UNAVAILABLE
            now[0] += 10
            stale = await collector.tick()  # List fails; the 10 s old answer still holds
            now[0] += 30
            expired = await collector.tick()  # 40 s old: too old to credit anyone
            kubelet.fail = None
            now[0] += 5
            recovered = await collector.tick()
            errors = collector.metrics.registry.get_sample_value(
                "gpusteward_collect_source_errors_total",
                {"source": "nvml", "reason": "pod_resources"})
        finally:
            collector.close()
            assert collector.pod_resources is not None
            await collector.pod_resources.close()
            await server.stop(None)
        return fresh, stale, expired, recovered, errors

    fresh, stale, expired, recovered, errors = asyncio.run(scenario())
    assert fresh.devices[0].pod is not None and stale.devices[0].pod == fresh.devices[0].pod
    assert all(d.pod is None for d in expired.devices)
    assert len(expired.devices) == 4  # sampling never stopped
    assert recovered.devices[0].pod == fresh.devices[0].pod
    assert errors == 2
    assert kubelet.calls == 4


def test_no_kubelet_socket_is_a_clear_error(socket_path):
    async def scenario():
        client = PodResourcesClient(str(socket_path), timeout_s=1)
        try:
            await client.list()
        finally:
            await client.close()

    with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
        asyncio.run(scenario())


@pytest.mark.parametrize(("device_id", "key"), [
    ("GPU-abc", "GPU-abc"),
    ("GPU-abc::3", "GPU-abc"),                      # device-plugin time-slicing replica
    ("MIG-def::0", "MIG-def"),
    ("GPU-abc/vgpu2", "GPU-abc"),                   # GKE time sharing
    ("nvidia1/gi2", "gi:1-2"),                      # GKE MIG
    ("nvidia0/gi13/vgpu1", "gi:0-13"),
    ("MIG-GPU-6f2c1a30-8d1e-4c35/3/0", "gi:GPU-6f2c1a30-8d1e-4c35/3"),  # R450/R460 MIG ids
])
def test_device_id_forms(device_id, key):
    keys = device_keys(device_id)
    assert keys[0] == device_id and key in keys


def test_a_shared_gpu_goes_to_the_first_pod_in_a_stable_order():
    answer = api_pb2.ListPodResourcesResponse(pod_resources=[
        kubelet_pod("b", "second", container("c", "nvidia.com/gpu", f"{WHOLE}::1")),
        kubelet_pod("a", "first", container("c", "nvidia.com/gpu", f"{WHOLE}::0")),
    ])
    assert owners_from_response(answer).gpu(WHOLE, 0) == PodRef(
        namespace="a", name="first", container="c")


def test_nvidia_n_device_ids_name_the_gpu_by_its_minor_number(socket_path, fake_nvml, publisher):
    # /dev/nvidiaN (GKE's nvidiaN ids, dcgm-exporter's device label) is the minor number,
    # which need not follow NVML's enumeration order: here the two are swapped.
    fake = fake_nvml("mixed-node")
    fake.gpus[0].minor, fake.gpus[1].minor = 1, 0
    kubelet = Kubelet(api_pb2.ListPodResourcesResponse(pod_resources=[
        kubelet_pod("ml", "train-0", container("trainer", "nvidia.com/gpu", "nvidia1")),
        kubelet_pod("serving", "llm-1", container("server", "nvidia.com/gpu", "nvidia0/gi1")),
    ]))

    pods = {d.uuid: d.pod
            for d in tick_beside_kubelet(fake, kubelet, socket_path, publisher).devices}
    assert pods[WHOLE] == PodRef(namespace="ml", name="train-0", container="trainer")
    assert pods[MIG_PARENT] is None
    assert pods[MIG_1] == PodRef(namespace="serving", name="llm-1", container="server")


def test_a_bare_index_device_id_is_the_nvml_index_not_the_minor():
    # The NVIDIA device plugin's "index" id strategy names GPUs by NVML index.
    owners = owners_from_response(api_pb2.ListPodResourcesResponse(pod_resources=[
        kubelet_pod("ml", "by-index", container("c", "nvidia.com/gpu", "0")),
        kubelet_pod("ml", "by-node", container("c", "nvidia.com/gpu", "nvidia3")),
    ]))
    assert [p.name for p in owners.gpu_holders(WHOLE, 0, minor=5)] == ["by-index"]
    assert [p.name for p in owners.gpu_holders(MIG_PARENT, 1, minor=3)] == ["by-node"]
    assert owners.gpu_holders(MIG_PARENT, 3, minor=1) == []
