"""Fixtures of the Kubernetes watcher tests: an API-server double and a watcher running on it.

The watcher runs on an event loop in its own thread so that tests stay
synchronous: they change objects in the double, then wait until the watcher
has caught up (every reflector at the double's newest resourceVersion and
every delivered delta published) and compare the exact event stream.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.schema import HwEvent, NodeInventory, NodeSample, PodAllocation, QueueEvent
from tests.conftest import KUBE_FIXTURES

FIXTURES = KUBE_FIXTURES  # re-exported: the watcher tests load them by name
CLOCK = 1_000.0
"""The watcher's clock in these tests: a constant, so events compare exactly."""


class RecordingPublisher:
    """A Publisher that keeps what it is given, in order."""

    def __init__(self) -> None:
        self.events: list[PodAllocation | NodeInventory | QueueEvent] = []
        self.others: list[NodeSample | HwEvent] = []
        self.flushes = 0

    async def sample(self, sample: NodeSample) -> None:
        self.others.append(sample)

    async def hw_event(self, event: HwEvent) -> None:
        self.others.append(event)

    async def allocation(self, event: PodAllocation | NodeInventory) -> None:
        self.events.append(event)

    async def queue(self, event: QueueEvent) -> None:
        self.events.append(event)

    async def flush(self) -> None:
        self.flushes += 1


class RunningWatcher:
    """A :class:`KubeWatcher` on its own loop thread, with helpers to wait for it."""

    def __init__(self, api: KubeApiServer, kubeconfig: Path, settings: KubeWatchSettings
                 ) -> None:
        self.api = api
        self.publisher = RecordingPublisher()
        self.watcher = KubeWatcher(api_client(settings), self.publisher, settings,
                                   clock=lambda: CLOCK)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self.watcher.run(self._stop))
        except BaseException as e:
            self.error = e

    def start(self, timeout: float = 10.0) -> RunningWatcher:
        self._thread.start()
        wait_until(self.watcher.synced.is_set, timeout, "the first list")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the watcher did not stop"
        if self.error is not None:
            raise self.error

    @property
    def events(self) -> list[Any]:
        return self.publisher.events

    def settled(self) -> bool:
        latest = str(self.api.resource_version)
        reflectors = list(self.watcher.reflectors.values())
        delivered = sum(r.stats.deltas for r in reflectors)
        return all(r.resource_version == latest for r in reflectors) and (
            delivered == self.watcher.processed)

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every change in the double has been seen and published."""
        wait_until(self.settled, timeout, "the watcher to catch up")

    def new_events(self, since: int, timeout: float = 10.0) -> list[Any]:
        self.settle(timeout)
        assert not self.publisher.others, "the watcher published samples or hardware events"
        return self.events[since:]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


WatcherFactory = Callable[..., RunningWatcher]


@pytest.fixture
def start_watcher(kube_api: KubeApiServer, kubeconfig: Path) -> Iterator[WatcherFactory]:
    """Start a watcher on ``kube_api``; keyword arguments override its settings."""
    running: list[RunningWatcher] = []

    def start(**overrides: Any) -> RunningWatcher:
        fields: dict[str, Any] = {"kubeconfig": str(kubeconfig), "backoff_initial_s": 0.05,
                                  "backoff_max_s": 0.2, "watch_timeout_s": 30}
        fields.update(overrides)
        watcher = RunningWatcher(kube_api, kubeconfig, KubeWatchSettings(**fields))
        running.append(watcher)
        return watcher.start()

    yield start
    for watcher in running:
        watcher.stop()
