"""Stream worker throughput and DBE-to-cordon latency on the embedded broker.

Throughput: the simulator first publishes two minutes of a 10,000-GPU fleet
(1,250 nodes x 8 GPUs at 1 Hz = 150,000 node samples); then one worker
process starts and the rate at which its committed sample offsets advance
from a quarter of the backlog to its end gives GPU-samples per second: the
sustained rate, without start-up, table recovery and the burst of the
fleet's initial placement (every pod's allocation and queue events at once).

Latency: the simulator feeds the same fleet live at 1 Hz; after 40 s, once
the worker has absorbed the initial placement, double-bit ECC errors appear
on 30 nodes, one every 2 s, carried by the samples only (no urgent event).
For each, the delay from handing the sample to the producer to the cordon
action arriving on the actions topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from aiokafka import TopicPartition
from figures import Figure

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.schema import Action, NodeSample
from gpusteward.settings import Settings
from gpusteward.streams.app import worker_group

NODES, GPUS = 1250, 8
FAULTS = 30


def fleet(duration_s: float, acceleration: float, faults: int = 0) -> Scenario:
    return Scenario.model_validate({
        "name": "fleet-10k", "seed": 3, "duration_s": duration_s, "sample_interval_s": 1.0,
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
        "faults": [{"kind": "ecc_dbe", "node": f"h100-{10 + 40 * i}", "at_s": 40 + 2 * i,
                    "urgent_event": False} for i in range(faults)],
    })


class TimedPublisher(KafkaPublisher):
    """Notes when the first sample showing a DBE on a node is handed to the producer."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.dbe_sent: dict[str, float] = {}

    async def sample(self, sample: NodeSample) -> None:
        await super().sample(sample)
        if sample.node not in self.dbe_sent and any(d.ecc_dbe_volatile for d in sample.devices):
            self.dbe_sent[sample.node] = time.monotonic()


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
    assert first is not None
    processed = total - first[1]
    rate = processed * GPUS / (now - first[0])
    cpu_per_record = (cpu - first[2]) / processed
    return [
        Figure("worker throughput (1 process)", rate, "GPU-samples/s"),
        Figure("worker CPU per node sample (8 GPUs)", cpu_per_record * 1e6, "µs"),
        Figure("worker capacity at one busy core", GPUS / cpu_per_record, "GPU-samples/s"),
        Figure("simulator publish rate", total * GPUS / publish_s, "GPU-samples/s"),
    ]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def latency(settings: Settings, log: Path) -> list[Figure]:
    await kafka.ensure_topics(settings)
    arrived: dict[str, float] = {}
    import msgspec

    decode = msgspec.json.Decoder(Action).decode
    reader = kafka.consumer(settings, topics.ACTIONS.name(settings), group_id=None,
                            auto_offset_reset="latest")
    await reader.start()
    stop = asyncio.Event()
    all_arrived = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            batch = await reader.getmany(timeout_ms=100)
            now = time.monotonic()
            for messages in batch.values():
                for message in messages:
                    action = decode(message.value)
                    if action.verb == "cordon" and action.target.node:
                        arrived.setdefault(action.target.node, now)
                        if len(arrived) >= FAULTS:
                            all_arrived.set()

    watching = asyncio.create_task(watch())
    publisher = TimedPublisher(settings)
    await publisher.start()
    with WorkerProcess(settings, log):
        await SimulatedCluster(fleet(40 + 2 * FAULTS + 5, 1.0, faults=FAULTS)).run(publisher)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_arrived.wait(), timeout=30)
    stop.set()
    await watching
    await reader.stop()
    await publisher.stop()
    delays = sorted((arrived[n] - publisher.dbe_sent[n]) * 1000
                    for n in publisher.dbe_sent if n in arrived)
    missing = len(publisher.dbe_sent) - len(delays)
    return [
        Figure("DBE sample -> cordon action, p50", statistics.median(delays), "ms"),
        Figure("DBE sample -> cordon action, p99",
               delays[min(len(delays) - 1, int(len(delays) * 0.99))], "ms"),
        Figure("DBE faults measured (missing)", float(len(delays)), f"({missing} missing)"),
        Figure("consumer fetch wait", float(settings.kafka.fetch_max_wait_ms), "ms"),
    ]


def run() -> list[Figure]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    with EmbeddedBroker(log_path=log_dir / "broker.log") as broker:
        base = broker.settings()
        figures = asyncio.run(throughput(base.model_copy(update={"topic_prefix": "bench-tp"}),
                                         log_dir / "worker-tp.log"))
        figures += asyncio.run(latency(base.model_copy(update={"topic_prefix": "bench-lat"}),
                                       log_dir / "worker-lat.log"))
    return figures
