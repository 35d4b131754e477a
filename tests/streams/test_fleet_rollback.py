"""A fleet record that breaks part-way is rolled back to the whole records before it.

The fleet agent snapshots its state (about 120 KB on a 10,000-GPU fleet's queue) once
per write, not after every queue event; a record that fails after changing the live
state is undone by rebuilding the state from the last snapshot and folding the records
since then again. Here a real worker process (``fleet_record_breaks.py``) gets three
admissions and, among them, one whose rule breaks after applying it, all in one batch:
the written fleet state holds the three and not the broken one, the earlier two were
folded a second time onto the snapshot, and the broken one is a dead letter. A refused
queue record, which changes nothing but the offset read, still reaches the changelog.

The other rollback: changelogs holding states another release wrote (read after a
rollback of the worker) or corrupt ones, preloaded before a real worker starts. What of
a state decodes on its own is kept, the open findings of its kept parts resolve under
their ids, and garbage still starts afresh.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.children import die_with_parent, stop_child
from gpusteward.sandbox.pipeline import WorkerProcess, settings_env
from gpusteward.schema import DeadLetter, Finding, NodeSample, NodeSummary, QueueEvent
from gpusteward.settings import Settings
from gpusteward.streams.fleet import FleetEvaluator, FleetState
from gpusteward.streams.node import NodeState
from gpusteward.topics import worker_group
from tests.streams import fleet_record_breaks
from tests.streams.test_node_states import OLD_STATES, scenario_sample

pytestmark = pytest.mark.e2e

T0 = 1_700_000_000.0
SCRIPT = Path(fleet_record_breaks.__file__)


def _pending(name: str, offset_s: float) -> QueueEvent:
    return QueueEvent(ts=T0 + offset_s, name=name, namespace="ml", cluster_queue="prod",
                      state="pending", created_at=T0 + offset_s, gpus=1)


async def _publish(settings: Settings, events: list[QueueEvent]) -> None:
    producer = kafka.producer(settings)
    await producer.start()
    try:
        for event in events:
            await producer.send(topics.QUEUE.name(settings), msgspec.json.encode(event),
                                key=b"prod")
        await producer.flush()
    finally:
        await producer.stop()


async def _preload(settings: Settings, changelog: list[tuple[str, bytes, bytes]],
                   samples: list[NodeSample]) -> None:
    """Write ``changelog`` records (topic, key, value) as an earlier worker left them, the
    topics made as the worker makes its changelogs (compacted; the node states with the node
    topics' partitions), then ``samples`` on the samples topic."""
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
    await admin.start()
    try:
        await admin.create_topics([
            NewTopic(name, settings.kafka.node_partitions
                     if name.endswith("-node-state-changelog") else 1,
                     settings.kafka.replication_factor,
                     topic_configs={"cleanup.policy": "compact"})
            for name in sorted({topic for topic, _, _ in changelog})])
    finally:
        await admin.close()
    producer = kafka.producer(settings)
    await producer.start()
    try:
        for topic, key, value in changelog:
            await producer.send(topic, value, key=key)
        for sample in samples:
            await producer.send(topics.SAMPLES.name(settings), msgspec.json.encode(sample),
                                key=sample.node.encode())
        await producer.flush()
    finally:
        await producer.stop()


def test_a_fleet_record_that_breaks_half_way_is_rolled_back_and_nothing_else_is(
        settings: Settings, tmp_path: Path) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    names = ["a", "b", fleet_record_breaks.POISON, "c"]
    asyncio.run(_publish(settings, [_pending(name, i) for i, name in enumerate(names)]))
    folded_log = tmp_path / "folded"
    env = {**os.environ, **settings_env(settings.model_copy(update={"health_port": free_port()})),
           "FOLDED_LOG": str(folded_log)}
    with open(tmp_path / "worker.log", "ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-P", str(SCRIPT), "--datadir", tempfile.mkdtemp(),
             "--loglevel", "warn"], env=env, stdout=log, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2], start_new_session=True,
            preexec_fn=die_with_parent)
    try:
        asyncio.run(kafka.wait_consumed(settings, worker_group(settings),
                                        [topics.QUEUE.name(settings)], timeout_s=60))
    finally:
        stop_child(worker, 15.0)

    changelog = topics.changelog(settings, "fleet-state")
    written = asyncio.run(kafka.read_all(settings, changelog))
    assert written, (tmp_path / "worker.log").read_text()
    state = msgspec.msgpack.decode(written[-1].value, type=FleetState)
    assert set(state.queue.waiting) == {"ml/a", "ml/b", "ml/c"}
    # One batch: the two admissions before the broken one were folded again onto the
    # snapshot (none was staged yet), then the batch went on.
    assert folded_log.read_text().split() == ["a", "b", "poison", "a", "b", "c"]
    dead = [msgspec.json.decode(r.value, type=DeadLetter) for r in asyncio.run(
        kafka.read_all(settings, topics.DEADLETTER.name(settings)))]
    assert [(d.source_topic, d.offset) for d in dead] == [(topics.QUEUE.name(settings), 2)]
    assert "fleet" in dead[0].error and "a fleet rule broke half-way" in dead[0].error


