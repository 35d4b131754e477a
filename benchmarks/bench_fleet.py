"""Fleet agent: time to evaluate fragmentation over 1,250 node summaries.

The fleet agent keeps the latest summary of every node and evaluates the
fleet-wide rules at most every ``evaluate_interval_s``. This measures one
evaluation on a 10,000-GPU fleet (1,250 nodes x 8 GPUs) in four forms:

- the FGD measure alone over the node summaries, with the request shapes of
  a realistic mix (1, 2, 4 and 8 GPUs);
- a whole evaluation (FGD, stranded demand for 200 pending workloads, queue
  SLO tick, start estimates, demand-aware reclaim) as the agent runs it;
- the same for a full, fragmented fleet (0-2 GPUs free per node, an idle
  holder of one GPU on each) and 1,000 workloads of 4 and 8 GPUs (half of them
  of 2-4 such pods) that fit no node even with every holder reclaimed, waiting
  an hour: the evaluation runs in the worker's event loop, beside the node
  join's urgent path;
- the FGD measure over 1,250 nodes whose GPUs are each partly allocated
  (per-GPU milli, all nodes distinct, the 24 request shapes of the Alibaba
  trace's mix): the worst case for the per-free-vector cache;
- the fleet state's checkpoint after one admission, with the queue following
  9,000 running 1-GPU pods of eight queues: the bytes it puts on the changelog
  (chunks that changed and the head: ``streams/stored.py``) against the whole
  state, which every batch with a queue event wrote until 2026-11-28, and the
  CPU the checkpoint takes.

Pure CPU, no broker; the median of repeated runs.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import msgspec
from figures import Figure

from gpusteward.rules import fragmentation as frag
from gpusteward.schema import IdleHold, NodeSummary, PodRef, PodSet, QueueEvent
from gpusteward.streams.fleet import FleetEvaluator, FleetState
from gpusteward.streams.stored import in_chunks

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


def _fleet(rng: random.Random, free: Sequence[int] = (0, 0, 0, 1, 2, 3, 4, 8),
           pending: int = 200, sizes: Sequence[int] = (1, 1, 1, 2, 4, 8),
           waited_s: float = 0.0, stuck: bool = False) -> tuple[FleetEvaluator, FleetState]:
    """The fleet's summaries, each node with one of ``free`` GPUs free, and ``pending``
    workloads of one of ``sizes`` GPUs waiting since ``waited_s`` before the summaries.
    ``stuck``: each node also has an idle holder of one GPU, and half the workloads are
    of several pods (reclaims are looked for, and found to be of no use)."""
    evaluator = FleetEvaluator()
    state = FleetState()
    for i in range(NODES):
        idle = [IdleHold(device=f"GPU-{i}-0", pod=PodRef("ml", f"nb-{i}"),
                         idle_since=START - 7200, gpus=1)] if stuck else []
        state.nodes[f"h100-{i}"] = NodeSummary(
            ts=START, node=f"h100-{i}", gpu_model="NVIDIA H100 80GB HBM3", gpus_total=GPUS,
            gpus_free=rng.choice(free), cordoned=rng.random() < 0.01, idle=idle,
        )
    for i in range(pending):
        ts = START - waited_s + i
        gpus = rng.choice(sizes)
        pods = [PodSet(count=rng.randint(2, 4), gpus=gpus)] if stuck and i % 2 else []
        evaluator.on_queue(state, QueueEvent(ts=ts, name=f"job-{i}", namespace="ml",
                                             cluster_queue="research", state="pending",
                                             created_at=ts, gpus=gpus, pod_sets=pods))
    return evaluator, state


def _mixed(rng: random.Random, pending: int = 250) -> tuple[FleetEvaluator, FleetState]:
    """A full fleet, a fifth of it MIG nodes, idle holders (whole GPUs or MIG slices) on 30 %
    of the nodes, and ``pending`` workloads waiting an hour: a quarter of one pod of 1-4
    GPUs, a quarter of one MIG slice, half of 2-4 pods of 1-2 GPUs. Half of them (126) find
    holders to reclaim (282), so the reclaim match searches for each: every reclaim changes
    the room, and no shape stays memoised as stuck."""
    evaluator, state = FleetEvaluator(), FleetState()
    for i in range(NODES):
        partitioned = i % 5 == 0
        idle: list[IdleHold] = []
        if rng.random() < 0.3:
            idle = [IdleHold(device=f"GPU-{i}-{k}", pod=PodRef("ml", f"nb-{i}-{k}"),
                             idle_since=START - 9000,
                             gpus=0 if partitioned else rng.choice([1, 1, 2]),
                             mig_profile=rng.choice(["1g.10gb", "3g.40gb"]) if partitioned
                             else None)
                    for k in range(rng.randint(1, 3))]
        state.nodes[f"a100-{i}"] = NodeSummary(
            ts=START, node=f"a100-{i}", gpu_model="NVIDIA A100-SXM4-80GB", gpus_total=GPUS,
            gpus_free=0 if partitioned else rng.choice([0, 0, 1]), idle=idle,
            mig_free={"1g.10gb": rng.choice([0, 1])} if partitioned else {},
            mig_total={"1g.10gb": 7} if partitioned else {})
    for i in range(pending):
        ts = START - 3600 + i
        gpus, mig, pods = rng.choice([1, 2, 4]), dict[str, int](), list[PodSet]()
        if i % 4 == 1:
            gpus, mig = 0, {rng.choice(["1g.10gb", "3g.40gb"]): 1}
        elif i % 4 > 1:
            count, each = rng.randint(2, 4), rng.choice([1, 2])
            gpus, pods = count * each, [PodSet(count=count, gpus=each)]
        evaluator.on_queue(state, QueueEvent(ts=ts, name=f"job-{i}", namespace="ml",
                                             cluster_queue="research", state="pending",
                                             created_at=ts, gpus=gpus, mig=mig, pod_sets=pods))
    return evaluator, state


def _evaluation_ms(evaluator: FleetEvaluator, state: FleetState) -> float:
    clock = [START + 300.0]

    def whole() -> None:
        # Within node_stale_s of the summaries, so every node stays in the evaluation.
        clock[0] += 1.0
        evaluator.evaluate(state, clock[0])

    return _median_ms(whole)


def _checkpoint(running: int = 9_000) -> tuple[float, float, float]:
    """KB of changelog per admission's checkpoint, KB of the whole state, ms of CPU."""
    evaluator, state = FleetEvaluator(), FleetState()
    table: dict[bytes, bytes] = {}
    written, times = [], []
    for i in range(running + REPEATS):
        ts = START + i
        for event in ("pending", "admitted"):
            evaluator.on_queue(state, QueueEvent(
                ts=ts + (event == "admitted"), name=f"job-{i:05d}", namespace="ml",
                cluster_queue=f"research-{i % 8}", state=event,
                created_at=ts, admitted_at=ts + 1 if event == "admitted" else None, gpus=1,
                kind="pod"), queue_caught_up=True)
        if i + 1 < running:
            continue
        started = time.process_time()
        writes = in_chunks(b"fleet", state, list(table), 500_000)
        times.append((time.process_time() - started) * 1000)
        for key, value in writes:
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value
        written.append(sum(len(value or b"") for _, value in writes) / 1024)
    whole = len(msgspec.msgpack.encode(state)) / 1024
    return statistics.median(written[1:]), whole, statistics.median(times[1:])


