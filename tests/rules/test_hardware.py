"""The hardware-fault rules on hand-made sample sequences: counters, remap, GPU lost, thermal."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpusteward.rules import hardware
from gpusteward.schema import Action, DeviceSample, Finding, HwEvent

T0 = 1_000_000.0
SETTINGS = hardware.HardwareSettings()
H100 = "NVIDIA H100 80GB HBM3"


def dev(**fields: Any) -> DeviceSample:
    base: dict[str, Any] = {"uuid": "GPU-1", "index": 0, "model": H100, "temp_c": 50.0,
                            "clock_event_reasons": 0, "ecc_sbe_volatile": 0, "pcie_replay": 0,
                            "nvlink_errors": 0, "remap_pending": False, "remap_failure": False,
                            "util_pct": 50.0}
    base.update(fields)
    return DeviceSample(**base)


def feed(track: hardware.HwTrack, readings: list[tuple[float, DeviceSample]],
         s: hardware.HardwareSettings = SETTINGS) -> list[Finding | Action]:
    out: list[Finding | Action] = []
    for ts, sample in readings:
        out += hardware.observe_sample(track, node="n1", device=sample, ts=ts, settings=s)
    return out


def firing(out: list[Finding | Action], kind: str | None = None) -> list[Finding]:
    return [o for o in out if isinstance(o, Finding) and o.state == "firing"
            and (kind is None or o.kind == kind)]


def resolved(out: list[Finding | Action]) -> list[Finding]:
    return [o for o in out if isinstance(o, Finding) and o.state == "resolved"]


def test_healthy_gpu_gives_nothing() -> None:
    assert feed(hardware.HwTrack(), [(T0 + i * 30, dev()) for i in range(200)]) == []


def test_sbe_burst_opens_one_episode_and_quiet_closes_it() -> None:
    track = hardware.HwTrack()
    # 40 SBE per 30 s sample: the threshold (100 per hour) is crossed at the 3rd increase.
    readings = [(T0 + i * 30, dev(ecc_sbe_volatile=40 * i)) for i in range(20)]
    out = feed(track, readings)
    (finding,) = firing(out)
    assert finding.kind == "ecc_sbe_rate" and finding.severity == "warning"
    # The first increase happened after the reading at T0: the burst spans T0 .. T0 + 90.
    assert finding.ts == T0 + 90 and finding.starts_at == T0
    assert "120 in 90 s" in finding.summary
    assert finding.evidence is not None and finding.evidence.values["increase"] == 120
    assert finding.runbook
    assert not [o for o in out if isinstance(o, Action)]
    # No increase for clear_s (1 h) after the last one, at T0 + 570, closes the episode, once.
    quiet = [(T0 + 600 + i * 60, dev(ecc_sbe_volatile=760)) for i in range(70)]
    out = feed(track, quiet)
    (closing,) = resolved(out)
    assert closing.id == finding.id and closing.ends_at == T0 + 600 + 60 * 60


def test_a_burst_seen_in_one_reading_spans_the_time_since_the_reading_before() -> None:
    """500 PCIe replays between two readings 15 s apart: 500 in 15 s, not in 0 s."""
    for kind, field in (("pcie_replay", "pcie_replay"), ("nvlink_errors", "nvlink_errors"),
                        ("ecc_sbe_rate", "ecc_sbe_volatile")):
        out = feed(hardware.HwTrack(), [(T0, dev(**{field: 0})), (T0 + 15, dev(**{field: 500}))])
        (finding,) = firing(out)
        assert finding.kind == kind
        assert ": 500 in 15 s (threshold" in finding.summary
        assert finding.starts_at == T0 and finding.evidence is not None
        assert finding.evidence.window_start == T0


def test_slow_sbe_trickle_never_fires() -> None:
    # 99 per hour forever: always just under the threshold.
    readings = [(T0 + i * 3600 / 99, dev(ecc_sbe_volatile=i)) for i in range(1000)]
    assert feed(hardware.HwTrack(), readings) == []


def test_counter_reset_is_a_new_baseline_not_a_burst() -> None:
    readings = [(T0, dev(ecc_sbe_volatile=5000)), (T0 + 30, dev(ecc_sbe_volatile=0)),
                (T0 + 60, dev(ecc_sbe_volatile=10))]
    assert feed(hardware.HwTrack(), readings) == []


def test_pcie_and_nvlink_bursts() -> None:
    track = hardware.HwTrack()
    out = feed(track, [(T0 + i * 10, dev(pcie_replay=30 * i, nvlink_errors=3 * i))
                       for i in range(10)])
    assert {f.kind for f in firing(out)} == {"pcie_replay", "nvlink_errors"}
    assert len(firing(out)) == 2


@pytest.mark.parametrize(("kind", "field", "per_sample", "every_s"), [
    ("pcie_replay", "pcie_replay", 60, 600), ("nvlink_errors", "nvlink_errors", 10, 600),
    ("nvlink_crc_errors", "nvlink_crc_errors", 18_000, 600)])
def test_a_counter_bursting_again_and_again_is_one_episode(
        kind: str, field: str, per_sample: int, every_s: int) -> None:
    """Bursts of two readings every 10 min for two hours under the shipped policy: one
    episode, closed once, clear_s after the last burst. Before, the quiet time was window_s
    (5 min): an episode per burst."""
    track, counter, readings = hardware.HwTrack(), 0, []
    for tick in range(int((2 * 3600 + every_s) // 60)):
        if tick % (every_s // 60) in (1, 2):
            counter += per_sample
        readings.append((T0 + 60 * tick, dev(**{field: counter})))
    out = feed(track, readings)
    assert [f.kind for f in firing(out)] == [kind] and resolved(out) == []
    last_increase = max(ts for (_, before), (ts, d) in itertools.pairwise(readings)
                        if getattr(d, field) > getattr(before, field))
    clear_s = {"pcie_replay": SETTINGS.pcie, "nvlink_errors": SETTINGS.nvlink,
               "nvlink_crc_errors": SETTINGS.nvlink_crc}[kind].clear_s
    quiet = [(readings[-1][0] + 60 * i, dev(**{field: counter}))
             for i in range(1, int(clear_s // 60) + 2 * every_s // 60)]
    (closing,) = resolved(feed(track, quiet))
    assert closing.id == firing(out)[0].id
    assert closing.ends_at == last_increase + clear_s
    assert f"burst for {clear_s:g} s" in closing.summary


def test_a_shorter_clear_s_closes_between_bursts() -> None:
    """clear_s is the policy's to set: at window_s (the old quiet time) each burst of a link
    bursting every 10 minutes is its own episode again."""
    s = hardware.HardwareSettings(pcie=hardware.PcieReplaySettings(clear_s=300))
    readings = [(T0 + 60 * tick, dev(pcie_replay=60 * sum(1 for t in range(tick + 1)
                                                        if t % 10 in (1, 2))))
                for tick in range(60)]
    out = feed(hardware.HwTrack(), readings, s)
    assert len(firing(out)) == len(resolved(out)) == 6


def test_nvlink_crc_errors_are_judged_on_their_own_rate() -> None:
    """CRC errors are routine on a healthy link: a jump of 412 between two readings and a
    trickle of 2 a minute raise nothing; 200 a second (DCGM fails a link at 100) opens one
    nvlink_crc_errors episode, which quiet closes. Replays stay nvlink_errors'."""
    healthy = [(T0, dev(nvlink_crc_errors=0)), (T0 + 15, dev(nvlink_crc_errors=412))]
    healthy += [(T0 + 15 + 30 * i, dev(nvlink_crc_errors=412 + i)) for i in range(1, 241)]
    track = hardware.HwTrack()
    assert feed(track, healthy) == []
    start = T0 + 15 + 30 * 241
    storm = [(start + 15 * i, dev(nvlink_crc_errors=652 + 3000 * i)) for i in range(12)]
    (finding,) = firing(feed(track, storm))
    assert finding.kind == "nvlink_crc_errors" and finding.ts == start + 150
    # The trickle's last few count too: they are in the window.
    assert "30003 in 270 s (threshold 30000 per 300 s)" in finding.summary
    quiet = [(start + 180 + 60 * i, dev(nvlink_crc_errors=652 + 3000 * 11)) for i in range(31)]
    (closing,) = resolved(feed(track, quiet))
    assert closing.id == finding.id and closing.kind == "nvlink_crc_errors"


