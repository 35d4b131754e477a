"""The rule policy: every rule's settings in one YAML file, with overrides where they differ.

A policy file has four sections besides ``node_pool_label``::

    rules:        {<rule>: {<field>: value}}                    # defaults of every rule
    node_pools:   {<pool>: {<rule>: {<field>: value}}}           # pool = value of node_pool_label
    queues:       {<queue>: {<rule>: {<field>: value}}}
    namespaces:   {<namespace>: {<rule>: {<field>: value}}}

Settings resolve in that order, later layers winning field by field (nested
mappings such as ``kinds`` or ``slowdown_c`` merge key by key): defaults,
then the node's pool, then the pod's queue, then its namespace, the most
specific owner last. Which layers reach a rule is said by its registry
entry: rules about a GPU (hardware faults) see only the pool layer, the idle
rule sees all of them. Resolved settings are cached per (namespace, queue,
pool), so the stream worker pays a dict lookup per sample. Section names are
checked against the registry: a rule's name is valid, the name of a finding
kind it emits is refused with the rule to configure instead.

This module is pure: it parses text it is given. Reading the file named by
``GPUSTEWARD_POLICY_FILE`` is the worker's and the CLI's business
(:mod:`gpusteward.streams.policy_file`); with no file, :class:`Policy` holds
every rule's defaults, which are also what the shipped ``policy.yaml`` says.

Errors name the file, the line and the field (``policy.yaml:12:
rules.idle_holder.window_s: Input should be greater than 0``): the YAML is
composed into nodes that keep their position, and each validation error's
location is walked down that tree (:mod:`gpusteward.configfile`, shared with the
simulated world's scenario files). Every problem is reported at once: a key
given twice in one mapping (YAML would keep the last silently), a section of
the wrong shape, and each rule section's own errors. A value a rule only
interprets at run time (a queue pattern, a request shape, a workload kind) is
checked by its settings model, so a file that loads does not fail later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpusteward.configfile import (
    ConfigFileError,
    Issue,
    compose,
    duplicate_keys,
    issues_of,
    line_of,
)
from gpusteward.rules import REGISTRY
from gpusteward.rules.registry import (
    DeviceRunner,
    EventHook,
    Registry,
    SampleHook,
    UnknownRuleError,
)

DEFAULT_POOL_LABEL = "gpusteward.io/node-pool"
SettingsT = TypeVar("SettingsT", bound=BaseModel)


class PolicyFile(BaseModel):
    """The shape of a policy file; rule sections are checked against each rule's model."""

    model_config = ConfigDict(extra="forbid")

    node_pool_label: str = Field(
        DEFAULT_POOL_LABEL, min_length=1,
        description="Node label whose value names a node's pool for node_pools overrides, "
        "e.g. cloud.google.com/gke-nodepool or eks.amazonaws.com/nodegroup.",
    )
    rules: dict[str, dict[str, Any]] = Field(default_factory=dict)
    node_pools: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    queues: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    namespaces: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)


@dataclass(frozen=True)
class Resolved:
    """The settings of every rule for one (namespace, queue, node pool), and what the node
    join runs with them: both derived from the registry, nothing per rule written here."""

    rules: Mapping[str, BaseModel]
    """Rule name -> its effective settings."""
    device: tuple[tuple[DeviceRunner, Any], ...]
    """Every distinct device runner of the registry, in its order, with its settings."""
    samples: tuple[tuple[SampleHook, str, bool, DeviceRunner, Any], ...]
    """The runners with a sample hook, unpacked for the node join's per-device loop:
    (hook, state name, gpu only, runner, settings)."""
    events: Mapping[str, tuple[tuple[DeviceRunner, EventHook, Any], ...]]
    """Hardware-event kind -> the runners that take it, their hook and settings."""

    @classmethod
    def from_rules(cls, rules: Mapping[str, BaseModel], registry: Registry) -> Resolved:
        device = tuple((runner, runner.settings_from(rules))
                       for runner, _ in registry.device_runners())
        events: dict[str, list[tuple[DeviceRunner, EventHook, Any]]] = {}
        for runner, settings in device:
            for kind, hook in runner.events.items():
                events.setdefault(kind, []).append((runner, hook, settings))
        samples = tuple((runner.on_sample, runner.state, runner.gpu_only, runner, settings)
                        for runner, settings in device if runner.on_sample is not None)
        return cls(rules=dict(rules), device=device, samples=samples,
                   events={kind: tuple(hooks) for kind, hooks in events.items()})

    def __getitem__(self, name: str) -> BaseModel:
        """The settings of the rule called ``name``."""
        try:
            return self.rules[name]
        except KeyError:
            raise UnknownRuleError(name, self.rules) from None

    def of(self, name: str, model: type[SettingsT]) -> SettingsT:
        """The settings of the rule called ``name``, checked to be a ``model``."""
        settings = self[name]
        if not isinstance(settings, model):
            raise TypeError(f"rule {name}: settings are {type(settings).__name__}, "
                            f"not {model.__name__}")
        return settings

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Every rule's effective settings as plain data (for ``rules explain``)."""
        return {name: model.model_dump(mode="json") for name, model in sorted(self.rules.items())}


