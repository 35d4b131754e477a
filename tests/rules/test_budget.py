"""Team GPU-hour budgets: GPU-hours held, thresholds, the projected crossing, the week."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gpusteward.rules import budget as b
from gpusteward.rules.fragmentation import FleetView
from gpusteward.schema import Finding, NodeSummary

MONDAY = b.week_start(1_763_683_200.0)
"""The Monday 00:00 UTC of the simulator's default start."""


def summary(ts: float, held: dict[str, float], node: str = "n") -> NodeSummary:
    return NodeSummary(ts=ts, node=node, gpu_model="H100", gpus_total=64, gpus_free=0,
                       held_by_team=held)


EMPTY = FleetView(nodes=[], pending={}, shape_counts={})


def run(held_at: dict[float, dict[str, float]], start: float, until: float,
        settings: b.BudgetSettings, step: float = 300) -> tuple[b.BudgetState, list[Finding]]:
    """One node's summaries every ``step``, each followed by a fleet evaluation."""
    state = b.BudgetState()
    out: list[Finding] = []
    times = sorted(held_at)
    t = start
    while t <= until:
        current = held_at[max(x for x in times if x <= t)]
        out += b.on_summary(state, summary(t, current), settings)
        out += b.evaluate(state, EMPTY, t, settings)
        t += step
    return state, out


def test_week_starts_monday_utc() -> None:
    # Day 0 of the epoch was a Thursday: Mondays are days 4, 11, 18, ...
    assert MONDAY % 86400 == 0 and (MONDAY // 86400) % 7 == 4
    assert b.week_start(MONDAY + 3 * 86400) == MONDAY
    assert b.week_start(MONDAY - 1) == MONDAY - b.WEEK_S


def test_gpu_hours_integrate_what_is_held() -> None:
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 10_000})
    state, _ = run({MONDAY: {"llm": 8}}, MONDAY, MONDAY + 3600, settings)
    assert abs(state.teams["llm"].used_gpu_h - 8.0) < 1e-9


def test_a_giant_job_is_projected_to_cross_then_crosses_each_threshold_once() -> None:
    # 100 GPU-hours a week; the team idles at 0.1 GPU, then a 64-GPU job starts on Monday
    # noon.
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 100})
    noon = MONDAY + 12 * 3600
    _, out = run({MONDAY: {"llm": 0.1}, noon: {"llm": 64}}, MONDAY, MONDAY + 86400, settings)
    firing = [(f.kind, f.state, f.labels.get("team")) for f in out]
    assert firing.count((b.PROJECTED_KIND, "firing", "llm")) == 1
    projected = next(f for f in out if f.kind == b.PROJECTED_KIND)
    assert noon <= projected.ts <= noon + 600
    assert projected.evidence is not None
    crossing = projected.evidence.values["crossing_ts"]
    thresholds = [f for f in out if f.kind == b.KIND]
    assert [f.evidence.values["threshold"] for f in thresholds if f.evidence] == [0.8, 1.0]
    assert [f.severity for f in thresholds] == ["info", "warning"]
    crossed = thresholds[1].ts
    # The projection said when: within a few evaluations of the real crossing.
    assert abs(crossed - crossing) <= 600
    assert (b.PROJECTED_KIND, "resolved", "llm") in firing


def test_no_budget_no_finding_and_teams_without_budget_are_ignored() -> None:
    _, out = run({MONDAY: {"llm": 64}}, MONDAY, MONDAY + 86400, b.BudgetSettings())
    assert out == []
    _, out = run({MONDAY: {"other": 64}}, MONDAY, MONDAY + 86400,
                 b.BudgetSettings(budgets_gpu_h={"llm": 1}))
    assert out == []


def test_a_new_week_resolves_and_starts_over() -> None:
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 10})
    state, out = run({MONDAY: {"llm": 4}}, MONDAY + 6 * 86400, MONDAY + 7 * 86400 + 3600,
                     settings)
    resolved = [f for f in out if f.state == "resolved" and f.kind == b.KIND]
    assert len(resolved) == 2 and all(f.ts == MONDAY + b.WEEK_S for f in resolved)
    assert state.teams["llm"].week_start == MONDAY + b.WEEK_S
    assert state.teams["llm"].used_gpu_h <= 4 * 1.1


def test_nodes_integrate_on_their_own_however_their_summaries_interleave() -> None:
    """One node's summaries hours behind another's (a catch-up) count the same."""
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 10_000})
    state = b.BudgetState()
    for node in ("ahead", "behind"):
        for i in range(13):
            b.on_summary(state, summary(MONDAY + 300 * i, {"llm": 4}, node), settings)
    assert abs(state.teams["llm"].used_gpu_h - 2 * 4 * 1.0) < 1e-9
    # Duplicates and late summaries of a node add nothing.
    b.on_summary(state, summary(MONDAY + 600, {"llm": 4}, "ahead"), settings)
    assert abs(state.teams["llm"].used_gpu_h - 8.0) < 1e-9


