"""The Prometheus collector behind an HA pair, end to end to the deployed worker's findings.

kube-prometheus-stack runs two Prometheus replicas behind one Service. Each
scrapes dcgm-exporter on its own, at its own phase (their external labels
differ, and Prometheus spreads scrapes by a hash of them), so for part of
every scrape interval after a change one replica has the new page and the
other the old one. A Service (or a mesh, or a reconnecting client) sends
each query to either.

Here: the sandbox's dcgm-exporter pages of one node, two real Prometheus
servers scraping them every 2 s (external labels ``prometheus_replica: a``
and ``b``), a round-robin HTTP proxy in front of them as the one URL,
``gpusteward collect prometheus`` as a process at a 0.25 s interval, the
worker as a process on the embedded broker. A double-bit ECC error (the DBE
counter and Xid 48) and a fatal Xid 46 are put on the pages at the moment
that leaves the replicas out of step for at least half a scrape interval.

What a user relies on: each XID reaches the hw-events topic once, a GPU's
DBE counter never reads lower after it read higher, sample times never go
back, and the worker raises one ecc_dbe finding that stays open (one cordon),
one finding for Xid 46 and no phantom RMA candidate.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp import web

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.children import die_with_parent
from gpusteward.sandbox.dcgm_pages import DcgmPages
from gpusteward.sandbox.pipeline import WorkerProcess, settings_env
from gpusteward.schema import Action, DeviceSample, Finding, HwEvent, NodeSample, PodRef
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.collectors.conftest import prometheus_query

pytestmark = pytest.mark.e2e

NODE = "gpu-node-07"
GPU0 = "GPU-3f2a9c4e-8b71-4d2e-9a65-1c7e0b5d2f18"
GPU1 = "GPU-9c04e1b7-2a6d-4f83-b5e0-7d19a3c8e642"
SCRAPE_S = 2.0
COLLECT_S = 0.25
GIB = 1 << 30


def _device(index: int, uuid: str, dbe: int = 0) -> DeviceSample:
    return DeviceSample(uuid=uuid, index=index, model="NVIDIA H100 80GB HBM3", util_pct=90.0,
                        mem_used_bytes=40 * GIB, mem_total_bytes=80 * GIB, temp_c=55.0,
                        power_w=400.0, sm_clock_mhz=1980, ecc_sbe_volatile=0,
                        ecc_dbe_volatile=dbe, pcie_replay=0, nvlink_errors=0,
                        pod=PodRef(namespace="ml", name=f"trainer-{index}", container="main"))


def _node(dbe_on_gpu1: int = 0) -> NodeSample:
    return NodeSample(ts=time.time(), node=NODE, source="nvml",
                      devices=[_device(0, GPU0), _device(1, GPU1, dbe_on_gpu1)])


class RoundRobin:
    """One URL in front of several Prometheus servers, each query to the next one, as a
    Service's kube-proxy or a mesh spreads requests over an HA pair."""

    def __init__(self, upstreams: list[str]) -> None:
        self.upstreams = upstreams
        self.asked = dict.fromkeys(upstreams, 0)
        self._next = itertools.cycle(upstreams)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _forward(self, request: web.Request) -> web.Response:
        upstream = next(self._next)
        self.asked[upstream] += 1
        async with aiohttp.ClientSession() as session, session.request(
                request.method, upstream + request.path_qs, data=await request.read(),
                headers={"Content-Type": request.headers.get("Content-Type", "")}) as answer:
            return web.Response(status=answer.status, body=await answer.read(),
                                content_type=answer.content_type)

    async def start(self, port: int) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _last_scrape(url: str) -> float:
    """When the replica last scraped the node (the XID gauge's sample time)."""
    answer = await asyncio.to_thread(prometheus_query, url,
                                     f'timestamp(DCGM_FI_DEV_XID_ERRORS{{UUID="{GPU0}"}})')
    return float(answer[0]["value"][1])


async def _next_scrape(url: str) -> None:
    """Return just after the replica's next scrape."""
    last = await _last_scrape(url)
    for _ in range(int(3 * SCRAPE_S / 0.02)):
        if await _last_scrape(url) > last:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} scraped nothing for {3 * SCRAPE_S} s")


async def out_of_step(replica_a: str, replica_b: str, change: Callable[[], None]) -> float:
    """Make ``change`` to the pages just after one replica scraped, chosen so that the other
    scrapes first and the two disagree for at least half a scrape interval; returns how
    long they disagree."""
    a, b = await _last_scrape(replica_a), await _last_scrape(replica_b)
    a_after_b = (a - b) % SCRAPE_S
    # Just after B's scrape, A takes the change a_after_b later and B a whole interval later.
    lagging, window = ((replica_b, SCRAPE_S - a_after_b) if a_after_b <= SCRAPE_S / 2
                       else (replica_a, a_after_b))
    await _next_scrape(lagging)
    change()
    return window


