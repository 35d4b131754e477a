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

Every number and string is bounded (``msgspec.Meta``), so that a decoded
record is also one every consumer can hold, compare and re-encode: integers
fit in int64 (msgpack state and Parquet cannot take more), readings lie in
their unit's physical range, timestamps between 1970 and 2100, names within
Kubernetes' limits, lists and maps within what a node can have. A record
outside these bounds fails to decode, the reason naming the field, and goes
to the dead-letter topic like any other malformed record. ``schema`` accepts
only versions this build knows.

It stays one module on purpose: it is the contract, every topic's payload in one place,
so docs/topics.md and the JSON Schemas are generated from one file.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

SCHEMA_VERSION = 1

INT64_MAX = 2**63 - 1
TS_MAX = 4_102_444_800.0
"""2100-01-01T00:00:00Z: a later event time is a broken clock or a broken record."""

Version = Annotated[int, Meta(ge=1, le=SCHEMA_VERSION,
                              description="Contract version; later versions are refused.")]
Timestamp = Annotated[float, Meta(ge=0.0, le=TS_MAX, description="Unix seconds.")]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
"""A counter, an amount of bytes or of devices: non-negative, within int64."""
Int64 = Annotated[int, Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
Index = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
"""A GPU's index (minor number); -1 when the source does not say."""
Percent = Annotated[float, Meta(ge=0.0, le=100.0)]
Celsius = Annotated[float, Meta(ge=-273.15, le=1000.0)]
Watts = Annotated[float, Meta(ge=0.0, le=100_000.0)]
Megahertz = Annotated[int, Meta(ge=0, le=100_000)]
Name = Annotated[str, Meta(max_length=253)]
"""A Kubernetes object name, label key, node, device UUID or queue (DNS subdomain: 253)."""
Key = Annotated[str, Meta(max_length=1024)]
"""A composite name: a fingerprint, an idempotency key, a finding id."""
TEXT_MAX = 16_384
Text = Annotated[str, Meta(max_length=TEXT_MAX)]
"""Free text: a label value, a reason, a summary, an error."""
Annotation = Annotated[str, Meta(max_length=262_144)]
"""An annotation value: Kubernetes limits all of an object's annotations to 256 KiB."""
Labels = Annotated[dict[Key, Text], Meta(max_length=1024)]
Annotations = Annotated[dict[Key, Annotation], Meta(max_length=1024)]
Counts = Annotated[dict[Name, Count], Meta(max_length=1024)]
"""Devices or slices by resource or profile name."""
Names = Annotated[list[Key], Meta(max_length=4096)]
GpuShare = Annotated[float, Meta(ge=0.0, le=1_000_000.0,
                                 description="Whole-GPU equivalents (a MIG device: its share).")]
WORKLOAD_KINDS = ("notebook", "batch", "inference")
"""The workload kinds a pod can be given (``workload_kind``): the watcher sets one of these
or none, so the policy refuses any other name where it selects pods by kind."""


class PodRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pod, as attributed to a device or named by an action."""

    namespace: Name
    name: Name
    uid: Name | None = None
    container: Name | None = None


class DeviceHolder(msgspec.Struct, omit_defaults=True):
    """One pod's share of a device that several pods may use (time-slicing, MPS).

    Filled by the NVML collector from the processes running on the device,
    each mapped to its pod through the host's ``/proc/<pid>/cgroup``, and by
    the dcgm and Prometheus sources from dcgm-exporter's per-pod series
    (``--kubernetes-virtual-gpus``); listed without readings by sources that
    see the pods but cannot split the device's readings between them (see
    ``DeviceSample.attribution``).
    """

    pod: PodRef | None = None
    """The pod, when the collector could name it (PodResources lists it on the device)."""
    pod_uid: Name | None = None
    """The pod's uid from the processes' cgroup; the worker joins it to the pod's allocation
    when ``pod`` is absent (several pods on the device, PodResources names no uid)."""
    processes: Count = 0
    """Processes of the pod running on the device (compute and MPS clients)."""
    activity_pct: Percent | None = None
    """The pod's SM utilisation on the device (sum over its processes, 0-100, NVML
    per-process samples); None when not reported (e.g. MIG devices) or not split."""
    mem_used_bytes: Count | None = None
    """Framebuffer memory the pod's processes use on the device; None when not reported."""
    mps: bool = False
    """Its processes are MPS clients (they share one MPS server context)."""


