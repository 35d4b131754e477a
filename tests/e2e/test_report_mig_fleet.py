"""The report of a MIG-partitioned fleet, on the deployed system: its GPUs are not free.

The NVML collector reads a MIG-enabled GPU beside its instances: a row of kind
``gpu`` that no pod holds (pods hold the instances). The fragmentation chart counted
each as a free whole GPU: on ``mig-inference`` (five A100s, every one partitioned)
it drew five free GPUs every hour, none of which a whole-GPU request could have.

The demo's deployed processes (worker, collectors on the simulated world, watcher on
the API double) with the overlay's rollup sink run ``mig-inference`` with one more
node of two whole A100s that nothing asks for (its workloads all ask for MIG
slices), as fast as it goes (nothing here waits on an action reaching the cluster); then
the report CronJob's own command. The free whole GPUs per hour must be those two.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from gpusteward.reports import compute
from gpusteward.sandbox import demo, deployment
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.sandbox.simulator.scenario import NodeGroup
from gpusteward.settings import Settings

pytestmark = pytest.mark.e2e

WHOLE_GPUS = 2


def _cluster() -> SimulatedCluster:
    scenario = scenarios.load("mig-inference")
    assert all(group.mig_layout for group in scenario.nodes)
    assert not any(w.mig == {} for w in scenario.workloads)  # nothing takes a whole GPU
    whole = NodeGroup(prefix="a100-whole", count=1, gpu_model="NVIDIA A100-SXM4-80GB",
                      gpus=WHOLE_GPUS)
    last_week = compute.week_of(time.time() - 7 * 86400)
    return SimulatedCluster(scenario.model_copy(update={
        "nodes": [*scenario.nodes, whole], "acceleration": 0.0,
        "start_ts": last_week.start + 2 * 86400}))


@pytest.mark.timeout(300)
def test_a_partitioned_gpu_is_not_a_free_gpu(settings: Settings, tmp_path: Path) -> None:
    cluster = _cluster()
    env = {"GPUSTEWARD_REPORT__FLUSH_INTERVAL_S": "1"}
    asyncio.run(demo._run(settings, cluster, Console(record=True, width=120), False, tmp_path,
                          [*demo.DEPLOYED, "rollup-sink"], env))
    manifests = deployment.Manifests.from_overlay(demo.overlay_path())
    (job,) = deployment.start(manifests, ["report"], demo.local_for(settings, tmp_path, env))
    assert job.wait(180) == 0, job.log_tail()
    report = json.loads((job.launch.mounts["/reports"] / "report.json").read_text())
    # Not vacuous: the collectors read the partitioned GPUs and their instances.
    assert report["totals"]["gpus"] == 5 + WHOLE_GPUS
    assert report["totals"]["allocated_gpu_hours"] > 0
    hours = report["fragmentation"]
    assert hours
    for hour in hours:
        assert hour["free_gpus"] == pytest.approx(WHOLE_GPUS), hour
        # Two free GPUs on one node: no 4-GPU request fits them.
        assert hour["stranded_share"] == pytest.approx(1.0), hour
