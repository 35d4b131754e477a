"""Reading every GPU and MIG device of a node once, in a worker thread (blocking NVML calls).

:class:`NvmlReader` owns the NVML handles and what is cached between ticks
(MIG descriptions, GPM sample buffers, calls this driver lacks). The
collector runs :meth:`NvmlReader.read` through ``asyncio.to_thread``, so a
wedged driver cannot freeze the event loop that publishes; everything that
decides events lives on the event loop, not here.

- "Not supported" (and its relatives: a missing symbol on an old driver, no
  such link, no permission) is a normal answer: the reading is ``None``.
  NVML documents several (utilisation on MIG-enabled GPUs, remapped rows on
  GPUs with MIG instances or before Ampere, ECC on boards without it).
- Retired pages (dynamic page retirement) are what a pre-Ampere GPU (T4, V100)
  has instead of row remapping: they are asked only of a GPU that gave no
  remapped rows, so an Ampere or newer GPU costs no extra call per tick. Newer
  calls fall back to the older ones they replace on drivers that lack them.
  Each GPU's first such answer per call is logged, once: INFO for what the
  GPU or driver lacks, WARNING for "no permission" (a restricted container:
  something to fix); other errors go to ``on_error`` with the GPU named.
- A GPU that falls off the bus (``NVMLError_GpuIsLost`` and relatives) ends
  its own reading only: it is listed in :attr:`Reading.unavailable` and the
  other GPUs are read on. So is a GPU that answers none of its readings
  (utilisation, memory, temperature, power) with anything but an error
  (``NVMLError_Unknown`` on every call: a GPU in a bad state, which nvidia-smi
  shows as "Unknown Error") for ``SILENT_TICKS`` reads in a row: it is as
  unusable as a lost one, and the error names it.
- MIG devices carry the GPU-instance profile *name* (``3g.40gb``; ids differ
  between GPU models) and, on GPUs with GPM (Hopper and newer), the
  graphics-engine activity: NVML has no utilisation for MIG devices, and
  idleness on MIG is judged on engine activity.
- With ``processes`` on, every device's running processes (compute and MPS
  clients) with their memory, and per-process SM utilisation samples since
  the previous read, go into :attr:`Reading.processes` for the collector to
  split the device between pods. On a MIG-enabled GPU they are read per MIG
  handle only: the parent's answer is the aggregate of its instances.

It stays one module: every NVML call the collector makes is here, beside the fallback
from a newer call to the one it replaces, so a driver difference is found in one place.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpusteward.collectors.attribution import ProcessShare
from gpusteward.collectors.nvml.api import ABSENT, UNAVAILABLE, Nvml
from gpusteward.errors import TemporaryError
from gpusteward.schema import DeviceSample

_NVLINK_FIELDS = (
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
)
"""Summed into ``nvlink_errors``: the link's real trouble."""
_NVLINK_CRC_FIELDS = (
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
)
"""Summed into ``nvlink_crc_errors``: routine on a healthy link, judged on their rate."""
_FIELDS = [*_NVLINK_FIELDS, *_NVLINK_CRC_FIELDS, pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
SILENT_TICKS = 3
"""Reads in a row in which a GPU answered none of its readings, each with an error, before
it is listed unavailable (one such read may be a driver's hiccup)."""
_PROFILE = re.compile(r"(\d+g\.\d+gb(?:\+[a-z]+)*)")

log = logging.getLogger(__name__)


class GpuUnavailable(TemporaryError):
    """Raised inside a reading when the GPU being read has gone."""


@dataclass
class Gpu:
    """A GPU found at start: its NVML handle and what names it."""

    index: int
    handle: Any
    uuid: str
    model: str
    minor: int = -1
    """The minor number: ``/dev/nvidia<minor>``, GKE's ``nvidia<minor>`` device ids and
    dcgm-exporter's ``device`` label. Not always the NVML index (which follows PCI bus
    order); the index where the driver does not say."""
    gpm: bool | None = None
    """GPM support; None until asked."""
    mig_enabled: bool = False
    """MIG mode as last read: a failed read (``NVMLError_Unknown`` mid-poll) keeps it, so the
    GPU's MIG devices do not vanish from one tick."""
    slowdown_c: float | None = None
    """The GPU's slowdown temperature, once read (it does not change); asked again each
    tick while unread (a board that does not say costs one call per tick)."""
    silent: int = 0
    """Reads in a row in which the GPU answered none of its readings, only errors."""
    process_samples_us: int = 0
    """Timestamp of the newest per-process utilisation sample read (NVML's lastSeenTimeStamp,
    microseconds): each read asks only for newer samples."""


@dataclass(frozen=True)
class _MigInfo:
    gpu_instance_id: int | None
    compute_instance_id: int | None
    profile: str | None
    placement: tuple[int, int] | None = None
    """(GPU-instance profile id, placement start): what NVIDIA's DRA driver names the MIG
    device by; None where the GPU instance could not be read."""


@dataclass
class _Gpm:
    """Two GPM sample buffers of one MIG device; a metric needs two samples."""

    previous: Any
    current: Any
    primed: bool = False
    request: Any = None
    """The metrics request, kept: it holds room for every GPM metric (about 19 KB)."""


@dataclass
class Reading:
    """What one tick saw: device samples, and GPUs that could not be read."""

    devices: list[DeviceSample] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    processes: dict[str, list[ProcessShare]] = field(default_factory=dict)
    """Device uuid -> its processes, when processes are read (empty list: none running)."""



def decode(value: Any) -> str:
    """An NVML string (bytes from older bindings) as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def profile_name(text: str) -> str | None:
    """The GPU-instance profile name in an NVML name: ``MIG 3g.40gb`` -> ``3g.40gb``.

    A compute-instance name (``1c.3g.40gb``) yields its GPU-instance part.
    """
    match = _PROFILE.search(text)
    return match.group(1) if match else None



def _float(value: int | None) -> float | None:
    return None if value is None else float(value)


class NvmlReader:
    """Reads every GPU and MIG device once per call; NVML errors other than "absent" go to
    ``on_error(where, error, gpu)``."""

    def __init__(self, nvml: Nvml, on_error: Callable[[str, BaseException, str], None], *,
                 processes: bool = False) -> None:
        self.nvml = nvml
        self.on_error = on_error
        self.processes = processes
        self.gpus: list[Gpu] = []
        self._mig_info: dict[str, _MigInfo] = {}
        self._gpm: dict[str, _Gpm] = {}
        self._mig_handles: dict[str, Any] = {}
        """MIG device uuid -> its handle, from the latest read (for the process calls)."""
        self._missing_symbols: set[tuple[str, tuple[str, ...]]] = set()
        """Newer NVML calls this driver lacks (NVMLError_FunctionNotFound once seen)."""
        self._reading: Gpu | None = None
        """The GPU being read (its MIG devices included): names it in logs and errors."""
        self._errors: list[str] = []
        """The calls that failed on the GPU being read, as ``call: NVMLError_...``."""
        self._absent_logged: set[tuple[str, str]] = set()
        """(GPU uuid, call) whose absent answer was logged: once per GPU, not per tick."""

    def open(self) -> list[tuple[int, pynvml.NVMLError]]:
        """Enumerate the GPUs (NVML initialised); returns those that cannot be read, by index.

        A GPU already gone at start has no uuid to name it by: the caller reports it by
        index and the others are monitored.
        """
        unreadable: list[tuple[int, pynvml.NVMLError]] = []
        for index in range(self.nvml.nvmlDeviceGetCount()):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = self.nvml.nvmlDeviceGetUUID(handle)
                model = self.nvml.nvmlDeviceGetName(handle)
            except pynvml.NVMLError as e:
                unreadable.append((index, e))
                continue
            self.gpus.append(Gpu(index=index, handle=handle, uuid=uuid, model=model,
                                 minor=self._minor(handle, index)))
        return unreadable

    def _minor(self, handle: Any, index: int) -> int:
        try:
            return int(self.nvml.nvmlDeviceGetMinorNumber(handle))
        except pynvml.NVMLError:  # not supported here (or gone: reported by the first read)
            return index

    def driver_version(self) -> str:
        try:
            return decode(self.nvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            return "unknown"

    def close(self) -> None:
        """Free the GPM buffers (blocking)."""
        for buffers in self._gpm.values():
            for sample in (buffers.previous, buffers.current):
                with contextlib.suppress(pynvml.NVMLError):
                    self.nvml.nvmlGpmSampleFree(sample)
        self._gpm.clear()

    def read(self) -> Reading:
        """Read every GPU and MIG device once (blocking NVML calls)."""
        reading = Reading()
        seen_mig: set[str] = set()
        for gpu in self.gpus:
            self._reading, self._errors = gpu, []
            try:
                devices = self._read_gpu(gpu, seen_mig)
                self._silence(gpu, devices[0])
                if self.processes:
                    self._read_processes(gpu, devices, reading.processes)
                reading.devices += devices
            except GpuUnavailable as e:
                reading.unavailable[gpu.uuid] = str(e)
        self._reading = None
        for uuid in set(self._mig_handles) - seen_mig:
            del self._mig_handles[uuid]
        for uuid in set(self._gpm) - seen_mig:  # MIG device gone (re-partitioned): free GPM buffers
            buffers = self._gpm.pop(uuid)
            for sample in (buffers.previous, buffers.current):
                with contextlib.suppress(pynvml.NVMLError):
                    self.nvml.nvmlGpmSampleFree(sample)
        return reading


    def _get(self, call: str, *args: Any, symbol_required: bool = False, **kwargs: Any) -> Any:
        """One NVML call; None where the reading does not exist here.

        With ``symbol_required``, a driver without the call raises
        NVMLError_FunctionNotFound instead, so the caller can fall back to an older one.
        """
        try:
            return getattr(self.nvml, call)(*args, **kwargs)
        except pynvml.NVMLError_FunctionNotFound as e:
            if symbol_required:
                raise
            self._absent(call, e)
            return None
        except UNAVAILABLE as e:
            raise GpuUnavailable(f"{call}: {type(e).__name__}: {e}") from e
        except ABSENT as e:
            self._absent(call, e)
            return None
        except pynvml.NVMLError as e:
            self._failed(call, e)
            return None

    def _gpu_name(self) -> str:
        gpu = self._reading
        return "" if gpu is None else f"GPU {gpu.index} ({gpu.model}, {gpu.uuid})"

    def _absent(self, call: str, error: pynvml.NVMLError) -> None:
        """Log the first absent answer of ``call`` on the GPU being read; later ones are the
        same news every tick."""
        gpu = self._reading
        key = ("" if gpu is None else gpu.uuid, call)
        if key in self._absent_logged or call == "nvmlDeviceGetMigDeviceHandleByIndex":
            return  # (an empty MIG slot answers NotFound: no reading is missing)
        self._absent_logged.add(key)
        if isinstance(error, pynvml.NVMLError_NoPermission):
            log.warning("%s: %s: no permission in this container; its reading stays absent "
                        "(docs/collectors.md, NVML collector)", self._gpu_name() or "NVML", call)
        else:
            log.info("%s: %s: %s; its reading is absent", self._gpu_name() or "NVML", call,
                     type(error).__name__.removeprefix("NVMLError_"))

    def _failed(self, call: str, error: BaseException) -> None:
        self._errors.append(f"{call}: {type(error).__name__}")
        self.on_error(call, error, self._gpu_name())

    def _silence(self, gpu: Gpu, sample: DeviceSample) -> None:
        """Count a read in which ``gpu`` answered none of its readings, each with an error;
        raise :class:`GpuUnavailable` at the ``SILENT_TICKS``-th in a row."""
        if not self._errors or any(value is not None for value in (
                sample.util_pct, sample.mem_used_bytes, sample.temp_c, sample.power_w)):
            gpu.silent = 0
            return
        gpu.silent += 1
        if gpu.silent >= SILENT_TICKS:
            kinds = ", ".join(dict.fromkeys(e.split(": ", 1)[1] for e in self._errors))
            raise GpuUnavailable(
                f"answered none of its readings for {gpu.silent} reads in a row, only errors "
                f"({kinds} on {len(self._errors)} calls, first {self._errors[0]}): the GPU "
                "needs a reset or the node a reboot")

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

    def _slowdown(self, gpu: Gpu) -> float | None:
        """The GPU's own slowdown temperature (read once): the thermal rule's threshold for it,
        where a per-model table can only guess (an L40S is not an L4)."""
        if gpu.slowdown_c is None:
            gpu.slowdown_c = _float(self._get("nvmlDeviceGetTemperatureThreshold", gpu.handle,
                                              pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        return gpu.slowdown_c

    def _clock_reasons(self, handle: Any) -> int | None:
        value = self._newest("nvmlDeviceGetCurrentClocksEventReasons",
                             "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return None if value is None else int(value)

    def _fields(self, handle: Any) -> tuple[int | None, int | None, int | None]:
        """NVLink replay + recovery errors, NVLink CRC errors (flit + data) and the recovery
        action; None each the GPU does not report."""
        values = self._get("nvmlDeviceGetFieldValues", handle, _FIELDS)
        if values is None:
            return None, None, None
        read: dict[int, int] = {}
        for value in values:
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                continue
            member = _VALUE_MEMBER.get(value.valueType)
            if member is not None:
                read[value.fieldId] = int(getattr(value.value, member))
        nvlink = [read[f] for f in _NVLINK_FIELDS if f in read]
        crc = [read[f] for f in _NVLINK_CRC_FIELDS if f in read]
        return (sum(nvlink) if nvlink else None, sum(crc) if crc else None,
                read.get(pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION))

    def _retired_pages(self, handle: Any) -> tuple[int | None, int | None, bool | None]:
        """Pages retired for multiple single-bit and for double-bit errors, and whether a
        retirement waits for a reset; None each where the GPU does not retire pages."""
        sbe = self._get("nvmlDeviceGetRetiredPages", handle,
                        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = self._get("nvmlDeviceGetRetiredPages", handle,
                        pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = self._get("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        return (None if sbe is None else len(sbe), None if dbe is None else len(dbe),
                None if pending is None else bool(pending))

    def _read_gpu(self, gpu: Gpu, seen_mig: set[str]) -> list[DeviceSample]:
        handle = gpu.handle
        mig_mode = self._get("nvmlDeviceGetMigMode", handle)
        if mig_mode is not None:
            gpu.mig_enabled = mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        mig_enabled = gpu.mig_enabled
        util = self._get("nvmlDeviceGetUtilizationRates", handle)
        memory = self._memory(handle)
        power_mw = self._get("nvmlDeviceGetPowerUsage", handle)
        sbe = self._get("nvmlDeviceGetTotalEccErrors", handle,
                        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
        dbe = self._get("nvmlDeviceGetTotalEccErrors", handle,
                        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        rows = self._get("nvmlDeviceGetRemappedRows", handle)
        retired_sbe = retired_dbe = retired_pending = None
        if rows is None:
            retired_sbe, retired_dbe, retired_pending = self._retired_pages(handle)
        nvlink, nvlink_crc, recovery = self._fields(handle)
        sample = DeviceSample(
            uuid=gpu.uuid, index=gpu.index, model=gpu.model, kind="gpu",
            util_pct=None if util is None else float(util.gpu),
            mem_used_bytes=None if memory is None else int(memory.used),
            mem_total_bytes=None if memory is None else int(memory.total),
            temp_c=_float(self._temperature(handle)),
            slowdown_temp_c=self._slowdown(gpu),
            power_w=None if power_mw is None else power_mw / 1000,
            sm_clock_mhz=self._get("nvmlDeviceGetClockInfo", handle, pynvml.NVML_CLOCK_SM),
            clock_event_reasons=self._clock_reasons(handle),
            ecc_sbe_volatile=sbe,
            ecc_dbe_volatile=dbe,
            remapped_rows_correctable=None if rows is None else int(rows[0]),
            remapped_rows_uncorrectable=None if rows is None else int(rows[1]),
            remap_pending=None if rows is None else bool(rows[2]),
            remap_failure=None if rows is None else bool(rows[3]),
            retired_pages_sbe=retired_sbe,
            retired_pages_dbe=retired_dbe,
            retired_pages_pending=retired_pending,
            pcie_replay=self._get("nvmlDeviceGetPcieReplayCounter", handle),
            nvlink_errors=nvlink,
            nvlink_crc_errors=nvlink_crc,
            recovery_action=recovery,
        )
        devices = [sample]
        if mig_enabled:
            devices += self._read_migs(gpu, seen_mig)
        return devices

    def _read_migs(self, gpu: Gpu, seen: set[str]) -> list[DeviceSample]:
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
            self._mig_handles[uuid] = mig_handle
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

    def _read_processes(self, gpu: Gpu, devices: list[DeviceSample],
                        into: dict[str, list[ProcessShare]]) -> None:
        """The processes of the GPU, or of each of its MIG devices, with their utilisation."""
        migs = [d for d in devices if d.kind == "mig"]
        if not migs:
            into[gpu.uuid] = self._processes_on(gpu.handle, self._process_util(gpu))
            return
        for device in migs:
            handle = self._mig_handles.get(device.uuid)
            if handle is not None:
                # No per-process utilisation on MIG devices: their holders' activity is
                # unknown and the device's engine activity stands for them.
                into[device.uuid] = self._processes_on(handle, None)

    def _processes_on(self, handle: Any, util: dict[int, float] | None
                      ) -> list[ProcessShare]:
        shares: dict[int, ProcessShare] = {}
        for call, mps in (("nvmlDeviceGetComputeRunningProcesses", False),
                          ("nvmlDeviceGetMPSComputeRunningProcesses", True)):
            for info in self._get(call, handle) or ():
                pid = int(info.pid)
                if pid in shares:  # listed by both calls: an MPS client
                    continue
                used = info.usedGpuMemory
                shares[pid] = ProcessShare(
                    pid=pid, mem_used_bytes=None if used is None else int(used),
                    sm_util_pct=util.get(pid, 0.0) if util is not None else None, mps=mps)
        return list(shares.values())

    def _process_util(self, gpu: Gpu) -> dict[int, float] | None:
        """Mean SM utilisation per PID since the last read; None: not available here.

        NVML answers NotFound when no process produced a sample since ``lastSeenTimeStamp``:
        every process was idle, which is an empty dict, not an absent reading.
        """
        try:
            samples = self.nvml.nvmlDeviceGetProcessUtilization(gpu.handle,
                                                                 gpu.process_samples_us)
        except pynvml.NVMLError_NotFound:
            return {}
        except UNAVAILABLE as e:
            raise GpuUnavailable(f"nvmlDeviceGetProcessUtilization: {e}") from e
        except ABSENT as e:
            self._absent("nvmlDeviceGetProcessUtilization", e)
            return None
        except pynvml.NVMLError as e:
            self._failed("nvmlDeviceGetProcessUtilization", e)
            return None
        totals: dict[int, list[float]] = {}
        for sample in samples:
            totals.setdefault(int(sample.pid), []).append(float(sample.smUtil))
            gpu.process_samples_us = max(gpu.process_samples_us, int(sample.timeStamp))
        return {pid: sum(values) / len(values) for pid, values in totals.items()}

    def _describe_mig(self, gpu: Gpu, mig_handle: Any) -> _MigInfo:
        gi = self._get("nvmlDeviceGetGpuInstanceId", mig_handle)
        ci = self._get("nvmlDeviceGetComputeInstanceId", mig_handle)
        profile: str | None = None
        placement: tuple[int, int] | None = None
        # The profile name by the documented route: GPU instance -> profile id -> profile info.
        instance = None if gi is None else self._get("nvmlDeviceGetGpuInstanceById",
                                                      gpu.handle, gi)
        if instance is not None:
            info = self._get("nvmlGpuInstanceGetInfo", instance)
            if info is not None:
                placement = (int(info.profileId), int(info.placement.start))
                profile_info = self._get("nvmlDeviceGetGpuInstanceProfileInfoById", gpu.handle,
                                         info.profileId)
                if profile_info is not None:
                    profile = profile_name(decode(profile_info.name))
        if profile is None:  # e.g. no privilege to open the instance: the device name has it
            name = self._get("nvmlDeviceGetName", mig_handle)
            profile = profile_name(decode(name)) if name is not None else None
        return _MigInfo(gpu_instance_id=gi, compute_instance_id=ci, profile=profile,
                        placement=placement)

    def mig_placement(self, uuid: str) -> tuple[int, int] | None:
        """(GPU-instance profile id, placement start) of a MIG device read before; None
        when unknown."""
        info = self._mig_info.get(uuid)
        return None if info is None else info.placement

    def _engine_active(self, gpu: Gpu, uuid: str, gpu_instance_id: int) -> float | None:
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
