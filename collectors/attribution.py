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
  ``nvidia<i>`` (GKE) is the device node ``/dev/nvidia<i>``: ``i`` is the
  GPU's minor number, as in dcgm-exporter's ``device`` label, which need
  not be its NVML enumeration index; a bare ``<i>`` (the NVIDIA device
  plugin's ``index`` id strategy) is the NVML index.

Devices handed out through Dynamic Resource Allocation come in a container's
``dynamic_resources`` instead (beta and on by default from Kubernetes 1.34,
feature gate ``KubeletPodResourcesDynamicResources``): per claim, each
device as (driver, pool, device name) with its CDI device ids. Neither
carries a uuid: NVIDIA's DRA driver (``gpu.nvidia.com``, NVIDIA/k8s-dra-driver-gpu)
names its devices after the GPU's minor number, and its CDI ids are
``k8s.gpu.nvidia.com/device=<device name>`` (or ``.../claim=<claim uid>-<device
name>``), so the name is what there is (:func:`dra_device_key`):

- ``gpu-<minor>``: the whole GPU ``/dev/nvidia<minor>`` (released drivers since
  v25.3.0; its release candidates used the NVML index);
- ``gpu-<minor>-mig-<profile>-<GI profile id>-<placement start>`` (v25.12 on, the
  profile name without dots) or ``gpu-<minor>-mig-<GI profile id>-<placement
  start>-<placement size>`` (v25.3, v25.8): the MIG device of that GPU whose GPU
  instance has that profile id and placement, as ``nvmlGpuInstanceGetInfo``
  reports them;
- ``gpu-vfio-<i>``: a GPU passed through to a virtual machine, which NVML does
  not see.

The messages carry no pod uid (dcgm-exporter gets it from the API server),
so :class:`PodRef` has ``uid=None`` here. A device shared by several pods
(time slicing, MPS) keeps all of them (:meth:`DeviceOwners.gpu_holders`);
the sample's single ``pod`` stays the first in (namespace, name, container)
order for older consumers.

Per-process attribution (:func:`attribute`) splits a shared device between
its pods: NVML lists the host PIDs running on a device, and each PID's
``/proc/<pid>/cgroup`` (read under the host's /proc, mounted read-only into
the collector) names its pod uid and container id, in every form the
kubelet's cgroup drivers and the runtimes write (:func:`container_of`).
PodResources then checks the result: a pod named there is the one the
device was given to; pods found only by uid are left for the worker to join
by uid (PodResources carries no uid).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpusteward.collectors.podresources import api_pb2, api_pb2_grpc
from gpusteward.errors import TemporaryError
from gpusteward.schema import DeviceHolder, PodRef

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

_GKE_MIG = re.compile(r"^nvidia([0-9]+)/gi([0-9]+)(/vgpu[0-9]+)?$")
_OLD_MIG = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/([0-9]+)/([0-9]+)$")
_GKE_SHARED = re.compile(r"^(.+)/vgpu[0-9]+$")

NVIDIA_DRA_DRIVER = "gpu.nvidia.com"
_DRA_GPU = re.compile(r"^gpu-([0-9]+)$")
# v25.3 and v25.8: minor, GI profile id, placement start, placement size.
_DRA_MIG_SIZED = re.compile(r"^gpu-([0-9]+)-mig-([0-9]+)-([0-9]+)-[0-9]+$")
# v25.12 on: minor, profile name (``1g10gb``, ``1g10gb-me``: always a letter), GI profile id,
# placement start.
_DRA_MIG_NAMED = re.compile(r"^gpu-([0-9]+)-mig-[a-z0-9-]*[a-z][a-z0-9-]*-([0-9]+)-([0-9]+)$")
_DRA_VFIO = re.compile(r"^gpu-vfio-[0-9]+$")


class PodResourcesError(TemporaryError):
    """The kubelet's PodResources service could not be read."""


@dataclass(frozen=True)
class DeviceOwners:
    """Device keys -> the pods holding the device, as the kubelet last reported them, in
    (namespace, name, container) order."""

    by_key: dict[str, list[PodRef]] = field(default_factory=dict)
    unnamed: tuple[str, ...] = ()
    """DRA devices of the watched drivers (``driver pool/device``) whose name says no GPU or
    MIG device this module knows: held, but credited to no device."""
    one_claim: frozenset[tuple[PodRef, ...]] = frozenset()
    """The holders of each device that several pods hold through one ResourceClaim (and
    nothing else), as :meth:`gpu_holders` lists them."""

    def through_one_claim(self, holders: list[PodRef]) -> bool:
        """Whether ``holders`` (several) hold their device through one shared claim: one
        allocation, which the driver gives back only once all of them are done."""
        return len(holders) > 1 and tuple(holders) in self.one_claim

    def __len__(self) -> int:
        return len(self.by_key)

    def _first_of(self, *keys: str) -> list[PodRef]:
        for key in keys:
            found = self.by_key.get(key)
            if found:
                return found
        return []

    def gpu_holders(self, uuid: str, index: int, minor: int | None = None) -> list[PodRef]:
        """Every holder of a whole GPU (several under time-slicing or MPS).

        ``index`` is the NVML index, ``minor`` the minor number (``/dev/nvidia<minor>``;
        None: taken to equal the index).
        """
        minor = index if minor is None else minor
        return self._first_of(uuid, f"nvidia{minor}", str(index))

    def mig_holders(self, uuid: str, *, parent_uuid: str, parent_index: int,
                    gpu_instance_id: int | None, parent_minor: int | None = None,
                    placement: tuple[int, int] | None = None) -> list[PodRef]:
        """Every holder of a MIG device (``parent_minor`` as ``minor`` of
        :meth:`gpu_holders`: GKE's ``nvidia<minor>/gi<g>``, NVIDIA's DRA device names).

        ``placement`` is (GPU-instance profile id, placement start) of its GPU instance
        (``nvmlGpuInstanceGetInfo``), which NVIDIA's DRA driver names a MIG device by;
        None: not known, and DRA holders cannot be found.
        """
        minor = parent_index if parent_minor is None else parent_minor
        keys = [uuid]
        if gpu_instance_id is not None:
            keys += [f"gi:{minor}-{gpu_instance_id}", f"gi:{parent_uuid}/{gpu_instance_id}"]
        if placement is not None:
            keys.append(_mig_placement_key(minor, *placement))
        return self._first_of(*keys)

    def gpu(self, uuid: str, index: int, minor: int | None = None) -> PodRef | None:
        """The first holder of a whole GPU."""
        return next(iter(self.gpu_holders(uuid, index, minor)), None)

    def mig(self, uuid: str, *, parent_uuid: str, parent_index: int,
            gpu_instance_id: int | None, parent_minor: int | None = None,
            placement: tuple[int, int] | None = None) -> PodRef | None:
        """The first holder of a MIG device."""
        return next(iter(self.mig_holders(uuid, parent_uuid=parent_uuid,
                                          parent_index=parent_index,
                                          gpu_instance_id=gpu_instance_id,
                                          parent_minor=parent_minor,
                                          placement=placement)), None)


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


def _mig_placement_key(minor: int, profile_id: int, placement_start: int) -> str:
    return f"mig:{minor}/{profile_id}/{placement_start}"


def dra_device_key(device_name: str) -> str | None:
    """The lookup key of a device NVIDIA's DRA driver names ``device_name``: the whole GPU
    by its minor number (the key GKE's ``nvidia<minor>`` has), a MIG device by its parent's
    minor and its GPU instance's profile id and placement start. None for any other name."""
    if match := _DRA_GPU.match(device_name):
        return f"nvidia{int(match.group(1))}"
    if match := _DRA_MIG_SIZED.match(device_name) or _DRA_MIG_NAMED.match(device_name):
        return _mig_placement_key(*(int(group) for group in match.groups()))
    return None


def is_gpu_resource(name: str, extra: Iterable[str] = ()) -> bool:
    return name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX) or name in extra


