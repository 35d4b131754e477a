"""A GPU replaced under repair takes its findings with it, end to end: collector records ->
Kafka -> the deployed stream worker -> findings and actions.

GPU 0 of an 8-GPU node falls off the bus (Xid 79): ``gpu_lost``, critical, and a drain,
asked again every ``reask_s`` while the finding stays open. The node is repaired: the GPU
is swapped (the new one has a uuid of its own, at the old one's index) and the node comes
back. The old uuid will never report again, so nothing closed its finding: its alert fired
for ever and its drain was asked again every 10 min, on a node its admin had put back into
service. Now the new GPU at that index resolves the old one's findings and the asks stop.
A GPU that is only missing (the node rebooted without it, the others' indices shifted)
keeps its finding.

A GPU the NVML collector cannot read when it starts has no uuid: its loss is filed under
``GPU-unknown``, which no sample ever shows answering, so it fired for ever too and its
drain was asked every 10 min after the repair. Now every GPU of the node answering again,
one not read since the loss, resolves it; a node whose GPU stays unreadable keeps it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import Action, DeviceSample, Finding, HwEvent, NodeSample
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.e2e.records import decoded

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
STEP_S = 30.0
MODEL = "NVIDIA A100-SXM4-80GB"


def page(node: str, ts: float, uuids: list[str]) -> NodeSample:
    """A node's sample as NVML enumerates its GPUs: indices in order of those present."""
    return NodeSample(ts=ts, node=node, source="nvml", devices=[
        DeviceSample(uuid=uuid, index=i, model=MODEL, util_pct=0.0, temp_c=40.0,
                     mem_used_bytes=0, mem_total_bytes=80 << 30)
        for i, uuid in enumerate(uuids)])


Publish = Callable[[KafkaPublisher, Callable[[], Awaitable[None]]], Awaitable[None]]
"""What a test sends, given the publisher and a step that waits until the worker has read
all that was published."""


async def healthy_until(publisher: KafkaPublisher, gpus: dict[str, list[str]],
                        end: float) -> float:
    """Every node reading all its GPUs, a sample every STEP_S from T0 until ``end``; the time
    of the next sample."""
    ts = T0
    while ts < end:
        for node, uuids in gpus.items():
            await publisher.sample(page(node, ts, uuids))
        ts += STEP_S
    return ts


