"""A start ETA for every pending workload.

Users waiting in a queue ask two questions: how long have I waited, and when
will I start. The queue rules answer the first; this rule answers the second
with an info finding per pending workload (``queue_start_eta``), which
``status`` and alerting show like any finding, re-issued under the same id
when the estimate moves and resolved when the workload starts, with the
estimate's error in the resolution's evidence.

The estimate plays the queue forward on the fleet's capacity:

- **queue position**: the pending workloads in admission order (higher
  priority first, then the longest waiting; Kueue's BestEffortFIFO and
  StrictFIFO order), across queues, since they share the GPUs;
- **expected release of held capacity**: every running workload (admitted
  and not finished) frees its GPUs at its expected end, the median run time
  of the workloads of its queue that ran at least as long as it has so far
  (its age against their history): a job running past most of its peers is
  expected to end with the longest of them, not at once;
- the GPUs free now, from the node summaries (less what the queue admitted
  since they were sent: the agent may read the queue ahead of them).

Workloads are placed in order as GPUs free up; a workload's ETA is when its
turn and its GPUs coincide. MIG devices are counted the same way, each
profile on its own: a MIG workload waits for the slices of its profiles that
running MIG workloads hold. Where there is no history yet (no workload of
the queue has finished), the estimate falls back to the **naive** one:
position divided by the queue's admission rate over the window; both figures
are in the evidence. A workload that no
single node could ever hold (a pod asking more GPUs than any node has, or
MIG devices no node's layout offers) gets no estimate, and takes no place
ahead of others: nothing that ends frees room for it (``stranded_capacity``
says why). One it had is resolved.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Collection, Sequence

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import finding_id, fingerprint, moved_enough
from gpusteward.rules.fragmentation import FleetView, unplaceable
from gpusteward.rules.registry import FleetRunner
from gpusteward.schema import Evidence, Finding, NodeSummary, PodRef, QueueEvent, Subject

KIND = "queue_start_eta"

RUNBOOK = (
    "An estimate, not a promise: the time this pending workload is expected to start, from its "
    "place in the queue, the queue's admission rate and when the running workloads are "
    "expected to end. It moves as work finishes early or late and as higher-priority work "
    "arrives."
)

_ORDER = {"pending": 0, "requeued": 0, "admitted": 1, "evicted": 2, "finished": 3,
          "deleted": 4}


class EtaSettings(BaseModel):
    """Settings of the start-ETA estimate of pending workloads."""

    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(
        3600, gt=0,
        description="Rolling window (seconds) of the admission rate the naive estimate uses; "
        "one hour, as the queue SLO rules' window.",
    )
    history: int = Field(
        200, ge=1,
        description="Finished workloads' run times kept per queue for the release estimate: "
        "enough for a stable median, small enough to follow a changing mix.",
    )
    reissue_after_s: float = Field(
        600, ge=0,
        description="An estimate is re-published when it moves by more than this (seconds) "
        "and by more than reissue_share of the time left: 10 min is below what a user "
        "plans around, above the noise of jobs ending a little early or late.",
    )
    reissue_share: float = Field(
        0.25, ge=0,
        description="Share of the time left to the previous estimate it must move by too.",
    )
    min_wait_s: float = Field(
        60, ge=0,
        description="A workload gets its first estimate once it has waited this long (seconds): "
        "most are admitted within seconds and never need one, and the fleet agent may read a "
        "summary a moment before the admission that ended a short wait.",
    )


class Running(msgspec.Struct):
    queue: str
    gpus: int
    admitted_at: float
    mig: dict[str, int] = {}
    """MIG devices it holds, by profile."""


class Pending(msgspec.Struct):
    queue: str
    since: float
    gpus: int
    mig: dict[str, int] = {}
    priority: int = 0


class Estimate(msgspec.Struct):
    """The published estimate of one pending workload."""

    open_id: str
    since: float
    queue: str
    eta: float
    first_eta: float
    naive_eta: float | None = None
    first_naive_eta: float | None = None


class EtaState(msgspec.Struct):
    last: dict[str, tuple[float, int]] = {}
    """Per workload, the time and lifecycle rank of the last event applied."""
    pending: dict[str, Pending] = {}
    running: dict[str, Running] = {}
    admissions: dict[str, list[float]] = {}
    """Per queue, admission times in the window, oldest first."""
    durations: dict[str, list[float]] = {}
    """Per queue, run times (seconds) of the last ``history`` finished workloads."""
    estimates: dict[str, Estimate] = {}


def on_queue(state: EtaState, event: QueueEvent, settings: EtaSettings) -> list[Finding]:
    """Apply one queue event; close the workload's estimate when it starts."""
    if event.gang is not None and event.kind == "workload":
        return []  # a gang's Workload: its pods are followed one by one
    key = f"{event.namespace}/{event.name}"
    position = (event.ts, _ORDER[event.state])
    last = state.last.get(key)
    if last is not None and position <= last:
        return []
    state.last[key] = position
    queue = event.cluster_queue
    out: list[Finding] = []
    if event.waiting:
        running = state.running.pop(key, None)
        if key not in state.pending:
            since = event.waiting_since or (
                event.created_at if event.state == "pending"
                and event.created_at is not None and running is None else event.ts)
            state.pending[key] = Pending(queue=queue, since=since, gpus=event.gpus,
                                         mig=dict(event.mig), priority=event.priority or 0)
    elif event.state == "admitted":
        waited = state.pending.pop(key, None)
        admitted_at = event.ts if event.admitted_at is None else event.admitted_at
        state.running[key] = Running(queue=queue, gpus=event.gpus, admitted_at=admitted_at,
                                     mig=dict(event.mig))
        if waited is not None:
            times = state.admissions.setdefault(queue, [])
            bisect.insort(times, admitted_at)
        out += _close(state, key, admitted_at, started=True)
    else:
        state.pending.pop(key, None)
        running = state.running.pop(key, None)
        if running is not None and event.state == "finished":
            runs = state.durations.setdefault(queue, [])
            runs.append(max(0.0, event.ts - running.admitted_at))
            del runs[:-settings.history]
        out += _close(state, key, event.ts, started=False)
    return out


