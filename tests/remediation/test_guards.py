"""The executor's pure decisions: guards in their order, and the circuit breaker's window.

No broker, no API: :meth:`Executor.verdict` and :class:`CircuitBreaker` do no I/O.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from gpusteward.errors import ApiTimeout
from gpusteward.remediation.executor import (
    CircuitBreaker,
    Executor,
    NoBackend,
    RemediationSettings,
)
from gpusteward.rules import idle
from gpusteward.schema import Action, ActionResult, ActionVerb, Outcome, PodRef, Subject
from gpusteward.settings import Settings


def act(verb: ActionVerb = "cordon", *, node: str | None = "gpu-1", pod: PodRef | None = None,
        rule: str = "ecc_dbe", dry_run: bool = False, key: str = "f1/cordon") -> Action:
    return Action(idempotency_key=key, verb=verb, target=Subject(node=node, pod=pod),
                  reason="uncorrectable ECC error", rule=rule, finding_ids=["f1"], ts=time.time(),
                  dry_run=dry_run)


def executor(execute: bool = True, **policy: object) -> Executor:
    return Executor(Settings(), NoBackend(), execute=execute,
                    remediation=RemediationSettings(**policy))  # type: ignore[arg-type]


def test_guards_in_order_idempotency_deny_lists_mig_dry_run_enablement() -> None:
    guarded = executor(enabled_rules={"ecc_dbe"}, deny_nodes={"gpu-9*"})
    guarded.apply_audit(ActionResult(idempotency_key="done/cordon", verb="cordon",
                                     target=Subject(node="gpu-90"), outcome="executed",
                                     detail="", actor="x", ts=1.0))
    verdicts = {
        "redelivered on a denied node": guarded.verdict(act(node="gpu-90", key="done/cordon")),
        "denied node": guarded.verdict(act(node="gpu-91")),
        "denied namespace": guarded.verdict(act("notify_owner", node=None,
                                                pod=PodRef("kube-system", "dns"))),
        "MIG relabel": guarded.verdict(act("set_mig_config")),
        "no node": guarded.verdict(act("drain", node=None)),
        "rule asks dry run": guarded.verdict(act(dry_run=True)),
        "rule not enabled": guarded.verdict(act(rule="idle_holder")),
        "acts": guarded.verdict(act()),
        "executor dry run": executor(execute=False, enabled_rules={"*"}).verdict(act()),
    }
    assert {k: v[0] if v else None for k, v in verdicts.items()} == {
        "redelivered on a denied node": "skipped", "denied node": "refused",
        "denied namespace": "refused", "MIG relabel": "refused", "no node": "refused",
        "rule asks dry run": "dry_run", "rule not enabled": "dry_run", "acts": None,
        "executor dry run": "dry_run"}
    assert verdicts["no node"] == ("refused", "drain needs a node")


def test_the_breaker_counts_distinct_nodes_in_its_window_and_stays_open() -> None:
    breaker = CircuitBreaker(RemediationSettings(breaker_window_s=100, breaker_max_nodes=2))
    assert breaker.limit(gpu_nodes=None) == 2
    assert breaker.limit(gpu_nodes=10) == 1  # 10 % of 10, at least one
    assert breaker.admits("a", 0, None) == (True, "")
    breaker.record("a", 0)
    breaker.record("b", 50)
    assert breaker.admits("a", 60, None) == (True, "")  # not a new node
    assert breaker.admits("c", 120, None) == (True, "")  # "a" left the window at 100
    breaker.record("c", 120)
    admitted, why = breaker.admits("d", 130, None)
    assert not admitted and why.startswith("circuit breaker tripped: 2 nodes already")
    assert breaker.open
    assert not breaker.admits("b", 10_000, None)[0]  # open until reset, whatever the time
    breaker.reset()
    assert breaker.admits("d", 10_000, None) == (True, "")


def test_a_denied_namespace_in_the_params_is_refused_too() -> None:
    """The backend requeues the Kueue workload its params name, in their namespace: the
    deny-list guards that namespace as well as the target pod's."""
    guarded = executor(enabled_rules={"*"}, deny_namespaces={"kube-*"})
    requeue = Action(idempotency_key="f1/requeue", verb="requeue",
                     target=Subject(pod=PodRef("ml", "train-0")), reason="spot", rule="spot",
                     finding_ids=["f1"], ts=time.time(),
                     params={"workload": "critical", "namespace": "kube-system"})
    assert guarded.verdict(requeue) == ("refused", "namespace kube-system is on the deny-list")
    assert guarded.verdict(msgspec.structs.replace(
        requeue, params={"workload": "wl", "namespace": "ml"})) is None


