"""Stream worker throughput on the embedded broker (latency: ``bench_latency.py``).

Throughput: the simulator first publishes two minutes of a 10,000-GPU fleet
(1,250 nodes x 8 GPUs at 1 Hz = 150,000 node samples); then one worker
process starts and the rate at which its committed sample offsets advance
from a quarter of the backlog to its end gives GPU-samples per second: the
sustained rate, without start-up, table recovery and the burst of the
fleet's initial placement (every pod's allocation and queue events at once).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from aiokafka import TopicPartition
from figures import Figure

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.settings import Settings
from gpusteward.streams.app import worker_group

NODES, GPUS = 1250, 8


def fleet(duration_s: float, acceleration: float, *, name: str = "fleet-10k",
          faults: Sequence[dict[str, object]] = ()) -> Scenario:
    """The 10,000-GPU fleet of the worker benchmarks, with ``faults`` if given."""
    return Scenario.model_validate({
        "name": name, "seed": 3, "duration_s": duration_s, "sample_interval_s": 1.0,
        "acceleration": acceleration,
        "nodes": [{"prefix": "h100", "count": NODES, "gpus": GPUS,
                   "gpu_model": "NVIDIA H100 80GB HBM3"}],
        "users": [f"user{i:03d}" for i in range(200)],
        "workloads": [
            {"group": "train", "count": 600, "gpus": 8, "phases": [{"util": [80, 99]}]},
            {"group": "infer", "count": 500, "gpus": 2, "kind": "inference",
             "phases": [{"util": [10, 60]}]},
            {"group": "nb", "count": 1500, "kind": "notebook",
             "phases": [{"for_s": [5, 30], "util": [20, 60]}, {"util": [0, 2]}]},
        ],
        "faults": list(faults),
    })


async def throughput(settings: Settings, log: Path) -> list[Figure]:
    await kafka.ensure_topics(settings)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    started = time.monotonic()
    await SimulatedCluster(fleet(119, 0.0)).run(publisher)
    publish_s = time.monotonic() - started
    await publisher.stop()
    samples = topics.SAMPLES.name(settings)
    ends: dict[TopicPartition, int] = {}
    for record in await kafka.read_all(settings, samples):
        tp = TopicPartition(record.topic, record.partition)
        ends[tp] = max(ends.get(tp, 0), record.offset + 1)
    total = sum(ends.values())
    group = worker_group(settings)
    with WorkerProcess(settings, log) as worker:
        assert worker.process is not None
        first: tuple[float, int, float] | None = None
        while True:
            await asyncio.sleep(0.2)
            done = sum(max(0, o) for o in (await kafka.committed(settings, group, ends)).values())
            now, cpu = time.monotonic(), cpu_seconds(worker.process.pid)
            if first is None and done >= total // 4:
                first = (now, done, cpu)
            if done >= total:
                break
        peak_rss = peak_resident_bytes(worker.process.pid)
    assert first is not None
    processed = total - first[1]
    rate = processed * GPUS / (now - first[0])
    cpu_per_record = (cpu - first[2]) / processed
    return [
        Figure("worker throughput (1 process)", rate, "GPU-samples/s"),
        Figure("worker CPU per node sample (8 GPUs)", cpu_per_record * 1e6, "µs"),
        Figure("worker capacity at one busy core", GPUS / cpu_per_record, "GPU-samples/s"),
        Figure("simulator publish rate", total * GPUS / publish_s, "GPU-samples/s"),
        # Every node's state on one worker (a manifest's memory limit must hold it); two
        # minutes of history, where a node's rule state grows for 30 (the leak rule's window).
        Figure("worker peak resident memory, all 1,250 nodes", peak_rss / 2**20, "MiB"),
    ]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_resident_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def run() -> list[Figure]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    with EmbeddedBroker(log_path=log_dir / "broker.log") as broker:
        base = broker.settings()
        figures = asyncio.run(throughput(base.model_copy(update={"topic_prefix": "bench-tp"}),
                                         log_dir / "worker-tp.log"))
    return figures
