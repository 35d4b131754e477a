"""Queue wait-time SLOs: workloads waiting too long, slow queues, and breaches to come.

Three findings, all from queue events (Kueue workloads or pending pods) and
an event-time clock the caller advances:

- ``queue_wait_slo``: one pending workload has waited longer than its
  queue's SLO. One finding per episode (an episode starts when the workload
  becomes pending, or pending again after an eviction or requeue), resolved
  when it is admitted, finishes, is deleted or is deactivated (a Kueue
  Workload with ``spec.active: false`` is not in the queue: Kueue admits it
  only once reactivated, and its wait starts again then).
- ``queue_p95_slo``: over a rolling window, the 95th percentile of the waits
  of the workloads admitted from a queue exceeds the queue's SLO (with a
  minimum number of admissions so one slow job is not a trend).
- ``queue_projected_breach``: the queue's depth divided by its admission
  rate over the window says a workload joining now would wait longer than
  the SLO, before any single workload has breached it.

SLOs are per queue: the first pattern (regular expression, searched in the
cluster-queue name) that matches gives the target, else the default. Events
for a workload at or before the last one applied for it (by time, then by
lifecycle order for events of the same time) are ignored, so
duplicates and late arrivals never reopen or close an episode; a workload that
left the queue is remembered for ``window_s``, and events older than that
for a workload no longer known are ignored as too late.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Annotated

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gpusteward.rules.findings import finding_id, fingerprint, resolved
from gpusteward.rules.registry import FleetRunner
from gpusteward.schema import Evidence, Finding, PodRef, PodSet, QueueEvent, Subject

WAIT_KIND = "queue_wait_slo"
P95_KIND = "queue_p95_slo"
PROJECTED_KIND = "queue_projected_breach"

WAIT_RUNBOOK = (
    "The workload has waited longer than its queue's SLO. Check why it is not admitted "
    "(kubectl describe workload: QuotaReserved reason), whether its shape fits any node "
    "(see stranded_capacity findings), and whether the queue's quota or cohort borrowing "
    "needs raising."
)
P95_RUNBOOK = (
    "Most workloads of this queue wait longer than its SLO. Compare demand with the "
    "ClusterQueue's nominal quota, look for idle holders and fragmentation taking the "
    "capacity, and consider more quota, preemption or a fair-sharing weight."
)
PROJECTED_RUNBOOK = (
    "At the current admission rate the queue's backlog will take longer than its SLO to "
    "clear. Add capacity or quota now, or pause low-priority submissions."
)

_STATE_ORDER = {"pending": 0, "requeued": 0, "admitted": 1, "evicted": 2, "finished": 3,
                "deleted": 4}
"""A workload's states in lifecycle order: of two events with the same time (a pending
workload admitted within the same second), the later state is the newer event."""


def _queue_pattern(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"not a regular expression: {error}") from error
    return pattern


QueuePattern = Annotated[str, AfterValidator(_queue_pattern)]
Seconds = Annotated[float, Field(gt=0)]


class QueueSloSettings(BaseModel):
    """Settings of the queue SLO rules."""

    model_config = ConfigDict(extra="forbid")

    slo_s: dict[QueuePattern, Seconds] = Field(
        default_factory=lambda: {"prod": 600.0, "research": 7200.0},
        description="Wait-time SLO in seconds (> 0) by queue-name pattern (Python regular "
        "expression searched in the cluster-queue name), first match wins. Production "
        "queues: 10 min, research: 2 h.",
    )
    default_slo_s: float = Field(
        3600.0, gt=0, description="SLO (seconds) of a queue no pattern matches.",
    )
    window_s: float = Field(
        3600.0, gt=0,
        description="Rolling window (seconds) for the p50/p95 waits and the admission rate: "
        "one hour smooths a burst but still shows a bad afternoon.",
    )
    min_admissions: int = Field(
        5, ge=1,
        description="Admissions in the window below which no p95 finding is raised.",
    )
    min_depth: int = Field(
        3, ge=1,
        description="Pending workloads below which no projected-breach finding is raised.",
    )

    def slo_for(self, queue: str) -> float:
        for pattern, slo in self.slo_s.items():
            if re.search(pattern, queue):
                return slo
        return self.default_slo_s


class Waiting(msgspec.Struct):
    """A workload in the queue now."""

    queue: str
    pending_since: float
    gpus: int = 0
    mig: dict[str, int] = {}
    open_id: str | None = None
    pod_sets: list[PodSet] = []
    """Its pods' shapes, for a workload of several pods (see :attr:`QueueEvent.pod_sets`)."""


