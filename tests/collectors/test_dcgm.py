"""The dcgm-exporter source against its real /metrics text served over HTTP."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import cast

import aiohttp
import pytest

from gpusteward import edge
from gpusteward.broker import free_port
from gpusteward.collectors import dcgm
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.settings import CollectSettings
from gpusteward.collectors.source import SourceError, run_source
from gpusteward.schema import DeviceSample, NodeSample, PodRef

GPU0 = "GPU-3f2a9c4e-8b71-4d2e-9a65-1c7e0b5d2f18"
GPU1 = "GPU-9c04e1b7-2a6d-4f83-b5e0-7d19a3c8e642"
MIB = 1 << 20
TRAINER = PodRef(namespace="ml-training", name="llama-ft-worker-0", container="trainer")
VLLM = PodRef(namespace="inference", name="vllm-infer-7c9d8b6f5-qx2lm", container="vllm")


async def collect_once(url: str, node: str | None = "node-a"):
    async with aiohttp.ClientSession() as session:
        return await dcgm.DcgmSource(url, node, session, timeout_s=2).collect()


def by_uuid(sample: NodeSample) -> dict[str, DeviceSample]:
    return {device.uuid: device for device in sample.devices}


def test_page_becomes_one_node_sample_with_gpu_and_mig_devices(exporter) -> None:
    samples, events = asyncio.run(collect_once(exporter.url, node="gpu-node-07"))

    assert len(samples) == 1
    sample = samples[0]
    assert (sample.node, sample.source) == ("gpu-node-07", "dcgm")
    devices = by_uuid(sample)
    assert list(devices) == [GPU0, GPU1, f"MIG-{GPU1}/1", f"MIG-{GPU1}/2"]

    gpu = devices[GPU0]
    assert (gpu.kind, gpu.index, gpu.model) == ("gpu", 0, "NVIDIA H100 80GB HBM3")
    assert gpu.util_pct == 97.0
    assert gpu.engine_active_pct == pytest.approx(96.3221)
    assert gpu.mem_used_bytes == 77045 * MIB
    assert gpu.mem_total_bytes == (77045 + 3961 + 553) * MIB
    assert (gpu.temp_c, gpu.power_w, gpu.sm_clock_mhz) == (63.0, 612.348, 1980)
    assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable) == (0, 0)
    assert gpu.remap_failure is False
    assert gpu.pod == TRAINER

    # The MIG-enabled GPU has no series of its own: its device-wide readings, repeated on
    # every instance, make a kind="gpu" parent, as the NVML reader emits one.
    parent = devices[GPU1]
    assert (parent.kind, parent.index, parent.model) == ("gpu", 1, "NVIDIA H100 80GB HBM3")
    assert (parent.temp_c, parent.power_w, parent.sm_clock_mhz, parent.pcie_replay) == (
        49.0, 287.915, 1755, 3)
    assert parent.pod is None and parent.util_pct is None and parent.mem_used_bytes is None

    busy = devices[f"MIG-{GPU1}/1"]
    assert (busy.kind, busy.index, busy.parent_uuid) == ("mig", 1, GPU1)
    assert (busy.temp_c, busy.power_w, busy.sm_clock_mhz, busy.pcie_replay) == (
        None, None, None, None), "device-wide readings are the parent's only"
    assert (busy.mig_profile, busy.gpu_instance_id) == ("3g.40gb", 1)
    assert busy.util_pct is None, "GPU_UTIL is not a MIG measure"
    assert busy.engine_active_pct == pytest.approx(87.4512)
    assert busy.mem_used_bytes == 31426 * MIB
    assert busy.remapped_rows_correctable is None, "not reported on a MIG GPU"
    assert busy.pod == VLLM

    idle = devices[f"MIG-{GPU1}/2"]
    assert idle.engine_active_pct == 0.0
    assert idle.pod is None

    # NVML reports a MIG GPU's XIDs on the parent, the instance in the detail; so do we.
    assert [(e.kind, e.uuid, e.xid, e.detail) for e in events] == [
        ("xid", GPU1, 31, "GPU memory page fault on GPU instance 1")]


def _old_spellings(page: str) -> str:
    """The page as ``--use-old-namespace`` and a post-PR-#655 exporter write it."""
    page = re.sub(r'([{,])pod="', r'\1pod_name="', page)
    page = re.sub(r'([{,])namespace="', r'\1pod_namespace="', page)
    page = re.sub(r'([{,])container="', r'\1container_name="', page)
    return page.replace('Hostname="', 'hostname="')


