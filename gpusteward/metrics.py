"""The pipeline processes' own Prometheus metrics: one set of names, one way to serve them.

Every long-running process (worker, alerting, remediation, rollup sink)
builds a :class:`PipelineMetrics` on a registry of its own (never
prometheus-client's global one: tests build as many as they like and a
process serves only its own series) and serves it with :func:`serve`. The
names live here, once, so the dashboards, the alert rules and the test that
cross-checks them read one list; a process leaves the families it has no
use for empty (a labelled family with no children exports no sample).

:func:`serve` answers ``/metrics`` and any extra paths it is given
(``{"/healthz": handler}``), so liveness and readiness probes can share the
port. The collectors keep their own families (``collectors/metrics.py``)
and serve them the same way.

A consumer's lag is read by :func:`lag_followed`, a task of its own beside the consume
loop, from the group's committed offsets on the broker: a loop stuck on an HTTP call,
a dead Alertmanager or a wedged API server commits nothing, so its lag grows on
``/metrics`` instead of freezing at its last value. Besides records, the lag is kept as
a time (:class:`LagClock`), which means the same on a 10-node fleet as on 1,250 nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from gpusteward import kafka
from gpusteward.settings import Settings

log = logging.getLogger(__name__)

Handler = Callable[[], tuple[int, bytes]]
"""An extra path's answer: (HTTP status, plain-text body), computed per request."""

PROCESSING_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
"""Seconds; the node join takes tens of microseconds per record, a Kubernetes call or a
Parquet write up to seconds, so the buckets span both."""

LAG_INTERVAL_S = 15.0
"""Seconds between lag readings: the default scrape interval, so every scrape sees a fresh
one, and the resolution of the lag in seconds."""
LAG_HISTORY = 1000
"""End offsets remembered per partition while its group is behind: one per reading at
which the end moved, so at least 4 hours of readings; a group behind for longer reads as
behind since the oldest one kept (the lag in seconds is then a lower bound)."""


def new_registry() -> CollectorRegistry:
    """A registry of one process (``auto_describe`` so a duplicate name fails at once)."""
    return CollectorRegistry(auto_describe=True)


