"""MIG capacity as the watcher reads a node and the worker's node join offers it.

A node under the device plugin's ``single`` strategy advertises its MIG devices as
``nvidia.com/gpu`` and names the profile in ``nvidia.com/gpu.product``; GFD drops the
``+`` of a media-extension profile from that label. The real watcher reads the node
and its pods from the API double; its events go through the worker's node join (no
broker: the join is the worker's pure core), whose summary is what the fleet rules and
the MIG advice count as free.
"""

from __future__ import annotations

from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod
from gpusteward.schema import NodeInventory, NodeSummary, PodAllocation
from gpusteward.streams.node import NodeJoin, NodeState

from .conftest import WatcherFactory


def _summary(events: list[object]) -> NodeSummary:
    join, state = NodeJoin(), NodeState()
    out: list[object] = []
    for event in events:
        if isinstance(event, NodeInventory | PodAllocation):
            out += join.on_allocation(state, event)
    return [o for o in out if isinstance(o, NodeSummary)][-1]


def test_single_strategy_node_offers_its_free_mig_devices(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    # An A100-40GB under all-1g.5gb: 7 devices, 2 held by one pod asking nvidia.com/gpu.
    kube_api.create(gpu_node("a100-single", labels={
        "nvidia.com/mig.strategy": "single", "nvidia.com/gpu.count": "7",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"},
        resources={"nvidia.com/gpu": "7"}))
    kube_api.create(gpu_pod("infer", node="a100-single", phase="Running",
                            resources={"nvidia.com/gpu": "2"}))
    watcher = start_watcher()
    summary = _summary(watcher.new_events(0))
    # Five MIG devices free, no whole GPU: nothing offered before.
    assert (summary.gpus_free, summary.mig_free) == (0, {"1g.5gb": 5})
    assert summary.mig_total == {"1g.5gb": 7}  # what its layout offers, held or not


def test_single_strategy_media_profile_reads_as_its_profile(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    # An H100 under all-1g.10gb.me: one 1g.10gb+me device; GFD labels it without the "+".
    kube_api.create(gpu_node("h100-me", labels={
        "nvidia.com/mig.strategy": "single", "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gbme"},
        resources={"nvidia.com/gpu": "1"}))
    kube_api.create(gpu_pod("video", node="h100-me", phase="Running",
                            resources={"nvidia.com/gpu": "1"}))
    watcher = start_watcher()
    events = watcher.new_events(0)
    pods = [e for e in events if isinstance(e, PodAllocation)]
    assert pods and pods[-1].mig == {"1g.10gb+me": 1}
    # Its one device is held: nothing free, under any spelling.
    assert _summary(events).mig_free == {}