async def _read(settings: Settings, spec: topics.TopicSpec, kind: type) -> list:
    decode = msgspec.json.Decoder(kind).decode  # type: ignore[var-annotated]
    return [decode(r.value) for r in await kafka.read_all(settings, spec.name(settings))]


def test_an_ha_pair_behind_one_url_reports_each_fault_once(
        settings: Settings, prometheus_factory: Callable[..., str], tmp_path: Path) -> None:
    asyncio.run(_run(settings, prometheus_factory, tmp_path))


async def _run(settings: Settings, prometheus_factory: Callable[..., str],
               tmp_path: Path) -> None:
    await kafka.ensure_topics(settings)
    async with DcgmPages() as pages:
        pages.sample(_node())
        job = {"job_name": "dcgm-exporter", "metrics_path": pages.path(NODE),
               "static_configs": [{"targets": [pages.address]}]}
        replica_a, replica_b = [
            await asyncio.to_thread(prometheus_factory, job, scrape_interval=f"{SCRAPE_S:g}s",
                                    external_labels={"prometheus_replica": name})
            for name in ("a", "b")]
        proxy = RoundRobin([replica_a, replica_b])
        await proxy.start(free_port())
        worker = WorkerProcess(settings, tmp_path / "worker.log", loglevel="info")
        worker.start()
        with (tmp_path / "collector.log").open("wb") as log:
            collector = subprocess.Popen(  # noqa: ASYNC220 (started once, returns at once)
                [sys.executable, "-P", "-m", "gpusteward.cli", "collect", "prometheus",
                 "--url", proxy.url, "--interval", str(COLLECT_S), "--metrics-port", "0"],
                env={**os.environ, **settings_env(settings)}, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        try:
            await asyncio.sleep(3 * SCRAPE_S)  # a baseline of healthy samples
            windows = [await out_of_step(replica_a, replica_b, lambda: pages.hw_event(HwEvent(
                ts=time.time(), node=NODE, kind="xid", uuid=GPU0, xid=46,
                detail="GPU stopped processing", source="nvml")))]
            await asyncio.sleep(2 * SCRAPE_S)

            def dbe() -> None:
                pages.sample(_node(dbe_on_gpu1=1))
                pages.hw_event(HwEvent(ts=time.time(), node=NODE, kind="xid", uuid=GPU1,
                                       xid=48, detail="DBE (Double Bit Error) ECC Error",
                                       source="nvml"))

            windows.append(await out_of_step(replica_a, replica_b, dbe))
            await asyncio.sleep(3 * SCRAPE_S)
        finally:
            collector.terminate()
            try:  # a pod's grace period: the publisher's drain alone may take 10 s
                collector.wait(30)
            except subprocess.TimeoutExpired:
                collector.kill()
                tail = (tmp_path / "collector.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"the collector outlived SIGTERM by 30 s:\n{tail}") from None
            await proxy.stop()
        try:
            names = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS)]
            await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=60)
        finally:
            worker.stop()
    print(f"replicas out of step for {windows} s; queries per replica {proxy.asked}")
    assert all(count > 10 for count in proxy.asked.values()), "both replicas were asked"
    assert min(windows) >= SCRAPE_S / 2, "the replicas disagreed for half an interval"

    events = await _read(settings, topics.HW_EVENTS, HwEvent)
    assert sorted((e.uuid, e.xid) for e in events if e.kind == "xid") == [
        (GPU0, 46), (GPU1, 48)], "each XID once, however the answers alternate"
    assert not [e for e in events if e.kind != "xid"], "no GPU lost, no phantom event"

    samples = [s for s in await _read(settings, topics.SAMPLES, NodeSample) if s.node == NODE]
    times = [s.ts for s in samples]
    assert times == sorted(times), "sample times never go back"
    assert len(samples) <= 2 * ((times[-1] - times[0]) / SCRAPE_S + 1), \
        "one sample per scrape of either replica, not one per query"
    dbe_counts = [d.ecc_dbe_volatile for s in samples for d in s.devices if d.uuid == GPU1]
    assert dbe_counts == sorted(dbe_counts) and dbe_counts[-1] == 1, \
        "the DBE counter never reads lower after it read higher"

    findings = await _read(settings, topics.FINDINGS, Finding)
    ecc = [f for f in findings if f.kind == "ecc_dbe"]
    assert [(f.state, f.subject.device) for f in ecc] == [("firing", GPU1)], \
        "one DBE episode, not closed by a lagging replica's zero and opened again"
    xid = [f for f in findings if f.kind == "xid"]
    assert [(f.state, f.subject.device) for f in xid] == [("firing", GPU0)], \
        "Xid 46 found once"
    assert not [f for f in findings if f.kind == "xid_rma"], "no RMA candidate from repeats"
    cordons = [a for a in await _read(settings, topics.ACTIONS, Action) if a.verb == "cordon"]
    assert len({a.idempotency_key for a in cordons}) == 1
