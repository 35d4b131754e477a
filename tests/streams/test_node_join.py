"""The node join without a broker: allocations, samples and events of one node."""

from __future__ import annotations

import msgspec
import pytest

from gpusteward.rules.policy import parse_policy
from gpusteward.schema import (
    DeviceSample,
    Finding,
    HwEvent,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    Rollup,
)
from gpusteward.streams.node import NodeJoin, NodeState, _Holders

POD = PodRef(namespace="ml-a", name="nb-a", uid="uid-a")
T0 = 1_000_000.0


def node_sample(ts: float, util: float, pod: PodRef | None = POD, dbe: int = 0) -> NodeSample:
    return NodeSample(ts=ts, node="n1", source="test", devices=[
        DeviceSample(uuid="GPU-1", index=0, model="A100", util_pct=util, pod=pod,
                     ecc_dbe_volatile=dbe),
        DeviceSample(uuid="GPU-2", index=1, model="A100", util_pct=90.0),
    ])


def allocation(phase: str, ts: float) -> PodAllocation:
    return PodAllocation(ts=ts, node="n1", pod=POD, phase=phase, gpus=1,  # type: ignore[arg-type]
                         device_ids=["GPU-1"], started_at=T0, workload_kind="notebook")


def findings(outputs: list) -> list[Finding]:
    return [o for o in outputs if isinstance(o, Finding)]


def test_idle_holder_from_allocation_and_resolution_on_release() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    out = []
    for i in range(0, 100):
        out += join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    (firing,) = findings(out)
    assert firing.labels["workload_kind"] == "notebook"
    (resolved,) = findings(join.on_allocation(state, allocation("finished", T0 + 3100)))
    assert resolved.state == "resolved" and resolved.id == firing.id


def test_samples_before_the_allocation_still_count() -> None:
    """Cross-topic order is not guaranteed: a late allocation must not delay detection."""
    join, state = NodeJoin(), NodeState()
    out = []
    for i in range(0, 81):
        if i == 50:
            join.on_allocation(state, allocation("running", T0 + i * 30))
        out += join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    (firing,) = findings(out)
    assert firing.starts_at == T0 + 600  # started_at from the allocation plus the grace
    assert firing.ts == T0 + 600 + 1800  # as soon as the window is full, at tick 80


def test_urgent_dbe_event_fires_once_with_the_sample() -> None:
    join, state = NodeJoin(), NodeState()
    event = HwEvent(ts=T0, node="n1", kind="ecc_dbe", uuid="GPU-1", count=1)
    first = join.on_hw_event(state, event)
    later = join.on_sample(state, node_sample(T0, 50.0, dbe=1))
    assert [f.kind for f in findings(first)] == ["ecc_dbe"] and findings(later) == []


def test_summary_reports_free_gpus_health_and_cordon() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, NodeInventory(ts=T0, node="n1", gpu_product="A100", gpu_count=2))
    join.on_allocation(state, allocation("running", T0 + 1))
    out = join.on_sample(state, node_sample(T0 + 2, 50.0, dbe=1))
    out += join.on_allocation(state, NodeInventory(ts=T0 + 3, node="n1", gpu_product="A100",
                                                   gpu_count=2, unschedulable=True))
    last = [o for o in out if isinstance(o, NodeSummary)][-1]
    assert (last.gpus_total, last.gpus_free, last.healthy, last.cordoned) == (2, 1, False, True)


def test_a_deleted_mig_node_offers_no_mig_device() -> None:
    """A deleted node's GPUs stop counting as free at once; its MIG devices too, or the
    fleet placed pending MIG pods on a node that is gone until its summary went stale."""
    join, state = NodeJoin(), NodeState()
    mig = {"nvidia.com/mig-1g.10gb": 7}
    first = join.on_allocation(state, NodeInventory(
        ts=T0, node="n1", gpu_product="A100", mig_strategy="mixed", allocatable=mig))
    gone = join.on_allocation(state, NodeInventory(
        ts=T0 + 1, node="n1", gpu_product="A100", mig_strategy="mixed", allocatable=mig,
        deleted=True))
    summaries = [o for o in first + gone if isinstance(o, NodeSummary)]
    assert [s.mig_free for s in summaries] == [{"1g.10gb": 7}, {}]
    assert [s.mig_total for s in summaries] == [{"1g.10gb": 7}, {}]