Attribution = Literal["device", "process", "shared"]
"""How the pods of a device were found: ``device``, one pod holds the whole device and the
readings are its own; ``process``, the readings of each holder are its own processes'
(NVML per-process, or dcgm-exporter's per-pod ``vgpu`` series); ``shared``, several pods
hold the device and the source cannot split its readings between them (dcgm-exporter
without per-pod series), or they hold it through one DRA ResourceClaim: one allocation,
idle for all of them or for none, whatever each one's own readings in ``holders`` say."""


class DeviceSample(msgspec.Struct, omit_defaults=True):
    """One reading of one GPU or one MIG device."""

    uuid: Name
    """``GPU-...`` for a whole GPU, ``MIG-...`` for a MIG device."""
    index: Index
    """The GPU's index (minor number); for a MIG device, its parent's."""
    model: Name
    """Product name as the driver reports it, e.g. ``NVIDIA A100-SXM4-80GB``."""
    kind: Literal["gpu", "mig"] = "gpu"
    parent_uuid: Name | None = None
    """The parent GPU of a MIG device."""
    mig_profile: Name | None = None
    """GPU-instance profile name of a MIG device, e.g. ``3g.40gb``."""
    gpu_instance_id: Count | None = None
    util_pct: Percent | None = None
    """GPU utilisation (NVML / DCGM_FI_DEV_GPU_UTIL); not reported for MIG devices."""
    engine_active_pct: Percent | None = None
    """Graphics-engine active share (DCGM_FI_PROF_GR_ENGINE_ACTIVE x 100); the MIG measure."""
    mem_used_bytes: Count | None = None
    mem_total_bytes: Count | None = None
    temp_c: Celsius | None = None
    slowdown_temp_c: Celsius | None = None
    """The GPU's own slowdown temperature (NVML's NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, what
    ``nvidia-smi -q`` calls "GPU Slowdown Temp"); None where the source does not say, and
    the thermal rule's per-model table stands in."""
    power_w: Watts | None = None
    sm_clock_mhz: Megahertz | None = None
    clock_event_reasons: Count | None = None
    """NVML clock-event (throttle) reason bitmask."""
    ecc_sbe_volatile: Count | None = None
    ecc_dbe_volatile: Count | None = None
    remapped_rows_correctable: Count | None = None
    remapped_rows_uncorrectable: Count | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages_sbe: Count | None = None
    """Framebuffer pages retired for repeated single-bit ECC errors (dynamic page retirement,
    pre-Ampere GPUs such as T4 and V100; NVML nvmlDeviceGetRetiredPages, DCGM_FI_DEV_RETIRED_SBE).
    None on Ampere and newer, where row remapping replaces it."""
    retired_pages_dbe: Count | None = None
    """Framebuffer pages retired for a double-bit ECC error (DCGM_FI_DEV_RETIRED_DBE)."""
    retired_pages_pending: bool | None = None
    """A page waits for retirement, which takes effect at the next GPU reset or driver reload
    (nvmlDeviceGetRetiredPagesPendingStatus, DCGM_FI_DEV_RETIRED_PENDING)."""
    pcie_replay: Count | None = None
    nvlink_errors: Count | None = None
    """NVLink replay + recovery errors, summed over the GPU's links (NVML / DCGM
    ``*_NVLINK_REPLAY_ERROR_COUNT_TOTAL`` + ``*_NVLINK_RECOVERY_ERROR_COUNT_TOTAL``): the
    errors DCGM's health check fails on at the first one. CRC errors are not in it (see
    ``nvlink_crc_errors``); a collector older than that field sent CRC + replay + recovery
    here, and it is judged as it was."""
    nvlink_crc_errors: Count | None = None
    """NVLink CRC errors, flit + data, summed over the GPU's links (NVML / DCGM
    ``*_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL`` + ``*_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL``).
    Routine on a healthy link (link training, a slow trickle): judged on its own rate.
    None where the GPU has no NVLink or the source does not read it."""
    recovery_action: Count | None = None
    """NVML GPU recovery action (0 none, 1 GPU reset, 2 node reboot, ...)."""
    pod: PodRef | None = None
    """The pod holding this device, when the collector could attribute it (on a device
    several pods hold, the first of ``holders`` with a name: kept for older consumers)."""
    holders: Annotated[list[DeviceHolder], Meta(max_length=1024)] = []
    """Every pod with work on the device, each with its own activity and memory where the
    source can split them (see ``attribution``); empty when not known."""
    attribution: Attribution | None = None
    """How ``pod`` and ``holders`` were found; None when the source attributes no pod."""


