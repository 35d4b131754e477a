"""A node under MIG reconfiguration: what its GPU reset looks like, and a failed one.

The GPU Operator's mig-manager applies a new ``nvidia.com/mig.config`` by setting
``nvidia.com/mig.config.state`` to ``pending`` (``rebooting`` when the node must
restart), stopping the GPU clients (their pods are evicted), toggling MIG mode and
recreating the GPU instances (a GPU reset), then ``success`` or ``failed``. Meanwhile
the GPUs it works on leave the exporters' pages, NVML may call them lost, and the
driver may log the reset's XIDs: faults, to the hardware rules, that would drain a node
someone is reconfiguring on purpose.

So while the state is pending or rebooting, the findings of those rules
(:data:`HELD_KINDS`) are raised, marked with the state and config, with no node action
(:func:`hold`); once the state is back to ``success``, each GPU that answers again has
the episodes that opened during the window closed (:func:`settle`). Faults a reset does
not cause (a double-bit ECC error, a failed row remap) keep their actions. A ``failed``
state is one warning naming the node and the config asked for, resolved by a later
success (:func:`failed`, :func:`recovered`).

Pure functions of the node join's state: the join keeps the state (it has the node's
inventory) and calls these; no settings, since there is nothing to tune.
"""

from __future__ import annotations

from typing import Any

from gpusteward.rules import hardware
from gpusteward.rules import xid as xid_rule
from gpusteward.rules.findings import finding_id, fingerprint, resolved
from gpusteward.schema import Action, Finding, Subject

RECONFIGURING = frozenset({"pending", "rebooting"})
"""``nvidia.com/mig.config.state`` values of a node mig-manager is working on."""

HELD_KINDS = frozenset({hardware.GPU_LOST_KIND, hardware.RECOVERY_KIND, xid_rule.KIND,
                        xid_rule.RMA_KIND})
"""Finding kinds a reconfiguration's GPU reset causes: a GPU gone from the bus while MIG
mode toggles, the driver asking for the reset it is doing, the reset's XIDs (and the RMA
count they would feed)."""

FAILED_KIND = "mig_config_failed"
FAILED_RUNBOOK = (
    "mig-manager could not apply the MIG layout the node's nvidia.com/mig.config label asks "
    "for (nvidia.com/mig.config.state=failed): the node runs another layout, or none, so pods "
    "asking for the new profiles will not schedule there. Read the nvidia-mig-manager pod's log "
    "on the node; check that the config name exists in the mig-parted ConfigMap and suits the "
    "GPU model, and that no process held the GPUs (`nvidia-smi`); then relabel to retry, or "
    "back to the previous config. The finding resolves when a reconfiguration succeeds.")


def hold(out: list[Any], state: str, config: str | None) -> list[Any]:
    """``out`` with its :data:`HELD_KINDS` findings marked as seen during a reconfiguration
    and the node actions they ask for left out (they act on no one: the node is busy being
    reconfigured on purpose)."""
    held: set[str] = set()
    for item in out:
        if isinstance(item, Finding) and item.kind in HELD_KINDS and item.state == "firing":
            held.add(item.id)
            item.labels = {**item.labels, "mig_config_state": state,
                           "mig_config": config or ""}
            item.summary += (f" (during a MIG reconfiguration to {config or '?'}, "
                             f"mig.config.state={state}: no node action taken)")
    if not held:
        return out
    return [item for item in out if not (isinstance(item, Action)
                                         and held.intersection(item.finding_ids))]


def settle(track: hardware.HwTrack, *, node: str, uuid: str, since: float, until: float,
           ts: float) -> list[Finding]:
    """Close the :data:`HELD_KINDS` episodes of GPU ``uuid`` that opened from ``since`` to
    ``until`` (the reconfiguration's start and its success), now that it answers again;
    the XIDs of the window stop counting towards an RMA."""
    out: list[Finding] = []
    why = "answers again after a successful MIG reconfiguration"
    for attr, kind in (("lost", hardware.GPU_LOST_KIND), ("recovery", hardware.RECOVERY_KIND)):
        episode = getattr(track, attr)
        if episode is not None and since <= episode.since <= until:
            out.append(resolved(episode.id, episode.fingerprint, kind,
                                Subject(node=node, device=uuid), f"{uuid} on {node}: {why}",
                                episode.since, ts))
            setattr(track, attr, None)
    xids = track.xid
    for cls, episode in list(xids.open.items()):
        if since <= episode.since <= until:
            del xids.open[cls]
            xids.closed_until[cls] = ts
            kind = xid_rule.RMA_KIND if cls == xid_rule.RMA_KIND else xid_rule.KIND
            out.append(resolved(episode.id, episode.fingerprint, kind,
                                Subject(node=node, device=uuid), f"{uuid} on {node}: {why}",
                                episode.since, ts))
    xids.recent = [r for r in xids.recent if not since <= r[0] <= until]
    return out


def unsettled(track: hardware.HwTrack, since: float, until: float) -> bool:
    """Whether GPU ``track`` still has an episode :func:`settle` would close."""
    return (any(e is not None and since <= e.since <= until
                for e in (track.lost, track.recovery))
            or any(since <= e.since <= until for e in track.xid.open.values()))


def failed(node: str, config: str | None, ts: float) -> tuple[Finding, hardware.Episode]:
    """The warning of a reconfiguration mig-manager reported failed, and its episode."""
    fp = fingerprint(FAILED_KIND, node)
    finding = Finding(
        id=finding_id(fp, ts), fingerprint=fp, kind=FAILED_KIND, severity="warning",
        state="firing", subject=Subject(node=node),
        summary=f"mig-manager failed to apply MIG config {config or '?'} on {node} "
                "(nvidia.com/mig.config.state=failed): the node is not in the layout asked for",
        starts_at=ts, ts=ts, runbook=FAILED_RUNBOOK,
        labels={"mig_config": config or ""})
    return finding, hardware.Episode(finding.id, finding.fingerprint, ts)


def recovered(episode: hardware.Episode, node: str, config: str | None, ts: float) -> Finding:
    """The failed reconfiguration's warning, resolved."""
    return resolved(episode.id, episode.fingerprint, FAILED_KIND, Subject(node=node),
                    f"MIG config {config or '?'} applied on {node}", episode.since, ts)
