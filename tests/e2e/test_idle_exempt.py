"""An owner who exempts an idle pod while its episode is open stops the ladder, end to end:
API double -> Kubernetes watcher (the pod's new label on its allocation event) -> Kafka ->
stream worker, beside a pod idle in the same way and left as it is.

The idle notice and the runbook tell the owner to add the exemption label if the hold is
intended; the ladder used to climb on regardless (a warning, a reminder and, at its end, a
reclaim of the pod its owner had exempted).
"""

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
from gpusteward.schema import Action, DeviceSample, Finding, NodeSample, PodRef
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.e2e.records import decoded

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the pods start
STEP_S = 240.0  # one sample per 4 min: within the rule's max_gap_s
SETTINGS = idle.IdleSettings()
FIRST = T0 + SETTINGS.grace_s + SETTINGS.window_s  # the first notice of both pods
LABELLED = FIRST + 3600  # the owner labels one pod an hour after its notice
WARNED = FIRST + SETTINGS.warn_after_s
RECLAIMED = WARNED + SETTINGS.reclaim_after_s
EXEMPTED, PLAIN = PodRef("ml-alice", "nb-exempted"), PodRef("ml-alice", "nb-plain")
LABEL = next(iter(SETTINGS.exempt_labels.items()))


def notebook(ref: PodRef) -> dict[str, object]:
    obj = gpu_pod(ref.name, ref.namespace, node="gpu-1", owner=None, uid=f"uid-{ref.name}",
                  labels={"gpusteward.io/workload-kind": "notebook"})
    start(obj, idle.rfc3339(T0))
    return obj


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_an_exemption_label_added_while_idle_closes_the_episode_and_stops_the_ladder(
        settings: Settings, tmp_path: Path) -> None:
    node_topics = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS,
                                               topics.ALLOCATIONS)]

    async def main() -> tuple[list[Finding], list[Action]]:
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        publisher = KafkaPublisher(settings)
        await publisher.start()
        now = [T0]
        stop = asyncio.Event()

        async def samples(until: float) -> None:
            while now[0] <= until:
                await publisher.sample(NodeSample(ts=now[0], node="gpu-1", source="test",
                                                  devices=[
                    DeviceSample(uuid="GPU-E", index=0, model="A100", util_pct=0.0,
                                 pod=EXEMPTED),
                    DeviceSample(uuid="GPU-P", index=1, model="A100", util_pct=0.0,
                                 pod=PLAIN)]))
                now[0] += STEP_S
            await publisher.flush()
            await kafka.wait_consumed(settings, worker_group(settings), node_topics, 90)

        try:
            with KubeApiServer(bookmark_interval_s=0.2) as api:
                api.load([gpu_node("gpu-1", gpus=2), notebook(EXEMPTED), notebook(PLAIN)])
                kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))
                watcher = KubeWatcher(api_client(kube), publisher, kube, clock=lambda: now[0])
                watching = asyncio.create_task(watcher.run(stop))
                await asyncio.wait_for(watcher.synced.wait(), 30)
                await publisher.flush()
                # The join must know the pods before their first samples.
                await kafka.wait_consumed(settings, worker_group(settings), node_topics, 60)
                await samples(LABELLED)
                before = len(await kafka.read_all(settings, topics.ALLOCATIONS.name(settings)))
                api.patch("Pod", EXEMPTED.name, {"metadata": {"labels": dict([LABEL])}},
                          EXEMPTED.namespace)
                for _ in range(100):  # the watcher publishes the pod's new labels
                    await publisher.flush()
                    allocations = await kafka.read_all(settings,
                                                       topics.ALLOCATIONS.name(settings))
                    if len(allocations) > before:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the watcher published no allocation for the label")
                await kafka.wait_consumed(settings, worker_group(settings), node_topics, 60)
                await samples(RECLAIMED + 1800)
                stop.set()
                await watching
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]

            return (await decoded(settings, topics.FINDINGS, Finding),
                    await decoded(settings, topics.ACTIONS, Action))
        finally:
            await publisher.stop()
            worker.stop()

    findings, actions = asyncio.run(main())

    def of(ref: PodRef, items: list[Any]) -> list[Any]:
        subjects = ((i, i.subject if isinstance(i, Finding) else i.target) for i in items)
        return [i for i, subject in subjects
                if subject.pod is not None and subject.pod.name == ref.name]

    # The pod left as it was climbs the whole ladder: notice, warning, reminder, reclaim.
    plain = [(a.verb, a.idempotency_key.rsplit("/", 1)[-1]) for a in of(PLAIN, actions)]
    assert plain == [("notify_owner", "notify_owner"), ("notify_owner", "warn"),
                     ("notify_owner", "remind"), ("requeue", "requeue")]
    # The exempted one: its first notice, then its episode closes at the first sample after
    # the label was read, saying why; nothing more is asked, and it does not open again.
    assert [(a.verb, a.ts) for a in of(EXEMPTED, actions)] == [("notify_owner", FIRST)]
    told = [(f.state, f.severity, f.ts) for f in of(EXEMPTED, findings)]
    closed_at = LABELLED + STEP_S
    assert told == [("firing", "info", FIRST), ("resolved", "info", closed_at)]
    [closed] = [f for f in of(EXEMPTED, findings) if f.state == "resolved"]
    assert closed.summary.endswith(
        f"exempt from idle detection (label {LABEL[0]}={LABEL[1]})")
