"""The HTML report as a reader sees it: rendered by headless Chromium, then looked at.

Chromium comes from Debian's packages (``.ci/system-deps`` installs it for
``make test``). The page is screenshotted whole; every chart is found in the
picture by its background, and each must show a title, data in the palette's
colours and a legend along its bottom edge. The first screen is also checked:
the headline and the named idle holders come before any chart.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from gpusteward.reports import archive, build, charts, compute, render, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox import rollups as synthetic
from gpusteward.schema import QueueEvent

CHROMIUM = Path("/usr/bin/chromium")
WEEK = compute.parse_week("2026-W47")
WIDTH = 1200
# Without Chromium the test skips on a workstation; under CI (CI=true) that is a failure.
pytestmark = pytest.mark.skipif(not CHROMIUM.exists() and not os.environ.get("CI"),
                                reason="needs Debian's chromium at /usr/bin/chromium")


def _rgb(color: str) -> tuple[int, int, int]:
    return (int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16))


def shoot(page: Path, picture: Path, height: int, profile: Path) -> np.ndarray:
    """A screenshot of ``page`` at WIDTH x ``height`` as an RGB array."""
    image = pytest.importorskip("PIL.Image")
    command = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
        f"--screenshot={picture}", f"--window-size={WIDTH},{height}", page.as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert picture.exists(), done.stderr[-2000:]
    return np.asarray(image.open(picture).convert("RGB"))


def sample_report(root: Path, gpus: int = 16, teams: int = 3) -> build.Report:
    """A week with a kept previous week (trends) and queue events: every chart has data."""
    before = archive.previous_week(WEEK)
    rollups = root / "rollups"
    store.write(rollups, synthetic.week_of_rollups(before.start, gpus=gpus, workloads=2 * gpus,
                                                   teams=teams, seed=4))
    store.write(rollups, synthetic.week_of_rollups(WEEK.start, gpus=gpus, workloads=2 * gpus,
                                                   teams=teams, seed=5))
    waits = [QueueEvent(ts=WEEK.start + 3600 * i + wait, name=f"w{i}", namespace="ml",
                        cluster_queue=queue, state="admitted", created_at=WEEK.start + 3600 * i,
                        admitted_at=WEEK.start + 3600 * i + wait)
             for i, (queue, wait) in enumerate([("prod-serving", 300.0), ("prod-serving", 900.0),
                                                ("research", 5000.0), ("batch", 1800.0)] * 3)]
    store.write(root / "queue", store.queue_frame(waits), store.QUEUE_SCHEMA)
    kept = root / "weeks"
    settings = ReportSettings()
    render.write(build.build(rollups, before, settings), archive.folder(kept, before))
    return build.build(rollups, WEEK, settings, queue=root / "queue",
                       previous=archive.previous(kept, WEEK))


def _charts(picture: np.ndarray) -> list[tuple[slice, slice]]:
    """The charts' boxes: large connected areas of the chart background."""
    background = np.all(picture == _rgb("#fafafa"), axis=2)
    labels, _ = ndimage.label(background)
    boxes = ndimage.find_objects(labels)
    return sorted((b for b in boxes if b is not None
                   and (b[0].stop - b[0].start) > 100 and (b[1].stop - b[1].start) > 300),
                  key=lambda b: (b[0].start, b[1].start))


def _count(area: np.ndarray, colors: list[str]) -> int:
    return int(sum(np.all(area == _rgb(c), axis=2).sum() for c in colors))


def problems(picture: np.ndarray, expected: int) -> list[str]:
    """What a reader would miss: charts not drawn, or drawn without title, data or legend."""
    boxes = _charts(picture)
    if len(boxes) != expected:
        return [f"{len(boxes)} charts seen of {expected}"]
    palette = list(charts.PALETTE)
    missing = []
    for rows, cols in boxes:
        chart = picture[rows, cols]
        height = chart.shape[0]
        title = chart[: height * 26 // 300]
        legend = chart[height - max(8, height * 22 // 300):]
        body = chart[height * 30 // 300: height - height * 22 // 300]
        where = f"chart at y={rows.start}"
        if (title.sum(axis=2) < 200).sum() <= 100:
            missing.append(f"{where}: no title")
        # Data: coloured marks (bars, lines, boxes, heatmap cells), not greys.
        if ((body.max(axis=2).astype(int) - body.min(axis=2)) > 40).sum() <= 150:
            missing.append(f"{where}: no data")
        if _count(legend, palette) < 16:
            missing.append(f"{where}: no legend keys")
        if (legend.sum(axis=2) < 200).sum() <= 10:
            missing.append(f"{where}: no legend text")
    return missing


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> build.Report:
    return sample_report(tmp_path_factory.mktemp("sample"))


def _page(report: build.Report, directory: Path) -> Path:
    return next(p for p in render.write(report, directory) if p.suffix == ".html")


def test_every_chart_shows_its_title_data_and_legend(report: build.Report, tmp_path: Path
                                                     ) -> None:
    page = _page(report, tmp_path / "out")
    expected = page.read_text().count("<svg")
    picture = shoot(page, tmp_path / "page.png", 7000, tmp_path / "profile")
    assert problems(picture, expected) == []


def test_a_chart_without_its_legend_is_seen(report: build.Report, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the check catches the bar and line charts drawn with no legend."""
    monkeypatch.setattr(charts, "_legend", lambda *_args, **_kwargs: [])
    page = _page(report, tmp_path / "out")
    picture = shoot(page, tmp_path / "page.png", 7000, tmp_path / "profile")
    found = problems(picture, page.read_text().count("<svg"))
    assert sum(p.endswith("no legend keys") for p in found) == 6, found


def test_the_first_screen_names_the_headline_and_idle_holders(report: build.Report,
                                                              tmp_path: Path) -> None:
    top = shoot(_page(report, tmp_path / "out"), tmp_path / "top.png", 900,
                tmp_path / "profile")
    assert top.shape == (900, WIDTH, 3)
    # Text (headline figures, the idle holders' table) and the arrows' colours, no chart yet.
    assert (top.sum(axis=2) < 200).sum() > 20_000
    arrows = _count(top, ["#c0392b", "#1e8449"])
    assert arrows > 20, "no trend arrows in the headline"
    assert len(_charts(top)) == 0
