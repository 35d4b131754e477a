"""The alert sink's lag keeps being read while its loop is stuck on a sink.

A dead Alertmanager or webhook holds the consume loop in ``deliver``; the lag used to be
set from that loop, so it froze at its last value and no lag alert could fire for the
very stall it exists for. It is read beside the loop now
(:func:`gpusteward.metrics.lag_followed`), from the group's committed offsets.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from gpusteward import kafka, metrics, topics
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.broker import free_port
from gpusteward.schema import Finding
from gpusteward.settings import MetricsSettings, Settings
from tests.alerting.test_consumer_edge import finding, publish

pytestmark = pytest.mark.e2e


class HungSink:
    """A sink whose first delivery never returns, as behind a peer that never answers."""

    def __init__(self) -> None:
        self.hung = asyncio.Event()

    async def deliver(self, finding: Finding) -> None:
        self.hung.set()
        await asyncio.Event().wait()


def test_a_consumer_stuck_on_its_sink_shows_its_lag_growing(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "LAG_INTERVAL_S", 0.2)
    settings = settings.model_copy(update={"metrics": MetricsSettings(port=free_port(),
                                                                      addr="127.0.0.1")})
    asyncio.run(kafka.ensure_topics(settings))
    sink = HungSink()
    consumer = FindingsConsumer(settings, [sink])
    labels = {"group": consumer.group_id, "topic": topics.FINDINGS.name(settings)}

    def value(name: str) -> float | None:
        return consumer.metrics.registry.get_sample_value(name, labels)

    async def main() -> tuple[float | None, float | None, float | None]:
        await publish(settings, [msgspec.json.encode(finding("f-1"))])
        task = asyncio.create_task(consumer.run(asyncio.Event()))
        try:
            await asyncio.wait_for(sink.hung.wait(), 30)
            await publish(settings, [msgspec.json.encode(finding(f"f-{n}"))
                                     for n in (2, 3, 4)])
            for _ in range(200):  # 20 s at most
                if value("gpusteward_consumer_lag_records") == 4:
                    break
                await asyncio.sleep(0.1)
            caught_up = value("gpusteward_consumer_caught_up_timestamp_seconds")
            await asyncio.sleep(1.0)  # five readings later
            return (value("gpusteward_consumer_lag_records"), caught_up,
                    value("gpusteward_consumer_caught_up_timestamp_seconds"))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    records, caught_up, caught_up_later = asyncio.run(main())
    # f-1 is not committed (its delivery never ended) and three more wait behind it.
    assert records == 4
    # The time it is caught up to stands still: time() minus it, the lag in seconds, grows.
    assert caught_up is not None and caught_up_later == caught_up < time.time() - 1
