"""Weekly report and MIG layout search at fleet scale.

- report: one synthetic week of minute rollups of 1,000 and of 10,000 GPUs
  (10.08 M and 100.8 M rows), written to the Parquet store once and kept in a
  cache folder (``BENCH_CACHE``, default ``~/.cache/gpusteward``) for later runs;
  from the store to the finished report (HTML, Markdown, JSON) in a child
  process, whose peak RSS is the report's own, and the peak size of its spill on
  disk (what the CronJob's spill volume must hold). Store size per GPU-week and
  the store's write rate are measured while the cache is filled.
- MIG: layouts for 1,000 GPUs (two pools of 500: H100 and A100) and 10,000
  workloads with random smallest profiles and shares of the week; and one
  live advice of the fleet agent at 10,000 GPUs (2,000 of them MIG). Each
  beside the previous solver (``tests/rules/mig/previous_solver.py``) on the
  same input.

``BENCH_REPORT_GPUS`` picks the report fleets (default ``1000,10000``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from figures import Figure

from gpusteward.reports import compute
from gpusteward.rules.mig import geometry, layout
from gpusteward.sandbox import rollups

ROOT = Path(__file__).resolve().parent.parent
GENERATE = """
import sys, time
from pathlib import Path
from gpusteward.sandbox import rollups
folder, gpus, start = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
began = time.perf_counter()
rows, writing = rollups.write_week(folder, start, gpus=gpus, workloads=gpus // 2, teams=12,
                                   seed=1)
