"""A node action refused as stale is asked for again while its fault holds, and carried out.

The simulator's world (a GPU with a double-bit ECC error that lasts, two idle
notebooks) drives the real stream worker, a child process; the remediation
executor runs in-process against the API-server double, with the wall clock
as in production: the scenario's event time ends now.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.schema import Action, ActionResult, NodeSample
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.remediation.cluster import cordoned, node

pytestmark = pytest.mark.e2e

HOURS = 2
INTERVAL_S = 60.0
REASK_S = 600.0
"""The worker's default ``reask_s``."""
FAULTY = "h100-1"


def scenario(nodes: int = 3, faulty: str = FAULTY, silent_at_s: float | None = None,
             acceleration: float = 0) -> Scenario:
    """Two hours of three one-GPU nodes whose event time ends now: a DBE on h100-1 at 10 min
    that lasts (the node keeps taking work until it is cordoned), and two notebooks left
    idle, whose owner notices must not be asked again. With ``silent_at_s``, the faulty
    node's collector sends nothing from then on."""
    faults: list[dict[str, object]] = [{"kind": "ecc_dbe", "node": faulty, "gpu": 0,
                                        "at_s": 600}]
    if silent_at_s is not None:
        faults.append({"kind": "collector_down", "node": faulty, "at_s": silent_at_s})
    return Scenario.model_validate({
        "name": "dbe-while-the-executor-is-down", "seed": 5,
        "start_ts": time.time() - HOURS * 3600 - INTERVAL_S,
        "duration_s": HOURS * 3600, "sample_interval_s": INTERVAL_S,
        "acceleration": acceleration,
        "nodes": [{"prefix": "h100", "count": nodes, "gpu_model": "NVIDIA H100 80GB HBM3",
                   "gpus": 1, "mem_gib": 80}],
        "users": ["alice", "bob"],
        "workloads": [{"group": "nb", "count": 2, "kind": "notebook", "mem_gib": [10, 20],
                       "phases": [{"for_s": [300, 300], "util": [30, 60]},
                                  {"util": [0, 1]}]}],
        "faults": faults,
    })


def _fresh(broker: EmbeddedBroker, name: str) -> Settings:
    return broker.settings().model_copy(update={"topic_prefix": name})


async def _read(settings: Settings, spec: topics.TopicSpec, kind: type) -> list:
    decode = msgspec.json.Decoder(kind).decode  # type: ignore[var-annotated]
    return [decode(r.value) for r in await kafka.read_all(settings, spec.name(settings))]


