"""MIG layout advice: per node pool, the GPU layouts that serve the most demand on the fewest GPUs.

Demand is one entry per workload: the smallest profile that fits it and the
share of the week it ran. Per pool the search is a small integer program,
solved exactly with HiGHS (``scipy.optimize.milp``):

- ``x[c]`` (integer) GPUs set to layout ``c``, one of the model's *maximal*
  valid layouts. Restricting to maximal layouts loses nothing: every valid
  layout is contained in a maximal one, and instances nobody uses cost
  nothing. So ``sum(x) <= GPUs in the pool``.
- ``u[p, q]`` (integer) workloads whose smallest profile is ``p`` placed on an
  instance of a profile ``q`` at least as large (compute and memory), bounded
  by the instances of ``q`` the layouts create; their sum ``c[p]`` is at most
  the number of such workloads.
- ``v[p]`` the share of the week served for ``p``: the longest-running ``c[p]``
  workloads are served first, so it is the prefix sum of their shares, a
  concave function of ``c[p]``. ``v[p]`` is bounded by the lines through
  consecutive points of that sum; the lines are added as the solves touch
  them (65 to start, then those around each answer, until the answer needs no
  more), so the program stays a few dozen columns whatever the fleet and the
  number of workloads. At integral ``c[p]`` the lines meet exactly at the sum.

Two solves make the order of goals exact: the first maximises the served
share of the week; the second holds that optimum (to 1e-6) and minimises
GPUs, with ties going to the plan that keeps more of today's layouts and
gives workloads fewer slices beyond their smallest profile. GPUs a pool does
not need, and GPUs planned as one full-size instance, get MIG disabled.
Each workload gets an instance of its own: a share under 1 weighs how much
serving it is worth, not a time-slice of an instance.

Cost (``make bench``, 2 shared cores): 1,000 GPUs and 10,000 over-subscribing
workloads in about 0.6 s, where one column per (profile, share) bucket took
10 s because the second solve had to branch over thousands of columns.

The result is a mig-parted config (``version: v1``, ``mig-configs``) with one
named config per distinct node arrangement, the ``nvidia.com/mig.config``
label for each node, and the change against the layout the nodes have now.
Chosen layouts are matched to GPUs so that as many GPUs as possible keep the
layout they have: a change destroys the instances on it and the pods using them.

Pure functions of their arguments: the report calls :func:`advise`, and the
fleet agent can call it periodically and publish :func:`advice_findings`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpusteward.rules.findings import finding_id, fingerprint
from gpusteward.rules.mig.advice import KIND
from gpusteward.rules.mig.geometry import Geometry, GeometryError, Layout, Profile
from gpusteward.schema import Evidence, Finding, Subject

CONFIG_LABEL = "nvidia.com/mig.config"
DISABLED = "all-disabled"
"""The GPU Operator's named config for MIG off; what a GPU outside every layout gets."""


@dataclass(frozen=True)
class Demand:
    """One workload's need for a MIG instance."""

    workload: str
    profile: str
    """The smallest profile that fits it (memory and compute, with headroom)."""
    share: float
    """Share of the week it ran, 0-1: how much serving it is worth."""


@dataclass(frozen=True)
class Pool:
    """GPUs that get one layout plan: nodes of one GPU model (a node pool)."""

    name: str
    model: str
    """Key of the model's geometry in ``mig_profiles.yaml``."""
    nodes: tuple[str, ...]
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node


@dataclass
class NodeChange:
    """What applying the advice does to one node."""

    node: str
    config_before: str | None
    config_after: str
    gpus_changed: list[int]
    instances_removed: dict[str, int]
    instances_added: dict[str, int]


@dataclass
class PoolAdvice:
    """The plan for one pool."""

    pool: Pool
    gpu_layouts: list[dict[str, int]]
    """One layout per MIG-enabled GPU the plan uses (the others get MIG disabled)."""
    served: dict[str, str]
    """workload -> the profile of the instance it gets."""
    unserved: list[str]
    demand_share: float
    served_share: float
    node_layouts: dict[str, list[dict[str, int] | None]] = field(default_factory=dict)
    """node -> per GPU index, its layout (None: MIG disabled)."""
    changes: list[NodeChange] = field(default_factory=list)

    whole_gpu: str | None = None
    """The full-GPU profile; a GPU planned as one such instance runs with MIG off."""
    unverified: list[str] = field(default_factory=list)
    """Profiles the plan uses whose placements are inferred, not captured on the model
    (``placement_verified: false``): the layouts may not be creatable as planned."""

    @property
    def gpus_used(self) -> int:
        return len(self.gpu_layouts)

    @property
    def mig_gpus(self) -> int:
        """GPUs the plan partitions (the others it uses serve whole-GPU work, MIG off)."""
        return sum(1 for layout in self.gpu_layouts if not _whole(layout, self.whole_gpu))


