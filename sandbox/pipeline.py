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
from pathlib import Path
from types import TracebackType

from gpusteward.children import die_with_parent, stop_child
from gpusteward.settings import Settings


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a child process these settings."""
    kafka = settings.kafka
    return {
        "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
        "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "GPUSTEWARD_KAFKA__FETCH_MAX_WAIT_MS": str(kafka.fetch_max_wait_ms),
        "GPUSTEWARD_KAFKA__NODE_PARTITIONS": str(kafka.node_partitions),
        "GPUSTEWARD_KAFKA__REBALANCE_TIMEOUT_S": str(kafka.rebalance_timeout_s),
    }


class WorkerProcess:
    """``gpusteward worker`` as a child process that can be killed and started again."""

    def __init__(self, settings: Settings, log_path: Path, loglevel: str = "warn") -> None:
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
