"""`gpusteward replay` then `gpusteward report`, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gpusteward.cli import app


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
