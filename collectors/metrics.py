"""A collector's own Prometheus metrics: what it sent, held back, dropped, failed to read.

Each collector process gets one :class:`CollectorMetrics` with its own
``CollectorRegistry`` (never the global one), so tests build as many as they
like and a process serves only its own series on ``/metrics``. The Kubernetes
watcher publishes through the same publisher, so its :class:`WatcherMetrics`
is the collector set (delivery, buffer, failures) plus its own families, on
one registry.

The registry also carries the process's own ``process_*`` series (resident
memory, CPU seconds, open files: prometheus-client's ``ProcessCollector``),
which the fleet dashboard draws for the collectors. The acknowledged-records
counter of each topic the process publishes to exists at 0 from the start,
so that a collector that never delivers has a series that says so
(``GpustewardCollectorSilent``) and ``rate()`` counts its first deliveries.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from gpusteward import topics


class CollectorMetrics:
    """The counters and gauges of one collector process."""

    PUBLISHES: tuple[topics.TopicSpec, ...] = (topics.SAMPLES,)
    """The topics whose acknowledged-records series starts at 0 (a collector sends hardware
    events too, but only when there are some)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.records_sent = Counter(
            "gpusteward_collect_records_sent_total",
            "Records the broker acknowledged, by topic (without the topic prefix).",
            ["topic"], registry=self.registry,
        )
        for spec in self.PUBLISHES:
            self.records_sent.labels(spec.suffix)
        self.records_buffered = Counter(
            "gpusteward_collect_records_buffered_total",
            "Records held back because a delivery attempt failed (counted once each).",
            ["topic"], registry=self.registry,
        )
        self.records_dropped = Counter(
            "gpusteward_collect_records_dropped_total",
            "Records dropped, oldest first, because the buffer was full.",
            ["topic"], registry=self.registry,
        )
        self.delivery_failures = Counter(
            "gpusteward_collect_delivery_failures_total",
            "Delivery attempts (flights) that failed or timed out.",
            registry=self.registry,
        )
        self.topics_lost = Counter(
            "gpusteward_collect_topics_lost_total",
            "Times the broker was found to have lost acknowledged records: a topic gone, or a "
            "partition's offsets starting again (a broker that came back empty).",
            registry=self.registry,
        )
        self.records_resent = Counter(
            "gpusteward_collect_records_resent_total",
            "Acknowledged records sent again because the broker lost them, by topic.",
            ["topic"], registry=self.registry,
        )
        self.source_errors = Counter(
            "gpusteward_collect_source_errors_total",
            "Reads of a source that failed, by source and reason (for NVML: the call or step "
            "that failed; 'not supported' is no error).",
            ["source", "reason"], registry=self.registry,
        )
        self.missing_field_families = Counter(
            "gpusteward_collect_missing_field_families_total",
            "Source answers that lacked every metric of a field family some rule reads "
            "(e.g. ECC counters switched off in dcgm-exporter), by source and family.",
            ["source", "family"], registry=self.registry,
        )
        self.samples = Counter(
            "gpusteward_collect_samples_total",
            "Node samples handed to the publisher, by source.",
            ["source"], registry=self.registry,
        )
        self.device_readings = Counter(
            "gpusteward_collect_device_readings_total",
            "Device (GPU and MIG) readings in those samples, by source.",
            ["source"], registry=self.registry,
        )
        self.hw_events = Counter(
            "gpusteward_collect_hw_events_total",
            "Hardware events handed to the publisher, by source and kind.",
            ["source", "kind"], registry=self.registry,
        )
        self.scrape_seconds = Histogram(
            "gpusteward_collect_scrape_duration_seconds",
            "Time to read and parse one source answer (NVML: every device once).",
            ["source"], registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.buffer_records = Gauge(
            "gpusteward_collect_buffer_records",
            "Records waiting for delivery.", registry=self.registry,
        )
        self.buffer_bytes = Gauge(
            "gpusteward_collect_buffer_bytes",
            "Bytes of records waiting for delivery.", registry=self.registry,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> WSGIServer:
        """Serve ``/metrics`` on ``addr:port`` from a background thread; returns the server.

        Call ``shutdown()`` on the returned server to stop it.
        """
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server


class WatcherMetrics(CollectorMetrics):
    """The Kubernetes watcher's families, beside the publisher's on the same registry.

    ``resource`` is a reflector's name: nodes, pods, localqueues, workloads, or a gang
    resource's ``plural.group``; a resource not served (no CRD) has no series.
    """

    PUBLISHES = (topics.ALLOCATIONS, topics.QUEUE)

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.events_published = Counter(
            "gpusteward_watch_events_published_total",
            "Events handed to the publisher, by kind (pod_allocation, node_inventory, "
            "queue); what the broker acknowledged is gpusteward_collect_records_sent_total.",
            ["kind"], registry=self.registry,
        )
        self.lists = Counter(
            "gpusteward_watch_lists_total",
            "Full LISTs completed, by resource and reason (first: the start; resync: every "
            "resync period; gone: the resourceVersion expired, 410).",
            ["resource", "reason"], registry=self.registry,
        )
        self.watches = Counter(
            "gpusteward_watch_requests_total",
            "Watch requests (re)started, by resource: one per watch timeout when all is "
            "well, more when streams break.",
            ["resource"], registry=self.registry,
        )
        self.errors = Counter(
            "gpusteward_watch_errors_total",
            "Failed list or watch requests, by resource and reason (gone for a 410, "
            "http_<status> for another API status, else the error type); each is retried "
            "with back-off.",
            ["resource", "reason"], registry=self.registry,
        )
        self.last_event = Gauge(
            "gpusteward_watch_last_event_timestamp_seconds",
            "Unix time the API server was last heard from, by resource: a completed LIST or "
            "a watch event, bookmarks included. A healthy watch hears at least once per "
            "resync period.",
            ["resource"], registry=self.registry,
        )
        self.dra_pods = Counter(
            "gpusteward_watch_dra_pods_total",
            "Pods with a Dynamic Resource Allocation claim the watcher cannot resolve to "
            "GPUs (ResourceClaims not served, a device in no ResourceSlice or without a "
            "uuid, a claim shared with another pod), by namespace, each counted once; a log "
            "line names each pod and why.",
            ["namespace"], registry=self.registry,
        )
        self.backlog = Gauge(
            "gpusteward_watch_backlog_deltas",
            "Object changes the reflectors delivered and the watcher has not yet published: "
            "growing means it is not keeping up.",
            registry=self.registry,
        )
        self.readback_failures = Counter(
            "gpusteward_watch_readback_failures_total",
            "Read-backs of the watcher's own topics at start that failed, by reason (the "
            "error's type: TimeoutError past readback_timeout_s, TooManyKeys past "
            "readback_max_keys). The watcher carries on without it: objects deleted while "
            "no watcher ran are not reported gone.",
            ["reason"], registry=self.registry,
        )
        self.readback_objects = Gauge(
            "gpusteward_watch_readback_objects",
            "Live objects (pods, nodes, workloads) the read-back at start found on the "
            "watcher's topics; -1 until it has, and when it failed.",
            registry=self.registry,
        )
        self.readback_objects.set(-1)
        self.readback_seconds = Gauge(
            "gpusteward_watch_readback_seconds",
            "How long the read-back at start took, seconds.",
            registry=self.registry,
        )
        self.found_gone = Counter(
            "gpusteward_watch_found_gone_total",
            "Objects the watcher's topics held live and its first list did not have (deleted "
            "while no watcher ran), reported gone at start, by resource.",
            ["resource"], registry=self.registry,
        )
