"""Fragmentation and stranded capacity: free GPUs in shapes pending work cannot use.

Two measures over the fleet's free capacity, both pure functions:

- **FGD fragmentation** (Weng et al., "Beware of Fragmentation", USENIX ATC
  2023). A node's free GPU capacity is a list of per-GPU free shares in milli
  (1000 = a whole free GPU). A task shape ``(gpus, milli)`` asks for ``gpus``
  GPUs with ``milli`` each (``gpus == 1`` and ``milli < 1000`` for a
  GPU-sharing task). A GPU is *usable* by the shape when its free share is at
  least ``milli``; the shape *fits* the node when at least ``gpus`` GPUs are
  usable. The fragment of the node for the shape is its whole free capacity
  when the shape does not fit, and the free capacity of the unusable GPUs
  when it does. Node fragmentation is the popularity-weighted sum of the
  fragments over the observed shapes; cluster fragmentation is the sum over
  nodes, and the ratio is fragmented / unallocated capacity. The paper also
  counts GPUs as fragments when a task's CPU request does not fit; node
  summaries carry no CPU, so this measure is GPU-only, and shapes asking for
  no GPU are left out of the popularity.
- **Stranded demand** (:class:`StrandedTrack`): a pending workload that fits
  the fleet's total free GPUs but no single node, or a pending MIG workload
  that fits no node while free MIG slices of other profiles sit unused. It
  fires only when the condition held for the whole window, so a workload
  the scheduler is about to place never raises it. A workload of several
  pods (a Kueue Workload's pod sets) needs a node for each pod, not one node
  for all; on a node whose GPUs are shared (time-slicing, MPS) a request
  counts in replicas, as the device plugin hands them out. A workload with a pod
  that asks more whole GPUs than any node of the fleet has, free or not, or MIG
  devices no node's layout offers together, is stranded too, whatever is free
  (:func:`fits_no_node`): it can never start as the fleet is, and waiting for
  it to drain will not change that.

The FGD computation sorts each node's free shares once and answers every
shape with a bisection, and caches per distinct free vector: a fleet of
identical nodes costs a handful of evaluations, not one per node.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, NamedTuple

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from gpusteward.rules.findings import finding_id, fingerprint, resolved
from gpusteward.rules.registry import FleetRunner
from gpusteward.schema import Evidence, Finding, NodeSummary, PodRef, PodSet, Subject

KIND = "fragmentation"
STRANDED_KIND = "stranded_capacity"
WHOLE = 1000
"""Milli of one whole GPU."""

RUNBOOK = (
    "Free GPUs are scattered in pieces the observed request shapes cannot use. Look at the "
    "blocking shapes in the labels: consolidate small jobs (bin-pack with a MostAllocated "
    "scoring strategy or FGD scheduling), drain the nodes with the fewest allocated GPUs, "
    "or repartition MIG GPUs towards the profiles that are asked for."
)
STRANDED_RUNBOOK = (
    "The pending workload would fit in the fleet's free GPUs added together, but not on any "
    "single node (or, for MIG, not in any node's free slices). Consolidate or preempt small "
    "holders on one node, change the MIG layout of a node towards the requested profile, "
    "or split the workload if it can run across nodes. Where the labels say no node has as "
    "many GPUs as one of its pods asks for, nothing the fleet frees will place it: ask for "
    "at most the largest node's GPUs per pod (more pods, or a smaller job), or add nodes "
    "that large."
)


class Shape(msgspec.Struct, frozen=True, order=True):
    """A request shape: ``gpus`` GPUs with ``milli`` thousandths of each."""

    gpus: int
    milli: int = WHOLE


def parse_shape(text: str) -> Shape:
    """``'2x1000'`` -> Shape(2, 1000); raises ValueError naming the bad text."""
    try:
        gpus, milli = (int(part) for part in text.split("x"))
    except ValueError as error:
        raise ValueError(f"bad shape {text!r}: expected '<gpus>x<milli>'") from error
    return Shape(gpus, milli)


def _request_shape(text: str) -> str:
    """A configured shape, checked as :func:`shapes` will parse it: whole GPUs or a share."""
    shape = parse_shape(text)
    if shape.gpus < 1 or not 0 < shape.milli <= WHOLE:
        raise ValueError(f"bad shape {text!r}: expected at least 1 GPU and 1 to {WHOLE} "
                         "milli of each")
    return text


RequestShape = Annotated[str, AfterValidator(_request_shape)]
Popularity = Annotated[float, Field(ge=0)]
"""A shape's weight: only the ratios matter; 0 leaves a shape out (a default one: a
policy's map is merged over the defaults, so it cannot drop a key)."""


