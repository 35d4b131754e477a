"""The node join on devices several pods hold: each holder judged on its own share."""

from __future__ import annotations

import msgspec

from gpusteward.schema import (
    DeviceHolder,
    DeviceSample,
    Finding,
    NodeSample,
    PodAllocation,
    PodRef,
)
from gpusteward.streams.node import NodeJoin, NodeState

T0 = 1_000_000.0
GIB = 1 << 30
BUSY = PodRef(namespace="nb", name="busy", uid="uid-busy")
IDLE = PodRef(namespace="nb", name="idle", uid="uid-idle")


def allocation(pod: PodRef, phase: str = "running", ts: float = T0) -> PodAllocation:
    return PodAllocation(ts=ts, node="n1", pod=pod, phase=phase,  # type: ignore[arg-type]
                         gpus=1, device_ids=["GPU-1"], started_at=T0 - 3600,
                         workload_kind="notebook", owner_kind="Notebook", owner_name=pod.name,
                         queue="research")


def by_process(ts: float, busy_pct: float, idle_pct: float) -> NodeSample:
    """What the NVML collector sends: holders by uid, each with its own activity."""
    return NodeSample(ts=ts, node="n1", source="nvml", devices=[DeviceSample(
        uuid="GPU-1", index=0, model="H100", util_pct=max(busy_pct, idle_pct),
        mem_used_bytes=14 * GIB, mem_total_bytes=80 * GIB, attribution="process",
        holders=[DeviceHolder(pod_uid="uid-busy", activity_pct=busy_pct,
                              mem_used_bytes=10 * GIB, processes=1),
                 DeviceHolder(pod_uid="uid-idle", activity_pct=idle_pct,
                              mem_used_bytes=4 * GIB, processes=1)])])


def shared(ts: float, util: float) -> NodeSample:
    """What dcgm-exporter lets a collector say: two pods, one reading."""
    pods = [PodRef(namespace="nb", name="busy"), PodRef(namespace="nb", name="idle")]
    return NodeSample(ts=ts, node="n1", source="dcgm", devices=[DeviceSample(
        uuid="GPU-1", index=0, model="H100", util_pct=util, pod=pods[0],
        attribution="shared", holders=[DeviceHolder(pod=p) for p in pods])])


def findings(outputs: list) -> list[Finding]:
    return [o for o in outputs if isinstance(o, Finding)]


def _run(join: NodeJoin, state: NodeState, make, minutes: int) -> list:
    out: list = []
    for i in range(minutes * 2):
        out += join.on_sample(state, make(T0 + i * 30))
    return out


def test_the_idle_pod_beside_a_busy_one_is_found_and_only_it() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(BUSY))
    join.on_allocation(state, allocation(IDLE))
    out = _run(join, state, lambda ts: by_process(ts, 85.0, 0.0), 40)
    (firing,) = findings(out)
    assert firing.subject.pod == IDLE and firing.subject.device == "GPU-1"
    assert firing.labels["workload_kind"] == "notebook"
    # Its owner is known as on a whole GPU: what a reclaim stops, and whom to tell.
    assert firing.labels["owner"] == "Notebook/idle"
    # The idle pod ends: its own episode resolves; the busy one never had one.
    (resolved,) = findings(join.on_allocation(state, allocation(IDLE, "finished", T0 + 2500)))
    assert resolved.id == firing.id and resolved.state == "resolved"
    assert "uid-idle" not in state.devices["GPU-1"].shares


def test_a_shared_busy_device_credits_no_one_and_flags_no_one() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(BUSY))
    join.on_allocation(state, allocation(IDLE))
    assert findings(_run(join, state, lambda ts: shared(ts, 85.0), 40)) == []


def test_a_shared_idle_device_is_idle_for_every_holder() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(BUSY))
    join.on_allocation(state, allocation(IDLE))
    out = findings(_run(join, state, lambda ts: shared(ts, 0.0), 40))
    assert sorted(f.subject.pod.name for f in out if f.subject.pod) == ["busy", "idle"]


def test_someone_elses_work_on_a_shared_device_does_not_reset_an_idle_run() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(BUSY))
    join.on_allocation(state, allocation(IDLE))
    # Idle, then two busy minutes (whose work, nobody can tell), then idle again: the busy
    # readings are no observation, so the run goes on for both holders, and the evidence
    # counts only the idle samples.
    busy = (T0 + 1200, T0 + 1320)
    out = findings(_run(join, state,
                        lambda ts: shared(ts, 85.0 if busy[0] <= ts < busy[1] else 0.0), 40))
    assert sorted(f.subject.pod.name for f in out if f.subject.pod) == ["busy", "idle"]
    assert all(f.evidence and f.evidence.samples == 61 - 4 for f in out)


def test_shares_survive_the_changelog_encoding() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(BUSY))
    join.on_allocation(state, allocation(IDLE))
    for i in range(30):
        join.on_sample(state, by_process(T0 + i * 30, 85.0, 0.0))
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=NodeState)
    assert restored == state
    out = []
    for i in range(30, 80):
        out += join.on_sample(restored, by_process(T0 + i * 30, 85.0, 0.0))
    assert [f.subject.pod for f in findings(out)] == [IDLE]


