"""Demand-aware reclaim: the short ladder only while someone waits for the idle GPU."""

from __future__ import annotations

import dataclasses
from collections import Counter

import msgspec
from hypothesis import assume, given
from hypothesis import strategies as st

from gpusteward.rules import demand as d
from gpusteward.rules import fragmentation
from gpusteward.rules.fragmentation import Demand, FleetView, placement
from gpusteward.rules.idle import RECLAIM_REASON
from gpusteward.schema import Action, Finding, IdleHold, NodeSummary, PodRef, PodSet

SETTINGS = d.DemandReclaimSettings()


def hold(i: int, idle_since: float = 0, *, kept_until: float | None = None,
         profile: str | None = None) -> IdleHold:
    return IdleHold(device=f"GPU-{i}", pod=PodRef("nb", f"notebook-{i}"),
                    idle_since=idle_since, gpus=0 if profile else 1, mig_profile=profile,
                    workload_kind="notebook", kept_until=kept_until)


def node(name: str, free: int, holds: list[IdleHold], total: int = 4,
         mig_free: dict[str, int] | None = None) -> NodeSummary:
    return NodeSummary(ts=0, node=name, gpu_model="A100", gpus_total=total, gpus_free=free,
                       idle=holds, mig_free=mig_free or {})


def view(nodes: list[NodeSummary], *demands: Demand) -> FleetView:
    return FleetView(nodes=nodes, pending={x.key: x for x in demands}, shape_counts={})


def job(gpus: int = 2, since: float = 0, key: str = "ml/train-2gpu",
        mig: dict[str, int] | None = None) -> Demand:
    return Demand(key=key, queue="research", gpus=gpus, since=since, mig=mig or {})


def run(fleet_at: dict[float, FleetView], until: float, step: float = 60,
        settings: d.DemandReclaimSettings = SETTINGS) -> list[Finding | Action]:
    """Evaluate every ``step``; the fleet view changes at the times given, and its node
    summaries are of each evaluation's time (the node join keeps up)."""
    state = d.DemandReclaimState()
    out: list[Finding | Action] = []
    times = sorted(fleet_at)
    t = 0.0
    while t <= until:
        current = fleet_at[max(x for x in times if x <= t)]
        current = dataclasses.replace(current, nodes=[msgspec.structs.replace(s, ts=t)
                                                      for s in current.nodes])
        out += d.evaluate(state, current, t, settings)
        t += step
    return out


def test_idleness_counts_only_as_far_as_the_node_s_summaries_saw_it() -> None:
    """With the node join behind (a worker catching up), the fleet's clock follows the
    queue, hours past the node's last summary: the notebook was seen idle for 40 min, and
    may have woken since. It is not reclaimed as idle for hours."""
    state = d.DemandReclaimState()
    seen = msgspec.structs.replace(node("a", 0, [hold(0), hold(1)]), ts=2400)
    out: list[Finding | Action] = []
    for t in range(0, 4 * 3600, 60):
        out += d.evaluate(state, view([seen], job()), t, SETTINGS)
    assert {a.verb for a in out if isinstance(a, Action)} == {"notify_owner"}
    told = [f for f in out if isinstance(f, Finding)]
    assert {f.subject.device for f in told} == {"GPU-0", "GPU-1"} and len(told) == 2
    assert all(f.evidence is not None and f.evidence.values["idle_s"] == 1800 for f in told)


def test_two_idle_notebooks_reclaimed_on_the_short_ladder_for_a_waiting_2_gpu_job() -> None:
    fleet = view([node("a", 0, [hold(0), hold(1)]), node("b", 0, [hold(2, 600)])], job())
    out = run({0: fleet}, until=3 * 3600)
    findings = [o for o in out if isinstance(o, Finding)]
    actions = [o for o in out if isinstance(o, Action)]
    # Node a needs two reclaims for the job, node b cannot hold it (one idle GPU): a only.
    assert {f.subject.device for f in findings} == {"GPU-0", "GPU-1"}
    notices = [a for a in actions if a.verb == "notify_owner"]
    reclaims = [a for a in actions if a.verb == "requeue"]
    assert len(notices) == 2 and len(reclaims) == 2
    assert all(a.ts == SETTINGS.notify_after_s for a in notices)
    assert all(a.ts == SETTINGS.reclaim_after_s for a in reclaims)
    assert all(a.params["reason"] == RECLAIM_REASON and a.dry_run for a in reclaims)
    assert all(a.params["idle_since"] == "0" for a in reclaims)
    first = findings[0]
    assert "ml/train-2gpu" in first.summary and first.labels["waiting"] == "ml/train-2gpu"
    assert first.evidence is not None and first.evidence.values["longest_wait_s"] == 1800


