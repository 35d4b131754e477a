"""dcgm-exporter as a sample source: scrape its /metrics, turn the series into NodeSamples.

A node that already runs NVIDIA's dcgm-exporter (the GPU Operator installs it)
needs no NVML access of ours: its ``/metrics`` page has every reading a
:class:`~gpusteward.schema.DeviceSample` holds, with the pod that uses each
device. This module has two layers:

- :func:`node_samples` maps parsed series (from this page, or from
  Prometheus in :mod:`gpusteward.collectors.prometheus`) to one NodeSample
  per node. It is where the label spellings of every dcgm-exporter release
  and of Prometheus relabelling are reconciled; both sources share it.
- :class:`DcgmSource` fetches the page with aiohttp, parses it with
  prometheus_client's text parser, and refuses a page it cannot trust
  (cut short, unparseable) as a whole: a tick yields a complete sample or a
  counted :class:`SourceError`, never half a node.

Stock dcgm-exporter leaves ECC, NVLink-error, row-remap-pending and
clock-event counters off (its default counters file), so on a stock page the
hardware rules would see nothing and say nothing. :class:`FieldCoverage`
checks every answer for the field families the rules read
(:data:`FIELD_FAMILIES`), logs each missing one once and counts the reads
that lacked it; deploy/components/dcgm-exporter ships a counters file that
enables them all.

MIG: with dcgm-exporter's default ``-d f`` a MIG-enabled GPU is exported per
GPU instance, labelled with the *parent* GPU's UUID plus ``GPU_I_ID`` and
``GPU_I_PROFILE``; the MIG device's own ``MIG-...`` UUID never appears. We
name such a device ``MIG-<parent uuid>/<GPU_I_ID>`` (the driver's pre-R470
MIG naming, without the compute-instance part): stable across scrapes and
restarts, unique per node. Utilisation is not reported for MIG instances,
so MIG devices carry ``engine_active_pct`` (DCGM_FI_PROF_GR_ENGINE_ACTIVE
x 100) and no ``util_pct``. The page has no series of the MIG-enabled GPU
itself: its device-wide readings (:data:`DEVICE_WIDE`: temperature, power,
clocks, PCIe, NVLink, ECC, row remapping) repeat on every instance. They
go on one ``kind="gpu"`` device per parent UUID made here, and off the
instances, which is the shape the NVML reader gives: the hardware rules
run on physical GPUs only and see each GPU once, and a device-wide
counter opens one episode, not one per instance. XIDs are the parent's
too (:class:`XidTracker`), as NVML reports them.

Shared GPUs: with ``--kubernetes-virtual-gpus`` dcgm-exporter repeats a
shared GPU's series once per pod with a ``vgpu`` label, and its GPU_UTIL
and FB_USED series then hold that pod's processes' share (NVML's
per-process calls). Each pod becomes a :class:`DeviceHolder` with its own
activity and memory (``attribution="process"``), the device's utilisation
is the highest share and its memory used the sum. Without the flag a
time-sliced GPU names one pod only; several pods without ``vgpu`` labels
(a merge of scrapes) are listed as ``shared``, readings not split.

It stays one module: the page parser, the series-to-field map and the missing-family
check read the same dcgm-exporter names.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from gpusteward import edge
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.settings import CollectSettings
from gpusteward.collectors.source import SourceError, run_source
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.schema import (
    INT64_MAX,
    Attribution,
    DeviceHolder,
    DeviceSample,
    HwEvent,
    NodeSample,
    PodRef,
)

log = logging.getLogger(__name__)

MIB = 1 << 20
BODY_EXCERPT = 200
"""Characters of a bad page quoted in an error; whole pages do not belong in logs."""


@dataclass(frozen=True)
class Series:
    """One parsed series: metric name, labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


# -- label spellings ---------------------------------------------------------------------------

POD_SPELLINGS: tuple[tuple[str, str, str], ...] = (
    ("pod", "namespace", "container"),
    ("pod_name", "pod_namespace", "container_name"),  # dcgm-exporter --use-old-namespace
    ("exported_pod", "exported_namespace", "exported_container"),  # Prometheus, honorLabels off
    ("exported_pod_name", "exported_pod_namespace", "exported_container_name"),
)
"""(pod, namespace, container) label names, in the order a direct scrape trusts them."""