class FragmentationSettings(BaseModel):
    """Settings of the fleet fragmentation rule."""

    model_config = ConfigDict(extra="forbid")

    ratio_threshold: float = Field(
        0.5, gt=0, le=1,
        description="Fragmentation ratio (fragmented / unallocated GPU capacity, 0-1) at or "
        "above which the fleet counts as fragmented. 0.5: half the free capacity unusable "
        "by the typical request is where FGD's evaluation shows jobs starting to queue.",
    )
    min_free_gpus: float = Field(
        2.0, ge=0,
        description="Free GPUs (whole-GPU equivalents) below which fragmentation is not "
        "reported: a nearly full fleet is fragmented by definition and that is not news.",
    )
    window_s: float = Field(
        900, gt=0,
        description="Seconds the ratio must stay at or above the threshold before the rule "
        "fires (15 min: longer than a scheduling burst).",
    )
    stranded_window_s: float = Field(
        300, gt=0,
        description="Seconds a pending workload must stay stranded (fits the fleet's total "
        "free capacity but no node, or no node at all as the fleet is) before a finding: "
        "5 min lets the scheduler act first, and the summaries of nodes just started arrive.",
    )
    default_shapes: dict[RequestShape, Popularity] = Field(
        default_factory=lambda: {"1x1000": 1.0},
        description="Request shapes ('<gpus>x<milli>': at least 1 GPU, 1 to 1000 milli of "
        "each) and their popularity (relative weights; 0 leaves a default shape out, and "
        "one must be above 0) used until workloads have been observed. One whole GPU is "
        "the commonest request.",
    )

    @field_validator("default_shapes")
    @classmethod
    def _some_shape(cls, weights: dict[str, float]) -> dict[str, float]:
        if not any(weights.values()):
            raise ValueError("needs a shape with a popularity above 0")
        return weights


def popularity(shapes: Iterable[Shape]) -> dict[Shape, float]:
    """The share of each shape among observed requests; GPU-less requests are left out."""
    counts: dict[Shape, int] = {}
    for shape in shapes:
        if shape.gpus > 0 and shape.milli > 0:
            counts[shape] = counts.get(shape, 0) + 1
    total = sum(counts.values())
    return {shape: n / total for shape, n in counts.items()} if total else {}


def _prefix_sums(values: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(values)]


def node_fragments(free_milli: Sequence[int], shapes: Iterable[Shape]) -> list[int]:
    """The fragment (milli) of one node's free per-GPU shares for each shape, in order."""
    ordered = sorted(free_milli)
    prefix = _prefix_sums(ordered)
    total = prefix[-1]
    fragments = []
    for shape in shapes:
        unusable = bisect.bisect_left(ordered, shape.milli)
        fits = len(ordered) - unusable >= shape.gpus
        fragments.append(prefix[unusable] if fits else total)
    return fragments


def node_fragmentation(free_milli: Sequence[int], shapes: Mapping[Shape, float]) -> float:
    """Popularity-weighted fragment (milli) of one node's free per-GPU shares."""
    fragments = node_fragments(free_milli, shapes)
    return sum(w * f for w, f in zip(shapes.values(), fragments, strict=True))


class FragmentationReport(msgspec.Struct):
    """Cluster fragmentation in milli, and per-shape fragments for the blocking shapes."""

    fragmented_milli: float
    unallocated_milli: int
    nodes: int
    by_shape: dict[str, float] = {}
    """Fragment (milli) each shape alone sees, unweighted: the shapes free capacity fails."""

    @property
    def ratio(self) -> float:
        return self.fragmented_milli / self.unallocated_milli if self.unallocated_milli else 0.0


