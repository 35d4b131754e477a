"""The week's tables in one pass over the store, a few hours of rows at a time.

A 10,000-GPU week is 100.8 M device-minutes: more than a machine holds at
once. So the report never holds the week's rows. It reads the store one time
slice at a time (:func:`gpusteward.reports.store.slices`: a few million rows,
every redelivered copy of a (device, minute) in the same slice as its
original), and folds each slice, in one polars plan per slice, into

- partial sums per (workload, device, model, day): the team, day and
  workload tables and a workload's devices and model are all sums of it, so
  the slice's held rows are grouped once for all of them; with the per-day
  fault counts and the per-hour free GPUs, these are bounded by workloads,
  devices, days and hours, not rows, and re-summed whenever a few slices have
  piled up;
- the set of devices seen;
- for the percentiles, which have no partial form, the values themselves,
  spilled to Arrow files split by a hash of the workload. Once the store is
  read, each split is read back alone and its workloads' percentiles are
  computed exactly, with the same polars expressions as before.

The next slice is read in a thread while one is folded. Where the CPU goes
(10,000 GPUs, per slice of 2.4 M rows, all threads): reading the Parquet
columns 0.35 s (the store writes text as dictionaries, read straight into
categoricals; text columns cost three times as much) and dropping repeats
0.12 s; deriving the report's columns and the workload hash 0.35 s; grouping
by workload and device 0.16 s, by workload and minute 0.19 s; the rest under
0.1 s each; the activity fold (:mod:`gpusteward.reports.activity`) 0.35 s;
the percentiles at the end 7 s for the week.

Peak memory is then one slice, one split and the partial tables. Every
figure is the same aggregation of the same rows as a direct polars
computation over the whole week (the tests compare them); only the order in
which floats are added differs.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Protocol

import polars as pl

from gpusteward.reports import store
from gpusteward.reports.compute import READ, WORKLOAD, WORKLOAD_NAME, hours_and_costs, prepare
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry as mig_geometry

SLICE_ROWS = 3_000_000
"""Rows read at a time (about 250 MB of them, two slices in memory with the read-ahead):
see :func:`store.slices`. Twice the slice cost 5 % less CPU and 300 MB more memory."""

SPLIT_ROWS = 2_000_000
"""Rows of spilled values per split read back at the end (about 40 MB of them)."""

SPILL_BYTES_PER_HELD_MINUTE = 50
"""Most bytes the spill takes per held device-minute (a whole GPU, a MIG instance or one
holder of a shared GPU, held for a minute): a value row (workload hash, activity, activity
times its share of the GPU, memory: 24 bytes) and, for a workload on one device, a
(workload, minute) row (24 bytes), plus Arrow's framing. Measured 40.5 on a synthetic week
where most workloads hold one device, 31.3 where they hold four
(``benchmarks/bench_report.py`` reports the peak). The spill lives until the run ends, so
its folder (:attr:`ReportSettings.spill_dir`) must hold :func:`spill_bytes_for` the
fleet: 5.0 GB for 10,000 devices held all week."""

WEEK_MINUTES = 7 * 1440


def spill_bytes_for(devices: int) -> int:
    """The most the spill takes for ``devices`` held all week (one device per workload)."""
    return devices * WEEK_MINUTES * SPILL_BYTES_PER_HELD_MINUTE

COMPACT_EVERY = 24
"""Slices of partial tables kept before they are summed into one."""

DEVICE = ["node", "index", "uuid", "kind", "parent_uuid", "mig_profile"]
"""What identifies a device and where it sits."""

Rows = Callable[[int, int], None]
"""Progress: rows read so far, rows in the week's files."""


@dataclass
class WeekTables:
    """Everything the report needs from the week's rows."""

    teams: pl.DataFrame
    daily: pl.DataFrame
    workloads: pl.DataFrame
    faults: pl.DataFrame
    fragmentation: pl.DataFrame
    need: pl.DataFrame
    """Per workload: what :func:`gpusteward.reports.recommend.recommend` advises on."""
    gpus: pl.DataFrame
    """One row per physical GPU: gpu_model, node, gpu (the parent of MIG devices)."""
    devices: pl.DataFrame
    """One row per device seen: node, index, uuid, kind, parent_uuid, mig_profile."""
    device_minutes: int
    spill_bytes: int = 0
    """The spill's peak size on disk (:data:`SPILL_BYTES_PER_HELD_MINUTE`)."""


