"""A deleted node leaves the fleet's view and its findings resolve, end to end: API double
-> Kubernetes watcher -> Kafka -> stream worker (node join and fleet agent) -> findings and
node summaries (-> the alerts process and a real Alertmanager, for the findings).

Three A100 nodes, ``big`` with 8 GPUs and ``s1``, ``s2`` with 4, all free. ``big`` is
deleted; then a pod asking for 8 GPUs on one node is created and waits. With ``big``
gone no node can ever hold it: the fleet has 8 GPUs free but at most 4 on a node, so
it is stranded, and it gets no start estimate. Then ``big`` is created again under its
name, and counts again: the pod now fits it and gets an estimate.

Before the node join sent tombstones, ``big``'s last summary (8 GPUs, none free) stayed
in the fleet agent's view until it went stale (``node_stale_s``, 10 min of event time)
and in ``gpusteward status`` for good (the summaries topic is compacted): the agent
promised the pod a start "now" on a node that no longer existed, and the status counted
8 allocated GPUs in the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.alerting.alertmanager import AlertmanagerSink
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.broker import free_port
from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import eta
from gpusteward.rules import fragmentation as frag
from gpusteward.rules import spot as spot_rules
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod, rfc3339
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import DeviceSample, Finding, NodeSample, NodeSummary, PodRef, Rollup
from gpusteward.settings import Settings
from gpusteward.status import StatusFold
from gpusteward.streams.fleet import FleetSettings
from gpusteward.streams.node import NodeState, RuleSettings
from gpusteward.topics import worker_group
from tests.alerting.conftest import start_alertmanager, stop_alertmanager
from tests.alerting.test_consumer_edge import consume_all
from tests.e2e.records import live_states

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
STEP_S = 30.0
MODEL = "NVIDIA A100-SXM4-80GB"
GPUS = {"big": 8, "s1": 4, "s2": 4}
WIDE = "team-a/wide"
"""The pod asking for 8 GPUs on one node."""


def _page(node: str, ts: float) -> NodeSample:
    return NodeSample(ts=ts, node=node, source="dcgm", devices=[
        DeviceSample(uuid=f"GPU-{node}-{i}", index=i, model=MODEL, util_pct=0.0, temp_c=40.0,
                     mem_total_bytes=80 << 30) for i in range(GPUS[node])])


async def _caught_up(settings: Settings, api: KubeApiServer, watcher: KubeWatcher,
                     publisher: KafkaPublisher) -> None:
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
    await kafka.wait_consumed(settings, worker_group(settings), [
        t.name(settings) for t in (topics.SAMPLES, topics.ALLOCATIONS)], 90)


class _Clock:
    """The simulated time both the watcher's clock and the pages read."""

    def __init__(self) -> None:
        self.now = T0


class _Deployed(NamedTuple):
    api: KubeApiServer
    publisher: KafkaPublisher
    caught_up: Callable[[], Awaitable[None]]
    """Waits until the worker has read all the watcher and the publisher sent."""
    restart_worker: Callable[[], None]
    """Stops the worker (SIGTERM) and starts another in its place, ready."""


