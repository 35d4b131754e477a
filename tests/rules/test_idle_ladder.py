"""The idle rule's per-kind defaults, exemptions and escalation ladder."""

from __future__ import annotations

import itertools

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpusteward.rules import idle
from gpusteward.schema import Action, DeviceSample, Finding, PodRef

POD = PodRef(namespace="ml-alice", name="nb-alice", uid="u1")
START = 1_000_000.0
SETTINGS = idle.IdleSettings()
REMIND_S = SETTINGS.reclaim_after_s - SETTINGS.remind_before_s
"""From the warning to the owner's reminder, remind_before_s before the reclaim."""


def run(holder: idle.Holder, hours: float, s: idle.IdleSettings = SETTINGS,
        util: float = 0.0, start: float = START) -> list[Finding | Action]:
    track = idle.IdleTrack()
    out: list[Finding | Action] = []
    sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=util)
    for i in range(int(hours * 3600 / 60) + 1):
        out += idle.observe(track, node="n1", sample=sample, holder=holder, ts=start + i * 60,
                            settings=s)
    return out


def test_ladder_notifies_then_warns_then_asks_a_dry_run_reclaim() -> None:
    out = run(idle.Holder(POD, START, "notebook"), 14)
    findings = [o for o in out if isinstance(o, Finding)]
    acts = [o for o in out if isinstance(o, Action)]
    assert [f.severity for f in findings] == ["info", "warning", "warning"]
    assert len({f.id for f in findings}) == 1
    assert [a.verb for a in acts] == ["notify_owner"] * 3 + ["requeue"]
    assert len({a.idempotency_key for a in acts}) == 4
    first = START + SETTINGS.grace_s + SETTINGS.window_s
    # The reminder: the warning's notice again, an hour before the reclaim (the warning's
    # Kubernetes Event is long gone by then), with the reclaim's time.
    warned, reminded = acts[1], acts[2]
    assert reminded.ts == first + SETTINGS.warn_after_s + REMIND_S
    assert reminded.reason.startswith("Reminder: ")
    assert reminded.reason.removeprefix("Reminder: ").split(" Next: ")[1] == (
        warned.reason.split(" Next: ")[1])
    assert [f.ts for f in findings] == [
        first, first + SETTINGS.warn_after_s,
        first + SETTINGS.warn_after_s + SETTINGS.reclaim_after_s]
    reclaim = acts[-1]
    assert reclaim.dry_run and reclaim.target.pod == POD
    assert [f.evidence.values["ladder_step"] for f in findings if f.evidence] == [1, 2, 3]


def test_reclaim_executes_only_when_asked() -> None:
    s = idle.IdleSettings(reclaim_execute=True)
    acts = [o for o in run(idle.Holder(POD, START, "notebook"), 14, s) if isinstance(o, Action)]
    assert acts[-1].verb == "requeue" and not acts[-1].dry_run


def test_batch_climbs_faster_and_inference_is_never_reclaimed() -> None:
    batch = [o.verb for o in run(idle.Holder(POD, START, "batch"), 3) if isinstance(o, Action)]
    assert batch == ["notify_owner", "notify_owner", "requeue"]
    serving = run(idle.Holder(POD, START, "inference"), 30)
    acts = [o.verb for o in serving if isinstance(o, Action)]
    assert acts == ["notify_owner", "notify_owner"]
    first = next(o for o in serving if isinstance(o, Finding))
    assert first.ts == START + SETTINGS.grace_s + 24 * 3600


def test_a_serving_pod_idle_every_night_is_not_an_idle_holder() -> None:
    """A business-hours LLM server: bursty requests by day (most 60 s readings catch no
    kernel), none for 13 h at night, for a week. Waiting for traffic is its job: no finding
    and no notice, night after night (the old 4 h window told its owner twice a night)."""
    holder = idle.Holder(POD, START, "inference")
    day = [0.0, 0.0, 0.0, 12.0, 0.0, 40.0] * (11 * 10)  # 11 h of readings a minute apart
    night = [0.0] * (13 * 60)
    track, out = idle.IdleTrack(), []
    for i, util in enumerate((day + night) * 7):
        sample = DeviceSample(uuid="GPU-1", index=0, model="L4", util_pct=util)
        out += idle.observe(track, node="n1", sample=sample, holder=holder,
                            ts=START + i * 60, settings=SETTINGS)
    assert out == []
    # One that gets no request for a whole day is still found, and its owner told.
    assert [o.verb for o in run(holder, 25) if isinstance(o, Action)] == ["notify_owner"]


def test_unknown_kind_uses_the_rules_values() -> None:
    (first, *_) = [o for o in run(idle.Holder(POD, START, "weird"), 1) if isinstance(o, Finding)]
    assert first.ts == START + SETTINGS.grace_s + SETTINGS.window_s