class _Partial:
    """Partial aggregates of one table, re-summed as slices arrive."""

    def __init__(self, keys: list[str], merge: dict[str, str]) -> None:
        self.keys = keys
        self.merge = merge
        self.parts: list[pl.DataFrame] = []

    def add(self, part: pl.DataFrame) -> None:
        self.parts.append(part)
        if len(self.parts) >= COMPACT_EVERY:
            self.parts = [self.result()]

    def result(self) -> pl.DataFrame:
        frame = pl.concat(self.parts, how="vertical_relaxed")
        if not self.merge:
            return frame.unique()
        return frame.group_by(self.keys).agg(
            [getattr(pl.col(c), how)() for c, how in self.merge.items()]).select(frame.columns)


_HOURS = ["allocated_gpu_hours", "used_gpu_hours", "idle_gpu_hours", "allocated_cost_usd",
          "idle_cost_usd"]


PAIR_SUMS = ["device_minutes", *_HOURS, "usd_sum"]


class WeekFold:
    """Folds slices of the week's rows into partial tables and spilled values."""

    def __init__(self, settings: ReportSettings,
                 geometries: Mapping[str, mig_geometry.Geometry], splits: int,
                 spill: Path) -> None:
        self.settings = settings
        self.geometries = geometries
        self.splits = max(1, splits)
        self.spill = spill
        self.device_minutes = 0
        # Per workload, team, device, model and day: the team, day, workload and model
        # tables are all sums of it, so each slice is grouped once for the four of them.
        # The team is a key, not part of the workload's name: a workload whose team label
        # changed mid-week is one workload, and each team gets the minutes it held.
        self.pairs = _Partial(["wid", "team", "uuid", "gpu_model", "day"], {
            **{c: "first" for c in WORKLOAD_NAME}, **dict.fromkeys(PAIR_SUMS, "sum"),
            "mem_peak_bytes": "max", "device_mem_total": "max", "uses_mig": "any",
            "last_ts": "max"})
        self.faults = _Partial(["day"], {"xid_events": "sum", "ecc_dbe_errors": "sum",
                                         "throttled_device_minutes": "sum"})
        self.hours = _Partial(["hour"], {"free": "sum", "usable": "sum", "minutes": "sum"})
        self.devices = _Partial([*DEVICE, "gpu_model"], {})
        self.pending: list[tuple[pl.DataFrame, pl.DataFrame]] = []
        self.pending_rows = 0
        self.flushes = 0
        self.spill_bytes = 0
        """Bytes spilled so far: the spill's peak, since its files live until the run ends."""

    def add(self, rows: pl.DataFrame) -> None:
        """Fold one slice of store rows, read as :data:`compute.READ`: de-duplicated, all
        of its minutes, all in one UTC day (as :func:`store.slices` yields them)."""
        if rows.is_empty():
            return
        first, last = (_day(rows["ts"].min()), _day(rows["ts"].max()))  # type: ignore[arg-type]
        if first != last:
            raise ValueError(f"a slice spans {first} to {last}: fold one day at a time")
        frame = prepare(rows, self.settings, self.geometries)
        held = frame.filter(pl.col("allocated")).with_columns(
            # One 64-bit hash stands for the workload's name: grouping by one number is
            # several times faster. It hashes the categoricals' codes (the same for a
            # text everywhere in this process): hashing the text took as long again.
            pl.struct([pl.col(c).to_physical() for c in WORKLOAD_NAME]).hash(seed=0)
            .alias("wid"))
        split = (pl.col("wid") % self.splits).alias("split")
        # One plan for every output of the slice: polars reads each derived column once
        # and runs the aggregations side by side.
        pairs, faults, hours, devices, values, minutes = pl.collect_all([
            held.group_by("wid", "team", "uuid", "gpu_model").agg(
                *[pl.col(c).first() for c in WORKLOAD_NAME],
                pl.col("ts").max().alias("last_ts"),
                pl.len().cast(pl.Int64).alias("device_minutes"),
                *hours_and_costs(),
                pl.col("hourly_usd").sum().alias("usd_sum"),
                pl.col("mem_used_max").max().alias("mem_peak_bytes"),
                pl.col("mem_total_bytes").max().alias("device_mem_total"),
                (pl.col("kind") == "mig").any().alias("uses_mig")),
            frame.select(
                pl.col("xid_count").sum().cast(pl.Int64).alias("xid_events"),
                pl.col("ecc_dbe_new").sum().cast(pl.Int64).alias("ecc_dbe_errors"),
                (pl.col("throttled_samples") > 0).sum().cast(pl.Int64)
                .alias("throttled_device_minutes")),
            _fragmentation_part(frame, self.settings.fragmentation_shape_gpus),
            frame.select(*DEVICE, "gpu_model").unique(),
            # Activity is relative to the device's share of its GPU (a MIG instance, one
            # holder of a shared GPU): times the share, it is GPU-equivalents.
            held.select(split, "wid", "util_mean",
                        (pl.col("util_mean") * pl.col("gpu_fraction")).cast(pl.Float32)
                        .alias("compute"), "mem_used_max"),
            # GPU-hours per minute times 60 is GPU-equivalents in use and held that minute;
            # a minute without any activity reading has no use (null), not none (0).
            held.group_by("wid", "ts").agg(
                pl.when(pl.col("util_mean").is_not_null().any())
                .then(pl.col("used_hours").sum() * 60).alias("used"),
                (pl.col("gpu_hours").sum() * 60).alias("held")).select(
                    split, "wid", "used", "held"),
        ])
        day = pl.lit(first).alias("day")
        self.device_minutes += rows.height
        self.pairs.add(pairs.with_columns(day))
        self.faults.add(faults.with_columns(day))
        self.hours.add(hours)
        self.devices.add(devices)
        self.pending.append((values, minutes))
        self.pending_rows += values.height
        if self.pending_rows >= SPLIT_ROWS:
            self._flush()

    def _flush(self) -> None:
        """Write the values waiting in memory to their splits' files."""
        if not self.pending:
            return
        for kind, index in (("values", 0), ("minutes", 1)):
            frame = pl.concat([p[index] for p in self.pending])
            for (split,), part in frame.partition_by("split", as_dict=True).items():
                folder = self.spill / kind / str(split)
                folder.mkdir(parents=True, exist_ok=True)
                # Arrow IPC, uncompressed: a sixth of the CPU of Parquet with lz4, and the
                # files live for one run (about 30 bytes a held device-minute).
                path = folder / f"{self.flushes}.arrow"
                part.drop("split").write_ipc(path)
                self.spill_bytes += path.stat().st_size
        self.flushes += 1
        self.pending, self.pending_rows = [], 0

    def finish(self) -> WeekTables:
        """The week's tables, once every slice is folded."""
        self._flush()
        pairs = _table(self.pairs, {
            "wid": pl.UInt64, "uuid": pl.String, "gpu_model": pl.String, "day": pl.Date,
            **dict.fromkeys(WORKLOAD, pl.String), "device_minutes": pl.Int64,
            **_hours_schema(), "usd_sum": pl.Float64, "mem_peak_bytes": pl.Int64,
            "device_mem_total": pl.Int64, "uses_mig": pl.Boolean, "last_ts": pl.Float64})
        teams = pairs.group_by("team").agg(pl.col(_HOURS).sum()).with_columns(
            (pl.col("used_gpu_hours") / pl.col("allocated_gpu_hours") * 100)
            .alias("efficiency_pct")).sort("allocated_gpu_hours", descending=True)
        daily = pairs.group_by("day", "team").agg(
            pl.col("allocated_gpu_hours", "used_gpu_hours").sum()).sort("day", "team")
        faults = _table(self.faults, {"day": pl.Date, "xid_events": pl.Int64,
                                      "ecc_dbe_errors": pl.Int64,
                                      "throttled_device_minutes": pl.Int64}).sort("day")
        hours = _table(self.hours, {"hour": pl.Datetime("ms", "UTC"), "free": pl.Int64,
                                    "usable": pl.Int64, "minutes": pl.Int64})
        fragmentation = hours.select(
            "hour", (pl.col("free") / pl.col("minutes")).alias("free_gpus"),
            (1 - pl.col("usable") / pl.col("free")).fill_nan(0.0).alias("stranded_share"),
        ).sort("hour")
        devices = _table(self.devices, {"node": pl.String, "index": pl.Int16,
                                         "uuid": pl.String, "kind": pl.String,
                                         "parent_uuid": pl.String, "mig_profile": pl.String,
                                         "gpu_model": pl.String})
        per_workload = self._per_workload(pairs, devices)
        workloads = per_workload.select(
            *WORKLOAD, "gpu_model", "devices", "device_minutes", "minutes",
            *_hours_schema(), *[f"util_p{q}" for q in (5, 25, 50, 75, 95)],
            "mem_peak_bytes").sort("allocated_gpu_hours", descending=True)
        need = per_workload.select(
            *WORKLOAD, "points", "minutes", "gpus_needed", "gpus_held", "activity_pct",
            "device_compute_needed", "device_mem_needed", "uses_mig", "mig_profile",
            "gpu_model",
            "device_mem_total", pl.col("allocated_gpu_hours").alias("gpu_hours"), "devices",
            "device_minutes", (pl.col("usd_sum") / pl.col("device_minutes")).alias("hourly_usd"),
        ).sort(WORKLOAD)
        return WeekTables(
            teams=teams, daily=daily, workloads=workloads, faults=faults,
            fragmentation=fragmentation, need=need,
            gpus=devices.select(
                "gpu_model", "node",
                pl.when(pl.col("kind") == "mig").then(pl.col("parent_uuid"))
                .otherwise(pl.col("uuid")).alias("gpu")).unique(),
            devices=devices.select(DEVICE).unique(),
            device_minutes=self.device_minutes, spill_bytes=self.spill_bytes)

    def _per_workload(self, pairs: pl.DataFrame, devices: pl.DataFrame) -> pl.DataFrame:
        """Per workload: the summed columns, its devices, model and MIG profile, its team
        (the latest its rows carried), and its percentiles."""
        sums = pairs.group_by("wid").agg(
            pl.col("team").sort_by("last_ts").last(),
            *[pl.col(c).first() for c in WORKLOAD_NAME],
            pl.col(PAIR_SUMS).sum(), pl.col("mem_peak_bytes", "device_mem_total").max(),
            pl.col("uses_mig").any(), pl.col("uuid").n_unique().cast(pl.UInt32)
            .alias("devices"))
        # The model it ran on most (ties: the first name), as mode() picked it.
        models = (pairs.group_by("wid", "gpu_model").agg(pl.col("device_minutes").sum())
                  .sort(["wid", "device_minutes", "gpu_model"],
                        descending=[False, True, False])
                  .group_by("wid").agg(pl.col("gpu_model").first()))
        # The MIG profile it held most (None for whole or shared GPUs), the same way.
        profiles = (pairs.join(devices.select("uuid", "mig_profile").unique("uuid", keep="any"),
                               on="uuid", how="left")
                    .group_by("wid", "mig_profile").agg(pl.col("device_minutes").sum())
                    .sort(["wid", "device_minutes", "mig_profile"],
                          descending=[False, True, False], nulls_last=True)
                    .group_by("wid").agg(pl.col("mig_profile").first()))
        percentiles = [self._split_percentiles(split) for split in range(self.splits)]
        return (sums.join(models, on="wid", how="left").join(profiles, on="wid", how="left")
                .join(pl.concat(percentiles, how="vertical_relaxed"), on="wid", how="left"))

    def _split_percentiles(self, split: int) -> pl.DataFrame:
        """The percentiles of one split's workloads, from their spilled values."""
        q = self.settings.percentile / 100
        mq = self.settings.memory_percentile / 100
        grow = 1 + self.settings.headroom_pct / 100
        values = _read(self.spill / "values" / str(split),
                       {"wid": pl.UInt64, "util_mean": pl.Float32, "compute": pl.Float32,
                        "mem_used_max": pl.Int64})
        minutes = _read(self.spill / "minutes" / str(split),
                        {"wid": pl.UInt64, "used": pl.Float64, "held": pl.Float64})
        # Percentiles over the readings there are: a device-minute without one (the NVML
        # collector has none for a MIG instance without GPM) is not a minute at 0 %.
        per_device = values.group_by("wid").agg(
            *[pl.col("util_mean").quantile(p / 100, "linear").alias(f"util_p{p}")
              for p in (5, 25, 50, 75, 95)],
            pl.col("util_mean").quantile(q, "linear").cast(pl.Float64).alias("activity_pct"),
            (pl.col("compute").quantile(q, "linear") * grow / 100)
            .alias("device_compute_needed"),
            (pl.col("mem_used_max").fill_null(0).quantile(mq, "linear") * grow)
            .alias("device_mem_needed"))
        demand = minutes.group_by("wid").agg(
            # A workload's (workload, minute) rows are its minutes: each lies in one slice.
            pl.len().cast(pl.Int64).alias("minutes"),
            # Minutes with an activity reading: the evidence advice needs.
            pl.col("used").count().cast(pl.Int64).alias("points"),
            (pl.col("used").quantile(q, "linear") * grow).alias("gpus_needed"),
            pl.col("held").mean().alias("gpus_held"))
        return per_device.join(demand, on="wid", how="full", coalesce=True)