@dataclass
class Advice:
    """Plans for every pool, as one mig-parted config and a label per node."""

    pools: list[PoolAdvice]
    mig_parted: dict[str, Any]
    labels: dict[str, str]
    """node -> value of ``nvidia.com/mig.config``."""

    @property
    def changes(self) -> list[NodeChange]:
        return [change for pool in self.pools for change in pool.changes]


def fits(bigger: Profile, smaller: Profile) -> bool:
    """Whether a workload sized for ``smaller`` runs on an instance of ``bigger``."""
    if smaller.media and not bigger.media:
        return False
    return (bigger.compute_slices >= smaller.compute_slices
            and bigger.memory_slices >= smaller.memory_slices)


def solve_pool(geometry: Geometry, gpus: int, demand: Sequence[Demand],
               today: Sequence[Layout | None] = ()
               ) -> tuple[list[dict[str, int]], dict[str, str]]:
    """The layouts (one per GPU used) and the workload -> profile assignment for one pool.

    ``today`` lists the pool's GPUs' layouts now; among plans equally good on
    demand and GPUs, the one that keeps most of them wins.
    """
    # Imported here: scipy.optimize is most of the stream worker's import time (about a
    # second of a restart), and only a pool with MIG demand needs it.
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    if gpus <= 0 or not demand:
        return [], {}
    wanted = {d.profile for d in demand}
    for name in wanted:
        geometry.profile(name)  # raises GeometryError naming the valid ones
    names = [p.name for p in geometry.base_profiles]
    names += sorted(wanted - set(names))
    layouts = geometry.maximal_layouts(names)
    kept_today = Counter(_key(t) for t in today if t and geometry.is_valid(t))
    known = {_key(c) for c in layouts}
    layouts += [dict(k) for k in sorted(kept_today) if k not in known]
    today_counts = [kept_today.get(_key(c), 0) for c in layouts]
    profiles = [geometry.profile(n) for n in names]
    by_smallest: dict[str, list[Demand]] = {}
    for d in sorted(demand, key=lambda d: (-d.share, d.workload)):
        by_smallest.setdefault(d.profile, []).append(d)
    smallest = sorted(by_smallest)
    # served[p][c]: the share served when the c longest-running workloads of p get an
    # instance; concave in c, so the lines through its consecutive points bound it.
    served_by = {p: np.concatenate([[0.0], np.cumsum([d.share for d in by_smallest[p]])])
                 for p in smallest}
    pairs = [(p, q.name) for p in smallest for q in profiles if fits(q, geometry.profile(p))]

    # Columns: x (GPUs per layout), u (placements), v (share served per smallest
    # profile), k (GPUs kept as they are today).
    n_x, n_u, n_v = len(layouts), len(pairs), len(smallest)
    n = n_x + n_u + n_v + n_x
    first_v, kept = n_x + n_u, n_x + n_u + n_v
    rows: list[tuple[dict[int, float], float, float]] = [
        ({i: 1.0 for i in range(n_x)}, 0.0, float(gpus))]
    for q in names:
        row = {n_x + k: 1.0 for k, (_, qq) in enumerate(pairs) if qq == q}
        if not row:
            continue
        for c, layout in enumerate(layouts):
            if layout.get(q):
                row[c] = -float(layout[q])
        rows.append((row, -np.inf, 0.0))
    placed_of = {p: [n_x + k for k, (pp, _) in enumerate(pairs) if pp == p] for p in smallest}
    for p in smallest:
        rows.append(({k: 1.0 for k in placed_of[p]}, 0.0, float(len(by_smallest[p]))))
    for c in range(n_x):
        if today_counts[c]:
            rows.append(({kept + c: 1.0, c: -1.0}, -np.inf, 0.0))
    integrality = np.concatenate([np.ones(n_x + n_u), np.zeros(n_v + n_x)])
    bounds = Bounds(np.zeros(n), np.concatenate([
        np.full(n_x + n_u, np.inf), [served_by[p][-1] for p in smallest],
        np.array(today_counts, dtype=float)]))
    cuts: set[tuple[int, int]] = set()

    def cut(j: int, count: int) -> None:
        """v_p <= the line through served[p][count] and served[p][count + 1]."""
        values = served_by[smallest[j]]
        if count < 0 or count + 1 >= len(values) or (j, count) in cuts:
            return
        cuts.add((j, count))
        slope = values[count + 1] - values[count]
        row = {first_v + j: 1.0, **{k: -slope for k in placed_of[smallest[j]]}}
        rows.append((row, -np.inf, float(values[count] - slope * count)))

    for j, p in enumerate(smallest):
        # 65 lines to start with; the solves add the ones their answers touch. Each
        # round is a small solve, so a coarse start and wide rounds were fastest.
        for count in np.unique(np.linspace(0, len(by_smallest[p]) - 1, 65).astype(int)):
            cut(j, int(count))

    def solve(objective: np.ndarray, extra: list[LinearConstraint]) -> np.ndarray:
        """Solve, adding the lines the answer violates until it needs none."""
        while True:
            matrix = lil_matrix((len(rows), n))
            for r, (coefficients, _, _) in enumerate(rows):
                for column, value in coefficients.items():
                    matrix[r, column] = value
            result = milp(objective, integrality=integrality, bounds=bounds,
                          constraints=[LinearConstraint(matrix.tocsr(), [r[1] for r in rows],
                                                        [r[2] for r in rows]), *extra],
                          options={"mip_rel_gap": 0.0, "presolve": True})
            if result.status != 0:
                raise RuntimeError(f"MIG layout search failed: {result.message}")
            before = len(cuts)
            for j, p in enumerate(smallest):
                count = int(np.rint(result.x[placed_of[p]].sum()))
                if result.x[first_v + j] > served_by[p][count] + 1e-9:
                    # The lines around the answer too: fewer rounds (measured).
                    for near in range(count - 16, count + 16):
                        cut(j, near)
            if len(cuts) == before:
                return result.x

    # Most demand served; the served share of the integral placements, recomputed
    # exactly: the solver's own objective carries its feasibility tolerance.
    first = solve(np.concatenate([np.zeros(n_x + n_u), -np.ones(n_v), np.zeros(n_x)]), [])
    best = sum(served_by[p][int(np.rint(first[placed_of[p]].sum()))] for p in smallest)
    # Hold it (less a rounding tolerance) and use the fewest GPUs. Ties on GPUs are
    # broken by two small terms that together stay below one GPU, so the GPU count stays
    # minimal: a bonus per GPU kept as it is today (at most `gpus` of them, under 1/2 in
    # all) and a cost per compute slice a workload gets beyond its smallest profile
    # (under 1/2 in all), so spare slices stay free for new work.
    keep = np.zeros(n)
    keep[first_v:kept] = 1.0
    extra = [geometry.profile(q).compute_slices - geometry.profile(p).compute_slices
             for p, q in pairs]
    worst = max(1, geometry.total_compute_slices * len(demand))
    fewest = np.concatenate([np.ones(n_x), np.array(extra, dtype=float) / (2 * worst + 2),
                             np.zeros(n_v), np.full(n_x, -1.0 / (2 * gpus + 2))])
    second = solve(fewest, [LinearConstraint(keep, best - 1e-6 * (1 + best), np.inf)])
    x = np.rint(second[:n_x]).astype(int)
    u = np.rint(second[n_x:n_x + n_u]).astype(int)

    gpu_layouts = [dict(layouts[c]) for c in range(n_x) for _ in range(x[c])]
    served: dict[str, str] = {}
    # Hand each smallest profile's instances to its longest-running workloads.
    placed: dict[str, list[str]] = {}
    for k, (p, q) in enumerate(pairs):
        placed.setdefault(p, []).extend([q] * u[k])
    for p, members in by_smallest.items():
        targets = sorted(placed.get(p, []), key=lambda q: _size(geometry.profile(q)))
        for d, q in zip(members, targets, strict=False):
            served[d.workload] = q
    return gpu_layouts, served


