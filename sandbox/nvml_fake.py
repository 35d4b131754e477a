"""A fake NVML, driven by a YAML description of devices, MIG layouts and faults.

It stands in for the ``pynvml`` module (nvidia-ml-py) wherever no GPU is
present: tests, the benchmark and ``make demo``-style runs. It answers the
calls :class:`gpusteward.collectors.nvml.Nvml` names with the same names,
signatures, return shapes and exceptions as ``pynvml``: failures are
pynvml's own ``NVMLError`` subclasses (``NVMLError_NotSupported``,
``NVMLError_GpuIsLost``, ``NVMLError_Timeout``...), and struct returns are
pynvml's own ctypes structures where the collector reads them field by
field (memory, utilisation, field values, profile info). So the collector
runs the very code path it runs on a real node.

What it models, and on purpose no more:

- GPUs with their readings, and calls listed under ``unsupported`` raise
  ``NVMLError_NotSupported``; calls under ``failing`` raise the pynvml error named
  (``NoPermission`` in a restricted container, ``Unknown`` mid-poll...), a ``broken``
  GPU raises its error on every call, its handle's included, and
  ``init_error`` makes ``nvmlInit`` fail (``LibRmVersionMismatch`` after a driver
  upgrade without a reboot); a MIG-enabled GPU refuses utilisation, and
  remapped rows while it has MIG devices, as NVML documents; retired pages
  (``retired_pages``) on the pre-Ampere GPUs given them, NotSupported elsewhere;
- MIG devices (uuid, GPU-instance profile name and id, instance ids, memory,
  graphics-engine activity through the GPM calls); a MIG handle answers
  only what NVML answers per instance;
- processes per GPU and per MIG device (``processes:``: pid, memory, SM
  utilisation, whether an MPS client), answered by
  ``nvmlDeviceGetComputeRunningProcesses`` / ``...MPSComputeRunningProcesses``
  as pynvml's friendly objects of ``c_nvmlProcessInfo_v3_t``, and by
  ``nvmlDeviceGetProcessUtilization`` as ``c_nvmlProcessUtilizationSample_t``
  newer than the caller's timestamp (``NVMLError_NotFound`` when there is
  none; ``NVMLError_NotSupported`` on a MIG handle, as drivers answer);
- events (XID, double-bit ECC, recovery action, GPU unavailable) queued by
  faults and delivered by ``nvmlEventSetWait``, which really blocks up to
  its timeout so the collector's listener thread behaves as on a GPU;
- faults scheduled by ``step`` in the YAML (``FakeNvml.step()`` applies the
  next step) or injected directly (``xid()``, ``ecc_dbe()``, ``lose()``).

The YAML format is documented by ``tests/data/nvml/*.yaml``.

It stays one module: it mirrors the pynvml surface the collector calls, one method per
NVML function, which reads best side by side.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from gpusteward.configfile import Issue, compose, line_of, read_text
from gpusteward.sandbox.simulator.scenario import ScenarioError

# Calls a MIG device handle answers; NVML reports the rest at GPU level.
_MIG_HANDLE_CALLS = frozenset({
    "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
})
_TUPLES = ("remapped_rows", "retired_pages")
"""FakeGpu readings given as lists in YAML and held as tuples."""
_NO_INSTANCE = 0xFFFFFFFF
"""gpuInstanceId/computeInstanceId of a process on a GPU without MIG."""

_NVLINK_FIELDS = {
    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: "crc_flit",
    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: "crc_data",
    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: "replay",
    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: "recovery",
}


def _error(code: int) -> pynvml.NVMLError:
    # NVMLError(code) returns the matching subclass (NVMLError_GpuIsLost for 15, ...).
    return pynvml.NVMLError(code)


def _named_error(name: str) -> pynvml.NVMLError:
    """pynvml's error by its class suffix: ``NoPermission`` -> ``NVMLError_NoPermission``."""
    kind = getattr(pynvml, f"NVMLError_{name}", None)
    if not (isinstance(kind, type) and issubclass(kind, pynvml.NVMLError)):
        raise ValueError(f"no pynvml error NVMLError_{name}")
    for constant in dir(pynvml):
        code = getattr(pynvml, constant)
        if (constant.startswith("NVML_ERROR_") and isinstance(code, int)
                and type(_error(code)) is kind):
            return _error(code)
    raise ValueError(f"NVMLError_{name} has no NVML return code")


