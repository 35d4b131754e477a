"""The per-minute fold the worker runs: duplicates, late readings, attribution, state encoding."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusteward.rules import rollup
from gpusteward.schema import DeviceHolder, DeviceSample, PodRef, Rollup

T0 = 1_700_000_040.0  # a minute boundary
WHO = rollup.attribution(PodRef("ml", "nb-0", uid="u0"), labels={"team": "vision"},
                         owner_kind="Notebook", owner_name="nb", queue="research",
                         workload_kind="notebook")


def gpu(util: float) -> DeviceSample:
    return DeviceSample(uuid="GPU-1", index=0, model="NVIDIA A100-SXM4-80GB", util_pct=util,
                        mem_used_bytes=int(util) << 20, power_w=100.0 + util)


def feed(fold: rollup.MinuteFold, track: rollup.RollupTrack, ts: float, util: float,
         who: rollup.Attribution | None = WHO) -> list:
    bucket = fold.bucket(track, ts)
    if bucket is None:
        fold.late(track, 1)
    else:
        fold.add(bucket, gpu(util), ts, who)
    return fold.advance(track, "n1", ts)


def test_attribution_team_owner_and_fallbacks() -> None:
    assert (WHO.team, WHO.owner_kind, WHO.owner_name, WHO.queue) == (
        "vision", "Notebook", "nb", "research")
    bare = rollup.attribution(PodRef("ml-b", "x-1"))
    assert (bare.team, bare.owner_name) == ("ml-b", "x-1")


def test_a_redelivered_reading_is_not_counted_twice() -> None:
    fold, track = rollup.MinuteFold(lateness_s=0), rollup.RollupTrack()
    for ts, util in ((T0, 10.0), (T0 + 30, 30.0), (T0 + 30, 30.0), (T0, 10.0)):
        assert feed(fold, track, ts, util) == []
    (first,) = feed(fold, track, T0 + 60, 50.0)
    assert (first.ts, first.samples, first.util_mean, first.util_min, first.util_max) == (
        T0, 2, 20.0, 10.0, 30.0)
    assert (first.team, first.owner_name, first.queue, first.pod) == (
        "vision", "nb", "research", "nb-0")
    assert first.power_mean == 120.0 and first.mem_used_max == 30 << 20


def test_a_reading_for_an_emitted_minute_is_late() -> None:
    fold, track = rollup.MinuteFold(lateness_s=30), rollup.RollupTrack()
    feed(fold, track, T0 + 10, 5.0)
    (emitted,) = feed(fold, track, T0 + 90, 5.0)
    assert emitted.ts == T0
    assert feed(fold, track, T0 + 50, 99.0) == [] and track.late == 1
    (rest,) = fold.flush(track, "n1")
    assert (rest.ts, rest.util_max) == (T0 + 60, 5.0)


def test_open_minutes_survive_the_changelog_encoding() -> None:
    fold, track = rollup.MinuteFold(lateness_s=60), rollup.RollupTrack()
    feed(fold, track, T0, 10.0)
    feed(fold, track, T0 + 30, 20.0)
    fold.count_xid(track, "GPU-1", T0 + 40)
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(track), type=rollup.RollupTrack)
    assert restored == track
    (out,) = fold.flush(restored, "n1")
    assert (out.samples, out.util_mean, out.xid_count, out.team) == (2, 15.0, 1, "vision")


def test_an_xid_read_again_is_counted_once() -> None:
    """Hardware events are checkpointed before their offsets are committed: one read again
    after a crash or a rebalance meets a state that already counted it."""
    fold, track = rollup.MinuteFold(lateness_s=60), rollup.RollupTrack()
    for ts in (T0 + 5, T0 + 5, T0 + 7, T0 + 5):
        fold.count_xid(track, "GPU-1", ts)
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(track), type=rollup.RollupTrack)
    fold.count_xid(restored, "GPU-1", T0 + 7)
    (out,) = fold.flush(restored, "n1")
    assert out.xid_count == 2


def test_a_minute_an_xid_opened_takes_the_first_samples_device_fields() -> None:
    fold, track = rollup.MinuteFold(lateness_s=60), rollup.RollupTrack()
    fold.count_xid(track, "GPU-1", T0 + 5)
    feed(fold, track, T0 + 10, 30.0)
    (out,) = fold.flush(track, "n1")
    assert (out.model, out.samples, out.xid_count, out.util_mean) == (
        gpu(0.0).model, 1, 1, 30.0)


def test_the_fold_fills_rollup_fields_in_the_schema_order() -> None:
    """The fold builds rollups positionally (for speed): a schema change must show here."""
    assert Rollup.__struct_fields__[:len(rollup.ROLLUP_FIELDS)] == rollup.ROLLUP_FIELDS
    assert Rollup.__struct_fields__[len(rollup.ROLLUP_FIELDS):] == ("schema",)


def _shared(attribution: str, ts: float, readings: bool = True) -> DeviceSample:
    """A device two pods hold, with their own readings where the source split them."""
    return DeviceSample(
        uuid="GPU-1", index=0, model="NVIDIA A100-SXM4-80GB", util_pct=50.0,
        mem_used_bytes=30 << 30, clock_event_reasons=0x20, attribution=attribution,  # type: ignore[arg-type]
        holders=[DeviceHolder(pod=PodRef("ml", "a"), activity_pct=40.0,
                              mem_used_bytes=20 << 30) if readings
                 else DeviceHolder(pod=PodRef("ml", "a")),
                 DeviceHolder(pod=PodRef("ml", "b"), activity_pct=10.0,
                              mem_used_bytes=10 << 30) if readings
                 else DeviceHolder(pod=PodRef("ml", "b"))])


def _shared_rows(attribution: str, readings: bool = True) -> dict[str | None, Rollup]:
    fold, track = rollup.MinuteFold(lateness_s=0), rollup.RollupTrack()
    for ts in (T0, T0 + 30):
        bucket = fold.bucket(track, ts)
        assert bucket is not None
        device = _shared(attribution, ts, readings)
        for share in device.holders:
            assert share.pod is not None
            fold.add_share(bucket, device, share, ts, rollup.attribution(share.pod))
    fold.count_xid(track, "GPU-1", T0 + 10)
    return {r.pod: r for r in fold.flush(track, "n1")}


def test_a_shared_device_gives_each_holder_a_row_with_its_share() -> None:
    rows = _shared_rows("process")
    assert set(rows) == {"a", "b"}
    assert [rows[p].gpu_fraction for p in "ab"] == [0.5, 0.5]
    # its own activity relative to its half: share x util is its own used GPU time
    assert [rows[p].util_mean for p in "ab"] == [80.0, 20.0]
    assert [rows[p].mem_used_max for p in "ab"] == [20 << 30, 10 << 30]
    # the device's throttling and XIDs are counted once, not once per holder
    assert sorted(r.throttled_samples for r in rows.values()) == [0, 2]
    assert sum(r.xid_count for r in rows.values()) == 1


def test_a_shared_device_that_cannot_be_split_spreads_the_device_evenly() -> None:
    rows = _shared_rows("shared", readings=False)
    assert [(rows[p].gpu_fraction, rows[p].util_mean) for p in "ab"] == [(0.5, 50.0)] * 2


def test_pods_sharing_one_dra_claim_keep_their_own_activity_in_their_rows() -> None:
    """Pods holding a GPU through one DRA claim are judged on the device as one (``shared``),
    but the NVML collector read each one's processes: its row says its own use."""
    rows = _shared_rows("shared")
    assert [(rows[p].gpu_fraction, rows[p].util_mean) for p in "ab"] == [(0.5, 80.0),
                                                                         (0.5, 20.0)]


