"""MIG demand and layouts from queue events and node summaries, and the advice they give."""

from __future__ import annotations

import json

import msgspec
import pytest

from gpusteward.rules.mig import geometry, layout, observed
from gpusteward.rules.mig.observed import MigObservation, MigWorkload
from gpusteward.schema import NodeSummary, QueueEvent, WorkloadState

GEOMETRIES = geometry.load()
A100 = "NVIDIA A100-SXM4-80GB"


def event(name: str, state: WorkloadState, ts: float, mig: dict[str, int] | None = None,
          gpus: int = 0) -> QueueEvent:
    return QueueEvent(ts=ts, name=name, namespace="svc", cluster_queue="prod", state=state,
                      mig=mig or {}, gpus=gpus)


def summary(node: str, ts: float, free: dict[str, int], gpus: int = 2,
            model: str = A100) -> NodeSummary:
    return NodeSummary(ts=ts, node=node, gpu_model=model, gpus_total=gpus, gpus_free=gpus,
                       mig_free=free)


def test_workload_lifecycle_and_share() -> None:
    seen = MigObservation()
    observed.on_queue(seen, "svc/chat", event("chat", "pending", 100, {"1g.10gb": 1}))
    observed.on_queue(seen, "svc/chat", event("chat", "admitted", 160, {"1g.10gb": 1}))
    observed.on_queue(seen, "svc/train", event("train", "pending", 100, gpus=8))
    assert seen.workloads == {"svc/chat": MigWorkload({"1g.10gb": 1}, since=100)}
    # Admission changes nothing of the entry: only the first event touched it.
    assert seen.touched == ["svc/chat"]
    # Still wanted: counts up to now.
    assert observed.share(seen.workloads["svc/chat"], 0, 200) == pytest.approx(0.5)
    observed.on_queue(seen, "svc/chat", event("chat", "finished", 150 + 100, {"1g.10gb": 1}))
    assert seen.workloads["svc/chat"].until == 250
    assert seen.touched == ["svc/chat", "svc/chat"]
    assert observed.share(seen.workloads["svc/chat"], 0, 1000) == pytest.approx(0.15)
    assert observed.share(seen.workloads["svc/chat"], 300, 1000) == 0.0
    observed.restart_interval(seen, 1000, [], forget_before=300)
    assert seen.workloads == {} and seen.touched[-1] == "svc/chat"


def test_layouts_packed_from_free_devices() -> None:
    a100 = GEOMETRIES["A100-80GB"]
    assert observed.gpu_layouts(a100, {"1g.10gb": 14}, 2) == [{"1g.10gb": 7}, {"1g.10gb": 7}]
    assert observed.gpu_layouts(a100, {"3g.40gb": 2, "1g.10gb": 1}, 2) == [
        {"3g.40gb": 2}, {"1g.10gb": 1}]
    # A profile the model lacks, and what fits on no GPU, are dropped.
    assert observed.gpu_layouts(a100, {"1g.12gb": 3, "7g.80gb": 3}, 2) == [
        {"7g.80gb": 1}, {"7g.80gb": 1}]
    assert observed.gpu_layouts(a100, {}, 2) == [None, None]


def test_free_devices_seen_are_the_most_at_once_since_the_interval_began() -> None:
    seen = MigObservation()
    observed.on_summary(seen, summary("n1", 0, {"1g.10gb": 3}))
    observed.on_summary(seen, summary("n1", 60, {"1g.10gb": 14}))
    observed.on_summary(seen, summary("n1", 120, {}))
    assert seen.instances == {"n1": {"1g.10gb": 14}}
    observed.restart_interval(seen, 3600, [summary("n1", 120, {"1g.10gb": 2})], 0)
    assert seen.instances == {"n1": {"1g.10gb": 2}} and seen.last_slot == 3600


def test_pools_by_model_skip_gpus_without_mig() -> None:
    summaries = [summary("a2", 0, {}, gpus=4), summary("a1", 0, {}, gpus=4),
                 summary("t4", 0, {}, model="Tesla T4"), summary("cpu", 0, {}, gpus=0),
                 summary("h1", 0, {}, gpus=8, model="NVIDIA H100 80GB HBM3")]
    assert observed.pools(GEOMETRIES, summaries) == [
        layout.Pool("A100-80GB", "A100-80GB", ("a1", "a2"), 4),
        layout.Pool("H100-80GB", "H100-80GB", ("h1",), 8)]
    # A fully partitioned node reports no whole GPUs: its instances seen say how many.
    seen = {"a9": {"1g.10gb": 9}, "a8": {}}
    assert observed.pools(GEOMETRIES, [summary("a9", 0, {}, gpus=0),
                                       summary("a8", 0, {}, gpus=0)], seen) == [
        layout.Pool("A100-80GB", "A100-80GB", ("a9",), 2)]
    # Nodes of one model with different GPU counts: one pool per count.
    assert observed.pools(GEOMETRIES, [*summaries, summary("a3", 0, {}, gpus=1)])[:2] == [
        layout.Pool("A100-80GB/1gpu", "A100-80GB", ("a3",), 1),
        layout.Pool("A100-80GB/4gpu", "A100-80GB", ("a1", "a2"), 4)]


