"""``gpusteward demo``: the system as deployed, on one laptop, against a simulated fleet.

It starts the embedded broker and the processes ``deploy/overlays/local``
declares — the stream worker, the alert sink and the remediation executor
acting on the Kubernetes API — with their commands, environment and mounted
ConfigMaps (:mod:`gpusteward.sandbox.deployment`). The simulator drives the
world they look at (:mod:`gpusteward.sandbox.world`): fake GPUs read by the
production NVML collector through NVML calls and a kubelet PodResources
socket, and an API-server double listed and watched by the production
Kubernetes watcher. What the executor writes into the API (a cordon, a
stopped notebook) changes the simulated cluster: a cordoned node takes no
new pods, a reclaimed notebook's GPU goes to whoever waits.

A live view shows the fleet, the findings and the executor's decisions; the
run ends by itself with a summary checked against the simulator's ground
truth: the idle holders found, the faulty node cordoned, the notebooks
reclaimed and the GPU-hours they gave back, and the research queue's wait
with gpusteward acting against the same seed run without it. Ctrl-C stops
everything; every child process is stopped on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.rules import REGISTRY, ecc, hardware
from gpusteward.rules.fragmentation import NEVER_PLACEABLE
from gpusteward.sandbox import deployment
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.world import World
from gpusteward.schema import (
    ActionResult,
    AllocationEvent,
    Finding,
    HwEvent,
    NodeSample,
    QueueEvent,
)
from gpusteward.settings import Settings

REPO = Path(__file__).resolve().parents[1]
LOCAL_OVERLAY = Path("deploy/overlays/local")
"""The overlay the demo starts, relative to the repository (the demo runs from a clone)."""
DEPLOYED = ["worker", "alerts", "remediation"]
"""The overlay's components that run as processes; the collectors and the watcher run in
the world, on the simulation's clock."""


def overlay_path() -> Path:
    for base in (Path.cwd(), REPO):
        if (base / LOCAL_OVERLAY / "kustomization.yaml").exists():
            return base / LOCAL_OVERLAY
    raise deployment.DeploymentError(
        f"{LOCAL_OVERLAY} not found: run the demo from the repository (make demo)")


@dataclass
class DemoState:
    """What the live view and the summary show."""

    findings: list[Finding] = field(default_factory=list)
    results: list[ActionResult] = field(default_factory=list)


class Observer:
    """Follows the findings and the executor's audit topic for the live view."""

    def __init__(self, settings: Settings, state: DemoState) -> None:
        self.settings = settings
        self.state = state
        self._finding = msgspec.json.Decoder(Finding).decode
        self._result = msgspec.json.Decoder(ActionResult).decode

    async def run(self, stop: asyncio.Event) -> None:
        findings = topics.FINDINGS.name(self.settings)
        consumer = kafka.consumer(self.settings, findings,
                                  topics.ACTION_RESULTS.name(self.settings), group_id=None)
        await consumer.start()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for messages in batch.values():
                    for message in messages:
                        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                            if message.topic == findings:
                                self.state.findings.append(self._finding(message.value or b""))
                            else:
                                self.state.results.append(self._result(message.value or b""))
        finally:
            await consumer.stop()


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M")


