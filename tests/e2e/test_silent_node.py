"""A node whose collector stops, or never runs, is told through the deployed worker.

The ``silent-nodes`` world (six one-GPU nodes, notebooks placed on them) runs
through the production collectors and watcher into the real stream worker, a
child process, on the embedded broker. Two nodes of one partition send nothing
for a while, their kubelets and pods going on: h100-5's collector stops at 20
min and is back at 60; h100-6 has none for the whole two hours (left out by
the DaemonSet). A third node of that partition, h100-2, sends all along: its
samples are the partition's clock. Then a worker that gets no batch at all.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.schema import Finding
from gpusteward.settings import Settings
from gpusteward.streams.node import NodeState
from gpusteward.streams.outputs import Departures
from gpusteward.topics import worker_group
from tests.e2e.records import live_states
from tests.e2e.world_run import run_in_world

pytestmark = pytest.mark.e2e

INTERVAL_S = 60.0
HOURS = 2
SILENT_AFTER_S = 600.0
"""The shipped policy's ``node_silent.silent_after_s``."""


def test_a_node_whose_collector_stops_or_never_runs_is_told_once_and_resolved(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The ``silent-nodes`` world through the production NVML collectors (fake NVML and
    kubelet per node), the watcher on the API-server double and the deployed worker:
    h100-5's collector stops ticking at 20 min and is back at 60, h100-6's never ticks.
    Each is told once, silent_after_s (within a look of the partition's clock) after its
    last sample or its inventory; h100-5 resolved by its first sample back; no other node
    told."""
    partitions = Departures(3600.0, 8).partition_of
    assert partitions(b"h100-5") == partitions(b"h100-6") == partitions(b"h100-2")
    run = asyncio.run(run_in_world(broker, "silent-nodes", tmp_path))
    start = run.cluster.start
    assert not [s for s in run.samples if s.node == "h100-6"]
    silent = [f for f in run.findings if f.kind == "node_silent"]
    by_node = {node: [(f.state, f.starts_at, f.ts) for f in silent if f.subject.node == node]
               for node in {f.subject.node for f in silent}}
    # No false alarm on the others. Where one is missing, what the worker's changelog holds
    # of it says why: no state at all (lost), or a state no look told.
    assert set(by_node) == {"h100-5", "h100-6"}, (by_node, asyncio.run(_stored(
        broker.settings().model_copy(update={"topic_prefix": "e2e-silent-nodes"}),
        {"h100-5", "h100-6"} - set(by_node))))

    # Its last sample at 19 min (the next tick is the first it misses); told within a look
    # (60 s of the partition's clock) of silent_after_s, resolved by its first sample back.
    [(state, since, told), (closed, closed_since, back)] = by_node["h100-5"]
    assert (state, closed) == ("firing", "resolved") and since == closed_since
    assert since == start + 1200 - INTERVAL_S
    assert since + SILENT_AFTER_S <= told <= since + SILENT_AFTER_S + 60 + INTERVAL_S
    assert back == start + 3600
    assert len({f.id for f in silent if f.subject.node == "h100-5"}) == 1

    # Never a sample: told silent_after_s after the watcher's inventory, once, open at the
    # end, naming its one GPU.
    [(state, since, told)] = by_node["h100-6"]
    assert state == "firing" and start <= since <= start + INTERVAL_S
    assert since + SILENT_AFTER_S <= told <= since + SILENT_AFTER_S + 60 + INTERVAL_S
    [finding] = [f for f in silent if f.subject.node == "h100-6"]
    assert finding.labels["sampled_before"] == "false" and finding.severity == "warning"
    assert "its 1 GPU takes work" in finding.summary


async def _stored(settings: Settings, nodes: set[str]) -> dict[str, object]:
    """What the worker's changelog holds of each of ``nodes`` (None: no state)."""
    states = live_states(await kafka.read_all(
        settings, topics.changelog(settings, "node-state")), NodeState)
    return {node: None if node not in states else {
        field: getattr(states[node], field)
        for field in ("gpu_count", "expected_from", "cordoned", "deleted", "silent")}
        for node in nodes}


def test_a_worker_with_no_batch_left_tells_a_silent_node_by_its_timer(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    """h100-1 is alone in its partition and its collector stopped 15 min before now; h100-2,
    in another partition, sends until now. The worker reads the world's backlog in a second
    or two, during which no partition is quiet, and then gets no batch at all: only its
    timer, between batches, can tell h100-1, by h100-2's newest sample moved on by the
    worker's own time. Before, nothing was asked or told after the last batch."""
    partitions = Departures(3600.0, 8).partition_of
    assert partitions(b"h100-1") != partitions(b"h100-2")
    start = time.time() - 1200 - 30
    world = SimulatedCluster(Scenario.model_validate({
        "name": "silent-after-the-last-batch", "seed": 11, "start_ts": start,
        "duration_s": 1200, "sample_interval_s": 30,
        "nodes": [{"prefix": "h100", "count": 2, "gpu_model": "NVIDIA H100 80GB HBM3",
                   "gpus": 1, "mem_gib": 80}],
        "users": ["alice"],
        "workloads": [{"group": "nb", "count": 1, "kind": "notebook",
                       "phases": [{"util": [30, 60]}]}],
        "faults": [{"kind": "collector_down", "node": "h100-1", "at_s": 300}],
    }))
    settings = broker.settings().model_copy(update={"topic_prefix": "e2e-silent-timer",
                                                    "quiet_partition_s": 3.0})

    async def run() -> list[Finding]:
        await kafka.ensure_topics(settings)
        publisher = KafkaPublisher(settings)
        await publisher.start()
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker.start()
        decode = msgspec.json.Decoder(Finding).decode
        try:
            await world.run(publisher)
            await kafka.wait_consumed(
                settings, worker_group(settings),
                [t.name(settings) for t in (topics.SAMPLES, topics.ALLOCATIONS)],
                timeout_s=180)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                found = [decode(r.value) for r in await kafka.read_all(
                    settings, topics.FINDINGS.name(settings))]
                if any(f.kind == "node_silent" for f in found):
                    break
                await asyncio.sleep(1)
            assert worker.alive
        finally:
            worker.stop()
            await publisher.stop()
        return found

    silent = [f for f in asyncio.run(run()) if f.kind == "node_silent"]
    assert [(f.subject.node, f.state, f.starts_at) for f in silent] == [
        ("h100-1", "firing", start + 300 - 30)]
    assert silent[0].ts >= start + 1200  # the worker's clock: past the world's last sample
