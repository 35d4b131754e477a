"""Kueue Workload objects, as the API serves them, through the watcher's translation into the
fleet agent: the waits its queue SLO and stranded-capacity rules judge."""

from __future__ import annotations

from gpusteward.collectors.kubernetes.reflector import Delta, Obj
from gpusteward.collectors.kubernetes.translate import Translator, parse_time
from gpusteward.sandbox.kube_objects import gpu_pod, rfc3339, set_condition, workload
from gpusteward.schema import Finding, NodeSummary
from gpusteward.streams.fleet import FleetEvaluator, FleetOutput, FleetState

CREATED = parse_time("2026-11-20T10:00:00Z") or 0.0
SLO = 600.0
"""The shipped SLO of a ``prod`` queue."""


class Fleet:
    """A watcher's translator feeding a fleet agent, its clock moved by node summaries."""

    def __init__(self, nodes: int = 4, free: int = 8) -> None:
        self.translator, self.evaluator, self.state = Translator(), FleetEvaluator(), FleetState()
        self.nodes, self.free = nodes, free
        self.out: list[FleetOutput] = []

    def see(self, obj: Obj, ts: float, resource: str = "workloads") -> None:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        for event in self.translator.apply(Delta(resource, "MODIFIED", key, obj), ts):
            self.out += self.evaluator.on_queue(self.state, event)  # type: ignore[arg-type]

    def run_until(self, ts: float, step: float = 30.0) -> None:
        t = self.state.clock or CREATED
        while t <= ts:
            for i in range(self.nodes):
                self.out += self.evaluator.on_summary(self.state, NodeSummary(
                    ts=t, node=f"gpu-{i}", gpu_model="A100", gpus_total=8,
                    gpus_free=self.free))
            t += step

    def findings(self, kind: str) -> list[Finding]:
        return [o for o in self.out if isinstance(o, Finding) and o.kind == kind]


def admit(obj: Obj, at: float) -> None:
    obj["status"]["admission"] = {"clusterQueue": "prod",
                                  "podSetAssignments": [{"name": "main", "count": 1}]}
    set_condition(obj, "QuotaReserved", "True", "QuotaReserved", rfc3339(at))
    set_condition(obj, "Admitted", "True", "Admitted", rfc3339(at))
    set_condition(obj, "Evicted", "False", "QuotaReserved", rfc3339(at))


def evict(obj: Obj, at: float, reason: str) -> None:
    obj["status"].pop("admission", None)
    set_condition(obj, "QuotaReserved", "False", "Pending", rfc3339(at))
    set_condition(obj, "Admitted", "False", "NoReservation", rfc3339(at))
    set_condition(obj, "Evicted", "True", reason, rfc3339(at))
    set_condition(obj, "Requeued", "False", reason, rfc3339(at))


def test_a_deactivated_workload_is_not_waiting_and_raises_no_slo_breach() -> None:
    # kueuectl stop: spec.active false; Kueue evicts it (reason Deactivated) and will not
    # admit it until it is resumed. However long it stays stopped, nobody is kept waiting.
    fleet = Fleet()
    job = workload("train", queue="prod")
    fleet.see(job, CREATED)
    admit(job, CREATED + 60)
    fleet.see(job, CREATED + 60)
    job["spec"]["active"] = False
    evict(job, CREATED + 120, "Deactivated")
    fleet.see(job, CREATED + 120)
    fleet.run_until(CREATED + 4 * 3600)
    assert fleet.findings("queue_wait_slo") == []
    assert "team-a/train" not in fleet.state.queue.waiting
    assert "team-a/train" not in fleet.state.tracks["eta"].pending  # no start estimate
    # Resumed: it waits again, from then, and a breach follows once that wait passes the SLO.
    job["spec"]["active"] = True
    set_condition(job, "Requeued", "True", "Reactivated", rfc3339(CREATED + 4 * 3600))
    fleet.see(job, CREATED + 4 * 3600 + 5)
    fleet.run_until(CREATED + 4 * 3600 + SLO + 60)
    (breach,) = fleet.findings("queue_wait_slo")
    assert breach.state == "firing" and breach.starts_at >= CREATED + 4 * 3600


def test_deactivating_a_waiting_workload_closes_its_breach() -> None:
    fleet = Fleet()
    job = workload("stuck", queue="prod")
    fleet.see(job, CREATED)
    fleet.run_until(CREATED + SLO + 60)
    (firing,) = fleet.findings("queue_wait_slo")
    job["spec"]["active"] = False
    fleet.see(job, CREATED + SLO + 90)
    fleet.run_until(CREATED + 3 * 3600)
    firing_again, closed = fleet.findings("queue_wait_slo")
    assert firing_again == firing
    assert closed.state == "resolved" and closed.id == firing.id
    assert "deactivated" in closed.summary


def training_job(name: str, workers: int, gpus_each: int) -> Obj:
    """A Kueue Workload of a PyTorchJob: a GPU master and GPU workers, as two pod sets."""
    job = workload(name, queue="research", gpus=gpus_each)
    job["metadata"]["ownerReferences"] = [{"kind": "PyTorchJob", "name": name,
                                           "controller": True}]
    master = job["spec"]["podSets"][0]
    master["name"] = "master"
    job["spec"]["podSets"].append({**master, "name": "worker", "count": workers - 1})
    return job