def test_old_label_names_and_lowercase_hostname(exporter, dcgm_page: str) -> None:
    exporter.body = _old_spellings(dcgm_page)
    assert "pod_name=" in exporter.body and ',pod="' not in exporter.body

    samples, _ = asyncio.run(collect_once(exporter.url))
    devices = by_uuid(samples[0])
    assert devices[GPU0].pod == TRAINER
    assert devices[f"MIG-{GPU1}/1"].pod == VLLM
    assert devices[f"MIG-{GPU1}/2"].pod is None

    # Without a configured node, the (lowercase) hostname label names the node.
    grouped = dcgm.node_samples(dcgm.parse_page(exporter.body), 0.0, "dcgm")
    assert list(grouped) == ["gpu-node-07"]


def test_exported_pod_labels_are_understood(dcgm_page: str) -> None:
    page = re.sub(r'([{,])(pod|namespace|container)="', r'\1exported_\2="', dcgm_page)
    sample = dcgm.node_samples(dcgm.parse_page(page), 0.0, "dcgm", node="n")["n"]
    assert by_uuid(sample)[GPU0].pod == TRAINER


def test_mig_instances_without_framebuffer_fields(exporter, dcgm_page: str) -> None:
    # dcgm-exporter issue #512: no DCGM_FI_DEV_FB_* for GPU instances on H100.
    exporter.body = "".join(
        line for line in dcgm_page.splitlines(keepends=True)
        if not (line.startswith("DCGM_FI_DEV_FB_") and "GPU_I_ID" in line))

    samples, _ = asyncio.run(collect_once(exporter.url))
    devices = by_uuid(samples[0])
    assert devices[f"MIG-{GPU1}/1"].mem_used_bytes is None
    assert devices[f"MIG-{GPU1}/1"].mem_total_bytes is None
    assert devices[f"MIG-{GPU1}/1"].engine_active_pct == pytest.approx(87.4512)
    assert devices[GPU0].mem_used_bytes == 77045 * MIB


def test_xid_changes_become_one_event_each(dcgm_page: str) -> None:
    tracker = dcgm.XidTracker()
    first = dcgm.parse_page(dcgm_page)
    assert [e.xid for e in tracker.events(first, 1.0, "dcgm", node="n")] == [31]
    assert tracker.events(first, 2.0, "dcgm", node="n") == [], "an unchanged XID is not new"

    gpu0_line = next(line for line in dcgm_page.splitlines()
                     if line.startswith("DCGM_FI_DEV_XID_ERRORS") and 'gpu="0"' in line)
    raised = dcgm_page.replace(
        gpu0_line, gpu0_line.replace('err_code="0"', 'err_code="79"')
        .replace("No Error", "GPU has fallen off the bus").rsplit(" ", 1)[0] + " 79")
    events = tracker.events(dcgm.parse_page(raised), 3.0, "dcgm", node="n")
    assert [(e.uuid, e.xid, e.detail, e.ts) for e in events] == [
        (GPU0, 79, "GPU has fallen off the bus", 3.0)]
    assert tracker.events(dcgm.parse_page(raised), 4.0, "dcgm", node="n") == []


