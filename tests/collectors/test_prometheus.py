"""The Prometheus source against a real Prometheus scraping the dcgm-exporter page.

The scrape job is set up as the dcgm-exporter Helm chart and the GPU
Operator's ServiceMonitor do it (``honor_labels: false``, target labels
pod/namespace/container of the exporter's own pod), so the workload pod
labels arrive as ``exported_*`` and the idle MIG instance carries the
exporter's pod: the case that must not become a false attribution.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpusteward import edge
from gpusteward.broker import free_port
from gpusteward.collectors import dcgm
from gpusteward.collectors.metrics import CollectorMetrics
from gpusteward.collectors.prometheus import (
    SCRAPED_AT,
    SCRAPED_LABEL,
    PrometheusSource,
    build_query,
    pod_resolver,
    series_of,
)
from gpusteward.collectors.source import SourceError
from gpusteward.schema import PodRef
from tests.collectors.conftest import AnsweringPrometheus, FakeExporter
from tests.collectors.conftest import prometheus_query as _query

GPU0 = "GPU-3f2a9c4e-8b71-4d2e-9a65-1c7e0b5d2f18"
GPU1 = "GPU-9c04e1b7-2a6d-4f83-b5e0-7d19a3c8e642"
TRAINER = PodRef(namespace="ml-training", name="llama-ft-worker-0", container="trainer")
VLLM = PodRef(namespace="inference", name="vllm-infer-7c9d8b6f5-qx2lm", container="vllm")
EXPORTER_POD = {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-x7k2p",
                "container": "nvidia-dcgm-exporter"}


def _job(name: str, target: str, honor_labels: bool = False, **extra: Any) -> dict[str, Any]:
    """A scrape job of one exporter, its target labelled as the exporter pod (what a
    ServiceMonitor or PodMonitor attaches), plus ``extra`` config (relabel_configs...)."""
    return {"job_name": name, "honor_labels": honor_labels,
            "static_configs": [{"targets": [target], "labels": {
                **EXPORTER_POD, "__meta_kubernetes_pod_node_name": "gpu-node-07"}}], **extra}


def _target(exporter: FakeExporter) -> str:
    return exporter.url.removeprefix("http://").removesuffix("/metrics")


@pytest.fixture
def prometheus(prometheus_factory: Callable[..., str], exporter: FakeExporter) -> str:
    """A real Prometheus that has scraped the exporter once, as the dcgm-exporter Helm chart
    and the GPU Operator's ServiceMonitor do (``honorLabels: false``)."""
    return prometheus_factory(_job("dcgm-exporter", _target(exporter)))


@pytest.mark.e2e
def test_samples_from_a_real_prometheus_with_exported_labels(prometheus: str) -> None:
    raw = _query(prometheus, 'DCGM_FI_DEV_FB_USED{GPU_I_ID="1"}')
    assert raw[0]["metric"]["exported_pod"] == VLLM.name, "the scrape renamed the pod labels"

    samples, events = asyncio.run(PrometheusSource(prometheus).collect())
    assert [s.node for s in samples] == ["gpu-node-07"]
    sample = samples[0]
    assert sample.source == "prometheus"
    assert abs(sample.ts - time.time()) < 60
    devices = {d.uuid: d for d in sample.devices}
    assert list(devices) == [GPU0, GPU1, f"MIG-{GPU1}/1", f"MIG-{GPU1}/2"]
    assert devices[GPU0].util_pct == 97.0
    assert (devices[GPU1].kind, devices[GPU1].temp_c) == ("gpu", 49.0), "the MIG GPU's parent"
    assert devices[f"MIG-{GPU1}/1"].temp_c is None
    assert devices[GPU0].pod == TRAINER
    assert devices[f"MIG-{GPU1}/1"].pod == VLLM
    assert devices[f"MIG-{GPU1}/1"].engine_active_pct == pytest.approx(87.4512)
    assert devices[f"MIG-{GPU1}/2"].pod is None, "the exporter's own pod holds no GPU"
    assert [(e.node, e.uuid, e.xid) for e in events] == [("gpu-node-07", GPU1, 31)]

    only_this = asyncio.run(PrometheusSource(prometheus, nodes=["gpu-node-07"]).collect())[0]
    assert [s.node for s in only_this] == ["gpu-node-07"]
    with pytest.raises(SourceError) as raised:
        asyncio.run(PrometheusSource(prometheus, nodes=["gpu-node-99"]).collect())
    assert raised.value.reason == "empty"

    exported = asyncio.run(PrometheusSource(prometheus, pod_labels="exported").collect())[0][0]
    assert [d.pod for d in exported.devices] == [TRAINER, None, VLLM, None]


