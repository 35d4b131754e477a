"""The weekly report's numbers, computed with polars from the rollup store.

Every figure is a plain aggregation over the (device, minute) rows, so a
reader can recompute any of them from the Parquet files (the tests do):

- GPU-hours weigh each device-minute by ``gpu_fraction`` (1 for a whole GPU,
  compute slices / total for a MIG device) and divide by 60;
- *allocated* counts device-minutes with an attributed pod, *used* weighs
  them by mean activity (``util_mean`` / 100), *idle* counts those whose peak
  activity stayed below the idle threshold;
- cost is GPU-hours times the model's hourly price from the settings;
- a workload is (namespace, owner kind, owner name): the pods of one
  Deployment, Job or notebook count together, under the team its latest
  rollups carried; the team tables count each minute for the team it carried.

Minutes without an activity reading (the NVML collector has none for a MIG
instance without GPM, nor for a GPU's first GPM sample) count as allocated,
not used and not idle: the report does not guess, as the live idle rule
treats such a sample as no observation and the rollup sink's idle metric
does not count it (:func:`idle_minute`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import polars as pl

from gpusteward.errors import ConfigError
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.rules.queue import QueueSloSettings

WORKLOAD = ["team", "namespace", "owner_kind", "owner_name"]
"""A workload's columns in the report's tables: what names it and its team."""
WORKLOAD_NAME = ["namespace", "owner_kind", "owner_name"]
"""What names a workload. Its team is not part of the name: a pod whose team label changed
mid-week stays one workload, of the team its latest rollups carried, while the team tables
give each team the GPU-hours it held."""
COLUMNS = ["ts", "node", "index", "uuid", "model", "kind", "parent_uuid", "mig_profile",
           "gpu_fraction", "util_mean", "util_max", "mem_used_max", "mem_total_bytes",
           "throttled_samples", "ecc_dbe_new", "xid_count", "namespace", "owner_kind",
           "owner_name", "team", "pod", "clock"]
"""The store columns the report reads as they are. ``pod`` and ``clock`` are needed
although the tables group by workload: a shared GPU has a row per holding pod, a node
whose clock stepped back names some minutes again on its new clock, and the rows are
named (and redelivered copies dropped) by device, minute, pod and clock
(:data:`store.ROW_NAME`)."""

ALLOCATED = pl.col("pod").is_not_null().alias("allocated")
"""A device-minute is allocated when a pod held it."""

READ: list[str | pl.Expr] = [*COLUMNS, ALLOCATED]
"""What the report reads from the store: :func:`prepare`'s input."""


class WeekError(ConfigError, ValueError):
    """A week that is not written as ISO ``YYYY-Www``."""


@dataclass(frozen=True)
class Week:
    """An ISO week, Monday 00:00 UTC to the next Monday."""

    label: str
    start: float
    end: float

    @property
    def minutes(self) -> int:
        return round((self.end - self.start) / 60)

    @property
    def days(self) -> list[date]:
        first = datetime.fromtimestamp(self.start, UTC).date()
        return [first + timedelta(days=i) for i in range(7)]


def parse_week(label: str) -> Week:
    match = re.fullmatch(r"(\d{4})-W(\d{2})", label)
    if not match:
        raise WeekError(f"week {label!r} is not written YYYY-Www, e.g. 2026-W47")
    try:
        monday = date.fromisocalendar(int(match.group(1)), int(match.group(2)), 1)
    except ValueError as error:
        raise WeekError(f"week {label!r} does not exist: {error}") from error
    start = datetime(monday.year, monday.month, monday.day, tzinfo=UTC).timestamp()
    return Week(label=label, start=start, end=start + 7 * 86400)


def week_of(ts: float) -> Week:
    year, number, _ = datetime.fromtimestamp(ts, UTC).isocalendar()
    return parse_week(f"{year}-W{number:02d}")


_MEMORY_SUFFIX = re.compile(r"[\s\-_]\d+\s*GB$", re.IGNORECASE)


def _product(name: str) -> str:
    """A model's name without vendor or memory size: the driver calls an L4 ``NVIDIA L4``
    and a T4 ``Tesla T4``, the price table ``L4-24GB`` and ``T4-16GB``."""
    return mig_geometry._squash(_MEMORY_SUFFIX.sub("", name.strip())).removeprefix("TESLA")


def canonical_models(models: list[str], settings: ReportSettings,
                     geometries: Mapping[str, mig_geometry.Geometry]) -> dict[str, str]:
    """Driver product names mapped to the keys of the price table and MIG geometries.

    A model without MIG is found in the price table by its name, else by its product
    alone when one key has it (``NVIDIA L40S`` is ``L40S-48GB``); else it keeps its name
    and is priced at ``default_hourly_usd``."""
    priced = {mig_geometry._squash(name): name for name in settings.gpu_models}
    products: dict[str, list[str]] = {}
    for name in settings.gpu_models:
        products.setdefault(_product(name), []).append(name)
    mapping: dict[str, str] = {}
    for model in models:
        found = mig_geometry.find(geometries, model)
        if found is not None:
            mapping[model] = found.model
        elif (exact := priced.get(mig_geometry._squash(model))) is not None:
            mapping[model] = exact
        else:
            same = products.get(_product(model), [])
            mapping[model] = same[0] if len(same) == 1 else model
    return mapping