async def _run_until(source, publisher, metrics: CollectorMetrics,
                     done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(run_source(source, publisher, stop, 0.05, metrics))
    try:
        async with asyncio.timeout(timeout_s):
            while not done():  # noqa: ASYNC110 - polls metrics, which have no event
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await task


def errors(metrics: CollectorMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "gpusteward_collect_source_errors_total", {"source": "dcgm", "reason": reason})
    return value or 0.0


@pytest.mark.parametrize("cut", ["mid_line", "short_body"])
def test_truncated_page_is_refused_whole_and_counted(exporter, recorder, dcgm_page: str,
                                                     cut: str) -> None:
    half = len(dcgm_page) // 2
    if cut == "mid_line":
        exporter.body = dcgm_page[:half]  # honest length, ends mid-line
    else:
        exporter.body = dcgm_page[:half]  # the connection closes before Content-Length bytes
        exporter.declared_length = len(dcgm_page)
    metrics = CollectorMetrics()

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            source = dcgm.DcgmSource(exporter.url, "node-a", session, timeout_s=2)
            await _run_until(source, recorder, metrics, lambda: errors(metrics, "truncated") >= 3)
            assert recorder.samples == [] and recorder.hw_events == []

            exporter.body, exporter.declared_length = dcgm_page, None
            await _run_until(source, recorder, metrics, lambda: bool(recorder.samples))

    asyncio.run(scenario())
    assert len(recorder.samples[0].devices) == 4  # 2 GPUs (one MIG-enabled), 2 instances


def test_unparseable_page_is_a_parse_error() -> None:
    with pytest.raises(SourceError) as raised:
        dcgm.parse_page('DCGM_FI_DEV_GPU_UTIL{gpu="0" 5\n')
    assert raised.value.reason == "parse"


def test_unreachable_exporter_is_counted_and_retried(exporter_factory, recorder,
                                                     dcgm_page: str) -> None:
    port = free_port()
    metrics = CollectorMetrics()
    url = f"http://127.0.0.1:{port}/metrics"

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            source = dcgm.DcgmSource(url, "node-a", session, timeout_s=1)
            await _run_until(source, recorder, metrics,
                             lambda: errors(metrics, "unreachable") >= 3)
            assert recorder.samples == []
            exporter_factory(dcgm_page, port=port).start()
            await _run_until(source, recorder, metrics, lambda: bool(recorder.samples))

    asyncio.run(scenario())
    assert recorder.samples[0].node == "node-a"
    assert errors(metrics, "unreachable") >= 3


def test_node_name_comes_from_the_page_unless_configured(exporter, recorder, monkeypatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.delenv("GPUSTEWARD_COLLECT__NODE_NAME", raising=False)

    async def first_sample(settings: CollectSettings) -> NodeSample:
        stop = asyncio.Event()
        task = asyncio.create_task(dcgm.run_dcgm_collector(settings, recorder, stop))
        async with asyncio.timeout(10):
            while not recorder.samples:  # noqa: ASYNC110 - the recorder has no event
                await asyncio.sleep(0.02)
        stop.set()
        await task
        return recorder.samples.pop()

    unset = CollectSettings(dcgm_url=exporter.url, interval_s=0.05)
    assert asyncio.run(first_sample(unset)).node == "gpu-node-07", "dcgm-exporter's Hostname"
    configured = CollectSettings(dcgm_url=exporter.url, interval_s=0.05, node_name="n-1")
    assert asyncio.run(first_sample(configured)).node == "n-1"
    monkeypatch.setenv("NODE_NAME", "n-2")
    assert asyncio.run(first_sample(CollectSettings(dcgm_url=exporter.url))).node == "n-2"


STOCK_MISSING = {"clock_event_reasons", "ecc_sbe", "ecc_dbe", "row_remap_pending",
                 "nvlink_errors", "nvlink_crc_errors"}
"""Field families the rules read that stock dcgm-exporter's counters leave off."""


def with_every_family(page: str) -> str:
    """The page as dcgm-exporter serves it with deploy/'s counters file: one series more
    per family the stock set lacks, on GPU 0."""
    labels = next(line for line in page.splitlines()
                  if line.startswith("DCGM_FI_DEV_GPU_TEMP{gpu=\"0\""))
    labels = labels[len("DCGM_FI_DEV_GPU_TEMP"):labels.rindex("}") + 1]
    added = [f"{family.metrics[0]}{labels} 0" for family in dcgm.FIELD_FAMILIES
             if family.name in STOCK_MISSING]
    return page + "\n".join(added) + "\n"


def test_stock_page_missing_families_are_logged_once_and_counted(
        exporter, caplog: pytest.LogCaptureFixture) -> None:
    metrics = CollectorMetrics()

    async def read(times: int) -> dcgm.DcgmSource:
        async with aiohttp.ClientSession() as session:
            source = dcgm.DcgmSource(exporter.url, "gpu-node-07", session, timeout_s=2,
                                     metrics=metrics)
            for _ in range(times):
                await source.collect()
            return source

    with caplog.at_level("WARNING", logger="gpusteward.collectors.dcgm"):
        source = asyncio.run(read(3))
    assert source.coverage.missing == STOCK_MISSING
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(STOCK_MISSING), "once per family, not per read"
    assert any("no ecc_dbe series (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL): ecc_dbe sees nothing"
               in message for message in warned)
    for family in dcgm.FIELD_FAMILIES:
        counted = metrics.registry.get_sample_value(
            "gpusteward_collect_missing_field_families_total",
            {"source": "dcgm", "family": family.name}) or 0
        assert counted == (3 if family.name in STOCK_MISSING else 0), family.name

    exporter.body = with_every_family(exporter.body)
    caplog.clear()
    source = asyncio.run(read(1))
    assert source.coverage.missing == set()
    assert not caplog.records


def test_unreadable_series_are_skipped_and_counted_the_rest_of_the_page_kept() -> None:
    """A broken exporter's reading (a counter past int64, a negative framebuffer, a MIG id
    that is no number) would make the worker refuse the node's whole sample: each such
    series is dropped here, counted once per metric, and the other readings stay."""
    page = "\n".join([
        f'DCGM_FI_DEV_GPU_TEMP{{gpu="0",UUID="{GPU0}"}} 61',
        f'DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{gpu="0",UUID="{GPU0}"}} 1e30',
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="{GPU0}"}} 250',
        f'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="{GPU0}"}} -5',
        f'DCGM_FI_DEV_POWER_USAGE{{gpu="1",UUID="{GPU1}",GPU_I_ID="x"}} 300',
        f'DCGM_FI_DEV_POWER_USAGE{{gpu="0",UUID="{GPU0}"}} 300',
    ]) + "\n"
    refusals = edge.Refusals(dcgm.log)
    samples = dcgm.node_samples(dcgm.parse_page(page), 1_763_683_200.0, "dcgm", node="n1",
                                refusals=refusals)
    (device,) = samples["n1"].devices
    assert (device.temp_c, device.power_w) == (61.0, 300.0)
    assert device.ecc_sbe_volatile is None and device.util_pct is None
    assert device.mem_used_bytes is None
    assert set(refusals.by_kind) == {"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_GPU_UTIL",
                                     "mem_used_bytes", "DCGM_FI_DEV_POWER_USAGE"}


