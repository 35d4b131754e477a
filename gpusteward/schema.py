"""The payload contract of every gpusteward topic.

One module holds every message type so that producers, the stream worker,
the consumers and downstream teams read the same definitions. Payloads are
msgspec Structs encoded as JSON: decoding a Struct costs well under a
microsecond, against several for a Faust ``Record``, and the JSON Schema
files downstream consumers need are generated from these classes
(``gpusteward schema export DIR``).

Conventions:

- every message carries ``schema`` (the contract version, bumped on an
  incompatible change) and ``ts``, its event time in Unix seconds (float);
- optional readings are ``None`` when the source does not report them
  ("not supported" on a device is an absent value, never an error); device
  readings that are ``None`` are left out of the JSON to keep samples small,
  while top-level messages always carry every field, ``schema`` included;
- percentages are 0-100, memory in bytes, power in watts, clocks in MHz.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1


class PodRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pod, as attributed to a device or named by an action."""

    namespace: str
    name: str
    uid: str | None = None
    container: str | None = None


class DeviceSample(msgspec.Struct, omit_defaults=True):
    """One reading of one GPU or one MIG device."""

    uuid: str
    """``GPU-...`` for a whole GPU, ``MIG-...`` for a MIG device."""
    index: int
    """The GPU's index (minor number); for a MIG device, its parent's."""
    model: str
    """Product name as the driver reports it, e.g. ``NVIDIA A100-SXM4-80GB``."""
    kind: Literal["gpu", "mig"] = "gpu"
    parent_uuid: str | None = None
    """The parent GPU of a MIG device."""
    mig_profile: str | None = None
    """GPU-instance profile name of a MIG device, e.g. ``3g.40gb``."""
    gpu_instance_id: int | None = None
    util_pct: float | None = None
    """GPU utilisation (NVML / DCGM_FI_DEV_GPU_UTIL); not reported for MIG devices."""
    engine_active_pct: float | None = None
    """Graphics-engine active share (DCGM_FI_PROF_GR_ENGINE_ACTIVE x 100); the MIG measure."""
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temp_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    clock_event_reasons: int | None = None
    """NVML clock-event (throttle) reason bitmask."""
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    pcie_replay: int | None = None
    nvlink_errors: int | None = None
    recovery_action: int | None = None
    """NVML GPU recovery action (0 none, 1 GPU reset, 2 node reboot, ...)."""
    pod: PodRef | None = None
    """The pod holding this device, when the collector could attribute it."""


class NodeSample(msgspec.Struct):
    """All devices of one node at one tick. Topic ``samples``, key = node."""

    ts: float
    node: str
    source: str
    """Which collector produced it: simulator, nvml, dcgm, prometheus."""
    devices: list[DeviceSample]
    schema: int = SCHEMA_VERSION


HwEventKind = Literal[
    "xid", "ecc_sbe", "ecc_dbe", "gpu_lost", "remap_failure", "throttle_start", "throttle_stop"
]


class HwEvent(msgspec.Struct):
    """An urgent hardware event, sent at once outside the tick. Key = node."""

    ts: float
    node: str
    kind: HwEventKind
    uuid: str | None = None
    xid: int | None = None
    count: int | None = None
    detail: str = ""
    source: str = ""
    schema: int = SCHEMA_VERSION


class Taint(msgspec.Struct, frozen=True, omit_defaults=True):
    key: str
    effect: str
    value: str | None = None


PodPhase = Literal["pending", "bound", "running", "finished", "deleted"]


class PodAllocation(msgspec.Struct, tag="pod"):
    """A pod's hold on GPUs or MIG devices of a node. Topic ``allocations``, key = node."""

    ts: float
    node: str
    pod: PodRef
    phase: PodPhase
    gpus: int = 0
    """Whole GPUs requested (``nvidia.com/gpu``)."""
    mig: dict[str, int] = {}
    """MIG devices requested, by profile name (``nvidia.com/mig-3g.40gb`` -> ``3g.40gb``)."""
    device_ids: list[str] = []
    """The device UUIDs the kubelet assigned, when known."""
    started_at: float | None = None
    owner_kind: str | None = None
    owner_name: str | None = None
    workload_kind: str | None = None
    """notebook, batch or inference, from labels or the owner chain."""
    queue: str | None = None
    priority_class: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    spot_tolerant: bool = False
    schema: int = SCHEMA_VERSION
    gang: str | None = None
    """The gang the pod belongs to, ``<Kind>/<name>`` in its namespace (a JobSet, a
    PyTorchJob, a coscheduling or Volcano PodGroup, a Kueue pod group), when it is one of
    several pods that only work together; None: not a gang member."""
    gang_size: int | None = None
    """Members the gang needs to run (PodGroup ``minMember``, Kueue pod-set counts, replica
    counts of the GPU replicas); None: not known (yet)."""


