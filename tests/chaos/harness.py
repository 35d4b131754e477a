"""What the failover test and the chaos experiments share: a faulty fleet run against
real worker processes, and its findings scored against the simulator's ground truth.

The scoring is the one `tests/e2e/test_faulty_fleet.py` states (every injected fault
family found once per episode, nothing else), counted rather than asserted so that an
experiment can print how far off it was:

- missed: a fault the shipped policy must find, with no firing finding;
- false: a firing finding that no injected fault explains;
- false resolutions: a fault that lasts to the end of the run (a GPU off the bus, a
  row-remap failure, an uncorrectable ECC error) reported resolved;
- under two ids: one episode published under more than one finding id, which
  consumers would take for two incidents.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
from aiokafka import TopicPartition

from gpusteward import kafka, topics
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator.engine import GroundTruth
from gpusteward.schema import Action, Finding
from gpusteward.settings import Settings
from tests.e2e.test_faulty_fleet import _expected, _key

NODE_TOPICS = (topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS)
# Faults that, once injected, last to the end of the simulated run.
LASTING = {"gpu_lost", "remap_failure", "ecc_dbe"}


@dataclass
class Score:
    missed: list[tuple[str, str, str]] = field(default_factory=list)
    false: list[tuple[str, str, str]] = field(default_factory=list)
    false_resolutions: list[tuple[str, str, str]] = field(default_factory=list)
    under_two_ids: list[tuple[str, str, str]] = field(default_factory=list)
    actions_repeated: int = 0
    """First asks published more than once under one idempotency key (redeliveries; the
    executor must carry each out once). The worker's re-asks of an open fault's node action
    (``Action.reask`` > 0) are meant, not counted."""

    @property
    def clean(self) -> bool:
        return not (self.missed or self.false or self.false_resolutions or self.under_two_ids)


def score(truth: GroundTruth, findings: Sequence[Finding], actions: Sequence[Action]) -> Score:
    expected = _expected(truth)
    firing = [f for f in findings if f.state == "firing"]
    ids: dict[tuple[str, str, str], set[str]] = {}
    for finding in firing:
        ids.setdefault(_key(finding), set()).add(finding.id)
    keys = [a.idempotency_key for a in actions if not a.reask]
    return Score(
        missed=sorted(set(expected) - set(ids)),
        false=sorted(set(ids) - set(expected)),
        false_resolutions=sorted({_key(f) for f in findings
                                  if f.state == "resolved" and f.kind in LASTING}),
        under_two_ids=sorted(k for k, v in ids.items() if len(v) > 1),
        actions_repeated=len(keys) - len(set(keys)),
    )


async def outputs(settings: Settings) -> tuple[list[Finding], list[Action]]:
    """Every finding and action the run published."""
    finding = msgspec.json.Decoder(Finding).decode
    action = msgspec.json.Decoder(Action).decode
    return (
        [finding(r.value) for r in await kafka.read_all(settings, topics.FINDINGS.name(settings))],
        [action(r.value) for r in await kafka.read_all(settings, topics.ACTIONS.name(settings))],
    )


async def drained(settings: Settings, group: str, timeout_s: float) -> float:
    """Seconds until ``group`` has committed every record of the node topics."""
    started = time.monotonic()
    names = [t.name(settings) for t in NODE_TOPICS]
    await kafka.wait_consumed(settings, group, names, timeout_s=timeout_s)
    return time.monotonic() - started


async def all_ready(workers: Sequence[WorkerProcess], timeout_s: float = 90.0,
                    steady_s: float = 0.0) -> float:
    """Seconds until every worker reports ready at once (the group has settled), and has
    at every probe for ``steady_s`` since: a group whose members rejoin again and again
    is ready only between its rebalances."""
    started = time.monotonic()
    steady_since: float | None = None
    while time.monotonic() - started < timeout_s:
        ready = await asyncio.gather(*(asyncio.to_thread(w.probe) for w in workers))
        if not all(ready):
            steady_since = None
        elif steady_since is None:
            steady_since = time.monotonic()
        if steady_since is not None and time.monotonic() - steady_since >= steady_s:
            return steady_since - started
        dead = [w.log_path for w in workers if not w.alive]
        if dead:
            raise RuntimeError(f"worker exited; see {dead}")
        await asyncio.sleep(0.1)
    raise TimeoutError(f"workers not all ready within {timeout_s}s")


async def resumed(settings: Settings, group: str, timeout_s: float = 60.0) -> float:
    """Seconds until the group has committed progress on every partition that has samples.

    Call it right after the fault. Samples arrive for every node at every tick, so a
    partition whose committed offset does not move is one nobody is working on: the
    dead worker's, until the group notices (a session timeout) and hands it over.
    """
    started = time.monotonic()
    name = topics.SAMPLES.name(settings)
    partitions = [TopicPartition(name, p) for p in range(settings.kafka.node_partitions)]
    at_fault = await kafka.committed(settings, group, partitions)
    reader = kafka.consumer(settings, group_id=None)
    await reader.start()
    try:
        ends = await reader.end_offsets(partitions)
    finally:
        await reader.stop()
    busy = [tp for tp in partitions if ends[tp] > 0]
    while time.monotonic() - started < timeout_s:
        now = await kafka.committed(settings, group, busy)
        if all(now[tp] > at_fault[tp] for tp in busy):
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{group} made no progress on some partition within {timeout_s}s")


@dataclass
class Usage:
    """A process's CPU time and resident memory, read from /proc."""

    cpu_s: float
    rss_mb: float

    @classmethod
    def of(cls, worker: WorkerProcess) -> Usage:
        pid = worker.process.pid if worker.process is not None else None
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            status = open(f"/proc/{pid}/status").read()
        except (OSError, TypeError):
            return cls(float("nan"), float("nan"))
        ticks = os.sysconf("SC_CLK_TCK")
        rss_kb = next(int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("VmRSS:"))
        # Fields 14 and 15 of stat (utime, stime); index 11 and 12 after the name.
        return cls((int(stat[11]) + int(stat[12])) / ticks, rss_kb / 1024)


def cpu_pct(before: Usage, after: Usage, wall_s: float) -> float:
    return 100.0 * (after.cpu_s - before.cpu_s) / wall_s if wall_s > 0 else float("nan")
