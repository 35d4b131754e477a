"""Per-workload right-sizing in the style of krr: a percentile of demand plus headroom.

A workload gets advice only with at least ``min_points`` minutes with an
activity reading: a minute without one (the NVML collector has none for a MIG
instance without GPM, nor for a GPU's first GPM sample) is no evidence of
idleness or of use, and a workload held that long without enough readings is
listed as having no activity data (:func:`no_activity_data`) instead of
being told anything. Its demand per minute is the GPU-equivalents it used
(sum over its devices of activity x device share) and the peak memory of
each device; a device's compute need is its activity times its share of the
GPU (a MIG instance's or a time-sliced holder's activity is relative to its
share), so a pod on a quarter of a GPU is never advised more. The
percentile (default p95) of that, plus ``headroom_pct``, is what it needs;
memory uses its own percentile (default the week's peak) because running
out of GPU memory kills the job. Four kinds of advice, each with the
saving it would have made this week at the settings' prices:

- ``give_back``: the workload's p95 activity (relative to what it holds, as
  the idle rule reads it) stays under the idle threshold: it held GPUs for
  nothing, and no smaller GPU fixes that (saving: everything it was
  allocated; it is the only advice such a workload gets);
- ``fewer_gpus``: a multi-GPU workload whose need rounds up to fewer GPUs;
- ``mig_profile``: a whole-GPU workload whose per-device need fits a MIG
  profile of its model (saving: the GPU-hours it held less the profile's
  share for the same minutes);
- ``cheaper_model``: the cheapest model whose memory holds it and whose
  compute keeps it under ``target_util_pct`` (saving: what it paid less a
  whole GPU of that model for the same device-minutes).

Advice that would save nothing (a time-sliced pod already holds less than
the profile or the cheaper GPU) is not given.

A workload can earn several kinds; :func:`per_team` keeps one action per
workload (the best saving, the others folded under it) and groups them by
team, biggest saving first, the long tail counted in one line.

The MIG demand for the layout recommender comes from the same numbers:
each device of a workload that fits a profile, with its share of the week;
a workload told ``give_back`` asks for no slice (its GPU should be freed, not
cut up for it), and a MIG workload without activity data asks for the profile
it holds (nothing says it needs less).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import polars as pl

from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.rules.mig.layout import Demand, Pool, smallest_fitting

GIB = 1 << 30


@dataclass
class Recommendation:
    workload: str
    team: str
    kind: str
    """give_back, fewer_gpus, mig_profile or cheaper_model."""
    current: str
    recommended: str
    saving_usd: float
    saving_gpu_hours: float
    points: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def workload_name(namespace: str | None, owner_kind: str | None, owner_name: str | None) -> str:
    return f"{namespace}/{(owner_kind or 'Pod').lower()}/{owner_name}"


def percentile_activity_pct(row: Mapping[str, Any]) -> float:
    """A workload's activity at the settings' percentile, relative to what it holds (a
    MIG instance, a share of a GPU), over the minutes with a reading."""
    return float(row["activity_pct"])


def has_activity_data(row: Mapping[str, Any], settings: ReportSettings) -> bool:
    """Enough minutes with an activity reading for advice."""
    return bool(row["points"] >= settings.min_points)


def no_activity_data(need: pl.DataFrame, settings: ReportSettings) -> list[dict[str, Any]]:
    """Workloads held long enough for advice but with too few activity readings for any:
    they get none, and the report says why."""
    out = []
    for row in need.iter_rows(named=True):
        if row["minutes"] >= settings.min_points and not has_activity_data(row, settings):
            out.append({"workload": workload_name(row["namespace"], row["owner_kind"],
                                                  row["owner_name"]),
                        "team": row["team"] or "", "gpu_hours": row["gpu_hours"],
                        "minutes": row["minutes"], "minutes_with_activity": row["points"],
                        "current": _held(row)})
    return sorted(out, key=lambda r: (-r["gpu_hours"], r["workload"]))


def _held(row: Mapping[str, Any]) -> str:
    """What a workload holds: "2 x H100-80GB", "0.25 x A100-80GB" (a shared GPU), or
    "1 x 1g.10gb" (MIG)."""
    devices = max(1, round(row["device_minutes"] / row["minutes"]))
    if row["uses_mig"] and row.get("mig_profile"):
        return f"{devices} x {row['mig_profile']}"
    held = row["gpus_held"]
    return f"{held:.2g} x {row['gpu_model']}" if held < 0.995 else \
        f"{devices} x {row['gpu_model']}"


def idle_all_week(row: Mapping[str, Any], settings: ReportSettings) -> bool:
    """Told ``give_back``: its activity at the percentile stays under the idle threshold."""
    return percentile_activity_pct(row) < settings.idle_threshold_pct


def recommend(need: pl.DataFrame, settings: ReportSettings,
              geometries: Mapping[str, mig_geometry.Geometry]) -> list[Recommendation]:
    out: list[Recommendation] = []
    for row in need.iter_rows(named=True):
        if not has_activity_data(row, settings):
            continue
        name = workload_name(row["namespace"], row["owner_kind"], row["owner_name"])
        team = row["team"] or ""
        hourly = row["hourly_usd"]
        hours = row["gpu_hours"]
        points = row["points"]
        why = (f"p{settings.percentile:g} use {row['gpus_needed']:.2f} GPU incl. "
               f"{settings.headroom_pct:g}% headroom over {points} min")
        held = row["gpus_held"]
        if idle_all_week(row, settings):
            # Idle all week: fewer GPUs, a MIG slice or a cheaper model would still be held
            # for nothing, so none is advised, not even as an alternative.
            out.append(Recommendation(
                name, team, "give_back", _held(row), "release the GPU",
                hours * hourly, hours, points,
                f"p{settings.percentile:g} activity "
                f"{percentile_activity_pct(row):.1f}% is below the idle threshold "
                f"({settings.idle_threshold_pct:g}%) over {points} min"))
            continue
        if not row["uses_mig"] and held > 1:
            mem_gpus = 0
            if row["device_mem_total"]:
                # The memory it holds at its peak, re-spread over full GPUs.
                mem_gpus = math.ceil(held * row["device_mem_needed"] / row["device_mem_total"])
            target = max(1, math.ceil(row["gpus_needed"] - 1e-9), mem_gpus)
            if target < round(held):
                saved_hours = hours * (1 - target / held)
                out.append(Recommendation(name, team, "fewer_gpus", f"{held:.1f} GPUs",
                                          f"{target} GPUs", saved_hours * hourly,
                                          saved_hours, points, why))
        geometry = geometries.get(row["gpu_model"])
        if not row["uses_mig"] and geometry is not None:
            profile = smallest_fitting(geometry, row["device_mem_needed"],
                                       row["device_compute_needed"])
            share = (profile.compute_slices / geometry.total_compute_slices
                     if profile is not None else 1.0)
            # Against what it holds: a time-sliced pod on a quarter of a GPU saves nothing
            # by moving to 2/7 of one.
            saved_hours = hours - share * row["device_minutes"] / 60
            if profile is not None and share < 1 and saved_hours > 1e-9:
                count = max(1, round(row["device_minutes"] / row["minutes"]))
                out.append(Recommendation(
                    name, team, "mig_profile", _held(row),
                    f"{count} x {profile.name}", saved_hours * hourly, saved_hours,
                    points, f"peak memory {row['device_mem_needed'] / GIB:.1f} GiB and "
                    f"p{settings.percentile:g} activity "
                    f"{row['device_compute_needed'] * 100:.0f}% per GPU incl. headroom"))
        cheaper = _cheaper_model(row, settings)
        if cheaper is not None and not row["uses_mig"]:
            model, price = cheaper
            # A whole GPU of that model for each device-minute, against what it paid for its
            # share: nothing saved for a pod holding a slice of a dearer GPU.
            saved = hours * hourly - row["device_minutes"] / 60 * price
            if saved <= 1e-9:
                continue
            out.append(Recommendation(
                name, team, "cheaper_model", row["gpu_model"], model, saved, 0.0, points,
                f"needs {row['device_mem_needed'] / GIB:.1f} GiB and fits under "
                f"{settings.target_util_pct:g}% of a {model}"))
    return sorted(out, key=lambda r: -r.saving_usd)


@dataclass
class WorkloadAction:
    """One workload's advice: the best saving, the other kinds folded under it."""

    best: Recommendation
    alternatives: list[Recommendation]

    def as_dict(self) -> dict[str, Any]:
        return {**self.best.as_dict(),
                "alternatives": [{"kind": r.kind, "recommended": r.recommended,
                                  "saving_usd": r.saving_usd} for r in self.alternatives]}


