"""The fleet agent's periodic MIG layout advice, through the evaluator (no broker)."""

from __future__ import annotations

import msgspec

from gpusteward.rules.mig import layout
from gpusteward.rules.mig.observed import MigWorkload
from gpusteward.rules.policy import parse_policy
from gpusteward.schema import Finding, NodeSummary, QueueEvent
from gpusteward.streams.fleet import FleetEvaluator, FleetOutput, FleetSettings, FleetState

HOUR = 3600.0
A100 = "NVIDIA A100-SXM4-80GB"


def summary(node: str, ts: float, free: dict[str, int], gpus: int = 2) -> NodeSummary:
    return NodeSummary(ts=ts, node=node, gpu_model=A100, gpus_total=gpus, gpus_free=gpus,
                       mig_free=free)


def request(name: str, ts: float, profile: str, state: str = "admitted") -> QueueEvent:
    return msgspec.convert({"ts": ts, "name": name, "namespace": "svc",
                            "cluster_queue": "prod-inference", "state": state,
                            "created_at": ts, "mig": {profile: 1}}, QueueEvent)


def evaluator() -> FleetEvaluator:
    return FleetEvaluator(FleetSettings(policy=parse_policy(
        f"rules: {{mig_layout_advice: {{interval_s: {HOUR}, window_s: {HOUR}}}}}")))


def run(ev: FleetEvaluator, state: FleetState, record: NodeSummary | QueueEvent
        ) -> list[FleetOutput]:
    """What the agent does per record: fold it in, then advise when an interval is due."""
    out = (ev.on_summary(state, record) if isinstance(record, NodeSummary)
           else ev.on_queue(state, record))
    slot = ev.mig_advice_due(state)
    if slot is not None:
        out += ev.mig_advice(state, slot)
    return out


def advice(outputs: list[FleetOutput]) -> list[Finding]:
    return [o for o in outputs if isinstance(o, Finding) and o.kind == layout.KIND]


def records(start: float) -> list[NodeSummary | QueueEvent]:
    """The mig-inference picture over one hour: two all-1g.10gb nodes with room to spare,
    a reranker asking for 2g.20gb from a quarter past."""
    out: list[NodeSummary | QueueEvent] = []
    out += [request(f"chat-{i}", start + 10, "1g.10gb") for i in range(6)]
    out.append(request("rerank", start + HOUR / 4, "2g.20gb", state="pending"))
    for t in range(60, int(HOUR) + 120, 60):
        out += [summary("a100-1g-1", start + t, {"1g.10gb": 8}),
                summary("a100-1g-2", start + t, {"1g.10gb": 14})]
    return sorted(out, key=lambda r: r.ts)


def test_advice_once_per_interval_with_a_stable_id() -> None:
    ev, state = evaluator(), FleetState()
    start = 100 * HOUR
    outputs = [(r, run(ev, state, r)) for r in records(start)]
    emitted = [(r.ts, f) for r, out in outputs for f in advice(out)]
    # The first interval only starts the observation; the first record past its end
    # brings the advice for the pool, once, at the interval's boundary.
    assert [ts for ts, _ in emitted] == [start + HOUR]
    finding = emitted[0][1]
    assert finding.ts == start + HOUR and finding.labels["pool"] == "A100-80GB"
    assert finding.evidence is not None
    assert finding.evidence.values["served_share"] == finding.evidence.values["demand_share"]
    # Six chats from 10 s in, the reranker for three quarters of the hour.
    assert abs(finding.evidence.values["demand_share"] - (6 * 3590 / 3600 + 0.75)) < 1e-9
    assert "GPU-instance-hours" in finding.summary
    assert any(v.find("2g.20gb") >= 0 for k, v in finding.labels.items()
               if k.startswith("config."))
    # Nothing more within the next interval.
    later = [run(ev, state, summary("a100-1g-2", start + HOUR + t, {"1g.10gb": 14}))
             for t in range(120, 3600, 600)]
    assert not any(advice(out) for out in later)


