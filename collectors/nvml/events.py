"""Hardware events: XIDs, double-bit ECC errors, recovery actions and lost GPUs, at once.

Two sources, one rule of "each fact once":

- :class:`EventListener`, a thread blocked in ``nvmlEventSetWait``, hands
  every NVML event to the event loop as a :class:`RawEvent` the moment the
  driver reports it, outside the tick;
- each tick's readings, because counters that only ever grow must become
  events where a rule has to act fast: a volatile DBE counter that grew is an
  ``ecc_dbe`` event even when the driver sent no DBE event, and a remap
  failure, a thermal or power slowdown starting or stopping, and a GPU that
  falls off the bus are events too.

:class:`HardwareEvents` holds what was last seen (on the event loop only, so
the listener thread and the tick's worker thread never race on it) and turns
both into :class:`HwEvent`, without publishing: the collector publishes the
listener's events at once and the tick's through the shared source loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpusteward.collectors.nvml.api import Nvml
from gpusteward.collectors.nvml.reader import Gpu, decode
from gpusteward.schema import DeviceSample, HwEvent

log = logging.getLogger(__name__)

SOURCE = "nvml"
"""The collector's name in NodeSample.source, HwEvent.source and metric labels."""

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


@dataclass(frozen=True)
class RawEvent:
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



def _reasons(mask: int) -> str:
    return ",".join(name for bit, name in SLOWDOWN_REASONS.items() if mask & bit)



@dataclass
class HardwareEvents:
    """What was last seen per GPU, to report each hardware fact once (event loop only)."""

    node_name: str
    dbe: dict[str, int] = field(default_factory=dict)
    remap_failure: dict[str, bool] = field(default_factory=dict)
    slowdown: dict[str, int] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    mig_by_instance: dict[tuple[str, int], str] = field(default_factory=dict)
    """(parent GPU uuid, GPU instance id) -> MIG device uuid, from the last tick."""

    def gpu_lost(self, uuid: str, detail: str, now: float) -> HwEvent | None:
        """``gpu_lost`` for a GPU the tick could not read, unless already reported."""
        if uuid in self.lost:
            return None
        self.lost.add(uuid)
        return HwEvent(ts=now, node=self.node_name, kind="gpu_lost", uuid=uuid, detail=detail,
                       source=SOURCE)

    def answers(self, uuid: str) -> bool:
        """Note that a GPU was read; True when it had been reported lost (it is back)."""
        if uuid not in self.lost:
            return False
        self.lost.discard(uuid)
        return True

    def from_counters(self, device: DeviceSample, now: float) -> list[HwEvent]:
        """The events a GPU's growing counters and slowdown bits imply since the last tick."""
        events: list[HwEvent] = []
        uuid = device.uuid
        dbe = device.ecc_dbe_volatile
        if dbe is not None:
            before = self.dbe.get(uuid)
            self.dbe[uuid] = dbe  # a lower count is a GPU reset: the new baseline
            if before is not None and dbe > before:
                events.append(HwEvent(
                    ts=now, node=self.node_name, kind="ecc_dbe", uuid=uuid, count=dbe,
                    detail=f"volatile double-bit ECC errors {before} -> {dbe}", source=SOURCE))
        if device.remap_failure is not None:
            failed_before = self.remap_failure.get(uuid, False)
            self.remap_failure[uuid] = device.remap_failure
            if device.remap_failure and not failed_before:
                events.append(HwEvent(
                    ts=now, node=self.node_name, kind="remap_failure", uuid=uuid,
                    count=device.remapped_rows_uncorrectable,
                    detail="row remapping failed: the GPU needs service", source=SOURCE))
        if device.clock_event_reasons is not None:
            slowdown = device.clock_event_reasons & SLOWDOWN_MASK
            previous = self.slowdown.get(uuid, 0)
            self.slowdown[uuid] = slowdown
            if slowdown and not previous:
                events.append(HwEvent(
                    ts=now, node=self.node_name, kind="throttle_start", uuid=uuid,
                    detail=_reasons(slowdown), source=SOURCE))
            elif previous and not slowdown:
                events.append(HwEvent(
                    ts=now, node=self.node_name, kind="throttle_stop", uuid=uuid,
                    detail=_reasons(previous), source=SOURCE))
        return events

    def from_raw(self, raw: RawEvent, now: float) -> HwEvent | None:
        """The event an NVML event means, or None when it repeats what was reported."""
        where = ""
        if raw.gpu_instance_id != NO_INSTANCE and raw.uuid is not None:
            mig = self.mig_by_instance.get((raw.uuid, raw.gpu_instance_id))
            where = f" on GPU instance {raw.gpu_instance_id}" + (f" ({mig})" if mig else "")
        if raw.event_type & pynvml.nvmlEventTypeXidCriticalError:
            return HwEvent(ts=now, node=self.node_name, kind="xid", uuid=raw.uuid, xid=raw.data,
                           detail=f"Xid {raw.data}{where}", source=SOURCE)
        if raw.event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            count = raw.dbe_count
            if raw.uuid is not None and count is not None:
                if count <= self.dbe.get(raw.uuid, -1):
                    return None  # the tick already reported this count
                self.dbe[raw.uuid] = count
            return HwEvent(ts=now, node=self.node_name, kind="ecc_dbe", uuid=raw.uuid,
                           count=count, detail=f"double-bit ECC error event{where}",
                           source=SOURCE)
        if raw.event_type & pynvml.nvmlEventTypeGpuRecoveryAction:
            # Xid 154 carries the same news in the kernel log; report it under that number.
            action = RECOVERY_ACTIONS.get(raw.data, "unknown")
            return HwEvent(ts=now, node=self.node_name, kind="xid", uuid=raw.uuid, xid=154,
                           detail=f"GPU recovery action: {action} ({raw.data})", source=SOURCE)
        if raw.event_type & pynvml.nvmlEventTypeGpuUnavailableError:
            if raw.uuid in self.lost:
                return None
            if raw.uuid is not None:
                self.lost.add(raw.uuid)
            return HwEvent(ts=now, node=self.node_name, kind="gpu_lost", uuid=raw.uuid,
                           detail="NVML: GPU unavailable", source=SOURCE)
        return None