def cluster_fragmentation(nodes: Iterable[Sequence[int]],
                          shapes: Mapping[Shape, float]) -> FragmentationReport:
    """FGD fragmentation of a set of nodes, each given by its per-GPU free milli."""
    counts: dict[tuple[int, ...], int] = {}
    for free in nodes:
        key = tuple(sorted(free))
        counts[key] = counts.get(key, 0) + 1
    names = [f"{s.gpus}x{s.milli}" for s in shapes]
    weights = list(shapes.values())
    per_shape = [0.0] * len(names)
    unallocated = 0
    for free, n in counts.items():
        unallocated += n * sum(free)
        for i, fragment in enumerate(node_fragments(free, shapes)):
            per_shape[i] += n * fragment
    fragmented = sum(w * f for w, f in zip(weights, per_shape, strict=True))
    return FragmentationReport(fragmented, unallocated, sum(counts.values()),
                               dict(zip(names, per_shape, strict=True)))


def free_milli(summary: NodeSummary) -> list[int]:
    """A node summary's free capacity as per-GPU milli: free whole GPUs, the rest taken.

    Cordoned and unhealthy nodes offer nothing: the scheduler will not use them.
    """
    if summary.cordoned or not summary.healthy:
        return [0] * summary.gpus_total
    free = min(summary.gpus_free, summary.gpus_total)
    return [WHOLE] * free + [0] * (summary.gpus_total - free)


class FragmentationTrack(msgspec.Struct):
    """Fleet-level state of the fragmentation rule."""

    above_since: float | None = None
    evaluations: int = 0
    max_ratio: float = 0.0
    open_id: str | None = None
    open_since: float | None = None


def summaries_time(ts: float, seen: float | None) -> float:
    """The time an evaluation at ``ts`` knows the nodes as of: the summaries' (``seen``:
    :attr:`FleetView.seen`), never past ``ts``; ``ts`` itself where not given."""
    return ts if seen is None else min(ts, seen)


def observe_fleet(track: FragmentationTrack, report: FragmentationReport, *, ts: float,
                  settings: FragmentationSettings, seen: float | None = None
                  ) -> list[Finding]:
    """Fold one fleet evaluation into ``track``; fire after ``window_s`` above threshold.

    The window is timed by the summaries the report is made of (``seen``, their time:
    :attr:`FleetView.seen`), not by ``ts`` where the queue has run ahead of them."""
    seen = summaries_time(ts, seen)
    fp = fingerprint(KIND, "fleet")
    subject = Subject()
    free_gpus = report.unallocated_milli / WHOLE
    above = report.ratio >= settings.ratio_threshold and free_gpus >= settings.min_free_gpus
    if not above:
        track.above_since, track.evaluations, track.max_ratio = None, 0, 0.0
        if track.open_id is None or track.open_since is None:
            return []
        closing = resolved(track.open_id, fp, KIND, subject,
                           f"fragmentation ratio back to {report.ratio:.2f}",
                           track.open_since, max(seen, track.open_since))
        track.open_id = track.open_since = None
        return [closing]
    if track.above_since is None:
        track.above_since = seen
    track.evaluations += 1
    track.max_ratio = max(track.max_ratio, report.ratio)
    if track.open_id is not None or seen - track.above_since < settings.window_s:
        return []
    track.open_id, track.open_since = finding_id(fp, track.above_since), track.above_since
    blocking = sorted(report.by_shape.items(), key=lambda kv: -kv[1])
    return [Finding(
        id=track.open_id, fingerprint=fp, kind=KIND, severity="warning", state="firing",
        subject=subject,
        summary=f"{report.ratio:.0%} of the fleet's {free_gpus:.1f} free GPUs are fragments "
        f"the observed request shapes cannot use",
        starts_at=track.above_since, ts=ts,
        evidence=Evidence(
            window_start=track.above_since, window_end=seen, samples=track.evaluations,
            values={"ratio": report.ratio, "max_ratio": track.max_ratio,
                    "fragmented_gpus": report.fragmented_milli / WHOLE,
                    "unallocated_gpus": free_gpus, "nodes": float(report.nodes)},
        ),
        runbook=RUNBOOK,
        labels={"blocking_shapes": ",".join(name for name, frag in blocking[:3] if frag > 0)},
    )]


# -- stranded demand ---------------------------------------------------------------------------


