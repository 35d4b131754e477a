"""The remediation executor's guards: dry-run per rule, deny-lists, MIG policy, the breaker,
idempotency across redelivery and restart, retries of temporary errors, the audit trail and
the dead-letter topic.

The decisions need no broker (the executor decides before it publishes): those tests use
plain settings and the API double; one test runs the whole loop on the broker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.remediation.executor import (
    Executor,
    NoBackend,
    RemediationSettings,
    describe,
    reset_breaker,
)
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.schema import Action, ActionResult, ActionVerb, DeadLetter, Finding, PodRef, Subject
from gpusteward.settings import Settings
from tests.remediation.cluster import cordoned, node, pod, publish_actions, writes

ENABLED = RemediationSettings(enabled_rules={"ecc_dbe"})
encode = msgspec.json.encode
OFFLINE = Settings()
"""Settings for the decision tests: they never reach the broker these name."""


def dbe_cordon(node_name: str, verb: ActionVerb = "cordon", rule: str = "ecc_dbe",
               **params: str) -> Action:
    return Action(idempotency_key=f"{node_name}-dbe/{verb}", verb=verb,
                  target=Subject(node=node_name), reason=f"uncorrectable ECC error on {node_name}",
                  rule=rule, finding_ids=[f"{node_name}-dbe"], ts=time.time(), params=params)


def decide_all(executor: Executor, actions: Iterable[Action]) -> list[ActionResult]:
    async def main() -> list[ActionResult]:
        return [await executor.decide(a) for a in actions]
    return asyncio.run(main())


def fleet(kube: KubeApiServer, size: int) -> list[str]:
    names = [f"gpu-{i:02d}" for i in range(size)]
    kube.load(node(n) for n in names)
    return names


def test_dry_run_is_the_default_and_execution_is_per_rule(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    fleet(kube, 4)
    backend = KubernetesBackend(kube_settings)
    dry = Executor(OFFLINE, backend)  # no execute, no enabled rules
    executing_nothing_enabled = Executor(OFFLINE, backend, execute=True,
                                         remediation=RemediationSettings())
    executing = Executor(OFFLINE, backend, execute=True, remediation=ENABLED)
    [a] = decide_all(dry, [dbe_cordon("gpu-00")])
    [b] = decide_all(executing_nothing_enabled, [dbe_cordon("gpu-01")])
    [c, d] = decide_all(executing, [dbe_cordon("gpu-02"),
                                    dbe_cordon("gpu-03", rule="idle_holder")])
    assert (a.outcome, b.outcome, c.outcome, d.outcome) == ("dry_run", "dry_run", "executed",
                                                            "dry_run")
    assert "executor in dry-run mode" in a.detail
    assert "rule ecc_dbe is not enabled; --enable-rule ecc_dbe" in b.detail
    assert a.detail.startswith("would cordon node gpu-00 (spec.unschedulable=true) because: "
                               "uncorrectable ECC error on gpu-00")
    assert cordoned(kube) == ["gpu-02"]


def test_deny_lists_and_mig_policy_refuse(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    fleet(kube, 3)
    kube.create(pod("kube-system", "coredns-1", "gpu-00"))
    policy = RemediationSettings(enabled_rules={"*"}, deny_nodes={"gpu-0[1]"})
    executor = Executor(OFFLINE, KubernetesBackend(kube_settings), execute=True,
                        remediation=policy)
    results = decide_all(executor, [
        dbe_cordon("gpu-01"),
        Action(idempotency_key="k/notify", verb="notify_owner",
               target=Subject(pod=PodRef("kube-system", "coredns-1")), reason="idle",
               rule="idle_holder", finding_ids=["k"], ts=time.time()),
        dbe_cordon("gpu-02", verb="set_mig_config", config="all-1g.10gb"),
    ])
    assert [r.outcome for r in results] == ["refused"] * 3
    assert [r.detail for r in results] == [
        "node gpu-01 is on the deny-list", "namespace kube-system is on the deny-list",
        "MIG relabels are not allowed by policy (allow_mig_config is off)"]
    assert cordoned(kube) == [] and kube.objects("Event") == []
    allowed = Executor(OFFLINE, KubernetesBackend(kube_settings), execute=True,
                       remediation=RemediationSettings(enabled_rules={"*"},
                                                       allow_mig_config=True))
    [relabel] = decide_all(allowed, [dbe_cordon("gpu-02", verb="set_mig_config",
                                                config="all-1g.10gb")])
    assert relabel.outcome == "executed"


def test_a_storm_on_half_the_fleet_cordons_no_more_than_the_breaker_allows(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    names = fleet(kube, 40)
    storm = [dbe_cordon(n) for n in names[:20]]  # half the fleet reports DBE at once
    executor = Executor(OFFLINE, KubernetesBackend(kube_settings), execute=True,
                        remediation=ENABLED)
    results = decide_all(executor, storm)
    # 10 % of 40 GPU nodes (counted through the API) = 4 per window.
    assert [r.outcome for r in results] == ["executed"] * 4 + ["refused"] * 16
    assert cordoned(kube) == names[:4]
    assert "circuit breaker (node actions) tripped: 4 nodes of 40 GPU nodes already disrupted" in \
        results[4].detail
    assert all("circuit breaker (node actions) open" in r.detail for r in results[5:])
    # Open until reset: even an action on an already-cordoned node's drain is refused.
    [later] = decide_all(executor, [dbe_cordon(names[30])])
    assert later.outcome == "refused"


def test_the_absolute_limit_holds_on_a_big_fleet(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    policy = RemediationSettings(enabled_rules={"*"}, breaker_max_nodes=3,
                                 fleet_gpu_nodes=1250)
    names = fleet(kube, 6)
    executor = Executor(OFFLINE, KubernetesBackend(kube_settings), execute=True,
                        remediation=policy)
    results = decide_all(executor, [dbe_cordon(n) for n in names])
    assert [r.outcome for r in results].count("executed") == 3
    # A second verb on a node already disrupted in the window is not a new node.
    fresh = Executor(OFFLINE, KubernetesBackend(kube_settings), execute=True,
                     remediation=policy)
    again = decide_all(fresh, [dbe_cordon(names[0], verb="taint"), dbe_cordon(names[0],
                                                                                verb="drain")])
    assert [r.outcome for r in again] == ["executed", "executed"]


def test_a_redelivered_action_changes_nothing(
        kube: KubeApiServer, kube_settings: KubeSettings) -> None:
    fleet(kube, 10)
    executor = Executor(OFFLINE, KubernetesBackend(kube_settings), execute=True,
                        remediation=ENABLED)
    first, again = decide_all(executor, [dbe_cordon("gpu-00"), dbe_cordon("gpu-00")])
    assert (first.outcome, again.outcome) == ("executed", "skipped")
    assert again.detail == "already executed (redelivered action)"
    assert len(writes(kube)) == 1


def test_describe_says_what_each_verb_would_do() -> None:
    texts = {verb: describe(dbe_cordon("gpu-1", verb=verb, config="all-3g.40gb"))
             for verb in ("cordon", "taint", "drain", "set_mig_config")}
    assert "evict its pods through the Eviction API" in texts["drain"]
    assert "gpusteward.io/unhealthy:NoSchedule" in texts["taint"]
    assert "nvidia.com/mig.config=all-3g.40gb" in texts["set_mig_config"]


# -- on the broker: the audit trail, restarts, the dead-letter topic ---------------------------


async def publish(settings: Settings, topic: str, values: Iterable[bytes]) -> None:
    producer = kafka.producer(settings)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()


async def run_until(executor: Executor, settings: Settings, values: list[bytes],
                    expected: int) -> list[ActionResult]:
    """Publish ``values`` as actions; run ``executor`` until it decided ``expected`` of them."""
    results: list[ActionResult] = []
    executor.on_result = lambda _action, result: results.append(result)
    stop = asyncio.Event()
    task = asyncio.create_task(executor.run(stop))
    await publish(settings, topics.ACTIONS.name(settings), values)
    for _ in range(300):
        if len(results) >= expected and (expected or _ > 30):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # let the batch's audit records flush and the offsets commit
    stop.set()
    await task
    return results


def decode_all(settings: Settings, topic: str, kind: type) -> list:
    records = asyncio.run(kafka.read_all(settings, topic))
    return [msgspec.json.decode(r.value or b"", type=kind) for r in records]


def test_the_loop_audits_retries_and_keeps_breaker_and_keys_across_a_restart_until_reset(
        kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    names = fleet(kube, 20)
    encode = msgspec.json.encode
    # 10 % of 20 = 2; short backoff: the first cordon meets one 503 and is tried again.
    policy = RemediationSettings(enabled_rules={"ecc_dbe"}, retry_backoff_s=0.01)
    kube.fail("PATCH", 1, status=503, path="/nodes/")

    def executor(group: str) -> Executor:
        return Executor(settings, KubernetesBackend(kube_settings), execute=True,
                        group_id=group, remediation=policy)

    storm = [encode(dbe_cordon(n)) for n in names[:10]]
    tripped = executor("g1")
    first = asyncio.run(run_until(tripped, settings, [*storm, b"{not json"], 10))
    assert [r.outcome for r in first].count("executed") == 2
    gauge = tripped.metrics.registry.get_sample_value
    assert gauge("gpusteward_breaker_open", {"group": "g1"}) == 1
    assert [gauge("gpusteward_breaker_circuit_open", {"group": "g1", "circuit": circuit})
            for circuit in ("nodes", "reclaims")] == [1, 0]
    assert cordoned(kube) == names[:2]

    audit = decode_all(settings, topics.ACTION_RESULTS.name(settings), ActionResult)
    assert sorted(r.outcome for r in audit if not r.idempotency_key.startswith("breaker/")) == \
        ["executed"] * 2 + ["refused"] * 8 + ["retrying"]
    [retried] = [r for r in audit if r.outcome == "retrying"]
    assert (retried.idempotency_key, retried.attempt) == (f"{names[0]}-dbe/cordon", 1)
    assert retried.error and retried.error.startswith("ServerError: 503 ServiceUnavailable")
    [final] = [r for r in audit if r.idempotency_key == retried.idempotency_key
               and r.outcome != "retrying"]
    assert (final.outcome, final.attempt, final.error) == ("executed", 2, None)
    assert audit.index(retried) < audit.index(final)
    assert len([r for r in audit if r.idempotency_key.startswith("breaker/trip/")]) == 1
    [breaker] = decode_all(settings, topics.FINDINGS.name(settings), Finding)
    assert (breaker.kind, breaker.state, breaker.severity) == (
        "remediation_breaker", "firing", "critical")
    [letter] = decode_all(settings, topics.DEADLETTER.name(settings), DeadLetter)
    assert letter.value == b"{not json" and letter.error.startswith("malformed: JSON is malformed")
    assert letter.source_topic == topics.ACTIONS.name(settings) and letter.offset == 10

    # A restart (another group reads the whole topic again): the breaker is still open and
    # the executed cordons are not repeated.
    writes_before = len(writes(kube))
    again = asyncio.run(run_until(executor("g2"), settings, [encode(dbe_cordon(names[15]))],
                                  11))
    assert sorted(r.outcome for r in again) == ["refused"] * 9 + ["skipped"] * 2
    assert len(writes(kube)) == writes_before

    # A reset of the other circuit (idle reclaims, not open) resolves nothing.
    asyncio.run(reset_breaker(settings, "bob", "reclaims only", circuit="reclaims"))
    assert decode_all(settings, topics.FINDINGS.name(settings), Finding) == [breaker]
    with pytest.raises(ValueError, match="no breaker circuit 'cordons'"):
        asyncio.run(reset_breaker(settings, "bob", circuit="cordons"))
    # An explicit reset closes it: the next executor cordons again and the finding resolves.
    asyncio.run(reset_breaker(settings, "alice", "driver roll-out finished"))
    after = asyncio.run(run_until(executor("g3"), settings, [encode(dbe_cordon(names[16]))],
                                  12))
    assert [r.outcome for r in after].count("executed") == 2  # limit 2 again after the reset
    states = [(f.state, f.labels.get("circuit"))
              for f in decode_all(settings, topics.FINDINGS.name(settings), Finding)]
    # The reset of the reclaims circuit resolved nothing: the one resolution is the nodes'.
    assert states[:2] == [("firing", "nodes"), ("resolved", "nodes")]
    resets = [r.idempotency_key.rpartition("/")[0] for r in decode_all(
        settings, topics.ACTION_RESULTS.name(settings), ActionResult)
        if r.idempotency_key.startswith("breaker/reset/")]
    assert resets == ["breaker/reset/reclaims", "breaker/reset"]


def test_no_backend_refuses_and_dry_run_only_describes() -> None:
    executor = Executor(OFFLINE, NoBackend(), execute=True, remediation=ENABLED)
    [result] = decide_all(executor, [dbe_cordon("gpu-1")])
    assert (result.outcome, result.detail) == ("refused", "backend none cannot cordon")


def test_a_cordon_read_after_the_executor_was_down_is_refused_audited_and_alerted(
        kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    """The worker asked for a cordon; the executor came back two hours later. It must not act
    on facts that old, but the DBE may persist: the refusal is on the audit topic with why
    and what follows (the worker's re-ask: tests/e2e/test_reask.py), and counted by verb and
    rule for the GpustewardActionsStale alert, so an operator is told. Dry runs and other
    refusals are not counted: nothing would have been carried out."""
    asyncio.run(kafka.ensure_topics(settings))
    fleet(kube, 3)
    asyncio.run(publish_actions(settings, dbe_cordon("gpu-00"),
                                dbe_cordon("gpu-01", rule="idle_holder")))
    back_later = Executor(settings, KubernetesBackend(kube_settings), execute=True,
                          group_id="late", remediation=RemediationSettings(
                              enabled_rules={"ecc_dbe"}, deny_nodes={"gpu-02"}),
                          clock=lambda: time.time() + 2 * 3600)
    results = asyncio.run(run_until(back_later, settings, [encode(dbe_cordon("gpu-02"))], 3))
    assert [(r.target.node, r.outcome) for r in results] == [
        ("gpu-00", "refused"), ("gpu-01", "dry_run"), ("gpu-02", "refused")]
    assert results[0].detail.startswith("stale: asked for at ")
    assert "check the finding's state and act by hand" in results[0].detail
    assert cordoned(kube) == []
    audit = decode_all(settings, topics.ACTION_RESULTS.name(settings), ActionResult)
    assert [(r.target.node, r.outcome) for r in audit] == [
        (r.target.node, r.outcome) for r in results]
    stale = back_later.metrics.registry.get_sample_value
    assert stale("gpusteward_actions_stale_total", {"verb": "cordon", "rule": "ecc_dbe"}) == 1
    assert stale("gpusteward_actions_stale_total", {"verb": "cordon",
                                                    "rule": "idle_holder"}) is None
