"""The report's three formats, all rendered from the one JSON document.

HTML is a single self-contained file (inline CSS and SVG, no scripts, no
external requests), so it can be mailed or attached to a ticket. Markdown
carries the same tables for a wiki or a pull request; JSON is the document
itself for other tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from html import escape
from pathlib import Path
from typing import Any

from gpusteward.reports import charts, waiting
from gpusteward.reports.build import Report

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
td:first-child,th:first-child,td:last-child{text-align:left}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.chart{width:100%;height:auto;background:#fafafa;border:1px solid #eee}
.kpi{display:inline-block;margin:4px 18px 4px 0}.kpi b{font-size:20px;display:block}
pre{background:#f5f5f5;padding:8px;font-size:11px;overflow:auto}
"""


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _table_rows(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]
                ) -> list[list[str]]:
    return [[_num(row.get(key)) for key, _ in columns] for row in rows]


TEAM_COLUMNS = [("team", "team"), ("allocated_gpu_hours", "allocated GPU-h"),
                ("used_gpu_hours", "used GPU-h"), ("efficiency_pct", "used %"),
                ("idle_gpu_hours", "idle GPU-h"), ("idle_cost_usd", "idle cost $"),
                ("allocated_cost_usd", "allocated cost $")]
ADVICE_COLUMNS = [("workload", "workload"), ("team", "team"), ("kind", "advice"),
                  ("current", "now"), ("recommended", "recommended"),
                  ("saving_usd", "saving $/week"), ("points", "minutes"), ("reason", "why")]
QUEUE_COLUMNS = [("cluster_queue", "queue"), ("admitted", "admitted"),
                 ("wait_p50_s", "p50 wait s"), ("wait_p95_s", "p95 wait s"), ("slo_s", "SLO s"),
                 ("within_slo_pct", "within SLO %")]
FAULT_COLUMNS = [("day", "day"), ("xid_events", "XID events"),
                 ("ecc_dbe_errors", "new DBE errors"),
                 ("throttled_device_minutes", "throttled device-minutes")]
POOL_COLUMNS = [("pool", "pool"), ("gpus", "GPUs"), ("gpus_used", "GPUs needed"),
                ("mig_gpus", "of which MIG"),
                ("demand_share", "demand (instance-weeks)"), ("served_share", "served")]
HTML_ADVICE_ROWS = 40
"""The HTML shows the largest savings; Markdown and JSON carry every recommendation."""
CHANGE_COLUMNS = [("node", "node"), ("config_after", "nvidia.com/mig.config"),
                  ("gpus_changed", "GPUs changed"), ("instances_removed", "instances removed"),
                  ("instances_added", "instances added")]


def _workload_label(row: dict[str, Any]) -> str:
    return f"{row['namespace']}/{row['owner_name']}"


def charts_for(data: dict[str, Any]) -> dict[str, str]:
    teams = data["teams"]
    first = datetime.fromtimestamp(data["start"], UTC).date()
    days = [(first + timedelta(days=i)).isoformat() for i in range(7)]
    per_day: dict[str, dict[str, float]] = {"allocated": {}, "used": {}}
    for row in data["daily"]:
        per_day["allocated"][row["day"]] = per_day["allocated"].get(row["day"], 0.0) + \
            row["allocated_gpu_hours"]
        per_day["used"][row["day"]] = per_day["used"].get(row["day"], 0.0) + \
            row["used_gpu_hours"]
    top = data["workloads"][:16]
    fragmentation = data["fragmentation"]
    return {
        "teams": charts.bars(
            "Allocated vs used GPU-hours per team", [r["team"] for r in teams],
            {"allocated": [r["allocated_gpu_hours"] for r in teams],
             "used": [r["used_gpu_hours"] for r in teams]}, "GPU-hours"),
        "days": charts.bars(
            "Allocated vs used GPU-hours per day", days,
            {"allocated": [per_day["allocated"].get(d, 0.0) for d in days],
             "used": [per_day["used"].get(d, 0.0) for d in days]}, "GPU-hours"),
        "idle": charts.bars(
            "Idle GPU-hours and their cost per team", [r["team"] for r in teams],
            {"idle GPU-hours": [r["idle_gpu_hours"] for r in teams],
             "idle cost $": [r["idle_cost_usd"] for r in teams]}, "GPU-hours / USD"),
        "utilisation": charts.boxes(
            "Utilisation per workload (p5-p25-p50-p75-p95 of minute means)",
            [(_workload_label(r), r["util_p5"] or 0.0, r["util_p25"] or 0.0,
              r["util_p50"] or 0.0, r["util_p75"] or 0.0, r["util_p95"] or 0.0)
             for r in top], "activity %"),
        "queues": charts.bars(
            "Queue wait p95 vs SLO", [r["cluster_queue"] for r in data["queues"]],
            {"p95 wait (s)": [r["wait_p95_s"] or 0.0 for r in data["queues"]]}, "seconds",
            marks=[r["slo_s"] for r in data["queues"]]),
        "faults": charts.bars(
            "Faults per day", [r["day"] for r in data["faults"]],
            {"XID events": [float(r["xid_events"]) for r in data["faults"]],
             "new DBE errors": [float(r["ecc_dbe_errors"]) for r in data["faults"]],
             "throttled device-min": [float(r["throttled_device_minutes"])
                                      for r in data["faults"]]}, "count"),
        "fragmentation": charts.lines(
            f"Fragmentation: share of free GPUs no {data['settings']['fragmentation_shape_gpus']}"
            "-GPU request fits (hourly)", [r["hour"][5:13] for r in fragmentation],
            {"stranded share %": [100 * (r["stranded_share"] or 0.0) for r in fragmentation]},
            "% of free GPUs", y_max=100.0),
    }


