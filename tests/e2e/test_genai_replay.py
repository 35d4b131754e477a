"""The Alibaba GenAI trace through the embedded broker and the real stream worker.

The whole trace (80 pods, ~23 h, 14,410 node samples) is published; the idle
periods the worker reports must be exactly those that
:func:`traces.offline_idle_periods` computes in polars, pod by pod, with the
same start times.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusteward.cli import app
from gpusteward.cli.sandbox import PipelineReplay, replay_through_pipeline
from gpusteward.reports import compute
from gpusteward.sandbox import traces
from gpusteward.settings import Settings
from tests.reports.test_idle_offline import series, write_trace

pytestmark = pytest.mark.e2e

OPTIONS = traces.GenAiOptions(start=compute.parse_week("2026-W47").start)


@pytest.fixture
def replayed(settings: Settings, shared_data: Path, tmp_path: Path) -> PipelineReplay:
    return asyncio.run(replay_through_pipeline(
        settings, shared_data / "traces", OPTIONS, tmp_path / "worker.log"))


def test_worker_finds_exactly_the_offline_idle_periods(replayed: PipelineReplay,
                                                       shared_data: Path) -> None:
    offline = traces.offline_idle_periods(shared_data / "traces", OPTIONS)
    expected = set(offline.select("pod", "starts_at").iter_rows())
    found = replayed.idle_periods()
    assert len(expected) > 100, "the trace has many idle periods"
    assert set(found) == expected
    # One finding id per period, and no two periods share one.
    ids = [next(iter(group)) for group in found.values()]
    assert all(len(group) == 1 for group in found.values())
    assert len(set(ids)) == len(ids)
    # Each period is reported at the sample where it reached the window, not later.
    first_ts: dict[tuple[str, float], float] = {}
    for f in replayed.findings:
        if f.kind == "idle_holder" and f.state == "firing" and f.subject.pod:
            key = (f"{f.subject.pod.namespace}/{f.subject.pod.name}", f.starts_at)
            first_ts[key] = min(first_ts.get(key, f.ts), f.ts)
    assert first_ts == {(pod, start): at for pod, start, at in
                        offline.select("pod", "starts_at", "found_at").iter_rows()}


def test_replay_through_pipeline_command(tmp_path: Path) -> None:
    rows = (series("a", 1e6, 1e6 + 3000, 0.0) + series("b", 1e6, 1e6 + 3000, 80.0)
            + series("c", 1e6, 1e6 + 1200, 0.0) + series("c", 1e6 + 1560, 1e6 + 4000, 1.0))
    folder = write_trace(tmp_path, rows)
    result = CliRunner().invoke(app, ["replay", "--through-pipeline", "--traces", str(folder)])
    assert result.exit_code == 0, result.output
    assert "the pipeline found exactly the offline idle periods" in result.output
    assert re.search(r"idle periods\W+2\W+2\W", result.output), result.output
