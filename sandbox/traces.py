"""Public GPU traces as collector output, so the pipeline and the report run on real data.

The Alibaba GenAI trace (``alibaba-genai-v2026``) has, for 80 Stable
Diffusion serving pods, the GPU duty cycle (percent) and the GPU memory
used (bytes) about every 57 s over ~23 h. ``container_ip`` is an anonymised
pod id; the two files join on it and on the timestamp. The trace says
nothing of nodes, GPU models or owners, so the replay states its
assumptions: each pod holds one whole GPU of ``model`` (default an
A100-80GB: the trace's peak is 50 GB), pods are packed ``gpus_per_node`` to a
node in the order of their ids, and each pod is its own workload
(``Deployment sd-<id>``) in namespace and team ``genai``.

Records come out exactly as a collector would publish them: one
:class:`NodeSample` per node per trace timestamp, and a bound/running
:class:`PodAllocation` per pod, so they go through any :class:`Publisher`
or straight into the rollup fold. Timestamps are shifted so the trace
starts at ``start`` (e.g. the Monday of the week a report is wanted for).

The openb trace (``alibaba-gpu-v2023``, the FGD paper's) lists 8,152 GPU
pods with creation and scheduling times over ~150 days but no node
placement, so it gives queue events only: each pod is ``pending`` at its
creation and ``admitted`` at its scheduling, in a cluster queue named after
its QoS class (LS, BE, Burstable, Guaranteed). :func:`openb_queue_events`
takes the trace's last ``days`` days and moves them to ``start``; with
``follow_to_end`` it follows each GPU pod to its end as the watcher does (a
``finished`` event at its deletion inside the window) and starts from the GPU
pods already running when the window opens, so that run times and held
capacity are known (what start ETAs need). :func:`openb_node_summaries` gives
the trace's GPU nodes (1,213 nodes, 6,212 GPUs) as node summaries; placement
being unknown, every GPU is reported free and the held capacity is what the
queue says runs. A pod's GPUs count whole (``num_gpu``), shared ones
(``gpu_milli`` below 1,000) included.

Cite "Alibaba Cluster Trace Program" when showing results on them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.errors import ConfigError
from gpusteward.schema import (
    DeviceSample,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    QueueEvent,
)

GENAI = "alibaba-genai-v2026"
OPENB = "alibaba-gpu-v2023"
OPENB_PODS = "openb_pod_list_default.csv"
OPENB_NODES = "openb_node_list_gpu_node.csv"
DUTY_FILE = "pod_gpu_duty_cycle_anon.csv"
MEMORY_FILE = "pod_gpu_memory_used_bytes_anon.csv"
GIB = 1 << 30


class TraceError(ConfigError, ValueError):
    """A trace folder or file that is missing or not in the expected shape."""


@dataclass(frozen=True)
class GenAiOptions:
    """How the GenAI trace is laid onto a fleet (the trace itself has no fleet)."""

    start: float | None = None
    """Unix seconds the trace's first timestamp is moved to; None keeps the original."""
    model: str = "NVIDIA A100-SXM4-80GB"
    mem_total_bytes: int = 80 * GIB
    gpus_per_node: int = 8
    namespace: str = "genai"
    node_prefix: str = "genai-node"


@dataclass(frozen=True)
class TracePod:
    """Where the replay puts one trace pod."""

    container_ip: str
    pod: str
    node: str
    index: int
    uuid: str


def read_genai(directory: Path) -> pl.DataFrame:
    """The joined trace: container_ip, ts, duty_pct, mem_used_bytes (either may be null)."""
    folder = directory / GENAI if (directory / GENAI).is_dir() else directory
    try:
        duty = pl.read_csv(folder / DUTY_FILE, schema_overrides={"value": pl.Float64})
        memory = pl.read_csv(folder / MEMORY_FILE, schema_overrides={"value": pl.Float64})
        duty = duty.select(pl.col("container_ip"), pl.col("timestamp_anon").alias("ts"),
                           pl.col("value").alias("duty_pct"))
        memory = memory.select(pl.col("container_ip"), pl.col("timestamp_anon").alias("ts"),
                               pl.col("value").alias("mem_used_bytes"))
    except (OSError, pl.exceptions.PolarsError) as error:
        raise TraceError(f"cannot read the GenAI trace in {folder}: {error}") from error
    joined = duty.join(memory, on=["container_ip", "ts"], how="full", coalesce=True)
    return joined.sort("ts", "container_ip")


