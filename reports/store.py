"""The Parquet rollup store: one folder per UTC day, files written atomically.

Layout: ``DIR/day=2026-11-16/part-<first minute>-<random>.parquet``. A file
is written under a dot-prefixed temporary name in its day folder and then
renamed with :func:`os.replace`, which is atomic on one filesystem, so a
reader sees a whole file or none; readers ignore dot files. Retention
removes whole day folders. Delivery into the store is at-least-once (the
sink commits offsets after a write), so readers drop repeated rows, named by
:data:`ROW_NAME`: :func:`scan` keeps one (redelivered rollups are equal). Files
written before a column was added (:data:`ADDED`) read as its old value.

The rollups' text columns are written as Parquet dictionaries (polars
categoricals, :data:`STORED`): a device's uuid, node and pod repeat every
minute, and a dictionary column is read into the report's categoricals at
about a third of the CPU of a text column. Stores written before hold text
columns; readers take both, file by file (:func:`_scan_files`).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import polars as pl

from gpusteward.schema import QueueEvent, Rollup

log = logging.getLogger(__name__)

SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "ts": pl.Float64, "node": pl.String, "uuid": pl.String, "model": pl.String,
    "samples": pl.Int32, "kind": pl.String, "index": pl.Int16,
    "parent_uuid": pl.String, "mig_profile": pl.String, "gpu_fraction": pl.Float32,
    "util_min": pl.Float32, "util_mean": pl.Float32, "util_max": pl.Float32,
    "mem_used_mean": pl.Float64, "mem_used_max": pl.Int64, "mem_total_bytes": pl.Int64,
    "power_mean": pl.Float32, "power_max": pl.Float32, "temp_max": pl.Float32,
    "throttled_samples": pl.Int32, "ecc_dbe_new": pl.Int32, "xid_count": pl.Int32,
    "namespace": pl.String, "pod": pl.String, "owner_kind": pl.String,
    "owner_name": pl.String, "team": pl.String, "workload_kind": pl.String,
    "queue": pl.String, "clock": pl.Int32,
}
"""Column types of the store; the Rollup fields less ``schema``."""

ADDED: dict[str, int] = {"clock": 0}
"""Columns added since the store's first version, with the value a file written before
holds (read as that, not refused as another version's)."""

STORED: dict[str, pl.DataType | type[pl.DataType]] = {
    c: pl.Categorical() if t == pl.String else t for c, t in SCHEMA.items()}
"""How :func:`write` stores rollups (its default) and the sink writes them: :data:`SCHEMA`
with text as dictionaries, which readers read as categoricals or as text."""

QUEUE_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "ts": pl.Float64, "name": pl.String, "namespace": pl.String, "cluster_queue": pl.String,
    "state": pl.String, "queue": pl.String, "created_at": pl.Float64,
    "admitted_at": pl.Float64, "gpus": pl.Int32, "priority": pl.Int32,
}
"""Column types of the queue-event store (same layout, its own folder); QueueEvent less
``schema`` and ``mig``."""


def frame(rollups: Iterable[Rollup]) -> pl.DataFrame:
    """Rollups as a DataFrame with the store's schema."""
    return _frame(rollups, SCHEMA)


def queue_frame(events: Iterable[QueueEvent]) -> pl.DataFrame:
    """Queue events as a DataFrame with the queue store's schema."""
    return _frame(events, QUEUE_SCHEMA)


def _frame(items: Iterable[msgspec.Struct], schema: dict[str, Any]) -> pl.DataFrame:
    rows = [{k: v for k, v in msgspec.structs.asdict(item).items() if k in schema}
            for item in items]
    return pl.DataFrame(rows, schema=schema)


def _day(ts: float) -> date:
    return datetime.fromtimestamp(ts, UTC).date()


def write(directory: Path, rows: pl.DataFrame, schema: dict[str, Any] | None = None
          ) -> list[Path]:
    """Write ``rows`` into their day folders, one new file per day, with the column types
    of ``schema`` (default: the rollups', :data:`STORED`); return the files."""
    if rows.is_empty():
        return []
    # A frame made without a column added since (:data:`ADDED`) holds its old value.
    rows = rows.select([(pl.col(c) if c in rows.columns or c not in ADDED
                         else pl.lit(ADDED[c])).cast(t).alias(c)
                        for c, t in (schema or STORED).items()])
    days = rows.with_columns(
        (pl.col("ts") * 1000).cast(pl.Int64).cast(pl.Datetime("ms", "UTC")).dt.date()
        .alias("_day"))
    written: list[Path] = []
    for (day,), part in days.partition_by("_day", as_dict=True, maintain_order=True).items():
        folder = directory / f"day={day.isoformat()}"
        folder.mkdir(parents=True, exist_ok=True)
        first = int(part["ts"].min())  # type: ignore[arg-type]
        name = f"part-{first}-{uuid.uuid4().hex[:12]}.parquet"
        temporary = folder / f".{name}.tmp"
        try:
            part.drop("_day").write_parquet(temporary, compression="zstd", statistics=True)
            os.replace(temporary, folder / name)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        written.append(folder / name)
    return written


