"""The per-node join: samples, hardware events and allocations of one node, and its rules.

:class:`NodeState` is everything the worker knows about one node: the pods
holding its devices (from allocation events) and each device's rule state.
It lives in a Faust table keyed by node, backed by a changelog topic, so a
restarted worker resumes where the last one stopped. :class:`NodeJoin`
folds one decoded record into a node's state and returns what to publish;
it does no I/O, so it is tested without a broker.

The join knows no rule by name: it runs every device runner of the rule
registry (:mod:`gpusteward.rules`) that the policy's resolution lists, on
each device sample, each hardware event its hooks take and each release of
a device. Settings come from the policy (:mod:`gpusteward.rules.policy`),
resolved per node pool, and per (namespace, queue, node pool) for a held
device (a rule's registry entry says which layers reach it); the policy
caches each resolution, so a sample pays dict lookups, not validation.
Per-device rule state is made of msgspec Structs inside :class:`DeviceState`,
so it rides the changelog with the rest of the node's state: the shipped
rules' as typed fields, a rule registered beyond them in ``tracks``.

A device several pods hold (a sample listing several ``holders``) runs the
runners that judge a holder (``per_holder``, e.g. idleness) once per holder,
on that holder's share of the device and with state of its own
(``DeviceState.shares``), so one busy pod neither hides nor is credited to
another; the other runners run once on the device. A device out of service (a runner's
health check finds an open episode) runs no ``per_holder`` runner: its holder's idleness
is the fault's consequence, not a second problem.

The join keeps the findings open on each node as its rules emit them
(``NodeState.findings``, touched only when a rule emits something), so that a node
deleted from the cluster has each of them resolved under its own id, whatever rule opened
it; its rules' state goes with it, and they judge nothing of it until it exists again.

It stays one module: the node's state, the pod-identity index and the loop over the
registry's runners are one hot path; splitting it would add calls per sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gpusteward.edge import Rejected
from gpusteward.rules import budget, ecc, hardware, idle, memory, memory_leak, rollup, silent
from gpusteward.rules import policy as policies
from gpusteward.rules import xid as xid_rule
from gpusteward.rules.findings import resolved
from gpusteward.rules.mig import reconfig
from gpusteward.rules.registry import DeviceRunner, SampleHook, state_in
from gpusteward.schema import (
    Action,
    AllocationEvent,
    DeviceHolder,
    DeviceSample,
    Finding,
    HwEvent,
    IdleHold,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    Rollup,
    Subject,
    Taint,
    mig_resource_profile,
    single_strategy_profile,
)

log = logging.getLogger(__name__)


class Holding(msgspec.Struct):
    """A pod's hold on devices of the node, from its allocation events."""

    pod: PodRef
    started_at: float
    devices: list[str]
    gpus: int = 0
    mig: dict[str, int] = {}
    workload_kind: str | None = None
    queue: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    owner_kind: str | None = None
    owner_name: str | None = None
    gang: str | None = None
    """The gang the pod is one member of (:attr:`.idle.Holder.gang`); None for a pod that
    works alone, a gang of one included."""
    images: list[str] = []
    """The images of its GPU containers (``PodAllocation.images``)."""
    memory_grows: bool = False
    """``PodAllocation.memory_grows``."""
    who: rollup.Attribution | None = None
    """The pod's columns in the rollups, made once from the fields above."""
    ended_at: float | None = None
    """When the pod finished or was deleted. The holding is kept until the node's samples
    are past that time: samples travel on another topic, and a worker behind on them
    reads a pod's end before its last samples."""


class DeviceState(msgspec.Struct):
    idle: idle.IdleTrack = msgspec.field(default_factory=idle.IdleTrack)
    ecc: ecc.EccTrack = msgspec.field(default_factory=ecc.EccTrack)
    hw: hardware.HwTrack = msgspec.field(default_factory=hardware.HwTrack)
    mem_low_free: memory.SustainTrack = msgspec.field(default_factory=memory.SustainTrack)
    mem_high: memory.SustainTrack = msgspec.field(default_factory=memory.SustainTrack)
    mem_leak: memory_leak.LeakTrack = msgspec.field(default_factory=memory_leak.LeakTrack)
    mem_overcommit: memory.SustainTrack = msgspec.field(default_factory=memory.SustainTrack)
    attributed: PodRef | None = None
    """The pod the collector last attributed the device to."""
    attributed_since: float | None = None
    vacated_by: PodRef | None = None
    """The pod the collector last saw leave the device (attributed, then attributed to no
    one), until it attributes the device again."""
    tracks: dict[str, Any] = {}
    """State of the rules whose runner names no field above, by the runner's state name.
    Decoded from the changelog as plain data and turned back into the runner's type on
    first use."""
    shares: dict[str, DeviceState] = {}
    """Per-holder state of a device several pods hold, by pod key (uid, or namespace/name):
    the state of the ``per_holder`` runners for that holder's share."""
    index: int | None = None
    """A physical GPU's index (minor number) in its first sample, -1 for a MIG device; None
    until the device's first sample (a hardware event may come first) and in a state from
    a build before this field (set at the device's next sample)."""
    out_of_service: bool | None = None
    """Whether a runner's health check finds the device out of service (:func:`_sick`);
    None: to be asked again, after a hook reported something on the device or an event
    reached it (the only times an episode opens or closes). Kept, not asked per sample:
    asking costs a call per health check per device per sample."""


_TYPED_TRACKS = frozenset({"idle", "ecc", "hw", "mem_low_free", "mem_high", "mem_leak",
                           "mem_overcommit"})
"""Runner state names that are typed fields of :class:`DeviceState`."""


def track_of(dev: DeviceState, runner: DeviceRunner) -> Any:
    """The state ``runner`` keeps for the device."""
    name = runner.state
    return (getattr(dev, name) if name in _TYPED_TRACKS
            else state_in(dev.tracks, name, runner.state_type))


Plan = tuple[tuple[SampleHook, str, bool, type, Any], ...]
"""The sample hooks one kind of device runs: (hook, state name, typed field, state type,
settings)."""


class _Prepared:
    """What the node join runs for one policy resolution, in the shape its loops want.

    Made once per resolution (:meth:`NodeJoin._prepare`), never per record: the per-device
    loop runs 7 hooks on each of 8 devices per sample, and a test or lookup per hook there
    costs as much as some rules' whole fast path.
    """

    __slots__ = ("checks", "plans", "resolved", "unwatched")

    def __init__(self, resolved: policies.Resolved, workload_kind: str | None) -> None:
        self.resolved = resolved
        # The runners with something to do for a holder of this kind (e.g. the low-free
        # memory rule watches only serving pods' devices): the others are never called.
        steps = [(hook, name, gpu_only, runner, settings)
                 for hook, name, gpu_only, runner, settings in resolved.samples
                 if runner.watches is None or runner.watches(settings, workload_kind)]

        def plan(gpu: bool, shared: bool) -> Plan:
            # A MIG device skips the GPU-only runners; a shared one the per-holder runners,
            # which run on its shares instead.
            return tuple((hook, name, name in _TYPED_TRACKS, runner.state_type, settings)
                         for hook, name, gpu_only, runner, settings in steps
                         if (gpu or not gpu_only) and not (shared and runner.per_holder))

        self.plans = (plan(False, False), plan(False, True), plan(True, False), plan(True, True))
        """The sample hooks of each kind of device, at ``2 * gpu + shared``."""
        self.checks = tuple((runner.state, runner.state in _TYPED_TRACKS, runner.state_type,
                             runner.unhealthy) for runner, _ in resolved.device
                            if runner.unhealthy is not None)
        """(state name, typed field, state type, check) of every runner with a health check."""
        self.unwatched = tuple((runner, runner.on_unwatched) for runner, settings
                               in resolved.device if runner.on_unwatched is not None
                               and runner.watches is not None
                               and not runner.watches(settings, workload_kind))
        """(runner, its ``on_unwatched`` hook) of every runner a holder of this kind is left
        out of."""


class OpenFinding(msgspec.Struct):
    """A finding open on the node, as its rule emitted it: what its resolution needs."""

    fingerprint: str
    kind: str
    subject: Subject
    since: float
    """Its ``starts_at``."""