class PipelineMetrics:
    """The families every pipeline process may export, on ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self.records_in = Counter(
            "gpusteward_records_in_total", "Records consumed, by topic.", ["topic"], registry=r)
        self.records_out = Counter(
            "gpusteward_records_out_total", "Records produced, by topic.", ["topic"], registry=r)
        self.consumer_lag = Gauge(
            "gpusteward_consumer_lag_records",
            "Records the group has not committed yet, by group and topic (a group-wide "
            "reading: every replica of a group reports the whole group).",
            ["group", "topic"], registry=r)
        self.consumer_caught_up = Gauge(
            "gpusteward_consumer_caught_up_timestamp_seconds",
            "Unix time up to which the group has consumed the topic: the last lag reading at "
            "which no partition's end was past the group's commit now (the reading itself "
            "when nothing is pending). time() minus it is the lag in seconds; it stops "
            "moving when the group stops committing or its lag cannot be read.",
            ["group", "topic"], registry=r)
        self.processing = Histogram(
            "gpusteward_processing_seconds", "Time to handle one consumed record, by stage.",
            ["stage"], registry=r, buckets=PROCESSING_BUCKETS)
        self.dead_letters = Counter(
            "gpusteward_dead_letters_total",
            "Records sent to the dead-letter topic, by source topic and reason (error type).",
            ["topic", "reason"], registry=r)
        self.clock_steps = Counter(
            "gpusteward_clock_steps_total",
            "Times the node join took a node's new clock after its collector's clock stepped "
            "back (docs/reliability.md, Clocks); the worker's log names the node and step.",
            registry=r)
        self.rebalances = Counter(
            "gpusteward_rebalances_total", "Partition assignments this process received.",
            ["group"], registry=r)
        self.findings = Counter(
            "gpusteward_findings_total", "Findings seen, by kind, severity and state.",
            ["kind", "severity", "state"], registry=r)
        self.findings_open = Gauge(
            "gpusteward_findings_open", "Findings firing and not yet resolved, by kind and "
            "severity.", ["kind", "severity"], registry=r)
        self.actions = Counter(
            "gpusteward_actions_total", "Action decisions, by verb and outcome.",
            ["verb", "outcome"], registry=r)
        self.actions_stale = Counter(
            "gpusteward_actions_stale_total",
            "Actions the executor would have carried out but refused as stale (older than "
            "max_action_age_s, or that far ahead of its clock), by verb and rule: a "
            "remediation not done, whose fault may persist (a node action of a hardware "
            "finding is asked for again while the finding stays open). Each is on the audit "
            "topic with its target.", ["verb", "rule"], registry=r)
        self.actions_reasked = Counter(
            "gpusteward_actions_reasked_total",
            "Re-asks of a node action (the same idempotency key, asked for again while its "
            "finding stays open) that the executor decided as it last decided that key, by "
            "verb and outcome: not audited again, nor counted in gpusteward_actions_total.",
            ["verb", "outcome"], registry=r)
        self.breaker_open = Gauge(
            "gpusteward_breaker_open",
            "1 while a circuit of the remediation breaker (node actions, idle reclaims) is open.",
            ["group"], registry=r)
        self.breaker_circuit_open = Gauge(
            "gpusteward_breaker_circuit_open",
            "1 while the remediation breaker's circuit is open: nodes (cordons, taints, drains, "
            "MIG relabels refused) or reclaims (idle reclaims refused).",
            ["group", "circuit"], registry=r)
        self.sink_bytes = Counter(
            "gpusteward_sink_written_bytes_total", "Bytes of Parquet files the sink wrote, by "
            "topic.", ["topic"], registry=r)
        self.sink_rows = Counter(
            "gpusteward_sink_written_rows_total", "Rows the sink wrote, by topic.", ["topic"],
            registry=r)
        # GPU-seconds of device-minutes (rollups): rate() of these is a number of GPUs, so
        # the fleet dashboard draws allocated vs busy GPUs and idle GPU-hours from them.
        self.gpu_seconds = Counter(
            "gpusteward_gpu_seconds_total",
            "GPU-seconds seen in rollups, by pool (GPU model), team and state (allocated, "
            "busy, idle: allocated = busy + idle).", ["pool", "team", "state"], registry=r)
        self.idle_cost = Counter(
            "gpusteward_gpu_idle_cost_usd_total", "List-price cost of idle allocated GPU "
            "time, USD, by pool and team.", ["pool", "team"], registry=r)


class OpenFindings:
    """The ``findings_open`` gauge kept from a stream of findings.

    Idempotent on the id, and in event time: a record older than the newest seen for its
    id changes nothing (the worker has been seen to publish a ``resolved`` stamped before
    the ``firing`` it follows; ``gpusteward status`` folds the same way).
    """

    def __init__(self, metrics: PipelineMetrics) -> None:
        self.metrics = metrics
        self.open: dict[str, tuple[str, str]] = {}
        self.newest: dict[str, float] = {}

    def observe(self, finding_id: str, kind: str, severity: str, state: str,
                ts: float = 0.0) -> None:
        if ts < self.newest.get(finding_id, ts):
            return
        self.newest[finding_id] = ts
        before = self.open.pop(finding_id, None)
        if before is not None:
            self.metrics.findings_open.labels(*before).dec()
        if state == "firing":
            self.open[finding_id] = (kind, severity)
            self.metrics.findings_open.labels(kind, severity).inc()

    def forget_before(self, ts: float) -> None:
        """Forget the closed findings last heard of before ``ts``: records older than the
        topic's retention are never read again, so their ids need no memory (one entry per
        finding ever seen kept a long-running process growing)."""
        self.newest = {fid: seen for fid, seen in self.newest.items()
                       if seen >= ts or fid in self.open}


class LagClock:
    """Turns a group's successive offset readings into its lag in records and in time.

    A reading at time ``t`` found each partition's end at ``e``; once the group's commit
    is at ``e`` or past it, the group has consumed everything written before ``t``. So the
    time the group is caught up to is the last reading whose end is at or below the commit
    now, with the resolution of the readings; a group behind since before the first
    reading is caught up to at most that reading's time. Pure: the caller reads the
    offsets and the clock.
    """

    def __init__(self, history: int = LAG_HISTORY) -> None:
        self.history = history
        self._ends: dict[Hashable, deque[list[float]]] = {}
        """Per partition: [first seen, last seen, end offset] for each end seen, oldest first."""

    def caught_up_at(self, partition: Hashable, end: int, committed: int, now: float) -> float:
        """The time up to which ``committed`` has consumed ``partition``, given its ``end`` now."""
        seen = self._ends.get(partition)
        if committed >= end or seen is None or end < seen[-1][2]:
            # Caught up, the first reading, or an end moved back (a topic made again).
            self._ends[partition] = deque([[now, now, end]], maxlen=self.history)
            return now
        if seen[-1][2] == end:
            seen[-1][1] = now
        else:
            seen.append([now, now, end])
        while len(seen) > 1 and seen[1][2] <= committed:
            seen.popleft()
        first_seen, last_seen, oldest_end = seen[0]
        return last_seen if oldest_end <= committed else first_seen

    def observe(self, metrics: PipelineMetrics, group: str,
                offsets: Mapping[Any, tuple[int, int]], now: float) -> None:
        """Set both lag gauges of ``group`` from one reading: (end, committed) by partition
        (``TopicPartition``-like, with a ``topic``)."""
        records: dict[str, int] = {}
        caught_up: dict[str, float] = {}
        for tp, (end, committed) in offsets.items():
            records[tp.topic] = records.get(tp.topic, 0) + max(0, end - committed)
            at = self.caught_up_at(tp, end, committed, now)
            caught_up[tp.topic] = min(caught_up.get(tp.topic, at), at)
        for topic, count in records.items():
            metrics.consumer_lag.labels(group, topic).set(count)
            metrics.consumer_caught_up.labels(group, topic).set(caught_up[topic])


OffsetReader = Callable[[], Awaitable[Mapping[Any, tuple[int, int]]]]
"""Reads (end, committed) by partition: a :class:`gpusteward.kafka.GroupOffsets` (its
clients kept open between readings), or a test's double."""


