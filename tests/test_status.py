"""The status fold: the latest state per key of each topic, turned into the fleet now."""

from __future__ import annotations

import msgspec

from gpusteward.rules import eta
from gpusteward.schema import (
    Action,
    ActionResult,
    Evidence,
    Finding,
    NodeSummary,
    PodAllocation,
    PodRef,
    QueueEvent,
    Subject,
)
from gpusteward.settings import Settings
from gpusteward.status import (
    BREAKER_RESET_PREFIX,
    BREAKER_TRIP_PREFIX,
    ETA_KIND,
    FleetStatus,
    PendingStatus,
    StatusFold,
)

NOW = 10_000.0


def pod(name: str, node: str, gpus: int, phase: str = "running", team: str | None = None,
        ts: float = 100.0) -> PodAllocation:
    return PodAllocation(ts=ts, node=node, pod=PodRef("ml", name, uid=f"uid-{name}"),
                         phase=phase, gpus=gpus,  # type: ignore[arg-type]
                         labels={"team": team} if team else {})


def finding(fid: str, kind: str, state: str, subject: Subject, ts: float = 200.0,
            severity: str = "warning") -> Finding:
    return Finding(id=fid, fingerprint=fid, kind=kind, severity=severity,  # type: ignore[arg-type]
                   state=state, subject=subject, summary=f"{kind} {fid}",  # type: ignore[arg-type]
                   starts_at=ts - 100, ts=ts)


def action(key: str, verb: str = "cordon", node: str = "n1") -> Action:
    return Action(idempotency_key=key, verb=verb, target=Subject(node=node),  # type: ignore[arg-type]
                  reason="r", rule="xid", finding_ids=["f"], ts=300.0)


def result(key: str, outcome: str, ts: float = 310.0, attempt: int = 1) -> ActionResult:
    return ActionResult(idempotency_key=key, verb="cordon", target=Subject(node="n1"),
                        outcome=outcome, detail=outcome, actor="t", ts=ts,  # type: ignore[arg-type]
                        attempt=attempt)


def fleet() -> StatusFold:
    fold = StatusFold()
    for node, model, free in (("n1", "H100", 2), ("n2", "H100", 4), ("n3", "A100", 8)):
        fold.summary(NodeSummary(ts=50.0, node=node, gpu_model=model, gpus_total=8,
                                 gpus_free=free))
    fold.allocation(pod("train", "n1", 4, team="vision"))
    fold.allocation(pod("notebook", "n1", 2, team="nlp"))
    fold.allocation(pod("serve", "n2", 4, team="nlp"))
    fold.allocation(pod("gone", "n3", 8, team="nlp"))
    fold.allocation(pod("gone", "n3", 8, phase="finished", team="nlp", ts=150.0))
    return fold


def test_pools_and_teams_count_allocated_and_busy_gpus():
    fold = fleet()
    fold.finding(finding("idle-1", "idle_holder", "firing",
                         Subject(node="n1", pod=PodRef("ml", "notebook", uid="uid-notebook"))))
    status = fold.snapshot(NOW)
    pools = {p.pool: (p.nodes, p.gpus, p.allocated, p.busy) for p in status.pools}
    assert pools == {"H100": (2, 16, 10, 8), "A100": (1, 8, 0, 0)}
    teams = {t.team: (t.pods, t.allocated, t.busy, t.idle) for t in status.teams}
    assert teams == {"vision": (1, 4, 4, 0), "nlp": (2, 6, 4, 2)}


def test_a_deleted_node_leaves_the_pools_and_an_older_summary_does_not_bring_it_back():
    fold = fleet()
    before = fold.summaries["n3"]
    fold.summary(msgspec.structs.replace(before, ts=60.0, gpus_total=0, gpus_free=0,
                                         deleted=True))
    fold.summary(before)  # redelivered after the tombstone (the topic is read again)
    assert {p.pool: p.nodes for p in fold.snapshot(NOW).pools} == {"H100": 2}
    fold.summary(msgspec.structs.replace(before, ts=70.0))  # created again
    assert {p.pool: p.nodes for p in fold.snapshot(NOW).pools} == {"H100": 2, "A100": 1}


