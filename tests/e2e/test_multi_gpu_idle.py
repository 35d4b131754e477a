"""Pods of several GPUs are judged as pods, through the production collectors and the
deployed worker (the ``multi-gpu-idle`` world: device-plugin GPUs, so the worker learns
which GPUs a pod holds from the collector's kubelet attribution, not from the API server).

A 4-GPU training job whose code runs on one GPU was reported idle on the other three, with
a notice per GPU at each ladder step and, after two and a half hours, three reclaims of a
job doing its work; a 4-GPU job that hung was four idle episodes, four notices per step,
four reclaims. Now the first is no idle holder at all (the weekly report's right-sizing
tells its owner it asks too much), and the second is one episode: one notice per step, one
reclaim, every GPU it frees offered to the fleet agent.

A two-worker JobSet that hangs (``stuck-gang``, one GPU each on nodes of their own) is an idle
gang: each worker is told and warned by its node's join but never reclaimed on its own (that
would stop the whole gang), and the fleet agent, which sees both, tells the owner once for
the gang and asks, two hours later, to suspend the whole gang (a dry run under the shipped
policy). Before, the workers were told and nothing more happened to the gang, ever.
"""

from __future__ import annotations

import asyncio

import pytest

from gpusteward.broker import EmbeddedBroker
from gpusteward.rules import gang, idle
from tests.e2e.world_run import WorldRun, run_in_world

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> WorldRun:
    # Paced (3.5 h in 20 s): the fleet agent judges the gang only with its members' queue
    # events read, which as fast as it goes may come after the day's last summary.
    return asyncio.run(run_in_world(broker, "multi-gpu-idle",
                                    tmp_path_factory.mktemp("multi-gpu"), wall_s=20.0))


def _pods(run: WorldRun) -> dict[str, list[str]]:
    """The world's pods by name prefix (``one-of-four``, ``hung``): their GPUs."""
    return {p.pod.rsplit("-", 1)[0]: p.devices for p in run.truth.pods}


def test_the_world_is_what_the_scenario_says(run: WorldRun) -> None:
    devices = _pods(run)
    assert sorted(devices) == ["hung", "one-of-four", "stuck-gang"]
    assert len(devices["hung"]) == len(devices["one-of-four"]) == 4
    used = devices["one-of-four"][0]
    readings = {(d.uuid, d.pod.name.rsplit("-", 1)[0]): d.util_pct or 0.0
                for s in run.samples for d in s.devices if d.pod is not None}
    assert readings[(used, "one-of-four")] > 80
    assert {readings[(uuid, "one-of-four")] for uuid in devices["one-of-four"][1:]} == {0.0}


def test_a_job_using_one_of_its_gpus_is_no_idle_holder(run: WorldRun) -> None:
    named = [f for f in run.findings if f.kind == idle.KIND and f.subject.pod is not None
             and f.subject.pod.name.startswith("one-of-four")]
    assert named == []
    assert not [a for a in run.actions if a.target.pod is not None
                and a.target.pod.name.startswith("one-of-four")]


def test_a_hung_job_is_one_idle_episode_one_notice_per_step_and_one_reclaim(
        run: WorldRun) -> None:
    found = [f for f in run.findings if f.kind == idle.KIND and f.subject.pod is not None
             and f.subject.pod.name.startswith("hung")]
    assert len({f.id for f in found}) == 1
    steps = sorted({int(f.evidence.values["ladder_step"]) for f in found
                    if f.state == "firing" and f.evidence is not None})
    assert steps == [1, 2, 3]  # the scenario runs past the batch ladder's reclaim
    first = next(f for f in found if f.state == "firing")
    assert first.evidence is not None and first.evidence.values["devices"] == 4.0
    assert all(uuid in first.summary for uuid in _pods(run)["hung"])
    actions = [a for a in run.actions if a.target.pod is not None
               and a.target.pod.name.startswith("hung")]
    notices = [a for a in actions if a.verb == "notify_owner"]
    # The notice and the warning (a batch job's reclaim comes an hour after the warning:
    # no reminder between them); the last step is the reclaim.
    assert len({a.idempotency_key for a in notices}) == 2
    assert "all 4 of its GPUs" in notices[0].reason
    assert len({a.idempotency_key for a in actions if a.verb == "requeue"}) == 1


def test_the_hung_job_is_offered_to_waiting_work_as_the_four_gpus_it_frees(
        run: WorldRun) -> None:
    offered = {(h.device, h.gpus) for s in run.summaries for h in s.idle
               if h.pod.name.startswith("hung")}
    assert len(offered) == 1 and offered.pop() in {(uuid, 4) for uuid in _pods(run)["hung"]}


def test_an_idle_gang_is_told_once_and_suspended_as_a_whole(run: WorldRun) -> None:
    members = sorted(p.pod for p in run.truth.pods if p.pod.startswith("stuck-gang"))
    assert len(members) == 2
    # Each worker: its own notice and warning, never its own reclaim.
    own = [f for f in run.findings if f.kind == idle.KIND and f.subject.pod is not None
           and f.subject.pod.name in members]
    assert {f.subject.pod.name for f in own if f.subject.pod} == set(members)
    assert all(f.labels.get("reclaim") == "gang" for f in own if f.state == "firing")
    member_actions = [a for a in run.actions if a.rule == idle.KIND and a.target.pod
                      is not None and a.target.pod.name in members]
    assert member_actions and {a.verb for a in member_actions} == {"notify_owner"}
    assert not [h for s in run.summaries for h in s.idle if h.pod.name in members]
    # The gang: one episode, one notice, one suspension of the whole JobSet.
    found = [f for f in run.findings if f.kind == gang.IDLE_KIND]
    assert len({f.id for f in found}) == 1 and all(f.state == "firing" for f in found)
    assert found[0].labels["gang"] == "JobSet/stuck-gang"
    actions = [a for a in run.actions if a.rule == gang.IDLE_KIND]
    told, suspend = sorted({a.idempotency_key: a for a in actions}.values(),
                           key=lambda a: a.ts)
    assert told.verb == "notify_owner" and told.target.pod is not None
    assert told.target.pod.name == members[0]
    assert "All 2 members of gang JobSet/stuck-gang" in told.reason
    assert (suspend.verb, suspend.dry_run, suspend.params["gang"]) == (
        "requeue", True, "JobSet/stuck-gang")
    assert suspend.params["reason"] == idle.RECLAIM_REASON
    assert 7200 <= suspend.ts - told.ts < 7200 + 120