def _leaking(ts: float) -> NodeSample:
    """Both pods working; the busy pod's memory grows 4 GiB/h from T0."""
    leaked = 10 * GIB + int(4 * GIB * (ts - T0) / 3600)
    sample = by_process(ts, 60.0, 30.0)
    busy, idle_holder = sample.devices[0].holders
    busy.mem_used_bytes = leaked
    sample.devices[0].mem_used_bytes = leaked + (idle_holder.mem_used_bytes or 0)
    return sample


def _leaks(outputs: list) -> list[Finding]:
    return [f for f in findings(outputs) if f.kind == "gpu_memory_leak"]


def test_the_leaking_pod_of_a_shared_gpu_is_the_one_named() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(BUSY))
    join.on_allocation(state, allocation(IDLE))
    out: list = []
    for i in range(45 * 4):  # 45 min at 15 s
        out += join.on_sample(state, _leaking(T0 + i * 15))
    leaks = _leaks(out)
    assert [(f.state, f.subject.pod) for f in leaks] == [("firing", BUSY)]
    free = leaks[0].evidence.values["free_bytes"]  # type: ignore[union-attr]
    assert free < 80 * GIB - 14 * GIB  # the device's free memory, not the holder's headroom


def test_a_leak_found_before_the_pods_allocation_is_read_waits_for_its_name() -> None:
    """A catch-up can read a node's samples far ahead of its allocations: the shares are
    known by uid only until then, and the finding waits for the name."""
    join, state = NodeJoin(), NodeState()
    out: list = []
    for i in range(45 * 4):  # the trend is there from minute 30; no allocation read yet
        out += join.on_sample(state, _leaking(T0 + i * 15))
    assert _leaks(out) == []
    join.on_allocation(state, allocation(BUSY))
    join.on_allocation(state, allocation(IDLE))
    out = []
    for i in range(45 * 4, 50 * 4):
        out += join.on_sample(state, _leaking(T0 + i * 15))
    (leak,) = _leaks(out)
    assert (leak.state, leak.subject.pod) == ("firing", BUSY)


def test_a_leaking_share_whose_allocation_never_comes_is_named_by_uid() -> None:
    join, state = NodeJoin(), NodeState()
    out: list = []
    for i in range(70 * 4):
        out += join.on_sample(state, _leaking(T0 + i * 15))
    (leak,) = _leaks(out)
    assert leak.subject.pod is None and "pod uid uid-busy" in leak.summary
    # one window (30 min) after the trend was first found, at minute 30
    assert T0 + 59 * 60 <= leak.ts <= T0 + 62 * 60


def test_summaries_count_physical_gpus_on_a_time_sliced_node() -> None:
    from gpusteward.schema import NodeInventory, NodeSummary

    join, state = NodeJoin(), NodeState()
    out = join.on_allocation(state, NodeInventory(
        ts=T0, node="n1", gpu_product="H100", gpu_count=2, gpu_replicas=4,
        gpu_sharing="time-slicing", capacity={"nvidia.com/gpu": 8},
        allocatable={"nvidia.com/gpu": 8}))
    assert [(s.gpus_total, s.gpus_free, s.gpu_replicas) for s in out
            if isinstance(s, NodeSummary)] == [(2, 2, 4)]
    # Two notebooks on replicas of one GPU take one physical GPU, not two of eight.
    join.on_allocation(state, allocation(BUSY, ts=T0 + 1))
    out = join.on_allocation(state, allocation(IDLE, ts=T0 + 2))
    (summary,) = [s for s in out if isinstance(s, NodeSummary)]
    assert (summary.gpus_total, summary.gpus_free) == (2, 1)
    assert summary.replicas_free == 6  # what a pod asking nvidia.com/gpu can still get


def whole(ts: float, util: float, pod: PodRef | None) -> NodeSample:
    """A whole GPU as a kubelet-backed collector reports it: its pod, or no one."""
    return NodeSample(ts=ts, node="n1", source="nvml", devices=[DeviceSample(
        uuid="GPU-1", index=0, model="H100", util_pct=util, pod=pod,
        attribution="device" if pod else None)])


def test_minutes_after_the_collector_saw_the_pod_leave_are_not_its_idleness() -> None:
    """A worker catching up can read a node's samples ahead of the allocation that ends the
    pod: the collector's word that the pod left wins meanwhile (no false idle finding)."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(BUSY))
    busy = _run(join, state, lambda ts: whole(ts, 90.0, BUSY), 20)
    gone = [o for i in range(80)
            for o in join.on_sample(state, whole(T0 + 1200 + 30 * i, 0.0, None))]
    assert findings(busy + gone) == []
    # The end arrives late: nothing to resolve, nothing fired.
    assert findings(join.on_allocation(state, allocation(BUSY, "finished", T0 + 1200))) == []


def test_a_collector_that_never_names_pods_leaves_the_allocation_in_charge() -> None:
    """Control: without attribution the allocation alone says who holds the device."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation(IDLE))
    (firing,) = findings(_run(join, state, lambda ts: whole(ts, 0.0, None), 40))
    assert firing.subject.pod == IDLE