def test_a_time_sliced_gpu_with_several_pods_is_marked_shared() -> None:
    # dcgm-exporter repeats a time-sliced GPU's series once per pod, the same readings in
    # each: it cannot tell the pods' shares apart.
    uuid = "GPU-5a5a5a5a-0000-4000-8000-000000000000"
    page = "".join(
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="{uuid}",modelName="NVIDIA H100",'
        f'Hostname="n",namespace="nb",pod="{pod}",container="jupyter"}} 80\n'
        for pod in ("busy", "idle"))
    page += ('DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-one",modelName="NVIDIA H100",'
             'Hostname="n",namespace="ml",pod="train",container="t"} 90\n')
    devices = by_uuid(dcgm.node_samples(dcgm.parse_page(page), 0.0, "dcgm")["n"])
    shared = devices[uuid]
    assert shared.attribution == "shared"
    assert [h.pod for h in shared.holders] == [
        PodRef(namespace="nb", name="busy", container="jupyter"),
        PodRef(namespace="nb", name="idle", container="jupyter")]
    assert all(h.activity_pct is None for h in shared.holders)  # not split: not credited
    assert shared.pod == shared.holders[0].pod and shared.util_pct == 80
    assert (devices["GPU-one"].attribution, devices["GPU-one"].holders) == ("device", [])


