"""The report command keeps each week's files and posts its summary to a webhook.

The webhook is a real HTTP server on localhost, as Slack's incoming webhooks
take it: a POST of ``{"text": ...}``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusteward.cli import app
from gpusteward.reports import compute, store
from gpusteward.sandbox import rollups as synthetic

WEEK = compute.parse_week("2026-W47")


class Hook:
    """A webhook that records what it is sent and answers ``status``."""

    def __init__(self) -> None:
        self.posts: list[dict[str, str]] = []
        self.status = 200
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.posts.append(json.loads(body))
                self.send_response(hook.status)
                self.end_headers()
                self.wfile.write(b"ok" if hook.status == 200 else b"no_service")

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/services/T0/B0/x"


@pytest.fixture
def hook() -> Iterator[Hook]:
    running = Hook()
    thread = threading.Thread(target=running.server.serve_forever, daemon=True)
    thread.start()
    yield running
    running.server.shutdown()
    running.server.server_close()


@pytest.fixture(scope="module")
def rollups(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rollups")
    store.write(directory, synthetic.week_of_rollups(WEEK.start, gpus=8, workloads=6, teams=2,
                                                     minutes=2 * 24 * 60, seed=3))
    return directory


def _run(rollups: Path, out: Path, env: dict[str, str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["report", "--week", WEEK.label, "--rollups", str(rollups),
                                      "--out", str(out)], env=env)
    return result.exit_code, result.output


def test_summary_posted_and_the_week_kept(hook: Hook, rollups: Path, tmp_path: Path) -> None:
    kept = tmp_path / "weeks"
    code, output = _run(rollups, tmp_path / "out", {
        "GPUSTEWARD_REPORT__WEBHOOK_URL": hook.url,
        "GPUSTEWARD_REPORT__ARCHIVE_DIR": str(kept),
        "GPUSTEWARD_REPORT__REPORT_URL": "https://reports.example/gpu"})
    assert code == 0, output
    assert sorted(p.name for p in (kept / WEEK.label).iterdir()) == [
        "mig-parted.yaml", "report.html", "report.json", "report.md"]
    data = json.loads((kept / WEEK.label / "report.json").read_text())
    (post,) = hook.posts
    text = post["text"]
    assert text.startswith(f"*GPU report {WEEK.label}*: {data['totals']['gpus']} GPUs, "
                           f"{data['totals']['allocated_gpu_hours']:,.0f} GPU-h allocated")
    top = data["idle_holders"][0]
    assert f"{top['namespace']}/{top['pod']} ({top['team']})" in text
    assert "*Top savings*" in text
    assert text.endswith(f"Full report: https://reports.example/gpu/{WEEK.label}/report.html")


def test_the_cluster_is_named_in_the_summary_and_the_title(
        hook: Hook, rollups: Path, tmp_path: Path) -> None:
    """Several clusters' reports in one channel: GPUSTEWARD_CLUSTER says whose each is."""
    out = tmp_path / "out"
    code, output = _run(rollups, out, {"GPUSTEWARD_REPORT__WEBHOOK_URL": hook.url,
                                       "GPUSTEWARD_CLUSTER": "prod-east"})
    assert code == 0, output
    (post,) = hook.posts
    assert post["text"].startswith(f"*GPU report prod-east {WEEK.label}*: ")
    title = f"GPU right-sizing report, prod-east, week {WEEK.label}"
    assert (out / "report.md").read_text().startswith(f"# {title}\n")
    assert f"<h1>{title}</h1>" in (out / "report.html").read_text()
    assert json.loads((out / "report.json").read_text())["cluster"] == "prod-east"


def test_a_refused_post_fails_the_job_after_writing_the_files(
        hook: Hook, rollups: Path, tmp_path: Path) -> None:
    hook.status = 404
    code, output = _run(rollups, tmp_path / "out", {"GPUSTEWARD_REPORT__WEBHOOK_URL": hook.url})
    assert code == 1 and "webhook answered 404" in output
    assert (tmp_path / "out" / "report.json").exists() and len(hook.posts) == 1


def test_no_webhook_no_post(hook: Hook, rollups: Path, tmp_path: Path) -> None:
    code, output = _run(rollups, tmp_path / "out", {"GPUSTEWARD_REPORT__WEBHOOK_URL": ""})
    assert code == 0, output
    assert hook.posts == []
