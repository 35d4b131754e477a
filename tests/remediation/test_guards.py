"""The executor's pure decisions: guards in their order, and the circuit breaker's window.

No broker, no API: :meth:`Executor.verdict` and :class:`CircuitBreaker` do no I/O.
"""

from __future__ import annotations

from gpusteward.remediation.executor import (
    CircuitBreaker,
    Executor,
    NoBackend,
    RemediationSettings,
)
from gpusteward.schema import Action, ActionResult, ActionVerb, PodRef, Subject
from gpusteward.settings import Settings


def act(verb: ActionVerb = "cordon", *, node: str | None = "gpu-1", pod: PodRef | None = None,
        rule: str = "ecc_dbe", dry_run: bool = False, key: str = "f1/cordon") -> Action:
    return Action(idempotency_key=key, verb=verb, target=Subject(node=node, pod=pod),
                  reason="uncorrectable ECC error", rule=rule, finding_ids=["f1"], ts=1.0,
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
