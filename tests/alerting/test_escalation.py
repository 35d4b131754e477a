"""An idle episode's escalation reaches Alertmanager and chat, as deployed.

The idle rule re-issues its episode's finding (same id, still firing) at severity
warning after the first notice. `gpusteward alerts` delivered each finding id and state
once, so the warning never reached a sink: Alertmanager kept the info alert (a route for
warnings never fired) and chat carried only the first notice, not the one naming the
reclaim's time.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.rules import idle
from gpusteward.schema import Finding
from gpusteward.settings import Settings
from tests.alerting.test_alertmanager import active_alerts
from tests.alerting.test_consumer_edge import publish
from tests.alerting.test_webhook_restart import AlertsProcess, ChatDouble, until
from tests.rules.test_idle_ladder import POD, run

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(180)
def test_the_warning_after_the_notice_replaces_the_alert_and_reaches_chat(
        settings: Settings, alertmanager: str, tmp_path: Path) -> None:
    start = time.time() - 15 * 3600
    ladder = [o for o in run(idle.Holder(POD, start, "notebook"), 14, start=start)
              if isinstance(o, Finding)]
    assert [f.severity for f in ladder] == ["info", "warning", "warning"]  # one episode
    fingerprint = ladder[0].fingerprint
    asyncio.run(kafka.ensure_topics(settings))

    async def main() -> tuple[list[str], list[dict]]:
        chat = ChatDouble()
        runner, url = await chat.start()
        alerts = AlertsProcess(settings, url, alertmanager, tmp_path / "alerts.log")
        try:
            alerts.start()
            await publish(settings, [msgspec.json.encode(ladder[0])])
            await until(lambda: active_alerts(alertmanager, fingerprint), 60, "the notice")
            await publish(settings, [msgspec.json.encode(f) for f in ladder[1:]])
            await kafka.wait_consumed(settings, f"{settings.topic_prefix}-alerts",
                                      [topics.FINDINGS.name(settings)], timeout_s=60)
            await until(lambda: len(chat.taken) >= 2, 30, "the warning in chat")
            await asyncio.sleep(1.0)  # time for a wrong third message to arrive
            return chat.taken, active_alerts(alertmanager, fingerprint)
        finally:
            if alerts.process is not None and alerts.process.poll() is None:
                await alerts.stop()
            await runner.cleanup()

    taken, active = asyncio.run(main())
    # One alert for the episode, at its current severity: the info one was ended, not
    # left to lapse beside it.
    assert [a["labels"]["severity"] for a in active] == ["warning"]
    assert active[0]["annotations"]["summary"] == ladder[1].summary
    # Chat: the notice and the warning; the reclaim step (same severity) is no new message.
    assert taken == [ladder[0].id, ladder[0].id]
