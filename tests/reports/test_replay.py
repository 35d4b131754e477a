"""The GenAI trace replayed into the pipeline's records, the rollup store and a report."""

from __future__ import annotations

import asyncio
from pathlib import Path

import polars as pl
import pytest

from gpusteward.reports import aggregate, build, compute, render, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.policy import parse_policy
from gpusteward.sandbox import traces
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent

WEEK = compute.parse_week("2026-W47")
# The same folder as the `shared_data` fixture, for module-scoped fixtures.
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


class MemoryPublisher:
    """A Publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.samples: list[NodeSample] = []
        self.allocations: list[AllocationEvent] = []
        self.flushed = 0

    async def sample(self, sample: NodeSample) -> None:
        self.samples.append(sample)

    async def hw_event(self, event: HwEvent) -> None:
        raise AssertionError("the trace has no hardware events")

    async def allocation(self, event: AllocationEvent) -> None:
        self.allocations.append(event)

    async def queue(self, event: QueueEvent) -> None:
        raise AssertionError("the GenAI trace has no queue")

    async def flush(self) -> None:
        self.flushed += 1


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pl.DataFrame]:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present")
    directory = tmp_path_factory.mktemp("genai")
    allocations, samples = traces.genai_records(SHARED_DATA / "traces",
                                                traces.GenAiOptions(start=WEEK.start))
    out = aggregate.rollups(samples, allocations=allocations)
    store.write(directory, store.frame(out))
    return directory, traces.read_genai(SHARED_DATA / "traces")


def test_rollups_equal_the_trace_per_pod_and_minute(replayed: tuple[Path, pl.DataFrame]
                                                    ) -> None:
    directory, trace = replayed
    rollups = store.scan(directory, WEEK.start, WEEK.end).collect()
    shift = WEEK.start - trace["ts"].min()  # type: ignore[operator]
    expected = (trace.with_columns(((pl.col("ts") + shift) // 60 * 60).alias("minute"))
                .group_by("container_ip", "minute")
                .agg(pl.col("duty_pct").mean().alias("util"),
                     pl.col("mem_used_bytes").max().alias("mem")))
    assert rollups.height == expected.height
    assert rollups["uuid"].n_unique() == trace["container_ip"].n_unique() == 80
    pods = traces.genai_pods(trace, traces.GenAiOptions())
    by_uuid = {p.uuid: ip for ip, p in pods.items()}
    joined = rollups.with_columns(
        pl.col("uuid").replace_strict(by_uuid).alias("container_ip"),
        pl.col("ts").alias("minute")).join(expected, on=["container_ip", "minute"])
    assert joined.height == expected.height
    diff = joined.select((pl.col("util_mean") - pl.col("util")).abs().max()).item()
    assert diff < 1e-3  # float32 storage
    assert (joined["mem_used_max"] == joined["mem"].cast(pl.Int64)).all()
    assert set(rollups["team"].unique()) == {"genai"}


def test_a_report_on_the_replayed_trace(replayed: tuple[Path, pl.DataFrame],
                                        tmp_path: Path) -> None:
    directory, _ = replayed
    report = build.build(directory, WEEK, ReportSettings())
    rows = store.scan(directory, WEEK.start, WEEK.end).collect()
    totals = report.data["totals"]
    assert totals["devices"] == 80
    assert totals["allocated_gpu_hours"] == pytest.approx(rows.height / 60)
    assert totals["used_gpu_hours"] == pytest.approx(
        rows.select((pl.col("util_mean").cast(pl.Float64) / 6000).sum()).item())
    # Serving pods that idle most of the day: the trace's mean duty cycle is under 10 %.
    assert totals["used_gpu_hours"] < 0.1 * totals["allocated_gpu_hours"]
    assert report.data["recommendations"]
    # One action per workload: every advised workload once, under its team.
    advised = {r["workload"] for r in report.data["recommendations"]}
    listed = [a["workload"] for t in report.data["actions"] for a in t["actions"]]
    assert len(listed) == len(set(listed))
    assert len(listed) + sum(t["tail_workloads"] for t in report.data["actions"]) == len(advised)
    # A workload whose p95 activity is under the idle threshold is told to give it back,
    # and only that: a MIG slice, a cheaper GPU or fewer GPUs would be held idle too.
    p95 = rows.filter(pl.col("util_mean").is_not_null()).group_by("owner_name").agg(
        pl.col("util_mean").quantile(0.95, "linear"))
    idle_owners = set(p95.filter(pl.col("util_mean") < 5)["owner_name"])
    assert idle_owners, "the trace has serving pods idle all day"
    for row in report.data["workloads"]:
        name = f"{row['namespace']}/{row['owner_kind'].lower()}/{row['owner_name']}"
        kinds = {r["kind"] for r in report.data["recommendations"] if r["workload"] == name}
        idle = row["owner_name"] in idle_owners
        assert ("give_back" in kinds) == (idle and bool(kinds)), name
        assert kinds <= {"give_back"} if idle else "give_back" not in kinds, (name, kinds)
    for action in (a for t in report.data["actions"] for a in t["actions"]):
        if action["kind"] == "give_back":
            assert action["alternatives"] == [], action
    assert any(a["kind"] == "give_back" for t in report.data["actions"] for a in t["actions"])
    # Idle holders named, most idle GPU-hours first, each with its longest episode.
    holders = report.data["idle_holders"]
    assert len(holders) == ReportSettings().idle_holders_shown
    hours = [h["idle_gpu_hours"] for h in holders]
    assert hours == sorted(hours, reverse=True)
    idle_per_pod = rows.filter(pl.col("util_max") < 5).group_by("pod").len().sort(
        "len", descending=True)
    assert holders[0]["pod"] == idle_per_pod["pod"][0]
    assert holders[0]["idle_gpu_hours"] == pytest.approx(idle_per_pod["len"][0] / 60)
    assert all(0 < h["longest_episode_h"] <= h["idle_gpu_hours"] + 1e-9 for h in holders)
    pool = report.data["mig"]["pools"][0]
    assert (pool["model"], pool["gpus"]) == ("A100-80GB", 80)
    assert pool["served_share"] == pytest.approx(pool["demand_share"])
    written = render.write(report, tmp_path)
    assert all(p.stat().st_size > 0 for p in written)


def test_replay_through_a_publisher(shared_data: Path) -> None:
    publisher = MemoryPublisher()
    sent = asyncio.run(traces.replay_genai(publisher, shared_data / "traces",
                                           traces.GenAiOptions(start=WEEK.start)))
    assert sent == len(publisher.samples) and publisher.flushed == 1
    assert len(publisher.allocations) == 80
    assert publisher.samples[0].ts == WEEK.start
    assert all(len(s.devices) <= 8 for s in publisher.samples)
    nodes = {s.node for s in publisher.samples}
    assert len(nodes) == 10


def test_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(traces.TraceError, match="cannot read the GenAI trace"):
        traces.genai_records(tmp_path)


def test_openb_queue_waits_in_the_report(shared_data: Path, tmp_path: Path) -> None:
    events = traces.openb_queue_events(shared_data / "traces", WEEK.start)
    store.write(tmp_path / "queue", store.queue_frame(events), store.QUEUE_SCHEMA)
    pods = pl.read_csv(shared_data / "traces" / "alibaba-gpu-v2023" /
                       "openb_pod_list_default.csv")
    window_start = pods["creation_time"].max() - 7 * 86400  # type: ignore[operator]
    recent = pods.filter(pl.col("creation_time") >= window_start)
    admitted = recent.filter((pl.col("pod_phase") != "Pending")
                             & (pl.col("scheduled_time") >= pl.col("creation_time")))
    assert sum(e.state == "pending" for e in events) == recent.height
    # The SLO comes from the rule policy, as the live queue rule's does.
    policy = parse_policy("rules:\n  queue_wait_slo:\n    slo_s: {'^LS$': 60.0}\n")
    report = build.build(tmp_path / "empty", WEEK, ReportSettings(), queue=tmp_path / "queue",
                         policy=policy)
    rows = {r["cluster_queue"]: r for r in report.data["queues"]}
    # The window is moved onto the report's week; admissions after its end fall outside.
    inside = admitted.filter(pl.col("scheduled_time") < window_start + 7 * 86400)
    assert sum(r["admitted"] for r in rows.values()) == inside.height
    ls = inside.filter(pl.col("qos") == "LS").with_columns(
        (pl.col("scheduled_time") - pl.col("creation_time")).alias("wait"))
    assert rows["LS"]["wait_p95_s"] == pytest.approx(ls["wait"].quantile(0.95, "linear"))
    assert rows["LS"]["within_slo_pct"] == pytest.approx(
        100 * (ls["wait"] <= 60).mean())  # type: ignore[operator]
