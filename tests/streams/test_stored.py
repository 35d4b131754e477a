"""The fleet state written in chunks and parts: what a recovery reads back after any crash,
and what one queue event costs the changelog.

The fleet agent's changelog is one partition, and a recovery reads a prefix of it (a worker
killed mid-write, or the embedded broker's high watermark trailing its last batch). Each
prefix of the writes of a checkpoint must give back the state before it or the one it
writes, never a mix, and never a record over the limit.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from gpusteward.schema import QueueEvent
from gpusteward.streams.fleet import FleetEvaluator, FleetState
from gpusteward.streams.stored import in_chunks, in_parts, joined

KEY = b"fleet"


def _apply(table: dict[bytes, bytes], writes: list[tuple[bytes, bytes | None]]) -> None:
    for key, value in writes:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def _read(table: dict[bytes, bytes]) -> bytes | None:
    return joined(KEY, table.get(KEY), table.get)


def _checkpoint(table: dict[bytes, bytes], writes: list[tuple[bytes, bytes | None]],
                limit: int, before: bytes | None, value: bytes) -> None:
    """Apply a checkpoint's ``writes`` to ``table``, having read it back cut at every point:
    the state ``before`` it or its ``value``, and no record over ``limit``."""
    assert all(v is None or len(v) <= limit for _, v in writes)
    for cut in range(len(writes) + 1):
        crashed = dict(table)
        _apply(crashed, writes[:cut])
        assert _read(crashed) in (before, value)
    _apply(table, writes)
    assert _read(table) == value


def test_every_prefix_of_a_checkpoint_reads_as_the_state_before_or_after_it() -> None:
    rng = random.Random(11)
    limit = 64
    table: dict[bytes, bytes] = {}
    before: bytes | None = None
    for _ in range(300):
        # States around the limit: whole, in two parts, in many; and back again.
        value = rng.randbytes(rng.choice((0, 10, 63, 64, 65, 128, 129, 700, 2_000)))
        _checkpoint(table, in_parts(KEY, value, list(table), limit), limit, before, value)
        # Nothing of earlier checkpoints stays: the head and its parts only.
        parts = -(-len(value) // limit) if len(value) > limit else 0
        assert len(table) == 1 + parts
        before = value


def test_a_state_that_fits_is_written_as_before() -> None:
    """An earlier build reads the state as it always did while it fits one record."""
    assert in_parts(KEY, b"\x81\xa1a\x01", [KEY], 100) == [(KEY, b"\x81\xa1a\x01")]


def test_parts_left_by_a_crash_before_their_head_are_deleted_by_the_next_checkpoint() -> None:
    table: dict[bytes, bytes] = {}
    _apply(table, in_parts(KEY, b"a" * 300, [], 100))
    orphans = in_parts(KEY, b"b" * 300, list(table), 100)[:2]  # killed before the head
    _apply(table, orphans)
    assert _read(table) == b"a" * 300
    _apply(table, in_parts(KEY, b"c" * 50, list(table), 100))
    assert table == {KEY: b"c" * 50}


def test_a_missing_part_is_an_error_not_a_shorter_state() -> None:
    table: dict[bytes, bytes] = {}
    _apply(table, in_parts(KEY, bytes(range(250)), [], 100))
    del table[sorted(k for k in table if k != KEY)[1]]
    with pytest.raises(msgspec.DecodeError, match=r"3 parts.*1 of them missing"):
        _read(table)


def _fleet(running: int) -> tuple[FleetEvaluator, FleetState]:
    """A fleet state following ``running`` admitted 1-GPU pods of eight queues."""
    evaluator, state = FleetEvaluator(), FleetState()
    for i in range(running):
        _admit(evaluator, state, i)
    return evaluator, state


def _admit(evaluator: FleetEvaluator, state: FleetState, i: int) -> None:
    t = 1_763_683_200.0 + i
    for event in ("pending", "admitted"):
        evaluator.on_queue(state, QueueEvent(
            ts=t + (event == "admitted"), name=f"job-{i:05d}", namespace="ml",
            cluster_queue=f"research-{i % 8}", state=event,
            created_at=t, admitted_at=t + 1 if event == "admitted" else None, gpus=1,
            kind="pod"), queue_caught_up=True)


def _stored(table: dict[bytes, bytes], value: object, limit: int = 500_000
            ) -> list[tuple[bytes, bytes | None]]:
    writes = in_chunks(KEY, value, list(table), limit)
    _apply(table, writes)
    return writes


def test_a_fleet_state_in_chunks_reads_back_byte_for_byte() -> None:
    _, state = _fleet(3_000)
    value = msgspec.msgpack.encode(state)
    table: dict[bytes, bytes] = {}
    writes = _stored(table, state)
    assert len(writes) > 10  # in chunks, not whole
    assert _read(table) == value  # the maps in their order too


def test_one_admission_writes_a_few_chunks_not_the_whole_state() -> None:
    """At 9,000 running pods the state is about 1 MB; an admission rewrote all of it."""
    evaluator, state = _fleet(9_000)
    table: dict[bytes, bytes] = {}
    _stored(table, state)
    _admit(evaluator, state, 9_000)
    value = msgspec.msgpack.encode(state)
    writes = _stored(table, state)
    written = sum(len(v or b"") for _, v in writes)
    assert written < len(value) / 4, (written, len(value))
    assert sum(1 for k, v in writes if v is not None and k.startswith(KEY + b"/c/")) <= 12
    assert _read(table) == value


def test_every_prefix_of_a_chunked_checkpoint_reads_as_the_state_before_or_after_it() -> None:
    rng = random.Random(5)
    limit = 2_000
    jobs: dict[str, list[float]] = {f"ns/job-{i}": [float(i), 1.0] for i in range(3_000)}
    admissions: list[tuple[float, float]] = [(float(i), 2.0) for i in range(1_000)]
    table: dict[bytes, bytes] = {}
    before: bytes | None = None
    serial = 3_000
    for _ in range(60):
        for _ in range(rng.randrange(1, 6)):  # a batch's queue events
            change = rng.random()
            if change < 0.4:
                jobs[f"ns/job-{serial}"] = [float(serial), 1.0]
                serial += 1
            elif change < 0.7 and jobs:
                del jobs[rng.choice(list(jobs))]
            else:
                jobs[rng.choice(list(jobs))][1] += 1.0
            admissions = [*admissions[rng.randrange(3):], (float(serial), rng.random())]
        state = {"queue": {"jobs": jobs, "clock": serial}, "admissions": admissions,
                 "small": [1, 2]}
        value = msgspec.msgpack.encode(state)
        _checkpoint(table, in_chunks(KEY, state, list(table), limit), limit, before, value)
        before = value


def test_a_state_that_shrinks_leaves_no_chunk_behind() -> None:
    _, state = _fleet(2_000)
    table: dict[bytes, bytes] = {}
    _stored(table, state)
    _stored(table, FleetState())
    assert table == {KEY: msgspec.msgpack.encode(FleetState())}


def test_a_missing_chunk_is_an_error_not_a_shorter_queue() -> None:
    _, state = _fleet(2_000)
    table: dict[bytes, bytes] = {}
    _stored(table, state)
    del table[sorted(k for k in table if k.startswith(KEY + b"/c/"))[3]]
    with pytest.raises(msgspec.DecodeError, match=r"chunks, 1 of them missing"):
        _read(table)


def test_a_state_the_previous_release_wrote_in_parts_is_read_and_its_parts_go() -> None:
    _, state = _fleet(3_000)
    old = msgspec.msgpack.encode(state)
    table: dict[bytes, bytes] = {}
    _apply(table, in_parts(KEY, old, [], 100_000))  # how releases before 2026-11-28 wrote it
    assert any(k.startswith(KEY + b"/1/") for k in table)
    assert _read(table) == old
    _stored(table, state, limit=100_000)
    assert not any(k.startswith(KEY + b"/1/") for k in table)
    assert _read(table) == old
