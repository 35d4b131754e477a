"""The executor's pure decisions: guards in their order, and the circuit breaker's window.

No broker, no API: :meth:`Executor.verdict` and :class:`CircuitBreaker` do no I/O.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from gpusteward.errors import ApiTimeout
from gpusteward.remediation.executor import (
    CircuitBreaker,
    Executor,
    NoBackend,
    RemediationSettings,
)
from gpusteward.rules import idle
from gpusteward.schema import (
    Action,
    ActionResult,
    ActionVerb,
    Finding,
    Outcome,
    PodRef,
    Subject,
)
from gpusteward.settings import Settings

T = TypeVar("T")


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
    assert not admitted
    assert why.startswith("circuit breaker (node actions) tripped: 2 nodes already")
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
    assert results[2].detail.startswith("circuit breaker (node actions) tripped: 2 nodes")
    assert backend.cordoned == {"gpu-1", "gpu-2"}
    restarted = executor()
    for result in results:
        restarted.apply_audit(result)
    assert sorted(restarted.breaker.disrupted) == ["gpu-1", "gpu-2"]


# -- time: stale actions and the owner's notice ----------------------------------------------

NOW = 1_800_000_000.0
"""The executor's clock in the tests below (2027-01-15)."""
WEEK_S = 7 * 86400


@dataclass
class RecordingProducer:
    """The executor's sender: what it publishes, by topic."""

    sent: list[tuple[str, bytes]] = field(default_factory=list)

    async def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.sent.append((topic, value))

    def on(self, topic: str, kind: type[T]) -> list[T]:
        return [msgspec.json.decode(value, type=kind) for t, value in self.sent if t == topic]


class Owners:
    """A backend that notifies owners, reclaims and cordons, and remembers what it did."""

    name = "owners"

    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []

    async def _did(self, action: Action) -> tuple[Outcome, str]:
        self.done.append((action.verb, action.idempotency_key))
        return "executed", f"{action.verb} done"

    notify_owner = requeue = cordon = _did


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def acting(clock: Clock, backend: Owners | None = None, **policy: Any) -> Executor:
    return Executor(Settings(), backend or Owners(), execute=True, clock=clock,
                    remediation=RemediationSettings(enabled_rules={"*"}, **policy))


def notice(episode: str, ts: float, step: str = "") -> Action:
    return Action(idempotency_key=f"{episode}/notify_owner{step}", verb="notify_owner",
                  target=Subject(node="gpu-1", pod=PodRef("ml", f"nb-{episode}")),
                  reason="idle for 30 min", rule=idle.KIND, finding_ids=[episode], ts=ts)


def reclaim(episode: str, ts: float) -> Action:
    return Action(idempotency_key=f"{episode}/requeue", verb="requeue",
                  target=Subject(node="gpu-1", pod=PodRef("ml", f"nb-{episode}")),
                  reason="idle for 12 h: reclaiming it", rule=idle.KIND,
                  finding_ids=[episode], ts=ts, params={"reason": idle.RECLAIM_REASON})


def handle(executor: Executor, producer: RecordingProducer, action: Action) -> ActionResult:
    result = asyncio.run(executor._handle(producer, msgspec.json.encode(action),
                                          key=b"gpu-1", partition=0, offset=0))
    assert result is not None
    return result


def test_an_action_older_than_max_action_age_s_is_refused_and_audited() -> None:
    """A backlog replayed after an outage: a week-old cordon is not carried out, its finding
    may have resolved since; the refusal is on the audit topic with why. An owner notice of
    a week-old episode is refused too, so its reclaim, replayed right after, finds no
    delivered notice."""
    backend = Owners()
    executor = acting(Clock(NOW), backend)
    producer = RecordingProducer()
    stale = msgspec.structs.replace(act("cordon", key="old/cordon"), ts=NOW - WEEK_S)
    result = handle(executor, producer, stale)
    assert result.outcome == "refused"
    assert result.detail.startswith("stale: asked for at 2027-01-08T08:00:00Z, 168.0 h ago, "
                                    "older than max_action_age_s=3600 s")
    assert producer.on("gpusteward.action-results.v1", ActionResult) == [result]
    assert backend.done == []

    told = handle(executor, producer, notice("week", NOW - WEEK_S))
    taken = handle(executor, producer, reclaim("week", NOW - WEEK_S + 12 * 3600))
    assert (told.outcome, taken.outcome) == ("refused", "refused")
    assert taken.detail.startswith("stale:")
    assert backend.done == []

    # Within the limit it acts, and with no limit (a simulation's clock) a week is no age.
    fresh = msgspec.structs.replace(act("cordon", key="new/cordon"), ts=NOW - 3000)
    assert handle(executor, producer, fresh).outcome == "executed"
    unlimited = acting(Clock(NOW), max_action_age_s=None)
    assert asyncio.run(unlimited.decide(stale)).outcome == "executed"


