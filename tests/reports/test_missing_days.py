"""Days without rollups are said where a reader looks, and such weeks do not compare.

When the rollup sink is down for days, the week's idle cost falls because less
was seen, not because anything was given back: the HTML, the Markdown and the
webhook summary say which days are missing, and the comparison with the week
before shows no arrows (green "better" ones would be false) when either week
misses days.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.reports import archive, build, compute, notify, render, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox import rollups as synthetic

WEEK = compute.parse_week("2026-W47")
BEFORE = archive.previous_week(WEEK)
ARROWS = ("▲", "▼")


def _week(folder: Path, week: compute.Week, days: int) -> None:
    store.write(folder, synthetic.week_of_rollups(week.start, gpus=2, workloads=2, teams=1,
                                                  minutes=days * 1440, seed=7))


def _pair(root: Path, days_before: int, days_now: int) -> build.Report:
    rollups, kept = root / "rollups", root / "archive"
    _week(rollups, BEFORE, days_before)
    _week(rollups, WEEK, days_now)
    settings = ReportSettings()
    render.write(build.build(rollups, BEFORE, settings), archive.folder(kept, BEFORE))
    return build.build(rollups, WEEK, settings, previous=archive.previous(kept, WEEK))


def test_missing_days_are_said_in_every_format_and_the_summary(tmp_path: Path) -> None:
    report = _pair(tmp_path, 7, 5)
    missing = [d.isoformat() for d in WEEK.days[5:]]
    assert report.data["missing_days"] == missing
    line = f"Data missing for {', '.join(missing)}"
    assert line in render.markdown(report)
    assert line in render.html(report)
    assert line in notify.summary(report.data)


@pytest.mark.parametrize(("days_before", "days_now", "which"),
                         [(7, 5, "this week"), (4, 7, "in 2026-W46")])
def test_a_week_with_missing_days_is_not_compared(
        tmp_path: Path, days_before: int, days_now: int, which: str) -> None:
    report = _pair(tmp_path, days_before, days_now)
    trends = report.data["trends"]
    assert trends["previous_week"] == BEFORE.label and trends["comparable"] is False
    assert f"data missing {which}" in trends["not_comparable"]
    markdown, html = render.markdown(report), render.html(report)
    assert not any(arrow in markdown or arrow in html for arrow in ARROWS)
    assert f"Not comparable with {BEFORE.label}" in markdown
    assert f"Not comparable with {BEFORE.label}" in html
    assert f"Not comparable with {BEFORE.label}" in notify.summary(report.data)


def test_two_whole_weeks_compare_with_arrows(tmp_path: Path) -> None:
    report = _pair(tmp_path, 7, 7)
    assert report.data["trends"]["comparable"] is True
    assert report.data["trends"]["not_comparable"] is None
    assert "Data missing" not in render.markdown(report)
    assert "Arrows: against 2026-W46" in render.html(report)
