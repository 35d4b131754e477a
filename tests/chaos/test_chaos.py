"""Chaos experiments: the faulty-fleet scenario through real workers while things break.

Each experiment is bounded in time, starts its own embedded broker, and checks what the
workers published against the simulator's ground truth (:mod:`tests.chaos.harness`). The
module prints one table at the end (``make chaos``):

- crash loop: one worker SIGKILLed every 20 s through the whole run and restarted at once;
- scale-out: three workers; one SIGKILLed, one SIGSTOPped past the session timeout and
  resumed, a fourth added;
- broker frozen for 60 s (SIGSTOP/SIGCONT) while the publisher buffers;
- broker killed and restarted empty on its port: the embedded broker is memory-only, so
  every topic, record, committed offset and changelog is gone; the worker must notice and
  exit non-zero (its supervisor restarts it, and the start creates the topics again).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from gpusteward import kafka
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.settings import Settings
from gpusteward.streams.app import worker_group
from tests.chaos import harness

pytestmark = pytest.mark.e2e


@dataclass
class Row:
    name: str
    score: harness.Score | None
    resume: str
    before: harness.Usage
    after: harness.Usage
    note: str = ""


ROWS: list[Row] = []


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    out = Table(title="chaos experiments (faulty-fleet, embedded broker)")
    for column in ("experiment", "missed", "false", "false resolutions", "under two ids",
                   "actions repeated", "time to resume", "worker CPU s / RSS MB before",
                   "after", "note"):
        out.add_column(column)
    for row in ROWS:
        s = row.score
        counts = ([str(len(s.missed)), str(len(s.false)), str(len(s.false_resolutions)),
                   str(len(s.under_two_ids)), str(s.actions_repeated)] if s else ["n/a"] * 5)
        out.add_row(row.name, *counts, row.resume,
                    f"{row.before.cpu_s:.1f} / {row.before.rss_mb:.0f}",
                    f"{row.after.cpu_s:.1f} / {row.after.rss_mb:.0f}", row.note)
    Console(width=200).print(out)


def _settings(broker: EmbeddedBroker, name: str) -> Settings:
    return broker.settings().model_copy(update={"topic_prefix": f"chaos-{name}"})


def _simulation(publisher: KafkaPublisher, acceleration: float) -> asyncio.Task[GroundTruth]:
    spec = scenarios.load("faulty-fleet").model_copy(update={"acceleration": acceleration})
    return asyncio.create_task(SimulatedCluster(spec).run(publisher))


async def _finish(settings: Settings, truth: GroundTruth) -> harness.Score:
    findings, actions = await harness.outputs(settings)
    return harness.score(truth, findings, actions)


def _experiment(tmp_path: Path, main: Callable[[EmbeddedBroker], Coroutine[Any, Any, Row]]) -> Row:
    """Run one experiment on a broker of its own; its row joins the printed table."""
    with EmbeddedBroker(log_path=tmp_path / "tansu.log") as broker:
        row = asyncio.run(main(broker))
    ROWS.append(row)
    return row


def _assert_clean(score: harness.Score) -> None:
    assert score.clean, score


def test_crash_loop(tmp_path: Path) -> None:
    async def main(broker: EmbeddedBroker) -> Row:
        settings = _settings(broker, "crash-loop")
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log", instance_id="worker-0")
        publisher = KafkaPublisher(settings)
        await publisher.start()
        readies: list[float] = []
        try:
            worker.start()
            await asyncio.to_thread(worker.wait_ready)
            before = harness.Usage.of(worker)
            simulation = _simulation(publisher, acceleration=60.0)  # 150 s
            while not simulation.done():
                await asyncio.wait({simulation}, timeout=20.0)
                if simulation.done():
                    break
                worker.kill()
                worker.start()
                readies.append(await asyncio.to_thread(worker.wait_ready))
            truth = await simulation
            behind = await harness.drained(settings, worker_group(settings), 120)
            after = harness.Usage.of(worker)
        finally:
            worker.stop()
            await publisher.stop()
        return Row("crash loop (SIGKILL every 20 s)", await _finish(settings, truth),
                   f"restart ready mean {sum(readies) / len(readies):.1f} s, "
                   f"max {max(readies):.1f} s", before, after,
                   f"{len(readies)} kills; drained {behind:.0f} s after the run")

    _assert_clean(_experiment(tmp_path, main).score or harness.Score())


def test_scale_out(tmp_path: Path) -> None:
    async def main(broker: EmbeddedBroker) -> Row:
        settings = _settings(broker, "scale-out")
        await kafka.ensure_topics(settings)
        workers = [WorkerProcess(settings, tmp_path / f"worker-{i}.log",
                                 instance_id=f"worker-{i}") for i in range(4)]
        publisher = KafkaPublisher(settings)
        await publisher.start()
        try:
            for worker in workers[:3]:
                worker.start()
            await harness.all_ready(workers[:3])
            before = harness.Usage.of(workers[1])
            simulation = _simulation(publisher, acceleration=60.0)
            await asyncio.sleep(10)
            workers[0].kill()
            after_kill = await harness.resumed(settings, worker_group(settings))
            frozen_for = settings.kafka.session_timeout_s + 6
            workers[2].freeze()
            stall = asyncio.create_task(harness.resumed(settings, worker_group(settings)))
            await asyncio.sleep(frozen_for)
            workers[2].thaw()
            after_stall = await stall
            workers[3].start()
            after_join = await harness.all_ready(workers[1:])
            truth = await simulation
            behind = await harness.drained(settings, worker_group(settings), 120)
            after = harness.Usage.of(workers[1])
            assert all(w.alive for w in workers[1:])
        finally:
            for worker in workers:
                worker.stop()
            await publisher.stop()
        return Row("scale-out (3 workers: kill, stall, add)", await _finish(settings, truth),
                   f"kill {after_kill:.1f} s, stall {after_stall:.1f} s, "
                   f"join {after_join:.1f} s", before, after,
                   f"stalled {frozen_for:.0f} s; drained {behind:.0f} s after the run")

    _assert_clean(_experiment(tmp_path, main).score or harness.Score())


def test_broker_frozen_for_a_minute(tmp_path: Path) -> None:
    async def main(broker: EmbeddedBroker) -> Row:
        settings = _settings(broker, "freeze")
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log", instance_id="worker-0")
        publisher = KafkaPublisher(settings)
        await publisher.start()
        try:
            worker.start()
            await asyncio.to_thread(worker.wait_ready)
            before = harness.Usage.of(worker)
            simulation = _simulation(publisher, acceleration=60.0)
            await asyncio.sleep(15)
            broker.freeze()
            await asyncio.sleep(60)
            broker.thaw()
            thawed = time.monotonic()
            await asyncio.to_thread(worker.wait_ready, 120)
            resume = time.monotonic() - thawed
            truth = await simulation
            behind = await harness.drained(settings, worker_group(settings), 180)
            after = harness.Usage.of(worker)
            alive = worker.alive
        finally:
            worker.stop()
            await publisher.stop()
        return Row("broker frozen 60 s", await _finish(settings, truth),
                   f"ready {resume:.1f} s after SIGCONT", before, after,
                   f"worker {'alive' if alive else 'restarted'}; drained {behind:.0f} s "
                   "after the run")

    _assert_clean(_experiment(tmp_path, main).score or harness.Score())


def test_broker_killed_and_restarted_empty(tmp_path: Path) -> None:
    """The memory-only broker loses every topic, record, offset and changelog. What must
    hold: the worker notices and exits non-zero instead of retrying forever, and a
    restarted worker creates the topics again and is ready."""

    async def main(broker: EmbeddedBroker) -> Row:
        settings = _settings(broker, "restart")
        await kafka.ensure_topics(settings)
        worker = WorkerProcess(settings, tmp_path / "worker.log", instance_id="worker-0")
        worker.start()
        try:
            await asyncio.to_thread(worker.wait_ready)
            before = harness.Usage.of(worker)
            broker.kill()
            await asyncio.to_thread(broker.start)  # the same port, no topics
            restarted = time.monotonic()
            assert worker.process is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(worker.process.wait, 60)
            noticed = time.monotonic() - restarted
            code = worker.exit_code
            worker.start()
            ready = await asyncio.to_thread(worker.wait_ready, 90)
            after = harness.Usage.of(worker)
        finally:
            worker.stop()
        assert code not in (None, 0), "the worker kept running against an empty broker"
        return Row("broker killed, restarted empty", None,
                   f"exit {code} after {noticed:.1f} s; restart ready {ready:.1f} s",
                   before, after, "memory-only: all topics, records, offsets, tables lost")

    _experiment(tmp_path, main)
