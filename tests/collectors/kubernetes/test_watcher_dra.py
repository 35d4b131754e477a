"""GPUs a pod holds through Dynamic Resource Allocation, as the API server states them.

Each test writes what NVIDIA's DRA driver (its ResourceSlices), the
resourceclaim controller (a claim per template, named in the pod's status)
and the scheduler (the claim's allocation and reservation, then the binding)
leave in the API-server double, lets the real watcher read them through the
``kubernetes`` client, and checks the events it publishes: the pod's GPUs and
MIG devices by uuid, which is how the worker's join matches the GPUs'
samples with their holder, and what the node join then offers as free.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gpusteward.collectors.kubernetes import dra
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import (
    allocate,
    bind,
    claim_pod,
    dra_gpu,
    dra_mig,
    gpu_node,
    gpu_pod,
    resource_claim,
    resource_claim_template,
    resource_slice,
    start,
    workload,
)
from gpusteward.schema import (
    DeviceHolder,
    DeviceSample,
    Finding,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
    QueueEvent,
)
from gpusteward.streams.node import NodeJoin, NodeState

from .conftest import RunningWatcher, WatcherFactory, wait_until

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
UUIDS = [f"GPU-7f3c2a1e-0000-4000-8000-00000000000{i}" for i in range(4)]
MIG_UUIDS = ["MIG-5a1b2c3d-0000-4000-8000-000000000001",
             "MIG-5a1b2c3d-0000-4000-8000-000000000002"]
NIC_DRIVER = "sriovnetwork.k8snetworkplumbingwg.io"


def dra_node(name: str, gpus: int, product: str = "NVIDIA-H100-80GB-HBM3") -> dict[str, Any]:
    """A node whose GPUs the DRA driver hands out: GPU feature discovery labels it, and no
    device plugin advertises ``nvidia.com/gpu``."""
    return gpu_node(name, gpus, labels={"nvidia.com/gpu.product": product}, resources={})


def h100_slice(node: str = "n1") -> dict[str, Any]:
    return resource_slice(node, [dra_gpu(i, UUIDS[i], H100) for i in range(4)])


def a100_mig_slice(node: str = "m1") -> dict[str, Any]:
    """One A100 in the 3g.40gb pair layout: two MIG devices (GI profile 9)."""
    return resource_slice(node, [dra_mig(0, "GPU-a100-parent", MIG_UUIDS[0], "3g.40gb", 9, 0, 4,
                                         A100),
                                 dra_mig(0, "GPU-a100-parent", MIG_UUIDS[1], "3g.40gb", 9, 4, 4,
                                         A100)])


def running_pod(name: str, node: str, claims: dict[str, str], *, uid: str,
                from_template: bool = True, owner: tuple[str, str] = ("Job", "train")
                ) -> dict[str, Any]:
    pod = gpu_pod(name, node=node, phase="Running", uid=uid, owner=owner)
    start(pod)
    return claim_pod(pod, claims, from_template)


def allocated(name: str, pod: dict[str, Any], node: str, devices: list[str], *,
              driver: str = "gpu.nvidia.com", pods: list[dict[str, Any]] | None = None,
              admin_access: bool = False) -> dict[str, Any]:
    claim = resource_claim(name, pod["metadata"]["namespace"], owner=pod,
                           count=len(devices))
    allocate(claim, node, devices, pods or [pod], driver=driver, admin_access=admin_access)
    return claim


def summary(watcher: RunningWatcher, node: str) -> NodeSummary:
    """The worker's node join's last summary of ``node`` after the watcher's events."""
    join, state = NodeJoin(), NodeState()
    summaries: list[NodeSummary] = []
    for event in watcher.events:
        if isinstance(event, (PodAllocation, NodeInventory)) and event.node == node:
            summaries += [o for o in join.on_allocation(state, event)
                          if isinstance(o, NodeSummary)]
    return summaries[-1]


def holdings(events: list[Any]) -> dict[str, tuple[str, int, dict[str, int], list[str]]]:
    """Pod name -> (phase, GPUs, MIG devices, device ids) of its last allocation event."""
    return {e.pod.name: (e.phase, e.gpus, dict(e.mig), list(e.device_ids)) for e in events
            if isinstance(e, PodAllocation)}


