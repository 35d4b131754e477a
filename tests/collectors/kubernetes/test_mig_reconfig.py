"""A MIG reconfiguration by the GPU Operator's mig-manager, as the worker's node join sees it.

Someone relabels a node's ``nvidia.com/mig.config``; mig-manager sets
``nvidia.com/mig.config.state`` to ``pending``, stops the GPU clients (their pods go
idle, then away), toggles MIG mode and resets the GPU (its series leave
dcgm-exporter's page, the driver may log an XID), then sets ``success`` or ``failed``.

The real watcher reads the node from the API double; the real dcgm-exporter loss
tracker (:class:`LostGpus`) turns the GPU missing from its pages into the ``gpu_lost``
event it publishes; both go through the worker's node join (no broker: the join is the
worker's pure core), whose findings, actions and summaries are what alerting,
remediation and the fleet rules act on. What must hold:

- while the state is pending (or rebooting), the reconfiguration's GPU loss and reset
  XID are raised but ask for no cordon, taint or drain, and resolve once the state is
  back to ``success`` with the GPUs answering;
- the pod mig-manager is evicting is not reported idle;
- the node offers no free capacity;
- ``failed`` raises one warning naming the node and the config asked for, resolved when
  a later reconfiguration succeeds.
"""

from __future__ import annotations

from typing import Any

from gpusteward.collectors.dcgm import LostGpus
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.sandbox.kube_objects import gpu_node, gpu_pod
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    HwEvent,
    NodeInventory,
    NodeSample,
    NodeSummary,
    PodAllocation,
    PodRef,
)
from gpusteward.streams.node import NodeJoin, NodeState

from .conftest import RunningWatcher, WatcherFactory

NODE = "a100-1"
MODEL = "NVIDIA A100-SXM4-80GB"
POD = PodRef(namespace="team-a", name="train")
RESET_XID = 46
"""An XID the catalog classes ``reset_gpu`` (taint for a reset), as a GPU reset may log."""


def _gpu(index: int, util: float, pod: PodRef | None = None) -> DeviceSample:
    return DeviceSample(uuid=f"GPU-{index}", index=index, model=MODEL, util_pct=util,
                        temp_c=40.0, mem_total_bytes=80 << 30, pod=pod)


class Node:
    """The node as the worker sees it: the watcher's events, dcgm samples and lost-GPU
    events through one node join, everything it emits kept in order."""

    def __init__(self, watcher: RunningWatcher) -> None:
        self.watcher = watcher
        self.join, self.state = NodeJoin(), NodeState()
        self.lost = LostGpus("dcgm")
        self.seen = 0
        self.out: list[Any] = []
        self.now = 0.0
        """The world's time: the watcher stamps what it reads with it, as a real watcher
        stamps it with the time it reads a change."""
        watcher.watcher.clock = lambda: self.now

    def kube(self) -> list[Any]:
        events = self.watcher.new_events(self.seen)
        self.seen += len(events)
        out: list[Any] = []
        for event in events:
            if isinstance(event, NodeInventory | PodAllocation):
                out += self.join.on_allocation(self.state, event)
        self.out += out
        return out

    def page(self, ts: float, devices: list[DeviceSample]) -> list[Any]:
        self.now = ts
        sample = NodeSample(ts=ts, node=NODE, source="dcgm", devices=devices)
        out = self.join.on_sample(self.state, sample)
        for event in self.lost.events([sample], ts):
            out += self.join.on_hw_event(self.state, event)
        self.out += out
        return out

    def hw(self, event: HwEvent) -> list[Any]:
        self.now = event.ts
        out = self.join.on_hw_event(self.state, event)
        self.out += out
        return out

    def summary(self) -> NodeSummary:
        return [o for o in self.out if isinstance(o, NodeSummary)][-1]


def _label(api: KubeApiServer, **labels: str) -> None:
    api.patch("Node", NODE, {"metadata": {"labels": {
        f"nvidia.com/{key.replace('_', '.')}": value for key, value in labels.items()}}})


def _firing(out: list[Any], kind: str) -> list[Finding]:
    return [o for o in out if isinstance(o, Finding) and o.kind == kind and o.state == "firing"]


