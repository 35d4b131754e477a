"""Fixtures of the alerting tests: a real Alertmanager.

The Alertmanager is the Debian package's binary, started on a free loopback
port with its own config and storage, without gossip (``start_alertmanager`` also
starts the members of an HA cluster); its tests are
skipped with the reason when the binary is missing (``.ci/system-deps``
installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusteward.broker import free_port

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"

CONFIG = """\
route:
  receiver: blackhole
  group_wait: 1h
receivers:
  - name: blackhole
"""


def start_alertmanager(workdir: Path, host: str = "127.0.0.1", port: int | None = None,
                       peers: tuple[str, ...] | None = None) -> subprocess.Popen[bytes]:
    """Start the real Alertmanager on ``host:port`` and wait until it is ready; ``peers``
    (gossip addresses, the first its own) makes it a member of an HA cluster, None starts
    it without gossip."""
    binary = shutil.which(ALERTMANAGER) or shutil.which("alertmanager")
    if binary is None:
        pytest.skip(f"{ALERTMANAGER} is not installed (Debian package prometheus-alertmanager; "
                    "`make system-deps` installs it)")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "alertmanager.yml").write_text(CONFIG)
    port = port or free_port()
    url = f"http://{host}:{port}"
    cluster = ["--cluster.listen-address="]
    if peers:
        cluster = [f"--cluster.listen-address={peers[0]}",
                   f"--cluster.advertise-address={peers[0]}",
                   "--cluster.settle-timeout=1s", "--cluster.pushpull-interval=1s",
                   "--cluster.gossip-interval=50ms",
                   *(f"--cluster.peer={peer}" for peer in peers[1:])]
    log = (workdir / "alertmanager.log").open("ab")
    process = subprocess.Popen(
        [binary, f"--config.file={workdir / 'alertmanager.yml'}",
         f"--storage.path={workdir / 'data'}", f"--web.listen-address={host}:{port}", *cluster],
        stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()
    deadline = time.monotonic() + 20
    while True:
        if process.poll() is not None:
            output = (workdir / "alertmanager.log").read_text()
            raise RuntimeError(f"alertmanager exited: {output}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_alertmanager(process)
            raise TimeoutError("alertmanager did not become ready in 20 s")
        time.sleep(0.1)


def stop_alertmanager(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a real Alertmanager, fresh for each test module."""
    port = free_port()
    process = start_alertmanager(tmp_path_factory.mktemp("alertmanager"), port=port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_alertmanager(process)
