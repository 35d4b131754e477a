"""Compacted topics and the worker's changelogs roll their segments often.

Kafka never compacts a topic's active segment, which by default stays active for 7 days or
1 GiB: a restarted worker replayed up to that much of every changelog partition it
recovers, however few keys it holds. Here a real worker on the embedded broker creates its
changelogs, and ``ensure_topics`` its compacted topics; each must say when to start a new
segment (``topics.COMPACTED_SEGMENTS``), as a real Kafka reads it from the topic's config.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpusteward import kafka, topics
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.settings import Settings

pytestmark = pytest.mark.e2e

CHANGELOGS = ("node-state", "fleet-state", "fleet-nodes", "fleet-mig-workloads", "fleet-spot")


def test_changelogs_and_compacted_topics_start_a_segment_every_ten_minutes(
        settings: Settings, tmp_path: Path) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    worker.start()
    try:
        worker.wait_ready()
    finally:
        worker.stop()
    names = [topics.changelog(settings, table) for table in CHANGELOGS] + [
        spec.name(settings) for spec in topics.ALL if spec.compacted]
    configs = asyncio.run(kafka.topic_configs(settings, names))
    expected = {"cleanup.policy": "compact", **topics.COMPACTED_SEGMENTS}
    assert {name: {k: configs[name].get(k) for k in expected} for name in names} == {
        name: expected for name in names}