def test_an_action_from_a_clock_far_ahead_is_refused_its_age_unknowable() -> None:
    """A node whose collector clock runs a day fast gives findings and actions a day ahead:
    their age would read negative for a day, so a backlog of them replayed any time that day
    would pass the age guard. Further ahead than max_action_age_s is refused, with why; a
    few minutes of skew acts, and the owner's notice still counts by the executor's clock."""
    backend = Owners()
    clock = Clock(NOW)
    executor = acting(clock, backend)
    producer = RecordingProducer()
    ahead = msgspec.structs.replace(act("cordon", key="ahead/cordon"), ts=NOW + 86400)
    result = handle(executor, producer, ahead)
    assert result.outcome == "refused"
    assert result.detail.startswith("asked for at 2027-01-16T08:00:00Z, 24.0 h ahead of the "
                                    "executor's clock, more than max_action_age_s=3600 s")
    assert backend.done == []

    told = handle(executor, producer, notice("skewed", NOW + 600))
    assert told.outcome == "executed"
    clock.now = NOW + 60  # the reclaim's event time: 40 min after the notice's; the executor's: 1
    early = handle(executor, producer, reclaim("skewed", NOW + 600 + 2400))
    assert early.outcome == "refused" and "min_notice_s=1800 s" in early.detail
    assert [verb for verb, _ in backend.done] == ["notify_owner"]


def test_a_reclaim_waits_min_notice_s_after_the_owner_was_told() -> None:
    """The notice and the reclaim of an idle episode replayed back to back: the owner was
    told a moment ago, not the hours the ladder promises. The reclaim is refused with when it
    would have been allowed; from min_notice_s after the first delivered notice it is
    carried out, by a restarted executor too (the notice's time is on the audit topic)."""
    clock = Clock(NOW)
    backend = Owners()
    executor = acting(clock, backend)
    told = asyncio.run(executor.decide(notice("ep", NOW - 60)))
    assert told.outcome == "executed"

    clock.now = NOW + 0.15
    early = asyncio.run(executor.decide(reclaim("ep", NOW)))
    assert early.outcome == "refused"
    assert early.detail.startswith("the owner was told only 0 s ago (notice delivered at "
                                   "2027-01-15T08:00:00Z); a reclaim follows a delivered notice "
                                   "by at least min_notice_s=1800 s, so not before "
                                   "2027-01-15T08:30:00Z.")
    assert "The rule does not ask again" in early.detail
    assert backend.done == [("notify_owner", "ep/notify_owner")]

    # A later notice of the same episode (the ladder's warning) does not restart the wait.
    clock.now = NOW + 1000
    assert asyncio.run(executor.decide(notice("ep", NOW + 1000, "/warn"))).outcome == "executed"
    clock.now = NOW + 1799
    assert asyncio.run(executor.decide(reclaim("ep", NOW + 1799))).outcome == "refused"

    restarted = acting(clock)
    restarted.apply_audit(told)
    assert restarted.verdict(reclaim("ep", NOW + 1799))[0] == "refused"  # type: ignore[index]
    clock.now = NOW + 1800
    assert restarted.verdict(reclaim("ep", NOW + 1800)) is None
    assert asyncio.run(executor.decide(reclaim("ep", NOW + 1800))).outcome == "executed"
    assert backend.done[-1] == ("requeue", "ep/requeue")

    # None or 0: a delivered notice is enough, as before.
    at_once = acting(Clock(NOW), min_notice_s=None)
    asyncio.run(at_once.decide(notice("ep", NOW)))
    assert at_once.verdict(reclaim("ep", NOW)) is None


