"""The report's waiting section: waits, start-ETA accuracy and gang hostage GPU-hours per queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.reports import build, compute, findings, render, store, waiting
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules import eta, gang
from gpusteward.sandbox import rollups as synthetic
from gpusteward.schema import Evidence, Finding, PodRef, QueueEvent, Subject

WEEK = compute.parse_week("2026-W47")
T = WEEK.start + 86400  # Tuesday 00:00


def queued(name: str, queue: str, state: str, ts: float, created: float,
           admitted: float | None = None) -> QueueEvent:
    return QueueEvent(ts=ts, name=name, namespace="ml", cluster_queue=queue,
                      state=state, created_at=created, admitted_at=admitted,  # type: ignore[arg-type]
                      gpus=1)


def closed_eta(name: str, queue: str, ts: float, error: float, naive: float | None) -> Finding:
    values = {"started_ts": ts, "first_eta_error_s": error, "eta_error_s": error / 2}
    if naive is not None:
        values["first_naive_eta_error_s"] = naive
    return Finding(id=f"eta-{name}", fingerprint=f"eta-{name}", kind=eta.KIND, severity="info",
                   state="resolved", subject=Subject(queue=queue, pod=PodRef("ml", name)),
                   summary="started", starts_at=ts - 600, ts=ts,
                   evidence=Evidence(window_start=ts - 600, window_end=ts, values=values),
                   labels={"queue": queue})


def gang_finding(state: str, since: float, ts: float, gpus: float = 6.0) -> Finding:
    values = {"gpus_held": gpus, "gpu_hours_held": gpus * (ts - since) / 3600}
    return Finding(id="gang-1", fingerprint="gang", kind=gang.KIND, severity="warning",
                   state=state,  # type: ignore[arg-type]
                   subject=Subject(queue="research", pod=PodRef("ml", "pretrain")),
                   summary="gang", starts_at=since, ts=ts,
                   evidence=Evidence(window_start=since, window_end=ts, values=values)
                   if state == "firing" else None,
                   labels={"queue": "research", "gang": "pretrain"})


def events() -> list[QueueEvent]:
    return [
        queued("a", "research", "pending", T, T),
        queued("a", "research", "admitted", T + 600, T, T + 600),
        queued("b", "research", "pending", T, T),
        queued("b", "research", "admitted", T + 1800, T, T + 1800),
        queued("stuck", "research", "pending", T + 3600, T + 3600),
        queued("c", "batch", "pending", T, T),
    ]


def test_waits_eta_errors_and_gang_hours_per_queue() -> None:
    assert (waiting.ETA_KIND, waiting.GANG_KIND) == (eta.KIND, gang.KIND)
    found = [
        closed_eta("a", "research", T + 600, -300.0, 1200.0),
        closed_eta("b", "research", T + 1800, 100.0, -2000.0),
        closed_eta("x", "research", T + 1900, 200.0, None),
        closed_eta("old", "research", WEEK.start - 10, 99999.0, 99999.0),  # last week's
        # Fired after its window with 0.5 GPU-hours counted, resolved an hour later.
        gang_finding("firing", T, T + 300),
        gang_finding("resolved", T, T + 300 + 3600),
        gang_finding("firing", T, T + 300),  # redelivered
    ]
    frame = store.queue_frame(events())
    rows = {r["cluster_queue"]: r for r in compute.records(
        waiting.waiting_table(frame, findings.frame(found), WEEK.start, WEEK.end))}
    assert set(rows) == {"research", "batch"}
    research = rows["research"]
    assert (research["admitted"], research["wait_p50_s"]) == (2, 1200.0)
    assert (research["pending_at_end"], research["longest_pending_s"]) == (
        1, WEEK.end - (T + 3600))
    assert (research["etas_closed"], research["eta_error_p50_s"], research["eta_error_p90_s"]
            ) == (3, 200.0, 300.0)
    assert (research["naive_error_p50_s"], research["naive_error_p90_s"]) == (1600.0, 2000.0)
    assert research["gang_episodes"] == 1
    assert research["gang_gpu_hours_held"] == pytest.approx(6 * 300 / 3600 + 6 * 1.0)
    batch = rows["batch"]
    assert (batch["admitted"], batch["pending_at_end"], batch["etas_closed"],
            batch["gang_episodes"], batch["eta_error_p50_s"]) == (0, 1, 0, 0, None)


def test_an_open_gang_episode_counts_to_the_end_of_the_week() -> None:
    since = WEEK.end - 7200
    (row,) = compute.records(waiting.waiting_table(
        None, findings.frame([gang_finding("firing", since, since + 1800, gpus=4.0)]),
        WEEK.start, WEEK.end))
    assert row["gang_gpu_hours_held"] == pytest.approx(4 * 2.0)


def test_the_report_carries_the_section_in_every_format(tmp_path: Path) -> None:
    rollups = tmp_path / "rollups"
    store.write(rollups, synthetic.week_of_rollups(WEEK.start, gpus=4, workloads=2, teams=1,
                                                   seed=1))
    found = tmp_path / "findings"
    store.write(found, findings.frame([closed_eta("a", "research", T + 600, -300.0, 1200.0)]),
                findings.SCHEMA)
    report = build.build(rollups, WEEK, ReportSettings(), queue=store.queue_frame(events()),
                         findings_dir=found)
    assert [r["cluster_queue"] for r in report.data["waiting"]] == ["batch", "research"]
    paths = {p.name: p for p in render.write(report, tmp_path / "out")}
    markdown = paths["report.md"].read_text()
    html = paths["report.html"].read_text()
    assert "## Waiting" in markdown and "<h2>Waiting</h2>" in html
    assert "| research | 2 | 1,200.0 |" in markdown
    assert "<td>research</td><td>2</td><td>1,200.0</td>" in html
    # No queue events and no findings: the section says so.
    empty = build.build(rollups, WEEK, ReportSettings())
    assert empty.data["waiting"] == []
    assert "_none this week_" in render.markdown(empty).split("## Waiting")[1]
