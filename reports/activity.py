"""Who held GPUs idle, and when each team works, from the week's rollups.

The weekly fold (:mod:`gpusteward.reports.weekly`) sums by team, day and
workload; two questions a team lead asks need other keys, so they are folded
here, from the same slices as the weekly fold (bounded memory), the same
rows and the same definitions (:func:`gpusteward.reports.compute.prepare`'s
idle test: peak activity below the threshold; GPU-hours weighed by
``gpu_fraction``):

- **idle holders**: per pod, the idle GPU-hours it held and its longest idle
  episode (an unbroken run of idle minutes on one device). Runs are kept per
  slice as (start, end) pairs and joined across slices at the end, so an
  episode that crosses midnight is one episode. A pod is its namespace and
  name: its owner and team are what the rollups said last, since the node
  join may learn them after its first minutes (the kubelet names a pod, the
  watcher's allocation brings the owner), and one pod must not be two holders;
- **heatmap**: per team, used over allocated GPU-hours by hour of day and day
  of week (UTC), the shape of seed 002's dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from gpusteward.reports import compute, store

MINUTE_S = 60.0
COMPACT_EVERY = 8
"""Slices of idle runs kept before they are joined into episodes."""
POD = ["namespace", "pod", "owner_kind", "owner_name", "team"]
NAME = ["namespace", "pod"]
"""What names a holder; the rest of ``POD`` describes it (the latest known)."""
ABOUT = [c for c in POD if c not in NAME]
COLUMNS = ["node", "gpu_fraction", "util_mean", "util_max", *POD]


@dataclass
class Activity:
    holders: pl.DataFrame
    """Per pod: namespace, pod, owner, team, idle_gpu_hours, longest_episode_h, devices,
    biggest first."""
    heatmap: pl.DataFrame
    """Per team, weekday (1 = Monday) and hour (0-23, UTC): allocated and used GPU-hours and
    utilisation_pct."""


class ActivityFold:
    """Folds slices of the week's rows (as :func:`store.slices` yields them, with at least
    :data:`COLUMNS`) into idle-holder runs and heatmap hours.

    The weekly fold reads the store once and hands each slice to this fold too
    (:func:`gpusteward.reports.weekly.fold_week`'s ``also``): a second pass over
    100 M rows would cost as much again as the first.
    """

    columns = COLUMNS

    def __init__(self, idle_threshold_pct: float) -> None:
        self.idle_threshold_pct = idle_threshold_pct
        self.runs: list[pl.DataFrame] = []
        self.hours: list[pl.DataFrame] = []
        # Episodes per (device, pod): those that ended, summed, and the last one, which the
        # next slice may continue. Bounded by devices x pods, not by runs: a busy week
        # breaks idleness into tens of millions of runs.
        self.closed = pl.DataFrame(schema=CLOSED_SCHEMA)
        self.open = pl.DataFrame(schema=RUN_SCHEMA)
        self.inner: list[pl.DataFrame] = []
        """Runs that are whole episodes (see :meth:`add`), as :data:`CLOSED_SCHEMA`."""

    def add(self, rows: pl.DataFrame) -> None:
        """Fold one slice: all rows of its minutes, after those of the slice before (as
        :func:`store.slices` yields them)."""
        rows = rows.select("ts", "uuid", *COLUMNS).filter(pl.col("pod").is_not_null()
                                                         ).with_columns(
            # A categorical fallback: a text one would turn the whole column into text.
            pl.coalesce("team", "namespace", pl.lit("unattributed", dtype=pl.Categorical)
                        ).alias("team"),
            (pl.col("gpu_fraction").cast(pl.Float64) / 60).alias("gpu_hours"),
            compute.idle_minute(self.idle_threshold_pct).alias("idle"))
        if rows.is_empty():
            return
        # Grouped by the hour's start, a number: a slice lies in one day, so it stands for
        # (weekday, hour), which are then worked out once per group instead of per row.
        stamp = ((pl.col("ts") // 3600 * 3600_000).cast(pl.Int64)
                 .cast(pl.Datetime("ms", "UTC")))
        self.hours.append(rows.group_by(stamp.alias("stamp"), "team").agg(
            pl.col("gpu_hours").sum().alias("allocated_gpu_hours"),
            (pl.col("gpu_hours") * pl.col("util_mean").fill_null(0) / 100).sum()
            .alias("used_gpu_hours")).select(
            "team", pl.col("stamp").dt.weekday().alias("weekday"),
            pl.col("stamp").dt.hour().alias("hour"), "allocated_gpu_hours",
            "used_gpu_hours"))
        runs = _runs(rows.filter("idle"))
        # A run that starts and ends more than a gap inside the slice cannot continue one
        # of another slice, which holds only earlier or later minutes: it is a whole
        # episode, and only the few runs at the slice's edges are joined.
        inner = ((pl.col("first") - rows["ts"].min() > 1.5 * MINUTE_S)
                 & (rows["ts"].max() - pl.col("last") > 1.5 * MINUTE_S))
        self.inner.append(_as_closed(runs.filter(inner)))
        self.runs.append(runs.filter(~inner))
        if len(self.runs) >= COMPACT_EVERY:
            self._compact()

    def _compact(self) -> None:
        """Join the runs into episodes; keep each key's last episode open, sum the others."""
        key = ["uuid", *NAME]
        episodes = _episodes(pl.concat([self.open, *self.runs]))
        latest = pl.col("last") == pl.col("last").max().over(key)
        self.open = episodes.filter(latest)
        self.closed = _closed(pl.concat([self.closed, *self.inner,
                                         _as_closed(episodes.filter(~latest))]))
        self.runs, self.inner = [], []

    def finish(self) -> Activity:
        heatmap_schema = {"team": pl.String, "weekday": pl.Int8, "hour": pl.Int8,
                          "allocated_gpu_hours": pl.Float64, "used_gpu_hours": pl.Float64}
        heatmap = (pl.concat(self.hours).cast(heatmap_schema)  # type: ignore[arg-type]
                   if self.hours else pl.DataFrame(schema=heatmap_schema))
        heatmap = heatmap.group_by("team", "weekday", "hour").agg(
            pl.col("allocated_gpu_hours", "used_gpu_hours").sum()).with_columns(
            (100 * pl.col("used_gpu_hours") / pl.col("allocated_gpu_hours")).alias(
                "utilisation_pct")).sort("team", "weekday", "hour")
        self._compact()
        return Activity(holders=_holders(pl.concat([self.closed, _as_closed(self.open)])),
                        heatmap=heatmap)


def fold(directory: Path, start: float, end: float, idle_threshold_pct: float) -> Activity:
    """Idle holders and the team heatmap of [start, end) in the store at ``directory``
    (a pass of its own; the report folds them in the weekly fold's pass)."""
    activity = ActivityFold(idle_threshold_pct)
    for rows in store.slices(directory, start, end, COLUMNS):
        activity.add(rows)
    return activity.finish()


# The text columns stay categoricals (as :func:`store.slices` reads them) until the holders
# table: runs and episodes are sorted and grouped by them several times a slice.
RUN_SCHEMA = {"uuid": pl.Categorical, **dict.fromkeys(POD, pl.Categorical),
              "first": pl.Float64, "last": pl.Float64, "gpu_hours": pl.Float64}


def _latest(columns: list[str], by: str | None = None) -> list[pl.Expr]:
    """Each column's last non-null value in the order of ``by`` (None: the rows' order,
    which a group keeps)."""
    return [(pl.col(c) if by is None else pl.col(c).sort_by(by)).drop_nulls().last().alias(c)
            for c in columns]


def _codes(columns: list[str]) -> list[pl.Expr]:
    """Sort keys that put each key's rows together: the categoricals' codes (the same for
    a text everywhere in this process), not their text, whose order is not needed and
    costs several times as much to sort by."""
    return [pl.col(c).to_physical() for c in columns]


def _runs(idle: pl.DataFrame) -> pl.DataFrame:
    """Unbroken runs of idle minutes per (device, pod): first and last minute, GPU-hours,
    and the pod's owner and team as the run's last minute knew them."""
    key = ["uuid", *NAME]
    ordered = idle.sort([*_codes(key), "ts"])
    # A new run where the key changes or a minute is missing.
    gap = ((pl.col("ts").diff() > 1.5 * MINUTE_S)
           | pl.any_horizontal([pl.col(k).ne_missing(pl.col(k).shift()) for k in key])
           ).fill_null(True)
    # Grouped by the run's number alone (its key is the same on all its rows): one integer
    # groups several times faster than it with the key's three columns.
    return (ordered.with_columns(gap.cum_sum().alias("run"))
            .group_by("run").agg(*[pl.col(k).first() for k in key],
                                 pl.col("ts").min().alias("first"),
                                 pl.col("ts").max().alias("last"),
                                 pl.col("gpu_hours").sum(), *_latest(ABOUT))
            .select(*RUN_SCHEMA).cast(RUN_SCHEMA))  # type: ignore[arg-type]


def _episodes(runs: pl.DataFrame) -> pl.DataFrame:
    """Runs joined into episodes per (device, pod), in the runs' schema: a run that starts
    the minute after the previous one of its key ended continues it (across slices, so an
    episode that crosses midnight is one)."""
    key = ["uuid", *NAME]
    every = runs.sort([*_codes(key), "first"])
    # A new episode where the key changes or the gap after the key's previous run is long.
    gap = ((pl.col("first") - pl.col("last").shift() > 1.5 * MINUTE_S)
           | pl.any_horizontal([pl.col(k).ne_missing(pl.col(k).shift()) for k in key])
           ).fill_null(True)
    return every.with_columns(gap.cum_sum().alias("episode")).group_by("episode").agg(
        *[pl.col(k).first() for k in key], pl.col("first").min(), pl.col("last").max(),
        pl.col("gpu_hours").sum(), *_latest(ABOUT)).select(*RUN_SCHEMA)


CLOSED_SCHEMA = {"uuid": pl.Categorical, **dict.fromkeys(POD, pl.Categorical),
                 "gpu_hours": pl.Float64, "hours": pl.Float64, "last": pl.Float64}
"""Episodes per (device, pod), summed: idle GPU-hours, the longest episode's hours, the
last idle minute (which orders the owner and team known last)."""


def _as_closed(episodes: pl.DataFrame) -> pl.DataFrame:
    return episodes.select(
        "uuid", *POD, "gpu_hours",
        ((pl.col("last") - pl.col("first") + MINUTE_S) / 3600).alias("hours"), "last")


def _closed(episodes: pl.DataFrame) -> pl.DataFrame:
    """Per (device, pod): GPU-hours summed, the longest episode, the latest owner."""
    return episodes.group_by("uuid", *NAME).agg(
        pl.col("gpu_hours").sum(), pl.col("hours").max(), *_latest(ABOUT, "last"),
        pl.col("last").max()).select(*CLOSED_SCHEMA)


def _holders(episodes: pl.DataFrame) -> pl.DataFrame:
    """Per pod (over its devices): idle GPU-hours, longest episode, devices, biggest first."""
    joined = _closed(episodes)
    return (joined.group_by(NAME).agg(
        pl.col("gpu_hours").sum().alias("idle_gpu_hours"),
        pl.col("hours").max().alias("longest_episode_h"),
        pl.col("uuid").n_unique().cast(pl.UInt32).alias("devices"), *_latest(ABOUT, "last"))
        .select(*[pl.col(c).cast(pl.String) for c in POD], "idle_gpu_hours",
                "longest_episode_h", "devices")
        .sort(["idle_gpu_hours", "namespace", "pod"], descending=[True, False, False]))
