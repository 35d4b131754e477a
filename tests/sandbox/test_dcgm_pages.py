"""The simulated nodes' dcgm-exporter pages, read by the production dcgm collector.

The pages stand in for dcgm-exporter when the Prometheus recipe is set
beside gpusteward (benchmarks/bench_peer.py) and for the dcgm path through
the world: what they serve must parse, with the collector users run, into
the readings the simulator holds, faults included.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gpusteward.collectors import dcgm
from gpusteward.sandbox.dcgm_pages import MIB, DcgmPages
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.schema import AllocationEvent, DeviceSample, HwEvent, NodeSample, QueueEvent


class _Feed:
    """The simulator's publisher: samples and hardware events go to the pages."""

    def __init__(self, pages: DcgmPages) -> None:
        self.pages = pages
        self.latest: dict[str, NodeSample] = {}
        self.xids: list[HwEvent] = []

    async def sample(self, sample: NodeSample) -> None:
        self.pages.sample(sample)
        self.latest[sample.node] = sample

    async def hw_event(self, event: HwEvent) -> None:
        self.pages.hw_event(event)
        if event.kind == "xid":
            self.xids.append(event)

    async def allocation(self, event: AllocationEvent) -> None: ...
    async def queue(self, event: QueueEvent) -> None: ...
    async def flush(self) -> None: ...


