"""This week against the previous one, per team and per queue.

The previous week is read from its own report JSON (kept by
:mod:`gpusteward.reports.archive`), not recomputed: the comparison costs
nothing, and it compares with what readers were shown last week. A team or
queue present in only one of the two weeks compares with nothing (None).
"""

from __future__ import annotations

from typing import Any

TEAM_METRICS = ("allocated_gpu_hours", "used_gpu_hours", "idle_gpu_hours", "idle_cost_usd",
                "findings")
"""What the team trend compares; "findings" is the finding episodes of the team's pods."""


def change_pct(now: float | None, before: float | None) -> float | None:
    """Relative change in percent; None when there is nothing to compare with."""
    if now is None or before is None or before == 0:
        return None
    return 100 * (now - before) / before


def _team_values(data: dict[str, Any]) -> dict[str, dict[str, float | int]]:
    found = data.get("findings", {}).get("per_team", {})
    out: dict[str, dict[str, float | int]] = {
        row["team"]: {m: float(row[m]) for m in TEAM_METRICS if m in row}
           for row in data.get("teams", [])}
    for team, values in out.items():
        values["findings"] = int(found.get(team, 0))
    return out


def teams(data: dict[str, Any], previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per team, each metric now and last week (``<metric>_before``), biggest team first."""
    now, before = _team_values(data), _team_values(previous or {})
    rows = []
    for team in [r["team"] for r in data.get("teams", [])]:
        row: dict[str, Any] = {"team": team}
        for metric in TEAM_METRICS:
            row[metric] = now[team].get(metric)
            row[f"{metric}_before"] = before.get(team, {}).get(metric)
        rows.append(row)
    return rows


def queues(data: dict[str, Any], previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per queue, the p95 wait now and last week, seconds."""
    before = {r["cluster_queue"]: r for r in (previous or {}).get("queues", [])}
    return [{"cluster_queue": r["cluster_queue"], "wait_p95_s": r["wait_p95_s"],
             "wait_p95_s_before": before.get(r["cluster_queue"], {}).get("wait_p95_s"),
             "slo_s": r["slo_s"]} for r in data.get("queues", [])]


def totals(data: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """The fleet's headline figures last week, for the headline's arrows."""
    if previous is None:
        return {}
    keys = ("allocated_gpu_hours", "used_gpu_hours", "idle_gpu_hours", "idle_cost_usd",
            "recommended_saving_usd")
    return {k: previous["totals"].get(k) for k in keys}