HOSTNAME_LABELS = ("Hostname", "hostname", "exported_Hostname", "exported_hostname")


def node_of(labels: Mapping[str, str]) -> str | None:
    """The node a series is from: dcgm-exporter's ``Hostname`` (``hostname`` after PR #655)."""
    for name in HOSTNAME_LABELS:
        if labels.get(name):
            return labels[name]
    return None


def pod_of(labels: Mapping[str, str],
           spellings: tuple[tuple[str, str, str], ...] = POD_SPELLINGS) -> PodRef | None:
    """The pod a series is attributed to, trying the label spellings in order."""
    for pod_label, namespace_label, container_label in spellings:
        pod = labels.get(pod_label)
        namespace = labels.get(namespace_label)
        if pod and namespace:
            uid = labels.get("pod_uid") or labels.get("exported_pod_uid") or None
            return PodRef(namespace=namespace, name=pod, uid=uid,
                          container=labels.get(container_label) or None)
    return None


def device_id(labels: Mapping[str, str]) -> tuple[str, str | None] | None:
    """(parent GPU UUID, GPU-instance id or None) of a series; None if it names no GPU."""
    uuid = labels.get("UUID") or labels.get("uuid")
    if not uuid:
        return None
    return uuid, (labels.get("GPU_I_ID") or None)


def mig_device_uuid(parent_uuid: str, gpu_instance_id: str) -> str:
    """The stable id of a MIG device that dcgm-exporter names only by parent and GI id."""
    return f"MIG-{parent_uuid}/{gpu_instance_id}"


# -- field mapping -----------------------------------------------------------------------------

def _pct_from_ratio(value: float) -> float:
    return round(value * 100.0, 4)


def _flag(value: float) -> bool:
    return value != 0


FIELDS: dict[str, tuple[str, Callable[[float], Any]]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("util_pct", float),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("engine_active_pct", _pct_from_ratio),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", float),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", float),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", int),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("clock_event_reasons", int),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("clock_event_reasons", int),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("ecc_sbe_volatile", int),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc_dbe_volatile", int),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("remapped_rows_correctable", int),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("remapped_rows_uncorrectable", int),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("remap_pending", _flag),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("remap_failure", _flag),
    "DCGM_FI_DEV_RETIRED_SBE": ("retired_pages_sbe", int),
    "DCGM_FI_DEV_RETIRED_DBE": ("retired_pages_dbe", int),
    "DCGM_FI_DEV_RETIRED_PENDING": ("retired_pages_pending", _flag),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replay", int),
}
"""dcgm-exporter metric -> (DeviceSample field, conversion)."""

FB_FIELDS = ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED")
"""Framebuffer MiB: used, free, reserved; total = their sum (NVML's total includes reserved)."""

NVLINK_REPLAY_FIELDS = (
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)
"""Summed into ``nvlink_errors``: replays and recoveries, the link's real trouble."""
NVLINK_CRC_FIELDS = (
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
)
"""Summed into ``nvlink_crc_errors``: routine on a healthy link, judged on their rate."""
NVLINK_ERROR_FIELDS = (*NVLINK_CRC_FIELDS, *NVLINK_REPLAY_FIELDS)
XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"

PER_POD_FIELDS = {"DCGM_FI_DEV_GPU_UTIL": "util_pct", "DCGM_FI_DEV_FB_USED": "mem_used_bytes"}
"""Metrics that hold one pod's share of a shared GPU when the series has a ``vgpu`` label
(``--kubernetes-virtual-gpus``: dcgm-exporter splits them by process); the others repeat
the device's reading in every pod's series."""
VGPU_LABEL = "vgpu"

