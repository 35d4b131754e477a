"""Which pod holds which GPU or MIG device, from the kubelet PodResources API v1.

The kubelet serves ``v1.PodResourcesLister`` over gRPC on a unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``, no TLS: access is access
to the socket). ``List`` returns, per pod and container, the device ids the
device plugin assigned. This module maps them to devices the way
dcgm-exporter does (``internal/pkg/transformation/kubernetes.go``), so the
NVML collector attributes a device to the same pod dcgm-exporter would:

- only ``nvidia.com/gpu`` and ``nvidia.com/mig-*`` resources (plus any extra
  names configured) count;
- a device id is the GPU or MIG uuid; a ``::N`` suffix (device-plugin
  time-slicing replicas) and a ``/vgpuN`` suffix (GKE time sharing) are
  stripped; GKE's ``nvidia<i>/gi<g>`` names GPU instance ``g`` of GPU ``i``;
  the R450/R460 form ``MIG-GPU-<uuid>/<gi>/<ci>`` names GPU instance ``gi``
  of that GPU; index-style ids (``nvidia0``, ``0``) name whole GPUs.

The messages carry no pod uid (dcgm-exporter gets it from the API server),
so :class:`PodRef` has ``uid=None`` here. A device shared by several pods
(time slicing) is attributed to the first in (namespace, name, container)
order: the sample has room for one holder.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from gpusteward.collectors.podresources import api_pb2, api_pb2_grpc
from gpusteward.errors import TemporaryError
from gpusteward.schema import PodRef

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

_GKE_MIG = re.compile(r"^nvidia([0-9]+)/gi([0-9]+)(/vgpu[0-9]+)?$")
_OLD_MIG = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/([0-9]+)/([0-9]+)$")
_GKE_SHARED = re.compile(r"^(.+)/vgpu[0-9]+$")


class PodResourcesError(TemporaryError):
    """The kubelet's PodResources service could not be read."""


@dataclass(frozen=True)
class DeviceOwners:
    """Device keys -> the pod holding the device, as the kubelet last reported them."""

    by_key: dict[str, PodRef] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by_key)

    def gpu(self, uuid: str, index: int) -> PodRef | None:
        """The holder of a whole GPU."""
        return (self.by_key.get(uuid) or self.by_key.get(f"nvidia{index}")
                or self.by_key.get(str(index)))

    def mig(self, uuid: str, *, parent_uuid: str, parent_index: int,
            gpu_instance_id: int | None) -> PodRef | None:
        """The holder of a MIG device."""
        if gpu_instance_id is None:
            return self.by_key.get(uuid)
        return (self.by_key.get(uuid)
                or self.by_key.get(f"gi:{parent_index}-{gpu_instance_id}")
                or self.by_key.get(f"gi:{parent_uuid}/{gpu_instance_id}"))


def device_keys(device_id: str) -> list[str]:
    """The lookup keys one kubelet device id stands for (the raw id first)."""
    keys = [device_id]
    bare = device_id.split("::", 1)[0]
    shared = _GKE_SHARED.match(bare)
    if match := _GKE_MIG.match(bare):
        keys.append(f"gi:{int(match.group(1))}-{int(match.group(2))}")
    elif match := _OLD_MIG.match(bare):
        keys.append(f"gi:{match.group(1)}/{int(match.group(2))}")
    elif shared:
        keys.append(shared.group(1))
    else:
        keys.append(bare)
    return list(dict.fromkeys(keys))


def is_gpu_resource(name: str, extra: Iterable[str] = ()) -> bool:
    return name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX) or name in extra


def owners_from_response(response: api_pb2.ListPodResourcesResponse,
                         extra_resources: Iterable[str] = ()) -> DeviceOwners:
    """Map every NVIDIA device id in a List answer to its pod and container."""
    extra = frozenset(extra_resources)
    held: list[tuple[tuple[str, str, str], str]] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if not is_gpu_resource(devices.resource_name, extra):
                    continue
                for device_id in devices.device_ids:
                    held.append(((pod.namespace, pod.name, container.name), device_id))
    by_key: dict[str, PodRef] = {}
    for (namespace, name, container_name), device_id in sorted(held):
        ref = PodRef(namespace=namespace, name=name, container=container_name or None)
        for key in device_keys(device_id):
            by_key.setdefault(key, ref)
    return DeviceOwners(by_key)


class PodResourcesClient:
    """An asyncio client of ``v1.PodResourcesLister`` on a unix socket."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout_s: float = 5.0,
                 extra_resources: Iterable[str] = ()) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.extra_resources = tuple(extra_resources)
        self._channel: grpc.aio.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None

    def _lister(self) -> api_pb2_grpc.PodResourcesListerStub:
        if self._stub is None:
            # unix:///abs/path is gRPC's naming scheme for a unix socket.
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket_path}")
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def list(self) -> api_pb2.ListPodResourcesResponse:
        """The kubelet's ``List`` answer; :class:`PodResourcesError` when it cannot be had."""
        try:
            response: api_pb2.ListPodResourcesResponse = await self._lister().List(
                api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PodResourcesError(
                f"PodResources List on {self.socket_path}: {e.code().name}: "
                f"{(e.details() or '')[:200]}") from e
        return response

    async def owners(self) -> DeviceOwners:
        return owners_from_response(await self.list(), self.extra_resources)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