class NodeSample(msgspec.Struct):
    """All devices of one node at one tick. Topic ``samples``, key = node."""

    ts: Timestamp
    node: Name
    source: Name
    """Which collector produced it: simulator, nvml, dcgm, prometheus."""
    devices: Annotated[list[DeviceSample], Meta(max_length=1024)]
    schema: Version = SCHEMA_VERSION


HwEventKind = Literal[
    "xid", "ecc_sbe", "ecc_dbe", "gpu_lost", "remap_failure", "throttle_start", "throttle_stop"
]


class HwEvent(msgspec.Struct):
    """An urgent hardware event, sent at once outside the tick. Key = node."""

    ts: Timestamp
    node: Name
    kind: HwEventKind
    uuid: Name | None = None
    xid: Count | None = None
    count: Count | None = None
    detail: Text = ""
    source: Name = ""
    schema: Version = SCHEMA_VERSION


class Taint(msgspec.Struct, frozen=True, omit_defaults=True):
    key: Name
    effect: Name
    value: Text | None = None


PodPhase = Literal["pending", "bound", "running", "finished", "deleted"]


class PodAllocation(msgspec.Struct, tag="pod"):
    """A pod's hold on GPUs or MIG devices of a node. Topic ``allocations``, key = node."""

    ts: Timestamp
    node: Name
    pod: PodRef
    phase: PodPhase
    gpus: Count = 0
    """Whole GPUs requested (``nvidia.com/gpu``)."""
    mig: Counts = {}
    """MIG devices requested, by profile name (``nvidia.com/mig-3g.40gb`` -> ``3g.40gb``)."""
    device_ids: Annotated[list[Name], Meta(max_length=1024)] = []
    """The device UUIDs the kubelet assigned, when known."""
    started_at: Timestamp | None = None
    owner_kind: Name | None = None
    owner_name: Name | None = None
    workload_kind: Name | None = None
    """notebook, batch or inference, from labels or the owner chain."""
    queue: Name | None = None
    priority_class: Name | None = None
    labels: Labels = {}
    annotations: Annotations = {}
    spot_tolerant: bool = False
    schema: Version = SCHEMA_VERSION
    gang: Name | None = None
    """The gang the pod belongs to, ``<Kind>/<name>`` in its namespace (a JobSet, a
    PyTorchJob, a coscheduling or Volcano PodGroup, a Kueue pod group), when it is one of
    several pods that only work together; None: not a gang member."""
    gang_size: Count | None = None
    """Members the gang needs to run (PodGroup ``minMember``, Kueue pod-set counts, replica
    counts of the GPU replicas); None: not known (yet)."""
    images: Annotated[list[Text], Meta(max_length=64)] = []
    """The images of the pod's containers that ask for GPUs (every app container's where
    none does: a pod whose GPUs come from a resource claim), as its spec names them: how
    the memory rules know a framework that reserves its memory pool when it starts
    (``exempt_images``); empty from a watcher before 2026-11-27."""
    memory_grows: bool = False
    """The environment of one of those containers turns its framework's memory pool off
    (:data:`gpusteward.collectors.kubernetes.translate.MEMORY_GROWS`: TensorFlow's allow
    growth, JAX's preallocation off): the memory it uses is what it holds, so its image or
    owner does not exempt it from ``gpu_memory_high``. False where the spec does not say (a
    value from a ConfigMap or Secret, which the watcher does not read), and from a watcher
    before 2026-11-28."""


