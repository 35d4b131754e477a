"""Running the stream worker as a child process, for the demo, the tests and the benchmarks.

Production runs ``gpusteward worker`` under a supervisor (a StatefulSet);
locally the same command is started here with the settings passed through
the environment, in its own session so that a Ctrl-C meant for the parent
does not kill it before the parent has shut its clients down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from gpusteward import health
from gpusteward.broker import free_port
from gpusteward.children import die_with_parent, stop_child
from gpusteward.health import READY_PATH
from gpusteward.settings import Settings


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a child process these settings."""
    kafka = settings.kafka
    env = {
        "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
        "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "GPUSTEWARD_KAFKA__FETCH_MAX_WAIT_MS": str(kafka.fetch_max_wait_ms),
        "GPUSTEWARD_KAFKA__NODE_PARTITIONS": str(kafka.node_partitions),
        "GPUSTEWARD_KAFKA__REBALANCE_TIMEOUT_S": str(kafka.rebalance_timeout_s),
        "GPUSTEWARD_KAFKA__SESSION_TIMEOUT_S": str(kafka.session_timeout_s),
        "GPUSTEWARD_KAFKA__MAX_MESSAGE_BYTES": str(kafka.max_message_bytes),
        "GPUSTEWARD_HEALTH_PORT": str(settings.health_port),
        "GPUSTEWARD_QUIET_PARTITION_S": str(settings.quiet_partition_s),
    }
    if kafka.group_instance_id is not None:
        env["GPUSTEWARD_KAFKA__GROUP_INSTANCE_ID"] = kafka.group_instance_id
    if settings.cluster:
        env["GPUSTEWARD_CLUSTER"] = settings.cluster
    return env


class WorkerProcess:
    """``gpusteward worker`` as a child process that can be killed and started again.

    With ``instance_id`` it is a static group member under that name (as a
    StatefulSet pod is under its own), and it always serves its health probe
    on a port of its own, which :meth:`wait_ready` polls.
    """

    def __init__(self, settings: Settings, log_path: Path, loglevel: str = "warn",
                 instance_id: str | None = None) -> None:
        kafka = settings.kafka.model_copy(update={"group_instance_id": instance_id})
        settings = settings.model_copy(update={"kafka": kafka, "health_port": free_port()})
        self.settings = settings
        self.log_path = log_path
        self.loglevel = loglevel
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **settings_env(self.settings)}
        datadir = tempfile.mkdtemp(prefix="gpusteward-worker-")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", "gpusteward.cli", "worker", "--datadir", datadir,
                 "--loglevel", self.loglevel],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent,
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def probe(self, path: str = READY_PATH) -> bool:
        """True when the worker answers ``path`` (``/readyz`` or ``/livez``) with 200."""
        return health.probe(self.settings.health_port, path) == 200

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Seconds until the worker reports ready; TimeoutError if it does not in time."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.probe():
                return time.monotonic() - started
            if not self.alive:
                raise RuntimeError(f"the worker exited (code {self.exit_code}); see "
                                   f"{self.log_path}")
            time.sleep(0.05)
        raise TimeoutError(f"the worker was not ready within {timeout_s}s; see {self.log_path}")

    @property
    def exit_code(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def freeze(self) -> None:
        """SIGSTOP: a worker that hangs (a long GC pause, a stuck host) without dying."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to commit offsets or flush anything."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        process, self.process = self.process, None
        stop_child(process, timeout_s)

    def __enter__(self) -> WorkerProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
