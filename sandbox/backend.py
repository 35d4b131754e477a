"""The remediation backend of the simulated world: verbs act on the fleet simulator.

It is a sandbox (``sandbox = True``): nothing real changes, so per-rule
enablement does not gate it.
"""

from __future__ import annotations

from gpusteward.sandbox.simulator.engine import SimulatedCluster
from gpusteward.schema import Action, Outcome


class SimulatorBackend:
    """Acts on a :class:`~gpusteward.sandbox.simulator.engine.SimulatedCluster`."""

    name = "simulator"
    sandbox = True

    def __init__(self, cluster: SimulatedCluster) -> None:
        self.cluster = cluster

    async def gpu_node_count(self) -> int | None:
        return len(self.cluster.nodes)

    async def cordon(self, action: Action) -> tuple[Outcome, str]:
        node = action.target.node
        sim_node = self.cluster.nodes.get(node or "")
        if sim_node is None:
            return "failed", f"no node {node!r} in the simulated cluster"
        if sim_node.cordoned:
            return "skipped", f"{node} is already cordoned"
        self.cluster.request_cordon(sim_node.name, action.reason)
        return "executed", f"cordoned {node}: no new pods will be scheduled there"

    async def notify_owner(self, action: Action) -> tuple[Outcome, str]:
        pod = action.target.pod
        if pod is None:
            return "failed", "notify_owner needs a pod"
        self.cluster.notify(pod, action.reason)
        return "executed", f"notified the owner of {pod.namespace}/{pod.name}"
