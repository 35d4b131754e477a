"""The node join running the hardware rules and the policy, without a broker."""

from __future__ import annotations

import msgspec
import pytest

from gpusteward.rules import policy
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    HwEvent,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
)
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings

T0 = 1_000_000.0
POD = PodRef(namespace="ml-a", name="train-a", uid="uid-a")
POLICY = policy.parse_policy("""\
node_pool_label: example.com/pool
node_pools:
  hot-room: {thermal_slowdown: {window_s: 900}}
namespaces:
  ml-a: {idle_holder: {window_s: 600, grace_s: 0}}
""")


def sample(ts: float, temp: float = 50.0, util: float = 50.0) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid=f"GPU-{g}", index=g, model="NVIDIA H100 80GB HBM3", util_pct=util,
                     temp_c=temp if g == 0 else 50.0, clock_event_reasons=0, ecc_sbe_volatile=0,
                     ecc_dbe_volatile=0, pcie_replay=0, nvlink_errors=0, remap_failure=False,
                     remap_pending=False)
        for g in range(2)])


def findings(out: list) -> list[Finding]:
    return [o for o in out if isinstance(o, Finding)]


def test_xid_event_taints_and_marks_the_node_unhealthy() -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_sample(state, sample(T0))
    out = join.on_hw_event(state, HwEvent(ts=T0 + 5, node="n1", kind="xid", uuid="GPU-1",
                                          xid=119))
    (finding,) = findings(out)
    assert finding.subject.device == "GPU-1" and finding.labels["action_class"] == "reset_gpu"
    (action,) = [o for o in out if isinstance(o, Action)]
    assert action.verb == "taint"
    (summary,) = [o for o in out if isinstance(o, NodeSummary)]
    assert not summary.healthy
    assert join.on_hw_event(state, HwEvent(ts=T0 + 5, node="n1", kind="xid", uuid="GPU-1",
                                           xid=119)) == []


def test_gpu_lost_without_uuid_still_drains() -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    out = join.on_hw_event(state, HwEvent(ts=T0, node="n1", kind="gpu_lost",
                                          detail="GPU 3 unreadable at start"))
    assert [o.verb for o in out if isinstance(o, Action)] == ["drain"]


def test_thermal_episode_survives_the_changelog_and_closes_once() -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    out = []
    for i in range(15):
        out += join.on_sample(state, sample(T0 + i * 30, temp=95.0))
    (fired,) = findings(out)
    assert fired.kind == "thermal_slowdown" and fired.subject.device == "GPU-0"
    # The worker crashes and a new one decodes the state from the changelog.
    encoded = msgspec.msgpack.encode(state)
    state = msgspec.msgpack.Decoder(NodeState).decode(encoded)
    join = NodeJoin(RuleSettings(policy=POLICY))
    out = []
    for i in range(15, 40):
        out += join.on_sample(state, sample(T0 + i * 30, temp=95.0))
    assert findings(out) == []
    for i in range(40, 61):  # clear_s, 600 s, of cool samples
        out += join.on_sample(state, sample(T0 + i * 30, temp=60.0))
    (closed,) = findings(out)
    assert closed.state == "resolved" and closed.id == fired.id


def test_node_pool_overrides_apply_from_the_inventory_label() -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_allocation(state, NodeInventory(ts=T0, node="n1", labels={
        "example.com/pool": "hot-room"}))
    assert state.pool == "hot-room"
    out = []
    for i in range(40):
        out += join.on_sample(state, sample(T0 + i * 30, temp=95.0))
    (fired,) = findings(out)
    assert fired.ts == T0 + 900


def test_namespace_overrides_apply_to_the_idle_rule() -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_allocation(state, PodAllocation(
        ts=T0, node="n1", pod=POD, phase="running", gpus=1, device_ids=["GPU-1"],
        started_at=T0, workload_kind="batch"))
    out = []
    for i in range(25):
        out += join.on_sample(state, sample(T0 + i * 30, util=0.0))
    (fired,) = [f for f in findings(out) if f.kind == "idle_holder"]
    assert fired.ts == T0 + 600 and fired.subject.pod == POD


