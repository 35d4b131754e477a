"""A gang all of whose members are idle is judged as a whole by the fleet agent: its owner is
told once, and the whole gang is suspended (a dry run under the shipped policy) two hours
later; a gang with one member at work is never suspended, and the episode resolves when a
member works again. Driven through the node joins' summaries and the watcher's queue events
into the fleet evaluator, under the shipped policy, as the worker runs them."""

from __future__ import annotations

import json
from pathlib import Path

from gpusteward.rules import gang, idle
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    QueueEvent,
)
from gpusteward.streams.fleet import FleetEvaluator, FleetSettings, FleetState
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings
from gpusteward.streams.policy_file import load_policy

REPO = Path(__file__).resolve().parents[2]
POLICY = load_policy(REPO / "deploy" / "base" / "policy.yaml")
T0 = 1_000_000.0
GANG = "JobSet/train"
MEMBERS = {f"n{i}": PodRef(namespace="ml", name=f"train-w-{i}", uid=f"u-{i}") for i in range(2)}


def _run(hours: float, busy: dict[str, tuple[float, float]] | None = None,
         keep_until: float | None = None) -> list[Finding | Action]:
    """Two members of a JobSet, one GPU each on a node of its own, samples every 30
    s for ``hours``; ``busy``: node -> (from, to) hours when its member works. Returns what
    the fleet agent emitted."""
    join = NodeJoin(RuleSettings(policy=POLICY))
    fleet = FleetEvaluator(FleetSettings(policy=POLICY))
    fleet_state = FleetState()
    states = {node: NodeState() for node in MEMBERS}
    out: list[Finding | Action] = []
    for node, pod in MEMBERS.items():
        annotations = ({idle.KEEP_UNTIL_ANNOTATION: idle.rfc3339(keep_until)}
                       if keep_until is not None and node == "n1" else {})
        join.on_allocation(states[node], PodAllocation(
            ts=T0, node=node, pod=pod, phase="running", gpus=1, device_ids=[f"GPU-{node}"],
            started_at=T0 - 3600, workload_kind="batch", owner_kind="JobSet",
            owner_name="train", gang=GANG, gang_size=2, annotations=annotations))
        out += fleet.on_queue(fleet_state, QueueEvent(
            ts=T0, name=pod.name, namespace="ml", cluster_queue="train", state="admitted",
            admitted_at=T0 - 3600, gpus=1, kind="pod", gang=GANG, gang_size=2))
    ts = T0
    while ts < T0 + hours * 3600:
        for node, pod in MEMBERS.items():
            window = (busy or {}).get(node)
            working = window is not None and window[0] * 3600 <= ts - T0 < window[1] * 3600
            for record in join.on_sample(states[node], NodeSample(
                    ts=ts, node=node, source="test", devices=[DeviceSample(
                        uuid=f"GPU-{node}", index=0, model="NVIDIA H100 80GB HBM3",
                        util_pct=90.0 if working else 0.0, temp_c=40.0, pod=pod)])):
                if isinstance(record, NodeSummary):
                    out += fleet.on_summary(fleet_state, record)
        ts += 30
    return out


def _of(out: list[Finding | Action]) -> tuple[list[Finding], list[Action]]:
    findings = [o for o in out if isinstance(o, Finding) and o.kind == gang.IDLE_KIND]
    ids = {f.id for f in findings}
    return findings, [o for o in out if isinstance(o, Action) and set(o.finding_ids) & ids]


def test_a_gang_all_idle_is_told_once_then_suspended_as_a_whole() -> None:
    findings, actions = _of(_run(5))
    firing = [f for f in findings if f.state == "firing"]
    assert len({f.id for f in firing}) == 1 and all(f.state == "firing" for f in findings)
    told, suspend = actions
    assert told.verb == "notify_owner" and told.target.pod == MEMBERS["n0"]
    assert "All 2 members of gang JobSet/train in ml" in told.reason
    assert "gpusteward act --restore JobSet/ml/train" in told.reason
    # The whole gang, two hours after the notice (the shipped idle_reclaim_after_s), once.
    assert suspend.verb == "requeue" and suspend.dry_run
    assert suspend.params["reason"] == idle.RECLAIM_REASON and suspend.params["gang"] == GANG
    assert "workload" not in suspend.params  # a requeue of the workload would restart it
    # The backend checks the member pod once more against the idle rule's exemptions.
    assert json.loads(suspend.params["exempt"])["labels"] == {"gpusteward.io/idle-exempt": "true"}
    # Two hours after the notice, once the members' summaries (every 60 s of an unchanged
    # node) show them idle that long: within a summary interval and an evaluation after.
    assert 7200 <= suspend.ts - told.ts <= 7200 + 60 + 30
    # The episode starts when the last member went idle (each member's own episode).
    assert firing[0].starts_at == max(f.starts_at for f in firing)


def test_a_gang_with_one_member_at_work_is_never_suspended() -> None:
    findings, actions = _of(_run(5, busy={"n1": (0, 5)}))
    assert findings == [] and actions == []


def test_the_episode_resolves_when_a_member_works_again() -> None:
    # Both idle from the start (told after about 35 min), n1 works from 1 h 30 to 2 h.
    findings, actions = _of(_run(2.5, busy={"n1": (1.5, 2.0)}))
    assert [a.verb for a in actions] == ["notify_owner"]
    assert [f.state for f in findings] == ["firing", "resolved"]
    assert findings[0].id == findings[1].id
    assert "no longer idle: a member works again" in findings[1].summary
    assert T0 + 1.5 * 3600 <= findings[1].ts < T0 + 1.5 * 3600 + 90


def test_a_members_keep_until_holds_the_whole_gang() -> None:
    # n1 is kept for 3 h from the start: the gang is idle (a finding) but neither told nor
    # suspended while the hold lasts; told once it ends, suspended two hours after that.
    findings, actions = _of(_run(5.5, keep_until=T0 + 3 * 3600))
    assert "left alone until" in findings[0].summary
    told, suspend = actions
    assert told.verb == "notify_owner" and T0 + 3 * 3600 <= told.ts < T0 + 3 * 3600 + 60
    assert suspend.verb == "requeue" and suspend.ts - told.ts >= 7200
