"""The node join around a MIG reconfiguration: what it holds, and what it must not.

The deployed path (watcher, dcgm loss tracker, join) is in
``tests/collectors/kubernetes/test_mig_reconfig.py``; these pin the edges of the window
on the join alone: faults a GPU reset does not cause, and faults after the window, still
act; ``rebooting`` holds as ``pending`` does; a deleted node's warning resolves, and its
held episodes with it; a GPU still silent ``mig_settle_s`` after the success acts, once;
the watcher's clock off the node's changes nothing; a worker that read the reset ahead of
the ``pending`` asked once and does not ask again.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gpusteward.edge import Rejected
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    HwEvent,
    NodeInventory,
    NodeSample,
    NodeSummary,
    QueueEvent,
)
from gpusteward.streams.fleet import FleetEvaluator, FleetState
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings

T0 = 1_000_000.0
MODEL = "NVIDIA A100-SXM4-80GB"


def inventory(ts: float, state: str | None, config: str = "all-1g.10gb",
              deleted: bool = False) -> NodeInventory:
    return NodeInventory(ts=ts, node="n1", gpu_product="NVIDIA-A100-SXM4-80GB", gpu_count=2,
                         mig_strategy="mixed", mig_config=config, mig_config_state=state,
                         allocatable={"nvidia.com/gpu": 2}, deleted=deleted)


def sample(ts: float, dbe: int = 0, gpus: int = 2) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid=f"GPU-{g}", index=g, model=MODEL, util_pct=10.0, temp_c=40.0,
                     ecc_dbe_volatile=dbe if g == 0 else 0) for g in range(gpus)])


def lost(ts: float) -> HwEvent:
    return HwEvent(ts=ts, node="n1", kind="gpu_lost", uuid="GPU-1", detail="gone")


def verbs(out: list[Any]) -> list[tuple[str, str]]:
    return [(o.verb, o.rule) for o in out if isinstance(o, Action)]


def test_a_fault_a_reset_does_not_cause_still_cordons_during_the_window() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, inventory(T0, "rebooting"))
    join.on_sample(state, sample(T0 + 10))
    out = join.on_sample(state, sample(T0 + 40, dbe=1))
    assert verbs(out) == [("cordon", "ecc_dbe")]
    assert verbs(join.on_hw_event(state, lost(T0 + 50))) == []  # rebooting holds as pending


def test_a_gpu_lost_after_the_success_drains() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, inventory(T0, "success", config="all-disabled"))
    join.on_allocation(state, inventory(T0 + 10, "pending"))
    assert verbs(join.on_hw_event(state, lost(T0 + 20))) == []
    join.on_allocation(state, inventory(T0 + 60, "success"))
    settled = join.on_sample(state, sample(T0 + 90))
    assert [f.state for f in settled if isinstance(f, Finding)] == ["resolved"]
    # A GPU lost later is a fault again, not the reconfiguration's.
    assert verbs(join.on_hw_event(state, lost(T0 + 600))) == [("drain", "gpu_lost")]


def test_a_failed_reconfiguration_keeps_its_episodes_and_a_deletion_resolves_it() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, inventory(T0, "pending"))
    join.on_hw_event(state, lost(T0 + 20))
    (warning,) = [o for o in join.on_allocation(state, inventory(T0 + 60, "failed"))
                  if isinstance(o, Finding)]
    assert (warning.kind, warning.state, warning.severity) == (
        "mig_config_failed", "firing", "warning")
    assert verbs(join.on_hw_event(state, lost(T0 + 90))) == []  # one episode, no drain
    out = join.on_allocation(state, inventory(T0 + 120, "failed", deleted=True))
    # The warning resolves as a deletion ends a failed reconfiguration; the GPU's held loss
    # as every finding open on a deleted node does.
    assert [(f.kind, f.state, f.id == warning.id) for f in out if isinstance(f, Finding)] == [
        ("mig_config_failed", "resolved", True), ("gpu_lost", "resolved", False)]


def test_a_loss_without_a_uuid_during_the_window_settles_when_every_gpu_answers() -> None:
    # The NVML collector restarted during the reset and could not read a GPU's UUID.
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, inventory(T0, "pending"))
    out = join.on_hw_event(state, HwEvent(ts=T0 + 20, node="n1", kind="gpu_lost",
                                          detail="GPU 1 unreadable at start"))
    assert verbs(out) == [] and [f.kind for f in out if isinstance(f, Finding)] == ["gpu_lost"]
    join.on_allocation(state, inventory(T0 + 60, "success"))
    settled = join.on_sample(state, sample(T0 + 90))
    assert [(f.kind, f.state) for f in settled if isinstance(f, Finding)] == [
        ("gpu_lost", "resolved")]
    assert not state.mig_held


def test_a_gpu_still_silent_after_the_success_drains_once_saying_why() -> None:
    join, state = NodeJoin(RuleSettings(mig_settle_s=300, reask_s=600)), NodeState()
    join.on_allocation(state, inventory(T0, "pending"))
    (held,) = [f for f in join.on_hw_event(state, lost(T0 + 20)) if isinstance(f, Finding)]
    join.on_allocation(state, inventory(T0 + 60, "success"))
    out: list[Any] = []
    for ts in range(int(T0) + 90, int(T0) + 360, 30):  # GPU 1 silent, inside the grace
        out += join.on_sample(state, sample(ts, gpus=1))
    assert verbs(out) == [] and not [f for f in out if isinstance(f, Finding)]
    # The node's state rides the changelog between any two records.
    state = msgspec.json.decode(msgspec.json.encode(state), type=NodeState)
    out = join.on_sample(state, sample(T0 + 360, gpus=1))  # 5 min after the success
    (again,) = [f for f in out if isinstance(f, Finding)]
    (drain,) = [a for a in out if isinstance(a, Action)]
    assert (again.id, again.state, again.severity) == (held.id, "firing", "critical")
    assert "not back 5 min after the MIG reconfiguration to all-1g.10gb succeeded" \
        in again.summary
    assert again.labels["mig_settle"] == "overdue"
    assert (drain.verb, drain.rule, drain.finding_ids, drain.reask, drain.ts) == (
        "drain", "gpu_lost", [held.id], 0, T0 + 360)
    assert drain.idempotency_key == f"{held.id}/drain" and "not back" in drain.reason
    later: list[Any] = []
    for ts in range(int(T0) + 390, int(T0) + 990, 30):  # asked once, then re-asked as any
        later += join.on_sample(state, sample(ts, gpus=1))
    assert [(a.verb, a.reask) for a in later if isinstance(a, Action)] == [("drain", 1)]
    back = join.on_sample(state, sample(T0 + 1020))
    assert [(f.id, f.state) for f in back if isinstance(f, Finding)] == [(held.id, "resolved")]
    assert not state.asks and not state.mig_held and state.mig_reconfig_since is None


@pytest.mark.parametrize("skew_s", [-120.0, 120.0])
def test_the_watchers_clock_off_the_nodes_settles_the_reset_all_the_same(skew_s: float
                                                                         ) -> None:
    # The watcher stamps the node's states on its own clock, skew_s off the node's: the
    # reset's XID (node time T0 + 30, between pending at T0 and success at T0 + 60) falls
    # before the window (watcher ahead) or after it (watcher behind).
    join, state = NodeJoin(), NodeState()
    join.on_sample(state, sample(T0 - 30))
    join.on_allocation(state, inventory(T0 + skew_s, "pending"))
    out = join.on_hw_event(state, HwEvent(ts=T0 + 30, node="n1", kind="xid", uuid="GPU-1",
                                          xid=46, detail="reset"))
    assert verbs(out) == []
    join.on_allocation(state, inventory(T0 + 60 + skew_s, "success"))
    settled = join.on_sample(state, sample(T0 + 90))
    assert [(f.kind, f.state) for f in settled if isinstance(f, Finding)] == [
        ("xid", "resolved")]
    assert not state.mig_held and not state.devices["GPU-1"].hw.xid.recent
    out = []
    for ts in range(int(T0) + 120, int(T0) + 1500, 30):
        out += join.on_sample(state, sample(ts))
    assert verbs(out) == [] and state.mig_reconfig_since is None


@pytest.mark.parametrize("back", [True, False])
def test_a_reset_read_after_the_success_is_held_as_during_the_window(back: bool) -> None:
    # The worker read the node's allocations ahead of its hardware events: the success
    # before the loss the reset caused a minute earlier (the GPU left the page, and the
    # loss tracker waited three scrapes to say so).
    join, state = NodeJoin(RuleSettings(mig_settle_s=300)), NodeState()
    join.on_allocation(state, inventory(T0, "pending"))
    join.on_allocation(state, inventory(T0 + 120, "success"))
    join.on_sample(state, sample(T0 + 30, gpus=1))
    out = join.on_hw_event(state, lost(T0 + 60))
    assert verbs(out) == [] and [f.labels["mig_config_state"] for f in out
                                 if isinstance(f, Finding)] == ["success"]
    later: list[Any] = []
    for ts in range(int(T0) + 150, int(T0) + 450, 30):
        later += join.on_sample(state, sample(ts, gpus=2 if back else 1))
    if back:
        assert verbs(later) == [] and [(f.kind, f.state) for f in later
                                       if isinstance(f, Finding)] == [("gpu_lost", "resolved")]
    else:
        assert [(a.verb, a.ts) for a in later if isinstance(a, Action)] == [
            ("drain", T0 + 420)]


def test_a_reset_read_ahead_of_the_pending_is_asked_for_once() -> None:
    # A worker catching up reads the node's hardware events ahead of its allocations: the
    # reset's loss is judged before the pending, and its drain asked (it cannot be taken
    # back). Read the pending, the join asks no more while the reconfiguration lasts, and
    # the loss settles with the success.
    join, state = NodeJoin(RuleSettings(reask_s=600)), NodeState()
    join.on_allocation(state, inventory(T0 - 600, "success", config="all-disabled"))
    assert verbs(join.on_hw_event(state, lost(T0 + 20))) == [("drain", "gpu_lost")]
    join.on_allocation(state, inventory(T0, "pending"))
    out: list[Any] = []
    for ts in range(int(T0) + 30, int(T0) + 1230, 30):  # 20 min of reconfiguration
        out += join.on_sample(state, sample(ts, gpus=1))
    assert verbs(out) == []
    join.on_allocation(state, inventory(T0 + 1230, "success"))
    out = join.on_sample(state, sample(T0 + 1260))
    assert [(f.kind, f.state) for f in out if isinstance(f, Finding)] == [
        ("gpu_lost", "resolved")]
    assert not state.asks


def test_a_collector_clock_stepped_back_moves_the_grace_with_it() -> None:
    # The node's collector clock goes back an hour after the success; once the join takes
    # the new clock (5 min on it later) the grace ends as long after the success on the new
    # clock, not an hour of samples later.
    join, state = NodeJoin(RuleSettings(mig_settle_s=600)), NodeState()
    join.on_allocation(state, inventory(T0, "pending"))
    join.on_sample(state, sample(T0 + 10, gpus=1))
    join.on_hw_event(state, lost(T0 + 20))
    join.on_allocation(state, inventory(T0 + 60, "success"))
    join.on_sample(state, sample(T0 + 90, gpus=1))
    step = 3600.0
    drains: list[float] = []
    for ts in range(int(T0 + 120 - step), int(T0 + 1200 - step), 30):
        try:
            out = join.on_sample(state, sample(ts, gpus=1))
        except Rejected:
            continue  # until the node has kept to its new clock for clock_step_after_s
        drains += [a.ts for a in out if isinstance(a, Action) and a.verb == "drain"]
    assert state.clock_steps == 1 and len(drains) == 1
    assert T0 + 660 - step <= drains[0] <= T0 + 660 - step + 60  # the step as measured


def test_a_layout_being_changed_tells_no_mig_request_it_can_never_start() -> None:
    """While mig-manager changes the node's layout, its summaries say so, and the fleet
    agent does not tell a pod asking for a profile the old layout lacks that it can never
    start: the new layout may offer it. A failed change leaves the old layout, and then it
    does, after the stranded window."""
    join, state = NodeJoin(), NodeState()
    fleet, view = FleetEvaluator(), FleetState()

    def mig_inventory(ts: float, mig_state: str) -> NodeInventory:
        return msgspec.structs.replace(inventory(ts, mig_state), allocatable={
            "nvidia.com/gpu": 0, "nvidia.com/mig-1g.10gb": 14})

    def run(start: float, end: float) -> list[Finding]:
        found: list[Any] = []
        for ts in range(int(start), int(end), 30):
            for output in join.on_sample(state, sample(ts)):
                if isinstance(output, NodeSummary):
                    summaries.append(output)
                    found += fleet.on_summary(view, output)
        return [f for f in found if isinstance(f, Finding) and f.kind == "stranded_capacity"]

    summaries: list[NodeSummary] = []
    join.on_allocation(state, mig_inventory(T0, "success"))
    fleet.on_queue(view, QueueEvent(ts=T0, name="rerank", namespace="ml",
                                    cluster_queue="serve", state="pending", created_at=T0,
                                    mig={"2g.20gb": 1}))
    join.on_allocation(state, mig_inventory(T0 + 10, "pending"))
    assert run(T0 + 30, T0 + 1230) == []  # 20 min of reconfiguration
    assert summaries and all(s.mig_changing and s.mig_total == {"1g.10gb": 14}
                             for s in summaries)
    join.on_allocation(state, mig_inventory(T0 + 1230, "failed"))
    (never,) = run(T0 + 1230, T0 + 1800)
    assert not summaries[-1].mig_changing
    assert never.evidence is not None and never.evidence.values[
        "requested_mig_devices_per_pod"] == 1
    assert never.starts_at >= T0 + 1230 and never.ts - never.starts_at >= 300
