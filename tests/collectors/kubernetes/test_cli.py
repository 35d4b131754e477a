"""``gpusteward watch`` as a process against the API double."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpusteward.sandbox.kube_api import KubeApiServer

from .conftest import FIXTURES


def test_watch_prints_events_and_stops_on_sigint(tmp_path: Path) -> None:
    executable = Path(sys.executable).parent / "gpusteward"
    with KubeApiServer() as api:
        api.load_dir(FIXTURES)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        out = tmp_path / "out.txt"
        with out.open("w") as sink:
            process = subprocess.Popen(
                [str(executable), "watch", "--stdout", "--kubeconfig", str(kubeconfig),
                 "--resources", "nodes,pods", "--loglevel", "warning"],
                stdout=sink, stderr=subprocess.PIPE, env={**os.environ,
                                                          "GPUSTEWARD_KUBE__RESYNC_PERIOD_S": "5"})
            deadline = time.monotonic() + 30
            while len(out.read_text().splitlines()) < 14 and time.monotonic() < deadline:
                time.sleep(0.1)
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=15)
    assert process.returncode == 0, stderr.decode()[-2000:]
    lines = [line.split("\t") for line in out.read_text().splitlines()]
    topics = [topic for topic, _, _ in lines]
    # Queue: the pending pod, and the JobSet's pod (a gang member, followed while bound).
    assert topics.count("allocations") == 6 + 6 and topics.count("queue") == 2
    pod = next(json.loads(value) for topic, key, value in lines
               if topic == "allocations" and key == "a100-spot-1" and '"type":"pod"' in value)
    assert (pod["pod"]["name"], pod["gpus"], pod["workload_kind"]) == (
        "train-llm-0-abcde", 4, "batch")
    # Only nodes and pods were asked for: no Kueue requests were made.
    assert not [r for r in api.requests if "kueue" in r.path]
