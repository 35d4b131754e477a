"""Fixtures of the collector tests: a real HTTP exporter on loopback and a recording publisher.

The exporter is a real HTTP server (``http.server`` in a thread) on a free
loopback port, so the collectors' own HTTP clients, and a real Prometheus,
read it exactly as they would read dcgm-exporter.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpusteward.broker import free_port
from gpusteward.collectors import dcgm
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent


def metric_value(text: str, line_start: str) -> float:
    """The value of the first line of a /metrics page that starts so; 0 when none does."""
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class FakeExporter:
    """Serves ``body`` at any path; ``declared_length`` lies about Content-Length when set."""

    def __init__(self, body: str = "", port: int | None = None) -> None:
        self.body = body
        self.status = 200
        self.declared_length: int | None = None
        self.requests = 0
        self.port = port or free_port()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self) -> FakeExporter:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                exporter.requests += 1
                payload = exporter.body.encode()
                self.send_response(exporter.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length",
                                 str(exporter.declared_length or len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        # A short poll interval so shutdown() at the end of a test takes milliseconds.
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def prometheus_query(url: str, promql: str) -> list[dict[str, Any]]:
    address = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(address, timeout=2) as answer:
        return json.load(answer)["data"]["result"]


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Starts real Prometheus servers on free loopback ports, each with the scrape jobs it is
    given (``external_labels``: an HA replica's own, which also shifts its scrape phase);
    returns a server's URL once every job has scraped its target."""
    if not Path(PROMETHEUS).exists():
        pytest.skip(f"{PROMETHEUS} is absent (Debian package 'prometheus'; .ci/system-deps)")
    started: list[subprocess.Popen[bytes]] = []

    def start(*jobs: dict[str, Any], scrape_interval: str = "1s",
              external_labels: dict[str, str] | None = None) -> str:
        port = free_port()
        home = tmp_path / f"prometheus-{port}"
        home.mkdir()
        config = home / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s",
                       "external_labels": external_labels or {}},
            "scrape_configs": list(jobs),
        }))
        log = home / "prometheus.log"
        with log.open("wb") as log_file:
            started.append(subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={home / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            if started[-1].poll() is not None:
                pytest.fail(f"prometheus exited: {log.read_text()[-2000:]}")
            try:
                scraped = {item["metric"]["job"]
                           for item in prometheus_query(url, "DCGM_FI_DEV_XID_ERRORS")}
                if len(scraped) == len(jobs):
                    return url
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no scrape within 30 s: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    yield start
    for process in started:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class AnsweringPrometheus:
    """A PrometheusConnect stand-in answering every instant query with fixed series."""

    def __init__(self, series: list[dcgm.Series]) -> None:
        self.series = series

    def custom_query(self, query: str, timeout: float | None = None) -> list[dict[str, Any]]:
        wanted = set(re.search(r'__name__=~"([^"]+)"', query)[1].split("|"))  # type: ignore[index]
        return [{"metric": {"__name__": s.name, **s.labels}, "value": [1.7e9, repr(s.value)]}
                for s in self.series if s.name in wanted]


RESEARCH = Path(__file__).resolve().parents[1] / "data" / "research"


@pytest.fixture
def dcgm_page() -> str:
    """The dcgm-exporter page of one node with two H100s, one MIG-partitioned."""
    return (RESEARCH / "dcgm_exporter_metrics.txt").read_text()


@pytest.fixture
def exporter_factory() -> Iterator[Callable[..., FakeExporter]]:
    """Makes (unstarted) exporters; stops every one at the end of the test."""
    made: list[FakeExporter] = []

    def make(body: str = "", port: int | None = None) -> FakeExporter:
        made.append(FakeExporter(body, port))
        return made[-1]

    yield make
    for exporter in made:
        exporter.stop()


@pytest.fixture
def exporter(dcgm_page: str, exporter_factory: Callable[..., FakeExporter]) -> FakeExporter:
    return exporter_factory(dcgm_page).start()


class RecordingPublisher:
    """A Publisher that keeps what it is given, in order."""

    def __init__(self) -> None:
        self.samples: list[NodeSample] = []
        self.hw_events: list[HwEvent] = []

    async def sample(self, sample: NodeSample) -> None:
        self.samples.append(sample)

    async def hw_event(self, event: HwEvent) -> None:
        self.hw_events.append(event)

    async def allocation(self, event: AllocationEvent) -> None:
        raise AssertionError("collectors of samples publish no allocations")

    async def queue(self, event: QueueEvent) -> None:
        raise AssertionError("collectors of samples publish no queue events")

    async def flush(self) -> None:
        pass


@pytest.fixture
def recorder() -> RecordingPublisher:
    return RecordingPublisher()