def _size(profile: Profile) -> tuple[int, int]:
    return (profile.compute_slices, profile.memory_slices)


def advise(geometries: Mapping[str, Geometry], pools: Sequence[Pool],
           demand: Mapping[str, Sequence[Demand]],
           current: Mapping[str, Sequence[Layout | None]] | None = None,
           current_labels: Mapping[str, str] | None = None) -> Advice:
    """The layout plan for every pool.

    ``demand`` maps a pool name to its workloads' demand; ``current`` maps a
    node to its GPUs' layouts today (None or an empty layout: MIG disabled),
    ``current_labels`` a node to its ``nvidia.com/mig.config`` today.
    """
    current = current or {}
    current_labels = current_labels or {}
    advices: list[PoolAdvice] = []
    configs: dict[str, list[dict[str, Any]]] = {}
    labels: dict[str, str] = {}
    for pool in pools:
        if pool.model not in geometries:
            raise GeometryError(f"pool {pool.name}: no MIG geometry for {pool.model!r}; "
                                f"known models: {', '.join(sorted(geometries))}")
        geometry = geometries[pool.model]
        wanted = demand.get(pool.name, ())
        today = [t for node in pool.nodes for t in current.get(node, ())]
        gpu_layouts, served = solve_pool(geometry, pool.gpus, wanted, today)
        full = geometry.full_profile
        advice = PoolAdvice(
            pool=pool, gpu_layouts=gpu_layouts, served=served,
            whole_gpu=full.name if full else None,
            unserved=sorted(d.workload for d in wanted if d.workload not in served),
            demand_share=sum(d.share for d in wanted),
            served_share=sum(d.share for d in wanted if d.workload in served),
            unverified=sorted({name for layout in gpu_layouts for name in layout
                               if not geometry.profile(name).placement_verified}),
        )
        # A GPU that is one full-size instance is a GPU with MIG off: plan it so, and
        # read today's such GPUs so, or the plan would churn them for nothing.
        partitioned = [g for g in gpu_layouts if not _whole(g, advice.whole_gpu)]
        today_by_node = {node: [None if t is None or _whole(t, advice.whole_gpu) else t
                                for t in current.get(node, ())] for node in pool.nodes}
        advice.node_layouts = _assign(pool, partitioned, today_by_node)
        for node, per_gpu in advice.node_layouts.items():
            name, entries = _node_config(per_gpu)
            configs.setdefault(name, entries)
            labels[node] = name
            change = _change(node, today_by_node[node], per_gpu,
                             current_labels.get(node), name)
            if change.gpus_changed:
                advice.changes.append(change)
        advices.append(advice)
    return Advice(pools=advices, mig_parted={"version": "v1", "mig-configs": configs},
                  labels=labels)


