"""One week's report, assembled: the numbers, the advice and the MIG plan.

:func:`build` is what ``gpusteward report`` runs between reading and
rendering; it returns a :class:`Report` whose ``data`` is the JSON document,
from which the HTML and Markdown are rendered, so the three formats cannot
disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import yaml

from gpusteward.reports import compute, recommend, store, waiting, weekly
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.rules.mig import layout
from gpusteward.schema import Finding

Step = Callable[[str], None]

STEPS = ("reading rollups", "usage and cost", "workload advice", "MIG layouts", "done")


@dataclass
class Report:
    week: compute.Week
    data: dict[str, Any]
    mig_parted_yaml: str


def build(directory: Path, week: compute.Week, settings: ReportSettings,
          queue: pl.DataFrame | Path | None = None,
          geometries: Mapping[str, mig_geometry.Geometry] | None = None,
          step: Step | None = None, rows: weekly.Rows | None = None,
          findings: Iterable[Finding] = ()) -> Report:
    """The report for ``week`` from the rollup store at ``directory``.

    ``queue`` is the week's queue events, or the folder of their store; ``findings``
    those the waiting section reads (start ETAs closed, gangs half-placed). ``step``
    hears each stage's name as it starts, ``rows`` the rows read so far and the
    rows in the week's files. Raises :class:`store.StoreError` for files another
    version wrote; days without files are listed in ``missing_days``.
    """
    geometries = mig_geometry.load() if geometries is None else geometries
    advance = step or (lambda _name: None)
    advance(STEPS[0])
    missing = store.missing_days(directory, week.start, week.end)
    tables = weekly.fold_week(directory, week.start, week.end, settings, geometries, rows)
    advance(STEPS[1])
    if isinstance(queue, Path):
        queue = store.scan_queue(queue, week.start, week.end)
    queues = compute.queue_table(queue, settings)
    waits = waiting.waiting_table(queue, findings, week.start, week.end)
    advance(STEPS[2])
    advice = recommend.recommend(tables.need, settings, geometries)
    advance(STEPS[3])
    pools, demand, today = recommend.mig_demand(tables.gpus, tables.devices, tables.need,
                                                week.minutes, settings, geometries)
    plan = layout.advise(geometries, pools, demand, current=today)
    advance(STEPS[4])

    teams = tables.teams
    totals = {
        "devices": tables.devices["uuid"].n_unique(),
        "nodes": tables.devices["node"].n_unique(),
        "device_minutes": tables.device_minutes,
        **{c: float(teams[c].sum()) for c in ("allocated_gpu_hours", "used_gpu_hours",
                                               "idle_gpu_hours", "idle_cost_usd",
                                               "allocated_cost_usd")},
        "recommended_saving_usd": _best_saving(advice),
    }
    data: dict[str, Any] = {
        "week": week.label,
        "start": week.start,
        "end": week.end,
        "missing_days": [day.isoformat() for day in missing],
        "settings": {
            "idle_threshold_pct": settings.idle_threshold_pct,
            "percentile": settings.percentile,
            "memory_percentile": settings.memory_percentile,
            "headroom_pct": settings.headroom_pct,
            "min_points": settings.min_points,
            "fragmentation_shape_gpus": settings.fragmentation_shape_gpus,
            "hourly_usd": {m: g.hourly_usd for m, g in settings.gpu_models.items()},
        },
        "totals": totals,
        "teams": compute.records(teams),
        "daily": compute.records(tables.daily),
        "workloads": compute.records(tables.workloads),
        "recommendations": [r.as_dict() for r in advice],
        "queues": compute.records(queues),
        "waiting": compute.records(waits),
        "faults": compute.records(tables.faults),
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
    return Report(week=week, data=data,
                  mig_parted_yaml=yaml.safe_dump(plan.mig_parted, sort_keys=False))


def _best_saving(advice: list[recommend.Recommendation]) -> float:
    """Sum over workloads of their single best saving (the kinds do not add up)."""
    best: dict[str, float] = {}
    for r in advice:
        best[r.workload] = max(best.get(r.workload, 0.0), r.saving_usd)
    return sum(best.values())
