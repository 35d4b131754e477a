"""The report's numbers equal direct polars computations on the same Parquet files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import polars as pl
import pytest

from gpusteward.reports import build, compute, gaps, notify, render, store, trends
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox import rollups as synthetic
from gpusteward.schema import DeviceSample, NodeSample, Rollup
from gpusteward.streams.node import NodeJoin, NodeState
from tests.streams.test_node_join import POD, allocation, node_sample

WEEK = compute.parse_week("2026-W47")
PRICES = {"NVIDIA H100 80GB HBM3": 3.5, "NVIDIA A100-SXM4-80GB": 2.2}
GIB = 1 << 30


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, build.Report, pl.DataFrame]:
    directory = tmp_path_factory.mktemp("rollups")
    rows = synthetic.week_of_rollups(WEEK.start, gpus=24, workloads=10, teams=3, seed=3)
    store.write(directory, rows)
    # A row of the week before and a redelivered copy of one row: neither may count.
    store.write(directory, rows.head(1).with_columns(pl.col("ts") - 86400))
    store.write(directory, rows.slice(500, 1))
    report = build.build(directory, WEEK, ReportSettings())
    raw = pl.read_parquet(store.files(directory, WEEK.start - 86400, WEEK.end))
    week = raw.filter(pl.col("ts") >= WEEK.start).unique(subset=["uuid", "ts"])
    return directory, report, week


def test_week_parsing() -> None:
    assert compute.parse_week("2026-W47").start == 1_763_337_600.0 + 52 * 7 * 86400
    with pytest.raises(compute.WeekError, match="YYYY-Www"):
        compute.parse_week("2026-47")
    with pytest.raises(compute.WeekError, match="does not exist"):
        compute.parse_week("2026-W60")


def test_totals_equal_direct_computation(built: tuple[Path, build.Report, pl.DataFrame]) -> None:
    _, report, week = built
    held = week.filter(pl.col("pod").is_not_null())
    idle = held.filter(pl.col("util_max") < 5)
    totals = report.data["totals"]
    assert totals["device_minutes"] == week.height == 24 * 7 * 1440
    assert totals["allocated_gpu_hours"] == pytest.approx(held.height / 60)
    assert totals["used_gpu_hours"] == pytest.approx(
        held.select((pl.col("util_mean").cast(pl.Float64) / 100 / 60).sum()).item())
    assert totals["idle_gpu_hours"] == pytest.approx(idle.height / 60)
    price = pl.col("model").replace_strict(PRICES, return_dtype=pl.Float64)
    assert totals["idle_cost_usd"] == pytest.approx(idle.select((price / 60).sum()).item())
    assert totals["allocated_cost_usd"] == pytest.approx(held.select((price / 60).sum()).item())


def test_team_and_day_tables_equal_direct_computation(
        built: tuple[Path, build.Report, pl.DataFrame]) -> None:
    _, report, week = built
    held = week.filter(pl.col("pod").is_not_null())
    expected = {team: (group.height / 60,
                       group.filter(pl.col("util_max") < 5).height / 60)
                for (team,), group in held.group_by("team")}
    got = {r["team"]: (r["allocated_gpu_hours"], r["idle_gpu_hours"])
           for r in report.data["teams"]}
    assert got.keys() == expected.keys()
    for team, (allocated, idle) in expected.items():
        assert got[team] == pytest.approx((allocated, idle))
    by_day: dict[str, float] = {}
    for row in report.data["daily"]:
        by_day[row["day"]] = by_day.get(row["day"], 0.0) + row["allocated_gpu_hours"]
    assert sorted(by_day) == [d.isoformat() for d in WEEK.days]
    assert sum(by_day.values()) == pytest.approx(held.height / 60)


def test_workload_percentiles_faults_and_fragmentation(
        built: tuple[Path, build.Report, pl.DataFrame]) -> None:
    _, report, week = built
    held = week.filter(pl.col("pod").is_not_null())
    first = report.data["workloads"][0]
    mine = held.filter(pl.col("owner_name") == first["owner_name"])
    assert first["util_p50"] == pytest.approx(mine["util_mean"].quantile(0.5, "linear"))
    assert first["devices"] == mine["uuid"].n_unique()
    assert sum(r["xid_events"] for r in report.data["faults"]) == week["xid_count"].sum()
    assert sum(r["ecc_dbe_errors"] for r in report.data["faults"]) == week["ecc_dbe_new"].sum()
    # Fragmentation of the first hour, by hand: per minute and node, free GPUs.
    hour = week.filter(pl.col("ts") < WEEK.start + 3600)
    free: dict[float, tuple[int, int]] = {}
    for (ts, _node), group in hour.group_by("ts", "node"):
        n = group["pod"].null_count()
        total, usable = free.get(ts, (0, 0))
        free[ts] = (total + n, usable + n // 4 * 4)
    stranded = 1 - sum(u for _, u in free.values()) / sum(t for t, _ in free.values())
    assert report.data["fragmentation"][0]["stranded_share"] == pytest.approx(stranded)


def test_three_formats_carry_the_same_numbers(
        built: tuple[Path, build.Report, pl.DataFrame], tmp_path: Path) -> None:
    _, report, _ = built
    paths = {p.name: p for p in render.write(report, tmp_path)}
    assert set(paths) == {"report.html", "report.md", "report.json", "mig-parted.yaml"}
    data = json.loads(paths["report.json"].read_text())
    assert data["totals"] == report.data["totals"]
    markdown = paths["report.md"].read_text()
    html = paths["report.html"].read_text()
    for team in report.data["teams"]:
        cell = f"{team['allocated_gpu_hours']:,.1f}"
        assert f"| {team['team']} | {cell} |" in markdown
        assert f"<td>{cell}</td>" in html
    # Seven charts and one heatmap per team (up to four).
    heatmaps = min(len(report.data["teams"]), render.HEATMAP_TEAMS)
    assert heatmaps >= 1
    assert html.count("<svg") == 7 + heatmaps and "<script" not in html and "http://" not in \
        html.replace("http://www.w3.org/2000/svg", "")


def _rows(owner: str, devices: int, minutes: int, util: float, mem_gib: float,
          start: float) -> list[Rollup]:
    return [Rollup(ts=start + m * 60, node="n1", uuid=f"GPU-{owner}-{d}", index=d,
                   model="NVIDIA H100 80GB HBM3", samples=4, util_mean=util, util_max=util,
                   mem_used_max=int(mem_gib * GIB), mem_total_bytes=80 * GIB,
                   namespace="ml", pod=f"{owner}-{d}", owner_kind="Job", owner_name=owner,
                   team="t")
            for m in range(minutes) for d in range(devices)]


def test_recommendations_follow_percentile_headroom_and_minimum_points(tmp_path: Path) -> None:
    rows = (_rows("wide", 4, 120, 10.0, 6.0, WEEK.start)       # 4 GPUs, 0.4 GPU busy
            + _rows("small", 1, 120, 10.0, 6.0, WEEK.start)    # fits a 1g.10gb
            + _rows("short", 1, 30, 10.0, 6.0, WEEK.start))    # too few minutes
    store.write(tmp_path, store.frame(rows))
    report = build.build(tmp_path, WEEK, ReportSettings(min_points=60))
    advice = {(r["workload"], r["kind"]): r for r in report.data["recommendations"]}
    fewer = advice[("ml/job/wide", "fewer_gpus")]
    assert (fewer["current"], fewer["recommended"]) == ("4.0 GPUs", "1 GPUs")
    # 3 of 4 GPUs for 2 hours at the H100 price.
    assert fewer["saving_usd"] == pytest.approx(3 * 2 * 3.5)
    mig = advice[("ml/job/small", "mig_profile")]
    assert mig["recommended"] == "1 x 1g.10gb"
    assert mig["saving_usd"] == pytest.approx(2 * 3.5 * 6 / 7)
    assert not any(w == "ml/job/short" for w, _ in advice)
    pools = {p["pool"]: p for p in report.data["mig"]["pools"]}
    assert pools["H100-80GB"]["gpus"] == 6
    assert pools["H100-80GB"]["instances"].get("1g.10gb", 0) >= 5


def _a100_sample(ts: float) -> NodeSample:
    """Node n1's A100 held by the join tests' pod, 10 % busy with 6 GiB in use."""
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-1", index=0, model="NVIDIA A100-SXM4-80GB", util_pct=10.0,
                     pod=POD, mem_used_bytes=6 * GIB, mem_total_bytes=80 * GIB)])


def test_a_workload_whose_team_label_changed_mid_week_is_one_workload(tmp_path: Path) -> None:
    """A Deployment's pod relabeled from team vision to team speech half-way: the node
    join's rollups carry each minute's team, the team table gives each team the GPU-hours
    it held, and the workload is one workload of its latest team, advised once on all of
    its minutes (not twice, each on half of the evidence and half of the saving)."""
    join, state = NodeJoin(), NodeState()
    start = WEEK.start + 86400
    held = msgspec.structs.replace(allocation("running", start), started_at=start,
                                   owner_kind="Deployment", owner_name="train")
    out: list[Any] = []
    for team, first in (("vision", 0), ("speech", 240)):
        join.on_allocation(state, msgspec.structs.replace(
            held, ts=start + first * 30, labels={"team": team}))
        out += [o for i in range(first, first + 240)
                for o in join.on_sample(state, _a100_sample(start + i * 30))]
    out += join.fold.flush(state.rollups, "n1")
    store.write(tmp_path, store.frame([o for o in out if isinstance(o, Rollup)]))

    data = build.build(tmp_path, WEEK, ReportSettings(min_points=60)).data
    teams = {t["team"]: t["allocated_gpu_hours"] for t in data["teams"]}
    assert teams == pytest.approx({"vision": 2.0, "speech": 2.0})
    (workload,) = data["workloads"]
    assert (workload["team"], workload["owner_name"]) == ("speech", "train")
    assert workload["allocated_gpu_hours"] == pytest.approx(4.0)
    assert workload["minutes"] == 240
    advised = [r for r in data["recommendations"] if r["workload"].endswith("/train")]
    assert advised and {r["team"] for r in advised} == {"speech"}
    assert len({r["kind"] for r in advised}) == len(advised)  # each advice once
    assert {r["points"] for r in advised} == {240}


def test_a_node_s_collector_down_for_hours_is_a_gap_not_idleness(tmp_path: Path) -> None:
    """Node n1's collector stops for three hours while its pod sits idle, then comes back.
    The node join emits no rollup for those minutes; the report counts them as neither
    allocated nor idle and says so (JSON ``gaps``, a line in Markdown, HTML and the
    webhook summary) instead of reporting less GPU time without a word. A node that
    joins or leaves mid-week has no gap before its first or after its last minute."""
    join, state = NodeJoin(), NodeState()
    start = WEEK.start + 2 * 86400
    join.on_allocation(state, msgspec.structs.replace(allocation("running", start),
                                                      started_at=start))
    out: list[Any] = []
    for first in (0, 600):  # minutes 0-119, then 300-419: nothing from minute 120 to 300
        out += [o for i in range(first, first + 240)
                for o in join.on_sample(state, node_sample(start + i * 30, 0.0))]
    out += join.fold.flush(state.rollups, "n1")
    store.write(tmp_path, store.frame([o for o in out if isinstance(o, Rollup)]))

    report = build.build(tmp_path, WEEK, ReportSettings())
    data = report.data
    assert data["totals"]["allocated_gpu_hours"] == pytest.approx(4.0)
    assert data["totals"]["idle_gpu_hours"] == pytest.approx(4.0)
    assert data["gaps"] == [{"node": "n1", "minutes": 180, "gaps": 1,
                             "longest_start": "2026-11-18T02:00:00Z",
                             "longest_end": "2026-11-18T05:00:00Z", "longest_minutes": 180}]
    note = ("No data from 1 node for 3.0 node-hours in all (longest: n1, 3.0 h from "
            "2026-11-18T02:00:00Z)")
    assert note in render.markdown(report) and note in render.html(report)
    assert note in notify.summary(data)


def test_rollups_not_stored_by_the_report_s_run_are_named_and_a_rerun_counts_them(
        tmp_path: Path) -> None:
    """The stream worker falls six hours behind on Sunday: when the report runs, the
    store's data stops at 18:00 and the last hours count nowhere. The report says so
    (JSON ``data_ends``, a line in every format); run again once the late rollups are
    stored, it counts them and the line is gone. The week's days without any file are
    named as missing days, not again as data ending early."""
    join, state = NodeJoin(), NodeState()
    sunday = WEEK.start + 6 * 86400
    join.on_allocation(state, msgspec.structs.replace(allocation("running", sunday),
                                                      started_at=sunday))
    out: list[Any] = []
    for i in range(0, 2 * 1440):  # Sunday, every 30 s
        out += join.on_sample(state, node_sample(sunday + i * 30, 50.0))
    out += join.fold.flush(state.rollups, "n1")
    rollups = [o for o in out if isinstance(o, Rollup)]
    on_time = [r for r in rollups if r.ts < sunday + 18 * 3600]
    store.write(tmp_path, store.frame(on_time))

    report = build.build(tmp_path, WEEK, ReportSettings())
    assert report.data["data_ends"] == {"after": "2026-11-22T18:00:00Z",
                                        "until": "2026-11-23T00:00:00Z", "minutes": 360}
    assert report.data["totals"]["allocated_gpu_hours"] == pytest.approx(18.0)
    note = "No data from 2026-11-22T18:00:00Z to 2026-11-23T00:00:00Z (6.0 h)"
    assert note in render.markdown(report) and note in notify.summary(report.data)
    assert len(report.data["missing_days"]) == 6
    assert "no data this week from 2026-11-22T18:00:00Z" in trends.comparability(
        {**report.data, "missing_days": []}, {"week": "2026-W46"})["not_comparable"]

    store.write(tmp_path, store.frame([r for r in rollups if r.ts >= sunday + 18 * 3600]))
    again = build.build(tmp_path, WEEK, ReportSettings())
    assert again.data["data_ends"] is None and note not in render.markdown(again)
    assert again.data["totals"]["allocated_gpu_hours"] == pytest.approx(24.0)


def test_data_stopping_before_days_without_files_is_named_up_to_the_first_of_them() -> None:
    """Data until Monday 01:00 of a week not over (Thursday 02:00 now), Tuesday to
    Thursday without files: those days are the missing days' note; the data-ends note
    covers Monday 01:00 to Tuesday 00:00 only."""
    missing = WEEK.days[1:4]
    ends = gaps.data_ends(WEEK.start + 3600 - 60, WEEK.end, WEEK.start + 3 * 86400 + 7200,
                          missing)
    assert ends == {"after": "2026-11-16T01:00:00Z", "until": "2026-11-17T00:00:00Z",
                    "minutes": 23 * 60}
    assert gaps.data_ends(WEEK.end - 600, WEEK.end, WEEK.end + 86400) is None


def test_one_price_set_by_variable_reprices_that_model_alone(
        built: tuple[Path, build.Report, pl.DataFrame], monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUSTEWARD_REPORT__GPU_MODELS__<MODEL>__HOURLY_USD changes one price: the other
    models keep theirs (a dict setting is otherwise replaced whole, and the variable's
    name arrives in lower case)."""
    directory, _, week = built
    monkeypatch.setenv("GPUSTEWARD_REPORT__GPU_MODELS__H100-80GB__HOURLY_USD", "4.0")
    settings = ReportSettings()
    assert settings.gpu_models["H100-80GB"].memory_gib == 80
    assert settings.gpu_models["A100-80GB"].hourly_usd == 2.2
    report = build.build(directory, WEEK, settings)
    held = week.filter(pl.col("pod").is_not_null())
    price = pl.col("model").replace_strict({**PRICES, "NVIDIA H100 80GB HBM3": 4.0},
                                           return_dtype=pl.Float64)
    assert report.data["totals"]["allocated_cost_usd"] == pytest.approx(
        held.select((price / 60).sum()).item())