def _audited(key: str, verb: ActionVerb, outcome: Outcome, *, node: str | None = None,
             attempt: int = 1) -> ActionResult:
    return ActionResult(idempotency_key=key, verb=verb, target=Subject(node=node),
                        outcome=outcome, detail="", actor="x", ts=1.0, attempt=attempt)


def test_a_reclaim_follows_only_a_delivered_owner_notice() -> None:
    """The owner is told first: an idle episode whose notices were dry runs (before
    --execute was switched on) or failed is never reclaimed; one delivered is enough, read
    back from the audit topic as well as just made."""
    acting = executor(enabled_rules={idle.KIND})
    reclaim = Action(idempotency_key="ep1/requeue", verb="requeue",
                     target=Subject(node="gpu-1", pod=PodRef("ml", "nb-0")), reason="idle",
                     rule=idle.KIND, finding_ids=["ep1"], ts=time.time(),
                     params={"reason": idle.RECLAIM_REASON})
    outcome, why = acting.verdict(reclaim) or ("acts", "")
    assert outcome == "refused" and why.startswith("the owner was not told first")
    acting.apply_audit(_audited("ep1/notify_owner", "notify_owner", "dry_run"))
    acting.apply_audit(_audited("ep1/notify_owner/warn", "notify_owner", "failed"))
    acting.apply_audit(_audited("ep2/notify_owner/warn", "notify_owner", "executed"))
    assert (acting.verdict(reclaim) or ("acts",))[0] == "refused"
    acting.apply_audit(_audited("ep1/notify_owner/warn", "notify_owner", "executed"))
    assert acting.verdict(reclaim) is None
    # A requeue for another reason (a spot interruption, a stuck gang) needs no notice.
    assert acting.verdict(msgspec.structs.replace(reclaim, params={})) is None


class Flaky:
    """A backend whose drains cordon and then fail, and whose cordons lose their first reply."""

    name = "flaky"

    def __init__(self) -> None:
        self.cordoned: set[str] = set()

    async def drain(self, action: Action) -> tuple[Outcome, str]:
        self.cordoned.add(action.target.node or "")
        return "failed", "drain incomplete: a PodDisruptionBudget blocked an eviction"

    async def cordon(self, action: Action) -> tuple[Outcome, str]:
        node = action.target.node or ""
        if node in self.cordoned:
            return "skipped", f"{node} is already cordoned"
        self.cordoned.add(node)
        raise ApiTimeout(0, "Timeout", "the reply was lost", delay=0.0)


def test_the_breaker_counts_nodes_a_failed_or_retried_action_disrupted() -> None:
    """A drain that cordoned its node and then failed on an eviction, and a cordon whose
    retry found its own earlier try's work, took capacity all the same: the breaker counts
    them, here and from the audit topic after a restart."""
    backend = Flaky()

    async def no_wait(_seconds: float) -> None:
        return None

    acting = Executor(Settings(), backend, execute=True, sleep=no_wait,
                      remediation=RemediationSettings(enabled_rules={"*"}, breaker_max_nodes=2,
                                                      fleet_gpu_nodes=1000))
    results = [asyncio.run(acting.decide(action)) for action in (
        act("drain", node="gpu-1", key="a/drain"), act("cordon", node="gpu-2", key="b/cordon"),
        act("drain", node="gpu-3", key="c/drain"))]
    assert [(r.outcome, r.attempt) for r in results] == [("failed", 1), ("skipped", 2),
                                                          ("refused", 1)]
    assert results[2].detail.startswith("circuit breaker tripped: 2 nodes")
    assert backend.cordoned == {"gpu-1", "gpu-2"}
    restarted = executor()
    for result in results:
        restarted.apply_audit(result)
    assert sorted(restarted.breaker.disrupted) == ["gpu-1", "gpu-2"]
