"""The weekly report's tables as computed before they streamed: from one frame of the week.

Kept to check that the streaming fold in :mod:`gpusteward.reports.weekly` gives the
same numbers at a size where the whole week fits in memory.
"""

from __future__ import annotations

import polars as pl

from gpusteward.reports.compute import WORKLOAD, WORKLOAD_NAME, hours_and_costs
from gpusteward.reports.settings import ReportSettings


def team_table(frame: pl.DataFrame) -> pl.DataFrame:
    held = frame.filter(pl.col("allocated"))
    return (held.group_by("team").agg(
        *hours_and_costs(),
    ).with_columns((pl.col("used_gpu_hours") / pl.col("allocated_gpu_hours") * 100)
                   .alias("efficiency_pct"))
        .sort("allocated_gpu_hours", descending=True))


def daily_table(frame: pl.DataFrame) -> pl.DataFrame:
    return (frame.filter(pl.col("allocated"))
            .group_by("day", "team").agg(
                pl.col("gpu_hours").sum().alias("allocated_gpu_hours"),
                pl.col("used_hours").sum().alias("used_gpu_hours"))
            .sort("day", "team"))


def workload_table(frame: pl.DataFrame) -> pl.DataFrame:
    held = frame.filter(pl.col("allocated"))
    # A workload is its name; its team the latest its rows carried.
    return (held.group_by(WORKLOAD_NAME).agg(
        pl.col("team").sort_by("ts").last(),
        pl.col("gpu_model").mode().first().alias("gpu_model"),
        pl.col("uuid").n_unique().alias("devices"),
        pl.len().alias("device_minutes"),
        pl.col("ts").n_unique().alias("minutes"),
        *hours_and_costs(),
        *[pl.col("util_mean").quantile(q / 100, "linear").alias(f"util_p{q}")
          for q in (5, 25, 50, 75, 95)],
        pl.col("mem_used_max").max().alias("mem_peak_bytes"),
    ).sort("allocated_gpu_hours", descending=True))


def fault_table(frame: pl.DataFrame) -> pl.DataFrame:
    return (frame.group_by("day").agg(
        pl.col("xid_count").sum().alias("xid_events"),
        pl.col("ecc_dbe_new").sum().alias("ecc_dbe_errors"),
        (pl.col("throttled_samples") > 0).sum().alias("throttled_device_minutes"),
    ).sort("day"))


def fragmentation_table(frame: pl.DataFrame, shape_gpus: int) -> pl.DataFrame:
    """Per hour: free whole GPUs (a MIG-enabled GPU is none) and the share of them no
    ``shape_gpus``-GPU request fits."""
    partitioned = frame.filter(pl.col("kind") == "mig").select(
        "ts", pl.col("parent_uuid").alias("uuid")).unique()
    per_node = (frame.filter(pl.col("kind") == "gpu")
                .join(partitioned, on=["ts", "uuid"], how="anti")
                .group_by("ts", "node").agg((~pl.col("allocated")).sum().alias("free")))
    per_minute = per_node.group_by("ts").agg(
        pl.col("free").sum().alias("free"),
        ((pl.col("free") // shape_gpus) * shape_gpus).sum().alias("usable"))
    return (per_minute.with_columns(
        (pl.col("ts") * 1000).cast(pl.Int64).cast(pl.Datetime("ms", "UTC"))
        .dt.truncate("1h").alias("hour"))
        .group_by("hour").agg(
            pl.col("free").mean().alias("free_gpus"),
            (1 - pl.col("usable").sum() / pl.col("free").sum()).fill_nan(0.0)
            .alias("stranded_share"))
        .sort("hour"))


def needs(frame: pl.DataFrame, settings: ReportSettings) -> pl.DataFrame:
    """Per workload: minutes of data, the GPUs it holds, and what it needs (with headroom)."""
    # One 64-bit hash stands for the four workload columns: grouping 10 M rows by two
    # numbers is several times faster than by four categoricals and a float.
    held = frame.filter(pl.col("allocated")).with_columns(
        pl.struct(WORKLOAD_NAME).hash(seed=0).alias("wid"),
        # Activity times the device's share of its GPU: GPU-equivalents. A missing reading
        # stays missing: it is no minute at 0 %.
        (pl.col("util_mean") * pl.col("gpu_fraction")).alias("compute"),
        pl.col("mem_used_max").fill_null(0), (pl.col("kind") == "mig").alias("mig"))
    q = settings.percentile / 100
    mq = settings.memory_percentile / 100
    grow = 1 + settings.headroom_pct / 100
    # GPU-hours per minute times 60 is GPU-equivalents in use and held that minute.
    per_minute = held.group_by("wid", "ts").agg(
        pl.when(pl.col("util_mean").is_not_null().any())
        .then(pl.col("used_hours").sum() * 60).alias("used"),
        (pl.col("gpu_hours").sum() * 60).alias("held"),
    )
    demand = per_minute.group_by("wid").agg(
        pl.len().alias("minutes"),
        pl.col("used").count().alias("points"),
        (pl.col("used").quantile(q, "linear") * grow).alias("gpus_needed"),
        pl.col("held").mean().alias("gpus_held"),
    )
    per_device = held.group_by("wid").agg(
        pl.col("team").sort_by("ts").last(),
        *[pl.col(c).first() for c in WORKLOAD_NAME],
        pl.col("util_mean").quantile(q, "linear").alias("activity_pct"),
        (pl.col("compute").quantile(q, "linear") * grow / 100)
        .alias("device_compute_needed"),
        (pl.col("mem_used_max").quantile(mq, "linear") * grow).alias("device_mem_needed"),
        pl.col("mig").any().alias("uses_mig"),
        pl.col("mig_profile").drop_nulls().mode().sort().first().alias("mig_profile"),
        pl.col("gpu_model").mode().first().alias("gpu_model"),
        pl.col("mem_total_bytes").max().alias("device_mem_total"),
        pl.col("gpu_hours").sum().alias("gpu_hours"),
        pl.col("uuid").n_unique().alias("devices"),
        pl.len().alias("device_minutes"),
        pl.col("hourly_usd").mean().alias("hourly_usd"),
    )
    return (demand.join(per_device, on="wid").drop("wid")
            .select(*WORKLOAD, pl.exclude(WORKLOAD)).sort(WORKLOAD))