def ddp(pods: int = 4, gpus: int = 2, *, key: str = "ml/ddp", since: float = 0) -> Demand:
    """A Kueue Workload of ``pods`` workers of ``gpus`` GPUs each."""
    return Demand(key=key, queue="research", gpus=pods * gpus, since=since,
                  pod_sets=(PodSet(count=pods, gpus=gpus),))


def reclaimed(out: list[Finding | Action]) -> set[str]:
    return {a.target.device or "" for a in out
            if isinstance(a, Action) and a.verb == "requeue"}


def test_a_workload_of_several_pods_is_matched_across_nodes() -> None:
    """4 workers x 2 GPUs need 2 GPUs on each of 4 nodes, not 8 on one: idle holders on four
    full nodes block it, and node a's single holder (1 GPU, no worker fits) is not needed."""
    nodes = [node("a", 0, [hold(0)]), *(node(n, 0, [hold(10 * i), hold(10 * i + 1)])
                                        for i, n in enumerate("bcde", start=1))]
    out = run({0: view(nodes, ddp())}, until=3 * 3600)
    assert reclaimed(out) == {"GPU-10", "GPU-11", "GPU-20", "GPU-21", "GPU-30", "GPU-31",
                              "GPU-40", "GPU-41"}
    finding = next(o for o in out if isinstance(o, Finding))
    assert "ml/ddp (4 pods of 2 GPUs, waiting" in finding.summary
    assert finding.labels["waiting"] == "ml/ddp"


def test_a_workload_of_several_pods_uses_free_room_elsewhere_first() -> None:
    # Two workers fit the free room of x and y; the other two need b's and c's holders.
    nodes = [node("x", 2, []), node("y", 2, []), node("b", 0, [hold(10), hold(11)]),
             node("c", 0, [hold(20), hold(21)]), node("d", 0, [hold(30), hold(31)])]
    assert reclaimed(run({0: view(nodes, ddp())}, until=3 * 3600)) == {
        "GPU-10", "GPU-11", "GPU-20", "GPU-21"}


def test_free_room_a_workload_of_several_pods_uses_is_not_offered_to_the_next() -> None:
    """Two jobs of 4 workers x 2 GPUs; x and y have room for two workers. The older job takes
    it and b's and c's holders; the younger needs four nodes' holders, and only d and e
    are left: it cannot start, so nothing is reclaimed for it."""
    def fleet(holders: str) -> FleetView:
        nodes = [node("x", 2, []), node("y", 2, []),
                 *(node(n, 0, [hold(10 * i), hold(10 * i + 1)])
                   for i, n in enumerate(holders, start=1))]
        return view(nodes, ddp(key="ml/old"), ddp(key="ml/new", since=100))

    out = run({0: fleet("bcde")}, until=3 * 3600)
    assert reclaimed(out) == {"GPU-10", "GPU-11", "GPU-20", "GPU-21"}
    assert {f.labels["waiting"] for f in out if isinstance(f, Finding)} == {"ml/old"}
    # With six nodes of holders the younger job is matched to the four it needs.
    holders = d.match(fleet("bcdefg"), 3600, SETTINGS)
    assert {h.device for node, h, waits in holders.values() if waits[0].key == "ml/new"} == {
        f"GPU-{10 * i + k}" for i in range(3, 7) for k in range(2)}