def test_a_refused_queue_record_alone_in_its_batch_is_checkpointed_as_read(
        settings: Settings, tmp_path: Path) -> None:
    """A refused queue record counts as read (a malformed one at the queue's tail must not
    keep the queue "behind" for ever), so its offset must reach the changelog: alone in its
    batch it did not, and after a restart or a rebalance the queue read as behind until the
    next valid queue event, with node summaries no longer moving the fleet's clock."""
    asyncio.run(kafka.ensure_topics(settings))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    group, queue = worker_group(settings), [topics.QUEUE.name(settings)]
    worker.start()
    try:
        asyncio.run(_publish(settings, [_pending("a", 0)]))
        asyncio.run(kafka.wait_consumed(settings, group, queue, timeout_s=60))

        async def malformed() -> None:
            producer = kafka.producer(settings)
            await producer.start()
            try:
                await producer.send_and_wait(queue[0], b'{"not": "a queue event"}',
                                             key=b"prod")
            finally:
                await producer.stop()

        asyncio.run(malformed())
        asyncio.run(kafka.wait_consumed(settings, group, queue, timeout_s=60))
    finally:
        worker.stop()
    written = asyncio.run(kafka.read_all(settings, topics.changelog(settings, "fleet-state")))
    assert written, (tmp_path / "worker.log").read_text()
    state = msgspec.msgpack.decode(written[-1].value, type=FleetState)
    assert state.queue_offset == 1 and set(state.queue.waiting) == {"ml/a"}


def test_states_a_rollback_cannot_decode_are_dropped_and_the_worker_goes_on(
        settings: Settings, tmp_path: Path) -> None:
    """A rollback: the changelogs hold states a newer release wrote (here a node summary of
    schema 2 and states this build's types cannot read) beside one the old release wrote. The
    worker recovers, drops each undecodable state with a dead letter naming its changelog,
    and goes on: the queue event and the node's sample after them are applied, not
    dead-lettered. The undecodable states used to dead-letter every record of their key for
    ever: for the fleet state, every queue event and node summary."""
    asyncio.run(kafka.ensure_topics(settings))
    changelogs = {table: topics.changelog(settings, table)
                  for table in ("fleet-state", "fleet-nodes", "node-state")}
    newer_summary = msgspec.json.encode(NodeSummary(ts=T0, node="n2", gpu_model=None, gpus_total=8,
                                                    gpus_free=8, healthy=True))
    newer_summary = newer_summary.replace(b'"schema":1', b'"schema":2')
    preload = [
        (changelogs["fleet-state"], b"fleet", msgspec.msgpack.encode({"queue_offset": "x"})),
        (changelogs["fleet-nodes"], b"n2", newer_summary),
        (changelogs["fleet-nodes"], b"n3", msgspec.json.encode(NodeSummary(
            ts=T0, node="n3", gpu_model=None, gpus_total=8, gpus_free=8, healthy=True))),
        (changelogs["node-state"], b"n1", b"\xc1 not msgpack"),
    ]
    asyncio.run(_preload(settings, preload, [NodeSample(ts=T0, node="n1", source="t",
                                                        devices=[])]))
    asyncio.run(_publish(settings, [_pending("a", 0)]))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    worker.start()
    try:
        asyncio.run(kafka.wait_consumed(
            settings, worker_group(settings),
            [topics.QUEUE.name(settings), topics.SAMPLES.name(settings)], timeout_s=60))
    finally:
        worker.stop()
    log = (tmp_path / "worker.log").read_text()
    dead = [msgspec.json.decode(r.value, type=DeadLetter) for r in asyncio.run(
        kafka.read_all(settings, topics.DEADLETTER.name(settings)))]
    assert sorted((d.source_topic, d.key, d.offset) for d in dead) == sorted(
        (topic, key, -1) for topic, key, _ in preload if key != b"n3"), log
    assert all("undecodable state" in d.error for d in dead)
    assert "undecodable state of 'n1' dropped" in log
    fleet = asyncio.run(kafka.read_all(settings, changelogs["fleet-state"]))
    state = msgspec.msgpack.decode(fleet[-1].value, type=FleetState)
    assert set(state.queue.waiting) == {"ml/a"}
    nodes = {r.key: r.value for r in asyncio.run(
        kafka.read_all(settings, changelogs["fleet-nodes"]))}
    assert nodes[b"n2"] is None, "the undecodable summary is deleted"
    node = asyncio.run(kafka.read_all(settings, changelogs["node-state"]))
    assert msgspec.msgpack.decode(node[-1].value, type=NodeState).gpu_count == 0