class NodeInventory(msgspec.Struct, tag="node"):
    """A node's GPU inventory and schedulability. Topic ``allocations``, key = node."""

    ts: Timestamp
    node: Name
    gpu_product: Name | None = None
    gpu_count: Count = 0
    mig_strategy: Name | None = None
    mig_config: Name | None = None
    allocatable: Counts = {}
    labels: Labels = {}
    taints: Annotated[list[Taint], Meta(max_length=1024)] = []
    unschedulable: bool = False
    spot: bool = False
    deleted: bool = False
    schema: Version = SCHEMA_VERSION
    capacity: Counts = {}
    """GPU and MIG capacity (``nvidia.com/gpu``, ``nvidia.com/mig-*``), as ``allocatable``."""
    gpu_memory_mib: Count | None = None
    """GPU Operator label ``nvidia.com/gpu.memory`` (of a MIG device under ``single``)."""
    mig_capable: bool | None = None
    """GPU Operator label ``nvidia.com/mig.capable``; None when not labelled."""
    mig_config_state: Name | None = None
    """``nvidia.com/mig.config.state``: pending, rebooting, success or failed (mig-manager)."""
    gpu_replicas: Count = 1
    """Pods each physical GPU is advertised to (GPU Operator label ``nvidia.com/gpu.replicas``:
    time-slicing or MPS replicas); 1 when not shared. ``gpu_count`` counts physical GPUs,
    ``capacity`` the advertised replicas."""
    gpu_sharing: Name | None = None
    """``nvidia.com/gpu.sharing-strategy``: ``time-slicing``, ``mps`` or ``none``."""


MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
"""The device plugin's extended resources under the ``mixed`` strategy, one per profile."""


def mig_resource_profile(resource: str) -> str | None:
    """The MIG profile of a resource name, or None when it is not a MIG resource.

    ``nvidia.com/mig-1g.10gb`` -> ``1g.10gb``; ``nvidia.com/mig-1g.10gb.me`` ->
    ``1g.10gb+me`` (the device plugin writes a profile's ``+`` as ``.``). Every reader of
    ``allocatable``, ``capacity`` and pod requests spells profiles this way, as NVML and
    ``mig_profiles.yaml`` do, so a held ``+me`` device is taken off the free one.
    """
    if not resource.startswith(MIG_RESOURCE_PREFIX):
        return None
    name = resource[len(MIG_RESOURCE_PREFIX):]
    match = _DOTTED_VARIANT.fullmatch(name)
    return f"{match[1]}+{match[2]}" if match else name


def single_strategy_profile(product: str | None) -> str | None:
    """The MIG profile a ``single``-strategy node advertises as ``nvidia.com/gpu``, from its
    ``nvidia.com/gpu.product`` label (``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb`` -> ``1g.5gb``);
    None when the label names none or the strategy is invalid on the node (``-MIG-INVALID``).

    GFD drops characters a label value cannot hold, ``+`` among them: ``1g.10gbme`` is
    ``1g.10gb+me``."""
    _, sep, profile = (product or "").rpartition("-MIG-")
    if not sep or not profile or profile == "INVALID":
        return None
    match = _LABELLED_VARIANT.fullmatch(profile)
    return f"{match[1]}+{match[2]}" if match else profile


