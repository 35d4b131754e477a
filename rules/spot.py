"""Spot interruptions: requeue a node's restartable work before the node goes.

A spot node that receives a termination taint (AWS node-termination-handler's
``spot-itn``, Karpenter's ``karpenter.sh/disrupted``, GKE's
``impending-node-termination``, cluster-autoscaler's scale-down taint) has
seconds to minutes left. The rule opens one ``spot_interruption`` finding per
episode (taint seen -> taint gone or node deleted) and sorts the node's pods
three ways, as the executor's Kubernetes backend can act on them:

- requeued: a restartable pod (its owner in ``restartable_owners``) that the
  backend can requeue: a Kueue workload's (owner ``Workload``, or the pod's
  ``kueue.x-k8s.io/workload`` annotation or label, which the backend reads), or a
  batch Job's pod (owner ``Job``, ``JobSet``, ``TrainJob``: the backend deletes it
  and the Job recreates it). One ``requeue`` action each;
- left to their controller: a restartable pod of another owner (Kubeflow's
  PyTorchJob, TFJob, MPIJob, JAXJob, ..., KubeRay's RayCluster). The backend
  refuses to delete those pods: whether the run survives losing one depends on
  its restart policy (a worker of a ``restartPolicy: Never`` job fails the whole
  job) and, for a Ray head, on GCS fault tolerance. So no action is asked: the
  finding names them, and their operator recreates them when the node goes;
- need a decision: every other pod (notebooks, bare pods, StatefulSets): a
  restart loses their state, so a human decides.

A pod that lands on the node during the episode is sorted and requeued too.

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
    "The cloud is reclaiming this spot node. The pods of Jobs, JobSets and Kueue workloads "
    "have been requeued (check the requeue actions and that the jobs resume from their last "
    "checkpoint elsewhere). Pods left to their controller (label left_to_controller: "
    "PyTorchJob, MPIJob, RayCluster, ...) are not touched: their operator recreates them "
    "when the node goes, and whether the run survives depends on its restart policy and "
    "checkpoints; requeue or restart the job by hand if it cannot. Move the other listed pods "
    "by hand if their state matters. Nothing to fix on the node itself."
)

REQUEUED_BY_JOB = frozenset({"Job", "JobSet", "TrainJob"})
"""Owner kinds whose pods a batch Job controls (a JobSet's and a Kubeflow Trainer v2 TrainJob's
pods are their Jobs'): the backend requeues such a pod by deleting it, and the Job recreates
it. Other owners' pods are requeued only through a Kueue workload."""

KUEUE_WORKLOAD_KEY = "kueue.x-k8s.io/workload"
"""The pod annotation (or label) naming its Kueue workload, which the backend requeues."""


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
        default_factory=lambda: ["Job", "Workload", "JobSet", "TrainJob", "PyTorchJob",
                                 "TFJob", "MPIJob", "JAXJob", "XGBoostJob", "PaddleJob",
                                 "RayJob", "RayCluster"],
        description="Owner kinds whose pods may restart elsewhere: batch controllers that "
        "recreate their pods and resume from checkpoints. Of these, a Kueue workload's pods "
        "and a Job's, JobSet's or TrainJob's are requeued; the others' are left to their "
        "controller (the backend does not delete them) and named in the finding.",
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
    kueue_workload: str | None = None
    """The Kueue workload its annotation or label names, if any."""


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
    deleted_at: float | None = None
    """Event time of the inventory that said the node was deleted (the first, if read
    again); None while it exists. The worker removes the track some time after."""


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
    if not event.deleted:
        track.deleted_at = None
    elif track.deleted_at is None:
        track.deleted_at = event.ts
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
    track.pods[key] = SpotPod(
        pod=event.pod, ts=event.ts, owner_kind=event.owner_kind, owner_name=event.owner_name,
        queue=event.queue, kueue_workload=(event.annotations.get(KUEUE_WORKLOAD_KEY)
                                           or event.labels.get(KUEUE_WORKLOAD_KEY)))
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


def _requeueable(pod: SpotPod, settings: SpotSettings) -> bool:
    """Whether the pod is restartable and the backend's requeue carries it out (a Kueue
    workload's pod, or a batch Job's), rather than refusing it."""
    return _restartable(pod, settings) and (
        pod.owner_kind == "Workload" or pod.kueue_workload is not None
        or pod.owner_kind in REQUEUED_BY_JOB)


def _finding(track: SpotNodeTrack, node: str, fp: str, ts: float,
             settings: SpotSettings) -> Finding:
    assert track.open_id is not None and track.open_since is not None
    pods = sorted(track.pods.values(), key=lambda p: (p.pod.namespace, p.pod.name))
    requeued = [p for p in pods if _requeueable(p, settings)]
    left = [p for p in pods if _restartable(p, settings) and not _requeueable(p, settings)]
    stuck = [p for p in pods if not _restartable(p, settings)]
    return Finding(
        id=track.open_id, fingerprint=fp, kind=KIND, severity="critical", state="firing",
        subject=Subject(node=node),
        summary=f"spot node {node} is being reclaimed ({track.open_taint}): "
        f"{len(requeued)} to requeue, {len(left)} left to their controller to recreate "
        f"({_owners(left)}), {len(stuck)} need a decision",
        starts_at=track.open_since, ts=ts,
        evidence=Evidence(window_start=track.open_since, window_end=ts,
                          values={"restartable_pods": float(len(requeued) + len(left)),
                                  "requeued_pods": float(len(requeued)),
                                  "left_to_controller_pods": float(len(left)),
                                  "other_pods": float(len(stuck))}),
        runbook=RUNBOOK,
        labels={"taint": track.open_taint or "",
                "not_requeued": _names(left + stuck),
                "left_to_controller": _names(left)},
    )


def _names(pods: list[SpotPod]) -> str:
    return ",".join(sorted(f"{p.pod.namespace}/{p.pod.name}" for p in pods))[:1000]


def _owners(pods: list[SpotPod]) -> str:
    """The owners of the pods left to their controller, for the summary: 'PyTorchJob ml/a'."""
    owners = sorted({f"{p.owner_kind} {p.pod.namespace}/{p.owner_name}" for p in pods})
    more = f" and {len(owners) - 5} more" if len(owners) > 5 else ""
    return (", ".join(owners[:5]) + more) if owners else "none"


def _requeue_all(track: SpotNodeTrack, finding: Finding, node: str,
                 settings: SpotSettings) -> list[Finding | Action]:
    out: list[Finding | Action] = []
    for key, pod in sorted(track.pods.items()):
        if key in track.requeued or not _requeueable(pod, settings):
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
