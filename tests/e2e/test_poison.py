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
from collections import Counter

import pytest

from gpusteward.broker import EmbeddedBroker
from tests.e2e.poison import PoisonRun, run_beside_faulty_fleet
from tests.e2e.test_faulty_fleet import _expected, _key

pytestmark = pytest.mark.e2e

PER_VARIANT = 20
GARBAGE_PER_TOPIC = 2


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> PoisonRun:
    settings = broker.settings().model_copy(update={"topic_prefix": "e2e-poison"})
    # The valid run takes a few seconds at full speed: the poison is spread over them.
    return asyncio.run(run_beside_faulty_fleet(
        settings, tmp_path_factory.mktemp("poison"), PER_VARIANT,
        garbage_per_topic=GARBAGE_PER_TOPIC, spread_s=6.0))


def test_every_bad_record_is_dead_lettered_once_with_a_reason(run: PoisonRun) -> None:
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


def test_the_valid_traffic_finds_what_the_ground_truth_holds(run: PoisonRun) -> None:
    expected = _expected(run.truth)
    firing = [f for f in run.findings if f.state == "firing"]
    assert {_key(f) for f in firing} == set(expected), "no missed fault and no false one"
    ids: dict[tuple[str, str, str], set[str]] = {}
    for finding in firing:
        ids.setdefault(_key(finding), set()).add(finding.id)
    assert all(len(v) == 1 for v in ids.values()), ids
    by_finding = {a.finding_ids[0]: a.verb for a in run.actions}
    assert {_key(f): by_finding.get(f.id) for f in firing} == expected


def test_the_worker_is_not_behind_after_the_publishers_stop(run: PoisonRun) -> None:
    assert run.catch_up_s < 30, f"caught up {run.catch_up_s:.1f} s after the publishers stopped"