def test_an_nvlink_crc_reading_after_samples_without_it_spans_the_whole_gap() -> None:
    """An exporter that leaves the CRC counter out for an hour: the 100,000 counted meanwhile
    are 28 a second, not 6,667 in the 15 s since the sample before."""
    readings = [(T0, dev(nvlink_crc_errors=0))]
    readings += [(T0 + 15 * i, dev()) for i in range(1, 240)]
    readings += [(T0 + 3600, dev(nvlink_crc_errors=100_000))]
    assert feed(hardware.HwTrack(), readings) == []


def test_an_older_collectors_nvlink_sum_is_judged_as_before() -> None:
    """A collector from before the split sends CRC + replay + recovery in nvlink_errors and
    no nvlink_crc_errors: 412 in 15 s fires nvlink_errors, as it always did."""
    out = feed(hardware.HwTrack(), [(T0, dev(nvlink_errors=0)), (T0 + 15, dev(nvlink_errors=412))])
    assert [f.kind for f in firing(out)] == ["nvlink_errors"]


def test_remap_failure_cordons_once_and_clears_on_reset() -> None:
    track = hardware.HwTrack()
    out = feed(track, [(T0 + i * 30, dev(remap_failure=True)) for i in range(10)])
    (finding,) = firing(out)
    assert finding.kind == "remap_failure" and finding.severity == "critical"
    (action,) = [o for o in out if isinstance(o, Action)]
    assert action.verb == "cordon" and action.target.node == "n1"
    (closing,) = resolved(feed(track, [(T0 + 400, dev(remap_failure=False))]))
    assert closing.id == finding.id


