"""A node's samples and hardware events wait for its allocations, the fleet's summaries for
the queue (``streams/app.py``, the consumer's ``_getmany``).

A worker started on a backlog of the embedded broker read hours of a node's samples before
the allocations that name their pods (the broker fills a fetch response from one
partition and starved the allocations' for several fetches): measured with a 200-node,
two-hour world published before the worker started, 6 of 11 runs applied allocations up
to 5,250 s of event time behind their node's samples, and exempt pods were told idle.
With the wait, 0 of 10.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP

from gpusteward import kafka, topics
from gpusteward.settings import Settings
from gpusteward.streams.app import create_app


def _asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, active: set[TP],
           behind: set[TP]) -> set[TP] | None:
    """The partitions the worker's consumer fetches from when ``active`` are its active
    partitions and the records of ``behind`` are not all handed on."""
    app = create_app(Settings(), datadir=str(tmp_path))
    consumer: Any = app.consumer
    asked: list[set[TP] | None] = []

    class Thread:
        def _ensure_consumer(self) -> str:
            return "fetcher"

        async def getmany(self, partitions: set[TP] | None, timeout: float  # noqa: ASYNC109
                          ) -> dict[TP, list[Any]]:
            asked.append(partitions)
            return {}

    consumer._thread = Thread()
    monkeypatch.setattr(kafka, "handed_on", lambda fetcher, tp: tp not in behind)
    asyncio.run(consumer._getmany(active, 1.0))
    return asked[0]


def _tp(spec: topics.TopicSpec, partition: int) -> TP:
    return TP(spec.name(Settings()), partition)


def test_a_node_partition_waits_while_its_allocations_are_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = {_tp(topics.SAMPLES, p) for p in range(8)}
    hw = {_tp(topics.HW_EVENTS, p) for p in range(8)}
    allocations = {_tp(topics.ALLOCATIONS, p) for p in range(8)}
    fleet = {_tp(topics.NODE_SUMMARIES, 0), _tp(topics.QUEUE, 0)}
    active = samples | hw | allocations | fleet
    behind = {_tp(topics.ALLOCATIONS, 3), _tp(topics.QUEUE, 0)}
    assert _asked(tmp_path, monkeypatch, active, behind) == active - {
        _tp(topics.SAMPLES, 3), _tp(topics.HW_EVENTS, 3), _tp(topics.NODE_SUMMARIES, 0)}
    # Nothing behind: everything is fetched.
    assert _asked(tmp_path, monkeypatch, active, set()) == active


def test_a_partition_whose_lead_is_not_read_here_does_not_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused lead (table recovery, a full stream buffer) or one not assigned here would
    hold its followers for as long: they are read as before."""
    active = {_tp(topics.SAMPLES, 0), _tp(topics.NODE_SUMMARIES, 0)}
    behind = {_tp(topics.ALLOCATIONS, 0), _tp(topics.QUEUE, 0)}
    assert _asked(tmp_path, monkeypatch, active, behind) == active