class NodeState(msgspec.Struct):
    """What the worker knows about one node."""

    devices: dict[str, DeviceState] = {}
    pods: dict[str, Holding] = {}
    gpu_model: str | None = None
    gpu_count: int = 0
    gpu_replicas: int = 1
    """Pods per physical GPU (time-slicing, MPS): a held replica takes no whole GPU."""
    cordoned: bool = False
    spot: bool = False
    mig_allocatable: dict[str, int] = {}
    """MIG devices the node offers, by profile (from ``nvidia.com/mig-*`` allocatable)."""
    pool: str | None = None
    """The node's pool: the value of the policy's node-pool label on the node."""
    last_summary_ts: float | None = None
    summary_dirty: bool = True
    rollups: rollup.RollupTrack = msgspec.field(default_factory=rollup.RollupTrack)
    """The node's open per-device minutes."""
    behind_since: float | None = None
    """The first of the node's samples refused in a row as too far back (its clock stepped
    back), on their own clock; None while its samples are in order."""
    behind_last: float | None = None
    """The newest of those refused samples."""
    clock_steps: int = 0
    """Stepped-back clocks of the node taken so far (``NodeSummary.clock_steps``)."""
    gpu_allocatable: int | None = None
    """``nvidia.com/gpu`` in the node's allocatable (replicas when shared): the kubelet
    takes a GPU its device plugin reports unhealthy out of allocatable, not out of capacity
    (``gpu_count``), and every GPU while the plugin restarts; the scheduler places nothing
    on what it left out. None until an inventory states it."""
    mig_config: str | None = None
    """The MIG config the node's ``nvidia.com/mig.config`` label asks for."""
    mig_config_state: str | None = None
    """``nvidia.com/mig.config.state``; while pending or rebooting the node is under
    reconfiguration (:mod:`gpusteward.rules.mig.reconfig`): its reset's hardware findings
    act on nothing, its holders are not judged idle, it offers no free capacity."""
    mig_reconfig_since: float | None = None
    """When the node's reconfiguration began (the inventory that said so); kept after it
    succeeds until the node's samples are ``mig_settle_s`` past the success. None: no
    reconfiguration to settle."""
    mig_reconfig_until: float | None = None
    """When it succeeded: episodes opened after that are not the reconfiguration's."""
    mig_held: dict[str, reconfig.Held] = {}
    """The reset's findings whose episodes are open (raised while the node read pending or
    rebooting, or read after the success with an event time in the window), by id, with the
    node actions held back from them: settled when their GPU answers after the success,
    raised again with those actions when it has not within ``mig_settle_s``. Empty outside
    a reconfiguration."""
    mig_failed: hardware.Episode | None = None
    """The open ``mig_config_failed`` warning: the state read ``failed``, no success since."""
    asks: dict[str, Action] = {}
    """The node actions (:data:`REASKED_VERBS`) of the node's open hardware findings, by
    idempotency key, each as last asked for: asked for again every ``reask_s`` while its
    finding stays open (:meth:`NodeJoin._reask`; by its partition's clock when the node's
    own samples stopped, :meth:`NodeJoin.reask_due`), forgotten when it resolves."""
    asks_due: float | None = None
    """Event time from which the next of ``asks`` is due; None with none."""
    deleted: bool = False
    """The node's last inventory said it was deleted: its summaries are tombstones
    (``NodeSummary.deleted``) and its rules run on nothing until an inventory says it
    exists again."""
    deleted_at: float | None = None
    """Event time of the inventory that said the node was deleted (the first, if read
    again); None while it exists. The worker removes the node's state once the samples of
    its partition are ``forget_deleted_s`` past it (:func:`deleted_since`)."""
    findings: dict[str, OpenFinding] = {}
    """The findings open on the node, by id, as its rules emitted them (a firing one adds,
    its resolution takes it out; :meth:`NodeJoin._note`): what the node's deletion resolves.
    Empty in a state written before it was kept: the findings open then are not known."""
    expected_from: float | None = None
    """Event time from which the node is expected to send samples: its first inventory, or
    the last that let it take pods again (uncordoned, ready, out of MIG reconfiguration,
    created again). A silence (:mod:`gpusteward.rules.silent`) counts from it or the node's
    newest sample, whichever is later."""
    silent: hardware.Episode | None = None
    """The open ``node_silent`` episode: no sample of the node for ``silent_after_s`` of its
    partition's event time (:meth:`NodeJoin.silence`); closed by its next sample."""
    sample_partition: int = -1
    sample_offset: int = -1
    """Where in the samples topic the newest sample applied to this state was (partition,
    offset): a sample read again at or before it, and no newer than the node's newest
    sample, was applied already (a replay from the last committed offset after a rebalance
    or a restart: the state was written after it, the offsets are committed later) and is
    skipped (:meth:`gpusteward.streams.app.NodeStates.apply`). -1: none known (a state
    written before 2026-11-28, or tests)."""
    waiting_xids: list[HwEvent] = []
    """Application-class XIDs read before the node's samples reached their time, with no
    allocation holding their GPU then (:meth:`NodeJoin._waits`): judged at the first sample
    at or past their time, when the node's inputs say who held the GPU. At most
    :data:`MAX_WAITING_XIDS`."""


class NodeDeletion(msgspec.Struct):
    """The fields of a stored :class:`NodeState` that say whether and when its node was
    deleted, and when its asks are due again: read for every node of the table after a
    rebalance, the rest skipped."""

    deleted: bool = False
    deleted_at: float | None = None
    last_summary_ts: float | None = None
    asks_due: float | None = None


def _excused(state: NodeState) -> bool:
    """A node whose silence is not told: deleted, taking no new pods (cordoned, not ready),
    or under MIG reconfiguration (mig-manager stops the GPUs' clients, the collector too)."""
    return (state.deleted or state.cordoned
            or state.mig_config_state in reconfig.RECONFIGURING)


def deleted_since(state: NodeState | NodeDeletion) -> float | None:
    """When the node was deleted, if it is: the event time of its deletion; for a state
    written before that was kept, its last summary's (a tombstone at or after the
    deletion). None while the node exists."""
    if not state.deleted:
        return None
    if state.deleted_at is not None:
        return state.deleted_at
    return state.last_summary_ts if state.last_summary_ts is not None else 0.0


MAX_WAITING_XIDS = 64
"""Most XIDs a node keeps waiting for its samples; more are judged at once."""

Output = Finding | Action | NodeSummary | Rollup


@dataclass
class RuleSettings:
    """The settings of the node join itself; the rules' own come from the policy."""

    policy: policies.Policy | None = None
    """The rule policy; None: every rule's defaults. The worker passes the one named by
    GPUSTEWARD_POLICY_FILE (:mod:`gpusteward.streams.policy_file`)."""
    summary_interval_s: float = 60.0
    """Event-time seconds between two summaries of an unchanged node."""
    checkpoint_interval_s: float = 30.0
    """Event-time seconds between two changelog writes of a node whose samples changed
    nothing that matters; anything a rule emits is written at once. Lower means less
    re-learning after a crash, higher means less changelog traffic (one record per node
    per interval instead of one per sample)."""
    rollup_lateness_s: float = 60.0
    """Event-time seconds a minute stays open after its end for late samples before its
    rollup is published; a sample later than that is counted and dropped."""
    clock_back_s: float = 600.0
    """Event-time seconds a node's sample may lie before the newest one of the node and
    still be taken as a duplicate or a straggler (ignored by the rules, counted late by
    the rollups). One further back says the collector's clock went back (an NTP step, a
    VM restored from a snapshot): it is refused as a dead letter naming the jump, until
    the node's samples have kept to their new clock for ``clock_step_after_s``.
    10 min: a redelivered batch (a crash between a checkpoint and its commit) spans
    seconds of a node's samples, not minutes."""
    clock_step_after_s: float = 300.0
    """Event-time seconds, on their own clock, that a node's samples must keep coming too
    far back (refused by ``clock_back_s``), each after the one before and within
    ``clock_back_s`` of it, before the join takes their clock as the node's new one: its
    rules' runs start over as after a gap, their open episodes go on under their ids, its
    open rollup minutes are emitted. The node's blindness after a step back is this long,
    not the step's length. 5 min: ten samples of a collector polling every 30 s; a replay
    of a few old records never keeps coming for that long."""
    reask_s: float | None = 600.0
    """Event-time seconds between two asks for a node action (cordon, taint, drain) of a
    hardware finding that stays open: the same idempotency key, a fresh ``ts``
    (``Action.reask`` counts them). The executor refuses an action older than its
    ``max_action_age_s`` (an outage's backlog) and carries a key out once, so asking again
    is what gets a faulty node cordoned on a fresh look after such a refusal, or after an
    ask that never reached it; a re-ask of a key it already decided the same way is not
    audited again. A cordon or taint is not asked again while the node's inventory says it
    takes no new pods (cordoned, or tainted by gpusteward): that is in place. 10 min: well
    inside the executor's 1 h, so a backlog holds a fresh re-ask, and six records an hour
    per open fault. Idle reclaims and owner notices are never asked again (their ladder
    has its own timing). None: ask once."""
    mig_settle_s: float = 300.0
    """Event-time seconds, on the node's samples' clock, that a GPU has after its node's
    MIG reconfiguration succeeded (``nvidia.com/mig.config.state=success``, as of the
    watcher's event) to answer again. One still silent then is a fault: the findings held
    during the reconfiguration (``gpu_lost``, an XID, a recovery action) are raised again
    saying so, with the cordon, taint or drain their rules asked for. 5 min: mig-manager
    sets success once the GPU instances exist and the operator's pods (dcgm-exporter,
    device plugin) are restarting; they are back in a minute or two, and a lost GPU waits
    that long at most before its node is drained."""
    forget_deleted_s: float = 3600.0
    """Event-time seconds after a node's deletion that the worker keeps its state, measured
    on the samples of the node's partition (other nodes' samples: a deleted node sends
    none); then the state is removed from the node table and its changelog, its open
    rollup minutes emitted first. Until then a late record of the node is handled as a
    deleted node's (samples folded into the rollups, judged by no rule); after it, one
    would start the node afresh, as a node seen for the first time. 1 h: the node's own
    samples were published before the deletion, ahead of the later ones on its partition,
    and its pods' deletions (the pod garbage collector's, tens of seconds after the node's)
    on the allocations topic trail them by far less even in a catch-up; a deleted 8-GPU
    node costs about 4.4 KB until then."""
    team_labels: tuple[str, ...] = rollup.DEFAULT_TEAM_LABELS
    """Pod labels naming the owning team in the rollups, first match wins; else the
    namespace. The weekly report groups by the team the rollups carry."""


