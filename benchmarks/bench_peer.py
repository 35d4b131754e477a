"""The Prometheus recipe and gpusteward, side by side on one simulated fleet.

What users run today to be told about broken or idle GPUs is dcgm-exporter
scraped by Prometheus, alert rules, and Alertmanager. This benchmark runs
that recipe for real next to gpusteward, on the same simulated world, and
times both from the injected event:

- **the peer**: the sandbox serves every simulated node's dcgm-exporter page
  (:mod:`gpusteward.sandbox.dcgm_pages`); a real Prometheus (Debian package)
  scrapes them every 15 s and evaluates, every 15 s, the recipe's rules
  (``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 0``, ``DCGM_FI_DEV_GPU_TEMP > 85``, and
  idle: a GPU held by a pod whose ``avg_over_time(DCGM_FI_DEV_GPU_UTIL[W])``
  is not above 5); a real Alertmanager receives the alerts, and the time an
  alert first shows in its API (polled every 0.2 s) is the peer's detection.
  Notification adds Alertmanager's ``group_wait`` (30 s by default) on top;
  it is not counted, to the peer's advantage.
- **gpusteward**: the world's production NVML collectors (on the same fake
  GPUs) and Kubernetes watcher publish to the embedded broker; the worker and
  the remediation executor run as ``deploy/overlays/local`` declares. The
  finding, the action and its execution are timed by when their records reach
  a consumer of the topics.

Time: Prometheus scrapes and evaluates on the wall clock, so the world runs
in real time (acceleration 1, one sample every 15 s, as dcgm-exporter with
``-c 15000``). To stay within a few minutes, every *window* is divided by
:data:`SCALE` on both sides alike: the idle window (30 min -> 2 min, in the
PromQL range and in gpusteward's policy), the idle start-up grace
(10 min -> 40 s) and the sustained-thermal window (5 min -> 20 s). Intervals
(sample, scrape, evaluation) and every processing latency are real.

The scenario (six single-A100 nodes, four simulated minutes) holds per family
the events to find and the bait that must not raise an alarm:

- ECC: an uncorrectable (double-bit) ECC error on a training GPU at 45 s;
- over-temperature: a GPU held above its slowdown temperature for 90 s (well
  past the sustained window) and another for a single 15 s sample (bait: a
  spike shorter than the window, which faulty-fleet also keeps quiet);
- idle holders: two notebooks used for a minute, then left idle; bait: a
  notebook in light use (30 s of work every 2 min, never idle for a whole
  window) and a training job with 30 s data-loading dips.

A false alarm is an alert or finding of the family on something that had no
such event: an idle alert on a pod never idle for a whole window, a
temperature alert without a sustained fault, an ECC alert on a healthy GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml
from figures import Figure

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker, free_port
from gpusteward.children import die_with_parent, stop_child
from gpusteward.collectors.transport.publisher import KafkaPublisher, Publisher
from gpusteward.health import READY_PATH
from gpusteward.sandbox import demo, deployment
from gpusteward.sandbox.dcgm_pages import DcgmPages
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.sandbox.world import World
from gpusteward.schema import (
    Action,
    ActionResult,
    AllocationEvent,
    Finding,
    HwEvent,
    NodeSample,
    QueueEvent,
)
from gpusteward.settings import Settings

PROMETHEUS = "/usr/bin/prometheus"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"

SCALE = 15
"""Every window (not interval) is divided by this on both sides."""
IDLE_WINDOW_S = 1800 / SCALE
IDLE_GRACE_S = 600 / SCALE
THERMAL_WINDOW_S = 300 / SCALE
INTERVAL_S = 15
"""Sample, scrape and rule-evaluation interval: real seconds."""
TAIL_S = 5.0
"""Wall seconds the race goes on after the scenario's last sample, for alerts in flight."""

