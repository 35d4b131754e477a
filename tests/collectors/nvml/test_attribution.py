"""Per-pod attribution from a real gRPC PodResources server on a unix socket."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gpusteward.collectors.attribution import (
    PodResourcesClient,
    PodResourcesError,
    device_keys,
    owners_from_response,
)
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.collectors.podresources import api_pb2, api_pb2_grpc
from gpusteward.schema import PodRef

WHOLE = "GPU-11111111-2222-4333-8444-555555555555"
MIG_PARENT = "GPU-66666666-7777-4888-9999-aaaaaaaaaaaa"
MIG_1 = "MIG-aaaaaaaa-0000-4000-8000-000000000001"


def _pod(namespace: str, name: str, *containers: api_pb2.ContainerResources
         ) -> api_pb2.PodResources:
    return api_pb2.PodResources(namespace=namespace, name=name, containers=list(containers))


def _container(name: str, resource: str, *device_ids: str) -> api_pb2.ContainerResources:
    return api_pb2.ContainerResources(name=name, devices=[
        api_pb2.ContainerDevices(resource_name=resource, device_ids=list(device_ids))])


# What a kubelet on the mixed node (tests/data/nvml/mixed-node.yaml) answers: a whole GPU
# to a training pod, MIG device 1 to a notebook under the mixed strategy, GPU instance 2
# of GPU 1 to an inference pod in GKE's notation, and a non-NVIDIA device to a third pod.
KUBELET_LIST = api_pb2.ListPodResourcesResponse(pod_resources=[
    _pod("ml", "train-0", _container("trainer", "nvidia.com/gpu", WHOLE),
         api_pb2.ContainerResources(name="sidecar")),
    _pod("research", "notebook-7", _container("jupyter", "nvidia.com/mig-3g.40gb", MIG_1)),
    _pod("serving", "llm-1", _container("server", "nvidia.com/gpu", "nvidia1/gi2")),
    _pod("infra", "fpga-job", _container("main", "example.com/fpga", "GPU-not-really")),
])


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResourcesLister, serving a fixed List answer."""

    def __init__(self, answer: api_pb2.ListPodResourcesResponse) -> None:
        self.answer = answer
        self.calls = 0
        self.fail: grpc.StatusCode | None = None

    async def List(self, request, context):  # the gRPC method name
        self.calls += 1
        if self.fail is not None:
            await context.abort(self.fail, "kubelet says no")
        return self.answer


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # A unix socket path must stay under ~107 bytes: pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="pr-"))
    yield directory / "kubelet.sock"
    shutil.rmtree(directory, ignore_errors=True)


async def _serve(kubelet: Kubelet, path: Path) -> grpc.aio.Server:
    server = grpc.aio.server()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


def test_client_reads_the_kubelet_over_its_unix_socket(socket_path):
    kubelet = Kubelet(KUBELET_LIST)

    async def scenario():
        server = await _serve(kubelet, socket_path)
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

    async def scenario():
        server = await _serve(kubelet, socket_path)
        collector = NvmlCollector(
            fake_nvml("mixed-node"), "node-a", publisher, registry=CollectorRegistry(),
            pod_resources=PodResourcesClient(str(socket_path), timeout_s=2))
        collector.open()
        try:
            return await collector.tick()
        finally:
            collector.close()
            assert collector.pod_resources is not None
            await collector.pod_resources.close()
            await server.stop(None)

    sample = asyncio.run(scenario())
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
        server = await _serve(kubelet, socket_path)
        collector = NvmlCollector(
            fake_nvml("mixed-node"), "node-a", publisher, registry=CollectorRegistry(),
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
            errors = collector.registry.get_sample_value(
                "gpusteward_nvml_source_errors_total", {"where": "pod_resources"})
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
        _pod("b", "second", _container("c", "nvidia.com/gpu", f"{WHOLE}::1")),
        _pod("a", "first", _container("c", "nvidia.com/gpu", f"{WHOLE}::0")),
    ])
    assert owners_from_response(answer).gpu(WHOLE, 0) == PodRef(
        namespace="a", name="first", container="c")
