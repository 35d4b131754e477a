"""A synthetic week of rollups: for the benchmark, the tests and trying the report out.

Vectorised with numpy so a week of 1,000 GPUs (10 M device-minutes) is
built in seconds. The fleet: ``gpus`` whole GPUs, 8 to a node, a mix of
H100 and A100 models; the week is cut into 6-hour blocks and in each block a
device is held (with probability ``held_share``) by one of ``workloads``
workloads spread over ``teams`` teams. Each workload has its own typical
utilisation (some near idle) and memory footprint; each minute adds noise.
Seeded, so a test can recompute what it expects.

Rows come an hour at a time in time order, as the sink writes them, so a
10,000-GPU week (100.8 M rows) is written with the memory of one hour:
:func:`write_week` does that, and keeps the week in a cache folder for the
benchmark to reuse.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from gpusteward.reports import store
from gpusteward.reports.store import SCHEMA

BLOCK_MINUTES = 360
CHUNK_MINUTES = 60
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")
GIB = 1 << 30


def rollup_hours(start: float, gpus: int = 64, workloads: int = 40, teams: int = 5,
                 held_share: float = 0.8, minutes: int = 7 * 24 * 60, seed: int = 7
                 ) -> Iterator[pl.DataFrame]:
    """Rollup rows for ``gpus`` devices over ``minutes`` minutes, an hour at a time."""
    rng = np.random.default_rng(seed)
    blocks = -(-minutes // BLOCK_MINUTES)
    held = rng.random((gpus, blocks)) < held_share
    holder = rng.integers(0, workloads, size=(gpus, blocks))
    # Per workload: a typical utilisation (a quarter of them near idle) and memory.
    typical = np.where(rng.random(workloads) < 0.25, rng.uniform(0, 3, workloads),
                       rng.uniform(5, 90, workloads))
    memory = rng.uniform(4, 70, workloads) * GIB
    team_of = rng.integers(0, teams, workloads)

    names = pl.Series([f"wl-{w:04d}" for w in range(workloads)])
    team_names = pl.Series([f"team-{t:02d}" for t in range(teams)])
    node_names = pl.Series([f"node-{d // 8:04d}" for d in range(gpus)])
    uuids = pl.Series([f"GPU-{d:08x}-0000-0000-0000-000000000000" for d in range(gpus)])
    models = pl.Series([MODELS[(d // 8) % 3 == 2] for d in range(gpus)])
    for first in range(0, minutes, CHUNK_MINUTES):
        count = min(CHUNK_MINUTES, minutes - first)
        minute = np.repeat(np.arange(first, first + count), gpus)
        device = np.tile(np.arange(gpus), count)
        yield _rows(start, rng, minute, device, held, holder, typical, memory, team_of,
                    names, team_names, node_names, uuids, models)


def _rows(start: float, rng: np.random.Generator, minute: np.ndarray, device: np.ndarray,
          held: np.ndarray, holder: np.ndarray, typical: np.ndarray, memory: np.ndarray,
          team_of: np.ndarray, names: pl.Series, team_names: pl.Series,
          node_names: pl.Series, uuids: pl.Series, models: pl.Series) -> pl.DataFrame:
    block = minute // BLOCK_MINUTES
    row_held = held[device, block]
    row_holder = np.where(row_held, holder[device, block], -1)
    noise = rng.normal(0, 4, device.size)
    util = np.where(row_held, np.clip(typical[np.maximum(row_holder, 0)] + noise, 0, 100), 0.0)
    spread = rng.uniform(0, 6, device.size)
    mem = np.where(row_held, memory[np.maximum(row_holder, 0)]
                   * rng.uniform(0.9, 1.0, device.size), 0.0)
    holder_index = pl.Series(np.maximum(row_holder, 0))
    is_held = pl.Series(row_held)
    device_index = pl.Series(device)

    frame = pl.DataFrame({
        "ts": start + minute.astype(np.float64) * 60,
        "node": node_names.gather(device_index),
        "uuid": uuids.gather(device_index),
        "model": models.gather(device_index),
        "samples": np.full(device.size, 4, dtype=np.int32),
        "kind": pl.repeat("gpu", device.size, eager=True),
        "index": (device % 8).astype(np.int16),
        "gpu_fraction": np.ones(device.size, dtype=np.float32),
        "util_min": np.clip(util - spread, 0, 100).astype(np.float32),
        "util_mean": util.astype(np.float32),
        "util_max": np.clip(util + spread, 0, 100).astype(np.float32),
        "mem_used_mean": mem * 0.95,
        "mem_used_max": mem.astype(np.int64),
        "mem_total_bytes": np.full(device.size, 80 * GIB, dtype=np.int64),
        "power_mean": (80 + util * 5).astype(np.float32),
        "power_max": (90 + util * 5.5).astype(np.float32),
        "temp_max": (35 + util * 0.4).astype(np.float32),
        "throttled_samples": (rng.random(device.size) < 0.0005).astype(np.int32),
        "ecc_dbe_new": (rng.random(device.size) < 0.00001).astype(np.int32),
        "xid_count": (rng.random(device.size) < 0.00005).astype(np.int32),
    })
    workload = names.gather(holder_index)
    team = team_names.gather(pl.Series(team_of[np.maximum(row_holder, 0)]))
    pod = (workload + "-" + pl.Series(block).cast(pl.String) + "-"
           + device_index.cast(pl.String))
    frame = frame.with_columns(
        pl.when(is_held).then(pl.lit("ml")).alias("namespace"),
        pl.when(is_held).then(pod).alias("pod"),
        pl.when(is_held).then(pl.lit("Job")).alias("owner_kind"),
        pl.when(is_held).then(workload).alias("owner_name"),
        pl.when(is_held).then(team).alias("team"),
        pl.when(is_held).then(pl.lit("batch")).alias("workload_kind"),
        pl.when(is_held).then(pl.lit("default")).alias("queue"),
        pl.lit(None, dtype=pl.String).alias("parent_uuid"),
        pl.lit(None, dtype=pl.String).alias("mig_profile"),
        pl.lit(0).alias("clock"),
    )
    return frame.select([pl.col(c).cast(t) for c, t in SCHEMA.items()])


def week_of_rollups(start: float, gpus: int = 64, workloads: int = 40, teams: int = 5,
                    held_share: float = 0.8, minutes: int = 7 * 24 * 60, seed: int = 7
                    ) -> pl.DataFrame:
    """Rollup rows for ``gpus`` devices over ``minutes`` minutes from ``start``."""
    return pl.concat(list(rollup_hours(start, gpus, workloads, teams, held_share, minutes,
                                       seed)))


def recipe(start: float, gpus: int, workloads: int, teams: int = 12, seed: int = 1
           ) -> dict[str, Any]:
    """What a synthetic week is made of, down to the store's column types: a store
    written another way is written again."""
    return {"start": start, "gpus": gpus, "workloads": workloads, "teams": teams,
            "seed": seed, "schema": list(SCHEMA),
            "stored": {c: str(t) for c, t in store.STORED.items()}}


def written(directory: Path, made_of: dict[str, Any]) -> bool:
    """Whether the store at ``directory`` holds the synthetic week of ``made_of``."""
    marker = directory / "synthetic.json"
    return marker.exists() and json.loads(marker.read_text()).get("recipe") == made_of


def write_week(directory: Path, start: float, gpus: int, workloads: int, teams: int = 12,
               seed: int = 1, hours_per_file: int = 6) -> tuple[int, float]:
    """Write a synthetic week into the store at ``directory`` unless it is there already.

    A ``synthetic.json`` beside the day folders records what was written
    (:func:`recipe`), and is written last, so an interrupted run starts again.
    Returns the number of rows and the seconds spent writing them (generating them
    not counted).
    """
    made_of = recipe(start, gpus, workloads, teams, seed)
    marker = directory / "synthetic.json"
    if written(directory, made_of):
        done = json.loads(marker.read_text())
        return int(done["rows"]), float(done.get("write_s", "nan"))
    for old in directory.glob("day=*"):
        for path in old.iterdir():
            path.unlink()
        old.rmdir()
    directory.mkdir(parents=True, exist_ok=True)
    rows, writing, pending = 0, 0.0, []
    hours = list(range(7 * 24))
    for hour, frame in zip(hours, rollup_hours(start, gpus, workloads, teams, seed=seed),
                           strict=True):
        pending.append(frame)
        rows += frame.height
        if len(pending) == hours_per_file or hour == hours[-1]:
            began = time.perf_counter()
            store.write(directory, pl.concat(pending))
            writing += time.perf_counter() - began
            pending = []
    marker.write_text(json.dumps({"recipe": made_of, "rows": rows, "write_s": writing}))
    return rows, writing