SCENARIO = f"""
name: peer-side-by-side
seed: 5
duration_s: 240
sample_interval_s: {INTERVAL_S}
acceleration: 1
cluster_queue: research
nodes:
  - {{prefix: a100, count: 8, gpu_model: NVIDIA A100-SXM4-80GB, gpus: 1, mem_gib: 80}}
users: [alice, bob, carol, dave, erin, frank, grace, heidi]
workloads:
  - group: nb-idle
    count: 2
    kind: notebook
    mem_gib: [12, 30]
    phases:
      - {{for_s: [60, 60], util: [30, 60]}}
      - {{util: [0, 2]}}
  - group: nb-light
    kind: notebook
    mem_gib: [6, 12]
    repeat: true
    phases:
      - {{for_s: [30, 30], util: [14, 18]}}
      - {{for_s: [90, 90], util: [0, 2]}}
  - group: train
    count: 4
    kind: batch
    mem_gib: [50, 76]
    phases: [{{util: [82, 99]}}]
  - group: train-sharded
    kind: batch
    mem_gib: [40, 70]
    repeat: true
    phases:
      - {{for_s: [60, 60], util: [80, 97]}}
      - {{for_s: [30, 30], util: [0, 3]}}
# nodes in placement order: a100-1, -2 nb-idle; -3 nb-light; -4 to -7 train; -8 train-sharded
faults:
  - {{kind: ecc_dbe, node: a100-4, gpu: 0, at_s: 45}}
  - {{kind: ecc_dbe, node: a100-6, gpu: 0, at_s: 105}}
  - {{kind: ecc_dbe, node: a100-7, gpu: 0, at_s: 180}}
  - {{kind: thermal, node: a100-5, gpu: 0, at_s: 60, for_s: 90}}
  - {{kind: thermal, node: a100-7, gpu: 0, at_s: 120, for_s: 75}}
  - {{kind: thermal, node: a100-8, gpu: 0, at_s: 165, for_s: 15}}
"""

POLICY = {"rules": {
    "idle_holder": {"window_s": IDLE_WINDOW_S, "grace_s": IDLE_GRACE_S},
    "thermal_slowdown": {"window_s": THERMAL_WINDOW_S, "clear_s": THERMAL_WINDOW_S / 2.5},
}}
"""gpusteward's policy: the shipped defaults with the windows scaled as the peer's."""

