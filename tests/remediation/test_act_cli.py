"""``gpusteward act --dry-run``: one readable line per action, and nothing done."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import typer
from typer.testing import CliRunner

from gpusteward import cli, kafka, topics
from gpusteward.remediation.kubernetes import KubeSettings
from gpusteward.schema import Action, PodRef, Subject
from gpusteward.settings import Settings

GPUSTEWARD = Path(sys.executable).parent / "gpusteward"


def test_act_dry_run_prints_what_each_action_would_do(settings: Settings) -> None:
    actions = [
        Action(idempotency_key="f1/cordon", verb="cordon", target=Subject(node="gpu-7"),
               reason="uncorrectable ECC error on GPU-3 (gpu-7)", rule="ecc_dbe",
               finding_ids=["f1"], ts=1.0),
        Action(idempotency_key="f2/notify_owner", verb="notify_owner",
               target=Subject(pod=PodRef("ml-alice", "notebook-0")),
               reason="GPU idle for 30 min", rule="idle_holder", finding_ids=["f2"], ts=2.0),
    ]

    async def publish() -> None:
        await kafka.ensure_topics(settings)
        producer = kafka.producer(settings)
        await producer.start()
        for action in actions:
            await producer.send_and_wait(topics.ACTIONS.name(settings),
                                         msgspec.json.encode(action), key=b"k")
        await producer.stop()

    asyncio.run(publish())
    env = {**os.environ, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
           "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
           "COLUMNS": "200", "TERM": "dumb"}
    process = subprocess.Popen([str(GPUSTEWARD), "act", "--dry-run"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    try:
        while len(lines) < 2 and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if line.startswith(("DRY_RUN", "REFUSED")):
                lines.append(line.rstrip())
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=20)
    assert len(lines) == 2, lines
    cordon, notify = lines
    assert cordon.startswith("DRY_RUN  cordon         gpu-7")
    assert ("would cordon node gpu-7 (spec.unschedulable=true) because: uncorrectable ECC "
            "error on GPU-3 (gpu-7) [executor in dry-run mode]") in cordon
    assert "rule=ecc_dbe" in cordon
    assert notify.startswith("DRY_RUN  notify_owner   ml-alice/notebook-0")
    assert "(a Kubernetes Event and an annotation)" in notify


def test_act_gives_the_kubernetes_backend_the_drain_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``GPUSTEWARD_REMEDIATION__DRAIN_*_PODS`` reach the drain; both are off unless set."""
    given: list[KubeSettings] = []

    def backend(kube: KubeSettings) -> None:
        given.append(kube)
        raise typer.Exit(3)  # before the consumer starts

    monkeypatch.setattr(cli, "_kubernetes_backend", backend)
    args = ["act", "--execute", "--backend", "kubernetes"]
    assert CliRunner().invoke(cli.app, args).exit_code == 3
    monkeypatch.setenv("GPUSTEWARD_REMEDIATION__DRAIN_BARE_PODS", "true")
    assert CliRunner().invoke(cli.app, args).exit_code == 3
    assert [(k.drain_bare_pods, k.drain_emptydir_pods) for k in given] == [
        (False, False), (True, False)]


def test_act_refuses_re_created_nodes_where_event_time_is_the_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node action older than its node (deleted and re-created since) is refused where
    actions' event time is the cluster's clock: always, but where max_action_age_s is null
    (the simulation, whose event time runs on a past date)."""
    given: list[KubeSettings] = []

    def backend(kube: KubeSettings) -> None:
        given.append(kube)
        raise typer.Exit(3)

    monkeypatch.setattr(cli, "_kubernetes_backend", backend)
    args = ["act", "--execute", "--backend", "kubernetes"]
    assert CliRunner().invoke(cli.app, args).exit_code == 3
    monkeypatch.setenv("GPUSTEWARD_REMEDIATION__MAX_ACTION_AGE_S", "null")
    assert CliRunner().invoke(cli.app, args).exit_code == 3
    assert [k.refuse_newer_nodes for k in given] == [True, False]