DEVICE_WIDE = frozenset({
    "temp_c", "power_w", "sm_clock_mhz", "clock_event_reasons", "ecc_sbe_volatile",
    "ecc_dbe_volatile", "remapped_rows_correctable", "remapped_rows_uncorrectable",
    "remap_pending", "remap_failure", "pcie_replay", "retired_pages_sbe", "retired_pages_dbe",
    "retired_pages_pending",
})
"""DeviceSample fields that describe the physical GPU (the NVLink errors too): on a
MIG-enabled GPU dcgm-exporter repeats them on every instance; they belong to the parent,
where the NVML reader puts them."""

MAPPED_METRICS: tuple[str, ...] = (*FIELDS, *FB_FIELDS, *NVLINK_ERROR_FIELDS, XID_FIELD)
"""Every metric this module reads; the Prometheus source asks for exactly these."""

_DEVICE_FIELDS = {f.name: f.type for f in msgspec.structs.fields(DeviceSample)}


def bounded(name: str, value: Any) -> Any:
    """``value`` if the schema accepts it for DeviceSample field ``name``, else ValueError.

    A reading out of its unit's range (a counter past int64, a negative memory size) is
    a broken exporter's; published, it would make the worker refuse the node's whole
    sample, so it is dropped here, series by series.
    """
    try:
        return msgspec.convert(value, _DEVICE_FIELDS[name])
    except msgspec.ValidationError as error:
        raise ValueError(f"{name}={value!r}: {error}") from error


@dataclass(frozen=True)
class FieldFamily:
    """DCGM fields that feed one reading a rule needs; present when any of its metrics is."""

    name: str
    metrics: tuple[str, ...]
    readers: str
    """The rules (or reports) that see nothing without it."""


