"""The simulated world as the production edges see it: GPUs, kubelets and an API server.

The simulator decides what happens (who runs where, how busy each GPU is,
which GPU fails); this module turns each decision into the state real
sources read, and lets the production readers read it:

- per node, a fake NVML (:class:`~gpusteward.sandbox.nvml_fake.FakeNvml`)
  whose readings and faults follow the simulator, a real kubelet
  PodResources gRPC server on a unix socket (pods by namespace and name, no
  uid, as a kubelet answers), and the production
  :class:`~gpusteward.collectors.nvml.NvmlCollector` reading both;
- on a shared GPU (time-slicing or MPS replicas), one process per pod in the
  fake NVML (an MPS client under MPS) with the pod's own memory and SM
  utilisation, its ``/proc/<pid>/cgroup`` under a host /proc of the world's
  (containerd under the systemd driver, cgroup v2, as on most nodes), and one
  replica device id per pod (``<uuid>::<n>``) at the kubelet: the collector
  splits the GPU between its pods as it does on a real node;
- on a node whose GPUs NVIDIA's DRA driver hands out (``allocation: dra``), the
  kubelet names each pod's devices as dynamic resources (claim, pool, device
  name), not by uuid, as a kubelet does for DRA: the collector maps the driver's
  device names to the GPUs (by minor number) and MIG devices (by GPU-instance
  profile and placement) the fake NVML reports;
- the Kubernetes API-server double holding the Nodes and Pods (and, for DRA,
  the ResourceSlices and ResourceClaims) a real cluster would hold, and the
  production
  :class:`~gpusteward.collectors.kubernetes.KubeWatcher` listing and
  watching it;
- optionally (``dcgm_pages``), the dcgm-exporter page of every node
  (:mod:`gpusteward.sandbox.dcgm_pages`), for the dcgm collector or a real
  Prometheus to scrape;
- and back: what the deployed executor writes into the double (a cordon)
  reaches the simulated cluster, which stops placing pods there.

The collectors and the watcher run here, in-process, because their clocks
must be the simulation's: the world runs hours of simulated time in
seconds, and a collector in its own process would stamp samples with the
wall clock. They run the production classes, through the production
protocols (NVML calls, gRPC, list/watch over HTTP) and the production Kafka
publisher; everything downstream (worker, alert sink, executor, sinks,
report) runs as the separate processes ``deploy/`` declares
(:mod:`gpusteward.sandbox.deployment`).

The world is a :class:`~gpusteward.collectors.transport.publisher.Publisher` for the
simulator: what the simulator would have published becomes world state.

It stays one module because the NVML side, the API side and the write-back share one
clock and one step order; split, each half would need the other's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusteward.collectors.attribution import PodResourcesClient
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.remediation.kubernetes import (
    NOTEBOOK_STOPPED,
    NOTICE_ANNOTATION,
    RECLAIMED_BECAUSE,
)
from gpusteward.sandbox.dcgm_pages import DcgmPages
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_mirror import (
    KubeMirrorPublisher,
    dra_claim_name,
    dra_device_names,
    dra_shared_claim_name,
    mig_placements,
)
from gpusteward.sandbox.kubelet import Assignment, KubeletPodResources
from gpusteward.sandbox.nvml_fake import FakeGpu, FakeMig, FakeNvml, FakeProcess
from gpusteward.schema import (
    AllocationEvent,
    DeviceSample,
    HwEvent,
    NodeSample,
    PodRef,
    QueueEvent,
)

if TYPE_CHECKING:
    from gpusteward.collectors.kubernetes import KubeWatcher
    from gpusteward.sandbox.simulator.engine import SimNode, SimulatedCluster

log = logging.getLogger(__name__)

EVENT_DELIVERY_TIMEOUT_S = 10.0
"""How long the world waits for the collector to publish an NVML event it raised."""

class _CountingPublisher:
    """Forwards a node collector's records; lets the world wait for its hardware events."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.hw_events = 0
        self.samples = 0
        self._changed = asyncio.Condition()

    async def sample(self, sample: NodeSample) -> None:
        await self.inner.sample(sample)
        self.samples += 1

    async def hw_event(self, event: HwEvent) -> None:
        await self.inner.hw_event(event)
        async with self._changed:
            self.hw_events += 1
            self._changed.notify_all()

    async def allocation(self, event: AllocationEvent) -> None:
        await self.inner.allocation(event)

    async def queue(self, event: QueueEvent) -> None:
        await self.inner.queue(event)

    async def flush(self) -> None:
        await self.inner.flush()

    async def wait_for_events(self, count: int, timeout_s: float) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.hw_events >= count),
                                   timeout_s)


