"""A memory finding is about its holder's use of the device: when the pod lets the device go,
the episode closes, whoever takes the device next, under the shipped policy.

A training job's high-memory episode used to outlive the job when a serving pod took the GPU
(the high-memory rule leaves serving pods' devices alone, so nothing judged the device again):
the alert fired for ever, naming a pod long gone. The same for a server's low-free episode
when a training job took its GPU.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpusteward.rules import policy
from gpusteward.schema import (
    DeviceHolder,
    DeviceSample,
    Finding,
    NodeSample,
    PodAllocation,
    PodPhase,
    PodRef,
)
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings
from gpusteward.streams.policy_file import load_policy

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
TOTAL_MIB = 81559  # an H100 80GB
T0 = 1_000_000.0
STEP = 30.0


def allocation(name: str, kind: str, ts: float, phase: PodPhase = "running") -> PodAllocation:
    pod = PodRef(namespace="ml", name=name, uid=f"u-{name}")
    return PodAllocation(ts=ts, node="n1", pod=pod, phase=phase, gpus=1, device_ids=["GPU-a"],
                         started_at=ts, workload_kind=kind, owner_kind="ReplicaSet",
                         owner_name=name)


def sample(ts: float, used_mib: float) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-a", index=0, model="NVIDIA H100 80GB HBM3", util_pct=60.0,
                     temp_c=60.0, mem_used_bytes=int(used_mib * MIB),
                     mem_total_bytes=TOTAL_MIB * MIB)])


@pytest.mark.parametrize(("rule", "first", "then"), [
    ("gpu_memory_high", "batch", "inference"),  # the next holder is one the rule leaves alone
    ("gpu_memory_low_free", "inference", "batch"),
    ("gpu_memory_high", "batch", "batch"),  # the next holder is judged afresh
])
def test_an_episode_closes_when_its_pod_releases_the_gpu(rule: str, first: str,
                                                         then: str) -> None:
    join = NodeJoin(RuleSettings(policy=load_policy(REPO / "deploy" / "base" / "policy.yaml")))
    state = NodeState()
    out = join.on_allocation(state, allocation("first", first, T0 - 600))
    ts = T0
    for _ in range(20):  # 10 min with 512 MiB free: above 90 % used, below the 2 GiB floor
        out += join.on_sample(state, sample(ts, TOTAL_MIB - 512))
        ts += STEP
    out += join.on_allocation(state, allocation("first", first, ts, phase="finished"))
    ended = ts
    out += join.on_allocation(state, allocation("next", then, ts + 5))
    for _ in range(240):  # two hours of the next pod, with as little free
        out += join.on_sample(state, sample(ts, TOTAL_MIB - 512))
        ts += STEP
    found = [(f.state, f.subject.pod.name if f.subject.pod else None, f.ts) for f in out
             if isinstance(f, Finding) and f.kind == rule]
    assert found[:2] == [("firing", "first", T0 + (300 if rule == "gpu_memory_high" else 60)),
                         ("resolved", "first", ended)]
    [closed] = [f for f in out if isinstance(f, Finding) and f.state == "resolved"]
    assert closed.summary == "GPU-a on n1: ml/first released the GPU"
    # A holder the rule judges gets an episode of its own (a window after it starts); one it
    # leaves alone gets none.
    judged_next = (rule == "gpu_memory_high") == (then == "batch")
    assert found[2:] == ([("firing", "next", ended + 300)] if judged_next else [])


@pytest.mark.parametrize(("rule", "kind", "now_left_alone"), [
    ("gpu_memory_high", "batch", "{gpu_memory_high: {exempt_kinds: [inference, batch]}}"),
    ("gpu_memory_overcommit", "batch",
     "{gpu_memory_overcommit: {exempt_kinds: [inference, batch]}}"),
    ("gpu_memory_low_free", "inference", "{gpu_memory_low_free: {workload_kinds: [notebook]}}"),
])
def test_an_episode_closes_when_the_policy_leaves_its_holders_kind_alone(
        rule: str, kind: str, now_left_alone: str) -> None:
    """The policy changes while an episode is open, and the worker restarts with it: the
    rule no longer judges devices of the holder's kind, so nothing would ever judge the
    device again while the pod runs (a server runs for weeks). The episode closes at the
    node's first sample under the new policy, saying why; the pod gets no new one."""
    shipped = load_policy(REPO / "deploy" / "base" / "policy.yaml")
    join, state = NodeJoin(RuleSettings(policy=shipped)), NodeState()
    out = join.on_allocation(state, allocation("holder", kind, T0 - 600))
    if rule == "gpu_memory_overcommit":  # a time-sliced GPU two pods share
        out += join.on_allocation(state, allocation("other", kind, T0 - 600))
    ts = T0
    for _ in range(20):  # 10 min with 512 MiB free: above 90 % used, below the 2 GiB floor
        out += join.on_sample(state, _shared(sample(ts, TOTAL_MIB - 512), rule))
        ts += STEP
    assert [f.state for f in out if isinstance(f, Finding) and f.kind == rule] == ["firing"]
    # The worker restarts with the new policy; the node's state comes from its changelog.
    state = msgspec.msgpack.Decoder(NodeState).decode(msgspec.msgpack.encode(state))
    join = NodeJoin(RuleSettings(policy=policy.parse_policy(f"rules: {now_left_alone}\n")))
    restarted = ts
    out = []
    for _ in range(240):  # two more hours as full
        out += join.on_sample(state, _shared(sample(ts, TOTAL_MIB - 512), rule))
        ts += STEP
    found = [f for f in out if isinstance(f, Finding) and f.kind == rule]
    assert [(f.state, f.ts) for f in found] == [("resolved", restarted)]
    assert found[0].summary.startswith("GPU-a on n1: ml/")
    assert found[0].summary.endswith("is of a workload kind the rule leaves alone now")
    assert not [f for f in state.findings.values() if f.kind == rule]


def _shared(node_sample: NodeSample, rule: str) -> NodeSample:
    """The sample as a time-sliced GPU's, held by both pods, for the overcommit rule."""
    if rule != "gpu_memory_overcommit":
        return node_sample
    (device,) = node_sample.devices
    half = (device.mem_used_bytes or 0) // 2
    holders = [DeviceHolder(pod=PodRef(namespace="ml", name=name, uid=f"u-{name}"),
                            mem_used_bytes=half) for name in ("holder", "other")]
    return msgspec.structs.replace(node_sample, devices=[
        msgspec.structs.replace(device, holders=holders, pod=None)])