def test_free_room_a_fitting_workload_would_start_on_is_not_offered_to_the_next() -> None:
    """The older job fits x, y, z and w without reclaims (it waits for quota): the younger
    one, of the same shape, needs the holders of b, c, d and e to start."""
    nodes = [*(node(n, 2, []) for n in "xyzw"),
             *(node(n, 0, [hold(10 * i), hold(10 * i + 1)])
               for i, n in enumerate("bcde", start=1))]
    holders = d.match(view(nodes, ddp(key="ml/old"), ddp(key="ml/new", since=100)), 3600,
                      SETTINGS)
    assert {waits[0].key for _, _, waits in holders.values()} == {"ml/new"}
    assert len(holders) == 8
    # A single-pod job that fits node x leaves the others' room to a workload of several.
    nodes = [node("x", 2, []), node("y", 2, []), node("z", 2, []),
             node("b", 0, [hold(10), hold(11)])]
    holders = d.match(view(nodes, job(key="ml/one"), ddp(3, key="ml/ddp", since=100)), 3600,
                      SETTINGS)
    assert {h.device for _, h, _ in holders.values()} == {"GPU-10", "GPU-11"}


def test_a_workload_of_several_pods_that_fits_or_never_fits_reclaims_nothing() -> None:
    fits = [node(n, 2, [hold(i)]) for i, n in enumerate("abcd")]
    assert run({0: view(fits, ddp())}, until=3 * 3600) == []
    # Two nodes of 4 GPUs cannot hold 4 workers of 4 GPUs, whatever is reclaimed.
    never = [node(n, 0, [hold(10 * i + k) for k in range(4)]) for i, n in enumerate("ab")]
    assert run({0: view(never, ddp(gpus=4))}, until=3 * 3600) == []


def test_a_job_that_fits_a_node_without_idle_holders_reclaims_nothing() -> None:
    """It waits for quota or the scheduler, not for anyone's idle GPU: node x has room."""
    nodes = [node("x", 2, []), node("a", 0, [hold(0), hold(1)])]
    assert run({0: view(nodes, job())}, until=3 * 3600) == []
    # Nor one that fits a node with idle holders already, while another would need reclaims.
    nodes = [node("a", 2, [hold(0)]), node("b", 0, [hold(1), hold(2)])]
    assert run({0: view(nodes, job())}, until=3 * 3600) == []


def test_time_sliced_node_counts_free_replicas_and_the_holders_replica() -> None:
    """On a time-sliced GPU a pod asks for replicas: 2 replicas free plus the idle holder's
    make room for a 3-replica request, though no physical GPU is free."""
    shared = NodeSummary(ts=0, node="ts", gpu_model="A100", gpus_total=1, gpus_free=0,
                         gpu_replicas=4, replicas_free=2, idle=[hold(0)])
    assert reclaimed(run({0: view([shared], job(gpus=3))}, until=3 * 3600)) == {"GPU-0"}
    # With 3 replicas free it fits already: no reclaim.
    roomy = msgspec.structs.replace(shared, replicas_free=3)
    assert run({0: view([roomy], job(gpus=3))}, until=3 * 3600) == []


def test_no_waiting_demand_no_finding() -> None:
    out = run({0: view([node("a", 0, [hold(0), hold(1)])])}, until=6 * 3600)
    assert out == []


def test_demand_that_fits_free_capacity_needs_no_reclaim() -> None:
    out = run({0: view([node("a", 2, [hold(0)])], job())}, until=6 * 3600)
    assert out == []


def test_a_workload_that_just_arrived_is_not_demand_yet() -> None:
    settings = d.DemandReclaimSettings(min_wait_s=600)
    state = d.DemandReclaimState()
    fleet = view([node("a", 0, [hold(0), hold(1)], )], job(since=3000))
    assert d.evaluate(state, fleet, 3500, settings) == []
    assert state.episodes == {}


def test_keep_until_in_force_wins() -> None:
    kept = view([node("a", 0, [hold(0, kept_until=10**9), hold(1)])], job())
    assert run({0: kept}, until=4 * 3600) == []