def render(cluster: SimulatedCluster, state: DemoState) -> Group:
    elapsed = (cluster.now - cluster.start) / 3600
    fleet = Table(title=f"fleet at {_clock(cluster.now)} UTC (+{elapsed:.1f} h simulated)")
    for column in ("node", "GPU", "holder", "util %", "state"):
        fleet.add_column(column)
    allocated = busy = 0
    for node in cluster.nodes.values():
        for gpu in node.gpus:
            holder = gpu.holder
            allocated += holder is not None
            busy += holder is not None and gpu.last_util >= 5
            flags = []
            if node.cordoned:
                flags.append("[red]cordoned[/]")
            if gpu.dbe:
                flags.append("[red]ECC DBE[/]")
            fleet.add_row(node.name, str(gpu.index),
                          f"{holder.namespace}/{holder.name}" if holder else "-",
                          f"{gpu.last_util:.0f}", " ".join(flags))
    total = sum(len(n.gpus) for n in cluster.nodes.values())
    header = (f"GPUs: {total} | allocated {allocated} | busy {busy} | "
              f"pending pods {len(cluster.queue)} | reclaimed {len(cluster.truth.reclaims)}")
    findings = Table(title="findings (latest)")
    for column in ("time", "state", "kind", "summary"):
        findings.add_column(column)
    for finding in state.findings[-8:]:
        findings.add_row(_clock(finding.ts), finding.state, finding.kind, finding.summary)
    actions = Table(title="executor decisions (latest)")
    for column in ("verb", "target", "outcome", "why"):
        actions.add_column(column)
    for result in state.results[-6:]:
        pod = result.target.pod
        target = f"{pod.namespace}/{pod.name}" if pod else (result.target.node or "")
        # Why it was not carried out: what the executor says in brackets (a dry run's or a
        # refusal's reason), else its detail; an executed action needs no reason.
        _, bracket, reason = result.detail.partition(" [")
        why = "" if result.outcome == "executed" else (
            reason.split(";")[0].rstrip("]") if bracket else result.detail)
        actions.add_row(result.verb, target, result.outcome, why)
    return Group(header, fleet, findings, actions)


@dataclass
class QueueWait:
    """Waits of a queue's workloads (seconds): those started, and those still pending."""

    waits: list[float]

    @classmethod
    def of(cls, truth: GroundTruth) -> QueueWait:
        waits = [p.started_at - p.queued_at for p in truth.pods if p.queued_at is not None]
        waits += [truth.end_ts - since for since in truth.pending_since.values()]
        return cls(sorted(waits))

    @property
    def mean_min(self) -> float:
        return sum(self.waits) / len(self.waits) / 60 if self.waits else 0.0

    @property
    def max_min(self) -> float:
        return self.waits[-1] / 60 if self.waits else 0.0

    def __str__(self) -> str:
        return f"mean {self.mean_min:.0f} min, longest {self.max_min:.0f} min"


class _Nowhere:
    """A publisher for the run without gpusteward: the world nobody watches."""

    async def sample(self, sample: NodeSample) -> None: ...
    async def hw_event(self, event: HwEvent) -> None: ...
    async def allocation(self, event: AllocationEvent) -> None: ...
    async def queue(self, event: QueueEvent) -> None: ...
    async def flush(self) -> None: ...


async def unattended(cluster: SimulatedCluster) -> GroundTruth:
    """The same scenario and seed with nobody acting: the wait gpusteward is measured against."""
    spec = cluster.scenario.model_copy(update={"acceleration": 0.0})
    return await SimulatedCluster(spec).run(_Nowhere())


