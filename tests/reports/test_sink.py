"""The rollup sink on the embedded broker: topic in, Parquet out, bad records dead-lettered."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import polars as pl
import pytest
from aiokafka import ConsumerRecord

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.health import probe
from gpusteward.reports import build, compute, findings, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.reports.sink import RollupSink, findings_sink, results_sink, rollup_sink
from gpusteward.sandbox.pipeline import settings_env
from gpusteward.schema import (
    ActionResult,
    DeadLetter,
    Evidence,
    Finding,
    Outcome,
    PodRef,
    Rollup,
    Subject,
)
from gpusteward.settings import Settings
from gpusteward.streams.node import NodeJoin, NodeState
from gpusteward.topics import TopicSpec
from tests.conftest import metrics_page
from tests.streams.test_node_clock import feed
from tests.streams.test_node_join import POD, allocation, node_sample

T0 = 1_763_337_600.0


@pytest.mark.e2e
def test_sink_writes_what_it_reads_and_dead_letters_the_rest(settings: Settings,
                                                             tmp_path: Path) -> None:
    report = ReportSettings(flush_rows=4, flush_interval_s=0.5, retention_days=30)
    # Even minutes are held by team a's pod; of those, every other one is idle (peak < 5 %).
    rollups = [Rollup(ts=T0 + 60 * i, node=f"n{i % 3}", uuid=f"GPU-{i % 3}", model="H100-80GB",
                      samples=4, util_mean=float(i),
                      util_max=2.0 if i % 4 == 0 else 50.0,
                      pod="p" if i % 2 == 0 else None, namespace="ns" if i % 2 == 0 else None,
                      team="a" if i % 2 == 0 else None) for i in range(10)]

    async def main() -> tuple[RollupSink, list[ConsumerRecord]]:
        await kafka.ensure_topics(settings)
        producer = kafka.producer(settings)
        await producer.start()
        topic = topics.ROLLUPS.name(settings)
        for rollup in rollups[:5]:
            await producer.send(topic, msgspec.json.encode(rollup), key=rollup.node.encode())
        await producer.send(topic, b"{not json", key=b"n0")
        for rollup in rollups[5:]:
            await producer.send(topic, msgspec.json.encode(rollup), key=rollup.node.encode())
        await producer.flush()
        await producer.stop()
        sink = RollupSink(settings, report, directory=tmp_path)
        stop = asyncio.Event()
        task = asyncio.create_task(sink.run(stop))
        for _ in range(300):
            if sink.rows_written + len(sink.buffer) >= 10 and sink.refusals.count == 1:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 30)
        return sink, await kafka.read_all(settings, topics.DEADLETTER.name(settings))

    sink, dead = asyncio.run(main())
    assert sink.rows_written == 10 and sink.buffer == []
    frame = store.scan(tmp_path, T0, T0 + 86400).collect().sort("ts")
    assert frame["util_mean"].to_list() == [float(i) for i in range(10)]
    assert frame.schema["util_mean"] == pl.Float32
    assert len(dead) == 1
    letter = msgspec.json.decode(dead[0].value or b"", type=DeadLetter)
    assert letter.value == b"{not json" and letter.source_topic.endswith("rollups.v1")
    registry, topic = sink.metrics.registry, topics.ROLLUPS.name(settings)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("gpusteward_records_in_total", topic=topic) == 11
    assert value("gpusteward_dead_letters_total", topic=topic, reason="malformed") == 1
    assert value("gpusteward_sink_written_rows_total", topic=topic) == 10
    assert value("gpusteward_sink_written_bytes_total", topic=topic) == sum(
        path.stat().st_size for path in tmp_path.rglob("*.parquet"))
    seconds = {state: value("gpusteward_gpu_seconds_total", pool="H100-80GB", team="a",
                            state=state) for state in ("allocated", "busy", "idle")}
    assert seconds == {"allocated": 300.0, "busy": 120.0, "idle": 180.0}
    cost = value("gpusteward_gpu_idle_cost_usd_total", pool="H100-80GB", team="a")
    assert cost == pytest.approx(3.5 * 180 / 3600)


@pytest.mark.e2e
def test_redelivered_rollups_are_written_once(settings: Settings, tmp_path: Path) -> None:
    """A worker re-publishes the minutes it had emitted before a crash: same names."""
    report = ReportSettings(flush_rows=1000, flush_interval_s=0.3)
    first = [Rollup(ts=T0 + 60 * i, node="n0", uuid="GPU-0", model="m", samples=6,
                    util_mean=float(i)) for i in range(6)]
    # The replay after the crash: the last three again, one of them only partly folded.
    again = [first[3], msgspec.structs.replace(first[4], samples=2, util_mean=99.0), first[5]]

    sink = asyncio.run(_drain(rollup_sink(settings, report, directory=tmp_path),
                              topics.ROLLUPS, first + again, key=b"n0", count=9))
    assert (sink.rows_written, sink.duplicates) == (6, 3)
    frame = store.scan(tmp_path, T0, T0 + 86400).collect().sort("ts")
    assert frame["util_mean"].to_list() == [float(i) for i in range(6)]


@pytest.mark.e2e
def test_findings_sink_keeps_each_ladder_step_once(settings: Settings, tmp_path: Path) -> None:
    """The idle rule's ladder on findings.v1, redelivered, lands in the findings store once."""
    report = ReportSettings(flush_rows=1000, flush_interval_s=0.3)
    pod = PodRef(namespace="ml", name="nb-0")
    steps = [Finding(id="idle-1", fingerprint="fp", kind="idle_holder", severity="info",
                     state="firing", subject=Subject(node="n0", device="GPU-0", pod=pod),
                     summary=f"step {s}", starts_at=T0, ts=T0 + 600 * s,
                     evidence=Evidence(window_start=T0, window_end=T0 + 600 * s,
                                       values={"ladder_step": float(s)}),
                     labels={"reclaim": "execute", "owner": "Notebook/nb"}) for s in (1, 2, 3)]

    sink = asyncio.run(_drain(findings_sink(settings, report, directory=tmp_path),
                              topics.FINDINGS, [*steps, steps[2]], key=b"fp", count=4))
    assert (sink.rows_written, sink.duplicates) == (3, 1)
    stored = findings.read(tmp_path, T0, T0 + 86400).sort("ts")
    assert stored["ladder_step"].to_list() == [1, 2, 3]
    assert stored["pod"].to_list() == ["nb-0"] * 3
    (ladder,) = findings.idle_ladder(stored).iter_rows(named=True)
    assert (ladder["ladder_step"], ladder["reclaim"]) == (3, "execute")


