"""Remediation and alerting costs: decision time per action, a DBE storm, Alertmanager refresh.

- dry-run decisions: pure executor cost per action (guards + describe), no I/O;
- storm: 250 of 500 GPU nodes report DBE at once; cordons go through the real
  ``kubernetes`` client to the local API double (sandbox/kube_api.py)
  over loopback HTTP, so the figure is client + thread hop + HTTP, not a real
  API server's latency;
- Alertmanager: posting 1,000 firing alerts in one refresh to a real
  Alertmanager (skipped when /usr/bin/prometheus-alertmanager is absent).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from figures import Figure

from gpusteward.alerting.alertmanager import AlertmanagerSink
from gpusteward.broker import free_port
from gpusteward.remediation.executor import Executor, NoBackend, RemediationSettings
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node
from gpusteward.schema import Action, Finding, Outcome, Subject
from gpusteward.settings import Settings


def _cordon(node: str, i: int) -> Action:
    return Action(idempotency_key=f"{node}-{i}/cordon", verb="cordon",
                  target=Subject(node=node), reason="DBE", rule="ecc_dbe",
                  finding_ids=[f"{node}-{i}"], ts=time.time())


def dry_run_decisions(count: int = 20_000) -> Figure:
    executor = Executor(Settings(), NoBackend())
    actions = [_cordon(f"gpu-{i % 500}", i) for i in range(count)]

    async def main() -> float:
        started = time.perf_counter()
        for action in actions:
            await executor.decide(action)
        return time.perf_counter() - started

    elapsed = asyncio.run(main())
    return Figure("dry-run decision per action", elapsed / count * 1e6, "µs")


def storm(nodes: int = 500) -> list[Figure]:
    with tempfile.TemporaryDirectory() as directory, KubeApiServer() as kube:
        names = [f"gpu-{i:03d}" for i in range(nodes)]
        kube.load(gpu_node(n) for n in names)
        kubeconfig = kube.write_kubeconfig(Path(directory) / "kubeconfig")
        backend = KubernetesBackend(KubeSettings(kubeconfig=str(kubeconfig)))
        executor = Executor(Settings(), backend, execute=True,
                            remediation=RemediationSettings(enabled_rules={"ecc_dbe"}))

        async def main() -> tuple[float, list[Outcome]]:
            started = time.perf_counter()
            outcomes = [(await executor.decide(_cordon(n, 0))).outcome
                        for n in names[: nodes // 2]]
            return time.perf_counter() - started, outcomes

        elapsed, outcomes = asyncio.run(main())
        return [
            Figure(f"storm: {nodes // 2} of {nodes} nodes report DBE, time to decide all",
                   elapsed * 1000, "ms"),
            Figure("storm: nodes cordoned (breaker limit min(20, 10 %))",
                   outcomes.count("executed"), "nodes"),
            Figure("storm: actions refused by the breaker", outcomes.count("refused"),
                   "actions"),
            Figure("storm: API writes", len([r for r in kube.requests if r.method != "GET"]),
                   "requests"),
        ]


def alertmanager_refresh(alerts: int = 1000) -> list[Figure]:
    binary = shutil.which("/usr/bin/prometheus-alertmanager")
    if binary is None:
        return []
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "am.yml"
        config.write_text("route: {receiver: blackhole}\nreceivers: [{name: blackhole}]\n")
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.path={directory}/data",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(200):
                try:
                    urllib.request.urlopen(f"{url}/-/ready", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            sink = AlertmanagerSink(url)
            findings = [Finding(id=f"fp{i}-1", fingerprint=f"fp{i}", kind="ecc_dbe",
                                severity="critical", state="firing",
                                subject=Subject(node=f"gpu-{i}"), summary="DBE",
                                starts_at=time.time(), ts=time.time()) for i in range(alerts)]

            async def main() -> tuple[float, float]:
                started = time.perf_counter()
                for finding in findings:
                    await sink.deliver(finding)
                one_by_one = time.perf_counter() - started
                started = time.perf_counter()
                await sink.refresh(force=True)
                refresh = time.perf_counter() - started
                await sink.close()
                return one_by_one, refresh

            one_by_one, refresh = asyncio.run(main())
        finally:
            process.terminate()
            process.wait(timeout=10)
    return [Figure("Alertmanager: post one new firing alert", one_by_one / alerts * 1000, "ms"),
            Figure(f"Alertmanager: re-send {alerts} firing alerts in one refresh",
                   refresh * 1000, "ms")]


def run() -> list[Figure]:
    return [dry_run_decisions(), *storm(), *alertmanager_refresh()]