# -- MIG-enabled GPUs: one kind="gpu" parent per GPU, as the NVML reader emits -----------------

def _set_all(page: str, metric: str, value: str, gpu: str | None = None) -> str:
    """Every ``metric`` series of the page (of one GPU, by its ``gpu`` label) set to value."""
    where = f'gpu="{gpu}"' if gpu is not None else ""
    return re.sub(rf'^({metric}{{{where}[^}}]*}}) \S+$', rf"\g<1> {value}", page,
                  flags=re.MULTILINE)


def _offline_source() -> dcgm.DcgmSource:
    """A source only asked to parse pages: it never opens its session."""
    return dcgm.DcgmSource("http://x", None, session=cast(aiohttp.ClientSession, None))


def _findings(page_at: Callable[[int], str], ticks: int) -> list[tuple[str, str, str]]:
    from gpusteward.schema import Finding
    from gpusteward.streams.node import NodeJoin, NodeState

    source, join, state = _offline_source(), NodeJoin(), NodeState()
    found: list[tuple[str, str, str]] = []
    for tick in range(ticks):
        sample, _ = source.parse(page_at(tick), 1_000_000.0 + 30 * tick)
        found += [(out.kind, out.subject.device or "", out.state)
                  for out in join.on_sample(state, sample) if isinstance(out, Finding)]
    return found


def test_a_hot_mig_enabled_gpu_opens_thermal_slowdown_once_on_its_parent(dcgm_page: str) -> None:
    hot = _set_all(dcgm_page, "DCGM_FI_DEV_GPU_TEMP", "95", gpu="1")
    found = _findings(lambda tick: hot, ticks=20)
    assert ("thermal_slowdown", GPU1, "firing") in found
    assert [f for f in found if f[0] == "thermal_slowdown"] == [
        ("thermal_slowdown", GPU1, "firing")], "one episode, on the physical GPU"


def test_growing_pcie_replays_on_a_mig_enabled_gpu_are_found(dcgm_page: str) -> None:
    found = _findings(lambda tick: _set_all(dcgm_page, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                                            str(50 * tick), gpu="1"), ticks=20)
    assert ("pcie_replay", GPU1, "firing") in found


def test_a_device_wide_dbe_counter_opens_one_ecc_episode_not_one_per_instance(
        dcgm_page: str) -> None:
    mig_line = next(line for line in dcgm_page.splitlines()
                    if line.startswith("DCGM_FI_DEV_GPU_TEMP") and 'GPU_I_ID="1"' in line)
    labels = mig_line.split("{", 1)[1].rsplit("}", 1)[0]
    other = labels.split(",container=")[0].replace('GPU_I_ID="1"', 'GPU_I_ID="2"')
    page = dcgm_page + "".join(f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{instance}}} 2\n"
                               for instance in (labels, other))
    sample = dcgm.node_samples(dcgm.parse_page(page), 0.0, "dcgm", node="n")["n"]
    devices = by_uuid(sample)
    assert devices[GPU1].ecc_dbe_volatile == 2
    assert devices[f"MIG-{GPU1}/1"].ecc_dbe_volatile is None
    assert devices[f"MIG-{GPU1}/2"].ecc_dbe_volatile is None
    assert [f for f in _findings(lambda tick: page, ticks=2) if f[0] == "ecc_dbe"] == [
        ("ecc_dbe", GPU1, "firing")]


