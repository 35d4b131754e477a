"""The watcher lists and watches what states a gang's size, through the real client.

PodGroups (coscheduling and Volcano), JobSets, PyTorchJobs and MPIJobs are CRDs a
cluster may not have: each is watched where served, skipped with one log line where
not, and picked up at a resync once its CRD appears.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gpusteward.collectors.kubernetes import KubeWatchSettings
from gpusteward.collectors.kubernetes.watcher import GANG_SOURCES
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_pod
from gpusteward.schema import QueueEvent

from .conftest import RunningWatcher, WatcherFactory, wait_until

ALL_GANG_RESOURCES = {f"{plural}.{group}" for plural, group, _ in GANG_SOURCES}
GPU_TEMPLATE = {"spec": {"containers": [{"name": "main", "resources": {
    "limits": {"nvidia.com/gpu": "8"}}}]}}
CPU_TEMPLATE = {"spec": {"containers": [{"name": "launcher"}]}}


def pod_group(name: str, group: str, min_member: int) -> dict[str, Any]:
    version = "v1alpha1" if group == "scheduling.x-k8s.io" else "v1beta1"
    return {"apiVersion": f"{group}/{version}", "kind": "PodGroup",
            "metadata": {"name": name, "namespace": "ml"}, "spec": {"minMember": min_member}}


def pytorch_job(name: str, workers: int) -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "template": GPU_TEMPLATE},
                "Worker": {"replicas": workers, "template": GPU_TEMPLATE}}}}


def mpi_job(name: str, workers: int) -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": CPU_TEMPLATE},
                "Worker": {"replicas": workers, "template": GPU_TEMPLATE}}}}


def job_set(name: str, replicas: int) -> dict[str, Any]:
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"replicatedJobs": [{"name": "workers", "replicas": replicas, "template": {
                "spec": {"parallelism": 2, "template": GPU_TEMPLATE}}}]}}


def test_every_gang_source_is_watched_and_sizes_reach_the_members(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(pod_group("cosched", "scheduling.x-k8s.io", 4))
    kube_api.create(pytorch_job("llm", 7))
    kube_api.create(gpu_pod("cosched-0", "ml", labels={"scheduling.x-k8s.io/pod-group":
                                                       "cosched"}, owner=None))
    kube_api.create(gpu_pod("llm-worker-0", "ml", owner=("PyTorchJob", "llm")))
    watcher = start_watcher()
    assert set(watcher.watcher.reflectors) >= ALL_GANG_RESOURCES
    assert watcher.watcher.gang_versions == {
        "podgroups.scheduling.x-k8s.io": "v1alpha1", "podgroups.scheduling.volcano.sh":
        "v1beta1", "jobsets.jobset.x-k8s.io": "v1alpha2", "pytorchjobs.kubeflow.org": "v1",
        "mpijobs.kubeflow.org": "v2beta1", "tfjobs.kubeflow.org": "v1"}
    sizes = {e.name: e.gang_size for e in watcher.events if isinstance(e, QueueEvent)}
    # Members listed before or after their gang object: both end with its size.
    assert sizes == {"cosched-0": 4, "llm-worker-0": 8}

    # Created while watched: the size reaches the member already reported.
    seen = len(watcher.events)
    volcano_member = gpu_pod("vc-0", "ml", owner=None)
    volcano_member["metadata"]["annotations"] = {"scheduling.k8s.io/group-name": "vc"}
    kube_api.create(volcano_member)
    kube_api.create(pod_group("vc", "scheduling.volcano.sh", 3))
    kube_api.create(gpu_pod("hpc-worker-0", "ml", owner=("MPIJob", "hpc")))
    kube_api.create(mpi_job("hpc", 2))
    kube_api.create(job_set("pre", 4))
    kube_api.create(gpu_pod("pre-workers-0-0", "ml", owner=("Job", "pre-workers-0"),
                            labels={"jobset.sigs.k8s.io/jobset-name": "pre"}))
    events = [e for e in watcher.new_events(seen) if isinstance(e, QueueEvent)]
    # Each reflector delivers in its own thread: the order across resources is free, the
    # outcome is not. A member reported before its gang object is sent again with the size.
    assert {(e.name, e.gang, e.gang_size) for e in events} >= {
        ("vc-0", "PodGroup/vc", 3), ("hpc-worker-0", "MPIJob/hpc", 2),
        ("pre-workers-0-0", "JobSet/pre", 8)}
    assert {e.name: (e.gang, e.gang_size) for e in events} == {
        "vc-0": ("PodGroup/vc", 3), "hpc-worker-0": ("MPIJob/hpc", 2),
        "pre-workers-0-0": ("JobSet/pre", 8)}
    assert watcher.watcher.translator.gang_sizes == {
        "ml/PodGroup/cosched": 4, "ml/PyTorchJob/llm": 8, "ml/PodGroup/vc": 3,
        "ml/MPIJob/hpc": 2, "ml/JobSet/pre": 8}
    # The watcher only reads, and only the resources it was told exist.
    gang_requests = {(r.method, r.path) for r in kube_api.requests
                     if r.path.startswith("/apis/") and "kueue" not in r.path
                     and "resource.k8s.io" not in r.path and r.path.count("/") == 4}
    assert gang_requests == {("GET", f"/apis/{group}/{version}/{plural}")
                             for name, version in watcher.watcher.gang_versions.items()
                             for plural, _, group in [name.partition(".")]}


def test_a_crd_not_installed_is_skipped_with_one_line_and_picked_up_once_installed(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    missing = {"pytorchjobs.kubeflow.org", "podgroups.scheduling.volcano.sh",
               "jobsets.jobset.x-k8s.io"}
    with KubeApiServer(absent=missing, bookmark_interval_s=0.05) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        api.create(gpu_pod("llm-worker-0", "ml", owner=("PyTorchJob", "llm")))
        caplog.set_level(logging.INFO, "gpusteward.collectors.kubernetes.watcher")
        watcher = RunningWatcher(api, kubeconfig, KubeWatchSettings(
            kubeconfig=str(kubeconfig), resync_period_s=0.3, backoff_initial_s=0.05)).start()
        try:
            assert set(watcher.watcher.gang_versions) == ALL_GANG_RESOURCES - missing
            assert not set(watcher.watcher.reflectors) & missing
            wait_until(lambda: sum(r.stats.lists for r in watcher.watcher.reflectors.values()
                                   ) > 2 * len(watcher.watcher.reflectors), 10, "resyncs")
            lines = [r.getMessage() for r in caplog.records if "is not served" in r.getMessage()]
            assert sorted(lines) == sorted(f"{name} is not served (no CRD); watching without it"
                                           for name in missing)
            assert not any(r.levelno >= logging.WARNING for r in caplog.records)
            assert not any(r.stats.errors for r in watcher.watcher.reflectors.values())
            # Only discovery ever asked about a missing resource.
            assert not [r for r in api.requests if r.path.endswith("/pytorchjobs")]

            api.absent = frozenset(missing - {"pytorchjobs.kubeflow.org"})
            api.create(pytorch_job("llm", 3))
            wait_until(lambda: "pytorchjobs.kubeflow.org" in watcher.watcher.reflectors, 10,
                       "the PyTorchJob CRD to be picked up")
            watcher.settle()
            sizes = [e.gang_size for e in watcher.events if isinstance(e, QueueEvent)]
            assert sizes == [None, 4]
        finally:
            watcher.stop()


def test_gang_resources_can_be_left_out(kube_api: KubeApiServer,
                                        start_watcher: WatcherFactory) -> None:
    watcher = start_watcher(resources=["nodes", "pods", "workloads"])
    assert not set(watcher.watcher.reflectors) & ALL_GANG_RESOURCES
    assert not [r for r in kube_api.requests if "podgroups" in r.path]


def test_the_sizes_of_gangs_deleted_are_forgotten(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    # A fleet runs thousands of training jobs a week: the watcher, up for months, keeps
    # the sizes of the gangs that exist, not of every gang it ever saw.
    kube_api.create(pytorch_job("resident", 3))
    watcher = start_watcher()
    for n in range(200):
        kube_api.create(pytorch_job(f"run-{n}", 1))
        kube_api.create(pod_group(f"pg-{n}", "scheduling.x-k8s.io", 2))
    translator = watcher.watcher.translator
    watcher.settle(20)
    assert len(translator.gang_sizes) == 401
    for n in range(200):
        kube_api.delete("PyTorchJob", f"run-{n}", "ml", group="kubeflow.org")
        kube_api.delete("PodGroup", f"pg-{n}", "ml", group="scheduling.x-k8s.io")
    watcher.settle(20)
    assert translator.gang_sizes == {"ml/PyTorchJob/resident": 4}