def test_each_write_applies_the_retention_in_days(tmp_path: Path) -> None:
    """The store keeps ``retention_days`` days up to the newest row written (no broker)."""
    sink = RollupSink(Settings(), ReportSettings(retention_days=2), directory=tmp_path)
    sink.buffer = [Rollup(ts=T0 + day * 86400, node="n0", uuid="GPU-0", model="m", samples=1)
                   for day in range(4)]
    asyncio.run(sink._flush())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day=2025-11-19", "day=2025-11-20"]
    assert sink.rows_written == 4


@pytest.mark.e2e
def test_results_sink_keeps_each_decision_once(settings: Settings, tmp_path: Path) -> None:
    """The executor's audit records, a retried attempt and a redelivery among them, land in
    the action-result store once each, and say the idle reclaim was executed."""
    report = ReportSettings(flush_rows=1000, flush_interval_s=0.3)
    target = Subject(node="n0", pod=PodRef(namespace="ml", name="nb-0"))
    tries: list[tuple[int, Outcome]] = [(1, "retrying"), (2, "executed")]
    records = [ActionResult(idempotency_key="idle-1/requeue", verb="requeue", target=target,
                            outcome=outcome, detail=outcome, actor="executor",
                            ts=T0 + attempt, attempt=attempt) for attempt, outcome in tries]

    sink = asyncio.run(_drain(results_sink(settings, report, directory=tmp_path),
                              topics.ACTION_RESULTS, [*records, records[1]],
                              key=b"idle-1/requeue", count=3))
    assert (sink.rows_written, sink.duplicates) == (2, 1)
    stored = findings.read_results(tmp_path, T0).sort("ts")
    assert stored["outcome"].to_list() == ["retrying", "executed"]
    assert stored["pod"].to_list() == ["nb-0"] * 2
    idle = findings.frame([Finding(
        id="idle-1", fingerprint="fp", kind="idle_holder", severity="warning", state="firing",
        subject=target, summary="reclaiming it", starts_at=T0 - 3600, ts=T0,
        labels={"reclaim": "execute"})])
    (reclaim,) = findings.idle_reclaims(idle, stored).iter_rows(named=True)
    assert (reclaim["pod"], reclaim["outcome"]) == ("nb-0", "executed")


