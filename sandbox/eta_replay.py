"""Start ETAs against reality: the openb trace replayed into the start-ETA rule.

The openb trace (:func:`~gpusteward.sandbox.traces.openb_queue_events`) says
when each GPU pod was created, scheduled and deleted on a real 6,212-GPU
cluster; the rule (:mod:`gpusteward.rules.eta`) never sees the future. The
replay feeds it the queue events in event-time order, as the fleet agent
would apply them, with the trace's GPU nodes as the fleet, and evaluates it
every ``interval_s`` (the fleet agent's evaluation interval) while anything
waits. For every pod that got an estimate and then started, the first
estimate is compared with the trace's start, beside two baselines made at the
same moment: the naive one the rule publishes with it (position ÷ the
queue's admission rate over the last hour), and "starts now" (no model at
all: on a cluster with free GPUs most waits are short, and a model must
beat that to be worth anything).

Only the ETA rule runs (the other fleet rules do not change its estimates),
so the replay measures the estimate, not the agent's throughput.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from gpusteward.rules import eta
from gpusteward.rules.fragmentation import FleetView
from gpusteward.sandbox import traces

START = 1_763_942_400.0
"""Where the replayed window starts (a Monday, 2025-11-24 00:00 UTC); any time works."""


@dataclass(frozen=True)
class Errors:
    """Absolute errors (seconds) of one estimator over the measured workloads."""

    median_s: float
    p90_s: float

    @classmethod
    def of(cls, errors: list[float]) -> Errors:
        if not errors:
            raise ValueError("no workload was measured")
        ordered = sorted(abs(e) for e in errors)
        p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
        return cls(statistics.median(ordered), p90)


@dataclass(frozen=True)
class EtaAccuracy:
    workloads: int
    """Pods estimated, then started, with a naive estimate beside the model's."""
    model: Errors
    naive: Errors
    now: Errors
    evaluations: int
    cpu_s: float
    """Process CPU time of the replay (events and evaluations), seconds."""


def replay_openb(directory: Path, days: float = 7.0, interval_s: float = 30.0,
                 settings: eta.EtaSettings | None = None) -> EtaAccuracy:
    """Replay the trace's last ``days`` into the ETA rule and measure its first estimates."""
    settings = settings or eta.EtaSettings()
    events = traces.openb_queue_events(directory, START, days, follow_to_end=True)
    fleet = FleetView(nodes=traces.openb_node_summaries(directory, START), pending={},
                      shape_counts={})
    began = time.process_time()
    state = eta.EtaState()
    made_at: dict[str, float] = {}
    closed: list[eta.Finding] = []
    clock, evaluations = START, 0

    def evaluate(now: float) -> None:
        nonlocal evaluations
        evaluations += 1
        for finding in eta.evaluate(state, fleet, now, settings):
            made_at.setdefault(finding.id, finding.ts)

    for event in events:
        # The agent evaluates on its own clock whatever arrives; between two events only
        # the evaluations while someone waits can publish anything.
        while state.pending and clock + interval_s <= event.ts:
            clock += interval_s
            evaluate(clock)
        if not state.pending:
            clock = max(clock, event.ts)
        closed += eta.on_queue(state, event, settings)
    cpu_s = time.process_time() - began
    model, naive, now = [], [], []
    for finding in closed:
        values = finding.evidence.values if finding.evidence else {}
        if "started_ts" not in values or "first_naive_eta_error_s" not in values:
            continue
        model.append(values["first_eta_error_s"])
        naive.append(values["first_naive_eta_error_s"])
        now.append(made_at[finding.id] - values["started_ts"])
    return EtaAccuracy(len(model), Errors.of(model), Errors.of(naive), Errors.of(now),
                       evaluations, cpu_s)