def _expected(device: DeviceSample) -> dict[str, object]:
    """What the page can say of a simulated device: the integers DCGM reports, MiB sizes."""
    mig = device.kind == "mig"
    return {
        "uuid": (dcgm.mig_device_uuid(device.parent_uuid or "", str(device.gpu_instance_id))
                 if mig else device.uuid),
        "index": device.index, "model": device.model, "kind": device.kind,
        "util_pct": None if mig else float(round(device.util_pct or 0)),
        "engine_active_pct": device.engine_active_pct,
        "temp_c": None if device.temp_c is None else float(round(device.temp_c)),
        "power_w": device.power_w, "sm_clock_mhz": device.sm_clock_mhz,
        "clock_event_reasons": device.clock_event_reasons,
        "ecc_sbe_volatile": device.ecc_sbe_volatile, "ecc_dbe_volatile": device.ecc_dbe_volatile,
        "pcie_replay": device.pcie_replay, "nvlink_errors": device.nvlink_errors,
        "nvlink_crc_errors": device.nvlink_crc_errors,
        "remap_failure": device.remap_failure, "remap_pending": device.remap_pending,
        "retired_pages_sbe": device.retired_pages_sbe,
        "retired_pages_dbe": device.retired_pages_dbe,
        "retired_pages_pending": device.retired_pages_pending,
        "mem_used_bytes": (device.mem_used_bytes or 0) // MIB * MIB,
        "mem_total_bytes": (None if device.mem_total_bytes is None
                            else device.mem_total_bytes // MIB * MIB),
        "pod": None if device.pod is None else (device.pod.namespace, device.pod.name),
        "pods": _pods(device),
    }


def _pods(device: DeviceSample) -> list[tuple[str, str]]:
    """Every pod on the device: its holders (a shared GPU), else its one pod."""
    pods = [h.pod for h in device.holders if h.pod is not None] or \
        ([device.pod] if device.pod is not None else [])
    return [(pod.namespace, pod.name) for pod in pods]


DEVICE_WIDE = ("temp_c", "power_w", "sm_clock_mhz", "clock_event_reasons", "ecc_sbe_volatile",
               "ecc_dbe_volatile", "pcie_replay", "nvlink_errors", "nvlink_crc_errors",
               "remap_failure", "remap_pending", "retired_pages_sbe", "retired_pages_dbe",
               "retired_pages_pending")


def _expected_devices(devices: list[DeviceSample]) -> list[dict[str, object]]:
    """The simulator's devices as the collector reads them back: a MIG-enabled GPU, which
    the page shows only per GPU instance, is one ``kind="gpu"`` parent holding the
    device-wide readings its instances repeat (the NVML reader's shape)."""
    expected: list[dict[str, object]] = []
    parents = {d.uuid for d in devices if d.kind == "gpu"}
    for device in devices:
        row = _expected(device)
        if device.kind == "mig" and device.parent_uuid:
            if device.parent_uuid not in parents:
                parents.add(device.parent_uuid)
                expected.append({name: None for name in row} | {
                    "uuid": device.parent_uuid, "index": device.index, "model": device.model,
                    "kind": "gpu", "pods": [], **{name: row[name] for name in DEVICE_WIDE}})
            row.update(dict.fromkeys(DEVICE_WIDE))
        expected.append(row)
    return expected


def _read(device: DeviceSample) -> dict[str, object]:
    values = {name: getattr(device, name) for name in _expected(device) if name != "pods"}
    values["pod"] = None if device.pod is None else (device.pod.namespace, device.pod.name)
    values["pods"] = _pods(device)
    return values


async def _collect_through_pages(name: str, check_every: int,
                                 lost: list[tuple[float, HwEvent]] | None = None
                                 ) -> tuple[int, int, list[int], set[str]]:
    """Step the scenario; every ``check_every`` ticks read every node's page with the
    production collector and compare it with the simulator's sample. Returns the devices
    checked, how many of them were on several pods, the XIDs read, the missing field
    families; the ``gpu_lost`` events read go in ``lost``, with the scenario's time."""
    spec = scenarios.load(name)
    cluster = SimulatedCluster(spec)
    checked, shared, xids = 0, 0, []
    lost = lost if lost is not None else []
    async with DcgmPages() as pages, aiohttp.ClientSession() as session:
        feed = _Feed(pages)
        sources = {node: dcgm.DcgmSource(pages.url(node), node, session)
                   for node in cluster.nodes}
        ticks = int(spec.duration_s // spec.sample_interval_s)
        for tick in range(ticks + 1):
            cluster.now = cluster.start + tick * spec.sample_interval_s
            await cluster.step(feed)
            if tick % check_every and tick != ticks:
                continue
            for node, source in sources.items():
                samples, events = await source.collect()
                assert samples[0].node == node
                read = [_read(d) for d in samples[0].devices]
                assert read == _expected_devices(feed.latest[node].devices), (node, tick)
                xids += [e.xid or 0 for e in events if e.kind == "xid"]
                lost += [(cluster.now - cluster.start, e) for e in events
                         if e.kind == "gpu_lost"]
                checked += len(read)
                shared += sum(len(r["pods"]) > 1 for r in read)  # type: ignore[arg-type]
        missing = set.union(*(s.coverage.missing for s in sources.values()))
    return checked, shared, xids, missing


def test_faulty_fleet_pages_read_back_as_the_simulated_readings() -> None:
    # Every fault of the scenario (DBE, thermal, SBE/PCIe/NVLink bursts, remap failure,
    # XIDs, a GPU lost) is on the pages at some check.
    checked, _, xids, missing = asyncio.run(_collect_through_pages("faulty-fleet", check_every=7))
    assert checked > 6 * 4 * 40
    # Every family the hardware and idle rules read is on the page, but engine activity:
    # the simulator reports none for whole GPUs (their utilisation stands for it).
    assert missing == {"gr_engine_active"}
    # The last XID of each device, seen once per change: every XID code the scenario raised
    # but 79, whose GPU is off the bus from that moment and leaves the page with its
    # readings (the simulator sends the XID as an urgent event, as the NVML collector does).
    assert set(xids) == {46, 13, 31, 119, 43}


def test_a_gpu_that_leaves_the_page_is_reported_lost_once() -> None:
    # dcgm-exporter has no series for a GPU off the bus (its values are blank), and the
    # XID 79 does not reach the page: the collector reports the GPU whose series left a page
    # that still has the node's other GPUs, after LOST_AFTER_SCRAPES reads without it.
    lost: list[tuple[float, HwEvent]] = []
    asyncio.run(_collect_through_pages("faulty-fleet", check_every=1, lost=lost))
    spec = scenarios.load("faulty-fleet")
    interval = spec.sample_interval_s
    cluster = SimulatedCluster(spec)
    uuid = {(node, gpu.index): gpu.uuid for node, n in cluster.nodes.items() for gpu in n.gpus}
    # The Xid 79 at 1500 s on h100-1 GPU 1 and the gpu_lost fault at 2400 s on h100-2 GPU 3.
    assert [(e.node, e.uuid, e.source) for _, e in lost] == [
        ("h100-1", uuid[("h100-1", 1)], "dcgm"), ("h100-2", uuid[("h100-2", 3)], "dcgm")]
    assert [at for at, _ in lost] == [
        pytest.approx(at, abs=interval)
        for at in (1500 + dcgm.LOST_AFTER_SCRAPES * interval,
                   2400 + dcgm.LOST_AFTER_SCRAPES * interval)]
    assert all("dcgm-exporter" in e.detail for _, e in lost)


def test_mig_instances_are_exported_per_gpu_instance_under_the_parent() -> None:
    checked, _, _, missing = asyncio.run(_collect_through_pages("mig-inference", check_every=20))
    assert checked > 0
    assert "gr_engine_active" not in missing


def test_a_shared_gpu_is_exported_once_per_pod_on_it() -> None:
    # Time-sliced and MPS GPUs: the device's readings, repeated for each of its pods; the
    # collector reads them back as one device shared by those pods (it cannot split them).
    _, shared, _, _ = asyncio.run(_collect_through_pages("shared-gpus", check_every=20))
    assert shared > 0


def test_an_unsampled_node_has_no_page() -> None:
    async def fetch() -> int:
        async with DcgmPages() as pages, aiohttp.ClientSession() as session, \
                session.get(pages.url("nowhere")) as answer:
            return answer.status

    assert asyncio.run(fetch()) == 404


@pytest.mark.parametrize("value,expected", [('a"b\\c\nd', 'a\\"b\\\\c\\nd')])
def test_label_values_are_escaped(value: str, expected: str) -> None:
    from gpusteward.sandbox.dcgm_pages import _labels

    assert _labels([("pod", value)]) == f'{{pod="{expected}"}}'
