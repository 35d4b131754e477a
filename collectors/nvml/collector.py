"""The NVML collector: a source on the shared tick loop, with hardware events outside it.

One :class:`NvmlCollector` runs per node (a DaemonSet pod). Each tick of
:func:`~gpusteward.collectors.source.run_source` calls :meth:`collect`,
which reads every GPU and MIG device in a worker thread
(:class:`~.reader.NvmlReader`), credits each device to the pod that holds
it (the kubelet's PodResources API) or, with the host's /proc at
``proc_root``, splits a shared device between its pods by their processes
(:func:`~gpusteward.collectors.attribution.attribute`), and returns one :class:`NodeSample` for
the node with the hardware events its counters imply; the loop publishes
them, times them and counts them under the shared collector metric names.
Beside the loop, the listener thread (:mod:`.events`) hands XIDs,
double-bit ECC errors, recovery actions and "GPU unavailable" to the event
loop, and they are published the moment NVML reports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import pynvml

from gpusteward.collectors.attribution import (
    DeviceOwners,
    PodResourcesClient,
    PodResourcesError,
    ProcCgroups,
    ProcessShare,
    attribute,
)
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.nvml.api import ABSENT, Nvml, NvmlUnavailable
from gpusteward.collectors.nvml.events import SOURCE, EventListener, HardwareEvents, RawEvent
from gpusteward.collectors.nvml.reader import NvmlReader
from gpusteward.collectors.settings import CollectSettings
from gpusteward.collectors.source import collect_once, run_source
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.schema import DeviceHolder, DeviceSample, HwEvent, NodeSample, PodRef

log = logging.getLogger(__name__)

_START_HINTS: dict[type, str] = {
    pynvml.NVMLError_LibRmVersionMismatch: "the NVML library and the loaded kernel driver "
    "differ, as after a driver upgrade without a reboot: reboot the node",
    pynvml.NVMLError_DriverNotLoaded: "no NVIDIA kernel driver is loaded on this node",
    pynvml.NVMLError_LibraryNotFound: "libnvidia-ml.so is not in the container: run it with "
    "the NVIDIA container runtime",
    pynvml.NVMLError_NoPermission: "the container may not open /dev/nvidia*",
}
"""What to do about an NVML that fails at start, by error."""


class NvmlCollector:
    """Samples every GPU and MIG device of a node and publishes them, with hardware events."""

    source = SOURCE

    def __init__(
        self,
        nvml: Nvml,
        node_name: str,
        publisher: Publisher,
        *,
        pod_resources: PodResourcesClient | None = None,
        interval_s: float = 1.0,
        event_wait_ms: int = 1000,
        pod_resources_refresh_s: float = 5.0,
        pod_resources_max_age_s: float = 30.0,
        proc_root: str | None = None,
        metrics: CollectorMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.node_name = node_name
        self.publisher = publisher
        self.pod_resources = pod_resources
        self.interval_s = interval_s
        self.event_wait_ms = event_wait_ms
        self.refresh_s = pod_resources_refresh_s
        self.max_age_s = pod_resources_max_age_s
        self.metrics = metrics if metrics is not None else CollectorMetrics()
        self.clock = clock
        self.cgroups = ProcCgroups(proc_root) if proc_root else None
        """The host's /proc, for per-process attribution; None: by PodResources alone."""
        self.reader = NvmlReader(nvml, on_error=self._count_error,
                                 processes=self.cgroups is not None)
        self.hw = HardwareEvents(node_name)
        self._logged: set[tuple[str, str, str]] = set()
        self._owners = DeviceOwners()
        self._owners_at: float | None = None
        self._owners_tried: float | None = None
        self._lost_at_start: list[tuple[int, str]] = []

    # --- lifecycle ---------------------------------------------------------

    def open(self) -> None:
        """Initialise NVML and enumerate the GPUs (blocking; call once)."""
        try:
            self.nvml.nvmlInit()
            unreadable = self.reader.open()
        except pynvml.NVMLError as e:
            hint = _START_HINTS.get(type(e), "")
            raise NvmlUnavailable(f"NVML cannot be used here: {type(e).__name__}: {e}"
                                  + (f" ({hint})" if hint else "")) from e
        for index, error in unreadable:
            log.error("GPU %d cannot be read at start (%s); it is not monitored", index, error)
            self.metrics.source_errors.labels(SOURCE, "enumerate").inc()
            if not isinstance(error, ABSENT):  # reported as gpu_lost on the first tick
                # Gone (GpuIsLost) or broken ("Unable to determine the device handle for GPU
                # ...: Unknown Error"): either way it takes no work. No permission is the
                # container's setting, not the GPU's fault: logged above, not reported.
                self._lost_at_start.append((index, f"{type(error).__name__}: {error}"))
        log.info("NVML: %d GPU(s) on %s, driver %s", len(self.reader.gpus), self.node_name,
                 self.reader.driver_version())

    def close(self) -> None:
        """Free GPM buffers and shut NVML down (blocking)."""
        self.reader.close()
        with contextlib.suppress(pynvml.NVMLError):
            self.nvml.nvmlShutdown()

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every ``interval_s`` and publish events as they come, until ``stop`` is set."""
        await asyncio.to_thread(self.open)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[RawEvent] = asyncio.Queue()
        listener = EventListener(
            self.nvml, self.reader.gpus, self.event_wait_ms,
            deliver=lambda raw: loop.call_soon_threadsafe(events.put_nowait, raw),
            on_error=self._count_error)
        listener.start()
        drain = asyncio.create_task(self._drain_events(events), name="nvml-events")
        try:
            await run_source(self, self.publisher, stop, self.interval_s, self.metrics)
        finally:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
            await asyncio.to_thread(listener.stop, self.event_wait_ms / 1000 * 2 + 1)
            while not events.empty():  # delivered before the listener stopped: still news
                await self._on_event(events.get_nowait())
            if self.pod_resources is not None:
                await self.pod_resources.close()
            await asyncio.to_thread(self.close)

    # --- one tick ------------------------------------------------------------

    async def collect(self) -> tuple[list[NodeSample], list[HwEvent]]:
        """Read every device once: the node sample and the events the readings imply."""
        reading = await asyncio.to_thread(self.reader.read)
        now = self.clock()
        await self._refresh_owners(now)
        owners = self._current_owners(now)
        events = [HwEvent(ts=now, node=self.node_name, kind="gpu_lost",
                          detail=f"GPU {index} unreadable at start: {why}", source=SOURCE)
                  for index, why in self._lost_at_start]
        self._lost_at_start = []
        by_uuid = {gpu.uuid: gpu for gpu in self.reader.gpus}
        for uuid, why in reading.unavailable.items():
            lost = self.hw.gpu_lost(uuid, f"GPU {by_uuid[uuid].index}: {why}", now)
            if lost is not None:
                events.append(lost)
        self.hw.mig_by_instance = {}
        for device in reading.devices:
            if device.kind == "mig":
                assert device.parent_uuid is not None
                gi = device.gpu_instance_id
                if gi is not None:
                    self.hw.mig_by_instance[(device.parent_uuid, gi)] = device.uuid
                parent = by_uuid.get(device.parent_uuid)
                self._attribute(device, owners.mig_holders(
                    device.uuid, parent_uuid=device.parent_uuid, parent_index=device.index,
                    gpu_instance_id=gi, parent_minor=parent.minor if parent else None,
                    placement=self.reader.mig_placement(device.uuid)),
                    reading.processes.get(device.uuid))
                continue
            if self.hw.answers(device.uuid):
                log.warning("GPU %s (%d) answers again", device.uuid, device.index)
            gpu = by_uuid.get(device.uuid)
            self._attribute(device, owners.gpu_holders(device.uuid, device.index,
                                                       gpu.minor if gpu else None),
                            reading.processes.get(device.uuid))
            events += self.hw.from_counters(device, now)
        sample = NodeSample(ts=now, node=self.node_name, source=SOURCE, devices=reading.devices)
        return [sample], events

    async def tick(self) -> NodeSample:
        """One tick as the loop runs it, published: for tests and the benchmark."""
        (sample,), _events = await collect_once(self, self.publisher, self.metrics)
        return sample

    def _count_error(self, where: str, error: BaseException, device: str = "") -> None:
        """Count a failed NVML call; log it once per device, call and kind of error (a broken
        counter must not flood the log, nor one GPU's failure hide another's)."""
        self.metrics.source_errors.labels(SOURCE, where).inc()
        key = (device, where, type(error).__name__)
        if key not in self._logged:
            self._logged.add(key)
            log.warning("NVML collector: %s%s failed: %s: %s (further ones only counted)",
                        f"{device}: " if device else "", where, type(error).__name__, error)

    # --- events from the listener ---------------------------------------------

    async def _drain_events(self, events: asyncio.Queue[RawEvent]) -> None:
        while True:
            raw = await events.get()
            try:
                await self._on_event(raw)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("publishing an NVML event failed")
                self.metrics.source_errors.labels(SOURCE, "publish_event").inc()

    async def _on_event(self, raw: RawEvent) -> None:
        event = self.hw.from_raw(raw, self.clock())
        if event is not None:
            await self.publisher.hw_event(event)
            self.metrics.hw_events.labels(SOURCE, event.kind).inc()

    # --- attribution -------------------------------------------------------------

    async def _refresh_owners(self, now: float) -> None:
        if self.pod_resources is None:
            return
        if self._owners_tried is not None and now - self._owners_tried < self.refresh_s:
            return
        self._owners_tried = now
        try:
            self._owners = await self.pod_resources.owners()
            self._owners_at = now
        except PodResourcesError as e:
            self._count_error("pod_resources", e)
            return
        for device in self._owners.unnamed:  # counted per List, logged once
            self.metrics.source_errors.labels(SOURCE, "dra_device_name").inc()
            if (device, "dra_device_name", "") not in self._logged:
                self._logged.add((device, "dra_device_name", ""))
                log.warning("the kubelet lists DRA device %s, whose name says no GPU or MIG "
                            "device: its holder is not attributed", device)

    def _attribute(self, device: DeviceSample, candidates: list[PodRef],
                   processes: list[ProcessShare] | None) -> None:
        """Fill the device's pod, holders and how they were found.

        By processes when they were read (each holder its own activity and memory); else by
        PodResources alone: one pod holds the device, or several share it and nothing here
        can split its readings between them. Pods that hold it through one shared DRA claim
        keep their own readings, but the device is ``shared``: the claim is one allocation,
        given back only when all its pods are done, so no one of them is idle on it while
        another uses it.
        """
        device.pod = candidates[0] if candidates else None
        if processes is not None and self.cgroups is not None:
            found = attribute(processes, candidates, self.cgroups)
            if found.outside_pods:
                self.metrics.source_errors.labels(SOURCE, "process_outside_pods").inc(
                    found.outside_pods)
            if found.unallocated_pods:
                self.metrics.source_errors.labels(SOURCE, "process_unallocated_pod").inc(
                    found.unallocated_pods)
            if found.holders:
                device.holders = found.holders
                device.attribution = "shared" if self._owners.through_one_claim(
                    candidates) else "process"
                named = [h.pod for h in found.holders if h.pod is not None]
                device.pod = named[0] if named else device.pod
                return
        pods = list(dict.fromkeys(PodRef(namespace=c.namespace, name=c.name)
                                  for c in candidates))
        if len(pods) > 1:
            device.holders = [DeviceHolder(pod=pod) for pod in pods]
            device.attribution = "shared"
        elif pods:
            device.attribution = "device"

    def _current_owners(self, now: float) -> DeviceOwners:
        if self._owners_at is None or now - self._owners_at > self.max_age_s:
            return DeviceOwners()
        return self._owners


async def run_nvml_collector(
    settings: CollectSettings,
    publisher: Publisher,
    stop: asyncio.Event,
    metrics: CollectorMetrics | None = None,
    *,
    nvml: Nvml | None = None,
) -> None:
    """Run the NVML collector until ``stop`` is set (the ``gpusteward collect nvml`` runner).

    ``nvml`` defaults to the real ``pynvml`` module (the CLI passes the
    sandbox's fake when ``fake_nvml`` is set); ``metrics`` receives the
    collector's metrics (fresh ones when None). Raises :class:`NvmlUnavailable`
    when NVML cannot be initialised here (no driver or library).
    """
    own = settings.nvml
    pod_resources = None
    if own.pod_resources_socket:
        pod_resources = PodResourcesClient(own.pod_resources_socket,
                                           timeout_s=own.pod_resources_timeout_s,
                                           extra_resources=own.extra_gpu_resources,
                                           dra_drivers=own.dra_drivers)
    collector = NvmlCollector(
        nvml if nvml is not None else pynvml, settings.node_name, publisher,
        pod_resources=pod_resources, interval_s=settings.interval_s,
        event_wait_ms=own.event_wait_ms,
        pod_resources_refresh_s=own.pod_resources_refresh_s,
        pod_resources_max_age_s=own.pod_resources_max_age_s, proc_root=own.proc_root,
        metrics=metrics)
    await collector.run(stop)
