"""The fleet state written in parts: what a recovery reads back after any crash.

The fleet agent's changelog is one partition, and a recovery reads a prefix of it (a worker
killed mid-write, or the embedded broker's high watermark trailing its last batch). Each
prefix of the writes of a checkpoint must give back the state before it or the one it
writes, never a mix, and never a record over the limit.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from gpusteward.streams.fleet import in_parts, joined

KEY = b"fleet"


def _apply(table: dict[bytes, bytes], writes: list[tuple[bytes, bytes | None]]) -> None:
    for key, value in writes:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def _read(table: dict[bytes, bytes]) -> bytes | None:
    return joined(KEY, table.get(KEY), table.get)


def test_every_prefix_of_a_checkpoint_reads_as_the_state_before_or_after_it() -> None:
    rng = random.Random(11)
    limit = 64
    table: dict[bytes, bytes] = {}
    before: bytes | None = None
    for _ in range(300):
        # States around the limit: whole, in two parts, in many; and back again.
        value = rng.randbytes(rng.choice((0, 10, 63, 64, 65, 128, 129, 700, 2_000)))
        writes = in_parts(KEY, value, list(table), limit)
        assert all(v is None or len(v) <= limit for _, v in writes)
        for cut in range(len(writes) + 1):
            crashed = dict(table)
            _apply(crashed, writes[:cut])
            assert _read(crashed) in (before, value)
        _apply(table, writes)
        assert _read(table) == value
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