def fake_gpu(gpu: Any) -> dict[str, Any]:
    """A simulated GPU as the fake NVML's description (its YAML keys).

    A MIG device's GPU-instance profile id and placement come from the MIG geometry file
    (:func:`~gpusteward.sandbox.kube_mirror.mig_placements`), so the collector maps them back
    to the profile name, and to the device NVIDIA's DRA driver names, as on a real GPU.
    """
    spec: dict[str, Any] = {"uuid": gpu.uuid, "name": gpu.model, "mem_total": gpu.mem_total,
                            "nvlink": {"crc_flit": 0, "crc_data": 0, "replay": 0,
                                       "recovery": 0}}
    if gpu.mig:
        placements = mig_placements(gpu)
        spec["gpm"] = True  # the simulator reports MIG engine activity on every model
        spec["mig"] = {"enabled": True, "devices": [
            {"uuid": mig.uuid, "profile": mig.profile,
             "profile_id": placements[mig.uuid][0], "placement_start": placements[mig.uuid][1],
             "placement_size": placements[mig.uuid][2],
             "gpu_instance_id": mig.gpu_instance_id} for mig in gpu.mig]}
    return spec


class NodeGpus:
    """One simulated node's GPUs, its kubelet socket and the NVML collector reading them."""

    def __init__(self, node: SimNode, socket_dir: Path, publisher: Publisher,
                 cluster: SimulatedCluster, proc_root: Path, pid_numbers: Iterator[int]) -> None:
        self.name = node.name
        self.nvml = FakeNvml({"gpus": [fake_gpu(gpu) for gpu in node.gpus]})
        self.proc_root = proc_root
        self.pid_numbers = pid_numbers
        """Host pids, shared by the world's nodes: one /proc holds them all."""
        self._pids: dict[tuple[str, str, str], int] = {}
        """(GPU uuid, namespace, pod) -> the pid of the pod's process on the GPU."""
        self.assignments: list[Assignment] = []
        self.dra_names = dra_device_names(node) if node.dra else None
        """GPU or MIG uuid -> its DRA device name, on a node whose GPUs DRA hands out."""
        self.group = node.group
        self.shared = node.dra and any(gpu.replicas > 1 for gpu in node.gpus)
        """Its pods share its one GPU through one claim (see :mod:`.kube_mirror`)."""
        self.kubelet = KubeletPodResources(socket_dir / f"{node.name}.sock",
                                           lambda: self.assignments)
        self.publisher = _CountingPublisher(publisher)
        self.cluster = cluster
        self._started = False
        self.collector = NvmlCollector(
            self.nvml, node.name, self.publisher,
            pod_resources=PodResourcesClient(str(self.kubelet.socket_path)),
            # the world ticks the collector itself, once per simulated sample
            interval_s=1e9, event_wait_ms=20,
            # the kubelet is asked on every tick: pods change between two ticks
            pod_resources_refresh_s=0.0,
            pod_resources_max_age_s=cluster.scenario.sample_interval_s * 4,
            proc_root=str(proc_root), clock=self._clock)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _clock(self) -> float:
        # Before the world's first step the collector's own first tick is stamped one
        # interval early, so it never shares a timestamp with a simulated sample.
        now = self.cluster.now
        return now if self._started else now - self.cluster.scenario.sample_interval_s

    async def start(self) -> None:
        await self.kubelet.start()
        self._task = asyncio.create_task(self.collector.run(self._stop),
                                         name=f"nvml-{self.name}")
        # The collector's own first tick comes after NVML is open and its event listener
        # runs: from then on a fault raised in the fake reaches the collector.
        deadline = time.monotonic() + 30
        while not self.publisher.samples:
            if self._task.done():
                self._task.result()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the NVML collector of {self.name} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.kubelet.stop()

    def check(self) -> None:
        if self._task is not None and self._task.done():
            self._task.result()
            raise RuntimeError(f"the NVML collector of {self.name} stopped on its own")

    async def hw_event(self, event: HwEvent) -> None:
        """A fault the simulator raises, as the GPU raises it through NVML."""
        self._started = True
        expect = self.publisher.hw_events
        if event.kind == "xid" and event.uuid is not None and event.xid is not None:
            self.nvml.xid(event.uuid, event.xid)
        elif event.kind == "ecc_dbe" and event.uuid is not None:
            gpu = self.nvml.gpu(event.uuid)
            self.nvml.ecc_dbe(event.uuid, max(1, (event.count or 0) - gpu.ecc_dbe))
        elif event.kind == "gpu_lost" and event.uuid is not None:
            self.nvml.lose(event.uuid)
        else:
            # remap failures, throttling: no NVML event; the readings carry them and the
            # collector's tick turns the change into the event
            return
        await self.publisher.wait_for_events(expect + 1, EVENT_DELIVERY_TIMEOUT_S)

    async def sample(self, sample: NodeSample) -> None:
        """The simulator's readings become the GPUs' state; the collector reads them."""
        self._started = True
        seen = {device.uuid: device for device in sample.devices}
        assignments = []
        for gpu in self.nvml.gpus:
            device = seen.get(gpu.uuid)
            if gpu.mig:
                for mig in gpu.mig:
                    mig_device = seen.get(mig.uuid)
                    if mig_device is not None:
                        _set_mig(mig, mig_device)
                        assignments += self._assignment(
                            mig_device, f"nvidia.com/mig-{mig.profile.replace('+', '.')}")
                continue
            if device is None:
                # gone from the readings without an event: the GPU no longer answers
                gpu.lost = True
                continue
            _set_gpu(gpu, device)
            gpu.processes = self._processes(device)
            assignments += self._assignment(device, "nvidia.com/gpu")
        self.assignments = assignments
        await self.collector.tick()


    def _assignment(self, device: DeviceSample, resource: str) -> list[Assignment]:
        """What the kubelet names for the device: the device plugin's id, or on a DRA
        node the pod's claim and the device's DRA name (no uuid)."""
        if self.dra_names is None or device.pod is None:
            return _assignment(device, resource)
        name = self.dra_names[device.uuid]
        if len(device.holders) > 1:  # its pods share one claim (the node's one GPU)
            claim = dra_shared_claim_name(self.group)
            return [Assignment(share.pod.namespace, share.pod.name, "main", resource, name,
                               claim=claim, pool=self.name)
                    for share in device.holders if share.pod is not None]
        pod = device.pod
        claim = (dra_shared_claim_name(self.group) if self.shared
                 else dra_claim_name(pod.name))
        return [Assignment(pod.namespace, pod.name, "main", resource, name, claim=claim,
                           pool=self.name)]

    def _processes(self, device: DeviceSample) -> list[FakeProcess]:
        """The pods' processes on a shared GPU, each with its cgroup under the world's /proc.

        Only shared GPUs get processes: a GPU one pod holds is credited by PodResources
        alone, and a fleet of them costs no process calls or /proc reads per tick.
        """
        out = []
        for share in device.holders:
            pod = share.pod
            if pod is None:
                continue
            key = (device.uuid, pod.namespace, pod.name)
            pid = self._pids.get(key)
            if pid is None:
                pid = self._pids[key] = next(self.pid_numbers)
                uid = self.cluster.pod_uid(pod.namespace, pod.name)
                folder = self.proc_root / str(pid)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "cgroup").write_text(_cgroup(uid, pid))
            out.append(FakeProcess(
                pid=pid, mem_used=share.mem_used_bytes,
                sm_util=None if share.activity_pct is None else round(share.activity_pct),
                mps=share.mps))
        return out


