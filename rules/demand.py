"""Demand-aware reclaim: an idle holder whose GPU would let a waiting workload start.

The idle rule (:mod:`.idle`) climbs its ladder on the device alone: notify
at 30 min, warn 4 h later, reclaim 8 h after that. That is right when
nobody needs the GPU and far too slow when someone waits for it. This rule
joins both sides, which only the fleet agent sees: the node summaries list
each node's devices held by pods the idle rule has an open episode on
(:class:`~gpusteward.schema.IdleHold`; an exempt pod never opens one, and one member of
a gang is not listed: reclaiming it would stop the whole gang), and
the queue state holds the pending demand with its shape (whole GPUs on one
node, or MIG devices by profile; for a Kueue Workload of several pods, its pod
sets, each pod needing room on some node) and its age. Room is what the
device plugin hands out: on nodes whose GPUs are time-sliced or shared by MPS,
free replicas (:func:`~.fragmentation.request_room`), and reclaiming an idle
holder there frees its replica.

Why the fleet agent and not the node join: which idle holders to reclaim is
a fleet-wide matching, not a per-node fact. Broadcasting the demand to every
node would make each node's idle rule escalate on its own, and one waiting
1-GPU job would shorten the ladder of every idle notebook in the fleet. Here
each waiting workload (oldest first) is matched to the node where it needs
the fewest reclaims (its free capacity counted first), and only those
holders escalate; a holder counted for one workload is not counted again.
A workload of several pods is matched across nodes: idle holders are added,
nodes with the most room first, until its pods can each be placed
(:func:`~.fragmentation.placement`, the stranded-capacity rule's check, over
the whole fleet's free room), then those the placement does not need are
dropped again. A workload whose pods fit the free room already (on any node,
with idle holders or not) is not blocked by anyone: it waits for quota or the
scheduler, and reclaims nothing. Whatever a workload's placement
(:func:`~.fragmentation.placement`) uses, free room on any node and the
holders reclaimed for it, is taken before the next workload is matched, a
workload that fits without reclaims included: it will start on that room
when admitted, and two workloads counting the same free GPUs would be told
they need fewer reclaims than they do.
The node join's only part is to say which devices are idle in the summary it
already sends: one hold per idle pod, with all the whole GPUs reclaiming it frees (a pod
of several GPUs is idle only while all of them are, and is one episode of the idle rule).

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

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.fragmentation import Demand, FleetView, Room, placement, request_room
from gpusteward.rules.idle import RECLAIM_REASON
from gpusteward.rules.registry import FleetRunner
from gpusteward.schema import Action, Evidence, Finding, IdleHold, NodeSummary, PodSet, Subject

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
    """Room for ``nvidia.com/gpu`` requests: free GPUs, or free replicas on shared GPUs."""
    free_mig: dict[str, int]
    holds: list[IdleHold] = field(default_factory=list)

    def released(self, holds: Sequence[IdleHold] = ()) -> NodeSummary:
        """Its summary with the room left to the matching, once ``holds`` are released."""
        room = self.free_gpus + sum(h.gpus for h in holds)
        mig = dict(self.free_mig)
        for hold in holds:
            if hold.mig_profile:
                mig[hold.mig_profile] = mig.get(hold.mig_profile, 0) + 1
        if self.summary.gpu_replicas > 1 and self.summary.replicas_free is not None:
            return msgspec.structs.replace(self.summary, replicas_free=room, mig_free=mig)
        return msgspec.structs.replace(self.summary, gpus_free=room, mig_free=mig)


def _node(summary: NodeSummary, now: float) -> _Node:
    return _Node(summary, request_room(summary), dict(summary.mig_free),
                 sorted((h for h in summary.idle if h.kept_until is None or h.kept_until <= now),
                        key=lambda h: h.idle_since))


def hold_key(node: str, hold: IdleHold) -> str:
    return f"{node}/{hold.device}/{hold.pod.namespace}/{hold.pod.name}"


def _needed_mig(demand: Demand, node: _Node) -> tuple[int, str | None] | None:
    """(MIG devices to reclaim, their profile) for the MIG pod ``demand`` on ``node``, or
    None when its idle holders cannot make it fit. Whole-GPU pods: :meth:`_ByRoom.fewest`."""
    if len(demand.mig) != 1:
        return None  # several profiles at once: rare, and no single reclaim answers it
    profile, count = next(iter(demand.mig.items()))
    short = count - node.free_mig.get(profile, 0)
    available = sum(h.mig_profile == profile for h in node.holds)
    return (short, profile) if 0 < short <= available else None


def _frees(hold: IdleHold, pods: Sequence[PodSet]) -> bool:
    """Whether releasing ``hold`` gives room to some of ``pods``."""
    if hold.mig_profile:
        return any(hold.mig_profile in p.mig for p in pods)
    return hold.gpus > 0 and any(p.gpus for p in pods)


def _useful(node: _Node, pods: Sequence[PodSet]) -> list[IdleHold]:
    """The node's holders, in its order, whose release can give one of ``pods`` room: for
    whole-GPU pods, not those released past the most GPUs the pods can take on it (pods
    of 4 and 8 GPUs take a multiple of 4, so of three 2-GPU holders on a node with none
    free, the third is not needed; pods of 4 and 6 take multiples of 2)."""
    holds = [h for h in node.holds if _frees(h, pods)]
    sizes = [p.gpus for p in pods if p.gpus]
    if not sizes or any(p.mig for p in pods):
        return holds
    step = math.gcd(*sizes)
    room = node.free_gpus + sum(h.gpus for h in holds)
    most = room // step * step - node.free_gpus  # GPUs worth releasing, from the first
    useful: list[IdleHold] = []
    for hold in holds:
        if most <= 0:
            break
        useful.append(hold)
        most -= hold.gpus
    return useful


def _reclaims_across(demand: Demand, nodes: list[_Node], views: dict[int, NodeSummary]
                     ) -> tuple[list[tuple[_Node, IdleHold]], dict[int, Room]] | None:
    """The idle holders on ``nodes`` whose release lets a workload of several pods be placed
    (on their nodes and the rest of the room ``views`` offers), and the room that placement
    takes by ``id`` of the node; None when no release makes them fit. ``views`` holds each
    node's summary with the room it still offers, by ``id`` of the node."""
    pods = demand.pods
    wanted = sum(p.count for p in pods)
    # For whole-GPU pods, how many of the smallest fit a node's room bounds how many pods fit
    # the fleet: the placement is only tried once that bound allows it.
    smallest = min((p.gpus for p in pods if p.gpus), default=0)
    bounded = smallest > 0 and not any(p.mig for p in pods)

    def slots(room: int) -> int:
        return room // smallest if bounded else wanted

    room = {id(n): n.free_gpus for n in nodes}
    bound = sum(slots(request_room(v)) for key, v in views.items() if key not in room)
    if bounded:
        # Not even every holder released makes room for enough of the smallest pods: the
        # answer of the search below, without ordering the fleet's holders for it (a queue
        # stuck behind a full fleet asks this of every shape at every evaluation). A loop,
        # not nested sums: it runs over every node with holders for each such workload.
        most = bound
        for n in nodes:
            freed = n.free_gpus
            for hold in n.holds:
                freed += hold.gpus
            most += freed // smallest
        if most < wanted:
            return None
    bound += sum(slots(r) for r in room.values())
    # The nodes as released so far. A node stays in its place even when a release is undone:
    # first fit depends on the order, and the placement kept must be one that was found.
    current = dict(views)
    released: dict[int, list[IdleHold]] = {}

    def fits() -> bool:
        return bound >= wanted and placement(pods, list(current.values())) is not None

    def release(node: _Node, hold: IdleHold, sign: int) -> None:
        nonlocal bound
        key = id(node)
        if sign > 0:
            released.setdefault(key, []).append(hold)
        else:
            released[key].remove(hold)
        bound -= slots(room[key])
        room[key] += sign * hold.gpus
        bound += slots(room[key])
        current[key] = node.released(released[key])

    # Nodes with the most room first: their holders complete a pod's place soonest. A node's
    # useful holders are worked out only as the search reaches it (it stops at the first
    # fit; the nodes' room and holders do not change while it runs).
    order = ((n, h) for n in sorted(nodes, key=lambda n: (-n.free_gpus, n.summary.node))
             for h in _useful(n, pods))
    taken: list[tuple[_Node, IdleHold]] = []
    for node, hold in order:
        taken.append((node, hold))
        release(node, hold, +1)
        if fits():
            break
    else:
        return None
    # A holder taken on the way whose node still fits none of the pods is not needed.
    for node, hold in reversed(taken[:-1]):
        release(node, hold, -1)
        if fits():
            taken.remove((node, hold))
        else:
            release(node, hold, +1)
    keys = list(current)
    placed = placement(pods, list(current.values()))
    if placed is None:  # cannot happen: the state left is one fits() said yes to
        return None
    return taken, {keys[i]: r for i, r in placed.items()}