def test_a_deleted_node_sends_tombstones_until_it_is_created_again() -> None:
    """Every summary of a deleted node is a tombstone that counts nothing, whatever still
    arrives for it (its pod's deletion, a last sample); the node created again under its
    name counts again."""
    join, state = NodeJoin(), NodeState()
    inventory = NodeInventory(ts=T0, node="n1", gpu_product="A100", gpu_count=2,
                              allocatable={"nvidia.com/gpu": 2})
    join.on_allocation(state, inventory)
    join.on_allocation(state, allocation("running", T0))
    out = join.on_allocation(state, msgspec.structs.replace(inventory, ts=T0 + 60,
                                                            deleted=True))
    out += join.on_sample(state, node_sample(T0 + 200, 0.0))
    out += join.on_allocation(state, allocation("deleted", T0 + 260))
    gone = [o for o in out if isinstance(o, NodeSummary)]
    assert len(gone) >= 2 and all(
        s.deleted and (s.gpus_total, s.gpus_free, s.idle, s.held_by_team) == (0, 0, [], {})
        for s in gone), gone
    back = join.on_allocation(state, msgspec.structs.replace(inventory, ts=T0 + 300))
    (summary,) = [o for o in back if isinstance(o, NodeSummary)]
    assert not summary.deleted and (summary.gpus_total, summary.gpus_free) == (2, 2)


def test_state_survives_the_changelog_encoding() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, allocation("running", T0))
    for i in range(0, 30):
        join.on_sample(state, node_sample(T0 + i * 30, 0.0))
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=NodeState)
    assert restored == state
    out = []
    for i in range(30, 100):
        out += join.on_sample(restored, node_sample(T0 + i * 30, 0.0))
    assert len(findings(out)) == 1


# Identity: the watcher's allocations carry the pod's uid and no device ids; the kubelet's
# PodResources attribution (the NVML collector's) carries namespace/name and no uid.

def watched(pod: PodRef, phase: str, ts: float, kind: str = "notebook",
            labels: dict[str, str] | None = None) -> PodAllocation:
    return PodAllocation(ts=ts, node="n1", pod=pod, phase=phase, gpus=1,  # type: ignore[arg-type]
                         started_at=ts, workload_kind=kind, queue="research",
                         owner_kind="Notebook", owner_name=pod.name, labels=labels or {})


def kubelet(pod: PodRef) -> PodRef:
    return PodRef(namespace=pod.namespace, name=pod.name, container="main")


def idle_run(join: NodeJoin, state: NodeState, attributed: PodRef | None, start: float,
             ticks: int) -> list:
    out = []
    for i in range(ticks):
        out += join.on_sample(state, node_sample(start + i * 30, 0.0, pod=attributed))
    return out


def test_uid_less_attribution_joins_the_watched_pod_by_name() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, watched(POD, "running", T0))
    (firing,) = findings(idle_run(join, state, kubelet(POD), T0, 100))
    # The allocation's identity, kind, queue and owner reach the finding.
    assert firing.subject.pod == POD
    assert firing.labels["workload_kind"] == "notebook"
    assert (firing.labels["queue"], firing.labels["owner"]) == ("research", "Notebook/nb-a")


def test_uid_less_attribution_of_an_exempt_inference_pod_gives_no_finding() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, watched(POD, "running", T0, kind="inference",
                                      labels={"gpusteward.io/idle-exempt": "true"}))
    # 40 minutes is past the default window: without the join this pod was flagged.
    assert findings(idle_run(join, state, kubelet(POD), T0, 5 * 60 * 2)) == []


