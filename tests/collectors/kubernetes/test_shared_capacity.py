"""Physical GPUs on nodes that advertise time-slicing or MPS replicas."""

from __future__ import annotations

from gpusteward.collectors.kubernetes import translate as kube
from gpusteward.sandbox.kube_objects import gpu_node


def test_time_sliced_node_counts_physical_gpus_and_reports_its_replicas() -> None:
    # GFD on a node of 2 GPUs shared 4 ways: capacity says 8 nvidia.com/gpu.
    node = gpu_node("ts", 2, labels={"nvidia.com/gpu.replicas": "4",
                                     "nvidia.com/gpu.sharing-strategy": "time-slicing"},
                    resources={"nvidia.com/gpu": "8"})
    inventory = kube.Translator().node_inventory(node, 1.0)
    assert (inventory.gpu_count, inventory.gpu_replicas, inventory.gpu_sharing) == (
        2, 4, "time-slicing")
    assert inventory.capacity == {"nvidia.com/gpu": 8}  # the advertised replicas, as they are


def test_an_unshared_node_is_unchanged() -> None:
    inventory = kube.Translator().node_inventory(gpu_node("plain", 8), 1.0)
    assert (inventory.gpu_count, inventory.gpu_replicas, inventory.gpu_sharing) == (8, 1, None)
