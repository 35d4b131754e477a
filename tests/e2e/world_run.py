"""A scenario run in the simulated world through the production collectors and the deployed
worker: the fake NVML and kubelet on each node with the NVML collector, the watcher on the
API-server double, ``gpusteward worker`` as a child process with the shipped policy."""

from __future__ import annotations

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
from gpusteward.streams.app import worker_group
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
                       publish: Callable[[World], Any] = lambda world: world) -> WorldRun:
    """Run ``scenario`` (as fast as it goes) in the world, on topics of its own; the
    simulator publishes to ``publish(world)`` (a recorder around the world, say)."""
    settings = broker.settings().model_copy(update={"topic_prefix": f"e2e-{scenario}"})
    await kafka.ensure_topics(settings)
    spec = scenarios.load(scenario).model_copy(update={"acceleration": 0.0})
    cluster = SimulatedCluster(spec)
    worker = WorkerProcess(settings, workdir / "worker.log")
    worker.start()
    publisher = KafkaPublisher(settings)
    await publisher.start()
    try:
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
