"""A fleet record that breaks part-way is rolled back to the whole records before it.

The fleet agent snapshots its state (about 120 KB on a 10,000-GPU fleet's queue) once
per write, not after every queue event; a record that fails after changing the live
state is undone by rebuilding the state from the last snapshot and folding the records
since then again. Here a real worker process (``fleet_record_breaks.py``) gets three
admissions and, among them, one whose rule breaks after applying it, all in one batch:
the written fleet state holds the three and not the broken one, the earlier two were
folded a second time onto the snapshot, and the broken one is a dead letter. A refused
queue record, which changes nothing but the offset read, still reaches the changelog.
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

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.children import die_with_parent, stop_child
from gpusteward.sandbox.pipeline import WorkerProcess, settings_env
from gpusteward.schema import DeadLetter, QueueEvent
from gpusteward.settings import Settings
from gpusteward.streams.app import worker_group
from gpusteward.streams.fleet import FleetState
from tests.streams import fleet_record_breaks

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

    changelog = f"{worker_group(settings)}-fleet-state-changelog"
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
    written = asyncio.run(kafka.read_all(settings, f"{group}-fleet-state-changelog"))
    assert written, (tmp_path / "worker.log").read_text()
    state = msgspec.msgpack.decode(written[-1].value, type=FleetState)
    assert state.queue_offset == 1 and set(state.queue.waiting) == {"ml/a"}
