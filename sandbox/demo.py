"""``gpusteward demo``: the whole loop on one laptop.

It starts the embedded broker, the stream worker (a separate process, as in
production), the simulator on a scenario, the console alert sink and the
remediation executor against the simulated cluster; it shows a live view
and ends by itself with a summary checked against the simulator's ground
truth. Ctrl-C stops everything; every child process is stopped on the way
out.

With ``feed="kubernetes"`` the simulator's allocation and queue events are
not published directly: the fleet is mirrored into the Kubernetes API-server
double (:mod:`gpusteward.sandbox.kube_mirror`) and the real watcher
publishes them, read from the API as in production. Samples and hardware
events still come from the simulator, as the node collectors would publish
them. The summary must match the same ground truth: the watcher's feed has
to be as good as the simulator's own. A cordon the executor applies to the
simulated cluster reaches the double as ``spec.unschedulable``, so the
watcher reports it as it would a real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from gpusteward import kafka, topics
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.broker import EmbeddedBroker
from gpusteward.collectors.transport.publisher import KafkaPublisher, Publisher
from gpusteward.remediation.executor import Executor
from gpusteward.sandbox.backend import SimulatorBackend
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import Action, ActionResult, Finding
from gpusteward.settings import Settings
from gpusteward.streams.app import worker_group

if TYPE_CHECKING:
    from gpusteward.collectors.kubernetes import KubeWatcher

Feed = Literal["simulator", "kubernetes"]
"""Where the allocation and queue events come from: the simulator itself, or the
Kubernetes watcher on the API-server double the simulator's fleet is mirrored into."""


@dataclass
class DemoState:
    """What the live view and the summary show."""

    findings: list[Finding] = field(default_factory=list)
    results: list[tuple[Action, ActionResult]] = field(default_factory=list)

    def on_finding(self, finding: Finding) -> None:
        self.findings.append(finding)

    def on_result(self, action: Action, result: ActionResult) -> None:
        self.results.append((action, result))


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
              f"pending pods {len(cluster.queue)}")
    findings = Table(title="findings (latest)")
    for column in ("time", "state", "kind", "summary"):
        findings.add_column(column)
    for finding in state.findings[-8:]:
        findings.add_row(_clock(finding.ts), finding.state, finding.kind, finding.summary)
    actions = Table(title="actions (latest)")
    for column in ("verb", "target", "outcome"):
        actions.add_column(column)
    for action, result in state.results[-6:]:
        pod = action.target.pod
        target = f"{pod.namespace}/{pod.name}" if pod else (action.target.node or "")
        actions.add_row(action.verb, target, result.outcome)
    return Group(header, fleet, findings, actions)


def summarize(console: Console, truth: GroundTruth, state: DemoState) -> bool:
    """Print what was found and done, checked against the ground truth; True if they agree."""
    idle_pods = sorted({f"{f.subject.pod.namespace}/{f.subject.pod.name}"
                        for f in state.findings
                        if f.kind == "idle_holder" and f.state == "firing" and f.subject.pod})
    cordoned = sorted({a.target.node or "" for a, r in state.results
                       if a.verb == "cordon" and r.outcome == "executed"})
    faulty = sorted({f.node for f in truth.faults})
    console.rule("summary")
    console.print(f"scenario {truth.scenario} (seed {truth.seed}), "
                  f"{(truth.end_ts - truth.start_ts) / 3600:.1f} h simulated")
    console.print(f"idle GPU holders found ({len(idle_pods)}): {', '.join(idle_pods) or '-'}")
    console.print(f"nodes cordoned ({len(cordoned)}): {', '.join(cordoned) or '-'}")
    console.print(f"pods still pending: {', '.join(truth.pending) or '-'}")
    console.print(f"findings: {len(state.findings)}, actions decided: {len(state.results)}")
    expected_idle = sorted(_expected_idle_pods(truth))
    agree = idle_pods == expected_idle and cordoned == faulty
    if agree:
        console.print("[green]matches the simulator's ground truth: every injected idle holder "
                      "and faulty GPU found, no false alarm[/]")
    else:
        console.print(f"[red]differs from ground truth: idle {expected_idle}, faulty {faulty}[/]")
    return agree