def test_demand_goes_to_the_pool_offering_the_profile() -> None:
    seen = MigObservation()
    observed.on_summary(seen, summary("h1", 0, {"1g.10gb": 7}, model="NVIDIA H100 80GB HBM3"))
    observed.on_summary(seen, summary("a1", 0, {"3g.40gb": 2}))
    observed.on_queue(seen, "svc/chat", event("chat", "admitted", 0, {"1g.10gb": 2}))
    observed.on_queue(seen, "svc/embed", event("embed", "pending", 50, {"2g.20gb": 1}))
    observed.on_queue(seen, "svc/big", event("big", "pending", 50, {"3g.40gb": 1}))
    observed.on_queue(seen, "svc/odd", event("odd", "pending", 50, {"5g.99gb": 1}))
    pools = observed.pools(GEOMETRIES, [summary("h1", 0, {}, model="NVIDIA H100 80GB HBM3",
                                                gpus=8),
                                        summary("a1", 0, {})])
    demand = observed.demand(GEOMETRIES, pools, seen, now=100, window_s=100)
    # 1g.10gb: both models have it, only the H100 node offers it; 3g.40gb: only the A100
    # offers it, though the H100 pool is larger. 2g.20gb: nobody offers it, the largest
    # pool able to gets it. A profile no model has is left out.
    assert demand == {
        "H100-80GB": [layout.Demand("svc/chat#1g.10gb#0", "1g.10gb", 1.0),
                      layout.Demand("svc/chat#1g.10gb#1", "1g.10gb", 1.0),
                      layout.Demand("svc/embed", "2g.20gb", 0.5)],
        "A100-80GB": [layout.Demand("svc/big", "3g.40gb", 0.5)]}


def test_stranded_profile_gets_a_layout_change() -> None:
    """The mig-inference scenario: a 2g.20gb request no node's layout offers."""
    seen = MigObservation()
    nodes = [summary("a100-1g-1", 0, {"1g.10gb": 14}), summary("a100-1g-2", 0, {"1g.10gb": 14}),
             summary("a100-3g-1", 0, {"3g.40gb": 2}, gpus=1)]
    for node in nodes:
        observed.on_summary(seen, node)
    for i in range(10):
        observed.on_queue(seen, f"svc/chat-{i}", event(f"chat-{i}", "admitted", 0,
                                                        {"1g.10gb": 1}))
    for i in range(2):
        observed.on_queue(seen, f"svc/embed-{i}", event(f"embed-{i}", "admitted", 0,
                                                         {"3g.40gb": 1}))
    observed.on_queue(seen, "svc/rerank", event("rerank", "pending", 900, {"2g.20gb": 1}))
    advice = observed.advise(GEOMETRIES, nodes, seen, now=3600, window_s=3600)
    # One pool per GPU count: the 3g node has one GPU, the 1g nodes two.
    small, large = advice.pools
    assert (small.pool.name, small.pool.gpus) == ("A100-80GB/1gpu", 1)
    assert (large.pool.name, large.pool.gpus) == ("A100-80GB/2gpu", 4)
    # The embedders stay where their layout is; chat and the reranker are planned on the
    # 1g nodes' four GPUs, in fewer of them than today, and the reranker is served.
    assert small.unserved == [] and small.changes == []
    assert large.unserved == [] and large.served["svc/rerank"] == "2g.20gb"
    assert large.served_share == pytest.approx(10 + 0.75)
    assert large.gpus_used < 4
    assert large.changes, "today's layouts do not serve the reranker: something must change"
    changed = {c.node for c in large.changes}
    (finding,) = layout.advice_findings(advice, ts=3600, window_start=0)
    assert finding.kind == layout.KIND and finding.severity == "info"
    assert finding.labels["pool"] == "A100-80GB/2gpu"
    assert {k.removeprefix("node.") for k in finding.labels if k.startswith("node.")} == changed
    assert finding.evidence is not None
    assert finding.evidence.values["demand_share"] == pytest.approx(10.75)
    # The finding carries the configs to apply: each relabelled node's config, as
    # mig-parted entries that hold the reranker's profile somewhere.
    configs = {k.removeprefix("config."): json.loads(v) for k, v in finding.labels.items()
               if k.startswith("config.")}
    assert set(configs) == {finding.labels[f"node.{n}"] for n in changed}
    assert any(entry.get("mig-devices", {}).get("2g.20gb") for entries in configs.values()
               for entry in entries)