def test_remap_failure_event_then_samples_give_one_episode() -> None:
    track = hardware.HwTrack()
    out = hardware.observe_remap_failure_event(track, node="n1", uuid="GPU-1", ts=T0,
                                               settings=SETTINGS)
    out += feed(track, [(T0 + i * 30, dev(remap_failure=True)) for i in range(5)])
    assert len(firing(out)) == 1


def test_remap_pending_taints_for_a_gpu_reset() -> None:
    out = feed(hardware.HwTrack(), [(T0 + i * 30, dev(remap_pending=True)) for i in range(5)])
    (finding,) = firing(out)
    assert finding.kind == "remap_pending"
    (action,) = [o for o in out if isinstance(o, Action)]
    assert action.verb == "taint"
    assert action.params == {"key": "gpusteward.io/gpu-reset-required", "effect": "NoSchedule"}


def test_gpu_lost_drains_once_and_resolves_when_the_gpu_answers() -> None:
    track = hardware.HwTrack()
    feed(track, [(T0, dev())])
    out = hardware.observe_lost(track, node="n1", uuid="GPU-1", ts=T0 + 10, detail="Xid 79",
                                settings=SETTINGS)
    out += hardware.observe_lost(track, node="n1", uuid="GPU-1", ts=T0 + 20, detail="again",
                                 settings=SETTINGS)
    (finding,) = firing(out)
    assert finding.kind == "gpu_lost" and finding.severity == "critical"
    assert [a.verb for a in out if isinstance(a, Action)] == ["drain"]
    (closing,) = resolved(feed(track, [(T0 + 900, dev())]))
    assert closing.id == finding.id


def test_a_sample_older_than_the_event_resolves_nothing() -> None:
    """Catching up, a worker may read the urgent hw-event before older samples of the
    node: those samples predate the fault and cannot close it."""
    track = hardware.HwTrack()
    feed(track, [(T0, dev())])
    out = hardware.observe_lost(track, node="n1", uuid="GPU-1", ts=T0 + 20, detail="Xid 79",
                                settings=SETTINGS)
    out += hardware.observe_remap_failure_event(track, node="n1", uuid="GPU-1", ts=T0 + 20,
                                                settings=SETTINGS)
    assert {f.kind for f in firing(out)} == {"gpu_lost", "remap_failure"}
    assert resolved(feed(track, [(T0 + 10, dev(remap_failure=False))])) == []
    assert {f.kind for f in resolved(feed(track, [(T0 + 30, dev(remap_failure=False))]))} \
        == {"gpu_lost", "remap_failure"}