def test_a_node_whose_summaries_trail_the_others_still_holds_its_gpus() -> None:
    """Partitions read unevenly (a worker catching up, a fast replay): one projection."""
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 100})
    state = b.BudgetState()
    out: list[Finding] = []

    def at(t: float, node: str, held: dict[str, float]) -> None:
        out.extend(b.on_summary(state, summary(MONDAY + t, held, node), settings))
        out.extend(b.evaluate(state, EMPTY, MONDAY + t, settings))

    for t in range(0, 1800, 300):
        at(t, "gpus", {"llm": 64})
        at(t, "other", {})
    # The other node's partition is read 20 minutes of event time ahead of this one's.
    for t in range(1800, 3000, 300):
        at(t, "other", {})
    for t in range(1800, 3000, 300):
        at(t, "gpus", {"llm": 64})
    assert [(f.kind, f.state) for f in out] == [(b.PROJECTED_KIND, "firing")]
    assert abs(state.teams["llm"].held - 64) < 1e-9


def test_nodes_summarised_behind_the_queue_still_hold_their_gpus() -> None:
    """The fleet's clock follows the queue, which a node join catching up trails by its
    backlog (two hours here): its nodes have not let their GPUs go."""
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 100})
    state = b.BudgetState()
    out: list[Finding] = []
    for t in range(0, 3600, 300):
        out += b.on_summary(state, summary(MONDAY + t, {"llm": 64}), settings)
        out += b.evaluate(state, EMPTY, MONDAY + t + 2 * 3600, settings)
    assert [(f.kind, f.state) for f in out] == [(b.PROJECTED_KIND, "firing")]
    assert abs(state.teams["llm"].held - 64) < 1e-9


def test_mig_devices_count_their_share_of_a_gpu() -> None:
    assert b.mig_gpus({"3g.40gb": 2, "1g.10gb": 1}) == 7 / 7


@given(gpus=st.floats(0, 64), budget=st.floats(1, 5000), hours=st.integers(1, 48))
def test_threshold_findings_match_use_and_fire_once(gpus: float, budget: float,
                                                    hours: int) -> None:
    settings = b.BudgetSettings(budgets_gpu_h={"t": budget})
    state, out = run({MONDAY: {"t": gpus}}, MONDAY, MONDAY + hours * 3600, settings)
    used = state.teams["t"].used_gpu_h
    fired = [f.evidence.values["threshold"] for f in out
             if f.kind == b.KIND and f.state == "firing" and f.evidence]
    assert fired == [t for t in (0.8, 1.0) if used >= t * budget]


def test_the_projection_follows_the_burn_rate_under_its_id() -> None:
    """A node whose summaries reach the agent after the others' (a worker catching up, a
    rebalance) first leaves its GPUs out of the rate; when they arrive, or when the team
    starts more work, the crossing it said moves, and the projection is re-issued under
    its id. A small change in what the team holds leaves it as it is."""
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 500})
    state = b.BudgetState()
    out: list[Finding] = []

    def at(t: float, held: dict[str, dict[str, float]]) -> None:
        for node, teams in held.items():
            out.extend(b.on_summary(state, summary(MONDAY + t, teams, node), settings))
        out.extend(b.evaluate(state, EMPTY, MONDAY + t, settings))

    three = {f"n{i}": {"llm": 8.0} for i in range(3)}
    at(0, three)
    at(60, three)
    at(120, {**three, "n3": {"llm": 8.0}})
    at(180, {**three, "n3": {"llm": 8.0}})
    at(240, {**three, "n3": {"llm": 9.0}})  # one GPU more: the crossing moves by 3 %
    firing = [f for f in out if f.kind == b.PROJECTED_KIND]
    assert [f.state for f in firing] == ["firing", "firing"]
    first, second = firing
    assert first.id == second.id and second.starts_at == first.starts_at == MONDAY
    assert first.evidence is not None and second.evidence is not None
    assert first.evidence.values["burn_gpus"] == 24 and second.evidence.values["burn_gpus"] == 32
    # 500 GPU-hours at 32 GPUs from Monday 00:00: 15.6 h; at 24 it would have been 20.8 h.
    assert abs(second.evidence.values["crossing_ts"] - (MONDAY + 500 / 32 * 3600)) <= 120
    assert state.teams["llm"].projected_crossing == second.evidence.values["crossing_ts"]


def test_a_node_s_clock_stepped_back_counts_its_gpu_hours_on_the_new_clock() -> None:
    """8 GPUs held for an hour, then the node's clock steps back 30 minutes and they are
    held another hour: the node's summaries on the new clock (``clock_steps`` 1) count at
    once, not only once they pass the old clock's last one; the time across the step is
    unknown and counts nothing."""
    settings = b.BudgetSettings(budgets_gpu_h={"llm": 10_000})
    state = b.BudgetState()
    old = [summary(MONDAY + i * 300, {"llm": 8}) for i in range(13)]
    new = [msgspec.structs.replace(summary(MONDAY + 1800 + i * 300, {"llm": 8}),
                                   clock_steps=1) for i in range(13)]
    for s in [*old, *new]:
        b.on_summary(state, s, settings)
        b.evaluate(state, EMPTY, s.ts, settings)
    counted = state.teams["llm"].used_gpu_h + sum(state.slots.get("llm", {}).values())
    assert abs(counted - 2 * 8.0) < 1e-9
    # A redelivered summary of the old clock counts nothing more.
    b.on_summary(state, old[-1], settings)
    assert state.nodes["n"].ts == new[-1].ts