def test_mig_devices_repeating_the_parents_readings_do_not_double_episodes() -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    out = []
    model = "NVIDIA H100 80GB HBM3"
    for i in range(15):
        devices = [
            DeviceSample(uuid="GPU-0", index=0, model=model, temp_c=95.0,
                         clock_event_reasons=0x40),
            DeviceSample(uuid="MIG-0-1", index=0, model=model, kind="mig", parent_uuid="GPU-0",
                         temp_c=95.0, clock_event_reasons=0x40),
        ]
        out += join.on_sample(state, NodeSample(ts=T0 + i * 30, node="n1", source="dcgm",
                                                devices=devices))
    assert [(f.kind, f.subject.device) for f in findings(out)] == [
        ("thermal_slowdown", "GPU-0")]


def held_sample(ts: float, util: float, dbe: int = 0) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-0", index=0, model="NVIDIA H100 80GB HBM3", util_pct=util,
                     temp_c=50.0, ecc_dbe_volatile=dbe, pod=POD)])


def test_a_pod_idle_on_a_gpu_out_of_service_is_neither_notified_nor_reclaimed() -> None:
    """One problem, one alert: a DBE cordons the node; the training pod crash-looping on the
    broken GPU (0 % for hours) is its consequence, not an idle holder to notify and reclaim."""
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_allocation(state, PodAllocation(
        ts=T0, node="n1", pod=POD, phase="running", device_ids=["GPU-0"], gpus=1,
        workload_kind="batch", started_at=T0, owner_kind="Job", owner_name="train-a"))
    join.on_sample(state, held_sample(T0 + 10, util=90.0))
    out = join.on_hw_event(state, HwEvent(ts=T0 + 20, node="n1", kind="ecc_dbe",
                                          uuid="GPU-0", count=1))
    assert [o.kind for o in findings(out)] == ["ecc_dbe"]
    for i in range(1, 12 * 120):  # 12 h at 30 s
        out += join.on_sample(state, held_sample(T0 + 20 + i * 30, util=0.0, dbe=1))
    assert [o.kind for o in findings(out)] == ["ecc_dbe"]
    # One cordon (asked for again while the DBE holds), no notice, no reclaim.
    assert [o.verb for o in out if isinstance(o, Action) and not o.reask] == ["cordon"]
    assert {o.verb for o in out if isinstance(o, Action)} == {"cordon"}
    # The GPU is reset (the counter reads 0): the pod is judged again, from a fresh window.
    reset = T0 + 20 + 12 * 3600 + 60
    out = []
    for i in range(40):
        out += join.on_sample(state, held_sample(reset + i * 30, util=0.0))
    assert [(o.kind, o.state) for o in findings(out)] == [("ecc_dbe", "resolved"),
                                                          ("idle_holder", "firing")]
    assert findings(out)[1].starts_at >= reset


def test_a_node_tainted_by_gpusteward_or_not_ready_offers_no_free_gpus() -> None:
    """The fleet's free capacity leaves out a node gpusteward tainted for a GPU reset, or
    Kubernetes tainted not-ready: its free GPUs are not stranded capacity."""
    from gpusteward.schema import Taint

    join, state = NodeJoin(policy=POLICY), NodeState()

    def inventory(*taints: Taint) -> NodeSummary:
        (summary,) = join.on_allocation(state, NodeInventory(
            ts=T0, node="n1", gpu_product="NVIDIA H100 80GB HBM3", gpu_count=8,
            taints=list(taints)))
        assert isinstance(summary, NodeSummary)
        return summary

    assert not inventory(Taint("nvidia.com/gpu", "NoSchedule")).cordoned
    assert inventory(Taint("gpusteward.io/gpu-reset-required", "NoSchedule")).cordoned
    assert inventory(Taint("node.kubernetes.io/unreachable", "NoExecute")).cordoned
    assert not inventory(Taint("gpusteward.io/gpu-reset-required", "PreferNoSchedule")).cordoned
    assert not inventory().cordoned