def _whole(layout: Layout, full: str | None) -> bool:
    return full is not None and _key(layout) == ((full, 1),)


def _key(layout: Layout | None) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((k, v) for k, v in (layout or {}).items() if v))


def _assign(pool: Pool, gpu_layouts: list[dict[str, int]],
            current: Mapping[str, Sequence[Layout | None]]
            ) -> dict[str, list[dict[str, int] | None]]:
    """Put the chosen layouts on GPUs, keeping as many GPUs as possible as they are."""
    remaining = Counter(_key(layout) for layout in gpu_layouts)
    slots = [(node, i) for node in pool.nodes for i in range(pool.gpus_per_node)]
    placed: dict[tuple[str, int], tuple[tuple[str, int], ...]] = {}
    for node, i in slots:
        today = list(current.get(node, ()))
        key = _key(today[i]) if i < len(today) else ()
        if key and remaining[key] > 0:
            placed[(node, i)] = key
            remaining[key] -= 1
    # The rest go first to GPUs partitioned today (they change anyway unless reused),
    # then to whole GPUs, node by node so that a node's GPUs tend to share a layout.
    leftovers = sorted(remaining.elements())

    def partitioned_today(slot: tuple[str, int]) -> bool:
        today = list(current.get(slot[0], ()))
        return slot[1] < len(today) and bool(_key(today[slot[1]]))

    for slot in sorted(slots, key=lambda slot: not partitioned_today(slot)):
        if slot not in placed and leftovers:
            placed[slot] = leftovers.pop(0)
    return {node: [dict(placed[(node, i)]) if (node, i) in placed else None
                   for i in range(pool.gpus_per_node)] for node in pool.nodes}


def _node_config(per_gpu: Sequence[dict[str, int] | None]) -> tuple[str, list[dict[str, Any]]]:
    """The mig-parted entries of one node's arrangement and a stable name for it."""
    groups: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for index, layout in enumerate(per_gpu):
        groups.setdefault(_key(layout), []).append(index)
    if list(groups) == [()]:
        return DISABLED, [{"devices": "all", "mig-enabled": False}]
    entries: list[dict[str, Any]] = []
    for key, indices in sorted(groups.items(), key=lambda item: item[1][0]):
        devices: str | list[int] = "all" if len(groups) == 1 else indices
        if key:
            entries.append({"devices": devices, "mig-enabled": True,
                            "mig-devices": dict(key)})
        else:
            entries.append({"devices": devices, "mig-enabled": False})
    canonical = repr([(e["devices"], sorted(e.get("mig-devices", {}).items()))
                      for e in entries])
    digest = hashlib.sha1(canonical.encode(), usedforsecurity=False).hexdigest()[:10]
    return f"gpusteward-{digest}", entries


