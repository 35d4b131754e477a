"""The rule policy: every rule's settings in one YAML file, with overrides where they differ.

A policy file has four sections besides ``node_pool_label``::

    rules:        {<rule>: {<field>: value}}                    # defaults of every rule
    node_pools:   {<pool>: {<rule>: {<field>: value}}}           # pool = value of node_pool_label
    queues:       {<queue>: {<rule>: {<field>: value}}}
    namespaces:   {<namespace>: {<rule>: {<field>: value}}}

Settings resolve in that order, later layers winning field by field (nested
mappings such as ``kinds`` or ``slowdown_c`` merge key by key): defaults,
then the node's pool, then the pod's queue, then its namespace, the most
specific owner last. Rules about a GPU (hardware faults) see only the pool
layer; the idle rule sees all of them. Resolved settings are cached per
(namespace, queue, pool), so the stream worker pays a dict lookup per sample.

Errors name the file, the line and the field (``policy.yaml:12:
rules.idle_holder.window_s: Input should be greater than 0``): the YAML is
composed into nodes that keep their position, and each validation error's
location is walked down that tree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpusteward.errors import ConfigError
from gpusteward.rules import REGISTRY, ecc, hardware, idle, xid

POLICY_ENV = "GPUSTEWARD_POLICY_FILE"
DEFAULT_POOL_LABEL = "gpusteward.io/node-pool"

# Registry name -> field of HardwareSettings, for the rules the node join groups.
_HARDWARE_FIELDS = {
    hardware.SBE_KIND: "sbe", hardware.PCIE_KIND: "pcie", hardware.NVLINK_KIND: "nvlink",
    hardware.REMAP_FAILURE_KIND: "remap_failure", hardware.REMAP_PENDING_KIND: "remap_pending",
    hardware.GPU_LOST_KIND: "gpu_lost", hardware.THERMAL_KIND: "thermal", xid.KIND: "xid",
    hardware.RECOVERY_KIND: "recovery",
}


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
    """The settings of every rule for one (namespace, queue, node pool)."""

    rules: Mapping[str, BaseModel]
    idle: idle.IdleSettings
    ecc: ecc.EccSettings
    hardware: hardware.HardwareSettings

    @classmethod
    def from_rules(cls, rules: Mapping[str, BaseModel]) -> Resolved:
        hw = hardware.HardwareSettings(
            **{attr: rules[name] for name, attr in _HARDWARE_FIELDS.items()})
        idle_settings, ecc_settings = rules[idle.KIND], rules[ecc.KIND]
        assert isinstance(idle_settings, idle.IdleSettings)
        assert isinstance(ecc_settings, ecc.EccSettings)
        return cls(rules=dict(rules), idle=idle_settings, ecc=ecc_settings, hardware=hw)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Every rule's effective settings as plain data (for ``rules explain``)."""
        return {name: model.model_dump(mode="json") for name, model in sorted(self.rules.items())}


@dataclass(frozen=True)
class PolicyIssue:
    """One problem in a policy file, located."""

    line: int | None
    field: str
    message: str


class PolicyError(ConfigError, ValueError):
    """A policy file that cannot be used; ``issues`` locates every problem found."""

    def __init__(self, origin: str, issues: list[PolicyIssue]) -> None:
        self.origin = origin
        self.issues = issues
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """``FILE:LINE: field: message`` for every issue."""
        return [f"{self.origin}:{i.line if i.line is not None else '?'}: {i.field or '<top>'}: "
                f"{i.message}" for i in self.issues]


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass
class Policy:
    """Validated policy data and a cache of resolved settings."""

    node_pool_label: str = DEFAULT_POOL_LABEL
    rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_pools: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    queues: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    namespaces: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    _cache: dict[tuple[str | None, str | None, str | None], Resolved] = field(
        default_factory=dict, repr=False, compare=False)

    def resolve(self, namespace: str | None = None, queue: str | None = None,
                node_pool: str | None = None) -> Resolved:
        """The effective settings of every rule for this namespace, queue and node pool."""
        key = (namespace, queue, node_pool)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        layers = [self.node_pools.get(node_pool or ""), self.queues.get(queue or ""),
                  self.namespaces.get(namespace or "")]
        models: dict[str, BaseModel] = {}
        for name, model in REGISTRY.items():
            data = _deep_merge(model().model_dump(), self.rules.get(name, {}))
            for layer in layers:
                if layer and name in layer:
                    data = _deep_merge(data, layer[name])
            models[name] = model.model_validate(data)
        resolved = self._cache[key] = Resolved.from_rules(models)
        return resolved