def apply_retention(directory: Path, keep_days: int, now: float) -> list[Path]:
    """Remove day folders older than ``keep_days`` before the day of ``now``."""
    oldest = _day(now) - timedelta(days=keep_days - 1)
    removed: list[Path] = []
    for folder in sorted(directory.glob("day=*")):
        try:
            day = date.fromisoformat(folder.name.removeprefix("day="))
        except ValueError:
            log.warning("not a day folder, left alone: %s", folder)
            continue
        if day < oldest:
            shutil.rmtree(folder)
            removed.append(folder)
    return removed


def files(directory: Path, start: float, end: float) -> list[Path]:
    """The Parquet files of the days that overlap [start, end)."""
    first, last = _day(start), _day(end - 1e-6)
    found: list[Path] = []
    for folder in sorted(directory.glob("day=*")):
        try:
            day = date.fromisoformat(folder.name.removeprefix("day="))
        except ValueError:
            continue
        if first <= day <= last:
            found.extend(sorted(p for p in folder.glob("*.parquet")
                                if not p.name.startswith(".")))
    return found


class StoreError(ValueError):
    """A store the report cannot read: another version's files, or not Parquet at all."""


def _checked(paths: list[Path], wanted: list[str]) -> list[dict[str, pl.DataType]]:
    """The files' schemas; raise :class:`StoreError` naming the first file that lacks or
    mistypes a column."""
    schemas = []
    for path in paths:
        try:
            found = pl.read_parquet_schema(path)
        except (OSError, pl.exceptions.PolarsError) as error:
            raise StoreError(f"{path} is not a readable Parquet file: {error}") from error
        missing = [c for c in wanted if c not in found and c not in ADDED]
        if missing:
            raise StoreError(
                f"{path} was written by another version of gpusteward: it lacks "
                f"{', '.join(missing)}. Re-write the store with this version's sink, or "
                "read it with the version that wrote it.")
        for column in wanted:
            if column in found and not _castable(found[column], SCHEMA[column]):
                raise StoreError(
                    f"{path} was written by another version of gpusteward: column "
                    f"{column} is {found[column]}, this version reads {SCHEMA[column]}.")
        schemas.append(found)
    return schemas


def _scan_files(paths: list[Path], types: dict[str, Any], exprs: Sequence[pl.Expr] = ()
                ) -> pl.LazyFrame:
    """The ``types`` columns of the files (cast to them) and ``exprs``, in file order.

    One scan reads files of one schema only: a store holds files of this version
    (text as dictionaries) and may hold older ones (text as text) or other integer
    widths, so each run of files written alike is scanned on its own and cast.
    """
    needed = list(dict.fromkeys([*types, *(n for e in exprs for n in e.meta.root_names())]))
    schemas = _checked(paths, needed)
    runs = itertools.groupby(zip(paths, schemas, strict=True),
                             key=lambda found: [found[1].get(c) for c in needed])
    scans = [pl.scan_parquet([path for path, _ in run], extra_columns="ignore").select(
        *[(pl.col(c) if kinds[needed.index(c)] is not None else pl.lit(ADDED[c]))
          .cast(t).alias(c) for c, t in types.items()], *exprs) for kinds, run in runs]
    return scans[0] if len(scans) == 1 else pl.concat(scans)


def _castable(found: Any, wanted: Any) -> bool:
    """Whether a column read as ``found`` holds what this version reads as ``wanted``."""
    if found == wanted:
        return True
    numeric = found.is_numeric() and pl.Series([], dtype=wanted).dtype.is_numeric()
    textual = found in (pl.String, pl.Categorical) and wanted == pl.String
    return bool(numeric or textual)


def count_rows(directory: Path, start: float, end: float) -> int:
    """Rows in the files of the days that overlap [start, end), from their footers."""
    paths = files(directory, start, end)
    if not paths:
        return 0
    _checked(paths, ["ts", "uuid"])
    return int(pl.scan_parquet(paths).select(pl.len()).collect().item())


def missing_days(directory: Path, start: float, end: float) -> list[date]:
    """The days of [start, end) with no file in the store."""
    day, last, missing = _day(start), _day(end - 1e-6), []
    while day <= last:
        if not files(directory, *_bounds(day)):
            missing.append(day)
        day += timedelta(days=1)
    return missing


def _bounds(day: date) -> tuple[float, float]:
    first = datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()
    return first, first + 86400


