"""Chat messages kept through a webhook outage survive a restart of ``gpusteward alerts``.

The webhook sink keeps what it could not post in memory, and the consumer used to commit
past those findings anyway: a restart during a Slack outage lost the messages for good
(it only logged how many). Now the consumer commits no further than the oldest finding
whose message is still kept, so the restarted process reads those findings again and
posts them; Alertmanager is not held back meanwhile, and a message already posted is not
posted twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiokafka import TopicPartition

from gpusteward import kafka, topics
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.alerting.webhook import WebhookSink
from gpusteward.broker import free_port
from gpusteward.sandbox.pipeline import settings_env
from gpusteward.schema import Finding, Subject
from gpusteward.settings import Settings
from tests.alerting.test_alertmanager import active_alerts, serve_app
from tests.alerting.test_consumer_edge import consume_all, publish

pytestmark = pytest.mark.e2e


def dbe(n: int) -> Finding:
    now = time.time()
    return Finding(id=f"dbe-{n}", fingerprint=f"dbe-{n}", kind="ecc_dbe", severity="critical",
                   state="firing", subject=Subject(node=f"gpu-node-{n}", device="GPU-0"),
                   summary=f"uncorrectable ECC error on GPU-0 (gpu-node-{n})",
                   starts_at=now - 60, ts=now - 60)


class ChatDouble:
    """A Slack-compatible incoming webhook that can be down (503) and come back."""

    def __init__(self) -> None:
        self.down = False
        self.taken: list[str] = []
        """The finding id of each message taken, in order."""
        self.refused = 0

    async def hook(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.down:
            self.refused += 1
            return web.Response(status=503, text="service unavailable")
        self.taken.append(body["gpusteward"]["id"])
        return web.Response(text="ok")

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/services/T0/B0/token", self.hook)
        runner, url = await serve_app(app)
        return runner, f"{url}/services/T0/B0/token"


class AlertsProcess:
    """``gpusteward alerts`` as deployed (deploy/base/alerts.yaml: the command and the
    webhook and Alertmanager URLs from the environment), as a child process."""

    def __init__(self, settings: Settings, webhook: str, alertmanager: str, log: Path) -> None:
        self.env = {**os.environ, **settings_env(settings.model_copy(
            update={"health_port": free_port()})), "GPUSTEWARD_WEBHOOK_URL": webhook,
            "GPUSTEWARD_ALERTMANAGER_URL": alertmanager, "COLUMNS": "200", "TERM": "dumb"}
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", "gpusteward.cli", "alerts"], env=self.env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    async def stop(self) -> int:
        """SIGTERM, as Kubernetes stops a pod; the exit status. Waited for off the event loop,
        where the chat double answers meanwhile."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(self.process.wait, 30)
        finally:
            if self.process.poll() is None:
                self.process.kill()


async def until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(240)
def test_messages_kept_through_a_chat_outage_are_posted_after_a_restart(
        settings: Settings, alertmanager: str, tmp_path: Path) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    first, during = dbe(1), [dbe(2), dbe(3)]

    async def main() -> tuple[ChatDouble, int, list[str]]:
        chat = ChatDouble()
        runner, url = await chat.start()
        log = tmp_path / "alerts.log"
        alerts = AlertsProcess(settings, url, alertmanager, log)
        try:
            await publish(settings, [msgspec.json.encode(first)])
            alerts.start()
            await until(lambda: chat.taken == [first.id], 60, "the first message posted")

            # The chat receiver goes down; two findings come while it is.
            chat.down = True
            await publish(settings, [msgspec.json.encode(f) for f in during])
            await until(lambda: all(f.summary in alerts.said() for f in during)
                        and chat.refused > 0, 60, "both findings read, the post refused")
            # Alertmanager is not held back by the chat outage.
            in_alertmanager = [f.id for f in during
                               if active_alerts(alertmanager, f.fingerprint)]
            stopped = await alerts.stop()

            chat.down = False
            alerts.start()  # the same Deployment's next pod: same group, same settings
            await until(lambda: len(chat.taken) >= 3, 60, "the kept messages posted")
            await kafka.wait_consumed(settings, f"{settings.topic_prefix}-alerts",
                                      [topics.FINDINGS.name(settings)], timeout_s=60)
            await asyncio.sleep(1.0)  # time for a wrong second post to arrive
            return chat, stopped, in_alertmanager
        finally:
            if alerts.process is not None and alerts.process.poll() is None:
                await alerts.stop()
            await runner.cleanup()

    chat, stopped, in_alertmanager = asyncio.run(main())
    said = (tmp_path / "alerts.log").read_text(errors="replace")
    assert stopped == 0, said[-3000:]
    assert in_alertmanager == [f.id for f in during]
    # Every message arrives, in order, and the one posted before the outage only once.
    assert chat.taken == [first.id, *(f.id for f in during)], said[-3000:]
    assert "not sent as the process stops" in said


def test_the_commit_moves_on_once_kept_messages_are_sent_without_new_findings(
        settings: Settings) -> None:
    """The outage ends while the process runs and no finding follows: the commit must move
    past the kept findings all the same, or the next restart would post them again."""
    asyncio.run(kafka.ensure_topics(settings))
    asyncio.run(publish(settings, [msgspec.json.encode(dbe(1))]))

    async def main() -> tuple[list[str], int]:
        chat = ChatDouble()
        chat.down = True
        runner, url = await chat.start()
        sink = WebhookSink(url, attempts=1, min_interval_s=0.0)
        consumer = FindingsConsumer(settings, [sink])
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        try:
            await until(lambda: chat.refused > 0, 60, "the post refused")
            await asyncio.sleep(1.0)
            group, partition = consumer.group_id, TopicPartition(
                topics.FINDINGS.name(settings), 0)
            held = (await kafka.committed(settings, group, [partition]))[partition]
            chat.down = False
            await consume_all_committed(consumer)
            return chat.taken, held
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await runner.cleanup()

    async def consume_all_committed(consumer: FindingsConsumer) -> None:
        await kafka.wait_consumed(consumer.settings, consumer.group_id,
                                  [topics.FINDINGS.name(consumer.settings)], timeout_s=60)

    taken, held = asyncio.run(main())
    assert held in (-1, 0)  # not past the finding whose message was kept
    assert taken == ["dbe-1"]
    # A restart now reads nothing again, and posts nothing twice.
    delivered: list[Finding] = []
    asyncio.run(consume_all(FindingsConsumer(settings, [], on_finding=delivered.append)))
    assert delivered == []