async def follow_lag(metrics: PipelineMetrics, group: str, read: OffsetReader,
                     interval_s: float = LAG_INTERVAL_S,
                     clock: Callable[[], float] = time.time) -> None:
    """Read ``group``'s offsets every ``interval_s`` and set its lag gauges, until cancelled.

    A failed reading is logged and changes nothing: the caught-up time stays where it was,
    so a lag that cannot be read alerts like a lag that grows.
    """
    lag = LagClock()
    while True:
        try:
            offsets = await read()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a lag reading must never stop the consumer
            log.warning("cannot read the lag of %s: %s", group, error)
        else:
            lag.observe(metrics, group, offsets, clock())
        await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def lag_followed(metrics: PipelineMetrics, settings: Settings, group: str,
                       topic_names: Iterable[str]) -> AsyncIterator[None]:
    """:func:`follow_lag` for ``group`` on ``topic_names`` while the block runs, beside it.

    Nothing is read when no metrics port is set: no one could scrape the gauges.
    """
    if not settings.metrics.port:
        yield
        return
    async with kafka.GroupOffsets(settings, group, topic_names) as read:
        task = asyncio.create_task(follow_lag(metrics, group, read, LAG_INTERVAL_S))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def observe_many(histogram: Any, value: float, count: int) -> None:
    """What ``count`` calls of ``histogram.observe(value)`` record, in one step.

    prometheus-client observes one value per call (a bucket search and two locked
    increments, about 0.6 µs); the node join times a batch of records by its mean and
    would pay that once per record. This adds to the sum and to the one bucket as those
    calls would, through the client's own value objects (``_sum``, ``_upper_bounds`` and
    ``_buckets`` of a histogram child, unchanged since prometheus-client 0.4).
    """
    histogram._sum.inc(value * count)
    for bound, bucket in zip(histogram._upper_bounds, histogram._buckets, strict=True):
        if value <= bound:
            bucket.inc(count)
            return


def metric_names(registries: Iterable[CollectorRegistry]) -> set[str]:
    """Every series name the registries can export (``_total``, ``_bucket`` … included)."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every 15 s would fill the log; errors still reach the scraper."""


@dataclass
class MetricsServer:
    """A running ``/metrics`` server; :meth:`stop` shuts it down and frees the port."""

    server: ThreadingWSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0",
          extra: Mapping[str, Handler] | None = None) -> MetricsServer:
    """Serve ``registry`` on ``/metrics`` (and ``extra`` paths) from a daemon thread.

    ``port`` 0 picks a free port (read it from the result). An extra path's
    handler runs on the server thread for each request and must not block long.
    """
    metrics_app = make_wsgi_app(registry)
    paths = dict(extra or {})

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        handler = paths.get(environ.get("PATH_INFO", ""))
        if handler is None:
            return metrics_app(environ, start_response)
        status, body = handler()
        reason = "OK" if status < 400 else "Service Unavailable" if status == 503 else "Error"
        start_response(f"{status} {reason}", [("Content-Type", "text/plain; charset=utf-8"),
                                              ("Content-Length", str(len(body)))])
        return [body]

    server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="gpusteward-metrics",
                              daemon=True)
    thread.start()
    return MetricsServer(server, thread)