def test_stale_gpu_lost_event_is_ignored() -> None:
    track = hardware.HwTrack()
    feed(track, [(T0 + 60, dev())])
    assert hardware.observe_lost(track, node="n1", uuid="GPU-1", ts=T0, detail="",
                                 settings=SETTINGS) == []


def test_thermal_fires_after_five_minutes_above_the_models_slowdown_temperature() -> None:
    threshold = SETTINGS.thermal.threshold_for(H100)
    assert threshold == 89.0
    track = hardware.HwTrack()
    out = feed(track, [(T0 + i * 30, dev(temp_c=threshold + 1)) for i in range(12)])
    (finding,) = firing(out)
    assert finding.kind == "thermal_slowdown"
    assert finding.starts_at == T0 and finding.ts == T0 + 300
    assert finding.evidence is not None and finding.evidence.samples == 11


def test_thermal_reason_bits_count_but_power_brake_does_not() -> None:
    hw_thermal = [(T0 + i * 30, dev(clock_event_reasons=0x40)) for i in range(12)]
    assert len(firing(feed(hardware.HwTrack(), hw_thermal))) == 1
    power = [(T0 + i * 30, dev(clock_event_reasons=0x80 | 0x04)) for i in range(30)]
    assert feed(hardware.HwTrack(), power) == []


def test_a_busy_gpu_held_at_its_max_operating_temperature_is_no_slowdown() -> None:
    """SW thermal slowdown (0x20) is the driver trimming the clocks so that the GPU stays at
    its max operating temperature: an H100 SXM under full load sits at 87 °C with the bit set
    for as long as the load lasts, below its slowdown temperature (89 °C). An hour of it is no
    finding; the HW bit, or the slowdown temperature, on top of it still is."""
    at_target = [(T0 + i * 30, dev(temp_c=87.0, clock_event_reasons=0x20)) for i in range(120)]
    assert feed(hardware.HwTrack(), at_target) == []
    clamped = [(T0 + i * 30, dev(temp_c=87.0, clock_event_reasons=0x20 | 0x40))
               for i in range(12)]
    assert len(firing(feed(hardware.HwTrack(), clamped))) == 1
    past = [(T0 + i * 30, dev(temp_c=89.0, clock_event_reasons=0x20)) for i in range(12)]
    assert len(firing(feed(hardware.HwTrack(), past))) == 1


def test_short_thermal_spike_does_not_fire() -> None:
    spike = [(T0 + i * 30, dev(temp_c=95.0 if 3 <= i < 12 else 60.0)) for i in range(40)]
    assert feed(hardware.HwTrack(), spike) == []


def test_hovering_at_the_limit_is_one_episode() -> None:
    track = hardware.HwTrack()
    readings = [(T0 + i * 30, dev(temp_c=95.0)) for i in range(20)]
    # Dips shorter than clear_s do not end the episode.
    readings += [(T0 + 600 + i * 30, dev(temp_c=95.0 if i % 3 else 80.0)) for i in range(40)]
    readings += [(T0 + 1800 + i * 30, dev(temp_c=60.0)) for i in range(25)]  # > clear_s
    out = feed(track, readings)
    assert len(firing(out)) == 1 and len(resolved(out)) == 1


def test_per_model_threshold_longest_match_wins() -> None:
    thermal = hardware.ThermalSettings(slowdown_c={"A10": 91.0, "A100": 85.0})
    assert thermal.threshold_for("NVIDIA A100-SXM4-80GB") == 85.0
    assert thermal.threshold_for("NVIDIA A10") == 91.0
    assert thermal.threshold_for("Tesla V100") == thermal.default_slowdown_c


def test_a_model_configured_below_the_default_runs_hot_at_its_own_threshold() -> None:
    # The sample path skips the lookup by model below the coolest configured threshold:
    # a model set lower than the default must still count its own.
    thermal = hardware.ThermalSettings(slowdown_c={"H100": 75.0}, window_s=60)
    assert thermal.coolest_c == 75.0
    settings = hardware.HardwareSettings(thermal=thermal)
    out = feed(hardware.HwTrack(), [(T0 + i * 30, dev(temp_c=80.0)) for i in range(4)],
               settings)
    assert [f.kind for f in firing(out)] == [hardware.THERMAL_KIND]
    assert feed(hardware.HwTrack(), [(T0 + i * 30, dev(temp_c=74.0)) for i in range(4)],
                settings) == []


