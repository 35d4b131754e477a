"""dcgm-exporter's ``/metrics`` pages for the simulated nodes, served over HTTP.

What users run today to watch GPUs is dcgm-exporter scraped by Prometheus.
To set that recipe beside gpusteward on the same simulated fleet (``make
bench``, benchmarks/bench_peer.py), and to read the world through the
production dcgm collector, each simulated node gets the page its
dcgm-exporter would serve: one server, a path per node
(``/nodes/<node>/metrics``).

A page is written as dcgm-exporter 4.x writes it (the shipped fixture,
shared/data/dcgm_exporter_metrics.txt, says where each detail comes from):
the metric names, ``# HELP`` and ``# TYPE`` of the counters file this
project ships (deploy/components/dcgm-exporter/dcgm-metrics.csv), the label
order of its render template (``gpu, UUID, pci_bus_id, device, modelName,
[GPU_I_PROFILE, GPU_I_ID], Hostname``, the driver-version label, then the
pod attributes in sorted order), integers as ``%d`` and doubles as ``%f``,
and a reading the device does not report left out rather than written as
zero. A MIG device is exported per GPU instance under its parent's UUID,
with graphics-engine activity and no GPU utilisation, as dcgm-exporter's
default ``-d f`` does; a GPU several pods share (time-slicing, MPS) has its
series repeated once per pod, with the device's readings, as dcgm-exporter
cannot split them either.

prometheus_client's writer is not used: it renames every counter's
``# TYPE`` line to ``<name>_total``, which dcgm-exporter does not do
(``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` and ``DCGM_FI_DEV_PCIE_REPLAY_COUNTER`` are
counters under their own names), so the page would not be the page users
scrape.

The readings are the simulator's: :meth:`DcgmPages.sample` takes each
NodeSample the world receives (the same one the node's fake NVML is set
from), :meth:`DcgmPages.hw_event` the XIDs, which dcgm-exporter shows as
the last XID code of each device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from gpusteward.broker import free_port
from gpusteward.schema import DeviceSample, HwEvent, NodeSample, PodRef

MIB = 1 << 20
DRIVER_VERSION = "580.105.08"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Field:
    """One dcgm-exporter metric: its name, type, help text and how it reads a device."""

    name: str
    type: str
    help: str
    read: Callable[[DeviceSample], float | None]
    double: bool = False
    """Written with ``%f`` (a DCGM double), else ``%d`` (a DCGM int64)."""


def _mib(value: int | None) -> int | None:
    return None if value is None else value // MIB


def _free_mib(device: DeviceSample) -> int | None:
    if device.mem_total_bytes is None or device.mem_used_bytes is None:
        return None
    return device.mem_total_bytes // MIB - device.mem_used_bytes // MIB


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


def _ratio(pct: float | None) -> float | None:
    return None if pct is None else pct / 100.0


def _rounded(value: float | None) -> int | None:
    return None if value is None else round(value)


WHOLE_GPU_ONLY = frozenset({"DCGM_FI_DEV_GPU_UTIL"})
"""Not reported for MIG instances (dcgm-exporter issues #50, #430)."""

FIELDS: tuple[Field, ...] = (
    Field("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
          lambda d: d.sm_clock_mhz),
    Field("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Current clock event reasons (bit mask).",
          lambda d: d.clock_event_reasons),
    Field("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
          lambda d: _rounded(d.temp_c)),
    Field("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).",
          lambda d: d.power_w, double=True),
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
          lambda d: d.pcie_replay),
    Field("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
          lambda d: _rounded(d.util_pct)),
    Field("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", _free_mib),
    Field("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
          lambda d: _mib(d.mem_used_bytes)),
    Field("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
          lambda d: None if d.mem_total_bytes is None else 0),
    Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
          "Total number of single-bit volatile ECC errors.", lambda d: d.ecc_sbe_volatile),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
          "Total number of double-bit volatile ECC errors.", lambda d: d.ecc_dbe_volatile),
    Field("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter",
          "Total number of NVLink flow-control CRC errors.", lambda d: d.nvlink_crc_errors),
    Field("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter",
          "Total number of NVLink retries.", lambda d: d.nvlink_errors),
    Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
          "Number of remapped rows for uncorrectable errors",
          lambda d: d.remapped_rows_uncorrectable),
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
          "Number of remapped rows for correctable errors",
          lambda d: d.remapped_rows_correctable),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
          lambda d: _flag(d.remap_failure)),
    Field("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending",
          lambda d: _flag(d.remap_pending)),
    Field("DCGM_FI_DEV_RETIRED_SBE", "counter",
          "Total number of retired pages due to single-bit errors.",
          lambda d: d.retired_pages_sbe),
    Field("DCGM_FI_DEV_RETIRED_DBE", "counter",
          "Total number of retired pages due to double-bit errors.",
          lambda d: d.retired_pages_dbe),
    Field("DCGM_FI_DEV_RETIRED_PENDING", "counter", "Total number of pages pending retirement.",
          lambda d: _flag(d.retired_pages_pending)),
    Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
          lambda d: _ratio(d.engine_active_pct), double=True),
)
XID = Field("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
            lambda d: None)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs) + "}"


