"""Start ETAs: release of held capacity, queue order, the naive fallback, one episode each."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gpusteward.rules import eta as e
from gpusteward.rules.fragmentation import Demand, FleetView
from gpusteward.schema import Finding, NodeSummary, QueueEvent, WorkloadState

SETTINGS = e.EtaSettings()


def ev(name: str, state: WorkloadState, ts: float, gpus: int = 1, priority: int = 0,
       created: float | None = None) -> QueueEvent:
    return QueueEvent(ts=ts, name=name, namespace="ml", cluster_queue="q", state=state,
                      created_at=created if created is not None else ts,
                      admitted_at=ts if state == "admitted" else None, gpus=gpus,
                      priority=priority)


def fleet(free: int, total: int = 2, nodes: int = 1) -> FleetView:
    summaries = [NodeSummary(ts=0, node=f"n{i}", gpu_model="L40S", gpus_total=total,
                             gpus_free=free if i == 0 else 0) for i in range(nodes)]
    return FleetView(nodes=summaries, pending={}, shape_counts={})


def apply(state: e.EtaState, *events: QueueEvent) -> list[Finding]:
    out: list[Finding] = []
    for event in events:
        out += e.on_queue(state, event, SETTINGS)
    return out


def with_history(runs: list[float]) -> e.EtaState:
    """A state whose queue has seen workloads run for ``runs`` seconds."""
    state = e.EtaState()
    for i, length in enumerate(runs):
        apply(state, ev(f"h{i}", "pending", 0), ev(f"h{i}", "admitted", 0),
              ev(f"h{i}", "finished", length))
    return state


def test_expected_end_is_the_median_of_peers_that_ran_as_long() -> None:
    running = e.Running(queue="q", gpus=1, admitted_at=1000)
    runs = [600.0, 1200.0, 1800.0, 2400.0]
    # Age 0: the median of all; age 1500: the median of 1800 and 2400.
    assert e.expected_end(running, runs, 1000) == 1000 + 1500
    assert e.expected_end(running, runs, 2500) == 1000 + 2100
    # Past every peer: half its age again.
    assert e.expected_end(running, runs, 4000) == 4000 + 1500
    assert e.expected_end(running, [], 1000) is None


def test_eta_follows_releases_in_queue_order() -> None:
    state = with_history([1200.0] * 5)
    apply(state, ev("r1", "pending", 5000), ev("r1", "admitted", 5000),
          ev("r2", "pending", 5600), ev("r2", "admitted", 5600))
    # Two GPUs, both held; r1 ends at 6200, r2 at 6800. Three wait.
    apply(state, ev("a", "pending", 5700), ev("b", "pending", 5800),
          ev("hi", "pending", 5900, priority=10))
    out = e.estimates(state, fleet(0), 6000, SETTINGS)
    # The high-priority one goes first, then in arrival order.
    assert out["ml/hi"][0] == 6200 and out["ml/hi"][2] == 0
    assert out["ml/a"][0] == 6800 and out["ml/a"][2] == 1
    # The third has no release left to wait for: it falls back to the naive figure.
    assert out["ml/b"][0] == out["ml/b"][1]


def test_free_capacity_starts_now_and_unplaceable_shapes_get_no_release_eta() -> None:
    state = with_history([600.0])
    apply(state, ev("now", "pending", 100), ev("huge", "pending", 110, gpus=3))
    out = e.estimates(state, fleet(1, total=2), 200, SETTINGS)
    assert out["ml/now"][0] == 200
    assert out["ml/huge"][0] == out["ml/huge"][1]  # 3 GPUs fit no 2-GPU node: naive only


def test_a_workload_no_node_can_hold_gets_no_estimate_and_takes_no_place() -> None:
    """A pod asking for more GPUs than any node has can never start: no estimate (the demo's
    2-GPU job on one-GPU nodes was told "expected to start in 8 min" for six hours), and the
    workloads behind it are not counted behind it."""
    state = with_history([1200.0] * 3)
    apply(state, ev("ddp", "pending", 100, gpus=2), ev("a", "pending", 200))
    nodes = fleet(0, total=1, nodes=4).nodes
    pending = {"ml/ddp": Demand("ml/ddp", "q", gpus=2), "ml/a": Demand("ml/a", "q", gpus=1)}
    (only,) = e.evaluate(state, FleetView(nodes=nodes, pending=pending, shape_counts={}),
                         1000, SETTINGS)
    assert only.subject.pod is not None and only.subject.pod.name == "a"
    assert only.evidence is not None and only.evidence.values["position"] == 0
    # One that had an estimate, when the only node that could hold it goes: resolved.
    state = with_history([1200.0] * 3)
    apply(state, ev("w", "pending", 100, gpus=2))
    big = fleet(0, total=2).nodes
    wants = {"ml/w": Demand("ml/w", "q", gpus=2)}
    (published,) = e.evaluate(state, FleetView(nodes=big, pending=wants, shape_counts={}),
                              1000, SETTINGS)
    assert published.state == "firing"
    (closed,) = e.evaluate(state, FleetView(nodes=nodes, pending=wants, shape_counts={}),
                           1100, SETTINGS)
    assert closed.id == published.id and closed.state == "resolved"
    assert closed.summary == "ml/w gets no estimate: no node of the fleet can hold it"
    assert e.evaluate(state, FleetView(nodes=nodes, pending=wants, shape_counts={}), 1200,
                      SETTINGS) == []


def test_a_mig_workload_no_layout_offers_gets_no_estimate() -> None:
    """mig-inference's reranker was told "expected to start in 5 min" (the naive figure) for
    a profile no node's layout has."""
    state = with_history([1200.0] * 3)
    apply(state, ev("rerank", "pending", 100))
    state.pending["ml/rerank"].mig = {"2g.20gb": 1}
    nodes = [NodeSummary(ts=0, node="a", gpu_model="A100", gpus_total=0, gpus_free=0,
                         mig_free={"1g.10gb": 3}, mig_total={"1g.10gb": 7})]
    pending = {"ml/rerank": Demand("ml/rerank", "q", mig={"2g.20gb": 1})}
    assert e.evaluate(state, FleetView(nodes=nodes, pending=pending, shape_counts={}), 1000,
                      SETTINGS) == []