def genai_pods(trace: pl.DataFrame, options: GenAiOptions) -> dict[str, TracePod]:
    """The placement of every trace pod: packed onto nodes in the order of their ids."""
    pods: dict[str, TracePod] = {}
    for i, ip in enumerate(sorted(trace["container_ip"].unique().to_list())):
        node = f"{options.node_prefix}-{i // options.gpus_per_node:03d}"
        digest = hashlib.sha1(ip.encode(), usedforsecurity=False).hexdigest()
        uuid = f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
        pods[ip] = TracePod(container_ip=ip, pod=f"sd-{ip[:8]}-0", node=node,
                            index=i % options.gpus_per_node, uuid=uuid)
    return pods


def _load(directory: Path, options: GenAiOptions
          ) -> tuple[pl.DataFrame, float, dict[str, TracePod]]:
    """The joined trace, the shift that moves it to ``options.start``, and its pods."""
    trace = read_genai(directory)
    if trace.is_empty():
        raise TraceError(f"the GenAI trace in {directory} has no rows")
    first_ts: float = trace.select(pl.col("ts").min()).item()
    shift = 0.0 if options.start is None else options.start - first_ts
    return trace, shift, genai_pods(trace, options)


def genai_records(directory: Path, options: GenAiOptions | None = None
                  ) -> tuple[list[PodAllocation], Iterator[NodeSample]]:
    """The pods' allocation events and, lazily in time order, the nodes' samples."""
    options = options or GenAiOptions()
    trace, shift, pods = _load(directory, options)
    first_seen = dict(trace.group_by("container_ip").agg(pl.col("ts").min()).iter_rows())
    allocations = [
        PodAllocation(
            ts=first_seen[p.container_ip] + shift, node=p.node,
            pod=PodRef(namespace=options.namespace, name=p.pod), phase="running", gpus=1,
            device_ids=[p.uuid], started_at=first_seen[p.container_ip] + shift,
            owner_kind="Deployment", owner_name=p.pod.rsplit("-", 1)[0],
            workload_kind="inference", labels={"team": options.namespace,
                                               "trace": GENAI},
        )
        for p in pods.values()
    ]

    def samples() -> Iterator[NodeSample]:
        rows = trace.with_columns(
            pl.col("container_ip").replace_strict({ip: p.node for ip, p in pods.items()})
            .alias("node"))
        for (ts, node), group in rows.group_by(["ts", "node"], maintain_order=True):
            devices = []
            for ip, duty, memory in group.select("container_ip", "duty_pct",
                                                 "mem_used_bytes").iter_rows():
                pod = pods[ip]
                devices.append(DeviceSample(
                    uuid=pod.uuid, index=pod.index, model=options.model, util_pct=duty,
                    mem_used_bytes=None if memory is None else int(memory),
                    mem_total_bytes=options.mem_total_bytes,
                    pod=PodRef(namespace=options.namespace, name=pod.pod)))
            yield NodeSample(ts=float(ts) + shift, node=str(node), source="trace:" + GENAI,
                             devices=sorted(devices, key=lambda d: d.index))

    return allocations, samples()


async def replay_genai(publisher: Publisher, directory: Path,
                       options: GenAiOptions | None = None, acceleration: float = 0.0) -> int:
    """Publish the trace through ``publisher``; returns the number of samples sent.

    ``acceleration`` is trace seconds per wall second (0: as fast as possible).
    """
    allocations, samples = genai_records(directory, options)
    for allocation in allocations:
        await publisher.allocation(allocation)
    sent = 0
    previous: float | None = None
    for sample in samples:
        if acceleration > 0 and previous is not None and sample.ts > previous:
            await asyncio.sleep((sample.ts - previous) / acceleration)
        previous = sample.ts
        await publisher.sample(sample)
        sent += 1
    await publisher.flush()
    return sent


def _openb_folder(directory: Path) -> Path:
    return directory / OPENB if (directory / OPENB).is_dir() else directory


