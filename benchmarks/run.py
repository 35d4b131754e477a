"""``make bench``: run every ``benchmarks/bench_*.py`` and print one table of figures.

Each benchmark module has ``run() -> list[Figure]``. Benchmarks measure on
the machine at hand; README records the figures with the machine they came
from. A module can be run alone: ``python -P benchmarks/run.py worker``.
Every figure printed is also written to ``bench-results.json`` at the
repository root: the machine and a list of ``{"benchmark", "name", "value",
"unit"}`` records, so runs compare without parsing the table.

Hosts differ: the development VM has been seen on hosts where the same code ran
twice as slow. So every run also times a fixed piece of pure Python (a loop of
attribute reads, dict writes and calls, the node join's kind of work) and
records it with the CPU model and the load average: figures from two runs
compare only where that reference agrees.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent


def _load(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def main(selected: list[str]) -> int:
    sys.path.insert(0, str(HERE))
    console = Console()
    reference_ms = _reference_ms()
    load_before = os.getloadavg()[0]
    machine = (f"{platform.machine()}, {_cpus()} CPUs ({_cpu_model()}), "
               f"Python {platform.python_version()}")
    table = Table(title=f"gpusteward benchmarks on {platform.node()} ({machine}); "
                        f"reference loop {reference_ms:.0f} ms")
    for column in ("benchmark", "figure", "value", "unit"):
        table.add_column(column)
    records: list[dict[str, object]] = []
    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        if selected and name not in selected:
            continue
        console.print(f"running {name} ...")
        started = time.monotonic()
        for figure in _load(path).run():
            table.add_row(name, figure.name, f"{figure.value:,.2f}", figure.unit)
            records.append({"benchmark": name, "name": figure.name,
                            "value": float(figure.value), "unit": figure.unit})
        console.print(f"  {name} took {time.monotonic() - started:.0f} s")
    load_after = os.getloadavg()[0]
    console.print(table)
    console.print(f"1-min load average {load_before:.2f} at the start, {load_after:.2f} at "
                  "the end")
    results = HERE.parent / "bench-results.json"
    results.write_text(json.dumps({"machine": f"{platform.node()} ({machine})",
                                   "reference_loop_ms": reference_ms,
                                   "load_average": [load_before, load_after],
                                   "results": records}, indent=1) + "\n")
    console.print(f"figures written to {results}")
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class _Reading:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _step(reading: _Reading, i: int) -> int:
    reading.value = i
    return i & 1023


def _reference_ms() -> float:
    """CPU milliseconds of a fixed pure-Python loop, best of five: the host's speed at
    the kind of work the worker does, to tell a slower host from a slower build."""
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        reading, seen = _Reading(), {}
        for i in range(300_000):
            seen[_step(reading, i)] = reading.value + i
        best = min(best, time.process_time() - started)
    return best * 1000


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