@contextlib.asynccontextmanager
async def _deployed(settings: Settings, tmp_path: Path, nodes: list[dict[str, Any]],
                    clock: _Clock) -> AsyncIterator[_Deployed]:
    """The deployed worker, a publisher for the collectors' samples, and the Kubernetes
    watcher on an API double holding ``nodes``. The watcher stops and the publisher is
    flushed when the block ends, the worker (checked alive) after."""
    await kafka.ensure_topics(settings)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    worker.start()

    def restart_worker() -> None:
        nonlocal worker
        worker.stop()
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        worker.wait_ready(90)

    publisher = KafkaPublisher(settings)
    await publisher.start()
    stop = asyncio.Event()
    try:
        with KubeApiServer(bookmark_interval_s=0.2) as api:
            api.load(nodes)
            kube = KubeWatchSettings(kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")))
            watcher = KubeWatcher(api_client(kube), publisher, kube, clock=lambda: clock.now)
            watching = asyncio.create_task(watcher.run(stop))
            await asyncio.wait_for(watcher.synced.wait(), 30)

            async def caught_up() -> None:
                await _caught_up(settings, api, watcher, publisher)

            yield _Deployed(api, publisher, caught_up, restart_worker)
            stop.set()
            await watching
            await publisher.flush()
        assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        await publisher.stop()
        worker.stop()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_deleted_node_leaves_the_fleet_and_counts_again_when_re_added(
        settings: Settings, tmp_path: Path) -> None:
    clock = _Clock()
    phases: dict[str, float] = {}

    async def main() -> tuple[list[Finding], list[NodeSummary]]:
        nodes = [gpu_node(node, gpus=gpus) for node, gpus in GPUS.items()]
        async with _deployed(settings, tmp_path, nodes, clock) as (api, publisher, caught_up,
                                                                   _):

            async def pages(names: tuple[str, ...], steps: int) -> None:
                for _ in range(steps):
                    for node in names:
                        await publisher.sample(_page(node, clock.now))
                    clock.now += STEP_S
                await caught_up()

            await pages(tuple(GPUS), 6)
            phases["deleted"] = clock.now
            api.delete("Node", "big")  # its collector goes with it
            await caught_up()
            clock.now += STEP_S
            api.create(gpu_pod("wide", node=None, resources={"nvidia.com/gpu": "8"},
                               uid="uid-wide", created=rfc3339(clock.now)))
            await caught_up()
            await pages(("s1", "s2"), 14)  # 7 min: stranded, and under node_stale_s
            phases["re-added"] = clock.now
            api.create(gpu_node("big", gpus=GPUS["big"]))
            await caught_up()
            await pages(tuple(GPUS), 6)
            await kafka.wait_consumed(settings, worker_group(settings), [
                t.name(settings) for t in (topics.NODE_SUMMARIES, topics.QUEUE)], 120)

        async def read(spec: topics.TopicSpec, kind: Any) -> list[Any]:
            records = await kafka.read_all(settings, spec.name(settings))
            return [msgspec.json.decode(r.value or b"", type=kind) for r in records]

        return await read(topics.FINDINGS, Finding), await read(topics.NODE_SUMMARIES,
                                                               NodeSummary)

    findings, summaries = asyncio.run(main())
    deleted, re_added = phases["deleted"], phases["re-added"]
    big = [s for s in summaries if s.node == "big"]
    gone = [s for s in big if deleted <= s.ts < re_added]
    # The node join's tombstones: the node offers and holds nothing, and says it is gone.
    assert gone and all(s.deleted and s.gpus_total == 0 and s.gpus_free == 0 for s in gone), \
        [(s.ts, s.deleted, s.gpus_total) for s in gone]
    back = [s for s in big if s.ts >= re_added]
    assert back and not any(s.deleted for s in back) and back[-1].gpus_free == 8

    def about_wide(kind: str) -> list[Finding]:
        return [f for f in findings if f.kind == kind and f.subject.pod is not None
                and f"{f.subject.pod.namespace}/{f.subject.pod.name}" == WIDE]

    # While big is gone: stranded (8 free, 4 at most on a node), and no start promised.
    stranded = about_wide(frag.STRANDED_KIND)
    assert [f.state for f in stranded] == ["firing", "resolved"], stranded
    assert stranded[0].ts < re_added <= stranded[1].ts
    estimates = about_wide(eta.KIND)
    assert not [f for f in estimates if f.ts < re_added], \
        [(f.ts - deleted, f.summary) for f in estimates]
    # Created again, big counts again: the pod fits it.
    assert [f for f in estimates if f.ts >= re_added and f.state == "firing"], estimates

    # gpusteward status over the summaries sent while big was gone: two nodes, 8 GPUs.
    fold = StatusFold()
    for summary in summaries:
        if summary.ts < re_added:
            fold.summary(summary)
    pools = fold.snapshot(re_added).pools
    assert [(p.nodes, p.gpus, p.allocated) for p in pools] == [(2, 8, 0)], pools


REPAIRED = "n1"
"""The node removed for repair: a notebook idle on GPU 0, a double-bit ECC error on GPU 1."""
KEPT = "n2"
"""A node that stays, with a double-bit ECC error of its own."""
NOTEBOOK = PodRef(namespace="team-a", name="nb")


def _faulty_page(node: str, ts: float, *, faulty: bool = True) -> NodeSample:
    """``node``'s dcgm page: on n1 the notebook idle on GPU 0; a DBE on its last GPU while
    ``faulty``."""
    gpus = 2 if node == REPAIRED else 1
    return NodeSample(ts=ts, node=node, source="dcgm", devices=[
        DeviceSample(uuid=f"GPU-{node}-{i}", index=i, model=MODEL, util_pct=0.0, temp_c=40.0,
                     mem_total_bytes=80 << 30, ecc_dbe_volatile=int(faulty and i == gpus - 1),
                     pod=NOTEBOOK if node == REPAIRED and faulty and i == 0 else None)
        for i in range(gpus)])


def _open_gauge(consumer: FindingsConsumer) -> dict[tuple[str, str], float]:
    """``gpusteward_findings_open``'s non-zero children: (kind, severity) -> open findings."""
    return {(sample.labels["kind"], sample.labels["severity"]): sample.value
            for family in consumer.metrics.registry.collect()
            if family.name == "gpusteward_findings_open"
            for sample in family.samples if sample.value}


def _active_alerts(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v2/alerts?active=true", timeout=5) as response:
        alerts: list[dict[str, Any]] = json.loads(response.read())
    return alerts


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_findings_of_a_deleted_node_resolve_and_its_alerts_end(
        settings: Settings, tmp_path: Path) -> None:
    """A node deleted from the cluster (taken out for repair) has every finding open on it
    resolved, under its own id, naming the deletion: its alerts end at Alertmanager and the
    open-findings gauge drops; another node's finding stays open; the node created again
    under its name, repaired, raises nothing from its old state.

    Before, no resolution ever came: the alerts process re-posted n1's alerts every minute
    and counted them open for ever."""
    clock = _Clock()
    phases: dict[str, float] = {}

    async def main() -> list[Finding]:
        nodes = [gpu_node(REPAIRED, gpus=2), gpu_node(KEPT, gpus=1)]
        async with _deployed(settings, tmp_path, nodes, clock) as (api, publisher, caught_up,
                                                                   _):
            api.create(gpu_pod(NOTEBOOK.name, NOTEBOOK.namespace, node=REPAIRED,
                               uid="uid-nb", phase="Running", created=rfc3339(clock.now)))
            await caught_up()

            async def pages(names: tuple[str, ...], steps: int, faulty: bool = True) -> None:
                for _ in range(steps):
                    for node in names:
                        await publisher.sample(_faulty_page(node, clock.now, faulty=faulty))
                    clock.now += STEP_S
                await caught_up()

            # 45 min: the DBEs at once, the notebook idle past grace and window (40 min).
            await pages((REPAIRED, KEPT), 90)
            phases["deleted"] = clock.now
            api.delete("Node", REPAIRED)  # its collector goes with it
            await caught_up()
            await pages((KEPT,), 4)
            phases["re-added"] = clock.now
            api.create(gpu_node(REPAIRED, gpus=2))  # repaired: no DBE, no pod
            await caught_up()
            await pages((REPAIRED,), 4, faulty=False)
        records = await kafka.read_all(settings, topics.FINDINGS.name(settings))
        return [msgspec.json.decode(r.value or b"", type=Finding) for r in records]

    findings = asyncio.run(main())
    deleted = phases["deleted"]
    on_n1 = [f for f in findings if f.subject.node == REPAIRED]
    fired = {f.id: f for f in on_n1 if f.state == "firing"}
    assert {f.kind for f in fired.values()} == {"idle_holder", "ecc_dbe"}, on_n1
    # Each resolved once, under its id and fingerprint, at the deletion, naming it.
    ends = [f for f in on_n1 if f.state == "resolved"]
    assert sorted((f.id, f.fingerprint, f.kind, f.ts) for f in ends) == sorted(
        (f.id, f.fingerprint, f.kind, deleted) for f in fired.values()), ends
    assert {f.summary for f in ends} == {f"node {REPAIRED} deleted from the cluster"}
    assert not [f for f in on_n1 if f.ts > deleted], "nothing after the deletion"
    # The node that stays keeps its finding open.
    assert [(f.kind, f.state) for f in findings if f.subject.node == KEPT] == [
        ("ecc_dbe", "firing")]

    # The alerts process, reading the topic, against a real Alertmanager.
    port = free_port()
    alertmanager = start_alertmanager(tmp_path / "alertmanager", port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        consumer = FindingsConsumer(settings, [sink := AlertmanagerSink(url)],
                                    group_id="alerts-after-deletion")

        async def alerts() -> None:
            await consume_all(consumer)
            await sink.refresh()
            await sink.close()

        asyncio.run(alerts())
        active = _active_alerts(url)
        assert [(a["labels"]["kind"], a["labels"]["node"]) for a in active] == [
            ("ecc_dbe", KEPT)], active
        assert _open_gauge(consumer) == {("ecc_dbe", "critical"): 1}
        assert {a["labels"]["node"] for a in sink.firing.values()} == {KEPT}
    finally:
        stop_alertmanager(alertmanager)


REPLACED = ("old-0", "old-1", "old-2", "old-3")
"""Nodes an autoscaler replaces under new names."""
REPLACEMENTS = ("new-0", "new-1", "new-2", "new-3")
NB_ON_OLD = PodRef(namespace="team-a", name="nb-old")
"""A pod on old-0, deleted after its node (the pod garbage collector's way)."""
MINUTE_S = 60.0


def _covering(settings: Settings) -> list[str]:
    """Names of small nodes that stay, one on each node partition: each partition's samples
    then move on, as a fleet's many nodes do."""
    partitions = list(range(settings.kafka.node_partitions))
    names: dict[int, str] = {}
    for i in range(1000):
        name = f"keep-{i}"
        names.setdefault(kafka.node_partitioner(name.encode(), partitions, partitions), name)
        if len(names) == len(partitions):
            return sorted(names.values())
    raise AssertionError("no names cover the partitions")


def _fleet_page(node: str, ts: float, dbe: bool = False) -> NodeSample:
    """A node's page: 4 GPUs (1 on the ``keep-`` nodes), a double-bit ECC error on the
    first GPU of old-1 and keep-0 (one finding each), or where ``dbe`` says."""
    gpus = 1 if node.startswith("keep-") else 4
    dbe = dbe or node in ("old-1", "keep-0")
    return NodeSample(ts=ts, node=node, source="dcgm", devices=[
        DeviceSample(uuid=f"GPU-{node}-{i}", index=i, model=MODEL, util_pct=50.0, temp_c=40.0,
                     mem_total_bytes=80 << 30,
                     ecc_dbe_volatile=int(i == 0 and dbe))
        for i in range(gpus)])


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_deleted_nodes_leave_the_worker_state_after_a_grace_and_a_restart_keeps_them_gone(
        settings: Settings, tmp_path: Path) -> None:
    """An autoscaler replaces four nodes under new names. Once each partition's samples are
    ``forget_deleted_s`` (1 h) past a deletion, the deleted node's state leaves the worker's
    table: its changelog's live keys are the live nodes only, a restarted worker recovers
    none of them (and removes, once its grace passes, a node deleted before the restart),
    and a node created again under a deleted name starts afresh. Nothing is lost on the
    way: the deleted nodes' findings resolved at the deletion, a late sample read after it
    is folded into its minute and judged by no rule, and every minute a deleted node sent
    samples for has its rollup rows, its last ones included (they were never emitted
    before: no later sample of the node closed them).

    Before, every deleted node stayed in the table and on the changelog for good."""
    clock = _Clock()
    keep = _covering(settings)
    changelog = topics.changelog(settings, "node-state")
    spot_changelog = topics.changelog(settings, "fleet-spot")
    grace = RuleSettings().forget_deleted_s
    assert FleetSettings().spot_forget_deleted_s == grace
    phases: dict[str, float] = {}
    paged: dict[str, set[float]] = {}

    async def main() -> tuple[dict[str, NodeState], dict[str, NodeState], list[Finding],
                              list[Rollup], set[str], set[str]]:
        nodes = [gpu_node(n, gpus=1) for n in keep] + [gpu_node(n, gpus=4) for n in REPLACED]
        async with _deployed(settings, tmp_path, nodes, clock) as deployed:
            api, publisher, caught_up = deployed.api, deployed.publisher, deployed.caught_up
            api.create(gpu_pod(NB_ON_OLD.name, NB_ON_OLD.namespace, node="old-0",
                               resources={"nvidia.com/gpu": "4"}, uid="uid-nb-old",
                               phase="Running", created=rfc3339(clock.now)))
            await caught_up()

            async def send(node: str, ts: float, dbe: bool = False) -> None:
                await publisher.sample(_fleet_page(node, ts, dbe))
                paged.setdefault(node, set()).add(ts - ts % MINUTE_S)

            async def relabel(touch: str) -> None:
                """A label put on each node that stays: an allocation record on each
                partition (the spot agent's records: its sweep moves on with them)."""
                for node in keep:
                    api.update(gpu_node(node, gpus=1, labels={"touched": touch}))
                await caught_up()

            async def pages(names: list[str], steps: int) -> None:
                for _ in range(steps):
                    for node in names:
                        await send(node, clock.now)
                    clock.now += MINUTE_S
                await caught_up()

            await pages([*keep, *REPLACED], 5)
            phases["deleted"] = deleted = clock.now
            for node in REPLACED:
                api.delete("Node", node)
            api.delete("Pod", NB_ON_OLD.name, NB_ON_OLD.namespace)  # its node is gone
            for node in REPLACEMENTS:
                api.create(gpu_node(node, gpus=4))
            await caught_up()
            # old-2's last page, read after its deletion, in the minute of its page before,
            # with a double-bit ECC error: a deleted node's sample is judged by no rule.
            await send("old-2", deleted - 30, dbe=True)
            await pages([*keep, *REPLACEMENTS], 40)
            phases["new-3 deleted"] = clock.now
            api.delete("Node", "new-3")
            await caught_up()
            await pages([*keep, *REPLACEMENTS[:3]], 23)  # deleted + 63 min: past the grace
            assert clock.now - MINUTE_S >= deleted + grace
            await relabel("1")
            phases["re-added"] = clock.now
            api.create(gpu_node("old-0", gpus=4))
            await caught_up()
            await pages([*keep, *REPLACEMENTS[:3], "old-0"], 3)
            before_restart = live_states(await kafka.read_all(settings, changelog), NodeState)
            spot_before = set(live_states(await kafka.read_all(settings, spot_changelog),
                                          spot_rules.SpotNodeTrack))

            deployed.restart_worker()
            await pages([*keep, *REPLACEMENTS[:3], "old-0"], 40)
            assert clock.now - MINUTE_S >= phases["new-3 deleted"] + grace
            await relabel("2")
            after = live_states(await kafka.read_all(settings, changelog), NodeState)
            spot_after = set(live_states(await kafka.read_all(settings, spot_changelog),
                                         spot_rules.SpotNodeTrack))

        async def read(spec: topics.TopicSpec, kind: Any) -> list[Any]:
            records = await kafka.read_all(settings, spec.name(settings))
            return [msgspec.json.decode(r.value or b"", type=kind) for r in records]

        return before_restart, after, await read(topics.FINDINGS, Finding), \
            await read(topics.ROLLUPS, Rollup), spot_before, spot_after

    before_restart, after, findings, rollups, spot_before, spot_after = asyncio.run(main())
    deleted, re_added = phases["deleted"], phases["re-added"]
    live = {*keep, *REPLACEMENTS[:3], "old-0"}
    # The table holds the live nodes, and new-3 only while its deletion is within the grace.
    assert set(before_restart) == live | {"new-3"}, sorted(before_restart)
    assert before_restart["new-3"].deleted
    # The restarted worker brought none back, and removed new-3 once its grace had passed.
    assert set(after) == live, sorted(after)
    # old-0, created again under its name, started afresh: none of its old pod, devices of
    # its own, its old minutes gone (emitted when it was removed).
    fresh = after["old-0"]
    assert not fresh.deleted and fresh.deleted_at is None and not fresh.pods, fresh.pods
    assert set(fresh.devices) == {f"GPU-old-0-{i}" for i in range(4)}
    assert all(minute >= re_added - MINUTE_S for minute in fresh.rollups.minutes)
    # The spot agent's tracks the same way (driven by its partitions' allocation records).
    assert spot_before == live | {"new-3"}, sorted(spot_before)
    assert spot_after == live, sorted(spot_after)

    # Findings: old-1's resolved at its deletion, keep-0's still open, none of old-2's late
    # page (a deleted node's sample is judged by no rule), none of old-0 created again.
    about = {node: [(f.kind, f.state, f.ts) for f in findings if f.subject.node == node]
             for node in ("old-1", "keep-0", "old-2", "old-0")}
    assert [(k, s) for k, s, _ in about["old-1"]] == [("ecc_dbe", "firing"),
                                                      ("ecc_dbe", "resolved")], about
    assert about["old-1"][1][2] == deleted
    assert [(k, s) for k, s, _ in about["keep-0"]] == [("ecc_dbe", "firing")], about
    assert about["old-2"] == [] and about["old-0"] == [], about

    # Rollups: every minute each node sent samples for has a row per GPU, the replaced
    # nodes' last minutes included; old-2's late page counted in its minute.
    for node in (*REPLACED, "new-3"):
        rows = [r for r in rollups if r.node == node and r.ts < re_added]
        paged[node] = {minute for minute in paged[node] if minute < re_added}
        by_device: dict[str, set[float]] = {}
        for row in rows:
            by_device.setdefault(row.uuid, set()).add(row.ts)
        assert by_device == {f"GPU-{node}-{i}": paged[node] for i in range(4)}, (
            node, sorted(paged[node] - by_device.get(f"GPU-{node}-0", set())))
    last_of_old_2 = [r for r in rollups if r.node == "old-2" and r.ts == deleted - MINUTE_S]
    assert {r.samples for r in last_of_old_2} == {2}, last_of_old_2