@dataclass
class FakeProcess:
    """A process with a context on a device."""

    pid: int
    mem_used: int | None = 0
    """Framebuffer bytes; None: NVML_VALUE_NOT_AVAILABLE (reported as None by pynvml)."""
    sm_util: int | None = 0
    """SM utilisation percent of its samples; None: it produces no utilisation samples."""
    mps: bool = False
    """An MPS client (listed by the MPS call, not the plain compute one)."""


@dataclass
class FakeMig:
    uuid: str
    profile: str
    """GPU-instance profile name, e.g. ``3g.40gb``."""
    profile_id: int
    gpu_instance_id: int
    compute_instance_id: int = 0
    placement_start: int | None = None
    """The GPU instance's placement start (memory slice); None: its position among the
    GPU's MIG devices."""
    placement_size: int = 1
    mem_total: int = 40 << 30
    mem_used: int = 0
    engine_active: float | None = None
    """Graphics-engine active percent served through GPM; None: no GPM sample."""
    processes: list[FakeProcess] = field(default_factory=list)


@dataclass
class FakeGpu:
    index: int
    uuid: str
    name: str
    minor: int | None = None
    """``/dev/nvidia<minor>``; None: the index (NVML's order and the minors usually agree)."""
    util_gpu: int = 0
    util_memory: int = 0
    mem_total: int = 80 << 30
    mem_reserved: int = 512 << 20
    mem_used: int = 0
    temp: int = 35
    slowdown_temp: int | None = None
    """NVML_TEMPERATURE_THRESHOLD_SLOWDOWN; None: the call answers NotSupported."""
    power_mw: int = 70_000
    sm_clock: int = 1410
    clocks_event_reasons: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    retired_pages: tuple[int, int, int] | None = None
    """Dynamic page retirement (pre-Ampere: T4, V100): pages retired for multiple single-bit
    errors, for double-bit errors, and 1 while a retirement is pending. None: the calls answer
    NotSupported, as on Ampere and newer, where row remapping replaces page retirement."""
    pcie_replay: int = 0
    nvlink: dict[str, int] | None = None
    """Error totals by counter (crc_flit, crc_data, replay, recovery); None: no NVLink."""
    recovery_action: int | None = 0
    gpm: bool = False
    """Whether the GPU supports GPM (Hopper and newer): engine activity of MIG devices."""
    mig_enabled: bool = False
    mig: list[FakeMig] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    failing: dict[str, str] = field(default_factory=dict)
    """pynvml call -> the NVMLError it raises, by class suffix (``NoPermission``, ``Unknown``)."""
    supported_events: int = pynvml.nvmlEventTypeAll
    lost: bool = False
    broken: str | None = None
    """A GPU in a bad state that answers every call with this NVMLError (by class suffix),
    its handle included: ``Unknown`` is nvidia-smi's "Unable to determine the device handle
    for GPU ...: Unknown Error", a GPU that needs a reset or a reboot."""


@dataclass(eq=False)
class _Handle:
    """A device handle; NVML hands out the same handle for a device every time."""

    gpu: FakeGpu
    mig: FakeMig | None = None


@dataclass
class _EventSet:
    registered: dict[str, int] = field(default_factory=dict)
    """GPU uuid -> event mask."""
    freed: bool = False


@dataclass
class FakeEventData:
    """Shaped like pynvml's ``c_nvmlEventData_t``."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeGpuInstanceInfo:
    """Shaped like pynvml's ``c_nvmlGpuInstanceInfo_t`` (the fields the collector reads)."""

    device: Any
    id: int
    profileId: int
    placement: Any
    """A ``c_nvmlGpuInstancePlacement_t`` (start, size)."""


