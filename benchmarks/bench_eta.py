"""Start ETAs against the real starts of the openb trace (Alibaba, 6,212 GPUs).

The trace's last week replayed into the start-ETA rule
(:mod:`gpusteward.sandbox.eta_replay`): for every GPU pod that got an
estimate and started, the absolute error of its first estimate against the
trace's start, median and p90, beside the naive baseline published with it
(position ÷ the queue's admission rate) and a "starts now" baseline made at
the same moment; and the replay's CPU time per evaluation. Skipped (no
figures) where the shared trace folder is absent.
"""

from __future__ import annotations

from pathlib import Path

from figures import Figure

from gpusteward.sandbox.eta_replay import replay_openb

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
DAYS = 7.0


def run() -> list[Figure]:
    if not TRACES.is_dir():
        return []
    measured = replay_openb(TRACES, DAYS)
    figures = [Figure("openb week: pods estimated, then started", measured.workloads, "pods")]
    for name, errors in (("start ETA", measured.model), ("naive ETA (position / rate)",
                                                         measured.naive),
                         ("'starts now' baseline", measured.now)):
        figures += [Figure(f"{name}: median |error|", errors.median_s, "s"),
                    Figure(f"{name}: p90 |error|", errors.p90_s, "s")]
    figures.append(Figure("replay CPU per ETA evaluation",
                          measured.cpu_s / max(1, measured.evaluations) * 1000, "ms"))
    return figures