def mig_ev(name: str, state: WorkloadState, ts: float, profile: str) -> QueueEvent:
    return msgspec.structs.replace(ev(name, state, ts, gpus=0), mig={profile: 1})


def test_a_mig_workload_waits_for_the_slices_of_its_profile_to_be_released() -> None:
    """A MIG workload got only the naive figure. It now waits for the slices of its profile
    the running MIG workloads hold, each profile on its own timeline: a whole-GPU job that
    no release frees room for does not hold it back, nor does one of another profile."""
    state = with_history([1200.0] * 3)
    apply(state, mig_ev("svc", "pending", 5000, "3g.40gb"),
          mig_ev("svc", "admitted", 5000, "3g.40gb"),
          mig_ev("small", "pending", 5000, "1g.10gb"),
          mig_ev("small", "admitted", 5000, "1g.10gb"),
          ev("big", "pending", 5050, gpus=2),
          mig_ev("w3", "pending", 5100, "3g.40gb"), mig_ev("w1", "pending", 5200, "1g.10gb"),
          mig_ev("w3b", "pending", 5300, "3g.40gb"))
    # One A100 in two 3g.40gb slices, one held by svc and one free; one GPU in seven 1g.10gb,
    # all held (six by workloads the queue does not show). The whole GPUs are all held.
    nodes = [NodeSummary(ts=0, node="mig", gpu_model="A100", gpus_total=0, gpus_free=0,
                         mig_free={"3g.40gb": 1}, mig_total={"3g.40gb": 2}),
             NodeSummary(ts=0, node="mig7", gpu_model="A100", gpus_total=0, gpus_free=0,
                         mig_free={}, mig_total={"1g.10gb": 7}),
             NodeSummary(ts=0, node="whole", gpu_model="A100", gpus_total=2, gpus_free=0)]
    out = e.estimates(state, FleetView(nodes=nodes, pending={}, shape_counts={}), 5400,
                      SETTINGS)
    assert out["ml/w3"][0] == 5400  # the free slice
    assert out["ml/w3b"][0] == 5000 + 1200  # svc's, at its expected end
    assert out["ml/w1"][0] == 5000 + 1200  # small's, though the 2-GPU job has no release
    assert out["ml/big"][0] == out["ml/big"][1]
    # A summary read before svc's admission shows its slice free too: what the queue
    # admitted since is taken off, where the layouts are known.
    trailing = [msgspec.structs.replace(nodes[0], mig_free={"3g.40gb": 2}), *nodes[1:]]
    assert e.available_now(state, trailing)["3g.40gb"] == 1


