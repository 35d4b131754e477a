"""A GPU that leaves dcgm-exporter's page (fallen off the bus: DCGM's values go blank and
dcgm-exporter skips blank values) is reported ``gpu_lost``; what only looks like it is not."""

from __future__ import annotations

from typing import cast

import aiohttp
import pytest

from gpusteward.collectors import dcgm
from gpusteward.collectors.source import SourceError
from gpusteward.schema import HwEvent

WHOLE = "GPU-3f2a9c4e-8b71-4d2e-9a65-1c7e0b5d2f18"
"""GPU 0 of the sample page: MIG disabled."""
MIG = "GPU-9c04e1b7-2a6d-4f83-b5e0-7d19a3c8e642"
"""GPU 1 of the sample page: two GPU instances."""


def _without(page: str, needle: str) -> str:
    return "".join(line for line in page.splitlines(keepends=True) if needle not in line)


def _source() -> dcgm.DcgmSource:
    return dcgm.DcgmSource("http://x", "gpu-node-07", session=cast(aiohttp.ClientSession, None))


def _lost(source: dcgm.DcgmSource, page: str, ts: float = 0.0) -> list[HwEvent]:
    _, events = source.parse(page, ts)
    return [e for e in events if e.kind == "gpu_lost"]


def test_a_gpu_gone_from_the_page_is_lost_after_the_set_reads(dcgm_page: str) -> None:
    source = _source()
    assert _lost(source, dcgm_page) == []
    gone = _without(dcgm_page, WHOLE)
    reads = [_lost(source, gone, ts) for ts in range(1, dcgm.LOST_AFTER_SCRAPES + 3)]
    assert [len(r) for r in reads] == [0] * (dcgm.LOST_AFTER_SCRAPES - 1) + [1, 0, 0]
    event = reads[dcgm.LOST_AFTER_SCRAPES - 1][0]
    assert (event.node, event.uuid, event.source) == ("gpu-node-07", WHOLE, "dcgm")
    assert "GPU 0" in event.detail and "dcgm-exporter" in event.detail


def test_a_mig_enabled_gpu_without_instances_is_no_loss(dcgm_page: str) -> None:
    # dcgm-exporter reports a MIG-enabled GPU only through its GPU instances, and a MIG
    # reconfiguration removes them all for a while: reported lost, the node would be
    # drained mid-reconfiguration. (The NVML collector reports a lost MIG-enabled GPU.)
    source = _source()
    _lost(source, dcgm_page)
    gone = _without(dcgm_page, MIG)
    assert [e for ts in range(1, 6) for e in _lost(source, gone, ts)] == []


def test_a_missed_read_a_scrape_error_or_a_mig_reconfiguration_is_no_loss(
        dcgm_page: str) -> None:
    source = _source()
    gone = _without(dcgm_page, WHOLE)
    _lost(source, dcgm_page)
    for _ in range(dcgm.LOST_AFTER_SCRAPES - 1):  # fewer reads than needed, then back
        assert _lost(source, gone) == []
    assert _lost(source, dcgm_page) == []
    for _ in range(dcgm.LOST_AFTER_SCRAPES - 1):  # the count starts again
        assert _lost(source, gone) == []
    # A page without GPU series (the exporter restarting, the driver unloaded for a drain)
    # is refused as a whole and counts as no read.
    for _ in range(5):
        with pytest.raises(SourceError):
            source.parse("# HELP x y\n# TYPE x gauge\nx 1\n", 0.0)
    assert _lost(source, dcgm_page) == []
    # MIG reconfigured: GPU instance 2 gone, the parent's other instance still there.
    one_instance = _without(dcgm_page, 'GPU_I_ID="2"')
    assert all(_lost(source, one_instance) == [] for _ in range(5))


def test_a_gpu_that_comes_back_and_goes_again_is_reported_again(dcgm_page: str) -> None:
    source = _source()
    gone = _without(dcgm_page, WHOLE)
    _lost(source, dcgm_page)
    first = [e for _ in range(5) for e in _lost(source, gone)]
    _lost(source, dcgm_page)
    second = [e for _ in range(5) for e in _lost(source, gone)]
    assert [e.uuid for e in first] == [e.uuid for e in second] == [WHOLE]


def test_a_node_absent_from_a_prometheus_answer_is_not_judged(dcgm_page: str) -> None:
    # One Prometheus answer covers many nodes: a node missing from it (its exporter not
    # scraped) loses no GPU; a node whose answer lacks one of its GPUs does.
    series = dcgm.parse_page(dcgm_page)
    lost = dcgm.LostGpus("prometheus")
    node_a = dcgm.node_samples(series, 0.0, "prometheus", node="a")["a"]
    node_b = dcgm.node_samples(series, 0.0, "prometheus", node="b")["b"]
    assert lost.events([node_a, node_b], 0.0) == []
    b_short = dcgm.node_samples(dcgm.parse_page(_without(dcgm_page, WHOLE)), 1.0, "prometheus",
                                node="b")["b"]
    events = [e for ts in range(1, 6) for e in lost.events([b_short], float(ts))]
    assert [(e.node, e.uuid, e.source) for e in events] == [("b", WHOLE, "prometheus")]
