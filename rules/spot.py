"""Spot interruptions: requeue a node's restartable work before the node goes.

A spot node that receives a termination taint (AWS node-termination-handler's
``spot-itn``, Karpenter's ``karpenter.sh/disrupted``, GKE's
``impending-node-termination``, cluster-autoscaler's scale-down taint) has
seconds to minutes left. The rule opens one ``spot_interruption`` finding per
episode (taint seen -> taint gone or node deleted) and asks for a
``requeue`` action for every restartable pod on the node: pods owned by a
Job-like controller or a Kueue Workload, whose work a checkpoint-and-restart
elsewhere preserves. Other pods (notebooks, bare pods, StatefulSets) are
named in the finding but not requeued: a restart loses their state, so a
human decides. A restartable pod that lands on the node during the episode
is requeued too.

AKS's ``kubernetes.azure.com/scalesetpriority=spot`` taint is on every node
of a spot pool from its creation: it marks placement, not an eviction, and
is deliberately not a termination key.

State is per node (its pods from allocation events and the open episode),
so the rule runs where the node's allocation events are: on the worker that
owns the node's partition. Pod events at or before the last one applied for
the pod (by time, then lifecycle order) and inventories older than the last
are ignored, so duplicates and late arrivals never reopen or close an
episode.
"""

from __future__ import annotations

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.schema import (
    Action,
    Evidence,
    Finding,
    NodeInventory,
    PodAllocation,
    PodRef,
    Subject,
)

KIND = "spot_interruption"

RUNBOOK = (
    "The cloud is reclaiming this spot node. Restartable work has been requeued (check the "
    "requeue actions and that the jobs resume from their last checkpoint elsewhere); move "
    "the listed non-restartable pods by hand if their state matters. Nothing to fix on the "
    "node itself."
)


_PHASE_ORDER = {"pending": 0, "bound": 1, "running": 2, "finished": 3, "deleted": 4}
"""Pod phases in lifecycle order, to order two events of a pod with the same time."""


SPOT_NOTICE_TAINTS = frozenset({"aws-node-termination-handler/spot-itn"})
"""Termination taints only a spot interruption notice sets: the node is spot whatever its
labels say (a self-managed node group's nodes carry no capacity-type label)."""


class SpotSettings(BaseModel):
    """Settings of the spot-interruption rule."""

    model_config = ConfigDict(extra="forbid")

    termination_taints: list[str] = Field(
        default_factory=lambda: [
            "aws-node-termination-handler/spot-itn",
            "aws-node-termination-handler/asg-lifecycle-termination",
            "karpenter.sh/disrupted",
            "cloud.google.com/impending-node-termination",
            "ToBeDeletedByClusterAutoscaler",
        ],
        description="Taint keys that announce the node's termination. Rebalance "
        "recommendations are left out: they are advice, and requeueing on them would churn.",
    )
    restartable_owners: list[str] = Field(
        default_factory=lambda: ["Job", "Workload", "JobSet", "PyTorchJob", "TFJob",
                                 "MPIJob", "RayJob", "RayCluster"],
        description="Owner kinds whose pods are requeued: batch controllers that recreate "
        "their pods and resume from checkpoints.",
    )
    spot_only: bool = Field(
        True,
        description="Act only on nodes marked spot (by a capacity-type label, or by the "
        "spot interruption notice taint itself). False also requeues on on-demand nodes "
        "that get a termination taint (e.g. Karpenter consolidation).",
    )


class SpotPod(msgspec.Struct):
    pod: PodRef
    ts: float
    owner_kind: str | None = None
    owner_name: str | None = None
    queue: str | None = None


class SpotNodeTrack(msgspec.Struct):
    """Per-node state of the rule."""

    pods: dict[str, SpotPod] = {}
    pod_event: dict[str, tuple[float, int]] = {}
    """Per pod, the time and lifecycle rank of the last event applied."""
    inventory_ts: float | None = None
    spot: bool = False
    open_id: str | None = None
    open_since: float | None = None
    open_taint: str | None = None
    requeued: list[str] = []


def _pod_key(pod: PodRef) -> str:
    return pod.uid or f"{pod.namespace}/{pod.name}"


def _termination_taint(event: NodeInventory, settings: SpotSettings) -> str | None:
    keys = set(settings.termination_taints)
    return next((t.key for t in event.taints if t.key in keys), None)


