"""What every command shares: Kafka settings from flags, topic creation, log set-up, the
options several commands take (each checked once, here), and the one-line report of a bad
setting.

Kept apart from the command modules so that none of them imports another
(the report, collect and watch commands used to reach into the main CLI's
private helpers, and it into them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsError

from gpusteward.errors import cut
from gpusteward.settings import Settings, host_ports, not_a_file


def _host_ports(value: str | None) -> str | None:
    if not value:  # unset or empty: the settings' own value
        return value
    try:
        return host_ports(value)
    except ValueError as error:  # click names the variable when the value came from it
        raise typer.BadParameter(str(error)) from error


Bootstrap = Annotated[
    str | None,
    typer.Option("--bootstrap", envvar="GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS",
                 callback=_host_ports, help="Kafka bootstrap servers (host:port,...)."),
]

LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "warn": "warning",
              "error": "error", "critical": "critical", "crit": "critical"}
"""The levels ``--loglevel`` takes, with Faust's short names, to the logging module's."""


def _log_level(value: str) -> str:
    level = LOG_LEVELS.get(value.lower())
    if level is None:
        raise typer.BadParameter(f"{value!r} is not a level: debug, info, warning, error or "
                                 "critical")
    return level


LogLevel = Annotated[str, typer.Option(
    "--loglevel", callback=_log_level, help="debug, info, warning, error or critical.")]


def folder(value: Path | None) -> Path | None:
    """The callback of an option naming a folder to write into: a file there is refused
    before any work is done (the first write would fail, and the work be lost)."""
    if value is None:
        return None
    try:
        return not_a_file(value)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error


def kafka_settings(bootstrap: str | None = None) -> Settings:
    """The settings from the environment, with ``--bootstrap`` winning when given."""
    settings = Settings()
    if bootstrap:
        kafka = settings.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        settings = settings.model_copy(update={"kafka": kafka})
    return settings


async def ensure_topics(settings: Settings) -> None:
    """Wait for the broker, then create any missing topic of the contract."""
    from gpusteward import kafka

    await kafka.wait_for_broker(settings)
    await kafka.ensure_topics(settings)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_consumer(settings: Settings, run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run a consumer with its health probe until SIGTERM or Ctrl-C, or until its topics
    vanish.

    Ready once its topics exist; live while its loop beats. SIGTERM (a pod being
    stopped) and Ctrl-C ask ``run`` to stop, so it finishes its batch (a sink flushes
    and commits) within the pod's grace period. A broker that comes back without the
    topics ends the process with an error, so its supervisor restarts it and the start
    creates them again.
    """
    from gpusteward import health, topics
    from gpusteward.kafka import list_topics

    async def main() -> str | None:
        state = health.Health()
        server = state.serve(settings.health_port) if settings.health_port else None
        beating = asyncio.create_task(health.heartbeat(state))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            # A stop while the broker is still awaited ends the wait (Ctrl-C on a laptop
            # whose broker is not up yet).
            preparing = asyncio.ensure_future(ensure_topics(settings))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({preparing, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not preparing.done():
                preparing.cancel()
                return None
            preparing.result()
            state.set_ready(True, "topics exist")
            working = asyncio.ensure_future(run(stop))
            names = [spec.name(settings) for spec in topics.ALL]
            watching = asyncio.create_task(
                health.watch_topics(state, names, lambda: list_topics(settings)))
            await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
            if working.done():
                watching.cancel()
                await working
                return None
            stop.set()
            await asyncio.wait({working}, timeout=10.0)
            return watching.result()
        finally:
            beating.cancel()
            if server is not None:
                server.shutdown()

    try:
        failure = asyncio.run(main())
    except KeyboardInterrupt:
        return
    if failure is not None:
        typer.echo(f"error: {failure}; exiting so that the supervisor restarts this process",
                   err=True)
        raise typer.Exit(3)


def _settings_model(name: str) -> type[BaseSettings] | None:
    """The loaded settings model called ``name`` (a ValidationError's title)."""
    pending: list[type[BaseSettings]] = [BaseSettings]
    while pending:
        cls = pending.pop()
        if cls.__name__ == name and cls.__module__.startswith("gpusteward."):
            return cls
        pending.extend(cls.__subclasses__())
    return None


def settings_errors(error: ValidationError,
                    environ: Mapping[str, str] | None = None) -> list[str] | None:
    """One line per problem of a settings model, naming the variable that set the value.

    None when ``error`` is not a settings model's: that is a bug, whose traceback is
    wanted. The value is repeated only when it is the variable's whole text (a field's,
    not a group's, which may hold a password); a value that came from a flag or a
    default is named by its field.
    """
    model = _settings_model(error.title)
    if model is None:
        return None
    environ = os.environ if environ is None else environ
    spelt = {name.upper(): name for name in environ}  # pydantic-settings ignores case
    prefix = str(model.model_config.get("env_prefix") or "")
    delimiter = model.model_config.get("env_nested_delimiter")
    lines = []
    for problem in error.errors(include_url=False):
        path = [part for part in problem["loc"] if isinstance(part, str)]
        depths = range(len(path), 0, -1) if delimiter else range(min(len(path), 1), 0, -1)
        candidates = [(prefix + (delimiter or "").join(path[:depth])).upper() for depth in depths]
        depth, found = next(((d, spelt[c]) for d, c in zip(depths, candidates, strict=True)
                             if c in spelt), (0, None))
        if found is not None:
            text = environ[found]
            where = f"{found}={cut(text, 80)!r}" if problem["input"] == text else found
            if depth < len(path):  # a key inside the variable's JSON
                where += f" (key {'.'.join(path[depth:])!r})"
        elif candidates and delimiter and problem["type"] == "missing":
            where = candidates[0]  # a nested field the variables beside it leave out
        elif candidates and delimiter and any(
                name.startswith(candidates[0] + delimiter) for name in spelt):
            where = f"{candidates[0]}{delimiter}*"  # a group's check, such as SASL's
        else:
            where = ".".join([model.__name__, *path])
        lines.append(f"{where}: {problem['msg'].removeprefix('Value error, ')}")
    return lines


def settings_source_error(error: SettingsError,
                          environ: Mapping[str, str] | None = None) -> str:
    """One line for a variable pydantic-settings could not even parse (a group or list
    that is not JSON), naming the variable: its error names only the field."""
    environ = os.environ if environ is None else environ
    field = re.search(r'field "([^"]+)"', str(error))
    cause = error.__cause__
    why = f"must be JSON (a list or an object): {cause}" if cause is not None else str(error)
    if field is not None:
        suffix = "_" + field.group(1).upper()
        named = [name for name in environ
                 if name.upper().startswith("GPUSTEWARD_") and name.upper().endswith(suffix)]
        named.sort(key=lambda name: _is_json(environ[name]))  # the unparsable one first
        if named:
            return f"{named[0]}={cut(environ[named[0]], 80)!r}: {why}"
    return str(error)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
