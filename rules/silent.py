"""A node with GPUs from which no GPU sample comes: every rule is blind to it.

A node whose collector stopped (a hung driver takes NVML with it, the collector
crash-loops, its pod was evicted) or never ran there (the DaemonSet's node
selector or tolerations leave the node out, a new node pool) still takes pods.
Its GPUs' faults, idle holders and memory go unseen, and nothing else says so:
the Prometheus alerts see collector processes, not the nodes none runs on.

The node join judges it (:meth:`gpusteward.streams.node.NodeJoin.silence`) on
the clock of the node's partition: the newest sample of any node of it, or,
where no node of the partition sends anything, of the worker's other partitions
(:class:`gpusteward.streams.app.NodeStates`), every minute of that clock and at
each of the node's inventories. Skew between workers never
counts: one partition is read by one worker, in order. The silence is measured
from the node's newest sample or from when it was expected to send (its first
inventory, or the one that let it take pods again), whichever is later. A node
that takes no new pods
(cordoned, not ready) or is being reconfigured by mig-manager (which stops
the GPUs' clients) opens no episode. The episode closes at the node's next
sample, or when the node is deleted.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import finding_id, fingerprint, resolved
from gpusteward.rules.hardware import Episode
from gpusteward.schema import Evidence, Finding, Subject

KIND = "node_silent"

RUNBOOK = (
    "No GPU sample has come from this node for the time the finding says, or none ever did, "
    "while Kubernetes still lists it with GPUs and it takes pods: gpusteward sees none of its "
    "GPUs' faults, idle holders or memory. Look for the collector pod on the node "
    "(`kubectl -n gpusteward-node get pods -o wide --field-selector spec.nodeName=NODE`): none "
    "there means the DaemonSet's nodeSelector or tolerations leave the node out (a new pool, a "
    "custom taint, a device plugin without GPU Feature Discovery's nvidia.com/gpu.present "
    "label; `gpusteward doctor` names every such node and why); one crash-looping or stuck "
    "usually means the driver is hung (`nvidia-smi` on the node hangs or fails): cordon the "
    "node and restart it. The finding resolves at the node's next sample.")


class NodeSilentSettings(BaseModel):
    """A node with GPUs sending no GPU samples: its faults and idle holders go unseen."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="False: a silent node of this pool is not told "
                          "(GPU nodes monitored by something else on purpose).")
    silent_after_s: float = Field(
        600.0, ge=120,
        description="Seconds of the node's partition's event time without a sample of the node "
        "(or since it was expected to send: its first inventory, or the one that let it take "
        "pods again) before it is "
        "told. Above a collector's restart and a rolling update of the DaemonSet.")
    severity: Literal["info", "warning", "critical"] = Field(
        "warning", description="Severity of the finding.")


def opened(node: str, since: float, ts: float, gpus: int, sampled: bool,
           settings: NodeSilentSettings) -> tuple[Finding, Episode]:
    """The finding of a node silent from ``since`` (its newest sample if ``sampled``, else
    when it was expected to send) to ``ts``, and its episode."""
    fp = fingerprint(KIND, node)
    minutes = (ts - since) / 60
    what = (f"no GPU sample from {node} for {minutes:.0f} min" if sampled else
            f"no GPU sample from {node} in the {minutes:.0f} min since it could take pods")
    finding = Finding(
        id=finding_id(fp, since), fingerprint=fp, kind=KIND, severity=settings.severity,
        state="firing", subject=Subject(node=node),
        summary=f"{what}: its {gpus} GPU{'s take' if gpus != 1 else ' takes'} work that "
                "gpusteward does not see (faults, idle holders, memory): is its collector "
                "running?",
        starts_at=since, ts=ts, runbook=RUNBOOK,
        evidence=Evidence(window_start=since, window_end=ts, samples=0,
                          values={"silent_s": round(ts - since, 1), "gpus": float(gpus)}),
        labels={"sampled_before": "true" if sampled else "false"})
    return finding, Episode(finding.id, finding.fingerprint, since)


def closed(episode: Episode, node: str, ts: float, why: str) -> Finding:
    """The silence's finding, resolved."""
    return resolved(episode.id, episode.fingerprint, KIND, Subject(node=node),
                    f"{node}: {why}", episode.since, ts)