def owners_from_response(response: api_pb2.ListPodResourcesResponse,
                         extra_resources: Iterable[str] = (),
                         dra_drivers: Iterable[str] = (NVIDIA_DRA_DRIVER,)) -> DeviceOwners:
    """Map every NVIDIA device in a List answer to its pod and container: the device
    plugin's ids, and the devices the ``dra_drivers`` gave through ResourceClaims."""
    extra, drivers = frozenset(extra_resources), frozenset(dra_drivers)
    held: list[tuple[tuple[str, str, str], list[str]]] = []
    unnamed: list[str] = []
    claims: dict[str, set[str | None]] = {}
    """Device key -> the claims it is held through (None: a device plugin's id)."""
    for pod in response.pod_resources:
        for container in pod.containers:
            holder = (pod.namespace, pod.name, container.name)
            for devices in container.devices:
                if not is_gpu_resource(devices.resource_name, extra):
                    continue
                for device_id in devices.device_ids:
                    keys = device_keys(device_id)
                    held.append((holder, keys))
                    claims.setdefault(keys[-1], set()).add(None)
            for claim in container.dynamic_resources:
                for device in claim.claim_resources:
                    if device.driver_name not in drivers:
                        continue
                    key = dra_device_key(device.device_name)
                    if key is not None:
                        held.append((holder, [key]))
                        claims.setdefault(key, set()).add(
                            f"{claim.claim_namespace}/{claim.claim_name}")
                    elif not _DRA_VFIO.match(device.device_name):  # no NVML device: not held here
                        unnamed.append(f"{device.driver_name} {device.pool_name}/"
                                       f"{device.device_name}")
    by_key: dict[str, list[PodRef]] = {}
    for (namespace, name, container_name), keys in sorted(held):
        ref = PodRef(namespace=namespace, name=name, container=container_name or None)
        for key in keys:
            holders = by_key.setdefault(key, [])
            if ref not in holders:  # several replicas (::0, ::1) of one GPU to one pod
                holders.append(ref)
    one_claim = frozenset(tuple(by_key[key]) for key, through in claims.items()
                          if len(through) == 1 and None not in through
                          and len(by_key.get(key, ())) > 1)
    return DeviceOwners(by_key, tuple(sorted(set(unnamed))), one_claim)