_CACHE_LIMIT = 32_768
"""Entries of the node join's per-holding and per-resolution caches before they are
cleared and rebuilt. A holding leaves its cache when replaced or forgotten; what this
bounds is the rest (the holdings of nodes a rebalance took away), at a few hundred bytes
each. A worker holding more live pods than this gets no worse than no cache."""


REASKED_VERBS = frozenset({"cordon", "taint", "drain"})
"""Verbs of the node actions the join asks for again while their finding stays open."""
_KEPT_OFF = frozenset({"cordon", "taint"})
"""Of those, the ones a node that takes no new pods has in place."""


_UNKNOWN_GPU = "GPU-unknown"
"""The device a hardware event without a UUID is filed under."""


def _pod_key(pod: PodRef) -> str:
    return pod.uid or f"{pod.namespace}/{pod.name}"


class _Holders:
    """The node's holdings at one sample's time, by device id and by pod identity.

    A pod is known by uid where both sides have it and by namespace/name otherwise
    (DESIGN.md, decision 4): the kubelet's PodResources API, and so the NVML collector's
    attribution, carries no uid, while the watcher's allocations do. Built once per sample
    from the handful of pods a node holds; a holding whose pod ended at or before the
    sample does not hold anything at its time, nor do the device ids of one that started
    after it.
    """

    __slots__ = ("_by_name", "_live", "_ts", "by_device", "expired")

    def __init__(self, pods: dict[str, Holding], ts: float, linger_s: float) -> None:
        self._ts = ts
        self.by_device: dict[str, Holding] = {}
        self._live: list[Holding] = []
        self._by_name: dict[tuple[str, str], list[Holding]] | None = None
        """Built at the first :meth:`find`: most samples find every device by its id."""
        self.expired: list[str] = []
        """Ended holdings the node's samples are well past: safe to forget."""
        for key, holding in pods.items():
            ended_at = holding.ended_at
            if ended_at is not None and ts >= ended_at:
                if ts - ended_at > linger_s:
                    self.expired.append(key)
                continue
            # An allocation read ahead of the samples (a worker catching up reads the small
            # allocations topic first) holds its devices only from its start: until then
            # they are the pod's before it. The collector's attribution still finds it by
            # name, should the node's clock run behind the start the API server stamped.
            if holding.started_at <= ts:
                for uuid in holding.devices:
                    self.by_device[uuid] = holding
            self._live.append(holding)

    def _names(self) -> dict[tuple[str, str], list[Holding]]:
        if self._by_name is None:
            self._by_name = {}
            for holding in self._live:
                name = (holding.pod.namespace, holding.pod.name)
                same = self._by_name.get(name)
                if same is None:
                    self._by_name[name] = [holding]
                else:
                    same.append(holding)
        return self._by_name

    def find(self, pod: PodRef) -> Holding | None:
        """The holding of the attributed ``pod``; None when no allocation matches it.

        A uid on both sides decides: a pod restarted under the same name (a new uid) is not
        the old one. Without a uid on one side the name decides, and of two live holdings
        with one name (the old pod's end not seen yet) the later started is the pod, since
        Kubernetes gives a name to one pod at a time; one that starts after the sample
        (read ahead of it, as a worker catching up reads allocations) only when none of
        that name had started by then.
        """
        found: Holding | None = None
        best = (False, 0.0)
        for holding in self._names().get((pod.namespace, pod.name), ()):
            if pod.uid is not None and holding.pod.uid is not None:
                if holding.pod.uid == pod.uid:
                    return holding
                continue  # both have uids and they differ: another pod of the same name
            rank = (holding.started_at <= self._ts, holding.started_at)
            if found is None or rank >= best:
                found, best = holding, rank
        return found


def _share_holding(state: NodeState, holders: _Holders, share: DeviceHolder
                   ) -> tuple[str | None, Holding | None]:
    """The key of a holder's share and its allocation: by the pod identity index (uid where
    both sides have one, else namespace/name), or by the cgroup's uid alone (per-process
    attribution of a pod PodResources does not name)."""
    uid = share.pod_uid or (share.pod.uid if share.pod is not None else None)
    if share.pod is not None:
        pod = share.pod if share.pod.uid or uid is None else msgspec.structs.replace(
            share.pod, uid=uid)
        return (uid or _pod_key(share.pod)), holders.find(pod)
    if uid is not None:
        holding = state.pods.get(uid)
        return uid, holding if holding is not None and holding.ended_at is None else None
    return None, None


def _share_keys(state: NodeState, holding: Holding, key: str) -> tuple[str, ...]:
    """The keys the ended ``holding`` (``state.pods[key]``) may have shares under: its
    key, and its namespace/name where the collector names holders without a uid
    (dcgm-exporter's per-pod series, :func:`_share_holding`), unless a live holding of the
    node has that name (a pod restarted under it: the share is that pod's now)."""
    pod = holding.pod
    if pod.uid is None:
        return (key,)
    name = (pod.namespace, pod.name)
    if any(other is not holding and other.ended_at is None
           and (other.pod.namespace, other.pod.name) == name for other in state.pods.values()):
        return (key,)
    return (key, f"{pod.namespace}/{pod.name}")


_OFF_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable",
                         "node.kubernetes.io/unschedulable",
                         "node.kubernetes.io/network-unavailable"})
"""Taints Kubernetes sets on a node that takes no new pods (NotReady, unreachable)."""


def _states_gpu_count(event: NodeInventory) -> bool:
    """The inventory's ``gpu_count`` is the node's, 0 included: it states the
    ``nvidia.com/gpu`` capacity and no MIG strategy hides GPUs from it (under ``single``
    it counts none, and under ``mixed`` a partitioned GPU is no ``nvidia.com/gpu``), so a
    node whose device plugin went counts no GPU. Otherwise a 0 means "not stated" (an
    inventory of a MIG node, or one without capacity) and the count known is kept."""
    return ("nvidia.com/gpu" in event.capacity and event.mig_strategy != "single"
            and not any(mig_resource_profile(key) for key in event.capacity))


def _keeps_pods_off(taint: Taint) -> bool:
    """Whether ``taint`` keeps new GPU pods off the node, as a cordon does: Kubernetes' own
    taints of a node not ready, and gpusteward's (``gpusteward.io/gpu-reset-required``).
    Other taints (``nvidia.com/gpu:NoSchedule``) are ones GPU pods tolerate."""
    return taint.effect in ("NoSchedule", "NoExecute") and (
        taint.key in _OFF_TAINTS or taint.key.startswith("gpusteward.io/"))


def _out_of_service(dev: DeviceState, checks: tuple[tuple[str, bool, type, Any], ...]
                    ) -> bool:
    """Whether a runner's health check finds an episode that takes the device out of
    service (``checks``: :attr:`_Prepared.checks`)."""
    for name, typed, state_type, unhealthy in checks:
        if unhealthy(getattr(dev, name) if typed else state_in(dev.tracks, name, state_type)):
            return True
    return False


def _several(holding: Holding) -> bool:
    """Whether the pod holds more than one device of the node."""
    return (holding.gpus > 1 or len(holding.devices) > 1
            or (bool(holding.mig) and holding.gpus + sum(holding.mig.values()) > 1))


def _pod_devices(state: NodeState, pod: PodRef, ids: list[str]) -> list[str]:
    """The node's devices ``pod`` holds: by its allocation's device ids, else as the
    collector attributes them (device-plugin GPUs, whose ids the API server does not know)."""
    return [uuid for uuid, dev in state.devices.items()
            if uuid in ids or (dev.attributed is not None and idle.same_pod(dev.attributed, pod))]


def _sick(dev: DeviceState, checks: tuple[tuple[str, bool, type, Any], ...]) -> bool:
    """Whether ``dev`` is out of service, asked of the health checks only when not known."""
    sick = dev.out_of_service
    if sick is None:
        sick = dev.out_of_service = bool(checks) and _out_of_service(dev, checks)
    return sick


def _idle_holder(holding: Holding, resolved: policies.Resolved | None = None,
                 state: NodeState | None = None) -> idle.Holder:
    """The idle rule's view of a holding: who, since when, and what owns it (the owner and
    queue decide what a reclaim does and whether a waiting workload could use the GPU),
    and, with the ``resolved`` settings its devices are judged with, what exempts it; with
    the node's ``state``, for a pod of several devices, how to find its others."""
    siblings = None
    if state is not None and _several(holding):
        def siblings(uuid: str) -> list[tuple[str, idle.IdleTrack]]:
            return [(other, state.devices[other].idle)
                    for other in _pod_devices(state, holding.pod, holding.devices)
                    if other != uuid]
    holder = idle.Holder(holding.pod, holding.started_at, holding.workload_kind,
                         holding.labels, holding.annotations, holding.queue,
                         holding.owner_kind, holding.owner_name, gang=holding.gang,
                         siblings=siblings, images=tuple(holding.images),
                         memory_grows=holding.memory_grows)
    settings = None if resolved is None else resolved.rules.get(idle.KIND)
    if isinstance(settings, idle.IdleSettings):
        exempt = settings.exemption(holder)
        if exempt is not None:
            holder = msgspec.structs.replace(holder, exempt=exempt)
    return holder


