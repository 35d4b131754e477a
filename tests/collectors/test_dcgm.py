"""The dcgm-exporter source against its real /metrics text served over HTTP."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

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
    assert list(devices) == [GPU0, f"MIG-{GPU1}/1", f"MIG-{GPU1}/2"]

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

    busy = devices[f"MIG-{GPU1}/1"]
    assert (busy.kind, busy.index, busy.parent_uuid) == ("mig", 1, GPU1)
    assert (busy.mig_profile, busy.gpu_instance_id) == ("3g.40gb", 1)
    assert busy.util_pct is None, "GPU_UTIL is not a MIG measure"
    assert busy.engine_active_pct == pytest.approx(87.4512)
    assert busy.mem_used_bytes == 31426 * MIB
    assert busy.remapped_rows_correctable is None, "not reported on a MIG GPU"
    assert busy.pod == VLLM

    idle = devices[f"MIG-{GPU1}/2"]
    assert idle.engine_active_pct == 0.0
    assert idle.pod is None

    assert [(e.kind, e.uuid, e.xid, e.detail) for e in events] == [
        ("xid", f"MIG-{GPU1}/1", 31, "GPU memory page fault")]


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
    assert len(recorder.samples[0].devices) == 3


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
                 "nvlink_errors"}
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