RULES = {"groups": [{"name": "gpu-recipe", "interval": f"{INTERVAL_S}s", "rules": [
    {"alert": "GpuIdle", "expr": 'avg_over_time(DCGM_FI_DEV_GPU_UTIL{pod!=""}'
                                 f'[{int(IDLE_WINDOW_S)}s]) <= 5'},
    {"alert": "GpuEccDbe", "expr": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 0"},
    {"alert": "GpuOverTemp", "expr": "DCGM_FI_DEV_GPU_TEMP > 85"},
    # Not the recipe: its temperature rule held for gpusteward's window, like for like.
    {"alert": "GpuOverTempHeld", "expr": "DCGM_FI_DEV_GPU_TEMP > 85",
     "for": f"{int(THERMAL_WINDOW_S)}s"},
]}]}
"""The recipe's alert rules. "A GPU requested by a pod" is a series with a ``pod`` label:
dcgm-exporter labels a device with the pod the kubelet assigned it to, and only then."""

FAMILIES = {"GpuEccDbe": "ecc", "GpuOverTemp": "thermal", "GpuIdle": "idle",
            "GpuOverTempHeld": "thermal-held",
            "ecc_dbe": "ecc", "thermal_slowdown": "thermal", "idle_holder": "idle"}
"""Alert names and finding kinds by family."""


# --- the wall clock of the simulated ticks ---------------------------------------------------

class _Clocked:
    """The world as the simulator's publisher, noting when each tick began on the wall clock."""

    def __init__(self, inner: Publisher, cluster: SimulatedCluster) -> None:
        self.inner = inner
        self.cluster = cluster
        self.wall: dict[float, float] = {}

    def _mark(self) -> None:
        self.wall.setdefault(self.cluster.now, time.time())

    async def sample(self, sample: NodeSample) -> None:
        self._mark()
        await self.inner.sample(sample)

    async def hw_event(self, event: HwEvent) -> None:
        self._mark()
        await self.inner.hw_event(event)

    async def allocation(self, event: AllocationEvent) -> None:
        self._mark()
        await self.inner.allocation(event)

    async def queue(self, event: QueueEvent) -> None:
        self._mark()
        await self.inner.queue(event)

    async def flush(self) -> None:
        await self.inner.flush()


# --- the peer: Prometheus and Alertmanager ------------------------------------------------------

@contextlib.contextmanager
def _daemon(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=die_with_parent)
    try:
        yield process
    finally:
        stop_child(process, timeout_s=10)


@contextlib.contextmanager
def peer(workdir: Path, pages: DcgmPages, nodes: list[str]) -> Iterator[tuple[str, str]]:
    """Alertmanager and a Prometheus scraping ``pages`` for ``nodes``; yields their URLs."""
    am_port, prom_port = free_port(), free_port()
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump({
        # every alert a group of its own; nobody is notified (arrival is what is timed)
        "route": {"receiver": "nobody", "group_by": ["..."]},
        "receivers": [{"name": "nobody"}],
    }))
    (workdir / "rules.yml").write_text(yaml.safe_dump(RULES))
    (workdir / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{INTERVAL_S}s",
                   "evaluation_interval": f"{INTERVAL_S}s"},
        "rule_files": [str(workdir / "rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [
            {"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "dcgm-exporter", "static_configs": [
            {"targets": [pages.address],
             "labels": {"__metrics_path__": pages.path(node), "node": node}}
            for node in nodes]}],
    }))
    with _daemon([ALERTMANAGER, f"--config.file={workdir / 'alertmanager.yml'}",
                  f"--storage.path={workdir / 'am-data'}",
                  f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                 workdir / "alertmanager.log"), \
            _daemon([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                     f"--storage.tsdb.path={workdir / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{prom_port}"],
                    workdir / "prometheus.log"):
        yield f"http://127.0.0.1:{am_port}", f"http://127.0.0.1:{prom_port}"


async def _ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(url) as answer:
                if answer.status == 200:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready in {timeout_s} s")
        await asyncio.sleep(0.2)


@dataclass
class PeerAlert:
    family: str
    labels: dict[str, str]
    arrived: float
    """Wall time the alert first showed in Alertmanager's API."""


async def watch_alertmanager(url: str, stop: asyncio.Event, alerts: list[PeerAlert]) -> None:
    """Note every alert (by fingerprint and start) the first time Alertmanager lists it."""
    seen: set[tuple[str, str]] = set()
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(f"{url}/api/v2/alerts") as answer:
                listed = await answer.json()
            now = time.time()
            for alert in listed:
                key = (alert["fingerprint"], alert["startsAt"])
                if key not in seen:
                    seen.add(key)
                    labels = alert["labels"]
                    alerts.append(PeerAlert(FAMILIES[labels["alertname"]], labels, now))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


# --- gpusteward: its outputs as they reach a consumer ----------------------------------------

@dataclass
class Outputs:
    findings: list[tuple[Finding, float]] = field(default_factory=list)
    actions: list[tuple[Action, float]] = field(default_factory=list)
    results: list[tuple[ActionResult, float]] = field(default_factory=list)


async def watch_gpusteward(settings: Settings, stop: asyncio.Event, out: Outputs) -> None:
    """Findings, actions and their results, each with the wall time it was produced."""
    decoders: dict[str, tuple[Any, list[Any]]] = {
        topics.FINDINGS.name(settings): (msgspec.json.Decoder(Finding), out.findings),
        topics.ACTIONS.name(settings): (msgspec.json.Decoder(Action), out.actions),
        topics.ACTION_RESULTS.name(settings): (msgspec.json.Decoder(ActionResult), out.results),
    }
    consumer = kafka.consumer(settings, *decoders, group_id=None)
    await consumer.start()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=100)
            arrived = time.time()
            for messages in batch.values():
                for message in messages:
                    decoder, into = decoders[message.topic]
                    # The producer's timestamp (its wall clock) unless a producer set the
                    # record's time from event time: then the arrival here.
                    produced = message.timestamp / 1000
                    into.append((decoder.decode(message.value or b""),
                                 produced if abs(arrived - produced) < 60 else arrived))
    finally:
        await consumer.stop()


# --- the race -----------------------------------------------------------------------------------

