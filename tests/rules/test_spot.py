"""Spot interruptions: termination taints -> one finding and requeue actions per pod."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpusteward.rules import spot
from gpusteward.schema import (
    Action,
    Finding,
    NodeInventory,
    PodAllocation,
    PodPhase,
    PodRef,
    Taint,
)

SETTINGS = spot.SpotSettings()
ITN = Taint("aws-node-termination-handler/spot-itn", "NoSchedule", "evt-1")


def inv(ts: float, *taints: Taint, spot_node: bool = True, deleted: bool = False
        ) -> NodeInventory:
    return NodeInventory(ts=ts, node="spot-1", gpu_count=8, spot=spot_node,
                         taints=list(taints), deleted=deleted)


def pod(name: str, ts: float, owner: str | None = "Job", phase: PodPhase = "running",
        annotations: dict[str, str] | None = None) -> PodAllocation:
    return PodAllocation(ts=ts, node="spot-1", pod=PodRef("ml", name, uid=f"uid-{name}"),
                         phase=phase, gpus=1, owner_kind=owner, owner_name=f"{name}-owner",
                         queue="batch", annotations=annotations or {})


def test_termination_taint_requeues_restartable_pods_only() -> None:
    track = spot.SpotNodeTrack()
    for event in (pod("train", 1), pod("nb", 2, owner="Notebook"),
                  pod("wl", 3, owner="Workload")):
        assert spot.on_pod(track, event, SETTINGS) == []
    out = spot.on_inventory(track, inv(10, ITN), SETTINGS)
    finding, *actions = out
    assert isinstance(finding, Finding)
    assert finding.kind == spot.KIND and finding.severity == "critical"
    assert finding.subject.node == "spot-1" and finding.runbook
    assert finding.labels["not_requeued"] == "ml/nb"
    assert finding.evidence and finding.evidence.values["restartable_pods"] == 2
    assert all(isinstance(a, Action) and a.verb == "requeue" for a in actions)
    names = sorted(a.target.pod.name for a in actions if isinstance(a, Action) and a.target.pod)
    assert names == ["train", "wl"]
    keys = {a.idempotency_key for a in actions if isinstance(a, Action)}
    assert len(keys) == 2 and all(k.startswith(finding.id) for k in keys)
    wl = next(a for a in actions if isinstance(a, Action) and a.target.pod
              and a.target.pod.name == "wl")
    assert (wl.params["workload"], wl.params["namespace"]) == ("wl-owner", "ml")
    assert wl.target.queue == "batch"


def test_operator_pods_without_a_kueue_workload_are_left_to_their_controller() -> None:
    """The backend deletes only a Job's pod or requeues a Kueue workload: a PyTorchJob's or a
    RayCluster's pod gets no requeue action, and the finding does not count it requeued."""
    track = spot.SpotNodeTrack()
    for event in (pod("worker-1", 1, owner="PyTorchJob"), pod("ray-w", 2, owner="RayCluster"),
                  pod("jax-0", 3, owner="JAXJob"), pod("job-0", 4)):
        spot.on_pod(track, event, SETTINGS)
    finding, *actions = spot.on_inventory(track, inv(10, ITN), SETTINGS)
    assert isinstance(finding, Finding)
    assert [a.target.pod.name for a in actions if isinstance(a, Action) and a.target.pod] == [
        "job-0"]
    assert (": 1 to requeue, 3 left to their controller to recreate (JAXJob ml/jax-0-owner, "
            "PyTorchJob ml/worker-1-owner, RayCluster ml/ray-w-owner), 0 need a decision"
            ) in finding.summary
    assert finding.labels["left_to_controller"] == "ml/jax-0,ml/ray-w,ml/worker-1"
    assert finding.labels["not_requeued"] == "ml/jax-0,ml/ray-w,ml/worker-1"
    assert finding.evidence and finding.evidence.values["requeued_pods"] == 1
    assert finding.evidence.values["left_to_controller_pods"] == 3
    assert "left_to_controller" in finding.runbook


def test_an_operator_pod_of_a_kueue_workload_is_requeued_through_it() -> None:
    track = spot.SpotNodeTrack()
    spot.on_pod(track, pod("worker-1", 1, owner="PyTorchJob",
                           annotations={"kueue.x-k8s.io/workload": "pytorchjob-x-1a2b3"}),
                SETTINGS)
    finding, action = spot.on_inventory(track, inv(10, ITN), SETTINGS)
    assert isinstance(action, Action) and action.verb == "requeue"
    assert isinstance(finding, Finding) and ": 1 to requeue, 0 left" in finding.summary


