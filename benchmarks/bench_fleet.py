"""Fleet agent: time to evaluate fragmentation over 1,250 node summaries.

The fleet agent keeps the latest summary of every node and evaluates the
fleet-wide rules at most every ``evaluate_interval_s``. This measures one
evaluation on a 10,000-GPU fleet (1,250 nodes x 8 GPUs) in three forms:

- the FGD measure alone over the node summaries, with the request shapes of
  a realistic mix (1, 2, 4 and 8 GPUs);
- a whole evaluation (FGD, stranded demand for 200 pending workloads, queue
  SLO tick) as the agent runs it;
- the FGD measure over 1,250 nodes whose GPUs are each partly allocated
  (per-GPU milli, all nodes distinct, the 24 request shapes of the Alibaba
  trace's mix): the worst case for the per-free-vector cache.

Pure CPU, no broker; the median of repeated runs.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from figures import Figure

from gpusteward.rules import fragmentation as frag
from gpusteward.schema import NodeSummary, QueueEvent
from gpusteward.streams.fleet import FleetEvaluator, FleetState

NODES, GPUS = 1250, 8
START = 1_763_683_200.0
REPEATS = 30


def _median_ms(work: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _fleet(rng: random.Random) -> tuple[FleetEvaluator, FleetState]:
    evaluator = FleetEvaluator()
    state = FleetState()
    for i in range(NODES):
        state.nodes[f"h100-{i}"] = NodeSummary(
            ts=START, node=f"h100-{i}", gpu_model="NVIDIA H100 80GB HBM3", gpus_total=GPUS,
            gpus_free=rng.choice([0, 0, 0, 1, 2, 3, 4, 8]), cordoned=rng.random() < 0.01,
        )
    for i in range(200):
        gpus = rng.choice([1, 1, 1, 2, 4, 8])
        evaluator.on_queue(state, QueueEvent(ts=START + i, name=f"job-{i}", namespace="ml",
                                             cluster_queue="research", state="pending",
                                             created_at=START + i, gpus=gpus))
    return evaluator, state


def run() -> list[Figure]:
    rng = random.Random(1)
    evaluator, state = _fleet(rng)
    fgd_ms = _median_ms(lambda: evaluator.fragmentation(state))
    clock = [START + 300.0]

    def whole() -> None:
        # Within node_stale_s of the summaries, so every node stays in the evaluation.
        clock[0] += 1.0
        evaluator.evaluate(state, clock[0])

    evaluate_ms = _median_ms(whole)
    assert len(state.nodes) == NODES and len(state.queue.waiting) == 200
    shapes = frag.popularity(
        [frag.Shape(1, m) for m in (1000, 810, 470, 320, 650, 230, 460, 590, 160, 550, 220,
                                    370, 110, 480, 50, 330, 350, 270, 440, 290, 140)]
        + [frag.Shape(g) for g in (2, 4, 8)]
    )
    partial = [[rng.choice([0, 0, 1000, rng.randint(1, 999)]) for _ in range(GPUS)]
               for _ in range(NODES)]
    partial_ms = _median_ms(lambda: frag.cluster_fragmentation(partial, shapes))
    return [
        Figure("FGD over 1,250 node summaries (whole-GPU free counts)", fgd_ms, "ms"),
        Figure("whole fleet evaluation (FGD + stranded for 200 pending + queue SLOs)",
               evaluate_ms, "ms"),
        Figure("FGD over 1,250 distinct partly-allocated nodes, 24 shapes (worst case)",
               partial_ms, "ms"),
    ]
