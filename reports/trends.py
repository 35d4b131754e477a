"""This week against the previous one, per team and per queue.

The previous week is read from its own report JSON (kept by
:mod:`gpusteward.reports.archive`), not recomputed: the comparison costs
nothing, and it compares with what readers were shown last week. A team or
queue present in only one of the two weeks compares with nothing (None).

Two weeks are comparable only when neither misses a day of rollups nor has its
data stop early (rollups not yet stored when it was reported): a week
whose sink was down for two days shows less idle time because it saw less,
not because anyone gave a GPU back (:func:`comparability`; the report then
shows both weeks' figures without arrows). Nor are two weeks measured with
another idle threshold or another price of a model they used: the same
fleet doing the same would show other idle hours or costs.
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


def _team_values(data: dict[str, Any]) -> dict[str, dict[str, float | int | None]]:
    found = data.get("findings", {})
    # A week reported without the findings store knows no team's findings: None, not 0.
    stored = found.get("stored", True)
    out: dict[str, dict[str, float | int | None]] = {
        row["team"]: {m: float(row[m]) for m in TEAM_METRICS if m in row}
           for row in data.get("teams", [])}
    for team, values in out.items():
        values["findings"] = int(found.get("per_team", {}).get(team, 0)) if stored else None
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


def missing_note(data: dict[str, Any]) -> str | None:
    """The line that says the week lacks data, for every format and the webhook summary;
    None when every day has rollups."""
    days = data.get("missing_days") or []
    if not days:
        return None
    if len(days) == 7:
        return (f"Data missing for the whole week ({days[0]} to {days[-1]}): no rollups were "
                "stored, so every figure is 0. Check the rollup sink.")
    others = 7 - len(days)
    return (f"Data missing for {', '.join(days)}: no rollups were stored on "
            f"{'that day' if len(days) == 1 else 'those days'}, so the figures cover the "
            f"other {others} day{'' if others == 1 else 's'} only.")


def gaps_note(data: dict[str, Any]) -> str | None:
    """The line that says nodes sent no data for part of the week (``gaps``: a collector
    or the pipeline down), for every format and the webhook summary; None without gaps."""
    found = data.get("gaps") or []
    if not found:
        return None
    hours = sum(g["minutes"] for g in found) / 60
    top = found[0]
    nodes = f"{len(found)} node{'' if len(found) == 1 else 's'}"
    return (f"No data from {nodes} for {hours:,.1f} node-hours in all (longest: {top['node']}, "
            f"{top['longest_minutes'] / 60:,.1f} h from {top['longest_start']}): the collector "
            "or the pipeline was down. Those minutes count as neither allocated nor idle, "
            "so the GPU-hours are short by them.")


def data_ends_note(data: dict[str, Any]) -> str | None:
    """The line that says the week's data stops before its end (``data_ends``: rollups
    not yet stored when the report ran), for every format and the webhook summary."""
    ends = data.get("data_ends")
    if not ends:
        return None
    return (f"No data from {ends['after']} to {ends['until']} ({ends['minutes'] / 60:,.1f} h), "
            "the end of the week's data: "
            "rollups that had not reached the store when the report ran (the stream worker "
            "or the rollup sink behind or down) count nowhere. Run the report for "
            f"{data['week']} again once they are in.")


def comparability(data: dict[str, Any], previous: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """Whether this week compares with the previous one: ``comparable`` (False without a
    previous week) and, when either misses days of rollups or has its data stop early,
    ``not_comparable`` saying which."""
    if previous is None:
        return {"comparable": False, "not_comparable": None}
    reasons = []
    if data.get("missing_days"):
        reasons.append(f"data missing this week ({', '.join(data['missing_days'])})")
    if previous.get("missing_days"):
        reasons.append(f"data missing in {previous['week']} "
                       f"({', '.join(previous['missing_days'])})")
    # Data stopping early (rollups not yet stored) is missing data too.
    for week, which in ((data, "this week"), (previous, f"in {previous['week']}")):
        ends = week.get("data_ends")
        if ends:
            reasons.append(f"no data {which} from {ends['after']} to {ends['until']}")
    reasons.extend(_measured_otherwise(data, previous))
    return {"comparable": not reasons,
            "not_comparable": "; ".join(reasons) if reasons else None}


def _measured_otherwise(data: dict[str, Any], previous: dict[str, Any]) -> list[str]:
    """Settings that changed what the figures measure between the two weeks: another idle
    threshold counts other minutes idle, another price of a model either week used costs
    the same hours otherwise (a week kept without its settings is taken as measured alike)."""
    now, before = data.get("settings") or {}, previous.get("settings") or {}
    reasons = []
    threshold, threshold_before = (now.get("idle_threshold_pct"),
                                   before.get("idle_threshold_pct"))
    if None not in (threshold, threshold_before) and threshold != threshold_before:
        reasons.append(f"idle threshold {threshold_before:g}% in {previous['week']}, "
                       f"{threshold:g}% this week")
    prices, prices_before = now.get("hourly_usd") or {}, before.get("hourly_usd") or {}
    used = sorted({w["gpu_model"] for week in (data, previous)
                   for w in week.get("workloads", []) if w.get("gpu_model")})
    for model in used:
        price, price_before = prices.get(model), prices_before.get(model)
        if price != price_before:
            reasons.append(f"{model} {_price(price_before)} in {previous['week']}, "
                           f"{_price(price)} this week")
    return reasons


def _price(hourly_usd: float | None) -> str:
    return "the default price" if hourly_usd is None else f"${hourly_usd:g}/h"


def totals(data: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """The fleet's headline figures last week, for the headline's arrows."""
    if previous is None:
        return {}
    keys = ("allocated_gpu_hours", "used_gpu_hours", "idle_gpu_hours", "idle_cost_usd",
            "recommended_saving_usd")
    return {k: previous["totals"].get(k) for k in keys}