def _share_view(device: DeviceSample, share: DeviceHolder) -> DeviceSample:
    """The device as one of its holders used it: the holder's own activity where the source
    split it, else the device's, marked ``shared``. Memory stays the device's (free memory is
    shared); the holder's own is in the view's one ``holders`` entry."""
    own_activity = device.attribution == "process" and share.activity_pct is not None
    return msgspec.structs.replace(
        device, pod=share.pod, holders=[share],
        util_pct=share.activity_pct if own_activity else device.util_pct,
        engine_active_pct=None if own_activity else device.engine_active_pct,
        attribution="process" if own_activity else "shared")


class NodeJoin:
    """Folds records into :class:`NodeState` and runs the per-node rules."""

    def __init__(self, settings: RuleSettings | None = None,
                 policy: policies.Policy | None = None,
                 on_clock_step: Callable[[str, float], None] | None = None) -> None:
        self.settings = settings or RuleSettings()
        self.policy = policy or self.settings.policy or policies.Policy()
        self.on_clock_step = on_clock_step
        """Called with the node and the step (seconds) when the join takes a node's new
        clock after a step back (the worker counts it in a metric)."""
        self.fold = rollup.MinuteFold(self.settings.rollup_lateness_s)
        # What a sample needs per resolution and per holding, made once: resolving the
        # policy and building the idle rule's holder for each device of each sample cost as
        # much as a rule. Keyed by id() with the object kept in the value, so an id is never
        # reused while cached; forgotten when the registry changes (the policy's resolutions
        # are new then), and bounded by _CACHE_LIMIT.
        self._prepared: dict[tuple[int, str | None], _Prepared] = {}
        self._held: dict[int, tuple[Holding, str | None, _Prepared, idle.Holder]] = {}
        self.policy.registry.watch(self._forget)

    def _forget(self) -> None:
        self._prepared.clear()
        self._held.clear()

    def _prepare(self, namespace: str | None, queue: str | None, pool: str | None,
                 workload_kind: str | None = None) -> _Prepared:
        resolved = self.policy.resolve(namespace, queue, pool)
        key = (id(resolved), workload_kind)
        found = self._prepared.get(key)
        if found is None or found.resolved is not resolved:
            if len(self._prepared) >= _CACHE_LIMIT:
                self._prepared.clear()
            found = self._prepared[key] = _Prepared(resolved, workload_kind)
        return found

    def _prepare_holding(self, holding: Holding, pool: str | None, state: NodeState
                         ) -> tuple[Holding, str | None, _Prepared, idle.Holder]:
        """What a device ``holding`` holds runs, and the idle rule's holder; cached."""
        if len(self._held) >= _CACHE_LIMIT:
            self._held.clear()
        prepared = self._prepare(holding.pod.namespace, holding.queue, pool,
                                 holding.workload_kind)
        found = self._held[id(holding)] = (holding, pool, prepared,
                                           _idle_holder(holding, prepared.resolved, state))
        return found

    def on_sample(self, state: NodeState, sample: NodeSample) -> list[Output]:
        newest = state.rollups.watermark
        out: list[Output] = []
        if newest is not None and sample.ts < newest - self.settings.clock_back_s:
            # Raised with nothing changed but the record of the run of such samples.
            if not self._behind(state, sample.ts):
                behind = (state.behind_last or sample.ts) - (state.behind_since or sample.ts)
                raise Rejected(
                    f"event time {sample.ts:.0f} is {newest - sample.ts:.0f} s before node "
                    f"{sample.node}'s newest sample ({newest:.0f}; more than clock_back_s="
                    f"{self.settings.clock_back_s:g} s): its collector's clock went back; "
                    f"its samples are refused until they have kept to their new clock for "
                    f"clock_step_after_s={self.settings.clock_step_after_s:g} s ({behind:.0f}"
                    " s so far), then the node's rules and rollups take that clock")
            out = self._take_new_clock(state, sample.node, newest - (state.behind_since
                                                                     or sample.ts))
        elif state.behind_since is not None:
            state.behind_since = state.behind_last = None  # the clock came back: no step
        holders = _Holders(state.pods, sample.ts, self.settings.rollup_lateness_s)
        if holders.expired:  # once per pod, when the node's samples are past its end
            out += self._expire(state, holders, sample.node, sample.ts)
        pool = state.pool
        node_prepared = self._prepare(None, None, pool)
        node_plans, checks = node_prepared.plans, node_prepared.checks
        devices = state.devices
        held_cache = self._held
        node, ts = sample.node, sample.ts
        fold, minutes = self.fold, state.rollups
        bucket = fold.bucket(minutes, ts)
        if bucket is None:
            fold.late(minutes, len(sample.devices))
        # mig-manager stops every GPU client before it resets the GPUs: an idle holder now
        # is one it is evicting, not one to notify and reclaim.
        reconfiguring = state.mig_config_state in reconfig.RECONFIGURING
        # A deleted node's samples (read late, or its collector's last) are folded into the
        # rollups but judged by no rule: a finding opened now would have nothing to resolve it.
        judging = not state.deleted
        if state.silent is not None:  # almost never: the node's first sample after a silence
            out.append(silent.closed(state.silent, node, ts,
                                     f"GPU samples again, {(ts - state.silent.since) / 60:.0f}"
                                     " min after the last"))
            state.silent = None
        if _UNKNOWN_GPU in devices and judging:  # almost never: a loss without a uuid
            out += self._unknown_back(state, sample, devices[_UNKNOWN_GPU])
        for device in sample.devices:
            dev = state.devices.get(device.uuid)
            if dev is None or dev.index is None:  # once per device
                if dev is None:
                    dev = state.devices[device.uuid] = DeviceState()
                if device.kind == "gpu":
                    dev.index = device.index
                    out += self._replaced(state, device, sample)
                else:
                    dev.index = -1
            shared = len(device.holders) > 1
            # A device out of service (lost, an uncorrectable error, a fatal XID) is not
            # judged for its holders: a pod idle on a dead GPU is the fault's consequence,
            # already reported, not a second problem to notify and reclaim. A MIG device is
            # as sick as its GPU, whose state holds the hardware episodes. An idle episode
            # open before the fault goes on (that idleness was real) and ends as usual.
            sick = dev.out_of_service
            if sick is None:
                sick = _sick(dev, checks)
            if device.parent_uuid is not None and not sick:
                parent = devices.get(device.parent_uuid)
                sick = parent is not None and _sick(parent, checks)
            sick = reconfiguring or (sick and dev.idle.open_id is None)
            if shared:
                out += self._on_shares(state, holders, dev, device, node, ts, bucket,
                                       judge=judging and not sick)
            holding = self._holding(dev, device, holders, ts)
            holder: idle.Holder | None
            if holding is not None:
                held = held_cache.get(id(holding))
                if held is None or held[0] is not holding or held[1] != pool:
                    held = self._prepare_holding(holding, pool, state)
                    if held[2].unwatched and judging:  # once per holding
                        out += self._unwatched(state, holding, held[2], node, ts)
                plans, holder = held[2].plans, held[3]
            elif device.pod is not None and dev.attributed_since is not None:
                # Attributed by the collector but no allocation seen yet: count from first sight.
                plans = self._prepare(device.pod.namespace, None, pool).plans
                holder = idle.Holder(device.pod, dev.attributed_since)
            else:
                plans, holder = node_plans, None
                if dev.attributed_since == ts and judging and dev.vacated_by is not None:
                    out += self._vacated(state, dev, device.uuid, holders, node, ts)
            if bucket is not None and not shared:  # a shared device: a row per holder
                who = holding.who if holding is not None else None
                fold.add(bucket, device, ts, who or self._who(holding, device.pod))
            if not judging:
                continue
            for hook, name, typed, state_type, settings in plans[2 * (device.kind == "gpu")
                                                                 + (shared or sick)]:
                track = getattr(dev, name) if typed else state_in(dev.tracks, name, state_type)
                found = hook(track, node, device, ts, settings, holder)
                if found:  # almost never: no list to extend
                    out += found
                    dev.out_of_service = None  # an episode may have opened or closed
        if state.gpu_model is None and sample.devices:
            state.gpu_model = sample.devices[0].model
            state.gpu_count = state.gpu_count or sum(d.kind == "gpu" for d in sample.devices)
        if state.mig_reconfig_since is not None:
            out = self._reconfig(state, out, sample)
        if out:  # almost never
            self._note(state, out)
        due = state.asks_due
        if due is not None and ts >= due:  # at most once per reask_s per node
            out += self._reask(state, ts)
        if state.waiting_xids:  # almost never: XIDs read ahead of their node's samples
            out += self._judge_waiting(state, ts)
        out += fold.advance(minutes, node, ts)
        return out + self._maybe_summary(state, sample.node, sample.ts)

    def _reconfig(self, state: NodeState, out: list[Output], sample: NodeSample | None
                  ) -> list[Output]:
        """``out`` of a node under (or just out of) MIG reconfiguration: while it lasts its
        reset's findings ask for no node action; after a success, each GPU the ``sample``
        shows answering has the episodes the reconfiguration opened closed, and those of a
        GPU still silent ``mig_settle_s`` later act."""
        since = state.mig_reconfig_since
        assert since is not None
        held = state.mig_held
        if held and out:  # an episode held that closed as usual is settled
            for item in out:
                if isinstance(item, Finding) and item.state == "resolved":
                    held.pop(item.id, None)
        if state.mig_config_state in reconfig.RECONFIGURING:
            return reconfig.hold(out, state.mig_config_state or "", state.mig_config, held)
        until = state.mig_reconfig_until
        if state.mig_config_state != "success" or until is None:
            return out  # after a failure its episodes close as usual; the warning is the news
        grace = self.settings.mig_settle_s
        if sample is None:
            # A hardware event of the reset read after the success (the worker read the
            # node's allocations ahead of its hardware events; the loss tracker waits a few
            # scrapes): held as during the window, by its own event time, the watcher's
            # ends widened by the grace (the two clocks may be that far apart). A sample's
            # findings are a live GPU's, not held.
            return reconfig.hold(out, "success", state.mig_config, held,
                                 between=(since - grace, until + grace))
        answering = {device.parent_uuid or device.uuid for device in sample.devices
                     if hardware.answers(device)}
        if len(answering) >= max(1, state.gpu_count):
            # Every GPU answers: a loss reported before its UUID could be read (the NVML
            # collector started during the reset) is over too.
            answering.add(_UNKNOWN_GPU)
        for uuid in answering:
            dev = state.devices.get(uuid)
            if dev is not None and reconfig.unsettled(dev.hw, since, until, held):
                settled = reconfig.settle(dev.hw, node=sample.node, uuid=uuid, since=since,
                                          until=until, ts=sample.ts, held=held)
                for finding in settled:
                    held.pop(finding.id, None)
                out += settled
                dev.out_of_service = None
                state.summary_dirty = True
        if sample.ts >= until + grace:
            # Not back by now: a fault, not the reset. Its held actions are asked for now,
            # and re-asked as any (:meth:`_note_asks`); the window ends, and with it this
            # method's cost per sample of the node.
            for kept in held.values():
                out += reconfig.overdue(kept, config=state.mig_config, after_s=grace,
                                        ts=sample.ts)
            self._end_reconfig(state)
            self._forget_old_layout(state, sample)
        return out

    @staticmethod
    def _replaced(state: NodeState, device: DeviceSample, sample: NodeSample) -> list[Output]:
        """A GPU new to the node: the GPU it replaced (one at its index the sample does not
        show) is gone from the node for good. Every finding open on the old one resolves and
        its state is forgotten, so a repaired node's lost or failed GPU neither alerts for
        ever nor has its drain asked again every ``reask_s``. A GPU missing without a new one
        in its place (fallen off the bus, the node rebooted without it: the others' indices
        may shift then, but their uuids are known) is still missing."""
        shown = {d.uuid for d in sample.devices}
        out: list[Output] = []
        for uuid, old in list(state.devices.items()):
            if old.index != device.index or uuid in shown:
                continue
            why = (f"{uuid} was replaced by {device.uuid} (GPU {device.index} of node "
                   f"{sample.node})")
            out += [resolved(finding_id, open_.fingerprint, open_.kind, open_.subject, why,
                             open_.since, max(sample.ts, open_.since))
                    for finding_id, open_ in state.findings.items()
                    if open_.subject.device == uuid]
            del state.devices[uuid]
            state.rollups.last_dbe.pop(uuid, None)
            state.summary_dirty = True
        return out

    @staticmethod
    def _unknown_back(state: NodeState, sample: NodeSample, unknown: DeviceState
                      ) -> list[Output]:
        """Whether ``sample`` ends the loss of a GPU filed without a UUID (the NVML collector
        could not read it at its start, so no sample of its own will ever answer): it does
        when every GPU of the node answers (``gpu_count``) and one of them is a GPU the node's
        samples had not shown since the loss (new to the node, or silent until now), read
        before the sample's devices update their state. Otherwise the loss, and its drain
        asked again every ``reask_s``, outlived the GPU's repair for ever. A node under MIG
        reconfiguration leaves it to :meth:`_reconfig`, which settles its reset's losses."""
        lost = unknown.hw.lost
        if lost is None or sample.ts <= lost.since or state.mig_reconfig_since is not None:
            return []
        answering = [device.uuid for device in sample.devices
                     if device.kind == "gpu" and hardware.answers(device)]
        if len(answering) < max(1, state.gpu_count):
            return []
        back = [uuid for uuid in answering
                if (dev := state.devices.get(uuid)) is None or dev.hw.last_ts is None
                or dev.hw.last_ts < lost.since]
        if not back:
            return []
        out: list[Output] = list(hardware.lost_over(
            unknown.hw, node=sample.node, uuid=_UNKNOWN_GPU, ts=sample.ts,
            why=f"all {len(answering)} GPUs of the node answer, {', '.join(back)} not read "
                "since the loss"))
        unknown.out_of_service = None
        state.summary_dirty = True
        return out

    def _forget_old_layout(self, state: NodeState, sample: NodeSample) -> None:
        """Forget the MIG devices of the layout a reconfiguration replaced: those ``sample``
        (the node's first ``mig_settle_s`` after the success) does not show, with nothing
        open on them. NVML names each new GPU instance with a new UUID, so a node
        repartitioned every day otherwise kept every MIG device it ever had, in every
        changelog write of its state. A whole GPU is kept however silent: its hardware
        history is its own, and a lost one has its finding open."""
        shown = {device.uuid for device in sample.devices}
        shown.update(device.parent_uuid for device in sample.devices if device.parent_uuid)
        named = {finding.subject.device for finding in state.findings.values()}
        checks = self._prepare(None, None, state.pool).checks
        gone = [uuid for uuid, dev in state.devices.items()
                if uuid.startswith("MIG-") and uuid not in shown and uuid not in named
                and dev.idle.open_id is None and not _out_of_service(dev, checks)]
        for uuid in gone:
            del state.devices[uuid]
            state.rollups.last_dbe.pop(uuid, None)

    @staticmethod
    def _end_reconfig(state: NodeState) -> None:
        """Nothing left of the node's reconfiguration to settle."""
        state.mig_reconfig_since = state.mig_reconfig_until = None
        state.mig_held = {}

    def _note(self, state: NodeState, out: list[Output]) -> None:
        """Keep the findings ``out`` opens on the node (re-issued ones replace themselves)
        and forget those it resolves; then the node actions (:meth:`_note_asks`). Called
        only with outputs: never per sample."""
        opened = state.findings
        for item in out:
            if isinstance(item, Finding):
                if item.state == "firing":
                    opened[item.id] = OpenFinding(item.fingerprint, item.kind, item.subject,
                                                  item.starts_at)
                else:
                    opened.pop(item.id, None)
        self._note_asks(state, out)

    def _note_asks(self, state: NodeState, out: list[Output]) -> None:
        """Keep the node actions the rules asked for in ``out``, to ask for them again while
        their findings stay open; forget those of the findings ``out`` resolves."""
        every = self.settings.reask_s
        if every is None:
            return
        asks = state.asks
        for item in out:
            if isinstance(item, Action):
                if item.verb in REASKED_VERBS and item.reask == 0:
                    asks[item.idempotency_key] = item
            elif isinstance(item, Finding) and item.state == "resolved" and asks:
                for key in [k for k, ask in asks.items() if item.id in ask.finding_ids]:
                    del asks[key]
        self._due(state)

    def _due(self, state: NodeState) -> None:
        """When the first of the node's asks is due again (None: none, or never asked)."""
        every = self.settings.reask_s
        asks = state.asks
        state.asks_due = (min(ask.ts for ask in asks.values()) + every
                          if asks and every is not None else None)

    def _reask(self, state: NodeState, ts: float) -> list[Output]:
        """The node's asks due at ``ts`` (its sample's event time), asked for again under
        their idempotency keys with ``ts``; a cordon or taint of a node that takes no new
        pods waits, and so does an action of a GPU reset's finding while the node's MIG
        reconfiguration is unsettled (one its worker read ahead of the ``pending``: it was
        asked for once, before the join knew)."""
        every = self.settings.reask_s
        assert every is not None
        out: list[Output] = []
        due: list[float] = []
        settling = state.mig_reconfig_since is not None
        for key, ask in state.asks.items():
            if ts - ask.ts < every:
                due.append(ask.ts + every)
            elif ((state.cordoned and ask.verb in _KEPT_OFF)
                  or (settling and ask.rule in reconfig.HELD_KINDS)):
                due.append(ts + every)
            else:
                again = state.asks[key] = msgspec.structs.replace(ask, ts=ts,
                                                                   reask=ask.reask + 1)
                out.append(again)
                due.append(ts + every)
        state.asks_due = min(due) if due else None
        return out

    def reask_due(self, state: NodeState, node: str, ts: float) -> list[Output]:
        """The node's asks due by ``ts``, the clock of its partition (the newest sample of any
        node of it), asked for again as its own sample would ask for them: a node whose
        collector stopped (its driver hung, the collector crashed) sends no sample, and its
        fault, whose node action the executor may have refused, holds all the same. A
        deleted node asks for nothing."""
        due = state.asks_due
        if due is None or ts < due or state.deleted:
            return []
        out = self._reask(state, ts)
        if out:
            log.info("node %s: %d node action(s) asked again at its partition's event time "
                     "%.0f; its own newest sample is of %s", node, len(out), ts,
                     "never" if state.rollups.watermark is None
                     else f"{state.rollups.watermark:.0f}")
        return out

    def silence(self, state: NodeState, node: str, ts: float) -> list[Output]:
        """The ``node_silent`` finding of a node with GPUs none of whose samples has come for
        ``silent_after_s`` by ``ts``, the clock of its partition (:class:`NodeStates`), counted
        from its newest sample or from when it was expected to send (``expected_from``),
        whichever is later. Nothing for a node told already, deleted,
        taking no new pods, or under MIG reconfiguration (mig-manager stops the GPUs'
        clients), nor where the node's pool turns the rule off."""
        if (state.silent is not None or _excused(state)
                or not (state.gpu_count or state.devices)):
            return []
        settings = self._prepare(None, None, state.pool).resolved.of(
            silent.KIND, silent.NodeSilentSettings)
        last, expected = state.rollups.watermark, state.expected_from
        since = max(last if last is not None else -1.0,
                    expected if expected is not None else -1.0)
        if not settings.enabled or since < 0 or ts - since < settings.silent_after_s:
            return []
        finding, state.silent = silent.opened(
            node, since, ts, state.gpu_count or len(state.devices), since == last, settings)
        out: list[Output] = [finding]
        self._note(state, out)
        log.warning("%s", finding.summary)
        return out

    def _behind(self, state: NodeState, ts: float) -> bool:
        """Count a sample too far back in the node's run of them; True once the run has
        kept to its own clock for ``clock_step_after_s``. A sample more than
        ``clock_back_s`` off the run's newest (either way) starts a new run; one at or
        before it (a redelivery) neither extends nor breaks it."""
        last = state.behind_last
        if last is None or abs(ts - last) > self.settings.clock_back_s:
            state.behind_since = state.behind_last = last = ts
        elif ts > last:
            state.behind_last = last = ts
        assert state.behind_since is not None
        return last - state.behind_since >= self.settings.clock_step_after_s

    def _take_new_clock(self, state: NodeState, node: str, step: float) -> list[Output]:
        """Take the node's new clock after a step back of ``step`` s: the open rollup
        minutes of the old clock are emitted as they stand, and each rule's state is moved
        to the new clock by its runner's ``on_clock_step`` (runs start over, open episodes go
        on). Once per step, so it may loop over every device."""
        log.warning("node %s: its collector's clock went back %.0f s and kept to it for "
                    "%g s; taking the new clock (open episodes go on, runs start over)",
                    node, step, self.settings.clock_step_after_s)
        if self.on_clock_step is not None:
            self.on_clock_step(node, step)
        out: list[Output] = list(self.fold.new_clock(state.rollups, node))
        state.behind_since = state.behind_last = None
        state.last_summary_ts, state.summary_dirty = None, True
        state.clock_steps += 1  # the fleet agent takes the next summary however old
        if state.mig_reconfig_until is not None:  # its grace ends as long after on the new
            state.mig_reconfig_until -= step
        if state.waiting_xids:  # judged on the new clock as long after
            state.waiting_xids = [msgspec.structs.replace(event, ts=event.ts - step)
                                  for event in state.waiting_xids]
        if state.asks:  # asked for on the old clock: due on the new one as long after
            state.asks = {key: msgspec.structs.replace(ask, ts=ask.ts - step)
                          for key, ask in state.asks.items()}
            state.asks_due = None if state.asks_due is None else state.asks_due - step
        hooks = [(runner, runner.on_clock_step)
                 for runner, _ in self.policy.registry.device_runners()
                 if runner.on_clock_step is not None]
        for dev in state.devices.values():
            for own in (dev, *dev.shares.values()):
                for runner, hook in hooks:
                    if own is dev or runner.per_holder:
                        if runner.state in _TYPED_TRACKS or runner.state in own.tracks:
                            hook(track_of(own, runner), step)
                if own.attributed_since is not None:
                    own.attributed_since -= step
            dev.out_of_service = None
        return out

    @staticmethod
    def _unwatched(state: NodeState, holding: Holding, prepared: _Prepared, node: str,
                   ts: float) -> list[Output]:
        """The episodes that the runners a holding of its kind is left out of (``watches``)
        have open on its devices, closed: opened under a policy that judged its kind (the
        worker restarted with one that does not), nothing would judge them again while the
        pod holds the devices, for weeks for a server."""
        out: list[Output] = []
        for uuid in holding.devices:
            dev = state.devices.get(uuid)
            if dev is not None:
                for runner, hook in prepared.unwatched:
                    out += hook(track_of(dev, runner), node, uuid, ts)
        return out

    def _on_shares(self, state: NodeState, holders: _Holders, dev: DeviceState,
                   device: DeviceSample, node: str, ts: float,
                   bucket: dict[str, rollup.Minute] | None, *, judge: bool = True
                   ) -> list[Output]:
        """Run the per-holder runners once per holder of a shared device, on its share
        (unless not ``judge``: the device is out of service), and fold each holder's share
        into a rollup row of its own."""
        out: list[Output] = []
        pool = state.pool
        for share in device.holders:
            key, holding = _share_holding(state, holders, share)
            if key is None:
                continue  # a holder with neither name nor uid: nothing to judge
            if bucket is not None:
                who = (self._holding_who(holding) if holding is not None
                       else self._who(None, share.pod))
                self.fold.add_share(bucket, device, share, ts, who)
            own = dev.shares.get(key)
            if not judge and (own is None or own.idle.open_id is None):
                continue
            if own is None:
                own = dev.shares[key] = DeviceState(attributed=share.pod, attributed_since=ts)
            view = _share_view(device, share)
            if holding is not None:
                resolved = self.policy.resolve(holding.pod.namespace, holding.queue, pool)
                steps = resolved.samples
                holder: idle.Holder | None = _idle_holder(holding, resolved)
            elif share.pod is not None and own.attributed_since is not None:
                steps = self.policy.resolve(share.pod.namespace, None, pool).samples
                holder = idle.Holder(share.pod, own.attributed_since)
            else:
                steps, holder = self.policy.resolve(None, None, pool).samples, None
            for hook, _name, _gpu_only, runner, settings in steps:
                if runner.per_holder:
                    out += hook(track_of(own, runner), node, view, ts, settings, holder)
        return out

    def on_hw_event(self, state: NodeState, event: HwEvent) -> list[Output]:
        newest = state.rollups.watermark
        if (state.behind_since is not None and newest is not None
                and event.ts < newest - self.settings.clock_back_s):
            # While the node's samples say its collector's clock went back, as a sample's:
            # the rules would take it for one long past, or skip it unseen. The node's
            # samples alone decide when its new clock is taken. Otherwise an event that far
            # behind is a late one (the worker reading the hardware events behind the
            # samples after an outage), and an XID is a fact however late: it is judged.
            raise Rejected(
                f"event time {event.ts:.0f} of the {event.kind} event is "
                f"{newest - event.ts:.0f} s before node {event.node}'s newest sample "
                f"({newest:.0f}; more than clock_back_s={self.settings.clock_back_s:g} s): "
                "its collector's clock went back (or the event is that late); its hardware "
                "events that far back are refused, and after a step back until "
                "the node's samples have kept to the new clock for clock_step_after_s="
                f"{self.settings.clock_step_after_s:g} s")
        # Only the kinds some runner takes: throttle_start/stop and ecc_sbe are left to the
        # samples, since the thermal and SBE rules need the whole window of readings.
        if event.kind == "xid" and event.uuid is not None:
            self.fold.count_xid(state.rollups, event.uuid, event.ts)
        return self._judge_event(state, event, may_wait=True)

    def _judge_event(self, state: NodeState, event: HwEvent, *, may_wait: bool
                     ) -> list[Output]:
        if state.deleted:  # judged by no rule, as its samples
            return []
        hooks = self.policy.resolve(None, None, state.pool).events.get(event.kind, ())
        uuid = event.uuid
        if uuid is None:
            hooks = tuple(h for h in hooks if event.kind in h[0].events_without_uuid)
            uuid = _UNKNOWN_GPU
        if not hooks:
            return []
        dev = state.devices.get(uuid)
        if dev is None:
            dev = state.devices[uuid] = DeviceState()
        holder = self._event_holder(state, dev, uuid, event.ts)
        if holder is None and may_wait and self._waits(state, event):
            state.waiting_xids.append(event)
            return []
        out: list[Output] = []
        for runner, hook, settings in hooks:
            out += hook(track_of(dev, runner), event, uuid, settings, holder)
        dev.out_of_service = None
        if out and state.mig_reconfig_since is not None:
            out = self._reconfig(state, out, None)
        if out:
            self._note(state, out)
            state.summary_dirty = True
            out += self._maybe_summary(state, event.node, event.ts)
        return out

    def on_allocation(self, state: NodeState, event: AllocationEvent) -> list[Output]:
        if isinstance(event, NodeInventory):
            return self._on_inventory(state, event)
        return self._on_pod(state, event)

    def _on_inventory(self, state: NodeState, event: NodeInventory) -> list[Output]:
        excused = _excused(state)
        state.gpu_model = event.gpu_product or state.gpu_model
        if _states_gpu_count(event):
            state.gpu_count = event.gpu_count  # 0 included: the node has lost its GPUs
        else:
            state.gpu_count = event.gpu_count or state.gpu_count
        state.gpu_replicas = event.gpu_replicas
        # A deleted node offers nothing and leaves the fleet's view (its summaries are
        # tombstones); the same name created again states its allocatable anew.
        if not event.deleted:
            state.deleted_at = None
        elif not state.deleted or state.deleted_at is None:
            state.deleted_at = event.ts
        state.deleted = event.deleted
        state.gpu_allocatable = 0 if event.deleted else event.allocatable.get("nvidia.com/gpu")
        state.cordoned = event.unschedulable or any(map(_keeps_pods_off, event.taints))
        state.spot = event.spot
        if state.asks_due is not None:  # a cordon that waited may be due as the node reopens
            self._due(state)
        state.pool = event.labels.get(self.policy.node_pool_label)
        # Profiles as pods request them (``1g.10gb+me``, not the resource's ``1g.10gb.me``),
        # or a held device would never be taken off the free ones.
        # A deleted node offers no MIG device either.
        state.mig_allocatable = {} if event.deleted else {
            profile: count for key, count in event.allocatable.items()
            if (profile := mig_resource_profile(key)) is not None}
        single = single_strategy_profile(event.gpu_product) \
            if event.mig_strategy == "single" else None
        if single is not None and not event.deleted:
            # Under ``single`` every nvidia.com/gpu is a MIG device of the labelled profile
            # (the watcher reports pods' GPUs so): they are MIG devices free, not GPUs.
            state.mig_allocatable[single] = state.mig_allocatable.get(single, 0) + \
                (state.gpu_allocatable or 0)
            state.gpu_allocatable = 0
        state.summary_dirty = True
        out = self._mig_config(state, event)  # a failed reconfiguration's warning resolves
        if out:
            self._note(state, out)
        if event.deleted:
            out += self._gone(state, event.node, event.ts)
        if state.expected_from is None or (excused and not _excused(state)):
            state.expected_from = event.ts
        return out + self._maybe_summary(state, event.node, event.ts)

    @staticmethod
    def _gone(state: NodeState, node: str, ts: float) -> list[Output]:
        """The node was deleted: every finding open on it resolves under its id, and its
        rules' state and asks are forgotten, so nothing fires again from them and the node
        created again under its name starts afresh. Once: a redelivered deletion finds
        nothing open (or, read again from an older checkpoint, resolves the same ids at the
        same time)."""
        why = f"node {node} deleted from the cluster"
        out: list[Output] = [
            resolved(finding_id, open_.fingerprint, open_.kind, open_.subject, why,
                     open_.since, max(ts, open_.since))
            for finding_id, open_ in state.findings.items()]
        state.findings, state.devices = {}, {}
        state.asks, state.asks_due = {}, None  # nothing left to act on
        state.silent = None
        return out

    def forget(self, state: NodeState, node: str) -> list[Output]:
        """The outputs due before a deleted node's state is removed: its open rollup minutes,
        as they stand (no later sample of the node will close them, and the weekly report
        counts its last GPU-minutes). Its holdings leave the join's cache."""
        for holding in state.pods.values():
            self._held.pop(id(holding), None)
        return list(self.fold.flush(state.rollups, node))

    @staticmethod
    def _mig_config(state: NodeState, event: NodeInventory) -> list[Output]:
        """Follow mig-manager's state of the node: a reconfiguration's window, and one
        warning per failed one (resolved by a success, or the node's deletion)."""
        state.mig_config, state.mig_config_state = event.mig_config, event.mig_config_state
        now = None if event.deleted else event.mig_config_state
        out: list[Output] = []
        if now in reconfig.RECONFIGURING:
            if state.mig_reconfig_since is None:
                state.mig_reconfig_since = event.ts
            state.mig_reconfig_until = None
        elif now == "success" and state.mig_reconfig_since is not None:
            state.mig_reconfig_until = state.mig_reconfig_until or event.ts
        elif now is None:  # deleted, or no longer managed by mig-manager
            NodeJoin._end_reconfig(state)
        if now == "failed" and state.mig_failed is None:
            finding, state.mig_failed = reconfig.failed(event.node, event.mig_config, event.ts)
            out.append(finding)
        elif now not in ("failed", *reconfig.RECONFIGURING) and state.mig_failed is not None:
            out.append(reconfig.recovered(state.mig_failed, event.node, event.mig_config,
                                          event.ts))
            state.mig_failed = None
        return out

    def _on_pod(self, state: NodeState, event: PodAllocation) -> list[Output]:
        key = _pod_key(event.pod)
        out: list[Output] = []
        if event.phase in ("finished", "deleted"):
            holding = state.pods.get(key)
            if holding is not None and holding.ended_at is None:
                holding.ended_at = event.ts
                out += self._release(state, holding, key, event.node, event.ts)
                state.summary_dirty = True
        elif event.phase in ("bound", "running"):
            known = state.pods.get(key)
            if known is not None and known.ended_at is not None and event.ts <= known.ended_at:
                return []  # a repeat of the pod's start, read after its end
            if known is not None:  # replaced: nothing would reach its cache entry again
                self._held.pop(id(known), None)
            holding = state.pods[key] = Holding(
                pod=event.pod, started_at=event.started_at or event.ts,
                devices=list(event.device_ids), gpus=event.gpus, mig=dict(event.mig),
                workload_kind=event.workload_kind, queue=event.queue,
                labels=dict(event.labels), annotations=dict(event.annotations),
                owner_kind=event.owner_kind, owner_name=event.owner_name,
                gang=event.gang if event.gang_size != 1 else None,
                images=list(event.images), memory_grows=event.memory_grows,
            )
            rollup.reattribute(state.rollups, self._holding_who(holding))
            state.summary_dirty = True
        if out:
            self._note(state, out)
        return out + self._maybe_summary(state, event.node, event.ts)

    def _vacated(self, state: NodeState, dev: DeviceState, uuid: str, holders: _Holders,
                 node: str, ts: float) -> list[Output]:
        """The collector saw the device's pod leave it (its sample at ``ts`` attributes the
        device to no one): a pod no allocation holds (the watcher never reported it, or
        not yet) has let the device go, and nothing else would ever say so, so its
        devices' rules are released as at a pod's end. One an allocation holds keeps it
        (a container restarting) until its end releases it."""
        left = dev.vacated_by
        if left is None or holders.find(left) is not None:
            return []
        out: list[Output] = []
        for runner, _ in self.policy.resolve(None, None, state.pool).device:
            if runner.on_release is not None:
                out += runner.on_release(track_of(dev, runner), node, uuid, ts)
        return out

    def _release(self, state: NodeState, holding: Holding, key: str, node: str, ts: float,
                 held: dict[str, Holding] | None = None) -> list[Output]:
        """Run the release hooks on the devices ``holding`` (``state.pods[key]``) let go of,
        but those another pod holds now (in ``held``, by device id), and on its shares of
        shared devices, which leave the state."""
        releases = [(runner, runner.on_release) for runner, _ in
                    self.policy.resolve(None, None, state.pool).device
                    if runner.on_release is not None]
        out: list[Output] = []
        for uuid in holding.devices:
            dev = state.devices.get(uuid)
            if dev is not None and (held is None or uuid not in held):
                for runner, release in releases:
                    out += release(track_of(dev, runner), node, uuid, ts)
        keys = _share_keys(state, holding, key)
        for uuid, dev in state.devices.items():  # its shares of shared devices
            if dev.shares:
                for share_key in keys:
                    share = dev.shares.pop(share_key, None)
                    if share is not None:
                        for runner, release in releases:
                            if runner.per_holder:
                                out += release(track_of(share, runner), node, uuid, ts)
        return out

    def _expire(self, state: NodeState, holders: _Holders, node: str, ts: float
                ) -> list[Output]:
        """Forget the ended holdings the node's samples are (at ``ts``) well past, releasing
        their devices once more: a worker that read a pod's end ahead of its last samples
        (catching up, it reads the small allocations topic first) released them before
        those samples, which then judged the devices as the pod's again, and an episode
        they opened (an idle notebook's last 30 min) had nothing left to close it: it fired
        for ever. A device another pod holds now is left to that pod's (its run goes on).
        Their shares of shared devices go too: otherwise a time-sliced GPU's state kept one
        share per pod that ever ran on it, on every changelog write of the node."""
        out: list[Output] = []
        for key in holders.expired:
            holding = state.pods.pop(key)
            self._held.pop(id(holding), None)
            out += self._release(state, holding, key, node, ts, holders.by_device)
        return out

    def _who(self, holding: Holding | None, attributed: PodRef | None
             ) -> rollup.Attribution | None:
        """The rollup attribution of a device: its holding's, else the collector's pod."""
        if holding is not None:
            return holding.who or self._holding_who(holding)
        if attributed is not None:
            return rollup.attribution(attributed, team_labels=self.settings.team_labels,
                                      allocated=False)
        return None

    def _holding_who(self, holding: Holding) -> rollup.Attribution:
        """The holding's rollup attribution, made once and kept on it."""
        if holding.who is None:
            holding.who = rollup.attribution(
                holding.pod, labels=holding.labels, owner_kind=holding.owner_kind,
                owner_name=holding.owner_name, workload_kind=holding.workload_kind,
                queue=holding.queue, team_labels=self.settings.team_labels)
        return holding.who

    def _waits(self, state: NodeState, event: HwEvent) -> bool:
        """Whether an XID with no holder known waits for the node's samples: an
        application-class one (judged by who held the GPU) read before the node's samples
        reached its time. The hardware events have an agent of their own, and one reading
        them ahead of the samples and allocations (catching up after an outage) would
        otherwise take every such XID for one of a holder not known, and so the GPU for the
        suspect. An XID of any other class is judged at once: it acts on its own."""
        newest = state.rollups.watermark
        if event.kind != "xid" or event.xid is None or (newest is not None
                                                         and event.ts <= newest):
            return False
        if len(state.waiting_xids) >= MAX_WAITING_XIDS:
            return False
        xids = self.policy.resolve(None, None, state.pool).rules.get(xid_rule.KIND)
        return isinstance(xids, xid_rule.XidSettings) and xids.judges_by_holder(event.xid)

    def _judge_waiting(self, state: NodeState, ts: float) -> list[Output]:
        """Judge the waiting XIDs the node's samples have now reached (at ``ts``)."""
        due = [event for event in state.waiting_xids if event.ts <= ts]
        if not due:
            return []
        state.waiting_xids = [event for event in state.waiting_xids if event.ts > ts]
        out: list[Output] = []
        for event in due:
            out += self._judge_event(state, event, may_wait=False)
        return out

    def _event_holder(self, state: NodeState, dev: DeviceState, uuid: str, ts: float
                      ) -> idle.Holder | None:
        """Who held the device at a hardware event's time (an event names no pod): the
        allocation holding it by device id then (started by ``ts``, not ended; the latest
        started), else the pod the collector last attributed it to (by its allocation where
        one matches). Event time decides, as the events may be read after the allocations
        of a later pod on the device. Unlike a sample's holder, a pod the collector saw leave
        the device still holds it: a crash-looping pod's container is gone between its XID
        and its restart, and its allocation is not. Looked up per event, never kept: events
        are rare and samples must not pay for them."""
        holding: Holding | None = None
        for held in state.pods.values():
            if (uuid in held.devices and held.started_at <= ts
                    and (held.ended_at is None or ts < held.ended_at)
                    and (holding is None or held.started_at >= holding.started_at)):
                holding = held
        attributed = dev.attributed
        if holding is None and attributed is not None:
            holding = _Holders(state.pods, ts, self.settings.rollup_lateness_s).find(attributed)
            if holding is None:
                return idle.Holder(attributed, dev.attributed_since or ts)
        return _idle_holder(holding) if holding is not None else None

    @staticmethod
    def _holding(dev: DeviceState, device: DeviceSample, holders: _Holders,
                 ts: float) -> Holding | None:
        """The allocation holding the device, by its device ids or the collector's attribution."""
        if device.pod != dev.attributed:
            dev.vacated_by = dev.attributed if device.pod is None else None
            dev.attributed, dev.attributed_since = device.pod, ts
        holding = holders.by_device.get(device.uuid)
        if holding is None and device.pod is not None:
            holding = holders.find(device.pod)
        elif (holding is not None and dev.vacated_by is not None
              and idle.same_pod(dev.vacated_by, holding.pod)):
            # The collector saw this pod leave the device; the allocation's end has not
            # arrived yet (it is on another topic, and a worker catching up can read the
            # samples ahead of it). The device is judged as held by no one meanwhile, so
            # minutes after the pod's end never count as its idleness.
            return None
        return holding

    def _maybe_summary(self, state: NodeState, node: str, ts: float) -> list[Output]:
        due = (state.last_summary_ts is None
               or ts - state.last_summary_ts >= self.settings.summary_interval_s)
        if not (state.summary_dirty or due):
            return []
        state.last_summary_ts, state.summary_dirty = ts, False
        if state.deleted:
            # A tombstone: the node is gone, whatever its pods' last events still say
            # (they are deleted after it); nothing on it is free, held or reclaimable.
            return [NodeSummary(
                ts=ts, node=node, gpu_model=state.gpu_model, gpus_total=0, gpus_free=0,
                healthy=self._healthy(state), cordoned=state.cordoned, spot=state.spot,
                gpu_replicas=state.gpu_replicas,
                replicas_free=0 if state.gpu_replicas > 1 else None, pool=state.pool,
                clock_steps=state.clock_steps, deleted=True)]
        holding = [h for h in state.pods.values() if h.ended_at is None]
        used = sum(h.gpus for h in holding)
        # Free is what the scheduler could still place: a GPU out of allocatable (failed,
        # or its device plugin restarting) is not free, though the node still has it.
        offered = state.gpu_count * state.gpu_replicas
        if state.gpu_allocatable is not None:
            offered = min(offered, state.gpu_allocatable)
        schedulable = offered // state.gpu_replicas
        replicas_free = None
        if state.gpu_replicas > 1:
            # Replicas of shared GPUs: a physical GPU is used when any replica of it is held
            # (by device ids; without them, as tightly packed as replicas allow).
            replicas_free = max(0, offered - used)
            physical = {d.split("::", 1)[0] for h in holding if h.gpus for d in h.devices}
            used = len(physical) if physical else -(-used // state.gpu_replicas)
        healthy = self._healthy(state)
        mig_free = dict(state.mig_allocatable)
        if state.mig_config_state in reconfig.RECONFIGURING:
            # mig-manager is tearing down and remaking the node's GPU instances: nothing
            # placed there now would run, whatever allocatable still says.
            schedulable, mig_free = 0, {}
            replicas_free = 0 if replicas_free is not None else None
        holds, gang_holds = self._idle_holds(state)
        teams: dict[str, float] = {}
        for held in holding:  # by the team the rollups name (team budgets count it)
            team = (held.who or self._holding_who(held)).team
            gpus = teams.get(team, 0.0) + held.gpus
            if held.mig:  # most pods hold whole GPUs: skip the MIG arithmetic for them
                gpus += budget.mig_gpus(held.mig)
                for profile, count in held.mig.items():
                    mig_free[profile] = mig_free.get(profile, 0) - count
            teams[team] = gpus
        return [NodeSummary(
            ts=ts, node=node, gpu_model=state.gpu_model, gpus_total=state.gpu_count,
            gpus_free=max(0, schedulable - used), healthy=healthy,
            cordoned=state.cordoned, spot=state.spot, gpu_replicas=state.gpu_replicas,
            replicas_free=replicas_free,
            mig_free={profile: n for profile, n in mig_free.items() if n > 0},
            mig_total={profile: n for profile, n in state.mig_allocatable.items() if n > 0},
            mig_changing=state.mig_config_state in reconfig.RECONFIGURING,
            pool=state.pool, idle=holds, idle_gangs=gang_holds,
            held_by_team={team: gpus for team, gpus in teams.items() if gpus > 0},
            clock_steps=state.clock_steps,
        )]

    def _healthy(self, state: NodeState) -> bool:
        """No device's state holds an episode that takes it out of service. Loops, not a
        generator over (device, check) pairs: it runs for every summary of every node."""
        checks = self._prepare(None, None, state.pool).checks
        for dev in state.devices.values():
            if _out_of_service(dev, checks):
                return False
        return True

    @staticmethod
    def _idle_holds(state: NodeState) -> tuple[list[IdleHold], list[IdleHold]]:
        """The devices the idle rule has an open episode on: the fleet agent's input for
        demand-aware reclaim (it matches them with the demand waiting fleet-wide), and,
        apart, those of gang members, for its gang rule (one member is not reclaimed on its
        own: reclaiming it would stop the whole gang)."""
        holds: list[IdleHold] = []
        gang_holds: list[IdleHold] = []
        if state.mig_config_state in reconfig.RECONFIGURING:
            return holds, gang_holds  # its pods are being evicted: nothing to reclaim
        for uuid, dev in state.devices.items():
            track = dev.idle
            if track.open_id is None or track.open_pod is None or track.open_since is None:
                continue
            holding = state.pods.get(_pod_key(track.open_pod))
            if holding is not None and holding.ended_at is not None:
                continue  # let go (lingering for late samples only)
            # A pod of several devices has one episode, on one of them: reclaiming it frees
            # them all, its whole GPUs in this hold, each MIG device in one of its own.
            devices = [uuid] if holding is None or not _several(holding) else [uuid, *(
                other for other in _pod_devices(state, holding.pod, holding.devices)
                if other != uuid and state.devices[other].idle.open_id is None)]
            gpus = sum(not device.startswith("MIG-") for device in devices)
            gang = holding.gang if holding is not None else None
            into = holds if gang is None else gang_holds
            for device in devices:
                mig = device.startswith("MIG-")
                if not mig and device != uuid:
                    continue
                profile = next(iter(holding.mig), None) if mig and holding is not None else None
                into.append(IdleHold(
                    device=device, pod=track.open_pod, idle_since=track.open_since,
                    gpus=0 if mig else gpus, mig_profile=profile,
                    workload_kind=holding.workload_kind if holding is not None else None,
                    kept_until=track.held_until, ladder_step=track.stage, gang=gang))
        return holds, gang_holds
