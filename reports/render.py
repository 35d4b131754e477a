"""The report's three formats, all rendered from the one JSON document.

HTML is a single self-contained file (inline CSS and SVG, no scripts, no
external requests), so it can be mailed or attached to a ticket. Markdown
carries the same sections for a wiki, a pull request or a chat; JSON is the
document itself for other tools (it alone keeps every piece of advice, in
``recommendations``).

The page reads top-down as a team lead acts: the headline with last week's
arrows, who held GPUs idle, what each team should change, then the trends and
the evidence. Each section is one function per format, taking the JSON
document, so a section can be added or moved without touching the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from html import escape
from pathlib import Path
from typing import Any

from gpusteward.reports import charts, waiting
from gpusteward.reports.build import Report
from gpusteward.reports.trends import data_ends_note, gaps_note, missing_note

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:14px 0 4px}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
td:first-child,th:first-child,td:last-child{text-align:left}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.chart{width:100%;height:auto;background:#fafafa;border:1px solid #eee}
.kpi{display:inline-block;margin:4px 18px 4px 0}.kpi b{font-size:20px;display:block}
.missing{background:#fdecea;border:1px solid #c0392b;padding:6px 10px}
.worse{color:#c0392b}.better{color:#1e8449}.tail{color:#555;font-style:italic}
details{font-size:12px;color:#444}
pre{background:#f5f5f5;padding:8px;font-size:11px;overflow:auto}
"""

Data = dict[str, Any]
Columns = Sequence[tuple[str, str]]


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _table_rows(rows: Sequence[Data], columns: Columns) -> list[list[str]]:
    return [[_num(row.get(key)) for key, _ in columns] for row in rows]


def change(now: float | None, before: float | None, worse_when_up: bool = True
           ) -> tuple[str, str]:
    """An arrow and the relative change against last week, and whether it is worse/better."""
    if now is None or before is None:
        return "", ""
    if before == 0:
        return ("=", "") if now == 0 else ("▲ new", "worse" if worse_when_up else "better")
    pct = 100 * (now - before) / before
    if abs(pct) < 0.5:
        return "= 0%", ""
    up = pct > 0
    return (f"{'▲' if up else '▼'} {pct:+.0f}%",
            "worse" if up == worse_when_up else "better")


TEAM_COLUMNS = [("team", "team"), ("allocated_gpu_hours", "allocated GPU-h"),
                ("used_gpu_hours", "used GPU-h"), ("efficiency_pct", "used %"),
                ("idle_gpu_hours", "idle GPU-h"), ("idle_cost_usd", "idle cost $"),
                ("allocated_cost_usd", "allocated cost $")]
HOLDER_COLUMNS = [("pod", "pod"), ("owner", "owner"), ("team", "team"),
                  ("idle_gpu_hours", "idle GPU-h"), ("longest_episode_h", "longest idle h"),
                  ("devices", "GPUs"), ("status", "what was done")]
ACTION_COLUMNS = [("workload", "workload"), ("kind", "advice"), ("current", "now"),
                  ("recommended", "recommended"), ("saving_usd", "saving $/week"),
                  ("others", "also possible"), ("reason", "why")]
TREND_METRICS = [("allocated_gpu_hours", "allocated GPU-h", False),
                 ("used_gpu_hours", "used GPU-h", False),
                 ("idle_gpu_hours", "idle GPU-h", True), ("idle_cost_usd", "idle cost $", True),
                 ("findings", "findings", True)]
"""Team trend columns: key, title, and whether a rise is worse."""
QUEUE_COLUMNS = [("cluster_queue", "queue"), ("admitted", "admitted"),
                 ("wait_p50_s", "p50 wait s"), ("wait_p95_s", "p95 wait s"), ("slo_s", "SLO s"),
                 ("within_slo_pct", "within SLO %")]
FAULT_COLUMNS = [("day", "day"), ("xid_events", "XID events"),
                 ("ecc_dbe_errors", "new DBE errors"),
                 ("throttled_device_minutes", "throttled device-minutes")]
FINDING_COLUMNS = [("kind", "rule"), ("episodes", "episodes"), ("resolved", "resolved")]
POOL_COLUMNS = [("pool", "pool"), ("gpus", "GPUs"), ("gpus_used", "GPUs needed"),
                ("mig_gpus", "of which MIG"),
                ("demand_share", "demand (instance-weeks)"), ("served_share", "served")]
CHANGE_COLUMNS = [("node", "node"), ("config_after", "nvidia.com/mig.config"),
                  ("gpus_changed", "GPUs changed"), ("instances_removed", "instances removed"),
                  ("instances_added", "instances added")]
