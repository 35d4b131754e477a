"""FGD fragmentation and stranded demand.

The measure is checked three ways: hand-worked nodes, properties over random
nodes, and the Alibaba GPU trace of the FGD paper replayed with a best-fit
placement, where every sampled cluster state is recomputed independently,
GPU by GPU, with the paper's case split written out in plain loops.
"""

from __future__ import annotations

import bisect
import csv
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusteward.rules import fragmentation as frag
from gpusteward.rules.fragmentation import Demand, Shape
from gpusteward.schema import NodeSummary, PodSet

SETTINGS = frag.FragmentationSettings()
TRACE = Path("traces/alibaba-gpu-v2023")


# -- the independent computation ----------------------------------------------------------------


def fgd_by_definition(nodes: Sequence[Sequence[int]], shapes: Mapping[Shape, float]
                      ) -> tuple[float, int]:
    """(fragmented, unallocated) milli, enumerating GPUs per node and task type."""
    fragmented = 0.0
    unallocated = 0
    for gpus in nodes:
        node_free = 0
        for free in gpus:
            node_free += free
        unallocated += node_free
        for shape, weight in shapes.items():
            if shape.milli < 1000:
                # A sharing task takes part of one GPU: it runs if any GPU has room;
                # then the GPUs with less room than it asks for are its fragments.
                runs = False
                for free in gpus:
                    if free >= shape.milli:
                        runs = True
                if not runs:
                    fragment = node_free
                else:
                    fragment = 0
                    for free in gpus:
                        if free < shape.milli:
                            fragment += free
            else:
                # A whole-GPU task needs `gpus` fully free GPUs; partly used ones are fragments.
                whole_free = 0
                for free in gpus:
                    if free == 1000:
                        whole_free += 1
                if whole_free < shape.gpus:
                    fragment = node_free
                else:
                    fragment = 0
                    for free in gpus:
                        if free != 1000:
                            fragment += free
            fragmented += weight * fragment
    return fragmented, unallocated


# -- hand-worked cases --------------------------------------------------------------------------


def test_node_fragment_follows_the_paper_cases() -> None:
    half = Shape(1, 500)
    whole = Shape(1, 1000)
    two = Shape(2, 1000)
    node = [1000, 300, 0, 600]  # one whole free GPU, two partly free
    # The half task fits (on the 1000 or the 600 GPU); only the 300 is a fragment to it.
    assert frag.node_fragmentation(node, {half: 1.0}) == 300
    # A whole GPU fits on the free one; the 300 and 600 are fragments.
    assert frag.node_fragmentation(node, {whole: 1.0}) == 900
    # Two whole GPUs do not fit: everything free is a fragment.
    assert frag.node_fragmentation(node, {two: 1.0}) == 1900
    mixed = frag.node_fragmentation(node, {half: 0.5, whole: 0.25, two: 0.25})
    assert mixed == pytest.approx(0.5 * 300 + 0.25 * 900 + 0.25 * 1900)


def test_cluster_ratio_and_blocking_shapes() -> None:
    shapes = {Shape(8, 1000): 0.5, Shape(1, 1000): 0.5}
    report = frag.cluster_fragmentation([[1000] * 8, [1000, 0, 0, 0, 0, 0, 0, 0]], shapes)
    assert report.unallocated_milli == 9000
    assert report.fragmented_milli == pytest.approx(0.5 * 1000)
    assert report.ratio == pytest.approx(500 / 9000)
    assert report.by_shape == {"8x1000": 1000.0, "1x1000": 0.0}


def test_popularity_leaves_out_gpu_less_requests() -> None:
    pop = frag.popularity([Shape(1), Shape(1), Shape(0, 0), Shape(1, 500)])
    assert pop == {Shape(1): pytest.approx(2 / 3), Shape(1, 500): pytest.approx(1 / 3)}
    assert frag.parse_shape("2x1000") == Shape(2, 1000)
    with pytest.raises(ValueError, match="bad shape"):
        frag.parse_shape("two")