def summarize(console: Console, truth: GroundTruth, state: DemoState,
              baseline: GroundTruth | None = None) -> bool:
    """Print what was found and done, checked against the ground truth; True if they agree."""
    idle_pods = sorted({f"{f.subject.pod.namespace}/{f.subject.pod.name}"
                        for f in state.findings
                        if f.kind == "idle_holder" and f.state == "firing" and f.subject.pod})
    cordoned = sorted({r.target.node or "" for r in state.results
                       if r.verb == "cordon" and r.outcome == "executed"})
    # Nodes told of as faulty: a hardware rule's finding on one of their GPUs, on exactly the
    # nodes given a fault. Which of them are also cordoned is the policy's choice (the local
    # overlay enables ECC DBE cordons only; the other hardware actions are dry runs).
    told = {f.subject.node for f in state.findings
            if f.state == "firing" and f.kind in _HARDWARE_KINDS}
    acted = {r.target.node for r in state.results if r.outcome == "executed"
             and r.verb in ("cordon", "drain", "taint")}
    faulty = sorted({f.node for f in truth.faults})
    reclaimed = sorted(f"{r.namespace}/{r.pod}" for r in truth.reclaims)
    given_back = sum(r.gpu_hours_given_back for r in truth.reclaims)
    console.rule("summary")
    console.print(f"scenario {truth.scenario} (seed {truth.seed}), "
                  f"{(truth.end_ts - truth.start_ts) / 3600:.1f} h simulated")
    console.print(f"idle GPU holders found ({len(idle_pods)}): {', '.join(idle_pods) or '-'}")
    console.print(f"owners told: {', '.join(sorted(set(truth.notified))) or '-'}")
    console.print(f"notebooks reclaimed ({len(reclaimed)}): {', '.join(reclaimed) or '-'}; "
                  f"GPU-hours given back: {given_back:.1f}")
    if faulty:
        console.print(f"nodes with injected GPU faults ({len(faulty)}): {', '.join(faulty)}; "
                      f"told: {len(told & set(faulty))}")
    console.print(f"nodes cordoned ({len(cordoned)}): {', '.join(cordoned) or '-'}")
    reclaimed_spot = sorted({r.node for r in truth.interruptions})
    spot_told = {f.subject.node for f in state.findings
                 if f.kind == "spot_interruption" and f.state == "firing"}
    if reclaimed_spot:
        console.print(f"spot nodes taken back ({len(reclaimed_spot)}): "
                      f"{', '.join(reclaimed_spot)}; told: {len(spot_told & set(reclaimed_spot))}")
    queue = QueueWait.of(truth)
    if baseline is not None:
        console.print(f"queue wait, with gpusteward acting: {queue}; the same day unattended: "
                      f"{QueueWait.of(baseline)}")
    console.print(f"pods still pending: {', '.join(truth.pending) or '-'}")
    # A workload no node can hold is told as such, and is promised no start.
    nowhere = {_pod_key(f) for f in state.findings
               if f.kind == "stranded_capacity" and f.state == "firing"
               and f.evidence is not None and not NEVER_PLACEABLE.isdisjoint(f.evidence.values)}
    promised = {_pod_key(f) for f in state.findings
                if f.kind == "queue_start_eta" and f.state == "firing"}
    unplaceable = set(truth.unplaceable)
    if unplaceable:
        console.print(f"fits no node ({len(unplaceable)}): {', '.join(sorted(unplaceable))}; "
                      f"told so: {', '.join(sorted(unplaceable & nowhere)) or '-'}; "
                      f"given a start estimate: {', '.join(sorted(unplaceable & promised)) or '-'}")
    console.print(f"findings: {len(state.findings)}, executor decisions: {len(state.results)}")
    expected_idle = sorted(_expected_idle_pods(truth))
    kinds = {f"{p.namespace}/{p.pod}": p.kind for p in truth.pods}
    agree = (idle_pods == expected_idle and told == set(faulty) and acted <= set(faulty)
             and set(reclaimed_spot) <= spot_told
             and set(reclaimed) <= set(idle_pods)
             and all(kinds[pod] == "notebook" for pod in reclaimed)
             and unplaceable <= nowhere and not unplaceable & promised)
    if agree:
        console.print("[green]matches the simulator's ground truth: every injected idle holder "
                      "and faulty GPU found, no healthy node acted on, every spot node taken "
                      "back told, only idle notebooks reclaimed, every workload that fits no "
                      "node told so and promised no start, no false alarm[/]")
    else:
        console.print(f"[red]differs from ground truth: idle {expected_idle}, faulty {faulty}, "
                      f"fitting no node {sorted(unplaceable)}[/]")
    return agree


_HARDWARE_KINDS = frozenset(kind for name in REGISTRY
                            if REGISTRY[name].device in (hardware.RUNNER, ecc.RUNNER)
                            for kind in REGISTRY[name].emits)
"""The finding kinds of the hardware rules (ECC, XID, counters, losses, heat)."""


def _pod_key(finding: Finding) -> str | None:
    pod = finding.subject.pod
    return None if pod is None else f"{pod.namespace}/{pod.name}"


def _expected_idle_pods(truth: GroundTruth, window_s: float = 1800, grace_s: float = 600
                        ) -> set[str]:
    """Pods whose injected idleness, counted after the grace, lasted a whole window."""
    found = set()
    for period in truth.idle_periods:
        counted_from = max(period.start, period.pod_started_at + grace_s)
        if period.end - counted_from >= window_s + truth.sample_interval_s:
            found.add(f"{period.namespace}/{period.pod}")
    return found


