"""The pure parts of the watcher: owner chains, workload kinds, requests, MIG names, states."""

from __future__ import annotations

import pytest

from gpusteward.collectors.kubernetes import translate as kube
from gpusteward.collectors.kubernetes.reflector import Delta


@pytest.mark.parametrize(("owner", "labels", "expected"), [
    (("ReplicaSet", "api-7c9d8f"), {"pod-template-hash": "7c9d8f"}, ("Deployment", "api")),
    # A ReplicaSet made by hand (no template hash in its name) stays a ReplicaSet.
    (("ReplicaSet", "handmade"), {"pod-template-hash": "7c9d8f"}, ("ReplicaSet", "handmade")),
    (("Job", "pt-workers-0"), {"jobset.sigs.k8s.io/jobset-name": "pt"}, ("JobSet", "pt")),
    (("Job", "nightly-2889"), {}, ("Job", "nightly-2889")),
    (("RayCluster", "rj-raycluster-x"), {"ray.io/originated-from-crd": "RayJob",
                                         "ray.io/originated-from-cr-name": "rj"},
     ("RayJob", "rj")),
    (("RayCluster", "shared"), {}, ("RayCluster", "shared")),
    (("StatefulSet", "nb"), {"notebook-name": "nb"}, ("Notebook", "nb")),
    (("StatefulSet", "db"), {}, ("StatefulSet", "db")),
    (None, {}, (None, None)),
])
def test_top_owner(owner: tuple[str, str] | None, labels: dict[str, str],
                   expected: tuple[str | None, str | None]) -> None:
    meta: dict[str, object] = {"labels": labels}
    if owner:
        meta["ownerReferences"] = [{"kind": "Other", "name": "x"},
                                   {"kind": owner[0], "name": owner[1], "controller": True}]
    assert kube.top_owner(meta) == expected


@pytest.mark.parametrize(("labels", "owner", "expected"), [
    ({"gpusteward.io/workload-kind": "inference"}, "Job", "inference"),
    ({"gpusteward.io/workload-kind": "bogus"}, "Job", "batch"),
    ({"notebook-name": "nb"}, "StatefulSet", "notebook"),
    ({"component": "singleuser-server"}, None, "notebook"),
    ({"serving.kserve.io/inferenceservice": "llm"}, "ReplicaSet", "inference"),
    ({}, "Deployment", "inference"),
    ({}, "StatefulSet", "inference"),
    ({}, "JobSet", "batch"),
    ({}, "RayJob", "batch"),
    ({}, "PyTorchJob", "batch"),
    ({}, None, None),
])
def test_workload_kind_rule(labels: dict[str, str], owner: str | None,
                            expected: str | None) -> None:
    assert kube.workload_kind(labels, owner, "gpusteward.io/workload-kind") == expected


def test_effective_requests_follow_the_init_container_rule() -> None:
    spec = {
        "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}],
        "containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "2"}}},
            {"resources": {"requests": {"nvidia.com/gpu": "2"}}},
            {"resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}},
        ],
    }
    assert kube.gpu_resources(spec) == {"nvidia.com/gpu": 4, "nvidia.com/mig-1g.10gb": 1}
    assert kube.gpu_resources({"containers": [{"resources": {"limits": {"cpu": "1"}}}]}) == {}