def test_gpus_are_counted_before_the_node_inventory_arrives(dcgm_page: str) -> None:
    from gpusteward.schema import NodeSummary
    from gpusteward.streams.node import NodeJoin, NodeState

    sample, _ = _offline_source().parse(dcgm_page, 1e6)
    state = NodeState()
    summaries = [o for o in NodeJoin().on_sample(state, sample) if isinstance(o, NodeSummary)]
    assert state.gpu_count == 2
    assert [s.gpus_total for s in summaries] == [2]


def test_an_xid_every_instance_repeats_is_one_event_on_the_parent(dcgm_page: str) -> None:
    fallen = re.sub(r'^(DCGM_FI_DEV_XID_ERRORS{gpu="1"[^}]*err_code=")\d+(",err_msg=")[^"]*'
                    r'("[^}]*}) \d+$', r"\g<1>79\g<2>GPU has fallen off the bus\g<3> 79",
                    dcgm_page, flags=re.MULTILINE)
    assert fallen.count("} 79\n") == 2
    events = dcgm.XidTracker().events(dcgm.parse_page(fallen), 1.0, "dcgm", node="n")
    assert [(e.uuid, e.xid) for e in events] == [(GPU1, 79)]


# -- shared GPUs with --kubernetes-virtual-gpus: each pod's own share -----------------------------

VGPU_LABELS = ('gpu="0",UUID="GPU-1",pci_bus_id="00000000:18:00.0",device="nvidia0",'
               'modelName="NVIDIA H100 80GB HBM3",Hostname="n1"')


def _vgpu_page(busy_util: float = 95, idle_util: float = 0) -> str:
    return "".join(
        f'{metric}{{{VGPU_LABELS},container="c",namespace="nb",pod="{pod}",vgpu="{n}"}} '
        f"{value}\n"
        for metric, values in (("DCGM_FI_DEV_GPU_UTIL", (busy_util, idle_util)),
                               ("DCGM_FI_DEV_FB_USED", (60000, 1000)),
                               ("DCGM_FI_DEV_FB_FREE", (20000, 20000)),
                               ("DCGM_FI_DEV_FB_RESERVED", (500, 500)),
                               ("DCGM_FI_DEV_GPU_TEMP", (60, 60)))
        for n, (pod, value) in enumerate(zip(("busy", "idle"), values, strict=True)))


def test_virtual_gpu_series_give_each_pod_its_own_activity_and_memory() -> None:
    (device,) = dcgm.node_samples(dcgm.parse_page(_vgpu_page()), 0.0, "dcgm")["n1"].devices
    assert device.attribution == "process"
    assert [(h.pod.name if h.pod else None, h.activity_pct, h.mem_used_bytes)
            for h in device.holders] == [("busy", 95.0, 60000 * MIB), ("idle", 0.0, 1000 * MIB)]
    assert device.util_pct == 95.0, "the device: its busiest share"
    assert device.mem_used_bytes == 61000 * MIB, "the device: every share's memory"
    assert device.mem_total_bytes == (61000 + 20000 + 500) * MIB
    assert device.temp_c == 60.0


def test_a_busy_pod_sharing_a_gpu_is_not_reported_idle() -> None:
    from gpusteward.schema import Finding, PodAllocation
    from gpusteward.streams.node import NodeJoin, NodeState

    start = 1_000_000.0
    join, state = NodeJoin(), NodeState()
    for name in ("busy", "idle"):
        join.on_allocation(state, PodAllocation(
            ts=start, node="n1", pod=PodRef(namespace="nb", name=name, uid=f"u-{name}"),
            phase="running", gpus=1, device_ids=["GPU-1"], started_at=start - 3600,
            workload_kind="notebook", owner_kind="Notebook", owner_name=name, queue="q"))
    source = _offline_source()
    found = []
    for tick in range(80):
        sample, _ = source.parse(_vgpu_page(), start + 30 * tick)
        found += [(f.kind, f.subject.pod.name if f.subject.pod else None)
                  for f in join.on_sample(state, sample) if isinstance(f, Finding)]
    assert ("idle_holder", "idle") in found
    assert ("idle_holder", "busy") not in found


