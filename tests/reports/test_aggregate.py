"""The per-minute fold: what the stream worker turns samples into."""

from __future__ import annotations

from gpusteward.reports.aggregate import MinuteRollups, rollups
from gpusteward.schema import DeviceSample, HwEvent, NodeSample, PodAllocation, PodRef

T0 = 1_700_000_040.0  # a minute boundary


def gpu(util: float | None, mem: int | None = None, pod: str | None = None,
        dbe: int | None = None, reasons: int | None = None) -> DeviceSample:
    return DeviceSample(uuid="GPU-1", index=0, model="NVIDIA A100-SXM4-80GB", util_pct=util,
                        mem_used_bytes=mem, power_w=100.0 if util is not None else None,
                        ecc_dbe_volatile=dbe, clock_event_reasons=reasons,
                        pod=PodRef("ml", pod) if pod else None)


def mig(engine: float) -> DeviceSample:
    return DeviceSample(uuid="MIG-1", index=0, model="NVIDIA A100-SXM4-80GB", kind="mig",
                        parent_uuid="GPU-2", mig_profile="3g.40gb", engine_active_pct=engine,
                        pod=PodRef("ml", "nb-0"))


def test_min_mean_max_memory_and_attribution_per_minute() -> None:
    allocation = PodAllocation(ts=T0, node="n1", pod=PodRef("ml", "train-0"), phase="running",
                               gpus=1, owner_kind="Job", owner_name="train",
                               labels={"team": "vision"}, queue="gpu-batch")
    samples = [NodeSample(ts=T0 + s, node="n1", source="test",
                          devices=[gpu(u, m, "train-0")])
               for s, u, m in ((0, 10.0, 100), (20, 30.0, 300), (40, 50.0, 200))]
    samples.append(NodeSample(ts=T0 + 60, node="n1", source="test", devices=[gpu(90.0)]))
    out = rollups(samples, allocations=[allocation])
    assert len(out) == 2
    first = out[0]
    assert (first.ts, first.samples) == (T0, 3)
    assert (first.util_min, first.util_mean, first.util_max) == (10.0, 30.0, 50.0)
    assert (first.mem_used_max, first.mem_used_mean) == (300, 200.0)
    assert (first.team, first.owner_name, first.queue, first.pod) == (
        "vision", "train", "gpu-batch", "train-0")
    # The next minute has no pod: unallocated, no team.
    assert out[1].pod is None and out[1].team is None and out[1].util_mean == 90.0


def test_team_falls_back_to_namespace_and_owner_to_pod() -> None:
    out = rollups([NodeSample(ts=T0, node="n1", source="t", devices=[gpu(1.0, pod="x-1")])])
    assert (out[0].team, out[0].owner_name) == ("ml", "x-1")


def test_mig_device_uses_engine_activity_and_its_share_of_the_gpu() -> None:
    out = rollups([NodeSample(ts=T0, node="n1", source="t", devices=[mig(42.0)])])
    assert out[0].util_mean == 42.0
    assert out[0].gpu_fraction == 3 / 7
    assert out[0].mig_profile == "3g.40gb"


def test_minute_is_emitted_after_lateness_and_late_samples_are_counted_not_merged() -> None:
    fold = MinuteRollups(lateness_s=30)
    assert fold.sample(NodeSample(ts=T0 + 10, node="n1", source="t", devices=[gpu(5.0)])) == []
    assert fold.sample(NodeSample(ts=T0 + 80, node="n1", source="t", devices=[gpu(5.0)])) == []
    emitted = fold.sample(NodeSample(ts=T0 + 95, node="n1", source="t", devices=[gpu(7.0)]))
    assert [r.ts for r in emitted] == [T0]
    late = fold.sample(NodeSample(ts=T0 + 20, node="n1", source="t", devices=[gpu(99.0)]))
    assert late == [] and fold.late_dropped == 1
    rest = fold.flush()
    assert [(r.ts, r.samples, r.util_max) for r in rest] == [(T0 + 60, 2, 7.0)]


def test_faults_new_dbe_throttling_and_xids() -> None:
    samples = [
        NodeSample(ts=T0, node="n1", source="t", devices=[gpu(5.0, dbe=3)]),
        NodeSample(ts=T0 + 60, node="n1", source="t", devices=[gpu(5.0, dbe=3, reasons=0x40)]),
        NodeSample(ts=T0 + 120, node="n1", source="t", devices=[gpu(5.0, dbe=5, reasons=0x1)]),
    ]
    xid = HwEvent(ts=T0 + 125, node="n1", kind="xid", uuid="GPU-1", xid=79)
    out = rollups(samples, hw_events=[xid])
    # Errors present at the first reading are the baseline, not new faults.
    assert [r.ecc_dbe_new for r in out] == [0, 0, 2]
    assert [r.throttled_samples for r in out] == [0, 1, 0]
    assert [r.xid_count for r in out] == [0, 0, 1]