@dataclass
class TeamActions:
    """A team's action list: its top workloads' actions and the rest in one line."""

    team: str
    actions: list[WorkloadAction]
    """The largest savings, biggest first."""
    tail: list[WorkloadAction]
    """The rest, summarised by :meth:`tail_summary`."""

    @property
    def saving_usd(self) -> float:
        return sum(a.best.saving_usd for a in [*self.actions, *self.tail])

    def tail_summary(self) -> str:
        """E.g. "42 more workloads: $958/week (30 to L40S-48GB, 12 to a MIG slice)"."""
        if not self.tail:
            return ""
        counts: dict[str, int] = {}
        for action in self.tail:
            what = _short(action.best)
            counts[what] = counts.get(what, 0) + 1
        parts = ", ".join(f"{n} {what}" for what, n in
                          sorted(counts.items(), key=lambda item: (-item[1], item[0])))
        saving = sum(a.best.saving_usd for a in self.tail)
        noun = "workload" if len(self.tail) == 1 else "workloads"
        return f"{len(self.tail)} more {noun}: ${saving:,.0f}/week ({parts})"

    def as_dict(self) -> dict[str, Any]:
        return {"team": self.team, "saving_usd": self.saving_usd,
                "workloads": len(self.actions) + len(self.tail),
                "actions": [a.as_dict() for a in self.actions],
                "tail_workloads": len(self.tail),
                "tail_saving_usd": sum(a.best.saving_usd for a in self.tail),
                "tail_summary": self.tail_summary()}


