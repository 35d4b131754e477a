"""Prometheus as a sample source, for clusters that already scrape dcgm-exporter.

One collector per cluster (not per node) asks Prometheus for the DCGM
series this project reads, in one instant query per tick, and maps them
with the same code as the direct scrape (:func:`dcgm.node_samples`): one
NodeSample per node, optionally only for the nodes in ``prometheus_nodes``.

The node is the record key the watcher's allocations join on, so it must be
the Kubernetes node name. dcgm-exporter's ``Hostname`` is that only when the
exporter has ``NODE_NAME`` set (from ``spec.nodeName``) or host networking;
otherwise it is the exporter pod's own host name, its pod name, and samples
keyed by it would join nothing. So a label that a scrape relabelled from
``__meta_kubernetes_pod_node_name`` (``node``, or the one ``node_label``
names) wins over ``Hostname``, and a ``Hostname`` that is the scraped pod's
name is refused, loudly, rather than published (:func:`node_resolver`).

Pod labels are the trap here. dcgm-exporter writes ``pod``/``namespace``/
``container``; a scrape with ``honorLabels: false`` (the default of its Helm
chart and of the GPU Operator's ServiceMonitor) renames them
``exported_pod``/... because the target's own ``pod`` label (the exporter's
pod) takes the name. A GPU that no pod uses then carries only the target's
``pod``: read naively, the exporter pod would own every idle GPU. See
:func:`pod_resolver` for how each ``pod_labels`` setting decides.

An HA pair behind one Service answers each query from either replica, and
the replicas scrape at their own phases: read in turn, their answers move a
gauge or counter back and forth. Each node's readings are therefore taken
once per scrape and in scrape order (:class:`NewestScrapes`), by the scrape
times the same query asks for.

prometheus-api-client is synchronous (requests); its calls run in a worker
thread so the event loop keeps publishing.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec
import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from gpusteward import edge
from gpusteward.collectors import dcgm
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.settings import CollectSettings
from gpusteward.collectors.source import SourceError, run_source
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.schema import HwEvent, NodeSample, PodRef

PodLabels = Literal["auto", "exported", "plain"]

EXPORTED = (
    ("exported_pod", "exported_namespace", "exported_container"),
    ("exported_pod_name", "exported_pod_namespace", "exported_container_name"),
)
OLD = (("pod_name", "pod_namespace", "container_name"),)
"""``--use-old-namespace`` names: no target label collides with them, so they arrive as-is."""
PLAIN = (("pod", "namespace", "container"),)


def pod_resolver(series: Sequence[dcgm.Series], mode: PodLabels) -> dcgm.PodResolver:
    """How to read a series' pod for this query result.

    - ``exported``: only exported_* (and the old names);
    - ``plain``: what dcgm-exporter wrote (honorLabels: true), unless the pod's
      name says it is a dcgm-exporter: honorLabels keeps the exporter's labels
      where it wrote them, but a series without them (a GPU no pod holds)
      still gets the target's own ``pod``/``namespace``/``container``;
    - ``auto``: exported_* when present; else the plain labels, unless they
      name a scrape target's own pod: a pod seen as ``pod`` next to an
      ``exported_pod`` in the same result, or one whose name says it is a
      dcgm-exporter. An idle node where no series has exported_* yet is
      the case the second rule covers.
    """
    if mode == "exported":
        return lambda labels: dcgm.pod_of(labels, EXPORTED + OLD)
    if mode == "plain":
        def resolve_plain(labels: Mapping[str, str]) -> PodRef | None:
            pod = dcgm.pod_of(labels, PLAIN + OLD)
            return None if pod is None or _is_exporter(pod) else pod

        return resolve_plain
    targets = {
        (labels.get("namespace"), labels.get("pod"))
        for labels in (item.labels for item in series)
        if "pod" in labels and ("exported_pod" in labels or "exported_namespace" in labels)
    }

    def resolve(labels: Mapping[str, str]) -> PodRef | None:
        pod = dcgm.pod_of(labels, EXPORTED + OLD)
        if pod is not None or "exported_pod" in labels:
            return pod
        pod = dcgm.pod_of(labels, PLAIN)
        if pod is None or (pod.namespace, pod.name) in targets or _is_exporter(pod):
            return None
        return pod

    return resolve


NODE_LABELS = ("node",)
"""Labels a scrape sets from ``__meta_kubernetes_pod_node_name`` (the prometheus-community
chart's kubernetes-pods job writes ``node``), trusted before ``Hostname`` when no
``node_label`` is configured."""


def node_resolver(series: Sequence[dcgm.Series], node_label: str | None = None,
                  refusals: edge.Refusals | None = None) -> dcgm.NodeResolver:
    """How to read a series' Kubernetes node name for this query result.

    ``node_label`` set: that label, nothing else (a series without it names no node).
    Otherwise a :data:`NODE_LABELS` label where the series has one, else dcgm-exporter's
    ``Hostname``/``hostname``, unless that is the host name of the scraped exporter pod: a
    ``Hostname`` equal to a series' target ``pod`` label (every series with ``honorLabels:
    false``, those of unheld GPUs with ``honorLabels: true``), or one that reads like a
    dcgm-exporter pod's name. Its series are then skipped, each refusal counted in
    ``refusals`` and the first logged, naming the remedies.
    """
    if node_label:
        return lambda labels: labels.get(node_label) or None
    pod_hostnames = {name for name in (dcgm.node_of(item.labels) for item in series
                                       if item.labels.get("pod") == dcgm.node_of(item.labels)
                                       or "dcgm-exporter" in (dcgm.node_of(item.labels) or ""))
                     if name}

    def resolve(labels: Mapping[str, str]) -> str | None:
        for name in NODE_LABELS:
            if labels.get(name):
                return labels[name]
        hostname = dcgm.node_of(labels)
        if hostname in pod_hostnames:
            if refusals is not None:
                refusals.note(
                    "hostname_is_pod", "skipping the series of Hostname %r: it is the "
                    "dcgm-exporter pod's host name, not a Kubernetes node name. Set NODE_NAME "
                    "on dcgm-exporter (fieldRef spec.nodeName), or relabel "
                    "__meta_kubernetes_pod_node_name into a label and name it in "
                    "PROMETHEUS_NODE_LABEL", hostname)
            return None
        return hostname

    return resolve


def _is_exporter(pod: PodRef) -> bool:
    """A scrape target's own pod: dcgm-exporter's, by the name every install gives it."""
    return "dcgm-exporter" in pod.name


def _promql_regex_alternatives(values: Iterable[str]) -> str:
    # re.escape gives an RE2-compatible pattern; PromQL string literals need the
    # backslashes doubled.
    return "|".join(re.escape(value) for value in values).replace("\\", "\\\\")


SCRAPED_AT = "gpusteward_scraped_at_seconds"
"""The name the query gives ``timestamp(DCGM_FI_DEV_XID_ERRORS)``: when Prometheus scraped each
device's page, which tells a replica's older answer from news (:class:`NewestScrapes`)."""
SCRAPED_LABEL = "gpusteward_scraped"
"""A label only those series carry: ``or`` matches label sets without the metric name, and
would drop them as copies of the XID gauges."""


def build_query(nodes: Sequence[str] = (), node_label: str | None = None) -> str:
    """The one instant query per tick: every mapped DCGM metric, for ``nodes`` or all, and the
    time each device's XID gauge was scraped (:data:`SCRAPED_AT`: ``timestamp()`` drops the
    metric name, ``label_replace`` gives it one so the series cannot pass for a reading)."""
    names = "|".join(dcgm.MAPPED_METRICS)
    if not nodes:
        matchers = [""]
    else:
        wanted = _promql_regex_alternatives(nodes)
        # Without a configured label the node is in a relabelled one or in Hostname, spelt
        # Hostname or hostname depending on the exporter release.
        labels = (node_label,) if node_label else (*NODE_LABELS, "Hostname", "hostname")
        matchers = [f',{label}=~"{wanted}"' for label in labels]
    readings = [f'{{__name__=~"{names}"{matcher}}}' for matcher in matchers]
    scraped = [f'label_replace(label_replace(timestamp({{__name__="{dcgm.XID_FIELD}"{matcher}}}), '
               f'"__name__", "{SCRAPED_AT}", "", ""), "{SCRAPED_LABEL}", "1", "", "")'
               for matcher in matchers]
    return " or ".join(readings + scraped)


class NewestScrapes:
    """Per node, the newest scrape the collector has published; anything older is no news.

    Behind a Service over an HA pair each query reaches either replica, and the replicas
    scrape dcgm-exporter at their own phases: for part of every scrape interval after a
    change one answers with the new page and the other with the old one. Read in turn,
    an XID gauge goes 0, 46, 0, 46 (each 46 a new XID), a DBE counter 1, 0, 1 (an episode
    closed as a GPU reset and opened again, a second cordon). Prometheus scrapes every
    series of a page at one instant, so a node's scrape time orders the answers of both
    replicas as the exporter's own pages were ordered: a node whose scrape is not newer
    than the last one published (the lagging replica, or the same scrape read again at an
    interval shorter than the scrape interval) is left out of the tick. One float per node;
    it needs no setting for the replicas' lag and no knowledge of which replica answered.
    """

    def __init__(self) -> None:
        self._newest: dict[str, float] = {}

    def news(self, node: str, scraped_at: float) -> bool:
        """Whether a scrape of ``node`` at ``scraped_at`` is newer than any published."""
        if scraped_at <= self._newest.get(node, float("-inf")):
            return False
        self._newest[node] = scraped_at
        return True


def newest_xids(xids: Iterable[dcgm.Series], scraped: Mapping[frozenset[tuple[str, str]], float],
                node_of: dcgm.NodeResolver
                ) -> dict[str, tuple[float | None, list[dcgm.Series]]]:
    """Per node, its newest scrape time (None when the answer has none) and the XID gauges
    of that scrape.

    A device read twice in one answer (two scrape jobs of one exporter, or a querier that
    does not deduplicate replicas) keeps its newest copy: applied in turn, an old copy's 0
    after a new copy's code would make the code news again at every tick.
    """
    newest: dict[tuple[str, tuple[str, str | None]], tuple[float | None, dcgm.Series]] = {}
    for item in xids:
        at = scraped.get(frozenset(item.labels.items()))
        node, ident = node_of(item.labels), dcgm.device_id(item.labels)
        if node is None or ident is None:
            continue
        held = newest.get((node, ident))
        if held is None or (at is not None and (held[0] is None or at > held[0])):
            newest[(node, ident)] = (at, item)
    nodes: dict[str, tuple[float | None, list[dcgm.Series]]] = {}
    for (node, _), (at, item) in newest.items():
        latest, items = nodes.get(node, (None, []))
        nodes[node] = (at if latest is None else latest if at is None else max(latest, at),
                       [*items, item])
    return nodes


def series_of(result: list[dict[str, Any]], refusals: edge.Refusals | None = None
              ) -> tuple[list[dcgm.Series], float | None]:
    """Series from an instant-vector result, and the evaluation time.

    An item that is no sample (no name, no [time, value] pair, a value that is no number)
    is skipped and counted in ``refusals``: one broken series must not cost the tick.
    """
    series: list[dcgm.Series] = []
    evaluated_at: float | None = None
    for item in result:
        try:
            labels = dict(item["metric"])
            timestamp, value = item["value"]
            item_ts = float(timestamp)
            series.append(dcgm.Series(str(labels.pop("__name__")), labels, float(value)))
        except (KeyError, TypeError, ValueError) as error:
            if refusals is None:
                raise
            refusals.note(type(error).__name__, "skipping a result item that is no sample: %s",
                          edge.reason(error))
            continue
        evaluated_at = item_ts
    return series, evaluated_at


class PrometheusSource:
    """The DCGM series of a cluster, read from its Prometheus once per tick."""

    source = "prometheus"

    def __init__(self, url: str, nodes: Sequence[str] = (), pod_labels: PodLabels = "auto",
                 timeout_s: float = 5.0, client: PrometheusConnect | None = None,
                 metrics: CollectorMetrics | None = None, node_label: str | None = None,
                 ) -> None:
        self.url = url
        self.nodes = tuple(nodes)
        self.pod_labels = pod_labels
        self.node_label = node_label
        self.timeout_s = timeout_s
        # One quick retry: the loop itself retries at the next tick.
        self._client = client or PrometheusConnect(
            url, disable_ssl=True, retry=Retry(total=1, backoff_factor=0.1))
        self._query = build_query(self.nodes, node_label)
        self._xids = dcgm.XidTracker()
        self._scrapes = NewestScrapes()
        self._lost = dcgm.LostGpus(self.source)
        # Judged over the whole answer: a family any node reports is switched on in the
        # exporters' counters file.
        self.coverage = dcgm.FieldCoverage(self.source, metrics)
        self.refusals = edge.Refusals(dcgm.log)
        """Series skipped as unreadable, by metric."""

    async def _ask(self) -> list[dict[str, Any]]:
        try:
            return await asyncio.to_thread(self._client.custom_query, self._query,
                                           timeout=self.timeout_s)
        except PrometheusApiClientException as error:
            raise SourceError("http_status", f"{self.url}: {str(error)[:dcgm.BODY_EXCERPT]}"
                              ) from error
        except requests.RequestException as error:
            raise SourceError("unreachable", f"{self.url} unreachable: {error}") from error
        except ValueError as error:  # a body that is not JSON
            raise SourceError("parse", f"{self.url}: not a query answer: {error}") from error

    async def collect(self) -> tuple[list[NodeSample], list[HwEvent]]:
        result = await self._ask()
        try:
            answer, evaluated_at = series_of(result, self.refusals)
        except (KeyError, TypeError, ValueError) as error:
            raise SourceError("parse", f"{self.url}: unexpected result shape: {error!r}"
                              ) from error
        series = [item for item in answer if item.name != SCRAPED_AT]
        if not series or evaluated_at is None:
            scope = f" for nodes {', '.join(self.nodes)}" if self.nodes else ""
            raise SourceError("empty", f"{self.url} has no DCGM series{scope}")
        node_of = node_resolver(series, self.node_label, self.refusals)
        samples = dcgm.node_samples(series, evaluated_at, self.source,
                                    pod_resolver=pod_resolver(series, self.pod_labels),
                                    refusals=self.refusals, node_resolver=node_of)
        if not samples:
            how = (f"label {self.node_label!r}" if self.node_label
                   else f"label {' or '.join(NODE_LABELS)}, or a Hostname that is no pod's")
            raise SourceError("parse", f"{self.url}: no DCGM series names its Kubernetes node "
                              f"(by {how}); see PROMETHEUS_NODE_LABEL in docs/collectors.md")
        self.coverage.check(item.name for item in series)
        scraped = {frozenset((label, value) for label, value in item.labels.items()
                             if label != SCRAPED_LABEL): item.value
                   for item in answer if item.name == SCRAPED_AT}
        xids = newest_xids((item for item in series if item.name == dcgm.XID_FIELD), scraped,
                           node_of)
        nodes: list[NodeSample] = []
        events: list[HwEvent] = []
        for name in sorted(samples):
            scraped_at, node_xids = xids.get(name, (None, []))
            if scraped_at is not None and not self._scrapes.news(name, scraped_at):
                continue
            # Stamped with the scrape, the time of the reading; a node without a scrape time
            # (no XID gauge in its exporter's counters) with the evaluation, every tick.
            at = evaluated_at if scraped_at is None else scraped_at
            sample = msgspec.structs.replace(samples[name], ts=at)
            nodes.append(sample)
            events += self._xids.events(node_xids, at, self.source, node=name)
            events += self._lost.events([sample], at)
        return nodes, events


async def run_prometheus_collector(settings: CollectSettings, publisher: Publisher,
                                   stop: asyncio.Event,
                                   metrics: CollectorMetrics | None = None) -> None:
    """Query Prometheus every ``settings.interval_s`` until ``stop``."""
    source = PrometheusSource(settings.prometheus_url, settings.prometheus_nodes,
                              settings.pod_labels, settings.scrape_timeout_s, metrics=metrics,
                              node_label=settings.prometheus_node_label)
    await run_source(source, publisher, stop, settings.interval_s, metrics)
