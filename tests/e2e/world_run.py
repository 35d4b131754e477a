"""A scenario run in the simulated world through the production collectors and the deployed
worker: the fake NVML and kubelet on each node with the NVML collector, the watcher on the
API-server double, ``gpusteward worker`` as a child process with the shipped policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.world import World
from gpusteward.schema import Action, Finding, NodeSample, NodeSummary
from gpusteward.topics import worker_group
from tests.e2e.records import decoded


@dataclass
class WorldRun:
    cluster: SimulatedCluster
    truth: GroundTruth
    samples: list[NodeSample]
    """What the collectors published."""
    findings: list[Finding]
    actions: list[Action]
    summaries: list[NodeSummary]


async def run_in_world(broker: EmbeddedBroker, scenario: str, workdir: Path,
                       publish: Callable[[World], Any] = lambda world: world,
                       wall_s: float | None = None) -> WorldRun:
    """Run ``scenario`` in the world, on topics of its own: as fast as it goes, or paced
    over ``wall_s`` seconds as a live cluster, with the worker ready before it starts; the
    simulator publishes to ``publish(world)`` (a recorder around the world, say).

    Paced where a test needs the watcher's events (queue, allocations) read before the
    samples of the same time: as fast as it goes, the collectors publish the whole day
    while the watcher still reads the API, and the fleet agent's clock is at the day's end
    by the time it learns of the pods (the rules judge a time only once)."""
    settings = broker.settings().model_copy(update={"topic_prefix": f"e2e-{scenario}"})
    await kafka.ensure_topics(settings)
    spec = scenarios.load(scenario)
    spec = spec.model_copy(update={"acceleration": 0.0 if wall_s is None
                                   else spec.duration_s / wall_s})
    cluster = SimulatedCluster(spec)
    worker = WorkerProcess(settings, workdir / "worker.log")
    worker.start()
    publisher = KafkaPublisher(settings)
    await publisher.start()
    try:
        # Its partitions assigned before the world starts, as a deployed worker's are (and
        # as run_scenario's in test_fleet.py): the run tests the worker keeping up with the
        # world, not how its start-up races the world's first hours.
        await asyncio.to_thread(worker.wait_ready)
        async with World(cluster, publisher, workdir) as world:
            truth = await cluster.run(publish(world))
            await world.settle()
        names = [t.name(settings) for t in (topics.SAMPLES, topics.ALLOCATIONS)]
        await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=120)
        # Then the fleet agent (in the worker's group) must have read the node summaries the
        # join wrote meanwhile, and the queue: its findings come last.
        names = [t.name(settings) for t in (topics.NODE_SUMMARIES, topics.QUEUE)]
        await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=120)
        assert worker.alive, f"the worker died; its log is {workdir / 'worker.log'}"
    finally:
        worker.stop()
        await publisher.stop()
    return WorldRun(cluster, truth, await decoded(settings, topics.SAMPLES, NodeSample),
                    await decoded(settings, topics.FINDINGS, Finding),
                    await decoded(settings, topics.ACTIONS, Action),
                    await decoded(settings, topics.NODE_SUMMARIES, NodeSummary))