def test_no_change_no_finding() -> None:
    seen = MigObservation()
    node = summary("a1", 0, {"1g.10gb": 7}, gpus=1)
    observed.on_summary(seen, node)
    for i in range(7):
        observed.on_queue(seen, f"svc/c{i}", event(f"c{i}", "admitted", 0, {"1g.10gb": 1}))
    advice = observed.advise(GEOMETRIES, [node], seen, now=100, window_s=100)
    assert advice.pools[0].served_share == pytest.approx(7.0)
    assert layout.advice_findings(advice, ts=100, window_start=0) == []


def test_slots_are_aligned_on_the_epoch() -> None:
    assert observed.slot_of(21_599.0, 21_600) == 0.0
    assert observed.slot_of(21_600.0, 21_600) == 21_600.0


@pytest.mark.parametrize("down", [{"cordoned": True}, {"healthy": False}])
def test_cordoned_and_unhealthy_nodes_are_planned_for_nobody(down: dict[str, bool]) -> None:
    """The only node with 2g.20gb slices is cordoned (or unhealthy): the reranker is not
    served there, so the node the scheduler uses is re-partitioned for it."""
    seen = MigObservation()
    usable = summary("a100-1g", 0, {"1g.10gb": 14})
    nodes = [usable, msgspec.structs.replace(summary("a100-2g", 0, {"2g.20gb": 6}), **down)]
    for node in nodes:
        observed.on_summary(seen, node)
    for i in range(10):
        observed.on_queue(seen, f"svc/chat-{i}", event(f"chat-{i}", "admitted", 0,
                                                        {"1g.10gb": 1}))
    observed.on_queue(seen, "svc/rerank", event("rerank", "pending", 0, {"2g.20gb": 1}))
    assert observed.pools(GEOMETRIES, nodes) == [
        layout.Pool("A100-80GB", "A100-80GB", ("a100-1g",), 2)]
    advice = observed.advise(GEOMETRIES, nodes, seen, now=3600, window_s=3600)
    (pool,) = advice.pools
    assert pool.served["svc/rerank"] == "2g.20gb"
    assert {c.node for c in pool.changes} == {"a100-1g"}
    # Back in service, it is planned again, with the layout seen while it was out.
    back = [usable, summary("a100-2g", 0, {})]
    assert observed.pools(GEOMETRIES, back, seen.instances) == [
        layout.Pool("A100-80GB", "A100-80GB", ("a100-1g", "a100-2g"), 2)]
    assert seen.instances["a100-2g"] == {"2g.20gb": 6}


@pytest.mark.parametrize("down", [{"cordoned": True}, {"healthy": False}])
def test_a_pool_keeps_its_name_and_its_advice_its_id_while_a_node_is_out(
        down: dict[str, bool]) -> None:
    """The only 1-GPU A100 node is cordoned (or unhealthy) for a while: it is planned for
    nobody, but the 2-GPU nodes' pool is still ``A100-80GB/2gpu`` and its advice keeps its
    fingerprint, so it is not republished under a new id while the node is out and again
    when it comes back."""
    seen = MigObservation()
    small = summary("a100-3g-1", 0, {"3g.40gb": 2}, gpus=1)
    nodes = [summary("a100-1g-1", 0, {"1g.10gb": 14}), summary("a100-1g-2", 0, {"1g.10gb": 14}),
             small]
    for node in nodes:
        observed.on_summary(seen, node)
    for i in range(10):
        observed.on_queue(seen, f"svc/chat-{i}", event(f"chat-{i}", "admitted", 0,
                                                        {"1g.10gb": 1}))
    observed.on_queue(seen, "svc/rerank", event("rerank", "pending", 900, {"2g.20gb": 1}))

    def advice(fleet: list[NodeSummary]) -> tuple[list[str], set[str]]:
        advised = observed.advise(GEOMETRIES, fleet, seen, now=3600, window_s=3600)
        findings = layout.advice_findings(advised, ts=3600, window_start=0)
        return [p.pool.name for p in advised.pools], {f.fingerprint for f in findings}

    in_service = advice(nodes)
    out = advice([*nodes[:2], msgspec.structs.replace(small, **down)])
    assert out[0] == ["A100-80GB/2gpu"]
    assert in_service[0] == ["A100-80GB/2gpu"] and out[1] == in_service[1] != set()