def test_unreachable_prometheus_is_a_source_error() -> None:
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(SourceError) as raised:
        asyncio.run(source.collect())
    assert raised.value.reason == "unreachable"


def _series(**labels: str) -> dcgm.Series:
    base = {"UUID": GPU0, "gpu": "0", "Hostname": "n"}
    return dcgm.Series("DCGM_FI_DEV_GPU_UTIL", {**base, **labels}, 1.0)


def test_auto_pod_labels_never_attribute_the_exporter_pod() -> None:
    # A node whose GPUs are all idle: no exported_* anywhere, only the target's labels.
    idle = [_series(**EXPORTER_POD)]
    assert pod_resolver(idle, "auto")(idle[0].labels) is None
    # honorLabels: true still attaches the target's own pod labels to a series that has
    # none (an unallocated GPU): plain mode must not credit the GPU to the exporter either.
    assert pod_resolver(idle, "plain")(idle[0].labels) is None

    # The target's pod, learnt from a series that also has exported_*, is never a holder.
    busy = _series(**EXPORTER_POD, exported_pod="p", exported_namespace="ns")
    other_target = _series(namespace="monitoring", pod="dcgm-0")
    resolve = pod_resolver([busy, other_target, _series(namespace="monitoring", pod="dcgm-0",
                                                        exported_pod="q",
                                                        exported_namespace="ns")], "auto")
    assert resolve(busy.labels) == PodRef(namespace="ns", name="p")
    assert resolve(other_target.labels) is None

    # honorLabels: true — dcgm-exporter's own labels are the workload's.
    honoured = _series(namespace="ml", pod="train-0", container="main")
    assert pod_resolver([honoured], "auto")(honoured.labels) == PodRef(
        namespace="ml", name="train-0", container="main")


def test_query_selects_nodes_by_either_hostname_spelling() -> None:
    query = build_query(["gpu-node.07"])
    assert 'Hostname=~"gpu\\\\-node\\\\.07"' in query
    assert 'hostname=~"gpu\\\\-node\\\\.07"' in query
    assert " or " in query
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" in build_query()


def test_stock_exporters_behind_prometheus_are_reported_missing_families(
        dcgm_page: str, caplog: pytest.LogCaptureFixture) -> None:
    metrics = CollectorMetrics()
    client = AnsweringPrometheus(dcgm.parse_page(dcgm_page))
    source = PrometheusSource("http://prometheus.invalid", client=client,
                              metrics=metrics)
    with caplog.at_level("WARNING", logger="gpusteward.collectors.dcgm"):
        asyncio.run(source.collect())
        asyncio.run(source.collect())
    missing = {"clock_event_reasons", "ecc_sbe", "ecc_dbe", "row_remap_pending",
               "nvlink_errors", "nvlink_crc_errors"}
    assert source.coverage.missing == missing
    assert len(caplog.records) == len(missing)
    assert all(r.getMessage().startswith("prometheus: no ") for r in caplog.records)
    assert metrics.registry.get_sample_value(
        "gpusteward_collect_missing_field_families_total",
        {"source": "prometheus", "family": "nvlink_errors"}) == 2


def test_a_result_item_that_is_no_sample_is_skipped_not_the_tick() -> None:
    refusals = edge.Refusals(logging.getLogger(__name__))
    result: list[dict[str, Any]] = [
        {"metric": {"__name__": "DCGM_FI_DEV_GPU_TEMP", "UUID": "GPU-0"}, "value": [10.0, "61"]},
        {"metric": {"UUID": "GPU-0"}, "value": [10.0, "1"]},
        {"metric": {"__name__": "DCGM_FI_DEV_GPU_UTIL"}, "value": [10.0, "lots"]},
        {"metric": {"__name__": "DCGM_FI_DEV_GPU_UTIL"}, "value": 10},
    ]
    series, evaluated_at = series_of(result, refusals)
    assert [s.name for s in series] == ["DCGM_FI_DEV_GPU_TEMP"] and evaluated_at == 10.0
    assert refusals.count == 3


def _honoured(page: str) -> list[dcgm.Series]:
    """The page as Prometheus keeps it with ``honorLabels: true``: the exporter's own pod
    labels stay; a series without them gets the target's (the exporter pod's)."""
    return [dcgm.Series(s.name, {**EXPORTER_POD, **s.labels}, s.value)
            for s in dcgm.parse_page(page)]


