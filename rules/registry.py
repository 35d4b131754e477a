"""The rule registry: one entry per rule, the one place the pipeline learns what rules exist.

An entry (:class:`Rule`) says everything the rest of the pipeline needs to
run, configure and gate a rule: its name (the key of its policy section and
of ``--enable-rule``), its settings model, its scope (per device, per node,
fleet-wide), which policy layers reach it, every finding kind it emits
(an action's ``rule`` is the kind of the finding that asked for it, so
enabling a rule enables the actions of all of them), and how it runs.

How it runs is a :class:`DeviceRunner` for the rules the node join calls on
every device sample and hardware event, and :class:`FleetRunner` s for the
evaluations the fleet agent runs every interval. Several rules may share
one runner: the hardware family keeps one state per GPU and reads one
sample in one call with a fast path (nine calls per GPU sample would cost
the node join a third of its budget), so each hardware rule's entry points to that shared runner and
the node join runs every distinct runner once. A runner gets its settings
built from the resolved settings of every rule (``settings_from``), once
per policy resolution, never per record.

The registry itself does no I/O; :mod:`gpusteward.rules` fills the shared
one explicitly, name by name, and tests may register a rule of their own
(:meth:`Registry.registered`) and take it out again.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from pydantic import BaseModel

from gpusteward.errors import ConfigError
from gpusteward.schema import (
    Action,
    DeviceSample,
    Finding,
    HwEvent,
    NodeSummary,
    QueueEvent,
)

log = logging.getLogger(__name__)

Scope = Literal["device", "node", "fleet"]
Layers = Literal["node", "workload"]
"""Which policy layers reach a rule: ``node`` (defaults, then the node's pool: rules about a
GPU or a node) or ``workload`` (also the pod's queue and namespace)."""
ALL_RULES = "*"
"""The ``--enable-rule`` name that stands for every rule."""

Out = list[Finding | Action]
SampleHook = Callable[[Any, str, DeviceSample, float, Any, Any], Out]
"""``(track, node, device sample, ts, settings, holder or None) -> outputs``, called
positionally, so a rule's own observe function can be the hook with no wrapper."""
EventHook = Callable[[Any, HwEvent, str, Any, Any], Out]
"""``(track, event, device uuid, settings, holder or None) -> outputs``: the holder is the
pod that held the device at the event's time, as the node join knows it (an event names
no pod)."""
ReleaseHook = Callable[[Any, str, str, float], Out]
"""``(track, node, device uuid, ts) -> outputs``: the device's holder let it go."""
ClockStepHook = Callable[[Any, float], None]
"""``(track, step seconds)``: the node's clock went back ``step`` s and the join takes its
new clock (:meth:`gpusteward.streams.node.NodeJoin.on_sample`)."""


@dataclass(frozen=True, eq=False)
class DeviceRunner:
    """How the node join runs a rule (or a family of rules) on one device's state."""

    state: str
    """Name of the per-device state (a field of the node join's device state when the
    pipeline ships the rule; kept in its ``tracks`` otherwise)."""
    state_type: type
    """The state's type: a msgspec Struct, so it rides the node's changelog."""
    settings_from: Callable[[Mapping[str, BaseModel]], Any]
    """The settings this runner gets, from the resolved settings of every rule."""
    on_sample: SampleHook | None = None
    gpu_only: bool = False
    """Only physical GPUs' samples (a MIG device repeats its parent's health readings)."""
    events: Mapping[str, EventHook] = field(default_factory=dict)
    """Hardware-event kind -> hook."""
    events_without_uuid: frozenset[str] = frozenset()
    """Event kinds that count even without a device UUID (filed under ``GPU-unknown``)."""
    on_release: ReleaseHook | None = None
    on_unwatched: ReleaseHook | None = None
    """Called on the device's state when the node join finds the device held by a pod whose
    kind ``watches`` leaves out, once per holding (and policy resolution), never per sample:
    the rule closes an episode it opened under a policy that judged that kind (the worker
    restarted with one that does not), which nothing would judge again while the pod holds
    the device."""
    on_clock_step: ClockStepHook | None = None
    """Called on the device's state when its node's collector clock stepped back and the
    join takes the new clock: the rule forgets its runs and windows, as after a gap longer
    than its ``max_gap_s`` (the step is a gap of unknown length), and moves the start of an
    open episode back by the step, so the episode goes on under its id on the new clock and
    ends only when the samples say so. None: the state is left as it is, and the rule
    ignores the node's samples until they pass its last one again."""
    per_holder: bool = False
    """On a device several pods hold (time-slicing, MPS), run once per holder on its share
    (its own activity and memory where the source split them, the device's readings marked
    ``shared`` where not), with state of its own per holder; once per device otherwise."""
    unhealthy: Callable[[Any], bool] | None = None
    """True while the state holds an episode that takes the GPU out of service."""
    watches: Callable[[Any, str | None], bool] | None = None
    """``(settings, the holder's workload kind or None) -> bool``: False when the runner has
    nothing to do on a device held by a pod of that kind (or by none), so the node join
    leaves it out of that device's hooks, decided once per holding, not per sample. None:
    it runs whoever holds the device."""


@dataclass(frozen=True, eq=False)
class FleetRunner:
    """One evaluation the fleet agent runs for a fleet-wide rule, every evaluation interval."""

    state: str
    """Name of the part of the fleet state it keeps (a field of the fleet agent's state when
    the pipeline ships the rule; kept in its ``tracks`` otherwise)."""
    state_type: type
    evaluate: Callable[[Any, Any, float, Any], Sequence[Finding | Action]]
    """``(state, fleet view, now, settings) -> outputs``; the view is
    :class:`gpusteward.rules.fragmentation.FleetView`: the nodes' latest summaries and the
    demand pending in the queue."""
    on_queue: Callable[[Any, QueueEvent, Any], Sequence[Finding | Action]] | None = None
    """``(state, queue event, settings) -> outputs``: called for every queue event the
    agent reads, for a rule that follows the queue beyond the demand pending in it."""
    on_summary: Callable[[Any, NodeSummary, Any], Sequence[Finding | Action]] | None = None
    """``(state, node summary, settings) -> outputs``: called for every node summary, for a
    rule that integrates each node's own sequence of summaries (its time between two, at
    the level of the first), which stays exact however the nodes' summaries interleave."""


@dataclass(frozen=True, eq=False)
class Rule:
    """One rule: what configures it, what it emits, how it runs."""

    name: str
    settings: type[BaseModel] | None
    """Its settings model (the policy section ``rules.<name>``); None: not configured by
    the policy (see ``owner``)."""
    scope: Scope
    kinds: tuple[str, ...] = ()
    """Every finding kind it emits besides ``name`` itself."""
    layers: Layers = "node"
    device: DeviceRunner | None = None
    fleet: tuple[FleetRunner, ...] = ()
    owner: str = "worker"
    """Who runs it: the stream worker, or another component (e.g. ``remediation``)."""
    summary: str = ""
    """One line about it; defaults to the first line of the settings model's docstring."""

    @property
    def emits(self) -> tuple[str, ...]:
        """Every finding kind it emits, its own name first."""
        return (self.name, *(k for k in self.kinds if k != self.name))

    def describe(self) -> str:
        if self.summary:
            return self.summary
        doc = (self.settings.__doc__ or "") if self.settings is not None else ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


def state_in(tracks: dict[str, Any], name: str, state_type: type) -> Any:
    """The state called ``name`` in ``tracks``, created, or turned back into ``state_type``
    when it was decoded from a changelog as plain data: how the node join and the fleet
    agent keep the state of a rule they have no typed field for.

    Plain data that is no ``state_type`` (written by a release whose rule kept another
    shape: a rollback) is dropped with a warning and the rule starts afresh. Raised, it
    failed every record that reached the rule, for ever (the state is read again from the
    changelog after each failure)."""
    track = tracks.get(name)
    if type(track) is not state_type:
        try:
            track = state_type() if track is None else msgspec.convert(track, state_type)
        except msgspec.ValidationError as error:
            log.warning("the state of rule runner %r is no %s (written by another release?): "
                        "dropped, the rule starts afresh: %s", name, state_type.__name__, error)
            track = state_type()
        tracks[name] = track
    return track


def own_settings(name: str) -> Callable[[Mapping[str, BaseModel]], BaseModel]:
    """``settings_from`` of a runner that serves one rule: that rule's settings."""
    def pick(rules: Mapping[str, BaseModel]) -> BaseModel:
        return rules[name]
    return pick


class UnknownRuleError(ConfigError, KeyError, ValueError):
    """A name that is no registered rule (or, where kinds count, no emitted kind)."""

    def __init__(self, name: str, valid: Iterable[str], what: str = "rule") -> None:
        super().__init__(name)
        self.name, self.valid, self.what = name, sorted(valid), what

    def __str__(self) -> str:
        return f"unknown {self.what} {self.name!r}; valid: {', '.join(self.valid)}"


class Registry(Mapping[str, Rule]):
    """Rules by name, in registration order; also every emitted kind's rule."""

    def __init__(self, rules: Iterable[Rule] = ()) -> None:
        self._rules: dict[str, Rule] = {}
        self._by_kind: dict[str, Rule] = {}
        self.version = 0
        """Bumped on every change."""
        self._watchers: list[weakref.WeakMethod[Callable[[], None]]] = []
        for rule in rules:
            self.register(rule)

    def __getitem__(self, name: str) -> Rule:
        try:
            return self._rules[name]
        except KeyError:
            raise UnknownRuleError(name, self._rules) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    # One registry is one object (a default value of dataclass fields, a cache owner), not a
    # value: compare and hash by identity.
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def watch(self, callback: Callable[[], None]) -> None:
        """Call the bound method ``callback`` on every change while its object lives: how a
        cache built from the registry (a policy's resolutions) forgets what is stale with no
        check on every lookup."""
        self._watchers.append(weakref.WeakMethod(callback))

    def _changed(self) -> None:
        self.version += 1
        alive = []
        for ref in self._watchers:
            callback = ref()
            if callback is not None:
                callback()
                alive.append(ref)
        self._watchers = alive

    def register(self, rule: Rule) -> Rule:
        """Add ``rule``; its name and kinds must be new."""
        taken = [k for k in rule.emits if k in self._by_kind]
        if rule.name in self._rules or taken:
            raise ValueError(f"rule {rule.name!r}: already registered: "
                             f"{', '.join(taken or [rule.name])}")
        self._rules[rule.name] = rule
        self._by_kind.update(dict.fromkeys(rule.emits, rule))
        self._changed()
        return rule

    def unregister(self, name: str) -> Rule:
        rule = self[name]
        del self._rules[name]
        for kind in rule.emits:
            self._by_kind.pop(kind, None)
        self._changed()
        return rule

    @contextmanager
    def registered(self, rule: Rule) -> Iterator[Rule]:
        """``rule`` registered for the ``with`` block, removed after it."""
        self.register(rule)
        try:
            yield rule
        finally:
            self.unregister(rule.name)

    @contextmanager
    def preserved(self) -> Iterator[Registry]:
        """The registry as it is now, put back after the block whatever it adds or removes
        (every test starts from the shipped rules)."""
        saved = list(self._rules.values())
        try:
            yield self
        finally:
            self._rules.clear()
            self._by_kind.clear()
            for rule in saved:
                self.register(rule)

    @property
    def kinds(self) -> Mapping[str, Rule]:
        """Every finding kind the registered rules emit -> the rule that emits it."""
        return self._by_kind

    def owner_of(self, name: str) -> Rule:
        """The rule called ``name``, or the rule that emits the kind ``name``."""
        rule = self._rules.get(name) or self._by_kind.get(name)
        if rule is None:
            raise UnknownRuleError(name, set(self._rules) | set(self._by_kind),
                                   "rule or finding kind")
        return rule

    def enabled_kinds(self, names: Iterable[str]) -> frozenset[str]:
        """The finding kinds whose actions ``names`` enable (``--enable-rule``).

        A rule name enables every kind the rule emits (``xid`` enables ``xid_rma``); a kind
        enables itself alone; ``*`` stays as it is, for every kind. An unknown name raises
        :class:`UnknownRuleError` listing the valid ones.
        """
        out: set[str] = set()
        for name in names:
            if name == ALL_RULES:
                out.add(ALL_RULES)
            elif name in self._rules:
                out.update(self._rules[name].emits)
            else:
                self.owner_of(name)  # raises for a name that is neither
                out.add(name)
        return frozenset(out)

    def configurable(self) -> dict[str, type[BaseModel]]:
        """Rule name -> settings model, for the rules the policy configures."""
        return {name: rule.settings for name, rule in self._rules.items()
                if rule.settings is not None}

    def device_runners(self) -> list[tuple[DeviceRunner, tuple[Rule, ...]]]:
        """Every distinct device runner, in registration order, with the rules it serves."""
        served: dict[int, tuple[DeviceRunner, list[Rule]]] = {}
        for rule in self._rules.values():
            if rule.device is not None:
                served.setdefault(id(rule.device), (rule.device, []))[1].append(rule)
        return [(runner, tuple(rules)) for runner, rules in served.values()]

    def in_scope(self, *scopes: Scope) -> list[Rule]:
        return [rule for rule in self._rules.values() if rule.scope in scopes]
