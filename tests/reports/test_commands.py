"""`gpusteward replay` then `gpusteward report`, as a user runs them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from gpusteward.cli import app
from gpusteward.cli.report import NO_DATA_EXIT
from gpusteward.reports import archive, compute, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox import rollups as synthetic


def test_replay_then_report(shared_data: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    replay = runner.invoke(app, [
        "replay", "--traces", str(shared_data / "traces"), "--week", "2026-W47",
        "--rollups", str(tmp_path / "rollups"), "--queue", str(tmp_path / "queue")])
    assert replay.exit_code == 0, replay.output
    assert "rollups of 80 pods" in replay.output and "openb queue events" in replay.output
    report = runner.invoke(app, [
        "report", "--week", "2026-W47", "--rollups", str(tmp_path / "rollups"),
        "--queue", str(tmp_path / "queue"), "--out", str(tmp_path / "out")])
    assert report.exit_code == 0, report.output
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["totals"]["devices"] == 80
    assert {q["cluster_queue"] for q in data["queues"]} >= {"LS", "BE"}
    assert (tmp_path / "out" / "mig-parted.yaml").read_text().startswith("version: v1")


def test_bad_week_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", "--week", "2026-47", "--rollups",
                                      str(tmp_path)])
    assert result.exit_code == 2
    assert "YYYY-Www" in result.output


WEEK = compute.parse_week("2026-W47")


def _report(rollups: Path, out: Path) -> Result:
    return CliRunner().invoke(app, ["report", "--week", WEEK.label, "--rollups", str(rollups),
                                    "--queue", str(out / "no-queue"), "--out", str(out)])


def test_progress_names_the_stage_and_the_rows_read(tmp_path: Path) -> None:
    rows = synthetic.week_of_rollups(WEEK.start, gpus=2, workloads=2, teams=1)
    store.write(tmp_path / "rollups", rows)
    result = _report(tmp_path / "rollups", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"rows read: {rows.height:,} of {rows.height:,}" in result.output
    assert f"report {WEEK.label}: done" in result.output


def test_an_empty_week_is_written_then_fails_and_missing_days_are_said(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    empty = _report(tmp_path / "empty", tmp_path / "out")
    # Written (it says so), then a failure the CronJob does not retry: not a traceback.
    assert empty.exit_code == NO_DATA_EXIT and isinstance(empty.exception, SystemExit), \
        empty.output
    assert f"no rollups for {WEEK.label}" in " ".join(empty.output.split())
    assert "Data missing for the whole week" in (tmp_path / "out" / "report.md").read_text()
    assert "Traceback" not in empty.output

    two_days = synthetic.week_of_rollups(WEEK.start, gpus=2, workloads=2, teams=1,
                                         minutes=2 * 1440)
    store.write(tmp_path / "two", two_days)
    partial = _report(tmp_path / "two", tmp_path / "out2")
    assert partial.exit_code == 0, partial.output
    named = " ".join(partial.output.split())  # rich wraps long lines
    assert f"no rollups for {WEEK.days[2].isoformat()}" in named
    assert "the report covers the other days" in named
    missing = ", ".join(d.isoformat() for d in WEEK.days[2:])
    for name in ("report.md", "report.html"):
        assert f"Data missing for {missing}" in (tmp_path / "out2" / name).read_text()


def test_a_store_written_by_another_version_is_a_message_not_a_traceback(
        tmp_path: Path) -> None:
    folder = tmp_path / "old" / f"day={WEEK.days[0].isoformat()}"
    folder.mkdir(parents=True)
    old = synthetic.week_of_rollups(WEEK.start, gpus=1, workloads=1, teams=1, minutes=10)
    old.rename({"util_mean": "utilization"}).write_parquet(folder / "part-0-x.parquet")
    result = _report(tmp_path / "old", tmp_path / "out")
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)
    named = " ".join(result.output.split())
    assert "written by another version of gpusteward" in named and "util_mean" in named
    assert "Traceback" not in result.output

    (folder / "part-0-x.parquet").write_bytes(b"not parquet at all")
    garbage = _report(tmp_path / "old", tmp_path / "out")
    assert garbage.exit_code == 1 and isinstance(garbage.exception, SystemExit)
    assert "is not a readable Parquet file" in " ".join(garbage.output.split())


def test_replay_without_a_week_puts_the_queue_on_last_week_behind_the_clock(
        shared_data: Path, tmp_path: Path) -> None:
    # The worker refuses events ahead of its clock: a default on the current week put
    # the rest of the week's queue events there, and `report` reads last week by default.
    replay = CliRunner().invoke(app, [
        "replay", "--traces", str(shared_data / "traces"),
        "--rollups", str(tmp_path / "rollups"), "--queue", str(tmp_path / "queue")])
    assert replay.exit_code == 0, replay.output
    last_week = compute.week_of(time.time() - 7 * 86400)
    events = store.scan_queue(tmp_path / "queue", 0.0, 4e9)
    assert events.height > 0
    first, last = events["ts"].min(), events["ts"].max()
    assert isinstance(first, float) and isinstance(last, float)
    assert first >= last_week.start
    assert last < last_week.end + 60 < time.time()


def test_a_week_at_other_prices_or_idle_threshold_is_not_compared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CronJob's command twice, the archive kept: the same fleet doing the same two
    weeks, the second reported after a price change (or another idle threshold), must not
    show an idle cost 'up 100 %' in red as if the teams idled twice as much."""
    before = archive.previous_week(WEEK)
    rollups, kept = tmp_path / "rollups", tmp_path / "archive"
    for week in (before, WEEK):
        store.write(rollups, synthetic.week_of_rollups(week.start, gpus=2, workloads=2,
                                                       teams=1, seed=7))
    monkeypatch.setenv("GPUSTEWARD_REPORT__ARCHIVE_DIR", str(kept))

    def report(week: compute.Week, out: Path) -> dict:
        result = CliRunner().invoke(app, ["report", "--week", week.label, "--rollups",
                                          str(rollups), "--queue", str(out / "no-queue"),
                                          "--out", str(out)])
        assert result.exit_code == 0, result.output
        data: dict = json.loads((out / "report.json").read_text())
        return data

    last = report(before, tmp_path / "before")
    (model,) = {w["gpu_model"] for w in last["workloads"]}
    price = ReportSettings().gpu_models[model].hourly_usd
    same = report(WEEK, tmp_path / "same")
    assert same["trends"]["comparable"] is True  # the control: like with like

    monkeypatch.setenv(f"GPUSTEWARD_REPORT__GPU_MODELS__{model}__HOURLY_USD", str(2 * price))
    repriced = report(WEEK, tmp_path / "repriced")
    # The same idle hours at twice the price: the change is the price's alone.
    assert repriced["totals"]["idle_gpu_hours"] == pytest.approx(
        last["totals"]["idle_gpu_hours"])
    assert repriced["totals"]["idle_cost_usd"] == pytest.approx(
        2 * last["totals"]["idle_cost_usd"])
    assert repriced["trends"]["comparable"] is False
    assert f"{model} ${price:g}/h in {before.label}, ${2 * price:g}/h this week" in \
        repriced["trends"]["not_comparable"]
    markdown = (tmp_path / "repriced" / "report.md").read_text()
    assert "▲" not in markdown and f"Not comparable with {before.label}" in markdown

    monkeypatch.delenv(f"GPUSTEWARD_REPORT__GPU_MODELS__{model}__HOURLY_USD")
    monkeypatch.setenv("GPUSTEWARD_REPORT__IDLE_THRESHOLD_PCT", "50")
    stricter = report(WEEK, tmp_path / "stricter")
    assert stricter["totals"]["idle_gpu_hours"] > last["totals"]["idle_gpu_hours"]
    assert stricter["trends"]["comparable"] is False
    assert f"idle threshold 5% in {before.label}, 50% this week" in \
        stricter["trends"]["not_comparable"]