def hw(ts: float, kind: str, **fields: object) -> HwEvent:
    return HwEvent(ts=ts, node="n1", kind=kind, uuid="GPU-1", **fields)  # type: ignore[arg-type]


def outcome(out: list) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(kind, state) of every finding and (verb, rule) of every action: what gets paged."""
    return ([(f.kind, f.state) for f in findings(out)],
            [(a.verb, a.rule) for a in out if isinstance(a, Action)])


@pytest.mark.parametrize("xid_first", [True, False])
def test_xid_48_and_the_dbe_event_are_one_finding_and_one_cordon(xid_first: bool) -> None:
    """One double-bit error arrives as Xid 48, NVML's DBE event and the DBE counter: one
    ecc_dbe finding, one cordon, whichever comes first; the reset's zero closes it."""
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_sample(state, sample(T0))
    events = [hw(T0 + 5, "xid", xid=48), hw(T0 + 6, "ecc_dbe", count=1)]
    out = []
    for event in events if xid_first else events[::-1]:
        out += join.on_hw_event(state, event)
    dbe = sample(T0 + 30)
    dbe.devices[1].ecc_dbe_volatile = 1
    out += join.on_sample(state, dbe)
    assert outcome(out) == ([("ecc_dbe", "firing")], [("cordon", "ecc_dbe")])
    assert outcome(join.on_sample(state, sample(T0 + 60)))[0] == [("ecc_dbe", "resolved")]


@pytest.mark.parametrize("xid_first", [True, False])
def test_xid_79_and_the_gpu_lost_event_are_one_finding_and_one_drain(xid_first: bool) -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_sample(state, sample(T0))
    events = [hw(T0 + 5, "xid", xid=79), hw(T0 + 6, "gpu_lost", detail="GPU is lost")]
    out = []
    for event in events if xid_first else events[::-1]:
        out += join.on_hw_event(state, event)
    assert outcome(out) == ([("gpu_lost", "firing")], [("drain", "gpu_lost")])


def xid_only_sample(ts: float) -> NodeSample:
    """A source with no ECC or lost-GPU signal of its own: temperatures and XIDs only."""
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid=f"GPU-{g}", index=g, model="NVIDIA H100 80GB HBM3", temp_c=50.0)
        for g in range(2)])


def test_xids_alone_still_cordon_on_48_and_drain_on_79() -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_sample(state, xid_only_sample(T0))
    out = join.on_hw_event(state, hw(T0 + 5, "xid", xid=48))
    assert outcome(out)[1] == [("cordon", "ecc_dbe")]
    (summary,) = [o for o in out if isinstance(o, NodeSummary)]
    assert not summary.healthy
    # No counter will ever read 0 here: the episode closes after a day with no Xid 48, as
    # the XID rule's did (and a repeat inside the day keeps it open).
    out = join.on_hw_event(state, hw(T0 + 3600, "xid", xid=48))
    out += join.on_sample(state, xid_only_sample(T0 + 3600 + 86000))
    # Nothing new: only the open episode's cordon, asked for again (its first sample since).
    assert outcome(out) == ([], [("cordon", "ecc_dbe")])
    assert [a.reask for a in out if isinstance(a, Action)] == [1]
    out = join.on_sample(state, xid_only_sample(T0 + 3600 + 86400))
    assert outcome(out)[0] == [("ecc_dbe", "resolved")]
    out = join.on_hw_event(state, hw(T0 + 90030, "xid", xid=79, detail="pci 0000:2a:00.0"))
    assert outcome(out) == ([("gpu_lost", "firing")], [("drain", "gpu_lost")])
    assert "Xid 79" in findings(out)[0].summary


