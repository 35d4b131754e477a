"""The webhook sink against a local HTTP receiver that records what it is sent."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web

from gpusteward.alerting.alertmanager import AlertmanagerSink
from gpusteward.alerting.webhook import WebhookSink
from gpusteward.broker import free_port
from gpusteward.rules.findings import resolved
from gpusteward.schema import Finding, Subject


def finding(severity: str = "critical") -> Finding:
    return Finding(id="fp-1-1000", fingerprint="fp-1", kind="ecc_dbe",
                   severity=severity, state="firing",  # type: ignore[arg-type]
                   subject=Subject(node="gpu-node-3", device="GPU-9"),
                   summary="uncorrectable ECC error on GPU-9 (gpu-node-3)",
                   starts_at=1000.0, ts=1000.0, runbook="drain and reset")


async def receiver(statuses: list[int]) -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """A receiver answering ``statuses`` in turn (then 200), recording every body."""
    received: list[dict[str, Any]] = []

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response(status=statuses.pop(0) if statuses else 200)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/hook", received


def test_firing_and_resolved_findings_are_sent_as_slack_messages() -> None:
    async def main() -> list[dict[str, Any]]:
        runner, url, received = await receiver([])
        sink = WebhookSink(url)
        fired = finding()
        await sink.deliver(fired)
        await sink.deliver(resolved(fired.id, fired.fingerprint, fired.kind, fired.subject,
                                    "GPU reset", fired.starts_at, 1100.0))
        await sink.close()
        await runner.cleanup()
        return received

    first, second = asyncio.run(main())
    assert first["text"] == ("[FIRING critical] ecc_dbe: uncorrectable ECC error on GPU-9 "
                             "(gpu-node-3)")
    attachment = first["attachments"][0]
    assert attachment["color"] == "#d62728"
    assert {"title": "node", "value": "gpu-node-3", "short": True} in attachment["fields"]
    assert first["gpusteward"]["fingerprint"] == "fp-1"
    assert second["text"].startswith("[RESOLVED] ecc_dbe")
    assert second["attachments"][0]["color"] == "#2ca02c"


def test_a_failing_receiver_is_retried_and_then_kept_for_refresh() -> None:
    async def main() -> tuple[int, int, int]:
        # 503 three times: deliver's three attempts fail; the refresh succeeds.
        runner, url, received = await receiver([503, 503, 503])
        sink = WebhookSink(url, attempts=3, backoff_s=0.01)
        await sink.deliver(finding())
        after_deliver = len(received)
        kept = len(sink.unsent)
        await sink.refresh()
        await sink.close()
        await runner.cleanup()
        return after_deliver, kept, len(sink.unsent)

    assert asyncio.run(main()) == (3, 1, 0)


def test_findings_below_the_minimum_severity_are_not_sent() -> None:
    async def main() -> int:
        runner, url, received = await receiver([])
        sink = WebhookSink(url, min_severity="warning")
        await sink.deliver(finding("info"))
        await sink.deliver(finding("warning"))
        await sink.close()
        await runner.cleanup()
        return len(received)

    assert asyncio.run(main()) == 1


# A Slack incoming webhook's path is its credential; a token may ride in the query, and a
# password in the URL itself.
SECRET_PATH = "/services/T0001/B0001/s3cr3tW3bh00kT0k3n"


def test_the_webhook_url_and_alertmanager_password_never_reach_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """A refused message and an unreachable receiver are logged by host and port only: the
    path, the query and ``user:password@`` are the credentials."""
    async def main() -> tuple[str, str]:
        async def refuse(request: web.Request) -> web.Response:
            return web.Response(status=404, text="no_service")

        app = web.Application()
        app.router.add_post(SECRET_PATH, refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        refusing = f"http://127.0.0.1:{runner.addresses[0][1]}"
        unreachable = f"http://127.0.0.1:{free_port()}"
        for url in (f"{refusing}{SECRET_PATH}?token=qu3ryT0k3n", f"{unreachable}{SECRET_PATH}",
                    "hooks.slack.com" + SECRET_PATH):  # no scheme: aiohttp's error quotes it
            sink = WebhookSink(url, attempts=1)
            await sink.deliver(finding())
            await sink.close()
        # One sink per failure: after one, a sink waits before its next request.
        for record in (finding(), resolved("fp-1-1000", "fp-1", "ecc_dbe", finding().subject,
                                           "GPU reset", 1000.0, 1100.0)):
            alertmanager = AlertmanagerSink(f"http://admin:hunt3rPassw0rd@{unreachable[7:]}",
                                            timeout_s=2)
            await alertmanager.deliver(record)
            await alertmanager.close()
        await runner.cleanup()
        return refusing, unreachable

    with caplog.at_level(logging.INFO, logger="gpusteward"):
        refusing, unreachable = asyncio.run(main())
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("gpusteward")]
    said = "\n".join(logged)
    for secret in ("s3cr3tW3bh00kT0k3n", "qu3ryT0k3n", "hunt3rPassw0rd", "admin"):
        assert secret not in said, said
    assert f"webhook {refusing}/… rejected a message (answered 404: no_service)" in said
    assert f"webhook {unreachable}/…: Cannot connect to host" in said
    assert f"cannot reach Alertmanager at {unreachable}: Cannot connect" in said
    assert "webhook <unreadable URL>: not an http(s) URL;" in said
    assert len(logged) == 5, said  # each failure still said, once
