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
  exit non-zero (its supervisor restarts it, and the start creates the topics again);
- the remediation executor (``gpusteward act --execute`` on the API-server double) killed
  again and again right after changing the cluster and before auditing: every effect
  must happen once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console
from rich.table import Table

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.children import stop_child
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.pipeline import WorkerProcess, settings_env
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import Action, ActionResult, ActionVerb, PodRef, Subject
from gpusteward.settings import Settings
from gpusteward.streams.outputs import subject_key
from gpusteward.topics import worker_group
from tests.chaos import executor_dies, harness
from tests.remediation import cluster

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


def test_executor_killed_between_deciding_and_auditing(tmp_path: Path) -> None:
    """Cordons and owner notices for 30 nodes; the executor dies after 1 to 4 effects, five
    times, each time before the last one's audit record; then one runs to the end. Every
    effect must be in the cluster once and every action audited with one final outcome."""
    nodes = [f"gpu-{i:02d}" for i in range(30)]

    def actions() -> list[Action]:
        out = []
        for name in nodes:
            pairs: tuple[tuple[ActionVerb, Subject], ...] = (
                ("cordon", Subject(node=name)),
                ("notify_owner", Subject(pod=PodRef("ml", f"job-{name}"))))
            for verb, target in pairs:
                out.append(Action(idempotency_key=f"{name}-dbe/{verb}", verb=verb,
                                  target=target, reason=f"ECC DBE on {name}", rule="ecc_dbe",
                                  finding_ids=[f"{name}-dbe"], ts=time.time()))
        return out

    async def main(broker: EmbeddedBroker) -> Row:
        settings = _settings(broker, "executor")
        await kafka.ensure_topics(settings)
        sent = actions()
        producer = kafka.producer(settings)
        await producer.start()
        try:
            for action in sent:
                await producer.send(topics.ACTIONS.name(settings), msgspec.json.encode(action),
                                    key=subject_key(action.target).encode())
            await producer.flush()
        finally:
            await producer.stop()
        with KubeApiServer() as kube:
            kube.load([cluster.node(n) for n in nodes])
            kube.load([cluster.pod("ml", f"job-{n}", n) for n in nodes])
            kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
            env = {**os.environ, **settings_env(settings),
                   "GPUSTEWARD_REMEDIATION__BREAKER_MAX_NODES": "1000",
                   "GPUSTEWARD_REMEDIATION__BREAKER_MAX_FRACTION": "1.0"}
            args = ["--execute", "--backend", "kubernetes", "--kubeconfig", str(kubeconfig),
                    "--enable-rule", "ecc_dbe"]
            codes = []
            started = time.monotonic()
            for after in (3, 1, 4, 2, 4):
                codes.append(await asyncio.to_thread(subprocess.call, [
                    sys.executable, "-P", str(Path(executor_dies.__file__)), *args],
                    env={**env, "GPUSTEWARD_CHAOS_DIE_AFTER": str(after)}, stdout=log,
                    stderr=subprocess.STDOUT, timeout=120))
            keys = {a.idempotency_key for a in sent}
            survivor = await asyncio.to_thread(
                subprocess.Popen, [sys.executable, "-P", "-m", "gpusteward.cli", "act", *args],
                env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                audit: list[ActionResult] = []
                for _ in range(600):
                    audit = [msgspec.json.decode(r.value or b"", type=ActionResult)
                             for r in await kafka.read_all(
                                 settings, topics.ACTION_RESULTS.name(settings))]
                    if keys <= {r.idempotency_key for r in audit}:
                        break
                    await asyncio.sleep(0.2)
            finally:
                stop_child(survivor, 15)
            done_s = time.monotonic() - started
            cordons = Counter(r.path for r in kube.requests
                              if r.method == "PATCH" and r.path.startswith("/api/v1/nodes/"))
            notices = Counter(e["involvedObject"]["name"] for e in kube.objects("Event"))
        finals = Counter(r.idempotency_key for r in audit if r.outcome != "retrying")
        twice = (sum(count - 1 for count in cordons.values() if count > 1)
                 + sum(count - 1 for count in notices.values() if count > 1))
        missing = (len(nodes) - len(cordons)) + (len(nodes) - len(notices))
        outcomes = Counter(r.outcome for r in audit)
        nothing = harness.Usage(float("nan"), float("nan"))
        row = Row("executor killed between acting and auditing", None,
                  f"all audited {done_s:.0f} s after the first start", nothing, nothing,
                  f"{codes.count(executor_dies.KILLED)} kills; effects twice {twice}, "
                  f"missing {missing}; audit {dict(outcomes)}")
        assert codes == [executor_dies.KILLED] * 5, codes
        assert twice == 0 and missing == 0, (cordons, notices)
        assert set(finals) == keys
        return row

    with open(tmp_path / "executor.log", "ab") as log:
        _experiment(tmp_path, main)


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
