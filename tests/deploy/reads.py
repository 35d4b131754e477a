"""What each gpusteward command reads from the environment, and what a deployment gives it.

pydantic-settings ignores a variable that matches no field (``extra="ignore"``),
and a click option's ``envvar`` is only looked up by name: a misspelt or stale
name in a manifest, or one set on a process that does not read it, leaves the
default in force and nobody is told. :func:`unread` says which of the
``GPUSTEWARD_*`` variables a container or compose service sees the command it
runs does not read. A command reads:

- the settings models it builds, walked field by field the way
  pydantic-settings matches names (``env_prefix``, nested models joined with
  ``env_nested_delimiter``, a dict field's keys, aliases; case-insensitive);
- the variables its click options name (``envvar=``), taken from the command;
- the plain lookups (``GPUSTEWARD_POLICY_FILE``).

Which models and lookups a command has is the table :data:`READS`, written from
``gpusteward/cli/`` (a command it does not know is an error). Where a process
builds a model but never uses some of its fields (a collector serves neither
the pipeline's /metrics nor a health port; the dcgm collector has no use for
the NVML settings), those fields are left out, so a variable set for them is
reported too.

No relaxation for a ConfigMap several containers load (``gpusteward-kafka``,
``gpusteward-store``) or compose's shared environments: such a source holds only
what every process loading it reads, and a setting one process reads is set on
that process alone (a shared ConfigMap once gave the policy file to alerts and
remediation, which mounted a policy they never read).
"""

from __future__ import annotations

import shlex
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import typer
from pydantic import AliasChoices, BaseModel
from pydantic_settings import BaseSettings

from gpusteward.cli import app
from gpusteward.cli.watch import KubeWatchEnvSettings
from gpusteward.collectors.settings import CollectSettings
from gpusteward.remediation.executor import RemediationSettings
from gpusteward.reports.settings import ReportSettings
from gpusteward.settings import Settings
from gpusteward.streams.policy_file import POLICY_ENV
from tests.deploy.conftest import Rendered

PREFIX = "GPUSTEWARD_"


@dataclass(frozen=True)
class Model:
    """A settings model a command builds, less the fields (dotted paths) it never uses."""

    settings: type[BaseSettings]
    unused: frozenset[str] = frozenset()


def model(settings: type[BaseSettings], *unused: str) -> Model:
    return Model(settings, frozenset(unused))


# Settings' /metrics and health port: the worker, the consumers (cli/common.run_consumer)
# and the watcher serve both; the collectors and the simulator
# neither (a collector serves its own /metrics, on collect.metrics_port).
_SERVING = ("metrics", "health_port")
_SOURCES = ("dcgm_url", "prometheus_url", "prometheus_nodes", "pod_labels", "nvml",
            "fake_nvml")

# GPUSTEWARD_CLUSTER names the cluster in alerts and chat (``alerts``) and in the weekly
# report (``report``); no other process uses it.
_CLUSTER = ("cluster",)
_ALL_BUT_CLUSTER = tuple(name for name in Settings.model_fields if name not in _CLUSTER)

# What each command reads besides its click options' envvars, keyed by its leading
# words (the longest key that starts a command wins). From gpusteward/cli/.
READS: dict[tuple[str, ...], tuple[Model | str, ...]] = {
    # worker(): kafka_settings(); streams/app.py: policy_from_env().
    ("worker",): (model(Settings, *_CLUSTER), POLICY_ENV),
    ("alerts",): (model(Settings),),
    # act(): kafka_settings() and RemediationSettings().
    ("act",): (model(Settings, *_CLUSTER), model(RemediationSettings)),
    # sink(): kafka_settings() and ReportSettings(); the rollup sink also the policy.
    ("sink",): (model(Settings, *_CLUSTER), model(ReportSettings)),
    ("sink", "rollups"): (model(Settings, *_CLUSTER), model(ReportSettings), POLICY_ENV),
    # report(): ReportSettings(), policy_from_env() and Settings().cluster; no Kafka.
    ("report",): (model(ReportSettings), POLICY_ENV, model(Settings, *_ALL_BUT_CLUSTER)),
    # watch(): KubeWatchEnvSettings(), then Settings() for Kafka, /metrics and health.
    ("watch",): (model(Settings, *_CLUSTER), model(KubeWatchEnvSettings)),
    ("collect", "nvml"): (
        model(Settings, *_SERVING, *_CLUSTER),
        model(CollectSettings, *(s for s in _SOURCES if s not in ("nvml", "fake_nvml")))),
    ("collect", "dcgm"): (
        model(Settings, *_SERVING, *_CLUSTER),
        model(CollectSettings, *(s for s in _SOURCES if s != "dcgm_url"))),
    ("collect", "prometheus"): (
        model(Settings, *_SERVING, *_CLUSTER),
        model(CollectSettings, *(s for s in _SOURCES if s not in (
            "prometheus_url", "prometheus_nodes", "pod_labels")))),
    ("simulate",): (model(Settings, *_SERVING, *_CLUSTER),),
    # doctor(): kafka_settings(); what else it checks, it takes from its options' envvars.
    ("doctor",): (model(Settings, *_SERVING, *_CLUSTER),),
    ("broker",): (),
}


@dataclass
class Names:
    """Variable names something reads: exact ones, and prefixes below which any name is
    read (a dict field's keys)."""

    exact: set[str] = field(default_factory=set)
    prefixes: set[str] = field(default_factory=set)

    def __contains__(self, name: str) -> bool:
        upper = name.upper()  # pydantic-settings' default: case-insensitive
        return upper in self.exact or any(upper.startswith(p) for p in self.prefixes)

    def update(self, other: Names) -> None:
        self.exact |= other.exact
        self.prefixes |= other.prefixes


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, through ``X | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (dict, typing.Mapping)


