"""Fleet agent MIG layout advice: per-record overhead, one advice, checkpoint growth.

A 10,000-GPU fleet (1,250 nodes x 8 GPUs, half A100-80GB, half H100-80GB), of
which 250 nodes (2,000 GPUs) are MIG-partitioned in mixed layouts, and 5,000
MIG workloads in the trailing window, each asking for one device of a common
inference profile (1g.10gb, 2g.20gb, 3g.40gb), arriving at random times so
that nearly every share is distinct (the solver's worst case for bucketing).
Measured:

- the MIG bookkeeping added to every record (the median of a summary's and a
  queue event's fold, in microseconds);
- one advice as the agent computes it each ``mig_advice_interval_s`` (pools,
  demand, today's layouts, the two solves per pool, the findings);
- the checkpointed fleet state's msgpack size with and without the MIG part,
  since the agent writes it on every queue event, and the size of a record of
  the MIG workload table (written when a workload's entry changes).

Pure CPU, no broker.
"""

from __future__ import annotations

import random
import statistics
import time

import msgspec
from figures import Figure

from gpusteward.rules.mig import observed
from gpusteward.rules.policy import parse_policy
from gpusteward.schema import NodeSummary, QueueEvent
from gpusteward.streams.fleet import FleetEvaluator, FleetSettings, FleetState

NODES, GPUS, MIG_NODES, WORKLOADS = 1250, 8, 250, 5000
WEEK = 7 * 86400.0
START = 1_763_683_200.0
LAYOUTS = [{"1g.10gb": 7}, {"3g.40gb": 2}, {"2g.20gb": 3}]
MODELS = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"]


def _fleet(rng: random.Random) -> tuple[FleetEvaluator, FleetState]:
    evaluator = FleetEvaluator(FleetSettings(policy=parse_policy(
        f"rules: {{mig_layout_advice: {{window_s: {WEEK}}}}}")))
    state = FleetState()
    # In event-time order, as the agent reads them: the queue rules drop events older
    # than their window behind the clock, and the MIG bookkeeping follows them.
    arrivals = sorted(START + rng.uniform(0, WEEK) for _ in range(WORKLOADS))
    for i, ts in enumerate(arrivals):
        evaluator.on_queue(state, QueueEvent(
            ts=ts, name=f"svc-{i}", namespace="inference", cluster_queue="prod",
            state="admitted", mig={rng.choice(["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]): 1}))
    for i in range(NODES):
        free: dict[str, int] = {}
        if i < MIG_NODES:
            for _ in range(GPUS):
                for profile, count in rng.choice(LAYOUTS).items():
                    free[profile] = free.get(profile, 0) + count
        evaluator.on_summary(state, NodeSummary(
            ts=START + WEEK, node=f"n{i:04d}", gpu_model=MODELS[i % 2], gpus_total=GPUS,
            gpus_free=GPUS, mig_free=free))
    assert len(state.mig.workloads) == WORKLOADS
    return evaluator, state


def run() -> list[Figure]:
    rng = random.Random(7)
    evaluator, state = _fleet(rng)
    summary = state.nodes["n0000"]
    event = QueueEvent(ts=START + WEEK, name="svc-0", namespace="inference",
                       cluster_queue="prod", state="admitted", mig={"1g.10gb": 1})
    per_record = []
    for _ in range(2000):
        started = time.perf_counter()
        observed.on_summary(state.mig, summary)
        observed.on_queue(state.mig, "inference/svc-0", event)
        per_record.append((time.perf_counter() - started) / 2 * 1e6)
    slot = observed.slot_of(START + WEEK, evaluator.mig_advice_settings.interval_s)
    started = time.perf_counter()
    findings = evaluator.mig_advice(state, slot)
    advise_s = time.perf_counter() - started
    assert findings, "the mixed layouts should not be the optimum"
    _, fresh = _fleet(random.Random(7))
    # As the agent writes it: nodes and MIG workloads live in tables of their own.
    with_mig = len(msgspec.msgpack.encode(msgspec.structs.replace(
        fresh, nodes={}, mig=msgspec.structs.replace(fresh.mig, workloads={}, touched=[]))))
    without = len(msgspec.msgpack.encode(msgspec.structs.replace(
        fresh, nodes={}, mig=observed.MigObservation())))
    per_workload = statistics.mean(len(msgspec.msgpack.encode(w))
                                   for w in fresh.mig.workloads.values())
    return [
        Figure("MIG bookkeeping per record (summary or queue event)",
               statistics.median(per_record), "us"),
        Figure(f"one MIG advice: {MIG_NODES * GPUS:,} MIG GPUs of {NODES * GPUS:,}, "
               f"{WORKLOADS:,} workloads", advise_s, "s"),
        Figure(f"checkpoint growth for {MIG_NODES} MIG nodes' layouts",
               (with_mig - without) / 1024, "KiB"),
        Figure("MIG workload table record (one per workload change)", per_workload, "B"),
        Figure("checkpoint without the MIG part (same fleet and queue)", without / 1024, "KiB"),
    ]
