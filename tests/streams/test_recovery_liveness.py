"""A worker replaying a long changelog is live all along, and serves its metrics.

Faust starts ``@app.task`` and ``@app.timer`` only after the first table recovery; a
heartbeat there failed ``/livez`` while a large changelog replayed, and the kubelet
restarted the worker into the same replay, forever. The worker here counts itself wedged
after 2 s without a beat (``short_liveness_worker.py``; it beats every second) and
recovers a changelog that takes many seconds to replay: ``/livez`` must answer 200 at
every probe while ``/readyz`` says 503, and ``/metrics`` must answer before the
recovery ends, with the worker group's lag (a replaying worker consumes nothing: its
lag is the figure an operator needs then).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from gpusteward import health, kafka, topics
from gpusteward.broker import free_port
from gpusteward.children import stop_child
from gpusteward.sandbox.pipeline import settings_env
from gpusteward.settings import Settings
from gpusteward.topics import worker_group
from tests.conftest import metrics_page
from tests.streams import short_liveness_worker

pytestmark = pytest.mark.e2e

CHANGELOG_RECORDS = 60_000
"""Node states on the changelog: about 10 s of replay on two shared CPUs, several times
the liveness threshold of the worker under test."""
SCRIPT = Path(short_liveness_worker.__file__)


async def _fill_changelog(settings: Settings) -> str:
    """The worker's node-state changelog, created as Faust would and filled with states."""
    name = topics.changelog(settings, "node-state")
    partitions = settings.kafka.node_partitions
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_config())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, settings.kafka.replication_factor,
                                            topic_configs={"cleanup.policy": "compact"})])
    finally:
        await admin.close()
    producer = kafka.producer(settings, linger_ms=20, max_batch_size=1 << 20)
    await producer.start()
    try:
        value = os.urandom(400)  # never decoded: no record for these nodes arrives
        pending = []
        for i in range(CHANGELOG_RECORDS):
            pending.append(await producer.send(name, value, key=b"node-%d" % i,
                                               partition=i % partitions))
            if len(pending) >= 20_000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return name


def test_a_worker_recovering_a_long_changelog_stays_live(settings: Settings,
                                                         tmp_path: Path) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    asyncio.run(_fill_changelog(settings))
    health_port, metrics_port = free_port(), free_port()
    env = {**os.environ,
           **settings_env(settings.model_copy(update={"health_port": health_port})),
           "GPUSTEWARD_METRICS__PORT": str(metrics_port)}
    log = tmp_path / "worker.log"
    with open(log, "ab") as out:
        worker = subprocess.Popen(
            [sys.executable, "-P", str(SCRIPT), "--datadir", tempfile.mkdtemp(),
             "--loglevel", "warn"], env=env, stdout=out, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while health.probe(health_port, health.LIVE_PATH) is None:
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker served no probe in 60 s"
            time.sleep(0.05)
        first_answer = time.monotonic()
        live_answers: list[int | None] = []
        metrics_while_recovering = lag_while_recovering = False
        while health.probe(health_port, health.READY_PATH) != 200:
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline + 120, "the worker never became ready"
            live_answers.append(health.probe(health_port, health.LIVE_PATH))
            page = metrics_page(metrics_port)
            metrics_while_recovering |= "gpusteward_records_in_total" in page
            lag_while_recovering |= (f'gpusteward_consumer_caught_up_timestamp_seconds{{group='
                                     f'"{worker_group(settings)}"') in page
            time.sleep(0.1)
        recovering_s = time.monotonic() - first_answer
        print(f"not ready for {recovering_s:.1f}s, {len(live_answers)} liveness probes")
        # The replay lasted long enough to have failed liveness under a timer's beat.
        assert recovering_s > 2 * short_liveness_worker.STALE_AFTER_S, recovering_s
        assert live_answers and set(live_answers) == {200}, live_answers
        assert metrics_while_recovering, "no /metrics page while the changelog replayed"
        assert lag_while_recovering, "no lag on /metrics while the changelog replayed"
    finally:
        stop_child(worker, 15.0)
