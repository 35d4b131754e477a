"""Prometheus as a sample source, for clusters that already scrape dcgm-exporter.

One collector per cluster (not per node) asks Prometheus for the DCGM
series this project reads, in one instant query per tick, and maps them
with the same code as the direct scrape (:func:`dcgm.node_samples`): one
NodeSample per node (dcgm-exporter's ``Hostname`` label), optionally only
for the nodes in ``prometheus_nodes``.

Pod labels are the trap here. dcgm-exporter writes ``pod``/``namespace``/
``container``; a scrape with ``honorLabels: false`` (the default of its Helm
chart and of the GPU Operator's ServiceMonitor) renames them
``exported_pod``/... because the target's own ``pod`` label (the exporter's
pod) takes the name. A GPU that no pod uses then carries only the target's
``pod``: read naively, the exporter pod would own every idle GPU. See
:func:`pod_resolver` for how each ``pod_labels`` setting decides.

prometheus-api-client is synchronous (requests); its calls run in a worker
thread so the event loop keeps publishing.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

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


def _is_exporter(pod: PodRef) -> bool:
    """A scrape target's own pod: dcgm-exporter's, by the name every install gives it."""
    return "dcgm-exporter" in pod.name


def _promql_regex_alternatives(values: Iterable[str]) -> str:
    # re.escape gives an RE2-compatible pattern; PromQL string literals need the
    # backslashes doubled.
    return "|".join(re.escape(value) for value in values).replace("\\", "\\\\")


def build_query(nodes: Sequence[str] = ()) -> str:
    """The one instant query per tick: every mapped DCGM metric, for ``nodes`` or all."""
    names = "|".join(dcgm.MAPPED_METRICS)
    if not nodes:
        return f'{{__name__=~"{names}"}}'
    wanted = _promql_regex_alternatives(nodes)
    # The node label is spelt Hostname or hostname depending on the exporter release.
    return " or ".join(f'{{__name__=~"{names}",{label}=~"{wanted}"}}'
                       for label in ("Hostname", "hostname"))


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
                 metrics: CollectorMetrics | None = None) -> None:
        self.url = url
        self.nodes = tuple(nodes)
        self.pod_labels = pod_labels
        self.timeout_s = timeout_s
        # One quick retry: the loop itself retries at the next tick.
        self._client = client or PrometheusConnect(
            url, disable_ssl=True, retry=Retry(total=1, backoff_factor=0.1))
        self._query = build_query(self.nodes)
        self._xids = dcgm.XidTracker()
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
            series, evaluated_at = series_of(result, self.refusals)
        except (KeyError, TypeError, ValueError) as error:
            raise SourceError("parse", f"{self.url}: unexpected result shape: {error!r}"
                              ) from error
        if not series or evaluated_at is None:
            scope = f" for nodes {', '.join(self.nodes)}" if self.nodes else ""
            raise SourceError("empty", f"{self.url} has no DCGM series{scope}")
        samples = dcgm.node_samples(series, evaluated_at, self.source,
                                    pod_resolver=pod_resolver(series, self.pod_labels),
                                    refusals=self.refusals)
        nodes = [samples[node] for node in sorted(samples)]
        events = self._xids.events(series, evaluated_at, self.source)
        events += self._lost.events(nodes, evaluated_at)
        self.coverage.check(item.name for item in series)
        return nodes, events


async def run_prometheus_collector(settings: CollectSettings, publisher: Publisher,
                                   stop: asyncio.Event,
                                   metrics: CollectorMetrics | None = None) -> None:
    """Query Prometheus every ``settings.interval_s`` until ``stop``."""
    source = PrometheusSource(settings.prometheus_url, settings.prometheus_nodes,
                              settings.pod_labels, settings.scrape_timeout_s, metrics=metrics)
    await run_source(source, publisher, stop, settings.interval_s, metrics)