def test_open_findings_are_the_latest_firing_state_per_id():
    fold = fleet()
    fold.finding(finding("a", "xid", "firing", Subject(node="n1", device="GPU-1"),
                         severity="critical"))
    fold.finding(finding("b", "thermal_slowdown", "firing", Subject(node="n2"), ts=250))
    fold.finding(finding("b", "thermal_slowdown", "resolved", Subject(node="n2"), ts=400))
    fold.finding(finding("b", "thermal_slowdown", "firing", Subject(node="n2"), ts=250))
    status = fold.snapshot(NOW)
    assert [(f.id, f.kind, f.severity, f.subject) for f in status.findings] == [
        ("a", "xid", "critical", "n1/GPU-1")]
    assert status.findings[0].age_s == NOW - 100


def test_actions_pending_until_a_final_result_and_retries_counted():
    fold = fleet()
    for key in ("k1", "k2", "k3"):
        fold.action(action(key))
    fold.result(result("k1", "retrying", attempt=1))
    fold.result(result("k1", "executed", ts=320, attempt=2))
    fold.result(result("k2", "retrying", attempt=1))
    status = fold.snapshot(NOW)
    assert [a.idempotency_key for a in status.pending_actions] == ["k2", "k3"]
    (done,) = status.recent_actions
    assert (done.idempotency_key, done.outcome, done.attempts) == ("k1", "executed", 2)


def test_breaker_follows_trip_and_reset_records():
    fold = fleet()
    fold.result(result(f"{BREAKER_TRIP_PREFIX}reclaims/1", "refused", ts=500))
    breaker = fold.snapshot(NOW).breaker
    assert (breaker.open, breaker.since, breaker.circuits) == (True, 500, ["reclaims"])
    fold.result(result(f"{BREAKER_TRIP_PREFIX}nodes/2", "refused", ts=550))
    breaker = fold.snapshot(NOW).breaker
    assert (breaker.since, breaker.circuits) == (500, ["reclaims", "nodes"])
    # A reset of one circuit leaves the other open, with its own reason and time.
    fold.result(result(f"{BREAKER_RESET_PREFIX}reclaims/3", "executed", ts=560))
    breaker = fold.snapshot(NOW).breaker
    assert (breaker.open, breaker.since, breaker.circuits) == (True, 550, ["nodes"])
    fold.result(result(f"{BREAKER_RESET_PREFIX}3", "executed", ts=600))
    assert not fold.snapshot(NOW).breaker.open
    # A trip recorded before the circuits were split stopped both.
    fold.result(result(f"{BREAKER_TRIP_PREFIX}4", "refused", ts=700))
    assert fold.snapshot(NOW).breaker.circuits == ["nodes", "reclaims"]


def test_queue_waits_count_pending_workloads_only():
    fold = fleet()
    for name, state, created in (("a", "pending", 1000.0), ("b", "pending", 4000.0),
                                 ("c", "admitted", 0.0)):
        fold.queue(QueueEvent(ts=5000.0, name=name, namespace="ml", cluster_queue="gpu",
                              state=state, created_at=created, gpus=2))  # type: ignore[arg-type]
    fold.queue(QueueEvent(ts=6000.0, name="b", namespace="ml", cluster_queue="gpu",
                          state="admitted", created_at=4000.0, gpus=2))
    (queue,) = fold.snapshot(NOW).queues
    assert (queue.pending, queue.pending_gpus, queue.longest_wait_s) == (1, 2, NOW - 1000)


def estimate(name: str, state: str, eta_ts: float, ts: float, naive: float | None = None,
             position: int = 0) -> Finding:
    values = {"eta_ts": eta_ts, "position": float(position)}
    if naive is not None:
        values["naive_eta_ts"] = naive
    return Finding(id=f"eta-{name}", fingerprint=f"eta-{name}", kind=ETA_KIND, severity="info",
                   state=state, subject=Subject(queue="gpu", pod=PodRef("ml", name)),  # type: ignore[arg-type]
                   summary=f"{name} expected", starts_at=1000.0, ts=ts,
                   evidence=Evidence(window_start=1000.0, window_end=ts, values=values))


