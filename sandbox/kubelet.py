"""A kubelet's PodResources API for a simulated node: a real gRPC server on a unix socket.

The NVML collector learns which pod holds which device from the kubelet's
``v1.PodResourcesLister`` (``List``), over gRPC on a unix socket. This server
speaks that protocol for real (grpc.aio, the generated servicer), answering
from the simulated world, so the collector's client, the socket, the
protobuf messages and the device-id mapping all run as on a node. Like the
real kubelet, the answer names pods by namespace and name only: there is no
pod uid in the message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpusteward.collectors.podresources import api_pb2, api_pb2_grpc


@dataclass(frozen=True)
class Assignment:
    """One device the device plugin gave to a pod's container."""

    namespace: str
    pod: str
    container: str
    resource: str
    """``nvidia.com/gpu`` or ``nvidia.com/mig-<profile>`` (the mixed MIG strategy)."""
    device_id: str
    """The GPU or MIG uuid, as the NVIDIA device plugin reports it; for a DRA device, the
    driver's device name (``gpu-0``)."""
    claim: str | None = None
    """The ResourceClaim (in the pod's namespace) of a device the DRA driver gave: the
    kubelet then names it as a dynamic resource (driver, pool, device), not by uuid."""
    driver: str = "gpu.nvidia.com"
    pool: str = ""
    """A DRA device's pool: NVIDIA's driver names it after the node."""


def list_response(assignments: Iterable[Assignment]) -> api_pb2.ListPodResourcesResponse:
    """``List``'s answer: one PodResources per pod, one ContainerResources per container;
    a DRA device among the container's ``dynamic_resources``, by claim."""
    pods: dict[tuple[str, str], dict[str, list[Assignment]]] = {}
    for item in assignments:
        pods.setdefault((item.namespace, item.pod), {}).setdefault(item.container, []
                                                                    ).append(item)
    answer = []
    for (namespace, name), containers in sorted(pods.items()):
        answer.append(api_pb2.PodResources(namespace=namespace, name=name, containers=[
            api_pb2.ContainerResources(name=container, devices=[
                api_pb2.ContainerDevices(resource_name=item.resource,
                                         device_ids=[item.device_id])
                for item in items if item.claim is None], dynamic_resources=[
                api_pb2.DynamicResource(
                    claim_name=item.claim, claim_namespace=namespace, claim_resources=[
                        api_pb2.ClaimResource(
                            driver_name=item.driver, pool_name=item.pool,
                            device_name=item.device_id, cdi_devices=[api_pb2.CDIDevice(
                                name=f"k8s.{item.driver}/device={item.device_id}")])])
                for item in items if item.claim is not None])
            for container, items in sorted(containers.items())]))
    return api_pb2.ListPodResourcesResponse(pod_resources=answer)


class _Lister(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, assignments: Callable[[], Iterable[Assignment]]) -> None:
        self.assignments = assignments
        self.calls = 0

    async def List(self, request: Any, context: Any) -> api_pb2.ListPodResourcesResponse:
        self.calls += 1
        return list_response(self.assignments())


class KubeletPodResources:
    """``v1.PodResourcesLister`` on ``socket_path``, answering ``assignments()`` now."""

    def __init__(self, socket_path: Path, assignments: Callable[[], Iterable[Assignment]]
                 ) -> None:
        self.socket_path = socket_path
        self.lister = _Lister(assignments)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self.lister, self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