def test_job_leaving_the_queue_resolves_the_episode_before_the_reclaim() -> None:
    waiting = view([node("a", 0, [hold(0), hold(1)])], job())
    gone = view([node("a", 0, [hold(0), hold(1)])])
    out = run({0: waiting, 3600: gone}, until=4 * 3600)
    assert [a.verb for a in out if isinstance(a, Action)] == ["notify_owner"] * 2
    closing = [f for f in out if isinstance(f, Finding) and f.state == "resolved"]
    assert len(closing) == 2 and all(f.ts == 3600 for f in closing)


def test_one_holder_counts_for_one_workload() -> None:
    # Two 1-GPU jobs, one idle GPU: one of them (the oldest) is matched.
    fleet = view([node("a", 0, [hold(0)])], job(1, since=0, key="ml/old"),
                 job(1, since=100, key="ml/new"))
    out = run({0: fleet}, until=3600)
    (finding,) = [f for f in out if isinstance(f, Finding)]
    assert finding.labels["waiting"] == "ml/old"


def test_mig_slice_matched_by_profile() -> None:
    fleet = view([node("m", 0, [hold(0, profile="1g.10gb"), hold(1, profile="3g.40gb")],
                       total=0)], job(0, mig={"3g.40gb": 1}))
    out = run({0: fleet}, until=3600)
    assert {f.subject.device for f in out if isinstance(f, Finding)} == {"GPU-1"}


@given(holds=st.integers(0, 4), free=st.integers(0, 4), want=st.integers(1, 4),
       waits=st.booleans())
def test_finding_only_when_reclaim_lets_a_waiting_workload_start(holds: int, free: int,
                                                                  want: int,
                                                                  waits: bool) -> None:
    demands = [job(want)] if waits else []
    fleet = view([node("a", free, [hold(i) for i in range(holds)], total=8)], *demands)
    out = run({0: fleet}, until=3 * 3600, step=300)
    firing = {f.id for f in out if isinstance(f, Finding)}
    helps = waits and free < want <= free + holds
    assert bool(firing) == helps
    if helps:
        # One episode per reclaimed holder, each with one notice and one reclaim.
        assert len(firing) == want - free
        verbs = [a.verb for a in out if isinstance(a, Action)]
        assert verbs.count("requeue") == verbs.count("notify_owner") == want - free


@given(st.lists(st.tuples(st.integers(0, 8), st.lists(st.sampled_from([1, 1, 2, 4]),
                                                        max_size=4)), min_size=1, max_size=8),
       st.lists(st.integers(0, 8), max_size=4),
       st.integers(2, 8), st.sampled_from([1, 2, 4, 8]))
def test_a_workload_of_several_pods_finds_reclaims_exactly_when_releasing_every_holder_fits(
        shapes: list[tuple[int, list[int]]], others: list[int], count: int,
        gpus: int) -> None:
    """The search for a workload of several pods that does not fit (and its shortcut: too
    few places even with every holder released) gives up exactly when the fleet with every
    useful holder released still cannot place it."""
    nodes = [d._Node(node(f"n{i}", free, []), free, {},
                     [msgspec.structs.replace(hold(10 * i + j), gpus=g)
                      for j, g in enumerate(sizes)])
             for i, (free, sizes) in enumerate(shapes)]
    # The room each node offers, by id of the node, as the match keeps it: the nodes without
    # holders, then those with holders as they are (only those with room).
    elsewhere = [d._Node(node(f"o{i}", free, [], total=8), free, {})
                 for i, free in enumerate(others) if free]
    views = {id(n): n.summary for n in elsewhere}
    views.update((id(n), n.released()) for n in nodes if n.free_gpus)
    # Pods of one shape: for them the placement (first fit) finds a place whenever one
    # exists, so "it cannot place them" is the fleet's answer, not the order's.
    pods = (PodSet(count=count, gpus=gpus),)
    demand = Demand(key="ml/ddp", queue="research", gpus=count * gpus, since=0,
                    pod_sets=pods)
    # The match asks only for workloads that do not fit as the fleet is.
    assume(placement(pods, list(views.values())) is None)
    every = [n.summary for n in elsewhere] + [n.released(d._useful(n, pods)) for n in nodes]
    found = d._reclaims_across(demand, nodes, views)
    assert (found is None) == (placement(pods, every) is None)
    if found is not None:
        reclaimed, _ = found
        assert all(h in n.holds for n, h in reclaimed)


