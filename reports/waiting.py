"""The weekly report's section on waiting: per queue, waits, start-ETA accuracy, gangs.

Three questions a platform team asks of a week, per cluster queue:

- **waits**: workloads admitted, their p50/p95 wait, and those still pending
  at the week's end with the longest of their waits (from the queue-event
  store, as the queue table);
- **how good the start ETAs were**: for every workload whose
  ``queue_start_eta`` finding was closed by its start in the week, the first
  estimate's absolute error, median and p90, beside the naive baseline's
  (position ÷ admission rate) published with it;
- **GPU-hours held hostage by gangs**: ``gang_partial`` episodes that began
  in the week, and the GPU-hours their placed members held while the others
  waited: what the finding counted when it fired, plus its GPUs held from
  then to the episode's resolution (or the week's end).

The last two come from the findings store (``gpusteward sink findings``:
the pipeline's findings kept by week, :mod:`gpusteward.reports.findings`);
without it they are empty. :func:`waiting_table` is pure (polars and the findings in, one frame
out); :func:`render` draws the section for the HTML or Markdown report.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from html import escape
from typing import Any, Literal

import polars as pl

ETA_KIND = "queue_start_eta"
GANG_KIND = "gang_partial"
"""The rules' kinds (rules/eta.py, rules/gang.py), as the findings carry them."""

SCHEMA: dict[str, Any] = {
    "cluster_queue": pl.String, "admitted": pl.UInt32, "wait_p50_s": pl.Float64,
    "wait_p95_s": pl.Float64, "pending_at_end": pl.UInt32, "longest_pending_s": pl.Float64,
    "etas_closed": pl.UInt32, "eta_error_p50_s": pl.Float64, "eta_error_p90_s": pl.Float64,
    "naive_error_p50_s": pl.Float64, "naive_error_p90_s": pl.Float64,
    "gang_episodes": pl.UInt32, "gang_gpu_hours_held": pl.Float64,
}
COLUMNS = [("cluster_queue", "queue"), ("admitted", "admitted"), ("wait_p50_s", "p50 wait s"),
           ("wait_p95_s", "p95 wait s"), ("pending_at_end", "pending at end"),
           ("longest_pending_s", "longest pending s"), ("etas_closed", "ETAs closed"),
           ("eta_error_p50_s", "ETA |error| p50 s"), ("eta_error_p90_s", "ETA |error| p90 s"),
           ("naive_error_p50_s", "naive |error| p50 s"),
           ("naive_error_p90_s", "naive |error| p90 s"),
           ("gang_episodes", "gangs half-placed"),
           ("gang_gpu_hours_held", "GPU-h held by gangs")]


