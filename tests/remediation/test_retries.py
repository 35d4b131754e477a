"""Temporary API errors are retried with backoff and audited per attempt; permanent ones are not.

Through the real ``kubernetes`` client against the API double, whose injected
failures answer 503, 429 with ``Retry-After``, or hang past the client's timeout.
No broker: the attempts are collected from the executor's ``on_attempt`` hook.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.sandbox.kube_api import KUEUE_GROUP, KubeApiServer
from gpusteward.schema import Action, ActionResult, PodRef, Subject
from gpusteward.settings import Settings
from tests.remediation.cluster import admitted_workload, cordoned, node, pdb, pod, pods


def cordon(node_name: str) -> Action:
    return Action(idempotency_key=f"{node_name}-dbe/cordon", verb="cordon",
                  target=Subject(node=node_name), reason="uncorrectable ECC error",
                  rule="ecc_dbe", finding_ids=[f"{node_name}-dbe"], ts=time.time())


class Run:
    """One executor on the double, with its waits and attempt records kept, not slept."""

    def __init__(self, kube_settings: KubeSettings, **policy: float) -> None:
        self.waits: list[float] = []
        self.attempts: list[ActionResult] = []

        async def sleep(seconds: float) -> None:
            self.waits.append(seconds)

        self.executor = Executor(
            Settings(), KubernetesBackend(kube_settings), execute=True, sleep=sleep,
            remediation=RemediationSettings(enabled_rules={"*"}, fleet_gpu_nodes=100,
                                            **policy))  # type: ignore[arg-type]

    def decide(self, action: Action) -> ActionResult:
        async def record(attempt: ActionResult) -> None:
            self.attempts.append(attempt)

        return asyncio.run(self.executor.decide(action, record))


def node_patches(kube: KubeApiServer) -> list[int]:
    return [r.status for r in kube.requests if r.method == "PATCH"]


def test_a_503_is_retried_with_exponential_backoff_and_each_attempt_audited(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.create(node("gpu-1"))
    kube.fail("PATCH", 2, status=503)
    run = Run(kube_settings)
    result = run.decide(cordon("gpu-1"))
    assert (result.outcome, result.attempt, result.error) == ("executed", 3, None)
    assert run.waits == [1.0, 2.0]
    assert [(a.outcome, a.attempt) for a in run.attempts] == [("retrying", 1), ("retrying", 2)]
    assert all(a.error and a.error.startswith("ServerError: 503 ServiceUnavailable")
               for a in run.attempts)
    assert "attempt 1 of 5 failed; retrying in 1 s" in run.attempts[0].detail
    assert node_patches(kube) == [503, 503, 200]
    assert cordoned(kube) == ["gpu-1"]
    # At least once, exactly once: the redelivered action is not carried out again.
    assert run.decide(cordon("gpu-1")).outcome == "skipped"
    assert node_patches(kube) == [503, 503, 200]


def test_a_429_waits_as_long_as_retry_after_says(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.create(node("gpu-1"))
    kube.fail("PATCH", 1, status=429, retry_after=7)
    run = Run(kube_settings)
    assert run.decide(cordon("gpu-1")).outcome == "executed"
    assert run.waits == [7.0]  # the server's 7 s, not the 1 s backoff
    assert run.attempts[0].error is not None and "TooManyRequests" in run.attempts[0].error


def test_a_timeout_and_a_dropped_connection_are_temporary(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.load([node("gpu-1"), node("gpu-2")])
    kube.fail("PATCH", 1, hang_s=3.0)  # held past the client's 0.3 s
    run = Run(kube_settings.model_copy(update={"request_timeout_s": 0.3}))
    result = run.decide(cordon("gpu-1"))
    assert (result.outcome, result.attempt) == ("executed", 2)
    [attempt] = run.attempts
    assert attempt.error is not None and attempt.error.startswith("ApiTimeout: Timeout")

    kube.fail("PATCH", 1, hang_s=0.05)  # closed unanswered well within the timeout
    result = run.decide(cordon("gpu-2"))
    assert (result.outcome, result.attempt) == ("executed", 2)
    assert run.attempts[-1].error is not None
    assert run.attempts[-1].error.startswith("ApiUnreachable: Unreachable")
    assert cordoned(kube) == ["gpu-1", "gpu-2"]


def test_a_404_is_permanent_and_not_retried(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    run = Run(kube_settings)
    result = run.decide(cordon("gpu-missing"))
    assert (result.outcome, result.attempt) == ("failed", 1)
    assert result.error is not None and result.error.startswith("NotFound: 404 NotFound")
    assert run.attempts == [] and run.waits == []


def test_retries_stop_at_the_attempt_limit_and_at_the_time_budget(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    kube.create(node("gpu-1"))
    kube.fail("GET", 10, status=503, path="/nodes/gpu-1$")
    limited = Run(kube_settings, retry_attempts=3)
    result = limited.decide(cordon("gpu-1"))
    assert (result.outcome, result.attempt) == ("failed", 3)
    assert result.detail.startswith("gave up after 3 attempts: ServerError: 503")
    assert limited.waits == [1.0, 2.0] and len(limited.attempts) == 2

    budgeted = Run(kube_settings, retry_budget_s=5)  # 1 + 2 fit; the next 4 s would not
    result = budgeted.decide(cordon("gpu-1"))
    assert (result.outcome, result.attempt) == ("failed", 3)
    assert "a wait of 4 s would pass the retry budget of 5 s" in result.detail
    assert budgeted.waits == [1.0, 2.0]
    assert cordoned(kube) == []


def drain(node_name: str) -> Action:
    return msgspec.structs.replace(cordon(node_name), idempotency_key=f"{node_name}-lost/drain",
                                   verb="drain", rule="gpu_lost")


def test_a_drain_whose_eviction_meets_a_503_or_a_timeout_retries_it_and_completes(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """An API server restarting mid-drain answers one eviction 503 and drops another: both
    are temporary, as on every other call, so the drain tries them again within its
    drain_timeout_s instead of reporting the node drained incomplete with pods on it."""
    kube.load([node("gpu-1"), pod("ml-alice", "train-0", "gpu-1"),
               pod("ml-bob", "serve-0", "gpu-1")])
    kube.fail("POST", 1, status=503, path="/pods/train-0/eviction$")
    kube.fail("POST", 1, hang_s=0.05, path="/pods/serve-0/eviction$")
    run = Run(kube_settings)
    result = run.decide(drain("gpu-1"))
    assert result.outcome == "executed", result.detail
    assert result.detail == "gpu-1 cordoned; evicted 2 pod(s)"
    assert pods(kube) == set()
    statuses = sorted((r.path.split("/")[6], r.status) for r in kube.requests
                      if r.path.endswith("/eviction"))
    assert statuses == [("serve-0", 0), ("serve-0", 201), ("train-0", 201), ("train-0", 503)]


def test_a_drain_reports_a_misconfigured_budget_at_once_and_an_outage_past_its_timeout(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """Two PodDisruptionBudgets selecting one pod make every eviction a 500 (the Eviction
    API's misconfiguration answer): retrying cannot help, so it is reported at once. An
    eviction that stays 503 is retried until drain_timeout_s, then reported with its error;
    neither pod is deleted."""
    kube.load([node("gpu-1"), pod("ml-bob", "serve-0", "gpu-1", labels={"app": "serve"}),
               pdb("ml-bob", "one", {"app": "serve"}, 1), pdb("ml-bob", "two", {"app": "serve"}, 1),
               pod("ml-alice", "train-0", "gpu-1")])
    kube.fail("POST", 1000, status=503, path="/pods/train-0/eviction$")
    result = Run(kube_settings).decide(drain("gpu-1"))
    assert result.outcome == "failed"
    assert "ml-bob/serve-0: 500 InternalError: This pod has more than one" in result.detail
    assert "ml-alice/train-0: 503 ServiceUnavailable" in result.detail
    assert result.detail.startswith("drain incomplete after 0.5 s")
    assert [(r.path.split("/")[6], r.status) for r in kube.requests
            if r.path.endswith("/serve-0/eviction")] == [("serve-0", 500)]
    assert len([r for r in kube.requests if r.path.endswith("/train-0/eviction")]) >= 3
    assert pods(kube) == {("ml-bob", "serve-0"), ("ml-alice", "train-0")}


def test_a_requeue_cut_short_by_an_outage_says_its_workload_is_left_inactive(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    """The API server goes away right after the requeue deactivated the Kueue workload: the
    retries run out with the job stopped (spec.active=false), which Kueue never admits
    again by itself. The audit must say so and how to resume it, not only the 503."""
    kube.load([pod("ml-dave", "train-0", "gpu-1", owner_kind="Job",
                   annotations={"kueue.x-k8s.io/workload": "job-train"}),
               admitted_workload("ml-dave", "job-train")])

    def outage_once_deactivated(api: KubeApiServer, before: Any, after: Any) -> None:
        if after["spec"].get("active") is False and (before or {}).get("spec", {}).get(
                "active", True):
            api.fail("GET", 100, status=503, path="/workloads/job-train$")
            api.fail("PATCH", 100, status=503, path="/workloads/job-train$")

    kube.add_controller("Workload", outage_once_deactivated, group=KUEUE_GROUP)
    requeue = Action(idempotency_key="spot-1/requeue", verb="requeue",
                     target=Subject(node="gpu-1", pod=PodRef("ml-dave", "train-0")),
                     reason="spot interruption", rule="spot_interruption",
                     finding_ids=["spot-1"], ts=time.time())
    result = Run(kube_settings).decide(requeue)
    assert (result.outcome, result.attempt) == ("failed", 5)
    assert kube.get("Workload", "job-train", "ml-dave", KUEUE_GROUP)["spec"]["active"] is False
    assert ("Kueue workload ml-dave/job-train is left inactive (spec.active=false) by this "
            "action") in result.detail
    assert "kueuectl resume workload job-train -n ml-dave" in result.detail
    assert "503 ServiceUnavailable" in result.detail
