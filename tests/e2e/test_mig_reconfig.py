"""A MIG reconfiguration by mig-manager, end to end: API double -> Kubernetes watcher ->
Kafka -> stream worker, with the dcgm-exporter loss tracker's ``gpu_lost`` events and a
reset XID published as the collectors publish them.

mig-manager sets ``nvidia.com/mig.config.state=pending``, stops the GPU clients (the pod
on GPU 0 sits at 0 % while it is evicted), toggles MIG mode on GPU 1 (it leaves the
exporter's page; the reset logs an XID), then sets ``success``; a second relabel fails;
after a third, GPU 1 stays off the page. The watcher's clock runs two minutes behind the
node's (it stamps the states, the collectors the reset). What the operator and the
executor see on the output topics:

- the loss and the XID as findings marked with the state, and no cordon, taint or drain;
  both resolved once the state reads success and the GPU answers;
- no idle finding or reclaim for the evicted pod;
- node summaries with nothing free during the window, saying the layout is changing;
- one ``mig_config_failed`` warning for the failure, resolved by the next success;
- the GPU still silent ``mig_settle_s`` (5 min) after the third success: its loss raised
  again saying so, and one drain.

The worker reads a node's allocations and hardware events from two topics; the test
lets it read the ``pending`` before the reset's events, as mig-manager's order has it
(see docs/detection.md on a worker catching up).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.dcgm import LostGpus
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, start
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    HwEvent,
    NodeSample,
    NodeSummary,
    PodRef,
)
from gpusteward.settings import Settings
from gpusteward.topics import worker_group

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the pod starts
STEP_S = 30.0
NODE = "a100-1"
MODEL = "NVIDIA A100-SXM4-80GB"
POD = PodRef("team-a", "train")
RESET_XID = 46  # class reset_gpu: a taint, were it a fault
WATCHER_BEHIND_S = 120.0
"""How far the watcher's clock (the node states' ts) runs behind the node's (the
samples' and hardware events')."""
SETTLE_S = 300.0  # RuleSettings.mig_settle_s's default


def _gpu(index: int, util: float, pod: PodRef | None = None) -> DeviceSample:
    return DeviceSample(uuid=f"GPU-{index}", index=index, model=MODEL, util_pct=util,
                        temp_c=40.0, mem_total_bytes=80 << 30, pod=pod)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_mig_reconfiguration_end_to_end(settings: Settings, tmp_path: Path) -> None:
    now = T0

    async def main() -> tuple[list[Finding], list[Action], list[NodeSummary],
                              dict[str, tuple[float, float]]]:
        nonlocal now
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()
        stop = asyncio.Event()
        lost = LostGpus("dcgm")
        node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS,
                                                   topics.ALLOCATIONS)]
        phases: dict[str, tuple[float, float]] = {}
        try:
            with KubeApiServer(bookmark_interval_s=0.2) as api:
                pod = gpu_pod("train", node=NODE, owner=None, uid="uid-train")
                start(pod, "2026-01-01T00:00:00Z")
                api.load([gpu_node(NODE, gpus=2, labels={
                    "nvidia.com/mig.config": "all-disabled",
                    "nvidia.com/mig.config.state": "success"}), pod])
                kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))
                watcher = KubeWatcher(api_client(kube), publisher, kube,
                                      clock=lambda: now - WATCHER_BEHIND_S)
                watching = asyncio.create_task(watcher.run(stop))
                await asyncio.wait_for(watcher.synced.wait(), 30)

                async def caught_up() -> None:
                    """Everything the watcher and the collectors sent, read by the worker."""
                    latest = str(api.resource_version)
                    for _ in range(500):
                        reflectors = list(watcher.reflectors.values())
                        if all(r.resource_version == latest for r in reflectors) and (
                                sum(r.stats.deltas for r in reflectors) == watcher.processed):
                            break
                        await asyncio.sleep(0.02)
                    else:
                        raise AssertionError("the watcher did not catch up in 10 s")
                    await publisher.flush()
                    await kafka.wait_consumed(settings, worker_group(settings), node_topics, 90)

                async def label(**labels: str) -> None:
                    api.patch("Node", NODE, {"metadata": {"labels": {
                        f"nvidia.com/{k.replace('_', '.')}": v for k, v in labels.items()}}})
                    await caught_up()

                async def page(devices: list[DeviceSample]) -> None:
                    nonlocal now
                    sample = NodeSample(ts=now, node=NODE, source="dcgm", devices=devices)
                    await publisher.sample(sample)
                    for event in lost.events([sample], now):
                        await publisher.hw_event(event)
                    now += STEP_S

                await caught_up()
                while now < T0 + 35 * 60:  # idle since its start, 5 min short of a notice
                    await page([_gpu(0, 0.0, POD), _gpu(1, 0.0)])
                await caught_up()
                window_start = now
                await label(mig_config="all-1g.10gb", mig_config_state="pending")
                for _ in range(12):  # 6 min: GPU 1 leaves the page, the pod is evicted
                    await page([_gpu(0, 0.0, POD)])
                await publisher.hw_event(HwEvent(ts=now, node=NODE, kind="xid", uuid="GPU-1",
                                                 xid=RESET_XID, source="dcgm"))
                await caught_up()
                now += STEP_S
                # Until the success, as the watcher stamps it (and the summary it brings).
                phases["window"] = (window_start, now - WATCHER_BEHIND_S)
                await label(mig_config_state="success")
                back = now
                for _ in range(3):
                    await page([_gpu(0, 0.0), _gpu(1, 5.0)])
                phases["back"] = (back, now)
                await caught_up()
                await label(mig_config="all-3g.40gb", mig_config_state="pending")
                await label(mig_config_state="failed")
                now += STEP_S
                await label(mig_config_state="pending")
                await label(mig_config_state="success")
                await page([_gpu(0, 50.0), _gpu(1, 5.0)])
                await caught_up()
                silent_start = now
                await label(mig_config="all-2g.20gb", mig_config_state="pending")
                for _ in range(4):  # GPU 1 leaves the page again; the pod is busy now
                    await page([_gpu(0, 50.0)])
                await label(mig_config_state="success")
                phases["silent"] = (silent_start, now)
                for _ in range(12):  # and does not come back
                    await page([_gpu(0, 50.0)])
                await caught_up()
                stop.set()
                await watching
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]

            async def read(spec: topics.TopicSpec, kind: Any) -> list[Any]:
                records = await kafka.read_all(settings, spec.name(settings))
                return [msgspec.json.decode(r.value or b"", type=kind) for r in records]

            return (await read(topics.FINDINGS, Finding), await read(topics.ACTIONS, Action),
                    await read(topics.NODE_SUMMARIES, NodeSummary), phases)
        finally:
            await publisher.stop()
            worker.stop()

    findings, actions, summaries, phases = asyncio.run(main())
    silent_start, succeeded = phases["silent"]
    disrupting = [a for a in actions if a.verb in ("cordon", "taint", "drain")]
    # One drain: the GPU still silent after the third reconfiguration, once its grace
    # (from the success, as the watcher stamped it) is over.
    assert [(a.verb, a.rule, a.reask) for a in disrupting] == [("drain", "gpu_lost", 0)], \
        f"a reconfiguration cordoned or drained the node: {disrupting}"
    (drain,) = disrupting
    due = succeeded - WATCHER_BEHIND_S + SETTLE_S
    losses = [(f.ts - succeeded, f.state, f.labels) for f in findings if f.kind == "gpu_lost"]
    assert due <= drain.ts < succeeded + SETTLE_S, (
        f"drained at {drain.ts - succeeded:+.0f} s of the success, due at "
        f"{due - succeeded:+.0f} s: {losses}")
    assert "not back 5 min after the MIG reconfiguration to all-2g.20gb succeeded" \
        in drain.reason
    assert not [f for f in findings if f.kind == "idle_holder"], "the evicted pod judged idle"
    assert not [a for a in actions if a.rule == "idle_holder"]

    def episodes(kind: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for f in findings:
            if f.kind == kind:
                out.setdefault(f.id, []).append(f.state)
        return out

    for kind in ("gpu_lost", "xid"):
        first_id, first_states = next(iter(episodes(kind).items()))
        assert first_states == ["firing", "resolved"], (kind, findings)
        firing = next(f for f in findings if f.id == first_id)
        assert firing.labels["mig_config_state"] == "pending"
        assert firing.labels["mig_config"] == "all-1g.10gb"
    assert len(episodes("xid")) == 1
    # Settled by the success, though the watcher stamped it before the XID's own time;
    # not left to the XID's quiet window.
    (settled,) = [f for f in findings if f.kind == "xid" and f.state == "resolved"]
    assert "answers again after a successful MIG reconfiguration" in settled.summary, settled
    assert phases["back"][0] <= settled.ts < phases["back"][1], (settled.ts, phases)
    # The third reconfiguration's loss: held, then raised again saying why, with the drain.
    (_, silent), = list(episodes("gpu_lost").items())[1:]
    assert silent == ["firing", "firing"]
    held, overdue = [f for f in findings if f.id in drain.finding_ids]
    assert held.labels["mig_config"] == "all-2g.20gb" and "no node action" in held.summary
    assert overdue.labels["mig_settle"] == "overdue" and overdue.summary == drain.reason
    assert list(episodes("mig_config_failed").values()) == [["firing", "resolved"]]
    (failed,) = [f for f in findings if f.kind == "mig_config_failed" and f.state == "firing"]
    assert failed.severity == "warning" and failed.subject.node == NODE
    assert failed.labels["mig_config"] == "all-3g.40gb" and "all-3g.40gb" in failed.summary

    begin, end = phases["window"]
    during = [s for s in summaries if s.node == NODE and begin <= s.ts < end]
    assert during and all(s.gpus_free == 0 and not s.mig_free and not s.idle
                          and s.mig_changing for s in during), \
        [(s.ts, s.gpus_free, s.mig_free, s.idle, s.mig_changing) for s in during]
    # The node after the second success, as the third reconfiguration began (the summary
    # the pending brings is stamped by the watcher).
    third = next(i for i, s in enumerate(summaries)
                 if s.ts == silent_start - WATCHER_BEHIND_S)
    assert summaries[third - 1].gpus_free == 1 and summaries[third - 1].healthy, \
        summaries[third - 1]
    assert not summaries[third - 1].mig_changing and summaries[third].mig_changing
    assert not summaries[-1].healthy, summaries[-1]  # GPU 1 lost, the node drained