def test_cordoned_and_unhealthy_nodes_offer_nothing() -> None:
    base = NodeSummary(ts=0, node="n", gpu_model=None, gpus_total=4, gpus_free=3)
    assert frag.free_milli(base) == [1000, 1000, 1000, 0]
    assert frag.free_milli(msgspec.structs.replace(base, cordoned=True)) == [0] * 4
    assert frag.free_milli(msgspec.structs.replace(base, healthy=False)) == [0] * 4


gpu_free = st.sampled_from([0, 100, 250, 500, 750, 1000]) | st.integers(0, 1000)
nodes_st = st.lists(st.lists(gpu_free, min_size=1, max_size=8), min_size=1, max_size=12)
shapes_st = st.dictionaries(
    st.builds(Shape, st.integers(1, 8), st.just(1000)) | st.builds(Shape, st.just(1),
                                                                    st.integers(1, 999)),
    st.floats(0.01, 1.0), min_size=1, max_size=6,
)


@given(nodes_st, shapes_st)
def test_matches_the_definition_and_stays_within_free_capacity(
    nodes: list[list[int]], shapes: dict[Shape, float]
) -> None:
    total = sum(shapes.values())
    shapes = {s: w / total for s, w in shapes.items()}
    report = frag.cluster_fragmentation(nodes, shapes)
    fragmented, unallocated = fgd_by_definition(nodes, shapes)
    assert report.unallocated_milli == unallocated
    assert report.fragmented_milli == pytest.approx(fragmented, abs=1e-6)
    assert 0.0 <= report.ratio <= 1.0 + 1e-9


# -- the Alibaba trace --------------------------------------------------------------------------


class BestFit:
    """Places trace pods with best fit: the GPU (sharing) or node (whole GPUs) left tightest."""

    def __init__(self, gpu_counts: list[int]) -> None:
        self.free = [[1000] * n for n in gpu_counts]
        # Every GPU as (free, node, gpu), sorted: the tightest GPU that fits is a bisection away.
        self.by_free = sorted((1000, n, g) for n, count in enumerate(gpu_counts)
                              for g in range(count))
        # Nodes by their count of fully free GPUs.
        self.by_whole: dict[int, set[int]] = {}
        for node, count in enumerate(gpu_counts):
            self.by_whole.setdefault(count, set()).add(node)

    def _whole(self, node: int) -> int:
        return sum(1 for f in self.free[node] if f == 1000)

    def _set(self, node: int, gpu: int, value: int) -> None:
        old = self.free[node][gpu]
        before = self._whole(node)
        del self.by_free[bisect.bisect_left(self.by_free, (old, node, gpu))]
        bisect.insort(self.by_free, (value, node, gpu))
        self.free[node][gpu] = value
        after = self._whole(node)
        if after != before:
            self.by_whole[before].discard(node)
            self.by_whole.setdefault(after, set()).add(node)

    def place(self, gpus: int, milli: int) -> list[tuple[int, int, int]] | None:
        """Take the capacity; return what was taken as (node, gpu, milli), None if no room."""
        if milli < 1000:
            at = bisect.bisect_left(self.by_free, (milli, -1, -1))
            if at == len(self.by_free):
                return None
            _, node, gpu = self.by_free[at]
            self._set(node, gpu, self.free[node][gpu] - milli)
            return [(node, gpu, milli)]
        for whole in sorted(c for c, members in self.by_whole.items() if members and c >= gpus):
            node = min(self.by_whole[whole])
            taken = [g for g, f in enumerate(self.free[node]) if f == 1000][:gpus]
            for gpu in taken:
                self._set(node, gpu, 0)
            return [(node, gpu, 1000) for gpu in taken]
        return None