@given(st.lists(st.integers(0, 8), max_size=12),
       st.lists(st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 4, 8])), min_size=1,
                max_size=3))
def test_a_workload_the_room_tally_rules_out_finds_no_placement(
        free: list[int], pod_sets: list[tuple[int, int]]) -> None:
    """The match skips placing a workload on the free room when the tally of the room each
    node offers rules it out: then no placement exists."""
    views = [node(f"n{i}", room, [], total=8) for i, room in enumerate(free)]
    rooms = Counter(fragmentation.request_room(v) for v in views)
    pods = [PodSet(count=count, gpus=gpus) for count, gpus in pod_sets]
    if d._no_room(pods, rooms):
        assert placement(pods, views) is None


def _holds_2gpu(*devices: int) -> list[IdleHold]:
    return [msgspec.structs.replace(hold(i), gpus=2) for i in devices]


def test_holders_past_the_last_place_a_pod_can_take_are_not_offered() -> None:
    """Three 2-GPU holders on a full node: for 4-GPU workers the third frees no place
    (6 GPUs hold one worker, as 4 do); for workers of 4 and 6 GPUs it does."""
    full = d._node(node("a", 0, _holds_2gpu(0, 1, 2), total=6), now=0)
    fours = [PodSet(count=2, gpus=4)]
    assert [h.device for h in d._useful(full, fours)] == ["GPU-0", "GPU-1"]
    assert [h.device for h in d._useful(full, [*fours, PodSet(count=1, gpus=6)])] == [
        "GPU-0", "GPU-1", "GPU-2"]
    # 2 GPUs free: one holder completes a worker's place, the other two a second one.
    roomy = d._node(node("b", 2, _holds_2gpu(3, 4, 5), total=8), now=0)
    assert [h.device for h in d._useful(roomy, fours)] == ["GPU-3", "GPU-4", "GPU-5"]
    # Eight 1-GPU holders, 8-GPU workers: all eight, none cut by counting holders.
    ones = d._node(node("c", 0, [hold(i) for i in range(10, 19)], total=9), now=0)
    assert len(d._useful(ones, [PodSet(count=1, gpus=8)])) == 8


@given(st.lists(st.tuples(st.integers(0, 8), st.lists(st.sampled_from([1, 1, 2, 4]),
                                                        max_size=3)), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(0, 11), st.integers(0, 8), st.booleans()), max_size=20),
       st.integers(0, 9))
def test_the_node_needing_fewest_reclaims_is_found_as_a_scan_of_every_node_finds_it(
        shapes: list[tuple[int, list[int]]], changes: list[tuple[int, int, bool]],
        gpus: int) -> None:
    """The match keeps the nodes with holders filed by their room; whatever the match has
    taken from them, the node it picks for a one-pod workload is the one a scan of every
    node picks: the fewest GPUs to reclaim (more than its free GPUs, at most what its
    holders free), then the name."""
    nodes = [d._Node(node(f"n{i % 3}-{i}", free, []), free, {},
                     [msgspec.structs.replace(hold(10 * i + j), gpus=g)
                      for j, g in enumerate(sizes)])
             for i, (free, sizes) in enumerate(shapes)]
    by_room = d._ByRoom(nodes)
    for which, free, drop in changes:
        n = nodes[which % len(nodes)]
        n.free_gpus = min(n.free_gpus, free)  # the match only takes room
        if drop and n.holds:
            n.holds.pop(0)
        by_room.moved(n)
        options = [(gpus - x.free_gpus, x.summary.node, x) for x in nodes
                   if gpus > 0 and 0 < gpus - x.free_gpus <= sum(h.gpus for h in x.holds)]
        expected = None if not options else ((min(options)[0], None), min(options)[2])
        assert by_room.fewest(gpus) == expected
