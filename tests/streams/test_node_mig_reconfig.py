"""The node join around a MIG reconfiguration: what it holds, and what it must not.

The deployed path (watcher, dcgm loss tracker, join) is in
``tests/collectors/kubernetes/test_mig_reconfig.py``; these pin the edges of the window
on the join alone: faults a GPU reset does not cause, and faults after the window, still
act; ``rebooting`` holds as ``pending`` does; a deleted node's warning resolves, and its
held episodes with it.
"""

from __future__ import annotations

from typing import Any

from gpusteward.schema import Action, DeviceSample, Finding, HwEvent, NodeInventory, NodeSample
from gpusteward.streams.node import NodeJoin, NodeState

T0 = 1_000_000.0
MODEL = "NVIDIA A100-SXM4-80GB"


def inventory(ts: float, state: str | None, config: str = "all-1g.10gb",
              deleted: bool = False) -> NodeInventory:
    return NodeInventory(ts=ts, node="n1", gpu_product="NVIDIA-A100-SXM4-80GB", gpu_count=2,
                         mig_strategy="mixed", mig_config=config, mig_config_state=state,
                         allocatable={"nvidia.com/gpu": 2}, deleted=deleted)


def sample(ts: float, dbe: int = 0) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid=f"GPU-{g}", index=g, model=MODEL, util_pct=10.0, temp_c=40.0,
                     ecc_dbe_volatile=dbe if g == 0 else 0) for g in range(2)])


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
    assert state.mig_reconfig_since is None
