"""One week's report, assembled: the numbers, the advice and the MIG plan.

:func:`build` is what ``gpusteward report`` runs between reading and
rendering; it returns a :class:`Report` whose ``data`` is the JSON document,
from which the HTML and Markdown are rendered, so the three formats cannot
disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import yaml

from gpusteward.reports import (
    activity,
    compute,
    findings,
    gaps,
    recommend,
    store,
    trends,
    waiting,
    weekly,
)
from gpusteward.reports import policy as live_policy
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.rules.mig import layout
from gpusteward.rules.policy import Policy

Step = Callable[[str], None]

STEPS = ("reading rollups", "usage and cost", "idle holders and hours", "workload advice",
         "MIG layouts", "done")


@dataclass
class Report:
    week: compute.Week
    data: dict[str, Any]
    mig_parted_yaml: str
    spill_bytes: int = 0
    """The peak size of the run's spill on disk (:attr:`ReportSettings.spill_dir`)."""

    @property
    def empty(self) -> bool:
        """No rollups at all in the week: every figure is 0, and nobody should act on it."""
        return not self.data["totals"]["device_minutes"]


def build(directory: Path, week: compute.Week, settings: ReportSettings,
          queue: pl.DataFrame | Path | None = None,
          geometries: Mapping[str, mig_geometry.Geometry] | None = None,
          step: Step | None = None, rows: weekly.Rows | None = None,
          policy: Policy | None = None, findings_dir: Path | None = None,
          previous: dict[str, Any] | None = None, results_dir: Path | None = None,
          cluster: str = "") -> Report:
    """The report for ``week`` from the rollup store at ``directory``.

    ``queue`` is the week's queue events, or the folder of their store. ``step``
    hears each stage's name as it starts, ``rows`` the rows read so far and the
    rows in the week's files. ``policy`` is the live rules' policy (default: their
    defaults): queue SLOs and, unless ``settings`` set it, the idle threshold come
    from it. ``findings_dir`` is the findings store (who was told, who reclaimed;
    None: not kept), ``results_dir`` the executor's audit records (whether a reclaim
    was carried out; None: not kept), ``previous`` last week's report JSON for the trends,
    ``cluster`` the cluster's name (``GPUSTEWARD_CLUSTER``; empty: none) the title and the
    summary give.
    Raises
    :class:`store.StoreError` for files another version wrote; days without files
    are listed in ``missing_days``.
    """
    geometries = mig_geometry.load() if geometries is None else geometries
    policy = policy or Policy()
    settings = live_policy.aligned(settings, policy)
    advance = step or (lambda _name: None)
    advance(STEPS[0])
    missing = store.missing_days(directory, week.start, week.end)
    holders = activity.ActivityFold(settings.idle_threshold_pct)
    unseen = gaps.GapFold()
    tables = weekly.fold_week(directory, week.start, week.end, settings, geometries, rows,
                              also=[holders, unseen])
    advance(STEPS[1])
    if isinstance(queue, Path):
        queue = store.scan_queue(queue, week.start, week.end)
    slos = live_policy.queue_slos(policy)
    queues = compute.queue_table(queue, slos)
    advance(STEPS[2])
    # Folded in the same pass, with keys of their own (pod; team, weekday and hour).
    hours = holders.finish()
    found = findings.read(findings_dir, week.start, week.end)
    decided = findings.read_results(results_dir, week.start)
    waits = waiting.waiting_table(queue, found, week.start, week.end)
    advance(STEPS[3])
    advice = recommend.recommend(tables.need, settings, geometries)
    advance(STEPS[4])
    pools, demand, today = recommend.mig_demand(tables.gpus, tables.devices, tables.need,
                                                week.minutes, settings, geometries)
    plan = layout.advise(geometries, pools, demand, current=today)
    advance(STEPS[5])

    teams = tables.teams
    totals = {
        "devices": tables.devices["uuid"].n_unique(),
        # Physical GPUs: a time-sliced GPU's holders share its uuid, a MIG device its parent's.
        "gpus": tables.gpus["gpu"].n_unique(),
        "nodes": tables.devices["node"].n_unique(),
        "device_minutes": tables.device_minutes,
        **{c: float(teams[c].sum()) for c in ("allocated_gpu_hours", "used_gpu_hours",
                                               "idle_gpu_hours", "idle_cost_usd",
                                               "allocated_cost_usd")},
        "recommended_saving_usd": _best_saving(advice),
    }
    data: dict[str, Any] = {
        "week": week.label,
        "cluster": cluster or None,
        "start": week.start,
        "end": week.end,
        "missing_days": [day.isoformat() for day in missing],
        # Minutes a node sent no rollup between two it sent: no data, not idleness.
        "gaps": gaps.per_node(unseen.finish()),
        # The week's data stopping early: rollups not yet stored when the report ran.
        "data_ends": gaps.data_ends(unseen.last, week.end, time.time(), missing),
        "settings": {
            "idle_threshold_pct": settings.idle_threshold_pct,
            "percentile": settings.percentile,
            "memory_percentile": settings.memory_percentile,
            "headroom_pct": settings.headroom_pct,
            "min_points": settings.min_points,
            "fragmentation_shape_gpus": settings.fragmentation_shape_gpus,
            "hourly_usd": {m: g.hourly_usd for m, g in settings.gpu_models.items()},
            "queue_slo_s": slos.slo_s,
            "default_queue_slo_s": slos.default_slo_s,
        },
        "totals": totals,
        "teams": compute.records(teams),
        "daily": compute.records(tables.daily),
        "workloads": compute.records(tables.workloads),
        "recommendations": [r.as_dict() for r in advice],
        # Held long enough for advice, without the activity readings advice needs.
        "no_activity_data": recommend.no_activity_data(tables.need, settings),
        "actions": [t.as_dict() for t in recommend.per_team(advice, settings.actions_per_team)],
        "queues": compute.records(queues),
        "waiting": compute.records(waits),
        "faults": compute.records(tables.faults),
        "idle_holders": _idle_holders(
            hours.holders, found, findings_dir is not None,
            findings.idle_reclaims(found, decided) if results_dir is not None else None,
            findings.restores(decided) if results_dir is not None else None,
            settings.idle_holders_shown),
        "heatmap": compute.records(hours.heatmap),
        "findings": {
            "stored": findings_dir is not None,
            "by_kind": compute.records(findings.episodes_by_kind(found)),
            "per_team": findings.per_team(found, hours.holders.select(
                "namespace", "team").unique(subset="namespace", keep="first")),
        },
        "fragmentation": compute.records(tables.fragmentation),
        "mig": {
            "pools": [{
                "pool": p.pool.name, "model": p.pool.model, "gpus": p.pool.gpus,
                "gpus_used": p.gpus_used, "mig_gpus": p.mig_gpus,
                "demand_share": p.demand_share,
                "served_share": p.served_share, "unserved": p.unserved,
                "instances": layout.instance_count(p.gpu_layouts),
            } for p in plan.pools],
            "mig_parted": plan.mig_parted,
            "labels": plan.labels,
            "changes": [{
                "node": c.node, "config_before": c.config_before,
                "config_after": c.config_after, "gpus_changed": c.gpus_changed,
                "instances_removed": c.instances_removed,
                "instances_added": c.instances_added,
            } for c in plan.changes],
        },
    }
    data["trends"] = {
        "previous_week": previous["week"] if previous else None,
        **trends.comparability(data, previous),
        "totals": trends.totals(data, previous),
        "teams": trends.teams(data, previous),
        "queues": trends.queues(data, previous),
    }
    return Report(week=week, data=data,
                  mig_parted_yaml=yaml.safe_dump(plan.mig_parted, sort_keys=False),
                  spill_bytes=tables.spill_bytes)