# --- per-process attribution ------------------------------------------------------------

# A pod's cgroup directory, in the kubelet's two cgroup-driver spellings: cgroupfs writes
# ``pod<uid>`` (dashes), systemd ``kubepods-<qos>-pod<uid>.slice`` (dashes turned to
# underscores, since a dash separates slice levels).
_POD_DIR = re.compile(
    r"(?:^|[/-])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
    r"(?:\.slice)?(?:/|$)")
# The container's cgroup: a bare id (cgroupfs, containerd and CRI-O), or a systemd scope
# named by the runtime (``cri-containerd-<id>.scope``, ``crio-<id>.scope``,
# ``docker-<id>.scope``). ``crio-conmon-<id>.scope`` is CRI-O's monitor, not the container.
_CONTAINER_DIR = re.compile(r"^(?:(cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True, slots=True)
class ContainerOf:
    """Where a process runs, from its cgroup path."""

    pod_uid: str
    container_id: str | None
    """The runtime's container id (64 hex digits); None for a process in the pod's own
    cgroup (the pod sandbox)."""


def container_of(cgroup_text: str) -> ContainerOf | None:
    """The pod and container of a process, from the text of its ``/proc/<pid>/cgroup``.

    Every line is ``hierarchy-id:controllers:path``: one ``0::path`` line under cgroup v2,
    one per controller under v1 (all naming the same pod). None for a process outside any
    pod (a host daemon, the driver's own threads).
    """
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1].strip()
        if "kubepods" not in path:
            continue
        pod = _POD_DIR.search(path)
        if pod is None:
            continue
        container = _CONTAINER_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
        return ContainerOf(pod_uid=pod.group(1).replace("_", "-"),
                           container_id=container.group(2) if container else None)
    return None