class QueueTrack(msgspec.Struct):
    """Per-queue rolling state: admissions in the window and open queue-level episodes."""

    first_seen: float
    admissions: list[tuple[float, float]] = []
    """(admitted at, wait seconds), oldest first, pruned to the window."""
    p95_since: float | None = None
    p95_open_id: str | None = None
    projected_since: float | None = None
    projected_open_id: str | None = None


class QueueState(msgspec.Struct):
    """Everything the queue rules know."""

    waiting: dict[str, Waiting] = {}
    last_event: dict[str, tuple[float, int]] = {}
    """Per workload, the event time and lifecycle rank of the last event applied."""
    forgotten_before: float = -math.inf
    """Workloads whose last event is older than this were forgotten; events older than this
    for a workload not known are too late to judge and are ignored."""
    queues: dict[str, QueueTrack] = {}


def workload_key(event: QueueEvent) -> str:
    return f"{event.namespace}/{event.name}"


def _workload_subject(key: str, queue: str) -> Subject:
    namespace, _, name = key.partition("/")
    return Subject(queue=queue, pod=PodRef(namespace=namespace, name=name))


def on_event(state: QueueState, event: QueueEvent, settings: QueueSloSettings) -> list[Finding]:
    """Apply one queue event; close the workload's episode when it leaves the queue."""
    key = workload_key(event)
    position = (event.ts, _STATE_ORDER[event.state])
    last = state.last_event.get(key)
    stale = event.ts <= state.forgotten_before if last is None else position <= last
    if stale:
        return []
    state.last_event[key] = position
    queue = event.cluster_queue
    track = state.queues.setdefault(queue, QueueTrack(first_seen=event.ts))
    waiting = state.waiting.get(key)
    if event.waiting:
        if waiting is None:
            # A first pending event carries the creation time; after an eviction the wait
            # counts again from the requeue (or eviction) the event states, else from the
            # event, as Kueue's admission wait does.
            since = event.waiting_since or (
                event.created_at if event.state == "pending" and event.created_at else event.ts)
            state.waiting[key] = Waiting(queue=queue, pending_since=since, gpus=event.gpus,
                                         mig=dict(event.mig), pod_sets=list(event.pod_sets))
        return []
    out: list[Finding] = []
    if waiting is not None:
        # The clock may not have ticked past the SLO while the workload waited (a quiet
        # queue, a worker catching up): its wait is known now, so judge it now, up to its
        # admission where the event states it (a watcher that saw it late adds no wait).
        admitted_at = (event.admitted_at or event.ts) if event.state == "admitted" else None
        out += _judge_wait(key, waiting, admitted_at or event.ts, settings)
        del state.waiting[key]
        if admitted_at is not None:
            track.admissions.append((admitted_at, max(0.0, admitted_at - waiting.pending_since)))
            track.admissions.sort()
        if waiting.open_id is not None:
            fp = fingerprint(WAIT_KIND, key)
            how = event.state if event.active else "deactivated"
            out.append(resolved(waiting.open_id, fp, WAIT_KIND, _workload_subject(key, queue),
                                f"{key} {how}", waiting.pending_since, event.ts))
    return out


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100) of a non-empty collection."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def tick(state: QueueState, now: float, settings: QueueSloSettings) -> list[Finding]:
    """Advance the event-time clock to ``now``; raise what has become due."""
    out: list[Finding] = []
    # A workload that left the queue keeps its last event time for a window, so that a late
    # duplicate of an earlier pending event cannot bring it back; then it is forgotten.
    horizon = now - settings.window_s
    state.forgotten_before = max(state.forgotten_before, horizon)
    for key in [k for k, (ts, _) in state.last_event.items()
                if ts < horizon and k not in state.waiting]:
        del state.last_event[key]
    for key, waiting in state.waiting.items():
        out += _judge_wait(key, waiting, now, settings)
    for queue, track in state.queues.items():
        out += _queue_level(state, queue, track, now, settings)
    return out


