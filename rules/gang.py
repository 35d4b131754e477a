"""Gangs placed in part: some members hold GPUs while the others cannot start.

A gang is a set of pods that only work together (a JobSet, a PyTorchJob or
MPIJob, a coscheduling or Volcano PodGroup, a Kueue pod group or the pods a
Kueue Workload admits). Without gang scheduling the default scheduler
happily places 6 of 8 workers: the six hold their GPUs and wait on a
collective that never completes, while the two stay pending. Kueue admits a
workload's quota all at once but does not place its pods, so an admitted
workload can be stuck the same way.

The rule follows every gang member on the queue topic (the watcher reports
a member through its whole life: pending, ``admitted`` when bound to a node,
finished or deleted; a Kueue Workload states the gang's size). A gang is
*partial* while at least one member is placed, fewer than the gang's size
are, and none has finished yet (a gang whose members finish one by one is
ending, not stuck). When it stays partial for ``window_s`` the rule raises
one finding per episode with the GPUs held hostage and their GPU-hours so
far, and (``requeue``) asks to requeue the whole gang: the Kueue workload
when there is one (``params.workload``), else a placed member's pod, which
the backend requeues only where that requeues the gang's owner (a Job's
pod) and refuses otherwise. The action is a dry run unless
``requeue_execute``. The episode resolves when the gang is whole, has no
member placed any more, or ends.

A gang all of whose placed members are idle (``gang_idle``) is the fleet's
to judge: each node's join tells and warns the owner of its idle members but
never reclaims one (that would stop the whole gang, its busy members on other
nodes too), and sends their idle holds in its summary apart
(``NodeSummary.idle_gangs``). When every placed member of a whole gang (none
pending, none finished) has an idle hold, the rule raises one finding for the
gang and tells its owner (a ``notify_owner`` on one member pod); if the gang
stays idle for ``idle_reclaim_after_s`` after that it asks to suspend the whole
gang (``requeue`` with ``params.reason`` idle-reclaim and ``params.gang``: the
backend suspends a JobSet or training job, or leaves its Kueue workload
inactive, with ``gpusteward act --restore`` to resume it), a dry run unless
``idle_reclaim_execute``, and never while a member's ``keep-until`` holds. The
episode resolves when a member works again, or the gang is no longer whole.

Events for a member at or before the last one applied for it (by time, then
lifecycle order) are ignored, as in :mod:`.queue`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.budget import mig_gpus
from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.idle import RECLAIM_REASON, IdleSettings, rfc3339
from gpusteward.rules.registry import FleetRunner
from gpusteward.schema import (
    Action,
    Evidence,
    Finding,
    IdleHold,
    NodeSummary,
    PodRef,
    QueueEvent,
    Subject,
)

KIND = "gang_partial"
REQUEUE_REASON = "gang-partial"
"""``params.reason`` of the requeue action."""

RUNBOOK = (
    "Part of the gang runs and holds its GPUs while the rest cannot be placed, so none of it "
    "makes progress. Requeue the whole gang (Kueue: deactivate and reactivate the workload), "
    "then enable gang scheduling (Kueue waitForPodsReady, the coscheduling plugin or "
    "Volcano) so that the gang is placed all at once or not at all."
)

IDLE_KIND = "gang_idle"

IDLE_RUNBOOK = (
    "Every member of the gang has held its GPUs idle: the whole job is hung, waiting for "
    "input, or done without exiting. Check its logs; stop it if it is done, or exempt its "
    "pods (label gpusteward.io/idle-exempt=true, or a gpusteward.io/keep-until annotation) "
    "if it must keep them. Suspended by gpusteward, it is resumed with `gpusteward act "
    "--restore <Kind>/<namespace>/<name>`."
)

_EXEMPT = json.dumps(IdleSettings().exempt_params, sort_keys=True)
"""The idle rule's shipped exemptions, which the backend checks on the member pod once more
before the suspension (``params.exempt``): a pod labelled exempt after the rule asked (the
runbook's way) is not suspended. A member exempt under the policy never has an idle hold,
so its gang is never found idle."""

_PENDING = ("pending", "evicted", "requeued")
_ENDED = ("finished", "deleted")
_STATE_ORDER = {"pending": 0, "requeued": 0, "admitted": 1, "evicted": 2, "finished": 3,
                "deleted": 4}


class GangSettings(BaseModel):
    """Settings of the partially placed gang rule."""

    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(
        900, gt=0,
        description="Seconds a gang must stay partly placed before a finding. 15 min covers "
        "a cluster-autoscaler scale-up (a few minutes) and image pulls on the new nodes.",
    )
    requeue: bool = Field(
        True, description="Ask to requeue the whole gang with the finding (a dry run unless "
        "requeue_execute).",
    )
    requeue_execute: bool = Field(
        False, description="False marks the requeue action dry_run: audited, never carried "
        "out. Requeueing restarts the placed members' work, so it is switched on by choice.",
    )
    forget_after_s: float = Field(
        86400, gt=0,
        description="Seconds after its last event a gang with no member left is forgotten "
        "(a day: later duplicates of its events are ignored as stale until then).",
    )
    idle_reclaim: bool = Field(
        True, description="Ask to suspend a gang all of whose placed members stay idle "
        "for idle_reclaim_after_s after its owner was told (gang_idle): a JobSet or training "
        "job suspended, a Kueue workload left inactive (a dry run unless "
        "idle_reclaim_execute). False: the owner is told, nothing more.",
    )
    idle_reclaim_after_s: float = Field(
        7200, gt=0,
        description="Seconds from the gang_idle notice (every placed member idle, each "
        "already told by the idle rule) to the suspension: 2 h, the batch ladder's notice to "
        "reclaim.",
    )
    idle_reclaim_execute: bool = Field(
        False, description="False marks the suspension dry_run: audited, never carried out. "
        "It stops every member of the job, so it is switched on by choice.",
    )


class Member(msgspec.Struct):
    """One member pod of a gang."""

    last: tuple[float, int]
    """Event time and lifecycle rank of the last event applied for it."""
    gpus: float = 0.0
    """GPUs it asks for (whole-GPU equivalents)."""
    placed_since: float | None = None
    """When it was bound to a node; None while it is pending."""
    ended: bool = False
    """It finished: the gang is ending, not stuck."""


class Gang(msgspec.Struct):
    """What the rule knows of one gang."""

    namespace: str
    name: str
    queue: str
    last_ts: float
    size: int | None = None
    """Members it needs, when a source stated it; else the members seen count."""
    workload: str | None = None
    """The Kueue workload that admits it, when there is one."""
    members: dict[str, Member] = {}
    deleted: dict[str, tuple[float, int]] = {}
    """Members deleted before they finished, with their last event's position."""
    partial_since: float | None = None
    open_id: str | None = None
    idle_since: float | None = None
    """When the last of its placed members went idle, while all of them are."""
    idle_id: str | None = None
    """The open ``gang_idle`` finding."""
    idle_told: float | None = None
    """When the ``gang_idle`` finding fired and its owner notice was asked for."""
    idle_reclaimed: bool = False
    """The suspension of this idle episode was asked for."""


class GangState(msgspec.Struct):
    gangs: dict[str, Gang] = {}


def _subject(gang: Gang) -> Subject:
    return Subject(queue=gang.queue, pod=PodRef(namespace=gang.namespace, name=gang.name))


def on_queue(state: GangState, event: QueueEvent, settings: GangSettings
             ) -> list[Finding | Action]:
    """Apply one queue event of a gang member (or of the Kueue workload of a gang)."""
    if event.gang is None:
        return []
    key = f"{event.namespace}/{event.gang}"
    gang = state.gangs.get(key)
    if gang is None:
        if event.state in _ENDED:
            return []
        gang = state.gangs[key] = Gang(namespace=event.namespace, name=event.gang,
                                       queue=event.cluster_queue, last_ts=event.ts)
    # The fleet clock may not have ticked past the window while the gang was partial (the
    # queue read ahead of the summaries, a quiet fleet): its episode is known up to this
    # event, so judge it before the event changes it.
    out = _judge(gang, event.ts, settings, late=True)
    gang.last_ts = max(gang.last_ts, event.ts)
    resized = bool(event.gang_size) and event.gang_size != gang.size
    if event.gang_size:
        gang.size = event.gang_size
    if event.kind == "workload":
        gang.workload = event.name
        return out + _update(gang, event.ts)  # a size learnt now may make it partial
    position = (event.ts, _STATE_ORDER[event.state])
    member = gang.members.get(event.name)
    last = member.last if member is not None else gang.deleted.get(event.name)
    if last is not None and position <= last:
        # An event already applied, sent again with the size the watcher learnt since (an
        # elastic job's minimum): the member is as it was, the gang may not be partial.
        return out + _update(gang, event.ts) if resized else out
    if member is None:
        member = gang.members[event.name] = Member(last=position)
    member.last = position
    member.gpus = event.gpus + mig_gpus(event.mig)
    if event.state in _PENDING:
        member.placed_since = None
    elif event.state == "admitted":
        if member.placed_since is None:
            member.placed_since = event.ts if event.admitted_at is None else event.admitted_at
    elif event.state == "finished":
        member.ended, member.placed_since = True, None
    else:
        # Deleted before it finished (preempted, evicted, scaled down): its controller
        # recreates it under a new name if the gang still needs it. Its last position is
        # kept, so a late duplicate cannot bring it back.
        del gang.members[event.name]
        gang.deleted[event.name] = position
    return out + _update(gang, event.ts)


def _counts(gang: Gang) -> tuple[int, int, int]:
    """(placed, pending, needed) members."""
    placed = sum(m.placed_since is not None for m in gang.members.values())
    pending = sum(m.placed_since is None and not m.ended for m in gang.members.values())
    needed = gang.size or sum(not m.ended for m in gang.members.values())
    return placed, pending, needed


def _update(gang: Gang, ts: float) -> list[Finding | Action]:
    placed, _, needed = _counts(gang)
    ending = any(m.ended for m in gang.members.values())
    partial = 0 < placed < needed and not ending
    if partial:
        if gang.partial_since is None:
            gang.partial_since = ts
        return []
    out: list[Finding | Action] = []
    if gang.open_id is not None and gang.partial_since is not None:
        why = ("ended" if ending else "is placed whole" if placed >= needed
               else "has no member placed")
        out.append(resolved(gang.open_id, fingerprint(KIND, gang.namespace, gang.name), KIND,
                            _subject(gang), f"gang {gang.namespace}/{gang.name} {why}",
                            gang.partial_since, ts))
        gang.open_id = None
    gang.partial_since = None
    return out


def evaluate(state: GangState, fleet: object, now: float, settings: GangSettings
             ) -> Sequence[Finding | Action]:
    """Raise what has stayed partial for the window, and what is idle as a whole; forget
    gangs long ended."""
    out: list[Finding | Action] = []
    idle, seen = _idle_members(getattr(fleet, "nodes", ()))
    for key, gang in list(state.gangs.items()):
        if all(m.ended for m in gang.members.values()) and \
                now - gang.last_ts > settings.forget_after_s:
            del state.gangs[key]
            continue
        out += _judge(gang, now, settings)
        out += _judge_idle(gang, idle.get(key, {}), now, settings,
                           seen=min(now, seen.get(key, now)))
    return out


def _idle_members(nodes: Sequence[NodeSummary]
                  ) -> tuple[dict[str, dict[str, IdleHold]], dict[str, float]]:
    """``namespace/gang`` -> member pod name -> its idle hold, from the nodes' summaries;
    and per gang, the time of the oldest of those summaries: its members are known idle up
    to then."""
    found: dict[str, dict[str, IdleHold]] = {}
    seen: dict[str, float] = {}
    for summary in nodes:
        for hold in summary.idle_gangs:
            if hold.gang is not None:
                key = f"{hold.pod.namespace}/{hold.gang}"
                found.setdefault(key, {}).setdefault(hold.pod.name, hold)
                seen[key] = min(summary.ts, seen.get(key, summary.ts))
    return found, seen


def _judge_idle(gang: Gang, holds: dict[str, IdleHold], now: float, settings: GangSettings,
                seen: float) -> list[Finding | Action]:
    """The gang's ``gang_idle`` episode: opened (with the owner's notice) once every placed
    member of the whole gang is idle, the suspension asked ``idle_reclaim_after_s`` after
    the notice, as the members' summaries (``seen``: the time of the oldest, at most
    ``now``) show them still idle then, resolved when that is no longer so. With the node
    join behind the queue, the fleet's clock runs ahead of what was seen of the gang."""
    placed = [name for name, m in gang.members.items() if m.placed_since is not None]
    _, pending, needed = _counts(gang)
    ended = any(m.ended for m in gang.members.values())
    whole = bool(placed) and len(placed) >= needed and not pending and not ended
    if not (whole and all(name in holds for name in placed)):
        if gang.idle_id is None:
            return []
        why = ("a member works again" if whole else "it ended" if ended
               else "it is no longer placed whole")
        assert gang.idle_since is not None
        out: list[Finding | Action] = [resolved(
            gang.idle_id, fingerprint(IDLE_KIND, gang.namespace, gang.name), IDLE_KIND,
            _subject(gang), f"gang {gang.namespace}/{gang.name} is no longer idle: {why}",
            gang.idle_since, now)]
        gang.idle_since = gang.idle_id = gang.idle_told = None
        gang.idle_reclaimed = False
        return out
    members = [holds[name] for name in sorted(placed)]
    held = max((h.kept_until for h in members if h.kept_until is not None and h.kept_until > now),
               default=None)
    if gang.idle_id is None:
        gang.idle_since = max(hold.idle_since for hold in members)
        gang.idle_id = finding_id(fingerprint(IDLE_KIND, gang.namespace, gang.name),
                                  gang.idle_since)
        if held is not None:  # left alone while a member's keep-until holds: no notice
            return [_idle_finding(gang, members, now, settings, held=held)]
    if gang.idle_told is None:
        if held is not None:
            return []
        gang.idle_told = now
        finding = _idle_finding(gang, members, now, settings)
        return [finding, action_for(finding, "notify_owner", _member(gang, members),
                                    finding.summary)]
    if gang.idle_reclaimed or not settings.idle_reclaim or held is not None or \
            seen - gang.idle_told < settings.idle_reclaim_after_s:
        return []  # a member's keep-until holds the gang: asked once it ends
    gang.idle_reclaimed = True
    finding = _idle_finding(gang, members, now, settings, reclaim=True)
    action = action_for(finding, "requeue", _member(gang, members), finding.summary)
    action.dry_run = not settings.idle_reclaim_execute
    action.params = {"reason": RECLAIM_REASON, "gang": gang.name,
                     "idle_since": repr(gang.idle_since), "exempt": _EXEMPT}
    if gang.workload is not None:
        # The Kueue Workload the watcher saw admit it (by its owner reference): what is
        # left inactive, since Kueue's pods need not name it. Not params.workload, which
        # asks for a requeue (a restart).
        action.params["gang_workload"] = gang.workload
    return [finding, action]


def _member(gang: Gang, members: list[IdleHold]) -> Subject:
    """The member pod a gang's notice and suspension name (the first by name): the
    backend finds the gang's object from it, and checks it is still a member."""
    return Subject(queue=gang.queue, pod=members[0].pod)


def _restore_name(gang: Gang) -> str:
    """``Kind/namespace/name`` of what the suspension stops, as ``act --restore`` takes it:
    the Kueue Workload of a gang Kueue admits (left inactive), else the gang's object."""
    if gang.workload is not None:
        return f"Workload/{gang.namespace}/{gang.workload}"
    kind, _, name = gang.name.partition("/")
    return f"{kind}/{gang.namespace}/{name}"


def _idle_finding(gang: Gang, members: list[IdleHold], now: float, settings: GangSettings,
                  *, reclaim: bool = False, held: float | None = None) -> Finding:
    assert gang.idle_id is not None and gang.idle_since is not None
    told = now if gang.idle_told is None else gang.idle_told
    gpus = sum(hold.gpus for hold in members)
    where = f"{gang.name} in {gang.namespace}"
    if held is not None:
        then = (f"left alone until {rfc3339(held)}, while a member's keep-until annotation "
                "holds")
    elif reclaim:
        then = "suspending it" if settings.idle_reclaim_execute else \
            "its suspension is recorded as a dry run (idle_reclaim_execute is off)"
    elif settings.idle_reclaim:
        then = (f"the whole gang is suspended at {rfc3339(now + settings.idle_reclaim_after_s)}"
                " unless a member works again first"
                + ("" if settings.idle_reclaim_execute else " (a dry run: recorded only)")
                + f"; resume it with `gpusteward act --restore {_restore_name(gang)}`")
    else:
        then = "nothing more is done (idle_reclaim is off)"
    summary = (f"All {len(members)} members of gang {where} have held their {gpus:g} GPUs "
               f"idle since {rfc3339(gang.idle_since)}: {then}")
    return Finding(
        id=gang.idle_id, fingerprint=fingerprint(IDLE_KIND, gang.namespace, gang.name),
        kind=IDLE_KIND, severity="warning", state="firing", subject=_subject(gang),
        summary=summary, starts_at=gang.idle_since, ts=now,
        evidence=Evidence(window_start=gang.idle_since, window_end=now,
                          values={"members_idle": float(len(members)), "gpus_idle": gpus,
                                  "reclaim_at": told + settings.idle_reclaim_after_s}),
        runbook=IDLE_RUNBOOK, labels={"queue": gang.queue, "gang": gang.name},
    )


def _judge(gang: Gang, now: float, settings: GangSettings, *, late: bool = False
           ) -> list[Finding | Action]:
    """The gang's finding if it has been partial for the window by ``now``, once. ``late``:
    judged on an event after the fact, so the finding is dated when it became due."""
    since = gang.partial_since
    if since is None or gang.open_id is not None or now - since < settings.window_s:
        return []
    return _fire(gang, since, since + settings.window_s if late else now, settings)


def _fire(gang: Gang, since: float, now: float, settings: GangSettings
          ) -> list[Finding | Action]:
    placed, pending, needed = _counts(gang)
    held = [(m.gpus, m.placed_since) for m in gang.members.values()
            if m.placed_since is not None]
    gpus = sum(g for g, _ in held)
    gpu_hours = sum(g * max(0.0, now - since) for g, since in held) / 3600
    fp = fingerprint(KIND, gang.namespace, gang.name)
    gang.open_id = finding_id(fp, since)
    finding = Finding(
        id=gang.open_id, fingerprint=fp, kind=KIND, severity="warning", state="firing",
        subject=_subject(gang),
        summary=f"gang {gang.namespace}/{gang.name} is placed in part: {placed} of {needed} "
        f"members run holding {gpus:g} GPUs ({gpu_hours:.1f} GPU-hours so far), {pending} "
        f"pending, for {(now - since) / 60:.0f} min",
        starts_at=since, ts=now,
        evidence=Evidence(window_start=since, window_end=now,
                          values={"gpus_held": gpus, "gpu_hours_held": gpu_hours,
                                  "members_placed": float(placed),
                                  "members_pending": float(pending),
                                  "gang_size": float(needed)}),
        runbook=RUNBOOK, labels={"queue": gang.queue, "gang": gang.name},
    )
    if not settings.requeue:
        return [finding]
    target = _subject(gang)
    params = {"reason": REQUEUE_REASON, "gang": gang.name}
    if gang.workload is not None:
        params |= {"workload": gang.workload, "namespace": gang.namespace}
    else:
        member = min(name for name, m in gang.members.items() if m.placed_since is not None)
        target = Subject(queue=gang.queue, pod=PodRef(namespace=gang.namespace, name=member))
    action = action_for(finding, "requeue", target, finding.summary)
    action.dry_run = not settings.requeue_execute
    action.params = params
    return [finding, action]


RUNNERS = (FleetRunner("gang", GangState, evaluate, on_queue=on_queue),)