def _close(state: EtaState, key: str, ts: float, *, started: bool,
           why: str = "left the queue") -> list[Finding]:
    estimate = state.estimates.pop(key, None)
    if estimate is None:
        return []
    values = {"eta_ts": estimate.eta, "first_eta_ts": estimate.first_eta}
    if started:
        values |= {"started_ts": ts, "eta_error_s": estimate.eta - ts,
                   "first_eta_error_s": estimate.first_eta - ts}
        if estimate.naive_eta is not None:
            values["naive_eta_error_s"] = estimate.naive_eta - ts
        if estimate.first_naive_eta is not None:
            values["first_naive_eta_error_s"] = estimate.first_naive_eta - ts
    return [Finding(
        id=estimate.open_id, fingerprint=fingerprint(KIND, key), kind=KIND, severity="info",
        state="resolved", subject=_subject(key, estimate.queue),
        summary=f"{key} " + (f"started {_against(ts - estimate.eta)}"
                             if started else why),
        starts_at=estimate.since, ts=ts, ends_at=ts,
        evidence=Evidence(window_start=estimate.since, window_end=ts, values=values),
        runbook=RUNBOOK, labels={"queue": estimate.queue},
    )]


def _against(late_s: float) -> str:
    """When a workload started against its estimate, in words: "12 min after its estimate"."""
    minutes = round(late_s / 60)
    if minutes == 0:
        return "within a minute of its estimate"
    return f"{abs(minutes)} min {'after' if minutes > 0 else 'before'} its estimate"


def _subject(key: str, queue: str) -> Subject:
    namespace, _, name = key.partition("/")
    return Subject(queue=queue, pod=PodRef(namespace=namespace, name=name))