def test_pending_workloads_show_their_latest_start_eta():
    assert ETA_KIND == eta.KIND
    fold = fleet()
    for name, created in (("a", 1000.0), ("b", 4000.0), ("c", 2000.0), ("d", 3000.0)):
        fold.queue(QueueEvent(ts=5000.0, name=name, namespace="ml", cluster_queue="gpu",
                              state="pending", created_at=created, gpus=2))
    # a: re-estimated under the same id (the later one counts, whatever the arrival order)
    fold.finding(estimate("a", "firing", NOW + 1800, ts=9000.0, naive=NOW + 3600, position=1))
    fold.finding(estimate("a", "firing", NOW + 600, ts=9500.0, naive=NOW + 900, position=0))
    fold.finding(estimate("a", "firing", NOW + 1800, ts=9000.0, naive=NOW + 3600, position=1))
    fold.finding(estimate("b", "firing", NOW - 300, ts=9600.0, position=2))  # overdue
    fold.finding(estimate("c", "firing", NOW + 60, ts=9000.0))
    fold.finding(estimate("c", "resolved", NOW + 60, ts=9700.0))  # closed: no estimate now
    fold.queue(QueueEvent(ts=5000.0, name="started", namespace="ml", cluster_queue="gpu",
                          state="admitted", gpus=1))
    fold.finding(estimate("started", "firing", NOW, ts=9000.0))
    status = fold.snapshot(NOW)
    assert status.pending == [
        PendingStatus("ml/b", "gpu", 2, NOW - 4000, NOW - 300, None, 3),
        PendingStatus("ml/a", "gpu", 2, NOW - 1000, NOW + 600, NOW + 900, 1),
        PendingStatus("ml/c", "gpu", 2, NOW - 2000),
        PendingStatus("ml/d", "gpu", 2, NOW - 3000),
    ]
    # Shown with the pending workloads, not among the open findings.
    assert not [f for f in status.findings if f.kind == ETA_KIND]


def test_the_rich_view_lists_pending_workloads_with_their_etas():
    from rich.console import Console

    from gpusteward.cli.status import render

    fold = fleet()
    fold.queue(QueueEvent(ts=5000.0, name="train-8", namespace="ml", cluster_queue="gpu",
                          state="pending", created_at=NOW - 1500, gpus=8))
    fold.queue(QueueEvent(ts=5000.0, name="late", namespace="ml", cluster_queue="gpu",
                          state="pending", created_at=NOW - 60, gpus=1))
    fold.finding(estimate("train-8", "firing", NOW + 45 * 60, ts=9000.0, naive=NOW + 7200))
    console = Console(record=True, width=200)
    console.print(render(fold.snapshot(NOW)))
    text = console.export_text()

    def cells(workload: str) -> list[str]:
        (row,) = [line for line in text.splitlines() if workload in line]
        return [cell.strip() for cell in row.strip("│ ").split("│")]

    assert cells("ml/train-8") == ["ml/train-8", "gpu", "8", "25m", "1", "in 45m", "in 2.0h"]
    assert cells("ml/late") == ["ml/late", "gpu", "1", "60s", "", "-", "-"]
    assert "Pending workloads (2)" in text


def test_the_snapshot_round_trips_as_json():
    status = fleet().snapshot(NOW, {"g": {"t": 3}})
    again = msgspec.json.decode(msgspec.json.encode(status), type=FleetStatus)
    assert again == status


def test_the_rich_view_shows_pools_findings_actions_breaker_and_lag():
    from rich.console import Console

    from gpusteward.cli.status import render

    fold = fleet()
    fold.finding(finding("a", "xid", "firing", Subject(node="n1", device="GPU-1"),
                         severity="critical"))
    fold.action(action("k1"))
    fold.result(result(f"{BREAKER_TRIP_PREFIX}1", "refused", ts=500))
    console = Console(record=True, width=200)
    console.print(render(fold.snapshot(NOW, {"gpusteward-worker": {"samples": 42}})))
    text = console.export_text()
    for expected in ("H100", "n1/GPU-1", "xid", "pending", "breaker: OPEN", "42", "vision"):
        assert expected in text, expected


def test_the_lag_lists_every_sink_group_under_the_topic_prefix():
    """The sinks' groups are named after the topic prefix (reports/sink.py); the status once
    asked for fixed gpusteward-...-sink names and left the results sink out."""
    from gpusteward.cli.status import consumer_groups

    groups = consumer_groups(Settings(topic_prefix="acme"))
    assert {group: [spec.suffix for spec in specs] for group, specs in groups.items()
            if group.endswith("-sink")} == {
        "acme-rollup-sink": ["rollups.v1"], "acme-queue-sink": ["queue.v1"],
        "acme-findings-sink": ["findings.v1"], "acme-results-sink": ["action-results.v1"]}
    assert all(group.startswith("acme-") for group in groups)
