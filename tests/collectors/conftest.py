"""Fixtures of the collector tests: a real HTTP exporter on loopback and a recording publisher.

The exporter is a real HTTP server (``http.server`` in a thread) on a free
loopback port, so the collectors' own HTTP clients, and a real Prometheus,
read it exactly as they would read dcgm-exporter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpusteward.broker import free_port
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