def _number(value: float, double: bool) -> str:
    return f"{value:f}" if double else f"{int(value):d}"


class DcgmPages:
    """The latest dcgm-exporter page of every simulated node, and the server that serves them.

    Use as ``async with DcgmPages() as pages:``; feed it with :meth:`sample`
    and :meth:`hw_event`; point a scraper at :meth:`url`. A node not yet
    sampled answers 404, as a node without an exporter would.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port()
        self._samples: dict[str, NodeSample] = {}
        self._last_xid: dict[tuple[str, str], tuple[int, str]] = {}
        self._runner: web.AppRunner | None = None

    # --- what the world tells it ------------------------------------------------

    def sample(self, sample: NodeSample) -> None:
        """The node's readings now; its page shows them until the next sample."""
        self._samples[sample.node] = sample

    def hw_event(self, event: HwEvent) -> None:
        """An XID becomes the device's last-XID gauge (the other events show in readings)."""
        if event.kind == "xid" and event.uuid is not None and event.xid is not None:
            self._last_xid[(event.node, event.uuid)] = (event.xid, event.detail)

    @property
    def nodes(self) -> list[str]:
        return sorted(self._samples)

    # --- the page -----------------------------------------------------------------

    def page(self, node: str) -> str:
        """The node's page in the Prometheus text format; KeyError if it was never sampled."""
        sample = self._samples[node]
        lines: list[str] = []
        for field in (*FIELDS, XID):
            rows = [row for device in sample.devices for row in self._rows(field, node, device)]
            if rows:
                lines += [f"# HELP {field.name} {field.help}",
                          f"# TYPE {field.name} {field.type}", *rows]
        return "\n".join(lines) + "\n"

    def _rows(self, field: Field, node: str, device: DeviceSample) -> list[str]:
        """The device's series of ``field``: one per pod on it (a time-sliced or MPS GPU's
        readings are repeated for each of its pods, as dcgm-exporter does), none if the
        device does not report the field."""
        mig = device.kind == "mig"
        attributes: list[tuple[str, str]] = []
        if field is XID:
            code, message = self._last_xid.get((node, device.uuid), (0, "No Error"))
            value: float | None = code
            attributes = [("err_code", str(code)), ("err_msg", message)]
        elif mig and field.name in WHOLE_GPU_ONLY:
            return []
        else:
            value = field.read(device)
        if value is None:
            return []  # dcgm-exporter skips a blank (unsupported) value
        pods: list[PodRef | None] = [h.pod for h in device.holders if h.pod is not None]
        number = _number(value, field.double)
        return [f"{field.name}{self._series_labels(node, device, attributes, pod)} {number}"
                for pod in pods or [device.pod]]

    @staticmethod
    def _series_labels(node: str, device: DeviceSample, attributes: list[tuple[str, str]],
                pod: PodRef | None) -> str:
        mig = device.kind == "mig"
        if pod is not None:
            attributes = [*attributes, ("container", pod.container or "main"),
                          ("namespace", pod.namespace), ("pod", pod.name)]
        labels = [("gpu", str(device.index)),
                  ("UUID", device.parent_uuid if mig and device.parent_uuid else device.uuid),
                  ("pci_bus_id", f"00000000:{0x18 + device.index:02X}:00.0"),
                  ("device", f"nvidia{device.index}"), ("modelName", device.model)]
        if mig:
            labels += [("GPU_I_PROFILE", device.mig_profile or ""),
                       ("GPU_I_ID", str(device.gpu_instance_id))]
        labels += [("Hostname", node), ("DCGM_FI_DRIVER_VERSION", DRIVER_VERSION),
                   *sorted(attributes)]
        return _labels(labels)

    # --- the server ---------------------------------------------------------------

    def url(self, node: str) -> str:
        return f"http://{self.host}:{self.port}{self.path(node)}"

    @staticmethod
    def path(node: str) -> str:
        return f"/nodes/{node}/metrics"

    @property
    def address(self) -> str:
        """``host:port``, a Prometheus scrape target (with ``__metrics_path__`` per node)."""
        return f"{self.host}:{self.port}"

    async def _serve(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        if node not in self._samples:
            raise web.HTTPNotFound(text=f"no exporter on node {node!r}\n")
        return web.Response(body=self.page(node).encode(), headers={"Content-Type": CONTENT_TYPE})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/nodes/{node}/metrics", self._serve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> DcgmPages:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