# --- properties ---------------------------------------------------------------------------

# Runs of samples, hot or not, arriving in order, twice each, with a late one every few,
# or after a gap longer than max_gap_s.
SEGMENTS = st.lists(st.tuples(st.integers(1, 40), st.booleans(),
                              st.sampled_from(["forward", "dup", "late", "gap"])),
                    min_size=1, max_size=10)
reached: set[str] = set()


def _ticks(segments: list[tuple[int, bool, str]]) -> list[tuple[int, bool]]:
    tick, out = 0, []
    for count, hot, pattern in segments:
        for i in range(count):
            tick += 6 if pattern == "gap" and i == 0 else 1
            out.append((tick, hot))
            if pattern == "dup":
                out.append((tick, hot))
            elif pattern == "late" and i % 3 == 2:
                out.append((tick - 2, not hot))
    return out


@settings(max_examples=150, deadline=None)
@given(SEGMENTS)
@example([(15, True, "dup"), (3, True, "late"), (10, False, "forward")])
def test_thermal_never_fires_unless_hot_for_the_whole_window(
        segments: list[tuple[int, bool, str]]) -> None:
    """Every firing window holds only hot accepted samples, no long gap, and spans window_s;
    every resolution follows clear_s without a hot sample; with duplicates and out-of-order
    samples mixed in."""
    s = SETTINGS.thermal
    track = hardware.HwTrack()
    accepted: list[tuple[float, bool]] = []
    last: float | None = None
    for tick, hot in _ticks(segments):
        ts = T0 + tick * 30.0
        if last is None or ts > last:
            accepted.append((ts, hot))
            last = ts
        for out in feed(track, [(ts, dev(temp_c=95.0 if hot else 60.0))]):
            assert isinstance(out, Finding)
            reached.add(out.state)
            if out.state == "firing":
                start, end = out.starts_at, out.ts
                assert end - start >= s.window_s
                inside = [(t, h) for t, h in accepted if start <= t <= end]
                assert all(h for _, h in inside)
                times = [t for t, _ in inside]
                assert all(b - a <= s.max_gap_s for a, b in itertools.pairwise(times))
            else:
                cool = [t for t, h in accepted if ts - s.clear_s <= t <= ts]
                assert all(not h for t, h in accepted if t in cool)


def test_the_thermal_property_saw_episodes_open_and_close() -> None:
    test_thermal_never_fires_unless_hot_for_the_whole_window()
    assert reached == {"firing", "resolved"}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 60)), min_size=1, max_size=150),
       st.lists(st.integers(-3, 3), max_size=150))
# A burst, a late and a duplicate sample inside it, then a quiet hour: open and close.
@example([(i, 50) for i in range(5)] + [(30, 0), (61, 0), (70, 0)], [0, 0, 1, -1, 0, 0, 0, 0])
def test_counter_fires_only_when_the_window_holds_the_threshold(
        raw: list[tuple[int, int]], jitter: list[int]) -> None:
    """A burst finding at ts means the accepted increments in (ts - window, ts] reach the
    threshold; at most one episode is open at a time, and it resolves only after clear_s
    without a burst. Delivery is jittered: late and duplicate samples (carrying the counter value of
    their own time) are mixed in."""
    s = SETTINGS.sbe
    # The GPU's true cumulative counter by tick, from the increments at each tick.
    by_tick: dict[int, int] = {}
    for tick, inc in raw:
        by_tick[tick] = by_tick.get(tick, 0) + inc
    counter, value_at = 0, {}
    for tick in sorted(by_tick):
        counter += by_tick[tick]
        value_at[tick] = counter
    ticks_ = sorted(value_at)
    delivered = [ticks_[max(0, min(len(ticks_) - 1, i + (jitter[i] if i < len(jitter) else 0)))]
                 for i in range(len(ticks_))]
    track = hardware.HwTrack()
    last: int | None = None
    increments: list[tuple[float, int]] = []
    bursting: list[float] = []
    """When the window, as the rule reads it (an increase spans the time since the reading
    before), held the threshold."""
    spans: list[tuple[float, int]] = []
    open_id: str | None = None
    for tick in delivered:
        ts = T0 + tick * 60.0
        if last is None or tick > last:
            if last is not None and value_at[tick] > value_at[last]:
                increments.append((ts, value_at[tick] - value_at[last]))
                spans.append((T0 + last * 60.0, value_at[tick] - value_at[last]))
                if sum(i for t, i in spans if t > ts - s.window_s) >= s.threshold:
                    bursting.append(ts)
            last = tick
        out = feed(track, [(ts, dev(ecc_sbe_volatile=value_at[tick]))])
        for finding in (o for o in out if isinstance(o, Finding)):
            reached.add("counter-" + finding.state)
            if finding.state == "firing":
                assert open_id is None
                open_id = finding.id
                assert sum(i for t, i in increments if ts - s.window_s < t <= ts) >= s.threshold
            else:
                # Quiet clear_s: no burst (a window at the threshold) since; a trickle below
                # the threshold does not hold an episode open.
                assert finding.id == open_id
                assert all(t <= ts - s.clear_s for t in bursting)
                open_id = None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=60), st.randoms())