def html(report: Report) -> str:
    data = report.data
    totals = data["totals"]
    figures = charts_for(data)

    def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
        if not rows:
            return "<p><i>none this week</i></p>"
        head = "".join(f"<th>{escape(title)}</th>" for _, title in columns)
        body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>"
                       for cells in _table_rows(rows, columns))
        return f"<table><tr>{head}</tr>{body}</table>"

    kpis = [("GPUs seen", _num(totals["devices"])),
            ("allocated GPU-h", _num(totals["allocated_gpu_hours"])),
            ("used GPU-h", _num(totals["used_gpu_hours"])),
            ("idle GPU-h", _num(totals["idle_gpu_hours"])),
            ("idle cost $", _num(totals["idle_cost_usd"], 0)),
            ("advised saving $/week", _num(totals["recommended_saving_usd"], 0))]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>gpusteward weekly report {escape(data['week'])}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>GPU right-sizing report, week {escape(data['week'])}</h1>",
        "<div>" + "".join(f"<span class='kpi'><b>{v}</b>{escape(k)}</span>" for k, v in kpis)
        + "</div>",
        "<h2>Usage and cost</h2><div class='grid'>",
        figures["teams"], figures["days"], figures["idle"], figures["utilisation"], "</div>",
        table(data["teams"], TEAM_COLUMNS),
        "<h2>Recommendations per workload</h2>",
        f"<p>p{data['settings']['percentile']:g} of demand plus "
        f"{data['settings']['headroom_pct']:g}% headroom, at least "
        f"{data['settings']['min_points']} minutes of data.</p>",
        table(data["recommendations"][:HTML_ADVICE_ROWS], ADVICE_COLUMNS),
        f"<p>{max(0, len(data['recommendations']) - HTML_ADVICE_ROWS)} more in report.json "
        "and report.md.</p>" if len(data["recommendations"]) > HTML_ADVICE_ROWS else "",
        "<h2>MIG layouts per node pool</h2>",
        table(data["mig"]["pools"], POOL_COLUMNS),
        table(data["mig"]["changes"], CHANGE_COLUMNS),
        f"<pre>{escape(report.mig_parted_yaml)}</pre>",
        "<h2>Queues, faults and fragmentation</h2><div class='grid'>",
        figures["queues"], figures["faults"], figures["fragmentation"], "</div>",
        table(data["queues"], QUEUE_COLUMNS),
        table(data["faults"], FAULT_COLUMNS),
        waiting.render(data.get("waiting", []), "html"),
        "</body></html>",
    ]
    return "\n".join(parts)


def markdown(report: Report) -> str:
    data = report.data
    totals = data["totals"]

    def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
        if not rows:
            return "_none this week_\n"
        lines = ["| " + " | ".join(t for _, t in columns) + " |",
                 "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
                  for cells in _table_rows(rows, columns)]
        return "\n".join(lines) + "\n"

    return "\n".join([
        f"# GPU right-sizing report, week {data['week']}",
        "",
        f"- GPUs seen: {totals['devices']}",
        f"- allocated GPU-hours: {_num(totals['allocated_gpu_hours'])}",
        f"- used GPU-hours: {_num(totals['used_gpu_hours'])}",
        f"- idle GPU-hours: {_num(totals['idle_gpu_hours'])} "
        f"(${_num(totals['idle_cost_usd'], 0)})",
        f"- advised saving: ${_num(totals['recommended_saving_usd'], 0)} per week",
        "", "## Teams", "", table(data["teams"], TEAM_COLUMNS),
        "## Recommendations", "", table(data["recommendations"], ADVICE_COLUMNS),
        "## MIG layouts", "", table(data["mig"]["pools"], POOL_COLUMNS),
        table(data["mig"]["changes"], CHANGE_COLUMNS),
        "```yaml", report.mig_parted_yaml.rstrip(), "```", "",
        "## Queues", "", table(data["queues"], QUEUE_COLUMNS),
        "## Faults", "", table(data["faults"], FAULT_COLUMNS),
        waiting.render(data.get("waiting", []), "markdown"),
    ])


def write(report: Report, directory: Path) -> list[Path]:
    """Write report.html, report.md, report.json and mig-parted.yaml into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    outputs = {
        "report.html": html(report),
        "report.md": markdown(report),
        "report.json": json.dumps(report.data, indent=1, default=str) + "\n",
        "mig-parted.yaml": report.mig_parted_yaml,
    }
    written = []
    for name, text in outputs.items():
        path = directory / name
        temporary = directory / f".{name}.tmp"
        temporary.write_text(text)
        temporary.replace(path)
        written.append(path)
    return written
