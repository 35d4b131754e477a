"""Demand-aware reclaim: an idle holder whose GPU would let a waiting workload start.

The idle rule (:mod:`.idle`) climbs its ladder on the device alone: notify
at 30 min, warn 4 h later, reclaim 8 h after that. That is right when
nobody needs the GPU and far too slow when someone waits for it. This rule
joins both sides, which only the fleet agent sees: the node summaries list
each node's devices held by pods the idle rule has an open episode on
(:class:`~gpusteward.schema.IdleHold`; an exempt pod never opens one), and
the queue state holds the pending demand with its shape (whole GPUs on one
node, or MIG devices by profile) and its age.

Why the fleet agent and not the node join: which idle holders to reclaim is
a fleet-wide matching, not a per-node fact. Broadcasting the demand to every
node would make each node's idle rule escalate on its own, and one waiting
1-GPU job would shorten the ladder of every idle notebook in the fleet. Here
each waiting workload (oldest first) is matched to the node where it needs
the fewest reclaims (its free capacity counted first), and only those
holders escalate; a holder counted for one workload is not counted again.
The node join's only part is to say which devices are idle in the summary it
already sends.

The short ladder counts from the start of the idle episode: a notice naming
the waiting workloads and how long they have waited once the device has
been idle ``notify_after_s``, a reclaim (verb ``requeue``, ``params.reason``
``idle-reclaim``, reclaimed by owner kind, a dry run unless
``reclaim_execute``) once idle ``reclaim_after_s``. No waiting demand, no
finding: the usual ladder goes on alone. A holder whose keep-until
annotation is in force is not counted (the backend checks the live pod
again before a reclaim). The episode resolves once the holder no longer
blocks anyone (the work started elsewhere, left the queue, or the holder
let go or became busy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.fragmentation import Demand, FleetView
from gpusteward.rules.idle import RECLAIM_REASON
from gpusteward.rules.registry import FleetRunner
from gpusteward.schema import Action, Evidence, Finding, IdleHold, NodeSummary, Subject

KIND = "idle_blocking_demand"

RUNBOOK = (
    "An idle pod holds a GPU that a waiting workload could start on. Ask the owner to release "
    "it now; the reclaim follows on the short ladder while the workload waits. Add the "
    "gpusteward.io/keep-until annotation to keep it for a while, or the exemption label if the "
    "hold is intended."
)


class DemandReclaimSettings(BaseModel):
    """Settings of demand-aware reclaim (idle holders that block waiting work)."""

    model_config = ConfigDict(extra="forbid")

    notify_after_s: float = Field(
        1800, gt=0,
        description="Seconds idle (from the start of the idle episode) after which the owner "
        "of an idle holder that blocks waiting work is told who waits: 30 min, the idle "
        "rule's own window.",
    )
    reclaim_after_s: float = Field(
        7200, gt=0,
        description="Seconds idle after which an idle holder that blocks waiting work is "
        "reclaimed: 2 h against the usual ladder's 12 h, since every hour idle is an hour "
        "someone else's job does not run.",
    )
    min_wait_s: float = Field(
        300, ge=0,
        description="Seconds a workload must have waited before it counts as demand: 5 min "
        "lets the scheduler place what fits first.",
    )
    reclaim: bool = Field(True, description="Ask to reclaim at the end of the short ladder.")
    reclaim_execute: bool = Field(
        False, description="False marks the reclaim action dry_run: audited, never carried "
        "out.",
    )
    reclaim_bare_pods: bool = Field(
        False, description="Whether the reclaim may delete a pod no controller owns (cannot "
        "be undone); as idle_holder's reclaim_bare_pods.",
    )
    keep_until_max_s: float = Field(
        14 * 86400, ge=0,
        description="Longest hold a gpusteward.io/keep-until annotation buys, seconds from "
        "the start of the idle episode, checked again on the live pod before a reclaim; keep "
        "it equal to idle_holder's keep_until_max_s.",
    )


class Blocking(msgspec.Struct):
    """An open episode: an idle holder that waiting work could use."""

    since: float
    node: str
    hold: IdleHold
    open_id: str
    stage: int = 0
    """0 found, 1 owner notified, 2 reclaim asked."""


class DemandReclaimState(msgspec.Struct):
    episodes: dict[str, Blocking] = {}


@dataclass
class _Node:
    """A node's capacity as the matching consumes it."""

    summary: NodeSummary
    free_gpus: int
    free_mig: dict[str, int]
    holds: list[IdleHold] = field(default_factory=list)


def hold_key(node: str, hold: IdleHold) -> str:
    return f"{node}/{hold.device}/{hold.pod.namespace}/{hold.pod.name}"


def _needed(demand: Demand, node: _Node) -> tuple[int, str | None] | None:
    """(devices to reclaim, MIG profile) for ``demand`` on ``node``, or None when its idle
    holders cannot make it fit."""
    if demand.mig:
        if len(demand.mig) != 1:
            return None  # several profiles at once: rare, and no single reclaim answers it
        profile, count = next(iter(demand.mig.items()))
        short = count - node.free_mig.get(profile, 0)
        available = sum(h.mig_profile == profile for h in node.holds)
        return (short, profile) if 0 < short <= available else None
    short = demand.gpus - node.free_gpus
    available = sum(h.gpus for h in node.holds)
    return (short, None) if 0 < short <= available and demand.gpus > 0 else None