def _short(advice: Recommendation) -> str:
    return {"give_back": "to give back", "fewer_gpus": "on fewer GPUs",
            "mig_profile": "to a MIG slice"}.get(advice.kind, f"to {advice.recommended}")


def per_workload(advice: list[Recommendation]) -> list[WorkloadAction]:
    """One action per workload, biggest saving first; a tie goes to the earlier kind."""
    grouped: dict[str, list[Recommendation]] = {}
    for r in advice:
        grouped.setdefault(r.workload, []).append(r)
    actions = []
    for items in grouped.values():
        ranked = sorted(items, key=lambda r: (-r.saving_usd, KINDS.index(r.kind)))
        actions.append(WorkloadAction(ranked[0], ranked[1:]))
    return sorted(actions, key=lambda a: (-a.best.saving_usd, a.best.workload))


def per_team(advice: list[Recommendation], shown: int) -> list[TeamActions]:
    """Each team's actions (``shown`` listed, the rest summarised), biggest saving first."""
    teams: dict[str, list[WorkloadAction]] = {}
    for action in per_workload(advice):
        teams.setdefault(action.best.team, []).append(action)
    out = [TeamActions(team, actions[:shown], actions[shown:]) for team, actions in teams.items()]
    return sorted(out, key=lambda t: (-t.saving_usd, t.team))


KINDS = ("give_back", "fewer_gpus", "mig_profile", "cheaper_model")
"""Advice kinds, in the order a tie is broken: the simplest change first."""