def test_plain_pod_labels_never_credit_an_idle_gpu_to_the_exporter_pod(dcgm_page: str) -> None:
    series = _honoured(dcgm_page)
    idle = next(s for s in series if s.labels.get("GPU_I_ID") == "2")
    assert idle.labels["pod"] == EXPORTER_POD["pod"], "the target's pod, on an unheld GPU"

    source = PrometheusSource("http://prometheus.invalid", pod_labels="plain",
                              client=AnsweringPrometheus(series))
    (sample,), _ = asyncio.run(source.collect())
    pods = {d.uuid: d.pod for d in sample.devices}
    assert pods == {GPU0: TRAINER, GPU1: None, f"MIG-{GPU1}/1": VLLM, f"MIG-{GPU1}/2": None}


def test_a_mig_enabled_gpu_behind_prometheus_gets_its_parent(dcgm_page: str) -> None:
    hot = re.sub(r'^(DCGM_FI_DEV_GPU_TEMP{gpu="1"[^}]*}) \S+$', r"\g<1> 95", dcgm_page,
                 flags=re.MULTILINE)
    source = PrometheusSource("http://prometheus.invalid",
                              client=AnsweringPrometheus(dcgm.parse_page(hot)))
    (sample,), _ = asyncio.run(source.collect())
    devices = {d.uuid: d for d in sample.devices}
    assert (devices[GPU1].kind, devices[GPU1].temp_c) == ("gpu", 95.0)
    assert [d.temp_c for d in sample.devices if d.kind == "mig"] == [None, None]


NODE_RELABEL = [{"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"}]
"""What a PodMonitor/ServiceMonitor relabelling of the exporter pod's node writes."""


def _hostname_is_the_pod(page: str) -> str:
    """The page of a dcgm-exporter without NODE_NAME nor host networking: its Hostname is
    its pod's host name, the pod name."""
    return page.replace('Hostname="gpu-node-07"', f'Hostname="{EXPORTER_POD["pod"]}"')


@pytest.mark.e2e
def test_samples_are_keyed_by_the_kubernetes_node_not_the_exporter_pods_hostname(
        dcgm_page: str, exporter_factory: Callable[..., FakeExporter],
        prometheus_factory: Callable[..., str], caplog: pytest.LogCaptureFixture) -> None:
    # The watcher's allocations for these pods are keyed by spec.nodeName, "gpu-node-07";
    # samples keyed by anything else meet none of them in the worker's join.
    target = _target(exporter_factory(_hostname_is_the_pod(dcgm_page)).start())
    relabelled = prometheus_factory(
        _job("podmonitor", target, relabel_configs=NODE_RELABEL),
        _job("servicemonitor", target, honor_labels=True, relabel_configs=[
            {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "instance"}]))

    sources = [lambda: PrometheusSource(relabelled),
               lambda: PrometheusSource(relabelled, nodes=["gpu-node-07"]),
               # (the podmonitor job's instance is its address: asked for by node only)
               lambda: PrometheusSource(relabelled, nodes=["gpu-node-07"], node_label="instance")]
    for source in sources:
        (sample,), _ = asyncio.run(source().collect())
        assert sample.node == "gpu-node-07"
        assert [d.pod for d in sample.devices] == [TRAINER, None, VLLM, None]

    # No label names the node: refused with the remedy, not published under the pod's name.
    bare = prometheus_factory(_job("servicemonitor", target))
    with caplog.at_level("WARNING", logger="gpusteward.collectors.dcgm"):
        with pytest.raises(SourceError) as raised:
            asyncio.run(PrometheusSource(bare).collect())
    assert "PROMETHEUS_NODE_LABEL" in str(raised.value)
    assert "NODE_NAME" in caplog.text and EXPORTER_POD["pod"] in caplog.text


NVLINK_FLIT = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"


@pytest.mark.e2e
def test_an_exporter_scraped_by_two_jobs_is_counted_once(
        dcgm_page: str, exporter_factory: Callable[..., FakeExporter],
        prometheus_factory: Callable[..., str]) -> None:
    # A ServiceMonitor (honorLabels: false) and the kubernetes-pods annotation job
    # (honor_labels: true) both scraping the exporter: Prometheus holds every series twice.
    gpu0 = next(line for line in dcgm_page.splitlines()
                if line.startswith('DCGM_FI_DEV_GPU_UTIL{gpu="0"'))
    labels = gpu0.rsplit(" ", 1)[0].removeprefix("DCGM_FI_DEV_GPU_UTIL")
    page = dcgm_page + (f"# HELP {NVLINK_FLIT} Total number of NVLink flow-control CRC errors.\n"
                        f"# TYPE {NVLINK_FLIT} counter\n{NVLINK_FLIT}{labels} 7\n")
    target = _target(exporter_factory(page).start())
    url = prometheus_factory(_job("servicemonitor", target, relabel_configs=NODE_RELABEL),
                             _job("kubernetes-pods", target, honor_labels=True,
                                  relabel_configs=NODE_RELABEL))
    assert len(_query(url, NVLINK_FLIT)) == 2, "the same counter twice"

    (sample,), _ = asyncio.run(PrometheusSource(url).collect())
    devices = {d.uuid: d for d in sample.devices}
    assert devices[GPU0].nvlink_crc_errors == 7, "7 errors, not 14: a doubled counter is a burst"
    assert devices[GPU0].nvlink_errors is None, "CRC errors are not replays"
    assert [d.pod for d in sample.devices] == [TRAINER, None, VLLM, None]