def test_a_pod_restarted_under_the_same_name_is_another_pod() -> None:
    join, state = NodeJoin(), NodeState()
    old = POD
    new = PodRef(namespace=POD.namespace, name=POD.name, uid="uid-a-2")
    join.on_allocation(state, watched(old, "running", T0, kind="batch"))
    join.on_allocation(state, watched(new, "running", T0 + 3000, kind="notebook"))
    # Name only: the later-started pod is the live one (the old one's end not seen yet).
    (firing,) = findings(idle_run(join, state, kubelet(POD), T0 + 3000, 90))
    assert firing.subject.pod == new and firing.labels["workload_kind"] == "notebook"
    # The old uid never matches the new pod of the same name.
    holders = _Holders(state.pods, T0 + 6000, 60)
    assert holders.find(old) is not None and holders.find(old).pod == old  # type: ignore[union-attr]
    join.on_allocation(state, watched(old, "finished", T0 + 6000))
    after = _Holders(state.pods, T0 + 6000, 60)
    assert after.find(old) is None
    assert after.find(kubelet(POD)).pod == new  # type: ignore[union-attr]


def test_a_pod_of_the_same_name_read_ahead_of_the_samples_is_not_yet_the_pod() -> None:
    """A worker catching up reads a node's allocations before its samples: the pod
    restarted under the old one's name an hour later is not the one the kubelet names now."""
    join, state = NodeJoin(), NodeState()
    new = PodRef(namespace=POD.namespace, name=POD.name, uid="uid-a-2")
    join.on_allocation(state, watched(POD, "running", T0, kind="batch"))
    join.on_allocation(state, watched(POD, "finished", T0 + 3000))
    join.on_allocation(state, watched(new, "running", T0 + 3600, kind="notebook"))
    assert _Holders(state.pods, T0 + 600, 60).find(kubelet(POD)).pod == POD  # type: ignore[union-attr]
    assert _Holders(state.pods, T0 + 3600, 60).find(kubelet(POD)).pod == new  # type: ignore[union-attr]
    # Nothing of that name started yet (the node's clock behind the API server's): the
    # one read ahead is still the best guess.
    assert _Holders(state.pods, T0 - 60, 60).find(kubelet(POD)).pod == new  # type: ignore[union-attr]


def test_uid_on_both_sides_decides_over_the_name() -> None:
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, watched(POD, "running", T0))
    stranger = PodRef(namespace=POD.namespace, name=POD.name, uid="uid-other")
    assert _Holders(state.pods, T0, 60).find(stranger) is None
    # A uid-less allocation (a source without uids) is still found from a uid-ful sample.
    anonymous = PodRef(namespace="ml-b", name="nb-b")
    join.on_allocation(state, watched(anonymous, "running", T0))
    found = _Holders(state.pods, T0, 60).find(PodRef(namespace="ml-b", name="nb-b", uid="uid-b"))
    assert found is not None and found.pod == anonymous


def test_rollups_per_device_per_minute_with_the_join_attribution() -> None:
    """Uid-less attribution: the rollup still carries the watched pod's owner, team, queue."""
    join, state = NodeJoin(), NodeState()
    join.on_allocation(state, watched(POD, "running", T0, labels={"team": "vision"}))
    out = []
    minute = T0 - T0 % 60
    for i in range(12):  # six minutes of 30 s samples
        out += join.on_sample(state, node_sample(minute + i * 30, 10.0 * (i % 2), kubelet(POD)))
    rollups = [o for o in out if isinstance(o, Rollup)]
    # Minutes close one lateness (60 s) after their end: four of the six so far.
    assert sorted({r.ts for r in rollups}) == [minute + 60 * m for m in range(4)]
    held = [r for r in rollups if r.uuid == "GPU-1"]
    assert len(held) == 4 and all(r.samples == 2 and r.util_mean == 5.0 for r in held)
    first = held[0]
    assert (first.pod, first.team, first.owner_kind, first.owner_name, first.queue,
            first.workload_kind) == ("nb-a", "vision", "Notebook", "nb-a", "research", "notebook")
    free = [r for r in rollups if r.uuid == "GPU-2"]
    assert len(free) == 4 and all(r.pod is None and r.team is None for r in free)
    # A redelivered sample changes nothing: no second rollup, no double count.
    assert [o for o in join.on_sample(state, node_sample(minute + 330, 0.0, kubelet(POD)))
            if isinstance(o, Rollup)] == []