class Demand(msgspec.Struct, frozen=True):
    """A pending workload's request: whole GPUs on one node, or MIG devices by profile."""

    key: str
    """namespace/name of the workload."""
    queue: str
    gpus: int = 0
    mig: dict[str, int] = {}
    since: float | None = None
    """When it started waiting (event time); None where not known."""
    pod_sets: tuple[PodSet, ...] = ()
    """Its pods' shapes, for a workload of several pods (a Kueue Workload's pod sets); empty:
    ``gpus`` and ``mig`` are one pod's."""

    @property
    def pods(self) -> tuple[PodSet, ...]:
        """Its pods' shapes: each pod needs room on one node."""
        return self.pod_sets or (PodSet(count=1, gpus=self.gpus, mig=self.mig),)

    @property
    def request(self) -> tuple[object, ...]:
        """What it asks for, as a key: workloads with the same one fit the same nodes, so a
        queue of many alike is judged once per evaluation."""
        return (self.gpus, tuple(sorted(self.mig.items())),
                *((p.count, p.gpus, tuple(sorted(p.mig.items()))) for p in self.pods))


class StrandedEpisode(msgspec.Struct):
    since: float
    queue: str
    evaluations: int = 0
    open_id: str | None = None


class StrandedTrack(msgspec.Struct):
    """Per pending workload, since when it has been stranded."""

    episodes: dict[str, StrandedEpisode] = {}


def request_room(summary: NodeSummary) -> int:
    """How many ``nvidia.com/gpu`` a pod can still get on a node: its free GPUs, or on shared
    GPUs (time-slicing, MPS) its free replicas, which is what the device plugin hands out."""
    if summary.gpu_replicas > 1 and summary.replicas_free is not None:
        return summary.replicas_free
    return summary.gpus_free


def capacity(summary: NodeSummary) -> int:
    """How many ``nvidia.com/gpu`` one pod could get on a node with nothing else on it: its
    GPUs, or on shared GPUs their replicas (the ceiling of :func:`request_room`)."""
    return summary.gpus_total * max(1, summary.gpu_replicas)


def fits_no_node(demand: Demand, largest: int,
                 layouts: Sequence[Mapping[str, int]] | None = None) -> dict[str, float] | None:
    """Why no node could ever hold one of ``demand``'s pods as the fleet is (the figures for
    the evidence), where ``largest`` is the largest :func:`capacity` of the fleet's nodes,
    free or not, cordoned or not: a pod asks for more whole GPUs. With ``layouts`` (every
    MIG node's ``mig_total``, None where not known), a pod asking for MIG devices no node's
    layout offers together: only a layout change places it. None when every pod fits some
    node, and when no node is known yet (``largest`` 0 and no layout)."""
    asked = max((p.gpus for p in demand.pods if not p.mig), default=0)
    if largest and asked > largest:
        return {"requested_gpus_per_pod": float(asked), "largest_node_gpus": float(largest)}
    if not layouts:
        return None
    for pod in demand.pods:
        if pod.mig and not any(all(layout.get(p, 0) >= n for p, n in pod.mig.items())
                               for layout in layouts):
            return {"requested_mig_devices_per_pod": float(sum(pod.mig.values())),
                    **{f"offered_mig_{p}": float(sum(layout.get(p, 0) for layout in layouts))
                       for p in sorted(pod.mig)}}
    return None


NEVER_PLACEABLE = frozenset({"largest_node_gpus", "requested_mig_devices_per_pod"})
"""Evidence keys of :func:`fits_no_node`: a stranded workload's finding with one of them
says it can never start as the fleet is."""


def mig_layouts(nodes: Iterable[NodeSummary]) -> list[Mapping[str, int]] | None:
    """Every MIG node's layout (``mig_total``); None when no node has MIG, or when a node's
    is not known: mig-manager is changing it (``mig_changing``: the node may offer any
    profile next), or its summary comes from an earlier build and shows free slices. One
    from an earlier build with every slice held reads as a node without MIG until its next
    summary (a rolling upgrade's first ``summary_interval_s``)."""
    layouts: list[Mapping[str, int]] = []
    for summary in nodes:
        if summary.mig_changing:
            return None
        if summary.mig_total:
            layouts.append(summary.mig_total)
        elif summary.mig_free:
            return None
    return layouts or None


