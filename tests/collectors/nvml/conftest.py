"""NVML collector test fixtures: the fake NVML from tests/data/nvml, a recording publisher."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent

DATA = Path(__file__).resolve().parents[2] / "data" / "nvml"


class RecordingPublisher:
    """A Publisher that keeps what it is given, and lets a test wait for it."""

    def __init__(self) -> None:
        self.samples: list[NodeSample] = []
        self.events: list[HwEvent] = []
        self._changed = asyncio.Condition()

    async def sample(self, sample: NodeSample) -> None:
        self.samples.append(sample)
        async with self._changed:
            self._changed.notify_all()

    async def hw_event(self, event: HwEvent) -> None:
        self.events.append(event)
        async with self._changed:
            self._changed.notify_all()

    async def allocation(self, event: AllocationEvent) -> None:
        raise AssertionError("the NVML collector publishes no allocations")

    async def queue(self, event: QueueEvent) -> None:
        raise AssertionError("the NVML collector publishes no queue events")

    async def flush(self) -> None:
        return None

    async def wait_for(self, predicate: Callable[[RecordingPublisher], bool],
                       timeout_s: float = 5.0) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout_s)

    def events_of(self, kind: str) -> list[HwEvent]:
        return [e for e in self.events if e.kind == kind]


@pytest.fixture
def nvml_data() -> Path:
    return DATA


@pytest.fixture
def fake_nvml() -> Callable[[str], FakeNvml]:
    """``fake_nvml("mig-node")``: a fresh fake NVML from tests/data/nvml/mig-node.yaml."""
    return lambda name: FakeNvml.from_yaml(DATA / f"{name}.yaml")


@pytest.fixture
def publisher() -> RecordingPublisher:
    return RecordingPublisher()