class FakeNvml:
    """The pynvml calls the collector makes, answered from a YAML description."""

    def __init__(self, description: Mapping[str, Any]) -> None:
        self.driver_version = str(description.get("driver_version", "550.54.15"))
        init_error = description.get("init_error")
        self.init_error = None if init_error is None else _named_error(str(init_error))
        """What ``nvmlInit`` raises; None: it succeeds."""
        self.gpus = _gpus(description.get("gpus", []))
        self._faults: list[dict[str, Any]] = list(description.get("faults", []))
        self.current_step = 0
        self.initialised = False
        self.calls = 0
        self._events: deque[FakeEventData] = deque()
        self._event_ready = threading.Condition()
        self._event_sets: list[_EventSet] = []
        self._gpm_samples: dict[int, tuple[ctypes.c_uint64, float | None]] = {}
        self._handles: dict[str, _Handle] = {}
        self._process_clock_us = 0
        """Timestamp of the fake's per-process utilisation samples: one second per call."""

    def _handle(self, gpu: FakeGpu, mig: FakeMig | None = None) -> _Handle:
        key = mig.uuid if mig else gpu.uuid
        handle = self._handles.get(key)
        if handle is None or handle.gpu is not gpu or handle.mig is not mig:
            handle = self._handles[key] = _Handle(gpu, mig)
        return handle

    @classmethod
    def from_yaml(cls, path: str | Path) -> FakeNvml:
        """The fake a YAML description file sets up; a :class:`ScenarioError` says what is
        wrong in it as ``FILE:LINE: field: message``, as for a scenario file."""
        origin = str(path)
        root, description = compose(read_text(path, ScenarioError), origin, ScenarioError)
        shape = {"driver_version": str, "init_error": str, "gpus": list, "faults": list}
        if not isinstance(description, dict):
            raise ScenarioError(origin, [Issue(line_of(root, ()) or 1, "", (
                "a fake NVML description is a mapping of " + ", ".join(shape)))])
        issues = [Issue(line_of(root, (key,)), str(key), f"unknown field; known: "
                                                          f"{', '.join(shape)}")
                  for key in description if key not in shape]
        issues += [Issue(line_of(root, (key,)), key, f"should be a {kind.__name__}")
                   for key, kind in shape.items()
                   if key in description and not isinstance(description[key], kind)]
        if issues:
            raise ScenarioError(origin, issues)
        try:
            return cls(description)
        except _BadGpu as error:
            raise ScenarioError(origin, [Issue(line_of(root, ("gpus", error.index)),
                                               f"gpus.{error.index}", str(error))]) from error
        except ValueError as error:  # a misspelt init_error
            raise ScenarioError(origin, [Issue(line_of(root, ("init_error",)) or 1,
                                               "init_error", str(error))]) from error

    # --- faults ---------------------------------------------------------

    def gpu(self, ref: int | str) -> FakeGpu:
        """A GPU by index or uuid."""
        for gpu in self.gpus:
            if ref in (gpu.index, gpu.uuid):
                return gpu
        raise KeyError(f"no fake GPU {ref!r}")

    def step(self) -> list[dict[str, Any]]:
        """Advance to the next step and apply the faults the YAML schedules for it."""
        self.current_step += 1
        due = [f for f in self._faults if f.get("step") == self.current_step]
        for fault in due:
            self.apply(fault)
        return due

    def apply(self, fault: Mapping[str, Any]) -> None:
        """Apply one fault entry (the same keys as under ``faults:`` in the YAML)."""
        gpu = self.gpu(fault["gpu"])
        if "set" in fault:
            for name, value in fault["set"].items():
                if not hasattr(gpu, name):
                    raise KeyError(f"fake GPU has no reading {name!r}")
                setattr(gpu, name, tuple(value) if name in _TUPLES and value is not None
                        else value)
        if "xid" in fault:
            self.xid(gpu.uuid, int(fault["xid"]), fault.get("gpu_instance_id"))
        if "dbe" in fault:
            self.ecc_dbe(gpu.uuid, int(fault["dbe"]), event=fault.get("event", True))
        if "recovery_action" in fault:
            gpu.recovery_action = int(fault["recovery_action"])
            self._queue(gpu, pynvml.nvmlEventTypeGpuRecoveryAction, gpu.recovery_action)
        if fault.get("lost"):
            self.lose(gpu.uuid)

    def xid(self, gpu: int | str, xid: int, gpu_instance_id: int | None = None) -> None:
        """An XID critical error, delivered to listeners as NVML does."""
        target = self.gpu(gpu)
        gi = 0xFFFFFFFF if gpu_instance_id is None else gpu_instance_id
        self._queue(target, pynvml.nvmlEventTypeXidCriticalError, xid, gi)

    def ecc_dbe(self, gpu: int | str, count: int = 1, *, event: bool = True) -> None:
        """Volatile double-bit ECC errors; with ``event`` the DBE event fires too."""
        target = self.gpu(gpu)
        target.ecc_dbe += count
        if event:
            self._queue(target, pynvml.nvmlEventTypeDoubleBitEccError, 0)

    def lose(self, gpu: int | str) -> None:
        """The GPU falls off the bus: from now on every call on it raises GpuIsLost."""
        target = self.gpu(gpu)
        target.lost = True
        self._queue(target, pynvml.nvmlEventTypeGpuUnavailableError, 0)

    def _queue(self, gpu: FakeGpu, event_type: int, data: int, gi: int = 0xFFFFFFFF) -> None:
        with self._event_ready:
            self._events.append(FakeEventData(self._handle(gpu), event_type, data, gi))
            self._event_ready.notify_all()

    # --- the pynvml surface ----------------------------------------------

    def _check(self, call: str, handle: Any = None) -> FakeGpu | None:
        self.calls += 1
        if not self.initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        if not isinstance(handle, _Handle):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.gpu.broken is not None:
            raise _named_error(handle.gpu.broken)
        if handle.mig is not None and call not in _MIG_HANDLE_CALLS:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if call in handle.gpu.unsupported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if call in handle.gpu.failing:
            raise _named_error(handle.gpu.failing[call])
        return handle.gpu

    def nvmlInit(self) -> None:
        self.calls += 1
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # NVML hands out handles of lost GPUs too; calls on them then fail.
        broken = self.gpus[index].broken
        if broken is not None:
            raise _named_error(broken)
        return self._handle(self.gpus[index])

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        gpu = self._check("nvmlDeviceGetUUID", handle)
        assert gpu is not None
        return handle.mig.uuid if handle.mig else gpu.uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        gpu = self._check("nvmlDeviceGetName", handle)
        assert gpu is not None
        return f"{gpu.name} MIG {handle.mig.profile}" if handle.mig else gpu.name

    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetMinorNumber", handle)
        assert gpu is not None
        return gpu.index if gpu.minor is None else gpu.minor

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        gpu = self._check("nvmlDeviceGetMigMode", handle)
        assert gpu is not None
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetMaxMigDeviceCount", handle)
        assert gpu is not None
        return 7 if gpu.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        gpu = self._check("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        assert gpu is not None
        if not gpu.mig_enabled or not 0 <= index < 7:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(gpu.mig):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._handle(gpu, gpu.mig[index])

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        self._check("nvmlDeviceGetGpuInstanceId", handle)
        if handle.mig is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        self._check("nvmlDeviceGetComputeInstanceId", handle)
        if handle.mig is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.compute_instance_id

    def _mig_by_gi(self, gpu: FakeGpu, gpu_instance_id: int) -> FakeMig:
        for mig in gpu.mig:
            if mig.gpu_instance_id == gpu_instance_id:
                return mig
        raise _error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetGpuInstanceById(self, handle: _Handle, gpu_instance_id: int) -> _Handle:
        gpu = self._check("nvmlDeviceGetGpuInstanceById", handle)
        assert gpu is not None
        return _Handle(gpu, self._mig_by_gi(gpu, gpu_instance_id))

    def nvmlGpuInstanceGetInfo(self, gpu_instance: _Handle) -> FakeGpuInstanceInfo:
        self._check("nvmlGpuInstanceGetInfo")
        mig = gpu_instance.mig
        assert mig is not None
        start = gpu_instance.gpu.mig.index(mig) if mig.placement_start is None \
            else mig.placement_start
        return FakeGpuInstanceInfo(self._handle(gpu_instance.gpu), mig.gpu_instance_id,
                                   mig.profile_id, pynvml.c_nvmlGpuInstancePlacement_t(
                                       start=start, size=mig.placement_size))

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, handle: _Handle, profile_id: int) -> Any:
        gpu = self._check("nvmlDeviceGetGpuInstanceProfileInfoById", handle)
        assert gpu is not None
        for mig in gpu.mig:
            if mig.profile_id == profile_id:
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.id = profile_id
                info.name = f"MIG {mig.profile}".encode()
                info.memorySizeMB = mig.mem_total >> 20
                return info
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        gpu = self._check("nvmlDeviceGetUtilizationRates", handle)
        assert gpu is not None
        if gpu.mig_enabled:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu, util.memory = gpu.util_gpu, gpu.util_memory
        return util

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        gpu = self._check("nvmlDeviceGetMemoryInfo", handle)
        assert gpu is not None
        total, used, reserved = ((handle.mig.mem_total, handle.mig.mem_used, 0) if handle.mig
                                 else (gpu.mem_total, gpu.mem_used, gpu.mem_reserved))
        if version:
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version, mem.reserved = version, reserved
            mem.used = used
        else:
            mem = pynvml.c_nvmlMemory_t()
            mem.used = used + reserved  # v1 counts reserved memory as used
        mem.total = total
        mem.free = total - used - reserved
        return mem

    def nvmlDeviceGetTemperatureV(self, handle: _Handle, sensor: int) -> int:
        gpu = self._check("nvmlDeviceGetTemperatureV", handle)
        assert gpu is not None
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temp

    def nvmlDeviceGetTemperatureThreshold(self, handle: _Handle, threshold: int) -> int:
        gpu = self._check("nvmlDeviceGetTemperatureThreshold", handle)
        assert gpu is not None
        if threshold != pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN or gpu.slowdown_temp is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.slowdown_temp

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        gpu = self._check("nvmlDeviceGetTemperature", handle)
        assert gpu is not None
        return gpu.temp

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetPowerUsage", handle)
        assert gpu is not None
        return gpu.power_mw

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        gpu = self._check("nvmlDeviceGetClockInfo", handle)
        assert gpu is not None
        if clock_type != pynvml.NVML_CLOCK_SM:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.sm_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetCurrentClocksEventReasons", handle)
        assert gpu is not None
        return gpu.clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        assert gpu is not None
        return gpu.clocks_event_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int,
                                    counter_type: int) -> int:
        gpu = self._check("nvmlDeviceGetTotalEccErrors", handle)
        assert gpu is not None
        if counter_type != pynvml.NVML_VOLATILE_ECC:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_dbe
        return gpu.ecc_sbe

    def nvmlDeviceGetRemappedRows(self, handle: _Handle) -> tuple[int, int, int, int]:
        gpu = self._check("nvmlDeviceGetRemappedRows", handle)
        assert gpu is not None
        if gpu.mig_enabled and gpu.mig:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.remapped_rows

    def nvmlDeviceGetRetiredPages(self, handle: _Handle, sourceFilter: int) -> list[int]:
        gpu = self._check("nvmlDeviceGetRetiredPages", handle)
        assert gpu is not None
        if gpu.retired_pages is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if sourceFilter not in (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                                pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        count = gpu.retired_pages[sourceFilter]
        # The pages' hardware addresses, as pynvml returns them (one 4 KiB page each).
        base = 0x1000_0000 * (sourceFilter + 1)
        return [base + page * 0x1000 for page in range(count)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        assert gpu is not None
        if gpu.retired_pages is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(bool(gpu.retired_pages[2]))

    def nvmlDeviceGetPcieReplayCounter(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetPcieReplayCounter", handle)
        assert gpu is not None
        return gpu.pcie_replay

    def nvmlDeviceGetFieldValues(self, handle: _Handle, field_ids: list[int]) -> Any:
        gpu = self._check("nvmlDeviceGetFieldValues", handle)
        assert gpu is not None
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for slot, field_id in zip(values, field_ids, strict=True):
            slot.fieldId = field_id
            slot.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            reading: int | None = None
            if field_id in _NVLINK_FIELDS and gpu.nvlink is not None:
                reading = gpu.nvlink.get(_NVLINK_FIELDS[field_id], 0)
            elif field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                reading = gpu.recovery_action
                slot.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            if reading is None:
                slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif slot.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                slot.value.uiVal = reading
            else:
                slot.value.ullVal = reading
        return values

    # events

    def _processes(self, call: str, handle: _Handle, mps: bool) -> list[Any]:
        self._check(call, handle)
        mig = handle.mig
        owners = mig.processes if mig is not None else handle.gpu.processes
        gi, ci = ((mig.gpu_instance_id, mig.compute_instance_id) if mig is not None
                  else (_NO_INSTANCE, _NO_INSTANCE))
        out = []
        for process in owners:
            if process.mps != mps:
                continue
            info = pynvml.c_nvmlProcessInfo_v3_t(
                pid=process.pid, gpuInstanceId=gi, computeInstanceId=ci,
                usedGpuMemory=(pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                               if process.mem_used is None else process.mem_used))
            friendly = pynvml.nvmlStructToFriendlyObject(info)
            if friendly.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                friendly.usedGpuMemory = None  # as pynvml does (WDDM)
            out.append(friendly)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle, mps=False)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._processes("nvmlDeviceGetMPSComputeRunningProcesses", handle, mps=True)

    def nvmlDeviceGetProcessUtilization(self, handle: _Handle, timeStamp: int) -> list[Any]:
        gpu = self._check("nvmlDeviceGetProcessUtilization", handle)
        assert gpu is not None
        self._process_clock_us += 1_000_000
        now = self._process_clock_us
        samples = [pynvml.c_nvmlProcessUtilizationSample_t(
                       pid=p.pid, timeStamp=now, smUtil=p.sm_util, memUtil=0, encUtil=0,
                       decUtil=0)
                   for p in gpu.processes if p.sm_util is not None and now > timeStamp]
        if not samples:  # "no valid sample entries since lastSeenTimeStamp"
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    def nvmlEventSetCreate(self) -> _EventSet:
        self._check("nvmlEventSetCreate")
        event_set = _EventSet()
        self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        gpu = self._check("nvmlDeviceGetSupportedEventTypes", handle)
        assert gpu is not None
        return gpu.supported_events

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int,
                                 event_set: _EventSet) -> None:
        gpu = self._check("nvmlDeviceRegisterEvents", handle)
        assert gpu is not None
        if event_types & ~gpu.supported_events:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.registered[gpu.uuid] = event_set.registered.get(gpu.uuid, 0) | event_types

    def nvmlEventSetWait(self, event_set: _EventSet, timeoutms: int) -> FakeEventData:
        self._check("nvmlEventSetWait")
        with self._event_ready:
            deadline_s = timeoutms / 1000
            while True:
                for event in list(self._events):
                    mask = event_set.registered.get(event.device.gpu.uuid, 0)
                    if mask & event.eventType:
                        self._events.remove(event)
                        return event
                if event_set.freed or not self._event_ready.wait(deadline_s):
                    raise _error(pynvml.NVML_ERROR_TIMEOUT)
                deadline_s = 0.001  # woken: look again, but never wait past one timeout

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._check("nvmlEventSetFree")
        event_set.freed = True

    # GPM (Hopper+): graphics-engine activity of MIG devices

    def nvmlGpmQueryDeviceSupport(self, handle: _Handle) -> Any:
        gpu = self._check("nvmlGpmQueryDeviceSupport", handle)
        assert gpu is not None
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(gpu.gpm)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._check("nvmlGpmSampleAlloc")
        # A real pointer, so it fits c_nvmlGpmMetricsGet_t.sample1/2; its address names it.
        backing = ctypes.c_uint64(0)
        sample = ctypes.cast(ctypes.pointer(backing), pynvml.c_nvmlGpmSample_t)
        self._gpm_samples[_address(sample)] = (backing, None)
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._check("nvmlGpmSampleFree")
        self._gpm_samples.pop(_address(sample), None)

    def nvmlGpmMigSampleGet(self, handle: _Handle, gpu_instance_id: int, sample: Any) -> Any:
        gpu = self._check("nvmlGpmMigSampleGet", handle)
        assert gpu is not None
        if not gpu.gpm:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mig = self._mig_by_gi(gpu, gpu_instance_id)
        backing, _ = self._gpm_samples[_address(sample)]
        self._gpm_samples[_address(sample)] = (backing, mig.engine_active)
        return sample

    def nvmlGpmMetricsGet(self, metrics_get: Any) -> Any:
        self._check("nvmlGpmMetricsGet")
        first = self._gpm_samples.get(_address(metrics_get.sample1))
        second = self._gpm_samples.get(_address(metrics_get.sample2))
        if first is None or second is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for i in range(metrics_get.numMetrics):
            metric = metrics_get.metrics[i]
            if metric.metricId == pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL and second[1] is not None:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = second[1]
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return metrics_get


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


_GIB = re.compile(r"^(\d+(?:\.\d+)?)\s*GiB$")


def _bytes(value: Any) -> int:
    """``80 GiB`` or a plain number of bytes."""
    if isinstance(value, str):
        match = _GIB.match(value.strip())
        if not match:
            raise ValueError(f"memory size {value!r}: write bytes or 'N GiB'")
        return int(float(match.group(1)) * (1 << 30))
    return int(value)


class _BadGpu(ValueError):
    """A GPU of a description that cannot be built; ``index`` says which."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.index = index


def _gpus(specs: list[Mapping[str, Any]]) -> list[FakeGpu]:
    gpus = []
    for index, spec in enumerate(specs):
        try:
            gpus.append(_gpu(index, spec))
        except (TypeError, ValueError, AttributeError) as error:  # a hand-written typo
            raise _BadGpu(index, error) from error
    return gpus


def _gpu(index: int, spec: Mapping[str, Any]) -> FakeGpu:
    known = set(FakeGpu.__dataclass_fields__) - {"index", "mig", "mig_enabled", "processes"}
    unknown = set(spec) - known - {"mig", "processes"}
    if unknown:
        raise ValueError(f"fake GPU {index}: unknown keys {sorted(unknown)}")
    values = {k: v for k, v in spec.items() if k in known}
    for key in ("mem_total", "mem_used", "mem_reserved"):
        if key in values:
            values[key] = _bytes(values[key])
    for key in _TUPLES:
        if values.get(key) is not None:
            values[key] = tuple(values[key])
    values["processes"] = _processes(spec.get("processes", ()))
    for name in [*(values.get("failing") or {}).values(), *filter(None, [values.get("broken")])]:
        _named_error(str(name))  # a misspelt error name is a mistake in the file
    gpu = FakeGpu(index=index, unsupported=set(spec.get("unsupported", ())),
                  **{k: v for k, v in values.items() if k != "unsupported"})
    mig = spec.get("mig")
    if mig is not None:
        gpu.mig_enabled = bool(mig.get("enabled", True))
        gpu.mig = [_mig(d) for d in mig.get("devices", ())]
    return gpu


def _mig(spec: Mapping[str, Any]) -> FakeMig:
    values = dict(spec)
    for key in ("mem_total", "mem_used"):
        if key in values:
            values[key] = _bytes(values[key])
    values["processes"] = _processes(values.get("processes", ()))
    return FakeMig(**values)


def _processes(specs: Any) -> list[FakeProcess]:
    out = []
    for spec in specs:
        values = dict(spec)
        if values.get("mem_used") is not None:
            values["mem_used"] = _bytes(values["mem_used"])
        out.append(FakeProcess(**values))
    return out
