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
x 100) and no ``util_pct``.

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
from gpusteward.schema import INT64_MAX, DeviceHolder, DeviceSample, HwEvent, NodeSample, PodRef

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
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replay", int),
}
"""dcgm-exporter metric -> (DeviceSample field, conversion)."""

FB_FIELDS = ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED")
"""Framebuffer MiB: used, free, reserved; total = their sum (NVML's total includes reserved)."""

NVLINK_ERROR_FIELDS = (
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)
XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"

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
    FieldFamily("row_remap_pending", ("DCGM_FI_DEV_ROW_REMAP_PENDING",), "remap_pending"),
    FieldFamily("nvlink_errors", NVLINK_ERROR_FIELDS, "nvlink_errors"),
    FieldFamily("pcie_replay", ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",), "pcie_replay"),
)
"""What the rules read, by family; every metric here is in :data:`MAPPED_METRICS`."""


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
    """Every pod a series of the device names: dcgm-exporter repeats a time-sliced GPU's
    series once per pod, all with the same device readings."""
    values: dict[str, Any] = field(default_factory=dict)
    framebuffer: dict[str, float] = field(default_factory=dict)
    nvlink_errors: int | None = None

    @property
    def uuid(self) -> str:
        if self.gpu_instance_id is None:
            return self.parent_uuid
        return mig_device_uuid(self.parent_uuid, self.gpu_instance_id)

    def sample(self, refusals: edge.Refusals) -> DeviceSample:
        used = self.framebuffer.get("DCGM_FI_DEV_FB_USED")
        total = None
        if all(name in self.framebuffer for name in FB_FIELDS):
            total = _kept("mem_total_bytes",
                          int(sum(self.framebuffer[name] for name in FB_FIELDS) * MIB), refusals)
        mig = self.gpu_instance_id is not None
        values = dict(self.values)
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
            mem_total_bytes=total, nvlink_errors=self.nvlink_errors,
            pod=self.pods[0] if self.pods else None,
            # Several pods: their readings cannot be told apart here (no per-process metrics),
            # so the sample says so, and the rules treat the device's readings as everyone's.
            holders=[DeviceHolder(pod=pod) for pod in self.pods] if len(self.pods) > 1 else [],
            attribution=(None if not self.pods else "device" if len(self.pods) == 1
                         else "shared"),
            **values,
        )


def _kept(name: str, value: Any, refusals: edge.Refusals) -> Any:
    """``value`` within its field's bounds, else None (not reported), counted."""
    try:
        return bounded(name, value)
    except ValueError as error:
        refusals.note(name, "dropping a reading out of range: %s", error)
        return None


PodResolver = Callable[[Mapping[str, str]], PodRef | None]


def node_samples(series: Iterable[Series], ts: float, source: str,
                 node: str | None = None, pod_resolver: PodResolver = pod_of,
                 refusals: edge.Refusals | None = None) -> dict[str, NodeSample]:
    """Group series by node and device into one NodeSample per node.

    ``node`` pins every series to one node (a per-node scrape, where the node
    name comes from the settings); otherwise the ``Hostname`` label decides
    and series without one are skipped. Devices are ordered by GPU index,
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
        node_name = node or node_of(item.labels)
        if ident is None or node_name is None:
            continue
        devices = nodes.setdefault(node_name, {})
        device = devices.get(ident)
        try:
            if device is None:
                device = devices[ident] = _new_device(ident, item.labels)
            _apply(device, item)
        except ValueError as error:
            refusals.note(item.name, "skipping series %s of %s: %s", item.name, ident[0], error)
            continue
        pod = pod_resolver(item.labels)
        if pod is not None and all((p.namespace, p.name) != (pod.namespace, pod.name)
                                   for p in device.pods):
            device.pods.append(pod)
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


def _apply(device: _Device, item: Series) -> None:
    mapped = FIELDS.get(item.name)
    if mapped is not None:
        name, convert = mapped
        device.values[name] = bounded(name, convert(item.value))
    elif item.name in FB_FIELDS:
        device.framebuffer[item.name] = item.value
    elif item.name in NVLINK_ERROR_FIELDS:
        device.nvlink_errors = bounded("nvlink_errors",
                                       (device.nvlink_errors or 0) + int(item.value))


class XidTracker:
    """Turns the last-XID gauge into one HwEvent per change.

    ``DCGM_FI_DEV_XID_ERRORS`` holds the code of the last XID a device raised.
    A device's first non-zero value is reported too: after a collector
    restart the fault may be new to the pipeline, and the consumers are
    idempotent, so a repeat costs less than a miss. Limitation: the same
    code raised twice in a row does not change the gauge and is seen once.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], int] = {}

    def events(self, series: Iterable[Series], ts: float, source: str,
               node: str | None = None) -> list[HwEvent]:
        found: list[HwEvent] = []
        for item in series:
            if item.name != XID_FIELD or not math.isfinite(item.value):
                continue
            ident = device_id(item.labels)
            node_name = node or node_of(item.labels)
            if ident is None or node_name is None:
                continue
            parent, instance = ident
            uuid = parent if instance is None else mig_device_uuid(parent, instance)
            code = int(item.value)
            if not 0 <= code <= INT64_MAX:
                continue  # no XID code: node_samples counts the series it cannot read
            previous = self._last.get((node_name, uuid))
            self._last[(node_name, uuid)] = code
            if code != 0 and code != previous:
                found.append(HwEvent(
                    ts=ts, node=node_name, kind="xid", uuid=uuid, xid=code,
                    detail=item.labels.get("err_msg", ""), source=source,
                ))
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
        # Only a page that made a sample moves the XID state on, so an event is never
        # consumed by a tick whose sample was refused.
        return sample, self._xids.events(series, ts, self.source, node=node)

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