def test_an_allocation_folded_after_the_first_samples_attributes_their_open_minutes() -> None:
    """A worker catching up on a backlog may read a pod's samples before its allocation."""
    join, state = NodeJoin(), NodeState()
    minute = T0 - T0 % 60
    out = []
    for i in range(3):
        out += join.on_sample(state, node_sample(minute + i * 30, 50.0, kubelet(POD)))
    join.on_allocation(state, watched(POD, "running", minute + 60, labels={"team": "vision"}))
    for i in range(3, 8):
        out += join.on_sample(state, node_sample(minute + i * 30, 50.0, kubelet(POD)))
    held = [o for o in out if isinstance(o, Rollup) and o.uuid == "GPU-1"]
    assert [r.ts for r in held] == [minute, minute + 60]
    assert {(r.team, r.owner_kind) for r in held} == {("vision", "Notebook")}


def test_a_pod_end_read_before_its_last_samples_keeps_them_attributed() -> None:
    """A worker behind on samples reads the pod's end (another topic) first."""
    join, state = NodeJoin(), NodeState()
    minute = T0 - T0 % 60
    join.on_allocation(state, watched(POD, "running", minute, labels={"team": "vision"}))
    join.on_allocation(state, watched(POD, "finished", minute + 120))
    out = []
    for i in range(10):
        util = 50.0 if i < 4 else 0.0
        out += join.on_sample(state, node_sample(minute + i * 30, util,
                                                 kubelet(POD) if i < 4 else None))
    held = [o for o in out if isinstance(o, Rollup) and o.uuid == "GPU-1"]
    assert [(r.ts, r.team, r.owner_kind) for r in held] == [
        (minute, "vision", "Notebook"), (minute + 60, "vision", "Notebook"),
        (minute + 120, None, None)]
    # Once the samples are past the end (and its lateness), the holding is forgotten.
    assert state.pods == {}
    summary = [o for o in out if isinstance(o, NodeSummary)][-1]
    assert summary.gpus_free == summary.gpus_total == 2  # the ended pod holds nothing


def test_a_held_device_follows_its_node_into_another_pool() -> None:
    # The join prepares what a holding's devices run once per holding and pool: a node
    # moved to another pool must get that pool's settings at its next sample.
    policy = parse_policy("node_pool_label: example.com/pool\nnode_pools:\n"
                          "  fast: {idle_holder: {window_s: 120, grace_s: 0}}\n")
    join, state = NodeJoin(policy=policy), NodeState()
    join.on_allocation(state, allocation("running", T0))
    out = join.on_sample(state, node_sample(T0, 0.0))
    out += join.on_sample(state, node_sample(T0 + 150, 0.0))
    assert findings(out) == []  # the default pool: 30 min of idleness, after a 10 min grace
    join.on_allocation(state, NodeInventory(ts=T0 + 151, node="n1", gpu_product="A100",
                                            gpu_count=2, labels={"example.com/pool": "fast"}))
    (firing,) = findings(join.on_sample(state, node_sample(T0 + 180, 0.0)))
    assert firing.kind == "idle_holder" and firing.starts_at == T0


def test_the_join_caches_nothing_of_a_replaced_holding() -> None:
    # Every allocation event replaces the pod's holding; the join's per-holding cache must
    # not keep the old ones for weeks.
    join, state = NodeJoin(), NodeState()
    for i in range(5):
        join.on_allocation(state, allocation("running", T0 + i))
        join.on_sample(state, node_sample(T0 + i + 0.5, 50.0))
    assert [held[0] for held in join._held.values()] == list(state.pods.values())


