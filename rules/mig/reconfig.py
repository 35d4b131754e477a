"""A node under MIG reconfiguration: what its GPU reset looks like, and a failed one.

The GPU Operator's mig-manager applies a new ``nvidia.com/mig.config`` by setting
``nvidia.com/mig.config.state`` to ``pending`` (``rebooting`` when the node must
restart), stopping the GPU clients (their pods are evicted), toggling MIG mode and
recreating the GPU instances (a GPU reset), then ``success`` or ``failed``. Meanwhile
the GPUs it works on leave the exporters' pages, NVML may call them lost, and the
driver may log the reset's XIDs: faults, to the hardware rules, that would drain a node
someone is reconfiguring on purpose.

So while the state is pending or rebooting, the findings of those rules
(:data:`HELD_KINDS`) are raised, marked with the state and config, with no node action;
the join keeps each with the actions held back from it (:func:`hold`, :class:`Held`).
Once the state is back to ``success``, each GPU that answers again has the episodes the
reconfiguration opened closed (:func:`settle`): the ones held, whatever their event time
(the window's ends are the watcher's clock, the episodes the node's collectors'), and
the ones a worker read ahead of the ``pending`` (catching up) whose event time falls in
the window. A GPU still silent a grace period after the success is a fault: its held
findings are raised again saying so, with their actions (:func:`overdue`). Faults a reset
does not cause (a double-bit ECC error, a failed row remap) keep their actions. A
``failed`` state is one warning naming the node and the config asked for, resolved by a
later success (:func:`failed`, :func:`recovered`).

Pure functions of the node join's state: the join keeps the state (it has the node's
inventory) and calls these; its ``mig_settle_s`` is the grace period.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import msgspec

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


class Held(msgspec.Struct):
    """A finding raised during a reconfiguration, kept until its episode closes or the
    GPU is overdue (:func:`overdue`)."""

    finding: Finding
    """As raised (labelled, its summary saying no action was taken)."""
    cause: str
    """Its summary as the rule wrote it, before the reconfiguration's note."""
    actions: list[Action] = []
    """The node actions its rule asked for and :func:`hold` left out."""


def hold(out: list[Any], state: str, config: str | None, held: dict[str, Held],
         between: tuple[float, float] | None = None) -> list[Any]:
    """``out`` with its :data:`HELD_KINDS` findings (those that started ``between`` two
    event times, if given) marked as seen during a reconfiguration and the node actions
    they ask for left out (they act on no one: the node is busy being reconfigured on
    purpose); each such finding is kept in ``held`` by id, with those actions."""
    now: dict[str, Held] = {}
    note = (f"during a MIG reconfiguration to {config or '?'}, mig.config.state={state}: "
            "no node action taken" if state in RECONFIGURING else
            f"as a MIG reconfiguration to {config or '?'} ends (mig.config.state={state}): "
            "no node action taken unless the GPU stays silent")
    for item in out:
        if (isinstance(item, Finding) and item.kind in HELD_KINDS and item.state == "firing"
                and (between is None or between[0] <= item.starts_at <= between[1])):
            cause = item.summary
            item.labels = {**item.labels, "mig_config_state": state,
                           "mig_config": config or ""}
            item.summary += f" ({note})"
            now[item.id] = held[item.id] = Held(item, cause)
    if not now:
        return out
    kept: list[Any] = []
    for item in out:
        if isinstance(item, Action) and (of := next(
                (now[i] for i in item.finding_ids if i in now), None)) is not None:
            of.actions.append(item)
        else:
            kept.append(item)
    return kept


def overdue(held: Held, *, config: str | None, after_s: float, ts: float) -> list[Any]:
    """The held finding of a GPU not back ``after_s`` after the reconfiguration succeeded,
    raised again under its id saying so, and the node actions its rule asked for, asked for
    now (their idempotency keys are the ones held: never carried out before)."""
    why = (f"{held.cause}: not back {after_s / 60:g} min after the MIG reconfiguration to "
           f"{config or '?'} succeeded, so a fault, not the reconfiguration's reset")
    if held.actions:
        why += f" ({', '.join(a.verb for a in held.actions)} asked for)"
    finding = msgspec.structs.replace(held.finding, summary=why, ts=ts,
                                      labels={**held.finding.labels, "mig_settle": "overdue"})
    return [finding, *(msgspec.structs.replace(a, reason=why, ts=ts) for a in held.actions)]


def settle(track: hardware.HwTrack, *, node: str, uuid: str, since: float, until: float,
           ts: float, held: Container[str]) -> list[Finding]:
    """Close the :data:`HELD_KINDS` episodes of GPU ``uuid`` the reconfiguration opened
    (those ``held``, and those that opened from ``since`` to ``until``: its start and its
    success), now that it answers again; the XIDs of the window stop counting towards an
    RMA."""
    out: list[Finding] = []
    why = "answers again after a successful MIG reconfiguration"
    # The window on the node's clock as far as its held episodes tell: the watcher's
    # ``since`` and ``until`` may be off it by the two clocks' skew.
    for episode in (track.lost, track.recovery, *track.xid.open.values()):
        if episode is not None and episode.id in held:
            since, until = min(since, episode.since), max(until, episode.since)
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
    xids.recent = [r for r in xids.recent if not since <= r.ts <= until]
    return out


def unsettled(track: hardware.HwTrack, since: float, until: float, held: Container[str]
              ) -> bool:
    """Whether GPU ``track`` still has an episode :func:`settle` would close."""
    return any(e is not None and (e.id in held or since <= e.since <= until)
               for e in (track.lost, track.recovery, *track.xid.open.values()))


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
