"""The previous exact MIG layout solver, kept to compare the new one against.

One continuous column per (smallest profile, share) bucket carried the served share
of the week; the current solver in :mod:`gpusteward.rules.mig.layout` carries it in
one column per profile, bounded by cuts. Tests and ``benchmarks/bench_report.py``
check that both reach the same optimum and time them side by side.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from gpusteward.rules.mig.geometry import Geometry, Layout
from gpusteward.rules.mig.layout import Demand, _key, _size, fits


def solve_pool(geometry: Geometry, gpus: int, demand: Sequence[Demand],
               today: Sequence[Layout | None] = ()
               ) -> tuple[list[dict[str, int]], dict[str, str]]:
    """The layouts (one per GPU used) and the workload -> profile assignment for one pool.

    ``today`` lists the pool's GPUs' layouts now; among plans equally good on
    demand and GPUs, the one that keeps most of them wins.
    """
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
    pairs = [(p, q.name) for p in sorted(by_smallest) for q in profiles
             if fits(q, geometry.profile(p))]
    # Workloads of one smallest profile and one share are interchangeable: one column
    # each, bounded by their number, keeps the program small when many run all week.
    buckets: list[tuple[str, float, int]] = []
    for p in sorted(by_smallest):
        for share, size in sorted(Counter(d.share for d in by_smallest[p]).items(),
                                  reverse=True):
            buckets.append((p, share, size))

    # Columns: x (GPUs per layout), u (placements), z (served per bucket), k (GPUs kept).
    n_x, n_u, n_z = len(layouts), len(pairs), len(buckets)
    n = n_x + n_u + n_z + n_x
    rows: list[tuple[dict[int, float], float, float]] = []
    rows.append(({i: 1.0 for i in range(n_x)}, 0.0, float(gpus)))
    for q in names:
        row = {n_x + k: 1.0 for k, (_, qq) in enumerate(pairs) if qq == q}
        if not row:
            continue
        for c, layout in enumerate(layouts):
            if layout.get(q):
                row[c] = -float(layout[q])
        rows.append((row, -np.inf, 0.0))
    offset = n_x + n_u
    for p in sorted(by_smallest):
        row = {n_x + k: 1.0 for k, (pp, _) in enumerate(pairs) if pp == p}
        for j, (bp, _, _) in enumerate(buckets):
            if bp == p:
                row[offset + j] = -1.0
        rows.append((row, 0.0, 0.0))
    kept = n_x + n_u + n_z
    for c in range(n_x):
        if today_counts[c]:
            rows.append(({kept + c: 1.0, c: -1.0}, -np.inf, 0.0))

    matrix = lil_matrix((len(rows), n))
    for r, (coefficients, _, _) in enumerate(rows):
        for column, value in coefficients.items():
            matrix[r, column] = value
    lower = np.array([row[1] for row in rows])
    upper = np.array([row[2] for row in rows])
    integrality = np.concatenate([np.ones(n_x + n_u), np.zeros(n_z + n_x)])
    bounds = Bounds(np.zeros(n), np.concatenate([
        np.full(n_x + n_u, np.inf), np.array([float(b[2]) for b in buckets]),
        np.array(today_counts, dtype=float)]))
    shares = np.array([b[1] for b in buckets])
    options = {"mip_rel_gap": 0.0, "presolve": True}

    serve = np.concatenate([np.zeros(n_x + n_u), -shares, np.zeros(n_x)])
    first_solve = milp(serve, constraints=LinearConstraint(matrix.tocsr(), lower, upper),
                       integrality=integrality, bounds=bounds, options=options)
    if first_solve.status != 0:
        raise RuntimeError(f"MIG layout search failed: {first_solve.message}")
    # The served share of the integral placements, recomputed exactly: the solver's own
    # objective carries its feasibility tolerance, and holding to it can be infeasible.
    first_u = np.rint(first_solve.x[n_x:n_x + n_u]).astype(int)
    count: Counter[str] = Counter()
    for k, (p, _) in enumerate(pairs):
        count[p] += first_u[k]
    best = sum(sum(d.share for d in by_smallest[p][:count[p]]) for p in by_smallest)
    # Hold the best served share (less a rounding tolerance) and use the fewest GPUs.
    keep = lil_matrix((1, n))
    for j, share in enumerate(shares):
        keep[0, offset + j] = share
    # Ties on GPUs are broken by two small terms that together stay below one GPU, so
    # the GPU count stays minimal: a bonus per GPU kept as it is today (at most `gpus`
    # of them, under 1/2 in all) and a cost per compute slice a workload gets beyond its
    # smallest profile (under 1/2 in all), so spare slices stay free for new work.
    extra = [geometry.profile(q).compute_slices - geometry.profile(p).compute_slices
             for p, q in pairs]
    worst = max(1, geometry.total_compute_slices * len(demand))
    fewest = np.concatenate([np.ones(n_x), np.array(extra, dtype=float) / (2 * worst + 2),
                             np.zeros(n_z), np.full(n_x, -1.0 / (2 * gpus + 2))])
    second_solve = milp(
        fewest,
        constraints=[LinearConstraint(matrix.tocsr(), lower, upper),
                     LinearConstraint(keep.tocsr(), best - 1e-6 * (1 + best), np.inf)],
        integrality=integrality, bounds=bounds, options=options,
    )
    if second_solve.status != 0:
        raise RuntimeError(f"MIG layout search failed: {second_solve.message}")
    x = np.rint(second_solve.x).astype(int)
    u = np.rint(second_solve.x[n_x:n_x + n_u]).astype(int)

    gpu_layouts = [dict(layouts[c]) for c in range(n_x) for _ in range(x[c])]
    served: dict[str, str] = {}
    # Ties in share can leave z fractional; the placed counts u are integral, so hand
    # the instances out to the longest-running workloads of each smallest profile.
    placed: dict[str, list[str]] = {}
    for k, (p, q) in enumerate(pairs):
        placed.setdefault(p, []).extend([q] * u[k])
    for p, members in by_smallest.items():
        targets = sorted(placed.get(p, []), key=lambda q: _size(geometry.profile(q)))
        for d, q in zip(members, targets, strict=False):
            served[d.workload] = q
    return gpu_layouts, served
