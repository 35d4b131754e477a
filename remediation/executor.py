"""Remediation: actions become changes to the cluster, carefully.

The executor reads the actions topic and, for each action, decides and
records one outcome on the audit topic (``action-results``):

- ``dry_run``: the executor is not in execute mode (the default), the
  action's rule is not enabled for execution (:class:`RemediationSettings`
  ``enabled_rules``), or the action asked only for a dry run; the audit says
  what would have happened;
- ``skipped``: the idempotency key was already executed (a redelivery), the
  backend found the effect already in place (the node was cordoned), or another
  key drained the node within ``drain_interval_s`` (one drain per GPU finding);
- ``refused``: a guard said no: the target is on a deny-list, MIG relabels
  are not allowed by policy, the action is older than ``max_action_age_s``
  (a backlog replayed after an outage; such a refusal of an action that would
  have been carried out is also counted in ``gpusteward_actions_stale_total``
  for the operator's alert; the worker asks again for a node action of a
  hardware finding every ``reask_s`` while the finding stays open, and the
  fresh re-ask is decided as any action), an idle reclaim's owner was not told
  ``min_notice_s`` before, the backend lacks the verb, or the circuit breaker
  is open;
- ``executed`` / ``failed``: the backend carried it out, or could not;
- ``retrying``: one attempt met a temporary error (an API 503 or 429, a
  timeout, a refused connection: :class:`~gpusteward.errors.TemporaryError`)
  and the executor tries again after a backoff (exponential from
  ``retry_backoff_s``, never shorter than the server's ``Retry-After``), at
  most ``retry_attempts`` tries and ``retry_budget_s`` seconds of waiting;
  each such record carries its attempt number and the error, and the last
  record of the action its final outcome. A permanent error (a 404, a 422,
  any error that is not temporary) is a final ``failed`` at once.

A re-ask (``Action.reask`` > 0: the same idempotency key asked for again
while its finding stays open) that the executor decides as it last decided
that key (skipped because executed, the same dry run, the same refusal; a
stale refusal whatever its age), touching nothing, writes no audit record: it
is counted in ``gpusteward_actions_reasked_total`` and logged at debug. The
last decision of each node action's key is rebuilt from the audit topic with
the rest, so a restarted executor stays as quiet.

Guards, in the order they are checked: idempotency, deny-lists, the MIG
policy, dry-run, the action's age, an idle reclaim's notice, the circuit
breaker, then the backend. The guards are pure given the executor's clock
(:meth:`Executor.verdict`); only the backend call and the fleet size are I/O.

Time is the executor's ``clock`` (the wall clock in production), compared with
the action's event time (``Action.ts``, the finding's: when the samples were
taken) for the age, and with the executor's own audit times for the notice: an
owner notice counts from when it was delivered, not from when the rule asked
for it, so a replayed backlog cannot notify and reclaim back to back.

The breaker has two circuits over one sliding window. ``nodes`` counts distinct
nodes disrupted (cordon, taint, drain, MIG relabel) and refuses a new node once
the window holds ``breaker_max_nodes`` nodes or ``breaker_max_fraction`` of the
GPU nodes; ``reclaims`` counts idle reclaims and refuses one more once the
window holds ``breaker_max_reclaims`` or ``breaker_max_reclaims_per_node`` per
GPU node (telemetry reporting 0 % activity fleet-wide would otherwise stop
every notebook in one pass). A tripped circuit stays open, refusing what it
counts, until an operator resets it or the whole breaker (``gpusteward act
--reset-breaker [--circuit nodes|reclaims]``), and publishes a
``remediation_breaker`` finding so someone is told. The circuits trip apart:
an idle storm (a holiday, telemetry at 0 %) must not leave a failing GPU
uncordoned until someone resets the breaker, nor a driver roll-out's cordons
stop the reclaims of idle notebooks.

State survives restarts through the audit topic alone: on start the executor
reads it and rebuilds the executed idempotency keys, the owners notified and
when, the nodes disrupted and the reclaims in the current window and the
breaker's state. Breaker transitions are audit
records of their own (idempotency key ``breaker/trip/...`` or
``breaker/reset/...``, verb ``cordon``), so downstream readers of the topic
see them as ordinary results. While running, the executor follows the audit
topic and folds every record into the same state: the CLI's resets, and the
decisions and trips of any other executor running at once (a pod on a lost node
still running beside its replacement, a scale to 2), so the limits, the notice
lead and the idempotency keys are fleet-wide, whatever the number of executors.
Before it carries an action out it reads the topic to its end; what stays open is
an action another executor is carrying out at that instant (at most one per other
executor: each acts on one action at a time), see docs/alerting-remediation.md.

Malformed action records (refused at :mod:`gpusteward.edge`) and any action
whose handling raises go to the dead-letter topic with the reason.
Backends are pluggable; the simulator backend acts on the fleet simulator
and is a sandbox (nothing real changes), so per-rule enablement does not
gate it; the Kubernetes backend lives in ``kubernetes.py``, the simulator's in
:mod:`gpusteward.sandbox.backend`.

It stays one module: guards, breaker, retries and the audit are one decision per action,
in the order the module docstring lists.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import msgspec
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console
from rich.markup import escape

from gpusteward import edge, kafka, topics
from gpusteward.errors import TemporaryError, cut
from gpusteward.metrics import PipelineMetrics, lag_followed, serve
from gpusteward.rules import REGISTRY, REMEDIATION_BREAKER
from gpusteward.rules.findings import finding_id, fingerprint
from gpusteward.rules.idle import RECLAIM_REASON, rfc3339
from gpusteward.rules.registry import ALL_RULES
from gpusteward.schema import (
    RESTORE_KEY_PREFIX,
    TEXT_MAX,
    Action,
    ActionResult,
    Finding,
    Outcome,
    Subject,
)
from gpusteward.settings import Settings
from gpusteward.status import BREAKER_CIRCUITS as CIRCUITS
from gpusteward.status import BREAKER_RESET_PREFIX, BREAKER_TRIP_PREFIX, breaker_circuits

log = logging.getLogger(__name__)

NODE_DISRUPTING = frozenset({"cordon", "taint", "drain", "set_mig_config"})
"""Verbs that take capacity away from a node: what the circuit breaker counts."""
BREAKER_KIND = REMEDIATION_BREAKER
NODES_CIRCUIT, RECLAIMS_CIRCUIT = CIRCUITS
_CIRCUIT_WORDS = {NODES_CIRCUIT: "node actions", RECLAIMS_CIRCUIT: "idle reclaims"}
MAX_AUDIT_DETAIL = TEXT_MAX
"""Longest detail an audit record carries (the schema's free text)."""
NOTICE_KEY = "/notify_owner"
"""What follows the finding id in the idempotency key of an owner notice (``action_for``)."""
RECLAIM_KEY = "/requeue"
"""What follows the finding id in the idempotency key of a reclaim (``action_for``)."""
FORGET_EVERY = 10_000
"""New idempotency keys between two passes that forget those older than the audit topic's
retention."""
CATCH_UP_S = 5.0
"""Longest wait, seconds, to read the audit topic to its end before carrying an action out
(:meth:`Executor._catch_up`): a few fetches on a healthy broker."""


def _may_have_acted(outcome: Outcome, attempt: int) -> bool:
    """Whether a decision may have changed the cluster, for the circuit breaker.

    Executed, and also failed (a drain cordons before an eviction a budget blocks; a write
    may land although its reply was lost), and skipped on a retry (the earlier try did it):
    a breaker that counts one too many stops early, one that counts too few lets a bad
    rule or bad telemetry go on disrupting nodes or stopping work.
    """
    return outcome in ("executed", "failed") or (outcome == "skipped" and attempt > 1)


def _disrupted(verb: str, outcome: Outcome, attempt: int) -> bool:
    """Whether a decision may have taken capacity from its node."""
    return verb in NODE_DISRUPTING and _may_have_acted(outcome, attempt)


_STALE_PREFIXES = ("stale: ", "asked for at ")
"""How the details of the age guard's refusals start (:meth:`Executor._age_refusal`)."""


DRAINED_PREFIX = "drained with "
"""How the detail of a drain skipped for another key's drain of its node starts."""


def _decision(outcome: Outcome, detail: str) -> str:
    """What a re-ask's decision must differ in from its key's last to be audited again: the
    outcome and its detail, a refusal as stale (or skewed) whatever the age it names, a
    drain skipped for another key's drain of its node whatever the key and time it names."""
    if outcome == "refused" and detail.startswith(_STALE_PREFIXES):
        return "refused: stale"
    if outcome == "skipped" and detail.startswith(DRAINED_PREFIX):
        return "skipped: drained with another key"
    return f"{outcome}: {detail}"


def _is_reclaim(action: Action) -> bool:
    return action.verb == "requeue" and action.params.get("reason") == RECLAIM_REASON


def known_rules(names: Iterable[str]) -> set[str]:
    """``names`` as a set, each a registered rule, a finding kind one emits, or ``*``;
    otherwise :class:`~gpusteward.rules.UnknownRuleError` (a ValueError) lists the valid."""
    names = set(names)
    REGISTRY.enabled_kinds(names)
    return names


class RemediationSettings(BaseSettings):
    """Guards of the remediation executor.

    Read from ``GPUSTEWARD_REMEDIATION__*`` (e.g.
    ``GPUSTEWARD_REMEDIATION__ENABLED_RULES='["ecc_dbe"]'``); CLI flags override.
    """

    model_config = SettingsConfigDict(env_prefix="GPUSTEWARD_REMEDIATION__",
                                      env_nested_delimiter="__", extra="ignore",
                                      env_parse_none_str="null")

    enabled_rules: set[str] = Field(
        default_factory=set,
        description="Rules whose actions are carried out in execute mode; every other rule's "
        "actions are only dry-run. Empty by default so that switching to --execute changes "
        "nothing until rules are enabled one by one. '*' enables all. A rule's name enables "
        "every finding kind it emits (xid: also xid_rma); a kind's name enables that kind. "
        "An unknown name is an error that lists the valid ones.",
    )

    @field_validator("enabled_rules")
    @classmethod
    def _known_rules(cls, names: set[str]) -> set[str]:
        return known_rules(names)

    def enables(self, kind: str) -> bool:
        """Whether the actions of findings of ``kind`` are carried out in execute mode."""
        enabled = REGISTRY.enabled_kinds(self.enabled_rules)
        return ALL_RULES in enabled or kind in enabled
    breaker_window_s: float = Field(
        600.0, gt=0, description="Sliding window of the circuit breaker, seconds (10 min).")
    breaker_max_fraction: float = Field(
        0.10, gt=0, le=1,
        description="Most GPU nodes disrupted per window, as a fraction of the GPU nodes "
        "(rounded up, so a small fleet may still lose one node). 10 %: a real fault hits few "
        "nodes at once; half the fleet at once is a bad driver, a bad rule or bad data.",
    )
    breaker_max_nodes: int = Field(
        20, ge=1, description="Most nodes disrupted per window whatever the fleet size.")
    breaker_max_reclaims: int = Field(
        50, ge=1,
        description="Most idle reclaims (requeue with params.reason idle-reclaim) per window "
        "whatever the fleet size; one more trips the breaker. 50 per 10 min: a 10,000-GPU "
        "fleet's ladder reclaims a few hundred GPUs a day, a handful per window; telemetry "
        "reporting 0 % activity fleet-wide asks for thousands at once.",
    )
    breaker_max_reclaims_per_node: float = Field(
        1.0, gt=0,
        description="Most idle reclaims per window per GPU node (rounded up): one per node, "
        "an eighth of an 8-GPU fleet's GPUs, so a small fleet is guarded too (10 nodes: 10 "
        "per window). Applies when the GPU node count is known (fleet_gpu_nodes or the "
        "backend).",
    )
    max_action_age_s: float | None = Field(
        3600.0, gt=0,
        description="Oldest action carried out, seconds between its event time (Action.ts, "
        "its finding's) and the executor's clock; an older one is refused and audited. 1 h: "
        "the pipeline acts within seconds, so an older action is a backlog replayed after "
        "an outage, whose finding may have resolved since and whose owner notice and "
        "reclaim would land back to back. An action further than this ahead of the "
        "executor's clock is refused too: its event time is skewed, its age unknowable. "
        "None (null in the environment): no limit, for a simulation whose event time is "
        "not the executor's clock.",
    )
    min_notice_s: float | None = Field(
        1800.0, ge=0,
        description="Least time, seconds by the executor's clock, between the delivery of "
        "the first owner notice of an idle episode and its reclaim; an earlier reclaim is "
        "refused, and the rule does not ask again, so the GPU stays with its owner for the "
        "episode. 30 min: at most the shortest wait the shipped ladders promise (batch: 1 h "
        "steps; demand-aware reclaim: notice at 30 min idle, reclaim at 2 h), enough for an "
        "owner to read the notice. Keep it below the smallest reclaim_after_s of your "
        "policy. None (null in the environment) or 0: only a delivered notice is required.",
    )
    fleet_gpu_nodes: int | None = Field(
        None, ge=1,
        description="GPU nodes in the fleet for the fractional limit; None asks the backend "
        "(the Kubernetes backend lists nodes) and, when it cannot tell, uses only the "
        "absolute limit.",
    )
    deny_namespaces: set[str] = Field(
        default_factory=lambda: {"kube-system"},
        description="Namespaces (glob patterns) whose pods are never acted on; drains leave "
        "their pods in place.",
    )
    drain_bare_pods: bool = Field(
        False, description="Whether a drain evicts pods without a controller, which nothing "
        "recreates (kubectl drain's --force). Off: the drain leaves them and names them.")
    drain_emptydir_pods: bool = Field(
        False, description="Whether a drain evicts pods with emptyDir volumes, whose data is "
        "lost (kubectl drain's --delete-emptydir-data). Off: the drain leaves them and names "
        "them.")
    deny_nodes: set[str] = Field(
        default_factory=set, description="Nodes (glob patterns) that are never acted on.")
    allow_mig_config: bool = Field(
        False, description="Whether set_mig_config may relabel nodes (it restarts the GPU "
        "Operator's MIG manager on the node and evicts its GPU pods).")
    drain_interval_s: float = Field(
        300.0, ge=0,
        description="Least seconds between two drains of one node, whatever the keys asking: "
        "the worker asks for a drain per GPU finding (eight for a node whose GPUs all fell "
        "off the bus) and again every reask_s (10 min) while they stay open, and each drain "
        "a PodDisruptionBudget blocks waits drain_timeout_s (4 min) and tells the blocked "
        "pods' owners. A drain of a node drained (executed or failed) within this is skipped, "
        "audited as such. 5 min, half of reask_s: each round of re-asks drains once. 0: "
        "every key drains.")
    retry_attempts: int = Field(
        5, ge=1, description="Most tries of one action whose backend calls fail with a "
        "temporary error (503, 429, timeout), the first included; 1 never retries. Five tries "
        "with the default backoff wait 1+2+4+8 = 15 s, past an API-server restart or a "
        "leader election.")
    retry_backoff_s: float = Field(
        1.0, gt=0, description="Wait after the first temporary error, seconds; doubles after "
        "each try up to retry_backoff_max_s. A server's Retry-After, when longer, wins.")
    retry_backoff_max_s: float = Field(
        30.0, gt=0, description="Longest wait between two tries, seconds.")
    retry_budget_s: float = Field(
        60.0, gt=0, description="Most seconds spent waiting between the tries of one action; "
        "a wait that would pass it ends the action as failed instead. Well below the Kafka "
        "consumer's max poll interval (5 min), which a drain's own wait also spends.")


class Backend(Protocol):
    """Carries out verbs on a cluster.

    A backend implements a verb as an async method of the verb's name
    (``cordon``, ``notify_owner``, ...) that takes the action and returns
    (outcome, detail); a verb it lacks is refused. It may also offer
    ``async gpu_node_count() -> int | None`` for the breaker's fractional
    limit, and set ``sandbox = True`` when nothing it does is real.
    """

    name: str


class NoBackend:
    """No cluster connected: every verb is refused (useful with ``--dry-run`` reviews)."""

    name = "none"


def _where(target: Subject) -> str:
    if target.node:
        return target.node
    if target.pod:
        return f"{target.pod.namespace}/{target.pod.name}"
    return target.queue or "?"


def describe(action: Action) -> str:
    """What an action would do, in words, for dry runs and reviews."""
    where = _where(action.target)
    params = action.params
    verbs = {
        "cordon": f"cordon node {where} (spec.unschedulable=true)",
        "taint": f"taint node {where} with {params.get('key', 'gpusteward.io/unhealthy')}:"
                 f"{params.get('effect', 'NoSchedule')}",
        "drain": f"drain node {where}: cordon it, then evict its pods through the Eviction API "
                 "(PodDisruptionBudgets respected; DaemonSet, mirror and finished pods "
                 "left, and pods without a controller or with emptyDir volumes unless "
                 "allowed)",
        "requeue": f"requeue {where}: deactivate and reactivate its Kueue workload, or delete "
                   "the pod of a plain Job so its controller recreates it"
                   if params.get("reason") != RECLAIM_REASON else
                   f"reclaim the GPUs of {where} through its owner (stop a Kubeflow Notebook, "
                   "scale a Deployment or StatefulSet to 0, requeue a Job or Kueue workload; "
                   "undo with `gpusteward act --restore KIND/NAMESPACE/NAME`)",
        "notify_owner": f"notify the owner of {where} (a Kubernetes Event and an annotation)",
        "set_mig_config": f"set nvidia.com/mig.config={params.get('config', '?')} on node {where}",
    }
    return f"would {verbs.get(action.verb, f'{action.verb} {where}')} because: {action.reason}"


class ReviewPrinter:
    """Prints one readable line per decision, for operators reviewing before enabling a rule."""

    STYLE = {"executed": "bold green", "dry_run": "cyan", "skipped": "dim",
             "refused": "bold yellow", "failed": "bold red", "retrying": "yellow"}

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)

    def __call__(self, action: Action, result: ActionResult) -> None:
        # Every field from a record is escaped: a rule or pod name with brackets is markup.
        self.console.print(
            f"[{self.STYLE[result.outcome]}]{result.outcome.upper():8}[/] "
            f"{action.verb:14} {escape(_where(action.target)):30} "
            f"[dim]rule={escape(action.rule)}[/] {escape(result.detail)}")