def test_reclaims_past_the_window_limit_trip_the_breaker() -> None:
    """Telemetry reporting 0 % activity fleet-wide asks to reclaim every GPU at once: on a
    10-node fleet the 11th reclaim in the window trips the breaker's reclaims circuit, which
    is audited, tells someone (the remediation_breaker finding) and refuses every reclaim
    until reset, after a restart too. A failing GPU is still cordoned meanwhile: the storm
    that stopped the reclaims must not stop hardware remediation."""
    clock = Clock(NOW)
    backend = Owners()
    executor = acting(clock, backend, fleet_gpu_nodes=10)
    producer = RecordingProducer()
    episodes = [f"ep{i}" for i in range(12)]
    for episode in episodes:
        handle(executor, producer, notice(episode, NOW))
    clock.now = NOW + 3600
    outcomes = [handle(executor, producer, reclaim(e, NOW + 3600)) for e in episodes]
    assert [r.outcome for r in outcomes] == ["executed"] * 10 + ["refused"] * 2
    assert outcomes[10].detail == ("circuit breaker (idle reclaims) tripped: 10 idle reclaims "
                                   "on 10 GPU nodes already in the last 600 s (limit 10); "
                                   "refused ep10/requeue")
    assert outcomes[11].detail.startswith("circuit breaker (idle reclaims) open since")
    assert len([v for v, _ in backend.done if v == "requeue"]) == 10

    audit = producer.on("gpusteward.action-results.v1", ActionResult)
    trips = [r for r in audit if r.idempotency_key.startswith("breaker/trip/")]
    assert [t.idempotency_key.split("/")[2] for t in trips] == ["reclaims"]
    assert [t.detail for t in trips] == [executor.breaker.tripped["reclaims"][1]]
    (alarm,) = producer.on("gpusteward.findings.v1", Finding)
    assert (alarm.kind, alarm.state, alarm.severity) == ("remediation_breaker", "firing",
                                                         "critical")
    assert alarm.labels == {"circuit": "reclaims"}
    assert "10 idle reclaims" in alarm.summary and "reclaims are stopped" in alarm.runbook
    # A GPU failing now is cordoned: the nodes circuit is closed.
    cordon = msgspec.structs.replace(act("cordon", key="x/cordon"), ts=clock.now)
    assert handle(executor, producer, cordon).outcome == "executed"
    # A restarted executor reads it all back: reclaims stopped, cordons not.
    restarted = acting(clock, fleet_gpu_nodes=10)
    for record in producer.on("gpusteward.action-results.v1", ActionResult):
        restarted.apply_audit(record)
    assert sorted(restarted.breaker.tripped) == ["reclaims"]
    assert len(restarted.breaker.reclaimed) == 10
    assert list(restarted.breaker.disrupted) == ["gpu-1"]  # 1 of 10 nodes: the nodes limit
    again = msgspec.structs.replace(act("cordon", key="x2/cordon"), ts=clock.now)
    assert asyncio.run(restarted.decide(again)).outcome == "executed"
    assert asyncio.run(restarted.decide(reclaim("ep11", NOW + 3601))).outcome == "refused"
    restarted.breaker.reset()
    clock.now = NOW + 3600 + 601  # the window passed: reclaims go on
    assert asyncio.run(restarted.decide(reclaim("ep11", NOW + 4201))).outcome == "executed"


def test_a_cordon_storm_stops_cordons_not_idle_reclaims() -> None:
    """A driver roll-out flags node after node: the nodes circuit trips at its limit and
    says so once, while the ladder's reclaim of a notebook idle for hours goes on."""
    clock = Clock(NOW)
    executor = acting(clock, Owners(), fleet_gpu_nodes=20, breaker_max_nodes=2)
    producer = RecordingProducer()
    cordons = [handle(executor, producer, msgspec.structs.replace(
        act("cordon", key=f"n{i}/cordon", node=f"gpu-{i}"), ts=NOW)) for i in range(4)]
    assert [r.outcome for r in cordons] == ["executed"] * 2 + ["refused"] * 2
    assert sorted(executor.breaker.tripped) == ["nodes"]
    handle(executor, producer, notice("ep", NOW))
    clock.now = NOW + 3600
    assert handle(executor, producer, reclaim("ep", NOW + 3600)).outcome == "executed"
    (alarm,) = producer.on("gpusteward.findings.v1", Finding)
    assert alarm.labels == {"circuit": "nodes"} and "(node actions)" in alarm.summary


def test_a_trip_recorded_before_the_circuits_were_split_stops_both() -> None:
    """An audit topic written by the build before the split holds ``breaker/trip/<ms>``:
    read back, it stops cordons and reclaims alike until a reset, as it did; a reset may
    name one circuit."""
    executor = acting(Clock(NOW), fleet_gpu_nodes=10)
    executor.apply_audit(_audited(f"breaker/trip/{NOW * 1000:.0f}", "cordon", "refused"))
    assert sorted(executor.breaker.tripped) == ["nodes", "reclaims"]
    # An operator resets one circuit (--circuit reclaims): cordons stay stopped.
    executor.apply_audit(_audited(f"breaker/reset/reclaims/{NOW * 1000 + 1:.0f}", "cordon",
                                  "executed"))
    assert sorted(executor.breaker.tripped) == ["nodes"]
    executor.apply_audit(_audited(f"breaker/reset/{NOW * 1000 + 2:.0f}", "cordon", "executed"))
    assert not executor.breaker.open


def test_the_reclaim_limit_follows_the_fleet_and_counts_only_idle_reclaims() -> None:
    breaker = CircuitBreaker(RemediationSettings())
    assert breaker.reclaim_limit(gpu_nodes=2) == 2
    assert breaker.reclaim_limit(gpu_nodes=10) == 10
    assert breaker.reclaim_limit(gpu_nodes=1250) == 50  # a 10,000-GPU fleet of 8-GPU nodes
    assert breaker.reclaim_limit(gpu_nodes=None) == 50
    # Read back from the audit topic: a requeue of a notified episode is a reclaim; a spot
    # or gang requeue (no notice) and an operator's restore are not.
    executor = acting(Clock(NOW))
    executor.apply_audit(_audited("ep/notify_owner", "notify_owner", "executed"))
    for key in ("ep/requeue", "spot/requeue", "restore/Notebook/ml/nb/1"):
        executor.apply_audit(_audited(key, "requeue", "executed"))
    assert list(executor.breaker.reclaimed) == ["ep/requeue"]