def unplaceable(pending: Mapping[str, Demand], nodes: Sequence[NodeSummary]
                ) -> dict[str, dict[str, float]]:
    """The ``pending`` workloads no node of ``nodes`` could ever hold, with why
    (:func:`fits_no_node`). Runs every evaluation: the nodes are looked at only while no node
    is found that holds the largest pod asked for."""
    pods = [p for demand in pending.values() for p in demand.pods]
    asked = max((p.gpus for p in pods if not p.mig), default=0)
    mig = any(p.mig for p in pods)
    if not mig and (not asked or any(capacity(s) >= asked for s in nodes)):
        return {}
    largest = max(map(capacity, nodes), default=0)
    layouts = mig_layouts(nodes) if mig else None
    return {key: why for key, demand in pending.items()
            if (why := fits_no_node(demand, largest, layouts)) is not None}


class FreeView:
    """The schedulable free capacity of the fleet, summed once per evaluation."""

    def __init__(self, summaries: Iterable[NodeSummary]) -> None:
        summaries = list(summaries)
        self.capacity = max(map(capacity, summaries), default=0)
        """The largest node's :func:`capacity`, cordoned and unhealthy nodes included."""
        self.layouts = mig_layouts(summaries)
        """Every MIG node's layout, cordoned and unhealthy nodes included (:func:`mig_layouts`)."""
        self.usable = [s for s in summaries if s.healthy and not s.cordoned]
        self.largest = max((request_room(s) for s in self.usable), default=0)
        self.total = sum(request_room(s) for s in self.usable)
        self.mig_nodes = [s.mig_free for s in self.usable if s.mig_free]
        self.mig_total = sum(sum(free.values()) for free in self.mig_nodes)
        self.mig_by_profile: dict[str, int] = {}
        for free in self.mig_nodes:
            for profile, count in free.items():
                self.mig_by_profile[profile] = self.mig_by_profile.get(profile, 0) + count


class Room(NamedTuple):
    """Room a placement takes on one node: ``nvidia.com/gpu`` (GPUs or replicas) and MIG
    devices by profile."""

    gpus: int = 0
    mig: dict[str, int] = {}


_NO_ROOM = Room()


