"""A minute without an activity reading is no observation, in every figure of the report.

The NVML collector has no utilisation for a MIG instance without GPM (A100, A30)
and none for a GPU's first GPM sample, so such rollups carry ``util_mean`` and
``util_max`` null. The live idle rule does not count them, nor does the rollup
sink's idle metric; the report must not either: not idle, not told to give the
GPU back, not cut to a smaller MIG layout, and listed as "no activity data".
"""

from __future__ import annotations

import pytest

from gpusteward.reports import build, compute, render, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.schema import Rollup

WEEK = compute.parse_week("2026-W47")
GIB = 1 << 30
A100 = "NVIDIA A100-SXM4-80GB"


def _mig_instance(instance: int, minutes: int) -> list[Rollup]:
    """A 1g.10gb instance of GPU-a held by a busy Deployment of its own, no reading."""
    return [Rollup(ts=WEEK.start + m * 60, node="n1", uuid=f"MIG-{instance}", index=0,
                   model=A100, kind="mig", parent_uuid="GPU-a", mig_profile="1g.10gb",
                   gpu_fraction=1 / 7, samples=60, util_mean=None, util_max=None,
                   mem_used_max=8 * GIB, mem_total_bytes=10 * GIB, namespace="ml",
                   pod=f"serve-{instance}-0", owner_kind="Deployment",
                   owner_name=f"serve-{instance}", team="t")
            for m in range(minutes)]


def _whole(uuid: str, owner: str, minutes: int, util: float | None,
           every_other_missing: bool = False) -> list[Rollup]:
    return [Rollup(ts=WEEK.start + m * 60, node="n2", uuid=uuid, index=0, model=A100,
                   samples=60,
                   util_mean=None if every_other_missing and m % 2 else util,
                   util_max=None if every_other_missing and m % 2 else util,
                   mem_used_max=8 * GIB, mem_total_bytes=80 * GIB, namespace="ml",
                   pod=f"{owner}-0", owner_kind="Job", owner_name=owner, team="t")
            for m in range(minutes)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> build.Report:
    rows = [r for i in range(7) for r in _mig_instance(i, 120)]
    rows += _whole("GPU-idle", "idler", 120, 0.0)          # read, and idle: 2 idle GPU-h
    rows += _whole("GPU-half", "halfread", 120, 50.0, every_other_missing=True)
    folder = tmp_path_factory.mktemp("rollups")
    store.write(folder, store.frame(rows))
    return build.build(folder, WEEK, ReportSettings(min_points=60))


def test_a_minute_without_a_reading_is_not_idle(report: build.Report) -> None:
    totals = report.data["totals"]
    # The read idle GPU, not the seven unread busy instances (2 h x 1/7 each).
    assert totals["idle_gpu_hours"] == pytest.approx(2.0)
    assert totals["allocated_gpu_hours"] == pytest.approx(2.0 + 2.0 + 2.0)
    assert [h["pod"] for h in report.data["idle_holders"]] == ["idler-0"]


def test_a_workload_without_readings_gets_no_advice_and_is_named(report: build.Report) -> None:
    advised = {r["workload"] for r in report.data["recommendations"]}
    assert not any(w.startswith("ml/deployment/serve-") for w in advised)
    assert "ml/job/idler" in advised  # a read idle GPU is still told
    unread = {r["workload"]: r for r in report.data["no_activity_data"]}
    assert set(unread) == {f"ml/deployment/serve-{i}" for i in range(7)}
    assert all(r["minutes_with_activity"] == 0 and r["minutes"] == 120
               and r["current"] == "1 x 1g.10gb" for r in unread.values())
    markdown = render.markdown(report)
    assert "No activity data: no advice" in markdown and "ml/deployment/serve-3" in markdown
    assert "No activity data: no advice" in render.html(report)


def test_the_mig_plan_keeps_the_instances_of_unread_workloads(report: build.Report) -> None:
    mig = report.data["mig"]
    assert all(not c["instances_removed"] for c in mig["changes"] if c["node"] == "n1")
    config = mig["mig_parted"]["mig-configs"][mig["labels"]["n1"]]
    assert sum(entry.get("mig-devices", {}).get("1g.10gb", 0) for entry in config) == 7


def test_percentiles_are_over_the_minutes_with_a_reading(report: build.Report) -> None:
    (half,) = [w for w in report.data["workloads"] if w["owner_name"] == "halfread"]
    # Every reading is 50 %: the unread minutes are not minutes at 0 %.
    assert half["util_p5"] == pytest.approx(50.0) and half["util_p95"] == pytest.approx(50.0)
    advice = [r for r in report.data["recommendations"] if r["workload"] == "ml/job/halfread"]
    assert advice and all(r["kind"] != "give_back" for r in advice)
    assert all(r["points"] == 60 for r in advice)  # the 60 minutes with a reading