def test_naive_is_position_over_admission_rate() -> None:
    state = e.EtaState()
    for i in range(6):  # six admissions in the last hour: 6/h
        apply(state, ev(f"x{i}", "pending", 1000 + i), ev(f"x{i}", "admitted", 1000 + 100 * i))
    apply(state, ev("w0", "pending", 2000), ev("w1", "pending", 2001))
    out = e.estimates(state, fleet(0), 3000, SETTINGS)
    assert out["ml/w0"][1] == 3000 + 600 and out["ml/w1"][1] == 3000 + 1200


def test_one_episode_per_wait_reissued_only_when_it_moves_and_closed_with_its_error() -> None:
    state = with_history([1200.0] * 3)
    apply(state, ev("r", "pending", 5000), ev("r", "admitted", 5000),
          ev("w", "pending", 5100))
    first = e.evaluate(state, fleet(0, total=1), 5200, SETTINGS)
    (published,) = first
    assert published.state == "firing" and published.evidence is not None
    assert published.evidence.values["eta_ts"] == 6200
    assert e.evaluate(state, fleet(0, total=1), 5260, SETTINGS) == []
    closing = apply(state, ev("r", "finished", 6000), ev("w", "admitted", 6030))
    (resolved,) = closing
    assert resolved.id == published.id and resolved.state == "resolved"
    assert resolved.evidence is not None
    assert resolved.evidence.values["eta_error_s"] == 6200 - 6030
    assert resolved.summary == "ml/w started 3 min before its estimate"


def test_a_workload_is_estimated_once_it_has_waited_min_wait() -> None:
    """A workload admitted within a minute never gets an estimate: the fleet agent can read
    a summary a moment before the admission that ended a wait of no time (the failover
    test's three workers saw it), and an ETA for a workload that starts at once is noise."""
    state = with_history([1200.0] * 3)
    apply(state, ev("r", "pending", 5000), ev("r", "admitted", 5000), ev("w", "pending", 5100))
    assert e.evaluate(state, fleet(0, total=1), 5100, SETTINGS) == []
    assert e.evaluate(state, fleet(0, total=1), 5100 + SETTINGS.min_wait_s - 1, SETTINGS) == []
    (published,) = e.evaluate(state, fleet(0, total=1), 5100 + SETTINGS.min_wait_s, SETTINGS)
    assert published.kind == e.KIND and published.state == "firing"


@given(runs=st.lists(st.floats(60, 7200), min_size=1, max_size=20),
       ages=st.lists(st.floats(0, 10000), min_size=1, max_size=6),
       waiting=st.integers(0, 8), free=st.integers(0, 4))
def test_etas_are_never_in_the_past_and_keep_queue_order(runs: list[float], ages: list[float],
                                                         waiting: int, free: int) -> None:
    state = with_history(runs)
    now = 20000.0
    for i, age in enumerate(ages):
        apply(state, ev(f"r{i}", "pending", now - age), ev(f"r{i}", "admitted", now - age))
    for i in range(waiting):
        apply(state, ev(f"w{i}", "pending", now - 100 + i))
    out = e.estimates(state, fleet(free, total=4), now, SETTINGS)
    etas = [out[f"ml/w{i}"][0] for i in range(waiting)]
    assert all(x is None or x >= now for x in etas)
    release = [x for x in etas if x is not None]
    # Equal shapes in FIFO order start in order (until the release model runs out).
    model = [x for i, x in enumerate(release) if out[f"ml/w{i}"][0] != out[f"ml/w{i}"][1]]
    assert model == sorted(model)