def _run_worker(settings: Settings, tmp_path: Path, topic: topics.TopicSpec = topics.SAMPLES,
                timeout_s: float = 90) -> str:
    """Start the worker, wait until it has read every record of ``topic``, stop it: its log."""
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    worker.start()
    try:
        asyncio.run(kafka.wait_consumed(settings, worker_group(settings),
                                        [topic.name(settings)], timeout_s=timeout_s))
    finally:
        worker.stop()
    return (tmp_path / "worker.log").read_text()


def _dead_letters(settings: Settings) -> list[DeadLetter]:
    return [msgspec.json.decode(r.value, type=DeadLetter) for r in asyncio.run(
        kafka.read_all(settings, topics.DEADLETTER.name(settings)))]


def test_a_state_with_one_device_in_another_shape_keeps_the_other_devices_findings(
        settings: Settings, tmp_path: Path) -> None:
    """A rollback: node n1's state, as a release checkpointed it with both GPUs' idle findings
    open, except that GPU-1's idle track is in a shape this build does not know (a newer
    release's). The worker keeps what decodes: GPU-0's idle finding resolves under the id
    it fired with once the GPU is busy, and nothing fires again for GPU-0; only GPU-1's
    state is dropped, named in the warning and the dead letter, which keeps the bytes. The
    whole state used to be dropped, and GPU-0's finding stayed open for ever."""
    asyncio.run(kafka.ensure_topics(settings))
    recorded = msgspec.msgpack.decode((OLD_STATES / "node-state-2026-11-25.msgpack").read_bytes())
    fired_as = recorded["devices"]["GPU-0"]["idle"]["open_id"]
    assert fired_as, "the recorded state holds GPU-0's idle finding open"
    recorded["devices"]["GPU-1"]["idle"] = [recorded["devices"]["GPU-1"]["idle"]]
    stored = msgspec.msgpack.encode(recorded)
    changelog = topics.changelog(settings, "node-state")
    asyncio.run(_preload(settings, [(changelog, b"n1", stored)],
                         [scenario_sample(tick) for tick in range(500, 700)]))

    log = _run_worker(settings, tmp_path)

    findings = [msgspec.json.decode(r.value, type=Finding) for r in asyncio.run(
        kafka.read_all(settings, topics.FINDINGS.name(settings)))]
    assert [(f.kind, f.state, f.id) for f in findings if f.subject.device == "GPU-0"] == [
        ("idle_holder", "resolved", fired_as)], log
    dead = _dead_letters(settings)
    assert [(d.source_topic, d.key, d.offset, d.value) for d in dead] == [
        (changelog, b"n1", -1, stored)]
    assert "dropped in part: devices['GPU-1'], the rest kept" in dead[0].error
    assert "undecodable state of 'n1' dropped in part: devices['GPU-1']" in log
    written = asyncio.run(kafka.read_all(settings, changelog))
    state = msgspec.msgpack.decode(written[-1].value, type=NodeState)
    assert state.devices["GPU-0"].idle.open_id is None and list(state.pods) == ["uid-1"]