def _cgroup(pod_uid: str, pid: int) -> str:
    """A container process's /proc/<pid>/cgroup: cgroup v2, systemd driver, containerd."""
    return ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{pod_uid.replace('-', '_')}.slice/cri-containerd-{pid:064x}.scope\n")


def _assignment(device: DeviceSample, resource: str) -> list[Assignment]:
    if len(device.holders) > 1:
        # A shared GPU: one replica each, named as the device plugin names replicas.
        return [Assignment(share.pod.namespace, share.pod.name, "main", resource,
                           f"{device.uuid}::{n}")
                for n, share in enumerate(device.holders) if share.pod is not None]
    pod = device.pod
    if pod is None:
        return []
    return [Assignment(pod.namespace, pod.name, "main", resource, device.uuid)]


def _set_gpu(gpu: FakeGpu, device: DeviceSample) -> None:
    gpu.util_gpu = round(device.util_pct or 0)
    gpu.mem_used = device.mem_used_bytes or 0
    if device.temp_c is not None:
        gpu.temp = round(device.temp_c)
    if device.power_w is not None:
        gpu.power_mw = round(device.power_w * 1000)
    if device.sm_clock_mhz is not None:
        gpu.sm_clock = device.sm_clock_mhz
    gpu.clocks_event_reasons = device.clock_event_reasons or 0
    gpu.ecc_sbe = device.ecc_sbe_volatile or 0
    gpu.ecc_dbe = device.ecc_dbe_volatile or 0
    gpu.pcie_replay = device.pcie_replay or 0
    if gpu.nvlink is not None:
        gpu.nvlink = {**gpu.nvlink, "replay": device.nvlink_errors or 0,
                      "crc_flit": device.nvlink_crc_errors or 0}
    gpu.remapped_rows = (0, 0, 0, 1 if device.remap_failure else 0)
    if device.retired_pages_pending is not None or device.retired_pages_sbe is not None:
        gpu.retired_pages = (device.retired_pages_sbe or 0, device.retired_pages_dbe or 0,
                             1 if device.retired_pages_pending else 0)


