"""Poison pills: every kind of malformed record on every input topic, beside a valid run.

The ``faulty-fleet`` scenario is published as in ``test_faulty_fleet.py``
while :mod:`tests.e2e.poison` sends each malformed variant (truncated JSON,
wrong types, huge integers, NaN and infinity, an absurd timestamp, empty
bytes, another schema's JSON, an unknown schema version, 5,000-deep nesting,
a non-UTF-8 key, 1 MB of garbage) to each of the worker's input topics,
keyed like the real traffic so that it lands in the partitions the worker
is busy with. Every bad record must reach the dead-letter topic exactly once
with a reason and its position, the findings of the valid traffic must be
those of the ground truth, and the worker must have consumed everything soon
after the publishers stop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import Action, DeadLetter, Finding
from gpusteward.streams.app import worker_group
from tests.e2e.poison import INPUT_TOPICS, PoisonSent, publish_poison
from tests.e2e.test_faulty_fleet import _expected, _key

pytestmark = pytest.mark.e2e

PER_VARIANT = 20
GARBAGE_PER_TOPIC = 2


@dataclass
class Run:
    truth: GroundTruth
    sent: PoisonSent
    dead: list[DeadLetter]
    findings: list[Finding]
    actions: list[Action]
    catch_up_s: float


async def _dead_letters(settings: object, expected: int, timeout_s: float = 20.0
                        ) -> list[DeadLetter]:
    """The dead-letter topic, read until it holds ``expected`` records or time is up."""
    decode = msgspec.json.Decoder(DeadLetter).decode
    deadline = time.monotonic() + timeout_s
    while True:
        dead = [decode(r.value) for r in await kafka.read_all(
            settings, topics.DEADLETTER.name(settings))]  # type: ignore[arg-type]
        if len(dead) >= expected or time.monotonic() > deadline:
            return dead
        await asyncio.sleep(0.5)


async def _run(broker: EmbeddedBroker, log_dir: Path) -> Run:
    settings = broker.settings().model_copy(update={"topic_prefix": "e2e-poison"})
    await kafka.ensure_topics(settings)
    spec = scenarios.load("faulty-fleet").model_copy(update={"acceleration": 0.0})
    cluster = SimulatedCluster(spec)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    worker = WorkerProcess(settings, log_dir / "worker.log")
    worker.start()
    try:
        # Poison starts first and is spread over the valid run, which takes a few seconds.
        poison = asyncio.create_task(publish_poison(
            settings, PER_VARIANT, garbage_per_topic=GARBAGE_PER_TOPIC, spread_s=6.0))
        truth = await cluster.run(publisher)
        sent = await poison
        stopped = time.monotonic()
        names = [t.name(settings) for t in INPUT_TOPICS]
        await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=60)
        catch_up_s = time.monotonic() - stopped
        assert worker.alive
    finally:
        worker.stop()
        await publisher.stop()
    findings = msgspec.json.Decoder(Finding).decode
    actions = msgspec.json.Decoder(Action).decode
    return Run(
        truth, sent, await _dead_letters(settings, sent.total),
        [findings(r.value) for r in await kafka.read_all(settings, topics.FINDINGS.name(settings))],
        [actions(r.value) for r in await kafka.read_all(settings, topics.ACTIONS.name(settings))],
        catch_up_s,
    )


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("poison")))


def test_every_bad_record_is_dead_lettered_once_with_a_reason(run: Run) -> None:
    assert run.sent.total == 5 * (11 * PER_VARIANT + GARBAGE_PER_TOPIC)
    assert Counter(d.source_topic for d in run.dead) == Counter(run.sent.by_topic)
    positions = {(d.source_topic, d.partition, d.offset) for d in run.dead}
    assert len(positions) == len(run.dead), "no record dead-lettered twice"
    assert all(d.error and d.offset >= 0 for d in run.dead)
    garbage = [d for d in run.dead if d.value_bytes == 1_000_000]
    assert len(garbage) == 5 * GARBAGE_PER_TOPIC
    assert all(d.truncated and d.value and len(d.value) < 1_000_000 for d in garbage)
    reasons = Counter(d.error.split(None, 1)[0] for d in run.dead)
    assert {"malformed:", "invalid:", "empty", "JSON", "key", "value"} <= set(reasons), reasons
    assert any("unknown schema version" in d.error for d in run.dead)


def test_the_valid_traffic_finds_what_the_ground_truth_holds(run: Run) -> None:
    expected = _expected(run.truth)
    firing = [f for f in run.findings if f.state == "firing"]
    assert {_key(f) for f in firing} == set(expected), "no missed fault and no false one"
    ids: dict[tuple[str, str, str], set[str]] = {}
    for finding in firing:
        ids.setdefault(_key(finding), set()).add(finding.id)
    assert all(len(v) == 1 for v in ids.values()), ids
    by_finding = {a.finding_ids[0]: a.verb for a in run.actions}
    assert {_key(f): by_finding.get(f.id) for f in firing} == expected


def test_the_worker_is_not_behind_after_the_publishers_stop(run: Run) -> None:
    assert run.catch_up_s < 30, f"caught up {run.catch_up_s:.1f} s after the publishers stopped"