def match(fleet: FleetView, now: float, settings: DemandReclaimSettings
          ) -> dict[str, tuple[str, IdleHold, list[Demand]]]:
    """Idle holders whose release lets waiting work start: hold key -> (node, hold, demands).

    Oldest waiting workload first; each takes the node where it needs the fewest reclaims
    (then the longest idle holders), and the capacity it takes is not offered again.
    """
    # Only nodes with idle holders can be matched: skipping the others first keeps an
    # evaluation of a 1,200-node fleet from sorting 1,200 empty lists.
    nodes = [_Node(s, s.gpus_free, dict(s.mig_free),
                   sorted((h for h in s.idle if h.kept_until is None or h.kept_until <= now),
                          key=lambda h: h.idle_since))
             for s in fleet.nodes if s.idle and s.healthy and not s.cordoned]
    nodes = [n for n in nodes if n.holds]
    waiting = sorted((d for d in fleet.pending.values()
                      if d.since is not None and now - d.since >= settings.min_wait_s),
                     key=lambda d: (d.since, d.key))
    out: dict[str, tuple[str, IdleHold, list[Demand]]] = {}
    for demand in waiting:
        options = [(need, node) for node in nodes if (need := _needed(demand, node))]
        if not options:
            continue
        (count, profile), node = min(options, key=lambda o: (o[0][0], o[1].summary.node))
        taken = [h for h in node.holds if (h.mig_profile == profile if profile
                                           else h.gpus > 0)][:count]
        for hold in taken:
            node.holds.remove(hold)
            out[hold_key(node.summary.node, hold)] = (node.summary.node, hold, [demand])
        # What it uses of the node's free capacity is gone for the next workload too.
        if profile:
            node.free_mig[profile] = 0
        else:
            node.free_gpus = 0
    return out


def _subject(node: str, hold: IdleHold) -> Subject:
    return Subject(node=node, device=hold.device, pod=hold.pod)


def evaluate(state: DemandReclaimState, fleet: FleetView, now: float,
             settings: DemandReclaimSettings) -> Sequence[Finding | Action]:
    blockers = match(fleet, now, settings)
    out: list[Finding | Action] = []
    for key in [k for k in state.episodes if k not in blockers]:
        ended = state.episodes.pop(key)
        if ended.stage > 0:
            out.append(resolved(ended.open_id, fingerprint(KIND, key), KIND,
                                _subject(ended.node, ended.hold),
                                f"{ended.hold.pod.namespace}/{ended.hold.pod.name} no "
                                "longer blocks waiting work", ended.since, now))
    for key, (node, hold, demands) in sorted(blockers.items()):
        episode = state.episodes.get(key)
        if episode is None:
            fp = fingerprint(KIND, key)
            episode = state.episodes[key] = Blocking(since=now, node=node, hold=hold,
                                                     open_id=finding_id(fp, now))
        episode.hold = hold
        idle_s = now - hold.idle_since
        if episode.stage == 0 and idle_s >= settings.notify_after_s:
            finding = _finding(key, episode, demands, now, "warning", 1)
            episode.stage = 1
            out += [finding, action_for(finding, "notify_owner", finding.subject,
                                        finding.summary)]
        if episode.stage == 1 and settings.reclaim and idle_s >= settings.reclaim_after_s:
            finding = _finding(key, episode, demands, now, "warning", 2)
            episode.stage = 2
            action = action_for(finding, "requeue", finding.subject,
                                finding.summary + ": reclaiming it")
            action.dry_run = not settings.reclaim_execute
            action.params = {"reason": RECLAIM_REASON, "idle_since": repr(hold.idle_since),
                             "keep_until_max_s": repr(settings.keep_until_max_s),
                             "delete_bare_pod": str(settings.reclaim_bare_pods).lower()}
            out += [finding, action]
    return out


def _finding(key: str, episode: Blocking, demands: list[Demand], now: float,
             severity: str, step: int) -> Finding:
    hold = episode.hold
    waited = {d.key: now - (now if d.since is None else d.since) for d in demands}
    waits = ", ".join(f"{d.key} ({_shape(d)}, waiting {waited[d.key] / 60:.0f} min)"
                      for d in demands)
    longest = max(waited.values())
    return Finding(
        id=episode.open_id, fingerprint=fingerprint(KIND, key), kind=KIND,
        severity=severity,  # type: ignore[arg-type]
        state="firing", subject=_subject(episode.node, hold),
        summary=f"{hold.pod.namespace}/{hold.pod.name} has held {hold.device} on "
        f"{episode.node} idle for {(now - hold.idle_since) / 60:.0f} min while {waits} "
        "could start on it",
        starts_at=episode.since, ts=now,
        evidence=Evidence(window_start=hold.idle_since, window_end=now,
                          values={"idle_s": now - hold.idle_since,
                                  "longest_wait_s": longest, "waiting": float(len(demands)),
                                  "ladder_step": float(step)}),
        runbook=RUNBOOK,
        labels={"waiting": ",".join(d.key for d in demands),
                "workload_kind": hold.workload_kind or "unknown"},
    )


def _shape(demand: Demand) -> str:
    if demand.mig:
        return ", ".join(f"{n}x {p}" for p, n in sorted(demand.mig.items()))
    return f"{demand.gpus} GPU" + ("s" if demand.gpus != 1 else "")


RUNNERS = (FleetRunner("demand_reclaim", DemandReclaimState, evaluate),)
