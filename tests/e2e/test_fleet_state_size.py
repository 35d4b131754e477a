"""The fleet agent's state at a 10,000-GPU cluster's queue, on the embedded broker.

The fleet agent checkpoints its state (the queue, every rule's tracks) to a changelog. Its
size grows with the workloads the queue follows, and at about 7,000 running GPU pods it
passed the largest record a producer sends by default (1,000,000 bytes, under Kafka's
``message.max.bytes``): the producer refused it and the worker stopped, and every worker
of the group that took the partition over stopped the same way. Now the state is written
in chunks (``streams/stored.py``), and one admission writes the few that change, not the
whole state, a megabyte per queue event until 2026-11-28. These drive a real worker through
such a queue, kill it, and check that the next one resumes with the whole queue.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import queue as queue_rules
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.schema import Finding, PodRef, QueueEvent
from gpusteward.settings import Settings
from gpusteward.streams.fleet import FleetState
from gpusteward.streams.stored import joined
from gpusteward.topics import worker_group

pytestmark = pytest.mark.e2e

RUNNING = 9_000
"""Running GPU pods: a 10,000-GPU cluster of mostly 1-GPU pods."""


def _pod(name: str, state: str, ts: float, created: float, queue: str = "research",
         gpus: int = 1) -> QueueEvent:
    return QueueEvent(ts=ts, name=name, namespace="ml",
                      cluster_queue=queue, state=state,  # type: ignore[arg-type]
                      created_at=created, admitted_at=ts if state == "admitted" else None,
                      gpus=gpus, kind="pod")


async def _publish(settings: Settings, events: list[QueueEvent]) -> None:
    publisher = KafkaPublisher(settings)
    await publisher.start()
    try:
        for event in events:
            await publisher.queue(event)
        await publisher.flush()
    finally:
        await publisher.stop()


async def _consumed(settings: Settings, worker: WorkerProcess) -> None:
    try:
        await kafka.wait_consumed(settings, worker_group(settings),
                                  [topics.QUEUE.name(settings)], timeout_s=90)
    finally:
        assert worker.alive, f"the worker stopped; its log is {worker.log_path}"


async def _stored_state(settings: Settings) -> tuple[FleetState, list[bytes | None], int]:
    """The fleet state as a recovery reads it from the changelog, the changelog's values in
    order, and the chunks the state is in."""
    table: dict[bytes, bytes | None] = {}
    records = await kafka.read_all(
        settings, topics.changelog(settings, "fleet-state"))
    for record in records:
        table[record.key] = record.value
    value = joined(b"fleet", table.get(b"fleet"), table.get)
    assert value is not None
    chunks = sum(1 for k, v in table.items() if k.startswith(b"fleet/c/") and v is not None)
    return (msgspec.msgpack.decode(value, type=FleetState), [r.value for r in records],
            chunks)


def test_a_queue_of_9000_running_pods_neither_stops_the_worker_nor_is_lost_on_restart(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    settings = broker.settings().model_copy(update={"topic_prefix": "e2e-big-queue"})
    t0 = time.time() - 3 * 3600
    rng = random.Random(5)
    # One production pod waits from the start: its 10-minute SLO is passed only after the
    # restart, so its finding needs the queue the first worker checkpointed.
    late = _pod("serving-late", "pending", t0, t0, queue="prod-serving")
    events = [late]
    for i in range(RUNNING):
        created = t0 + 1 + i * 300 / RUNNING
        gpus = rng.choice((1, 1, 1, 2, 4, 8))
        events += [_pod(f"train-{i}", "pending", created, created, gpus=gpus),
                   _pod(f"train-{i}", "admitted", created + 2, created, gpus=gpus)]

    async def run() -> list[Finding]:
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        try:
            await asyncio.to_thread(worker.wait_ready)
            await _publish(settings, events)
            await _consumed(settings, worker)
            state, values, chunks = await _stored_state(settings)
            assert max(len(v or b"") for v in values) <= settings.kafka.max_message_bytes
            assert chunks >= 2, "the state was written whole: the test no longer shows chunks"
            assert len(state.queue.last_event) == RUNNING + 1
            assert list(state.queue.waiting) == ["ml/serving-late"]
            # One more admission: a checkpoint or two of what changed, not the whole state.
            whole = len(msgspec.msgpack.encode(state))
            await _publish(settings, [_pod("one-more", "pending", t0 + 400, t0 + 400),
                                      _pod("one-more", "admitted", t0 + 402, t0 + 400)])
            await _consumed(settings, worker)
            state, after_one, _ = await _stored_state(settings)
            assert "ml/one-more" in state.queue.last_event
            written = sum(len(v or b"") for v in after_one[len(values):])
            assert 0 < written < whole / 10, (written, whole)
            worker.kill()
            worker.start()
            await asyncio.to_thread(worker.wait_ready)
            # Event time moves on past the waiting pod's SLO (and 9,000 pods end).
            after = t0 + 900
            await _publish(settings, [_pod(f"train-{i}", "finished", after + i * 0.01,
                                           t0 + 1, gpus=1) for i in range(RUNNING)])
            await _consumed(settings, worker)
        finally:
            worker.stop()
        decode = msgspec.json.Decoder(Finding).decode
        return [decode(r.value) for r in
                await kafka.read_all(settings, topics.FINDINGS.name(settings))]

    findings = asyncio.run(run())
    waits = [f for f in findings if f.kind == queue_rules.WAIT_KIND and f.state == "firing"]
    assert [(f.subject.queue, f.subject.pod) for f in waits] == [
        ("prod-serving", PodRef(namespace="ml", name="serving-late"))], waits
