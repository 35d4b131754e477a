"""The ``gpusteward`` command: one entry point for every process and tool."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError

from gpusteward.cli import report as report_commands
from gpusteward.cli import sandbox as sandbox_commands
from gpusteward.cli import status as status_commands
from gpusteward.cli.collect import collect_app
from gpusteward.cli.common import (
    Bootstrap,
    LogLevel,
    ensure_topics,
    folder,
    kafka_settings,
    run_consumer,
    settings_errors,
    settings_source_error,
)
from gpusteward.cli.doctor import doctor
from gpusteward.cli.rules import rules_app
from gpusteward.cli.watch import watch as kube_watch
from gpusteward.errors import ConfigError
from gpusteward.settings import Settings

if TYPE_CHECKING:
    from gpusteward.remediation.kubernetes import KubernetesBackend, KubeSettings

app = typer.Typer(help="Steward of a Kubernetes GPU fleet, as a stream of events.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
schema_app = typer.Typer(help="The payload contract.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")
app.add_typer(collect_app, name="collect")
app.command("report")(report_commands.report)
app.command("sink")(report_commands.sink)
app.command("replay")(sandbox_commands.replay)
app.command("simulate")(sandbox_commands.simulate)
app.command("demo")(sandbox_commands.demo)
app.add_typer(rules_app, name="rules")
app.command(name="watch")(kube_watch)
app.command(name="status")(status_commands.status)
app.command(name="doctor")(doctor)


@app.command()
def broker(port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port on 127.0.0.1.")
                           ] = 9092) -> None:
    """Run the embedded Kafka-compatible broker (memory-only) until Ctrl-C."""
    from gpusteward.broker import PortInUse, serve_forever

    try:
        status = serve_forever(port)
    except PortInUse as error:
        raise typer.BadParameter(str(error), param_hint="--port") from error
    raise typer.Exit(status)


@app.command()
def worker(
    bootstrap: Bootstrap = None,
    datadir: Annotated[str | None, typer.Option(help="Faust data directory.")] = None,
    loglevel: LogLevel = "warn",
) -> None:
    """Run the stream worker: the node join and its rules."""
    import uvloop

    from gpusteward.streams import app as worker_app
    from gpusteward.streams.node import RuleSettings
    from gpusteward.streams.policy_file import policy_from_env

    # Every loop of the worker (its agents', its consumer thread's) on libuv, as Faust
    # recommends: about 4 µs (3 %) less worker CPU per node sample on bench_worker.
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    settings = kafka_settings(bootstrap)
    # A bad policy file is reported at once, not after the broker has been waited for.
    rules = RuleSettings(policy=policy_from_env())
    asyncio.run(ensure_topics(settings))
    faust_app = worker_app.create_app(settings, rules, datadir=datadir)
    if settings.health_port:
        faust_app.health.serve(settings.health_port)
    from faust.worker import Worker

    faust_worker = Worker(faust_app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    # Faust's terminal spinner turns the root logger to DEBUG so that it can spin on every
    # record: every library debug call then builds a log record on the hot path.
    faust_worker.spinner = None
    # A sample allocates dozens of objects and the worker's heap (every node's state,
    # Faust's own) is large and long-lived: at the default thresholds a full collection
    # (about 90 ms on the 10,000-GPU benchmark fleet) ran every few seconds, 5 % of the
    # worker's CPU. What is loaded by now is frozen out of the collections, and they run
    # about 30 times less often; cyclic garbage is still collected.
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
    faust_worker.execute_from_commandline()



@app.command()
def alerts(
    bootstrap: Bootstrap = None,
    alertmanager: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_ALERTMANAGER_URL", help="Alertmanager base URLs to post every "
        "alert to, comma-separated: each replica of an HA cluster, or "
        "dns+http://HOST:PORT for every address of a headless Service "
        "(dns+http://alertmanager-operated.monitoring.svc:9093).")
    ] = None,
    webhook: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_WEBHOOK_URL", help="Slack-compatible webhook URL.")] = None,
) -> None:
    """Print findings to the console as they arrive (and post them to Alertmanager/webhook)."""
    from gpusteward.alerting.alertmanager import AlertmanagerSink
    from gpusteward.alerting.consumer import AlertSink, ConsoleSink, FindingsConsumer
    from gpusteward.alerting.webhook import WebhookSink

    settings = kafka_settings(bootstrap)
    sinks: list[AlertSink] = [ConsoleSink()]
    try:
        sinks += ([AlertmanagerSink(alertmanager, cluster=settings.cluster)]
                  if alertmanager else [])
    except ConfigError as error:
        raise typer.BadParameter(str(error), param_hint="--alertmanager") from error
    sinks += [WebhookSink(webhook, cluster=settings.cluster)] if webhook else []
    run_consumer(settings, lambda stop: FindingsConsumer(settings, sinks).run(stop))


@app.command()
def act(
    bootstrap: Bootstrap = None,
    execute: Annotated[bool, typer.Option(
        "--execute/--dry-run", help="Carry actions of enabled rules out (default: only say "
        "what would happen).")] = False,
    backend: Annotated[str, typer.Option(
        help="kubernetes (the cluster of --kubeconfig or the in-cluster account) or none.")
    ] = "none",
    kubeconfig: Annotated[str | None, typer.Option(help="Kubeconfig for --backend kubernetes.")
                          ] = None,
    enable_rule: Annotated[list[str] | None, typer.Option(
        "--enable-rule", help="A rule (all the kinds it emits) or finding kind whose actions "
        "--execute carries out (repeat; '*' = all); "
        "adds to GPUSTEWARD_REMEDIATION__ENABLED_RULES.")] = None,
    reset_breaker: Annotated[bool, typer.Option(
        "--reset-breaker", help="Record a circuit-breaker reset on the audit topic and exit.")
    ] = False,
    circuit: Annotated[str | None, typer.Option(
        help="With --reset-breaker: reset only this circuit, nodes (cordon, taint, drain, MIG "
        "relabel) or reclaims (idle reclaims); both by default.")] = None,
    restore: Annotated[str | None, typer.Option(
        "--restore", metavar="KIND/NAMESPACE/NAME",
        help="Undo a reclaim and exit: start a stopped Notebook, scale a Deployment or "
        "StatefulSet back to its replicas before, resume a suspended gang (a JobSet, a "
        "PyTorchJob, TFJob, MPIJob, XGBoostJob, PaddleJob or JAXJob, or a Kueue Workload left "
        "inactive) (needs --backend kubernetes; audited).")
    ] = None,
    operator: Annotated[str, typer.Option(help="Who resets the breaker or restores (for the "
                                                "audit).")] = "operator",
) -> None:
    """Run the remediation executor: one line per action saying what it did or would do."""
    from gpusteward.remediation import executor as remediation

    settings = kafka_settings(bootstrap)
    if reset_breaker:
        try:
            record = asyncio.run(remediation.reset_breaker(settings, operator, circuit=circuit))
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
        typer.echo(f"circuit breaker reset recorded ({record.idempotency_key})")
        return
    if restore is not None:
        if backend != "kubernetes":
            raise typer.BadParameter("--restore needs --backend kubernetes")
        from gpusteward.remediation.kubernetes import KubeSettings

        client = _kubernetes_backend(KubeSettings(kubeconfig=kubeconfig))
        try:
            result = asyncio.run(remediation.restore(settings, client, restore, operator))
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
        typer.echo(f"{result.outcome.upper()}: {result.detail}")
        if result.outcome not in ("executed", "skipped"):
            raise typer.Exit(1)
        return
    policy = remediation.RemediationSettings()
    try:
        policy.enabled_rules |= remediation.known_rules(enable_rule or [])
    except ValueError as error:  # an unknown rule: the message lists the valid ones
        raise typer.BadParameter(str(error), param_hint="--enable-rule") from error
    chosen: remediation.Backend
    if backend == "kubernetes":
        from gpusteward.remediation.kubernetes import KubeSettings

        chosen = _kubernetes_backend(KubeSettings(
            kubeconfig=kubeconfig, deny_namespaces=policy.deny_namespaces,
            drain_bare_pods=policy.drain_bare_pods,
            drain_emptydir_pods=policy.drain_emptydir_pods,
            refuse_newer_nodes=policy.max_action_age_s is not None))
    elif backend == "none":
        chosen = remediation.NoBackend()
    else:
        raise typer.BadParameter(f"unknown backend {backend!r}: kubernetes or none")
    executor = remediation.Executor(settings, chosen, execute=execute, remediation=policy,
                                    on_result=remediation.ReviewPrinter())
    run_consumer(settings, executor.run)


def _kubernetes_backend(kube: KubeSettings) -> KubernetesBackend:
    """The backend of ``act --backend kubernetes``; a kubeconfig that cannot be loaded is a
    usage error naming the flag, as ``watch`` reports it."""
    from gpusteward.remediation.kubernetes import KubernetesBackend

    try:
        return KubernetesBackend(kube)
    except ConfigError as error:
        raise typer.BadParameter(str(error), param_hint="--kubeconfig") from error


@schema_app.command("export")
def schema_export(directory: Annotated[Path, typer.Argument(
        callback=folder, help="Output directory.")]) -> None:
    """Write the JSON Schema of every topic's payload into DIRECTORY."""
    from gpusteward import topics
    from gpusteward.schema import json_schema

    directory.mkdir(parents=True, exist_ok=True)
    settings = Settings()
    for spec in topics.ALL:
        path = directory / f"{spec.name(settings)}.schema.json"
        document = {"$id": path.name, "description": spec.doc, **json_schema(spec.value)}
        path.write_bytes(msgspec.json.format(msgspec.json.encode(document)) + b"\n")
        typer.echo(str(path))