@pytest.mark.parametrize("reading", [
    {"util_pct": 0.0},
    {"util_pct": 0.0, "mem_used_bytes": 0, "temp_c": 0.0},
])
def test_a_lost_gpu_is_not_back_on_a_sample_filled_with_zeros(reading: dict) -> None:
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_sample(state, sample(T0))
    assert outcome(join.on_hw_event(state, hw(T0 + 5, "gpu_lost")))[0] == [
        ("gpu_lost", "firing")]
    zeros = NodeSample(ts=T0 + 30, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-1", index=1, model="NVIDIA H100 80GB HBM3", **reading)])
    assert findings(join.on_sample(state, zeros)) == []
    # A real reading (NVML's shape: temperature, memory, utilisation) is the GPU back.
    assert outcome(join.on_sample(state, sample(T0 + 60)))[0] == [("gpu_lost", "resolved")]


# -- asking again for a node action while its finding stays open -----------------------------


def dbe_sample(ts: float, dbe: int = 1, reboot: bool = False) -> NodeSample:
    """The node's sample with GPU-1's volatile DBE counter at ``dbe``; with ``reboot``, GPU-0's
    driver asks for a node reboot (a drain)."""
    reading = sample(ts)
    reading.devices[1].ecc_dbe_volatile = dbe
    reading.devices[0].recovery_action = 2 if reboot else 0
    return reading


def actions(out: list) -> list[Action]:
    return [o for o in out if isinstance(o, Action)]


def test_an_open_dbe_asks_for_its_cordon_again_every_reask_s_until_it_resolves() -> None:
    """The executor may have refused the cordon as stale (it was down) or never got it:
    while the DBE holds, the join asks again under the same key with a fresh event time,
    once per reask_s however many samples; the state it keeps for that rides the changelog;
    once the GPU is reset the episode resolves and nothing more is asked."""
    join, state = NodeJoin(RuleSettings(policy=POLICY, reask_s=600)), NodeState()
    asked = actions(join.on_sample(state, dbe_sample(T0)))
    for i in range(1, 41):  # 20 minutes of samples every 30 s
        asked += actions(join.on_sample(state, dbe_sample(T0 + 30 * i)))
        if i == 25:  # a worker restart: the node's state comes back from the changelog
            state = msgspec.msgpack.Decoder(NodeState).decode(msgspec.msgpack.encode(state))
            join = NodeJoin(RuleSettings(policy=POLICY, reask_s=600))
    assert [(a.verb, a.reask, a.ts) for a in asked] == [
        ("cordon", 0, T0), ("cordon", 1, T0 + 600), ("cordon", 2, T0 + 1200)]
    assert {a.idempotency_key for a in asked} == {asked[0].idempotency_key}
    assert {tuple(a.finding_ids) for a in asked} == {tuple(asked[0].finding_ids)}
    # The GPU is reset: the counter reads 0, the episode resolves, nothing is asked again.
    out = join.on_sample(state, dbe_sample(T0 + 1230, dbe=0))
    assert outcome(out) == ([("ecc_dbe", "resolved")], [])
    later = [join.on_sample(state, dbe_sample(T0 + 1230 + 30 * i, dbe=0)) for i in range(1, 80)]
    assert [a for out in later for a in actions(out)] == []
    assert (state.asks, state.asks_due) == ({}, None)


def test_a_cordon_waits_while_the_node_takes_no_new_pods_and_a_drain_does_not() -> None:
    """A node cordoned (by the executor, or by hand) has what a cordon or a taint asked for:
    those are not asked again until it is uncordoned. A drain still is (a cordoned node may
    still run the pods of a lost GPU), and no idle notice or reclaim ever is."""
    join, state = NodeJoin(RuleSettings(policy=POLICY, reask_s=600)), NodeState()
    inventory = NodeInventory(ts=T0, node="n1", gpu_product="NVIDIA H100 80GB HBM3",
                              gpu_count=2, unschedulable=True)
    join.on_allocation(state, inventory)
    asked = []
    for i in range(41):
        asked += actions(join.on_sample(state, dbe_sample(T0 + 30 * i, reboot=True)))
    assert sorted((a.verb, a.reask) for a in asked) == [
        ("cordon", 0), ("drain", 0), ("drain", 1), ("drain", 2)]
    # Uncordoned by hand while the DBE holds: the cordon is asked for again at once.
    join.on_allocation(state, msgspec.structs.replace(inventory, ts=T0 + 1230,
                                                      unschedulable=False))
    again = actions(join.on_sample(state, dbe_sample(T0 + 1230, reboot=True)))
    assert [(a.verb, a.reask, a.ts) for a in again] == [("cordon", 1, T0 + 1230)]


def test_a_node_deleted_is_asked_for_nothing_more() -> None:
    join, state = NodeJoin(RuleSettings(policy=POLICY, reask_s=600)), NodeState()
    assert [a.verb for a in actions(join.on_sample(state, dbe_sample(T0)))] == ["cordon"]
    join.on_allocation(state, NodeInventory(ts=T0 + 10, node="n1", deleted=True))
    later = [join.on_sample(state, dbe_sample(T0 + 30 * i)) for i in range(1, 41)]
    assert [a for out in later for a in actions(out)] == []


def test_reask_s_none_asks_once() -> None:
    join, state = NodeJoin(RuleSettings(policy=POLICY, reask_s=None)), NodeState()
    out = [join.on_sample(state, dbe_sample(T0 + 30 * i)) for i in range(80)]
    assert [(a.verb, a.reask) for o in out for a in actions(o)] == [("cordon", 0)]


def _held(ts: float, phase: str = "running") -> PodAllocation:
    """train-a (namespace ml-a: idle after 10 min) holding GPU-0."""
    return PodAllocation(ts=ts, node="n1", pod=POD, phase=phase, gpus=1,  # type: ignore[arg-type]
                         device_ids=["GPU-0"], started_at=T0)


def _faulty_and_idle(join: NodeJoin, state: NodeState) -> list[Finding]:
    """n1 with GPU-0 held and idle for 20 min and a DBE on GPU-1: two findings open."""
    join.on_allocation(state, NodeInventory(ts=T0, node="n1", gpu_product="NVIDIA H100 80GB "
                                            "HBM3", gpu_count=2))
    join.on_allocation(state, _held(T0))
    out = []
    for i in range(41):
        reading = sample(T0 + 30 * i, util=0.0)
        reading.devices[1].ecc_dbe_volatile = 1
        out += join.on_sample(state, reading)
    fired = findings(out)
    assert {(f.kind, f.state) for f in fired} == {("idle_holder", "firing"),
                                                  ("ecc_dbe", "firing")}, fired
    return fired


def test_a_deleted_node_resolves_every_finding_open_on_it_once() -> None:
    """A node deleted from the cluster (for repair, say) has its open findings resolved,
    each under its own id and fingerprint and with the reason; nothing fires again on it
    from the old state, a redelivered deletion resolves nothing twice, and the node created
    again under its name starts afresh. Before, they stayed open, alerted every minute,
    for ever."""
    join, state = NodeJoin(RuleSettings(policy=POLICY, reask_s=600)), NodeState()
    fired = _faulty_and_idle(join, state)
    gone = T0 + 1300
    deletion = NodeInventory(ts=gone, node="n1", deleted=True)
    out = join.on_allocation(state, deletion)
    closed = findings(out)
    opened = {f.id: f for f in fired}
    assert sorted((f.kind, f.state, f.id, f.fingerprint, f.subject, f.starts_at, f.ends_at)
                  for f in closed) == sorted(
        (f.kind, "resolved", f.id, f.fingerprint, f.subject, f.starts_at, gone)
        for f in opened.values())
    assert all(f.summary == "node n1 deleted from the cluster" for f in closed)
    assert [s.deleted for s in out if isinstance(s, NodeSummary)] == [True]

    # Read again from the checkpoint before it (a crash before the commit): the same records.
    assert findings(join.on_allocation(state, deletion)) == []  # redelivered: nothing more
    # What still arrives for the gone node (late samples, an XID, its pod's deletion) raises
    # nothing: no finding would ever resolve it.
    late: list = []
    for i in range(1, 41):
        late += join.on_sample(state, dbe_sample(gone + 30 * i))
    late += join.on_hw_event(state, HwEvent(ts=gone + 5, node="n1", kind="xid",
                                            uuid="GPU-1", xid=79))
    late += join.on_allocation(state, _held(gone + 1300, "deleted"))
    assert [o for o in late if isinstance(o, Finding | Action)] == []
    assert state.findings == {} and state.asks == {}

    # Created again under its name, still with the DBE: a new episode, a new id.
    join.on_allocation(state, NodeInventory(ts=gone + 1400, node="n1", gpu_count=2))
    again = findings(join.on_sample(state, dbe_sample(gone + 1410)))
    assert [(f.kind, f.state) for f in again] == [("ecc_dbe", "firing")]
    assert again[0].id not in opened


def test_a_deletion_read_again_from_an_older_checkpoint_resolves_the_same_records() -> None:
    join, state = NodeJoin(RuleSettings(policy=POLICY)), NodeState()
    _faulty_and_idle(join, state)
    checkpoint = msgspec.msgpack.encode(state)
    deletion = NodeInventory(ts=T0 + 1300, node="n1", deleted=True)
    first = findings(join.on_allocation(state, deletion))
    replayed = findings(join.on_allocation(
        msgspec.msgpack.decode(checkpoint, type=NodeState), deletion))
    assert len(first) == 2 and replayed == first


def test_a_finding_resolved_before_the_deletion_is_not_resolved_again() -> None:
    join, state = NodeJoin(RuleSettings(policy=POLICY)), NodeState()
    fired = _faulty_and_idle(join, state)
    released = findings(join.on_allocation(state, _held(T0 + 1250, "finished")))
    assert [(f.kind, f.state) for f in released] == [("idle_holder", "resolved")]
    closed = findings(join.on_allocation(state, NodeInventory(ts=T0 + 1300, node="n1",
                                                              deleted=True)))
    assert [(f.kind, f.id) for f in closed] == [
        (f.kind, f.id) for f in fired if f.kind == "ecc_dbe"]


def _job(name: str, ts: float, phase: str = "running", devices: bool = True,
         started_at: float | None = None) -> PodAllocation:
    """A pod of the Job ``name`` on GPU-1 (by device id, or as the watcher without them)."""
    return PodAllocation(ts=ts, node="n1", pod=PodRef(namespace="ml-a", name=f"{name}-x1",
                                                      uid=f"uid-{name}"),
                         phase=phase, gpus=1,  # type: ignore[arg-type]
                         device_ids=["GPU-1"] if devices else [],
                         started_at=ts if started_at is None else started_at,
                         owner_kind="Job", owner_name=name, workload_kind="batch")


@pytest.mark.parametrize("allocations_first", [False, True])
def test_app_xids_are_told_apart_by_the_pod_the_allocations_say_held_the_gpu(
        allocations_first: bool) -> None:
    """A crash-looping pod's Xid 13s (the events name no pod; its allocation holds GPU-1)
    are that workload's error: an info finding naming it, the node still healthy. Once
    another workload's pod hits an application XID on the same GPU, the episode is the
    hardware-suspect warning. Event time decides who held the GPU, also when the worker
    reads the later pod's allocation before the earlier pod's XIDs."""
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_allocation(state, _job("train", T0))
    join.on_sample(state, sample(T0 + 10))
    # The Job ends; another workload's pod gets the GPU.
    later = [_job("train", T0 + 3000, phase="finished", started_at=T0), _job("eval", T0 + 3100)]
    if allocations_first:
        for event in later:
            join.on_allocation(state, event)
    out = []
    for i in range(5):
        out += join.on_hw_event(state, hw(T0 + 60 + i * 300, "xid", xid=13))
    (info,) = findings(out)
    assert info.severity == "info" and info.subject.pod is not None
    assert (info.subject.pod.name, info.labels["workload"]) == ("train-x1", "ml-a/Job/train")
    assert [o for o in out if isinstance(o, Action)] == []
    assert all(s.healthy for s in out if isinstance(s, NodeSummary))
    if not allocations_first:
        for event in later:
            join.on_allocation(state, event)
    # The new pod hits Xid 31 on the same GPU.
    out = join.on_hw_event(state, hw(T0 + 3200, "xid", xid=31))
    (warning,) = findings(out)
    assert (warning.severity, warning.id) == ("warning", info.id)
    assert warning.labels["workloads"] == "ml-a/Job/eval, ml-a/Job/train"


def test_app_xids_find_their_pod_through_the_collectors_attribution() -> None:
    """Without device ids on the allocations (the watcher's), the collector's attribution
    names the pod, matched to its allocation by name: still one workload, an info finding."""
    join, state = NodeJoin(policy=POLICY), NodeState()
    join.on_allocation(state, _job("train", T0, devices=False))
    reading = sample(T0 + 10)
    reading.devices[1].pod = PodRef(namespace="ml-a", name="train-x1")
    join.on_sample(state, reading)
    out = []
    for i in range(5):
        out += join.on_hw_event(state, hw(T0 + 60 + i * 300, "xid", xid=13))
    (info,) = findings(out)
    assert (info.severity, info.labels["workload"]) == ("info", "ml-a/Job/train")


def test_app_xids_read_ahead_of_the_nodes_samples_wait_for_them_to_name_the_holder() -> None:
    """The hardware events have an agent of their own: a worker catching up reads a
    crash-looping pod's XIDs before its node's allocations and samples. They wait (through
    the changelog) for the samples to reach their time, then are judged with the holder
    known: the workload's info finding, not a warning for a holder not known."""
    join, state = NodeJoin(policy=POLICY), NodeState()
    out = []
    for i in range(5):
        out += join.on_hw_event(state, hw(T0 + 60 + i * 300, "xid", xid=13))
    assert out == [] and len(state.waiting_xids) == 5
    state = msgspec.msgpack.Decoder(NodeState).decode(msgspec.msgpack.encode(state))
    join.on_allocation(state, _job("train", T0))
    for i in range(60):
        out += join.on_sample(state, sample(T0 + i * 30))
    (info,) = findings(out)
    assert (info.severity, info.labels["workload"]) == ("info", "ml-a/Job/train")
    assert info.evidence is not None and info.evidence.values["count"] == 5
    assert not state.waiting_xids


def _gpus(ts: float, uuids: list[str]) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="nvml", devices=[
        DeviceSample(uuid=uuid, index=i, model="NVIDIA A100-SXM4-80GB", util_pct=0.0,
                     temp_c=40.0, mem_used_bytes=0, mem_total_bytes=80 << 30)
        for i, uuid in enumerate(uuids)])