def _set_mig(mig: FakeMig, device: DeviceSample) -> None:
    mig.engine_active = device.engine_active_pct
    mig.mem_used = device.mem_used_bytes or 0


class World:
    """The simulated cluster's GPUs, kubelets and API server, read by the production edges.

    Use as ``async with World(cluster, publisher, workdir) as world:`` and pass
    ``world`` to :meth:`SimulatedCluster.run` as its publisher.
    """

    def __init__(self, cluster: SimulatedCluster, publisher: Publisher, workdir: Path,
                 dcgm_pages: DcgmPages | None = None) -> None:
        """``dcgm_pages``: also serve every node's dcgm-exporter page there, for the world's
        lifetime (its URL is known before the world starts)."""
        self.cluster = cluster
        self.dcgm_pages = dcgm_pages
        self.publisher = publisher
        self.workdir = workdir
        # unix socket paths must stay under 108 bytes: a short folder of their own
        self.socket_dir = Path(tempfile.mkdtemp(prefix="gsw-kubelet-"))
        self.api = KubeApiServer(bookmark_interval_s=0.2)
        self.api.record_requests = False  # a run makes thousands; nobody reads them
        self.mirror = KubeMirrorPublisher(self, self.api, cluster)
        self.proc_root = self.socket_dir / "proc"
        """The nodes' host /proc (each pid unique in the world)."""
        pids = itertools.count(40_000)
        self.nodes = {name: NodeGpus(node, self.socket_dir, publisher, cluster, self.proc_root,
                                     pids) for name, node in cluster.nodes.items()}
        self.kubeconfig = self.api.write_kubeconfig(workdir / "kubeconfig")
        """Written at once, so processes can be started before the world (and gRPC) is."""
        self.watcher: KubeWatcher | None = None
        self._client: Any = None
        self._watch_stop = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None
        self._seen_rv = 0
        self._noticed: set[str] = set()
        self._previous_tick = cluster.on_tick
        cluster.on_tick = self._on_tick

    # --- lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> World:
        from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client

        self.api.start()
        try:
            if self.dcgm_pages is not None:
                await self.dcgm_pages.start()
            for name, node in self.nodes.items():
                if not self.cluster.collector_absent(name):  # else none ever runs there
                    await node.start()
            kube = KubeWatchSettings(kubeconfig=str(self.kubeconfig))
            self._client = api_client(kube)
            cluster = self.cluster
            self.watcher = KubeWatcher(self._client, self.publisher, kube,
                                       clock=lambda: cluster.now)
            self._watch_task = asyncio.create_task(self.watcher.run(self._watch_stop))
            synced = asyncio.ensure_future(self.watcher.synced.wait())
            try:
                await asyncio.wait({synced, self._watch_task}, timeout=30,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                synced.cancel()
            self.check()
            if not self.watcher.synced.is_set():
                raise RuntimeError("the Kubernetes watcher did not list the API double in 30 s")
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def _close(self) -> None:
        self.cluster.on_tick = self._previous_tick
        self._watch_stop.set()
        try:
            if self._watch_task is not None:
                await self._watch_task  # raises the watcher's error, if it failed
        finally:
            for node in self.nodes.values():
                await node.stop()
            if self._client is not None:
                self._client.close()
            if self.dcgm_pages is not None:
                await self.dcgm_pages.stop()
            self.api.stop()
            # the kubelet sockets and the host /proc of the world's processes
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def check(self) -> None:
        """Raise the error of a collector or the watcher that stopped on its own."""
        for node in self.nodes.values():
            node.check()
        if self._watch_task is not None and self._watch_task.done():
            self._watch_task.result()
            raise RuntimeError("the Kubernetes watcher stopped on its own")

    def settled(self) -> bool:
        """Every change in the double seen by its reflector and published."""
        assert self.watcher is not None
        reflectors = self.watcher.reflectors
        delivered = sum(r.stats.deltas for r in reflectors.values())
        return all(int(r.resource_version or 0) >= self.api.latest_change(name)
                   for name, r in reflectors.items()) and delivered == self.watcher.processed

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until the watcher has published everything written into the double."""
        await self._caught_up(timeout_s)
        await self.publisher.flush()

    async def _caught_up(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.settled():
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Kubernetes watcher did not catch up in {timeout_s} s")
            await asyncio.sleep(0.001)
        self._seen_rv = self.api.resource_version

    # --- what the cluster writes back ------------------------------------------

    def _on_tick(self, cluster: SimulatedCluster) -> None:
        """Carry what was written into the API back into the simulated cluster.

        A cordoned Node takes no new pods; a stopped Notebook or a Deployment or
        StatefulSet scaled to zero loses its pod (the simulated controllers act as the
        real ones would), and the GPUs are free for whoever waits; an owner notice on a
        pod is counted as told.
        """
        self.check()
        for node in self.api.objects("Node"):
            name = node["metadata"]["name"]
            sim_node = cluster.nodes.get(name)
            if sim_node is not None and node["spec"].get("unschedulable") and \
                    not sim_node.cordoned:
                cluster.request_cordon(name, "cordoned through the Kubernetes API")
        running = {(w.namespace, w.name) for w in cluster.running}
        for owner in self._given_up():
            meta = owner["metadata"]
            if (meta["namespace"], meta["name"]) in running:
                why = (meta.get("annotations") or {}).get(RECLAIMED_BECAUSE, "reclaimed")
                cluster.request_reclaim(meta["namespace"], meta["name"], why)
        for pod in self.api.objects("Pod"):
            meta = pod["metadata"]
            if NOTICE_ANNOTATION in (meta.get("annotations") or {}):
                key = f"{meta['namespace']}/{meta['name']}"
                if key not in self._noticed:
                    self._noticed.add(key)
                    cluster.notify(PodRef(namespace=meta["namespace"], name=meta["name"]),
                                   meta["annotations"][NOTICE_ANNOTATION])
        if self._previous_tick is not None:
            self._previous_tick(cluster)

    def _given_up(self) -> list[dict[str, Any]]:
        """Owners that no longer want their pod: stopped Notebooks, scaled to zero."""
        stopped = [n for n in self.api.objects("Notebook", group="kubeflow.org")
                   if NOTEBOOK_STOPPED in (n["metadata"].get("annotations") or {})]
        scaled = [o for kind in ("Deployment", "StatefulSet")
                  for o in self.api.objects(kind, group="apps")
                  if o["spec"].get("replicas") == 0]
        return stopped + scaled

    # --- the simulator's Publisher: its decisions become world state -----------

    async def sample(self, sample: NodeSample) -> None:
        # The watcher stamps what it sees with the simulated clock: let it see this
        # step's changes before the step's samples, as a real watcher sees a pod bound
        # well before the GPU gets busy.
        if self.api.resource_version != self._seen_rv:
            await self._caught_up()
        if self.dcgm_pages is not None:
            self.dcgm_pages.sample(sample)
        await self.nodes[sample.node].sample(sample)

    async def hw_event(self, event: HwEvent) -> None:
        if self.dcgm_pages is not None:
            self.dcgm_pages.hw_event(event)
        await self.nodes[event.node].hw_event(event)

    async def allocation(self, event: AllocationEvent) -> None:
        await self.mirror.allocation(event)

    async def queue(self, event: QueueEvent) -> None:
        await self.mirror.queue(event)

    async def flush(self) -> None:
        await self.publisher.flush()
