"""The ECC double-bit rule: one finding and one cordon per episode."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpusteward.rules import ecc
from gpusteward.schema import Action, Finding

SETTINGS = ecc.EccSettings()


def observe(track: ecc.EccTrack, count: int | None, ts: float, from_sample: bool = True
            ) -> list[Finding | Action]:
    return ecc.observe(track, node="n1", uuid="GPU-1", dbe_count=count, ts=ts,
                       settings=SETTINGS, from_sample=from_sample)


def test_first_dbe_fires_with_cordon_then_repeats_are_silent() -> None:
    track = ecc.EccTrack()
    assert observe(track, 0, 10) == []
    finding, action = observe(track, 1, 20)
    assert isinstance(finding, Finding) and finding.severity == "critical"
    assert isinstance(action, Action) and action.verb == "cordon"
    assert action.target.node == "n1" and action.idempotency_key == f"{finding.id}/cordon"
    assert observe(track, 1, 30) == [] and observe(track, 2, 40) == []
    assert observe(track, 3, 45, from_sample=False) == []


def test_urgent_event_then_sample_is_one_episode() -> None:
    track = ecc.EccTrack()
    assert len(observe(track, 1, 20, from_sample=False)) == 2
    assert observe(track, 1, 20) == []


def test_reset_to_zero_resolves_and_a_new_error_is_a_new_episode() -> None:
    track = ecc.EccTrack()
    first = observe(track, 1, 20)[0]
    (closing,) = observe(track, 0, 50)
    again = observe(track, 1, 80)[0]
    assert isinstance(first, Finding) and isinstance(closing, Finding)
    assert isinstance(again, Finding)
    assert closing.state == "resolved" and closing.id == first.id
    assert again.id != first.id


def test_cordon_can_be_turned_off() -> None:
    out = ecc.observe(ecc.EccTrack(), node="n1", uuid="GPU-1", dbe_count=1, ts=1,
                      settings=ecc.EccSettings(cordon=False))
    assert [type(o) for o in out] == [Finding]


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 5)), min_size=1, max_size=60))
def test_one_episode_gives_one_finding_whatever_the_order(readings: list[tuple[int, int]]
                                                          ) -> None:
    track = ecc.EccTrack()
    out: list[Finding | Action] = []
    for ts, count in readings + readings:  # out of order and duplicated
        out += observe(track, count, float(ts))
    assert len([o for o in out if isinstance(o, Finding)]) == 1
    assert len([o for o in out if isinstance(o, Action)]) == 1


def test_unknown_rule_names_the_valid_ones() -> None:
    from gpusteward import rules

    try:
        rules.settings_model("nope")
    except rules.UnknownRuleError as error:
        assert "ecc_dbe" in str(error) and "idle_holder" in str(error)
    else:
        raise AssertionError("expected UnknownRuleError")


def test_a_clock_step_moves_the_quiet_window_of_an_episode_no_counter_can_close() -> None:
    """An Xid 48 episode on a GPU whose samples carry no DBE counter closes after the quiet
    window; after the node's clock is stepped back an hour, the window runs on the new
    clock (left on the old one, the GPU would stay out of service an hour too long)."""
    from gpusteward.rules import xid as xid_rule
    from gpusteward.schema import DeviceSample, HwEvent

    run = ecc.EccRun(SETTINGS, takes_xid=True, quiet_s=3600.0)
    track = ecc.EccTrack()
    event = HwEvent(ts=10_000.0, node="n1", kind="xid", uuid="GPU-1", xid=xid_rule.XID_DBE)
    assert ecc.observe_xid_event(track, event, "GPU-1", run)
    ecc.clock_step(track, 3600.0)
    device = DeviceSample(uuid="GPU-1", index=0, model="A100", temp_c=40.0)
    # 3,600 s after the Xid on the new clock: 10,000 - 3,600 + 3,600.
    assert ecc.observe_sample(track, "n1", device, 10_000.0 - 1.0, run) == []
    (closed,) = ecc.observe_sample(track, "n1", device, 10_000.0, run)
    assert isinstance(closed, Finding) and closed.state == "resolved"
    assert closed.starts_at == 10_000.0 - 3600.0