print(rows, time.perf_counter() - began, writing)
"""
BUILD = """
import json, os, resource, sys, tempfile, time
from pathlib import Path
from gpusteward.reports import build, compute, render
from gpusteward.reports.settings import ReportSettings
folder, label = Path(sys.argv[1]), sys.argv[2]
began, cpu = time.perf_counter(), time.process_time()
report = build.build(folder, compute.parse_week(label), ReportSettings())
built, cpu = time.perf_counter(), time.process_time() - cpu
render.write(report, Path(tempfile.mkdtemp(prefix="bench-report-out-")))
print(json.dumps({"build_s": built - began, "build_cpu_s": cpu,
                  "render_s": time.perf_counter() - built,
                  "rows": report.data["totals"]["device_minutes"],
                  "spill_bytes": report.spill_bytes,
                  "held_device_minutes": sum(w["device_minutes"]
                                             for w in report.data["workloads"]),
                  "load": os.getloadavg()[0],
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _cache() -> Path:
    return Path(os.environ.get("BENCH_CACHE", Path.home() / ".cache" / "gpusteward"))


def _report(gpus: int) -> list[Figure]:
    week = compute.parse_week("2026-W47")
    folder = _cache() / f"bench-rollups-{gpus}"
    fleet = f"{gpus:,} GPUs"
    figures: list[Figure] = []
    # Written again when the recipe or the store's column types changed.
    if not rollups.written(folder, rollups.recipe(week.start, gpus, gpus // 2, teams=12,
                                                  seed=1)):
        child = subprocess.run([sys.executable, "-P", "-c", GENERATE, str(folder), str(gpus),
                                str(week.start)], capture_output=True, text=True, check=True)
        rows, seconds, writing = (float(v) for v in child.stdout.split())
        # One writer's Parquet write (store.write, as the sink calls it) against the
        # fleet's own rate: a rollup per GPU per minute.
        figures += [
            Figure(f"generate and write the synthetic week ({fleet})", seconds, "s"),
            Figure(f"store write rate, one writer ({fleet})", rows / writing, "rows/s"),
            Figure(f"store write speed against real time ({fleet})",
                   rows / writing / (gpus / 60), "x"),
        ]
    size = sum(p.stat().st_size for p in folder.rglob("*.parquet"))
    child = subprocess.run([sys.executable, "-P", "-c", BUILD, str(folder), week.label],
                           capture_output=True, text=True, check=True)
    built = json.loads(child.stdout.splitlines()[-1])
    return [
        *figures,
        Figure(f"rollup rows ({fleet} x 1 week)", built["rows"], "rows"),
        Figure(f"Parquet store size ({fleet})", size / 1e6, "MB"),
        Figure(f"Parquet store size per GPU-week ({fleet})", size / gpus / 1e3, "kB"),
        Figure(f"build report: read, aggregate, advise, MIG ({fleet})", built["build_s"], "s"),
        # All threads' CPU: on a busy machine the wall time says more about the others.
        Figure(f"build report, CPU time of all threads ({fleet})", built["build_cpu_s"], "s"),
        Figure(f"build report, CPU per million rows ({fleet})",
               built["build_cpu_s"] / built["rows"] * 1e6, "s"),
        Figure(f"load average (1 min) at the end of the build ({fleet})", built["load"], ""),
        Figure(f"render HTML, Markdown, JSON ({fleet})", built["render_s"], "s"),
        Figure(f"peak RSS of the report process ({fleet})", built["peak_mib"], "MiB"),
        Figure(f"peak spill on disk of the report ({fleet})", built["spill_bytes"] / 2**20,
               "MiB"),
        Figure(f"spill per held device-minute ({fleet})",
               built["spill_bytes"] / max(1, built["held_device_minutes"]), "B"),
    ]


def _previous() -> Callable[..., tuple[list[dict[str, int]], dict[str, str]]]:
    """The previous solver, kept beside the tests, for the same input."""
    sys.path.insert(0, str(ROOT))
    from tests.rules.mig import previous_solver

    return previous_solver.solve_pool


def _timed(run: Callable[[], object], solver: Callable[..., object] | None = None
           ) -> tuple[float, object]:
    """Seconds to run ``run`` (with ``solver`` standing in for the pool solver)."""
    current = layout.solve_pool
    if solver is not None:
        layout.solve_pool = solver  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        result = run()
        return time.perf_counter() - started, result
    finally:
        layout.solve_pool = current


def _mig(gpus: int = 1000, workloads: int = 10_000) -> list[Figure]:
    geometries = geometry.load()
    rng = random.Random(11)
    pools = [layout.Pool("h100", "H100-80GB", tuple(f"h{i:03d}" for i in range(gpus // 16)), 8),
             layout.Pool("a100", "A100-80GB", tuple(f"a{i:03d}" for i in range(gpus // 16)), 8)]
    demand: dict[str, list[layout.Demand]] = {"h100": [], "a100": []}
    for i in range(workloads):
        pool = pools[i % 2]
        names = [p.name for p in geometries[pool.model].base_profiles]
        profile = rng.choices(names, weights=[40, 15, 20, 15, 5, 5])[0]
        demand[pool.name].append(layout.Demand(f"w{i}", profile, round(rng.random(), 3)))
    elapsed, result = _timed(lambda: layout.advise(geometries, pools, demand))
    before, previous = _timed(lambda: layout.advise(geometries, pools, demand), _previous())
    assert isinstance(result, layout.Advice) and isinstance(previous, layout.Advice)
    served = sum(p.served_share for p in result.pools)
    wanted = sum(p.demand_share for p in result.pools)
    label = "over-subscribed" if served < wanted - 1e-6 else "all served"
    name = f"MIG plan, {gpus:,} GPUs x {workloads:,} workloads ({label})"
    return [
        Figure(name, elapsed, "s"),
        Figure(f"{name}, previous solver", before, "s"),
        Figure(f"{name}: demand served", 100 * served / wanted, "%"),
        Figure(f"{name}: demand served, previous solver",
               100 * sum(p.served_share for p in previous.pools) / wanted, "%"),
        Figure(f"{name}: GPUs used", sum(p.gpus_used for p in result.pools), "GPUs"),
        Figure(f"{name}: GPUs used, previous solver",
               sum(p.gpus_used for p in previous.pools), "GPUs"),
    ]


def _live_advice() -> list[Figure]:
    """The fleet agent's advice on the bench_mig_advice fleet, new and previous solver."""
    import bench_mig_advice as fleet

    evaluator, state = fleet._fleet(random.Random(7))
    slot = fleet.observed.slot_of(fleet.START + fleet.WEEK,
                                  evaluator.mig_advice_settings.interval_s)
    elapsed, _ = _timed(lambda: evaluator.mig_advice(state, slot))
    evaluator, state = fleet._fleet(random.Random(7))
    before, _ = _timed(lambda: evaluator.mig_advice(state, slot), _previous())
    name = (f"live MIG advice, 10,000 GPUs ({fleet.MIG_NODES * fleet.GPUS:,} MIG), "
            f"{fleet.WORKLOADS:,} workloads")
    return [Figure(name, elapsed, "s"), Figure(f"{name}, previous solver", before, "s")]


def run() -> list[Figure]:
    fleets = [int(g) for g in os.environ.get("BENCH_REPORT_GPUS", "1000,10000").split(",")]
    figures = _mig() + _mig(workloads=3000) + _live_advice()
    for gpus in fleets:
        figures += _report(gpus)
    return figures