async def race(settings: Settings, cluster: SimulatedCluster, workdir: Path
               ) -> tuple[GroundTruth, dict[float, float], list[PeerAlert], Outputs]:
    policy = workdir / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    manifests = deployment.Manifests.from_overlay(demo.overlay_path())
    local = deployment.Local(settings.kafka.bootstrap_servers, workdir,
                             topic_prefix=settings.topic_prefix,
                             kubeconfig=workdir / "kubeconfig",
                             extra_env={"GPUSTEWARD_POLICY_FILE": str(policy)})
    settings = manifests.launch("collector", local).settings()
    await kafka.ensure_topics(settings)
    pages = DcgmPages()
    publisher = KafkaPublisher(settings)
    await publisher.start()
    stop = asyncio.Event()
    alerts: list[PeerAlert] = []
    outputs = Outputs()
    processes: list[deployment.Process] = []
    watchers: list[asyncio.Task[None]] = []
    try:
        world = World(cluster, publisher, workdir, dcgm_pages=pages)
        # started before the world's gRPC servers and clients run: nothing to fork but us
        processes = list(deployment.start(manifests, ["worker", "remediation"], local))
        with peer(workdir, pages, sorted(cluster.nodes)) as (alertmanager, prometheus):
            async with aiohttp.ClientSession() as session:
                await _ready(session, f"{alertmanager}/-/ready")
                await _ready(session, f"{prometheus}/-/ready")
                # gpusteward's processes ready too: neither side's start-up is timed
                for process in processes:
                    port = process.launch.env.get(deployment.HEALTH_PORT, "0")
                    if port != "0":
                        await deployment.while_alive(processes, _ready(
                            session, f"http://127.0.0.1:{port}{READY_PATH}", 120))
            watchers = [
                asyncio.create_task(watch_alertmanager(alertmanager, stop, alerts)),
                asyncio.create_task(watch_gpusteward(settings, stop, outputs))]
            async with world:
                clocked = _Clocked(world, cluster)
                truth = await cluster.run(clocked)
                await asyncio.sleep(TAIL_S)
            stop.set()
            await asyncio.gather(*watchers)
        return truth, clocked.wall, alerts, outputs
    finally:
        stop.set()
        await asyncio.gather(*watchers, return_exceptions=True)
        for process in processes:
            process.stop()
        await publisher.stop()


# --- the score ----------------------------------------------------------------------------------

@dataclass
class Event:
    """Something a side should report: where, when (wall), and the truth's words for it."""

    family: str
    node: str
    pod: str | None
    at: float


def events(truth: GroundTruth, wall: dict[float, float]) -> list[Event]:
    """The faults and idle holders of the run, timed on the wall clock of their tick."""
    found = [Event("ecc", f.node, None, wall[f.ts]) for f in truth.faults if f.kind == "ecc_dbe"]
    found += [Event("thermal", f.node, None, wall[f.ts]) for f in truth.faults
              if f.kind == "thermal" and (f.end or math.inf) - f.ts > THERMAL_WINDOW_S]
    found += [Event("idle", p.node, f"{p.namespace}/{p.pod}", wall[p.start])
              for p in truth.idle_periods if p.end - p.start >= IDLE_WINDOW_S]
    return found


def _peer_matches(alert: PeerAlert, event: Event) -> bool:
    if alert.family.split("-")[0] != event.family or alert.labels.get("Hostname") != event.node:
        return False
    return event.pod is None or \
        f"{alert.labels.get('namespace')}/{alert.labels.get('pod')}" == event.pod


def _finding_matches(finding: Finding, event: Event) -> bool:
    subject = finding.subject
    if FAMILIES.get(finding.kind) != event.family or subject.node != event.node:
        return False
    pod = subject.pod
    return event.pod is None or (pod is not None and f"{pod.namespace}/{pod.name}" == event.pod)


def _first(times: list[float], since: float) -> float:
    """Seconds from ``since`` to the first of ``times``; NaN when there is none (a miss)."""
    return min(times) - since if times else math.nan


def _detections(name: str, delays: list[float], misses: bool = True) -> list[Figure]:
    """The mean delay of the detected events (none if all were missed), and how many were."""
    found = [d for d in delays if not math.isnan(d)]
    figures = [Figure(f"{name} (mean of {len(found)})", sum(found) / len(found), "s")] \
        if found else []
    if misses:
        figures.append(Figure(f"{name}: missed", len(delays) - len(found), ""))
    return figures


TITLES = {"ecc": "DBE ECC error", "thermal": "over-temperature",
          "idle": "idle holder, from idle start"}