def matches(name: str | None, patterns: set[str]) -> bool:
    """Whether ``name`` matches one of the deny-list's glob ``patterns``."""
    return name is not None and any(fnmatch.fnmatchcase(name, p) for p in patterns)


class CircuitBreaker:
    """Counts distinct nodes disrupted and idle reclaims per window; each circuit trips open
    on its own and stays open until reset."""

    def __init__(self, settings: RemediationSettings) -> None:
        self.settings = settings
        self.disrupted: dict[str, float] = {}
        """Node -> when it was last disrupted, within the window."""
        self.reclaimed: dict[str, float] = {}
        """Idempotency key of an idle reclaim -> when it was carried out, within the window."""
        self.tripped: dict[str, tuple[float, str]] = {}
        """Open circuit -> (when it tripped, why)."""

    @property
    def open(self) -> bool:
        """Whether any circuit is open."""
        return bool(self.tripped)

    def is_open(self, circuit: str) -> bool:
        return circuit in self.tripped

    def limit(self, gpu_nodes: int | None) -> int:
        """Most distinct nodes per window for a fleet of ``gpu_nodes`` GPU nodes."""
        if gpu_nodes is None:
            return self.settings.breaker_max_nodes
        by_fraction = math.ceil(self.settings.breaker_max_fraction * gpu_nodes)
        return max(1, min(self.settings.breaker_max_nodes, by_fraction))

    def reclaim_limit(self, gpu_nodes: int | None) -> int:
        """Most idle reclaims per window for a fleet of ``gpu_nodes`` GPU nodes."""
        if gpu_nodes is None:
            return self.settings.breaker_max_reclaims
        per_node = math.ceil(self.settings.breaker_max_reclaims_per_node * gpu_nodes)
        return max(1, min(self.settings.breaker_max_reclaims, per_node))

    def _expire(self, now: float) -> None:
        horizon = now - self.settings.breaker_window_s
        self.disrupted = {n: ts for n, ts in self.disrupted.items() if ts > horizon}
        self.reclaimed = {k: ts for k, ts in self.reclaimed.items() if ts > horizon}

    def _refuse_open(self, circuit: str) -> tuple[bool, str]:
        since, reason = self.tripped[circuit]
        return False, (f"circuit breaker ({_CIRCUIT_WORDS[circuit]}) open since "
                       f"{time.ctime(since)}: {reason}; reset with `gpusteward act "
                       f"--reset-breaker --circuit {circuit}`")

    def admits(self, node: str, now: float, gpu_nodes: int | None) -> tuple[bool, str]:
        """Whether disrupting ``node`` now is allowed; trips the nodes circuit when it is not."""
        if self.is_open(NODES_CIRCUIT):
            return self._refuse_open(NODES_CIRCUIT)
        self._expire(now)
        if node in self.disrupted:
            return True, ""
        limit = self.limit(gpu_nodes)
        if len(self.disrupted) + 1 > limit:
            fleet = f" of {gpu_nodes} GPU nodes" if gpu_nodes else ""
            return self._trip_refusing(now, NODES_CIRCUIT, (
                f"{len(self.disrupted)} nodes{fleet} already disrupted in the last "
                f"{self.settings.breaker_window_s:g} s (limit {limit}); refused {node}"))
        return True, ""

    def admits_reclaim(self, key: str, now: float, gpu_nodes: int | None) -> tuple[bool, str]:
        """Whether the idle reclaim ``key`` may go ahead now; trips the reclaims circuit
        when not."""
        if self.is_open(RECLAIMS_CIRCUIT):
            return self._refuse_open(RECLAIMS_CIRCUIT)
        self._expire(now)
        if key in self.reclaimed:  # a retry of one already counted
            return True, ""
        limit = self.reclaim_limit(gpu_nodes)
        if len(self.reclaimed) + 1 > limit:
            fleet = f" on {gpu_nodes} GPU nodes" if gpu_nodes else ""
            return self._trip_refusing(now, RECLAIMS_CIRCUIT, (
                f"{len(self.reclaimed)} idle reclaims{fleet} already in the last "
                f"{self.settings.breaker_window_s:g} s (limit {limit}); refused {key}"))
        return True, ""

    def _trip_refusing(self, now: float, circuit: str, reason: str) -> tuple[bool, str]:
        self.trip(now, reason, circuit)
        return False, f"circuit breaker ({_CIRCUIT_WORDS[circuit]}) tripped: {reason}"

    def record(self, node: str, ts: float) -> None:
        self.disrupted[node] = max(ts, self.disrupted.get(node, 0.0))

    def record_reclaim(self, key: str, ts: float) -> None:
        self.reclaimed[key] = max(ts, self.reclaimed.get(key, 0.0))

    def trip(self, now: float, reason: str, circuit: str) -> None:
        """Open ``circuit``; one already open stays open since its first trip."""
        self.tripped.setdefault(circuit, (now, reason))

    def reset(self, circuit: str | None = None) -> None:
        """Close ``circuit`` (None: every circuit) and forget what it counted in the window
        (an operator's reset)."""
        if circuit in (None, NODES_CIRCUIT):
            self.tripped.pop(NODES_CIRCUIT, None)
            self.disrupted.clear()
        if circuit in (None, RECLAIMS_CIRCUIT):
            self.tripped.pop(RECLAIMS_CIRCUIT, None)
            self.reclaimed.clear()


