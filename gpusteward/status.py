"""The fleet now, folded from the contract's topics: what ``gpusteward status`` shows.

:class:`StatusFold` takes the records of the findings, actions,
action-results, node-summaries, allocations and queue topics in any amount
and order of arrival, keeps only the latest state per key (a finding by id,
a node summary by node, a pod by uid or namespace/name, an action by
idempotency key, a workload by namespace/name), exactly as the compacted
topics do, and :meth:`StatusFold.snapshot` turns that into a
:class:`FleetStatus`. It does no I/O and reads no clock (``now`` is passed
in), so tests drive it without a broker and ``--watch`` feeds it
incrementally from a consumer that stays at the topics' ends.

"Busy" here means allocated and not named by an open idle-holder finding:
the pipeline's own verdict, not a fresh utilisation reading (the status
reads no samples, which are the big topic).

Each pending workload is listed with how long it has waited and its start
ETA: the open ``queue_start_eta`` finding the fleet agent keeps for it
(``rules/eta.py``). Those info findings, one per pending workload, are shown
there and not again among the open findings, where a busy queue would bury
everything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from gpusteward.schema import (
    Action,
    ActionResult,
    Finding,
    NodeInventory,
    NodeSummary,
    PodAllocation,
    QueueEvent,
    Subject,
    summary_follows,
)

IDLE_KIND = "idle_holder"
ETA_KIND = "queue_start_eta"
"""The start-ETA findings (rules/eta.py's KIND: the core reads the contract, not rules)."""
# The audit topic's breaker records (the remediation executor writes them, with these
# names; the keys are part of the action-results contract, see
# docs/alerting-remediation.md).
BREAKER_TRIP_PREFIX = "breaker/trip/"
BREAKER_RESET_PREFIX = "breaker/reset/"
BREAKER_CIRCUITS = ("nodes", "reclaims")
"""The breaker's circuits: node-disrupting actions, idle reclaims. A trip or reset record
names its circuit (``breaker/trip/<circuit>/<ms>``, ``breaker/reset/<circuit>/<ms>``); one
that names none (a trip written before the circuits were split, a reset of the whole
breaker) is about both."""


def breaker_circuits(key: str) -> tuple[str, ...]:
    """The circuits the breaker trip or reset record of idempotency ``key`` is about."""
    named = key.split("/")[2] if key.count("/") >= 3 else ""
    return (named,) if named in BREAKER_CIRCUITS else BREAKER_CIRCUITS
TEAM_LABELS = ("team", "gpusteward.io/team", "app.kubernetes.io/part-of")
"""Pod labels naming the owning team, first match wins; else the namespace (as the report)."""
RECENT_ACTIONS = 20
"""Final action outcomes the status lists, newest first."""
HOLDING = frozenset({"bound", "running"})
"""Pod phases in which a pod holds its GPUs."""


class PoolStatus(msgspec.Struct):
    """One GPU model's nodes: GPUs in total, allocated to pods, and of those busy."""

    pool: str
    nodes: int
    gpus: int
    allocated: int
    busy: int
    unhealthy_nodes: int
    cordoned_nodes: int


class TeamStatus(msgspec.Struct):
    """GPUs held by a team's running pods, and how many of them the idle rule names."""

    team: str
    pods: int
    allocated: int
    busy: int
    idle: int


class OpenFinding(msgspec.Struct):
    id: str
    kind: str
    severity: str
    subject: str
    summary: str
    starts_at: float
    age_s: float


class ActionStatus(msgspec.Struct):
    """An action; ``outcome`` None while no final result is on the audit topic."""

    idempotency_key: str
    verb: str
    target: str
    rule: str
    ts: float
    dry_run: bool
    outcome: str | None = None
    detail: str = ""
    attempts: int = 0


class BreakerStatus(msgspec.Struct):
    open: bool = False
    since: float | None = None
    reason: str = ""
    circuits: list[str] = []
    """The open circuits: ``nodes`` (node-disrupting actions), ``reclaims`` (idle reclaims)."""


class QueueStatus(msgspec.Struct):
    """Workloads waiting in one cluster queue, and the longest wait so far (seconds)."""

    cluster_queue: str
    pending: int
    pending_gpus: int
    longest_wait_s: float


class PendingStatus(msgspec.Struct):
    """A pending workload: how long it has waited and when it is expected to start."""

    workload: str
    """namespace/name."""
    cluster_queue: str
    gpus: int
    waited_s: float
    eta_ts: float | None = None
    """Expected start (Unix seconds); None while no estimate is published."""
    naive_eta_ts: float | None = None
    """The baseline estimate (position ÷ the queue's admission rate), when known."""
    position: int | None = None
    """1-based place in its queue when the estimate was made."""


class FleetStatus(msgspec.Struct):
    ts: float
    pools: list[PoolStatus]
    teams: list[TeamStatus]
    findings: list[OpenFinding]
    pending_actions: list[ActionStatus]
    recent_actions: list[ActionStatus]
    breaker: BreakerStatus
    queues: list[QueueStatus]
    lag: dict[str, dict[str, int]] = {}
    """Consumer group -> topic -> records not yet committed."""
    pending: list[PendingStatus] = []
    """Pending workloads, soonest expected start first (no estimate last)."""


def describe(subject: Subject) -> str:
    """A subject as one short string: pod, else device on node, else node, else queue."""
    if subject.pod is not None:
        where = f" on {subject.node}" if subject.node else ""
        return f"{subject.pod.namespace}/{subject.pod.name}{where}"
    if subject.device and subject.node:
        return f"{subject.node}/{subject.device}"
    return subject.node or subject.queue or subject.device or "fleet"


def _pod_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


class StatusFold:
    """The latest state per key of every topic the status reads."""

    def __init__(self, team_labels: Sequence[str] = TEAM_LABELS) -> None:
        self.team_labels = tuple(team_labels)
        self.findings: dict[str, Finding] = {}
        self.actions: dict[str, Action] = {}
        self.results: dict[str, ActionResult] = {}
        self.attempts: dict[str, int] = {}
        self.summaries: dict[str, NodeSummary] = {}
        self.inventory: dict[str, NodeInventory] = {}
        self.pods: dict[str, PodAllocation] = {}
        self.workloads: dict[str, QueueEvent] = {}
        self.breaker = BreakerStatus()
        self._tripped: dict[str, tuple[float, str]] = {}
        """Open breaker circuit -> (when it tripped, why)."""

    # -- folding ---------------------------------------------------------------------------

    def finding(self, finding: Finding) -> None:
        known = self.findings.get(finding.id)
        # A redelivered older record must not reopen a resolved finding.
        if known is None or finding.ts >= known.ts:
            self.findings[finding.id] = finding

    def action(self, action: Action) -> None:
        self.actions.setdefault(action.idempotency_key, action)

    def _breaker_record(self, key: str, result: ActionResult) -> None:
        """Fold a breaker trip or reset: each circuit is open from its first trip to the
        next reset of it."""
        for circuit in breaker_circuits(key):
            if key.startswith(BREAKER_TRIP_PREFIX):
                self._tripped.setdefault(circuit, (result.ts, result.detail))
            else:
                self._tripped.pop(circuit, None)
        if not self._tripped:
            self.breaker = BreakerStatus(open=False, since=result.ts, reason=result.detail)
            return
        open_ = sorted(self._tripped.items(), key=lambda item: item[1][0])
        self.breaker = BreakerStatus(
            open=True, since=open_[0][1][0], reason="; ".join(why for _, (_, why) in open_),
            circuits=[circuit for circuit, _ in open_])

    def result(self, result: ActionResult) -> None:
        key = result.idempotency_key
        if key.startswith((BREAKER_TRIP_PREFIX, BREAKER_RESET_PREFIX)):
            self._breaker_record(key, result)
            return
        self.attempts[key] = max(self.attempts.get(key, 0), result.attempt)
        if result.outcome != "retrying":
            self.results[key] = result

    def summary(self, summary: NodeSummary) -> None:
        known = self.summaries.get(summary.node)
        if known is None or summary_follows(summary, known.ts, known.clock_steps) or (
                summary.ts, summary.clock_steps) == (known.ts, known.clock_steps):
            self.summaries[summary.node] = summary

    def allocation(self, event: PodAllocation | NodeInventory) -> None:
        if isinstance(event, NodeInventory):
            if event.deleted:
                self.inventory.pop(event.node, None)
            else:
                self.inventory[event.node] = event
            return
        key = event.pod.uid or _pod_key(event.pod.namespace, event.pod.name)
        if event.phase in HOLDING:
            self.pods[key] = event
        else:
            self.pods.pop(key, None)

    def queue(self, event: QueueEvent) -> None:
        key = _pod_key(event.namespace, event.name)
        if event.state == "pending" and event.active:
            known = self.workloads.get(key)
            self.workloads[key] = event if known is None or known.ts <= event.ts else known
        else:
            self.workloads.pop(key, None)

    # -- the view --------------------------------------------------------------------------

    def team(self, pod: PodAllocation) -> str:
        for label in self.team_labels:
            if pod.labels.get(label):
                return pod.labels[label]
        return pod.pod.namespace

    def pool(self, node: str) -> str:
        summary = self.summaries.get(node)
        if summary is not None and summary.gpu_model:
            return summary.gpu_model
        inventory = self.inventory.get(node)
        return (inventory.gpu_product if inventory else None) or "unknown"

    def open_findings(self) -> list[Finding]:
        return [f for f in self.findings.values() if f.state == "firing"]

    def _idle_gpus(self, open_findings: Iterable[Finding]) -> dict[str, int]:
        """Pod key -> GPUs the idle rule names (its devices, else all the pod's GPUs)."""
        devices: dict[str, set[str]] = {}
        for finding in open_findings:
            pod = finding.subject.pod
            if finding.kind != IDLE_KIND or pod is None:
                continue
            held = self.pods.get(pod.uid or "") or self.pods.get(_pod_key(pod.namespace,
                                                                          pod.name))
            if held is None:
                continue
            key = held.pod.uid or _pod_key(held.pod.namespace, held.pod.name)
            devices.setdefault(key, set()).add(finding.subject.device or "*")
        idle: dict[str, int] = {}
        for key, named in devices.items():
            gpus = self.pods[key].gpus
            idle[key] = gpus if "*" in named else min(gpus, len(named))
        return idle

    def _pending(self, open_findings: Iterable[Finding], now: float) -> list[PendingStatus]:
        etas: dict[str, Finding] = {}
        for finding in open_findings:
            pod = finding.subject.pod
            if finding.kind == ETA_KIND and pod is not None:
                etas[_pod_key(pod.namespace, pod.name)] = finding
        out = []
        for key, event in self.workloads.items():
            entry = PendingStatus(key, event.cluster_queue, event.gpus,
                                  max(0.0, now - (event.created_at or event.ts)))
            estimate = etas.get(key)
            if estimate is not None and estimate.evidence is not None:
                values = estimate.evidence.values
                entry.eta_ts = values.get("eta_ts")
                entry.naive_eta_ts = values.get("naive_eta_ts")
                if "position" in values:
                    entry.position = int(values["position"]) + 1
            out.append(entry)
        return sorted(out, key=lambda p: (p.eta_ts is None, p.eta_ts or 0.0, -p.waited_s,
                                          p.workload))

    def snapshot(self, now: float, lag: dict[str, dict[str, int]] | None = None
                 ) -> FleetStatus:
        open_findings = self.open_findings()
        pending_workloads = self._pending(open_findings, now)
        idle = self._idle_gpus(open_findings)
        teams: dict[str, TeamStatus] = {}
        idle_by_node: dict[str, int] = {}
        for key, pod in self.pods.items():
            team = teams.setdefault(self.team(pod), TeamStatus(self.team(pod), 0, 0, 0, 0))
            team.pods += 1
            team.allocated += pod.gpus
            team.idle += idle.get(key, 0)
            idle_by_node[pod.node] = idle_by_node.get(pod.node, 0) + idle.get(key, 0)
        for team in teams.values():
            team.busy = team.allocated - team.idle
        pools: dict[str, PoolStatus] = {}
        for node, summary in self.summaries.items():
            if summary.deleted:
                continue  # the node's tombstone, kept so that no older summary revives it
            name = self.pool(node)
            pool = pools.setdefault(name, PoolStatus(name, 0, 0, 0, 0, 0, 0))
            allocated = summary.gpus_total - summary.gpus_free
            pool.nodes += 1
            pool.gpus += summary.gpus_total
            pool.allocated += allocated
            pool.busy += max(0, allocated - idle_by_node.get(node, 0))
            pool.unhealthy_nodes += not summary.healthy
            pool.cordoned_nodes += summary.cordoned
        findings = sorted(
            (OpenFinding(f.id, f.kind, f.severity, describe(f.subject), f.summary, f.starts_at,
                         max(0.0, now - f.starts_at)) for f in open_findings
            if f.kind != ETA_KIND),
            key=lambda f: (("critical", "warning", "info").index(f.severity), f.starts_at))
        pending, recent = [], []
        for key, action in self.actions.items():
            result = self.results.get(key)
            entry = ActionStatus(key, action.verb, describe(action.target), action.rule,
                                 action.ts, action.dry_run, attempts=self.attempts.get(key, 0))
            if result is None:
                pending.append(entry)
            else:
                entry.outcome, entry.detail, entry.ts = result.outcome, result.detail, result.ts
                recent.append(entry)
        queues: dict[str, QueueStatus] = {}
        for event in self.workloads.values():
            queue = queues.setdefault(event.cluster_queue,
                                      QueueStatus(event.cluster_queue, 0, 0, 0.0))
            queue.pending += 1
            queue.pending_gpus += event.gpus
            queue.longest_wait_s = max(queue.longest_wait_s,
                                       now - (event.created_at or event.ts))
        return FleetStatus(
            ts=now,
            pools=sorted(pools.values(), key=lambda p: p.pool),
            teams=sorted(teams.values(), key=lambda t: (-t.allocated, t.team)),
            findings=findings,
            pending_actions=sorted(pending, key=lambda a: a.ts),
            recent_actions=sorted(recent, key=lambda a: -a.ts)[:RECENT_ACTIONS],
            breaker=self.breaker,
            queues=sorted(queues.values(), key=lambda q: -q.longest_wait_s),
            lag=lag or {},
            pending=pending_workloads,
        )