@pytest.mark.parametrize("fault_first", [False, True])
def test_a_gpu_replaced_at_its_index_takes_its_findings_and_asks_with_it(
        fault_first: bool) -> None:
    # The fault may be read before the node's first sample (a worker catching up reads the
    # small hardware-events topic first): the GPU's state, made by the event, learns its
    # index from the first sample that shows it.
    join, state, out = NodeJoin(), NodeState(), []
    lost = HwEvent(ts=T0 + 15, node="n1", kind="xid", uuid="GPU-0", xid=79)
    if fault_first:
        out += join.on_hw_event(state, lost)
    out += join.on_sample(state, _gpus(T0, ["GPU-0", "GPU-1"]))
    if not fault_first:
        out += join.on_hw_event(state, lost)
    ts = T0 + 30
    while ts < T0 + 1800:  # GPU-1 alone: GPU-0 stays lost, its drain asked again
        out += join.on_sample(state, _gpus(ts, ["GPU-1"]))
        ts += 30
    out += join.on_sample(state, _gpus(ts, ["GPU-new", "GPU-1"]))
    replaced = ts
    while ts < T0 + 5400:
        ts += 30
        out += join.on_sample(state, _gpus(ts, ["GPU-new", "GPU-1"]))
    found = [(f.kind, f.state, f.ts) for f in findings(out)]
    assert found == [("gpu_lost", "firing", T0 + 15), ("gpu_lost", "resolved", replaced)]
    assert [a.ts for a in actions(out) if a.verb == "drain"] == [T0 + 15, T0 + 630,
                                                                T0 + 1230]
    assert sorted(state.devices) == ["GPU-1", "GPU-new"]
    assert not state.findings and not state.asks


