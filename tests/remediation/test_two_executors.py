"""Two executors at once in one consumer group: the guards hold fleet-wide.

A Deployment does not promise one pod at a time: a pod on a node cut off from the
API server stays (Unknown, Terminating) while its replacement starts, an operator
scales to 2, a rollout overlaps. Here two real executors (their own Kafka consumers in
one group on the embedded broker, the Kubernetes backend on the API-server double) run
at once; the actions partition moves from one to the other as one stops, as it does
when the old pod finally goes. What one did must bind the other: the nodes it
disrupted count in the other's breaker window, its trip stops the other, the owner
notice it delivered lets the other reclaim after the lead, and a key it executed is
not carried out again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from gpusteward import kafka, topics
from gpusteward.remediation.executor import (
    BREAKER_RESET_PREFIX,
    BREAKER_TRIP_PREFIX,
    Executor,
    RemediationSettings,
    reset_breaker,
)
from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings
from gpusteward.rules.idle import RECLAIM_REASON
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.schema import Action, ActionResult, PodRef, Subject
from gpusteward.settings import Settings
from tests.remediation.cluster import cordoned, job, node, pod, publish_actions

Scenario = Callable[["Pair"], Awaitable[None]]


class Pair:
    """Two executors running at once in one group, each with its own decisions."""

    def __init__(self, settings: Settings, kube_settings: KubeSettings,
                 policy: RemediationSettings) -> None:
        self.settings = settings
        self.executors = [Executor(settings, KubernetesBackend(kube_settings), execute=True,
                                   remediation=policy, group_id="executors")
                          for _ in range(2)]
        self.decided: list[list[ActionResult]] = [[], []]
        self._stops = [asyncio.Event(), asyncio.Event()]
        self._tasks: list[asyncio.Task[None]] = []
        self._news = asyncio.Event()
        for index, executor in enumerate(self.executors):
            executor.on_result = (lambda _a, r, i=index: self._note(i, r))

    def _note(self, index: int, result: ActionResult) -> None:
        self.decided[index].append(result)
        self._news.set()

    async def start(self, *which: int) -> None:
        """Start the executors ``which`` (both by default)."""
        for index in which or (0, 1):
            self._tasks.append(asyncio.create_task(
                self.executors[index].run(self._stops[index])))
        # Joined the group and the partition is assigned (the embedded broker holds a
        # join for half the session).
        await asyncio.sleep(3.0)

    async def publish(self, *actions: Action) -> None:
        await publish_actions(self.settings, *actions)

    async def until(self, count: int, timeout_s: float = 20.0) -> None:
        """Until ``count`` decisions were made in all."""
        async with asyncio.timeout(timeout_s):
            while sum(map(len, self.decided)) < count:
                self._news.clear()
                await self._news.wait()

    def holder(self) -> int:
        """The executor that made the last decision: the one holding the partition."""
        return max((0, 1), key=lambda i: max((r.ts for r in self.decided[i]), default=0.0))

    async def stop(self, index: int) -> None:
        self._stops[index].set()
        await self._tasks[index]

    async def stop_all(self) -> None:
        for stop in self._stops:
            stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def run(settings: Settings, kube_settings: KubeSettings, policy: RemediationSettings,
        scenario: Scenario, *, started: tuple[int, ...] = (0, 1)) -> Pair:
    settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(
        update={"session_timeout_s": 2.0})})

    async def main() -> Pair:
        await kafka.ensure_topics(settings)
        pair = Pair(settings, kube_settings, policy)
        await pair.start(*started)
        try:
            await scenario(pair)
        finally:
            await pair.stop_all()
        for task in pair._tasks:
            assert task.exception() is None, task.exception()
        return pair

    return asyncio.run(main())


def cordon(node_name: str) -> Action:
    return Action(idempotency_key=f"f-{node_name}/cordon", verb="cordon",
                  target=Subject(node=node_name), reason="ECC DBE", rule="ecc_dbe",
                  finding_ids=[f"f-{node_name}"], ts=time.time())


async def hand_over(pair: Pair) -> int:
    """Stop the executor holding the partition; the other is the one that goes on."""
    holder = pair.holder()
    await pair.stop(holder)
    return 1 - holder


BREAKER = RemediationSettings(enabled_rules={"ecc_dbe"}, breaker_max_nodes=2,
                              fleet_gpu_nodes=100)


def test_nodes_one_executor_disrupted_count_in_the_others_breaker_window(
        kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    kube.load([node(f"gpu-{i}") for i in range(1, 5)])

    async def scenario(pair: Pair) -> None:
        await pair.publish(cordon("gpu-1"), cordon("gpu-2"))
        await pair.until(2)
        other = await hand_over(pair)
        await pair.publish(cordon("gpu-3"))
        await pair.until(3)
        [third] = pair.decided[other]
        assert third.outcome == "refused", third
        assert "circuit breaker (node actions) tripped: 2 nodes" in third.detail

    run(settings, kube_settings, BREAKER, scenario)
    assert cordoned(kube) == ["gpu-1", "gpu-2"], "the fleet-wide limit is 2 nodes per window"


def test_a_trip_by_one_executor_stops_the_other_and_a_reset_reaches_both(
        kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    kube.load([node(f"gpu-{i}") for i in range(1, 6)])
    # A window short enough to be over before the hand-over: only the trip stops gpu-4.
    policy = BREAKER.model_copy(update={"breaker_window_s": 1.0})

    async def scenario(pair: Pair) -> None:
        await pair.publish(cordon("gpu-1"), cordon("gpu-2"), cordon("gpu-3"))
        await pair.until(3)
        first = pair.holder()
        assert [r.outcome for r in pair.decided[first]] == ["executed", "executed", "refused"]
        await asyncio.sleep(1.0)  # the trip's audit record read by the other
        assert all(e.breaker.open for e in pair.executors), "the trip reaches both"
        other = await hand_over(pair)
        await asyncio.sleep(1.0)
        await pair.publish(cordon("gpu-4"))
        await pair.until(4)
        [fourth] = pair.decided[other]
        assert fourth.outcome == "refused", fourth
        assert "circuit breaker (node actions) open" in fourth.detail, fourth
        await reset_breaker(pair.settings, "alice", "checked the nodes")
        await asyncio.sleep(1.0)
        assert not pair.executors[other].breaker.open
        await pair.publish(cordon("gpu-5"))
        await pair.until(5)
        assert pair.decided[other][-1].outcome == "executed"

    pair = run(settings, kube_settings, policy, scenario)
    assert cordoned(kube) == ["gpu-1", "gpu-2", "gpu-5"]
    audit = asyncio.run(kafka.read_all(pair.settings, topics.ACTION_RESULTS.name(settings)))
    keys = [(r.key or b"").decode() for r in audit]
    assert sum(k.startswith(BREAKER_TRIP_PREFIX) for k in keys) == 1, "one trip, one record"
    assert sum(k.startswith(BREAKER_RESET_PREFIX) for k in keys) == 1


def test_an_owner_notice_one_executor_delivered_lets_the_other_reclaim_after_the_lead(
        kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    kube.load([node("gpu-1"), pod("ml-alice", "serve-0", "gpu-1", owner_kind="Job",
                                  owner_name="serve"), job("ml-alice", "serve")])
    policy = RemediationSettings(enabled_rules={"idle_holder"}, min_notice_s=1.0)
    target = Subject(node="gpu-1", pod=PodRef("ml-alice", "serve-0", "uid-ml-alice-serve-0"))
    notice = Action(idempotency_key="f1/notify_owner", verb="notify_owner", target=target,
                    reason="idle for 30 min", rule="idle_holder", finding_ids=["f1"],
                    ts=time.time())

    async def scenario(pair: Pair) -> None:
        await pair.publish(notice)
        await pair.until(1)
        assert pair.decided[pair.holder()][0].outcome == "executed"
        other = await hand_over(pair)
        reclaim = Action(idempotency_key="f1/requeue", verb="requeue", target=target,
                         reason="idle for 2 h", rule="idle_holder", finding_ids=["f1"],
                         ts=time.time(), params={"reason": RECLAIM_REASON})
        await pair.publish(reclaim)
        await pair.until(2)
        [reclaimed] = pair.decided[other]
        assert reclaimed.outcome == "executed", reclaimed

    run(settings, kube_settings, policy, scenario)
    assert ("ml-alice", "serve-0") not in {
        (p["metadata"]["namespace"], p["metadata"]["name"]) for p in kube.objects("Pod")}


def test_a_key_one_executor_carried_out_is_not_carried_out_again_by_the_other(
        kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    kube.load([node("gpu-1")])
    first = cordon("gpu-1")

    async def scenario(pair: Pair) -> None:
        await pair.publish(first)
        await pair.until(1)
        other = await hand_over(pair)
        # The same action delivered again (a re-publish, a rebalance before the commit).
        await pair.publish(first)
        await pair.until(2)
        [again] = pair.decided[other]
        assert again.outcome == "skipped" and "already executed" in again.detail, again

    run(settings, kube_settings, BREAKER, scenario)


def test_an_action_in_flight_when_the_other_executor_joins_takes_effect_once(
        kube: KubeApiServer, kube_settings: KubeSettings, settings: Settings) -> None:
    """A rebalance mid-action, the race left: the first executor waits out a 503's
    Retry-After while the second joins the group and may be handed the partition, the
    action not committed. Whichever decides it again, the node is cordoned by one write:
    the second skips a key it read as executed, or the backend finds the cordon in place.
    (Which executor ends up with the partition is the broker's choice: this pins the
    bound the docs state, and passes on the old code too.)"""
    kube.load([node("gpu-1")])
    kube.fail("PATCH", retry_after=4.0)
    policy = BREAKER.model_copy(update={"retry_backoff_s": 0.1})

    async def scenario(pair: Pair) -> None:
        await pair.publish(cordon("gpu-1"))
        await asyncio.sleep(0.5)  # the first try refused, the executor waiting to retry
        await pair.start(1)
        await pair.until(2, timeout_s=15.0)  # a retrying record and a final one at least
        await asyncio.sleep(6.0)  # the partition's new holder has read it again, if it got it

    pair = run(settings, kube_settings, policy, scenario, started=(0,))
    finals = [r for r in pair.decided[0] + pair.decided[1] if r.outcome != "retrying"]
    assert finals and {r.outcome for r in finals} <= {"executed", "skipped"}, finals
    assert [r.method for r in kube.requests if r.method == "PATCH" and r.status == 200] == \
        ["PATCH"], "the node was cordoned by one write"
    assert cordoned(kube) == ["gpu-1"]