@schema_app.command("docs")
def schema_docs(
    out: Annotated[Path, typer.Option(help="Where to write the page.")] = Path("docs/topics.md"),
) -> None:
    """Regenerate docs/topics.md from the topic registry and the schema."""
    from gpusteward.topicdoc import render

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    typer.echo(str(out))


CONFIG_EXIT = 2
"""Exit status of a process stopped by its configuration: click's for a usage error."""


def main() -> None:
    """Run the command; a bad setting or policy ends it with a line per problem that names
    the variable or file, not with a traceback (the pod log a user reads after a
    CrashLoopBackOff holds the few lines that matter)."""
    try:
        app()
    except ValidationError as error:
        lines = settings_errors(error)
        if lines is None:  # not a setting: a bug, whose traceback is wanted
            raise
        for line in lines:
            typer.echo(f"error: {line}", err=True)
        raise SystemExit(CONFIG_EXIT) from None
    except SettingsError as error:  # a variable that is not even JSON
        typer.echo(f"error: {settings_source_error(error)}", err=True)
        raise SystemExit(CONFIG_EXIT) from None
    except ConfigError as error:
        for line in str(error).splitlines():
            typer.echo(f"error: {line}", err=True)
        raise SystemExit(CONFIG_EXIT) from None


if __name__ == "__main__":
    main()