def local_for(settings: Settings, log_dir: Path, extra_env: Mapping[str, str] | None = None
              ) -> deployment.Local:
    """What differs here for the overlay's processes: the broker, the prefix, the API double's
    kubeconfig and the folder standing for their volumes (a later process started with
    the same, e.g. the report job, reads the stores the run's sinks wrote)."""
    return deployment.Local(settings.kafka.bootstrap_servers, log_dir,
                            topic_prefix=settings.topic_prefix,
                            kubeconfig=log_dir / "kubeconfig", extra_env=dict(extra_env or {}))


async def _run(settings: Settings, cluster: SimulatedCluster, console: Console,
               live_view: bool, log_dir: Path, components: Sequence[str] = tuple(DEPLOYED),
               extra_env: Mapping[str, str] | None = None) -> tuple[GroundTruth, DemoState]:
    """The deployed processes against the world until the scenario ends and all is drained.

    ``settings`` says where the broker is and which topic prefix to use; everything
    else the processes read comes from the overlay. ``components`` are the overlay's
    components started (a test adds the sinks), ``extra_env`` what they get besides.
    """
    manifests = deployment.Manifests.from_overlay(overlay_path())
    local = local_for(settings, log_dir, extra_env)
    settings = manifests.launch("collector", local).settings()
    await kafka.ensure_topics(settings)
    state = DemoState()
    stop = asyncio.Event()
    observer = asyncio.create_task(Observer(settings, state).run(stop))
    publisher = KafkaPublisher(settings)
    await publisher.start()
    processes: list[deployment.Process] = []
    live = Live(render(cluster, state), console=console, refresh_per_second=4,
                transient=False) if live_view else contextlib.nullcontext()

    def refresh(c: SimulatedCluster) -> None:
        if isinstance(live, Live):
            live.update(render(c, state))

    cluster.on_tick = refresh  # before the world, which chains its own tick to it
    try:
        world = World(cluster, publisher, log_dir)
        # started before the world's gRPC servers and clients run: nothing to fork but us
        processes = list(deployment.start(manifests, list(components), local))
        await deployment.wait_ready(processes)
        async with world:
            with live:
                truth = await cluster.run(world)
                await world.settle()
                await deployment.drain(settings, processes)
                refresh(cluster)
        state.findings = [msgspec.json.decode(r.value or b"", type=Finding) for r in
                          await kafka.read_all(settings, topics.FINDINGS.name(settings))]
        state.results = [msgspec.json.decode(r.value or b"", type=ActionResult) for r in
                         await kafka.read_all(settings, topics.ACTION_RESULTS.name(settings))]
        return truth, state
    finally:
        stop.set()
        await asyncio.gather(observer, return_exceptions=True)
        for process in processes:
            process.stop()
        await publisher.stop()


def run_demo(scenario_name: str = "eight-a100", duration_s: float = 60.0,
             live_view: bool = True, seed: int | None = None) -> int:
    """Run the demo; the exit status is 0 when the summary matches the ground truth."""
    console = Console()
    scenario = scenarios.load(scenario_name)
    scenario = scenario.model_copy(update={
        "acceleration": scenario.duration_s / duration_s if duration_s > 0 else 0.0,
        **({"seed": seed} if seed is not None else {}),
    })
    cluster = SimulatedCluster(scenario)
    log_dir = Path(tempfile.mkdtemp(prefix="gpusteward-demo-"))
    console.print(f"starting the embedded broker, the processes of {LOCAL_OVERLAY} "
                  f"({', '.join(DEPLOYED)}) and the simulated world: per node the NVML "
                  f"collector on fake GPUs and a kubelet socket, the Kubernetes watcher on "
                  f"an API-server double (logs in {log_dir})")
    # SIGTERM (a supervisor, `kill`) takes the same orderly way out as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with EmbeddedBroker(log_path=log_dir / "broker.log") as broker:
            settings = broker.settings().model_copy(update={"topic_prefix": "demo"})
            truth, state = asyncio.run(_run(settings, cluster, console, live_view, log_dir))
        baseline = asyncio.run(unattended(cluster))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: everything stopped[/]")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if summarize(console, truth, state, baseline) else 1