def _read_trace(shared_data: Path) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    with (shared_data / TRACE / "openb_node_list_gpu_node.csv").open() as f:
        nodes = [int(row["gpu"]) for row in csv.DictReader(f)]
    pods = []
    with (shared_data / TRACE / "openb_pod_list_default.csv").open() as f:
        for row in csv.DictReader(f):
            created, deleted = int(row["creation_time"]), int(row["deletion_time"] or 0)
            pods.append((int(row["num_gpu"]), int(row["gpu_milli"]), created, deleted))
    return nodes, pods


def test_fgd_on_the_alibaba_trace_matches_the_definition(shared_data: Path) -> None:
    nodes, pods = _read_trace(shared_data)
    assert len(nodes) == 1213 and sum(nodes) == 6212
    shapes = frag.popularity(Shape(g, m) for g, m, _, _ in pods)
    assert len(shapes) == 24  # the trace's GPU request shapes
    # As in the paper's evaluation, the trace's pods arrive in creation order (the list
    # cycled) and stay, until the cluster is saturated: fragmentation grows as it fills.
    # Cluster states are sampled along the way and recomputed independently.
    gpu_pods = [(g, m) for g, m, _, _ in pods if g > 0]
    cluster = BestFit(nodes)
    rng = random.Random(2023)
    ratios: list[float] = []
    failures = placed = step = 0
    while failures < 200:
        gpus, milli = gpu_pods[step % len(gpu_pods)]
        step += 1
        if cluster.place(gpus, milli) is None:
            failures += 1
        else:
            placed += 1
        if rng.random() >= 1 / 120:
            continue
        report = frag.cluster_fragmentation(cluster.free, shapes)
        fragmented, unallocated = fgd_by_definition(cluster.free, shapes)
        assert report.unallocated_milli == unallocated
        assert math.isclose(report.fragmented_milli, fragmented, rel_tol=1e-9, abs_tol=1e-6)
        ratios.append(report.ratio)
    assert len(ratios) >= 40
    # The states are not trivial: thousands of pods placed, fragmentation grew as it filled.
    assert placed > 5000
    assert ratios[0] < 0.05 < max(ratios) <= 1.0


# -- stranded demand ----------------------------------------------------------------------------


def _summary(node: str, free: int, total: int = 8, **kw: object) -> NodeSummary:
    return NodeSummary(ts=0, node=node, gpu_model="H100", gpus_total=total, gpus_free=free,
                       **kw)  # type: ignore[arg-type]


def test_stranded_fires_after_the_window_once_and_resolves_on_admission() -> None:
    track = frag.StrandedTrack()
    fleet = [_summary("a", 2), _summary("b", 2), _summary("c", 1)]
    demand = {"ml/ddp": Demand("ml/ddp", "research", gpus=4)}
    out = []
    for t in range(0, 600, 30):
        out += frag.observe_stranded(track, demand, fleet, ts=t, settings=SETTINGS)
    (firing,) = out
    assert firing.kind == frag.STRANDED_KIND and firing.state == "firing"
    assert firing.starts_at == 0 and firing.ts == SETTINGS.stranded_window_s
    assert firing.evidence and firing.evidence.values["fleet_free_gpus"] == 5
    assert firing.runbook
    (closed,) = frag.observe_stranded(track, {}, fleet, ts=700, settings=SETTINGS)
    assert closed.state == "resolved" and closed.id == firing.id
    assert closed.subject == firing.subject


def test_not_stranded_when_a_node_fits_or_the_fleet_is_short() -> None:
    fits = [_summary("a", 4), _summary("b", 2)]
    short = [_summary("a", 1), _summary("b", 1)]
    cordoned = [_summary("a", 2), _summary("b", 2, cordoned=True)]
    demand = Demand("ml/x", "q", gpus=3)
    assert frag.stranded_reason(demand, fits) is None
    assert frag.stranded_reason(demand, short) is None
    assert frag.stranded_reason(demand, cordoned) is None