def test_a_workload_of_several_pods_that_fit_a_node_each_is_not_stranded() -> None:
    # 4 pods of 2 GPUs (8 in all) and 4 nodes with 2 free each: each pod has a node, so
    # whatever keeps it waiting (quota), it is not the fleet's fragmentation.
    fleet = Fleet(nodes=4, free=2)
    job = training_job("ddp", workers=4, gpus_each=2)
    fleet.see(job, CREATED)
    (event,) = fleet.translator.workloads.values()
    assert event.gpus == 8 and [(p.count, p.gpus) for p in event.pod_sets] == [(1, 2), (3, 2)]
    fleet.run_until(CREATED + 3600)
    assert fleet.findings("stranded_capacity") == []


def test_a_workload_of_several_pods_no_nodes_can_hold_is_stranded() -> None:
    # 4 pods of 4 GPUs, 16 free in all but 3 on each node: no pod has a node.
    fleet = Fleet(nodes=6, free=3)
    fleet.see(training_job("ddp", workers=4, gpus_each=4), CREATED)
    fleet.run_until(CREATED + 3600)
    (stranded,) = fleet.findings("stranded_capacity")
    assert stranded.labels["shape"] == "4 pods of 4 GPUs"
    assert stranded.evidence and stranded.evidence.values["pods"] == 4


def test_pod_sets_without_gpus_are_left_out() -> None:
    job = training_job("mpi", workers=3, gpus_each=1)
    launcher = job["spec"]["podSets"][0]
    job["spec"]["podSets"][0] = {"name": "launcher", "count": 1, "template": {"spec": {
        "containers": [{"name": "l", "resources": {"requests": {"cpu": "1"}}}]}}}
    assert launcher["name"] == "master"
    event = Translator().workload_event(job, CREATED)
    assert event.gpus == 2 and [(p.count, p.gpus) for p in event.pod_sets] == [(2, 1)]


def test_after_a_restart_the_wait_of_a_requeued_workload_counts_from_its_requeue() -> None:
    # The watcher (re)lists a workload preempted at +0 and requeued at +60 (backoff over):
    # it has waited since +60 whenever the watcher first sees it, so at +1200 it is past
    # its 10 min SLO already.
    fleet = Fleet()
    job = workload("preempted", queue="prod")
    evict(job, CREATED, "Preempted")
    set_condition(job, "Preempted", "True", "InClusterQueue", rfc3339(CREATED))
    set_condition(job, "Requeued", "True", "BackoffFinished", rfc3339(CREATED + 60))
    fleet.see(job, CREATED + 1200)
    (event,) = fleet.translator.workloads.values()
    assert (event.state, event.waiting_since) == ("requeued", CREATED + 60)
    assert fleet.state.tracks["eta"].pending["team-a/preempted"].since == CREATED + 60
    fleet.run_until(CREATED + 1260)
    (breach,) = fleet.findings("queue_wait_slo")
    assert breach.starts_at == CREATED + 60 and breach.ts <= CREATED + 1230


def test_an_admission_seen_late_is_judged_at_the_admission() -> None:
    # Admitted at +300 (within the SLO); the watcher, restarted, reports it at +1500.
    fleet = Fleet()
    job = workload("late", queue="prod")
    fleet.see(job, CREATED)
    admit(job, CREATED + 300)
    fleet.see(job, CREATED + 1500)
    assert fleet.findings("queue_wait_slo") == []
    assert fleet.state.queue.queues["prod"].admissions == [(CREATED + 300, 300.0)]


def test_a_pod_held_at_kueues_gate_waits_once_as_its_workload() -> None:
    # Kueue's pod integration: the pod is created gated, its Workload waits in the queue.
    # One wait, one breach; and once admitted and let through, the pod's own wait for a
    # node starts then, not at its creation an hour ago.
    fleet = Fleet()
    pod = gpu_pod("infer", owner=None, labels={"kueue.x-k8s.io/queue-name": "prod"})
    pod["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    job = workload("pod-infer-1a2b3", queue="prod", gpus=1)
    job["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": "infer",
                                           "controller": True}]
    fleet.see(pod, CREATED, "pods")
    fleet.see(job, CREATED)
    assert list(fleet.state.queue.waiting) == ["team-a/pod-infer-1a2b3"]
    fleet.run_until(CREATED + 3600)
    (breach,) = fleet.findings("queue_wait_slo")
    assert breach.subject.pod and breach.subject.pod.name == "pod-infer-1a2b3"
    admit(job, CREATED + 3600)
    fleet.see(job, CREATED + 3600)
    del pod["spec"]["schedulingGates"]
    fleet.see(pod, CREATED + 3605, "pods")
    assert fleet.state.queue.waiting["team-a/infer"].pending_since == CREATED + 3605
    fleet.run_until(CREATED + 3900)
    assert [f.state for f in fleet.findings("queue_wait_slo")] == ["firing", "resolved"]