def test_the_images_of_a_pod_are_those_of_its_gpu_containers() -> None:
    gpu = {"limits": {"nvidia.com/gpu": "1"}}
    spec = {
        "initContainers": [{"image": "busybox:1.36"},  # done before the rest start
                           {"image": "profiler:2", "restartPolicy": "Always",
                            "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}],
        "containers": [{"image": "tensorflow/tensorflow:2.17.0-gpu", "resources": gpu},
                       {"image": "envoy:1.31"},
                       {"image": "tensorflow/tensorflow:2.17.0-gpu", "resources": gpu}],
    }
    assert kube.gpu_images(spec) == ["tensorflow/tensorflow:2.17.0-gpu", "profiler:2"]
    # GPUs from a resource claim: no container names a GPU resource, all of them may use it.
    claimed = {"containers": [{"image": "jax:1"}, {"image": "sidecar:1"}, {"name": "no-image"}]}
    assert kube.gpu_images(claimed) == ["jax:1", "sidecar:1"]


def test_a_framework_told_to_grow_its_memory_is_known_by_its_gpu_containers_environment(
        ) -> None:
    gpu = {"limits": {"nvidia.com/gpu": "1"}}

    def spec(*env: dict[str, object], on_gpu: bool = True) -> dict[str, object]:
        return {"containers": [{"image": "tensorflow/tensorflow:2.17.0-gpu",
                                "resources": gpu if on_gpu else {}, "env": list(env)},
                               {"image": "envoy:1.31", "resources": {} if on_gpu else gpu}]}

    assert kube.memory_grows(spec({"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "true"}))
    assert kube.memory_grows(spec({"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "True"}))
    assert kube.memory_grows(spec({"name": "XLA_PYTHON_CLIENT_PREALLOCATE", "value": "false"}))
    assert kube.memory_grows(spec({"name": "XLA_PYTHON_CLIENT_ALLOCATOR", "value": "platform"}))
    # A pool kept, or a value the watcher cannot read (a ConfigMap's), or another container's.
    assert not kube.memory_grows(spec({"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "false"}))
    assert not kube.memory_grows(spec({"name": "XLA_PYTHON_CLIENT_MEM_FRACTION", "value": ".5"}))
    assert not kube.memory_grows(spec({"name": "TF_FORCE_GPU_ALLOW_GROWTH",
                                       "valueFrom": {"configMapKeyRef": {"name": "tf"}}}))
    assert not kube.memory_grows(spec({"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "true"},
                                      on_gpu=False))
    assert not kube.memory_grows(spec())


def test_mig_profile_names() -> None:
    assert kube.mig_profile("nvidia.com/mig-3g.40gb") == "3g.40gb"
    assert kube.mig_profile("nvidia.com/mig-1g.10gb.me") == "1g.10gb+me"
    assert kube.mig_profile("nvidia.com/gpu") is None
    assert kube.single_strategy_profile({"nvidia.com/mig.strategy": "single",
                                         "nvidia.com/gpu.product": "NVIDIA-H100-NVL-MIG-1g.12gb"}
                                        ) == "1g.12gb"
    assert kube.single_strategy_profile({"nvidia.com/mig.strategy": "single",
                                         "nvidia.com/gpu.product": "NVIDIA-A100-MIG-INVALID"}
                                        ) is None
    assert kube.single_strategy_profile({"nvidia.com/mig.strategy": "mixed",
                                         "nvidia.com/gpu.product": "X-MIG-1g.5gb"}) is None


def _conditions(*items: tuple[str, str, str]) -> dict[str, dict[str, str]]:
    return {kind: {"type": kind, "status": status, "reason": reason}
            for kind, status, reason in items}


@pytest.mark.parametrize(("conditions", "expected"), [
    ((), ("pending", None)),
    ((("QuotaReserved", "False", "WaitingForQuota"),), ("pending", "WaitingForQuota")),
    # Quota reserved but admission checks not Ready yet: still waiting.
    ((("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "False",
                                                   "UnsatisfiedAdmissionChecks")),
     ("pending", "QuotaReserved")),
    ((("Admitted", "True", "Admitted"),), ("admitted", "Admitted")),
    ((("Evicted", "True", "PodsReadyTimeout"),), ("evicted", "PodsReadyTimeout")),
    ((("Evicted", "True", "Deactivated"), ("Requeued", "True", "Reactivated")),
     ("requeued", "Reactivated")),
    ((("Evicted", "True", "Preempted"), ("Admitted", "True", "Admitted")),
     ("admitted", "Admitted")),
    ((("Finished", "True", "Failed"), ("Admitted", "True", "Admitted")),
     ("finished", "Failed")),
])
def test_workload_state(conditions: tuple[tuple[str, str, str], ...],
                        expected: tuple[str, str | None]) -> None:
    assert kube.workload_state(_conditions(*conditions)) == expected


def test_spot_tolerations() -> None:
    assert kube.spot_tolerant({"tolerations": [{"key": "kubernetes.azure.com/scalesetpriority",
                                                "operator": "Equal", "value": "spot"}]})
    assert kube.spot_tolerant({"tolerations": [{"operator": "Exists"}]})
    assert not kube.spot_tolerant({"tolerations": [{"key": "nvidia.com/gpu",
                                                    "operator": "Exists"}]})
    assert not kube.spot_tolerant({})


def test_translator_ignores_cpu_pods_and_reports_deletions_found_by_relist() -> None:
    translator = kube.Translator()
    cpu = {"metadata": {"name": "c", "namespace": "n", "uid": "u1"},
           "spec": {"nodeName": "n1", "containers": [{"resources": {}}]},
           "status": {"phase": "Running"}}
    assert translator.apply(Delta("pods", "ADDED", "u1", cpu), 1.0) == []
    assert translator.apply(Delta("pods", "DELETED", "u1", None), 2.0) == []
    gpu = {"metadata": {"name": "g", "namespace": "n", "uid": "u2"},
           "spec": {"nodeName": "n1", "containers": [
               {"resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
           "status": {"phase": "Running"}}
    [added] = translator.apply(Delta("pods", "ADDED", "u2", gpu), 1.0)
    [deleted] = translator.apply(Delta("pods", "DELETED", "u2", None), 2.0)
    assert (deleted.phase, deleted.ts, deleted.node, deleted.pod) == (  # type: ignore[union-attr]
        "deleted", 2.0, "n1", added.pod)  # type: ignore[union-attr]
