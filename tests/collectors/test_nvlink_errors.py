"""NVLink errors from each collector to the hardware rule: CRC errors judged on their rate.

A healthy link counts CRC errors (link training at boot, a slow trickle); DCGM's health
check fails a link on them only at 100 per second, while any replay or recovery error is
real trouble. Each collector (NVML on the fake NVML, a dcgm-exporter page, Prometheus in
front of dcgm-exporter) must hand the two apart, and the node join under the shipped policy
must stay quiet on the healthy link and fire on a replay burst and on a CRC storm.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

from gpusteward.collectors import dcgm
from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.collectors.prometheus import PrometheusSource
from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.schema import Finding, NodeSample
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings
from gpusteward.streams.policy_file import load_policy
from tests.collectors.conftest import RESEARCH, AnsweringPrometheus, RecordingPublisher

REPO = Path(__file__).resolve().parents[2]
POLICY = load_policy(REPO / "deploy" / "base" / "policy.yaml")
T0 = 1_763_683_200.0
FLIT = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
REPLAY = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"

Reader = Callable[[float, int, int], NodeSample]
"""(event time, CRC flit total, replay total) -> the node's sample as the collector maps it."""


@contextmanager
def nvml_reader() -> Iterator[Reader]:
    fake = FakeNvml.from_yaml(REPO / "tests" / "data" / "nvml" / "mixed-node.yaml")
    collector = NvmlCollector(fake, "node-a", RecordingPublisher(), interval_s=60.0,
                              event_wait_ms=50)
    loop = asyncio.new_event_loop()
    collector.open()

    def read(ts: float, crc: int, replay: int) -> NodeSample:
        fake.gpus[0].nvlink = {"crc_flit": crc, "crc_data": 0, "replay": replay, "recovery": 0}
        return msgspec.structs.replace(loop.run_until_complete(collector.tick()), ts=ts)

    try:
        yield read
    finally:
        collector.close()
        loop.close()


def _page(crc: int, replay: int) -> str:
    """dcgm-exporter's page with NVLink error counters on GPU 0 (deploy/'s counters file)."""
    page = (RESEARCH / "dcgm_exporter_metrics.txt").read_text()
    line = next(line for line in page.splitlines()
                if line.startswith('DCGM_FI_DEV_GPU_TEMP{gpu="0"'))
    labels = line[len("DCGM_FI_DEV_GPU_TEMP"):line.rindex("}") + 1]
    return page + f"{FLIT}{labels} {crc}\n{REPLAY}{labels} {replay}\n"


@contextmanager
def dcgm_reader() -> Iterator[Reader]:
    source = dcgm.DcgmSource("http://dcgm-exporter.invalid/metrics", None, None)  # type: ignore[arg-type]
    yield lambda ts, crc, replay: source.parse(_page(crc, replay), ts)[0]


@contextmanager
def prometheus_reader() -> Iterator[Reader]:
    client = AnsweringPrometheus([])
    source = PrometheusSource("http://prometheus.invalid", client=client)

    def read(ts: float, crc: int, replay: int) -> NodeSample:
        client.series = dcgm.parse_page(_page(crc, replay))
        (sample,), _ = asyncio.run(source.collect())
        return msgspec.structs.replace(sample, ts=ts)

    yield read


READERS = {"nvml": nvml_reader, "dcgm": dcgm_reader, "prometheus": prometheus_reader}


def nvlink_findings(reader: str, readings: list[tuple[float, int, int]]) -> list[Finding]:
    """Every NVLink finding the node join gives on the collector's samples of ``readings``."""
    join, state = NodeJoin(RuleSettings(policy=POLICY)), NodeState()
    out: list[Finding] = []
    with READERS[reader]() as read:
        for ts, crc, replay in readings:
            out += [o for o in join.on_sample(state, read(ts, crc, replay))
                    if isinstance(o, Finding) and o.kind.startswith("nvlink")]
    return out


@pytest.mark.parametrize("reader", READERS)
def test_a_healthy_links_crc_jump_and_trickle_raise_nothing(reader: str) -> None:
    """412 CRC errors between two readings 15 s apart (link training), then 2 a minute for
    an hour: far below DCGM's 100 per second. Replays stay at 0."""
    jump = [(T0, 0, 0), (T0 + 15, 412, 0)]
    trickle = [(T0 + 15 + 30 * i, 412 + i, 0) for i in range(1, 121)]
    assert nvlink_findings(reader, jump + trickle) == []


@pytest.mark.parametrize("reader", READERS)
def test_a_replay_burst_still_fires_nvlink_errors(reader: str) -> None:
    readings = [(T0 + 15 * i, 0, 5 * i) for i in range(4)]
    (finding,) = nvlink_findings(reader, readings)
    assert (finding.kind, finding.state, finding.ts) == ("nvlink_errors", "firing", T0 + 30)


@pytest.mark.parametrize("reader", READERS)
def test_a_crc_storm_above_dcgms_rate_fires_nvlink_crc_errors(reader: str) -> None:
    """200 CRC errors a second (3000 per 15 s reading): twice DCGM's failing rate."""
    readings = [(T0 + 15 * i, 3000 * i, 0) for i in range(12)]
    (finding,) = nvlink_findings(reader, readings)
    assert (finding.kind, finding.state) == ("nvlink_crc_errors", "firing")
    assert finding.ts == T0 + 150 and "30000 in 150 s" in finding.summary