def expected_end(running: Running, durations: Sequence[float], now: float) -> float | None:
    """When ``running`` is expected to end: the median run time of its queue's workloads
    that ran at least as long as it has so far; None without any history."""
    if not durations:
        return None
    age = now - running.admitted_at
    longer = [d for d in durations if d >= age]
    if longer:
        return running.admitted_at + statistics.median(longer)
    # Older than every workload seen: it ends soon or runs on; half its age again is the
    # memoryless guess (the median remaining life of a process past all its peers' ages).
    return now + age / 2


GPUS = "nvidia.com/gpu"
"""The whole GPUs' key among the resources :func:`estimates` counts; the others are MIG
profiles."""


def _counts(gpus: int, mig: dict[str, int]) -> dict[str, int]:
    """Whole GPUs and MIG devices by profile, as the resources :func:`estimates` counts."""
    if not mig:
        return {GPUS: gpus} if gpus > 0 else {}
    return {r: n for r, n in ((GPUS, gpus), *mig.items()) if n > 0}


def available_now(state: EtaState, usable: Sequence[NodeSummary], *, mig: bool = True
                  ) -> dict[str, int]:
    """Whole GPUs, and with ``mig`` MIG devices by profile, free on the ``usable`` nodes
    (healthy, uncordoned), less what the queue admitted since their summaries: the agent
    reads both as they come, and the summaries may trail the queue. MIG devices are
    corrected so only where every MIG node's layout is known (``mig_total``; not from an
    earlier build)."""
    held = sum(run.gpus for run in state.running.values())
    available = {GPUS: max(0, min(sum(s.gpus_free for s in usable),
                                  sum(s.gpus_total for s in usable) - held))}
    if not mig:
        return available
    free: dict[str, int] = {}
    room: dict[str, int] = {}
    layouts = True
    for summary in usable:
        if summary.mig_free or summary.mig_total:
            layouts = layouts and bool(summary.mig_total)
            for profile, count in summary.mig_free.items():
                free[profile] = free.get(profile, 0) + count
            for profile, count in summary.mig_total.items():
                room[profile] = room.get(profile, 0) + count
    if layouts:
        for run in state.running.values():
            for profile, count in run.mig.items():
                room[profile] = room.get(profile, 0) - count
    for profile, count in free.items():
        available[profile] = max(0, min(count, room.get(profile, 0))) if layouts else count
    return available


def estimates(state: EtaState, fleet: FleetView, now: float, settings: EtaSettings,
              nowhere: Collection[str] = ()) -> dict[str, tuple[float | None, float | None, int]]:
    """Per pending workload but those ``nowhere`` (no node could ever hold them): (ETA,
    naive ETA, position in its queue).

    Each resource (whole GPUs, each MIG profile) has its own timeline: the running
    workloads' expected releases of it, taken in queue order. A workload's ETA is when
    every resource it asks for is there for it; one that no known release frees enough of
    falls back to the naive figure, and so does every later one asking for that resource.
    """
    usable = [s for s in fleet.nodes if s.healthy and not s.cordoned]
    largest = max((s.gpus_total for s in usable), default=0)
    available = available_now(state, usable,
                              mig=any(wait.mig for wait in state.pending.values()))
    releases: dict[str, list[tuple[float, int]]] = {}
    for run in state.running.values():
        end = expected_end(run, state.durations.get(run.queue, ()), now)
        if end is not None:
            for resource, count in _counts(run.gpus, run.mig).items():
                releases.setdefault(resource, []).append((max(end, now), count))
    for timeline in releases.values():
        timeline.sort(reverse=True)  # the next release last, to pop
    clocks: dict[str, float] = {}

    def take(resource: str, count: int) -> float | None:
        """When ``count`` of ``resource`` are there, its next releases taken as needed; None
        when no known release frees enough."""
        have, clock = available.get(resource, 0), clocks.get(resource, now)
        timeline = releases.get(resource)
        while have < count and timeline:
            end, freed = timeline.pop()
            have += freed
            if end > clock:
                clock = end
        available[resource], clocks[resource] = have, clock
        return clock if have >= count else None

    blocked: set[str] = set()
    order = sorted(state.pending.items(),
                   key=lambda kv: (-kv[1].priority, kv[1].since, kv[0]))
    positions: dict[str, int] = {}
    out: dict[str, tuple[float | None, float | None, int]] = {}
    for key, wait in order:
        if key in nowhere:
            continue
        position = positions.get(wait.queue, 0)
        positions[wait.queue] = position + 1
        naive = _naive(state, wait.queue, position, now, settings)
        need = _counts(wait.gpus, wait.mig)
        eta: float | None = None
        if need and wait.gpus <= largest and blocked.isdisjoint(need):
            eta = now
            for resource, count in need.items():
                ready = take(resource, count)
                if ready is None:  # no known release frees enough: the rest fall back too
                    blocked.add(resource)
                    eta = None
                    break
                eta = max(eta, ready)
            if eta is not None:
                for resource, count in need.items():
                    available[resource] -= count
        out[key] = (eta if eta is not None else naive, naive, position)
    return out