def test_kubeflow_trainer_and_training_operator_kinds_are_restartable() -> None:
    for owner in ("JAXJob", "XGBoostJob", "PaddleJob", "TrainJob"):
        assert owner in SETTINGS.restartable_owners
    track = spot.SpotNodeTrack()
    spot.on_pod(track, pod("trainer-0", 1, owner="TrainJob"), SETTINGS)
    _, action = spot.on_inventory(track, inv(10, ITN), SETTINGS)
    assert isinstance(action, Action) and action.verb == "requeue"


def test_repeated_inventory_does_not_repeat_and_removal_resolves() -> None:
    track = spot.SpotNodeTrack()
    spot.on_pod(track, pod("train", 1), SETTINGS)
    first = spot.on_inventory(track, inv(10, ITN), SETTINGS)
    assert spot.on_inventory(track, inv(20, ITN), SETTINGS) == []
    assert spot.on_inventory(track, inv(10, ITN), SETTINGS) == []  # duplicate
    (closed,) = spot.on_inventory(track, inv(30), SETTINGS)
    assert isinstance(closed, Finding) and closed.state == "resolved"
    assert closed.id == first[0].id  # type: ignore[union-attr]
    # A stale tainted inventory arriving late does not reopen.
    assert spot.on_inventory(track, inv(25, ITN), SETTINGS) == []


def test_pod_arriving_during_the_episode_is_requeued() -> None:
    track = spot.SpotNodeTrack()
    spot.on_inventory(track, inv(10, ITN), SETTINGS)
    (action,) = spot.on_pod(track, pod("late", 20), SETTINGS)
    assert isinstance(action, Action) and action.target.pod
    assert action.target.pod.name == "late"
    assert spot.on_pod(track, pod("late", 21), SETTINGS) == []


def test_placement_taints_and_on_demand_nodes_are_left_alone() -> None:
    aks = Taint("kubernetes.azure.com/scalesetpriority", "NoSchedule", "spot")
    track = spot.SpotNodeTrack()
    spot.on_pod(track, pod("train", 1), SETTINGS)
    assert spot.on_inventory(track, inv(10, aks), SETTINGS) == []
    # Karpenter consolidating an on-demand node: not an interruption.
    disrupted = Taint("karpenter.sh/disrupted", "NoSchedule")
    assert spot.on_inventory(track, inv(20, disrupted, spot_node=False), SETTINGS) == []
    anywhere = spot.SpotSettings(spot_only=False)
    assert spot.on_inventory(spot.SpotNodeTrack(), inv(20, disrupted, spot_node=False),
                             anywhere)


def test_a_spot_interruption_notice_marks_the_node_spot_without_a_label() -> None:
    # aws-node-termination-handler on a self-managed node group: the nodes carry no
    # capacity-type label, and spot-itn is only ever set on a spot interruption notice.
    track = spot.SpotNodeTrack()
    spot.on_pod(track, pod("train", 1), SETTINGS)
    finding, action = spot.on_inventory(track, inv(20, ITN, spot_node=False), SETTINGS)
    assert isinstance(finding, Finding) and finding.kind == spot.KIND
    assert isinstance(action, Action) and action.verb == "requeue"


@given(st.lists(st.tuples(st.integers(0, 20), st.booleans(), st.booleans()), max_size=40))
def test_episodes_open_and_close_in_step_with_the_taint(
    steps: list[tuple[int, bool, bool]]
) -> None:
    """Whatever the order and duplicates: one firing per episode, resolves only an open one,
    and each pod is requeued at most once per episode."""
    track = spot.SpotNodeTrack()
    spot.on_pod(track, pod("train", 0), SETTINGS)
    open_id: str | None = None
    requeued: set[str] = set()
    for ts, tainted, is_pod in steps:
        if is_pod:
            out = spot.on_pod(track, pod(f"p{ts % 3}", ts + 0.5), SETTINGS)
        else:
            out = spot.on_inventory(track, inv(ts, *([ITN] if tainted else [])), SETTINGS)
        for item in out:
            if isinstance(item, Finding) and item.state == "firing":
                assert open_id is None
                open_id, requeued = item.id, set()
            elif isinstance(item, Finding):
                assert item.id == open_id
                open_id = None
            else:
                assert open_id is not None and item.finding_ids == [open_id]
                assert item.idempotency_key not in requeued
                requeued.add(item.idempotency_key)


def test_pod_finished_in_the_same_second_it_started_is_gone() -> None:
    track = spot.SpotNodeTrack()
    spot.on_pod(track, pod("quick", 5, phase="finished"), SETTINGS)
    spot.on_pod(track, pod("quick", 5), SETTINGS)  # the earlier running event, late
    assert spot.on_inventory(track, inv(10, ITN), SETTINGS)[1:] == []