async def _simulate(settings: Settings, log_dir: Path, cluster: SimulatedCluster,
                    between: asyncio.Event | None = None,
                    resume: asyncio.Event | None = None) -> None:
    """Run the world through the worker until the worker has read all of it. With
    ``between``, stop the world half-way, wait until the worker has read that far, set
    ``between`` and wait for ``resume`` before the second half."""
    publisher = KafkaPublisher(settings)
    await publisher.start()
    worker = WorkerProcess(settings, log_dir / "worker.log", loglevel="info")
    worker.start()
    names = [t.name(settings) for t in (topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS)]
    try:
        half = asyncio.Event()
        ticks = int(cluster.scenario.duration_s // INTERVAL_S)
        cluster.on_tick = lambda world: half.set() if (
            between is not None and world.now >= world.start + ticks // 2 * INTERVAL_S) else None
        await cluster.run(publisher, stop=half)
        if between is not None and resume is not None:
            await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=180)
            between.set()
            await resume.wait()
            for tick in range(ticks // 2 + 1, ticks + 1):  # the second half, as run() steps
                cluster.now = cluster.start + tick * INTERVAL_S
                await cluster.step(publisher)
            await publisher.flush()
        await kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=180)
        assert worker.alive
    finally:
        worker.stop()
        await publisher.stop()


async def _execute(executor: Executor, settings: Settings, stop: asyncio.Event) -> None:
    """Run ``executor`` until ``stop``, then until it has decided every action published."""
    running = asyncio.create_task(executor.run(done := asyncio.Event()))
    await stop.wait()
    await kafka.wait_consumed(settings, executor.group_id, [topics.ACTIONS.name(settings)])
    done.set()
    await running


def _kube(kube_api: KubeApiServer, kubeconfig: Path, nodes: int = 3) -> KubernetesBackend:
    kube_api.load(node(f"h100-{i}", gpus=1) for i in range(1, nodes + 1))
    return KubernetesBackend(KubeSettings(kubeconfig=str(kubeconfig), request_timeout_s=5))


def _cordons(records: list, faulty: str = FAULTY) -> list:
    return [r for r in records if r.verb == "cordon" and r.target.node == faulty]


def test_a_cordon_refused_as_stale_is_carried_out_when_the_worker_asks_again(
        broker: EmbeddedBroker, tmp_path: Path, kube_api: KubeApiServer,
        kubeconfig: Path) -> None:
    """The executor was down for the two hours: the cordon the worker asked for when the DBE
    hit is refused as stale (audited, counted for the alert), the worker's re-asks since
    are decided afresh, the first within max_action_age_s cordons the node, and the later
    ones add nothing to the audit trail."""
    settings = _fresh(broker, "e2e-reask-stale")
    asyncio.run(kafka.ensure_topics(settings))
    asyncio.run(_simulate(settings, tmp_path, SimulatedCluster(scenario())))
    backend = _kube(kube_api, kubeconfig)
    executor = Executor(settings, backend, execute=True, group_id="back-after-2h",
                        remediation=RemediationSettings(enabled_rules={"ecc_dbe"}))
    (go := asyncio.Event()).set()
    asyncio.run(_execute(executor, settings, go))

    actions = asyncio.run(_read(settings, topics.ACTIONS, Action))
    asked = _cordons(actions)
    # Asked when the DBE hit, then every 10 min of the node's event time while it holds,
    # under one key with a fresh event time each.
    assert [a.reask for a in asked] == list(range(len(asked)))
    assert len(asked) == int((HOURS * 3600 - 600) // REASK_S) + 1
    assert {a.idempotency_key for a in asked} == {asked[0].idempotency_key}
    assert {round(b.ts - a.ts) for a, b in itertools.pairwise(asked)} == {REASK_S}
    # Owner notices and idle reclaims are never asked again; no other node is acted on.
    ladder = [a for a in actions if a.verb in ("notify_owner", "requeue")]
    assert ladder, "the idle notebooks were noticed"
    assert all(a.reask == 0 for a in ladder)
    assert len({a.idempotency_key for a in ladder}) == len(ladder)
    assert {a.target.node for a in actions if a.verb in ("cordon", "taint", "drain")} == {FAULTY}

    audit = _cordons(asyncio.run(_read(settings, topics.ACTION_RESULTS, ActionResult)))
    assert [r.outcome for r in audit] == ["refused", "executed"]
    assert audit[0].detail.startswith("stale: asked for at ")
    assert "the worker asks again" in audit[0].detail
    assert cordoned(kube_api) == [FAULTY]
    metric = executor.metrics.registry.get_sample_value
    assert metric("gpusteward_actions_stale_total", {"verb": "cordon", "rule": "ecc_dbe"}) == 1
    stale_again = sum(1 for a in asked[1:] if a.ts < time.time() - 3600)
    assert metric("gpusteward_actions_reasked_total", {"verb": "cordon",
                                                       "outcome": "refused"}) == stale_again
    assert metric("gpusteward_actions_reasked_total", {"verb": "cordon", "outcome": "skipped"}) \
        == len(asked) - 2 - stale_again


def test_in_dry_run_the_re_asks_add_no_audit_record_across_an_executor_restart(
        broker: EmbeddedBroker, tmp_path: Path, kube_api: KubeApiServer,
        kubeconfig: Path) -> None:
    """The shipped default: the executor in dry-run, up all along. The cordon is audited as
    a dry run once, not once per re-ask, and an executor restarted half-way (its state
    rebuilt from the audit topic) stays as quiet."""
    settings = _fresh(broker, "e2e-reask-dry")
    asyncio.run(kafka.ensure_topics(settings))
    backend = _kube(kube_api, kubeconfig)

    def dry() -> Executor:
        return Executor(settings, backend, group_id="dry")

    async def main() -> None:
        half, resume, first_stop, second_stop = (asyncio.Event() for _ in range(4))
        world = asyncio.create_task(_simulate(settings, tmp_path, SimulatedCluster(scenario()),
                                              between=half, resume=resume))
        first = asyncio.create_task(_execute(dry(), settings, first_stop))
        await half.wait()
        first_stop.set()
        await first
        second = asyncio.create_task(_execute(dry(), settings, second_stop))
        resume.set()
        await world
        second_stop.set()
        await second

    asyncio.run(main())
    asked = _cordons(asyncio.run(_read(settings, topics.ACTIONS, Action)))
    assert len(asked) > 4 and [a.reask for a in asked] == list(range(len(asked)))
    half_way = asked[0].ts - 600 + HOURS * 3600 / 2
    assert [a for a in asked if a.ts > half_way], "re-asks came after the restart"
    audit = _cordons(asyncio.run(_read(settings, topics.ACTION_RESULTS, ActionResult)))
    assert [r.outcome for r in audit] == ["dry_run"]
    assert cordoned(kube_api) == []


def test_a_node_whose_collector_stopped_is_still_asked_to_be_cordoned(
        broker: EmbeddedBroker, tmp_path: Path, kube_api: KubeApiServer,
        kubeconfig: Path) -> None:
    """As above, but the faulty node's collector stops a minute after the DBE (a hung driver
    takes NVML with it) while its kubelet goes on taking pods. Its cordon is asked for again
    every 10 min all the same, by the samples of the other nodes of its partition, as its
    own would, and the executor back after two hours cordons it. Before, a node that sent
    no sample was asked nothing more: the stale refusal was the last word and the node kept
    taking work."""
    nodes, faulty, silent_at_s = 6, "h100-2", 660.0
    names = [f"h100-{i}" for i in range(1, nodes + 1)]
    partition = {name: kafka.node_partitioner(name.encode(), list(range(8)), list(range(8)))
                 for name in names}
    assert [n for n in names if n != faulty and partition[n] == partition[faulty]], \
        "another node shares the faulty node's partition"
    settings = _fresh(broker, "e2e-reask-silent")
    assert settings.kafka.node_partitions == 8
    asyncio.run(kafka.ensure_topics(settings))
    world = SimulatedCluster(scenario(nodes, faulty, silent_at_s))
    asyncio.run(_simulate(settings, tmp_path, world))
    executor = Executor(settings, _kube(kube_api, kubeconfig, nodes), execute=True,
                        group_id="back-after-2h",
                        remediation=RemediationSettings(enabled_rules={"ecc_dbe"}))
    (go := asyncio.Event()).set()
    asyncio.run(_execute(executor, settings, go))

    samples = asyncio.run(_read(settings, topics.SAMPLES, NodeSample))
    assert max(s.ts for s in samples if s.node == faulty) < world.start + silent_at_s
    asked = _cordons(asyncio.run(_read(settings, topics.ACTIONS, Action)), faulty)
    assert [a.reask for a in asked] == list(range(len(asked)))
    assert all(a.ts > world.start + silent_at_s for a in asked[1:])
    assert len(asked) == int((HOURS * 3600 - 600) // REASK_S) + 1
    assert {round(b.ts - a.ts) for a, b in itertools.pairwise(asked)} == {REASK_S}
    audit = _cordons(asyncio.run(_read(settings, topics.ACTION_RESULTS, ActionResult)), faulty)
    assert [r.outcome for r in audit] == ["refused", "executed"]
    assert cordoned(kube_api) == [faulty]


def test_a_silent_node_alone_in_its_partition_is_asked_by_the_workers_other_partitions(
        broker: EmbeddedBroker, tmp_path: Path, kube_api: KubeApiServer,
        kubeconfig: Path) -> None:
    """A small cluster: the faulty h100-1 is the only node of its partition, so no
    neighbour's sample asks for its cordon once its collector stops. When the worker has
    had no record of that partition for quiet_partition_s of its own clock (3 s here, the
    world paced at 4 min a second; 2 min by default), the newest sample of its other
    partitions asks, and the executor back after two hours cordons the node."""
    faulty, silent_at_s = "h100-1", 660.0
    partition = {f"h100-{i}": kafka.node_partitioner(f"h100-{i}".encode(), list(range(8)),
                                                      list(range(8))) for i in (1, 2, 3)}
    assert list(partition.values()).count(partition[faulty]) == 1, partition
    settings = _fresh(broker, "e2e-reask-alone").model_copy(update={"quiet_partition_s": 3.0})
    asyncio.run(kafka.ensure_topics(settings))
    world = SimulatedCluster(scenario(3, faulty, silent_at_s, acceleration=240))
    asyncio.run(_simulate(settings, tmp_path, world))
    executor = Executor(settings, _kube(kube_api, kubeconfig), execute=True,
                        group_id="back-after-2h",
                        remediation=RemediationSettings(enabled_rules={"ecc_dbe"}))
    (go := asyncio.Event()).set()
    asyncio.run(_execute(executor, settings, go))

    asked = _cordons(asyncio.run(_read(settings, topics.ACTIONS, Action)), faulty)
    assert [a.reask for a in asked] == list(range(len(asked)))
    assert len(asked) >= 3, [round(a.ts - world.start) for a in asked]
    assert all(a.ts > world.start + silent_at_s for a in asked[1:])
    assert min(round(b.ts - a.ts) for a, b in itertools.pairwise(asked)) >= REASK_S
    audit = _cordons(asyncio.run(_read(settings, topics.ACTION_RESULTS, ActionResult)), faulty)
    assert [r.outcome for r in audit] == ["refused", "executed"]
    assert cordoned(kube_api) == [faulty]