def slices(directory: Path, start: float, end: float, columns: Sequence[str | pl.Expr],
           rows: int = 2_000_000, categorical: bool = True) -> Iterator[pl.DataFrame]:
    """The rollups of [start, end), a few hours at a time, one row per (device, minute, pod).

    Each slice holds whole minutes of one UTC day, so every redelivered copy of a
    row lands in the slice of its original and is dropped there. A slice spans as
    many hours (a divisor of 24) as keep it near ``rows`` rows, judged by each
    day's row count; the sink writes in time order, so the row groups' ``ts``
    statistics let the scan skip the rest of the day. ``columns`` are names, read
    with the store's types (text as categoricals when ``categorical``), or
    expressions over the store's columns, evaluated in the scan.
    """
    names = [c for c in columns if isinstance(c, str)]
    exprs = [c for c in columns if isinstance(c, pl.Expr)]
    wanted = list(dict.fromkeys(["ts", "uuid", *names]))
    types = {c: pl.Categorical if categorical and SCHEMA[c] == pl.String else SCHEMA[c]
             for c in wanted}
    day, last = _day(start), _day(end - 1e-6)
    while day <= last:
        first, after = _bounds(day)
        paths = files(directory, first, after)
        day += timedelta(days=1)
        if not paths:
            continue
        scan = _scan_files(paths, types, exprs)
        per_day = int(scan.select(pl.len()).collect().item())
        hours = max([h for h in (1, 2, 3, 4, 6, 8, 12, 24) if per_day * h <= rows * 24],
                    default=1)
        slice_start = max(first, start)
        while slice_start < min(after, end):
            slice_end = min(first + (int((slice_start - first) // 3600) + hours) * 3600,
                            after, end)
            rows_now = scan.filter((pl.col("ts") >= slice_start)
                                   & (pl.col("ts") < slice_end)).collect()
            yield _distinct(rows_now, slice_start)
            slice_start = slice_end


ROW_NAME = ("uuid", "ts", "namespace", "pod", "clock")
"""What names a rollup row: device, minute, holding pod (a shared GPU has a row per
holder) and the node's clock (a minute named again on a node's stepped-back clock is a
minute of its own). Readers keep the first row of each name."""


def _name(columns: Iterable[str]) -> list[str]:
    """The row name's columns among ``columns`` (a narrow read without the pod columns
    names rows by device and minute, as before GPUs had a row per holder)."""
    present = set(columns)
    return [c for c in ROW_NAME if c in present]


def _distinct(rows: pl.DataFrame, start: float) -> pl.DataFrame:
    """``rows`` with each name (device, minute, pod, clock) once.

    Counting distinct keys is a quarter of the cost of marking the first of each,
    and a store rarely holds a redelivered row: count first. The count's key (the
    uuid's category code and whole seconds since ``start``, then the pod's code
    beside it where shared GPUs give a device several rows a minute) is equal for
    equal rows, so a redelivery is never missed; a rare false alarm (or a minute named on
    two clocks of a node) costs the exact pass.
    """
    if rows.schema["uuid"] == pl.Categorical:
        key = (pl.col("uuid").to_physical().cast(pl.UInt64) * (1 << 32)
               + (pl.col("ts") - start).cast(pl.UInt64))
        if rows.select(key.n_unique()).item() == rows.height:
            return rows
        if rows.schema.get("pod") == pl.Categorical and rows.select(
                pl.struct(key, pl.col("pod").to_physical()).n_unique()).item() == rows.height:
            return rows
    return rows.filter(pl.struct(_name(rows.columns)).is_first_distinct())


def scan(directory: Path, start: float, end: float, columns: list[str] | None = None,
         categorical: bool = False) -> pl.LazyFrame:
    """Rollups with ``start <= ts < end``, one row per (device, minute, holding pod, clock).

    Name the ``columns`` you need: the de-duplication has to read every column
    it keeps, so a narrow scan is several times faster. ``categorical`` reads the
    text columns as categoricals: at 10 M rows that halves the memory.
    """
    wanted = list(SCHEMA) if columns is None else list(dict.fromkeys(["ts", "uuid", *columns]))
    types = {c: pl.Categorical if categorical and SCHEMA[c] == pl.String else SCHEMA[c]
             for c in wanted}
    paths = files(directory, start, end)
    if not paths:
        return pl.LazyFrame(schema=types)
    _checked(paths, list(dict.fromkeys([*wanted, *ROW_NAME])))
    # Dictionary columns (this version's files) are read as the text they hold.
    return (pl.scan_parquet(paths, schema=SCHEMA, missing_columns="insert",
                            cast_options=pl.ScanCastOptions(categorical_to_string="allow"))
            .with_columns([pl.col(c).fill_null(v) for c, v in ADDED.items()])
            .select(list(dict.fromkeys([*wanted, *ROW_NAME])))
            .cast(types)  # type: ignore[arg-type]
            .filter((pl.col("ts") >= start) & (pl.col("ts") < end))
            # Several times faster than unique(subset=...) on polars 2.1, same rows kept.
            .filter(pl.struct(list(ROW_NAME)).is_first_distinct()).select(wanted))


def scan_queue(directory: Path, start: float, end: float) -> pl.DataFrame:
    """Queue events with ``start <= ts < end``, each (workload, state, ts) once."""
    paths = files(directory, start, end)
    if not paths:
        return pl.DataFrame(schema=QUEUE_SCHEMA)
    return (pl.scan_parquet(paths, schema=QUEUE_SCHEMA)
            .filter((pl.col("ts") >= start) & (pl.col("ts") < end))
            .unique(subset=["namespace", "name", "state", "ts"], keep="any").collect())
