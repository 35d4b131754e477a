"""Fault → action latency on the embedded broker, hop by hop.

The simulator feeds a 10,000-GPU fleet live at 1 Hz to one worker process and
one executor process (``gpusteward act --dry-run``, the production command).
After 40 s, once the worker has absorbed the fleet's initial placement,
double-bit ECC errors appear on 30 nodes, one every 2 s: every other one only
in the samples, the others also as the urgent hardware event the NVML
collector sends at once. Each is followed to its audit record.

Every hop is timed from what is already on the wire, so nothing is added to the
contract: the wall-clock time the record is handed to the publisher (created),
the Kafka timestamp the producer stamps on it (produced), the time a reader
with the worker's fetch settings receives it (fetched: the broker's part), the
Kafka timestamp of the cordon action (decided and sent by the worker), the
executor's decision time (``ActionResult.ts``), the audit record's Kafka
timestamp and the time a reader receives it. All processes share one host
clock; Kafka timestamps are whole milliseconds.

The faulty nodes publish through a publisher of their own, as each node's own
collector does in production; the rest of the fleet shares one, whose queue
is an artefact of simulating 1,250 nodes in one process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from bench_worker import fleet
from figures import Figure

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.children import die_with_parent, stop_child
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess, settings_env
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.schema import Action, ActionResult, HwEvent, NodeSample
from gpusteward.settings import Settings

T = TypeVar("T")
FAULTS = 30
WARM_UP_S = 40


def fault_node(i: int) -> str:
    return f"h100-{10 + 40 * i}"


def scenario() -> Scenario:
    return fleet(WARM_UP_S + 2 * FAULTS + 5, 1.0, name="fleet-10k-faults", faults=[
        {"kind": "ecc_dbe", "node": fault_node(i), "at_s": WARM_UP_S + 2 * i,
         "urgent_event": i % 2 == 1} for i in range(FAULTS)])


@dataclass
class Fault:
    """The times (wall clock, seconds) one fault passed each hop; None until it did."""

    urgent: bool
    created: float | None = None
    """The first record showing the fault was handed to a publisher."""
    record: str = ""
    """Which record that was: ``sample`` or ``hw_event``; the later hops follow it."""
    produced: float | None = None
    fetched: float | None = None
    decided: float | None = None
    action_fetched: float | None = None
    executed: float | None = None
    audited: float | None = None
    audit_fetched: float | None = None
    seen: set[str] = field(default_factory=set)


class QuietLoop:
    """An event loop in a thread of its own, for what must not wait on the simulator.

    The simulator keeps its loop busy generating 1,250 samples a second; a record or a
    fetch waiting on that loop would time the benchmark, not the pipeline. The GIL is
    handed over every millisecond (``sys.setswitchinterval``) while it runs.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="quiet-loop",
                                       daemon=True)

    def __enter__(self) -> QuietLoop:
        self.switch = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
        sys.setswitchinterval(self.switch)

    async def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the quiet loop and wait for it from the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    def soon(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Hand ``coroutine`` to the quiet loop without waiting (in order of handing)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)


class FaultPublisher(KafkaPublisher):
    """The fleet's publisher; the faulty nodes' records go through a publisher of their own
    on the quiet loop, as each node's own collector does in production."""

    def __init__(self, settings: Settings, faults: dict[str, Fault], quiet: QuietLoop) -> None:
        super().__init__(settings)
        self.own = KafkaPublisher(settings)
        self.faults = faults
        self.quiet = quiet

    async def start(self) -> None:
        await super().start()
        await self.quiet.run(self.own.start())

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        await self.quiet.run(self.own.stop(drain_timeout_s))
        await super().stop(drain_timeout_s)

    async def sample(self, sample: NodeSample) -> None:
        fault = self.faults.get(sample.node)
        if fault is None:
            return await super().sample(sample)
        if fault.created is None and any(d.ecc_dbe_volatile for d in sample.devices):
            fault.created, fault.record = time.time(), "sample"
        self.quiet.soon(self.own.sample(sample))

    async def hw_event(self, event: HwEvent) -> None:
        fault = self.faults.get(event.node)
        if fault is None:
            return await super().hw_event(event)
        if fault.created is None and event.kind == "ecc_dbe":
            fault.created, fault.record = time.time(), "hw_event"
        self.quiet.soon(self.own.hw_event(event))