NO_DATA_COLUMNS = [("workload", "workload"), ("team", "team"), ("current", "holds"),
                   ("gpu_hours", "GPU-h"), ("minutes", "minutes held"),
                   ("minutes_with_activity", "minutes with activity")]
HEATMAP_TEAMS = 4
"""Teams drawn as heatmaps, most allocated first (the JSON has every team)."""
WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def arrows_shown(data: Data) -> bool:
    """Arrows against last week only when the two weeks compare (no missing days)."""
    return bool(data["trends"].get("comparable", data["trends"]["previous_week"]))


def _not_comparable(data: Data) -> str:
    return (f"Not comparable with {data['trends']['previous_week']}: "
            f"{data['trends']['not_comparable']}; no arrows.")


def _workload_label(row: Data) -> str:
    return f"{row['namespace']}/{row['owner_name']}"


def _action_rows(team: Data) -> list[Data]:
    return [{**a, "others": ", ".join(f"{o['kind']} ${o['saving_usd']:,.0f}"
                                      for o in a["alternatives"])} for a in team["actions"]]


def _trend_rows(data: Data) -> list[Data]:
    """Team trend cells: each metric now with its arrow against last week (or, when the
    weeks do not compare, with last week's figure beside it)."""
    rows = []
    arrows = arrows_shown(data)
    for row in data["trends"]["teams"]:
        cells: Data = {"team": row["team"]}
        for key, _, worse_up in TREND_METRICS:
            if arrows:
                arrow, _ = change(row[key], row[f"{key}_before"], worse_up)
            else:
                arrow = f"(was {_num(row[f'{key}_before'])})"
            cells[key] = f"{_num(row[key])} {arrow}".strip()
        rows.append(cells)
    return rows


def heatmap_teams(data: Data) -> list[str]:
    return [r["team"] for r in data["teams"]][:HEATMAP_TEAMS]


def charts_for(data: Data) -> dict[str, str]:
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
    figures = {
        "teams": charts.bars(
            "Allocated vs used GPU-hours per team", [r["team"] for r in teams],
            {"allocated": [r["allocated_gpu_hours"] for r in teams],
             "used": [r["used_gpu_hours"] for r in teams]}, "GPU-hours"),
        "days": charts.bars(
            "Allocated vs used GPU-hours per day", days,
            {"allocated": [per_day["allocated"].get(d, 0.0) for d in days],
             "used": [per_day["used"].get(d, 0.0) for d in days]}, "GPU-hours"),
        "utilisation": charts.boxes(
            "Utilisation per workload, 16 largest (minute means)",
            [(_workload_label(r), r["util_p5"] or 0.0, r["util_p25"] or 0.0,
              r["util_p50"] or 0.0, r["util_p75"] or 0.0, r["util_p95"] or 0.0)
             for r in top], "activity %"),
        "queues": charts.bars(
            "Queue wait p95 vs SLO", [r["cluster_queue"] for r in data["queues"]],
            {"p95 wait": [r["wait_p95_s"] or 0.0 for r in data["queues"]]}, "seconds",
            marks=[r["slo_s"] for r in data["queues"]]),
        # Events only: throttled device-minutes are a duration, in the table below.
        "faults": charts.bars(
            "GPU fault events per day", [r["day"] for r in data["faults"]],
            {"XID events": [float(r["xid_events"]) for r in data["faults"]],
             "new DBE errors": [float(r["ecc_dbe_errors"]) for r in data["faults"]]}, "events"),
        "fragmentation": charts.lines(
            f"Fragmentation: share of free GPUs no {data['settings']['fragmentation_shape_gpus']}"
            "-GPU request fits (hourly)", [r["hour"][5:13] for r in fragmentation],
            {"stranded share": [100 * (r["stranded_share"] or 0.0) for r in fragmentation]},
            "% of free GPUs", y_max=100.0),
    }
    trend = data["trends"]["teams"]
    # Idle hours in GPU-hours only: their cost is in the table, on no second axis.
    idle_series: dict[str, Sequence[float]] = {
        "idle this week": [r["idle_gpu_hours"] for r in trend]}
    if data["trends"]["previous_week"]:
        idle_series = {"idle last week": [r["idle_gpu_hours_before"] or 0.0 for r in trend],
                       **idle_series}
    figures["idle"] = charts.bars("Idle GPU-hours per team" + (
        ", last week and this" if len(idle_series) > 1 else ""),
        [r["team"] for r in trend], idle_series, "GPU-hours")
    cells = {(r["team"], r["weekday"], r["hour"]): r["utilisation_pct"]
             for r in data["heatmap"]}
    for team in heatmap_teams(data):
        figures[f"heatmap:{team}"] = charts.heatmap(
            f"{team}: used share of allocated GPU-hours, by hour (UTC)", WEEKDAYS,
            [f"{h:02d}" for h in range(24)],
            [[cells.get((team, d + 1, h)) for h in range(24)] for d in range(7)], "%")
    return figures


