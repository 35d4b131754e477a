"""The NVML collector: per-GPU and per-MIG-device readings, and hardware events at once.

One :class:`NvmlCollector` runs per node (a DaemonSet pod). Every tick it
reads each GPU and each MIG device through NVML (nvidia-ml-py, ``import
pynvml``) and publishes one :class:`NodeSample` for the node; a listener
thread blocks in ``nvmlEventSetWait`` and publishes XIDs, double-bit ECC
errors, recovery-action changes and "GPU unavailable" as :class:`HwEvent`
the moment NVML reports them, outside the tick.

Why it is shaped so:

- NVML comes in as a constructor argument typed by the :class:`Nvml`
  Protocol, the subset of ``pynvml`` used here. Production passes the
  ``pynvml`` module itself; tests and the benchmark pass
  :class:`gpusteward.sandbox.nvml_fake.FakeNvml`, which raises pynvml's own
  exception classes, so both run this very code.
- "Not supported" (and its relatives: a missing symbol on an old driver, no
  such link, no permission) is a normal answer: the reading is ``None``.
  NVML documents several (utilisation on MIG-enabled GPUs, remapped rows on
  GPUs with MIG instances, ECC on boards without it).
- A GPU that falls off the bus (``NVMLError_GpuIsLost`` and relatives) is a
  hardware event, ``gpu_lost``, published once; the GPU leaves the sample
  and the others go on being sampled. It is tried again each tick.
- Counter readings that only ever grow are turned into events where a rule
  must act fast: a volatile DBE counter that grew is an ``ecc_dbe`` event
  even when the driver sent no DBE event, and a remap failure or a thermal
  or power slowdown starting/stopping is an event too.
- The NVML calls of a tick run in a worker thread: a wedged driver must not
  freeze the event loop that publishes. All state that decides events lives
  on the event loop, so the tick thread and the listener thread never race.
- MIG devices carry the GPU-instance profile *name* (``3g.40gb``; ids differ
  between GPU models) and, on GPUs with GPM (Hopper and newer), the
  graphics-engine activity: NVML has no utilisation for MIG devices, and
  idleness on MIG is judged on engine activity.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pynvml
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, Field

from gpusteward.collectors.attribution import (
    DEFAULT_SOCKET,
    DeviceOwners,
    PodResourcesClient,
    PodResourcesError,
)
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.errors import PermanentError, TemporaryError
from gpusteward.schema import DeviceSample, HwEvent, NodeSample

log = logging.getLogger(__name__)

SOURCE = "nvml"

# A device-level answer that means "this reading does not exist here".
_ABSENT = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NotFound,
    pynvml.NVMLError_InvalidArgument,
    pynvml.NVMLError_NoData,
    pynvml.NVMLError_NoPermission,
)
# The GPU itself is gone or unusable until reset: every call on it fails.
_UNAVAILABLE = (
    pynvml.NVMLError_GpuIsLost,
    pynvml.NVMLError_GpuNotFound,
    pynvml.NVMLError_ResetRequired,
)

NO_INSTANCE = 0xFFFFFFFF
"""NVML_GPU_INSTANCE_ID_ANY: an event not tied to one GPU instance."""

WANTED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeGpuRecoveryAction
    | pynvml.nvmlEventTypeGpuUnavailableError
)

SLOWDOWN_REASONS = {
    pynvml.nvmlClocksEventReasonSwPowerCap: "sw_power_cap",
    pynvml.nvmlClocksEventReasonHwSlowdown: "hw_slowdown",
    pynvml.nvmlClocksEventReasonSwThermalSlowdown: "sw_thermal",
    pynvml.nvmlClocksEventReasonHwThermalSlowdown: "hw_thermal",
    pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "hw_power_brake",
}
"""Clock-event bits meaning heat or power holds the GPU back (idle, app clocks are benign)."""
SLOWDOWN_MASK = sum(SLOWDOWN_REASONS)

RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p",
                    4: "drain_and_reset", 5: "recover_imex_domain", 6: "bus_reset",
                    7: "system_reboot"}

_NVLINK_FIELDS = (
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
)
_FIELDS = [*_NVLINK_FIELDS, pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_PROFILE = re.compile(r"(\d+g\.\d+gb(?:\+[a-z]+)*)")


class Nvml(Protocol):
    """The part of ``pynvml`` the collector calls (same names and arguments)."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMigMode(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any: ...
    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int: ...
    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int: ...
    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gpu_instance_id: int) -> Any: ...
    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any: ...
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, handle: Any, profile_id: int) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any: ...
    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int,
                                    counter_type: int) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int: ...
    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[int]) -> Any: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait(self, event_set: Any, timeoutms: int) -> Any: ...
    def nvmlEventSetFree(self, event_set: Any) -> None: ...
    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any: ...
    def nvmlGpmSampleAlloc(self) -> Any: ...
    def nvmlGpmSampleFree(self, sample: Any) -> None: ...
    def nvmlGpmMigSampleGet(self, handle: Any, gpu_instance_id: int, sample: Any) -> Any: ...
    def nvmlGpmMetricsGet(self, metrics_get: Any) -> Any: ...


