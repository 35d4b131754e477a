"""A worker killed between publishing a finding and writing the state that says so loses nothing.

The node join and the fleet agent write two things for a record that fires a rule:
the findings and actions, and their state (a changelog), which records them as
reported so that they are not fired again. The scale-out chaos experiment lost two XID findings
when a worker died after the state landed and before the findings did: recovery
read "already reported" and re-processing emitted nothing. The worker now waits for
the findings' delivery before it writes the state
(:meth:`OutputTopics.emit_then_checkpoint`). Here a real worker process is made to
die in exactly that window (``killed_between_writes.py``), and a fresh worker then
re-processes the record: the finding is on the topic, under one id. The fleet agent
wrote its state first until its batches too waited for their findings' delivery, and
its other two tables (the latest summary per node, the MIG workloads) first until they
were staged with that state: a worker killed in between left summaries from after the
record the fleet state is at, and re-processing judged the fleet with its future.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.rules import queue as queue_rules
from gpusteward.rules import xid as xid_rule
from gpusteward.sandbox.pipeline import WorkerProcess, settings_env
from gpusteward.schema import DeviceSample, Finding, HwEvent, NodeSample, NodeSummary, QueueEvent
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.streams import killed_between_writes

pytestmark = pytest.mark.e2e

T0 = 1_700_000_000.0
SCRIPT = Path(killed_between_writes.__file__)


Record = tuple[topics.TopicSpec, bytes, msgspec.Struct]
"""What to publish: the topic, the key and the record."""


def _node_records() -> list[Record]:
    """A sample of node n1, then an XID that takes its GPU out of service (a finding)."""
    sample = NodeSample(ts=T0, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-0", index=0, model="NVIDIA H100 80GB HBM3", util_pct=50.0)])
    xid = HwEvent(ts=T0 + 5, node="n1", kind="xid", uuid="GPU-0", xid=119)
    return [(topics.SAMPLES, b"n1", sample), (topics.HW_EVENTS, b"n1", xid)]


def _fleet_records() -> list[Record]:
    """A 1-GPU workload pending on a full fleet for 15 minutes: its wait breaches the SLO."""
    pending = QueueEvent(ts=T0, name="api", namespace="serve", cluster_queue="prod",
                         state="pending", created_at=T0, gpus=1)
    summaries = [NodeSummary(ts=T0 + t, node="n0", gpu_model="H100", gpus_total=8, gpus_free=0)
                 for t in range(0, 900, 30)]
    return [(topics.QUEUE, b"prod", pending),
            *((topics.NODE_SUMMARIES, b"n0", summary) for summary in summaries)]


async def _publish(settings: Settings, records: list[Record]) -> None:
    producer = kafka.producer(settings)
    await producer.start()
    try:
        for spec, key, record in records:
            await producer.send_and_wait(spec.name(settings), msgspec.json.encode(record),
                                         key=key)
    finally:
        await producer.stop()


def _killed_worker(settings: Settings, log: Path) -> int:
    """Run the worker that dies between the writes; its exit code."""
    env = {**os.environ, **settings_env(settings.model_copy(update={"health_port": free_port()}))}
    with open(log, "ab") as out:
        return subprocess.run(
            [sys.executable, "-P", str(SCRIPT), "--datadir", tempfile.mkdtemp(), "--loglevel",
             "warn"], env=env, stdout=out, stderr=subprocess.STDOUT, timeout=60,
            cwd=Path(__file__).resolve().parents[2]).returncode


def _killed_then_recovered(settings: Settings, tmp_path: Path,
                           records: list[Record]) -> list[Finding]:
    """The findings on the topic after a worker died between the writes and a fresh one
    re-processed what it had not committed."""
    asyncio.run(kafka.ensure_topics(settings))
    asyncio.run(_publish(settings, records))
    code = _killed_worker(settings, tmp_path / "killed.log")
    assert code != killed_between_writes.WRITTEN_FIRST, (
        "the state saying the finding was reported was written before the finding was delivered")
    assert code != killed_between_writes.SUMMARIES_AHEAD, (
        "the node summary that fired the finding was written before the finding was delivered")
    assert code == killed_between_writes.KILLED_BETWEEN, (tmp_path / "killed.log").read_text()

    # A fresh worker recovers the state the dead one wrote and re-processes what it had not
    # committed; the finding must be on the topic whatever it re-emits, and under one id.
    worker = WorkerProcess(settings, tmp_path / "fresh.log")
    worker.start()
    try:
        worker.wait_ready()
        asyncio.run(kafka.wait_consumed(settings, worker_group(settings),
                                        sorted({spec.name(settings) for spec, _, _ in records}),
                                        timeout_s=30))
    finally:
        worker.stop()
    decode = msgspec.json.Decoder(Finding).decode
    return [decode(r.value) for r in asyncio.run(
        kafka.read_all(settings, topics.FINDINGS.name(settings)))]


def test_a_kill_between_finding_and_state_loses_no_finding(settings: Settings,
                                                            tmp_path: Path) -> None:
    found = _killed_then_recovered(settings, tmp_path, _node_records())
    xids = {f.id for f in found if f.kind == xid_rule.KIND and f.state == "firing"}
    assert len(xids) == 1, found


def test_a_kill_between_fleet_finding_and_fleet_tables_loses_no_finding(
        settings: Settings, tmp_path: Path) -> None:
    """The fleet state and the summary that fired the breach, both after the finding."""
    found = _killed_then_recovered(settings, tmp_path, _fleet_records())
    breaches = {f.id for f in found if f.kind == queue_rules.WAIT_KIND and f.state == "firing"}
    assert len(breaches) == 1, found
