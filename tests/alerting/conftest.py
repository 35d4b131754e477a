"""Fixtures of the alerting tests: a real Alertmanager.

The Alertmanager is the Debian package's binary, started on a free loopback
port with its own config and storage and without gossip; its tests are
skipped with the reason when the binary is missing (``.ci/system-deps``
installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"

CONFIG = """\
route:
  receiver: blackhole
  group_wait: 1h
receivers:
  - name: blackhole
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a real Alertmanager, fresh for each test module."""
    binary = shutil.which(ALERTMANAGER) or shutil.which("alertmanager")
    if binary is None:
        pytest.skip(f"{ALERTMANAGER} is not installed (Debian package prometheus-alertmanager; "
                    "`make system-deps` installs it)")
    workdir: Path = tmp_path_factory.mktemp("alertmanager")
    (workdir / "alertmanager.yml").write_text(CONFIG)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (workdir / "alertmanager.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={workdir / 'alertmanager.yml'}",
         f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address="],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            if process.poll() is not None:
                output = (workdir / "alertmanager.log").read_text()
                raise RuntimeError(f"alertmanager exited: {output}")
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("alertmanager did not become ready in 20 s")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
