"""A pod of several GPUs is idle only while all of them are, under the shipped policy: one
episode on the device that first saw the whole pod idle, closed as soon as any of its GPUs
works again, and no episode at all while one of them works."""

from __future__ import annotations

from pathlib import Path

from gpusteward.rules import idle
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    NodeSample,
    PodAllocation,
    PodRef,
)
from gpusteward.streams.node import NodeJoin, NodeState, Output, RuleSettings
from gpusteward.streams.policy_file import load_policy

REPO = Path(__file__).resolve().parents[2]
T0 = 1_000_000.0
GPUS = [f"GPU-{i}" for i in range(4)]
POD = PodRef(namespace="ml", name="train-0", uid="u-train-0")


def _run(busy: dict[str, float], start_s: float, end_s: float, join: NodeJoin,
         state: NodeState) -> list[Output]:
    """Samples every 30 s from ``start_s`` to ``end_s``; the device-plugin shape: the
    allocation names no device, the collector attributes each GPU to the pod."""
    out: list[Output] = []
    ts = T0 + start_s
    while ts < T0 + end_s:
        out += join.on_sample(state, NodeSample(ts=ts, node="n1", source="test", devices=[
            DeviceSample(uuid=uuid, index=i, model="NVIDIA H100 80GB HBM3",
                         util_pct=busy.get(uuid, 0.0), temp_c=50.0, pod=POD)
            for i, uuid in enumerate(GPUS)]))
        ts += 30
    return out


def _start() -> tuple[NodeJoin, NodeState]:
    join = NodeJoin(RuleSettings(policy=load_policy(REPO / "deploy" / "base" / "policy.yaml")))
    state = NodeState()
    join.on_allocation(state, PodAllocation(
        ts=T0, node="n1", pod=POD, phase="running", gpus=4, started_at=T0 - 3600,
        workload_kind="batch", owner_kind="Job", owner_name="train"))
    return join, state


def _idle(out: list[Output]) -> list[Finding]:
    return [o for o in out if isinstance(o, Finding) and o.kind == idle.KIND]


def test_one_busy_gpu_keeps_the_pod_out_of_idle_detection() -> None:
    join, state = _start()
    out = _run({"GPU-0": 90.0}, 0, 6 * 3600, join, state)
    assert _idle(out) == [] and [o for o in out if isinstance(o, Action)] == []


def test_the_episode_is_one_and_closes_when_any_gpu_works_again() -> None:
    join, state = _start()
    out = _run({}, 0, 3600, join, state)
    (opened,) = _idle(out)
    assert opened.subject.device == "GPU-0" and opened.evidence is not None
    assert opened.evidence.values["devices"] == 4.0
    notices = [o for o in out if isinstance(o, Action) and o.verb == "notify_owner"]
    assert len(notices) == 1 and "all 4 of its GPUs (GPU-0 and 3 more)" in notices[0].reason
    # The job comes back to life on GPU-2 only: the pod works, the episode ends.
    (closed,) = _idle(_run({"GPU-2": 80.0}, 3600, 3660, join, state))
    assert (closed.id, closed.state) == (opened.id, "resolved")
    assert "GPU-2" in closed.summary
    # Idle again: a new episode, a whole window after GPU-2 went quiet.
    again = _idle(_run({}, 3660, 3660 + 1800 + 120, join, state))
    assert len(again) == 1 and again[0].id != opened.id
    assert again[0].starts_at >= T0 + 3660