def _scrape(at: float, xid: int = 0, dbe: int = 0, gpus: tuple[str, ...] = (GPU0, GPU1),
            job: str = "dcgm-exporter") -> list[dict[str, Any]]:
    """What a Prometheus that scraped gpu-node-07's page at ``at`` answers the collector's
    query: GPU0's readings with XID ``xid`` and DBE count ``dbe``, and each XID gauge's
    scrape time as the query names it."""
    items: list[dict[str, Any]] = []
    for index, uuid in enumerate((GPU0, GPU1)):
        if uuid not in gpus:
            continue
        labels = {"gpu": str(index), "UUID": uuid, "Hostname": "gpu-node-07", "job": job}
        code = xid if uuid == GPU0 else 0
        gauge = {**labels, "err_code": str(code)}
        items += [
            {"metric": {"__name__": "DCGM_FI_DEV_GPU_TEMP", **labels}, "value": [at + 5, "50"]},
            {"metric": {"__name__": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", **labels},
             "value": [at + 5, str(dbe if uuid == GPU0 else 0)]},
            {"metric": {"__name__": dcgm.XID_FIELD, **gauge}, "value": [at + 5, str(code)]},
            {"metric": {"__name__": SCRAPED_AT, SCRAPED_LABEL: "1", **gauge},
             "value": [at + 5, str(at)]},
        ]
    return items


class _Replicas:
    """A PrometheusConnect stand-in giving the answers it holds, one per query, in turn."""

    def __init__(self, *answers: list[dict[str, Any]]) -> None:
        self.answers = list(answers)

    def custom_query(self, query: str, timeout: float | None = None) -> list[dict[str, Any]]:
        return self.answers.pop(0)


def _collect(source: PrometheusSource) -> tuple[list[tuple[float, int | None]], list[str]]:
    samples, events = asyncio.run(source.collect())
    return ([(s.ts, s.devices[0].ecc_dbe_volatile) for s in samples],
            [f"{e.kind} {e.xid or ''}".strip() for e in events])


def test_an_older_scrape_from_the_other_replica_is_no_news() -> None:
    # Two replicas out of phase behind one Service: B scraped the XID and the DBE at 101,
    # A's newest scrape (100) is still the page before them.
    source = PrometheusSource("http://prometheus.invalid", client=_Replicas(
        _scrape(100), _scrape(101, xid=48, dbe=1), _scrape(100), _scrape(101, xid=48, dbe=1),
        _scrape(102, xid=48, dbe=1),
        # Two copies of each device in one answer (the exporter scraped by two jobs, or a
        # querier that does not deduplicate replicas): the newer XID gauge is the one read.
        _scrape(103, xid=48, dbe=1, job="a") + _scrape(102.5, job="b"),
        _scrape(104, xid=48, dbe=1, job="a") + _scrape(102.5, job="b")))
    assert [_collect(source) for _ in range(5)] == [
        ([(100, 0)], []), ([(101, 1)], ["xid 48"]), ([], []), ([], []), ([(102, 1)], [])]
    assert [_collect(source)[1] for _ in range(2)] == [[], []]


def test_one_scrape_read_again_and_again_is_one_reading() -> None:
    # INTERVAL_S shorter than the scrape interval: the GPU missing from one scrape is one
    # missing reading, not three in a row (a GPU lost is three scrapes without it).
    without = (GPU1,)
    source = PrometheusSource("http://prometheus.invalid", client=_Replicas(
        _scrape(100), *[_scrape(101, gpus=without)] * 3, _scrape(102),
        *[_scrape(at, gpus=without) for at in (103, 104, 105)]))
    assert [_collect(source)[1] for _ in range(8)] == [[]] * 7 + [["gpu_lost"]]
