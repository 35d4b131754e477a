"""Weekly report and MIG layout search at fleet scale.

- report: one week of minute rollups of 1,000 GPUs (10,080,000 rows, synthetic,
  written to the Parquet store first), from the store to the finished report
  (HTML, Markdown, JSON); peak memory of the process is reported too.
- MIG: layouts for 1,000 GPUs (two pools of 500: H100 and A100) and 10,000
  workloads with random smallest profiles and shares of the week.

``BENCH_REPORT_GPUS`` shrinks the report fleet for a quick run.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import Figure

from gpusteward.reports import build, compute, render
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry, layout

GENERATE = """
import sys, time
from pathlib import Path
from gpusteward.reports import store
from gpusteward.sandbox import rollups as synthetic
folder, gpus, start = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
began = time.perf_counter()
rows = synthetic.week_of_rollups(start, gpus=gpus, workloads=gpus // 2, teams=12, seed=1)
generated = time.perf_counter()
store.write(folder, rows)
print(rows.height, generated - began, time.perf_counter() - generated)
"""


def _report(gpus: int) -> list[Figure]:
    week = compute.parse_week("2026-W47")
    folder = Path(tempfile.mkdtemp(prefix="bench-report-"))
    try:
        # Generate and write in a child process, so this process's peak memory is the
        # report's own.
        child = subprocess.run(
            [sys.executable, "-P", "-c", GENERATE, str(folder / "rollups"), str(gpus),
             str(week.start)], capture_output=True, text=True, check=True)
        count, generate_s, write_s = (float(v) for v in child.stdout.split())
        written = time.perf_counter()
        report = build.build(folder / "rollups", week, ReportSettings())
        built = time.perf_counter()
        render.write(report, folder / "out")
        rendered = time.perf_counter()
        size = sum(p.stat().st_size for p in (folder / "rollups").rglob("*.parquet"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return [
        Figure(f"rollup rows ({gpus} GPUs x 1 week)", count, "rows"),
        Figure("generate synthetic rollups", generate_s, "s"),
        Figure("write Parquet store", write_s, "s"),
        Figure("Parquet store size", size / 1e6, "MB"),
        Figure("build report (read, aggregate, advise, MIG)", built - written, "s"),
        Figure("render HTML, Markdown, JSON", rendered - built, "s"),
        Figure("peak RSS while building the report", peak_kib / 1024, "MiB"),
    ]


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
    started = time.perf_counter()
    advice = layout.advise(geometries, pools, demand)
    elapsed = time.perf_counter() - started
    served = sum(p.served_share for p in advice.pools)
    wanted = sum(p.demand_share for p in advice.pools)
    label = "over-subscribed" if served < wanted - 1e-6 else "all served"
    return [
        Figure(f"MIG layouts for {gpus} GPUs, {workloads} workloads ({label})", elapsed, "s"),
        Figure("MIG demand served", 100 * served / wanted, "%"),
        Figure("GPUs the plan uses", sum(p.gpus_used for p in advice.pools), "GPUs"),
    ]


def run() -> list[Figure]:
    return _mig() + _mig(workloads=3000) + _report(int(os.environ.get("BENCH_REPORT_GPUS", "1000")))