PolicyIssue = Issue
"""One problem in a policy file, located (the shared :class:`~gpusteward.configfile.Issue`)."""


class PolicyError(ConfigFileError):
    """A policy file that cannot be used; ``issues`` locates every problem found."""


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``, map by map. The override's keys come first: where a map's
    order matters (the queue SLO's patterns, first match wins), a policy's entries are tried
    before the defaults, and a pool's or an owner's before the file's."""
    merged: dict[str, Any] = {}
    for key, value in override.items():
        old = base.get(key)
        merged[key] = (_deep_merge(old, value) if isinstance(value, Mapping)
                       and isinstance(old, dict) else value)
    for key, value in base.items():
        merged.setdefault(key, value)
    return merged


@dataclass
class Policy:
    """Validated policy data and a cache of resolved settings."""

    node_pool_label: str = DEFAULT_POOL_LABEL
    rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_pools: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    queues: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    namespaces: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    registry: Registry = field(default=REGISTRY, repr=False, compare=False)
    """The rules this policy configures; the shared registry unless a test brings its own."""
    _cache: dict[tuple[str | None, str | None, str | None], Resolved] = field(
        default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Resolutions hold what the registry listed: forget them when it changes.
        self.registry.watch(self._forget_resolutions)

    def _forget_resolutions(self) -> None:
        self._cache.clear()

    def resolve(self, namespace: str | None = None, queue: str | None = None,
                node_pool: str | None = None) -> Resolved:
        """The effective settings of every rule for this namespace, queue and node pool.

        A rule sees the layers its registry entry names: the pool layer for rules about a
        GPU or node, also the queue and namespace layers for rules about a workload.
        """
        cached = self._cache.get((namespace, queue, node_pool))
        if cached is not None:
            return cached
        pool = self.node_pools.get(node_pool or "")
        workload = [self.queues.get(queue or ""), self.namespaces.get(namespace or "")]
        models: dict[str, BaseModel] = {}
        for name, rule in self.registry.items():
            model = rule.settings
            if model is None:
                continue
            data = _deep_merge(model().model_dump(), self.rules.get(name, {}))
            for layer in [pool, *workload] if rule.layers == "workload" else [pool]:
                if layer and name in layer:
                    data = _deep_merge(data, layer[name])
            models[name] = model.model_validate(data)
        resolved = Resolved.from_rules(models, self.registry)
        self._cache[(namespace, queue, node_pool)] = resolved
        return resolved


def _validate_shape(data: Any, root: yaml.Node | None
                    ) -> tuple[PolicyFile | None, list[PolicyIssue]]:
    """The file's sections, and the problems of their shape. An owner or section whose
    shape is wrong is left out so that the rest can still be checked and every problem
    reported at once; None when nothing is left to check (the file is not a mapping)."""
    try:
        return PolicyFile.model_validate(data), []
    except ValidationError as error:
        issues = issues_of(error, root)
        if not isinstance(data, dict):
            return None, issues
        usable = dict(data)
        for detail in error.errors():
            section, *rest = detail["loc"]
            inner = usable.get(section)
            if rest and isinstance(inner, dict):
                usable[section] = {k: v for k, v in inner.items() if k != rest[0]}
            else:
                usable.pop(section, None)
        try:
            return PolicyFile.model_validate(usable), issues
        except ValidationError:
            return None, issues


def parse_policy(text: str, origin: str = "<policy>", registry: Registry = REGISTRY) -> Policy:
    """A policy from YAML text; :class:`PolicyError` lists every problem with its line."""
    root, data = compose(text, origin, PolicyError)
    if data is None:
        data = {}
    issues = duplicate_keys(root)
    shape, shape_issues = _validate_shape(data, root)
    issues += shape_issues
    if shape is None:
        raise PolicyError(origin, issues)
    defaults: dict[str, dict[str, Any]] = {}
    for name, body in shape.rules.items():
        if _check_rule(registry, name, body, {}, ("rules", name), root, issues):
            defaults[name] = body
    for section in ("node_pools", "queues", "namespaces"):
        for owner, rules in getattr(shape, section).items():
            for name, body in rules.items():
                _check_rule(registry, name, body, defaults.get(name, {}),
                            (section, owner, name), root, issues)
    if issues:
        raise PolicyError(origin, sorted(issues, key=lambda i: (i.line is None, i.line or 0)))
    return Policy(node_pool_label=shape.node_pool_label, rules=defaults,
                  node_pools=shape.node_pools, queues=shape.queues, namespaces=shape.namespaces,
                  registry=registry)


def _check_rule(registry: Registry, name: str, body: dict[str, Any], base: dict[str, Any],
                loc: tuple[Any, ...], root: yaml.Node | None, issues: list[PolicyIssue]) -> bool:
    rule = registry.get(name) or registry.kinds.get(name)
    model = rule.settings if rule is not None and rule.name == name else None
    if model is None:
        if rule is None:
            why = f"unknown rule; valid rules: {', '.join(sorted(registry.configurable()))}"
        elif rule.name != name:
            why = f"a finding kind of rule {rule.name}; configure it under {rule.name}"
        else:
            why = f"not configured by the policy: {rule.describe()}"
        issues.append(PolicyIssue(line_of(root, loc), ".".join(loc), why))
        return False
    try:
        model.model_validate(_deep_merge(_deep_merge(model().model_dump(), base), body))
    except ValidationError as error:
        issues.extend(issues_of(error, root, loc))
        return False
    return True


def render_defaults(registry: Registry = REGISTRY) -> str:
    """A policy file with every rule's defaults, each field preceded by its description."""
    lines = [
        "# gpusteward rule policy: the defaults of every rule.",
        "# Generated from the rules' settings models (`gpusteward rules defaults`); copy it,",
        "# change what differs, and point the worker at it with GPUSTEWARD_POLICY_FILE.",
        "# Check a file with `gpusteward rules check FILE`; see the settings that apply to a",
        "# namespace/queue/node pool with `gpusteward rules explain`.",
        "",
        *(f"# {line}" for line in _wrap(
            PolicyFile.model_fields["node_pool_label"].description or "")),
        f"node_pool_label: {DEFAULT_POOL_LABEL}",
        "",
        "rules:",
    ]
    for name, model in sorted(registry.configurable().items()):
        lines.append(f"  # {(model.__doc__ or '').strip().splitlines()[0]}")
        lines.append(f"  {name}:")
        defaults = model().model_dump(mode="json")
        for field_name, info in model.model_fields.items():
            for text_line in _wrap(info.description or ""):
                lines.append(f"    # {text_line}")
            value = defaults[field_name]
            if isinstance(value, dict) and value:
                lines.append(f"    {field_name}:")
                for key, item in sorted(value.items(), key=lambda kv: str(kv[0])):
                    lines.append(f"      {_flow({key: _without_none(item)})}")
            else:
                lines.append(f"    {_flow({field_name: value})}")
    lines += [
        "",
        "# Overrides, most specific last: node pool, then queue, then namespace. Only the",
        "# fields that differ are needed. Examples:",
        "#   node_pools:",
        "#     l4-inference: {thermal_slowdown: {window_s: 600}}",
        "#   queues:",
        "#     research: {idle_holder: {window_s: 3600}}",
        "#   namespaces:",
        "#     ml-serving: {idle_holder: {reclaim: false}}",
        "node_pools: {}",
        "queues: {}",
        "namespaces: {}",
        "",
    ]
    return "\n".join(lines)


def _flow(value: dict[Any, Any]) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=True).strip()
    return text[1:-1]


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def _wrap(text: str, width: int = 88) -> list[str]:
    words, lines, current = text.split(), [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return lines