def idle_minute(threshold_pct: float) -> pl.Expr:
    """A device-minute is idle when it has a peak activity reading below the threshold; a
    minute without a reading is not (null compares as null, made False)."""
    return (pl.col("util_max") < threshold_pct).fill_null(False)


def prepare(rows: pl.DataFrame, settings: ReportSettings,
            geometries: Mapping[str, mig_geometry.Geometry]) -> pl.LazyFrame:
    """Rows read as :data:`READ` with the columns the report derives: models canonical,
    prices attached, GPU-hours, idle minutes, the team.

    Lazy, so that :mod:`gpusteward.reports.weekly` computes only what each of its
    aggregations uses, in one pass over each slice.
    """
    frame = rows.select([c if isinstance(c, str) else c.meta.output_name() for c in READ])
    # The distinct models first: as text, every row's model would be made a string.
    models = frame["model"].unique().cast(pl.String).to_list()
    mapping = canonical_models([m for m in models if m is not None], settings, geometries)
    prices = {m: settings.hourly_usd(c) for m, c in mapping.items()}
    strings = ["node", "uuid", "kind", "parent_uuid", "mig_profile", "namespace", "owner_kind",
               "owner_name", "team", "gpu_model"]
    # On the categoricals, not their text: at 100 M rows making text costs seconds.
    model = pl.col("model").cast(pl.Categorical)
    gpu_hours = pl.col("gpu_fraction").cast(pl.Float64) / 60
    cost = gpu_hours * model.replace_strict(prices, default=settings.default_hourly_usd,
                                            return_dtype=pl.Float64)
    idle = idle_minute(settings.idle_threshold_pct)
    return frame.lazy().with_columns(
        model.replace_strict(mapping, default=None, return_dtype=pl.Categorical)
        .alias("gpu_model"),
        model.replace_strict(prices, default=settings.default_hourly_usd,
                             return_dtype=pl.Float64).alias("hourly_usd"),
        gpu_hours.alias("gpu_hours"),
        (gpu_hours * pl.col("util_mean").fill_null(0).cast(pl.Float64) / 100)
        .alias("used_hours"),
        idle.alias("idle_minute"),
        # Idle hours and costs as columns (0 when busy): plain sums group fastest.
        pl.when(idle).then(gpu_hours).otherwise(0.0).alias("idle_hours"),
        cost.alias("cost_usd"),
        pl.when(idle).then(cost).otherwise(0.0).alias("idle_cost"),
        # Rollups from other producers may lack a team: fall back as the fold does.
        pl.coalesce(pl.col("team").cast(pl.Categorical),
                    pl.col("namespace").cast(pl.Categorical),
                    pl.lit("unattributed", dtype=pl.Categorical)).alias("team"),
        (pl.col("ts") * 1000).cast(pl.Int64).cast(pl.Datetime("ms", "UTC")).dt.date()
        .alias("day"),
    ).drop("model").with_columns([pl.col(c).cast(pl.Categorical) for c in strings])


def hours_and_costs() -> list[pl.Expr]:
    """Allocated, used and idle GPU-hours with their cost, for any grouping."""
    return [
        pl.col("gpu_hours").sum().alias("allocated_gpu_hours"),
        pl.col("used_hours").sum().alias("used_gpu_hours"),
        pl.col("idle_hours").sum().alias("idle_gpu_hours"),
        pl.col("cost_usd").sum().alias("allocated_cost_usd"),
        pl.col("idle_cost").sum().alias("idle_cost_usd"),
    ]


def queue_table(queue: pl.DataFrame | None, slos: QueueSloSettings) -> pl.DataFrame:
    """Per cluster queue: admissions, p50/p95 wait, the SLO and the share within it.

    Each queue's SLO is the live rule's (``slos.slo_for``: pattern, first match wins).
    """
    schema = {"cluster_queue": pl.String, "admitted": pl.UInt32, "wait_p50_s": pl.Float64,
              "wait_p95_s": pl.Float64, "slo_s": pl.Float64, "within_slo_pct": pl.Float64}
    if queue is None or queue.is_empty():
        return pl.DataFrame(schema=schema)
    admitted = (queue.filter((pl.col("state") == "admitted")
                             & pl.col("admitted_at").is_not_null()
                             & pl.col("created_at").is_not_null())
                .unique(subset=["namespace", "name"], keep="first")
                .with_columns((pl.col("admitted_at") - pl.col("created_at")).alias("wait_s")))
    names = admitted["cluster_queue"].unique().drop_nulls().to_list()
    return (admitted.with_columns(
        pl.col("cluster_queue").replace_strict({n: slos.slo_for(n) for n in names},
                                               default=slos.default_slo_s,
                                               return_dtype=pl.Float64).alias("slo_s"))
        .group_by("cluster_queue").agg(
            pl.len().cast(pl.UInt32).alias("admitted"),
            pl.col("wait_s").quantile(0.5, "linear").alias("wait_p50_s"),
            pl.col("wait_s").quantile(0.95, "linear").alias("wait_p95_s"),
            pl.col("slo_s").first(),
            ((pl.col("wait_s") <= pl.col("slo_s")).mean() * 100).alias("within_slo_pct"))
        .sort("cluster_queue").select(list(schema)).cast(schema))  # type: ignore[arg-type]


def records(frame: pl.DataFrame) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts (dates and datetimes as ISO strings)."""
    out = frame.with_columns(
        [pl.col(c).dt.to_string() for c, t in frame.schema.items()
         if t in (pl.Date,) or isinstance(t, pl.Datetime)])
    return out.to_dicts()