def score(truth: GroundTruth, wall: dict[float, float], alerts: list[PeerAlert],
          outputs: Outputs) -> list[Figure]:
    """Per family: each side's delay from the event, their ratio, and false alarms."""
    wanted = events(truth, wall)
    findings = [(f, t) for f, t in outputs.findings
                if f.kind in FAMILIES and f.state == "firing"]
    figures: list[Figure] = []
    for family, title in TITLES.items():
        these = [e for e in wanted if e.family == family]
        peer_s, found_s, acted_s, done_s, held_s = [], [], [], [], []
        refused = 0
        for event in these:
            matching = [a for a in alerts if _peer_matches(a, event)]
            peer_s.append(_first([a.arrived for a in matching if a.family == family], event.at))
            held_s.append(_first([a.arrived for a in matching if a.family == "thermal-held"],
                                 event.at))
            hits = [(f, t) for f, t in findings if _finding_matches(f, event)]
            found_s.append(_first([t for _, t in hits], event.at))
            ids = {f.id for f, _ in hits}
            acted = [(a, t) for a, t in outputs.actions if set(a.finding_ids) & ids]
            acted_s.append(_first([t for _, t in acted], event.at))
            keys = {a.idempotency_key for a, _ in acted}
            answers = [(r, t) for r, t in outputs.results
                       if r.idempotency_key in keys and r.outcome != "retrying"]
            done_s.append(_first([t for _, t in answers], event.at))
            refused += sum(r.outcome == "refused" for r, _ in answers)
        figures += _detections(f"{title}: event -> Alertmanager alert (Prometheus recipe)",
                               peer_s)
        if family == "thermal":
            figures += _detections(f"{title}: event -> Alertmanager alert (recipe rule with "
                                   f"for: {THERMAL_WINDOW_S:.0f}s, as gpusteward's window)",
                                   held_s)
        figures += _detections(f"{title}: event -> gpusteward finding", found_s)
        if family != "thermal":  # a sustained slowdown is reported, not acted on
            figures += _detections(f"{title}: event -> gpusteward action", acted_s, False)
            # The executor's answer: carried out on the API, or refused by its guards (the
            # circuit breaker allows one disruptive action per 600 s: one cordon here).
            figures += _detections(f"{title}: event -> executor's answer on the API",
                                   done_s, False)
            figures.append(Figure(f"{title}: of which refused by the executor's guards",
                                  refused, ""))
        pairs = [(p, f) for p, f in zip(peer_s, found_s, strict=True)
                 if not (math.isnan(p) or math.isnan(f))]
        if pairs:
            figures.append(Figure(f"{title}: Prometheus recipe / gpusteward (finding)",
                                  sum(p for p, _ in pairs) / sum(f for _, f in pairs), "x"))
        if family == "idle" and not all(map(math.isnan, found_s)):
            late = max(f for f in found_s if not math.isnan(f)) - IDLE_WINDOW_S
            figures.append(Figure(f"{title}: gpusteward's latest finding after the window "
                                  f"(target <= {INTERVAL_S} s sample interval)", late, "s"))
        for side, side_family in (("Prometheus recipe", family), ("recipe with for:",
                                                                    "thermal-held")):
            if side_family == "thermal-held" and family != "thermal":
                continue
            false = [a for a in alerts if a.family == side_family
                     and not any(_peer_matches(a, e) for e in these)]
            figures.append(Figure(f"{title}: false alarms, {side}", len(false), ""))
        false_findings = [f for f, _ in findings if FAMILIES[f.kind] == family
                          and not any(_finding_matches(f, e) for e in these)]
        figures.append(Figure(f"{title}: false alarms, gpusteward", len(false_findings), ""))
    return figures


def run() -> list[Figure]:
    missing = [b for b in (PROMETHEUS, ALERTMANAGER) if not shutil.which(b)]
    if missing:
        print(f"  peer: skipped, {', '.join(missing)} absent (make system-deps)")
        return []
    scenario = Scenario.model_validate(yaml.safe_load(SCENARIO))
    cluster = SimulatedCluster(scenario)
    workdir = Path(tempfile.mkdtemp(prefix="gpusteward-peer-"))
    print(f"  peer: real time, {INTERVAL_S} s sample/scrape/evaluation, windows / {SCALE} on "
          f"both sides (idle {IDLE_WINDOW_S:.0f} s, grace {IDLE_GRACE_S:.0f} s, thermal "
          f"{THERMAL_WINDOW_S:.0f} s); logs in {workdir}")
    with EmbeddedBroker(log_path=workdir / "broker.log") as broker:
        settings = broker.settings().model_copy(update={"topic_prefix": "peer"})
        truth, wall, alerts, outputs = asyncio.run(race(settings, cluster, workdir))
    (workdir / "alerts.json").write_text(json.dumps(
        [{"family": a.family, "labels": a.labels, "arrived": a.arrived} for a in alerts],
        indent=1))
    return score(truth, wall, alerts, outputs)