def _p(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of absolute values; None for none."""
    if not values:
        return None
    ordered = sorted(abs(v) for v in values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _waits(queue: pl.DataFrame | None, end: float) -> dict[str, dict[str, Any]]:
    if queue is None or queue.is_empty():
        return {}
    latest = queue.sort("ts").unique(subset=["namespace", "name"], keep="last")
    admitted = (queue.filter((pl.col("state") == "admitted") & pl.col("admitted_at").is_not_null()
                             & pl.col("created_at").is_not_null())
                .unique(subset=["namespace", "name"], keep="first")
                .with_columns((pl.col("admitted_at") - pl.col("created_at")).alias("wait_s")))
    out: dict[str, dict[str, Any]] = {}
    for row in admitted.group_by("cluster_queue").agg(
            pl.len().alias("admitted"),
            pl.col("wait_s").quantile(0.5, "linear").alias("wait_p50_s"),
            pl.col("wait_s").quantile(0.95, "linear").alias("wait_p95_s")).iter_rows(named=True):
        out[row.pop("cluster_queue")] = row
    pending = latest.filter(pl.col("state") == "pending").with_columns(
        (end - pl.coalesce("created_at", "ts")).alias("waited_s"))
    for row in pending.group_by("cluster_queue").agg(
            pl.len().alias("pending_at_end"),
            pl.col("waited_s").max().alias("longest_pending_s")).iter_rows(named=True):
        out.setdefault(row.pop("cluster_queue"), {}).update(row)
    return out


def waiting_table(queue: pl.DataFrame | None, findings: pl.DataFrame, start: float,
                  end: float) -> pl.DataFrame:
    """One row per cluster queue seen in the week's queue events or waiting findings.

    ``findings`` is the week's findings store (:func:`gpusteward.reports.findings.read`).
    """
    rows = _waits(queue, end)
    eta_errors: dict[str, tuple[list[float], list[float]]] = {}
    firing: dict[str, dict[str, Any]] = {}
    resolved: dict[str, float] = {}
    relevant = findings.filter(pl.col("kind").is_in([ETA_KIND, GANG_KIND]))
    for finding in relevant.iter_rows(named=True):
        values = json.loads(finding["values"]) if finding["values"] else {}
        if finding["kind"] == ETA_KIND and finding["state"] == "resolved" and \
                "first_eta_error_s" in values and start <= finding["ts"] < end:
            model, naive = eta_errors.setdefault(finding["queue"] or "?", ([], []))
            model.append(values["first_eta_error_s"])
            if "first_naive_eta_error_s" in values:
                naive.append(values["first_naive_eta_error_s"])
        elif finding["kind"] == GANG_KIND and start <= finding["starts_at"] < end:
            if finding["state"] == "firing":
                known = firing.get(finding["id"])
                if known is None or finding["ts"] < known["ts"]:
                    firing[finding["id"]] = {**finding, "values": values}  # the first counted
            else:
                resolved[finding["id"]] = finding["ts"]
    for queue_name, (model, naive) in eta_errors.items():
        rows.setdefault(queue_name, {}).update(
            etas_closed=len(model), eta_error_p50_s=statistics.median(abs(e) for e in model),
            eta_error_p90_s=_p(model, 90),
            naive_error_p50_s=statistics.median(abs(e) for e in naive) if naive else None,
            naive_error_p90_s=_p(naive, 90))
    for finding_id, finding in firing.items():
        values = finding["values"]
        until = min(resolved.get(finding_id, end), end)
        hours = values.get("gpu_hours_held", 0.0) + \
            values.get("gpus_held", 0.0) * max(0.0, until - finding["ts"]) / 3600
        row = rows.setdefault(finding["queue"] or "?", {})
        row["gang_episodes"] = row.get("gang_episodes", 0) + 1
        row["gang_gpu_hours_held"] = row.get("gang_gpu_hours_held", 0.0) + hours
    return pl.DataFrame([{**dict.fromkeys(SCHEMA), "admitted": 0, "pending_at_end": 0,
                          "etas_closed": 0, "gang_episodes": 0, "gang_gpu_hours_held": 0.0,
                          **row, "cluster_queue": name}
                         for name, row in sorted(rows.items())], schema=SCHEMA)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if isinstance(value, float) else str(value)


def render(rows: Sequence[dict[str, Any]], form: Literal["html", "markdown"]) -> str:
    """The section (heading, a line on what it counts, the table) in one format."""
    note = ("Waits from the queue events; ETA errors are the first estimate's against the "
            "start, beside the naive baseline (position / admission rate); gangs half-placed "
            "count the GPU-hours their placed members held while the others waited.")
    cells = [[_cell(row.get(key)) for key, _ in COLUMNS] for row in rows]
    if form == "markdown":
        lines = ["## Waiting", "", note, ""]
        if not rows:
            return "\n".join([*lines, "_none this week_", ""])
        lines += ["| " + " | ".join(title for _, title in COLUMNS) + " |",
                  "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines) + "\n"
    head = "".join(f"<th>{escape(title)}</th>" for _, title in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
                   for row in cells)
    table = f"<table><tr>{head}</tr>{body}</table>" if rows else "<p><i>none this week</i></p>"
    return f"<h2>Waiting</h2><p>{escape(note)}</p>{table}"