def run() -> list[Figure]:
    rng = random.Random(1)
    evaluator, state = _fleet(rng)
    fgd_ms = _median_ms(lambda: evaluator.fragmentation(state))
    evaluate_ms = _evaluation_ms(evaluator, state)
    assert len(state.nodes) == NODES and len(state.queue.waiting) == 200
    # A full, fragmented fleet and a queue of work that fits no node, waiting an hour: each
    # evaluation tries to place every workload, and to reclaim idle holders for it
    # (demand-aware reclaim).
    evaluator, state = _fleet(rng, free=(0, 1, 2), pending=1000, sizes=(4, 8),
                              waited_s=3600.0, stuck=True)
    stuck_ms = _evaluation_ms(evaluator, state)
    assert len(state.nodes) == NODES and len(state.queue.waiting) == 1000
    evaluator, state = _mixed(rng)
    mixed_ms = _evaluation_ms(evaluator, state)
    assert len(state.queue.waiting) == 250
    shapes = frag.popularity(
        [frag.Shape(1, m) for m in (1000, 810, 470, 320, 650, 230, 460, 590, 160, 550, 220,
                                    370, 110, 480, 50, 330, 350, 270, 440, 290, 140)]
        + [frag.Shape(g) for g in (2, 4, 8)]
    )
    partial = [[rng.choice([0, 0, 1000, rng.randint(1, 999)]) for _ in range(GPUS)]
               for _ in range(NODES)]
    partial_ms = _median_ms(lambda: frag.cluster_fragmentation(partial, shapes))
    written_kb, whole_kb, checkpoint_ms = _checkpoint()
    return [
        Figure("FGD over 1,250 node summaries (whole-GPU free counts)", fgd_ms, "ms"),
        Figure("whole fleet evaluation (FGD + stranded for 200 pending + queue SLOs)",
               evaluate_ms, "ms"),
        Figure("whole fleet evaluation, 1,000 pending that fit no node, an idle holder on "
               "every node",
               stuck_ms, "ms"),
        Figure("whole fleet evaluation, 250 pending of whole GPUs, MIG slices and several "
               "pods, half of them finding idle holders to reclaim", mixed_ms, "ms"),
        Figure("FGD over 1,250 distinct partly-allocated nodes, 24 shapes (worst case)",
               partial_ms, "ms"),
        Figure("fleet state checkpoint after one admission, 9,000 running pods: changelog",
               written_kb, "KiB"),
        Figure("the same state whole (every such checkpoint until 2026-11-28)", whole_kb,
               "KiB"),
        Figure("fleet state checkpoint after one admission, 9,000 running pods: CPU",
               checkpoint_ms, "ms"),
    ]
