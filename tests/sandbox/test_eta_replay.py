"""The openb replay of the start ETAs: the trace followed to each pod's end, and measured."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gpusteward.sandbox import eta_replay, traces

DAY = 86400.0


def test_followed_to_the_end_from_what_already_runs(shared_data: Path) -> None:
    folder = shared_data / "traces"
    events = traces.openb_queue_events(folder, eta_replay.START, days=1.0, follow_to_end=True)
    every = pl.read_csv(folder / traces.OPENB / traces.OPENB_PODS)
    end = float(every["creation_time"].max())  # type: ignore[arg-type]
    pods = every.filter(pl.col("num_gpu") > 0)
    shift = eta_replay.START - (end - DAY)
    assert [e.ts for e in events] == sorted(e.ts for e in events)
    assert {e.gpus for e in events} <= {1, 2, 4, 8}  # GPU pods only
    by_pod: dict[str, list[str]] = {}
    for event in events:
        by_pod.setdefault(event.name, []).append(event.state)
    created = pods.filter(pl.col("creation_time") >= end - DAY)
    assert sum(states[0] == "pending" for states in by_pod.values()) == created.height
    # A pod already running when the window opens is admitted at its start, then ends.
    before = {n for n, states in by_pod.items() if states[0] == "admitted"}
    assert before and all(e.ts == eta_replay.START for e in events
                          if e.name in before and e.state == "admitted")
    row = pods.filter(pl.col("name") == sorted(before)[0]).row(0, named=True)
    assert row["creation_time"] < end - DAY < row["deletion_time"]
    for event in events:
        if event.state == "finished":
            truth = pods.filter(pl.col("name") == event.name).row(0, named=True)
            assert event.ts == truth["deletion_time"] + shift
            assert event.admitted_at == truth["scheduled_time"] + shift
    assert all(states in (["pending"], ["pending", "admitted"], ["pending", "admitted",
                                                                 "finished"],
                          ["admitted"], ["admitted", "finished"])
               for states in by_pod.values())
    nodes = traces.openb_node_summaries(folder, eta_replay.START)
    assert (len(nodes), sum(n.gpus_total for n in nodes)) == (1213, 6212)


def test_a_day_of_estimates_measured_against_the_trace(shared_data: Path) -> None:
    measured = eta_replay.replay_openb(shared_data / "traces", days=1.0)
    assert measured.workloads > 100
    assert measured.model.median_s <= measured.model.p90_s
    # On this trace the naive baseline is far off (pods that never start sit ahead in
    # their queue); the model is not worse than starting now.
    assert measured.model.median_s < measured.naive.median_s
    assert measured.model.p90_s <= measured.now.p90_s


def test_errors_are_absolute() -> None:
    errors = eta_replay.Errors.of([-300.0, 10.0, 20.0, -40.0, 1000.0])
    assert (errors.median_s, errors.p90_s) == (40.0, 1000.0)
    assert eta_replay.Errors.of([5.0]) == eta_replay.Errors(5.0, 5.0)
    with pytest.raises(ValueError):
        eta_replay.Errors.of([])