def _best_saving(advice: list[recommend.Recommendation]) -> float:
    """Sum over workloads of their single best saving (the kinds do not add up)."""
    return sum(a.best.saving_usd for a in recommend.per_workload(advice))


def _idle_holders(holders: pl.DataFrame, found: pl.DataFrame, stored: bool,
                  reclaims: pl.DataFrame | None, restores: pl.DataFrame | None,
                  shown: int) -> list[dict[str, Any]]:
    """The top idle holders, each with what the idle rule did about it this week and,
    where the executor's results are kept (``reclaims``), what became of its reclaim: an
    operator's restore of its owner after the reclaim (``restores``) undid it."""
    pods = ["namespace", "pod"]
    outcomes = reclaims if reclaims is not None else pl.DataFrame(
        schema={"namespace": pl.String, "pod": pl.String, "outcome": pl.String,
                "detail": pl.String, "decided_at": pl.Float64})
    undone = restores if restores is not None else pl.DataFrame(
        schema={"owner": pl.String, "restored_at": pl.Float64, "restored_by": pl.String})
    top = (holders.head(shown).join(findings.idle_ladder(found), on=pods, how="left")
           .join(outcomes, on=pods, how="left")
           # The owner a restore names: KIND/NAMESPACE/NAME, as `act --restore` takes it.
           .with_columns(pl.concat_str("owner_kind", "namespace", "owner_name", separator="/")
                         .alias("restore_owner")))
    # The first restore of the owner after its reclaim was carried out undid that reclaim
    # (a later one may undo a later week's reclaim).
    first_restore = (top.filter(pl.col("outcome") == "executed")
                     .join(undone, left_on="restore_owner", right_on="owner")
                     .filter(pl.col("restored_at") >= pl.col("decided_at"))
                     .sort("restored_at").group_by(pods).first()
                     .select(*pods, "restored_at", "restored_by"))
    top = top.join(first_restore, on=pods, how="left")
    out = []
    for row in top.iter_rows(named=True):
        owner = f"{row['owner_kind'] or 'Pod'}/{row['owner_name'] or row['pod']}"
        restored = row["restored_at"] is not None
        status = _status(row["ladder_step"], row["reclaim"], stored, row["outcome"],
                         reclaims is not None)
        out.append({"namespace": row["namespace"], "pod": row["pod"], "owner": owner,
                    "team": row["team"], "idle_gpu_hours": row["idle_gpu_hours"],
                    "longest_episode_h": row["longest_episode_h"], "devices": row["devices"],
                    "ladder_step": row["ladder_step"], "reclaim_outcome": row["outcome"],
                    "reclaim_detail": row["detail"],
                    "restored_at": row["restored_at"], "restored_by": row["restored_by"],
                    "status": (f"{status}, then restored by {row['restored_by']}"
                               if restored else status)})
    return out


def _status(step: int | None, reclaim: str | None, stored: bool, outcome: str | None,
            results_stored: bool) -> str:
    """What the idle rule's ladder did: told, warned, reclaim asked; and, from the
    executor's results, whether the reclaim was carried out ("reclaimed") or not."""
    if not stored:
        return "unknown (no findings store)"
    if step is None:
        return "not told (no episode past the rule's window)"
    if step < 3:
        return "warned" if step == 2 else "told"
    if outcome is not None:
        return {"executed": "reclaimed", "refused": "reclaim refused by the executor",
                "failed": "reclaim failed", "dry_run": "reclaim asked (dry run)",
                "skipped": "reclaim skipped (nothing left to reclaim)"}.get(outcome, outcome)
    ordered = "reclaim ordered, no executor result" if results_stored else "reclaim ordered"
    return {"execute": ordered, "dry_run": "reclaim asked (dry run)",
            "refused": "reclaim refused (bare pod)"}.get(reclaim or "", "reclaim asked")
