"""The webhook sink against a local HTTP receiver that records what it is sent."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gpusteward.alerting.webhook import WebhookSink
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