def _expected_idle_pods(truth: GroundTruth, window_s: float = 1800, grace_s: float = 600
                        ) -> set[str]:
    """Pods whose injected idleness, counted after the grace, lasted a whole window."""
    found = set()
    for period in truth.idle_periods:
        counted_from = max(period.start, period.pod_started_at + grace_s)
        if period.end - counted_from >= window_s + truth.sample_interval_s:
            found.add(f"{period.namespace}/{period.pod}")
    return found


class SimulatorFeed:
    """The simulator publishes its own allocation and queue events."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    async def __aenter__(self) -> SimulatorFeed:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def check(self) -> None:
        """Raise if the feed has failed (this one cannot)."""

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Return once everything the simulator wrote is published (it is already)."""


class KubernetesFeed:
    """The fleet mirrored into the API-server double; the real watcher publishes its events.

    The double serves HTTP from its own thread and the watcher's reflectors
    run in theirs; leaving the ``async with`` (normally, on an error or on
    Ctrl-C) stops the watcher, joins its threads and shuts the double down.
    """

    def __init__(self, publisher: Publisher, cluster: SimulatedCluster, log_dir: Path) -> None:
        from gpusteward.sandbox.kube_api import KubeApiServer
        from gpusteward.sandbox.kube_mirror import KubeMirrorPublisher

        self.cluster = cluster
        self.log_dir = log_dir
        self.inner = publisher
        # Bookmarks move every reflector to the newest resourceVersion, which settle() needs.
        self.api = KubeApiServer(bookmark_interval_s=0.2)
        self.api.record_requests = False  # a demo run makes thousands; nobody reads them
        self.publisher: Publisher = KubeMirrorPublisher(publisher, self.api, cluster)
        self._stop = asyncio.Event()
        self._client: Any = None
        self.watcher: KubeWatcher
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> KubernetesFeed:
        from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client

        self.api.start()
        try:
            kubeconfig = self.api.write_kubeconfig(self.log_dir / "kubeconfig")
            kube = KubeWatchSettings(kubeconfig=str(kubeconfig))
            self._client = api_client(kube)
            cluster = self.cluster
            # Event times are the simulation's, as the simulator's own feed stamps them.
            self.watcher = KubeWatcher(self._client, self.inner, kube, clock=lambda: cluster.now)
            self._task = asyncio.create_task(self.watcher.run(self._stop))
            synced = asyncio.ensure_future(self.watcher.synced.wait())
            try:
                await asyncio.wait({synced, self._task}, timeout=30,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                synced.cancel()
            self.check()
            if not self.watcher.synced.is_set():
                raise RuntimeError("the Kubernetes watcher did not list the API double in 30 s")
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def _close(self) -> None:
        self._stop.set()
        try:
            if self._task is not None:
                await self._task  # raises the watcher's error, if it failed
        finally:
            if self._client is not None:
                self._client.close()
            self.api.stop()

    def check(self) -> None:
        """Raise the watcher's error if it has stopped on its own."""
        if self._task is not None and self._task.done():
            self._task.result()
            raise RuntimeError("the Kubernetes watcher stopped on its own")

    def settled(self) -> bool:
        """Every change in the double seen by every reflector and published."""
        latest = self.api.resource_version
        reflectors = list(self.watcher.reflectors.values())
        delivered = sum(r.stats.deltas for r in reflectors)
        return all(int(r.resource_version or 0) >= latest for r in reflectors) and (
            delivered == self.watcher.processed)

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until the watcher has published everything written into the double."""
        deadline = time.monotonic() + timeout_s
        while not self.settled():
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Kubernetes watcher did not catch up in {timeout_s} s")
            await asyncio.sleep(0.05)
        await self.inner.flush()


async def _run(settings: Settings, cluster: SimulatedCluster, console: Console,
               live_view: bool, log_dir: Path, feed: Feed = "simulator"
               ) -> tuple[GroundTruth, DemoState]:
    await kafka.ensure_topics(settings)
    worker = WorkerProcess(settings, log_dir / "worker.log")
    worker.start()
    state = DemoState()
    stop = asyncio.Event()
    publisher = KafkaPublisher(settings)
    await publisher.start()
    alerts = FindingsConsumer(settings, [], on_finding=state.on_finding)
    executor = Executor(settings, SimulatorBackend(cluster), execute=True,
                        on_result=state.on_result)
    consumers = [asyncio.create_task(alerts.run(stop)), asyncio.create_task(executor.run(stop))]
    allocations = (KubernetesFeed(publisher, cluster, log_dir) if feed == "kubernetes"
                   else SimulatorFeed(publisher))
    try:
        async with allocations:
            live = Live(render(cluster, state), console=console, refresh_per_second=4,
                        transient=False) if live_view else contextlib.nullcontext()
            with live:
                def refresh(c: SimulatedCluster) -> None:
                    if isinstance(live, Live):
                        live.update(render(c, state))
                    allocations.check()
                cluster.on_tick = refresh
                truth = await cluster.run(allocations.publisher)
                await allocations.settle()
                # Drain: the worker through everything published, then the consumers
                # through everything the worker produced.
                drained = asyncio.create_task(_drain(settings, alerts, executor))
                while not drained.done():
                    await asyncio.wait([drained], timeout=0.5)
                    if not worker.alive:
                        drained.cancel()
                        raise RuntimeError(
                            f"the worker exited early; see {log_dir / 'worker.log'}")
                    allocations.check()
                await drained
                refresh(cluster)
        return truth, state
    finally:
        stop.set()
        await asyncio.gather(*consumers, return_exceptions=True)
        await publisher.stop()
        worker.stop()


async def _drain(settings: Settings, alerts: FindingsConsumer, executor: Executor,
                 timeout_s: float = 180.0) -> None:
    node_topics = [spec.name(settings) for spec in (topics.SAMPLES, topics.HW_EVENTS,
                                                    topics.ALLOCATIONS)]
    await kafka.wait_consumed(settings, worker_group(settings), node_topics, timeout_s)
    await kafka.wait_consumed(settings, alerts.group_id, [topics.FINDINGS.name(settings)],
                              timeout_s)
    await kafka.wait_consumed(settings, executor.group_id, [topics.ACTIONS.name(settings)],
                              timeout_s)


def run_demo(scenario_name: str = "eight-a100", duration_s: float = 60.0,
             live_view: bool = True, seed: int | None = None, feed: Feed = "simulator") -> int:
    """Run the demo; the exit status is 0 when the summary matches the ground truth."""
    console = Console()
    scenario = scenarios.load(scenario_name)
    scenario = scenario.model_copy(update={
        "acceleration": scenario.duration_s / duration_s if duration_s > 0 else 0.0,
        **({"seed": seed} if seed is not None else {}),
    })
    cluster = SimulatedCluster(scenario)
    log_dir = Path(tempfile.mkdtemp(prefix="gpusteward-demo-"))
    via = (" (allocations through the Kubernetes watcher on the API-server double)"
           if feed == "kubernetes" else "")
    console.print(f"starting the embedded broker, the worker and the simulator{via} "
                  f"(logs in {log_dir})")
    # SIGTERM (a supervisor, `kill`) takes the same orderly way out as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with EmbeddedBroker(log_path=log_dir / "broker.log") as broker:
            settings = broker.settings()
            truth, state = asyncio.run(_run(settings, cluster, console, live_view, log_dir,
                                            feed))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: everything stopped[/]")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if summarize(console, truth, state) else 1