class _ByRoom:
    """The nodes with idle holders by what a whole-GPU pod finds on them, (free GPUs, GPUs
    their holders would free), each group in name order: the node where a pod needs the
    fewest reclaims is found among a few groups, not by looking at every node for each
    waiting workload (1,000 workloads that each find a reclaim looked at the whole fleet
    1,000 times)."""

    def __init__(self, nodes: Sequence[_Node]) -> None:
        self.groups: dict[tuple[int, int], list[_Node]] = {}
        self.filed: dict[int, tuple[int, int]] = {}
        for node in sorted(nodes, key=_name):
            key = self.filed[id(node)] = _room_key(node)
            self.groups.setdefault(key, []).append(node)

    def moved(self, node: _Node) -> None:
        """File ``node`` again after its free room or its holders changed."""
        old = self.filed.get(id(node))
        new = _room_key(node)
        if old is None or old == new:
            return
        self.groups[old].remove(node)
        bisect.insort(self.groups.setdefault(new, []), node, key=_name)
        self.filed[id(node)] = new

    def fewest(self, gpus: int) -> tuple[tuple[int, str | None], _Node] | None:
        """The node where a pod of ``gpus`` whole GPUs needs the fewest reclaims (more than
        its free GPUs, at most what its holders free), then the first by name: ((GPUs to
        reclaim, None), node), or None."""
        if gpus <= 0:
            return None
        found = [(gpus - free, _name(group[0]), group[0])
                 for (free, held), group in self.groups.items()
                 if group and 0 < gpus - free <= held]
        if not found:
            return None
        short, _, node = min(found, key=lambda f: (f[0], f[1]))
        return (short, None), node