_DOTTED_VARIANT = re.compile(r"(\d+g\.\d+gb)\.(\w+)")
_LABELLED_VARIANT = re.compile(r"(\d+g\.\d+gb)(me|gfx)")


AllocationEvent = PodAllocation | NodeInventory

WorkloadState = Literal["pending", "admitted", "evicted", "requeued", "finished", "deleted"]

KUEUE_GATED = "SchedulingGated/kueue.x-k8s.io/admission"
"""``QueueEvent.reason`` of a pod Kueue holds at its admission gate (its pod integration,
pod groups): its Kueue Workload reports that wait, so the pod is not waiting on its own."""


class PodSet(msgspec.Struct, frozen=True, omit_defaults=True):
    """Pods of one shape in a Kueue Workload: ``count`` pods of ``gpus`` GPUs and ``mig``
    devices each."""

    count: Count
    gpus: Count = 0
    mig: Counts = {}


class QueueEvent(msgspec.Struct):
    """A queued workload (Kueue Workload or a pending pod). Topic ``queue``, key = cluster queue."""

    ts: Timestamp
    name: Name
    namespace: Name
    cluster_queue: Name
    state: WorkloadState
    queue: Name | None = None
    created_at: Timestamp | None = None
    admitted_at: Timestamp | None = None
    gpus: Count = 0
    mig: Counts = {}
    priority: Int64 | None = None
    schema: Version = SCHEMA_VERSION
    kind: Literal["workload", "pod"] | None = None
    """What waits: a Kueue Workload or a GPU pod without a node; None when unknown."""
    uid: Name | None = None
    priority_class: Name | None = None
    reason: Text | None = None
    """Reason of the condition that decided ``state`` (e.g. ``Preempted/InClusterQueue``)."""
    active: bool = True
    """A Kueue Workload's ``spec.active``; False once deactivated (stopped)."""
    gang: Name | None = None
    """As :attr:`PodAllocation.gang`. A gang member pod is reported here through its whole
    life (pending, ``admitted`` once bound to a node, finished or deleted), so the fleet
    agent sees every member of a gang on the queue topic; a Kueue Workload names the gang of
    the pods it admits (its owner)."""
    gang_size: Count | None = None
    """As :attr:`PodAllocation.gang_size`."""
    waiting_since: Timestamp | None = None
    """When its current wait began, as the API states it: for a Kueue Workload back in the
    queue after an eviction, the time of its ``Requeued`` condition (else ``Evicted``). None:
    a first wait (from ``created_at``), or not stated (from the event)."""
    pod_sets: Annotated[list[PodSet], Meta(max_length=64)] = []
    """A Kueue Workload's GPU pod sets (Kueue allows 18), whose pods together ask for
    ``gpus`` and ``mig``: each pod needs room on some node, not the whole workload on one.
    Empty for a pod (its ``gpus`` and ``mig`` are one pod's) and where not known."""

    @property
    def waiting(self) -> bool:
        """Whether it waits for admission: pending, evicted or requeued, and active. A
        deactivated Kueue Workload (``spec.active: false``, e.g. ``kueuectl stop``) is
        evicted and stays so, but Kueue admits it only once reactivated: it does not wait.
        Nor does a pod held at Kueue's admission gate: its Workload's event is the wait."""
        return self.state in ("pending", "evicted", "requeued") and self.active and \
            self.reason != KUEUE_GATED


