"""The tick loop shared by every sample source (NVML, dcgm-exporter, Prometheus).

A source answers one question per tick, ``collect()``: the NodeSamples and
hardware events it sees now, or a :class:`SourceError`. The loop owns the
schedule, the error accounting, the metrics and the publishing, so a source
stays a small, testable reader. A source with news that cannot wait for the
tick (NVML's event thread) publishes that itself, beside the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
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


async def collect_once(source: Source, publisher: Publisher,
                       metrics: CollectorMetrics | None = None
                       ) -> tuple[list[NodeSample], list[HwEvent]]:
    """One tick: read ``source`` and publish what it saw; returns it.

    Hardware events go out before the sample of the same tick: they are the
    urgent path. A :class:`SourceError` from the read is raised unpublished.
    """
    started = time.perf_counter()
    samples, events = await source.collect()
    if metrics is not None:
        metrics.scrape_seconds.labels(source.source).observe(time.perf_counter() - started)
    for event in events:
        await publisher.hw_event(event)
        if metrics is not None:
            metrics.hw_events.labels(source.source, event.kind).inc()
    for sample in samples:
        await publisher.sample(sample)
        if metrics is not None:
            metrics.samples.labels(source.source).inc()
            metrics.device_readings.labels(source.source).inc(len(sample.devices))
    return samples, events


async def run_source(source: Source, publisher: Publisher, stop: asyncio.Event,
                     interval_s: float, metrics: CollectorMetrics | None = None) -> None:
    """Collect from ``source`` every ``interval_s`` until ``stop`` is set.

    A failed read is logged, counted and retried at the next tick; so is a
    tick that failed otherwise (a publisher hiccup, a driver error outside
    any one device): a DaemonSet collector outlives a bad tick. Ticks keep a
    fixed schedule: a slow read delays the next tick, it does not shift all
    the following ones.
    """
    loop = asyncio.get_running_loop()
    next_tick = loop.time()
    failing = False
    while not stop.is_set():
        try:
            await collect_once(source, publisher, metrics)
        except SourceError as error:
            if metrics is not None:
                metrics.source_errors.labels(source.source, error.reason).inc()
            # One warning when a source starts failing, then debug lines, so a dead
            # exporter does not flood the log at every tick.
            log.log(logging.DEBUG if failing else logging.WARNING,
                    "%s read failed (%s): %s; retrying next tick",
                    source.source, error.reason, error)
            failing = True
        except Exception:
            log.exception("%s tick failed; retrying next tick", source.source)
            if metrics is not None:
                metrics.source_errors.labels(source.source, "tick").inc()
        else:
            if failing:
                log.warning("%s read works again", source.source)
            failing = False
        next_tick = max(next_tick + interval_s, loop.time())
        try:
            await asyncio.wait_for(stop.wait(), timeout=next_tick - loop.time())
        except TimeoutError:
            pass
