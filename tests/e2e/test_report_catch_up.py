"""The report after the worker catches up: each pod's GPU-hours are the minutes it held.

A worker that was down or behind reads a backlog of samples and of allocations, and
the small allocations topic is read ahead of the samples: the allocation of a pod that
starts on a device later is known before the samples of the pod holding it now. Where
allocations name their devices (DRA claims resolved to uuids, as the simulator's do
with ``attribution: uid``), the rollups once gave every minute of a device to the
latest pod allocated on it, so the report charged the gang-half-placed scenario's
``holder`` job's 90 minutes on two GPUs to the ``finetune`` gang that only ran after it.

The ``gang-half-placed`` scenario is published as fast as it goes (the backlog) to the
real stream worker and ``gpusteward sink rollups``; the report's allocated GPU-hours
per workload must be what the simulated GPUs read: each closed minute of a device
counted for the pod its last reading of the minute names.
"""

from __future__ import annotations

import asyncio

import pytest

from gpusteward.broker import EmbeddedBroker
from gpusteward.sandbox.simulator import scenario as scenarios
from tests.e2e.test_identity_and_rollups import LATENESS_S, Run, _run

pytestmark = pytest.mark.e2e

SCENARIO = scenarios.load("gang-half-placed").model_copy(update={"acceleration": 0.0})


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return asyncio.run(_run(broker, tmp_path_factory.mktemp("catch-up"), SCENARIO,
                            "e2e-report-catch-up"))


def _held_hours(run: Run) -> dict[str, float]:
    """Per workload (its namespace: one per owner here), GPU-hours held over the minutes
    the worker could close, from the simulated readings."""
    last = max(s.ts for s in run.samples)
    holder: dict[tuple[str, float], str | None] = {}
    for sample in sorted(run.samples, key=lambda s: s.ts):
        minute = sample.ts - sample.ts % 60
        if minute + 60 + LATENESS_S > last:
            continue
        for device in sample.devices:
            holder[(device.uuid, minute)] = (device.pod.namespace if device.pod is not None
                                             else None)
    out: dict[str, float] = {}
    for namespace in holder.values():
        if namespace is not None:
            out[namespace] = out.get(namespace, 0.0) + 1 / 60
    return out


def test_each_workload_is_charged_the_minutes_it_held(run: Run) -> None:
    expected = _held_hours(run)
    got = {w["namespace"]: w["allocated_gpu_hours"] for w in run.report["workloads"]}
    assert set(got) == set(expected)
    for namespace, hours in expected.items():
        # A minute a device changed hands may go to either pod: two per GPU at most.
        assert got[namespace] == pytest.approx(hours, abs=2 * 8 / 60), namespace
    # Not vacuous: the holder job held two GPUs for 90 minutes before the gang ran.
    assert expected["ml-ana"] > 2.5
