"""``make bench``: run every ``benchmarks/bench_*.py`` and print one table of figures.

Each benchmark module has ``run() -> list[Figure]``. Benchmarks measure on
the machine at hand; README records the figures with the machine they came
from. A module can be run alone: ``python -P benchmarks/run.py worker``.
Every figure printed is also written to ``bench-results.json`` at the
repository root: the machine and a list of ``{"benchmark", "name", "value",
"unit"}`` records, so runs compare without parsing the table.
"""

from __future__ import annotations

import importlib.util
import json
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
    machine = f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}"
    table = Table(title=f"gpusteward benchmarks on {platform.node()} ({machine})")
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
    console.print(table)
    results = HERE.parent / "bench-results.json"
    results.write_text(json.dumps({"machine": f"{platform.node()} ({machine})",
                                   "results": records}, indent=1) + "\n")
    console.print(f"figures written to {results}")
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
