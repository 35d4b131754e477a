"""Queue SLO rules: per-workload waits, rolling p95 per queue, projected breaches."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusteward.rules import queue as q
from gpusteward.schema import Finding, QueueEvent, WorkloadState

SETTINGS = q.QueueSloSettings()


def ev(name: str, state: WorkloadState, ts: float, *, queue: str = "prod-serving",
       created: float | None = None, admitted: float | None = None) -> QueueEvent:
    return QueueEvent(ts=ts, name=name, namespace="ml", cluster_queue=queue, state=state,
                      created_at=created, admitted_at=admitted, gpus=1)


def run(events: list[QueueEvent], until: float, step: float = 30.0,
        settings: q.QueueSloSettings = SETTINGS) -> tuple[q.QueueState, list[Finding]]:
    """Apply events in order, ticking the clock every ``step`` of event time up to ``until``."""
    state = q.QueueState()
    out: list[Finding] = []
    pending = sorted(events, key=lambda e: e.ts)
    t = 0.0
    while t <= until:
        while pending and pending[0].ts <= t:
            out += q.on_event(state, pending.pop(0), settings)
        out += q.tick(state, t, settings)
        t += step
    return state, out


def test_slo_by_pattern_with_a_default() -> None:
    assert SETTINGS.slo_for("prod-serving") == 600
    assert SETTINGS.slo_for("team-research") == 7200
    assert SETTINGS.slo_for("other") == SETTINGS.default_slo_s
    custom = q.QueueSloSettings(slo_s={"^gold$": 60}, default_slo_s=120)
    assert custom.slo_for("gold") == 60 and custom.slo_for("golden") == 120


def test_pending_past_slo_fires_once_and_resolves_on_admission() -> None:
    _, out = run([ev("a", "pending", 0, created=0), ev("a", "admitted", 1500, admitted=1500)],
                 until=1800)
    waits = [f for f in out if f.kind == q.WAIT_KIND]
    firing, closed = waits
    assert firing.state == "firing" and firing.starts_at == 0
    assert 600 < firing.ts <= 630
    assert firing.evidence and firing.evidence.values["slo_s"] == 600
    assert firing.runbook and firing.subject.pod and firing.subject.pod.name == "a"
    assert closed.state == "resolved" and closed.id == firing.id and closed.ts == 1500


def test_within_slo_no_finding() -> None:
    _, out = run([ev("a", "pending", 0, created=0), ev("a", "admitted", 590)], until=3600)
    assert [f for f in out if f.kind == q.WAIT_KIND] == []


def test_research_queue_has_a_longer_slo() -> None:
    _, out = run([ev("a", "pending", 0, created=0, queue="research")], until=7000)
    assert [f for f in out if f.kind == q.WAIT_KIND] == []
    _, out = run([ev("a", "pending", 0, created=0, queue="research")], until=7300)
    assert [f.kind for f in out if f.kind == q.WAIT_KIND] == [q.WAIT_KIND]


def test_eviction_starts_a_new_episode() -> None:
    events = [ev("a", "pending", 0, created=0), ev("a", "admitted", 700),
              ev("a", "evicted", 1000), ev("a", "admitted", 2000)]
    _, out = run(events, until=2100)
    firing = [f for f in out if f.kind == q.WAIT_KIND and f.state == "firing"]
    assert [f.starts_at for f in firing] == [0, 1000]
    assert len({f.id for f in firing}) == 2


def test_late_duplicate_pending_does_not_reopen() -> None:
    state = q.QueueState()
    assert q.on_event(state, ev("a", "pending", 0, created=0), SETTINGS) == []
    q.tick(state, 700, SETTINGS)
    (closed,) = q.on_event(state, ev("a", "admitted", 800), SETTINGS)
    assert closed.state == "resolved"
    assert q.on_event(state, ev("a", "pending", 0, created=0), SETTINGS) == []
    assert [f for f in q.tick(state, 2000, SETTINGS) if f.kind == q.WAIT_KIND] == []


def test_p95_over_target_fires_and_resolves() -> None:
    settings = q.QueueSloSettings(min_admissions=5, window_s=3600, min_depth=100)
    slow = [e for i in range(6) for e in (ev(f"s{i}", "pending", i * 10, created=i * 10),
                                          ev(f"s{i}", "admitted", 900 + i * 10))]
    state, out = run(slow, until=1000, settings=settings)
    (p95,) = [f for f in out if f.kind == q.P95_KIND]
    assert p95.state == "firing" and p95.subject.queue == "prod-serving"
    assert p95.evidence and p95.evidence.values["p95_wait_s"] == 900
    assert p95.evidence.samples == 6
    # An hour later the slow admissions have left the window: resolved.
    later = q.tick(state, 1000 + 3600, settings)
    assert [(f.kind, f.state) for f in later] == [(q.P95_KIND, "resolved")]


def test_p95_needs_enough_admissions() -> None:
    settings = q.QueueSloSettings(min_admissions=5, min_depth=100)
    slow = [e for i in range(4) for e in (ev(f"s{i}", "pending", 0, created=0),
                                          ev(f"s{i}", "admitted", 900))]
    _, out = run(slow, until=1000, settings=settings)
    assert [f for f in out if f.kind == q.P95_KIND] == []


def test_projected_breach_before_any_workload_breaches() -> None:
    # Two admissions an hour, ten waiting: a newcomer would wait 5 h against a 2 h SLO.
    events = [ev("early1", "pending", 0, created=0, queue="research"),
              ev("early1", "admitted", 600, queue="research"),
              ev("early2", "pending", 0, created=0, queue="research"),
              ev("early2", "admitted", 1800, queue="research")]
    events += [ev(f"w{i}", "pending", 3000, created=3000, queue="research") for i in range(10)]
    _, out = run(events, until=3600)
    (projected,) = [f for f in out if f.kind == q.PROJECTED_KIND]
    assert projected.ts == 3600 and projected.evidence
    assert projected.evidence.values["depth"] == 10
    assert projected.evidence.values["projected_wait_s"] == pytest.approx(5 * 3600)
    assert not [f for f in out if f.kind == q.WAIT_KIND]


def test_no_projection_for_a_queue_that_keeps_up() -> None:
    events = []
    for i in range(60):
        events += [ev(f"w{i}", "pending", i * 60, created=i * 60),
                   ev(f"w{i}", "admitted", i * 60 + 30)]
    _, out = run(events, until=3600 * 2)
    assert out == []


events_st = st.lists(
    st.tuples(st.sampled_from(["a", "b"]),
              st.sampled_from(["pending", "admitted", "evicted", "finished", "deleted"]),
              st.integers(0, 200)),
    max_size=30,
)


@given(events_st, st.randoms(use_true_random=False))
def test_shuffled_and_duplicated_events_keep_episodes_sound(
    events: list[tuple[str, WorkloadState, int]], rnd: object
) -> None:
    """Whatever the order and duplication: each id fires at most once, every resolve closes
    an open id, and a firing workload had waited past its SLO."""
    settings = q.QueueSloSettings(slo_s={"": 600})
    stream = [ev(n, s, t * 30.0, created=t * 30.0) for n, s, t in events]
    stream = stream + stream[: len(stream) // 2]
    rnd.shuffle(stream)  # type: ignore[attr-defined]
    state = q.QueueState()
    open_ids: set[str] = set()
    fired: set[str] = set()
    now = 0.0
    for event in stream:
        now = max(now, event.ts)
        for f in q.on_event(state, event, settings) + q.tick(state, now, settings):
            if f.kind != q.WAIT_KIND:
                continue
            if f.state == "firing":
                assert f.id not in fired
                assert f.ts - f.starts_at > 600
                fired.add(f.id)
                open_ids.add(f.id)
            else:
                assert f.id in open_ids
                open_ids.remove(f.id)


def test_admission_in_the_same_second_as_pending_counts() -> None:
    """Events of one time are ordered by lifecycle: pending then admitted, whatever arrives
    first, and the late pending cannot reopen the workload."""
    for order in (("pending", "admitted"), ("admitted", "pending")):
        state = q.QueueState()
        for status in order:
            q.on_event(state, ev("a", status, 30, created=29), SETTINGS)
        assert state.waiting == {}
        assert q.tick(state, 5000, SETTINGS) == []


def test_breach_judged_at_admission_when_the_clock_never_ticked_past_it() -> None:
    state = q.QueueState()
    q.on_event(state, ev("a", "pending", 0, created=0), SETTINGS)
    firing, closed = q.on_event(state, ev("a", "admitted", 900), SETTINGS)
    assert (firing.state, closed.state) == ("firing", "resolved")
    assert firing.id == closed.id and firing.ts == 900
    assert firing.evidence and firing.evidence.values["wait_s"] == 900
    state = q.QueueState()
    q.on_event(state, ev("b", "pending", 0, created=0), SETTINGS)
    assert q.on_event(state, ev("b", "admitted", 600), SETTINGS) == []
