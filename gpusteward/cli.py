"""The ``gpusteward`` command: one entry point for every process and tool."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import typer

from gpusteward.collectors.cli import collect_app
from gpusteward.collectors.kube_cli import watch as kube_watch
from gpusteward.report import commands as report_commands
from gpusteward.rulescli import rules_app
from gpusteward.settings import Settings

app = typer.Typer(help="Steward of a Kubernetes GPU fleet, as a stream of events.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
schema_app = typer.Typer(help="The payload contract.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")
app.add_typer(collect_app, name="collect")
app.command("report")(report_commands.report)
app.command("replay")(report_commands.replay)
app.add_typer(rules_app, name="rules")
app.command(name="watch")(kube_watch)

Bootstrap = Annotated[
    str | None,
    typer.Option("--bootstrap", envvar="GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS",
                 help="Kafka bootstrap servers (host:port,...)."),
]


def _settings(bootstrap: str | None = None) -> Settings:
    settings = Settings()
    if bootstrap:
        kafka = settings.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        settings = settings.model_copy(update={"kafka": kafka})
    return settings


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def broker(port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1.")] = 9092) -> None:
    """Run the embedded Kafka-compatible broker (memory-only) until Ctrl-C."""
    from gpusteward.broker import serve_forever

    serve_forever(port)


@app.command()
def worker(
    bootstrap: Bootstrap = None,
    datadir: Annotated[str | None, typer.Option(help="Faust data directory.")] = None,
    loglevel: Annotated[str, typer.Option(help="crit, error, warn, info or debug.")] = "warn",
) -> None:
    """Run the stream worker: the node join and its rules."""
    from gpusteward.streams import app as worker_app

    settings = _settings(bootstrap)
    asyncio.run(_ensure(settings))
    faust_app = worker_app.create_app(settings, datadir=datadir)
    from faust.worker import Worker

    faust_worker = Worker(faust_app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    # Faust's terminal spinner turns the root logger to DEBUG so that it can spin on every
    # record: every library debug call then builds a log record on the hot path.
    faust_worker.spinner = None
    faust_worker.execute_from_commandline()


async def _ensure(settings: Settings) -> None:
    from gpusteward import kafka

    await kafka.wait_for_broker(settings)
    await kafka.ensure_topics(settings)


@app.command()
def simulate(
    scenario: Annotated[str, typer.Argument(help="Built-in scenario name or a YAML file.")
                        ] = "eight-a100",
    bootstrap: Bootstrap = None,
    acceleration: Annotated[float | None, typer.Option(
        help="Simulated seconds per wall second (0 = as fast as possible).")] = None,
    truth: Annotated[Path | None, typer.Option(help="Write the ground truth JSON here.")
                     ] = None,
) -> None:
    """Publish a simulated fleet's samples and allocation events."""
    from gpusteward.collectors.publisher import KafkaPublisher
    from gpusteward.collectors.simulator import scenario as scenarios
    from gpusteward.collectors.simulator.engine import SimulatedCluster

    spec = scenarios.load(scenario)
    if acceleration is not None:
        spec = spec.model_copy(update={"acceleration": acceleration})
    settings = _settings(bootstrap)

    async def main() -> None:
        await _ensure(settings)
        publisher = KafkaPublisher(settings)
        await publisher.start()
        try:
            result = await SimulatedCluster(spec).run(publisher)
        finally:
            await publisher.stop()
        if truth:
            truth.write_bytes(msgspec.json.format(msgspec.json.encode(result)))

    asyncio.run(main())


@app.command()
def alerts(
    bootstrap: Bootstrap = None,
    alertmanager: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_ALERTMANAGER_URL", help="Alertmanager base URL to post alerts to.")
    ] = None,
    webhook: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_WEBHOOK_URL", help="Slack-compatible webhook URL.")] = None,
) -> None:
    """Print findings to the console as they arrive (and post them to Alertmanager/webhook)."""
    from gpusteward.consumers.alertmanager import AlertmanagerSink
    from gpusteward.consumers.alerts import AlertSink, ConsoleSink, FindingsConsumer
    from gpusteward.consumers.webhook import WebhookSink

    settings = _settings(bootstrap)
    sinks: list[AlertSink] = [ConsoleSink()]
    sinks += [AlertmanagerSink(alertmanager)] if alertmanager else []
    sinks += [WebhookSink(webhook)] if webhook else []
    _run_until_interrupted(settings, lambda stop: FindingsConsumer(settings, sinks).run(stop))


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
        "--enable-rule", help="A rule whose actions --execute carries out (repeat; '*' = all); "
        "adds to GPUSTEWARD_REMEDIATION__ENABLED_RULES.")] = None,
    reset_breaker: Annotated[bool, typer.Option(
        "--reset-breaker", help="Record a circuit-breaker reset on the audit topic and exit.")
    ] = False,
    operator: Annotated[str, typer.Option(help="Who resets the breaker (for the audit).")
                        ] = "operator",
) -> None:
    """Run the remediation executor: one line per action saying what it did or would do."""
    from gpusteward.consumers import remediation

    settings = _settings(bootstrap)
    if reset_breaker:
        record = asyncio.run(remediation.reset_breaker(settings, operator))
        typer.echo(f"circuit breaker reset recorded ({record.idempotency_key})")
        return
    policy = remediation.RemediationSettings()
    policy.enabled_rules |= set(enable_rule or [])
    chosen: remediation.Backend
    if backend == "kubernetes":
        from gpusteward.consumers.kube_backend import KubernetesBackend, KubeSettings

        chosen = KubernetesBackend(KubeSettings(kubeconfig=kubeconfig,
                                                deny_namespaces=policy.deny_namespaces))
    elif backend == "none":
        chosen = remediation.NoBackend()
    else:
        raise typer.BadParameter(f"unknown backend {backend!r}: kubernetes or none")
    executor = remediation.Executor(settings, chosen, execute=execute, remediation=policy,
                                    on_result=remediation.ReviewPrinter())
    _run_until_interrupted(settings, executor.run)


def _run_until_interrupted(settings: Settings, run: object) -> None:
    async def main() -> None:
        await _ensure(settings)
        stop = asyncio.Event()
        await run(stop)  # type: ignore[operator]

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


@app.command()
def demo(
    duration: Annotated[float, typer.Option(
        "--duration", help="Wall seconds the scenario takes (0 = as fast as possible).")] = 60.0,
    scenario: Annotated[str, typer.Option(help="Built-in scenario or YAML file.")
                        ] = "eight-a100",
    seed: Annotated[int | None, typer.Option(help="Override the scenario's seed.")] = None,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Show the live view.")] = True,
    feed: Annotated[Literal["simulator", "kubernetes"], typer.Option(
        help="Where allocation and queue events come from: the simulator itself, or the "
        "Kubernetes watcher on an API-server double the simulated fleet is mirrored into."
    )] = "simulator",
) -> None:
    """Run the whole pipeline on an embedded broker and a simulated fleet."""
    from gpusteward.demo import run_demo

    raise typer.Exit(run_demo(scenario, duration, live_view=live, seed=seed, feed=feed))


@schema_app.command("export")
def schema_export(directory: Annotated[Path, typer.Argument(help="Output directory.")]) -> None:
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
