"""``gpusteward demo`` on both allocation feeds, checked as the demo checks itself.

The demo's own run (``demo._run``: the real worker process, the alert sink,
the executor on the simulated cluster) on the session broker, 20 s of wall
time for six simulated hours; its summary must match the simulator's ground
truth, which is what makes ``gpusteward demo`` exit 0. With the kubernetes
feed, what reached the allocations and queue topics must have come through
the watcher (the simulator's own events look different: no node labels, no
queue-event kind), and the executor's cordon must have reached the watcher
through the API double. A cancelled run (what Ctrl-C does to ``asyncio.run``)
must leave no watcher thread, no API-double server and no worker behind.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console

from gpusteward import kafka, topics
from gpusteward.sandbox import demo
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.schema import AllocationEvent, NodeInventory, QueueEvent
from gpusteward.settings import Settings

pytestmark = pytest.mark.e2e

WALL_S = 20.0


def _cluster() -> SimulatedCluster:
    scenario = scenarios.load("eight-a100")
    return SimulatedCluster(scenario.model_copy(
        update={"acceleration": scenario.duration_s / WALL_S}))


async def _topic(settings: Settings, spec: topics.TopicSpec, kind: Any) -> list:
    records = await kafka.read_all(settings, spec.name(settings))
    return [msgspec.json.decode(r.value or b"", type=kind) for r in records]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("feed", ["simulator", "kubernetes"])
def test_demo_summary_matches_ground_truth(feed: demo.Feed, settings: Settings,
                                           tmp_path: Path) -> None:
    cluster = _cluster()
    console = Console(record=True, width=120)

    async def main() -> tuple[list[AllocationEvent], list[QueueEvent]]:
        truth, state = await demo._run(settings, cluster, console, False, tmp_path, feed)
        assert demo.summarize(console, truth, state), console.export_text()[-3000:]
        return (await _topic(settings, topics.ALLOCATIONS, AllocationEvent),
                await _topic(settings, topics.QUEUE, QueueEvent))

    allocations, queue = asyncio.run(main())
    inventories = [e for e in allocations if isinstance(e, NodeInventory)]
    assert inventories and queue
    truth = cluster.finish_truth()
    faulty = {fault.node for fault in truth.faults}
    assert faulty, "the scenario injects a faulty GPU"
    # The cordon the executor applied to the simulated cluster is on the topic either way.
    assert {e.node for e in inventories if e.unschedulable} == faulty
    from_watcher = (all("nvidia.com/gpu.count" in e.labels for e in inventories)
                    and all(q.kind == "pod" for q in queue))
    from_simulator = (all(not e.labels for e in inventories)
                      and all(q.kind is None for q in queue))
    assert from_watcher if feed == "kubernetes" else from_simulator


class _Worker(WorkerProcess):
    """The demo's worker, remembered so the test can see it was stopped."""

    started: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        super().start()
        assert self.process is not None
        _Worker.started.append(self.process)


def _kube_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.is_alive() and (t.name.startswith("reflector-") or t.name == "kube-api-double")]


@pytest.mark.timeout(120)
def test_interrupted_kubernetes_demo_stops_everything(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "WorkerProcess", _Worker)
    _Worker.started = []
    cluster = _cluster()
    seen_running: list[str] = []
    stopping_s: list[float] = []

    async def main() -> None:
        run = asyncio.create_task(demo._run(settings, cluster, Console(quiet=True), False,
                                            tmp_path, "kubernetes"))
        # Interrupt in the middle of the scenario, the watcher and the double busy.
        deadline = time.monotonic() + 60
        while cluster.now < cluster.start + 3600 and not run.done():
            assert time.monotonic() < deadline, "the demo did not get going"
            await asyncio.sleep(0.1)
        seen_running.extend(_kube_threads())
        run.cancel()  # what asyncio.run does to its main task on the first Ctrl-C
        cancelled = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await run  # not a normal return: it was stopped in the middle
        stopping_s.append(time.monotonic() - cancelled)

    asyncio.run(main())
    assert stopping_s[0] < 15, f"stopping took {stopping_s[0]:.1f} s"
    assert "kube-api-double" in seen_running and any(
        name.startswith("reflector-") for name in seen_running)
    assert _kube_threads() == []
    assert len(_Worker.started) == 1 and _Worker.started[0].poll() is not None