Attempt = Callable[[ActionResult], Awaitable[None]]
"""Called with the audit record of each try that will be retried (outcome ``retrying``)."""


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {cut(str(error))}"


class Executor:
    """Consumes actions, decides, acts through a backend and audits every decision."""

    def __init__(self, settings: Settings, backend: Backend, *, execute: bool = False,
                 group_id: str | None = None, actor: str = "gpusteward-executor",
                 on_result: Callable[[Action, ActionResult], None] | None = None,
                 remediation: RemediationSettings | None = None,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.settings = settings
        self.backend = backend
        self.execute = execute
        self.group_id = group_id or f"{settings.topic_prefix}-remediation"
        self.actor = f"{actor}/{backend.name}"
        self.on_result = on_result
        self.remediation = remediation if remediation is not None else RemediationSettings()
        self.clock = clock
        self._sleep = sleep
        self.breaker = CircuitBreaker(self.remediation)
        self.executed_keys: set[str] = set()
        self.decided: dict[str, str] = {}
        """Idempotency key of a node action (the verbs the worker asks for again) -> its
        last final decision (:func:`_decision`), to tell a re-ask that changes nothing."""
        self.drained: dict[str, tuple[float, str]] = {}
        """Node -> when (executor's clock) and under which key it was last drained (executed
        or failed: the backend was asked), for ``drain_interval_s``."""
        self.notified: dict[str, float] = {}
        """Finding -> when (executor's clock) its first owner notice was delivered (executed,
        or found already there)."""
        self._heard: dict[str, float] = {}
        """Idempotency key -> the time of its latest final decision: the three above forget
        what the audit topic no longer keeps (:meth:`_forget_old`)."""
        self._forget_at = FORGET_EVERY
        self.sandbox = bool(getattr(backend, "sandbox", False))
        self._decode = edge.Edge[Action](Action)
        self._decode_result = edge.Edge[ActionResult](ActionResult)
        self.refusals = edge.Refusals(log)
        """Actions dead-lettered and audit records skipped, by kind."""
        self._encode = msgspec.json.Encoder().encode
        self._audit_topic = topics.ACTION_RESULTS.name(settings)
        self._pending_findings: list[Finding] = []
        self._fleet_cache: tuple[float, int | None] | None = None
        self._audit: Any = None
        """The reader following the audit topic while :meth:`run` runs."""
        self.metrics = PipelineMetrics()

    # -- state from the audit topic -------------------------------------------------------

    async def load_history(self) -> None:
        """Rebuild executed keys, the breaker window and breaker state from the audit topic."""
        for record in await kafka.read_all(self.settings, self._audit_topic):
            try:
                result = self._decode_result(record.value, record.key)
            except edge.Rejected as error:
                self.refusals.note(f"audit {edge.kind_of(error)}",
                                   "skipping an audit record that is none: %s", error)
                continue
            self.apply_audit(result)

    def apply_audit(self, result: ActionResult) -> None:
        """Fold one audit record (ours or another executor's) into the executor's state."""
        key = result.idempotency_key
        if key.startswith(BREAKER_TRIP_PREFIX):
            # Open since its first trip, whoever tripped it.
            for circuit in breaker_circuits(key):
                self.breaker.trip(result.ts, result.detail, circuit)
        elif key.startswith(BREAKER_RESET_PREFIX):
            for circuit in breaker_circuits(key):
                self.breaker.reset(circuit)
        else:
            # The record does not say why a requeue was asked for; a requeue of an episode
            # whose owner was notified is a reclaim (only the idle ladders notify and then
            # requeue, and a reclaim is carried out only after a delivered notice; the audit
            # topic has one partition, so the notice is read first).
            reclaim = (result.verb == "requeue"
                       and key.partition(RECLAIM_KEY)[0] in self.notified)
            self._fold(key, result.verb, result.outcome, result.attempt,
                       result.target.node, result.ts, reclaim=reclaim, detail=result.detail)

    def _fold(self, key: str, verb: str, outcome: Outcome, attempt: int, node: str | None,
              ts: float, *, reclaim: bool = False, detail: str = "") -> None:
        """What one final decision changes in the executor's state, whether it is read back
        from the audit topic or just made."""
        if len(self._heard) >= self._forget_at:
            self._forget_old(ts)
        self._heard[key] = max(ts, self._heard.get(key, ts))
        if outcome == "executed":
            self.executed_keys.add(key)
        if verb in NODE_DISRUPTING and outcome != "retrying":
            self.decided[key] = _decision(outcome, detail)
        if node and _disrupted(verb, outcome, attempt):
            self.breaker.record(node, ts)
        if node and verb == "drain" and outcome in ("executed", "failed"):
            self.drained[node] = max((ts, key), self.drained.get(node, (ts, key)))
        if reclaim and _may_have_acted(outcome, attempt):
            self.breaker.record_reclaim(key, ts)
        if verb == "notify_owner" and outcome in ("executed", "skipped") and NOTICE_KEY in key:
            episode = key.rpartition(NOTICE_KEY)[0]
            self.notified[episode] = min(ts, self.notified.get(episode, ts))

    def _forget_old(self, now: float) -> None:
        """Forget the keys decided, and the notices delivered, longer ago than the audit
        topic keeps records: a restarted executor, rebuilt from that topic, knows no more.
        A process running for months kept every key it ever decided (about 215 bytes each)."""
        cutoff = now - topics.ACTION_RESULTS.retention_ms / 1000
        old = [key for key, ts in self._heard.items() if ts < cutoff]
        for key in old:
            del self._heard[key]
            self.executed_keys.discard(key)
            self.decided.pop(key, None)
        self.notified = {episode: ts for episode, ts in self.notified.items() if ts >= cutoff}
        self.drained = {node: at for node, at in self.drained.items() if at[0] >= cutoff}
        self._forget_at = len(self._heard) + FORGET_EVERY

    # -- deciding --------------------------------------------------------------------------

    def _rule_enabled(self, rule: str) -> bool:
        return self.sandbox or self.remediation.enables(rule)

    async def _gpu_nodes(self) -> int | None:
        if self.remediation.fleet_gpu_nodes is not None:
            return self.remediation.fleet_gpu_nodes
        count = getattr(self.backend, "gpu_node_count", None)
        if count is None:
            return None
        now = self.clock()
        if self._fleet_cache is None or now - self._fleet_cache[0] > 60:
            try:
                self._fleet_cache = (now, await count())
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the absolute limit still holds
                log.warning("cannot count GPU nodes (%s); using the absolute breaker limit",
                            error)
                self._fleet_cache = (now, None)
        return self._fleet_cache[1]

    def _guard(self, action: Action) -> str | None:
        """Why a guard refuses ``action``, or None."""
        target = action.target
        if matches(target.node, self.remediation.deny_nodes):
            return f"node {target.node} is on the deny-list"
        # The namespace the backend acts in: the target pod's, or the one its params name (a
        # Kueue workload's).
        for namespace in (target.pod.namespace if target.pod else None,
                          action.params.get("namespace")):
            if matches(namespace, self.remediation.deny_namespaces):
                return f"namespace {namespace} is on the deny-list"
        if action.verb == "set_mig_config" and not self.remediation.allow_mig_config:
            return "MIG relabels are not allowed by policy (allow_mig_config is off)"
        if action.verb in NODE_DISRUPTING and not target.node:
            return f"{action.verb} needs a node"
        return None

    def verdict(self, action: Action, now: float | None = None) -> tuple[Outcome, str] | None:
        """The outcome the guards give ``action`` at ``now`` (the executor's clock when
        None) without the backend, or None to act.

        Pure: the executed keys, the owners notified and when, the policy, the mode and
        the time decide; no I/O.
        """
        refusal = self._guard(action)
        if action.idempotency_key in self.executed_keys:
            return "skipped", "already executed (redelivered action)"
        if refusal:
            return "refused", refusal
        if not self.execute:
            return "dry_run", f"{describe(action)} [executor in dry-run mode]"
        if action.dry_run:
            return "dry_run", f"{describe(action)} [the rule asked for a dry run]"
        if not self._rule_enabled(action.rule):
            return "dry_run", (f"{describe(action)} [rule {action.rule} is not enabled; "
                               f"--enable-rule {action.rule} to act]")
        now = self.clock() if now is None else now
        stale = self._age_refusal(action, now)
        if stale is not None:
            return "refused", stale
        if _is_reclaim(action):
            return self._notice_verdict(action, now)
        if action.verb == "drain" and action.target.node in self.drained:
            drained_at, by = self.drained[action.target.node]
            if by != action.idempotency_key and \
                    now - drained_at < self.remediation.drain_interval_s:
                # The node's other GPU findings ask for the same drain: one blocked drain
                # per GPU would hold the executor drain_timeout_s each and tell the blocked
                # pods' owners once per GPU.
                return "skipped", (
                    f"{DRAINED_PREFIX}{by} at {rfc3339(drained_at)}, "
                    f"{now - drained_at:.0f} s ago: node {action.target.node} is drained at "
                    f"most once per drain_interval_s={self.remediation.drain_interval_s:g} s "
                    "whatever the findings asking; a later re-ask drains it again if pods "
                    "are left")
        return None

    def _age_refusal(self, action: Action, now: float) -> str | None:
        """Why ``action`` is too old, or too far ahead of ``now``, to be carried out, or None."""
        policy = self.remediation
        age = now - action.ts
        if policy.max_action_age_s is not None and age > policy.max_action_age_s:
            # A backlog replayed after an outage: the finding may have resolved since, and
            # a notice and its reclaim would land back to back.
            return (
                f"stale: asked for at {rfc3339(action.ts)}, {age / 3600:.1f} h ago, older "
                f"than max_action_age_s={policy.max_action_age_s:g} s (a backlog replayed "
                "after an outage?); its finding may have resolved since. Not carried out; "
                "the worker asks again for a node action of a hardware finding every "
                "reask_s while the finding stays open, and a fresh re-ask is carried out. "
                "Otherwise check the finding's state and act by hand if it still applies")
        if policy.max_action_age_s is not None and -age > policy.max_action_age_s:
            # Its age cannot be told: a worker whose event time runs that far ahead (a node's
            # collector clock) would otherwise have a backlog carried out however old it is.
            return (
                f"asked for at {rfc3339(action.ts)}, {-age / 3600:.1f} h ahead of the "
                f"executor's clock, more than max_action_age_s={policy.max_action_age_s:g} s: "
                "the clock of the node its finding came from is skewed, so the action's "
                "age cannot be judged. Not carried out (a re-ask from that clock is refused "
                "too): fix the node's clock, check the finding and act by hand if it still "
                "applies")
        return None

    def _notice_verdict(self, action: Action, now: float) -> tuple[Outcome, str] | None:
        """Whether the owner of the reclaim's episode was told first, long enough ago."""
        told = [self.notified[f] for f in action.finding_ids if f in self.notified]
        if not told:
            # E.g. an episode whose notices were dry runs, before --execute was switched on,
            # or whose notices failed: the owner may never have heard of it.
            return "refused", ("the owner was not told first: no notice of this idle "
                               "episode was delivered; a reclaim follows only a delivered one")
        min_notice = self.remediation.min_notice_s or 0.0
        told_at = min(told)
        if now - told_at < min_notice:
            return "refused", (
                f"the owner was told only {now - told_at:.0f} s ago (notice delivered at "
                f"{rfc3339(told_at)}); a reclaim follows a delivered notice by at least "
                f"min_notice_s={min_notice:g} s, so not before {rfc3339(told_at + min_notice)}. "
                "The rule does not ask again: the GPU stays with its owner for this idle "
                "episode")
        return None

    async def decide(self, action: Action, on_attempt: Attempt | None = None) -> ActionResult:
        """The final outcome for one action; carries it out when it should.

        Tries that meet a temporary error are retried; each is reported to
        ``on_attempt`` (the audit topic, when running) before the wait.
        """
        now = self.clock()
        error: str | None = None
        attempt = 1
        decided = self.verdict(action, now)
        if decided is not None:
            outcome, detail = decided
        else:
            outcome, detail, error, attempt = await self._act(action, now, on_attempt)
        self._fold(action.idempotency_key, action.verb, outcome, attempt, action.target.node,
                   now, reclaim=_is_reclaim(action), detail=detail)
        return self._result(action, outcome, detail, now, error=error, attempt=attempt)

    def _result(self, action: Action, outcome: Outcome, detail: str, ts: float, *,
                error: str | None = None, attempt: int = 1) -> ActionResult:
        if len(detail) > MAX_AUDIT_DETAIL:
            # A longest reason in a dry run's words, or a drain's list of pods left, would make
            # a record no reader of the audit topic accepts: the decision would be unaudited.
            detail = cut(detail, MAX_AUDIT_DETAIL - 64)
        return ActionResult(
            idempotency_key=action.idempotency_key, verb=action.verb, target=action.target,
            outcome=outcome, detail=detail, actor=self.actor, ts=ts, error=error,
            attempt=attempt,
        )

    async def _act(self, action: Action, now: float, on_attempt: Attempt | None
                   ) -> tuple[Outcome, str, str | None, int]:
        """(outcome, detail, error, attempt) of carrying ``action`` out through the backend."""
        handler = getattr(self.backend, action.verb, None)
        if handler is None:
            return "refused", f"backend {self.backend.name} cannot {action.verb}", None, 1
        if action.verb in NODE_DISRUPTING or _is_reclaim(action):
            circuit = NODES_CIRCUIT if action.verb in NODE_DISRUPTING else RECLAIMS_CIRCUIT
            was_open = self.breaker.is_open(circuit)
            if circuit == NODES_CIRCUIT:
                admitted, why = self.breaker.admits(action.target.node or "", now,
                                                    await self._gpu_nodes())
            else:
                admitted, why = self.breaker.admits_reclaim(action.idempotency_key, now,
                                                            await self._gpu_nodes())
            if not admitted:
                if not was_open:
                    self._pending_findings.append(
                        self._breaker_finding("firing", now, circuit))
                return "refused", why, None, 1
        policy = self.remediation
        backoff, waited = policy.retry_backoff_s, 0.0
        attempt = 1
        while True:
            try:
                outcome, detail = await handler(action)
                return outcome, detail, None, attempt
            except asyncio.CancelledError:
                raise
            except TemporaryError as error:
                why = _error_text(error)
                delay = max(error.delay, backoff)
                if attempt >= policy.retry_attempts:
                    return "failed", f"gave up after {attempt} attempts: {why}", why, attempt
                if waited + delay > policy.retry_budget_s:
                    return "failed", (f"gave up after {attempt} attempt(s): a wait of "
                                      f"{delay:g} s would pass the retry budget of "
                                      f"{policy.retry_budget_s:g} s: {why}"), why, attempt
                log.warning("%s attempt %d failed, retrying in %g s: %s",
                            action.idempotency_key, attempt, delay, why)
                if on_attempt is not None:
                    await on_attempt(self._result(
                        action, "retrying", f"attempt {attempt} of {policy.retry_attempts} "
                        f"failed; retrying in {delay:g} s: {why}", self.clock(), error=why,
                        attempt=attempt))
                await self._sleep(delay)
                waited += delay
                backoff = min(backoff * 2, policy.retry_backoff_max_s)
                attempt += 1
            except Exception as error:  # permanent: audited as failed, not fatal
                why = _error_text(error)
                return "failed", why, why, attempt

    def _breaker_finding(self, state: str, now: float, circuit: str) -> Finding:
        """The ``remediation_breaker`` finding of ``circuit``: one alert per circuit (the
        nodes circuit's keeps the fingerprint of the breaker before the split, so a finding
        open then is resolved by the next reset)."""
        fp = (fingerprint(BREAKER_KIND, self.settings.topic_prefix) if circuit == NODES_CIRCUIT
              else fingerprint(BREAKER_KIND, self.settings.topic_prefix, circuit))
        opened, reason = self.breaker.tripped.get(circuit, (now, ""))
        words = _CIRCUIT_WORDS[circuit]
        stopped = ("Node-disrupting remediation (cordon, taint, drain, MIG relabel) is "
                   "stopped; idle reclaims go on under their own limit. Check why so many "
                   "nodes were flagged at once (a driver roll-out, a bad rule, bad telemetry)"
                   if circuit == NODES_CIRCUIT else
                   "Idle reclaims are stopped; cordons and drains of failing GPUs go on under "
                   "their own limit. Check why so many GPUs were found idle at once (a "
                   "holiday, a bad rule, bad telemetry such as 0 % activity fleet-wide)")
        return Finding(
            id=finding_id(fp, opened), fingerprint=fp, kind=BREAKER_KIND,
            severity="critical" if state == "firing" else "info",
            state=state,  # type: ignore[arg-type]
            subject=Subject(), starts_at=opened, ts=now,
            ends_at=now if state == "resolved" else None,
            summary=(f"remediation circuit breaker ({words}) tripped: {reason}"
                     if state == "firing" else f"remediation circuit breaker ({words}) reset"),
            runbook=f"{stopped}, then run `gpusteward act --reset-breaker --circuit {circuit}`.",
            labels={"circuit": circuit},
        )

    def breaker_record(self, kind: str, detail: str, now: float,
                       circuit: str | None = None) -> ActionResult:
        """The audit record of a breaker transition, ``trip`` or ``reset``, of ``circuit``
        (a reset of None: of every circuit)."""
        prefix = BREAKER_TRIP_PREFIX if kind == "trip" else BREAKER_RESET_PREFIX
        where = f"{circuit}/" if circuit is not None else ""
        return ActionResult(
            idempotency_key=f"{prefix}{where}{round(now * 1000)}", verb="cordon",
            target=Subject(), outcome="refused" if kind == "trip" else "executed",
            detail=detail, actor=self.actor, ts=now,
        )

    # -- running ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        # The follower's place is taken before the history is read, so no record written
        # meanwhile is missed (those read twice fold to the same state).
        audit = self._audit = await self._follow_audit()
        await self.load_history()
        consumer = kafka.consumer(self.settings, topics.ACTIONS.name(self.settings),
                                  group_id=self.group_id)
        producer = kafka.producer(self.settings)
        port = self.settings.metrics.port
        server = serve(self.metrics.registry, port, self.settings.metrics.addr) if port else None
        processing = self.metrics.processing.labels("remediation")
        deliveries = kafka.Deliveries(producer)
        await producer.start()
        await consumer.start()
        try:
            async with lag_followed(self.metrics, self.settings, self.group_id,
                                    [topics.ACTIONS.name(self.settings)]):
                while not stop.is_set():
                    await self._read_audit(audit)
                    batch = await consumer.getmany(timeout_ms=200)
                    for tp, messages in batch.items():
                        for message in messages:
                            started = time.perf_counter()
                            self.metrics.records_in.labels(tp.topic).inc()
                            await self._handle(deliveries, message.value, key=message.key,
                                               partition=tp.partition, offset=message.offset,
                                               topic=tp.topic)
                            processing.observe(time.perf_counter() - started)
                    if batch:
                        # The audit records and dead letters are on the broker before the
                        # offsets move on: one the broker never took raises here, and nothing
                        # is committed.
                        await deliveries.delivered()
                        await consumer.commit()
                    self.metrics.breaker_open.labels(self.group_id).set(int(self.breaker.open))
                    for circuit in CIRCUITS:
                        self.metrics.breaker_circuit_open.labels(self.group_id, circuit).set(
                            int(self.breaker.is_open(circuit)))
        finally:
            if server is not None:
                server.stop()
            await consumer.stop()
            self._audit = None
            await audit.stop()
            await producer.stop()

    async def _follow_audit(self) -> Any:
        """A reader positioned at the audit topic's end now, to follow what is written
        from here on: other executors' decisions and breaker trips, the CLI's resets."""
        from aiokafka import TopicPartition

        reader = kafka.consumer(self.settings, group_id=None)
        await reader.start()
        partitions = reader.partitions_for_topic(self._audit_topic)
        if not partitions:
            await reader._client.force_metadata_update()
            partitions = reader.partitions_for_topic(self._audit_topic) or {0}
        assigned = [TopicPartition(self._audit_topic, p) for p in sorted(partitions)]
        reader.assign(assigned)
        await reader.seek_to_end(*assigned)
        for partition in assigned:
            await reader.position(partition)  # the end now, not when first fetched
        return reader

    async def _read_audit(self, audit: Any, timeout_ms: int = 0) -> None:
        """Fold the audit records read since the last call, every executor's (ours again
        too: folding is idempotent, and the topic's one partition keeps their order)."""
        batch = await audit.getmany(timeout_ms=timeout_ms)
        for messages in batch.values():
            for message in messages:
                try:
                    result = self._decode_result(message.value, message.key)
                except edge.Rejected:
                    continue  # counted where the history is read
                was_open = set(self.breaker.tripped)
                self.apply_audit(result)
                if was_open != set(self.breaker.tripped):
                    log.warning("circuit breaker %s: %s",
                                ", ".join(sorted(self.breaker.tripped)) + " open"
                                if self.breaker.open else "reset", result.detail)

    async def _catch_up(self, audit: Any) -> None:
        """Fold the audit topic up to its end as it is now, within ``CATCH_UP_S``.

        An end the embedded broker reports short (the first record of the last batch)
        is passed by fetching that batch, which brings the whole of it. A broker that does
        not answer costs a warning, not the action: it is decided on what was read."""
        try:
            ends = await audit.end_offsets(list(audit.assignment()))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.warning("cannot read the audit topic's end (%s); deciding on what was read",
                        _error_text(error))
            return
        deadline = time.monotonic() + CATCH_UP_S
        while True:
            behind = [tp for tp, end in ends.items() if await audit.position(tp) < end]
            if not behind:
                break
            if time.monotonic() > deadline:
                log.warning("the audit topic was not read to its end within %g s; deciding "
                            "on what was read", CATCH_UP_S)
                break
            await self._read_audit(audit, timeout_ms=100)
        await self._read_audit(audit)

    async def _handle(self, producer: kafka.Sender, raw: bytes | None, *,
                      key: bytes | None = None, partition: int = -1, offset: int = -1,
                      topic: str | None = None) -> ActionResult | None:
        source = topic or topics.ACTIONS.name(self.settings)
        try:
            action = self._decode(raw, key)
            if self._audit is not None and self.verdict(action) is None:
                # About to act: first what the other executors decided up to now (a key
                # they carried out, a node they disrupted, a notice they delivered, a trip).
                await self._catch_up(self._audit)
            was_open = set(self.breaker.tripped)
            last = self.decided.get(action.idempotency_key)
            done = action.idempotency_key in self.executed_keys

            async def audit_attempt(record: ActionResult) -> None:
                await producer.send(self._audit_topic, self._encode(record),
                                    key=record.idempotency_key.encode())
                self.metrics.actions.labels(record.verb, record.outcome).inc()

            result = await self.decide(action, audit_attempt)
            if (action.reask and last is not None and set(self.breaker.tripped) == was_open
                    and not _may_have_acted(result.outcome, result.attempt)
                    and (done or _decision(result.outcome, result.detail) == last)):
                # Asked again while its finding stays open, and decided as before: the audit
                # topic already says so (a dry run would otherwise add a record per node
                # fault every reask_s).
                self.metrics.actions_reasked.labels(result.verb, result.outcome).inc()
                log.debug("%s asked again (%d): %s, as before: %s", action.idempotency_key,
                          action.reask, result.outcome, result.detail)
                return result
            self.metrics.actions.labels(result.verb, result.outcome).inc()
            if result.outcome == "refused" and result.detail == self._age_refusal(action,
                                                                                   result.ts):
                # A remediation not done, whose fault may persist: the GpustewardActionsStale
                # alert tells an operator. A node action of a hardware finding is asked for
                # again while the finding stays open, and a fresh re-ask is carried out.
                self.metrics.actions_stale.labels(action.verb, action.rule).inc()
                log.warning("%s %s of %s refused as stale: %s", action.idempotency_key,
                            action.verb, _where(action.target), result.detail)
        except Exception as error:  # one record's failure is that record's: never a crash loop
            why = edge.reason(error, "" if isinstance(error, edge.Rejected) else "executor")
            self.refusals.note(f"action {edge.kind_of(error)}",
                               "action at %s[%d]@%d goes to the dead-letter topic: %s",
                               source, partition, offset, why)
            letter = edge.dead_letter(source, partition, offset, key, raw, why)
            await producer.send(topics.DEADLETTER.name(self.settings), self._encode(letter),
                                key=source.encode())
            self.metrics.dead_letters.labels(source, type(error).__name__).inc()
            return None
        log.info("%s %s: %s", result.outcome, action.idempotency_key, result.detail)
        for circuit, (_, reason) in self.breaker.tripped.items():
            if circuit not in was_open:
                trip = self.breaker_record("trip", reason, result.ts, circuit)
                await producer.send(self._audit_topic, self._encode(trip),
                                    key=trip.idempotency_key.encode())
        await producer.send(self._audit_topic, self._encode(result),
                            key=action.idempotency_key.encode())
        for finding in self._pending_findings:
            await producer.send(topics.FINDINGS.name(self.settings), self._encode(finding),
                                key=finding.fingerprint.encode())
        self._pending_findings.clear()
        if self.on_result:
            try:
                self.on_result(action, result)
            except Exception:  # a display's failure is not the decision's: it is audited
                log.exception("reporting %s failed", action.idempotency_key)
        return result


async def restore(settings: Settings, backend: Any, target: str, operator: str) -> ActionResult:
    """Undo a reclaim on ``target`` (``KIND/NAMESPACE/NAME``) and audit it.

    An operator's command, not an action from the topic: it bypasses the
    executor's guards (the owner asked for the GPUs back) but is recorded on the
    audit topic like any decision, keyed ``restore/KIND/NAMESPACE/NAME/<ms>``.
    The schema has no restore verb, so the record carries ``requeue``, the verb
    whose reclaim it undoes.
    """
    parts = target.split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--restore takes KIND/NAMESPACE/NAME, not {target!r}")
    outcome, detail = await backend.restore(*parts)
    now = time.time()
    record = ActionResult(
        idempotency_key=f"{RESTORE_KEY_PREFIX}{target}/{round(now * 1000)}", verb="requeue",
        # Subject has no field for a Deployment or a Notebook: the key and detail name it.
        target=Subject(), outcome=outcome,
        detail=f"restore {target} by {operator}: {detail}",
        actor=f"{operator}/{backend.name}", ts=now)
    producer = kafka.producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(topics.ACTION_RESULTS.name(settings),
                                     msgspec.json.encode(record),
                                     key=record.idempotency_key.encode())
    finally:
        await producer.stop()
    return record


async def reset_breaker(settings: Settings, operator: str, reason: str = "",
                        circuit: str | None = None) -> ActionResult:
    """Record a reset of the breaker's ``circuit`` (None: both) on the audit topic and
    resolve the breaker findings of the circuits it closes.

    Running executors follow the audit topic and close their breaker when
    they read it; executors that start later read it with the history.
    """
    executor = Executor(settings, NoBackend(), actor=f"{operator}")
    await executor.load_history()
    now = time.time()
    if circuit is not None and circuit not in CIRCUITS:
        raise ValueError(f"no breaker circuit {circuit!r}: one of {', '.join(CIRCUITS)}")
    was_open = [c for c in sorted(executor.breaker.tripped) if circuit in (None, c)]
    record = executor.breaker_record("reset", f"reset by {operator}"
                                     + (f": {reason}" if reason else ""), now, circuit)
    producer = kafka.producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(executor._audit_topic, executor._encode(record),
                                     key=record.idempotency_key.encode())
        for circuit in was_open:
            closing = executor._breaker_finding("resolved", now, circuit)
            await producer.send_and_wait(topics.FINDINGS.name(settings),
                                         executor._encode(closing),
                                         key=closing.fingerprint.encode())
    finally:
        await producer.stop()
    return record