def _judge_wait(key: str, waiting: Waiting, now: float,
                settings: QueueSloSettings) -> list[Finding]:
    """The breach finding of a workload that has waited past its SLO at ``now``, once."""
    slo = settings.slo_for(waiting.queue)
    waited = now - waiting.pending_since
    if waiting.open_id is not None or waited <= slo:
        return []
    fp = fingerprint(WAIT_KIND, key)
    waiting.open_id = finding_id(fp, waiting.pending_since)
    return [Finding(
        id=waiting.open_id, fingerprint=fp, kind=WAIT_KIND,
        severity="warning", state="firing", subject=_workload_subject(key, waiting.queue),
        summary=f"{key} has waited {waited / 60:.0f} min in {waiting.queue} "
        f"(SLO {slo / 60:.0f} min)",
        starts_at=waiting.pending_since, ts=now,
        evidence=Evidence(window_start=waiting.pending_since, window_end=now,
                          values={"wait_s": waited, "slo_s": slo,
                                  "gpus": float(waiting.gpus)}),
        runbook=WAIT_RUNBOOK, labels={"queue": waiting.queue},
    )]


def _queue_level(state: QueueState, queue: str, track: QueueTrack, now: float,
                 settings: QueueSloSettings) -> list[Finding]:
    out: list[Finding] = []
    window_start = now - settings.window_s
    while track.admissions and track.admissions[0][0] < window_start:
        track.admissions.pop(0)
    slo = settings.slo_for(queue)
    subject = Subject(queue=queue)
    waits = [wait for _, wait in track.admissions]
    p95 = percentile(waits, 95) if waits else 0.0
    breached = len(waits) >= settings.min_admissions and p95 > slo
    fp = fingerprint(P95_KIND, queue)
    if breached and track.p95_open_id is None:
        since = max(track.admissions[0][0], window_start)
        track.p95_since, track.p95_open_id = since, finding_id(fp, since)
        out.append(Finding(
            id=track.p95_open_id, fingerprint=fp, kind=P95_KIND, severity="warning",
            state="firing", subject=subject,
            summary=f"p95 wait in {queue} is {p95 / 60:.0f} min over the last "
            f"{settings.window_s / 60:.0f} min (SLO {slo / 60:.0f} min)",
            starts_at=since, ts=now,
            evidence=Evidence(window_start=window_start, window_end=now, samples=len(waits),
                              values={"p50_wait_s": percentile(waits, 50), "p95_wait_s": p95,
                                      "slo_s": slo}),
            runbook=P95_RUNBOOK, labels={"queue": queue},
        ))
    elif not breached and track.p95_open_id is not None and track.p95_since is not None:
        out.append(resolved(track.p95_open_id, fp, P95_KIND, subject,
                            f"p95 wait in {queue} back within SLO", track.p95_since, now))
        track.p95_since = track.p95_open_id = None

    depth = sum(1 for w in state.waiting.values() if w.queue == queue)
    # Admissions per second over the window; a queue observed for less than a window
    # has no rate yet and makes no projection.
    observed_window = now - track.first_seen >= settings.window_s
    rate = len(track.admissions) / settings.window_s
    projected = math.inf if rate == 0 else depth / rate
    breach_ahead = observed_window and depth >= settings.min_depth and projected > slo
    fp = fingerprint(PROJECTED_KIND, queue)
    if breach_ahead and track.projected_open_id is None:
        track.projected_since, track.projected_open_id = now, finding_id(fp, now)
        out.append(Finding(
            id=track.projected_open_id, fingerprint=fp, kind=PROJECTED_KIND,
            severity="warning", state="firing", subject=subject,
            summary=f"{queue}: {depth} pending at {rate * 3600:.1f} admissions/h "
            f"will wait past the {slo / 60:.0f} min SLO",
            starts_at=now, ts=now,
            evidence=Evidence(window_start=window_start, window_end=now, samples=len(waits),
                              values={"depth": float(depth), "admissions_per_h": rate * 3600,
                                      "projected_wait_s": min(projected, 1e12),
                                      "slo_s": slo}),
            runbook=PROJECTED_RUNBOOK, labels={"queue": queue},
        ))
    elif (not breach_ahead and track.projected_open_id is not None
          and track.projected_since is not None):
        out.append(resolved(track.projected_open_id, fp, PROJECTED_KIND, subject,
                            f"{queue}: backlog clears within SLO", track.projected_since, now))
        track.projected_since = track.projected_open_id = None
    return out


def _evaluate(state: QueueState, fleet: object, now: float,
              settings: QueueSloSettings) -> list[Finding]:
    return tick(state, now, settings)


RUNNERS = (FleetRunner("queue", QueueState, _evaluate),)
"""The fleet agent's evaluation of the rule; queue events reach it through :func:`on_event`,
which the agent calls for every event (the other fleet rules read the demand it keeps)."""
