"""The Alertmanager sink against a real Alertmanager, read back through its v2 API."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from typing import Any

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.alerting.alertmanager import AlertmanagerSink, parse_targets
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.rules.findings import resolved
from gpusteward.schema import Evidence, Finding, PodRef, Subject
from gpusteward.settings import Settings


def firing(fp: str, *, node: str = "gpu-node-1", severity: str = "critical") -> Finding:
    return Finding(
        id=f"{fp}-1000", fingerprint=fp, kind="ecc_dbe", severity=severity,  # type: ignore[arg-type]
        state="firing", subject=Subject(node=node, device="GPU-1234",
                                        pod=PodRef(namespace="ml-alice", name="train-0")),
        summary=f"uncorrectable ECC error on GPU-1234 ({node})",
        starts_at=time.time() - 60, ts=time.time() - 60,
        evidence=Evidence(window_start=0, window_end=1, values={"ecc_dbe_volatile": 2}),
        runbook="drain and reset the GPU",
    )


def ending(finding: Finding) -> Finding:
    # The rules' resolved record: same id and fingerprint, severity info.
    return resolved(finding.id, finding.fingerprint, finding.kind, finding.subject,
                    "DBE counter back to 0", finding.starts_at, time.time())


def active_alerts(url: str, fingerprint: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"filter": f'fingerprint="{fingerprint}"'})
    with urllib.request.urlopen(f"{url}/api/v2/alerts?{query}", timeout=5) as response:
        return json.loads(response.read())


def ends_at(alert: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(alert["endsAt"].replace("Z", "+00:00")).timestamp()


def test_firing_finding_becomes_an_alert_with_labels_and_annotations(alertmanager: str) -> None:
    sink = AlertmanagerSink(alertmanager, generator_url="http://grafana/d/gpusteward")
    finding = firing("fp-labels")

    async def main() -> None:
        await sink.deliver(finding)
        await sink.close()

    asyncio.run(main())
    [alert] = active_alerts(alertmanager, "fp-labels")
    assert alert["labels"] == {
        "alertname": "GpuStewardEccDbe", "kind": "ecc_dbe", "severity": "critical",
        "fingerprint": "fp-labels", "source": "gpusteward", "node": "gpu-node-1",
        "device": "GPU-1234", "namespace": "ml-alice", "pod": "train-0",
    }
    assert alert["annotations"]["summary"] == finding.summary
    assert alert["annotations"]["runbook"] == "drain and reset the GPU"
    assert alert["annotations"]["evidence"] == "ecc_dbe_volatile=2"
    assert alert["generatorURL"] == "http://grafana/d/gpusteward?fingerprint=fp-labels"
    assert alert["status"]["state"] == "active"
    assert abs(ends_at(alert) - (time.time() + 240)) < 30


def test_resolved_finding_ends_the_alert_even_with_another_severity(alertmanager: str) -> None:
    sink = AlertmanagerSink(alertmanager)
    finding = firing("fp-resolve")

    async def main() -> None:
        await sink.deliver(finding)
        assert len(active_alerts(alertmanager, "fp-resolve")) == 1
        await sink.deliver(ending(finding))
        await sink.close()

    asyncio.run(main())
    assert active_alerts(alertmanager, "fp-resolve") == []
    assert sink.firing == {} and sink.pending_resolved == {}


def test_a_restarted_sink_still_ends_the_alert_it_did_not_open(alertmanager: str) -> None:
    finding = firing("fp-restart", severity="warning")

    async def main() -> None:
        first = AlertmanagerSink(alertmanager)
        await first.deliver(finding)
        await first.close()
        assert len(active_alerts(alertmanager, "fp-restart")) == 1
        after_restart = AlertmanagerSink(alertmanager)
        await after_restart.deliver(ending(finding))
        await after_restart.close()

    asyncio.run(main())
    assert active_alerts(alertmanager, "fp-restart") == []


def test_firing_alerts_are_resent_before_they_expire(alertmanager: str) -> None:
    offset = [0.0]
    sink = AlertmanagerSink(alertmanager, resend_interval_s=60,
                            clock=lambda: time.time() + offset[0])

    async def main() -> tuple[float, float, float]:
        await sink.deliver(firing("fp-resend"))
        first = ends_at(active_alerts(alertmanager, "fp-resend")[0])
        offset[0] = 30  # within the interval: nothing is re-sent
        await sink.refresh()
        unchanged = ends_at(active_alerts(alertmanager, "fp-resend")[0])
        offset[0] = 61
        await sink.refresh()
        later = ends_at(active_alerts(alertmanager, "fp-resend")[0])
        await sink.close()
        return first, unchanged, later

    first, unchanged, later = asyncio.run(main())
    assert unchanged == first
    # Re-sent one interval later: endsAt moved on by about that much, long before it passed.
    assert 55 < later - first < 70


def test_an_unreachable_alertmanager_keeps_the_alert_for_the_next_refresh(
        alertmanager: str) -> None:
    sink = AlertmanagerSink("http://127.0.0.1:9", timeout_s=2)
    finding = firing("fp-retry")

    async def main() -> None:
        await sink.deliver(finding)  # connection refused: logged, kept
        assert "fp-retry" in sink.firing
        sink.targets = parse_targets(alertmanager)  # Alertmanager is back
        await sink.refresh(force=True)
        await sink.close()

    asyncio.run(main())
    assert len(active_alerts(alertmanager, "fp-retry")) == 1


def test_findings_consumer_feeds_alertmanager_from_the_topic(alertmanager: str,
                                                             settings: Settings) -> None:
    fired = firing("fp-topic")

    async def main() -> None:
        await kafka.ensure_topics(settings)
        producer = kafka.producer(settings)
        await producer.start()
        await producer.send_and_wait(topics.FINDINGS.name(settings), msgspec.json.encode(fired),
                                     key=fired.fingerprint.encode())
        await producer.send_and_wait(topics.FINDINGS.name(settings), msgspec.json.encode(fired),
                                     key=fired.fingerprint.encode())  # a redelivery
        stop = asyncio.Event()
        seen: list[Finding] = []
        consumer = FindingsConsumer(settings, [AlertmanagerSink(alertmanager)],
                                    group_id="am-test", on_finding=seen.append)
        task = asyncio.create_task(consumer.run(stop))
        for _ in range(200):
            if active_alerts(alertmanager, "fp-topic"):
                break
            await asyncio.sleep(0.05)
        assert len(active_alerts(alertmanager, "fp-topic")) == 1
        await producer.send_and_wait(topics.FINDINGS.name(settings),
                                     msgspec.json.encode(ending(fired)),
                                     key=fired.fingerprint.encode())
        for _ in range(200):
            if not active_alerts(alertmanager, "fp-topic"):
                break
            await asyncio.sleep(0.05)
        stop.set()
        await task
        await producer.stop()
        assert [f.state for f in seen] == ["firing", "resolved"]

    asyncio.run(main())
    assert active_alerts(alertmanager, "fp-topic") == []



def test_a_failing_alertmanager_gets_one_request_per_retry_interval_not_one_per_finding(
        ) -> None:
    """Behind an Alertmanager that fails (or hangs, a timeout each), a burst of findings
    posted one request each held the consumer, and every sink after this one, for one
    failure per finding. After a failure the sink keeps what arrives and the refresh
    after the retry interval sends it all in one request."""

    now = [1_000.0]
    app, received = _recording_alertmanager([503])

    async def main() -> list[str]:
        runner, url = await serve_app(app)
        sink = AlertmanagerSink(url,
                                clock=lambda: now[0])
        try:
            for i in range(5):
                await sink.deliver(firing(f"fp-burst-{i}"))
            assert len(received) == 1  # the first failed; the next four were kept
            now[0] += 61.0
            await sink.refresh()
            return list(sink.firing)
        finally:
            await sink.close()
            await runner.cleanup()

    kept = asyncio.run(main())
    burst = [f"fp-burst-{i}" for i in range(5)]
    assert kept == burst
    assert [sorted(a["labels"]["fingerprint"] for a in body) for body in received] == [
        ["fp-burst-0"], burst]


async def serve_app(app: Any) -> tuple[Any, str]:
    """Start ``app`` on a free local port: its runner (to clean up) and its URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _recording_alertmanager(statuses: list[int]) -> tuple[Any, list[list[dict[str, Any]]]]:
    """An aiohttp app that records each POSTed body and answers ``statuses`` in turn (200
    once they run out)."""
    from aiohttp import web

    received: list[list[dict[str, Any]]] = []

    async def alerts(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response(status=statuses.pop(0) if statuses else 200)

    app = web.Application()
    app.router.add_post("/api/v2/alerts", alerts)
    return app, received


def test_a_burst_of_findings_in_one_consumer_batch_is_one_request() -> None:
    """A healthy Alertmanager got one POST per new finding: a burst of 1,000 findings was
    1,000 requests. The consumer hands a batch's new findings to the sink at once, and it
    posts them in one request; an episode that fires and resolves in the batch is sent
    once, resolved."""

    settings = Settings()
    app, received = _recording_alertmanager([])

    async def main() -> AlertmanagerSink:
        runner, url = await serve_app(app)
        sink = AlertmanagerSink(url)
        consumer = FindingsConsumer(settings, [sink], group_id="am-batch")
        burst = [firing(f"fp-many-{i}") for i in range(1000)]
        new: list[Finding] = []
        try:
            for finding in [*burst, ending(burst[0])]:
                await consumer._handle(None, msgspec.json.encode(finding),  # type: ignore[arg-type]
                                       finding.fingerprint.encode(), batch=new)
            await consumer._deliver(new)
            return sink
        finally:
            await sink.close()
            await runner.cleanup()

    sink = asyncio.run(main())
    assert len(received) == 1
    by_fingerprint = {a["labels"]["fingerprint"]: a for a in received[0]}
    assert len(received[0]) == len(by_fingerprint) == 1000
    assert ends_at(by_fingerprint["fp-many-0"]) < time.time()  # ended, not alive
    assert ends_at(by_fingerprint["fp-many-1"]) > time.time()
    assert "fp-many-0" not in sink.firing and len(sink.firing) == 999
    assert sink.pending_resolved == {}


def test_a_failed_batch_post_is_posted_again_by_the_next_refresh() -> None:

    now = [1_000.0]
    app, received = _recording_alertmanager([503])
    ended = ending(firing("fp-retry-0"))

    async def main() -> AlertmanagerSink:
        runner, url = await serve_app(app)
        sink = AlertmanagerSink(url,
                                clock=lambda: now[0])
        try:
            opened = [firing(f"fp-retry-{i}") for i in range(3)]
            await sink.deliver_many(opened[:2])
            await sink.deliver_many([ended])  # backing off: kept, not posted
            assert len(received) == 1
            now[0] += 61.0
            await sink.refresh()
            return sink
        finally:
            await sink.close()
            await runner.cleanup()

    sink = asyncio.run(main())
    assert [sorted(a["labels"]["fingerprint"] for a in body) for body in received] == [
        ["fp-retry-0", "fp-retry-1"], ["fp-retry-0", "fp-retry-1"]]
    resent = {a["labels"]["fingerprint"]: a for a in received[1]}
    assert ends_at(resent["fp-retry-0"]) == pytest.approx(ended.ends_at)  # the resolution
    assert ends_at(resent["fp-retry-1"]) == pytest.approx(now[0] + sink.lifetime_s)
    assert sink.pending_resolved == {}


def test_a_steady_stream_of_new_findings_does_not_stop_the_resends(alertmanager: str) -> None:
    """Every accepted post counted as the resend: with a new finding at least once a
    minute (any large fleet), the alerts already firing were never re-posted and lapsed at
    their ``endsAt``, four minutes on, announced as resolved while still firing."""
    now = [time.time()]
    sink = AlertmanagerSink(alertmanager, clock=lambda: now[0])

    async def main() -> None:
        await sink.deliver(firing("fp-steady"))
        for i in range(6):  # a new finding every 50 s for 5 minutes
            now[0] += 50
            await sink.deliver(firing(f"fp-steady-{i}"))
            await sink.refresh()
        await sink.close()

    asyncio.run(main())
    [alert] = active_alerts(alertmanager, "fp-steady")
    assert ends_at(alert) > now[0] + 60  # re-posted within the last minute: still firing