def test_duplicated_and_shuffled_samples_of_one_burst_give_one_finding(
        ticks_: list[int], rnd: Any) -> None:
    """One SBE burst delivered with duplicates and local reordering: exactly one finding."""
    readings = [(T0 + i * 30.0, dev(ecc_sbe_volatile=50 * i)) for i in range(10)]
    noisy = readings + [readings[t % len(readings)] for t in ticks_]
    rnd.shuffle(noisy)
    noisy.sort(key=lambda r: r[0])  # arrival mostly in order, duplicates interleaved
    assert len(firing(feed(hardware.HwTrack(), noisy))) == 1


def test_the_counter_property_saw_bursts_open_and_close() -> None:
    test_counter_fires_only_when_the_window_holds_the_threshold()
    assert {"counter-firing", "counter-resolved"} <= reached


def test_driver_recovery_action_asks_for_its_node_action_and_clears() -> None:
    track = hardware.HwTrack()
    out = feed(track, [(T0, dev(recovery_action=0)), (T0 + 30, dev(recovery_action=1)),
                       (T0 + 60, dev(recovery_action=1))])
    (reset,) = firing(out)
    assert reset.kind == "gpu_recovery_action" and reset.severity == "critical"
    assert [(a.verb, a.params["key"]) for a in out if isinstance(a, Action)] == [
        ("taint", "gpusteward.io/gpu-reset-required")]
    out = feed(track, [(T0 + 90, dev(recovery_action=2))])
    assert [f.state for f in out if isinstance(f, Finding)] == ["resolved", "firing"]
    assert [a.verb for a in out if isinstance(a, Action)] == ["drain"]
    (closing,) = resolved(feed(track, [(T0 + 120, dev(recovery_action=0))]))
    assert closing.state == "resolved" and track.recovery is None


def test_a_counter_jump_across_a_long_gap_is_not_a_burst() -> None:
    readings = [(T0, dev(ecc_sbe_volatile=0)), (T0 + 7200, dev(ecc_sbe_volatile=500)),
                (T0 + 7230, dev(ecc_sbe_volatile=510))]
    assert feed(hardware.HwTrack(), readings) == []


def test_samples_without_the_counter_do_not_hide_a_gap() -> None:
    """An exporter that stops giving one counter for two hours while the GPU still reports:
    the increase found when it returns is spread over those two hours, no burst."""
    readings = [(T0, dev(pcie_replay=1000))]
    readings += [(T0 + i * 15, dev(pcie_replay=None)) for i in range(1, 480)]
    readings += [(T0 + 7200, dev(pcie_replay=1150)), (T0 + 7215, dev(pcie_replay=1150))]
    assert feed(hardware.HwTrack(), readings) == []
    # A missing reading or two inside a real burst still counts its increase.
    burst = [(T0 + i * 15, dev(pcie_replay=None if i in (3, 4) else 40 * i)) for i in range(8)]
    assert len(firing(feed(hardware.HwTrack(), burst), "pcie_replay")) == 1


