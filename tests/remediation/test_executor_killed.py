"""The executor killed between carrying an action out and auditing it: the effect happens once.

The executor commits an action's offset only after its audit record is on the broker, so
an executor that dies after the API call and before the audit (a SIGKILL, a node lost)
leaves the action to be read again, and the audit topic does not list its key: the
restarted executor decides again. What keeps the effect single is the backend, which
reads before it writes and reports ``skipped`` when the effect is in place, or
``executed`` where the effect names the action (a cordon, a taint, a MIG relabel, a Kueue
requeue): then the audit says what happened and the circuit breaker counts the node. Here the
death is injected in exactly that window (after the real call returns, before the
executor goes on), the executor is run again on the same group, and the API double counts
the writes. ``make chaos`` does the same with ``gpusteward act`` processes and SIGKILL.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.remediation.executor import Executor, RemediationSettings
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.schema import Action, ActionResult, PodRef, Subject
from gpusteward.settings import Settings
from tests.remediation.cluster import admitted_workload, node, pod, publish_actions, writes


class Killed(BaseException):
    """The process dying: nothing in the executor catches it, as nothing survives a SIGKILL."""


class DiesAfterActing:
    """The Kubernetes backend, dying right after the first call it carries out."""

    def __init__(self, backend: KubernetesBackend) -> None:
        self._backend = backend
        self.name = backend.name

    def __getattr__(self, verb: str) -> Any:
        handler = getattr(self._backend, verb)
        if verb not in ACTIONS:
            return handler

        async def act_then_die(action: Action) -> Any:
            await handler(action)
            raise Killed(f"killed after {action.verb}, before the audit")
        return act_then_die


ACTIONS = {
    "cordon": Subject(node="gpu-1"),
    "taint": Subject(node="gpu-1"),
    "set_mig_config": Subject(node="gpu-1"),
    "notify_owner": Subject(pod=PodRef("ml-alice", "notebook-0")),
    "requeue": Subject(pod=PodRef("ml-dave", "train-0")),
}
PARAMS = {"set_mig_config": {"config": "all-3g.40gb"}}
REPLAYED = {"cordon": "executed", "taint": "executed", "set_mig_config": "executed",
            "notify_owner": "skipped", "requeue": "executed"}
"""The replay's outcome: executed where the effect names the action that made it."""
DISRUPTING = {"cordon", "taint", "set_mig_config"}
"""The verbs whose replay the circuit breaker counts against the node."""


async def _run(executor: Executor, settings: Settings, timeout_s: float = 20.0
               ) -> list[ActionResult]:
    results: list[ActionResult] = []
    decided = asyncio.Event()

    def on_result(_action: Action, result: ActionResult) -> None:
        results.append(result)
        decided.set()

    executor.on_result = on_result
    stop = asyncio.Event()
    task = asyncio.create_task(executor.run(stop))
    waiting = asyncio.create_task(decided.wait())
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.3)  # the audit record flushed, the offset committed
    finally:
        waiting.cancel()
        stop.set()
    await task
    return results


@pytest.mark.parametrize("verb", sorted(ACTIONS))
def test_an_action_carried_out_then_killed_before_its_audit_is_not_repeated(
        verb: str, kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    kube.load([node("gpu-1"), pod("ml-alice", "notebook-0", "gpu-1"),
               pod("ml-dave", "train-0", "gpu-1", owner_kind="Job",
                   annotations={"kueue.x-k8s.io/workload": "job-train-abc12"}),
               admitted_workload("ml-dave", "job-train-abc12")])
    # A short session: the embedded broker holds a new member's join for half of it.
    settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(
        update={"session_timeout_s": 2.0})})
    asyncio.run(kafka.ensure_topics(settings))
    action = Action(idempotency_key=f"f1/{verb}", verb=verb,  # type: ignore[arg-type]
                    target=ACTIONS[verb], reason="ECC DBE on GPU-1", rule="ecc_dbe",
                    finding_ids=["f1"], ts=time.time(), params=PARAMS.get(verb, {}))
    policy = RemediationSettings(enabled_rules={"ecc_dbe"}, allow_mig_config=True)

    asyncio.run(publish_actions(settings, action))
    dying = Executor(settings, DiesAfterActing(KubernetesBackend(kube_settings)), execute=True,
                     remediation=policy, group_id="executor")
    with pytest.raises(Killed):
        asyncio.run(_run(dying, settings))
    effects = len(writes(kube))
    assert effects >= 1, "the first executor carried the action out before it died"
    audit = asyncio.run(kafka.read_all(settings, topics.ACTION_RESULTS.name(settings)))
    assert audit == [], "it died before auditing"

    restarted = Executor(settings, KubernetesBackend(kube_settings), execute=True,
                         remediation=policy, group_id="executor")
    [result] = asyncio.run(_run(restarted, settings))
    assert result.idempotency_key == action.idempotency_key
    assert result.outcome == REPLAYED[verb], result
    assert ("earlier try" if REPLAYED[verb] == "executed" else "already") in result.detail
    assert len(writes(kube)) == effects, "the effect was carried out a second time"
    audit = asyncio.run(kafka.read_all(settings, topics.ACTION_RESULTS.name(settings)))
    assert [msgspec.json.decode(r.value or b"", type=ActionResult).outcome for r in audit] == \
        [REPLAYED[verb]]
    # The cordon, taint or relabel the dead executor made counts against the breaker's
    # limit all the same.
    assert list(restarted.breaker.disrupted) == (["gpu-1"] if verb in DISRUPTING else [])
