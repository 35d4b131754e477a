"""The offline idle-period computation on small hand-made traces, one rule of the definition
per test, so that it can be trusted as the reference the pipeline is checked against."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gpusteward.rules.idle import KIND as IDLE
from gpusteward.rules.idle import IdleSettings
from gpusteward.rules.policy import parse_policy
from gpusteward.sandbox import traces

T0 = 1_000_000.0
STEP = 60.0


def write_trace(folder: Path, rows: list[tuple[str, float, float | None]]) -> Path:
    """A GenAI-shaped trace folder from (pod, ts, duty) rows; memory is on every row, so a
    row with duty None is a sample without a duty cycle, as in the real trace."""
    target = folder / traces.GENAI
    target.mkdir(parents=True)
    pl.DataFrame(
        [(duty, ts, pod) for pod, ts, duty in rows if duty is not None],
        schema={"value": pl.Float64, "timestamp_anon": pl.Float64, "container_ip": pl.String},
        orient="row").write_csv(target / traces.DUTY_FILE)
    pl.DataFrame(
        [(ts, 1e9, pod) for pod, ts, _ in rows],
        schema={"timestamp_anon": pl.Float64, "value": pl.Float64, "container_ip": pl.String},
        orient="row").write_csv(target / traces.MEMORY_FILE)
    return folder


def series(pod: str, start: float, end: float, duty: float | None) -> list[
        tuple[str, float, float | None]]:
    """Rows every STEP seconds from start up to and including end."""
    count = int((end - start) // STEP) + 1
    return [(pod, start + i * STEP, duty) for i in range(count)]


def periods(folder: Path) -> list[tuple[str, float, float]]:
    found = traces.offline_idle_periods(folder)
    return [(ip, start, at) for ip, start, at in
            found.select("container_ip", "starts_at", "found_at").iter_rows()]


def test_grace_after_pod_start_then_the_window(tmp_path: Path) -> None:
    folder = write_trace(tmp_path, series("a", T0, T0 + 3000, 0.0))
    # Idle from its first row: counted from start + 600 s grace, found 1800 s later.
    assert periods(folder) == [("a", T0 + 600, T0 + 2400)]


def test_a_busy_row_ends_the_period_and_a_new_one_can_follow(tmp_path: Path) -> None:
    rows = [*series("a", T0, T0 + 2940, 1.0), ("a", T0 + 3000, 5.0),
            *series("a", T0 + 3060, T0 + 4860, 4.9)]
    assert periods(write_trace(tmp_path, rows)) == [
        ("a", T0 + 600, T0 + 2400), ("a", T0 + 3060, T0 + 4860)]


def test_a_run_one_row_short_of_the_window_is_not_a_period(tmp_path: Path) -> None:
    rows = series("a", T0, T0 + 600, 50.0) + series("a", T0 + 660, T0 + 2400, 0.0)
    assert periods(write_trace(tmp_path, rows)) == []


def test_a_gap_restarts_the_run(tmp_path: Path) -> None:
    rows = series("a", T0, T0 + 1200, 0.0) + series("a", T0 + 1501, T0 + 3600, 0.0)
    assert periods(write_trace(tmp_path, rows)) == [("a", T0 + 1501, T0 + 1501 + 1800)]


def test_a_gap_of_exactly_max_gap_does_not_restart(tmp_path: Path) -> None:
    rows = series("a", T0, T0 + 1200, 0.0) + series("a", T0 + 1500, T0 + 3000, 0.0)
    assert periods(write_trace(tmp_path, rows)) == [("a", T0 + 600, T0 + 2400)]


def test_a_gap_inside_a_period_does_not_open_a_second_one(tmp_path: Path) -> None:
    rows = series("a", T0, T0 + 2400, 0.0) + series("a", T0 + 3000, T0 + 6000, 0.0)
    assert periods(write_trace(tmp_path, rows)) == [("a", T0 + 600, T0 + 2400)]


def test_a_row_without_duty_is_no_observation_and_does_not_hide_a_gap(tmp_path: Path) -> None:
    # 460 s between the last reading before it and the first after it: more than max_gap_s,
    # so the run restarts at T0 + 1660 and is 1340 s long when the trace ends.
    rows = [*series("a", T0, T0 + 1200, 0.0), ("a", T0 + 1600, None),
            *series("a", T0 + 1660, T0 + 3000, 0.0)]
    assert periods(write_trace(tmp_path, rows)) == []


def test_pods_are_independent_and_placed(tmp_path: Path) -> None:
    rows = series("a", T0, T0 + 2400, 0.0) + series("b", T0 + 120, T0 + 2400, 90.0)
    found = traces.offline_idle_periods(write_trace(tmp_path, rows))
    assert found.select("pod", "node", "starts_at").rows() == [
        ("genai/sd-a-0", "genai-node-000", T0 + 600)]


def test_moved_to_a_start_time(tmp_path: Path) -> None:
    folder = write_trace(tmp_path, series("a", T0, T0 + 3000, 0.0))
    found = traces.offline_idle_periods(folder, traces.GenAiOptions(start=5_000_000.0))
    assert found["starts_at"].to_list() == [5_000_600.0]


def test_trace_policy_gives_inference_pods_the_base_definition() -> None:
    policy = parse_policy(traces.genai_idle_policy())
    definition = traces.IdleDefinition()
    effective = policy.resolve("genai").of(IDLE, IdleSettings).effective("inference")
    assert (effective.threshold_pct, effective.window_s, effective.grace_s) == (
        definition.threshold_pct, definition.window_s, definition.grace_s)
    assert policy.resolve("genai").of(IDLE, IdleSettings).max_gap_s == definition.max_gap_s
    # Other namespaces keep the shipped 24 h window for serving pods.
    serving = policy.resolve("ml-serving").of(IDLE, IdleSettings)
    assert serving.effective("inference").window_s == 24 * 3600


def test_empty_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(traces.TraceError):
        traces.offline_idle_periods(write_trace(tmp_path, []))