class IdleHold(msgspec.Struct, frozen=True, omit_defaults=True):
    """A device of the node whose holder the idle rule has an open episode on: what
    demand-aware reclaim may offer to waiting work (one member of a gang is left out:
    reclaiming it would stop the whole gang)."""

    device: Name
    pod: PodRef
    idle_since: Timestamp
    """Start of the idle episode (after the start-up grace), Unix seconds."""
    gpus: Count = 0
    """Whole GPUs it frees when reclaimed: 1 for a GPU device, all of them for a pod of
    several (one hold, on the device its idle episode is on), 0 for a MIG device."""
    mig_profile: Name | None = None
    """The MIG profile it frees, for a MIG device."""
    workload_kind: Name | None = None
    kept_until: Timestamp | None = None
    """Until when a ``gpusteward.io/keep-until`` annotation holds it (Unix seconds)."""
    ladder_step: Annotated[int, Meta(ge=0, le=3)] = 1
    """The idle rule's ladder step: 1 notified, 2 warned, 3 reclaim asked."""
    gang: Name | None = None
    """The gang the pod is one member of (:attr:`PodAllocation.gang`), in
    :attr:`NodeSummary.idle_gangs` only."""


class NodeSummary(msgspec.Struct):
    """Free capacity and health of a node for fleet-wide rules. Compacted, key = node."""

    ts: Timestamp
    node: Name
    gpu_model: Name | None
    gpus_total: Count
    gpus_free: Int64
    mig_free: Annotated[dict[Name, Int64], Meta(max_length=1024)] = {}
    healthy: bool = True
    cordoned: bool = False
    """The node takes no new pods: cordoned, or tainted NoSchedule/NoExecute by Kubernetes
    (not ready, unreachable) or by gpusteward (``gpusteward.io/*``)."""
    spot: bool = False
    schema: Version = SCHEMA_VERSION
    gpu_replicas: Count = 1
    """Pods each GPU is shared by (time-slicing or MPS replicas); ``gpus_total`` and
    ``gpus_free`` count physical GPUs, a GPU with any holder being not free."""
    replicas_free: Count | None = None
    """On a node whose GPUs are shared (``gpu_replicas`` > 1), the replicas no pod holds:
    there a request of N ``nvidia.com/gpu`` asks N replicas, not N GPUs. None: not shared
    (or not known), requests count in ``gpus_free``."""
    pool: Name | None = None
    """The node's pool (the policy's node-pool label), for demand matched by pool."""
    idle: Annotated[list[IdleHold], Meta(max_length=4096)] = []
    """Devices held by pods the idle rule finds idle (open, not exempt episodes): what the
    fleet agent may reclaim for waiting work (demand-aware reclaim)."""
    idle_gangs: Annotated[list[IdleHold], Meta(max_length=4096)] = []
    """The same for pods that are one member of a gang (:attr:`IdleHold.gang`), never
    offered to waiting work: reclaiming one would stop the whole gang. The fleet agent's
    gang rule suspends a gang once every member is idle. A list of its own, so that a
    fleet agent of an earlier build (a rolling upgrade) offers none of them."""
    held_by_team: Annotated[dict[Name, GpuShare], Meta(max_length=1024)] = {}
    """GPUs held on the node by team (whole-GPU equivalents; a MIG device counts its share
    of compute slices), for team GPU-hour budgets."""
    clock_steps: Count = 0
    """How many stepped-back clocks of the node the node join has taken (see
    docs/reliability.md "Clocks"): a summary with more is on a newer clock and follows one
    with fewer however old its time (:func:`summary_follows`)."""
    deleted: bool = False
    """The node was deleted from Kubernetes: this summary is its tombstone. It offers and
    holds nothing (``gpus_total``, ``gpus_free`` 0, no MIG devices, idle holds or team
    holdings) and the node leaves the fleet's view (capacity, fragmentation, start
    estimates, MIG advice, ``gpusteward status``) until a later summary says otherwise: the
    node created again under its name. A consumer that ignores the field counts no GPU of
    it either. Every summary the node join sends for the node until then is one, so a
    redelivered or late one keeps it out."""
    mig_total: Annotated[dict[Name, Int64], Meta(max_length=1024)] = {}
    """MIG devices the node's layout offers by profile (its allocatable ``nvidia.com/mig-*``),
    held or not: what a MIG request could ever get there without a layout change. Empty on
    a node without MIG and from a build before this field (then not known)."""
    mig_changing: bool = False
    """mig-manager is changing the node's MIG layout (``nvidia.com/mig.config.state``
    ``pending`` or ``rebooting``): ``mig_total`` is the layout being replaced, and what the
    node will offer is known only once its allocatable changes. Meanwhile a MIG request that
    no layout offers is not told it can never start (:func:`.rules.fragmentation.mig_layouts`).
    False from a build before 2026-11-28."""


