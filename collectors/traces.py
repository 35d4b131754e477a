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
takes the trace's last ``days`` days and moves them to ``start``.

Cite "Alibaba Cluster Trace Program" when showing results on them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from gpusteward.collectors.publisher import Publisher
from gpusteward.schema import DeviceSample, NodeSample, PodAllocation, PodRef, QueueEvent

GENAI = "alibaba-genai-v2026"
OPENB = "alibaba-gpu-v2023"
OPENB_PODS = "openb_pod_list_default.csv"
DUTY_FILE = "pod_gpu_duty_cycle_anon.csv"
MEMORY_FILE = "pod_gpu_memory_used_bytes_anon.csv"
GIB = 1 << 30


class TraceError(ValueError):
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


def genai_records(directory: Path, options: GenAiOptions | None = None
                  ) -> tuple[list[PodAllocation], Iterator[NodeSample]]:
    """The pods' allocation events and, lazily in time order, the nodes' samples."""
    options = options or GenAiOptions()
    trace = read_genai(directory)
    if trace.is_empty():
        raise TraceError(f"the GenAI trace in {directory} has no rows")
    first_ts: float = trace.select(pl.col("ts").min()).item()
    shift = 0.0 if options.start is None else options.start - first_ts
    pods = genai_pods(trace, options)
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


def openb_queue_events(directory: Path, start: float, days: float = 7.0,
                       namespace: str = "openb") -> list[QueueEvent]:
    """Pending and admitted events of the openb pods created in the trace's last ``days``."""
    folder = directory / OPENB if (directory / OPENB).is_dir() else directory
    try:
        pods = pl.read_csv(folder / OPENB_PODS)
    except (OSError, pl.exceptions.PolarsError) as error:
        raise TraceError(f"cannot read the openb trace in {folder}: {error}") from error
    window_end = float(pods["creation_time"].max())  # type: ignore[arg-type]
    window_start = window_end - days * 86400
    shift = start - window_start
    recent = pods.filter(pl.col("creation_time") >= window_start).sort("creation_time")
    events: list[QueueEvent] = []
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
    return events