def _resolved(out: list[Any], kind: str) -> list[Finding]:
    return [o for o in out if isinstance(o, Finding) and o.kind == kind and o.state == "resolved"]


def test_reconfiguration_raises_no_disruption_and_a_failure_is_reported(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    kube_api.create(gpu_node(NODE, gpus=2, labels={"nvidia.com/mig.config": "all-disabled",
                                                   "nvidia.com/mig.config.state": "success"}))
    kube_api.create(gpu_pod("train", node=NODE, phase="Running"))
    node = Node(start_watcher())
    node.kube()
    holding = next(iter(node.state.pods.values()))
    start = holding.started_at
    assert node.summary().gpus_free == 1  # one of two GPUs held

    # The pod has sat at 0 % since it started: 35 min, past the 10 min grace, 5 min short
    # of the 30 min idle window.
    ts = start
    while ts < start + 35 * 60:
        node.page(ts, [_gpu(0, 0.0, POD), _gpu(1, 0.0)])
        ts += 30.0
    assert not _firing(node.out, "idle_holder")

    # Someone asks for a MIG layout; mig-manager takes the node.
    _label(kube_api, mig_config="all-1g.10gb", mig_config_state="pending")
    node.kube()
    assert (node.summary().gpus_free, node.summary().mig_free) == (0, {}), \
        "a node under reconfiguration is offered as free capacity"

    # mig-manager stops the GPU clients (the pod is being evicted, still at 0 %), then
    # toggles MIG mode on GPU 1: it leaves dcgm-exporter's page while GPU 0 stays, and the
    # reset logs an XID.
    window: list[Any] = []
    for _ in range(12):  # 6 min
        window += node.page(ts, [_gpu(0, 0.0, POD)])
        ts += 30.0
    window += node.hw(HwEvent(ts=ts, node=NODE, kind="xid", uuid="GPU-1", xid=RESET_XID,
                              source="dcgm"))
    lost = _firing(window, "gpu_lost")
    xids = _firing(window, "xid")
    assert lost and xids, "the reconfiguration's loss and reset are still reported"
    assert not _firing(window, "idle_holder"), "the pod mig-manager evicts was judged idle"
    disrupting = [o for o in window if isinstance(o, Action)
                  and o.verb in ("cordon", "taint", "drain")]
    assert not disrupting, f"a reconfiguration cordoned or drained the node: {disrupting}"
    for finding in lost + xids:
        assert finding.labels.get("mig_config_state") == "pending", finding
    assert node.summary().gpus_free == 0

    # The layout is made: the state reads success and both GPUs answer again.
    _label(kube_api, mig_config_state="success")
    node.kube()
    settled: list[Any] = []
    for _ in range(3):
        ts += 30.0
        settled += node.page(ts, [_gpu(0, 0.0), _gpu(1, 5.0)])
    assert {f.id for f in _resolved(settled, "gpu_lost")} == {f.id for f in lost}
    assert {f.id for f in _resolved(settled, "xid")} == {f.id for f in xids}
    assert node.summary().healthy

    # Another relabel fails: mig-manager leaves the node without the layout asked for.
    _label(kube_api, mig_config="all-3g.40gb", mig_config_state="pending")
    node.kube()
    _label(kube_api, mig_config_state="failed")
    failed = node.kube()
    (warning,) = _firing(failed, "mig_config_failed")
    assert warning.severity == "warning"
    assert warning.subject.node == NODE
    assert "all-3g.40gb" in warning.summary and NODE in warning.summary
    assert warning.labels["mig_config"] == "all-3g.40gb"
    _label(kube_api, mig_config_state="failed")  # no change: the watcher may repeat it
    kube_api.patch("Node", NODE, {"metadata": {"annotations": {"touched": "1"}}})
    assert not _firing(node.kube(), "mig_config_failed"), "one warning per failure"
    _label(kube_api, mig_config_state="pending")
    node.kube()
    _label(kube_api, mig_config_state="success")
    done = node.kube()
    assert [f.id for f in _resolved(done, "mig_config_failed")] == [warning.id]
