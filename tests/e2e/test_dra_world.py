"""GPUs handed out through Dynamic Resource Allocation, judged by the deployed worker.

The ``dra-gpus`` world: NVIDIA's DRA driver publishes the nodes' GPUs and MIG
devices as ResourceSlices, each pod gets its own through a ResourceClaim
(allocated by the simulated scheduler, reserved for the pod), and nothing
advertises ``nvidia.com/gpu``. The kubelet's PodResources names such devices
by claim, pool and the driver's device name, not by uuid; the NVML collector
maps the names to its devices, and the Kubernetes watcher, reading claims and
slices from the API-server double through the real client, names their uuids.
The worker runs as ``deploy/`` declares it (command, environment, mounted
policy).

What must hold, against the simulator's ground truth: the nodes' samples name
each device's holder; the notebooks left idle on whole GPUs and on a MIG device
are found, each on its own device, and no busy pod is; the nodes' summaries do
not offer the held GPUs as free; the pods left waiting, their claims
unallocated, are on the queue with what their claims ask, get a start ETA and
breach their queue's SLO.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import eta, queue
from gpusteward.sandbox import deployment
from gpusteward.sandbox.demo import _expected_idle_pods
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.world import World
from gpusteward.schema import Finding, NodeSample, NodeSummary, QueueEvent

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "overlays" / "local"


@dataclass
class Run:
    truth: GroundTruth
    held_at_end: dict[str, int]
    """Node -> whole GPUs its running pods hold when the world stops."""
    mig_held_at_end: dict[str, int]
    """MIG profile -> devices the running pods hold when the world stops."""
    findings: list[Finding]
    summaries: list[NodeSummary]
    samples: list[NodeSample]
    queue: list[QueueEvent]


async def _run(broker: EmbeddedBroker, workdir: Path, scenario: str = "dra-gpus") -> Run:
    manifests = deployment.Manifests.from_overlay(OVERLAY)
    spec = scenarios.load(scenario).model_copy(update={"acceleration": 0.0})
    cluster = SimulatedCluster(spec)
    local = deployment.Local(broker.bootstrap, workdir, topic_prefix=f"e2e-{scenario}",
                             kubeconfig=workdir / "kubeconfig")
    settings = manifests.launch("collector", local).settings()
    await kafka.ensure_topics(settings)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    processes: list[deployment.Process] = []
    try:
        world = World(cluster, publisher, workdir)
        assert world.kubeconfig == local.kubeconfig
        processes = list(deployment.start(manifests, ["worker"], local))
        await deployment.wait_ready(processes)
        async with world:
            truth = await cluster.run(world)
            await world.settle()
            await deployment.drain(settings, processes)
        held: dict[str, int] = {}
        mig_held: dict[str, int] = {}
        for workload in cluster.running:
            if workload.node is not None and not workload.spec.mig:
                held[workload.node.name] = held.get(workload.node.name, 0) + \
                    workload.spec.gpus
            for profile, count in workload.spec.mig.items():
                mig_held[profile] = mig_held.get(profile, 0) + count
    finally:
        for process in processes:
            process.stop()
        await publisher.stop()

    async def read(topic: topics.TopicSpec) -> list[bytes]:
        return [r.value or b"" for r in await kafka.read_all(settings, topic.name(settings))]

    return Run(truth, held, mig_held,
               [msgspec.json.decode(v, type=Finding) for v in await read(topics.FINDINGS)],
               [msgspec.json.decode(v, type=NodeSummary)
                for v in await read(topics.NODE_SUMMARIES)],
               [msgspec.json.decode(v, type=NodeSample) for v in await read(topics.SAMPLES)],
               [msgspec.json.decode(v, type=QueueEvent) for v in await read(topics.QUEUE)])


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("dra-world")))


def test_the_nodes_name_the_holders_of_dra_gpus_and_mig_devices(run: Run) -> None:
    """The kubelet names DRA devices by claim and the driver's device name, not by uuid:
    the NVML collector maps the names to its GPUs (by minor number) and MIG devices (by
    GPU-instance profile and placement), so its samples name every holder, on its own
    device, without the watcher."""
    held = {(p.namespace, p.pod, device) for p in run.truth.pods for device in p.devices}
    named = {(d.pod.namespace, d.pod.name, d.uuid)
             for s in run.samples if s.source == "nvml" for d in s.devices if d.pod}
    assert any(device.startswith("MIG-") for _, _, device in held)
    assert named == held


def test_idle_holders_of_dra_gpus_and_mig_devices_are_found_on_their_devices(
        run: Run) -> None:
    expected = _expected_idle_pods(run.truth)
    idle = {(p.namespace, p.pod, p.devices[0]) for p in run.truth.pods
            if f"{p.namespace}/{p.pod}" in expected}
    assert {pod.split("/", 1)[1].rsplit("-", 1)[0] for pod in expected} == {
        "nb-idle", "nb-mig-idle"}
    assert len(idle) == 3 and any(device.startswith("MIG-") for _, _, device in idle)
    found = {(f.subject.pod.namespace, f.subject.pod.name, f.subject.device)
             for f in run.findings
             if f.kind == "idle_holder" and f.state == "firing" and f.subject.pod}
    assert found == idle


def test_gpus_held_through_claims_are_not_offered_as_free(run: Run) -> None:
    """No device plugin advertises the nodes' GPUs: the capacity is what the slices
    publish (whole GPUs, MIG devices by profile), less what the claims hold."""
    last = {s.node: s for s in run.summaries}
    whole = {node: summary for node, summary in last.items() if node.startswith("h100-dra")}
    assert {node: s.gpus_total for node, s in whole.items()} == {"h100-dra-1": 2,
                                                                  "h100-dra-2": 2}
    assert sum(run.held_at_end.values()) == 3
    assert {node: s.gpus_free for node, s in whole.items()} == {
        node: 2 - run.held_at_end.get(node, 0) for node in whole}
    mig = last["a100-mig-dra-1"]
    assert run.mig_held_at_end == {"3g.40gb": 2}
    assert (mig.gpus_free, mig.mig_free) == (0, {})  # its one GPU is partitioned


def test_pods_waiting_for_dra_gpus_are_queued_and_breach_their_queue_slo(run: Run) -> None:
    """Two pods wait, their claims unallocated: what they ask is in their claims (two
    GPUs; one 3g.40gb device by its profile selector), not in an extended resource. The
    watcher puts them on the queue as it would a device-plugin pod, so the worker's fleet
    agent gives each a start ETA and finds its wait past the research queue's 2 h SLO."""
    waiting = dict(run.truth.pending_since)
    assert {key.split("/", 1)[1].rsplit("-", 1)[0] for key in waiting} == {
        "train-wide", "serve-mig-more"}
    asked = {f"{e.namespace}/{e.name}": (e.gpus, dict(e.mig)) for e in run.queue
             if e.kind == "pod" and e.state == "pending"}
    assert {key: asked.get(key) for key in waiting} == {
        key: (2, {}) if "train-wide" in key else (0, {"3g.40gb": 1}) for key in waiting}
    slo = queue.QueueSloSettings().slo_for("research")

    def subjects(kind: str) -> set[str]:
        return {f"{f.subject.pod.namespace}/{f.subject.pod.name}" for f in run.findings
                if f.kind == kind and f.state == "firing" and f.subject.pod}

    assert subjects(queue.WAIT_KIND) == set(waiting)
    assert all(run.truth.end_ts - since > slo for since in waiting.values())
    assert set(waiting) <= subjects(eta.KIND)