async def _drain(sink: RollupSink, topic: TopicSpec, records: list[Any], key: bytes,
                 count: int) -> RollupSink:
    """Publish ``records`` on ``topic``, run ``sink`` until it has seen ``count`` of them
    (written or dropped as repeats), and stop it as on shutdown."""
    settings = sink.settings
    await kafka.ensure_topics(settings)
    producer = kafka.producer(settings)
    await producer.start()
    for record in records:
        await producer.send(topic.name(settings), msgspec.json.encode(record), key=key)
    await producer.flush()
    await producer.stop()
    stop = asyncio.Event()
    task = asyncio.create_task(sink.run(stop))
    for _ in range(300):
        if sink.rows_written + sink.duplicates >= count:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 30)
    return sink


@pytest.mark.e2e
def test_sink_command_is_probed_scraped_and_flushes_on_sigterm(settings: Settings,
                                                               tmp_path: Path) -> None:
    """`gpusteward sink rollups` as the Deployment runs it: ready on its health port once
    its topics exist, its rows on /metrics, and a SIGTERM (the pod stopped) writes the rows
    still buffered before it exits 0: none waits for a redelivery."""
    health, metrics = free_port(), free_port()
    env = {**os.environ, **settings_env(settings.model_copy(update={"health_port": health})),
           "GPUSTEWARD_METRICS__PORT": str(metrics),
           # Nothing flushes on its own during the test: only the stop can write the rows.
           "GPUSTEWARD_REPORT__FLUSH_ROWS": "100000",
           "GPUSTEWARD_REPORT__FLUSH_INTERVAL_S": "3600"}
    rollups = [Rollup(ts=T0 + 60 * i, node="n0", uuid="GPU-0", model="H100-80GB", samples=60,
                      util_mean=float(i)) for i in range(6)]
    asyncio.run(_publish(settings, rollups))
    log = tmp_path / "sink.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-P", "-m", "gpusteward.cli", "sink", "rollups",
             "--dir", str(tmp_path / "store")],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        topic = topics.ROLLUPS.name(settings)
        read = f'gpusteward_records_in_total{{topic="{topic}"}} 6.0'
        deadline = time.monotonic() + 60
        while not (probe(health) == 200 and read in metrics_page(metrics)):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert not list((tmp_path / "store").rglob("*.parquet"))  # still buffered
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    frame = store.scan(tmp_path / "store", T0, T0 + 86400).collect().sort("ts")
    assert frame["util_mean"].to_list() == [float(i) for i in range(6)]
    assert "6 rows in 1 files" in log.read_text()


async def _publish(settings: Settings, rollups: list[Rollup]) -> None:
    await kafka.ensure_topics(settings)
    producer = kafka.producer(settings)
    await producer.start()
    for rollup in rollups:
        await producer.send(topics.ROLLUPS.name(settings), msgspec.json.encode(rollup),
                            key=rollup.node.encode())
    await producer.flush()
    await producer.stop()


