"""Liveness and readiness of a long-running process, on HTTP for Kubernetes probes.

A process is *live* while its event loop keeps beating: a loop wedged by a
blocking call, or a worker whose consumer died while the process stayed up
(faust-streaming #175), stops beating and the liveness probe fails, so the
kubelet restarts it instead of leaving it. A process is *ready* when it does
its work: the stream worker once its partitions are assigned and its tables
recovered, the consumers once their topics exist, and none of them while
the broker has not answered for ``broker_silence_s`` (a broker frozen or cut
off: the process is up but does no work, and its readiness says so). A
process that finds its topics gone (a broker that came back empty) reports
why and is no longer live.

The server is the standard library's, on a thread of its own, so a probe
is answered even while the loop is busy, and it says "not live" precisely
when the loop is not beating.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LIVE_PATH = "/livez"
READY_PATH = "/readyz"


class Health:
    """The state the probes report; thread-safe (plain attribute writes)."""

    def __init__(self, stale_after_s: float = 30.0, broker_silence_s: float = 15.0) -> None:
        self.stale_after_s = stale_after_s
        """Seconds without a beat after which the process counts as wedged."""
        self.broker_silence_s = broker_silence_s
        """Seconds without an answer from the broker after which the process is not ready:
        three of :func:`watch_topics`' 5 s rounds, so one slow answer does not flap it."""
        self._last_beat = time.monotonic()
        self._broker_answered: float | None = None
        """When the broker last answered; None until it first does (not counted before)."""
        self._ready = False
        self._failure: str | None = None
        self.reason = "starting"

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self._ready = ready
        self.reason = reason or ("ready" if ready else "not ready")

    def broker_answered(self) -> None:
        self._broker_answered = time.monotonic()

    @property
    def broker_silent_s(self) -> float:
        """Seconds since the broker last answered; 0 until it first has."""
        if self._broker_answered is None:
            return 0.0
        return time.monotonic() - self._broker_answered

    def fail(self, reason: str) -> None:
        """Not live any more, for ``reason``: the supervisor should restart the process."""
        self._failure = reason
        self.set_ready(False, reason)

    @property
    def live(self) -> bool:
        if self._failure is not None:
            return False
        return time.monotonic() - self._last_beat < self.stale_after_s

    @property
    def ready(self) -> bool:
        return self._ready and self.live and self.broker_silent_s < self.broker_silence_s

    def report(self) -> dict[str, object]:
        silent_s = self.broker_silent_s
        reason = self._failure or (f"no answer from the broker for {silent_s:.0f}s"
                                   if silent_s >= self.broker_silence_s else self.reason)
        return {"live": self.live, "ready": self.ready, "reason": reason,
                "since_beat_s": round(time.monotonic() - self._last_beat, 3),
                "broker_silent_s": round(silent_s, 3)}

    def serve(self, port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
        """Answer ``/livez`` and ``/readyz`` on ``addr:port`` from a daemon thread."""
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == LIVE_PATH:
                    ok = health.live
                elif self.path == READY_PATH:
                    ok = health.ready
                else:
                    self.send_error(404)
                    return
                body = json.dumps(health.report()).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return None  # a probe every few seconds is not news

        server = ThreadingHTTPServer((addr, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
        return server


async def heartbeat(health: Health, interval_s: float = 1.0,
                    ready: Callable[[], bool] | None = None) -> None:
    """Beat every ``interval_s`` for as long as the running loop turns.

    With ``ready``, readiness follows it at each beat (a publisher's ``healthy``:
    records are reaching Kafka rather than piling up in its buffer).
    """
    while True:
        health.beat()
        if ready is not None:
            ok = ready()
            health.set_ready(ok, "" if ok else "records are not reaching Kafka")
        await asyncio.sleep(interval_s)


async def watch_topics(health: Health, names: list[str],
                       list_topics: Callable[[], Awaitable[Iterable[str]]],
                       interval_s: float = 5.0) -> str:
    """Return a reason once any of ``names`` is missing from ``await list_topics()``.

    Each answer counts as the broker's (:meth:`Health.broker_answered`); a round that
    gets none within ``interval_s`` (a frozen broker accepts connections and answers
    nothing) is given up, so that silence shows in readiness. A broker restarted
    without its data (the memory-only embedded one, or a cluster rebuilt) answers
    for topics it no longer has with UnknownTopicOrPartition, and clients retry
    that forever. The caller exits non-zero on the reason, so its supervisor
    restarts it and the start creates the topics again.
    """
    while True:
        await asyncio.sleep(interval_s)
        try:
            existing = set(await asyncio.wait_for(list_topics(), timeout=interval_s))
        except asyncio.CancelledError:
            raise
        except Exception:  # a broker that does not answer is not a missing topic
            continue
        health.broker_answered()
        missing = sorted(set(names) - existing)
        if missing:
            reason = "topics missing on the broker: " + ", ".join(missing)
            health.fail(reason)
            return reason


def probe(port: int, path: str = READY_PATH, timeout_s: float = 1.0) -> int | None:
    """The HTTP status a process's probe at ``path`` answers on this host (200 ready or
    live, 503 not), as a kubelet asks it; None when nothing answers on ``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}",
                                    timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None