def _hours_schema() -> dict[str, Any]:
    return dict.fromkeys(_HOURS, pl.Float64)


def _day(ts: float) -> date:
    return datetime.fromtimestamp(ts, UTC).date()


def _table(partial: _Partial, schema: dict[str, Any]) -> pl.DataFrame:
    if not partial.parts:
        return pl.DataFrame(schema=schema)
    return partial.result().select(list(schema)).cast(schema)  # type: ignore[arg-type]


def _read(folder: Path, schema: dict[str, Any]) -> pl.DataFrame:
    paths = sorted(folder.glob("*.arrow"))
    return pl.scan_ipc(paths).collect() if paths else pl.DataFrame(schema=schema)


def _fragmentation_part(frame: pl.LazyFrame, shape_gpus: int) -> pl.LazyFrame:
    """Per hour: free whole GPUs summed over its minutes, those a request can use, minutes.

    A MIG-enabled GPU is no whole GPU a request can have, though the NVML collector
    reads it beside its instances (a row of kind ``gpu`` no pod holds): the minutes it
    has instances it is left out."""
    partitioned = (frame.filter(pl.col("kind") == "mig")
                   .select("ts", pl.col("parent_uuid").alias("uuid")).unique())
    per_node = (frame.filter(pl.col("kind") == "gpu")
                .join(partitioned, on=["ts", "uuid"], how="anti")
                # The node's code, not its name: the name is not kept, and codes group faster.
                .group_by("ts", pl.col("node").to_physical())
                .agg((~pl.col("allocated")).sum().alias("free")))
    per_minute = per_node.group_by("ts").agg(
        pl.col("free").sum().alias("free"),
        ((pl.col("free") // shape_gpus) * shape_gpus).sum().alias("usable"))
    return (per_minute.with_columns(
        (pl.col("ts") * 1000).cast(pl.Int64).cast(pl.Datetime("ms", "UTC"))
        .dt.truncate("1h").alias("hour"))
        .group_by("hour").agg(pl.col("free").sum().cast(pl.Int64),
                              pl.col("usable").sum().cast(pl.Int64),
                              pl.len().cast(pl.Int64).alias("minutes")))


class SliceFold(Protocol):
    """Another fold fed the same slices (the report reads the store once)."""

    columns: list[str]
    """The store columns it needs beside ``ts`` and ``uuid``."""

    def add(self, rows: pl.DataFrame) -> None: ...


def fold_week(directory: Path, start: float, end: float, settings: ReportSettings,
              geometries: Mapping[str, mig_geometry.Geometry],
              rows: Rows | None = None, also: Sequence[SliceFold] = ()) -> WeekTables:
    """Read the week's rollups from the store slice by slice and fold them (and hand
    each slice to the folds in ``also``)."""
    read_names = {c for c in READ if isinstance(c, str)}
    columns = [*READ, *dict.fromkeys(c for f in also for c in f.columns
                                     if c not in read_names)]
    total = store.count_rows(directory, start, end)
    # In settings.spill_dir (None: TMPDIR or /tmp), which must hold spill_bytes_for the fleet.
    if settings.spill_dir is not None:
        settings.spill_dir.mkdir(parents=True, exist_ok=True)
    spill = Path(tempfile.mkdtemp(prefix="gpusteward-report-", dir=settings.spill_dir))
    try:
        fold = WeekFold(settings, geometries, splits=-(-total // SPLIT_ROWS), spill=spill)
        read = 0
        for part in _ahead(store.slices(directory, start, end, columns, SLICE_ROWS)):
            fold.add(part)
            for other in also:
                other.add(part)
            read += part.height
            if rows is not None:
                rows(read, total)
        return fold.finish()
    finally:
        shutil.rmtree(spill, ignore_errors=True)


def _ahead(parts: Iterator[pl.DataFrame]) -> Iterator[pl.DataFrame]:
    """``parts``, each read in a thread while the one before it is folded.

    Reading (Parquet decoding) and folding each keep about one core busy, and
    polars releases the GIL in both: on two cores the week takes the longer of
    the two instead of their sum, for one more slice in memory.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="report-read") as reader:
        following = reader.submit(next, parts, None)
        while (part := following.result()) is not None:
            following = reader.submit(next, parts, None)
            yield part