@given(activities=st.lists(st.floats(0, 100), min_size=2, max_size=8),
       attribution=st.sampled_from(["process", "shared"]), readings=st.booleans())
def test_holder_rows_add_up_to_the_device(activities: list[float], attribution: str,
                                          readings: bool) -> None:
    """Whatever the holders do, their rows' shares make the whole GPU, and their used GPU
    time (share x util) is their own activity where it was split, else the device's."""
    device_util = min(100.0, sum(activities))
    device = DeviceSample(
        uuid="GPU-1", index=0, model="NVIDIA A100-SXM4-80GB", util_pct=device_util,
        attribution=attribution,  # type: ignore[arg-type]
        holders=[DeviceHolder(pod=PodRef("ml", f"p{i}"), activity_pct=a if readings else None)
                 for i, a in enumerate(activities)])
    fold, track = rollup.MinuteFold(lateness_s=0), rollup.RollupTrack()
    bucket = fold.bucket(track, T0)
    assert bucket is not None
    for share in device.holders:
        assert share.pod is not None
        fold.add_share(bucket, device, share, T0, rollup.attribution(share.pod))
    rows = fold.flush(track, "n1")
    assert len(rows) == len(activities)
    assert sum(r.gpu_fraction for r in rows) == pytest.approx(1.0)
    used = sum(r.gpu_fraction * (r.util_mean or 0) for r in rows)
    assert used == pytest.approx(sum(activities) if readings else device_util, abs=1e-6)
