"""The report's costs at the configured price of each GPU model, on the deployed rollup path.

NVML names an L4 ``NVIDIA L4``, a T4 ``Tesla T4`` and an L40S ``NVIDIA L40S``;
the price table (``GPU_MODELS``, docs/report.md) keys them ``L4-24GB``,
``T4-16GB`` and ``L40S-48GB``. A simulated fleet of the three goes through the
real stream worker and ``gpusteward sink rollups`` (as
:mod:`tests.e2e.test_identity_and_rollups` runs them), and each team's
allocated and idle cost in the report must be its GPU-hours on each model times
that model's configured price (before, the three were priced at
``default_hourly_usd``, $2.00: an L4 team's bill almost three times too high).
"""

from __future__ import annotations

import asyncio

import pytest

from gpusteward.broker import EmbeddedBroker
from gpusteward.reports.settings import ReportSettings
from gpusteward.sandbox.simulator.scenario import Scenario
from tests.e2e.test_identity_and_rollups import LATENESS_S, Run, _run

pytestmark = pytest.mark.e2e

SETTINGS = ReportSettings()
PRICE_KEY = {"NVIDIA L4": "L4-24GB", "Tesla T4": "T4-16GB", "NVIDIA L40S": "L40S-48GB"}
"""What NVML calls each model, and its row in the shipped price table."""
TEAMS = {"chat": "chat", "embed": "search", "render": "media"}
SCENARIO = Scenario.model_validate({
    "name": "priced-models", "seed": 11, "duration_s": 3600, "sample_interval_s": 30,
    "acceleration": 600, "users": ["ana", "ben"],
    "nodes": [{"prefix": "l4", "count": 1, "gpu_model": "NVIDIA L4", "gpus": 2, "mem_gib": 24},
              {"prefix": "t4", "count": 1, "gpu_model": "Tesla T4", "gpus": 1, "mem_gib": 16},
              {"prefix": "l40s", "count": 1, "gpu_model": "NVIDIA L40S", "gpus": 1,
               "mem_gib": 48}],
    "workloads": [
        {"group": "chat", "count": 2, "node_group": "l4", "mem_gib": [4, 8],
         "labels": {"team": "chat"}, "phases": [{"util": [30, 60]}]},
        # Busy for ten minutes, then idle: idle cost at the T4's price.
        {"group": "embed", "node_group": "t4", "mem_gib": [4, 8], "labels": {"team": "search"},
         "phases": [{"for_s": [600, 600], "util": [40, 80]}, {"util": [0, 2]}]},
        {"group": "render", "node_group": "l40s", "mem_gib": [4, 8],
         "labels": {"team": "media"}, "phases": [{"util": [50, 90]}]},
    ],
})


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("prices"), SCENARIO,
                            "e2e-report-prices"))


def _cost_by_team(run: Run) -> dict[str, dict[str, float]]:
    """Per team, allocated and idle cost from the simulated readings: each held minute the
    worker could close (one lateness after its end) at its GPU's price per minute."""
    last = max(s.ts for s in run.samples)
    minutes: dict[tuple[str, float], tuple[float, str | None, str]] = {}
    for sample in run.samples:
        minute = sample.ts - sample.ts % 60
        if minute + 60 + LATENESS_S > last:
            continue
        for device in sample.devices:
            peak, team, model = minutes.get((device.uuid, minute), (0.0, None, device.model))
            assert device.util_pct is not None
            if device.pod is not None:
                team = TEAMS[device.pod.name.split("-")[0]]
            minutes[(device.uuid, minute)] = (max(peak, device.util_pct), team, model)
    out: dict[str, dict[str, float]] = {}
    for peak, team, model in minutes.values():
        if team is None:
            continue
        per_minute = SETTINGS.gpu_models[PRICE_KEY[model]].hourly_usd / 60
        cost = out.setdefault(team, {"allocated": 0.0, "idle": 0.0})
        cost["allocated"] += per_minute
        cost["idle"] += per_minute if peak < SETTINGS.idle_threshold_pct else 0.0
    return out


def test_each_team_pays_its_gpu_models_configured_price(run: Run) -> None:
    expected = _cost_by_team(run)
    assert set(expected) == {"chat", "search", "media"}
    got = {t["team"]: {"allocated": t["allocated_cost_usd"], "idle": t["idle_cost_usd"]}
           for t in run.report["teams"]}
    assert set(got) == set(expected)
    # One minute of the dearest of the three (an L40S) is the worker's rounding at the edges.
    one_minute = SETTINGS.gpu_models["L40S-48GB"].hourly_usd / 60
    for team, cost in expected.items():
        for measure, value in cost.items():
            assert got[team][measure] == pytest.approx(value, abs=one_minute), (team, measure)
    # Not vacuous: the T4 team held its GPU idle for most of the hour.
    assert expected["search"]["idle"] > 0.5 * expected["search"]["allocated"] > 0
    assert run.report["totals"]["allocated_cost_usd"] == pytest.approx(
        sum(c["allocated"] for c in expected.values()), abs=4 * one_minute)