def on_inventory(track: SpotNodeTrack, event: NodeInventory,
                 settings: SpotSettings) -> list[Finding | Action]:
    """A node inventory: open an episode on a termination taint, close it when it is gone."""
    # An inventory carries the node's whole state, so one with the same time as the last is
    # applied too: a duplicate changes nothing, a second change in the same second is news.
    if track.inventory_ts is not None and event.ts < track.inventory_ts:
        return []
    track.inventory_ts = event.ts
    taint = None if event.deleted else _termination_taint(event, settings)
    track.spot = event.spot or taint in SPOT_NOTICE_TAINTS
    if taint is not None and (track.spot or not settings.spot_only):
        if track.open_id is not None:
            return []
        fp = fingerprint(KIND, event.node)
        track.open_id, track.open_since, track.open_taint = (
            finding_id(fp, event.ts), event.ts, taint)
        track.requeued = []
        finding = _finding(track, event.node, fp, event.ts, settings)
        return [finding, *_requeue_all(track, finding, event.node, settings)]
    if track.open_id is None or track.open_since is None:
        return []
    fp = fingerprint(KIND, event.node)
    why = "the node was deleted" if event.deleted else "the termination taint was removed"
    closing = resolved(track.open_id, fp, KIND, Subject(node=event.node),
                       f"{event.node}: {why}", track.open_since, event.ts)
    track.open_id = track.open_since = track.open_taint = None
    track.requeued = []
    return [closing]


def on_pod(track: SpotNodeTrack, event: PodAllocation,
           settings: SpotSettings) -> list[Finding | Action]:
    """A pod event on the node; a restartable pod arriving during an episode is requeued."""
    key = _pod_key(event.pod)
    position = (event.ts, _PHASE_ORDER[event.phase])
    last = track.pod_event.get(key)
    if last is not None and position <= last:
        return []
    track.pod_event[key] = position
    if event.phase in ("finished", "deleted"):
        track.pods.pop(key, None)
        return []
    if event.phase not in ("bound", "running"):
        return []
    track.pods[key] = SpotPod(pod=event.pod, ts=event.ts, owner_kind=event.owner_kind,
                              owner_name=event.owner_name, queue=event.queue)
    if track.open_id is None:
        return []
    finding = _finding(track, event.node, fingerprint(KIND, event.node), event.ts, settings)
    return _requeue_all(track, finding, event.node, settings)


def forget_finished_pods(track: SpotNodeTrack, before: float) -> None:
    """Drop the duplicate guards of pods gone before ``before`` (keeps the state small)."""
    for key in [k for k, (ts, _) in track.pod_event.items()
                if ts < before and k not in track.pods]:
        del track.pod_event[key]


def _restartable(pod: SpotPod, settings: SpotSettings) -> bool:
    return pod.owner_kind in settings.restartable_owners


def _finding(track: SpotNodeTrack, node: str, fp: str, ts: float,
             settings: SpotSettings) -> Finding:
    assert track.open_id is not None and track.open_since is not None
    restartable = sorted(f"{p.pod.namespace}/{p.pod.name}" for p in track.pods.values()
                         if _restartable(p, settings))
    stuck = sorted(f"{p.pod.namespace}/{p.pod.name}" for p in track.pods.values()
                   if not _restartable(p, settings))
    return Finding(
        id=track.open_id, fingerprint=fp, kind=KIND, severity="critical", state="firing",
        subject=Subject(node=node),
        summary=f"spot node {node} is being reclaimed ({track.open_taint}): "
        f"{len(restartable)} pods requeued, {len(stuck)} need a decision",
        starts_at=track.open_since, ts=ts,
        evidence=Evidence(window_start=track.open_since, window_end=ts,
                          values={"restartable_pods": float(len(restartable)),
                                  "other_pods": float(len(stuck))}),
        runbook=RUNBOOK,
        labels={"taint": track.open_taint or "", "not_requeued": ",".join(stuck)[:1000]},
    )


def _requeue_all(track: SpotNodeTrack, finding: Finding, node: str,
                 settings: SpotSettings) -> list[Finding | Action]:
    out: list[Finding | Action] = []
    for key, pod in sorted(track.pods.items()):
        if key in track.requeued or not _restartable(pod, settings):
            continue
        track.requeued.append(key)
        target = Subject(node=node, pod=pod.pod, queue=pod.queue)
        action = action_for(finding, "requeue", target,
                            f"spot node {node} is being reclaimed ({track.open_taint})")
        # One action per pod: the idempotency key names the pod as well as the episode.
        params = {"owner_kind": pod.owner_kind or "", "owner_name": pod.owner_name or ""}
        if pod.owner_kind == "Workload" and pod.owner_name:
            # The backend's workload is a name, in params.namespace (as the gang rule's).
            params["workload"] = pod.owner_name
            params["namespace"] = pod.pod.namespace
        out.append(msgspec.structs.replace(
            action, idempotency_key=f"{action.idempotency_key}/{pod.pod.namespace}/{pod.pod.name}",
            params=params,
        ))
    return out
