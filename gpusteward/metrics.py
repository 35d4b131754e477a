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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

Handler = Callable[[], tuple[int, bytes]]
"""An extra path's answer: (HTTP status, plain-text body), computed per request."""

PROCESSING_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
"""Seconds; the node join takes tens of microseconds per record, a Kubernetes call or a
Parquet write up to seconds, so the buckets span both."""


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
            "Records between the group's position and the partition end, by group and topic.",
            ["group", "topic"], registry=r)
        self.processing = Histogram(
            "gpusteward_processing_seconds", "Time to handle one consumed record, by stage.",
            ["stage"], registry=r, buckets=PROCESSING_BUCKETS)
        self.dead_letters = Counter(
            "gpusteward_dead_letters_total",
            "Records sent to the dead-letter topic, by source topic and reason (error type).",
            ["topic", "reason"], registry=r)
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
        self.breaker_open = Gauge(
            "gpusteward_breaker_open", "1 while the remediation circuit breaker is open.",
            ["group"], registry=r)
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


async def observe_lag(metrics: PipelineMetrics, consumer: Any, group: str) -> None:
    """Set the lag gauge from an aiokafka consumer's own view (no request to the broker).

    ``highwater`` is what the last fetch reported; a partition not fetched yet is skipped.
    """
    by_topic: dict[str, int] = {}
    for tp in consumer.assignment():
        end = consumer.highwater(tp)
        if end is None:
            continue
        position = await consumer.position(tp)
        by_topic[tp.topic] = by_topic.get(tp.topic, 0) + max(0, end - position)
    for topic, lag in by_topic.items():
        metrics.consumer_lag.labels(group, topic).set(lag)


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