def test_samples_without_a_temperature_do_not_hide_a_gap() -> None:
    """Hot, then ten minutes of samples without temperature or clock reasons (an exporter
    that dropped the field), then hot again: two readings, not ten minutes of evidence."""
    readings = [(T0, dev(temp_c=95.0))]
    readings += [(T0 + i * 15, dev(temp_c=None, clock_event_reasons=None))
                 for i in range(1, 40)]
    readings += [(T0 + 600, dev(temp_c=95.0)), (T0 + 615, dev(temp_c=95.0))]
    assert feed(hardware.HwTrack(), readings) == []
    # A reading missing now and then inside a hot run is no gap.
    hot = [(T0 + i * 30, dev(temp_c=95.0) if i % 4 != 1 else
            dev(temp_c=None, clock_event_reasons=None)) for i in range(12)]
    assert len(firing(feed(hardware.HwTrack(), hot), "thermal_slowdown")) == 1


def test_retired_pages_threshold_is_a_validated_policy_setting() -> None:
    from gpusteward.rules import policy

    custom = policy.parse_policy("rules:\n  retired_pages: {threshold: 10}\n").resolve()
    settings = hardware.HardwareSettings.from_rules(custom.rules)
    out = feed(hardware.HwTrack(), [(T0, dev(retired_pages_sbe=9, retired_pages_dbe=0)),
                                    (T0 + 30, dev(retired_pages_sbe=9, retired_pages_dbe=1))],
               settings)
    (finding,) = firing(out)
    assert finding.kind == "retired_pages" and not [o for o in out if isinstance(o, Action)]
    assert finding.evidence is not None and finding.evidence.values["threshold"] == 10.0
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy("rules:\n  retired_pages:\n    threshold: 0\n", "p.yaml")
    assert caught.value.lines()[0].startswith("p.yaml:3: rules.retired_pages.threshold")