@pytest.mark.parametrize("attributed", [True, False])
@pytest.mark.parametrize("then", [None, PodRef(namespace="ml-a", name="train-b", uid="uid-b")])
def test_an_idle_episode_opened_by_samples_read_after_its_pods_end_resolves(
        then: PodRef | None, attributed: bool) -> None:
    """A worker catching up reads the small allocations topic first: a notebook's start
    and its deletion 3 h later, and (``then``) the next pod to hold its GPU, before the
    node's samples of those hours. The end releases the GPU with nothing open; the
    notebook's last idle hours, read after, open its idle episode; nothing closed it then:
    it fired for ever, listed as an idle hold in the summaries, or (a next pod on the GPU)
    climbed its ladder with that pod's name, to a reclaim of a pod never judged idle. It
    resolves at the first sample past the end that attributes the GPU to another pod or to
    none, or that the next pod's allocation holds; from a source that attributes nothing,
    with no next pod, once the samples are rollup_lateness_s (60 s) past the end."""
    join, state = NodeJoin(), NodeState()
    out = join.on_allocation(state, allocation("running", T0))
    end = T0 + 3 * 3600
    out += join.on_allocation(state, allocation("deleted", end))
    if then is not None:
        out += join.on_allocation(state, PodAllocation(
            ts=end + 30, node="n1", pod=then, phase="running", gpus=1,
            device_ids=["GPU-1"], started_at=end + 30, workload_kind="batch"))
    ts = T0
    while ts < end + 9 * 3600:  # idle throughout, the next pod too
        pod = (POD if ts < end else then) if attributed else None
        out += join.on_sample(state, node_sample(ts, 0.0, pod))
        ts += 30
    idle = [(f.state, f.subject.pod, f.ts) for f in findings(out) if f.kind == "idle_holder"]
    closed = end if attributed else end + 90 if then is None else end + 30
    assert idle[:2] == [("firing", POD, T0 + 2400), ("resolved", POD, closed)]
    assert next(f.summary for f in findings(out) if f.state == "resolved") == (
        "ml-a/nb-a: the pod released the GPU")
    # The next pod is judged on its own: its window from its start (and its grace).
    assert {(state, pod) for state, pod, _ in idle[2:]} == (
        set() if then is None else {("firing", then)})  # its ladder's steps
    assert all(a.target.pod in (None, then) or a.ts < end for a in out
               if not isinstance(a, (Finding, NodeSummary, Rollup)))
    last = [o for o in out if isinstance(o, NodeSummary)][-1]
    assert [hold.pod for hold in last.idle] == ([] if then is None else [then])


def test_an_idle_pod_no_allocation_holds_lets_go_when_the_collector_sees_it_leave() -> None:
    """A pod the collector attributes the GPU to, with no allocation (the watcher never
    reported it: down, or the pod came and went before it looked), is judged idle from
    first sight. When it goes, no allocation's end will ever say so: its episode fired for
    ever, the GPU listed as an idle hold. It resolves at the first sample that attributes
    the GPU to no one. A pod an allocation holds keeps its episode while its container
    restarts (the collector sees it leave and come back): its end releases the GPU."""
    bare = PodRef(namespace="ml-a", name="nb-a")  # as the collector names it: no uid
    for allocated in (False, True):
        join, state = NodeJoin(), NodeState()
        out = join.on_allocation(state, allocation("running", T0)) if allocated else []
        ts = T0
        while ts < T0 + 10 * 3600:
            gone = T0 + 3 * 3600 <= ts < T0 + 3 * 3600 + 120  # 2 min unattributed
            if not allocated:
                gone = ts >= T0 + 3 * 3600
            out += join.on_sample(state, node_sample(ts, 0.0, None if gone else bare))
            ts += 30
        idle = [(f.state, f.ts, f.summary) for f in findings(out) if f.kind == "idle_holder"]
        if allocated:  # one episode throughout, climbing its ladder
            assert {(s, f) for s, f, _ in idle} == {("firing", T0 + 2400), *(
                ("firing", f) for s, f, _ in idle[1:])} and idle[0][0] == "firing"
            assert all(s == "firing" for s, _, _ in idle)
            assert state.findings
        else:
            assert idle == [("firing", T0 + 2400, idle[0][2]),
                            ("resolved", T0 + 3 * 3600, "ml-a/nb-a: the pod released the GPU")]
            last = [o for o in out if isinstance(o, NodeSummary)][-1]
            assert last.idle == [] and not state.findings