class EventListener:
    """A thread blocked in ``nvmlEventSetWait``, handing events to the event loop."""

    def __init__(self, nvml: Nvml, gpus: list[Gpu], wait_ms: int,
                 deliver: Callable[[RawEvent], object],
                 on_error: Callable[[str, BaseException, str], None]) -> None:
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
            self.on_error("nvmlEventSetCreate", e, "")
            return None
        for gpu in self.gpus:
            try:
                mask = self.nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle) & WANTED_EVENTS
                if mask:
                    self.nvml.nvmlDeviceRegisterEvents(gpu.handle, mask, event_set)
                    self.registered[_handle_key(gpu.handle)] = gpu.uuid
            except pynvml.NVMLError as e:
                self.on_error("nvmlDeviceRegisterEvents", e,
                              f"GPU {gpu.index} ({gpu.model}, {gpu.uuid})")
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
                    self.on_error("nvmlEventSetWait", e, "")
                    self._stop.wait(self.wait_ms / 1000)  # no busy loop on a persistent error
                    continue
                try:
                    self.deliver(self._raw(data))
                except RuntimeError:  # the event loop is closed: nobody to deliver to
                    return
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                self.nvml.nvmlEventSetFree(event_set)

    def _raw(self, data: Any) -> RawEvent:
        uuid = self.registered.get(_handle_key(data.device))
        if uuid is None:
            with contextlib.suppress(pynvml.NVMLError):
                uuid = decode(self.nvml.nvmlDeviceGetUUID(data.device))
        dbe_count: int | None = None
        if int(data.eventType) & pynvml.nvmlEventTypeDoubleBitEccError:
            with contextlib.suppress(pynvml.NVMLError):
                dbe_count = int(self.nvml.nvmlDeviceGetTotalEccErrors(
                    data.device, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    pynvml.NVML_VOLATILE_ECC))
        return RawEvent(uuid=uuid, event_type=int(data.eventType), data=int(data.eventData),
                         gpu_instance_id=int(data.gpuInstanceId), dbe_count=dbe_count)