def test_mig_demand_stranded_by_the_wrong_profiles() -> None:
    fleet = [_summary("a", 0, mig_free={"1g.10gb": 4}), _summary("b", 0, mig_free={"2g.20gb": 1})]
    demand = Demand("ml/infer", "prod", mig={"3g.40gb": 1})
    assert frag.stranded_reason(demand, fleet) == {
        "free_mig_devices": 5.0, "requested_mig_devices": 1.0,
        "free_mig_1g.10gb": 4.0, "free_mig_2g.20gb": 1.0}
    track = frag.StrandedTrack()
    pending = {"ml/infer": demand}
    out = []
    for t in range(0, 400, 60):
        out += frag.observe_stranded(track, pending, fleet, ts=t, settings=SETTINGS)
    (finding,) = out
    assert finding.labels["shape"] == "1x 3g.40gb"
    assert finding.labels["advice"] == (
        "repartition a MIG node with idle slices (1g.10gb x4, 2g.20gb x1) to offer 1x 3g.40gb")
    ok = Demand("ml/small", "prod", mig={"1g.10gb": 2})
    assert frag.stranded_reason(ok, fleet) is None


@given(st.lists(st.tuples(st.integers(0, 8), st.booleans()), min_size=1, max_size=40))
def test_stranded_only_after_a_whole_window_of_stranded_evaluations(
    steps: list[tuple[int, bool]]
) -> None:
    """Every finding's window holds only stranded evaluations, and one episode fires once."""
    track = frag.StrandedTrack()
    demand = {"ml/ddp": Demand("ml/ddp", "q", gpus=4)}
    history: list[tuple[float, bool]] = []
    fired: list[str] = []
    for i, (free_a, pending) in enumerate(steps):
        ts = i * 60.0
        fleet = [_summary("a", free_a % 4), _summary("b", 3)]
        stranded = pending and frag.stranded_reason(demand["ml/ddp"], fleet) is not None
        history.append((ts, stranded))
        out = frag.observe_stranded(track, demand if pending else {}, fleet, ts=ts,
                                    settings=SETTINGS)
        for finding in out:
            if finding.state == "firing":
                assert finding.id not in fired
                fired.append(finding.id)
                window = [s for t, s in history if finding.starts_at <= t <= ts]
                assert all(window)
                assert ts - finding.starts_at >= SETTINGS.stranded_window_s


def test_fleet_fragmentation_fires_after_the_window_and_resolves() -> None:
    track = frag.FragmentationTrack()
    shapes = {Shape(8): 1.0}
    bad = frag.cluster_fragmentation([[1000, 1000, 0, 0, 0, 0, 0, 0]] * 4, shapes)
    good = frag.cluster_fragmentation([[1000] * 8, [0] * 8], shapes)
    assert bad.ratio == 1.0 and good.ratio == 0.0
    out = []
    for t in range(0, 1200, 60):
        out += frag.observe_fleet(track, bad, ts=t, settings=SETTINGS)
    (firing,) = out
    assert firing.ts == SETTINGS.window_s and firing.starts_at == 0
    assert firing.labels["blocking_shapes"] == "8x1000"
    (closed,) = frag.observe_fleet(track, good, ts=1300, settings=SETTINGS)
    assert closed.state == "resolved" and closed.id == firing.id


@given(st.lists(st.booleans(), min_size=1, max_size=60))
def test_fleet_finding_only_after_a_whole_window_above_threshold(steps: list[bool]) -> None:
    track = frag.FragmentationTrack()
    shapes = {Shape(8): 1.0}
    bad = frag.cluster_fragmentation([[1000, 1000, 0, 0, 0, 0, 0, 0]] * 4, shapes)
    good = frag.cluster_fragmentation([[1000] * 8] * 4, shapes)
    history: list[tuple[float, bool]] = []
    open_id = None
    for i, fragmented in enumerate(steps):
        ts = i * 60.0
        history.append((ts, fragmented))
        for finding in frag.observe_fleet(track, bad if fragmented else good, ts=ts,
                                          settings=SETTINGS):
            if finding.state == "firing":
                assert open_id is None
                open_id = finding.id
                assert all(f for t, f in history if finding.starts_at <= t <= ts)
                assert ts - finding.starts_at >= SETTINGS.window_s
            else:
                assert finding.id == open_id
                open_id = None


