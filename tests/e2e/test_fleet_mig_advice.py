"""The fleet agent's MIG layout advice end to end: simulator -> broker -> real worker.

The ``mig-inference`` scenario (two all-1g.10gb A100 nodes, one 3g.40gb node, a
reranker asking for a 2g.20gb slice no layout offers) is stretched past one
advice interval (6 h of event time, the default) and published as fast as it
goes; the worker must publish one advice finding for the pool whose layout
must change, and none for the pool already right. The summaries report no
whole GPUs on these fully partitioned nodes (the ``mixed`` strategy), so
this also checks that GPU counts come from the MIG devices seen free.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules.mig import layout
from gpusteward.rules.mig.advice import MigAdviceSettings
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.schema import Finding
from gpusteward.topics import worker_group

pytestmark = pytest.mark.e2e


async def _run(broker: EmbeddedBroker, log: Path) -> list[Finding]:
    settings = broker.settings().model_copy(update={"topic_prefix": "e2e-mig-advice"})
    await kafka.ensure_topics(settings)
    interval = MigAdviceSettings().interval_s
    spec = scenarios.load("mig-inference").model_copy(
        update={"acceleration": 0.0, "duration_s": interval + 600, "sample_interval_s": 60.0})
    cluster = SimulatedCluster(spec)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    worker = WorkerProcess(settings, log)
    worker.start()
    try:
        await cluster.run(publisher)
        group = worker_group(settings)
        await kafka.wait_consumed(settings, group, [t.name(settings) for t in (
            topics.SAMPLES, topics.ALLOCATIONS)], timeout_s=180)
        await kafka.wait_consumed(settings, group, [t.name(settings) for t in (
            topics.NODE_SUMMARIES, topics.QUEUE)], timeout_s=120)
        assert worker.alive, f"the worker died; its log is {log}"
    finally:
        worker.stop()
        await publisher.stop()
    decode = msgspec.json.Decoder(Finding).decode
    return [decode(r.value) for r in await kafka.read_all(settings,
                                                           topics.FINDINGS.name(settings))]


def test_advice_for_the_pool_that_strands_the_reranker(broker: EmbeddedBroker,
                                                       tmp_path: Path) -> None:
    findings = asyncio.run(_run(broker, tmp_path / "worker.log"))
    advice = [f for f in findings if f.kind == layout.KIND]
    spec = scenarios.load("mig-inference")
    boundary = spec.start_ts + MigAdviceSettings().interval_s
    # One advice, at the interval boundary, for the 2-GPU nodes' pool (the one-GPU
    # 3g.40gb node serves its embedders as it is).
    assert [(f.ts, f.labels["pool"]) for f in advice] == [(boundary, "A100-80GB/2gpu")]
    (finding,) = advice
    assert finding.severity == "info" and finding.evidence is not None
    assert finding.evidence.values["served_share"] == pytest.approx(
        finding.evidence.values["demand_share"])
    nodes = {k.removeprefix("node.") for k in finding.labels if k.startswith("node.")}
    assert nodes and nodes <= {"a100-1g-1", "a100-1g-2"}
    configs = [json.loads(v) for k, v in finding.labels.items() if k.startswith("config.")]
    assert any(entry.get("mig-devices", {}).get("2g.20gb") for entries in configs
               for entry in entries)