def test_a_trickle_below_the_threshold_does_not_hold_an_episode_open() -> None:
    """NVLink CRC errors trickle on a healthy link: after a storm, a few a minute must not keep
    its episode open for ever (any increase used to restart the quiet time)."""
    s = SETTINGS.nvlink_crc
    track, counter, readings = hardware.HwTrack(), 0, []
    for tick in range(3):  # a storm: 30,000 in two minutes, the threshold
        readings.append((T0 + 60 * tick, dev(nvlink_crc_errors=counter)))
        counter += 15_000
    storm_end = T0 + 60 * 3
    readings.append((storm_end, dev(nvlink_crc_errors=counter)))
    for tick in range(1, int(2 * s.clear_s // 60)):  # then 5 a minute, for twice clear_s
        counter += 5
        readings.append((storm_end + 60 * tick, dev(nvlink_crc_errors=counter)))
    out = feed(track, readings)
    (opened,) = firing(out)
    (closing,) = resolved(out)
    assert closing.id == opened.id and closing.ends_at is not None
    assert closing.ends_at <= storm_end + s.window_s + s.clear_s


# A step of one GPU's life: a sample, most often a calm one (every counter as before, cool,
# no flag) after 30 s, an hour or a day; else one with a counter up a little, up a lot or
# unread, a flag, heat, a recovery action or retired pages; an XID, a loss or a clock step.
_CALM: dict[str, Any] = {"kind": "sample", "sbe": "same", "pcie": "same", "nvlink": "same",
                         "crc": "same", "flag": None, "temp": 50.0, "reasons": 0,
                         "recovery": None, "retired": None}
_CALM_PRE_AMPERE = {**_CALM, "retired": 3}  # a V100's NVML reads its retired pages
_RETIRING = {**_CALM, "retired": 60}  # ... up to the threshold
_COUNTER = st.sampled_from(["same", "same", "same", "+1", "+500", "none"])
_CALM_STEP = st.builds(lambda calm, dt: {**calm, "dt": dt},
                       st.sampled_from([_CALM, _CALM, _CALM_PRE_AMPERE, _RETIRING]),
                       st.sampled_from([30, 30, 3600, 90_000]))
_STEP = st.one_of(
    _CALM_STEP, _CALM_STEP, _CALM_STEP,
    st.fixed_dictionaries({
        "kind": st.just("sample"), "dt": st.sampled_from([30, 30, 30, 0, -60, 400]),
        "sbe": _COUNTER, "pcie": _COUNTER, "nvlink": _COUNTER,
        "crc": st.sampled_from(["absent", "same", "same", "+200"]),
        "flag": st.sampled_from([None, None, "remap_pending", "remap_failure",
                                 "retired_pages_pending"]),
        "temp": st.sampled_from([50.0, 50.0, 95.0, None]),
        "reasons": st.sampled_from([0, 0, 0x40, 0x20]),
        "recovery": st.sampled_from([None, None, 0, 1]),
        "retired": st.sampled_from([None, None, 3, 3, 60]),
    }),
    st.fixed_dictionaries({"kind": st.just("xid"), "dt": st.sampled_from([1, 10]),
                           "xid": st.sampled_from([13, 48, 62, 74, 79, 94, 119])}),
    st.fixed_dictionaries({"kind": st.just("lost"), "dt": st.just(1)}),
    st.fixed_dictionaries({"kind": st.just("clock_step"), "dt": st.just(0)}),
)


def _live(track: hardware.HwTrack, steps: list[dict[str, Any]], *,
          calm: bool) -> list[list[Finding | Action]]:
    """What each step of ``steps`` gave on ``track``; without ``calm`` every sample takes the
    whole path (the track's :attr:`~hardware.HwTrack.calm` forgotten before it)."""
    counts = {"sbe": 0, "pcie": 0, "nvlink": 0, "crc": 0}
    ts, out = T0, list[list[Finding | Action]]()
    for step in steps:
        ts += step["dt"]
        if step["kind"] == "clock_step":
            hardware.clock_step(track, 600.0)
            ts -= 600.0
            out.append([])
            continue
        if step["kind"] != "sample":
            event = HwEvent(ts=ts, node="n1", kind="xid" if step["kind"] == "xid" else "gpu_lost",
                            uuid="GPU-1", xid=step.get("xid"))
            hook = hardware.RUNNER.events[event.kind]
            out.append(hook(track, event, "GPU-1", SETTINGS, None))
            continue
        reading: dict[str, Any] = {}
        for name in counts:
            change = step[name]
            counts[name] += {"+1": 1, "+500": 500, "+200": 200}.get(change, 0)
            reading[name] = None if change in ("none", "absent") else counts[name]
        fields: dict[str, Any] = {
            "ecc_sbe_volatile": reading["sbe"], "pcie_replay": reading["pcie"],
            "nvlink_errors": reading["nvlink"], "nvlink_crc_errors": reading["crc"],
            "temp_c": step["temp"], "clock_event_reasons": step["reasons"],
            "recovery_action": step["recovery"], "retired_pages_sbe": step["retired"]}
        if step["flag"] is not None:
            fields[step["flag"]] = True
        if not calm:
            track.calm = None
        out.append(hardware.observe_sample(track, "n1", dev(**fields), ts, SETTINGS))
    return out


def _calm_after(*steps: dict[str, Any], dt: float = 30) -> list[dict[str, Any]]:
    """A calm sample, ``steps``, then a calm sample ``dt`` later."""
    return [{**_CALM, "dt": 30}, *steps, {**_CALM, "dt": dt}]


@settings(max_examples=600, deadline=None)
@given(st.lists(_STEP, min_size=1, max_size=40))
# Each way the short path could miss a change, once for certain: an XID episode to expire,
# a loss to resolve, counters a clock step forgot, retired pages at the threshold and back.
@example(_calm_after({"kind": "xid", "xid": 62, "dt": 1}, dt=90_000))
@example(_calm_after({"kind": "lost", "dt": 1}))
@example(_calm_after({"kind": "clock_step", "dt": 0}))
@example(_calm_after({**_RETIRING, "dt": 30}))
@example(_calm_after({**_RETIRING, "dt": 30}, {**_CALM_PRE_AMPERE, "dt": 30}))
def test_the_calm_path_is_the_whole_path_in_short(steps: list[dict[str, Any]]) -> None:
    """A calm GPU's sample (:attr:`hardware.HwTrack.calm`) skips the rules' state, so it must
    give what the whole path gives, and leave the same state behind, whatever came before:
    bursts, unread counters, flags, heat, XIDs, losses, clock steps."""
    short, whole = hardware.HwTrack(), hardware.HwTrack()
    assert _live(short, steps, calm=True) == _live(whole, steps, calm=False)
    short.calm = whole.calm = None
    assert short == whole