def _nvml(ts: float, indices: list[int]) -> NodeSample:
    """The NVML collector's sample of a node whose GPUs at ``indices`` it could read (one it
    cannot read at its start is left out, its index with it)."""
    return NodeSample(ts=ts, node="n1", source="nvml", devices=[
        DeviceSample(uuid=f"GPU-{i}", index=i, model="NVIDIA A100-SXM4-80GB", util_pct=0.0,
                     temp_c=40.0, mem_used_bytes=0, mem_total_bytes=80 << 30)
        for i in indices])


UNREADABLE = HwEvent(ts=T0, node="n1", kind="gpu_lost", source="nvml",
                     detail="GPU 3 unreadable at start: NVMLError_GpuIsLost")


@pytest.mark.parametrize("how", ["inventory", "event_first", "no_inventory", "plugin_down"])
def test_a_gpu_lost_without_uuid_resolves_once_every_gpu_answers_again(how: str) -> None:
    """The NVML collector started with GPU 3 unreadable (no UUID to file its loss under):
    drained, asked again while the node runs on 3 GPUs. Repaired and rebooted, all 4
    answer: the loss resolves and its drain is asked no more (it was asked every 10 min for
    ever, since no sample of ``GPU-unknown`` ever answers). While GPU 3 stays unreadable the
    loss stays open, whatever the node's inventory says it has (4, nothing yet, or 0 while
    its device plugin is down) and whichever of the event and the samples is read first."""
    join, state, out = NodeJoin(RuleSettings(reask_s=600)), NodeState(), []
    if how in ("inventory", "event_first"):
        out += join.on_allocation(state, NodeInventory(
            ts=T0 - 60, node="n1", gpu_product="NVIDIA A100-SXM4-80GB", gpu_count=4,
            capacity={"nvidia.com/gpu": 4}, allocatable={"nvidia.com/gpu": 4}))
    elif how == "plugin_down":
        out += join.on_allocation(state, NodeInventory(
            ts=T0 - 60, node="n1", capacity={"nvidia.com/gpu": 0},
            allocatable={"nvidia.com/gpu": 0}))
    if how == "event_first":  # a worker catching up reads the hardware events first
        out += join.on_hw_event(state, UNREADABLE)
        out += join.on_sample(state, _nvml(T0, [0, 1, 2]))
    else:
        out += join.on_sample(state, _nvml(T0, [0, 1, 2]))
        out += join.on_hw_event(state, UNREADABLE)
    ts = T0
    while ts < T0 + 1800:  # GPU 3 unreadable for half an hour
        ts += 30
        out += join.on_sample(state, _nvml(ts, [0, 1, 2]))
        if ts == T0 + 900:  # a worker restart: the node's state comes from the changelog
            state = msgspec.msgpack.Decoder(NodeState).decode(msgspec.msgpack.encode(state))
            join = NodeJoin(RuleSettings(reask_s=600))
    assert [(f.kind, f.state) for f in findings(out)] == [("gpu_lost", "firing")]
    back = ts + 300  # repaired: the node rebooted, its collector reads every GPU
    ts = back
    while ts < back + 3600:
        out += join.on_sample(state, _nvml(ts, [0, 1, 2, 3]))
        ts += 30
    found = [(f.kind, f.state, f.subject.device, f.ts) for f in findings(out)]
    assert found == [("gpu_lost", "firing", "GPU-unknown", T0),
                     ("gpu_lost", "resolved", "GPU-unknown", back)]
    assert findings(out)[-1].summary == ("GPU-unknown on n1: all 4 GPUs of the node answer, "
                                         "GPU-3 not read since the loss")
    assert [a.ts for a in actions(out) if a.verb == "drain"] == [T0, T0 + 600, T0 + 1200,
                                                                T0 + 1800]
    assert not state.findings and not state.asks
    (summary,) = [o for o in join.on_allocation(state, NodeInventory(
        ts=ts, node="n1", gpu_count=4, capacity={"nvidia.com/gpu": 4}))
        if isinstance(o, NodeSummary)]
    assert summary.healthy