def test_exemptions_by_namespace_label_and_annotation() -> None:
    s = idle.IdleSettings(exempt_namespaces=["ml-alice"])
    assert run(idle.Holder(POD, START), 3, s) == []
    labelled = idle.Holder(POD, START, labels={"gpusteward.io/idle-exempt": "true"})
    assert run(labelled, 3) == []
    s = idle.IdleSettings(exempt_annotations={"owner.example.com/keep": "*"})
    annotated = idle.Holder(POD, START, annotations={"owner.example.com/keep": "until friday"})
    assert run(annotated, 3, s) == []
    other = idle.Holder(POD, START, labels={"gpusteward.io/idle-exempt": "false"})
    assert run(other, 3) != []


def test_busy_again_after_the_warning_resolves_the_episode() -> None:
    track = idle.IdleTrack()
    holder = idle.Holder(POD, START, "notebook")
    out: list[Finding | Action] = []
    for i in range((6 * 60) + 1):
        sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=0.0)
        out += idle.observe(track, node="n1", sample=sample, holder=holder,
                            ts=START + i * 60, settings=SETTINGS)
    busy = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=80.0)
    out += idle.observe(track, node="n1", sample=busy, holder=holder, ts=START + 6 * 3600 + 60,
                        settings=SETTINGS)
    states = [(f.state, f.severity) for f in out if isinstance(f, Finding)]
    assert states == [("firing", "info"), ("firing", "warning"), ("resolved", "info")]
    assert track.stage == 0


FAST = idle.IdleSettings(warn_after_s=600, reclaim_after_s=600)
reached: set[float] = set()


# Runs of samples, each with one activity level and one way of arriving: in order, each
# twice (duplicates), with a late sample every few (out of order), or after a long gap.
SEGMENTS = st.lists(st.tuples(st.integers(1, 150), st.sampled_from([0.0, 0.0, 0.0, 3.0, 60.0]),
                              st.sampled_from(["forward", "dup", "late", "gap"])),
                    min_size=1, max_size=12)


def _moves(segments: list[tuple[int, float, str]]) -> list[tuple[int, float]]:
    moves: list[tuple[int, float]] = []
    for count, util, pattern in segments:
        for i in range(count):
            if pattern == "gap" and i == 0:
                moves.append((12, util))
            elif pattern == "late" and i % 4 == 3:
                moves += [(1, util), (-2, 60.0), (2, util)]
            else:
                moves.append((1, util))
                if pattern == "dup":
                    moves.append((0, util))
    return moves


@settings(max_examples=150, deadline=None)
@given(SEGMENTS)
@example([(100, 0.0, "late"), (60, 0.0, "dup")])
def test_every_ladder_step_rests_on_an_unbroken_idle_run(
        segments: list[tuple[int, float, str]]) -> None:
    """Each firing finding (first notice and each later step) has an evidence window of only
    idle samples with no long gap, at least as long as that step's wait; out-of-order and
    duplicate samples mixed in. Steps come in order, at most one of each per episode."""
    moves = _moves(segments)
    holder = idle.Holder(POD, START, "notebook")
    track = idle.IdleTrack()
    accepted: list[tuple[float, float]] = []
    last: float | None = None
    steps: list[float] = []
    tick = 0
    for move, util in moves:
        tick = max(0, tick + move)
        ts = START + tick * 30.0
        if last is None or ts > last:
            accepted.append((ts, util))
            last = ts
        sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=util)
        for out in idle.observe(track, node="n1", sample=sample, holder=holder, ts=ts,
                                settings=FAST):
            if not isinstance(out, Finding):
                continue
            if out.state == "resolved":
                steps = []
                continue
            assert out.evidence is not None
            step = out.evidence.values["ladder_step"]
            steps.append(step)
            reached.add(step)
            assert steps == [1.0, 2.0, 3.0][:len(steps)]
            start, end = out.evidence.window_start, out.ts
            wait = FAST.window_s if step == 1 else FAST.warn_after_s
            assert end - start >= wait
            inside = [(t, u) for t, u in accepted if start <= t <= end]
            assert all(u < FAST.threshold_pct for _, u in inside)
            times = [t for t, _ in inside]
            assert all(b - a <= FAST.max_gap_s for a, b in itertools.pairwise(times))


def test_the_ladder_property_reached_every_step() -> None:
    """The property above is only worth something if its examples climb the whole ladder."""
    test_every_ladder_step_rests_on_an_unbroken_idle_run()
    assert reached == {1.0, 2.0, 3.0}