@pytest.mark.parametrize("garbage", [b"\xc1\x00\xff", msgspec.msgpack.encode(["not", "a", "map"]),
                                     msgspec.msgpack.encode({"devices": "v9", "pods": 7})])
def test_a_state_that_is_garbage_still_starts_afresh(
        settings: Settings, tmp_path: Path, garbage: bytes) -> None:
    """Bytes that are no msgpack, no map, or a map of which nothing decodes: nothing is
    taken from them; the node starts afresh as it always did, and the dead letter and the
    warning say so."""
    asyncio.run(kafka.ensure_topics(settings))
    changelog = topics.changelog(settings, "node-state")
    asyncio.run(_preload(settings, [(changelog, b"n1", garbage)],
                         [scenario_sample(tick) for tick in range(500, 510)]))

    log = _run_worker(settings, tmp_path)

    dead = _dead_letters(settings)
    assert [(d.source_topic, d.key, d.value) for d in dead] == [(changelog, b"n1", garbage)], log
    assert "dropped, it starts afresh" in dead[0].error
    assert "undecodable state of 'n1' dropped, it starts afresh" in log
    written = asyncio.run(kafka.read_all(settings, changelog))
    state = msgspec.msgpack.decode(written[-1].value, type=NodeState)
    assert state.pods == {} and state.devices["GPU-0"].idle.open_id is None


def test_a_fleet_state_with_one_field_in_another_shape_keeps_the_queue_s_open_findings(
        settings: Settings, tmp_path: Path) -> None:
    """A rollback: the fleet state holds workload ml/a's wait-time finding open, and its
    fragmentation track is in a shape this build does not know. The worker keeps the rest:
    ml/a's admission resolves the finding under the id it fired with; only the
    fragmentation track starts afresh, named in the dead letter. The whole fleet state used
    to be dropped, and the finding stayed open for ever."""
    evaluator, fleet = FleetEvaluator(), FleetState()
    evaluator.on_queue(fleet, _pending("a", 0))
    fired = [f for f in evaluator.on_queue(fleet, _pending("b", 900))  # past prod's SLO
             if isinstance(f, Finding)]
    assert [(f.kind, f.state, f.subject.pod and f.subject.pod.name) for f in fired] == [
        ("queue_wait_slo", "firing", "a")]
    recorded = msgspec.msgpack.decode(msgspec.msgpack.encode(fleet))
    recorded["fragmentation"] = [recorded["fragmentation"]]
    stored = msgspec.msgpack.encode(recorded)
    asyncio.run(kafka.ensure_topics(settings))
    changelog = topics.changelog(settings, "fleet-state")
    asyncio.run(_preload(settings, [(changelog, b"fleet", stored)], []))
    admitted = msgspec.structs.replace(_pending("a", 1000), state="admitted")
    asyncio.run(_publish(settings, [admitted]))

    log = _run_worker(settings, tmp_path, topics.QUEUE, timeout_s=60)

    findings = [msgspec.json.decode(r.value, type=Finding) for r in asyncio.run(
        kafka.read_all(settings, topics.FINDINGS.name(settings)))]
    assert [(f.kind, f.state, f.id) for f in findings] == [
        ("queue_wait_slo", "resolved", fired[0].id)], log
    dead = _dead_letters(settings)
    assert [(d.source_topic, d.key, d.value) for d in dead] == [(changelog, b"fleet", stored)]
    assert "dropped in part: fragmentation, the rest kept" in dead[0].error
    written = asyncio.run(kafka.read_all(settings, changelog))
    state = msgspec.msgpack.decode(written[-1].value, type=FleetState)
    assert set(state.queue.waiting) == {"ml/b"}