@pytest.fixture(scope="module")
def shared_run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("dra-shared"),
                            "dra-shared-claim"))


def test_a_shared_claim_is_idle_for_all_its_pods_or_for_none(shared_run: Run) -> None:
    """Two notebooks share one L4 through one claim, each one's use read from its
    processes. The claim is one allocation, given back only once both are gone: the idle
    notebook is no idle holder while its neighbour keeps the GPU busy (reclaiming it would
    free nothing); once both are idle, both are found, each with its owner (the watcher
    reports the claim's second pod too), so each is reclaimed through its own."""
    truth = shared_run.truth
    pods = {p.pod.rsplit("-", 1)[0]: p for p in truth.pods}
    assert set(pods) == {"nb-idle", "nb-busy"}
    busy_idle_from = min(p.start for p in truth.idle_periods if p.pod == pods["nb-busy"].pod)
    found = {f.subject.pod.name.rsplit("-", 1)[0]: f for f in shared_run.findings
             if f.kind == "idle_holder" and f.state == "firing" and f.subject.pod}
    assert {pod: f.starts_at >= busy_idle_from for pod, f in found.items()} == {
        "nb-idle": True, "nb-busy": True}
    assert all(f.labels.get("owner", "").startswith("Notebook/") for f in found.values())
    (device,) = {d for p in truth.pods for d in p.devices}
    shared = [d for s in shared_run.samples if s.source == "nvml" for d in s.devices
              if d.uuid == device and len(d.holders) == 2]
    assert shared and {d.attribution for d in shared} == {"shared"}
    # each pod's own use is still read (and goes into its rollup rows)
    assert any(h.activity_pct and h.activity_pct >= 40 for d in shared for h in d.holders)
    (summary,) = {s.node: s for s in shared_run.summaries}.values()
    assert (summary.gpus_total, summary.gpus_free) == (1, 0)  # the GPU counted once

