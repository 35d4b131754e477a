"""The ``gpusteward report`` and ``sink`` commands: the rollup store, written and read.

Heavy imports (polars, scipy) happen inside the command, so the CLI starts
fast for every other command.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from gpusteward.cli.common import Bootstrap, configure_logging, ensure_topics, kafka_settings

SINKS = ("rollups", "queue")


def report(
    week: Annotated[str | None, typer.Option(
        help="ISO week, e.g. 2026-W47 (default: the last complete week).")] = None,
    out: Annotated[Path, typer.Option(help="Folder for report.html, .md, .json and "
                                           "mig-parted.yaml.")] = Path("report"),
    rollups: Annotated[Path | None, typer.Option(
        help="Rollup store folder (default: GPUSTEWARD_REPORT__ROLLUP_DIR or ./rollups).")
    ] = None,
    queue: Annotated[Path | None, typer.Option(
        help="Queue-event store folder (default: GPUSTEWARD_REPORT__QUEUE_DIR or "
             "./queue-events; skipped when absent).")] = None,
    findings_from_kafka: Annotated[bool, typer.Option(
        "--findings-from-kafka", help="Read the findings topic (GPUSTEWARD_KAFKA__*) for the "
        "waiting section's start-ETA accuracy and gangs half-placed; the topic's retention "
        "must cover the week.")] = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Write the weekly right-sizing report from the Parquet rollup store."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gpusteward.reports import build, compute, render, store
    from gpusteward.reports.settings import ReportSettings

    settings = ReportSettings()
    directory = rollups or settings.rollup_dir
    try:
        chosen = compute.parse_week(week) if week else compute.week_of(time.time() - 7 * 86400)
    except compute.WeekError as error:
        raise typer.BadParameter(str(error), param_hint="--week") from error
    if not directory.is_dir():
        raise typer.BadParameter(f"{directory} is not a folder", param_hint="--rollups")
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task(f"report {chosen.label}", total=len(build.STEPS))
        reading = progress.add_task("rows read", total=None)

        def step(name: str) -> None:
            progress.update(task, advance=1, description=f"report {chosen.label}: {name}")

        def rows(read: int, total: int) -> None:
            progress.update(reading, completed=read, total=total,
                            description=f"rows read: {read:,} of {total:,}")

        queue_dir = queue or settings.queue_dir
        findings = _findings(bootstrap) if findings_from_kafka else []
        try:
            result = build.build(directory, chosen, settings,
                                 queue=queue_dir if queue_dir.is_dir() else None, step=step,
                                 rows=rows, findings=findings)
        except store.StoreError as error:
            console.print(f"[red]{error}[/]")
            raise typer.Exit(1) from error
    for path in render.write(result, out):
        typer.echo(str(path))
    totals = result.data["totals"]
    if not totals["device_minutes"]:
        console.print(f"[yellow]no rollups for {chosen.label} in {directory}[/]")
    elif result.data["missing_days"]:
        console.print(f"[yellow]no rollups for {', '.join(result.data['missing_days'])} in "
                      f"{directory}: the report covers the other days[/]")


def _findings(bootstrap: str | None) -> list[Any]:
    """Every finding on the findings topic (the waiting section filters the week's)."""
    import msgspec

    from gpusteward import kafka, topics
    from gpusteward.schema import Finding

    settings = kafka_settings(bootstrap)
    decode = msgspec.json.Decoder(Finding).decode

    async def read() -> list[Finding]:
        records = await kafka.read_all(settings, topics.FINDINGS.name(settings))
        out = []
        for record in records:
            try:
                out.append(decode(record.value or b""))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a finding of this schema: the dead-letter topic's business
        return out

    return asyncio.run(read())


def sink(
    topic: Annotated[str, typer.Argument(
        help="rollups (gpusteward.rollups.v1 into the rollup store) or queue "
             "(gpusteward.queue.v1 into the queue-event store).")],
    bootstrap: Bootstrap = None,
    directory: Annotated[Path | None, typer.Option(
        "--dir", help="Store folder (default: GPUSTEWARD_REPORT__ROLLUP_DIR or "
                      "GPUSTEWARD_REPORT__QUEUE_DIR).")] = None,
    loglevel: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run a sink: a topic into its Parquet store, until SIGTERM or Ctrl-C (then flush)."""
    from gpusteward.reports import sink as sinks
    from gpusteward.reports.settings import ReportSettings

    if topic not in SINKS:
        raise typer.BadParameter(f"unknown sink {topic!r}: {' or '.join(SINKS)}",
                                 param_hint="TOPIC")
    configure_logging(loglevel)
    settings = kafka_settings(bootstrap)
    report = ReportSettings()
    make = sinks.rollup_sink if topic == "rollups" else sinks.queue_sink
    running = make(settings, report, directory)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # A pod is stopped with SIGTERM: flush the buffer and commit before going.
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await ensure_topics(settings)
        await running.run(stop)

    asyncio.run(main())
    typer.echo(f"{topic} sink: {running.rows_written} rows in {running.files_written} files "
               f"under {running.directory}, {running.duplicates} repeats skipped, "
               f"{running.dead_lettered} dead-lettered")