# ---- HTML, one function per section ----------------------------------------------------


def _html_table(rows: Sequence[Data], columns: Columns,
                classes: Sequence[dict[str, str]] | None = None) -> str:
    if not rows:
        return "<p><i>none this week</i></p>"
    head = "".join(f"<th>{escape(title)}</th>" for _, title in columns)
    body = []
    for i, cells in enumerate(_table_rows(rows, columns)):
        marks = classes[i] if classes else {}
        body.append("<tr>" + "".join(
            f"<td class='{marks[key]}'>{escape(c)}</td>" if marks.get(key)
            else f"<td>{escape(c)}</td>" for (key, _), c in zip(columns, cells, strict=True))
            + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def html_missing(data: Data, figures: dict[str, str]) -> str:
    notes = [note for note in (missing_note(data), data_ends_note(data), gaps_note(data))
             if note]
    return "".join(f"<p class='missing'><b>{escape(note)}</b></p>" for note in notes)


def html_headline(data: Data, figures: dict[str, str]) -> str:
    totals = data["totals"]
    before = data["trends"]["totals"] if arrows_shown(data) else {}
    # Physical GPUs: a time-sliced GPU's holders and a GPU's MIG devices count it once.
    kpis = [("GPUs seen", _num(totals["gpus"]), None, None, True)]
    for key, title, digits, worse_up in (
            ("allocated_gpu_hours", "allocated GPU-h", 1, False),
            ("used_gpu_hours", "used GPU-h", 1, False),
            ("idle_gpu_hours", "idle GPU-h", 1, True), ("idle_cost_usd", "idle cost $", 0, True),
            ("recommended_saving_usd", "advised saving $/week", 0, True)):
        kpis.append((title, _num(totals[key], digits), totals[key], before.get(key), worse_up))
    spans = []
    for title, shown, now, was, worse_up in kpis:
        arrow, mood = change(now, was, worse_up)
        note = f" <small class='{mood}'>{escape(arrow)}</small>" if arrow else ""
        spans.append(f"<span class='kpi'><b>{shown}{note}</b>{escape(title)}</span>")
    versus = ""
    if arrows_shown(data):
        versus = f"<p>Arrows: against {escape(data['trends']['previous_week'])}.</p>"
    elif data["trends"]["previous_week"]:
        versus = f"<p class='missing'>{escape(_not_comparable(data))}</p>"
    return f"<div>{''.join(spans)}</div>{versus}"


def html_idle_holders(data: Data, figures: dict[str, str]) -> str:
    threshold = data["settings"]["idle_threshold_pct"]
    return (f"<h2>Who held GPUs idle</h2><p>Pods with the most GPU-hours below "
            f"{threshold:g}% peak activity; the longest unbroken idle run on one GPU; what the "
            "live idle rule did about it this week and, for a reclaim, what the executor "
            "did (reclaimed only when it carried it out).</p>"
            + _html_table(data["idle_holders"], HOLDER_COLUMNS))


def html_actions(data: Data, figures: dict[str, str]) -> str:
    settings = data["settings"]
    parts = ["<h2>What each team should change</h2>",
             f"<p>One action per workload, the biggest saving first (p"
             f"{settings['percentile']:g} of demand plus {settings['headroom_pct']:g}% headroom, "
             f"at least {settings['min_points']} minutes of data); a workload idle all week is "
             "told to give its GPUs back.</p>"]
    if not data["actions"]:
        parts.append("<p><i>nothing to change this week</i></p>")
    for team in data["actions"]:
        parts.append(f"<h3>{escape(team['team'])}: ${team['saving_usd']:,.0f}/week over "
                     f"{_count(team['workloads'], 'workload')}</h3>")
        parts.append(_html_table(_action_rows(team), ACTION_COLUMNS))
        if team["tail_summary"]:
            parts.append(f"<p class='tail'>{escape(team['tail_summary'])}</p>")
    if data.get("no_activity_data"):
        parts.append("<h3>No activity data: no advice</h3><p>Held GPUs without enough "
                     "minutes with an activity reading (e.g. MIG instances on a GPU without "
                     "GPM): neither idle nor busy as far as the report knows.</p>"
                     + _html_table(data["no_activity_data"], NO_DATA_COLUMNS))
    return "".join(parts)


def html_trends(data: Data, figures: dict[str, str]) -> str:
    trends = data["trends"]
    if not trends["previous_week"]:
        return ("<h2>Against last week</h2><p><i>No report of the previous week was kept, "
                "so there is nothing to compare with.</i></p>")
    arrows = arrows_shown(data)
    marks = []
    for row in trends["teams"]:
        marks.append({key: change(row[key], row[f"{key}_before"], worse_up)[1] if arrows
                      else "" for key, _, worse_up in TREND_METRICS})
    queues = [{**q, "change": change(q["wait_p95_s"], q["wait_p95_s_before"])[0]
               if arrows else "not comparable"} for q in trends["queues"]]
    note = "" if arrows else f"<p class='missing'>{escape(_not_comparable(data))}</p>"
    return (f"<h2>Against last week ({escape(trends['previous_week'])})</h2>" + note
            + _html_table(_trend_rows(data), [("team", "team"), *[(k, t) for k, t, _ in
                                                                   TREND_METRICS]], marks)
            + _html_table(queues, [("cluster_queue", "queue"), ("wait_p95_s", "p95 wait s"),
                                   ("wait_p95_s_before", "last week s"), ("change", "change"),
                                   ("slo_s", "SLO s")]))


def html_usage(data: Data, figures: dict[str, str]) -> str:
    return ("<h2>Usage and cost</h2><div class='grid'>" + figures["teams"] + figures["idle"]
            + figures["days"] + figures["utilisation"] + "</div>"
            + _html_table(data["teams"], TEAM_COLUMNS))


def html_heatmaps(data: Data, figures: dict[str, str]) -> str:
    maps = [figures[f"heatmap:{t}"] for t in heatmap_teams(data)]
    if not maps:
        return ""
    return ("<h2>When each team uses its GPUs</h2><div class='grid'>" + "".join(maps)
            + "</div>")


def html_mig(data: Data, figures: dict[str, str]) -> str:
    return ("<h2>MIG layouts per node pool</h2>" + _html_table(data["mig"]["pools"], POOL_COLUMNS)
            + _html_table(data["mig"]["changes"], CHANGE_COLUMNS)
            + f"<details><summary>mig-parted configuration</summary><pre>"
            f"{escape(data['mig_parted_yaml'])}</pre></details>")


def html_fleet(data: Data, figures: dict[str, str]) -> str:
    found = data["findings"]
    findings = (_html_table(found["by_kind"], FINDING_COLUMNS) if found["stored"]
                else "<p><i>No findings store configured.</i></p>")
    return ("<h2>Queues, faults and fragmentation</h2><div class='grid'>" + figures["queues"]
            + figures["faults"] + figures["fragmentation"] + "</div>"
            + _html_table(data["queues"], QUEUE_COLUMNS)
            + _html_table(data["faults"], FAULT_COLUMNS)
            + "<h3>What the live rules found this week</h3>" + findings)


def html_waiting(data: Data, figures: dict[str, str]) -> str:
    return waiting.render(data["waiting"], "html")


Section = Callable[[Data, dict[str, str]], str]
HTML_SECTIONS: list[Section] = [html_missing, html_headline, html_idle_holders, html_actions,
                                html_trends, html_usage, html_heatmaps, html_mig, html_fleet,
                                html_waiting]
"""The page's sections in reading order; add a section by adding its function here."""


def where_and_when(data: Data) -> str:
    """``week 2026-W47``, or ``prod-east, week 2026-W47`` where the cluster is named
    (``GPUSTEWARD_CLUSTER``): one reader may get several clusters' reports."""
    week = f"week {data['week']}"
    return f"{data['cluster']}, {week}" if data.get("cluster") else week


def html(report: Report) -> str:
    data = {**report.data, "mig_parted_yaml": report.mig_parted_yaml}
    figures = charts_for(data)
    return "\n".join([
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>gpusteward weekly report {escape(where_and_when(data))}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>GPU right-sizing report, {escape(where_and_when(data))}</h1>",
        *(section(data, figures) for section in HTML_SECTIONS),
        "</body></html>"])


# ---- Markdown, the same sections ---------------------------------------------------------


def _md_table(rows: Sequence[Data], columns: Columns) -> str:
    if not rows:
        return "_none this week_\n"
    lines = ["| " + " | ".join(t for _, t in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
              for cells in _table_rows(rows, columns)]
    return "\n".join(lines) + "\n"


def md_missing(data: Data) -> str:
    notes = [note for note in (missing_note(data), data_ends_note(data), gaps_note(data))
             if note]
    return "\n".join(f"> **{note}**\n" for note in notes)


def md_headline(data: Data) -> str:
    totals = data["totals"]
    before = data["trends"]["totals"] if arrows_shown(data) else {}

    def line(title: str, key: str, digits: int = 1, worse_up: bool = True) -> str:
        arrow = change(totals[key], before.get(key), worse_up)[0]
        return f"- {title}: {_num(totals[key], digits)}" + (f" ({arrow})" if arrow else "")

    return "\n".join([
        f"- GPUs seen: {totals['gpus']} ({totals['devices']} devices, MIG instances apart)",
        line("allocated GPU-hours", "allocated_gpu_hours", worse_up=False),
        line("used GPU-hours", "used_gpu_hours", worse_up=False),
        line("idle GPU-hours", "idle_gpu_hours"),
        line("idle cost $", "idle_cost_usd", 0),
        line("advised saving $/week", "recommended_saving_usd", 0),
        *([f"- {_not_comparable(data)}"] if data["trends"]["previous_week"]
          and not arrows_shown(data) else []), ""])


def md_idle_holders(data: Data) -> str:
    return "## Who held GPUs idle\n\n" + _md_table(data["idle_holders"], HOLDER_COLUMNS)


def md_actions(data: Data) -> str:
    parts = ["## What each team should change\n"]
    for team in data["actions"]:
        parts.append(f"### {team['team']}: ${team['saving_usd']:,.0f}/week over "
                     f"{_count(team['workloads'], 'workload')}\n")
        parts.append(_md_table(_action_rows(team), ACTION_COLUMNS))
        if team["tail_summary"]:
            parts.append(f"_{team['tail_summary']}_\n")
    if data.get("no_activity_data"):
        parts.append("### No activity data: no advice\n")
        parts.append(_md_table(data["no_activity_data"], NO_DATA_COLUMNS))
    return "\n".join(parts)


def md_trends(data: Data) -> str:
    if not data["trends"]["previous_week"]:
        return "## Against last week\n\n_no report of the previous week was kept_\n"
    arrows = arrows_shown(data)
    queues = [{**q, "change": change(q["wait_p95_s"], q["wait_p95_s_before"])[0]
               if arrows else "not comparable"} for q in data["trends"]["queues"]]
    return (f"## Against last week ({data['trends']['previous_week']})\n\n"
            + ("" if arrows else f"_{_not_comparable(data)}_\n\n")
            + _md_table(_trend_rows(data), [("team", "team"),
                                            *[(k, t) for k, t, _ in TREND_METRICS]]) + "\n"
            + _md_table(queues, [("cluster_queue", "queue"), ("wait_p95_s", "p95 wait s"),
                                 ("wait_p95_s_before", "last week s"), ("change", "change")]))


def md_usage(data: Data) -> str:
    return "## Teams\n\n" + _md_table(data["teams"], TEAM_COLUMNS)


def md_mig(data: Data) -> str:
    return ("## MIG layouts\n\n" + _md_table(data["mig"]["pools"], POOL_COLUMNS)
            + _md_table(data["mig"]["changes"], CHANGE_COLUMNS)
            + "```yaml\n" + data["mig_parted_yaml"].rstrip() + "\n```\n")


def md_fleet(data: Data) -> str:
    return ("## Queues\n\n" + _md_table(data["queues"], QUEUE_COLUMNS)
            + "\n## Faults\n\n" + _md_table(data["faults"], FAULT_COLUMNS)
            + "\n## Findings\n\n" + (_md_table(data["findings"]["by_kind"], FINDING_COLUMNS)
                                     if data["findings"]["stored"] else "_no findings store_\n"))


def md_waiting(data: Data) -> str:
    return waiting.render(data["waiting"], "markdown")


MD_SECTIONS: list[Callable[[Data], str]] = [md_missing, md_headline, md_idle_holders, md_actions,
                                            md_trends, md_usage, md_mig, md_fleet,
                                            md_waiting]


def markdown(report: Report) -> str:
    data = {**report.data, "mig_parted_yaml": report.mig_parted_yaml}
    return "\n".join([f"# GPU right-sizing report, {where_and_when(data)}", "",
                      *(section(data) for section in MD_SECTIONS)])


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
