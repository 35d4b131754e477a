"""A ``gpusteward.io/keep-until`` pod annotation holds the idle ladder until its time, end to
end: API double -> Kubernetes watcher (which carries the pod's annotations to the allocation
event) -> Kafka -> stream worker, beside an unannotated pod idle in the same way."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gpusteward import kafka, topics
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import idle
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, start
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import (
    Action,
    AllocationEvent,
    DeviceSample,
    Finding,
    NodeSample,
    PodAllocation,
    PodRef,
)
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.e2e.records import decoded

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the pods start
STEP_S = 240.0  # one sample per 4 min: within the rule's max_gap_s
SETTINGS = idle.IdleSettings()
FIRST = T0 + SETTINGS.grace_s + SETTINGS.window_s  # the first notice of an idle pod
HOLD_END = T0 + 8 * 3600  # after the warning would have come (FIRST + 4 h)
KEPT, PLAIN = PodRef("ml-alice", "nb-kept"), PodRef("ml-alice", "nb-plain")


def notebook(ref: PodRef, annotations: dict[str, str]) -> dict[str, object]:
    obj = gpu_pod(ref.name, ref.namespace, node="gpu-1", owner=None, uid=f"uid-{ref.name}",
                  labels={"gpusteward.io/workload-kind": "notebook"})
    start(obj, idle.rfc3339(T0))
    obj["metadata"]["annotations"] = annotations
    return obj


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_keep_until_holds_the_idle_ladder_until_its_time(settings: Settings,
                                                         tmp_path: Path) -> None:
    async def main() -> tuple[list[Finding], list[Action], list[AllocationEvent]]:
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()
        stop = asyncio.Event()
        try:
            with KubeApiServer(bookmark_interval_s=0.2) as api:
                api.load([gpu_node("gpu-1", gpus=2),
                          notebook(KEPT, {idle.KEEP_UNTIL_ANNOTATION: idle.rfc3339(HOLD_END)}),
                          notebook(PLAIN, {})])
                kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))
                watcher = KubeWatcher(api_client(kube), publisher, kube, clock=lambda: T0)
                watching = asyncio.create_task(watcher.run(stop))
                await asyncio.wait_for(watcher.synced.wait(), 30)
                await publisher.flush()
                stop.set()
                await watching
            # The join must know the pods (and their annotations) before their first samples.
            await kafka.wait_consumed(settings, worker_group(settings),
                                      [topics.ALLOCATIONS.name(settings)], 60)
            ts = T0
            while ts <= T0 + 9 * 3600:
                await publisher.sample(NodeSample(ts=ts, node="gpu-1", source="test", devices=[
                    DeviceSample(uuid="GPU-K", index=0, model="A100", util_pct=0.0, pod=KEPT),
                    DeviceSample(uuid="GPU-P", index=1, model="A100", util_pct=0.0,
                                 pod=PLAIN)]))
                ts += STEP_S
            await publisher.flush()
            node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS,
                                                       topics.ALLOCATIONS)]
            await kafka.wait_consumed(settings, worker_group(settings), node_topics, 90)
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]

            return (await decoded(settings, topics.FINDINGS, Finding),
                    await decoded(settings, topics.ACTIONS, Action),
                    await decoded(settings, topics.ALLOCATIONS, AllocationEvent))
        finally:
            await publisher.stop()
            worker.stop()

    findings, actions, allocations = asyncio.run(main())
    carried = {a.pod.name: a.annotations for a in allocations
               if isinstance(a, PodAllocation)}
    assert carried["nb-kept"] == {idle.KEEP_UNTIL_ANNOTATION: idle.rfc3339(HOLD_END)}

    def of(ref: PodRef, items: list[Any]) -> list[Any]:
        subjects = ((i, i.subject if isinstance(i, Finding) else i.target) for i in items)
        return [i for i, subject in subjects
                if subject.pod is not None and subject.pod.name == ref.name]

    plain = [(a.verb, a.ts) for a in of(PLAIN, actions)]
    assert plain == [("notify_owner", FIRST), ("notify_owner", FIRST + SETTINGS.warn_after_s)]
    kept = [(a.verb, a.ts) for a in of(KEPT, actions)]
    # Nothing while held; the ladder's next step (the warning) on the first sample after it.
    assert kept == [("notify_owner", HOLD_END)]
    held = [f for f in of(KEPT, findings) if f.state == "firing"]
    assert held[0].ts == FIRST and "left alone until" in held[0].summary
    assert held[0].evidence and held[0].evidence.values["kept_until"] == HOLD_END
    assert held[-1].severity == "warning" and held[-1].ts == HOLD_END
    # The owner's notice of that warning says what comes next, from the finding.
    [warned] = of(KEPT, actions)
    assert warned.reason == idle.owner_notice(held[-1])
    assert "a reclaim at" in warned.reason
