"""Partially placed gangs: held GPUs, the window, one finding per episode, the requeue."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import example, given
from hypothesis import strategies as st

from gpusteward.rules import gang as g
from gpusteward.schema import (
    Action,
    Finding,
    IdleHold,
    NodeSummary,
    PodRef,
    QueueEvent,
    WorkloadState,
)

SETTINGS = g.GangSettings()


def member(i: int, state: WorkloadState, ts: float, *, size: int | None = 8,
           gang: str = "JobSet/pretrain", gpus: int = 8) -> QueueEvent:
    return QueueEvent(ts=ts, name=f"pretrain-w-{i}", namespace="ml", cluster_queue="train",
                      state=state, created_at=0, admitted_at=ts if state == "admitted" else None,
                      gpus=gpus, kind="pod", gang=gang, gang_size=size)


def run(events: list[QueueEvent], until: float, settings: g.GangSettings = SETTINGS,
        step: float = 30.0) -> tuple[g.GangState, list[Finding | Action]]:
    state = g.GangState()
    out: list[Finding | Action] = []
    pending = sorted(events, key=lambda e: e.ts)
    t = 0.0
    while t <= until:
        while pending and pending[0].ts <= t:
            out += g.on_queue(state, pending.pop(0), settings)
        out += g.evaluate(state, None, t, settings)
        t += step
    return state, out


def six_of_eight(at: float = 60) -> list[QueueEvent]:
    events = [member(i, "pending", 0) for i in range(8)]
    return events + [member(i, "admitted", at) for i in range(6)]


def test_six_of_eight_placed_fires_after_the_window_with_the_hostage_gpus() -> None:
    _, out = run(six_of_eight(), until=3600)
    (finding,) = [o for o in out if isinstance(o, Finding)]
    assert finding.kind == g.KIND and finding.state == "firing"
    assert finding.starts_at == 60 and 60 + SETTINGS.window_s <= finding.ts < 60 + \
        SETTINGS.window_s + 30
    assert finding.evidence is not None
    values = finding.evidence.values
    assert values["gpus_held"] == 48 and values["members_placed"] == 6
    assert values["members_pending"] == 2 and values["gang_size"] == 8
    # 48 GPUs held for (finding time - 60 s) so far.
    assert abs(values["gpu_hours_held"] - 48 * (finding.ts - 60) / 3600) < 1e-9
    (action,) = [o for o in out if isinstance(o, Action)]
    assert action.verb == "requeue" and action.dry_run
    assert action.params["reason"] == g.REQUEUE_REASON
    # No Kueue workload known: a placed member's pod is the target.
    assert action.target.pod is not None and action.target.pod.name == "pretrain-w-0"


def test_fully_placed_gang_never_fires() -> None:
    events = [member(i, "pending", 0) for i in range(8)]
    events += [member(i, "admitted", 60 + 10 * i) for i in range(8)]
    _, out = run(events, until=7200)
    assert out == []


def test_members_placed_by_size_stated_later_and_missing_members_count() -> None:
    # Only six pods exist (the controller is slow or the quota is short): still partial.
    events = [member(i, "admitted", 0, size=None) for i in range(6)]
    events.append(QueueEvent(ts=30, name="wl-pretrain", namespace="ml", cluster_queue="train",
                             state="admitted", kind="workload", gang="JobSet/pretrain",
                             gang_size=8))
    _, out = run(events, until=1800)
    (finding, action) = out
    assert isinstance(finding, Finding) and isinstance(action, Action)
    # With a Kueue workload the whole workload is requeued.
    assert action.params["workload"] == "wl-pretrain" and action.params["namespace"] == "ml"


def test_resolves_once_the_rest_is_placed() -> None:
    events = [*six_of_eight(), member(6, "admitted", 2000), member(7, "admitted", 2010)]
    _, out = run(events, until=3000)
    states = [(o.kind, o.state) for o in out if isinstance(o, Finding)]
    assert states == [(g.KIND, "firing"), (g.KIND, "resolved")]


def test_a_gang_finishing_member_by_member_is_ending_not_stuck() -> None:
    events = [member(i, "admitted", 0) for i in range(8)]
    events += [member(i, "finished", 600 + 60 * i) for i in range(8)]
    _, out = run(events, until=3600)
    assert out == []


def test_requeue_is_policy_and_execution_opt_in() -> None:
    _, out = run(six_of_eight(), until=3600, settings=g.GangSettings(requeue=False))
    assert [type(o) for o in out] == [Finding]
    _, out = run(six_of_eight(), until=3600, settings=g.GangSettings(requeue_execute=True))
    (action,) = [o for o in out if isinstance(o, Action)]
    assert not action.dry_run


def test_duplicates_and_late_events_change_nothing() -> None:
    events = six_of_eight()
    # A late duplicate of an earlier pending event after admission; a replayed admission.
    events += [member(0, "pending", 30), member(0, "admitted", 60)]
    _, out = run(events, until=3600)
    assert len([o for o in out if isinstance(o, Finding)]) == 1


def test_non_gang_events_are_ignored() -> None:
    event = QueueEvent(ts=0, name="solo", namespace="ml", cluster_queue="q", state="admitted",
                       gpus=1)
    state = g.GangState()
    assert g.on_queue(state, event, SETTINGS) == [] and state.gangs == {}


@given(placed=st.integers(0, 8), size=st.integers(1, 8),
       placed_at=st.floats(0, 3600), until=st.floats(0, 7200))
@example(placed=1, size=2, placed_at=2.2858481520528548e-102, until=900.0)
def test_fires_only_when_partial_for_the_window_and_once(placed: int, size: int,
                                                         placed_at: float,
                                                         until: float) -> None:
    placed = min(placed, size)
    events = [member(i, "pending", 0, size=size) for i in range(size)]
    events += [member(i, "admitted", placed_at, size=size) for i in range(placed)]
    _, out = run(events, until=until, step=60)
    firing = [o for o in out if isinstance(o, Finding) and o.state == "firing"]
    # Placement lands on the first tick at or after placed_at; the episode runs from
    # placed_at (event time), so it is due on the first tick a window after that, in the
    # rule's own arithmetic (900 - 2e-102 is 900.0: due on the tick of 900, not 960).
    due_at = -(-placed_at // 60) * 60
    while due_at - placed_at < SETTINGS.window_s:
        due_at += 60
    partial = 0 < placed < size
    due = partial and until >= due_at
    assert len(firing) == (1 if due else 0)
    if firing:
        assert firing[0].starts_at == placed_at


def test_judged_on_the_next_event_when_no_evaluation_fell_in_the_window() -> None:
    """The queue read ahead of the summaries: the gang's episode is judged when its next
    event arrives, dated when it became due."""
    state = g.GangState()
    out: list[Finding | Action] = []
    for event in [*six_of_eight(), member(6, "admitted", 2400), member(7, "admitted", 2400)]:
        out += g.on_queue(state, event, SETTINGS)
    firing, _, closing = out
    assert isinstance(firing, Finding) and firing.ts == 60 + SETTINGS.window_s
    assert isinstance(closing, Finding) and closing.state == "resolved"
    assert g.evaluate(state, None, 3000, SETTINGS) == []


def test_an_idle_gang_kueue_admits_is_suspended_through_its_workload() -> None:
    """The watcher's Workload event names the gang's Workload: the notice says to restore
    that, and the suspension names it (``gang_workload``, not ``workload``: a requeue)."""
    state = g.GangState()
    events = [member(i, "admitted", 0, size=2) for i in range(2)] + [QueueEvent(
        ts=0, name="jobset-pretrain-4f5g6", namespace="ml", cluster_queue="train",
        state="admitted", kind="workload", gang="JobSet/pretrain", gang_size=2)]
    for event in events:
        g.on_queue(state, event, SETTINGS)
    holds = [IdleHold(device=f"GPU-{i}", pod=PodRef(namespace="ml", name=f"pretrain-w-{i}"),
                      idle_since=600.0, gpus=8, gang="JobSet/pretrain") for i in range(2)]

    def fleet(ts: float) -> SimpleNamespace:
        return SimpleNamespace(nodes=[NodeSummary(ts=ts, node=f"n{i}", gpu_model=None,
                                                  gpus_total=8, gpus_free=0,
                                                  idle_gangs=[holds[i]]) for i in range(2)])

    out = list(g.evaluate(state, fleet(900), 900, SETTINGS))
    (told,) = [o for o in out if isinstance(o, Action)]
    assert "gpusteward act --restore Workload/ml/jobset-pretrain-4f5g6" in told.reason
    later = 900 + SETTINGS.idle_reclaim_after_s
    # Not while its members' summaries are of the notice's time (the node join behind):
    # they may have woken since.
    assert not [o for o in g.evaluate(state, fleet(900), later, SETTINGS)
                if isinstance(o, Action)]
    out = list(g.evaluate(state, fleet(later), later, SETTINGS))
    (suspend,) = [o for o in out if isinstance(o, Action)]
    assert suspend.params["gang_workload"] == "jobset-pretrain-4f5g6"
    assert "workload" not in suspend.params


def test_a_size_learnt_on_an_event_already_applied_ends_the_partial_run() -> None:
    """An elastic job (minimum 2) seen as 4 placed of 6 members before the watcher read its
    object: the size comes on the members' events sent again, which may be no newer than
    the ones applied (the object's event time behind the pods'). Before, the size was kept
    but the gang stayed partial from then on, and a finding "4 of 2 members" and a requeue
    of a job training as it should came after the window (seen under load in
    tests/e2e/test_waiting_deployed.py)."""
    events = [member(i, "pending", 0, size=None, gang="PyTorchJob/elastic") for i in range(6)]
    events += [member(i, "admitted", 60, size=None, gang="PyTorchJob/elastic")
               for i in range(4)]
    events += [member(i, "admitted", 60, size=2, gang="PyTorchJob/elastic") for i in range(4)]
    _, out = run(events, until=3600)
    assert out == []