def openb_queue_events(directory: Path, start: float, days: float = 7.0,
                       namespace: str = "openb", *, follow_to_end: bool = False
                       ) -> list[QueueEvent]:
    """Pending and admitted events of the openb pods created in the trace's last ``days``;
    with ``follow_to_end``, GPU pods only, followed to their end, from the pods already
    running at the window's start, in event-time order."""
    folder = _openb_folder(directory)
    try:
        pods = pl.read_csv(folder / OPENB_PODS)
    except (OSError, pl.exceptions.PolarsError) as error:
        raise TraceError(f"cannot read the openb trace in {folder}: {error}") from error
    window_end = float(pods["creation_time"].max())  # type: ignore[arg-type]
    window_start = window_end - days * 86400
    shift = start - window_start
    scheduled_ok = (pl.col("pod_phase") != "Pending") & (
        pl.col("scheduled_time") >= pl.col("creation_time"))
    events: list[QueueEvent] = []
    if follow_to_end:
        pods = pods.filter(pl.col("num_gpu") > 0)
        running = pods.filter((pl.col("creation_time") < window_start) & scheduled_ok
                              & (pl.col("scheduled_time") < window_start)
                              & (pl.col("deletion_time") > window_start))
        for name, created, scheduled, qos, gpus in running.select(
                "name", "creation_time", "scheduled_time", "qos", "num_gpu").iter_rows():
            events.append(QueueEvent(ts=start, name=name, namespace=namespace,
                                     cluster_queue=str(qos), state="admitted",
                                     created_at=float(created) + shift,
                                     admitted_at=float(scheduled) + shift, gpus=int(gpus)))
    recent = pods.filter(pl.col("creation_time") >= window_start).sort("creation_time")
    for name, created, scheduled, qos, gpus, phase in recent.select(
            "name", "creation_time", "scheduled_time", "qos", "num_gpu", "pod_phase"
    ).iter_rows():
        created_at = float(created) + shift
        events.append(QueueEvent(ts=created_at, name=name, namespace=namespace,
                                 cluster_queue=str(qos), state="pending",
                                 created_at=created_at, gpus=int(gpus)))
        # Pods never scheduled carry no (or a zero) scheduled time: they stay pending.
        if phase != "Pending" and scheduled is not None and scheduled >= created:
            admitted_at = float(scheduled) + shift
            events.append(QueueEvent(ts=admitted_at, name=name, namespace=namespace,
                                     cluster_queue=str(qos), state="admitted",
                                     created_at=created_at, admitted_at=admitted_at,
                                     gpus=int(gpus)))
    if follow_to_end:
        ended = pods.filter(scheduled_ok & (pl.col("deletion_time") > window_start)
                            & (pl.col("deletion_time") <= window_end)
                            & (pl.col("deletion_time") > pl.col("scheduled_time")))
        for name, created, scheduled, deleted, qos, gpus in ended.select(
                "name", "creation_time", "scheduled_time", "deletion_time", "qos", "num_gpu"
        ).iter_rows():
            events.append(QueueEvent(ts=float(deleted) + shift, name=name,
                                     namespace=namespace, cluster_queue=str(qos),
                                     state="finished", created_at=float(created) + shift,
                                     admitted_at=float(scheduled) + shift, gpus=int(gpus)))
        # Within one second: what ends frees its GPUs first, and a pod scheduled the second
        # it was created is pending before it is admitted.
        order = {"finished": 0, "pending": 1, "admitted": 2}
        events.sort(key=lambda e: (e.ts, order[e.state]))
    return events


def openb_node_summaries(directory: Path, ts: float) -> list[NodeSummary]:
    """The openb GPU nodes as node summaries at ``ts``, every GPU free (see the module)."""
    folder = _openb_folder(directory)
    try:
        nodes = pl.read_csv(folder / OPENB_NODES)
    except (OSError, pl.exceptions.PolarsError) as error:
        raise TraceError(f"cannot read the openb nodes in {folder}: {error}") from error
    return [NodeSummary(ts=ts, node=str(name), gpu_model=str(model), gpus_total=int(gpus),
                        gpus_free=int(gpus))
            for name, gpus, model in nodes.select("sn", "gpu", "model").iter_rows()
            if gpus and int(gpus) > 0]


