"""The HTML report rendered by headless Chromium shows its charts.

Chromium is big, so it is not in .ci/system-deps: the test skips when
/usr/bin/chromium is absent (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpusteward.reports import build, charts, compute, render, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox import rollups as synthetic

CHROMIUM = Path("/usr/bin/chromium")
WEEK = compute.parse_week("2026-W47")


def _rgb(color: str) -> tuple[int, int, int]:
    return (int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16))


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_headless_chromium_shows_the_charts(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    rows = synthetic.week_of_rollups(WEEK.start, gpus=16, workloads=8, teams=3, seed=5)
    store.write(tmp_path / "rollups", rows)
    report = build.build(tmp_path / "rollups", WEEK, ReportSettings())
    html = next(p for p in render.write(report, tmp_path / "out") if p.suffix == ".html")
    shot = tmp_path / "report.png"
    command = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}", "--window-size=1200,1600", html.as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert shot.exists(), done.stderr[-2000:]
    picture = image.open(shot).convert("RGB")
    assert picture.size == (1200, 1600)
    counts = {color: 0 for color in charts.PALETTE[:2]}
    wanted = {_rgb(c): c for c in counts}
    for count, pixel in picture.getcolors(maxcolors=1 << 20) or []:
        if pixel in wanted:
            counts[wanted[pixel]] += count
    # The first screen holds the usage charts: both series colours fill real areas.
    assert all(n > 5_000 for n in counts.values()), counts