def _kept(until: str, **settings: float) -> tuple[list[Finding], list[Action]]:
    holder = idle.Holder(POD, START, "notebook", annotations={idle.KEEP_UNTIL_ANNOTATION: until})
    out = run(holder, 40, idle.IdleSettings(**settings))
    return ([o for o in out if isinstance(o, Finding)], [o for o in out if isinstance(o, Action)])


def test_keep_until_holds_the_ladder_and_the_finding_says_so() -> None:
    first = START + SETTINGS.grace_s + SETTINGS.window_s
    hold_end = START + 20 * 3600
    findings, acts = _kept(idle.rfc3339(hold_end))
    # Raised, but no notice while the owner's hold lasts.
    assert findings[0].ts == first
    assert f"left alone until {idle.rfc3339(hold_end)} (gpusteward.io/keep-until)" in (
        findings[0].summary)
    assert findings[0].evidence and findings[0].evidence.values["kept_until"] == hold_end
    # When it ends: the warning at once, the reclaim reclaim_after_s later.
    assert [(a.verb, a.ts) for a in acts] == [
        ("notify_owner", hold_end), ("notify_owner", hold_end + REMIND_S),
        ("requeue", hold_end + SETTINGS.reclaim_after_s)]
    assert [f.severity for f in findings] == ["info", "warning", "warning"]


def test_keep_until_added_after_the_first_notice_is_reported_once() -> None:
    track = idle.IdleTrack()
    sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=0.0)
    hold_end = START + 30 * 3600
    out: list[Finding | Action] = []
    for i in range(40 * 60 + 1):
        ts = START + i * 60
        # The owner reads the first notice and annotates the pod an hour later.
        annotations = ({idle.KEEP_UNTIL_ANNOTATION: idle.rfc3339(hold_end)}
                       if ts > START + 2 * 3600 else {})
        holder = idle.Holder(POD, START, "notebook", annotations=annotations)
        out += idle.observe(track, node="n1", sample=sample, holder=holder, ts=ts,
                            settings=SETTINGS)
    findings = [o for o in out if isinstance(o, Finding)]
    acts = [o for o in out if isinstance(o, Action)]
    held = [f for f in findings if "left alone" in f.summary]
    assert len(held) == 1 and held[0].ts == START + 2 * 3600 + 60
    assert [(a.verb, a.ts) for a in acts] == [
        ("notify_owner", START + SETTINGS.grace_s + SETTINGS.window_s),
        ("notify_owner", hold_end), ("notify_owner", hold_end + REMIND_S),
        ("requeue", hold_end + SETTINGS.reclaim_after_s)]


def test_keep_until_is_capped_by_policy() -> None:
    # The cap counts from the start of the idle episode (the finding's starts_at).
    idle_since = START + SETTINGS.grace_s
    first = idle_since + SETTINGS.window_s
    findings, acts = _kept("2099-01-01T00:00:00Z", keep_until_max_s=10 * 3600)
    assert findings[0].starts_at == idle_since
    assert findings[0].evidence and findings[0].evidence.values["kept_until"] == (
        idle_since + 36000)
    assert [a.ts for a in acts] == [idle_since + 36000, idle_since + 36000 + REMIND_S,
                                    idle_since + 36000 + SETTINGS.reclaim_after_s]
    # 0 ignores the annotation: the ordinary ladder.
    _, acts = _kept("2099-01-01T00:00:00Z", keep_until_max_s=0)
    assert [a.ts for a in acts] == [first, first + SETTINGS.warn_after_s,
                                    first + SETTINGS.warn_after_s + REMIND_S,
                                    first + SETTINGS.warn_after_s + SETTINGS.reclaim_after_s]


def test_kept_until_reads_only_zoned_rfc3339_times() -> None:
    assert idle.kept_until({"gpusteward.io/keep-until": "2026-11-30T12:00:00+01:00"}, 0,
                           1e12) == 1796036400.0
    for unreadable in ("2026-11-30T12:00:00", "next friday", ""):
        assert idle.kept_until({"gpusteward.io/keep-until": unreadable}, 0, 1e12) is None
    assert idle.kept_until({}, 0, 1e12) is None


def test_reclaim_action_carries_what_the_backend_rechecks() -> None:
    s = idle.IdleSettings(reclaim_execute=True, reclaim_bare_pods=True, keep_until_max_s=3600)
    reclaim = [o for o in run(idle.Holder(POD, START, "notebook"), 14, s)
               if isinstance(o, Action)][-1]
    assert reclaim.params == {"reason": "idle-reclaim",
                              "idle_since": repr(START + s.grace_s),
                              "keep_until_max_s": "3600.0", "delete_bare_pod": "true",
                              "exempt": '{"annotations": {}, "labels": '
                                        '{"gpusteward.io/idle-exempt": "true"}, '
                                        '"namespaces": []}'}