def t4_page(page: str, *, sbe: int, dbe: int, pending: int) -> str:
    """The page with GPU 0 a T4 (Turing), as dcgm-exporter writes one with deploy/'s counters:
    no remapped-row series (page retirement instead), the three RETIRED fields."""
    lines = [line.replace('modelName="NVIDIA H100 80GB HBM3"', 'modelName="Tesla T4"')
             if 'gpu="0"' in line else line for line in page.splitlines()
             if not (line.startswith(("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS{gpu=\"0\"",
                                      "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{gpu=\"0\"",
                                      "DCGM_FI_DEV_ROW_REMAP_")) and 'gpu="0"' in line)]
    temp = next(line for line in lines if line.startswith('DCGM_FI_DEV_GPU_TEMP{gpu="0"'))
    labels = temp[len("DCGM_FI_DEV_GPU_TEMP"):temp.rindex("}") + 1]
    for metric, value in (("DCGM_FI_DEV_RETIRED_SBE", sbe), ("DCGM_FI_DEV_RETIRED_DBE", dbe),
                          ("DCGM_FI_DEV_RETIRED_PENDING", pending)):
        lines += [f"# HELP {metric} Retired pages.", f"# TYPE {metric} counter",
                  f"{metric}{labels} {value}"]
    return "\n".join(lines) + "\n"


def test_t4_page_retirement_on_the_page_taints_then_resolves_and_reports_a_worn_gpu(
        dcgm_page: str, exporter_factory) -> None:
    """dcgm-exporter's RETIRED fields, read by the production source from a served page, reach
    the node join: pending -> a taint for a GPU reset until none is pending; the retired
    pages reaching the threshold (60) -> a finding that recommends replacing the GPU."""
    from gpusteward.schema import Action, Finding
    from gpusteward.streams.node import NodeJoin, NodeState

    pages = [t4_page(dcgm_page, sbe=2, dbe=0, pending=0),
             t4_page(dcgm_page, sbe=2, dbe=1, pending=1),
             t4_page(dcgm_page, sbe=2, dbe=1, pending=0),
             t4_page(dcgm_page, sbe=57, dbe=3, pending=0)]
    exporter = exporter_factory(pages[0]).start()
    join, state = NodeJoin(), NodeState()
    seen: list[tuple[str, str, str]] = []
    actions: list[Action] = []
    for tick, page in enumerate(pages):
        exporter.body = page
        (sample,), _ = asyncio.run(collect_once(exporter.url))
        device = by_uuid(sample)[GPU0]
        assert device.model == "Tesla T4" and device.remap_pending is None
        assert device.retired_pages_dbe == (0 if tick == 0 else 3 if tick == 3 else 1)
        sample.ts = 1_000_000.0 + 30 * tick
        out = join.on_sample(state, sample)
        seen += [(o.kind, o.state, str(tick)) for o in out if isinstance(o, Finding)
                 and o.kind.startswith("retired_pages")]
        actions += [o for o in out if isinstance(o, Action)]
    assert seen == [("retired_pages_pending", "firing", "1"),
                    ("retired_pages_pending", "resolved", "2"),
                    ("retired_pages", "firing", "3")]
    (taint,) = actions
    assert taint.verb == "taint" and taint.params["key"] == "gpusteward.io/gpu-reset-required"


def test_a_t4_page_without_the_retired_fields_names_the_missing_family(dcgm_page: str) -> None:
    """Stock counters leave the RETIRED fields off: on a T4 node (no remapped rows either)
    the retired-page rules would be blind, and the source says so."""
    page = t4_page(dcgm_page, sbe=0, dbe=0, pending=0)
    stock = "\n".join(line for line in page.splitlines() if "RETIRED" not in line
                      and 'gpu="1"' not in line) + "\n"
    source = _offline_source()
    source.parse(stock, 1e6)
    assert {"row_remap_pending", "retired_memory"} <= source.coverage.missing
    source.parse(page, 1e6 + 30)
    assert not {"row_remap_pending", "retired_memory"} & source.coverage.missing
