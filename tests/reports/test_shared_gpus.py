"""A time-sliced node in the weekly report: each holder its share, physical GPUs counted.

The rollups come from the worker's own fold (the node join) over what the
NVML collector sends for a node of two GPUs advertised four times each: the
first GPU shared by four notebooks (their own activity and memory, by
per-process attribution), the second by one training pod. The rollup sink's
store and the report then credit each notebook with a quarter of the GPU
(not the first with all of it), its own used and idle GPU-hours, and count
two GPUs, not eight replicas.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.reports import build, compute, render, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.schema import (
    DeviceHolder,
    DeviceSample,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    Rollup,
)
from gpusteward.streams.node import NodeJoin, NodeState

WEEK = compute.parse_week("2026-W47")
T0 = WEEK.start + 86400
GIB = 1 << 30
HOURS = 2
SHARED, WHOLE = "GPU-shared-0", "GPU-whole-1"
# namespace (= team) -> (SM utilisation of the whole GPU, percent; GiB)
NOTEBOOKS = {"busy": (60.0, 6), "mid": (20.0, 4), "light": (10.0, 2), "idle": (0.0, 3)}


def _pod(namespace: str) -> PodRef:
    return PodRef(namespace=namespace, name=f"nb-{namespace}", uid=f"uid-{namespace}")


def _sample(ts: float) -> NodeSample:
    holders = [DeviceHolder(pod_uid=_pod(ns).uid, processes=1, activity_pct=util,
                            mem_used_bytes=gib * GIB)
               for ns, (util, gib) in NOTEBOOKS.items()]
    return NodeSample(ts=ts, node="ts-1", source="nvml", devices=[
        DeviceSample(uuid=SHARED, index=0, model="NVIDIA L4", util_pct=90.0,
                     mem_used_bytes=15 * GIB, mem_total_bytes=24 * GIB,
                     attribution="process", holders=holders),
        DeviceSample(uuid=WHOLE, index=1, model="NVIDIA L4", util_pct=80.0,
                     mem_used_bytes=10 * GIB, mem_total_bytes=24 * GIB,
                     pod=PodRef(namespace="train", name="train-0"), attribution="device"),
    ])


def _fold() -> tuple[list[Rollup], list[NodeSummary]]:
    join, state = NodeJoin(), NodeState()
    out = join.on_allocation(state, NodeInventory(
        ts=T0 - 60, node="ts-1", gpu_product="NVIDIA L4", gpu_count=2, gpu_replicas=4,
        gpu_sharing="time-slicing", allocatable={"nvidia.com/gpu": 8}))
    for replica, ns in enumerate(NOTEBOOKS):
        out += join.on_allocation(state, PodAllocation(
            ts=T0 - 60, node="ts-1", pod=_pod(ns), phase="running", gpus=1,
            device_ids=[f"{SHARED}::{replica}"], started_at=T0 - 60,
            workload_kind="notebook", owner_kind="Notebook", owner_name=f"nb-{ns}"))
    out += join.on_allocation(state, PodAllocation(
        ts=T0 - 60, node="ts-1", pod=PodRef(namespace="train", name="train-0", uid="uid-t"),
        phase="running", gpus=1, device_ids=[WHOLE], started_at=T0 - 60,
        workload_kind="batch", owner_kind="Job", owner_name="train"))
    for i in range(HOURS * 120):
        out += join.on_sample(state, _sample(T0 + i * 30))
    return ([o for o in out if isinstance(o, Rollup)],
            [o for o in out if isinstance(o, NodeSummary)])


def test_each_holder_of_a_shared_gpu_has_a_rollup_row_with_its_share() -> None:
    rollups, _ = _fold()
    minute = min(r.ts for r in rollups)
    rows = {r.pod: r for r in rollups if r.ts == minute}
    assert set(rows) == {f"nb-{ns}" for ns in NOTEBOOKS} | {"train-0"}
    for ns, (util, gib) in NOTEBOOKS.items():
        row = rows[f"nb-{ns}"]
        assert (row.uuid, row.gpu_fraction, row.namespace) == (SHARED, 0.25, ns)
        # its own activity relative to its quarter: used GPU-hours are its own
        assert row.util_mean == pytest.approx(util * 4)
        assert row.mem_used_max == gib * GIB
    assert sum(r.gpu_fraction for r in rows.values() if r.uuid == SHARED) == 1.0
    assert rows["train-0"].gpu_fraction == 1.0 and rows["train-0"].util_mean == 80.0


def test_the_summary_counts_physical_gpus() -> None:
    _, summaries = _fold()
    last = summaries[-1]
    assert (last.gpus_total, last.gpus_free, last.gpu_replicas) == (2, 0, 4)


def test_the_report_credits_each_holder_its_share_and_counts_physical_gpus(
        tmp_path: Path) -> None:
    rollups, _ = _fold()
    store.write(tmp_path, store.frame(rollups))
    store.write(tmp_path, store.frame(rollups[:40]))  # redelivered: counted once
    report = build.build(tmp_path, WEEK, ReportSettings())
    teams = {t["team"]: t for t in report.data["teams"]}
    # The minutes the fold closed (the last one waits for its lateness).
    minutes = len({r.ts for r in rollups})
    hours = minutes / 60
    for ns, (util, _gib) in NOTEBOOKS.items():
        team = teams[ns]
        assert team["allocated_gpu_hours"] == pytest.approx(0.25 * hours), ns
        assert team["used_gpu_hours"] == pytest.approx(util / 100 * hours), ns
        assert team["idle_gpu_hours"] == pytest.approx(0.25 * hours if util < 5 else 0.0), ns
    assert teams["train"]["allocated_gpu_hours"] == pytest.approx(hours)
    # The idle notebook is told to give back the quarter of an L4 it holds: what it holds
    # (not "0.2 x", a quarter rounded), and what that quarter cost at the L4's price.
    (idle,) = [r for r in report.data["recommendations"] if r["team"] == "idle"]
    l4 = ReportSettings().gpu_models["L4-24GB"].hourly_usd
    assert (idle["kind"], idle["current"]) == ("give_back", "0.25 x L4-24GB")
    assert idle["saving_usd"] == pytest.approx(0.25 * hours * l4)
    totals = report.data["totals"]
    assert totals["allocated_gpu_hours"] == pytest.approx(2 * hours)
    assert (totals["devices"], totals["gpus"], totals["nodes"]) == (2, 2, 1)
    assert "- GPUs seen: 2 (2 devices" in render.markdown(report)


def test_holders_in_one_namespace_are_each_counted(tmp_path: Path) -> None:
    """Two pods of one namespace time-slicing a GPU: two rows per minute, both counted
    (rows are named by device, minute and pod; by namespace alone they were one)."""
    rows = [Rollup(ts=T0 + 60 * minute, node="ts-1", uuid="GPU-L4", model="NVIDIA L4",
                   samples=60, gpu_fraction=0.5, util_mean=40.0, util_max=50.0,
                   namespace="ml", pod=pod, owner_kind="Notebook", owner_name=pod, team="ml")
            for minute in range(120) for pod in ("nb-a", "nb-b")]
    store.write(tmp_path, store.frame(rows))
    report = build.build(tmp_path, WEEK, ReportSettings())
    assert report.data["totals"]["allocated_gpu_hours"] == pytest.approx(2.0)
    assert report.data["totals"]["gpus"] == 1
    per_workload = {w["owner_name"]: w for w in report.data["workloads"]}
    assert set(per_workload) == {"nb-a", "nb-b"}


def _time_sliced_a100(util_of_share: float) -> list[Rollup]:
    """One A100-80GB time-sliced four ways for 2 h: each holder (a Deployment of its own)
    at ``util_of_share`` percent of its quarter, 8 GiB."""
    return [Rollup(ts=WEEK.start + m * 60, node="ts-a", uuid="GPU-a100", index=0,
                   model="NVIDIA A100-SXM4-80GB", gpu_fraction=0.25, samples=60,
                   util_mean=util_of_share, util_max=util_of_share + 5,
                   mem_used_max=8 * GIB, mem_total_bytes=80 * GIB, namespace="ml",
                   pod=f"nb-{h}-0", owner_kind="Deployment", owner_name=f"nb-{h}", team="t")
            for h in "abcd" for m in range(120)]


@pytest.mark.parametrize("util_of_share", [20.0, 60.0])
def test_a_shared_gpus_holders_are_advised_against_their_share(
        tmp_path: Path, util_of_share: float) -> None:
    """Activity relative to a quarter of a GPU is a quarter as much GPU: a holder at 60 %
    of its quarter needs 0.15 GPU plus headroom (a 2g.20gb, more than the quarter it holds:
    no MIG advice), one at 20 % needs 0.05 (a 1g.10gb, less). Every saving is what it holds
    less what it would hold, and advice that saves nothing is not given."""
    store.write(tmp_path, store.frame(_time_sliced_a100(util_of_share)))
    report = build.build(tmp_path, WEEK, ReportSettings(min_points=60))
    advice = report.data["recommendations"]
    assert all(r["saving_usd"] > 0 for r in advice)
    mig = [r for r in advice if r["kind"] == "mig_profile"]
    hours, price = 2 * 0.25, 2.2
    if util_of_share == 20.0:
        assert {r["recommended"] for r in mig} == {"1 x 1g.10gb"} and len(mig) == 4
        for r in mig:
            assert r["current"] == "0.25 x A100-80GB"
            assert r["saving_gpu_hours"] == pytest.approx(hours - 2 / 7)
            assert r["saving_usd"] == pytest.approx((hours - 2 / 7) * price)
    else:
        # Neither a 2g.20gb (2/7 of a GPU) nor a whole L4 ($1.40 for the 2 h) costs less
        # than the quarter of an A100 it holds ($1.10): nothing to advise.
        assert advice == []
    for r in advice:
        if r["kind"] == "cheaper_model":
            # A whole GPU of the cheaper model against a quarter of an A100.
            cheaper = ReportSettings().gpu_models[r["recommended"]].hourly_usd
            assert r["saving_usd"] == pytest.approx(hours * price - 2 * cheaper)
    # Never advised more than it saves: the headline is less than what the pods cost.
    assert report.data["totals"]["recommended_saving_usd"] < \
        report.data["totals"]["allocated_cost_usd"]