def test_restarted_worker_republishes_the_same_id() -> None:
    ev, state = evaluator(), FleetState()
    start = 100 * HOUR
    stream = records(start)
    crossing = next(i for i, r in enumerate(stream) if r.ts >= start + HOUR)
    # The checkpoint and the MIG workload table as the agent writes them (nodes and MIG
    # workloads live in tables of their own, written as they change).
    table: dict[str, bytes] = {}
    for record in stream[:crossing]:
        run(ev, state, record)
        for key in state.mig.touched:
            table[key] = msgspec.msgpack.encode(state.mig.workloads[key])
        state.mig.touched = []
    encoded = msgspec.msgpack.encode(msgspec.structs.replace(
        state, nodes={}, mig=msgspec.structs.replace(state.mig, workloads={})))
    first = advice(run(ev, state, stream[crossing]))
    restored = msgspec.msgpack.decode(encoded, type=FleetState)
    restored.nodes = dict(state.nodes)
    restored.mig.workloads = {k: msgspec.msgpack.decode(v, type=MigWorkload)
                              for k, v in table.items()}
    assert len(restored.mig.workloads) == 7
    again = advice(run(evaluator(), restored, stream[crossing]))
    assert [f.id for f in first] == [f.id for f in again] and len(first) == 1
    # The next interval is another episode, with another id.
    for record in records(start + HOUR):
        nxt = [f for f in advice(run(ev, state, record)) if f.state == "firing"]
        if nxt:
            assert nxt[0].id != first[0].id
            break
    else:
        raise AssertionError("no advice in the second interval")


def test_no_demand_no_advice() -> None:
    ev, state = evaluator(), FleetState()
    out: list[FleetOutput] = []
    for t in range(0, int(3 * HOUR), 300):
        out += run(ev, state, summary("a1", t, {"1g.10gb": 14}))
    # Nothing asks for MIG: no advice, rather than advice to switch MIG off on the
    # strength of a queue that may not report MIG requests at all.
    assert advice(out) == []
    assert state.mig.last_slot == 2 * HOUR


def test_a_pools_advice_resolves_once_it_is_no_longer_advised() -> None:
    """Each interval's advice is a finding of its own (its id from the window's start):
    the next interval's for the pool supersedes it, and it resolves just before that one
    fires (Alertmanager and chat keep one alert per pool, the sink nets the two in a batch);
    once no interval advises the pool (the reranker that wanted 2g.20gb is gone from the
    window), the last advice resolves. None resolved ever before: the last advice, "relabel
    1 node(s)", fired for ever after the layout was applied or the demand left, and every
    superseded one stayed open for the alerting consumer, which restores open findings."""
    ev, state = evaluator(), FleetState()
    start = 100 * HOUR
    out: list[FleetOutput] = []
    for record in records(start) + records(start + HOUR)[7:]:  # the same demand 2 h
        out += run(ev, state, record)
    for i in range(7):  # every workload finishes
        name = "rerank" if i == 6 else f"chat-{i}"
        out += run(ev, state, msgspec.structs.replace(
            request(name, start + 2 * HOUR + 30, "1g.10gb"), state="finished"))
    for t in range(60, int(3 * HOUR), 60):  # three more hours of the nodes' summaries
        out += run(ev, state, summary("a100-1g-1", start + 2 * HOUR + t, {"1g.10gb": 8}))
    # A restart after it all: the state goes through the changelog encoding.
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=FleetState)
    for t in range(0, int(2 * HOUR), 600):
        out += run(ev, state, summary("a100-1g-1", start + 5 * HOUR + t, {"1g.10gb": 8}))
    found = [(f.state, f.ts, f.starts_at) for f in advice(out)]
    # The third interval still saw the demand's last 30 s; the fourth saw none.
    assert found == [("firing", start + HOUR, start),
                     ("resolved", start + 2 * HOUR, start),
                     ("firing", start + 2 * HOUR, start + HOUR),
                     ("resolved", start + 3 * HOUR, start + HOUR),
                     ("firing", start + 3 * HOUR, start + 2 * HOUR),
                     ("resolved", start + 4 * HOUR, start + 2 * HOUR)]
    first, superseded, *_, last, gone = advice(out)
    assert (superseded.id, gone.id) == (first.id, last.id)
    assert superseded.summary == ("pool A100-80GB: superseded by the advice of the next "
                                  "interval")
    assert gone.summary == "pool A100-80GB: no MIG layout change advised any more"