def _cheaper_model(row: dict[str, Any], settings: ReportSettings) -> tuple[str, float] | None:
    current = settings.gpu_models.get(row["gpu_model"])
    if current is None:
        return None
    best: tuple[str, float] | None = None
    for name, model in settings.gpu_models.items():
        if model.hourly_usd >= current.hourly_usd:
            continue
        if row["device_mem_needed"] > model.memory_gib * GIB:
            continue
        scaled = row["device_compute_needed"] * 100 * current.relative_compute \
            / model.relative_compute
        if scaled > settings.target_util_pct:
            continue
        if best is None or model.hourly_usd < best[1]:
            best = (name, model.hourly_usd)
    return best


def mig_demand(gpus: pl.DataFrame, devices: pl.DataFrame, need: pl.DataFrame,
               week_minutes: int, settings: ReportSettings,
               geometries: Mapping[str, mig_geometry.Geometry]
               ) -> tuple[list[Pool], dict[str, list[Demand]],
                          dict[str, list[dict[str, int] | None]]]:
    """Pools (one per MIG-capable model), their demand, and each node's layout today.

    ``gpus`` has a row per physical GPU (gpu_model, node, gpu), ``devices`` a row
    per device seen (node, index, uuid, kind, parent_uuid, mig_profile), ``need``
    the per-workload table of the week's fold.
    """
    nodes = (gpus.group_by("gpu_model", "node").agg(pl.col("gpu").n_unique().alias("gpus"))
             .sort("gpu_model", "node"))
    pools: list[Pool] = []
    for (model,), group in nodes.group_by("gpu_model", maintain_order=True):
        if model not in geometries:
            continue
        pools.append(Pool(name=str(model), model=str(model),
                          nodes=tuple(group["node"].to_list()),
                          gpus_per_node=int(group["gpus"].max())))  # type: ignore[arg-type]
    demand: dict[str, list[Demand]] = {}
    for row in need.iter_rows(named=True):
        geometry = geometries.get(row["gpu_model"])
        if geometry is None or row["minutes"] < settings.min_points:
            continue
        if not has_activity_data(row, settings):
            # Nothing says it needs less than it holds: a MIG workload keeps its profile.
            profile = _current_profile(geometry, row)
        elif idle_all_week(row, settings):
            continue  # an idle workload is told to give its GPU back, not given a slice
        else:
            profile = smallest_fitting(geometry, row["device_mem_needed"],
                                       row["device_compute_needed"])
        if profile is None:
            continue
        name = workload_name(row["namespace"], row["owner_kind"], row["owner_name"])
        # Devices held at once: GPUs, MIG instances, or one share of a shared GPU.
        held = max(1, round(row["device_minutes"] / row["minutes"]))
        share = row["device_minutes"] / held / week_minutes
        for i in range(held):
            label = name if held == 1 else f"{name}#{i}"
            demand.setdefault(row["gpu_model"], []).append(Demand(label, profile.name,
                                                                   min(1.0, share)))
    return pools, demand, current_layouts(devices)


def _current_profile(geometry: mig_geometry.Geometry,
                     row: Mapping[str, Any]) -> mig_geometry.Profile | None:
    """The MIG profile a workload holds, if it holds one its model's geometry knows."""
    if not row["uses_mig"] or not row["mig_profile"]:
        return None
    try:
        return geometry.profile(row["mig_profile"])
    except mig_geometry.GeometryError:
        return None


def current_layouts(devices: pl.DataFrame) -> dict[str, list[dict[str, int] | None]]:
    """Each node's GPUs as seen this week: the MIG profiles on each, None for a whole GPU."""
    devices = devices.select("node", "index", "uuid", "kind", "parent_uuid", "mig_profile"
                             ).unique()
    gpus: dict[str, dict[tuple[int, str], dict[str, int] | None]] = {}
    for node, index, uuid, kind, parent, profile in devices.sort("node", "index", "uuid"
                                                                 ).iter_rows():
        per_node = gpus.setdefault(node, {})
        if kind == "mig" and parent and profile:
            layout = per_node.get((index, parent)) or {}
            layout[profile] = layout.get(profile, 0) + 1
            per_node[(index, parent)] = layout
        else:
            per_node.setdefault((index, uuid), None)
    return {node: [per_node[g] for g in sorted(per_node)] for node, per_node in gpus.items()}