def _key_node(node: yaml.Node, key: Any) -> tuple[yaml.Node | None, yaml.Node | None]:
    """The key node and value node of ``key`` in a mapping node."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if str(key_node.value) == str(key):
                return key_node, value_node
    return None, None


def _line(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the deepest node ``loc`` reaches in the composed YAML."""
    if root is None:
        return None
    node: yaml.Node = root
    line = node.start_mark.line + 1
    for part in loc:
        if part == "[key]":
            return line
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
            continue
        key_node, value_node = _key_node(node, part)
        if key_node is None or value_node is None:
            return line
        line = key_node.start_mark.line + 1
        node = value_node
    return line


def _issues(error: ValidationError, prefix: tuple[Any, ...],
            root: yaml.Node | None) -> list[PolicyIssue]:
    out = []
    for detail in error.errors():
        loc = prefix + tuple(detail["loc"])
        name = ".".join(str(p) for p in loc if p != "[key]")
        out.append(PolicyIssue(_line(root, loc), name, detail["msg"]))
    return out


def parse_policy(text: str, origin: str = "<policy>") -> Policy:
    """A policy from YAML text; :class:`PolicyError` lists every problem with its line."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        raise PolicyError(origin, [PolicyIssue(mark.line + 1 if mark else None, "",
                                               f"not valid YAML: {error.problem}")]) from error
    if data is None:
        data = {}
    try:
        shape = PolicyFile.model_validate(data)
    except ValidationError as error:
        raise PolicyError(origin, _issues(error, (), root)) from error
    issues: list[PolicyIssue] = []
    defaults: dict[str, dict[str, Any]] = {}
    for name, body in shape.rules.items():
        if _check_rule(name, body, {}, ("rules", name), root, issues):
            defaults[name] = body
    for section in ("node_pools", "queues", "namespaces"):
        for owner, rules in getattr(shape, section).items():
            for name, body in rules.items():
                _check_rule(name, body, defaults.get(name, {}), (section, owner, name), root,
                            issues)
    if issues:
        raise PolicyError(origin, issues)
    return Policy(node_pool_label=shape.node_pool_label, rules=defaults,
                  node_pools=shape.node_pools, queues=shape.queues, namespaces=shape.namespaces)


def _check_rule(name: str, body: dict[str, Any], base: dict[str, Any], loc: tuple[Any, ...],
                root: yaml.Node | None, issues: list[PolicyIssue]) -> bool:
    model = REGISTRY.get(name)
    if model is None:
        issues.append(PolicyIssue(_line(root, loc), ".".join(loc),
                                  f"unknown rule; valid rules: {', '.join(sorted(REGISTRY))}"))
        return False
    try:
        model.model_validate(_deep_merge(_deep_merge(model().model_dump(), base), body))
    except ValidationError as error:
        issues.extend(_issues(error, loc, root))
        return False
    return True


def shipped_policy_text() -> str:
    """The policy file shipped with the package: every rule's defaults, documented."""
    return resources.files(__package__).joinpath("policy.yaml").read_text()


def load_policy(path: str | os.PathLike[str] | None = None) -> Policy:
    """The policy in ``path``, or the shipped defaults when ``path`` is None."""
    if path is None:
        return parse_policy(shipped_policy_text(), "policy.yaml (shipped)")
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise PolicyError(str(path), [PolicyIssue(None, "", f"cannot read: {error}")]) from error
    return parse_policy(text, str(path))


def policy_from_env(environ: Mapping[str, str] | None = None) -> Policy:
    """The policy named by ``GPUSTEWARD_POLICY_FILE``, or the shipped one when it is unset."""
    environ = os.environ if environ is None else environ
    return load_policy(environ.get(POLICY_ENV) or None)


def render_defaults() -> str:
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
    for name, model in sorted(REGISTRY.items()):
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
