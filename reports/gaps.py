"""Where the week has no data: the minutes a node sent no rollup between two it sent.

A minute without a rollup is not an idle minute: the collector was down, the
node unreachable, or the pipeline behind. The report counts such a minute as
neither allocated nor idle (there is no row to count), so a node's gap lowers
its GPU-hours without a word unless the report names it. A node reports every
device every minute it is read, held or not, so a node's minutes without any
row between its first and its last of the week are its gaps; before its first
and after its last it was not in the fleet (joined or left mid-week), which is
no gap.

The same holds for the whole fleet at the week's end: rollups that had not
reached the store when the report ran (the stream worker or the rollup sink
behind or down over Sunday night) count nowhere, and every node merely seems
to stop early. :func:`data_ends` names that.

Folded from the weekly fold's slices (:func:`gpusteward.reports.weekly.fold_week`'s
``also``), as runs of minutes per node, joined across slices: bounded by the
nodes and their gaps, not by rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, date, datetime

import polars as pl

MINUTE_S = 60.0
TAIL_S = 15 * 60.0
"""How long before the week's end (or before now, for a week not over) the store's data
may stop without a word: the worker publishes a minute a lateness (60 s) after its end
and the sink writes every ``flush_interval_s`` (300 s)."""
COMPACT_EVERY = 8
"""Slices of runs kept before they are joined."""
SPAN_SCHEMA = {"node": pl.String, "first": pl.Float64, "last": pl.Float64}
GAP_SCHEMA = {"node": pl.String, "start": pl.Float64, "end": pl.Float64,
              "minutes": pl.Int64}
"""A gap: the node, its first minute without data, the minute its data came back
(exclusive), and the minutes between."""


class GapFold:
    """Folds slices of the week's rows into per-node runs of minutes with data."""

    columns = ["node"]

    def __init__(self) -> None:
        self.spans: list[pl.DataFrame] = []
        self.last: float | None = None
        """The newest minute with data in the week."""

    def add(self, rows: pl.DataFrame) -> None:
        if rows.is_empty():
            return
        newest = float(rows["ts"].max())  # type: ignore[arg-type]
        self.last = newest if self.last is None else max(self.last, newest)
        # A node's minutes, once each (a row per device), before any text is made.
        minutes = rows.select("node", "ts").unique()
        self.spans.append(_joined(minutes.select(
            pl.col("node").cast(pl.String), pl.col("ts").alias("first"),
            pl.col("ts").alias("last"))))
        if len(self.spans) >= COMPACT_EVERY:
            self.spans = [_joined(pl.concat(self.spans))]

    def finish(self) -> pl.DataFrame:
        """The week's gaps, longest first."""
        if not self.spans:
            return pl.DataFrame(schema=GAP_SCHEMA)
        spans = _joined(pl.concat(self.spans)).sort("node", "first")
        return (spans.with_columns(pl.col("last").shift().over("node").alias("before"))
                .filter(pl.col("before").is_not_null())
                .select("node", (pl.col("before") + MINUTE_S).alias("start"),
                        pl.col("first").alias("end"),
                        ((pl.col("first") - pl.col("before")) / MINUTE_S - 1)
                        .round().cast(pl.Int64).alias("minutes"))
                .sort(["minutes", "node", "start"], descending=[True, False, False]))


def data_ends(last: float | None, end: float, now: float, missing: Sequence[date] = ()
              ) -> dict[str, object] | None:
    """When the week's data stops more than :data:`TAIL_S` before its end (or before
    ``now``, in a week not over): the first minute without data and the end (ISO UTC),
    and the minutes between; None otherwise, and for a week without data. The week's last
    ``missing`` days (no file at all, named as such) are not counted again."""
    until = min(end, now)
    while (day := _day_before(until)) in missing:
        until = datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()
    if last is None or until - (last + MINUTE_S) <= TAIL_S:
        return None
    after = last + MINUTE_S
    return {"after": _iso(after), "until": _iso(until),
            "minutes": round((until - after) / MINUTE_S)}


def _day_before(ts: float) -> date:
    return datetime.fromtimestamp(ts - 1, UTC).date()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def per_node(found: pl.DataFrame) -> list[dict[str, object]]:
    """The gaps per node, most minutes first: minutes and gaps in all, and the longest
    (its first minute without data and the minute data came back, ISO UTC)."""
    if found.is_empty():
        return []
    iso = "%Y-%m-%dT%H:%M:%SZ"
    return (found.group_by("node").agg(
        pl.col("minutes").sum(), pl.len().cast(pl.Int64).alias("gaps"),
        *[pl.col(c).sort_by("minutes", descending=True).first().alias(f"longest_{c}")
          for c in ("start", "end", "minutes")])
        .with_columns([(pl.col(c) * 1000).cast(pl.Int64).cast(pl.Datetime("ms", "UTC"))
                       .dt.strftime(iso) for c in ("longest_start", "longest_end")])
        .sort(["minutes", "node"], descending=[True, False]).to_dicts())


def _joined(spans: pl.DataFrame) -> pl.DataFrame:
    """Spans of one node that touch or overlap (the next starts at most a minute after
    the last ends) joined into one."""
    ordered = spans.sort("node", "first")
    reach = pl.col("last").cum_max().shift().over("node")
    new = ((pl.col("first") - reach > 1.5 * MINUTE_S)
           | pl.col("node").ne_missing(pl.col("node").shift())).fill_null(True)
    return (ordered.with_columns(new.cum_sum().alias("span")).group_by("span")
            .agg(pl.col("node").first(), pl.col("first").min(), pl.col("last").max())
            .select(*SPAN_SCHEMA).cast(SPAN_SCHEMA))  # type: ignore[arg-type]
