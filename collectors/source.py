"""The tick loop shared by the sources that read samples from elsewhere (dcgm, Prometheus).

A source answers one question per tick, ``collect()``: the NodeSamples and
hardware events it sees now, or a :class:`SourceError`. The loop owns the
schedule, the error accounting and the publishing, so a source stays a
small, testable reader.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.errors import TemporaryError
from gpusteward.schema import HwEvent, NodeSample

log = logging.getLogger(__name__)


class SourceError(TemporaryError):
    """A read of a source that produced nothing publishable this tick.

    ``reason`` is a short stable word (unreachable, http_status, truncated,
    parse, empty) used as the ``reason`` label of the source-error counter.
    Every such error is temporary: the next tick tries again.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Source(Protocol):
    """A reader the loop calls once per tick."""

    source: str
    """Its name in NodeSample.source and in metric labels."""

    async def collect(self) -> tuple[list[NodeSample], list[HwEvent]]: ...


async def run_source(source: Source, publisher: Publisher, stop: asyncio.Event,
                     interval_s: float, metrics: CollectorMetrics | None = None) -> None:
    """Collect from ``source`` every ``interval_s`` until ``stop`` is set.

    A failed read is logged, counted and retried at the next tick. Ticks keep
    a fixed schedule: a slow read delays the next tick, it does not shift all
    the following ones. Hardware events go out before the sample of the same
    tick: they are the urgent path.
    """
    loop = asyncio.get_running_loop()
    next_tick = loop.time()
    failing = False
    while not stop.is_set():
        started = loop.time()
        try:
            samples, events = await source.collect()
        except SourceError as error:
            if metrics is not None:
                metrics.source_errors.labels(source.source, error.reason).inc()
            # One warning when a source starts failing, then debug lines, so a dead
            # exporter does not flood the log at every tick.
            log.log(logging.DEBUG if failing else logging.WARNING,
                    "%s read failed (%s): %s; retrying next tick",
                    source.source, error.reason, error)
            failing = True
        else:
            if failing:
                log.warning("%s read works again", source.source)
            failing = False
            if metrics is not None:
                metrics.scrape_seconds.labels(source.source).observe(loop.time() - started)
            for event in events:
                await publisher.hw_event(event)
            for sample in samples:
                await publisher.sample(sample)
        next_tick = max(next_tick + interval_s, loop.time())
        try:
            await asyncio.wait_for(stop.wait(), timeout=next_tick - loop.time())
        except TimeoutError:
            pass
