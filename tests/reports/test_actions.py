"""One action per workload, grouped by team: what a team lead acts on."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.reports import build, compute, recommend, store, weekly
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules.mig import geometry as mig_geometry
from gpusteward.schema import Rollup

WEEK = compute.parse_week("2026-W47")
GIB = 1 << 30
H100_USD = 3.5


def _rows(owner: str, team: str, devices: int, minutes: int, util: float,
          mem_gib: float) -> list[Rollup]:
    return [Rollup(ts=WEEK.start + m * 60, node=f"n-{owner}", uuid=f"GPU-{owner}-{d}", index=d,
                   model="NVIDIA H100 80GB HBM3", samples=4, util_mean=util, util_max=util,
                   mem_used_max=int(mem_gib * GIB), mem_total_bytes=80 * GIB,
                   namespace="ml", pod=f"{owner}-{d}", owner_kind="Job", owner_name=owner,
                   team=team)
            for m in range(minutes) for d in range(devices)]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("actions")
    rows = (_rows("asleep", "vision", 1, 120, 0.0, 2.0)     # idle: give it back
            + _rows("small", "vision", 1, 120, 10.0, 6.0)   # fits a MIG slice, or an L4
            + _rows("wide", "nlp", 4, 120, 10.0, 6.0)       # fewer GPUs, MIG, cheaper model
            + _rows("tiny1", "nlp", 1, 90, 10.0, 6.0)
            + _rows("tiny2", "nlp", 1, 80, 10.0, 6.0))
    store.write(directory, store.frame(rows))
    return directory


SETTINGS = ReportSettings(min_points=60, actions_per_team=1)


@pytest.fixture(scope="module")
def report(directory: Path) -> build.Report:
    return build.build(directory, WEEK, SETTINGS)


def test_one_action_per_workload_with_the_others_folded_under_it(report: build.Report) -> None:
    advised = {r["workload"] for r in report.data["recommendations"]}
    actions = [a for team in report.data["actions"] for a in team["actions"]]
    # Every workload with advice appears in exactly one team's list or its tail count.
    listed = [a["workload"] for a in actions]
    assert len(listed) == len(set(listed))
    assert len(listed) + sum(t["tail_workloads"] for t in report.data["actions"]) \
        == len(advised)
    for action in actions:
        others = [r for r in report.data["recommendations"]
                  if r["workload"] == action["workload"] and r["kind"] != action["kind"]]
        assert action["saving_usd"] >= max((r["saving_usd"] for r in others), default=0.0)
        assert sorted(a["kind"] for a in action["alternatives"]) == \
            sorted(r["kind"] for r in others)


def test_an_idle_workload_is_told_to_give_the_gpu_back(report: build.Report) -> None:
    (vision,) = [t for t in report.data["actions"] if t["team"] == "vision"]
    (top,) = vision["actions"]
    assert top["workload"] == "ml/job/asleep" and top["kind"] == "give_back"
    # The whole allocation (2 GPU-hours at the H100 price) is the saving.
    assert top["saving_usd"] == pytest.approx(2 * H100_USD)
    # Only that: a MIG slice or a cheaper GPU would be held idle too.
    assert top["alternatives"] == []


def test_teams_sorted_by_saving_and_the_tail_in_one_line(report: build.Report) -> None:
    teams = report.data["actions"]
    assert [t["saving_usd"] for t in teams] == sorted((t["saving_usd"] for t in teams),
                                                      reverse=True)
    (nlp,) = [t for t in teams if t["team"] == "nlp"]
    assert [a["workload"] for a in nlp["actions"]] == ["ml/job/wide"]
    assert nlp["tail_workloads"] == 2
    assert nlp["tail_summary"].startswith(
        f"2 more workloads: ${nlp['tail_saving_usd']:,.0f}/week (2 ")
    assert nlp["saving_usd"] == pytest.approx(
        nlp["actions"][0]["saving_usd"] + nlp["tail_saving_usd"])
    assert report.data["totals"]["recommended_saving_usd"] == pytest.approx(
        sum(t["saving_usd"] for t in teams))


def test_an_idle_workload_asks_for_no_mig_slice_in_the_layout(directory: Path) -> None:
    # Told to give its GPU back, it must not also make the layout cut GPUs up for it; the
    # busy workloads that fit a profile still ask for theirs.
    geometries = mig_geometry.load()
    tables = weekly.fold_week(directory, WEEK.start, WEEK.end, SETTINGS, geometries)
    _, demand, _ = recommend.mig_demand(tables.gpus, tables.devices, tables.need,
                                        WEEK.minutes, SETTINGS, geometries)
    asking = {d.workload.split("#")[0] for pool in demand.values() for d in pool}
    assert asking == {"ml/job/small", "ml/job/wide", "ml/job/tiny1", "ml/job/tiny2"}
