"""A node whose eight GPUs fall off the bus at once, with a pod its budget keeps there.

The simulator's world drives the real stream worker, a child process; the remediation
executor runs in-process against the API-server double (as in ``test_reask.py``), with
the wall clock as in production: the scenario's event time ends now. The worker raises
one ``gpu_lost`` finding per GPU, and each asks for a drain of the node under its own
key, asked again every ``reask_s`` while the GPU stays lost.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.sandbox.simulator.scenario import Scenario
from gpusteward.schema import Action, ActionResult
from tests.e2e.records import decoded
from tests.e2e.test_reask import INTERVAL_S, _execute, _fresh, _simulate
from tests.remediation.cluster import node, pdb, pod

pytestmark = pytest.mark.e2e

HOURS = 1
GPUS = 8
LOST = "gpu-1"


def scenario() -> Scenario:
    """An hour of two idle-free 8-GPU nodes; at 10 min every GPU of gpu-1 reports Xid 79."""
    return Scenario.model_validate({
        "name": "node-off-the-bus", "seed": 5,
        "start_ts": time.time() - HOURS * 3600 - INTERVAL_S,
        "duration_s": HOURS * 3600, "sample_interval_s": INTERVAL_S, "acceleration": 0,
        "nodes": [{"prefix": "gpu", "count": 2, "gpu_model": "NVIDIA H100 80GB HBM3",
                   "gpus": GPUS, "mem_gib": 80}],
        "users": ["alice", "bob"],
        "workloads": [{"group": "train", "count": 2, "kind": "batch", "gpus": GPUS,
                       "mem_gib": [40, 70], "phases": [{"util": [70, 99]}]}],
        "faults": [{"kind": "xid", "xid": 79, "node": LOST, "gpu": gpu, "at_s": 600}
                   for gpu in range(GPUS)],
    })


def test_a_node_drained_for_each_of_its_gpus_is_drained_once_per_re_ask_not_once_per_gpu(
        broker: EmbeddedBroker, tmp_path: Path, kube_api: KubeApiServer,
        kubeconfig: Path) -> None:
    """Before, each GPU's finding drained the node on its own key, each blocked drain waited
    out drain_timeout_s and told the blocked pod's owner again, and so did each key's
    re-ask: eight Warning Events on the pod per re-ask, and the executor busy eight drain
    timeouts per node every reask_s. Now a drain of a node another key drained within
    reask_s is skipped, audited as such, and the pod's owner hears once per re-ask."""
    settings = _fresh(broker, "e2e-drain-storm")
    asyncio.run(kafka.ensure_topics(settings))
    asyncio.run(_simulate(settings, tmp_path, SimulatedCluster(scenario())))
    kube_api.load(node(f"gpu-{i}", gpus=GPUS) for i in (1, 2))
    kube_api.load(pod("ml-alice", "serving-0", LOST, labels={"app": "serving"}))
    kube_api.load(pdb("ml-alice", "serving", {"app": "serving"}, allowed=0))
    backend = KubernetesBackend(KubeSettings(
        kubeconfig=str(kubeconfig), request_timeout_s=5, drain_timeout_s=0.2,
        eviction_backoff_s=0.01, eviction_backoff_max_s=0.05))
    executor = Executor(settings, backend, execute=True, group_id="drains",
                        remediation=RemediationSettings(enabled_rules={"gpu_lost"}))
    (go := asyncio.Event()).set()
    asyncio.run(_execute(executor, settings, go))

    drains = [a for a in asyncio.run(decoded(settings, topics.ACTIONS, Action))
              if a.verb == "drain"]
    keys = {a.idempotency_key for a in drains}
    assert len(keys) == GPUS and {a.target.node for a in drains} == {LOST}
    rounds = 1 + max(a.reask for a in drains)
    assert rounds >= 2  # asked again while the GPUs stay lost
    audit = [r for r in asyncio.run(decoded(settings, topics.ACTION_RESULTS, ActionResult))
             if r.verb == "drain"]
    tried = [r for r in audit if r.outcome == "failed"]
    told = [e for e in kube_api.objects("Event") if e.get("reason") == "GpuStewardDrainBlocked"]
    print(f"drains asked {len(drains)} ({len(keys)} keys, {rounds} rounds); audit "
          f"{Counter(r.outcome for r in audit)}; blocked-pod events {len(told)}")
    assert len(tried) <= rounds, Counter(r.outcome for r in audit)
    assert len(told) <= rounds
    skipped = [r for r in audit if r.outcome == "skipped"]
    assert skipped and all("drained" in r.detail for r in skipped)
