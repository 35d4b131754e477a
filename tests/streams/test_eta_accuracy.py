"""How good the start ETAs are: measured against the simulator's truth on queue-pressure.

The simulator publishes into the node join and the fleet agent in-process, in the order it
produces its records (as a live cluster would deliver them, with no worker start-up lag),
so every workload is estimated from the fleet of its time. For each workload that got an
estimate and started, the first estimate published for it is compared with its true start,
beside the naive baseline (position ÷ the queue's admission rate) published with it.
"""

from __future__ import annotations

import asyncio
import math
import statistics

from gpusteward.rules import eta
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import (
    AllocationEvent,
    Finding,
    HwEvent,
    NodeSample,
    NodeSummary,
    QueueEvent,
)
from gpusteward.streams.fleet import FleetEvaluator, FleetOutput, FleetState
from gpusteward.streams.node import NodeJoin, NodeState, Output


class InProcess:
    """The simulator's publisher, feeding the node join and the fleet agent directly."""

    def __init__(self) -> None:
        self.join, self.nodes = NodeJoin(), dict[str, NodeState]()
        self.fleet, self.state = FleetEvaluator(), FleetState()
        self.outputs: list[FleetOutput] = []

    def _from_node(self, outputs: list[Output]) -> None:
        for output in outputs:
            if isinstance(output, NodeSummary):
                self.outputs += self.fleet.on_summary(self.state, output)

    async def sample(self, sample: NodeSample) -> None:
        self._from_node(self.join.on_sample(self.nodes.setdefault(sample.node, NodeState()),
                                            sample))

    async def hw_event(self, event: HwEvent) -> None:
        self._from_node(self.join.on_hw_event(self.nodes.setdefault(event.node, NodeState()),
                                              event))

    async def allocation(self, event: AllocationEvent) -> None:
        self._from_node(self.join.on_allocation(
            self.nodes.setdefault(event.node, NodeState()), event))

    async def queue(self, event: QueueEvent) -> None:
        self.outputs += self.fleet.on_queue(self.state, event)

    async def flush(self) -> None:
        return None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(abs(v) for v in values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def test_eta_error_on_queue_pressure_against_the_naive_baseline() -> None:
    spec = scenarios.load("queue-pressure").model_copy(update={"acceleration": 0.0})
    pipeline = InProcess()
    truth: GroundTruth = asyncio.run(SimulatedCluster(spec).run(pipeline))
    started = {f"{p.namespace}/{p.pod}": p for p in truth.pods}
    closed = {f"{f.subject.pod.namespace}/{f.subject.pod.name}": f
              for f in pipeline.outputs if isinstance(f, Finding) and f.kind == eta.KIND
              and f.state == "resolved" and f.subject.pod and f.evidence
              and "started_ts" in f.evidence.values}
    # Every workload that waited more than one evaluation got an estimate before it started.
    waited = {key for key, pod in started.items()
              if pod.queued_at is not None and pod.started_at - pod.queued_at >= 60}
    assert len(waited) >= 8 and waited <= set(closed)
    model, naive = [], []
    for key, finding in closed.items():
        assert finding.evidence is not None
        values = finding.evidence.values
        assert values["started_ts"] == started[key].started_at
        if "first_naive_eta_error_s" in values:  # the same workloads for both
            model.append(values["first_eta_error_s"])
            naive.append(values["first_naive_eta_error_s"])
    assert len(model) >= 8
    figures = {name: (statistics.median(abs(e) for e in errors), _percentile(errors, 90))
               for name, errors in (("eta", model), ("naive", naive))}
    print(f"\nstart ETA on queue-pressure, {len(model)} workloads, |first estimate - start| "
          f"(s): median {figures['eta'][0]:.0f}, p90 {figures['eta'][1]:.0f}; naive "
          f"median {figures['naive'][0]:.0f}, p90 {figures['naive'][1]:.0f}")
    assert figures["eta"][0] < figures["naive"][0]
    assert figures["eta"][1] < figures["naive"][1]