class ProcCgroups:
    """Reads ``<proc_root>/<pid>/cgroup``: the host's /proc, mounted into the collector."""

    def __init__(self, proc_root: str | Path = "/proc") -> None:
        self.root = Path(proc_root)

    def container_of(self, pid: int) -> ContainerOf | None:
        """None when the process is outside any pod, or gone, or not visible here."""
        try:
            text = (self.root / str(pid) / "cgroup").read_text()
        except OSError:  # exited between NVML's answer and this read, or no host /proc
            return None
        return container_of(text)


@dataclass(frozen=True, slots=True)
class ProcessShare:
    """One process on one device, as NVML reports it."""

    pid: int
    mem_used_bytes: int | None
    """None: NVML does not report it here (NVML_VALUE_NOT_AVAILABLE)."""
    sm_util_pct: float | None
    """Mean SM utilisation of the process's samples since the last read; None when the
    device gives no per-process samples (e.g. MIG devices)."""
    mps: bool = False


@dataclass
class Attributed:
    """The holders of one device, and the processes that could not be credited to a pod."""

    holders: list[DeviceHolder]
    outside_pods: int = 0
    """Processes in no pod's cgroup (host processes), or gone before they were read."""
    unallocated_pods: int = 0
    """Pods found running on the device beyond those PodResources lists for it (a
    container that sees every GPU, e.g. NVIDIA_VISIBLE_DEVICES=all)."""


def _sum(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def attribute(processes: Sequence[ProcessShare], candidates: Sequence[PodRef],
              cgroups: ProcCgroups) -> Attributed:
    """Split a device's processes between its pods, checked against PodResources.

    ``candidates`` are the pods PodResources lists for the device. One candidate pod and
    one pod found on the device: that is it, named (with its container when one container
    holds the device). Otherwise the pods found go by uid (PodResources has none), for the
    worker to join to their allocations.
    """
    by_uid: dict[str, list[ProcessShare]] = {}
    outside = 0
    for process in processes:
        where = cgroups.container_of(process.pid)
        if where is None:
            outside += 1
            continue
        by_uid.setdefault(where.pod_uid, []).append(process)
    named = list(dict.fromkeys(PodRef(namespace=c.namespace, name=c.name) for c in candidates))
    holders: list[DeviceHolder] = []
    for uid, own in sorted(by_uid.items()):
        pod: PodRef | None = None
        if len(named) == 1 and len(by_uid) == 1:
            containers = {c.container for c in candidates}
            container = containers.pop() if len(containers) == 1 else None
            pod = PodRef(namespace=named[0].namespace, name=named[0].name, uid=uid,
                         container=container)
        sm = _sum(p.sm_util_pct for p in own)
        holders.append(DeviceHolder(
            pod=pod, pod_uid=None if pod is not None else uid, processes=len(own),
            activity_pct=None if sm is None else min(100.0, float(sm)),
            mem_used_bytes=(None if all(p.mem_used_bytes is None for p in own)
                            else sum(p.mem_used_bytes or 0 for p in own)),
            mps=any(p.mps for p in own)))
    return Attributed(holders, outside_pods=outside,
                      unallocated_pods=max(0, len(by_uid) - len(named)))


class PodResourcesClient:
    """An asyncio client of ``v1.PodResourcesLister`` on a unix socket."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout_s: float = 5.0,
                 extra_resources: Iterable[str] = (),
                 dra_drivers: Iterable[str] = (NVIDIA_DRA_DRIVER,)) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.extra_resources = tuple(extra_resources)
        self.dra_drivers = tuple(dra_drivers)
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
        return owners_from_response(await self.list(), self.extra_resources, self.dra_drivers)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
