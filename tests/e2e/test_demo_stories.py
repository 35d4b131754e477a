"""``gpusteward demo --scenario NAME`` for the demo's other stories, checked as the demo
checks itself (the overlay's processes against the simulated world on the session broker;
see ``test_demo.py``). A file of their own, so that ``make test``'s workers (a file each at a
time) share the demo's runs: together they were the suite's longest file by three times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from gpusteward.sandbox import demo
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.settings import Settings
from tests.e2e.test_demo import WALL_S

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "story"), [
    ("spot-batch", lambda truth: truth.interruptions),
    ("faulty-fleet", lambda truth: truth.faults),
    ("queue-pressure", lambda truth: truth.unplaceable),
    ("mig-inference", lambda truth: truth.unplaceable),
])
def test_the_other_stories_as_deployed_match_their_ground_truth(
        settings: Settings, tmp_path: Path, name: str,
        story: Callable[[GroundTruth], list[Any]]) -> None:
    """`gpusteward demo --scenario NAME`: the overlay's processes against the world, whose
    API double and kubelet sockets carry what the simulator does (a spot node's taint and
    its deletion, faulty GPUs, a job no node can hold). Each story happened (``story``) and
    the summary agrees with the ground truth: before, spot-batch crashed the world (two pods
    of one name), its interruptions never reached the watcher (no taint on the Node),
    faulty-fleet's summary called every fault the policy leaves to a dry run missed, and
    the job no node can hold (queue-pressure's 3 GPUs, mig-inference's 2g.20gb slice) was
    given a start estimate."""
    scenario = scenarios.load(name)
    cluster = SimulatedCluster(scenario.model_copy(
        update={"acceleration": scenario.duration_s / WALL_S}))
    console = Console(record=True, width=120)

    async def main() -> tuple[GroundTruth, bool]:
        truth, state = await demo._run(settings, cluster, console, False, tmp_path)
        return truth, demo.summarize(console, truth, state)

    truth, agree = asyncio.run(main())
    assert story(truth), "the scenario's story happened"
    assert agree, console.export_text()[-3000:]
