"""An idle holder's chat message and alert carry the owner's notice, word for word."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gpusteward.alerting.alertmanager import AlertmanagerSink
from gpusteward.alerting.webhook import WebhookSink, slack_escape
from gpusteward.rules import idle
from gpusteward.schema import DeviceSample, Finding, PodRef
from tests.alerting.test_alertmanager import active_alerts
from tests.alerting.test_webhook import receiver


def idle_finding(start: float) -> Finding:
    """The idle rule's first finding on a notebook that has held a GPU unused since ``start``."""
    settings = idle.IdleSettings()
    holder = idle.Holder(PodRef("ml-alice", "nb-alice-0"), start, "notebook",
                         owner_kind="Notebook", owner_name="nb-alice")
    sample = DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=0.0)
    track, ts = idle.IdleTrack(), start
    while True:
        for out in idle.observe(track, "gpu-node-1", sample, ts, settings, holder):
            if isinstance(out, Finding):
                return out
        ts += 60


def test_the_slack_message_says_the_owner_notice() -> None:
    fired = idle_finding(1_767_225_600.0)
    notice = idle.owner_notice(fired)
    assert notice and "kubectl annotate pod -n ml-alice nb-alice-0" in notice

    async def main() -> list[dict[str, Any]]:
        runner, url, received = await receiver([])
        sink = WebhookSink(url)
        await sink.deliver(fired)
        await sink.close()
        await runner.cleanup()
        return received

    [message] = asyncio.run(main())
    # Word for word as Slack shows it: its formatting reads <RFC 3339 time> as a link, and
    # the owner's kubectl command lost its placeholder.
    assert message["text"] == f"[FIRING info] idle_holder: {slack_escape(notice)}"
    assert "keep-until=&lt;RFC 3339 time&gt;" in message["text"]
    assert message["attachments"][0]["fallback"] == message["text"]


def test_the_alert_description_is_the_owner_notice(alertmanager: str) -> None:
    fired = idle_finding(time.time() - 3 * 3600)
    sink = AlertmanagerSink(alertmanager)

    async def main() -> None:
        await sink.deliver(fired)
        await sink.close()

    asyncio.run(main())
    [alert] = active_alerts(alertmanager, fired.fingerprint)
    assert alert["annotations"]["description"] == idle.owner_notice(fired)
    assert alert["annotations"]["summary"] == fired.summary
    assert alert["labels"]["reclaim"] == "dry_run"
