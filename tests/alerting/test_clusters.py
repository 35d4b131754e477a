"""Two clusters, one Alertmanager and one chat channel: ``GPUSTEWARD_CLUSTER`` keeps them apart.

A finding's fingerprint names its kind and subject (node, device, pod, queue), never the
cluster: two clusters' ``gpusteward alerts`` posting to one Alertmanager with the same node
names (``gpu-node-1`` in each) sent one label set, so their alerts were one alert, one
cluster's resolution ended the other's, and a restarted process resolving an alert it
never saw fire ended the other cluster's too. Each cluster's name is now its alerts'
``cluster`` label, and its chat messages say which cluster.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from gpusteward import kafka
from gpusteward.alerting.alertmanager import AlertmanagerSink
from gpusteward.rules.findings import finding_id, fingerprint, resolved
from gpusteward.schema import Finding, Subject
from gpusteward.settings import Settings
from tests.alerting.test_alertmanager import active_alerts, serve_app
from tests.alerting.test_consumer_edge import publish
from tests.alerting.test_webhook_restart import AlertsProcess, until

pytestmark = pytest.mark.e2e

SPOT = fingerprint("spot_interruption", "gpu-node-1")
"""The spot rule's fingerprint of gpu-node-1: the same in every cluster with that node."""


def spot(starts_at: float) -> Finding:
    return Finding(id=finding_id(SPOT, starts_at), fingerprint=SPOT, kind="spot_interruption",
                   severity="warning", state="firing", subject=Subject(node="gpu-node-1"),
                   summary="spot node gpu-node-1 is being reclaimed", starts_at=starts_at,
                   ts=starts_at)


def ended(finding: Finding) -> Finding:
    return resolved(finding.id, finding.fingerprint, finding.kind, finding.subject,
                    "node gpu-node-1 is back", finding.starts_at, time.time())


def clusters_firing(alertmanager: str) -> dict[str, str]:
    """The active alerts of gpu-node-1's spot fingerprint: cluster label -> state."""
    return {a["labels"].get("cluster", ""): a["status"]["state"]
            for a in active_alerts(alertmanager, SPOT)}


class Channel:
    """One Slack-compatible incoming webhook both clusters post to."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def hook(self, request: web.Request) -> web.Response:
        self.messages.append(await request.json())
        return web.Response(text="ok")

    def texts(self) -> list[str]:
        return [m["text"] for m in self.messages]

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/services/T0/B0/token", self.hook)
        runner, url = await serve_app(app)
        return runner, f"{url}/services/T0/B0/token"


@pytest.mark.timeout(180)
def test_two_clusters_with_the_same_node_names_fire_and_resolve_apart(
        settings: Settings, alertmanager: str, tmp_path: Path) -> None:
    """Each cluster's deployed ``gpusteward alerts`` (its own topics, its name in
    GPUSTEWARD_CLUSTER) posts gpu-node-1's spot interruption to the same real Alertmanager
    and webhook; east's resolution ends east's alert and leaves west's firing."""
    east = settings.model_copy(update={"cluster": "east"})
    west = settings.model_copy(update={"cluster": "west",
                                       "topic_prefix": f"{settings.topic_prefix}w"})
    for each in (east, west):
        asyncio.run(kafka.ensure_topics(each))
    now = time.time()
    east_spot, west_spot = spot(now - 120), spot(now - 60)

    async def main() -> Channel:
        channel = Channel()
        runner, url = await channel.start()
        processes = [AlertsProcess(each, url, alertmanager, tmp_path / f"{each.cluster}.log")
                     for each in (east, west)]
        try:
            for process in processes:
                process.start()
            await publish(east, [msgspec.json.encode(east_spot)])
            await publish(west, [msgspec.json.encode(west_spot)])
            # A sink posts to Alertmanager before the webhook: once both messages are in,
            # both clusters have posted their alert.
            await until(lambda: len(channel.messages) == 2, 60, "both clusters' messages")
            assert clusters_firing(alertmanager) == {"east": "active", "west": "active"}

            await publish(east, [msgspec.json.encode(ended(east_spot))])
            await until(lambda: len(channel.messages) == 3, 60, "east's resolution posted")
            assert clusters_firing(alertmanager) == {"west": "active"}
            for process in processes:
                assert await process.stop() == 0, process.said()
        finally:
            for process in processes:
                if process.process is not None and process.process.poll() is None:
                    process.process.kill()
            await runner.cleanup()
        return channel

    channel = asyncio.run(main())
    texts = channel.texts()
    assert sorted(texts[:2]) == [
        "[FIRING warning] east: spot_interruption: spot node gpu-node-1 is being reclaimed",
        "[FIRING warning] west: spot_interruption: spot node gpu-node-1 is being reclaimed"]
    assert texts[2] == "[RESOLVED] east: spot_interruption: node gpu-node-1 is back"
    for message in channel.messages:
        fields = message["attachments"][0]["fields"]
        assert fields[0]["title"] == "cluster"
        assert f"] {fields[0]['value']}: spot_interruption" in message["text"]
        assert message["gpusteward_cluster"] == fields[0]["value"]


def test_a_restart_ends_its_own_clusters_alert_only(alertmanager: str) -> None:
    """The resolve-after-restart path: a process that never saw the alert fire asks
    Alertmanager for the active alerts with its fingerprint and ends them; it ends only its
    own cluster's (and a pipeline without a name only alerts without one)."""
    fired = spot(time.time() - 60)

    async def main() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        sinks = [AlertmanagerSink(alertmanager, cluster=name) for name in ("east", "west", "")]
        for sink in sinks:
            await sink.deliver(fired)
            await sink.close()
        before = clusters_firing(alertmanager)
        unnamed = AlertmanagerSink(alertmanager)  # restarted: it knows no alert firing
        await unnamed.deliver(ended(fired))
        await unnamed.close()
        after_unnamed = clusters_firing(alertmanager)
        restarted = AlertmanagerSink(alertmanager, cluster="east")
        await restarted.deliver(ended(fired))
        await restarted.close()
        return before, after_unnamed, clusters_firing(alertmanager)

    before, after_unnamed, after_east = asyncio.run(main())
    assert before == {"east": "active", "west": "active", "": "active"}
    assert after_unnamed == {"east": "active", "west": "active"}
    assert after_east == {"west": "active"}