class NodeInventory(msgspec.Struct, tag="node"):
    """A node's GPU inventory and schedulability. Topic ``allocations``, key = node."""

    ts: float
    node: str
    gpu_product: str | None = None
    gpu_count: int = 0
    mig_strategy: str | None = None
    mig_config: str | None = None
    allocatable: dict[str, int] = {}
    labels: dict[str, str] = {}
    taints: list[Taint] = []
    unschedulable: bool = False
    spot: bool = False
    deleted: bool = False
    schema: int = SCHEMA_VERSION
    capacity: dict[str, int] = {}
    """GPU and MIG capacity (``nvidia.com/gpu``, ``nvidia.com/mig-*``), as ``allocatable``."""
    gpu_memory_mib: int | None = None
    """GPU Operator label ``nvidia.com/gpu.memory`` (of a MIG device under ``single``)."""
    mig_capable: bool | None = None
    """GPU Operator label ``nvidia.com/mig.capable``; None when not labelled."""
    mig_config_state: str | None = None
    """``nvidia.com/mig.config.state``: pending, rebooting, success or failed (mig-manager)."""


AllocationEvent = PodAllocation | NodeInventory

WorkloadState = Literal["pending", "admitted", "evicted", "requeued", "finished", "deleted"]


class QueueEvent(msgspec.Struct):
    """A queued workload (Kueue Workload or a pending pod). Topic ``queue``, key = cluster queue."""

    ts: float
    name: str
    namespace: str
    cluster_queue: str
    state: WorkloadState
    queue: str | None = None
    created_at: float | None = None
    admitted_at: float | None = None
    gpus: int = 0
    mig: dict[str, int] = {}
    priority: int | None = None
    schema: int = SCHEMA_VERSION
    kind: Literal["workload", "pod"] | None = None
    """What waits: a Kueue Workload or a GPU pod without a node; None when unknown."""
    uid: str | None = None
    priority_class: str | None = None
    reason: str | None = None
    """Reason of the condition that decided ``state`` (e.g. ``Preempted/InClusterQueue``)."""
    active: bool = True
    """A Kueue Workload's ``spec.active``; False once deactivated (stopped)."""
    gang: str | None = None
    """As :attr:`PodAllocation.gang`. A gang member pod is reported here through its whole
    life (pending, ``admitted`` once bound to a node, finished or deleted), so the fleet
    agent sees every member of a gang on the queue topic; a Kueue Workload names the gang of
    the pods it admits (its owner)."""
    gang_size: int | None = None
    """As :attr:`PodAllocation.gang_size`."""


class IdleHold(msgspec.Struct, frozen=True, omit_defaults=True):
    """A device of the node whose holder the idle rule has an open episode on."""

    device: str
    pod: PodRef
    idle_since: float
    """Start of the idle episode (after the start-up grace), Unix seconds."""
    gpus: int = 0
    """Whole GPUs it frees when reclaimed (1 for a GPU device, 0 for a MIG device)."""
    mig_profile: str | None = None
    """The MIG profile it frees, for a MIG device."""
    workload_kind: str | None = None
    kept_until: float | None = None
    """Until when a ``gpusteward.io/keep-until`` annotation holds it (Unix seconds)."""
    ladder_step: int = 1
    """The idle rule's ladder step: 1 notified, 2 warned, 3 reclaim asked."""


class NodeSummary(msgspec.Struct):
    """Free capacity and health of a node for fleet-wide rules. Compacted, key = node."""

    ts: float
    node: str
    gpu_model: str | None
    gpus_total: int
    gpus_free: int
    mig_free: dict[str, int] = {}
    healthy: bool = True
    cordoned: bool = False
    spot: bool = False
    schema: int = SCHEMA_VERSION
    pool: str | None = None
    """The node's pool (the policy's node-pool label), for demand matched by pool."""
    idle: list[IdleHold] = []
    """Devices held by pods the idle rule finds idle (open, not exempt episodes): what the
    fleet agent may reclaim for waiting work (demand-aware reclaim)."""
    held_by_team: dict[str, float] = {}
    """GPUs held on the node by team (whole-GPU equivalents; a MIG device counts its share
    of compute slices), for team GPU-hour budgets."""


