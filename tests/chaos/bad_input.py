"""``make chaos`` (bad input): about 10,000 malformed records per input topic beside a run.

The poison test of ``make test`` sends 20 of each variant; this experiment
sends ``--per-variant`` (default 908: 11 variants make about 10,000 per
topic, plus 20 records of 1 MB garbage) over ``--spread`` seconds while the
``faulty-fleet`` scenario runs through a real worker on a fresh embedded
broker, then prints what came out against what went in: bad records sent
and dead-lettered per topic, findings missed and false against the ground
truth, and how long the worker took to catch up after the publishers
stopped. Exits non-zero when any target is missed.

Run: ``python -P tests/chaos/bad_input.py [--per-variant N] [--spread S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
# After site-packages: `gpusteward` is the installed package, `tests` this checkout's.
sys.path.append(str(ROOT))

from gpusteward.broker import EmbeddedBroker  # noqa: E402
from tests.e2e.poison import INPUT_TOPICS, run_beside_faulty_fleet  # noqa: E402
from tests.e2e.test_faulty_fleet import _expected, _key  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-variant", type=int, default=908)
    parser.add_argument("--garbage", type=int, default=20, help="1 MB records per topic")
    parser.add_argument("--spread", type=float, default=60.0, help="seconds to send them over")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpusteward-chaos-") as tmp, \
            EmbeddedBroker(log_path=Path(tmp) / "tansu.log") as broker:
        settings = broker.settings().model_copy(update={"topic_prefix": "chaos-poison"})
        run = asyncio.run(run_beside_faulty_fleet(
            settings, Path(tmp), args.per_variant, garbage_per_topic=args.garbage,
            spread_s=args.spread, catch_up_timeout_s=300.0))
    dead = Counter(d.source_topic for d in run.dead)
    without_reason = sum(1 for d in run.dead if not d.error)
    expected = set(_expected(run.truth))
    found = {_key(f) for f in run.findings if f.state == "firing"}
    table = Table(title="chaos: bad input beside the faulty-fleet run")
    for column in ("input topic", "bad sent", "dead-lettered", "share"):
        table.add_column(column, justify="right")
    ok = True
    for topic in INPUT_TOPICS:
        name = topic.name(settings)
        sent, kept = run.sent.by_topic.get(name, 0), dead.get(name, 0)
        ok &= sent == kept
        table.add_row(name, str(sent), str(kept), f"{kept / sent:.1%}" if sent else "-")
    console = Console()
    console.print(table)
    missed, false = expected - found, found - expected
    ok &= not missed and not false and without_reason == 0
    console.print(f"dead letters without a reason: {without_reason}")
    console.print(f"findings expected {len(expected)}, missed {len(missed)}, false {len(false)}")
    console.print(f"worker caught up {run.catch_up_s:.1f} s after the publishers stopped")
    console.print("[green]all targets met[/]" if ok else "[red]targets missed[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
