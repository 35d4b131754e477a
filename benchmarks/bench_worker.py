"""Stream worker throughput on the embedded broker (latency: ``bench_latency.py``).

Throughput: the simulator first publishes two minutes of a 10,000-GPU fleet
(1,250 nodes x 8 GPUs at 1 Hz = 150,000 node samples); then one worker
process starts and the rate at which its committed sample offsets advance
from a quarter of the backlog to its end gives GPU-samples per second: the
sustained rate, without start-up, table recovery and the burst of the
fleet's initial placement (every pod's allocation and queue events at once).

Scale-out: 1, 2, 4 and 8 workers in one consumer group (where the host has
the CPUs) drain a longer backlog of the same fleet (up to six minutes, as much
as the simulator publishes in half the workers' session timeout: eight workers
drain two minutes in about three seconds, too short a stretch for offsets
committed every half second), measured the same way once the group has
formed. n workers are compared with the one worker of these runs, not the
one above: a longer backlog costs more per record (its nodes' rule state is
older). With them, how busy each worker and the broker were, which says
whether the workers or something outside them set the pace, and how much
more the largest partition holds than the mean.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
from gpusteward.topics import worker_group

NODES, GPUS = 1250, 8
SCALE_OUT = (1, 2, 4, 8)
"""Workers in the scale-out runs (at most the node topics' 8 partitions), each run where
the host has two CPUs more than workers."""
BACKLOG_S = 119.0
SCALE_OUT_BACKLOG_S = 359.0
"""Seconds of the fleet published as the scale-out backlog at most."""
SCALE_OUT_SESSION_S = 60.0
"""The scale-out workers' session timeout: frozen while the backlog is published, they
keep their partitions this long (the embedded broker holds a group's first join for
half of it)."""


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


async def throughput(settings: Settings, log: Path,
                     broker_pid: int) -> tuple[list[Figure], float]:
    """One worker's figures, and the simulator's publish rate (GPU-samples/s)."""
    await kafka.ensure_topics(settings)
    publish_s = await publish_backlog(settings, BACKLOG_S)
    ends = await sample_ends(settings)
    with WorkerProcess(settings, log) as worker:
        drained = await drain(settings, [worker], ends, broker_pid)
        assert worker.process is not None
        peak_rss = peak_resident_bytes(worker.process.pid)
    publish_rate = sum(ends.values()) * GPUS / publish_s
    return [
        Figure("worker throughput (1 process)", drained.rate, "GPU-samples/s"),
        Figure("worker CPU per node sample (8 GPUs)", drained.cpu_per_record * 1e6, "µs"),
        Figure("worker capacity at one busy core", GPUS / drained.cpu_per_record,
               "GPU-samples/s"),
        Figure("broker busy meanwhile", drained.broker_busy, "cores"),
        Figure("simulator publish rate", publish_rate, "GPU-samples/s"),
        # Every node's state on one worker (a manifest's memory limit must hold it); two
        # minutes of history, where a node's rule state grows for 30 (the leak rule's window).
        Figure("worker peak resident memory, all 1,250 nodes", peak_rss / 2**20, "MiB"),
    ], publish_rate


async def scale_out(settings: Settings, log_dir: Path, count: int,
                    broker_pid: int, backlog_s: float = SCALE_OUT_BACKLOG_S) -> Drained:
    """How ``count`` workers in one group drain the backlog.

    The workers start on empty topics and are measured only once all of them are ready
    with the partitions shared out: a group that forms while a backlog drains would
    measure its rebalances. They are frozen (SIGSTOP) while the simulator publishes the
    backlog, within their session timeout so the group stays as it is, and thawed
    together; the rate is then measured as for one worker.
    """
    await kafka.ensure_topics(settings)
    workers = [WorkerProcess(settings, log_dir / f"worker-{count}-{i}.log")
               for i in range(count)]
    try:
        for worker in workers:
            worker.start()
        await all_ready(workers)
        frozen_at = time.monotonic()
        for worker in workers:
            worker.freeze()
        await publish_backlog(settings, backlog_s)
        ends = await sample_ends(settings)
        frozen_s = time.monotonic() - frozen_at
        if frozen_s > settings.kafka.session_timeout_s * 0.8:
            raise RuntimeError(f"the workers were frozen {frozen_s:.0f} s, too close to their "
                               "session timeout: the group may have rebalanced")
        for worker in workers:
            worker.thaw()
        return await drain(settings, workers, ends, broker_pid)
    finally:
        for worker in workers:
            worker.thaw()
            worker.stop()


async def all_ready(workers: Sequence[WorkerProcess], timeout_s: float = 180.0) -> None:
    """Wait until every worker is ready twice in a row, 2 s apart: each member's join
    rebalances the group and makes all of them not ready until it ends."""
    deadline = time.monotonic() + timeout_s
    stable = 0
    while stable < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(workers)} workers not all ready in {timeout_s:.0f} s")
        if not all(worker.alive for worker in workers):
            raise RuntimeError("a worker exited; see its log")
        stable = stable + 1 if all(worker.probe() for worker in workers) else 0
        await asyncio.sleep(2.0)


async def publish_backlog(settings: Settings, duration_s: float) -> float:
    """Publish ``duration_s`` of the 10,000-GPU fleet as fast as the simulator can;
    seconds."""
    publisher = KafkaPublisher(settings)
    await publisher.start()
    started = time.monotonic()
    await SimulatedCluster(fleet(duration_s, 0.0)).run(publisher)
    await publisher.stop()
    return time.monotonic() - started


async def sample_ends(settings: Settings) -> dict[TopicPartition, int]:
    """The end offset of each partition of the samples topic."""
    reader = kafka.consumer(settings, group_id=None)
    await reader.start()
    try:
        partitions = await kafka.topic_partitions(reader, topics.SAMPLES.name(settings))
        return await kafka.true_end_offsets(reader, partitions)
    finally:
        await reader.stop()


@dataclass(frozen=True)
class Drained:
    """How a group of workers drained a backlog (see :func:`drain`)."""

    rate: float
    """GPU-samples per second."""
    cpu_per_record: float
    """The workers' CPU seconds per node sample."""
    workers_busy: tuple[float, float, float]
    """Each worker's CPU seconds per second (1: a busy core): least, mean, most. Far apart,
    the partitions' work was uneven; all low, the workers waited on something."""
    broker_busy: float
    """The broker's CPU seconds per second (cores)."""
    measured_s: float
    """Seconds of the stretch measured."""
    largest_partition: float
    """The largest partition's share of the backlog over the mean partition's: a worker
    with it has that much more than its share to do."""


async def drain(settings: Settings, workers: Sequence[WorkerProcess],
                ends: dict[TopicPartition, int], broker_pid: int) -> Drained:
    """How fast the workers' group commits the samples up to ``ends``, from a quarter of
    them to the last (no start-up, table recovery or initial placement burst), and the
    CPU the workers and the broker spent over that stretch."""
    total = sum(ends.values())
    group = worker_group(settings)
    pids = [worker.process.pid for worker in workers if worker.process is not None]
    first: tuple[float, int, list[float], float] | None = None
    while True:
        await asyncio.sleep(0.2)
        done = sum(max(0, o) for o in (await kafka.committed(settings, group, ends)).values())
        now, cpu = time.monotonic(), [cpu_seconds(pid) for pid in pids]
        broker_cpu = cpu_seconds(broker_pid)
        if first is None and done >= total // 4:
            first = (now, done, cpu, broker_cpu)
        if done >= total:
            break
    assert first is not None
    processed, wall = total - first[1], now - first[0]
    busy = [(end - start) / wall for start, end in zip(first[2], cpu, strict=True)]
    return Drained(rate=processed * GPUS / wall, cpu_per_record=sum(busy) * wall / processed,
                   workers_busy=(min(busy), sum(busy) / len(busy), max(busy)),
                   broker_busy=(broker_cpu - first[3]) / wall, measured_s=wall,
                   largest_partition=max(ends.values()) * len(ends) / total)


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
    cpus = len(os.sched_getaffinity(0))
    with EmbeddedBroker(log_path=log_dir / "broker.log") as broker:
        assert broker.process is not None
        base, pid = broker.settings(), broker.process.pid
        figures, publish_rate = asyncio.run(throughput(
            base.model_copy(update={"topic_prefix": "bench-tp"}), log_dir / "worker-tp.log",
            pid))
        # As much backlog as the simulator publishes here in half the session timeout.
        backlog_s = float(round(min(SCALE_OUT_BACKLOG_S, max(
            BACKLOG_S, publish_rate / (NODES * GPUS) * SCALE_OUT_SESSION_S / 2))))
        counts = [n for n in SCALE_OUT if n + 2 <= cpus]
        if not counts:
            print(f"  scale-out: not run on {cpus} CPUs (n workers need n + 2: the broker "
                  "and the simulator)")
        else:
            figures.append(Figure("scale-out backlog", backlog_s, "s of the fleet"))
        # Frozen workers keep their partitions for the session timeout only.
        frozen = base.kafka.model_copy(update={"session_timeout_s": SCALE_OUT_SESSION_S})
        for n in counts:
            settings = base.model_copy(update={"topic_prefix": f"bench-so{n}",
                                               "kafka": frozen})
            drained = asyncio.run(scale_out(settings, log_dir, n, pid, backlog_s))
            if n == 1:
                one = drained.rate
                # The same fleet each time: its partitions' shares are the backlog's.
                figures.append(Figure("scale-out largest partition / mean",
                                      drained.largest_partition, "x"))
                label, busy = "1 worker", [("busy", drained.workers_busy[1])]
            else:
                label, busy = f"{n} workers", list(zip(
                    ("busy, least", "busy, mean", "busy, most"), drained.workers_busy,
                    strict=True))
            figures += [
                Figure(f"{label} in one group: throughput", drained.rate, "GPU-samples/s"),
                *([Figure(f"{label}: of {n} x one worker", 100 * drained.rate / (n * one),
                          "%")] if n > 1 else []),
                Figure(f"{label}: CPU per node sample", drained.cpu_per_record * 1e6, "µs"),
                *(Figure(f"{label}: {which}", 100 * share, "% of a core")
                  for which, share in busy),
                Figure(f"{label}: broker busy", drained.broker_busy, "cores"),
                Figure(f"{label}: measured over", drained.measured_s, "s"),
            ]
    return figures