GENAI_IDLE_POLICY = """\
# gpusteward policy for replaying the Alibaba GenAI trace: the idle definition of
# "30+ min below 5 %" for its serving pods. The shipped policy gives inference pods a
# 24 h window (serving pods wait for traffic at night); this override, scoped to the
# trace's namespace, brings them back to the rule's base window so the replay checks
# the same definition as the offline computation (traces.offline_idle_periods).
namespaces:
  {namespace}:
    idle_holder:
      kinds:
        inference: {{window_s: {window_s:g}}}
"""


@dataclass(frozen=True)
class IdleDefinition:
    """What counts as an idle period: the idle rule's definition, stated on its own."""

    threshold_pct: float = 5.0
    window_s: float = 1800.0
    grace_s: float = 600.0
    max_gap_s: float = 300.0


def genai_idle_policy(options: GenAiOptions | None = None,
                      definition: IdleDefinition | None = None) -> str:
    """The policy file (YAML) under which the worker applies ``definition`` to the trace's
    pods; threshold, grace and gap are the shipped defaults, so only the window differs."""
    options = options or GenAiOptions()
    definition = definition or IdleDefinition()
    return GENAI_IDLE_POLICY.format(namespace=options.namespace, window_s=definition.window_s)


def offline_idle_periods(directory: Path, options: GenAiOptions | None = None,
                         definition: IdleDefinition | None = None) -> pl.DataFrame:
    """The idle periods of the trace's pods, computed in one pass of polars expressions.

    Independent of the stream worker (it shares none of its code), so the two can check
    each other. Per pod, over its rows in time order: a row with a duty cycle at or above
    the threshold is busy and ends any idle period; an idle row starts a run when none is
    going or when more than ``max_gap_s`` passed since the pod's previous row with a duty
    cycle (a row without one is no observation: it neither extends a run nor hides a
    gap). A run counts from the later of its first row and the pod's first
    row plus ``grace_s``, and becomes an idle period at its first row ``window_s`` or more
    after that. Between two busy rows there is at most one period: a gap restarts the run
    but does not end a period already found.

    Returns one row per period: pod, container_ip, node, device, starts_at (the counted-
    from time, on the replay's clock), found_at (the row at which the window was reached)
    and last_idle_at (the period's last idle row).
    """
    options = options or GenAiOptions()
    definition = definition or IdleDefinition()
    trace, shift, pods = _load(directory, options)
    by_pod = pl.col("container_ip")
    rows = (
        trace.lazy()
        .with_columns(pl.col("ts") + shift)
        .sort("container_ip", "ts")
        .with_columns(pod_start=pl.col("ts").min().over(by_pod))
        .filter(pl.col("duty_pct").is_not_null())
        .with_columns(
            gap=(pl.col("ts").diff().over(by_pod) > definition.max_gap_s).fill_null(False),
        )
        .with_columns(busy=pl.col("duty_pct") >= definition.threshold_pct)
        .with_columns(
            # Stretch: the rows from one busy row to the next; run: split again at gaps.
            stretch=pl.col("busy").cast(pl.UInt32).cum_sum().over(by_pod),
            run=(pl.col("busy") | pl.col("gap")).cast(pl.UInt32).cum_sum().over(by_pod),
        )
        .filter(~pl.col("busy"))
        .with_columns(
            counted_from=pl.max_horizontal(
                pl.col("ts").min().over(by_pod, "run"),
                pl.col("pod_start") + definition.grace_s),
        )
        .with_columns(reached=pl.col("ts") - pl.col("counted_from") >= definition.window_s)
    )
    periods = (
        rows.filter(pl.col("reached"))
        .group_by("container_ip", "stretch")
        .agg(pl.col("counted_from").first().alias("starts_at"),
             pl.col("ts").first().alias("found_at"))
        .join(rows.group_by("container_ip", "stretch").agg(pl.col("ts").max()
                                                           .alias("last_idle_at")),
              on=["container_ip", "stretch"])
        .sort("container_ip", "starts_at")
        .collect()
    )
    placement = pl.DataFrame(
        [(p.container_ip, f"{options.namespace}/{p.pod}", p.node, p.uuid)
         for p in pods.values()],
        schema=["container_ip", "pod", "node", "device"], orient="row")
    return periods.join(placement, on="container_ip").select(
        "pod", "container_ip", "node", "device", "starts_at", "found_at", "last_idle_at"
    ).sort("pod", "starts_at")
