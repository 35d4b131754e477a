"""The alerts process against an HA pair of real Alertmanagers (gossiping, as
kube-prometheus-stack runs them): every alert reaches every replica, one replica down or
hanging holds nothing up, and resolving asks every replica.

Alertmanager replicas gossip silences and the notification log, not alerts; the
Alertmanager README: "Do not load balance traffic between Prometheus and its
Alertmanagers ... The Alertmanager implementation expects all alerts to be sent to all
Alertmanagers to ensure high availability."
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from gpusteward import kafka, topics
from gpusteward.alerting.alertmanager import AlertmanagerSink, parse_targets
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.broker import free_port
from gpusteward.cli import app
from gpusteward.errors import ConfigError
from gpusteward.schema import Finding
from gpusteward.settings import Settings

from .conftest import start_alertmanager, stop_alertmanager
from .test_alertmanager import active_alerts, ending, firing, serve_app

HOSTS = ("127.0.0.1", "127.0.0.2")
"""The replicas' addresses: one port, two loopback addresses, as a headless Service's
pods answer on one port at their own IPs."""


class Pair:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.gossip = [f"{host}:{free_port()}" for host in HOSTS]
        self.urls = [f"http://{host}:{self.port}" for host in HOSTS]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * len(HOSTS)
        for i in range(len(HOSTS)):
            self.start(i)

    def start(self, i: int) -> None:
        """Start replica ``i`` (again: a restart keeps its storage, which holds silences
        and the notification log, never alerts)."""
        peers = (self.gossip[i], *(g for g in self.gossip if g != self.gossip[i]))
        self.processes[i] = start_alertmanager(self.root / f"am-{i}", HOSTS[i], self.port,
                                               peers)

    def stop(self, i: int) -> None:
        process = self.processes[i]
        if process is not None:
            stop_alertmanager(process)
            self.processes[i] = None


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    replicas = Pair(tmp_path)
    try:
        yield replicas
    finally:
        for i in range(len(HOSTS)):
            replicas.stop(i)


async def _until(check: object, timeout_s: float = 10.0) -> float:
    """Seconds until ``check()`` is true; fails after ``timeout_s``."""
    started = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - started < timeout_s, "not within the time allowed"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def test_gossip_does_not_copy_alerts_between_replicas(pair: Pair) -> None:
    """Why the sink posts to each replica: one posted to one replica only is on that one
    only (and gone when it restarts)."""
    sink = AlertmanagerSink(pair.urls[0])

    async def main() -> None:
        await sink.deliver(firing("fp-gossip"))
        await sink.close()
        await asyncio.sleep(2)  # several gossip and push-pull intervals

    asyncio.run(main())
    assert len(active_alerts(pair.urls[0], "fp-gossip")) == 1
    assert active_alerts(pair.urls[1], "fp-gossip") == []


def test_the_alerts_process_posts_to_every_replica_and_survives_one_down(
        pair: Pair, settings: Settings) -> None:
    """Through the findings topic and the alerts process's consumer, with the setting's
    comma-separated list: each replica has each alert; with one replica stopped, the
    other still gets new alerts and their resolutions at once; the replica started
    again gets the alerts still firing at the next refresh; a restarted process
    resolves an alert it never saw fire by asking the replicas."""
    first, second = firing("fp-ha-1"), firing("fp-ha-2")
    delays: dict[str, float] = {}

    async def main() -> None:
        await kafka.ensure_topics(settings)
        producer = kafka.producer(settings)
        await producer.start()

        async def publish(finding: Finding) -> None:
            await producer.send_and_wait(topics.FINDINGS.name(settings),
                                         msgspec.json.encode(finding),
                                         key=finding.fingerprint.encode())

        stop = asyncio.Event()
        # A resend interval of 2 s (60 s deployed) lets the test see the refresh.
        sink = AlertmanagerSink(",".join(pair.urls), timeout_s=3, resend_interval_s=2)
        task = asyncio.create_task(FindingsConsumer(settings, [sink], group_id="am-ha").run(stop))
        await publish(first)
        await _until(lambda: all(len(active_alerts(u, "fp-ha-1")) == 1 for u in pair.urls))

        pair.stop(1)
        sent = time.monotonic()
        await publish(second)
        await _until(lambda: len(active_alerts(pair.urls[0], "fp-ha-2")) == 1)
        delays["new alert, one replica down"] = time.monotonic() - sent
        sent = time.monotonic()
        await publish(ending(first))
        await _until(lambda: active_alerts(pair.urls[0], "fp-ha-1") == [])
        delays["resolution, one replica down"] = time.monotonic() - sent
        assert "fp-ha-1" in sink.pending_resolved  # kept for the replica that is down

        pair.start(1)  # it lost every alert: Alertmanager keeps none on disk
        restarted = time.monotonic()
        await _until(lambda: len(active_alerts(pair.urls[1], "fp-ha-2")) == 1)
        delays["firing alert at the restarted replica"] = time.monotonic() - restarted
        assert active_alerts(pair.urls[1], "fp-ha-1") == []
        stop.set()
        await task

        # A restarted process: it never saw fp-ha-2 fire; the replica that is up holds it.
        after_restart = AlertmanagerSink(",".join(pair.urls), timeout_s=3)
        await after_restart.deliver(ending(second))
        await after_restart.close()
        await producer.stop()

    asyncio.run(main())
    assert all(active_alerts(url, "fp-ha-2") == [] for url in pair.urls)
    print(delays)
    assert delays["new alert, one replica down"] < 1, delays
    assert delays["resolution, one replica down"] < 1, delays
    assert delays["firing alert at the restarted replica"] < 2 * 2 + 1, delays


def test_dns_entries_post_to_every_address_looked_up_at_each_refresh(pair: Pair) -> None:
    """``dns+http://name:port``: every address of the name is a replica, looked up again
    at each refresh, so a replica that (re)appears gets every firing alert then."""
    records = {"alertmanager-operated.monitoring.svc": [HOSTS[0]]}
    now = [time.time()]

    async def resolve(host: str, port: int) -> list[str]:
        assert port == pair.port
        return records[host]

    sink = AlertmanagerSink(f"dns+http://alertmanager-operated.monitoring.svc:{pair.port}",
                            resolve=resolve, clock=lambda: now[0])

    async def main() -> None:
        await sink.deliver(firing("fp-dns"))
        assert len(active_alerts(pair.urls[0], "fp-dns")) == 1
        assert active_alerts(pair.urls[1], "fp-dns") == []  # not in the records yet
        records["alertmanager-operated.monitoring.svc"] = list(HOSTS)  # a replica joins
        now[0] += 61
        await sink.refresh()
        assert len(active_alerts(pair.urls[1], "fp-dns")) == 1
        await sink.deliver(ending(firing("fp-dns")))
        await sink.close()

    asyncio.run(main())
    assert all(active_alerts(url, "fp-dns") == [] for url in pair.urls)


def test_a_hanging_replica_does_not_hold_up_the_other(alertmanager: str) -> None:
    """A replica that accepts the connection and never answers: the other has the alert
    at once; after that one timeout the hanging one is retried after each back-off in the
    background, so no later delivery or refresh waits for it."""
    from aiohttp import web

    released = asyncio.Event()
    hung: list[float] = []

    async def hang(request: web.Request) -> web.Response:
        hung.append(time.monotonic())
        await released.wait()  # until the test ends
        return web.Response()

    hanging = web.Application()
    hanging.router.add_post("/api/v2/alerts", hang)

    async def main() -> dict[str, float]:
        runner, url = await serve_app(hanging)
        # A resend interval of 2 s (60 s deployed): a 0.5 s back-off, over several times.
        sink = AlertmanagerSink(f"{url},{alertmanager}", timeout_s=2, resend_interval_s=2)
        try:
            delivering = asyncio.create_task(sink.deliver(firing("fp-hang-0")))
            arrived = await _until(lambda: len(active_alerts(alertmanager, "fp-hang-0")) == 1)
            await delivering  # the one timeout
            slowest = 0.0
            for i in range(1, 21):  # a new finding every 0.3 s for 6 s
                started = time.monotonic()
                await sink.deliver(firing(f"fp-hang-{i}"))
                await sink.refresh()
                slowest = max(slowest, time.monotonic() - started)
                assert len(active_alerts(alertmanager, f"fp-hang-{i}")) == 1
                await asyncio.sleep(0.3)
            return {"first alert at the healthy replica": arrived,
                    "slowest later delivery and refresh": slowest}
        finally:
            released.set()
            await sink.close()
            await runner.cleanup()

    figures = asyncio.run(main())
    print(figures, {"requests to the hanging replica": len(hung)})
    assert figures["first alert at the healthy replica"] < 1.5
    assert figures["slowest later delivery and refresh"] < 0.5, figures
    assert 2 <= len(hung) <= 5  # retried after each back-off, not once per finding


@pytest.mark.parametrize(("value", "says"), [
    ("http://am-0:9093,,http://am-1:9093", "entry 2 of 3 is empty"),
    ("http://am-0:9093,alertmanager:9093", "entry 2 of 2 ('alertmanager:9093') is no http"),
    ("http://user:s3cret@am-0:9093/?x=1", "entry 1 of 1 (http://am-0:9093/…) has a query"),
    ("dns+http://alertmanager-operated", "(dns+http://alertmanager-operated) has no port"),
    ("http://am-0:99999", "is no URL"),
])
def test_a_bad_url_list_names_the_setting_and_the_entry(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_targets(value)
    assert "GPUSTEWARD_ALERTMANAGER_URL" in str(raised.value) and says in str(raised.value)
    assert "s3cret" not in str(raised.value)
    result = CliRunner().invoke(app, ["alerts"], env={"GPUSTEWARD_ALERTMANAGER_URL": value})
    assert result.exit_code == 2 and "GPUSTEWARD_ALERTMANAGER_URL" in result.output
    assert "s3cret" not in result.output


def test_a_dns_entry_is_looked_up_with_the_system_resolver(alertmanager: str) -> None:
    """``dns+http://localhost:PORT`` through the real resolver: its 127.0.0.1 record is the
    Alertmanager (a ::1 record, where the resolver gives one, is a replica that is down)."""
    port = alertmanager.rsplit(":", 1)[1]
    sink = AlertmanagerSink(f"dns+http://localhost:{port}", timeout_s=2)

    async def main() -> list[str]:
        await sink.deliver(firing("fp-resolver"))
        await sink.close()
        return list(sink.replicas)

    replicas = asyncio.run(main())
    assert f"http://127.0.0.1:{port}" in replicas
    assert len(active_alerts(alertmanager, "fp-resolver")) == 1


def test_a_resolution_while_no_replica_can_be_looked_up_is_sent_once_one_is(
        alertmanager: str) -> None:
    """The process restarts while DNS fails: the alert it restored from the topic ends,
    and the replica found later is told so, not left to time the alert out."""
    port = int(alertmanager.rsplit(":", 1)[1])
    dns_up = [False]
    now = [time.time()]

    async def resolve(host: str, port: int) -> list[str]:
        if not dns_up[0]:
            raise OSError("Temporary failure in name resolution")
        return ["127.0.0.1"]

    finding = firing("fp-no-dns")

    async def main() -> None:
        before = AlertmanagerSink(alertmanager)
        await before.deliver(finding)  # posted by the process before the restart
        await before.close()
        sink = AlertmanagerSink(f"dns+http://alertmanager-operated:{port}", resolve=resolve,
                                clock=lambda: now[0])
        sink.restore([finding])
        await sink.refresh()  # no replica: nothing sent, nothing lost
        await sink.deliver(ending(finding))
        assert list(sink.pending_resolved) == ["fp-no-dns"]
        dns_up[0] = True
        now[0] += 61
        await sink.refresh()
        assert sink.pending_resolved == {}
        await sink.close()

    asyncio.run(main())
    assert active_alerts(alertmanager, "fp-no-dns") == []