def _change(node: str, before: Sequence[Layout | None], after: Sequence[dict[str, int] | None],
            label_before: str | None, label_after: str) -> NodeChange:
    changed: list[int] = []
    removed: Counter[str] = Counter()
    added: Counter[str] = Counter()
    for i, new in enumerate(after):
        old = before[i] if i < len(before) else None
        if _key(old) != _key(new):
            changed.append(i)
            removed.update({k: v for k, v in (old or {}).items() if v})
            added.update({k: v for k, v in (new or {}).items() if v})
    return NodeChange(node=node, config_before=label_before, config_after=label_after,
                      gpus_changed=changed, instances_removed=dict(removed),
                      instances_added=dict(added))


def advice_findings(advice: Advice, ts: float, window_start: float, *,
                    period: str = "week", source: str = "the weekly report") -> list[Finding]:
    """One info finding per pool whose plan changes a node, for the findings topic.

    ``period`` names what a share is a share of (the summary counts GPU-instance-
    ``period``s); ``source`` is where the runbook sends the reader for the whole config.
    Labels: ``pool``, ``node.<name>`` -> its planned config name (the first 20 changed
    nodes), ``config.<name>`` -> that config's mig-parted entries as JSON, so the
    finding alone says what to apply, and ``placement_verified`` (``false`` when the plan
    uses a profile whose placements were inferred for the model: the summary and runbook
    then say to check ``nvidia-smi mig -lgipp`` first).
    """
    findings: list[Finding] = []
    configs = advice.mig_parted.get("mig-configs", {})
    for pool in advice.pools:
        if not pool.changes:
            continue
        print_ = fingerprint(KIND, pool.pool.name)
        shown = pool.changes[:20]
        names = sorted({c.config_after for c in shown})
        caveat = (f" (placements of {', '.join(pool.unverified)} on {pool.pool.model} are "
                  "inferred, not verified)") if pool.unverified else ""
        check = ("First check that the GPUs offer these placements (nvidia-smi mig -lgipp "
                 "on one node): they were inferred, not captured, for this model. "
                 ) if pool.unverified else ""
        findings.append(Finding(
            id=finding_id(print_, window_start), fingerprint=print_, kind=KIND,
            severity="info", state="firing", subject=Subject(node=None),
            summary=(f"pool {pool.pool.name}: a MIG layout on {pool.gpus_used} of "
                     f"{pool.pool.gpus} GPUs serves {pool.served_share:.1f} of "
                     f"{pool.demand_share:.1f} GPU-instance-{period}s; relabel "
                     f"{len(pool.changes)} node(s){caveat}"),
            starts_at=window_start, ts=ts,
            evidence=Evidence(window_start=window_start, window_end=ts,
                              values={"gpus_used": float(pool.gpus_used),
                                      "gpus": float(pool.pool.gpus),
                                      "served_share": pool.served_share,
                                      "demand_share": pool.demand_share,
                                      "nodes_changed": float(len(pool.changes)),
                                      "gpus_changed": float(sum(len(c.gpus_changed)
                                                                for c in pool.changes))}),
            labels={"pool": pool.pool.name,
                    "placement_verified": "false" if pool.unverified else "true",
                    **{f"node.{c.node}": c.config_after for c in shown},
                    **{f"config.{name}": json.dumps(configs[name], sort_keys=True,
                                                    separators=(",", ":"))
                       for name in names if name in configs}},
            runbook=f"{check}Apply the mig-parted config (labels config.*, or {source}), then set "
                    f"{CONFIG_LABEL} on the listed nodes after draining their MIG pods.",
        ))
    return findings


def instance_count(layouts: Sequence[Layout]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for layout in layouts:
        total.update({k: v for k, v in layout.items() if v})
    return dict(total)


def smallest_fitting(geometry: Geometry, memory_bytes: float, compute_fraction: float,
                     media: bool = False) -> Profile | None:
    """The smallest profile with the memory and share of compute a workload needs, if any."""
    candidates = [p for p in geometry.profiles
                  if (p.base or (media and p.media)) and p.media == media
                  and p.usable_bytes >= memory_bytes
                  and p.compute_slices >= math.ceil(
                      compute_fraction * geometry.total_compute_slices - 1e-9)]
    if not candidates:
        return None
    return min(candidates, key=lambda p: (p.compute_slices, p.memory_slices, p.name))