def _name(node: _Node) -> str:
    return node.summary.node


def _room_key(node: _Node) -> tuple[int, int]:
    return node.free_gpus, sum(h.gpus for h in node.holds)


def match(fleet: FleetView, now: float, settings: DemandReclaimSettings
          ) -> dict[str, tuple[str, IdleHold, list[Demand]]]:
    """Idle holders whose release lets waiting work start: hold key -> (node, hold, demands).

    Oldest waiting workload first; a workload of one pod takes the node where it needs the
    fewest reclaims (then the longest idle holders), one of several pods the holders whose
    release lets each pod find a node; the capacity it takes (free room and holders, on
    every node its placement uses) is not offered again, nor is the free room a workload
    that fits without reclaims would take.
    """
    waiting = sorted((d for d in fleet.pending.values()
                      if d.since is not None and now - d.since >= settings.min_wait_s),
                     key=lambda d: (d.since, d.key))
    if not waiting:
        return {}
    usable = [s for s in fleet.nodes if s.healthy and not s.cordoned]
    # Only nodes with idle holders are matched: skipping the others keeps an evaluation of a
    # 1,200-node fleet from sorting 1,200 empty lists. The free room of the others says
    # whether a workload fits without any reclaim, and is taken as workloads are placed.
    nodes = [n for s in usable if s.idle and (n := _node(s, now)).holds]
    matched = {id(n.summary) for n in nodes}
    elsewhere = [_Node(s, request_room(s), dict(s.mig_free)) for s in usable
                 if id(s) not in matched and (request_room(s) > 0 or any(s.mig_free.values()))]
    by_id = {id(n): n for n in [*elsewhere, *nodes]}
    # The room each node offers the next workload, by id of the node: free room without
    # reclaims first, so a placement uses it before a reclaimed holder's.
    views: dict[int, NodeSummary] = {id(n): n.summary for n in elsewhere}
    rooms: Counter[int] = Counter(request_room(v) for v in views.values())
    """How many of ``views`` offer each amount of ``nvidia.com/gpu`` room: a one-pod
    workload of more GPUs than any offers is not placed on them."""

    def keep_open(key: int, view: NodeSummary) -> None:
        """Keep ``view`` in ``views`` only while it has room (the placement skips the
        others), in its place (first fit follows the order), and ``rooms`` counting it."""
        old = views.get(key)
        if old is not None:
            rooms[request_room(old)] -= 1
        if request_room(view) > 0 or any(view.mig_free.values()):
            views[key] = view
            rooms[request_room(view)] += 1
        else:
            views.pop(key, None)

    for node in nodes:
        keep_open(id(node), node.released())
    by_room = _ByRoom(nodes)
    by_profile: dict[str, list[_Node]] = {}
    """The nodes with holders of each MIG profile (holders are only taken away): a MIG pod
    looks at those, not at every node with holders."""
    for node in nodes:
        for held in {h.mig_profile for h in node.holds if h.mig_profile}:
            by_profile.setdefault(held, []).append(node)

    stuck: set[tuple[object, ...]] = set()
    """The shapes that found neither room nor a reclaim in the fleet as it is: a queue that
    waits because nothing fits holds many workloads of a few shapes, and each would scan the
    whole fleet and its holders again for the same answer. Emptied whenever the room or the
    holders change."""

    def use(spent: dict[int, Room], reclaimed: Sequence[tuple[_Node, IdleHold]] = ()) -> None:
        """Take what a placement uses from the free room offered to the next workload (the
        room a reclaimed holder gives is used first; a holder reclaimed for one workload
        is not offered again)."""
        stuck.clear()
        for key, room in spent.items():
            node = by_id[key]
            holds = [h for n, h in reclaimed if n is node]
            node.free_gpus -= max(0, room.gpus - sum(h.gpus for h in holds))
            for profile, count in room.mig.items():
                freed = sum(h.mig_profile == profile for h in holds)
                node.free_mig[profile] = node.free_mig.get(profile, 0) - max(0, count - freed)
            keep_open(key, node.released())
            by_room.moved(node)

    out: dict[str, tuple[str, IdleHold, list[Demand]]] = {}
    for demand in waiting:
        shape = demand.request
        if shape in stuck:
            continue
        pods = demand.pods
        placed = None if _no_room(pods, rooms) else placement(pods, list(views.values()))
        if placed is not None:
            # It fits without any reclaim: it waits for quota or the scheduler, and the room
            # it would start on is not the next workload's.
            keys = list(views)
            use({keys[i]: r for i, r in placed.items()})
            continue
        if sum(p.count for p in demand.pods) > 1:
            across = _reclaims_across(demand, nodes, views)
            if across is None:
                stuck.add(shape)
                continue
            reclaimed, spent = across
            for node, hold in reclaimed:
                node.holds.remove(hold)
                by_room.moved(node)
                out[hold_key(node.summary.node, hold)] = (node.summary.node, hold, [demand])
            use(spent, reclaimed)
            continue
        if demand.mig:
            options = [(need, node) for node in by_profile.get(next(iter(demand.mig)), ())
                       if (need := _needed_mig(demand, node))]
            chosen = min(options, key=lambda o: (o[0][0], _name(o[1]))) if options else None
        else:
            chosen = by_room.fewest(demand.gpus)
        if chosen is None:
            stuck.add(shape)
            continue
        (count, profile), node = chosen
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
        keep_open(id(node), node.released())
        by_room.moved(node)
        stuck.clear()
    return out