async def follow(settings: Settings, faults: dict[str, Fault], stop: asyncio.Event,
                 done: asyncio.Event) -> None:
    """Note when each fault's records reach a reader, and their Kafka timestamps."""
    names = {topics.SAMPLES.name(settings): "sample", topics.HW_EVENTS.name(settings): "hw_event",
             topics.ACTIONS.name(settings): "action",
             topics.ACTION_RESULTS.name(settings): "audit"}
    reader = kafka.consumer(settings, *names, group_id=None, auto_offset_reset="latest")
    await reader.start()
    decode_sample = msgspec.json.Decoder(NodeSample).decode
    decode_event = msgspec.json.Decoder(HwEvent).decode
    decode_action = msgspec.json.Decoder(Action).decode
    decode_result = msgspec.json.Decoder(ActionResult).decode
    try:
        while not stop.is_set():
            batch = await reader.getmany(timeout_ms=100)
            now = time.time()
            for tp, records in batch.items():
                kind = names[tp.topic]
                for record in records:
                    stamp = record.timestamp / 1000
                    if kind in ("sample", "hw_event"):
                        fault = faults.get((record.key or b"").decode())
                        if fault is None or fault.fetched is not None or fault.record != kind:
                            continue
                        shows = (decode_event(record.value).kind == "ecc_dbe"
                                 if kind == "hw_event" else
                                 any(d.ecc_dbe_volatile
                                     for d in decode_sample(record.value).devices))
                        if shows:
                            fault.produced, fault.fetched = stamp, now
                    elif kind == "action":
                        action = decode_action(record.value)
                        fault = faults.get(action.target.node or "")
                        if fault is not None and action.verb == "cordon" and fault.decided is None:
                            fault.decided, fault.action_fetched = stamp, now
                    else:
                        result = decode_result(record.value)
                        fault = faults.get(result.target.node or "")
                        if (fault is not None and result.verb == "cordon"
                                and fault.executed is None):
                            fault.executed, fault.audited, fault.audit_fetched = (
                                result.ts, stamp, now)
                            if all(f.audit_fetched for f in faults.values()):
                                done.set()
    finally:
        await reader.stop()


HOPS = [
    ("publisher: handed over -> produced", "created", "produced"),
    ("broker: produced -> fetched by a reader", "produced", "fetched"),
    ("worker: fetched -> cordon action produced", "fetched", "decided"),
    ("executor: action produced -> decided", "decided", "executed"),
    ("executor: decided -> audit produced", "executed", "audited"),
    ("broker: audit produced -> fetched", "audited", "audit_fetched"),
]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def breakdown(faults: list[Fault], label: str) -> list[Figure]:
    """p50/p99 of each hop and of the whole path, in ms, over the faults that completed it."""
    figures: list[Figure] = []
    complete = [f for f in faults if f.created is not None and f.audit_fetched is not None]
    for name, start, end in [*HOPS, ("total: handed over -> cordon action fetched",
                                     "created", "action_fetched"),
                             ("total: handed over -> audit fetched", "created",
                              "audit_fetched")]:
        delays = [(getattr(f, end) - getattr(f, start)) * 1000 for f in complete]
        if not delays:
            continue
        for q in (50, 99):
            figures.append(Figure(f"{label} {name}, p{q}", percentile(delays, q), "ms"))
    figures.append(Figure(f"{label} faults measured", float(len(complete)),
                          f"({len(faults) - len(complete)} missing)"))
    return figures


async def _events() -> tuple[asyncio.Event, asyncio.Event]:
    return asyncio.Event(), asyncio.Event()


def start_executor(settings: Settings, log_path: Path) -> subprocess.Popen[bytes]:
    """``gpusteward act --dry-run``, the production executor, as a child process."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "gpusteward.cli", "act", "--dry-run",
             "--backend", "none"], env={**os.environ, **settings_env(settings)},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent)


async def latency(settings: Settings, log_dir: Path) -> list[Figure]:
    await kafka.ensure_topics(settings)
    faults = {fault_node(i): Fault(urgent=i % 2 == 1) for i in range(FAULTS)}
    with QuietLoop() as quiet:
        # Both events belong to the quiet loop, where the reader runs.
        stop, done = await quiet.run(_events())
        following = quiet.soon(follow(settings, faults, stop, done))
        publisher = FaultPublisher(settings, faults, quiet)
        await publisher.start()
        executor = start_executor(settings, log_dir / "executor.log")
        try:
            with WorkerProcess(settings, log_dir / "worker.log"):
                await SimulatedCluster(scenario()).run(publisher)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(quiet.run(done.wait()), timeout=30)
        finally:
            stop_child(executor, 15.0)
            quiet.loop.call_soon_threadsafe(stop.set)
            await asyncio.wrap_future(following)
            await publisher.stop()
    by_path = [f for f in faults.values() if not f.urgent], [f for f in faults.values()
                                                             if f.urgent]
    return [*breakdown(by_path[0], "DBE in a sample:"),
            *breakdown(by_path[1], "DBE urgent event:"),
            Figure("consumer fetch wait (fetch_max_wait_ms)",
                   float(settings.kafka.fetch_max_wait_ms), "ms")]


def run() -> list[Figure]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    with EmbeddedBroker(log_path=log_dir / "broker.log") as broker:
        settings = broker.settings().model_copy(update={"topic_prefix": "bench-lat"})
        return asyncio.run(latency(settings, log_dir))