def _field_names(name: str, info: Any) -> list[str]:
    alias = info.validation_alias
    if isinstance(alias, str):
        return [alias]
    if isinstance(alias, AliasChoices):
        return [c for c in alias.choices if isinstance(c, str)]
    return [name]


def model_names(read: Model) -> Names:
    """The variables ``read.settings`` takes its fields from, less its unused fields."""
    config = read.settings.model_config
    prefix = str(config.get("env_prefix", "")).upper()
    delimiter = config.get("env_nested_delimiter") or None
    names = Names()

    def walk(cls: type[BaseModel], path: str, env: str) -> None:
        for name, info in cls.model_fields.items():
            dotted = f"{path}{name}"
            if dotted in read.unused:
                continue
            for spelt in _field_names(name, info):
                # A top-level alias is matched without the prefix, as pydantic-settings does.
                full = spelt.upper() if (not path and spelt != name) else f"{env}{spelt.upper()}"
                names.exact.add(full)  # a whole nested value, as JSON, is read too
                if delimiter is None:
                    continue
                nested = _submodel(info.annotation)
                if nested is not None:
                    walk(nested, f"{dotted}.", f"{full}{delimiter.upper()}")
                elif _is_mapping(info.annotation):
                    names.prefixes.add(f"{full}{delimiter.upper()}")

    walk(read.settings, "", prefix)
    return names


def _command(argv: list[str]) -> tuple[tuple[str, ...], Any]:
    """The words that name the command in ``argv``, and the click command (typer's own
    copy of click, so groups are told by their ``commands``)."""
    command: Any = typer.main.get_command(app)
    path: list[str] = []
    for word in argv:
        if word not in getattr(command, "commands", {}):
            break
        command = command.commands[word]
        path.append(word)
    return tuple(path), command


def read_by(argv: list[str]) -> Names:
    """Every GPUSTEWARD_* variable the gpusteward process started with ``argv`` reads."""
    path, command = _command(argv)
    words = [w for w in argv if not w.startswith("-")]
    keys = [k for k in READS if tuple(words[:len(k)]) == k]
    assert keys and path, f"`gpusteward {' '.join(argv)}`: not a command READS knows"
    names = Names()
    for read in READS[max(keys, key=len)]:
        if isinstance(read, str):
            names.exact.add(read)
        else:
            names.update(model_names(read))
    for param in command.params:
        envvars = [param.envvar] if isinstance(param.envvar, str) else param.envvar or []
        names.exact |= {e.upper() for e in envvars}
    return names


@dataclass
class Process:
    """One container or compose service: what it runs and the variables it sees."""

    where: str
    argv: list[str] | None  # None: not a gpusteward process
    seen: set[str]  # the variables its container or service is given


def gpusteward_argv(image: str | None, command: list[str] | None,
                    args: list[str] | None) -> list[str] | None:
    """The arguments of ``gpusteward`` a container runs, or None when it runs something else.

    The image's entrypoint is ``gpusteward``; a shell command is looked into for an
    ``exec gpusteward ...``.
    """
    if command:
        if command[0].endswith("gpusteward"):
            return [*command[1:], *(args or [])]
        if command[:2] == ["/bin/sh", "-c"]:
            words = shlex.split(command[2])
            if "gpusteward" in words:
                return words[words.index("gpusteward") + 1:]
        return None
    name = (image or "").rsplit("/", 1)[-1].split(":", 1)[0]
    return list(args or []) if name == "gpusteward" else None


def kubernetes_processes(rendered: Rendered) -> Iterator[Process]:
    for workload in rendered.workloads():
        pod = rendered.pod_spec(workload)
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{rendered.variant}: {workload['kind']}/{workload['metadata']['name']}"
            seen: set[str] = set()
            for source in container.get("envFrom", []):
                # A Secret's keys are not in the manifests: none may be loaded whole.
                assert "configMapRef" in source, f"{where}: envFrom {source}: keys unknown"
                name = source["configMapRef"]["name"]
                seen |= {source.get("prefix", "") + key
                         for key in rendered.config_map(workload, name).get("data", {})}
            # value or valueFrom, both set it
            seen |= {variable["name"] for variable in container.get("env", [])}
            yield Process(f"{where} container {container['name']}",
                          gpusteward_argv(container.get("image"), container.get("command"),
                                          container.get("args")), seen)


def compose_processes(compose: dict[str, Any]) -> Iterator[Process]:
    for name, service in compose["services"].items():
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        entrypoint = service.get("entrypoint")
        command = service.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if entrypoint:
            argv = gpusteward_argv(None, [*entrypoint, *(command or [])][:3], None)
        else:
            argv = gpusteward_argv(service.get("image"), None, command)
        yield Process(f"compose service {name}", argv, set(environment))


def unread(processes: Iterable[Process]) -> list[str]:
    """A line for every GPUSTEWARD_* variable the process it reaches does not read."""
    processes = list(processes)
    readers = {id(p): read_by(p.argv) for p in processes if p.argv is not None}
    problems = []
    for process in processes:
        seen = {n for n in process.seen if n.upper().startswith(PREFIX)}
        if process.argv is None:
            problems += [f"{process.where}: {n} (not a gpusteward process)" for n in sorted(seen)]
            continue
        reads = readers[id(process)]
        problems += [f"{process.where} (gpusteward {' '.join(process.argv)}): "
                     f"{name} is read by nothing it runs"
                     for name in sorted(seen) if name not in reads]
    return problems


