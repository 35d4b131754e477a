"""The layout recommender: valid layouts, optimal on small demands, mig-parted output."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from functools import cache

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpusteward.rules.mig import geometry, layout
from gpusteward.rules.mig.layout import Demand, Pool

from . import previous_solver
from .test_geometry import brute_force_valid

GEOMETRIES = geometry.load()


def brute_force_optimum(model: str, gpus: int, demand: list[Demand]) -> tuple[float, int]:
    """(best served share, fewest GPUs reaching it) over every multiset of valid layouts."""
    geo = GEOMETRIES[model]
    names = [p.name for p in geo.base_profiles]
    names += sorted({d.profile for d in demand} - set(names))
    valid = [tuple(sorted(d.items())) for d in geo.valid_layouts(names)]
    options = [[q for q in names if layout.fits(geo.profile(q), geo.profile(d.profile))]
               for d in demand]

    @cache
    def served(inventory: tuple[tuple[str, int], ...]) -> float:
        have = dict(inventory)
        best = 0.0
        for choice in itertools.product(*[[None, *o] for o in options]):
            used = Counter(q for q in choice if q)
            if all(have.get(q, 0) >= c for q, c in used.items()):
                best = max(best, sum(d.share for d, q in zip(demand, choice, strict=True) if q))
        return best

    results: list[tuple[float, int]] = [(0.0, 0)]
    for k in range(1, gpus + 1):
        for combo in itertools.combinations_with_replacement(valid, k):
            total: Counter[str] = Counter()
            for lay in combo:
                total.update(dict(lay))
            results.append((served(tuple(sorted(total.items()))), k))
    best = max(r[0] for r in results)
    return best, min(k for value, k in results if value >= best - 1e-9)


def demand_strategy(model: str, max_workloads: int) -> st.SearchStrategy[list[Demand]]:
    names = [p.name for p in GEOMETRIES[model].base_profiles]
    return st.lists(
        st.tuples(st.sampled_from(names), st.integers(1, 10)),
        min_size=1, max_size=max_workloads,
    ).map(lambda items: [Demand(f"w{i}", p, s / 10) for i, (p, s) in enumerate(items)])


def check(model: str, gpus: int, demand: list[Demand]) -> None:
    geo = GEOMETRIES[model]
    layouts, served = layout.solve_pool(geo, gpus, demand)
    assert len(layouts) <= gpus
    for lay in layouts:
        assert brute_force_valid(geo, lay), lay
    # The assignment is feasible: no profile is handed out more often than it exists.
    have = layout.instance_count(layouts)
    for q, count in Counter(served.values()).items():
        assert count <= have.get(q, 0)
    for d in demand:
        if d.workload in served:
            assert layout.fits(geo.profile(served[d.workload]), geo.profile(d.profile))
    best, fewest = brute_force_optimum(model, gpus, demand)
    value = sum(d.share for d in demand if d.workload in served)
    assert abs(value - best) < 1e-6
    assert len(layouts) == fewest


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(demand=demand_strategy("A30-24GB", 4), gpus=st.integers(1, 3))
@example(demand=[Demand("w0", "1g.6gb", 0.2), Demand("w1", "1g.6gb", 0.3),
                 Demand("w2", "4g.24gb", 0.3)], gpus=1)  # once infeasible: solver tolerance
def test_a30_layouts_are_valid_and_optimal(demand: list[Demand], gpus: int) -> None:
    check("A30-24GB", gpus, demand)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(demand=demand_strategy("A100-80GB", 3), gpus=st.integers(1, 2))
def test_a100_layouts_are_valid_and_optimal(demand: list[Demand], gpus: int) -> None:
    check("A100-80GB", gpus, demand)


def test_more_demand_than_gpus_serves_the_longest_running_first() -> None:
    demand = [Demand("short", "7g.80gb", 0.1), Demand("long", "7g.80gb", 0.9)]
    layouts, served = layout.solve_pool(GEOMETRIES["H100-80GB"], 1, demand)
    assert layouts == [{"7g.80gb": 1}]
    assert served == {"long": "7g.80gb"}


def test_advice_uses_fewest_gpus_and_writes_a_mig_parted_config() -> None:
    pool = Pool("a100", "A100-80GB", ("node-a", "node-b"), 4)
    demand = {"a100": [Demand(f"nb{i}", "1g.10gb", 0.5) for i in range(9)]
              + [Demand("train", "3g.40gb", 1.0)]}
    advice = layout.advise(GEOMETRIES, [pool], demand)
    plan = advice.pools[0]
    assert plan.gpus_used == 2 and not plan.unserved
    config = yaml.safe_load(yaml.safe_dump(advice.mig_parted))
    assert config["version"] == "v1"
    per_node = {node: config["mig-configs"][advice.labels[node]] for node in pool.nodes}
    # The two MIG GPUs sit on node-a; node-b's GPUs stay whole.
    assert per_node["node-b"] == [{"devices": "all", "mig-enabled": False}]
    enabled = [e for e in per_node["node-a"] if e["mig-enabled"]]
    total: Counter[str] = Counter()
    for entry in enabled:
        assert isinstance(entry["devices"], list)
        for _ in entry["devices"]:
            total.update(entry["mig-devices"])
            assert GEOMETRIES["A100-80GB"].is_valid(entry["mig-devices"])
    assert total["1g.10gb"] >= 9 and total["3g.40gb"] >= 1
    assert {c.node for c in advice.changes} == {"node-a"}


def test_advice_on_inferred_placements_says_to_verify_them_first() -> None:
    # The H200's placements are inferred from the H100's (placement_verified: false in
    # mig_profiles.yaml); the H100's were captured. Same demand, same plan shape.
    for model, small, large, verified in (("H100-80GB", "1g.10gb", "3g.40gb", True),
                                          ("H200-141GB", "1g.18gb", "3g.71gb", False)):
        assert all(p.placement_verified == verified for p in GEOMETRIES[model].profiles)
        pool = Pool("p", model, ("node-a",), 2)
        demand = {"p": [Demand(f"nb{i}", small, 0.5) for i in range(4)]
                  + [Demand("train", large, 1.0)]}
        advice = layout.advise(GEOMETRIES, [pool], demand)
        (finding,) = layout.advice_findings(advice, ts=100.0, window_start=0.0)
        assert finding.labels["placement_verified"] == str(verified).lower()
        assert ("inferred" in finding.summary) is not verified
        assert finding.runbook and ("nvidia-smi mig -lgipp" in finding.runbook) is not verified


def test_todays_layout_is_kept_where_it_already_serves() -> None:
    pool = Pool("h100", "H100-80GB", ("n1",), 2)
    demand = {"h100": [Demand(f"w{i}", "1g.10gb", 1.0) for i in range(7)]}
    today = {"n1": [None, {"1g.10gb": 7}]}
    advice = layout.advise(GEOMETRIES, [pool], demand, current=today,
                           current_labels={"n1": "custom"})
    assert advice.pools[0].node_layouts["n1"] == [None, {"1g.10gb": 7}]
    assert advice.changes == []
    moved = layout.advise(GEOMETRIES, [pool], demand, current={"n1": [{"3g.40gb": 2}, None]})
    change = moved.changes[0]
    assert change.gpus_changed == [0] and change.instances_removed == {"3g.40gb": 2}
    findings = layout.advice_findings(moved, ts=100.0, window_start=0.0)
    assert len(findings) == 1 and findings[0].kind == layout.KIND


def test_smallest_fitting_profile() -> None:
    geo = GEOMETRIES["H100-80GB"]
    gib = 1 << 30
    assert layout.smallest_fitting(geo, 8 * gib, 0.1).name == "1g.10gb"  # type: ignore[union-attr]
    assert layout.smallest_fitting(geo, 15 * gib, 0.1).name == "1g.20gb"  # type: ignore[union-attr]
    assert layout.smallest_fitting(geo, 15 * gib, 0.3).name == "3g.40gb"  # type: ignore[union-attr]
    assert layout.smallest_fitting(geo, 90 * gib, 0.3) is None


def test_whole_gpu_demand_runs_with_mig_off() -> None:
    pool = Pool("h100", "H100-80GB", ("n1",), 2)
    demand = {"h100": [Demand("big", "7g.80gb", 1.0), Demand("small", "2g.20gb", 1.0)]}
    # GPU 0 runs whole today (one full-size instance is the same as MIG off); GPU 1 is
    # partitioned into 1g slices, which cannot hold a 2g workload: the one change needed.
    advice = layout.advise(GEOMETRIES, [pool], demand,
                           current={"n1": [{"7g.80gb": 1}, {"1g.10gb": 7}]})
    plan = advice.pools[0]
    assert plan.gpus_used == 2 and plan.mig_gpus == 1
    entries = advice.mig_parted["mig-configs"][advice.labels["n1"]]
    assert {"devices": [0], "mig-enabled": False} in entries
    assert [e["devices"] for e in entries if e["mig-enabled"]] == [[1]]
    assert [c.gpus_changed for c in advice.changes] == [[1]]


def _plan_value(demand: list[Demand], served: dict[str, str]) -> float:
    return sum(d.share for d in demand if d.workload in served)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(demand=demand_strategy("H100-80GB", 12), gpus=st.integers(1, 4),
       today=st.lists(st.sampled_from([None, {"1g.10gb": 7}, {"3g.40gb": 2},
                                       {"2g.20gb": 3}, {"7g.80gb": 1}]), max_size=4))
def test_same_optimum_as_the_previous_solver(demand: list[Demand], gpus: int,
                                             today: list[dict[str, int] | None]) -> None:
    geo = GEOMETRIES["H100-80GB"]
    layouts, served = layout.solve_pool(geo, gpus, demand, today[:gpus])
    before, served_before = previous_solver.solve_pool(geo, gpus, demand, today[:gpus])
    assert abs(_plan_value(demand, served) - _plan_value(demand, served_before)) < 1e-6
    assert len(layouts) == len(before)
    kept = Counter(layout._key(t) for t in today[:gpus] if t)
    assert (sum((Counter(layout._key(g) for g in layouts) & kept).values())
            == sum((Counter(layout._key(g) for g in before) & kept).values()))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), workloads=st.integers(300, 1200), gpus=st.integers(4, 200))
def test_same_optimum_as_the_previous_solver_with_many_workloads(
        seed: int, workloads: int, gpus: int) -> None:
    # Hundreds of workloads per profile: the solver starts with fewer lines than the
    # served share has points, so it has to add the ones its answers touch.
    rng = random.Random(seed)
    geo = GEOMETRIES["A100-80GB"]
    names = [p.name for p in geo.base_profiles][:2]
    demand = [Demand(f"w{i}", rng.choice(names), round(rng.random(), 3))
              for i in range(workloads)]
    layouts, served = layout.solve_pool(geo, gpus, demand)
    before, served_before = previous_solver.solve_pool(geo, gpus, demand)
    value, value_before = _plan_value(demand, served), _plan_value(demand, served_before)
    # Both hold the first solve's optimum to the same relative tolerance.
    assert abs(value - value_before) <= 2e-6 * (1 + value_before)
    assert len(layouts) == len(before)
    for lay in layouts:
        assert geo.is_valid(lay), lay


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(demand=demand_strategy("H100-80GB", 20), nodes=st.integers(1, 3),
       today=st.lists(st.sampled_from([None, {"1g.10gb": 7}, {"3g.40gb": 2},
                                       {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}]),
                      max_size=6))
def test_every_emitted_layout_is_valid(demand: list[Demand], nodes: int,
                                       today: list[dict[str, int] | None]) -> None:
    geo = GEOMETRIES["H100-80GB"]
    pool = Pool("h100", "H100-80GB", tuple(f"n{i}" for i in range(nodes)), 2)
    current = {f"n{i}": today[2 * i:2 * i + 2] for i in range(nodes)}
    advice = layout.advise(GEOMETRIES, [pool], {"h100": demand}, current=current)
    plan = advice.pools[0]
    assert plan.gpus_used <= pool.gpus
    placed = [g for per_gpu in plan.node_layouts.values() for g in per_gpu if g]
    assert len(placed) == plan.mig_gpus
    for lay in placed:
        assert brute_force_valid(geo, lay), lay
    have = layout.instance_count(plan.gpu_layouts)
    for q, count in Counter(plan.served.values()).items():
        assert count <= have.get(q, 0)