def _no_room(pods: Sequence[PodSet], rooms: Counter[int]) -> bool:
    """Whether whole-GPU ``pods`` cannot all find room on nodes offering the ``rooms`` counted
    (how many nodes offer each amount of ``nvidia.com/gpu`` room), without placing them: a
    node of room r holds at most r // g pods of g GPUs, so too few places for the smallest
    pods, or one pod larger than any node's room, settles it. False: it may fit."""
    if any(p.mig for p in pods):
        return False
    sizes = [p.gpus for p in pods if p.gpus]
    if not sizes:
        return False
    offered = [r for r, n in rooms.items() if n]
    if max(sizes) > max(offered, default=0):
        return True
    smallest = min(sizes)
    return (sum(n * (r // smallest) for r, n in rooms.items())
            < sum(p.count for p in pods if p.gpus))


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
    # A holder's idleness is known up to its node's summary: with the node join behind the
    # queue (a worker catching up), the fleet's clock runs ahead of what was seen of it.
    seen = {s.node: s.ts for s in fleet.nodes} if blockers else {}
    for key, (node, hold, demands) in sorted(blockers.items()):
        episode = state.episodes.get(key)
        if episode is None:
            fp = fingerprint(KIND, key)
            episode = state.episodes[key] = Blocking(since=now, node=node, hold=hold,
                                                     open_id=finding_id(fp, now))
        episode.hold = hold
        idle_s = min(now, seen.get(node, now)) - hold.idle_since
        if episode.stage == 0 and idle_s >= settings.notify_after_s:
            finding = _finding(key, episode, demands, now, idle_s, "warning", 1)
            episode.stage = 1
            out += [finding, action_for(finding, "notify_owner", finding.subject,
                                        finding.summary)]
        if episode.stage == 1 and settings.reclaim and idle_s >= settings.reclaim_after_s:
            finding = _finding(key, episode, demands, now, idle_s, "warning", 2)
            episode.stage = 2
            action = action_for(finding, "requeue", finding.subject,
                                finding.summary + ": reclaiming it")
            action.dry_run = not settings.reclaim_execute
            action.params = {"reason": RECLAIM_REASON, "idle_since": repr(hold.idle_since),
                             "keep_until_max_s": repr(settings.keep_until_max_s),
                             "delete_bare_pod": str(settings.reclaim_bare_pods).lower()}
            out += [finding, action]
    return out


def _finding(key: str, episode: Blocking, demands: list[Demand], now: float, idle_s: float,
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
        f"{episode.node} idle for {idle_s / 60:.0f} min while {waits} "
        "could start on it",
        starts_at=episode.since, ts=now,
        evidence=Evidence(window_start=hold.idle_since, window_end=now,
                          values={"idle_s": idle_s,
                                  "longest_wait_s": longest, "waiting": float(len(demands)),
                                  "ladder_step": float(step)}),
        runbook=RUNBOOK,
        labels={"waiting": ",".join(d.key for d in demands),
                "workload_kind": hold.workload_kind or "unknown"},
    )


def _shape(demand: Demand) -> str:
    if sum(p.count for p in demand.pods) > 1:
        return " + ".join(f"{p.count} pods of {_shape(Demand('', '', p.gpus, p.mig))}"
                          for p in demand.pods)
    if demand.mig:
        return ", ".join(f"{n}x {p}" for p, n in sorted(demand.mig.items()))
    return f"{demand.gpus} GPU" + ("s" if demand.gpus != 1 else "")


RUNNERS = (FleetRunner("demand_reclaim", DemandReclaimState, evaluate),)
