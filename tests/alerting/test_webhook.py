"""The webhook sink against a local HTTP receiver that records what it is sent."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import pytest
from aiohttp import web

from gpusteward import kafka
from gpusteward.alerting.alertmanager import AlertmanagerSink
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.alerting.webhook import WebhookSink, slack_message
from gpusteward.broker import free_port
from gpusteward.rules.findings import resolved
from gpusteward.schema import Finding, Subject
from gpusteward.settings import Settings
from tests.alerting.test_alertmanager import serve_app
from tests.alerting.test_consumer_edge import T0, consume_all, publish


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
    runner, url = await serve_app(app)
    return runner, f"{url}/hook", received


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
        await sink.refresh(force=True)  # waits out the back-off and the pace
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
    # A sink that stops with a message kept says so: that line names no URL part either.
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("gpusteward")
              and "not sent as the process stops" not in r.getMessage()]
    said = "\n".join(logged)
    for secret in ("s3cr3tW3bh00kT0k3n", "qu3ryT0k3n", "hunt3rPassw0rd", "admin"):
        assert secret not in said, said
    assert f"webhook {refusing}/… rejected a message (answered 404: no_service)" in said
    assert f"webhook {unreachable}/…: Cannot connect to host" in said
    assert f"cannot reach Alertmanager at {unreachable}: Cannot connect" in said
    assert "webhook <unreadable URL>: not an http(s) URL;" in said
    assert len(logged) == 5, said  # each failure still said, once


async def slack_double(rate_s: float = 1.0, retry_after: str = "1"
                       ) -> tuple[web.AppRunner, str, list[dict[str, Any]], list[float]]:
    """An incoming webhook that, as Slack does, takes one message per ``rate_s`` and answers
    any other with 429 and ``Retry-After``; what it took, and when each request came."""
    taken: list[dict[str, Any]] = []
    arrivals: list[float] = []
    last = [-1e9]

    async def hook(request: web.Request) -> web.Response:
        body = await request.json()
        now = time.monotonic()
        arrivals.append(now)
        if now - last[0] < rate_s:
            return web.Response(status=429, text="rate_limited",
                                headers={"Retry-After": retry_after})
        last[0] = now
        taken.append(body)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner, url = await serve_app(app)
    return runner, f"{url}/hook", taken, arrivals


def _ids(message: dict[str, Any]) -> list[str]:
    data = message["gpusteward"]
    return [f["id"] for f in data["findings"]] if data.get("digest") else [data["id"]]


@pytest.mark.e2e
def test_a_burst_of_a_thousand_findings_is_a_digest_at_slacks_rate(settings: Settings
                                                                   ) -> None:
    """A fleet-wide incident through the deployed consumer: the channel gets a few digest
    messages, at Slack's rate, naming every finding once; none lost, none twice. Before,
    it got one message per finding, each met by 429 and retried without its Retry-After:
    a thousand findings held the consumer for about half an hour."""
    asyncio.run(kafka.ensure_topics(settings))
    burst = [Finding(id=f"ecc-{i}", fingerprint=f"ecc-{i}", kind="ecc_dbe",
                     severity="critical", state="firing",
                     subject=Subject(node=f"gpu-node-{i}", device="GPU-0"),
                     summary=f"uncorrectable ECC error on GPU-0 (gpu-node-{i})",
                     starts_at=T0, ts=T0) for i in range(1000)]
    asyncio.run(publish(settings, [msgspec.json.encode(f) for f in burst]))

    async def main() -> tuple[list[dict[str, Any]], list[float], float]:
        runner, url, taken, arrivals = await slack_double()
        consumer = FindingsConsumer(settings, [WebhookSink(url)],
                                    group_id="webhook-burst")
        started = time.monotonic()
        await consume_all(consumer)
        took = time.monotonic() - started
        await runner.cleanup()
        return taken, arrivals, took

    taken, arrivals, took = asyncio.run(main())
    ids = [i for message in taken for i in _ids(message)]
    assert sorted(ids) == sorted(f.id for f in burst)  # every finding once
    assert len(taken) <= 5, len(taken)
    assert len(arrivals) == len(taken)  # paced: no request met a 429
    first = taken[0]
    assert first["text"].startswith("[FIRING critical] ")
    assert " findings at once " in first["text"]
    assert len(first["text"]) <= 40_000
    assert took < 30, took


def test_a_429s_retry_after_is_waited_out_and_nothing_is_sent_twice() -> None:
    async def main() -> tuple[list[dict[str, Any]], list[float]]:
        runner, url, taken, arrivals = await slack_double(rate_s=2.0, retry_after="2")
        sink = WebhookSink(url, min_interval_s=0.0)
        await sink.deliver(finding())
        second = Finding(id="fp-2-1000", fingerprint="fp-2", kind="ecc_dbe",
                         severity="critical", state="firing",
                         subject=Subject(node="gpu-node-4"), summary="x",
                         starts_at=1000.0, ts=1000.0)
        await sink.deliver(second)  # within 2 s: 429, Retry-After 2
        await sink.close()
        await runner.cleanup()
        return taken, arrivals

    taken, arrivals = asyncio.run(main())
    assert [_ids(m) for m in taken] == [["fp-1-1000"], ["fp-2-1000"]]
    assert len(arrivals) == 3  # the second message once refused, then taken
    assert arrivals[2] - arrivals[1] >= 1.9  # not the 0.5 s backoff


def test_while_messages_are_kept_new_ones_queue_behind_them_in_order() -> None:
    """A chat outage: the firing message is kept; the resolution that follows must not
    reach the channel before it (RESOLVED, then FIRING, reads as an open incident), and
    must not cost the consumer another round of retries."""
    async def main() -> tuple[list[dict[str, Any]], int]:
        runner, url, received = await receiver([503, 503, 503])
        sink = WebhookSink(url, attempts=3, backoff_s=0.01, min_interval_s=0.0)
        fired = finding()
        await sink.deliver(fired)
        await sink.deliver(resolved(fired.id, fired.fingerprint, fired.kind, fired.subject,
                                    "GPU reset", fired.starts_at, 1100.0))
        posts_while_down = len(received)
        await sink.refresh(force=True)
        await sink.close()
        await runner.cleanup()
        return received[3:], posts_while_down

    taken, posts_while_down = asyncio.run(main())
    assert posts_while_down == 3
    assert [m["text"].split("]")[0] for m in taken] == ["[FIRING critical", "[RESOLVED"]


def test_pod_names_and_angle_brackets_reach_slack_literally() -> None:
    """Slack reads ``<...>`` as a link or mention and ``&`` as an entity: the text is
    escaped as its formatting guide asks, the data under ``gpusteward`` is not."""
    odd = Finding(id="fp-3-1000", fingerprint="fp-3", kind="ecc_dbe", severity="warning",
                  state="firing", subject=Subject(node="n<1>&co", device="GPU-1"),
                  summary="a <!channel> & <https://x.example|click>", starts_at=1000.0,
                  ts=1000.0)
    message = slack_message(odd)
    assert message["text"] == ("[FIRING warning] ecc_dbe: a &lt;!channel&gt; &amp; "
                               "&lt;https://x.example|click&gt;")
    assert {"title": "node", "value": "n&lt;1&gt;&amp;co", "short": True} in (
        message["attachments"][0]["fields"])
    assert message["gpusteward"]["subject"]["node"] == "n<1>&co"


def test_a_revoked_webhook_is_said_once_and_not_retried(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[dict[str, Any]]:
        runner, url, received = await receiver([410] * 20)
        # A message per finding (no budget: digest_every_s 0), each refused for good.
        sink = WebhookSink(url, min_interval_s=0.0, digest_every_s=0.0)
        for n in range(20):
            await sink.deliver(Finding(id=f"g-{n}", fingerprint=f"g-{n}", kind="ecc_dbe",
                                       severity="critical", state="firing",
                                       subject=Subject(node=f"n{n}"), summary="x",
                                       starts_at=1000.0, ts=1000.0))
        await sink.refresh(force=True)
        kept = len(sink.unsent)
        await sink.close()
        await runner.cleanup()
        assert kept == 0
        return received

    with caplog.at_level(logging.INFO, logger="gpusteward"):
        received = asyncio.run(main())
    assert len(received) == 20  # each tried once, none retried
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "answered 410" in errors[0] and "revoked or its URL is wrong" in errors[0]


def test_a_storm_that_trickles_in_is_ten_messages_then_a_digest_a_window() -> None:
    """A bad driver rolling out breaks eight nodes' GPU at a time: each consumer batch holds
    eight findings, under the old per-batch digest threshold, so every batch was eight
    messages. Now at most ten messages per window, the rest are gathered (held back from
    the commit) and posted as one digest per window."""
    def batch(k: int) -> list[Finding]:
        return [Finding(id=f"dbe-{node}", fingerprint=f"dbe-{node}", kind="ecc_dbe",
                        severity="critical", state="firing",
                        subject=Subject(node=f"gpu-node-{node}", device="GPU-0"),
                        summary="uncorrectable ECC error", starts_at=T0, ts=T0)
                for node in range(8 * k, 8 * k + 8)]

    async def main() -> tuple[list[dict[str, Any]], int, int]:
        runner, url, received = await receiver([])
        sink = WebhookSink(url, min_interval_s=0.0, digest_every_s=1.0)
        for k in range(6):
            await sink.deliver_many(batch(k))
            await sink.refresh()
        held = len(sink.holding())
        before = len(received)
        await asyncio.sleep(1.0)
        await sink.refresh()
        await sink.close()
        await runner.cleanup()
        return received, held, before

    received, held, before = asyncio.run(main())
    named = [i for m in received for i in _ids(m)]
    assert sorted(named) == sorted(f"dbe-{node}" for node in range(48))
    # The first batch a message each; the second would pass ten: one digest at once; the
    # next four within the window: one digest when it is over.
    assert [len(_ids(m)) for m in received] == [1] * 8 + [8, 32]
    assert received[-1]["text"].startswith("[FIRING critical] 32 findings at once")
    assert (held, before) == (32, 9)  # gathered, not sent, not committed past


def test_a_nodes_gpus_failing_together_are_one_message() -> None:
    """Eight GPUs of one node with the same fault in one batch: one message naming the
    eight, not eight; another node's finding its own."""
    node = [Finding(id=f"lost-{gpu}", fingerprint=f"lost-{gpu}", kind="gpu_lost",
                    severity="critical", state="firing",
                    subject=Subject(node="gpu-node-1", device=f"GPU-{gpu}"),
                    summary="GPU fallen off the bus", starts_at=T0, ts=T0) for gpu in range(8)]
    other = finding()

    async def main() -> list[dict[str, Any]]:
        runner, url, received = await receiver([])
        sink = WebhookSink(url, min_interval_s=0.0)
        await sink.deliver_many([*node, other])
        await sink.close()
        await runner.cleanup()
        return received

    received = asyncio.run(main())
    assert [_ids(m) for m in received] == [[f.id for f in node], [other.id]]
    assert received[0]["text"].startswith("[FIRING critical] 8 findings at once")
    assert "gpu-node-1 GPU-7" in received[0]["text"]