@pytest.mark.e2e
def test_minutes_a_node_names_again_on_its_new_clock_are_all_reported(settings: Settings,
                                                                      tmp_path: Path) -> None:
    """A node's collector clock steps back an hour (an NTP step, a VM restored from a
    snapshot) while its pod is held: two hours busy, then idle on the new clock. Once the
    node join takes the new clock it names again minutes it named on the old one; each is
    a minute the pod held its GPU. Through the topic, the sink and the store, the report
    counts every one of them: none dropped as a repeat of the other clock's minute."""
    week = compute.parse_week("2026-W47")
    start = week.start + 86400
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, msgspec.structs.replace(allocation("running", start),
                                                      started_at=start))
    out, refused = feed(join, state, [node_sample(start + i * 30, 90.0) for i in range(241)]
                        + [node_sample(start + 3630 + i * 30, 0.0) for i in range(80)])
    out += join.fold.flush(state.rollups, "n1")
    rollups = [o for o in out if isinstance(o, Rollup)]
    held = [r for r in rollups if r.pod is not None]
    busy = [r for r in held if r.util_max is not None and r.util_max >= 5]
    idle = [r for r in held if r.util_max is not None and r.util_max < 5]
    assert refused == 10 and (len(busy), len(idle)) == (121, 36)
    assert {r.ts for r in idle} <= {r.ts for r in busy}  # the new clock's minutes, again

    sink = asyncio.run(_drain(rollup_sink(settings, ReportSettings(flush_interval_s=0.3),
                                          directory=tmp_path),
                              topics.ROLLUPS, rollups, key=b"n1", count=len(rollups)))
    assert (sink.rows_written, sink.duplicates) == (len(rollups), 0)
    data = build.build(tmp_path, week, ReportSettings()).data
    team = {t["team"]: t for t in data["teams"]}[POD.namespace]
    assert team["allocated_gpu_hours"] == pytest.approx(157 / 60)
    assert team["idle_gpu_hours"] == pytest.approx(36 / 60)
    (holder,) = data["idle_holders"]
    assert holder["pod"] == POD.name and holder["idle_gpu_hours"] == pytest.approx(36 / 60)


class _Killed(Exception):
    """The sink's process killed (OOM, node lost) right after a file is in place."""


@pytest.mark.e2e
def test_a_sink_killed_between_its_file_and_its_commit_loses_and_doubles_nothing(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sink writes a day's file and is killed before it commits: nothing committed,
    its next start re-reads the topic from the group's last commit and writes the same
    rollups again. The store then holds each twice; the report counts each minute once,
    the two hours held and nothing else."""
    week = compute.parse_week("2026-W47")
    rollups = [Rollup(ts=week.start + 60 * i, node="n0", uuid="GPU-0", model="H100-80GB",
                      samples=6, util_mean=0.0, util_max=0.0, namespace="ml", pod="nb",
                      team="t") for i in range(120)]
    report = ReportSettings(flush_rows=1000, flush_interval_s=0.3)
    first = rollup_sink(settings, report, directory=tmp_path)
    written = first._flush

    async def killed_after_the_file() -> None:
        await written()
        raise _Killed

    monkeypatch.setattr(first, "_flush", killed_after_the_file)
    with pytest.raises(_Killed):
        asyncio.run(_drain(first, topics.ROLLUPS, rollups, key=b"n0", count=len(rollups)))
    assert first.rows_written == len(rollups)

    again = asyncio.run(_drain(rollup_sink(settings, report, directory=tmp_path),
                               topics.ROLLUPS, [], key=b"n0", count=len(rollups)))
    assert again.rows_written == len(rollups)  # re-read from the last commit: none
    assert store.count_rows(tmp_path, week.start, week.end) == 2 * len(rollups)
    data = build.build(tmp_path, week, ReportSettings()).data
    assert data["totals"]["allocated_gpu_hours"] == pytest.approx(2.0)
    assert data["totals"]["idle_gpu_hours"] == pytest.approx(2.0)
    assert data["totals"]["device_minutes"] == len(rollups)