def run(settings: Settings, tmp_path: Path, publish: Publish
        ) -> tuple[list[Finding], list[Action]]:
    """Run ``publish`` against the deployed worker; the findings and actions it published."""
    node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS,
                                               topics.ALLOCATIONS)]

    async def main() -> tuple[list[Finding], list[Action]]:
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()

        async def consumed() -> None:
            await publisher.flush()
            await kafka.wait_consumed(settings, worker_group(settings), node_topics, 90)

        try:
            await publish(publisher, consumed)
            await consumed()
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]
            return (await decoded(settings, topics.FINDINGS, Finding),
                    await decoded(settings, topics.ACTIONS, Action))
        finally:
            await publisher.stop()
            worker.stop()

    return asyncio.run(main())


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_replaced_gpu_resolves_its_findings_and_a_missing_one_does_not(
        settings: Settings, tmp_path: Path) -> None:
    gpus = {node: [f"GPU-{node}-{i}" for i in range(8)] for node in ("fixed", "missing")}
    lost_at = T0 + 10 * STEP_S
    back_at = lost_at + 3600  # an hour later both nodes report again

    async def publish(publisher: KafkaPublisher,
                      consumed: Callable[[], Awaitable[None]]) -> None:
        ts = await healthy_until(publisher, gpus, lost_at)
        await consumed()
        for node, uuids in gpus.items():
            await publisher.hw_event(HwEvent(ts=lost_at, node=node, kind="xid",
                                             uuid=uuids[0], xid=79,
                                             detail="GPU has fallen off the bus"))
        # The fault is read before the repair, as it is when it happens (the worker reads
        # the two topics at their own paces: a backlog could put the repair first).
        await consumed()
        # Both run without their GPU 0 (the other seven keep their indices until a
        # reboot), then come back: ``fixed`` with a new GPU in its slot, ``missing``
        # rebooted without it, its GPUs enumerated again from 0.
        while ts < back_at:
            for node, uuids in gpus.items():
                sample = page(node, ts, uuids)
                await publisher.sample(msgspec.structs.replace(
                    sample, devices=sample.devices[1:]))
            ts += STEP_S
        after = {"fixed": ["GPU-fixed-new", *gpus["fixed"][1:]],
                 "missing": gpus["missing"][1:]}
        while ts < back_at + 3600:
            for node, uuids in after.items():
                await publisher.sample(page(node, ts, uuids))
            ts += STEP_S

    findings, actions = run(settings, tmp_path, publish)
    lost = {(f.subject.node, f.state, f.ts) for f in findings if f.kind == "gpu_lost"}
    assert lost == {("fixed", "firing", lost_at), ("missing", "firing", lost_at),
                    ("fixed", "resolved", back_at)}
    [replaced] = [f for f in findings if f.kind == "gpu_lost" and f.state == "resolved"]
    assert replaced.summary == ("GPU-fixed-0 was replaced by GPU-fixed-new (GPU 0 of node "
                                "fixed)")
    drains = {node: sorted(a.ts for a in actions
                           if a.verb == "drain" and a.target.node == node)
              for node in gpus}
    # Asked at the fault, then every 10 min while the finding is open: for ``fixed`` until
    # its new GPU reported, for ``missing`` to the end.
    every = 600.0
    assert drains["fixed"] == [lost_at + k * every for k in range(6)]  # none from back_at
    assert drains["missing"] == [lost_at + k * every for k in range(12)]


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_gpu_lost_unreadable_at_start_resolves_once_the_node_reads_every_gpu(
        settings: Settings, tmp_path: Path) -> None:
    gpus = {node: [f"GPU-{node}-{i}" for i in range(4)] for node in ("fixed", "still")}
    lost_at = T0 + 10 * STEP_S  # the node rebooted: its collector cannot read GPU 3
    back_at = lost_at + 3600  # an hour later ``fixed`` is repaired and reads all four

    def without_3(node: str, ts: float) -> NodeSample:
        sample = page(node, ts, gpus[node])
        return msgspec.structs.replace(sample, devices=sample.devices[:3])

    async def publish(publisher: KafkaPublisher,
                      consumed: Callable[[], Awaitable[None]]) -> None:
        ts = await healthy_until(publisher, gpus, lost_at)
        # The collector's first tick after the reboot, as it publishes it: the sample of
        # the GPUs it could read and the loss of the one it could not (no uuid).
        for node in gpus:
            await publisher.sample(without_3(node, ts))
            await publisher.hw_event(HwEvent(
                ts=ts, node=node, kind="gpu_lost", source="nvml",
                detail="GPU 3 unreadable at start: NVMLError_GpuIsLost"))
        # Read as it happens, before the hour after it (the worker reads the two topics
        # at their own paces: a backlog could read the loss after later samples).
        await consumed()
        ts += STEP_S
        while ts < back_at:
            for node in gpus:
                await publisher.sample(without_3(node, ts))
            ts += STEP_S
        while ts < back_at + 3600:
            await publisher.sample(page("fixed", ts, gpus["fixed"]))
            await publisher.sample(without_3("still", ts))
            ts += STEP_S

    findings, actions = run(settings, tmp_path, publish)
    lost = {(f.subject.node, f.subject.device, f.state, f.ts) for f in findings
            if f.kind == "gpu_lost"}
    assert lost == {("fixed", "GPU-unknown", "firing", lost_at),
                    ("still", "GPU-unknown", "firing", lost_at),
                    ("fixed", "GPU-unknown", "resolved", back_at)}
    [ended] = [f for f in findings if f.kind == "gpu_lost" and f.state == "resolved"]
    assert ended.summary == ("GPU-unknown on fixed: all 4 GPUs of the node answer, "
                             "GPU-fixed-3 not read since the loss")
    drains = {node: sorted(a.ts for a in actions
                           if a.verb == "drain" and a.target.node == node)
              for node in gpus}
    every = 600.0
    assert drains["fixed"] == [lost_at + k * every for k in range(6)]  # none from back_at
    assert drains["still"] == [lost_at + k * every for k in range(12)]