def summary_follows(summary: NodeSummary, ts: float, clock_steps: int) -> bool:
    """``summary`` is newer than the node's last one, of time ``ts`` after ``clock_steps``
    clock steps: on a clock taken since (its time may be an hour before the last one's
    after an hour's step), or later on the same one. A summary of an earlier clock is not,
    however late its time (a redelivered one): where the node join's count restarted (its
    state dropped, or an older release's), the fleet agent takes the node's summaries
    again once it has let the node go as stale (``node_stale_s``)."""
    if summary.clock_steps != clock_steps:
        return summary.clock_steps > clock_steps
    return summary.ts > ts


Severity = Literal["info", "warning", "critical"]
FindingState = Literal["firing", "resolved"]


class Subject(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a finding or action is about; any of the parts may be absent."""

    node: Name | None = None
    device: Name | None = None
    pod: PodRef | None = None
    queue: Name | None = None


class Evidence(msgspec.Struct, omit_defaults=True):
    """The window of observations that made a rule fire."""

    window_start: Timestamp
    window_end: Timestamp
    samples: Count = 0
    values: Annotated[dict[Name, float], Meta(max_length=1024)] = {}


class Finding(msgspec.Struct):
    """A detected problem. Topic ``findings``, key = fingerprint.

    ``fingerprint`` names the problem (rule + subject) and is stable across
    episodes; ``id`` names one episode (fingerprint + window start) and is the
    same on every redelivery, so consumers deduplicate on it.
    """

    id: Key
    fingerprint: Key
    kind: Name
    severity: Severity
    state: FindingState
    subject: Subject
    summary: Text
    starts_at: Timestamp
    ts: Timestamp
    ends_at: Timestamp | None = None
    evidence: Evidence | None = None
    runbook: Text = ""
    labels: Labels = {}
    schema: Version = SCHEMA_VERSION


ActionVerb = Literal["notify_owner", "cordon", "taint", "drain", "requeue", "set_mig_config"]


class Action(msgspec.Struct):
    """A remediation the pipeline asks for. Topic ``actions``, key = subject (its node, else
    ``namespace/pod``, else its queue, else empty: :data:`gpusteward.topics.ACTIONS`).

    ``idempotency_key`` is deterministic (finding id + verb): executing the
    same key twice must have the effect of executing it once.
    """

    idempotency_key: Key
    verb: ActionVerb
    target: Subject
    reason: Text
    rule: Name
    finding_ids: Names
    ts: Timestamp
    dry_run: bool = False
    """Set when the rule's policy wants only a dry run: no executor carries it out."""
    params: Labels = {}
    reask: Count = 0
    """How many times the worker has asked for this action again while its finding stays
    open: 0 the first ask; each re-ask (every ``reask_s`` of the node's event time, node
    actions of hardware findings only) has the same ``idempotency_key`` and a fresh ``ts``.
    An executor still carries a key out once; a re-ask lets an action refused as stale, or
    never delivered, be decided on fresh facts."""
    schema: Version = SCHEMA_VERSION


Outcome = Literal["executed", "dry_run", "skipped", "refused", "failed", "retrying"]
"""``retrying``: one attempt met a temporary error (a 503, a 429, a timeout) and another
follows; the action's last record carries its final outcome."""


RESTORE_KEY_PREFIX = "restore/"
"""The idempotency key of an operator's restore (``gpusteward act --restore``) is this,
then the restored owner (``KIND/NAMESPACE/NAME``) and ``/<ms>``: the audit record of an
undone reclaim, which the weekly report matches to the reclaim it undid."""


class ActionResult(msgspec.Struct):
    """The audit record of one decision on one action. Key = idempotency key."""

    idempotency_key: Key
    verb: ActionVerb
    target: Subject
    outcome: Outcome
    detail: Text
    actor: Name
    ts: Timestamp
    error: Text | None = None
    """The error of a ``retrying`` or ``failed`` attempt (its class and message, cut)."""
    attempt: Count = 1
    """Which try of the backend call this record reports, from 1 (retries count up)."""
    schema: Version = SCHEMA_VERSION


class DeadLetter(msgspec.Struct):
    """A record that could not be processed, kept with the reason. Key = source topic.

    ``error`` says why: the edge's refusal (``invalid: ... - at `$.devices[0].temp_c```)
    or, prefixed by the agent, what processing raised."""

    source_topic: Name
    partition: Count
    offset: Int64
    error: Text
    ts: Timestamp
    key: bytes | None = None
    value: bytes | None = None
    schema: Version = SCHEMA_VERSION
    value_bytes: Count | None = None
    """Size of the record's value; larger than ``value`` when it was cut."""
    truncated: bool = False
    """The value was cut (a dead letter must fit the broker's message limit, and the
    value travels base64-encoded in it)."""


def json_schema(struct: Any) -> dict[str, Any]:
    """The JSON Schema of one payload type (with its referenced definitions)."""
    return msgspec.json.schema(struct)


class Rollup(msgspec.Struct, omit_defaults=True):
    """One device over one minute of event time. Topic ``rollups``, key = node.

    Flat on purpose: one rollup is one row of the Parquet store the weekly
    report reads. ``util_*`` is the device's activity measure (GPU
    utilisation, or graphics-engine activity on a MIG device).

    A device several pods hold (time-slicing, MPS) has one row per holder,
    named by (uuid, ts, namespace, pod): ``gpu_fraction`` is the holder's share
    (the device's split evenly between the pods holding it), memory its own
    where the source split it, and ``util_*`` its activity relative to that
    share (its own SM utilisation of the whole device times the holders: above
    100 when it used more than its share; the device's own where the source
    cannot split), so ``gpu_fraction x util`` is its used GPU time.

    ``clock`` tells a node's clocks apart: after its collector's clock steps back
    and the node join takes the new one, minutes already named on the old clock
    are named again, and each is a minute of its own, so a row is named by
    (uuid, ts, namespace, pod, clock).
    """

    ts: Timestamp
    """Start of the minute, Unix seconds (a multiple of 60)."""
    node: Name
    uuid: Name
    model: Name
    samples: Count
    kind: Literal["gpu", "mig"] = "gpu"
    index: Index = 0
    parent_uuid: Name | None = None
    mig_profile: Name | None = None
    gpu_fraction: float = 1.0
    """Share of a whole GPU the row stands for (compute slices / total for MIG; 1 / holders for
    one holder of a shared GPU): GPU-hours weight."""
    util_min: float | None = None
    util_mean: float | None = None
    util_max: float | None = None
    mem_used_mean: float | None = None
    mem_used_max: Count | None = None
    mem_total_bytes: Count | None = None
    power_mean: float | None = None
    power_max: float | None = None
    temp_max: float | None = None
    throttled_samples: Count = 0
    """Samples with a thermal or power-brake clock-event reason set."""
    ecc_dbe_new: Count = 0
    """Double-bit ECC errors that appeared during the minute."""
    xid_count: Count = 0
    namespace: Name | None = None
    pod: Name | None = None
    owner_kind: Name | None = None
    owner_name: Name | None = None
    team: Name | None = None
    workload_kind: Name | None = None
    queue: Name | None = None
    clock: Count = 0
    """The node's clock the minute was read on: 0, and one more each time the node join
    took a node's stepped-back clock (``NodeSummary.clock_steps``)."""
    schema: Version = SCHEMA_VERSION
