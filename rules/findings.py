"""Identity of findings and actions: deterministic fingerprints and ids.

A fingerprint names a problem (rule + subject) and stays the same across
episodes; a finding id names one episode (fingerprint + window start). Both
are pure functions of the data, so a redelivered sample produces the same
ids and consumers can deduplicate on them.
"""

from __future__ import annotations

import hashlib

from gpusteward.schema import Action, ActionVerb, Finding, Subject


def fingerprint(kind: str, *parts: str) -> str:
    """A short stable hash of the rule kind and the subject's parts."""
    digest = hashlib.sha1("\x1f".join((kind, *parts)).encode(), usedforsecurity=False)
    return digest.hexdigest()[:16]


def finding_id(fingerprint_: str, window_start: float) -> str:
    """The id of one episode of a problem: its fingerprint and its start in ms."""
    return f"{fingerprint_}-{round(window_start * 1000)}"


def moved_enough(previous: float, current: float, now: float, after_s: float,
                 share: float) -> bool:
    """Whether an estimated time (an ETA, a projected crossing) moved enough to re-issue
    its finding: by more than ``after_s`` seconds and by more than ``share`` of the time
    that was left to the ``previous`` estimate. Smaller moves are noise to its reader."""
    moved = abs(current - previous)
    return moved > after_s and moved > share * max(0.0, previous - now)


def action_for(finding: Finding, verb: ActionVerb, target: Subject, reason: str) -> Action:
    """An action asked for by ``finding``; its idempotency key is the finding id and verb."""
    return Action(
        idempotency_key=f"{finding.id}/{verb}",
        verb=verb,
        target=target,
        reason=reason,
        rule=finding.kind,
        finding_ids=[finding.id],
        ts=finding.ts,
    )


def resolved(finding_id_: str, fingerprint_: str, kind: str, subject: Subject,
             summary: str, starts_at: float, ts: float) -> Finding:
    """The closing record of an episode: same id, state resolved, ends_at set."""
    return Finding(
        id=finding_id_, fingerprint=fingerprint_, kind=kind, severity="info",
        state="resolved", subject=subject, summary=summary,
        starts_at=starts_at, ts=ts, ends_at=ts,
    )