def waits(events: list[Any]) -> list[tuple[str, str, int, dict[str, int]]]:
    """(name, state, GPUs, MIG devices) of the pods' queue events."""
    return [(e.name, e.state, e.gpus, dict(e.mig)) for e in events
            if isinstance(e, QueueEvent) and e.kind == "pod"]


def unresolved(watcher: RunningWatcher, namespace: str = "team-a") -> float:
    return watcher.watcher.metrics.registry.get_sample_value(
        "gpusteward_watch_dra_pods_total", {"namespace": namespace}) or 0.0


def test_gpus_and_mig_devices_held_through_claims_are_reported_by_uuid(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A training pod with two whole GPUs (and a NIC of another driver) and an inference
    pod with a MIG device, all through claims made from templates: each is reported
    holding them, by the uuids the slices publish. No device plugin advertises the nodes'
    GPUs: their slices do, so the nodes offer what those publish, less what is held."""
    kube_api.create(dra_node("n1", gpus=4))
    kube_api.create(dra_node("m1", gpus=1, product="NVIDIA-A100-SXM4-80GB"))
    kube_api.create(h100_slice())
    kube_api.create(a100_mig_slice())
    kube_api.create(resource_slice("n1", [{"name": "eth1", "attributes": {
        "type": {"string": "vf"}}}], driver=NIC_DRIVER))
    train = running_pod("train-0", "n1", {"gpu": "train-0-gpu-7x2kq",
                                          "nic": "train-0-nic-p9w4d"}, uid="u-train")
    infer = running_pod("infer", "m1", {"gpu": "infer-gpu-m4q8z"}, uid="u-infer",
                        owner=("ReplicaSet", "infer-5d8f9c"))
    kube_api.create(allocated("train-0-gpu-7x2kq", train, "n1", ["gpu-0", "gpu-1"]))
    kube_api.create(allocated("train-0-nic-p9w4d", train, "n1", ["eth1"], driver=NIC_DRIVER))
    kube_api.create(allocated("infer-gpu-m4q8z", infer, "m1", ["gpu-0-mig-9-4-4"]))
    kube_api.create(train)
    kube_api.create(infer)

    watcher = start_watcher()
    assert holdings(watcher.events) == {
        "train-0": ("running", 2, {}, UUIDS[:2]),
        "infer": ("running", 0, {"3g.40gb": 1}, [MIG_UUIDS[1]]),
    }
    # Slices are listed before nodes: each node's first inventory counts their devices.
    assert [(e.node, e.gpu_count, e.capacity) for e in watcher.events
            if isinstance(e, NodeInventory)] == [
        ("m1", 0, {"nvidia.com/gpu": 0, "nvidia.com/mig-3g.40gb": 2}),
        ("n1", 4, {"nvidia.com/gpu": 4})]
    n1, m1 = summary(watcher, "n1"), summary(watcher, "m1")
    assert (n1.gpus_total, n1.gpus_free) == (4, 2)
    # GFD labels m1 with one GPU; it is partitioned: no whole GPU is free, one 3g.40gb is.
    assert (m1.gpus_free, m1.mig_free) == (0, {"3g.40gb": 1})
    assert unresolved(watcher) == 0


def test_a_node_moved_from_the_device_plugin_to_dra_offers_its_slices_devices(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A node whose device plugin was removed for the DRA driver may still state
    ``nvidia.com/gpu: 0``: what its slices publish is what it has."""
    kube_api.create(gpu_node("n1", 4, resources={"nvidia.com/gpu": "0"}))
    kube_api.create(h100_slice())
    watcher = start_watcher()
    (inventory,) = [e for e in watcher.events if isinstance(e, NodeInventory)]
    assert (inventory.gpu_count, inventory.allocatable) == (4, {"nvidia.com/gpu": 4})
    assert summary(watcher, "n1").gpus_free == 4


def test_a_claim_allocated_after_its_pod_was_seen_bound_completes_the_pod(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """The claims' and the pods' watches are separate streams: a pod may be read bound
    before its claim's allocation. It is reported once the claim says what it holds; its
    end keeps the devices it held, whatever the claim says after (the controller releases
    a claim once its pod is done), and its deletion is reported."""
    kube_api.create(dra_node("n1", gpus=4))
    kube_api.create(h100_slice())
    watcher = start_watcher()

    pod = claim_pod(gpu_pod("nb", uid="u-nb", owner=("StatefulSet", "nb")),
                    {"gpu": "nb-gpu-q2r8t"})
    claim = resource_claim("nb-gpu-q2r8t", "team-a", owner=pod)
    mark = len(watcher.events)
    kube_api.create(claim)
    kube_api.create(pod)
    assert waits(watcher.new_events(mark)) == [("nb", "pending", 1, {})]

    mark = len(watcher.events)
    kube_api.mutate("Pod", "nb", lambda p: bind(p, "n1"), "team-a")
    # Bound: no longer waiting, but what it holds is not known yet.
    assert [(type(e).__name__, getattr(e, "state", None)) for e in watcher.new_events(mark)
            ] == [("QueueEvent", "admitted")]
    mark = len(watcher.events)
    kube_api.mutate("ResourceClaim", "nb-gpu-q2r8t",
                    lambda c: allocate(c, "n1", ["gpu-3"], [pod]), "team-a",
                    "resource.k8s.io")
    assert holdings(watcher.new_events(mark)) == {"nb": ("bound", 1, {}, [UUIDS[3]])}

    mark = len(watcher.events)
    kube_api.mutate("Pod", "nb", lambda p: start(p), "team-a")
    kube_api.mutate("Pod", "nb", lambda p: p["status"].update(phase="Succeeded"), "team-a")
    kube_api.mutate("ResourceClaim", "nb-gpu-q2r8t", lambda c: c.update(status={}), "team-a",
                    "resource.k8s.io")
    kube_api.delete("ResourceClaim", "nb-gpu-q2r8t", "team-a", "resource.k8s.io")
    kube_api.delete("Pod", "nb", "team-a")
    assert [(e.phase, e.gpus, list(e.device_ids)) for e in watcher.new_events(mark)
            if isinstance(e, PodAllocation)] == [
        ("running", 1, [UUIDS[3]]), ("finished", 1, [UUIDS[3]]),
        ("deleted", 1, [UUIDS[3]])]
    assert unresolved(watcher) == 0


def test_a_slice_published_late_completes_the_pods_waiting_for_it(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A device the claim names but no slice publishes (yet: a driver restarting) cannot
    be told apart, GPU or MIG, nor matched with its samples: the pod is said unresolved,
    once, and reported as soon as the slice is (re)published."""
    kube_api.create(dra_node("n1", gpus=4))
    pod = running_pod("train-0", "n1", {"gpu": "train-0-gpu-7x2kq"}, uid="u-train")
    kube_api.create(allocated("train-0-gpu-7x2kq", pod, "n1", ["gpu-2"]))
    kube_api.create(pod)
    watcher = start_watcher()
    assert holdings(watcher.events) == {}
    assert unresolved(watcher) == 1

    assert summary(watcher, "n1").gpus_free == 4  # GFD's count, nothing known held

    mark = len(watcher.events)
    kube_api.create(h100_slice())
    new = watcher.new_events(mark)
    assert holdings(new) == {"train-0": ("running", 1, {}, [UUIDS[2]])}
    assert [e.capacity for e in new if isinstance(e, NodeInventory)] == [
        {"nvidia.com/gpu": 4}]
    assert summary(watcher, "n1").gpus_free == 3
    assert unresolved(watcher) == 1


def test_a_shared_claim_counts_its_gpu_once_and_reports_every_pod(
        kube_api: KubeApiServer, start_watcher: WatcherFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    """A claim shared by two pods counts its GPU once, with the first pod it is reserved
    for; the other holds a share of it (no GPU of its own), so the worker knows its owner
    when the node names it among the GPU's holders; an admin-access claim (a monitoring
    agent's) holds nothing and is no fault; another driver's devices are not GPUs and no
    fault either."""
    caplog.set_level(logging.WARNING, "gpusteward.collectors.kubernetes.watcher")
    kube_api.create(dra_node("n1", gpus=4))
    kube_api.create(h100_slice())
    first = running_pod("ray-head", "n1", {"gpu": "shared-gpu"}, uid="u-head",
                        from_template=False)
    second = running_pod("ray-worker", "n1", {"gpu": "shared-gpu"}, uid="u-worker",
                         from_template=False)
    shared = resource_claim("shared-gpu", "team-a")
    allocate(shared, "n1", ["gpu-0"], [first, second])
    monitor = running_pod("dcgm-probe", "n1", {"gpu": "dcgm-probe-gpu-z8v1c"}, uid="u-mon",
                          owner=("DaemonSet", "dcgm-probe"))
    for obj in (shared, allocated("dcgm-probe-gpu-z8v1c", monitor, "n1", ["gpu-1"],
                                  admin_access=True), first, second, monitor):
        kube_api.create(obj)

    watcher = start_watcher()
    assert holdings(watcher.events) == {"ray-head": ("running", 1, {}, [UUIDS[0]]),
                                        "ray-worker": ("running", 0, {}, [])}
    worker = next(e for e in watcher.events
                  if isinstance(e, PodAllocation) and e.pod.name == "ray-worker")
    assert (worker.owner_kind, worker.owner_name) == ("Job", "train")
    assert summary(watcher, "n1").gpus_free == 3
    mark = len(watcher.events)
    kube_api.mutate("Pod", "ray-worker", lambda p: p["status"].update(podIP="10.0.0.9"),
                    "team-a")
    assert watcher.new_events(mark) == []
    assert unresolved(watcher) == 0
    assert not [r for r in caplog.records if "Dynamic Resource" in r.getMessage()]


def _request(**exactly: Any) -> dict[str, Any]:
    return {"name": "r", "exactly": {"deviceClassName": "gpu.nvidia.com", **exactly}}


@pytest.mark.parametrize(("requests", "asked"), [
    ([_request()], {"nvidia.com/gpu": 1}),                          # count defaults to 1
    ([_request(count=2), _request(count=1)], {"nvidia.com/gpu": 3}),
    ([_request(allocationMode="All")], {"nvidia.com/gpu": 1}),      # every one: at least one
    ([_request(deviceClassName="mig.nvidia.com", count=2, selectors=[{"cel": {
        "expression": 'device.attributes["gpu.nvidia.com"].profile == "1g.10gb+me"'}}])],
     {"nvidia.com/mig-1g.10gb.me": 2}),
    ([_request(deviceClassName="mig.nvidia.com")], {}),              # no profile named
    ([{"name": "r", "firstAvailable": [                              # the first choice
        {"name": "big", "deviceClassName": "gpu.nvidia.com", "count": 2},
        {"name": "small", "deviceClassName": "gpu.nvidia.com", "count": 1}]}],
     {"nvidia.com/gpu": 2}),
    ([_request(adminAccess=True)], {}),                               # monitoring, no ask
    ([_request(deviceClassName="sriov.example.com")], {}),
])
def test_what_a_claims_device_requests_ask_for(requests: list[dict[str, Any]],
                                               asked: dict[str, int]) -> None:
    assert dra.requested({"requests": requests}) == asked


def test_pods_waiting_for_dra_gpus_are_queued_with_what_their_claims_ask(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A pod waiting for GPUs through claims waits like one asking ``nvidia.com/gpu``: it is
    on the queue topic with what its claims' requests ask (two GPUs; one 3g.40gb MIG device
    chosen by its profile selector), read from the claim made for it or, before the
    resourceclaim controller made it, from its template; another driver's request (a NIC)
    asks for no GPU. Once bound and allocated it is admitted and holds its devices."""
    kube_api.create(dra_node("n1", gpus=4))
    kube_api.create(h100_slice())
    kube_api.create(resource_claim_template("train-gpus", "team-a", count=2))
    kube_api.create(resource_claim_template("mig-slice", "team-a",
                                            device_class="mig.nvidia.com",
                                            profile="3g.40gb"))
    kube_api.create(resource_claim_template("nic", "team-a",
                                            device_class="sriov.nvidia.com"))
    train = claim_pod(gpu_pod("train-0", uid="u-train", resources={}),
                      {"gpu": "train-0-gpu-7x2kq", "nic": "train-0-nic-p9w4d"},
                      templates={"gpu": "train-gpus", "nic": "nic"})
    kube_api.create(resource_claim("train-0-gpu-7x2kq", "team-a", owner=train, count=2))
    kube_api.create(train)
    # The controller has not made its claim yet: its template says what it asks.
    infer = claim_pod(gpu_pod("infer", uid="u-infer", resources={},
                              owner=("ReplicaSet", "infer-5d8f9c")),
                      {"gpu": None}, templates={"gpu": "mig-slice"})
    kube_api.create(infer)
    watcher = start_watcher()
    assert waits(watcher.events) == [("infer", "pending", 0, {"3g.40gb": 1}),
                                     ("train-0", "pending", 2, {})]

    mark = len(watcher.events)
    kube_api.mutate("ResourceClaim", "train-0-gpu-7x2kq",
                    lambda c: allocate(c, "n1", ["gpu-0", "gpu-1"], [train]), "team-a",
                    "resource.k8s.io")
    kube_api.mutate("Pod", "train-0", lambda p: bind(p, "n1"), "team-a")
    new = watcher.new_events(mark)
    assert waits(new) == [("train-0", "admitted", 2, {})]
    assert holdings(new) == {"train-0": ("bound", 2, {}, UUIDS[:2])}


def test_a_pod_seen_before_its_claim_template_is_queued_once_the_template_comes(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """Templates and pods are watched apart: a pod read before the template it names is
    queued as soon as the template is read."""
    kube_api.create(dra_node("n1", gpus=4))
    kube_api.create(h100_slice())
    watcher = start_watcher()
    mark = len(watcher.events)
    kube_api.create(claim_pod(gpu_pod("train-0", uid="u-train", resources={}),
                              {"gpu": None}, templates={"gpu": "train-gpus"}))
    assert watcher.new_events(mark) == []
    kube_api.create(resource_claim_template("train-gpus", "team-a", count=2))
    assert waits(watcher.new_events(mark)) == [("train-0", "pending", 2, {})]


def test_a_shared_claim_is_idle_for_all_its_pods_or_for_none(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """The worker's node join, fed the watcher's events for two pods sharing one claim and
    the samples the NVML collector publishes for such a GPU (``shared``, each pod's own
    activity in ``holders``): the idle pod is not idle while its neighbour keeps the GPU
    busy (the claim would stay allocated were it reclaimed); once both are idle, both are
    found, each with its owner (which decides what a reclaim does)."""
    kube_api.create(dra_node("n1", gpus=4))
    kube_api.create(h100_slice())
    head = running_pod("ray-head", "n1", {"gpu": "shared-gpu"}, uid="u-head",
                       from_template=False, owner=("ReplicaSet", "ray-5d8f9c"))
    worker = running_pod("ray-worker", "n1", {"gpu": "shared-gpu"}, uid="u-worker",
                         from_template=False)
    shared = resource_claim("shared-gpu", "team-a")
    allocate(shared, "n1", ["gpu-0"], [head, worker])
    for obj in (shared, head, worker):
        kube_api.create(obj)
    watcher = start_watcher()
    join, state = NodeJoin(), NodeState()
    for event in watcher.events:
        if isinstance(event, (PodAllocation, NodeInventory)):
            join.on_allocation(state, event)
    started = max(e.started_at or 0.0 for e in watcher.events if isinstance(e, PodAllocation))

    def idle_found(since: float, until: float, worker_activity: float) -> dict[str, str]:
        found: dict[str, str] = {}
        for ts in range(int(since), int(until), 60):
            sample = NodeSample(ts=float(ts), node="n1", source="nvml", devices=[DeviceSample(
                uuid=UUIDS[0], index=0, model=H100, util_pct=worker_activity,
                mem_used_bytes=30 << 30, mem_total_bytes=80 << 30, attribution="shared",
                pod=PodRef("team-a", "ray-head"), holders=[
                    DeviceHolder(pod=PodRef("team-a", "ray-head"), activity_pct=0.0),
                    DeviceHolder(pod=PodRef("team-a", "ray-worker"),
                                 activity_pct=worker_activity)])])
            for out in join.on_sample(state, sample):
                if isinstance(out, Finding) and out.kind == "idle_holder" and \
                        out.state == "firing" and out.subject.pod is not None:
                    found[out.subject.pod.name] = out.labels.get("owner", "")
        return found

    assert idle_found(started, started + 3 * 3600, 90.0) == {}
    assert idle_found(started + 3 * 3600, started + 5 * 3600, 0.0) == {
        "ray-head": "ReplicaSet/ray-5d8f9c", "ray-worker": "Job/train"}


def test_a_kueue_workload_of_dra_pods_asks_what_its_template_claims_ask(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A Kueue Workload whose pod template asks for GPUs through a claim template waits
    for them like one asking ``nvidia.com/gpu``: per pod set and in all."""
    kube_api.create(resource_claim_template("train-gpus", "team-a", count=2))
    pending = workload("wl", gpus=0, count=3)
    (pod_set,) = pending["spec"]["podSets"]
    pod_set["template"]["spec"]["resourceClaims"] = [
        {"name": "gpu", "resourceClaimTemplateName": "train-gpus"}]
    kube_api.create(pending)
    watcher = start_watcher()
    (event,) = [e for e in watcher.events if isinstance(e, QueueEvent)]
    assert (event.kind, event.state, event.gpus) == ("workload", "pending", 6)
    assert [(s.count, s.gpus) for s in event.pod_sets] == [(3, 2)]


def test_a_cluster_without_dra_v1_is_watched_without_it_until_it_is_served(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Before Kubernetes 1.34 resource.k8s.io/v1 is not served: the watcher says so in one
    line, keeps running (no crash loop), reports the device-plugin pods as before and says
    each DRA pod unresolved; once the cluster serves it (an upgrade), the next resync
    watches claims and completes the pods, without a restart."""
    caplog.set_level(logging.INFO, "gpusteward.collectors.kubernetes.watcher")
    dra = {"resourceclaims.resource.k8s.io", "resourceclaimtemplates.resource.k8s.io",
           "resourceslices.resource.k8s.io"}
    with KubeApiServer(bookmark_interval_s=0.05, absent=dra) as api:
        from gpusteward.collectors.kubernetes import KubeWatchSettings

        api.create(dra_node("n1", gpus=4))
        api.create(gpu_pod("plugin-pod", node="n1", phase="Running", uid="u-plugin"))
        pod = running_pod("train-0", "n1", {"gpu": "train-0-gpu-7x2kq"}, uid="u-train")
        api.create(pod)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        watcher = RunningWatcher(api, kubeconfig, KubeWatchSettings(
            kubeconfig=str(kubeconfig), resync_period_s=0.5, backoff_initial_s=0.05)).start()
        try:
            assert holdings(watcher.events) == {"plugin-pod": ("running", 1, {}, [])}
            assert "resourceclaims" not in watcher.watcher.reflectors
            assert unresolved(watcher) == 1
            lines = [r.getMessage() for r in caplog.records if "resource.k8s.io" in
                     r.getMessage()]
            assert lines[0] == ("resource.k8s.io/v1 is not served (Kubernetes before 1.34): "
                                "watching without ResourceClaims, so GPUs pods get through "
                                "DRA are not reported")

            api.absent = frozenset()
            api.create(h100_slice())
            api.create(allocated("train-0-gpu-7x2kq", pod, "n1", ["gpu-1"]))
            wait_until(lambda: "resourceclaims" in watcher.watcher.reflectors, 10,
                       "the next resync")
            watcher.settle()
            assert holdings(watcher.events)["train-0"] == ("running", 1, {}, [UUIDS[1]])
            assert sum(r.getMessage() == lines[0] for r in caplog.records) == 1  # said once
        finally:
            watcher.stop()