Severity = Literal["info", "warning", "critical"]
FindingState = Literal["firing", "resolved"]


class Subject(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a finding or action is about; any of the parts may be absent."""

    node: str | None = None
    device: str | None = None
    pod: PodRef | None = None
    queue: str | None = None


class Evidence(msgspec.Struct, omit_defaults=True):
    """The window of observations that made a rule fire."""

    window_start: float
    window_end: float
    samples: int = 0
    values: dict[str, float] = {}


class Finding(msgspec.Struct):
    """A detected problem. Topic ``findings``, key = fingerprint.

    ``fingerprint`` names the problem (rule + subject) and is stable across
    episodes; ``id`` names one episode (fingerprint + window start) and is the
    same on every redelivery, so consumers deduplicate on it.
    """

    id: str
    fingerprint: str
    kind: str
    severity: Severity
    state: FindingState
    subject: Subject
    summary: str
    starts_at: float
    ts: float
    ends_at: float | None = None
    evidence: Evidence | None = None
    runbook: str = ""
    labels: dict[str, str] = {}
    schema: int = SCHEMA_VERSION


ActionVerb = Literal["notify_owner", "cordon", "taint", "drain", "requeue", "set_mig_config"]


class Action(msgspec.Struct):
    """A remediation the pipeline asks for. Topic ``actions``, key = subject.

    ``idempotency_key`` is deterministic (finding id + verb): executing the
    same key twice must have the effect of executing it once.
    """

    idempotency_key: str
    verb: ActionVerb
    target: Subject
    reason: str
    rule: str
    finding_ids: list[str]
    ts: float
    dry_run: bool = False
    """Set when the rule's policy wants only a dry run: no executor carries it out."""
    params: dict[str, str] = {}
    schema: int = SCHEMA_VERSION


Outcome = Literal["executed", "dry_run", "skipped", "refused", "failed", "retrying"]
"""``retrying``: one attempt met a temporary error (a 503, a 429, a timeout) and another
follows; the action's last record carries its final outcome."""


class ActionResult(msgspec.Struct):
    """The audit record of one decision on one action. Key = idempotency key."""

    idempotency_key: str
    verb: ActionVerb
    target: Subject
    outcome: Outcome
    detail: str
    actor: str
    ts: float
    error: str | None = None
    """The error of a ``retrying`` or ``failed`` attempt (its class and message, cut)."""
    attempt: int = 1
    """Which try of the backend call this record reports, from 1 (retries count up)."""
    schema: int = SCHEMA_VERSION


class DeadLetter(msgspec.Struct):
    """A record that could not be processed, kept whole with the reason."""

    source_topic: str
    partition: int
    offset: int
    error: str
    ts: float
    key: bytes | None = None
    value: bytes | None = None
    schema: int = SCHEMA_VERSION


def json_schema(struct: Any) -> dict[str, Any]:
    """The JSON Schema of one payload type (with its referenced definitions)."""
    return msgspec.json.schema(struct)


class Rollup(msgspec.Struct, omit_defaults=True):
    """One device over one minute of event time. Topic ``rollups``, key = node.

    Flat on purpose: one rollup is one row of the Parquet store the weekly
    report reads. ``util_*`` is the device's activity measure (GPU
    utilisation, or graphics-engine activity on a MIG device).
    """

    ts: float
    """Start of the minute, Unix seconds (a multiple of 60)."""
    node: str
    uuid: str
    model: str
    samples: int
    kind: Literal["gpu", "mig"] = "gpu"
    index: int = 0
    parent_uuid: str | None = None
    mig_profile: str | None = None
    gpu_fraction: float = 1.0
    """Share of a whole GPU the device is (compute slices / total for MIG): GPU-hours weight."""
    util_min: float | None = None
    util_mean: float | None = None
    util_max: float | None = None
    mem_used_mean: float | None = None
    mem_used_max: int | None = None
    mem_total_bytes: int | None = None
    power_mean: float | None = None
    power_max: float | None = None
    temp_max: float | None = None
    throttled_samples: int = 0
    """Samples with a thermal or power-brake clock-event reason set."""
    ecc_dbe_new: int = 0
    """Double-bit ECC errors that appeared during the minute."""
    xid_count: int = 0
    namespace: str | None = None
    pod: str | None = None
    owner_kind: str | None = None
    owner_name: str | None = None
    team: str | None = None
    workload_kind: str | None = None
    queue: str | None = None
    schema: int = SCHEMA_VERSION
