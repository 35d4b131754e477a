"""The idle-holder rule on hand-made sample sequences."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusteward.rules import idle
from gpusteward.schema import Action, DeviceSample, Finding, PodRef

POD = PodRef(namespace="ml-alice", name="nb-alice", uid="u1")
SETTINGS = idle.IdleSettings()
START = 1_000_000.0
HOLDER = idle.Holder(POD, START)


def sample(util: float | None, kind: str = "gpu", engine: float | None = None) -> DeviceSample:
    return DeviceSample(uuid="GPU-1", index=0, model="A100", kind=kind,  # type: ignore[arg-type]
                        util_pct=util, engine_active_pct=engine)


def feed(track: idle.IdleTrack, readings: list[tuple[float, float | None]],
         holder: idle.Holder | None = HOLDER) -> list[Finding | Action]:
    out: list[Finding | Action] = []
    for ts, util in readings:
        out += idle.observe(track, node="n1", sample=sample(util), holder=holder, ts=ts,
                            settings=SETTINGS)
    return out


def every(step: float, start: float, end: float, util: float) -> list[tuple[float, float | None]]:
    n = int((end - start) // step)
    return [(start + i * step, util) for i in range(n + 1)]


def test_fires_once_after_grace_plus_window_with_notify_action() -> None:
    track = idle.IdleTrack()
    out = feed(track, every(30, START, START + 3 * 3600, 1.0))
    findings = [o for o in out if isinstance(o, Finding)]
    actions = [o for o in out if isinstance(o, Action)]
    assert len(findings) == 1 and len(actions) == 1
    (finding,) = findings
    assert finding.state == "firing"
    assert finding.starts_at == START + SETTINGS.grace_s
    assert finding.ts == START + SETTINGS.grace_s + SETTINGS.window_s
    assert finding.subject.pod == POD
    assert actions[0].verb == "notify_owner"
    assert actions[0].idempotency_key == f"{finding.id}/notify_owner"


def test_busy_again_resolves_the_same_episode() -> None:
    track = idle.IdleTrack()
    out = feed(track, [*every(30, START, START + 3000, 0.5), (START + 3030, 60.0)])
    firing = [o for o in out if isinstance(o, Finding) and o.state == "firing"]
    resolved = [o for o in out if isinstance(o, Finding) and o.state == "resolved"]
    assert len(firing) == 1 and len(resolved) == 1
    assert resolved[0].id == firing[0].id and resolved[0].ends_at == START + 3030


def test_busy_under_another_pod_resolves_as_released_not_as_used_again() -> None:
    """The demo's reclaimed notebooks: stopped, their GPU given to a waiting job, whose busy
    samples came before the notebook's end was read. The notebook did not use it again."""
    track = idle.IdleTrack()
    feed(track, every(30, START, START + 3000, 0.5))
    job = idle.Holder(PodRef(namespace="ml-rupert", name="sweep-rupert", uid="u2"), START + 3010)
    (closing,) = feed(track, [(START + 3030, 90.0)], holder=job)
    assert isinstance(closing, Finding) and closing.state == "resolved"
    assert closing.subject.pod == POD
    assert closing.summary == "ml-alice/nb-alice: the pod released the GPU"
    (again,) = [o for o in feed(idle.IdleTrack(), [*every(30, START, START + 3000, 0.5),
                                                   (START + 3030, 90.0)])
                if isinstance(o, Finding) and o.state == "resolved"]
    assert again.summary == "ml-alice/nb-alice: the pod is using the GPU again"


def test_release_resolves() -> None:
    track = idle.IdleTrack()
    feed(track, every(30, START, START + 3000, 0.5))
    (closing,) = idle.release(track, node="n1", uuid="GPU-1", ts=START + 3100)
    assert isinstance(closing, Finding) and closing.state == "resolved"
    assert idle.release(track, node="n1", uuid="GPU-1", ts=START + 3200) == []


def test_short_dip_does_not_fire() -> None:
    readings = (every(30, START, START + 1200, 90.0)
                + every(30, START + 1230, START + 1230 + 1500, 0.0)
                + every(30, START + 2760, START + 5000, 90.0))
    assert feed(idle.IdleTrack(), readings) == []


def test_no_holder_no_finding() -> None:
    assert feed(idle.IdleTrack(), every(30, START, START + 7200, 0.0), holder=None) == []


def test_gap_longer_than_max_gap_restarts_the_window() -> None:
    readings = every(30, START + 600, START + 1500, 0.0) + every(
        30, START + 1500 + SETTINGS.max_gap_s + 60, START + 3000, 0.0)
    assert feed(idle.IdleTrack(), readings) == []


def test_a_sample_without_a_reading_does_not_bridge_a_gap() -> None:
    readings = [*every(30, START + 600, START + 1500, 0.0), (START + 1700, None),
                *every(30, START + 1760, START + 3000, 0.0)]
    # 1500 -> 1760 is 260 s without a reading, under max_gap_s: the run goes on ...
    assert [o.state for o in feed(idle.IdleTrack(), readings) if isinstance(o, Finding)] == [
        "firing"]
    readings = [*every(30, START + 600, START + 1500, 0.0), (START + 1700, None),
                *every(30, START + 1860, START + 3000, 0.0)]
    # ... while 1500 -> 1860 is 360 s: the run restarts at 1860, and the empty sample at
    # 1700 must not hide that.
    assert feed(idle.IdleTrack(), readings) == []


def test_mig_device_uses_engine_activity_not_gpu_util() -> None:
    track = idle.IdleTrack()
    out: list[Finding | Action] = []
    for ts, _ in every(30, START, START + 3000, 0.0):
        # GPU_UTIL is not reported on MIG; engine activity says it is busy.
        out += idle.observe(track, node="n1", sample=sample(None, "mig", engine=40.0),
                            holder=idle.Holder(POD, START), ts=ts, settings=SETTINGS)
    assert out == []
    assert idle.activity_pct(sample(None, "mig", engine=1.0)) == 1.0


def test_duplicate_and_late_samples_are_ignored() -> None:
    track = idle.IdleTrack()
    readings = every(30, START, START + 2500, 0.0)
    noisy = [r for pair in zip(readings, readings, strict=True) for r in pair]
    noisy.insert(40, (START + 100, 95.0))  # a late busy sample must not reset the window
    out = feed(track, noisy)
    assert [o.state for o in out if isinstance(o, Finding)] == ["firing"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.floats(0, 100, allow_nan=False)),
                min_size=1, max_size=300))
def test_never_fires_unless_idle_for_the_whole_window(raw: list[tuple[int, float]]) -> None:
    """Property: a firing finding's window holds only idle samples, no long gaps, and is
    at least window_s long; with out-of-order and duplicate samples mixed in."""
    readings = [(START + tick * 30.0, util) for tick, util in raw]
    track = idle.IdleTrack()
    accepted: list[tuple[float, float]] = []
    last = None
    for ts, util in readings:
        if last is None or ts > last:
            accepted.append((ts, util))
            last = ts
        for out in idle.observe(track, node="n1", sample=sample(util), holder=HOLDER, ts=ts,
                                settings=SETTINGS):
            if isinstance(out, Finding) and out.state == "firing":
                start, end = out.starts_at, out.ts
                assert end - start >= SETTINGS.window_s
                assert start >= START + SETTINGS.grace_s
                inside = [(t, u) for t, u in accepted if start <= t <= end]
                assert all(u < SETTINGS.threshold_pct for _, u in inside)
                times = [t for t, _ in inside]
                assert all(b - a <= SETTINGS.max_gap_s for a, b in itertools.pairwise(times))
