"""The topic registry: every topic's name, key, payload, partitioning and cleanup.

The registry is the single place a topic is defined. Processes call
:func:`gpusteward.kafka.ensure_topics` on start, which creates what is
missing from these specs; ``docs/topics.md`` and the JSON Schema export read
the same specs, so the documentation cannot drift from what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpusteward import schema
from gpusteward.settings import Settings

DAY_MS = 24 * 3600 * 1000


COMPACTED_SEGMENTS = {"segment.ms": str(10 * 60 * 1000), "segment.bytes": str(64 << 20)}
"""How often a compacted topic (and a worker's changelog) starts a new segment: every 10
minutes, or at 64 MiB. Kafka never compacts a topic's active segment, and by default one
stays active for 7 days or 1 GiB, so a restarted worker replayed up to that much per
changelog partition (at 10,000 GPUs a node-state partition takes about 110 KiB/s: a GiB in
under three hours) however few keys it holds. With these, what a recovery or a reader from
the start reads is the compacted state and at most about the last 10 minutes of writes."""


@dataclass(frozen=True)
class TopicSpec:
    """One topic of the contract."""

    suffix: str
    """Name without the prefix, e.g. ``samples.v1``."""
    key: str
    """What the record key is, in words."""
    value: Any
    """The msgspec type of the value."""
    doc: str
    node_keyed: bool = False
    """Node-keyed topics share ``kafka.node_partitions`` so they are co-partitioned."""
    partitions: int = 1
    """Partitions when not node-keyed."""
    compacted: bool = False
    retention_ms: int = 7 * DAY_MS

    def name(self, settings: Settings) -> str:
        return f"{settings.topic_prefix}.{self.suffix}"

    def partition_count(self, settings: Settings) -> int:
        return settings.kafka.node_partitions if self.node_keyed else self.partitions

    def config(self) -> dict[str, str]:
        if self.compacted:
            return {"cleanup.policy": "compact", **COMPACTED_SEGMENTS}
        return {"cleanup.policy": "delete", "retention.ms": str(self.retention_ms)}


SAMPLES = TopicSpec(
    "samples.v1", "node name", schema.NodeSample,
    "One message per node per tick with every GPU and MIG device of the node.",
    node_keyed=True, retention_ms=DAY_MS,
)
HW_EVENTS = TopicSpec(
    "hw-events.v1", "node name", schema.HwEvent,
    "XID, ECC, GPU-lost and throttle events, sent at once outside the tick.",
    node_keyed=True,
)
ALLOCATIONS = TopicSpec(
    "allocations.v1",
    "node name for node inventory, `node/pod/<uid>` for a pod (`node/pod/<namespace>/<name>` "
    "for a pod without a uid)",
    schema.PodAllocation | schema.NodeInventory,
    "Pod GPU/MIG holdings (tag `pod`) and node inventory (tag `node`). Compacted: the last "
    "record of every pod and node is kept. Partitioned by the node part of the key.",
    node_keyed=True, compacted=True,
)
QUEUE = TopicSpec(
    "queue.v1", "cluster queue", schema.QueueEvent,
    "Kueue workloads and pending GPU pods: pending, admitted, evicted, requeued, finished.",
    partitions=1,
)
NODE_SUMMARIES = TopicSpec(
    "node-summaries.v1", "node name", schema.NodeSummary,
    "Free GPUs and MIG slices, health and cordon state per node, for the fleet agent.",
    partitions=1, compacted=True,
)
FINDINGS = TopicSpec(
    "findings.v1", "finding fingerprint", schema.Finding,
    "Detected problems, firing then resolved, with evidence and a runbook.",
    partitions=1, retention_ms=30 * DAY_MS,
)
ACTIONS = TopicSpec(
    "actions.v1", "subject: its node, else `namespace/pod`, else its queue, else the empty string",
    schema.Action,
    "Remediations asked for by the rules, each with an idempotency key.",
    partitions=1, retention_ms=30 * DAY_MS,
)
ACTION_RESULTS = TopicSpec(
    "action-results.v1", "idempotency key", schema.ActionResult,
    "The audit trail: every decision on every action "
    "(executed, dry_run, skipped, refused, failed) and every retried attempt (retrying).",
    partitions=1, retention_ms=365 * DAY_MS,
)
DEADLETTER = TopicSpec(
    "deadletter.v1", "source topic", schema.DeadLetter,
    "Records that could not be processed, with the raw bytes and the reason.",
    partitions=1, retention_ms=30 * DAY_MS,
)

ROLLUPS = TopicSpec(
    "rollups.v1", "node name", schema.Rollup,
    "Per device per minute: min/mean/max utilisation, memory, power, faults, attributed pod.",
    node_keyed=True, retention_ms=3 * DAY_MS,
)

def worker_group(settings: Settings) -> str:
    """The worker's Faust app id, which is also its consumer group (the fleet agents' too)
    and the prefix of its tables' changelogs (``<group>-<table>-changelog``)."""
    return f"{settings.topic_prefix}-worker"


def changelog(settings: Settings, table: str) -> str:
    """The changelog topic Faust keeps for the worker's ``table`` (``node-state``,
    ``fleet-state``, ...)."""
    return f"{worker_group(settings)}-{table}-changelog"


def allocation_key(event: schema.PodAllocation | schema.NodeInventory) -> str:
    """The compaction key of an allocation event; its node part picks the partition."""
    if isinstance(event, schema.NodeInventory):
        return event.node
    pod = event.pod
    return f"{event.node}/pod/{pod.uid or f'{pod.namespace}/{pod.name}'}"


ALL: tuple[TopicSpec, ...] = (
    SAMPLES, HW_EVENTS, ALLOCATIONS, QUEUE, NODE_SUMMARIES,
    FINDINGS, ACTIONS, ACTION_RESULTS, DEADLETTER, ROLLUPS,
)