class NvmlUnavailable(PermanentError):
    """NVML cannot be used on this machine (no driver, no library, version mismatch)."""


class NvmlSettings(BaseModel):
    """Settings of the NVML collector (nest them in the collector settings as ``nvml``)."""

    node_name: str | None = Field(
        None, description="Node name on every record. None: $NODE_NAME (the downward API), "
                          "else the host name.")
    interval_s: float = Field(
        1.0, gt=0, description="Seconds between samples. 1 s matches dcgm-exporter's default "
                               "and costs about 1,250 messages/s per 10,000 GPUs.")
    event_wait_ms: int = Field(
        1000, ge=10, le=60_000,
        description="Longest one nvmlEventSetWait blocks, ms; bounds how long stopping takes.")
    pod_resources_socket: str | None = Field(
        DEFAULT_SOCKET, description="The kubelet PodResources socket; None: no pod attribution "
                                    "(outside Kubernetes).")
    pod_resources_timeout_s: float = Field(5.0, gt=0, description="Timeout of one List call, s.")
    pod_resources_refresh_s: float = Field(
        5.0, gt=0, description="Seconds between List calls: a new pod goes unattributed at most "
                               "this long. dcgm-exporter lists on every scrape.")
    pod_resources_max_age_s: float = Field(
        30.0, gt=0, description="While List fails, the last answer is used this long, then "
                                "samples go out unattributed, not credited to a pod maybe gone.")
    extra_gpu_resources: list[str] = Field(
        [], description="Resource names counted besides nvidia.com/gpu and nvidia.com/mig-*.")
    def resolved_node_name(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


class CollectorMetrics:
    """The collector's own Prometheus metrics, on a registry the caller owns."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples = Counter(
            "gpusteward_nvml_samples_published_total", "Node samples published.",
            registry=registry)
        self.devices = Counter(
            "gpusteward_nvml_device_samples_total", "Device (GPU and MIG) readings published.",
            registry=registry)
        self.events = Counter(
            "gpusteward_nvml_events_published_total", "Hardware events published, by kind.",
            ["kind"], registry=registry)
        self.source_errors = Counter(
            "gpusteward_nvml_source_errors_total",
            "NVML or kubelet errors other than 'not supported', by where they happened.",
            ["where"], registry=registry)
        self.tick_seconds = Histogram(
            "gpusteward_nvml_tick_seconds", "Time to read every device once, seconds.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=registry)


class _GpuUnavailable(TemporaryError):
    """Raised inside a tick when the GPU being read has gone."""


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    model: str
    gpm: bool | None = None
    """GPM support; None until asked."""


@dataclass(frozen=True)
class _MigInfo:
    gpu_instance_id: int | None
    compute_instance_id: int | None
    profile: str | None


@dataclass
class _Gpm:
    """Two GPM sample buffers of one MIG device; a metric needs two samples."""

    previous: Any
    current: Any
    primed: bool = False
    request: Any = None
    """The metrics request, kept: it holds room for every GPM metric (about 19 KB)."""


@dataclass
class _Reading:
    """What one tick saw: device samples, and GPUs that could not be read."""

    devices: list[DeviceSample] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _RawEvent:
    """An NVML event as the listener thread saw it."""

    uuid: str | None
    event_type: int
    data: int
    gpu_instance_id: int
    dbe_count: int | None = None


def _handle_key(handle: Any) -> Any:
    # ctypes handles are new pointer objects on every return: compare addresses.
    try:
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        return ("obj", id(handle))


def _decode(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def profile_name(text: str) -> str | None:
    """The GPU-instance profile name in an NVML name: ``MIG 3g.40gb`` -> ``3g.40gb``.

    A compute-instance name (``1c.3g.40gb``) yields its GPU-instance part.
    """
    match = _PROFILE.search(text)
    return match.group(1) if match else None


class NvmlCollector:
    """Samples every GPU and MIG device of a node and publishes them, with hardware events."""

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
        registry: CollectorRegistry | None = None,
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
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = CollectorMetrics(self.registry)
        self.clock = clock
        self.gpus: list[_Gpu] = []
        # Read by the tick thread only.
        self._mig_info: dict[str, _MigInfo] = {}
        self._gpm: dict[str, _Gpm] = {}
        self._missing_symbols: set[tuple[str, tuple[str, ...]]] = set()
        """Newer NVML calls this driver lacks (NVMLError_FunctionNotFound once seen)."""
        self._logged: set[tuple[str, str]] = set()
        # Event loop state: what was last seen, to turn changes into events.
        self._dbe: dict[str, int] = {}
        self._remap_failure: dict[str, bool] = {}
        self._slowdown: dict[str, int] = {}
        self._lost: set[str] = set()
        self._mig_by_instance: dict[tuple[str, int], str] = {}
        self._owners = DeviceOwners()
        self._owners_at: float | None = None
        self._owners_tried: float | None = None
        self._listener: _EventListener | None = None
        self._lost_at_start: list[tuple[int, str]] = []

    # --- lifecycle ---------------------------------------------------------

    def open(self) -> None:
        """Initialise NVML and enumerate the GPUs (blocking; call once)."""
        try:
            self.nvml.nvmlInit()
            count = self.nvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML cannot be used here: {type(e).__name__}: {e}") from e
        for index in range(count):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = self.nvml.nvmlDeviceGetUUID(handle)
                model = self.nvml.nvmlDeviceGetName(handle)
            except pynvml.NVMLError as e:
                # A GPU already gone at start has no uuid to name it by: report it by
                # index (gpu_lost on the first tick) and monitor the others.
                log.error("GPU %d cannot be read at start (%s); it is not monitored", index, e)
                self.metrics.source_errors.labels("enumerate").inc()
                if isinstance(e, _UNAVAILABLE):
                    self._lost_at_start.append((index, f"{type(e).__name__}: {e}"))
                continue
            self.gpus.append(_Gpu(index=index, handle=handle, uuid=uuid, model=model))
        log.info("NVML: %d GPU(s) on %s, driver %s", len(self.gpus), self.node_name,
                 self._driver_version())

    def _driver_version(self) -> str:
        try:
            return _decode(self.nvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            return "unknown"

    def close(self) -> None:
        """Free GPM buffers and shut NVML down (blocking)."""
        for buffers in self._gpm.values():
            for sample in (buffers.previous, buffers.current):
                with contextlib.suppress(pynvml.NVMLError):
                    self.nvml.nvmlGpmSampleFree(sample)
        self._gpm.clear()
        with contextlib.suppress(pynvml.NVMLError):
            self.nvml.nvmlShutdown()

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every ``interval_s`` and publish events as they come, until ``stop`` is set."""
        await asyncio.to_thread(self.open)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[_RawEvent] = asyncio.Queue()
        self._listener = _EventListener(
            self.nvml, self.gpus, self.event_wait_ms,
            deliver=lambda raw: loop.call_soon_threadsafe(events.put_nowait, raw),
            on_error=self._count_error)
        self._listener.start()
        drain = asyncio.create_task(self._drain_events(events), name="nvml-events")
        try:
            next_tick = loop.time()
            while not stop.is_set():
                try:
                    await self.tick()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    # A DaemonSet collector outlives a bad tick (a publisher hiccup, a
                    # driver error outside any one GPU); the counter makes it visible.
                    log.exception("NVML tick failed")
                    self._count_error("tick", e)
                next_tick += self.interval_s
                delay = next_tick - loop.time()
                if delay < 0:  # fell behind: skip the missed ticks, keep the cadence
                    next_tick = loop.time()
                    delay = 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
        finally:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
            await asyncio.to_thread(self._listener.stop, self.event_wait_ms / 1000 * 2 + 1)
            while not events.empty():  # delivered before the listener stopped: still news
                await self._on_event(events.get_nowait())
            if self.pod_resources is not None:
                await self.pod_resources.close()
            await asyncio.to_thread(self.close)

    # --- one tick ------------------------------------------------------------

    async def tick(self) -> NodeSample:
        """Read every device once, publish the node sample and the events it implies."""
        started = time.perf_counter()
        reading = await asyncio.to_thread(self.read)
        self.metrics.tick_seconds.observe(time.perf_counter() - started)
        now = self.clock()
        await self._refresh_owners(now)
        owners = self._current_owners(now)
        by_uuid = {gpu.uuid: gpu for gpu in self.gpus}
        for index, why in self._lost_at_start:
            await self._emit(HwEvent(ts=now, node=self.node_name, kind="gpu_lost",
                                     detail=f"GPU {index} unreadable at start: {why}",
                                     source=SOURCE))
        self._lost_at_start = []
        for uuid, why in reading.unavailable.items():
            if uuid not in self._lost:
                self._lost.add(uuid)
                await self._emit(HwEvent(ts=now, node=self.node_name, kind="gpu_lost", uuid=uuid,
                                         detail=f"GPU {by_uuid[uuid].index}: {why}",
                                         source=SOURCE))
        self._mig_by_instance = {}
        for device in reading.devices:
            if device.kind == "mig":
                assert device.parent_uuid is not None
                gi = device.gpu_instance_id
                if gi is not None:
                    self._mig_by_instance[(device.parent_uuid, gi)] = device.uuid
                device.pod = owners.mig(device.uuid, parent_uuid=device.parent_uuid,
                                        parent_index=device.index, gpu_instance_id=gi)
                continue
            if device.uuid in self._lost:
                log.warning("GPU %s (%d) answers again", device.uuid, device.index)
                self._lost.discard(device.uuid)
            device.pod = owners.gpu(device.uuid, device.index)
            await self._counter_events(device, now)
        sample = NodeSample(ts=now, node=self.node_name, source=SOURCE, devices=reading.devices)
        await self.publisher.sample(sample)
        self.metrics.samples.inc()
        self.metrics.devices.inc(len(reading.devices))
        return sample

    async def _counter_events(self, device: DeviceSample, now: float) -> None:
        uuid = device.uuid
        dbe = device.ecc_dbe_volatile
        if dbe is not None:
            before = self._dbe.get(uuid)
            self._dbe[uuid] = dbe  # a lower count is a GPU reset: the new baseline
            if before is not None and dbe > before:
                await self._emit(HwEvent(
                    ts=now, node=self.node_name, kind="ecc_dbe", uuid=uuid, count=dbe,
                    detail=f"volatile double-bit ECC errors {before} -> {dbe}", source=SOURCE))
        if device.remap_failure is not None:
            failed_before = self._remap_failure.get(uuid, False)
            self._remap_failure[uuid] = device.remap_failure
            if device.remap_failure and not failed_before:
                await self._emit(HwEvent(
                    ts=now, node=self.node_name, kind="remap_failure", uuid=uuid,
                    count=device.remapped_rows_uncorrectable,
                    detail="row remapping failed: the GPU needs service", source=SOURCE))
        if device.clock_event_reasons is not None:
            slowdown = device.clock_event_reasons & SLOWDOWN_MASK
            previous = self._slowdown.get(uuid, 0)
            self._slowdown[uuid] = slowdown
            if slowdown and not previous:
                await self._emit(HwEvent(
                    ts=now, node=self.node_name, kind="throttle_start", uuid=uuid,
                    detail=_reasons(slowdown), source=SOURCE))
            elif previous and not slowdown:
                await self._emit(HwEvent(
                    ts=now, node=self.node_name, kind="throttle_stop", uuid=uuid,
                    detail=_reasons(previous), source=SOURCE))

    async def _emit(self, event: HwEvent) -> None:
        await self.publisher.hw_event(event)
        self.metrics.events.labels(event.kind).inc()

    # --- events from the listener ---------------------------------------------

    async def _drain_events(self, events: asyncio.Queue[_RawEvent]) -> None:
        while True:
            raw = await events.get()
            try:
                await self._on_event(raw)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("publishing an NVML event failed")
                self.metrics.source_errors.labels("publish_event").inc()

    async def _on_event(self, raw: _RawEvent) -> None:
        now = self.clock()
        where = ""
        if raw.gpu_instance_id != NO_INSTANCE and raw.uuid is not None:
            mig = self._mig_by_instance.get((raw.uuid, raw.gpu_instance_id))
            where = f" on GPU instance {raw.gpu_instance_id}" + (f" ({mig})" if mig else "")
        event: HwEvent | None = None
        if raw.event_type & pynvml.nvmlEventTypeXidCriticalError:
            event = HwEvent(ts=now, node=self.node_name, kind="xid", uuid=raw.uuid, xid=raw.data,
                            detail=f"Xid {raw.data}{where}", source=SOURCE)
        elif raw.event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            count = raw.dbe_count
            if raw.uuid is not None and count is not None:
                if count <= self._dbe.get(raw.uuid, -1):
                    return  # the tick already reported this count
                self._dbe[raw.uuid] = count
            event = HwEvent(ts=now, node=self.node_name, kind="ecc_dbe", uuid=raw.uuid,
                            count=count, detail=f"double-bit ECC error event{where}",
                            source=SOURCE)
        elif raw.event_type & pynvml.nvmlEventTypeGpuRecoveryAction:
            # Xid 154 carries the same news in the kernel log; report it under that number.
            action = RECOVERY_ACTIONS.get(raw.data, "unknown")
            event = HwEvent(ts=now, node=self.node_name, kind="xid", uuid=raw.uuid, xid=154,
                            detail=f"GPU recovery action: {action} ({raw.data})", source=SOURCE)
        elif raw.event_type & pynvml.nvmlEventTypeGpuUnavailableError:
            if raw.uuid in self._lost:
                return
            if raw.uuid is not None:
                self._lost.add(raw.uuid)
            event = HwEvent(ts=now, node=self.node_name, kind="gpu_lost", uuid=raw.uuid,
                            detail="NVML: GPU unavailable", source=SOURCE)
        if event is not None:
            await self._emit(event)

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

    def _current_owners(self, now: float) -> DeviceOwners:
        if self._owners_at is None or now - self._owners_at > self.max_age_s:
            return DeviceOwners()
        return self._owners

    # --- reading (runs in a worker thread) ------------------------------------

    def read(self) -> _Reading:
        """Read every GPU and MIG device once (blocking NVML calls)."""
        reading = _Reading()
        seen_mig: set[str] = set()
        for gpu in self.gpus:
            try:
                reading.devices += self._read_gpu(gpu, seen_mig)
            except _GpuUnavailable as e:
                reading.unavailable[gpu.uuid] = str(e)
        for uuid in set(self._gpm) - seen_mig:  # MIG device gone (re-partitioned): free GPM buffers
            buffers = self._gpm.pop(uuid)
            for sample in (buffers.previous, buffers.current):
                with contextlib.suppress(pynvml.NVMLError):
                    self.nvml.nvmlGpmSampleFree(sample)
        return reading

    def _count_error(self, where: str, error: BaseException) -> None:
        self.metrics.source_errors.labels(where).inc()
        key = (where, type(error).__name__)
        if key not in self._logged:  # once per kind: a broken counter must not flood the log
            self._logged.add(key)
            log.warning("NVML collector: %s failed: %s (further ones only counted)", where, error)

    def _get(self, call: str, *args: Any, symbol_required: bool = False, **kwargs: Any) -> Any:
        """One NVML call; None where the reading does not exist here.

        With ``symbol_required``, a driver without the call raises
        NVMLError_FunctionNotFound instead, so the caller can fall back to an older one.
        """
        try:
            return getattr(self.nvml, call)(*args, **kwargs)
        except pynvml.NVMLError_FunctionNotFound:
            if symbol_required:
                raise
            return None
        except _UNAVAILABLE as e:
            raise _GpuUnavailable(f"{call}: {type(e).__name__}: {e}") from e
        except _ABSENT:
            return None
        except pynvml.NVMLError as e:
            self._count_error(call, e)
            return None

    def _newest(self, newer: str, older: str, *args: Any, **newer_kwargs: Any) -> Any:
        """``newer`` while this driver has it, else the ``older`` call it replaces."""
        key = (newer, tuple(sorted(newer_kwargs)))
        if key not in self._missing_symbols:
            try:
                return self._get(newer, *args, symbol_required=True, **newer_kwargs)
            except pynvml.NVMLError_FunctionNotFound:
                self._missing_symbols.add(key)  # a driver older than the symbol
        return self._get(older, *args)

    def _memory(self, handle: Any) -> Any:
        return self._newest("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", handle,
                            version=pynvml.nvmlMemory_v2)

    def _temperature(self, handle: Any) -> int | None:
        value = self._newest("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature", handle,
                             pynvml.NVML_TEMPERATURE_GPU)
        return None if value is None else int(value)

    def _clock_reasons(self, handle: Any) -> int | None:
        value = self._newest("nvmlDeviceGetCurrentClocksEventReasons",
                             "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return None if value is None else int(value)

    def _fields(self, handle: Any) -> tuple[int | None, int | None]:
        """NVLink error total (CRC flit + CRC data + replay + recovery) and recovery action."""
        values = self._get("nvmlDeviceGetFieldValues", handle, _FIELDS)
        if values is None:
            return None, None
        read: dict[int, int] = {}
        for value in values:
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                continue
            member = _VALUE_MEMBER.get(value.valueType)
            if member is not None:
                read[value.fieldId] = int(getattr(value.value, member))
        nvlink = [read[f] for f in _NVLINK_FIELDS if f in read]
        return (sum(nvlink) if nvlink else None,
                read.get(pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION))

    def _read_gpu(self, gpu: _Gpu, seen_mig: set[str]) -> list[DeviceSample]:
        handle = gpu.handle
        mig_mode = self._get("nvmlDeviceGetMigMode", handle)
        mig_enabled = bool(mig_mode) and mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        util = self._get("nvmlDeviceGetUtilizationRates", handle)
        memory = self._memory(handle)
        power_mw = self._get("nvmlDeviceGetPowerUsage", handle)
        sbe = self._get("nvmlDeviceGetTotalEccErrors", handle,
                        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
        dbe = self._get("nvmlDeviceGetTotalEccErrors", handle,
                        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        rows = self._get("nvmlDeviceGetRemappedRows", handle)
        nvlink, recovery = self._fields(handle)
        sample = DeviceSample(
            uuid=gpu.uuid, index=gpu.index, model=gpu.model, kind="gpu",
            util_pct=None if util is None else float(util.gpu),
            mem_used_bytes=None if memory is None else int(memory.used),
            mem_total_bytes=None if memory is None else int(memory.total),
            temp_c=_float(self._temperature(handle)),
            power_w=None if power_mw is None else power_mw / 1000,
            sm_clock_mhz=self._get("nvmlDeviceGetClockInfo", handle, pynvml.NVML_CLOCK_SM),
            clock_event_reasons=self._clock_reasons(handle),
            ecc_sbe_volatile=sbe,
            ecc_dbe_volatile=dbe,
            remapped_rows_correctable=None if rows is None else int(rows[0]),
            remapped_rows_uncorrectable=None if rows is None else int(rows[1]),
            remap_pending=None if rows is None else bool(rows[2]),
            remap_failure=None if rows is None else bool(rows[3]),
            pcie_replay=self._get("nvmlDeviceGetPcieReplayCounter", handle),
            nvlink_errors=nvlink,
            recovery_action=recovery,
        )
        devices = [sample]
        if mig_enabled:
            devices += self._read_migs(gpu, seen_mig)
        return devices

    def _read_migs(self, gpu: _Gpu, seen: set[str]) -> list[DeviceSample]:
        devices: list[DeviceSample] = []
        slots = self._get("nvmlDeviceGetMaxMigDeviceCount", gpu.handle) or 0
        for slot in range(slots):
            mig_handle = self._get("nvmlDeviceGetMigDeviceHandleByIndex", gpu.handle, slot)
            if mig_handle is None:  # an empty slot
                continue
            uuid = self._get("nvmlDeviceGetUUID", mig_handle)
            if uuid is None:
                continue
            seen.add(uuid)
            info = self._mig_info.get(uuid)
            if info is None:
                info = self._mig_info[uuid] = self._describe_mig(gpu, mig_handle)
            memory = self._memory(mig_handle)
            devices.append(DeviceSample(
                uuid=uuid, index=gpu.index, model=gpu.model, kind="mig", parent_uuid=gpu.uuid,
                mig_profile=info.profile, gpu_instance_id=info.gpu_instance_id,
                engine_active_pct=(None if info.gpu_instance_id is None
                                   else self._engine_active(gpu, uuid, info.gpu_instance_id)),
                mem_used_bytes=None if memory is None else int(memory.used),
                mem_total_bytes=None if memory is None else int(memory.total),
            ))
        return devices

    def _describe_mig(self, gpu: _Gpu, mig_handle: Any) -> _MigInfo:
        gi = self._get("nvmlDeviceGetGpuInstanceId", mig_handle)
        ci = self._get("nvmlDeviceGetComputeInstanceId", mig_handle)
        profile: str | None = None
        # The profile name by the documented route: GPU instance -> profile id -> profile info.
        instance = None if gi is None else self._get("nvmlDeviceGetGpuInstanceById",
                                                      gpu.handle, gi)
        if instance is not None:
            info = self._get("nvmlGpuInstanceGetInfo", instance)
            if info is not None:
                profile_info = self._get("nvmlDeviceGetGpuInstanceProfileInfoById", gpu.handle,
                                         info.profileId)
                if profile_info is not None:
                    profile = profile_name(_decode(profile_info.name))
        if profile is None:  # e.g. no privilege to open the instance: the device name has it
            name = self._get("nvmlDeviceGetName", mig_handle)
            profile = profile_name(_decode(name)) if name is not None else None
        return _MigInfo(gpu_instance_id=gi, compute_instance_id=ci, profile=profile)

    def _engine_active(self, gpu: _Gpu, uuid: str, gpu_instance_id: int) -> float | None:
        if gpu.gpm is None:
            support = self._get("nvmlGpmQueryDeviceSupport", gpu.handle)
            gpu.gpm = bool(support is not None and support.isSupportedDevice)
        if not gpu.gpm:
            return None
        buffers = self._gpm.get(uuid)
        if buffers is None:
            first = self._get("nvmlGpmSampleAlloc")
            second = self._get("nvmlGpmSampleAlloc")
            if first is None or second is None:
                gpu.gpm = False
                return None
            buffers = self._gpm[uuid] = _Gpm(first, second)
        if self._get("nvmlGpmMigSampleGet", gpu.handle, gpu_instance_id, buffers.current) is None:
            return None
        value: float | None = None
        if buffers.primed:
            request = buffers.request
            if request is None:
                request = buffers.request = pynvml.c_nvmlGpmMetricsGet_t()
                request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
                request.numMetrics = 1
            request.sample1 = buffers.previous
            request.sample2 = buffers.current
            request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
            answer = self._get("nvmlGpmMetricsGet", request)
            if answer is not None and answer.metrics[0].nvmlReturn == pynvml.NVML_SUCCESS:
                value = float(answer.metrics[0].value)
        buffers.previous, buffers.current, buffers.primed = buffers.current, buffers.previous, True
        return value


def _float(value: int | None) -> float | None:
    return None if value is None else float(value)


def _reasons(mask: int) -> str:
    return ",".join(name for bit, name in SLOWDOWN_REASONS.items() if mask & bit)


class _EventListener:
    """A thread blocked in ``nvmlEventSetWait``, handing events to the event loop."""

    def __init__(self, nvml: Nvml, gpus: list[_Gpu], wait_ms: int,
                 deliver: Callable[[_RawEvent], object],
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.nvml = nvml
        self.gpus = gpus
        self.wait_ms = wait_ms
        self.deliver = deliver
        self.on_error = on_error
        self.registered: dict[Any, str] = {}
        self.ready = threading.Event()
        """Set once registration is done (whatever came of it)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _register(self) -> Any:
        try:
            event_set = self.nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            self.on_error("nvmlEventSetCreate", e)
            return None
        for gpu in self.gpus:
            try:
                mask = self.nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle) & WANTED_EVENTS
                if mask:
                    self.nvml.nvmlDeviceRegisterEvents(gpu.handle, mask, event_set)
                    self.registered[_handle_key(gpu.handle)] = gpu.uuid
            except pynvml.NVMLError as e:
                self.on_error("nvmlDeviceRegisterEvents", e)
        if not self.registered:
            log.warning("NVML events: no GPU accepts event registration; XIDs are not watched")
        return event_set

    def _run(self) -> None:
        event_set = self._register()
        self.ready.set()
        if event_set is None:
            return
        try:
            while self.registered and not self._stop.is_set():
                try:
                    data = self.nvml.nvmlEventSetWait(event_set, self.wait_ms)
                except pynvml.NVMLError_Timeout:
                    continue
                except pynvml.NVMLError as e:
                    self.on_error("nvmlEventSetWait", e)
                    self._stop.wait(self.wait_ms / 1000)  # no busy loop on a persistent error
                    continue
                try:
                    self.deliver(self._raw(data))
                except RuntimeError:  # the event loop is closed: nobody to deliver to
                    return
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                self.nvml.nvmlEventSetFree(event_set)

    def _raw(self, data: Any) -> _RawEvent:
        uuid = self.registered.get(_handle_key(data.device))
        if uuid is None:
            with contextlib.suppress(pynvml.NVMLError):
                uuid = _decode(self.nvml.nvmlDeviceGetUUID(data.device))
        dbe_count: int | None = None
        if int(data.eventType) & pynvml.nvmlEventTypeDoubleBitEccError:
            with contextlib.suppress(pynvml.NVMLError):
                dbe_count = int(self.nvml.nvmlDeviceGetTotalEccErrors(
                    data.device, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    pynvml.NVML_VOLATILE_ECC))
        return _RawEvent(uuid=uuid, event_type=int(data.eventType), data=int(data.eventData),
                         gpu_instance_id=int(data.gpuInstanceId), dbe_count=dbe_count)


async def run_nvml_collector(
    settings: NvmlSettings,
    publisher: Publisher,
    stop: asyncio.Event,
    *,
    nvml: Nvml | None = None,
    registry: CollectorRegistry | None = None,
) -> None:
    """Run the NVML collector until ``stop`` is set.

    ``nvml`` defaults to the real ``pynvml`` module (the CLI passes the
    sandbox's fake when ``fake_nvml`` is set); ``registry`` receives the
    collector's metrics (a fresh one when None). Raises :class:`NvmlUnavailable` when NVML cannot be
    initialised here (no driver or library).
    """
    pod_resources = None
    if settings.pod_resources_socket:
        pod_resources = PodResourcesClient(settings.pod_resources_socket,
                                           timeout_s=settings.pod_resources_timeout_s,
                                           extra_resources=settings.extra_gpu_resources)
    collector = NvmlCollector(
        nvml if nvml is not None else pynvml, settings.resolved_node_name(), publisher,
        pod_resources=pod_resources, interval_s=settings.interval_s,
        event_wait_ms=settings.event_wait_ms,
        pod_resources_refresh_s=settings.pod_resources_refresh_s,
        pod_resources_max_age_s=settings.pod_resources_max_age_s, registry=registry)
    await collector.run(stop)