def test_placeable_gives_each_pod_a_node_with_room() -> None:
    fleet = [_summary("a", 3), _summary("b", 1), _summary("c", 2)]
    master_and_workers = [PodSet(count=1, gpus=1), PodSet(count=2, gpus=2)]
    assert frag.placeable(master_and_workers, fleet)  # workers on a and c, master on b
    assert not frag.placeable([PodSet(count=3, gpus=2)], fleet)  # 6 free, room for 2 pods
    mig = [_summary("m1", 0, mig_free={"1g.10gb": 1}), _summary("m2", 0, mig_free={"1g.10gb": 2})]
    assert frag.placeable([PodSet(count=3, mig={"1g.10gb": 1})], mig)
    assert not frag.placeable([PodSet(count=2, mig={"1g.10gb": 2})], mig)


def test_several_pods_are_stranded_only_when_no_placement_exists() -> None:
    pods = (PodSet(count=4, gpus=2),)
    spread = [_summary(n, 2) for n in "abcd"]
    demand = Demand("ml/ddp", "research", gpus=8, pod_sets=pods)
    assert frag.stranded_reason(demand, spread) is None
    odd = [_summary("a", 3), _summary("b", 3), _summary("c", 1), _summary("d", 1)]
    reason = frag.stranded_reason(demand, odd)
    assert reason is not None and reason["pods"] == 4 and reason["fleet_free_gpus"] == 8


def test_a_request_on_shared_gpus_counts_in_replicas() -> None:
    # Two nodes of one GPU time-sliced 4 ways, one replica held on each: 1 pod asking for
    # 2 nvidia.com/gpu gets 2 replicas on either node; it is not stranded.
    shared = [_summary(n, 0, total=1, gpu_replicas=4, replicas_free=3) for n in "ab"]
    demand = Demand("ml/infer", "serving", gpus=2)
    assert frag.stranded_reason(demand, shared) is None
    # Wholly free shared GPUs too: 1 GPU x 4 replicas is room for 4, not 1.
    idle = [_summary(n, 1, total=1, gpu_replicas=4, replicas_free=4) for n in "ab"]
    assert frag.stranded_reason(Demand("ml/big", "serving", gpus=4), idle) is None
    # 8 replicas are more than either node has at all: it fits no node, whatever is free.
    assert frag.stranded_reason(Demand("ml/huge", "serving", gpus=8), idle) == {
        "requested_gpus_per_pod": 8.0, "largest_node_gpus": 4.0}
    assert frag.stranded_reason(Demand("ml/big", "serving", gpus=3), [
        _summary(n, 0, total=2, gpu_replicas=2, replicas_free=2) for n in "ab"]) == {
        "fleet_free_gpus": 4.0, "largest_node_free_gpus": 2.0, "requested_gpus": 3.0}


