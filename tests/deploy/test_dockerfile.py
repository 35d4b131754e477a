"""The Dockerfile builds the image the manifests and the compose file run.

No Docker engine is available where the tests run, so the image itself is
not built here; these checks hold the Dockerfile to what the manifests
assume (entry point, numeric non-root uid) and check that `pip install .`,
the Dockerfile's install step, ships the console script and package data.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines if line and not line.startswith("#")
    ]


def test_dockerfile_shape():
    steps = instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    assert ("RUN", "pip install . && rm -rf /src") in steps
    assert steps[-2] == ("ENTRYPOINT", '["gpusteward"]')
    (user,) = [value for op, value in steps if op == "USER"]
    assert user == "10001:10001"


def test_manifests_run_as_the_image_user(render):
    uid = 10001
    for variant in ("dev", "production"):
        for workload in render(variant).workloads():
            if workload["metadata"]["labels"].get("app.kubernetes.io/name") != "gpusteward":
                continue
            spec = render(variant).pod_spec(workload)
            container = spec["containers"][0]
            assert container["image"].split("/")[-1].startswith("gpusteward:")
            if "nvml" in container.get("args", []):
                continue
            assert spec["securityContext"]["runAsUser"] == uid
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert compose["x-gpusteward"]["user"] == f"{uid}:{uid}"


@pytest.mark.timeout(300)
def test_pip_install_dot_ships_the_entry_point_and_data(tmp_path):
    # The build context holds only what the Dockerfile COPYs, so a file the
    # install needs but the Dockerfile forgets fails here.
    context = tmp_path / "context"
    context.mkdir()
    for op, value in instructions():
        if op == "COPY":
            *sources, _ = value.split()
            for source in sources:
                path = REPO / source
                if path.is_dir():
                    shutil.copytree(path, context / source,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(path, context / source)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--quiet", "-w", str(tmp_path), str(context)],
        capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # The packaging declares every folder it ships (data folders included), so the build
    # says nothing: setuptools' "Package would be ignored" warnings were dozens once.
    assert "Warning" not in result.stderr, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("gpusteward-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("gpusteward/cli/__init__.py", "gpusteward/streams/app.py",
                   "gpusteward/rules/idle.py", "gpusteward/alerting/consumer.py",
                   "gpusteward/remediation/executor.py", "gpusteward/reports/build.py",
                   "gpusteward/sandbox/simulator/scenarios/eight-a100.yaml",
                   "gpusteward/metrics.py", "gpusteward/status.py"):
        assert needed in names, needed
    scenarios = {p.name for p in (REPO / "sandbox/simulator/scenarios").glob("*.yaml")}
    assert {n.rsplit("/", 1)[1] for n in names
            if n.startswith("gpusteward/sandbox/simulator/scenarios/")} == scenarios
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "gpusteward = gpusteward.cli:main" in zipfile.ZipFile(wheel).read(
        entry_points).decode()