def placement(pods: Iterable[PodSet], nodes: Sequence[NodeSummary]) -> dict[int, Room] | None:
    """Where each pod finds a node with room for it, taking what it uses (first fit, in the
    order of ``nodes``, largest pods first: for pods of one shape this finds a placement
    whenever one exists): the room taken on the nodes it uses, by their position in
    ``nodes``, or None when some pod finds none."""
    taken: dict[int, Room] = {}
    for pod_set in sorted(pods, key=lambda p: (-p.gpus, -sum(p.mig.values()))):
        left, gpus = pod_set.count, pod_set.gpus
        asked = [(p, n) for p, n in pod_set.mig.items() if n]
        # Each node's room is worked out only as the scan reaches it: a pod usually fits one
        # of the first, and the fleet agent places every waiting workload each evaluation.
        for i, summary in enumerate(nodes):
            free = request_room(summary)
            if free <= 0 and not summary.mig_free:
                continue
            used = taken.get(i, _NO_ROOM)
            count = min(left, (free - used.gpus) // gpus) if gpus else left
            for p, n in asked:
                count = min(count, (summary.mig_free.get(p, 0) - used.mig.get(p, 0)) // n)
            if count <= 0:
                continue
            used_mig = dict(used.mig)
            for p, n in pod_set.mig.items():
                used_mig[p] = used_mig.get(p, 0) + count * n
            taken[i] = Room(used.gpus + count * gpus, used_mig)
            left -= count
            if not left:
                break
        if left:
            return None
    return taken


def placeable(pods: Iterable[PodSet], nodes: Iterable[NodeSummary]) -> bool:
    """Whether each pod finds a node with room for it (:func:`placement`)."""
    return placement(pods, list(nodes)) is not None


def stranded_reason(demand: Demand, fleet: FreeView | Iterable[NodeSummary]
                    ) -> dict[str, float] | None:
    """Why ``demand`` is stranded (the figures for the evidence), or None when it is not.

    Stranded: the fleet's free capacity adds up to what it asks for (MIG devices of any
    profile), but its pods cannot each be given a node with room for them; or one of its
    pods asks for more GPUs than any node has, or MIG devices no node's layout offers
    (:func:`fits_no_node`), whatever is free.
    """
    view = fleet if isinstance(fleet, FreeView) else FreeView(fleet)
    never = fits_no_node(demand, view.capacity, view.layouts)
    if never is not None:
        if demand.mig:  # for the layout advice: the slices free now, by profile
            never |= {f"free_mig_{p}": float(n) for p, n in sorted(view.mig_by_profile.items())}
        return never
    pods = sum(p.count for p in demand.pods)
    several = {"pods": float(pods)} if pods > 1 else {}
    if demand.mig:
        wanted = sum(demand.mig.values())
        if view.mig_total < wanted:
            return None
        if pods == 1:  # the common case, without copying every node's free slices
            if any(all(free.get(p, 0) >= n for p, n in demand.mig.items())
                   for free in view.mig_nodes):
                return None
        elif placeable(demand.pods, view.usable):
            return None
        return {"free_mig_devices": float(view.mig_total),
                "requested_mig_devices": float(wanted), **several,
                **{f"free_mig_{p}": float(n) for p, n in sorted(view.mig_by_profile.items())}}
    if demand.gpus <= 0 or view.total < demand.gpus:
        return None
    if view.largest >= demand.gpus or (pods > 1 and placeable(demand.pods, view.usable)):
        return None
    return {"fleet_free_gpus": float(view.total), "largest_node_free_gpus": float(view.largest),
            "requested_gpus": float(demand.gpus), **several}


def observe_stranded(track: StrandedTrack, pending: Mapping[str, Demand],
                     summaries: Sequence[NodeSummary], *, ts: float,
                     settings: FragmentationSettings, seen: float | None = None
                     ) -> list[Finding]:
    """Evaluate every pending workload against the fleet's free capacity at ``ts``.

    A workload that left the queue, or that is no longer stranded, closes its episode.
    An episode is timed by the summaries that show it (``seen``, their time, where the
    queue has run ahead of them: :attr:`FleetView.seen`), not by ``ts``: it starts no
    earlier than the workload's wait, and fires once the summaries have shown it for
    ``stranded_window_s``.
    """
    out: list[Finding] = []
    view = FreeView(summaries)
    seen = summaries_time(ts, seen)
    for key in list(track.episodes):
        if key not in pending:
            out += _close_stranded(track, key, ts, "the workload left the queue")
    reasons: dict[tuple[object, ...], dict[str, float] | None] = {}
    for key, demand in pending.items():
        request = demand.request
        if request not in reasons:
            reasons[request] = stranded_reason(demand, view)
        reason = reasons[request]
        if reason is None:
            if key in track.episodes:
                out += _close_stranded(track, key, seen, "the workload fits a node again")
            continue
        episode = track.episodes.get(key)
        if episode is None:
            since = seen if demand.since is None else max(seen, demand.since)
            episode = track.episodes[key] = StrandedEpisode(since=since, queue=demand.queue)
        episode.evaluations += 1
        if episode.open_id is not None or seen - episode.since < settings.stranded_window_s:
            continue
        fp = fingerprint(STRANDED_KIND, key)
        episode.open_id = finding_id(fp, episode.since)
        namespace, _, name = key.partition("/")
        shape = _shape(demand)
        labels = {"shape": shape, "namespace": namespace, "name": name}
        if "requested_mig_devices_per_pod" in reason:
            summary = (f"{key} waits for {shape}: no node's MIG layout offers it, so it can "
                       "never start until a layout changes")
        elif "largest_node_gpus" in reason:
            largest = int(reason["largest_node_gpus"])
            summary = (f"{key} waits for {shape}: no node of the fleet has "
                       f"{int(reason['requested_gpus_per_pod'])} GPUs (the largest has "
                       f"{largest}), so it can never start as it is")
            labels["advice"] = (f"ask for at most {largest} GPUs per pod, or add a node "
                                "that large")
        else:
            summary = (f"{key} waits for {shape}: the fleet has the capacity free, but no "
                       "node has it in that shape")
        if demand.mig:
            # MIG layout advice: the free slices are there, in the wrong profiles.
            free = ", ".join(f"{k.removeprefix('free_mig_')} x{v:g}" for k, v in reason.items()
                             if k.startswith("free_mig_") and k != "free_mig_devices")
            labels["advice"] = (f"repartition a MIG node with idle slices ({free}) to offer "
                                f"{shape}" if free else f"repartition a MIG node to offer {shape}")
        out.append(Finding(
            id=episode.open_id, fingerprint=fp, kind=STRANDED_KIND, severity="warning",
            state="firing", subject=_stranded_subject(key, demand.queue),
            summary=summary, starts_at=episode.since, ts=ts,
            evidence=Evidence(window_start=episode.since, window_end=max(seen, episode.since),
                              samples=episode.evaluations, values=dict(reason)),
            runbook=STRANDED_RUNBOOK, labels=labels,
        ))
    return out


def _shape(demand: Demand) -> str:
    """What the workload asks for, in words: one pod's shape, or each pod set's."""

    def one(gpus: int, mig: Mapping[str, int]) -> str:
        return ", ".join(f"{n}x {p}" for p, n in sorted(mig.items())) if mig \
            else f"{gpus} GPUs"

    if sum(p.count for p in demand.pods) == 1:
        return one(demand.gpus, demand.mig) + ("" if demand.mig else " on one node")
    counts: dict[str, int] = {}  # pod sets of one shape (a master and its workers) together
    for pod_set in demand.pods:
        text = one(pod_set.gpus, pod_set.mig)
        counts[text] = counts.get(text, 0) + pod_set.count
    return " + ".join(f"{n} pod{'s' if n > 1 else ''} of {text}" for text, n in counts.items())


def _stranded_subject(key: str, queue: str) -> Subject:
    namespace, _, name = key.partition("/")
    return Subject(queue=queue, pod=PodRef(namespace=namespace, name=name))


def _close_stranded(track: StrandedTrack, key: str, ts: float, why: str) -> list[Finding]:
    episode = track.episodes.pop(key)
    if episode.open_id is None:
        return []
    fp = fingerprint(STRANDED_KIND, key)
    return [resolved(episode.open_id, fp, STRANDED_KIND, _stranded_subject(key, episode.queue),
                     f"{key}: {why}", episode.since, max(ts, episode.since))]


@dataclass(frozen=True)
class FleetView:
    """What the fleet rules judge at one evaluation, built once per evaluation."""

    nodes: Sequence[NodeSummary]
    """The latest summary of every node in the fleet."""
    pending: Mapping[str, Demand]
    """Workloads waiting in the queue, by workload key."""
    shape_counts: Mapping[str, int]
    """Observed request shapes ('<gpus>x<milli>'), one count per workload that queued."""
    seen: float | None = None
    """Event time the summaries have reached (the newest one's); None: the evaluation's. A
    worker catching up reads the queue's one partition ahead of the node join's summaries,
    and the nodes' state is known only as of this."""


def shapes(shape_counts: Mapping[str, float], settings: FragmentationSettings
           ) -> dict[Shape, float]:
    """The request shapes' popularity: observed ones, else the configured defaults."""
    counts = shape_counts or settings.default_shapes
    total = sum(counts.values())
    return {parse_shape(k): v / total for k, v in counts.items() if v}


def _evaluate_fragmentation(track: FragmentationTrack, fleet: FleetView, now: float,
                            settings: FragmentationSettings) -> list[Finding]:
    if not fleet.nodes:
        return []
    report = cluster_fragmentation((free_milli(s) for s in fleet.nodes),
                                   shapes(fleet.shape_counts, settings))
    return observe_fleet(track, report, ts=now, settings=settings, seen=fleet.seen)


def _evaluate_stranded(track: StrandedTrack, fleet: FleetView, now: float,
                       settings: FragmentationSettings) -> list[Finding]:
    return observe_stranded(track, fleet.pending, list(fleet.nodes), ts=now, settings=settings,
                            seen=fleet.seen)


RUNNERS = (FleetRunner("fragmentation", FragmentationTrack, _evaluate_fragmentation),
           FleetRunner("stranded", StrandedTrack, _evaluate_stranded))
"""The fleet agent's evaluations of the rule: the fleet's fragmentation, then each pending
workload that fits the fleet's free capacity but no node."""