def test_mig_demand_no_layout_offers_is_stranded_whatever_is_free() -> None:
    """mig-inference's reranker asks for a 2g.20gb slice no node's layout has: only a layout
    change places it, free slices or not. A layout not known (a summary from a build
    before ``mig_total``) judges nothing."""
    fleet = [_summary("a", 0, mig_free={"1g.10gb": 3}, mig_total={"1g.10gb": 7}),
             _summary("b", 0, mig_total={"3g.40gb": 2})]
    rerank = Demand("ml/rerank", "prod", mig={"2g.20gb": 1})
    assert frag.stranded_reason(rerank, fleet) == {
        "requested_mig_devices_per_pod": 1.0, "offered_mig_2g.20gb": 0.0,
        "free_mig_1g.10gb": 3.0}
    track = frag.StrandedTrack()
    out = []
    for t in range(0, 600, 30):
        out += frag.observe_stranded(track, {"ml/rerank": rerank}, fleet, ts=t,
                                     settings=SETTINGS)
    (firing,) = out
    assert firing.summary == ("ml/rerank waits for 1x 2g.20gb: no node's MIG layout offers "
                              "it, so it can never start until a layout changes")
    assert firing.labels["advice"] == ("repartition a MIG node with idle slices (1g.10gb x3) "
                                       "to offer 1x 2g.20gb")
    # Offered by b's layout, both held, while 1g.10gb slices sit free: stranded as before
    # (the free slices in other profiles), not as never placeable.
    assert frag.stranded_reason(Demand("ml/embed", "prod", mig={"3g.40gb": 1}), fleet) == {
        "free_mig_devices": 3.0, "requested_mig_devices": 1.0, "free_mig_1g.10gb": 3.0}
    # Two 3g.40gb in one pod: b's layout has them together.
    assert frag.fits_no_node(Demand("ml/two", "prod", mig={"3g.40gb": 2}), 0,
                             frag.mig_layouts(fleet)) is None
    unknown = [_summary("a", 0, mig_free={"1g.10gb": 3}), *fleet[1:]]
    assert frag.mig_layouts(unknown) is None
    # b's layout being changed by mig-manager: what it will offer is not known either.
    changing = [fleet[0], msgspec.structs.replace(fleet[1], mig_changing=True)]
    assert frag.mig_layouts(changing) is None
    assert frag.stranded_reason(rerank, changing) == frag.stranded_reason(rerank, unknown)
    assert frag.stranded_reason(rerank, unknown) == {
        "free_mig_devices": 3.0, "requested_mig_devices": 1.0, "free_mig_1g.10gb": 3.0}


def test_a_pod_larger_than_every_node_is_stranded_whatever_is_free() -> None:
    """The demo's 2-GPU job on one-GPU nodes: the fleet is busy, so its free GPUs never add
    up to the request, yet no amount of waiting places it. It is told, as stranded."""
    busy = [_summary(f"a100-{i}", 0, total=1) for i in range(8)]
    track = frag.StrandedTrack()
    demand = {"ml-ivan/ddp-ivan": Demand("ml-ivan/ddp-ivan", "research", gpus=2)}
    out = []
    for t in range(0, 600, 30):
        out += frag.observe_stranded(track, demand, busy, ts=t, settings=SETTINGS)
    (firing,) = out
    assert firing.state == "firing" and firing.ts == SETTINGS.stranded_window_s
    assert firing.evidence and firing.evidence.values == {"requested_gpus_per_pod": 2.0,
                                                          "largest_node_gpus": 1.0}
    assert firing.summary == ("ml-ivan/ddp-ivan waits for 2 GPUs on one node: no node of the "
                              "fleet has 2 GPUs (the largest has 1), so it can never start as "
                              "it is")
    assert firing.labels["advice"] == "ask for at most 1 GPUs per pod, or add a node that large"
    # A node that large joins (cordoned, busy: it could still hold it one day): resolved.
    (closed,) = frag.observe_stranded(
        track, demand, [*busy, _summary("h100-1", 0, total=8, cordoned=True)], ts=630,
        settings=SETTINGS)
    assert closed.state == "resolved" and closed.id == firing.id
    # A pod of a workload of several: each pod must fit some node.
    pods = Demand("ml/ddp", "q", gpus=4, pod_sets=(PodSet(count=2, gpus=2),))
    assert frag.stranded_reason(pods, busy) == {"requested_gpus_per_pod": 2.0,
                                                "largest_node_gpus": 1.0}
    assert frag.stranded_reason(Demand("ml/one", "q", gpus=1), busy) is None
    # MIG layouts change, and no fleet known says nothing.
    assert frag.stranded_reason(Demand("ml/m", "q", mig={"7g.80gb": 2}), busy) is None
    assert frag.stranded_reason(demand["ml-ivan/ddp-ivan"], []) is None