FIELD_FAMILIES: tuple[FieldFamily, ...] = (
    FieldFamily("gpu_util", ("DCGM_FI_DEV_GPU_UTIL",), "idle_holder on whole GPUs"),
    FieldFamily("gr_engine_active", ("DCGM_FI_PROF_GR_ENGINE_ACTIVE",),
                "idle_holder on MIG devices"),
    FieldFamily("framebuffer", ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"),
                "memory use in reports"),
    FieldFamily("temperature", ("DCGM_FI_DEV_GPU_TEMP",), "thermal_slowdown"),
    FieldFamily("clock_event_reasons", ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                                        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
                "thermal_slowdown"),
    FieldFamily("ecc_sbe", ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",), "ecc_sbe_rate"),
    FieldFamily("ecc_dbe", ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",), "ecc_dbe"),
    FieldFamily("xid", (XID_FIELD,), "xid"),
    FieldFamily("row_remap_failure", ("DCGM_FI_DEV_ROW_REMAP_FAILURE",), "remap_failure"),
    # One family for both mechanisms: a GPU has row remapping (Ampere and newer) or page
    # retirement (before), never both, so either series means the reset news is read.
    FieldFamily("row_remap_pending", ("DCGM_FI_DEV_ROW_REMAP_PENDING",
                                      "DCGM_FI_DEV_RETIRED_PENDING"),
                "remap_pending and retired_pages_pending"),
    # Likewise the counts: remapped rows (stock) on Ampere and newer, retired pages before.
    FieldFamily("retired_memory", ("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE",
                                   "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
                                   "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
                "retired_pages on pre-Ampere GPUs"),
    FieldFamily("nvlink_errors", NVLINK_REPLAY_FIELDS, "nvlink_errors"),
    FieldFamily("nvlink_crc_errors", NVLINK_CRC_FIELDS, "nvlink_crc_errors"),
    FieldFamily("pcie_replay", ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",), "pcie_replay"),
)
"""What the rules read, by family; every metric here is in :data:`MAPPED_METRICS`."""

NVML_ONLY_RULES: tuple[str, ...] = ("gpu_recovery_action",)
"""Rules no dcgm-exporter field can feed, however its counters are set: the driver's
recovery action (NVML field 230) has no DCGM field. They fire from the NVML collector only
(an Xid 154 still reaches the ``xid`` rule)."""


class FieldCoverage:
    """Notices the field families a source's answers lack: logged once, counted every read.

    A family is missing from an answer when none of its metrics has a series
    in it: the exporter's counters file leaves it out, or the GPUs do not
    support it (dcgm-exporter skips blank values). Either way the rules that
    read it are blind, which must not be silent.
    """

    def __init__(self, source: str, metrics: CollectorMetrics | None = None) -> None:
        self.source = source
        self.metrics = metrics
        self.missing: set[str] = set()
        """Families the last checked answer lacked."""
        self._logged: set[str] = set()

    def check(self, names: Iterable[str]) -> list[FieldFamily]:
        """Record one answer (the metric names of its series); return the families it lacks."""
        present = set(names)
        lacking = [f for f in FIELD_FAMILIES if present.isdisjoint(f.metrics)]
        self.missing = {f.name for f in lacking}
        for family in lacking:
            if self.metrics is not None:
                self.metrics.missing_field_families.labels(self.source, family.name).inc()
            if family.name not in self._logged:
                self._logged.add(family.name)
                log.warning(
                    "%s: no %s series (%s): %s sees nothing from this source. Enable the "
                    "fields in dcgm-exporter's counters file (deploy/components/dcgm-exporter/"
                    "dcgm-metrics.csv) or check that these GPUs support them",
                    self.source, family.name, ", ".join(family.metrics), family.readers)
        return lacking


@dataclass
class _Device:
    """The readings of one device gathered across the page's families."""

    parent_uuid: str
    gpu_instance_id: str | None
    index: int = -1
    model: str = ""
    mig_profile: str | None = None
    pods: list[PodRef] = field(default_factory=list)
    """Every pod a series of the device names. Several only on a shared GPU with
    ``--kubernetes-virtual-gpus`` (without it dcgm-exporter names one pod per GPU), where
    GPU_UTIL and FB_USED are each pod's own (:attr:`shares`) and the rest repeat."""
    shares: dict[tuple[str, str], dict[str, dict[str, float]]] = field(default_factory=dict)
    """(namespace, pod) -> per-pod field -> ``vgpu`` label -> that series' reading (percent,
    or MiB for memory)."""
    values: dict[str, Any] = field(default_factory=dict)
    framebuffer: dict[str, float] = field(default_factory=dict)
    nvlink: dict[str, int] = field(default_factory=dict)
    """NVLink error counter -> its reading; ``nvlink_errors`` sums the replay and recovery
    counters, ``nvlink_crc_errors`` the CRC ones. Kept per counter,
    not added up series by series, so a counter Prometheus holds twice (the exporter
    scraped by two jobs) is counted once."""

    @property
    def uuid(self) -> str:
        if self.gpu_instance_id is None:
            return self.parent_uuid
        return mig_device_uuid(self.parent_uuid, self.gpu_instance_id)

    def sample(self, refusals: edge.Refusals) -> DeviceSample:
        values = dict(self.values)
        framebuffer = dict(self.framebuffer)
        holders = [DeviceHolder(pod=pod) for pod in self.pods] if len(self.pods) > 1 else []
        attribution: Attribution | None = (None if not self.pods else "device"
                                           if len(self.pods) == 1 else "shared")
        if self.shares:
            holders = [self._holder(pod) for pod in self.pods]
            attribution = "process"
            activity = [h.activity_pct for h in holders if h.activity_pct is not None]
            if activity:
                values["util_pct"] = max(activity)
            shared_mib = [sum(own.get("mem_used_bytes", {}).values())
                          for own in self.shares.values() if own.get("mem_used_bytes")]
            if shared_mib:
                framebuffer["DCGM_FI_DEV_FB_USED"] = sum(shared_mib)
        used = framebuffer.get("DCGM_FI_DEV_FB_USED")
        total = None
        if all(name in framebuffer for name in FB_FIELDS):
            total = _kept("mem_total_bytes",
                          int(sum(framebuffer[name] for name in FB_FIELDS) * MIB), refusals)
        mig = self.gpu_instance_id is not None
        if mig:
            # dcgm-exporter does not report GPU_UTIL per GPU instance; should a release ever
            # repeat the parent's value there, it would not describe this device.
            values.pop("util_pct", None)
        return DeviceSample(
            uuid=self.uuid, index=self.index, model=self.model,
            kind="mig" if mig else "gpu",
            parent_uuid=self.parent_uuid if mig else None,
            mig_profile=self.mig_profile,
            gpu_instance_id=int(self.gpu_instance_id) if self.gpu_instance_id else None,
            mem_used_bytes=(_kept("mem_used_bytes", int(used * MIB), refusals)
                            if used is not None else None),
            mem_total_bytes=total,
            nvlink_errors=self._nvlink("nvlink_errors", NVLINK_REPLAY_FIELDS, refusals),
            nvlink_crc_errors=self._nvlink("nvlink_crc_errors", NVLINK_CRC_FIELDS, refusals),
            pod=self.pods[0] if self.pods else None,
            # Several pods without per-pod series ("shared"): their readings cannot be told
            # apart, and the rules treat the device's readings as everyone's.
            holders=holders, attribution=attribution,
            **values,
        )

    def _nvlink(self, name: str, metrics: tuple[str, ...],
                refusals: edge.Refusals) -> int | None:
        """The sum of the NVLink counters ``metrics`` the page has, for field ``name``; None
        when it has none of them."""
        counts = [self.nvlink[metric] for metric in metrics if metric in self.nvlink]
        return _kept(name, sum(counts), refusals) if counts else None

    def _holder(self, pod: PodRef) -> DeviceHolder:
        """A pod's share from its ``vgpu`` series, summed over them as NVML's per-process
        attribution sums a pod's processes; None where the pod had no such series."""
        own = self.shares.get((pod.namespace, pod.name), {})
        util = own.get("util_pct")
        mib = own.get("mem_used_bytes")
        return DeviceHolder(
            pod=pod,
            activity_pct=None if not util else min(100.0, sum(util.values())),
            mem_used_bytes=None if not mib else int(sum(mib.values()) * MIB))


def _kept(name: str, value: Any, refusals: edge.Refusals) -> Any:
    """``value`` within its field's bounds, else None (not reported), counted."""
    try:
        return bounded(name, value)
    except ValueError as error:
        refusals.note(name, "dropping a reading out of range: %s", error)
        return None


PodResolver = Callable[[Mapping[str, str]], PodRef | None]
NodeResolver = Callable[[Mapping[str, str]], str | None]


def node_samples(series: Iterable[Series], ts: float, source: str,
                 node: str | None = None, pod_resolver: PodResolver = pod_of,
                 refusals: edge.Refusals | None = None,
                 node_resolver: NodeResolver = node_of) -> dict[str, NodeSample]:
    """Group series by node and device into one NodeSample per node.

    ``node`` pins every series to one node (a per-node scrape, where the node
    name comes from the settings); otherwise ``node_resolver`` (the ``Hostname``
    label) decides and series it names no node for are skipped. Devices are ordered by GPU index,
    then GPU-instance id. A series that cannot be a reading (a value out of
    its field's range, a GPU-instance id that is no number) is skipped and
    counted in ``refusals``, logged once per metric.
    """
    refusals = refusals if refusals is not None else edge.Refusals(log)
    nodes: dict[str, dict[tuple[str, str | None], _Device]] = {}
    for item in series:
        if not math.isfinite(item.value):
            continue
        ident = device_id(item.labels)
        node_name = node or node_resolver(item.labels)
        if ident is None or node_name is None:
            continue
        devices = nodes.setdefault(node_name, {})
        device = devices.get(ident)
        pod = pod_resolver(item.labels)
        try:
            if device is None:
                device = devices[ident] = _new_device(ident, item.labels)
            _apply(device, item, pod)
        except ValueError as error:
            refusals.note(item.name, "skipping series %s of %s: %s", item.name, ident[0], error)
            continue
        if pod is not None and all((p.namespace, p.name) != (pod.namespace, pod.name)
                                   for p in device.pods):
            device.pods.append(pod)
    for devices in nodes.values():
        _add_mig_parents(devices)
    return {
        name: NodeSample(ts=ts, node=name, source=source, devices=[
            device.sample(refusals) for device in sorted(
                devices.values(),
                key=lambda d: (d.index, int(d.gpu_instance_id or -1), d.parent_uuid))
        ])
        for name, devices in nodes.items()
    }


def _new_device(ident: tuple[str, str | None], labels: Mapping[str, str]) -> _Device:
    if ident[1] is not None and not ident[1].isdigit():
        raise ValueError(f"GPU_I_ID {ident[1][:40]!r} is no number")
    index = labels.get("gpu", "")
    return _Device(
        parent_uuid=ident[0], gpu_instance_id=ident[1],
        index=int(index) if index.isdigit() else -1,
        model=labels.get("modelName") or labels.get("modelname") or "",
        mig_profile=labels.get("GPU_I_PROFILE") or None,
    )


def _add_mig_parents(devices: dict[tuple[str, str | None], _Device]) -> None:
    """Give every MIG-enabled GPU a ``kind="gpu"`` device with its device-wide readings.

    They are taken off the instances, which only repeat them (the highest value where a
    release does not repeat them exactly: counters only grow). A parent with series of
    its own (an exporter run with GPU entities too) keeps its own readings.
    """
    instances: dict[str, list[_Device]] = {}
    for device in devices.values():
        if device.gpu_instance_id is not None:
            instances.setdefault(device.parent_uuid, []).append(device)
    for parent_uuid, parts in instances.items():
        parent = devices.get((parent_uuid, None))
        if parent is None:
            parent = devices[(parent_uuid, None)] = _Device(
                parent_uuid=parent_uuid, gpu_instance_id=None, index=parts[0].index,
                model=parts[0].model)
        repeated: dict[str, Any] = {}
        nvlink: dict[str, int] = {}
        for part in parts:
            for name in DEVICE_WIDE & part.values.keys():
                value = part.values.pop(name)
                repeated[name] = max(repeated.get(name, value), value)
            for name, count in part.nvlink.items():
                nvlink[name] = max(nvlink.get(name, count), count)
            part.nvlink = {}
        parent.values = {**repeated, **parent.values}
        parent.nvlink = parent.nvlink or nvlink


def _apply(device: _Device, item: Series, pod: PodRef | None = None) -> None:
    share = PER_POD_FIELDS.get(item.name)
    if share is not None and pod is not None and VGPU_LABEL in item.labels:
        bounded(share, float(item.value) if share == "util_pct" else int(item.value * MIB))
        per_field = device.shares.setdefault((pod.namespace, pod.name), {})
        per_field.setdefault(share, {})[item.labels[VGPU_LABEL]] = float(item.value)
        return
    mapped = FIELDS.get(item.name)
    if mapped is not None:
        name, convert = mapped
        device.values[name] = bounded(name, convert(item.value))
    elif item.name in FB_FIELDS:
        device.framebuffer[item.name] = item.value
    elif item.name in NVLINK_ERROR_FIELDS:
        # The same counter twice (two scrape jobs, one behind): the higher is the newer.
        count = bounded("nvlink_errors", int(item.value))
        device.nvlink[item.name] = max(device.nvlink.get(item.name, count), count)


class XidTracker:
    """Turns the last-XID gauge into one HwEvent per change.

    ``DCGM_FI_DEV_XID_ERRORS`` holds the code of the last XID a device raised.
    A device's first non-zero value is reported too: after a collector
    restart the fault may be new to the pipeline, and the consumers are
    idempotent, so a repeat costs less than a miss. Limitation: the same
    code raised twice in a row does not change the gauge and is seen once.

    On a MIG-enabled GPU the gauge is read per GPU instance, but the event names
    the parent GPU (the instance goes in its detail), as NVML's XID events do:
    the XID rules judge physical GPUs, and a code every instance repeats is one
    event, not one per instance.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], int] = {}

    def events(self, series: Iterable[Series], ts: float, source: str,
               node: str | None = None, node_resolver: NodeResolver = node_of,
               ) -> list[HwEvent]:
        found: list[HwEvent] = []
        reported: set[tuple[str, str, int]] = set()
        for item in series:
            if item.name != XID_FIELD or not math.isfinite(item.value):
                continue
            ident = device_id(item.labels)
            node_name = node or node_resolver(item.labels)
            if ident is None or node_name is None:
                continue
            parent, instance = ident
            code = int(item.value)
            if not 0 <= code <= INT64_MAX:
                continue  # no XID code: node_samples counts the series it cannot read
            key = (node_name, parent if instance is None else mig_device_uuid(parent, instance))
            previous = self._last.get(key)
            self._last[key] = code
            if code == 0 or code == previous or (node_name, parent, code) in reported:
                continue
            reported.add((node_name, parent, code))
            detail = item.labels.get("err_msg", "")
            if instance is not None:
                detail = f"{detail} on GPU instance {instance}".strip()
            found.append(HwEvent(ts=ts, node=node_name, kind="xid", uuid=parent, xid=code,
                                 detail=detail, source=source))
        return found


LOST_AFTER_SCRAPES = 3
"""Readable answers in a row a known GPU must be missing from before it is reported lost."""


class LostGpus:
    """Turns a GPU that left a node's page into one ``gpu_lost`` event.

    dcgm-exporter says nothing of a GPU fallen off the bus: DCGM answers blank values
    for it, dcgm-exporter skips blank values, and the GPU's series leave the page (an
    Xid 79 rarely makes it to ``DCGM_FI_DEV_XID_ERRORS`` first). So a physical GPU
    (parent UUID, which a MIG reconfiguration keeps) seen on a node is reported lost
    once it is missing from ``after`` answers in a row that had the node's other GPUs:
    a scrape that fails or has no GPU series at all (the exporter down, the node gone or
    drained of its driver) is no answer and moves nothing, and one missed scrape is no
    loss. A GPU that comes back is forgotten as lost, so a second loss is reported again.

    A MIG-enabled GPU is not followed: dcgm-exporter reports it only through its GPU
    instances, and a MIG reconfiguration (mig-parted destroys every instance, then makes
    the new layout) leaves it with none and no series for as long as that takes; reported
    lost, the gpu_lost rule would drain a node under reconfiguration. The NVML collector
    reports a lost MIG-enabled GPU.

    Limitations: a GPU already gone when this collector starts is never seen, so never
    reported (the NVML collector reports it); a node's last GPU leaves an empty page,
    which is a scrape error, not a loss.
    """

    def __init__(self, source: str, after: int = LOST_AFTER_SCRAPES) -> None:
        if after < 1:
            raise ValueError(f"after must be at least 1, not {after}")
        self.source = source
        self.after = after
        self._known: dict[str, dict[str, int]] = {}
        """node -> parent UUID -> GPU index, of every GPU seen."""
        self._missing: dict[tuple[str, str], int] = {}
        """(node, UUID) -> answers in a row without it."""
        self._reported: set[tuple[str, str]] = set()

    def events(self, samples: Iterable[NodeSample], ts: float) -> list[HwEvent]:
        """The GPUs the answer's nodes lost, each once; a node not in it is not judged."""
        found: list[HwEvent] = []
        for sample in samples:
            present = {d.uuid: d.index for d in sample.devices if d.kind == "gpu"}
            if not present:
                continue
            mig = {d.parent_uuid for d in sample.devices if d.parent_uuid is not None}
            known = self._known.setdefault(sample.node, {})
            for uuid, index in present.items():
                self._missing.pop((sample.node, uuid), None)
                self._reported.discard((sample.node, uuid))
                if uuid in mig:  # its instances may all go in a reconfiguration
                    known.pop(uuid, None)
                else:
                    known[uuid] = index
            for uuid, index in known.items():
                key = (sample.node, uuid)
                if uuid in present or key in self._reported:
                    continue
                self._missing[key] = count = self._missing.get(key, 0) + 1
                if count < self.after:
                    continue
                self._reported.add(key)
                found.append(HwEvent(
                    ts=ts, node=sample.node, kind="gpu_lost", uuid=uuid, source=self.source,
                    detail=f"GPU {index} gone from dcgm-exporter's series ({self.source}) for "
                           f"{count} reads while the node's other GPUs are reported; "
                           "fallen off the bus?"))
        return found


# -- the scrape --------------------------------------------------------------------------------

def parse_page(text: str) -> list[Series]:
    """Parse a whole /metrics page; raise :class:`SourceError` if it cannot be trusted.

    The page must end with a newline, as the text format requires: a body
    cut short mid-number would otherwise parse into a wrong value.
    """
    if not text.strip():
        raise SourceError("empty", "the exporter returned an empty page")
    if not text.endswith("\n"):
        raise SourceError(
            "truncated", f"the page ends mid-line (...{text[-BODY_EXCERPT // 2:]!r}); cut short?")
    try:
        return [
            Series(family.name, sample.labels, float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except ValueError as error:
        raise SourceError("parse", f"unparseable page: {str(error)[:BODY_EXCERPT]}") from error


class DcgmSource:
    """One node's dcgm-exporter, read once per tick."""

    source = "dcgm"

    def __init__(self, url: str, node: str | None, session: aiohttp.ClientSession,
                 timeout_s: float = 5.0, metrics: CollectorMetrics | None = None) -> None:
        """``node`` None: name the sample after the page's ``Hostname`` label.

        dcgm-exporter sets that label from its own ``NODE_NAME`` (the GPU
        Operator fills it with the pod's node), so it is the right key when
        this collector was not told its node: the host name of a pod
        without host networking is the pod's name, not the node's.
        """
        self.url = url
        self.node = node
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._xids = XidTracker()
        self._lost = LostGpus(self.source)
        self.coverage = FieldCoverage(self.source, metrics)
        self.refusals = edge.Refusals(log)
        """Series skipped as unreadable, by metric."""

    async def fetch(self) -> str:
        """The page's text; :class:`SourceError` if the exporter cannot be read."""
        try:
            async with self._session.get(self.url, timeout=self._timeout) as response:
                if response.status != 200:
                    body = (await response.text(errors="replace"))[:BODY_EXCERPT]
                    raise SourceError("http_status",
                                      f"{self.url} answered {response.status}: {body!r}")
                return await response.text(errors="replace")
        except aiohttp.ClientPayloadError as error:
            # The connection closed before Content-Length bytes (or the last chunk) arrived.
            raise SourceError("truncated", f"{self.url}: body cut short: {error}") from error
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            raise SourceError("unreachable",
                              f"{self.url} unreachable: {type(error).__name__}: {error}") from error

    def parse(self, text: str, ts: float) -> tuple[NodeSample, list[HwEvent]]:
        """One NodeSample (and the XID changes) from a page; all or nothing."""
        series = parse_page(text)
        node = self.node
        if node is None:
            named = {node_of(item.labels) for item in series} - {None}
            if len(named) != 1:
                raise SourceError("parse", f"{self.url}: expected one Hostname label, found "
                                  f"{sorted(n or '' for n in named)}; set the node name")
            node = named.pop()
        samples = node_samples(series, ts, self.source, node=node, refusals=self.refusals)
        sample = samples.get(node or "")
        if sample is None or not sample.devices:
            raise SourceError("empty", f"{self.url} reports no GPU series")
        self.coverage.check(item.name for item in series)
        # Only a page that made a sample moves the XID and lost-GPU state on, so an event is never
        # consumed by a tick whose sample was refused.
        events = self._xids.events(series, ts, self.source, node=node)
        return sample, events + self._lost.events([sample], ts)

    async def collect(self) -> tuple[list[NodeSample], list[HwEvent]]:
        text = await self.fetch()
        sample, events = self.parse(text, time.time())
        return [sample], events


async def run_dcgm_collector(settings: CollectSettings, publisher: Publisher,
                             stop: asyncio.Event, metrics: CollectorMetrics | None = None,
                             ) -> None:
    """Scrape this node's dcgm-exporter every ``settings.interval_s`` until ``stop``.

    The node name is the configured one when it was set (flag, environment
    or ``NODE_NAME``), else dcgm-exporter's ``Hostname`` label.
    """
    explicit = "node_name" in settings.model_fields_set or bool(os.environ.get("NODE_NAME"))
    async with aiohttp.ClientSession() as session:
        source = DcgmSource(settings.dcgm_url, settings.node_name if explicit else None,
                            session, timeout_s=settings.scrape_timeout_s, metrics=metrics)
        await run_source(source, publisher, stop, settings.interval_s, metrics)