def _naive(state: EtaState, queue: str, position: int, now: float, settings: EtaSettings
           ) -> float | None:
    """Position ÷ admission rate over the window: the baseline."""
    times = state.admissions.get(queue, [])
    start = bisect.bisect_left(times, now - settings.window_s)
    del times[:start]
    if not times:
        return None
    rate = len(times) / settings.window_s
    return now + (position + 1) / rate


def evaluate(state: EtaState, fleet: FleetView, now: float, settings: EtaSettings
             ) -> list[Finding]:
    horizon = now - settings.window_s
    for key in [k for k, (ts, _) in state.last.items()
                if ts < horizon and k not in state.pending and k not in state.running]:
        del state.last[key]
    out: list[Finding] = []
    if not fleet.nodes:
        return out  # no node known yet (the queue read ahead of the first summaries)
    nowhere = unplaceable(fleet.pending, fleet.nodes).keys() & state.pending.keys()
    for key in nowhere & state.estimates.keys():
        out += _close(state, key, now, started=False,
                      why="gets no estimate: no node of the fleet can hold it")
    for key, (eta, naive, position) in estimates(state, fleet, now, settings,
                                                 nowhere).items():
        if eta is None or not math.isfinite(eta):
            continue
        wait = state.pending[key]
        current = state.estimates.get(key)
        if current is None and now - wait.since < settings.min_wait_s:
            continue
        if current is not None:
            if not moved_enough(current.eta, eta, now, settings.reissue_after_s,
                                settings.reissue_share):
                continue
            current.eta, current.naive_eta = eta, naive
        else:
            fp = fingerprint(KIND, key)
            current = state.estimates[key] = Estimate(
                open_id=finding_id(fp, wait.since), since=wait.since, queue=wait.queue,
                eta=eta, first_eta=eta, naive_eta=naive, first_naive_eta=naive)
        values = {"eta_ts": eta, "eta_in_s": eta - now, "waited_s": now - wait.since,
                  "position": float(position), "gpus": float(wait.gpus)}
        if naive is not None:
            values["naive_eta_ts"] = naive
        out.append(Finding(
            id=current.open_id, fingerprint=fingerprint(KIND, key), kind=KIND,
            severity="info", state="firing", subject=_subject(key, wait.queue),
            summary=f"{key} has waited {(now - wait.since) / 60:.0f} min in {wait.queue} "
            f"(position {position + 1}); expected to start in {(eta - now) / 60:.0f} min",
            starts_at=wait.since, ts=now,
            evidence=Evidence(window_start=wait.since, window_end=now, values=values),
            runbook=RUNBOOK, labels={"queue": wait.queue},
        ))
    return out


RUNNERS = (FleetRunner("eta", EtaState, evaluate, on_queue=on_queue),)
