"""A synthetic week of rollups: for the benchmark, the tests and trying the report out.

Vectorised with numpy so a week of 1,000 GPUs (10 M device-minutes) is
built in seconds. The fleet: ``gpus`` whole GPUs, 8 to a node, a mix of
H100 and A100 models; the week is cut into 6-hour blocks and in each block a
device is held (with probability ``held_share``) by one of ``workloads``
workloads spread over ``teams`` teams. Each workload has its own typical
utilisation (some near idle) and memory footprint; each minute adds noise.
Seeded, so a test can recompute what it expects.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from gpusteward.reports.store import SCHEMA

BLOCK_MINUTES = 360
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")
GIB = 1 << 30


def week_of_rollups(start: float, gpus: int = 64, workloads: int = 40, teams: int = 5,
                    held_share: float = 0.8, minutes: int = 7 * 24 * 60, seed: int = 7
                    ) -> pl.DataFrame:
    """Rollup rows for ``gpus`` devices over ``minutes`` minutes from ``start``."""
    rng = np.random.default_rng(seed)
    blocks = -(-minutes // BLOCK_MINUTES)
    device = np.repeat(np.arange(gpus), minutes)
    minute = np.tile(np.arange(minutes), gpus)
    block = minute // BLOCK_MINUTES

    held = rng.random((gpus, blocks)) < held_share
    holder = rng.integers(0, workloads, size=(gpus, blocks))
    row_held = held[device, block]
    row_holder = np.where(row_held, holder[device, block], -1)

    # Per workload: a typical utilisation (a quarter of them near idle) and memory.
    typical = np.where(rng.random(workloads) < 0.25, rng.uniform(0, 3, workloads),
                       rng.uniform(5, 90, workloads))
    memory = rng.uniform(4, 70, workloads) * GIB
    team_of = rng.integers(0, teams, workloads)

    noise = rng.normal(0, 4, device.size)
    util = np.where(row_held, np.clip(typical[np.maximum(row_holder, 0)] + noise, 0, 100), 0.0)
    spread = rng.uniform(0, 6, device.size)
    mem = np.where(row_held, memory[np.maximum(row_holder, 0)]
                   * rng.uniform(0.9, 1.0, device.size), 0.0)

    names = pl.Series([f"wl-{w:04d}" for w in range(workloads)])
    team_names = pl.Series([f"team-{t:02d}" for t in range(teams)])
    node_names = pl.Series([f"node-{d // 8:04d}" for d in range(gpus)])
    uuids = pl.Series([f"GPU-{d:08x}-0000-0000-0000-000000000000" for d in range(gpus)])
    models = pl.Series([MODELS[(d // 8) % 3 == 2] for d in range(gpus)])
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
    )
    return frame.select([pl.col(c).cast(t) for c, t in SCHEMA.items()])
