"""The ``gpusteward report`` and ``sink`` commands: the rollup store, written and read.

Heavy imports (polars, scipy) happen inside the command, so the CLI starts
fast for every other command.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated

import typer

from gpusteward.cli.common import (
    Bootstrap,
    LogLevel,
    configure_logging,
    folder,
    kafka_settings,
    run_consumer,
)

SINKS = ("rollups", "queue", "findings", "results")
NO_DATA_EXIT = 4
"""Exit status of a report whose week has no rollups at all (written and posted anyway, so
the gap is seen): the CronJob fails the Job at once on it instead of retrying, since a
rerun finds no more data (deploy/base/report.yaml, podFailurePolicy)."""


def report(
    week: Annotated[str | None, typer.Option(
        help="ISO week, e.g. 2026-W47 (default: the last complete week).")] = None,
    out: Annotated[Path, typer.Option(callback=folder, help="Folder for report.html, .md, "
                                      ".json and mig-parted.yaml.")] = Path("report"),
    rollups: Annotated[Path | None, typer.Option(
        help="Rollup store folder (default: GPUSTEWARD_REPORT__ROLLUP_DIR or ./rollups).")
    ] = None,
    queue: Annotated[Path | None, typer.Option(
        help="Queue-event store folder (default: GPUSTEWARD_REPORT__QUEUE_DIR or "
             "./queue-events; skipped when absent).")] = None,
) -> None:
    """Write the weekly right-sizing report from the Parquet rollup store.

    With GPUSTEWARD_REPORT__ARCHIVE_DIR set, the report is also kept there under its
    week's name and compared with the previous week's; with
    GPUSTEWARD_REPORT__WEBHOOK_URL set, its summary is posted to that webhook. A week
    without any rollups is written and posted too (it says so), then exits with status 4.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gpusteward.errors import TemporaryError
    from gpusteward.reports import archive, build, compute, notify, render, store
    from gpusteward.reports.settings import ReportSettings
    from gpusteward.settings import Settings
    from gpusteward.streams.policy_file import policy_from_env

    settings = ReportSettings()
    # GPUSTEWARD_CLUSTER, the one setting of the pipeline's the report reads (no Kafka).
    cluster = Settings().cluster
    # The live rules' policy: the report judges queues and idleness as the alerts do.
    policy = policy_from_env()
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
        findings_dir = settings.findings_dir if settings.findings_dir.is_dir() else None
        results_dir = settings.results_dir if settings.results_dir.is_dir() else None
        try:
            result = build.build(directory, chosen, settings,
                                 queue=queue_dir if queue_dir.is_dir() else None, step=step,
                                 rows=rows, policy=policy, findings_dir=findings_dir,
                                 results_dir=results_dir,
                                 previous=archive.previous(settings.archive_dir, chosen),
                                 cluster=cluster)
        except store.StoreError as error:
            console.print(f"[red]{error}[/]")
            raise typer.Exit(1) from error
    for path in render.write(result, out):
        typer.echo(str(path))
    if settings.archive_dir is not None:
        for path in render.write(result, archive.folder(settings.archive_dir, chosen)):
            typer.echo(str(path))
    if result.empty:
        console.print(f"[red]no rollups for {chosen.label} in {directory}: the report says "
                      "so, and the job fails[/]")
    elif result.data["missing_days"]:
        console.print(f"[yellow]no rollups for {', '.join(result.data['missing_days'])} in "
                      f"{directory}: the report covers the other days[/]")
    url = settings.webhook_url.get_secret_value() if settings.webhook_url else ""
    if url:
        link = settings.report_url
        if link and settings.archive_dir is not None:
            link = f"{link.rstrip('/')}/{chosen.label}/report.html"
        try:
            asyncio.run(notify.post(url, notify.summary(result.data, link)))
        except TemporaryError as error:
            # The files are written; the job fails so the miss shows and can be re-run.
            console.print(f"[red]summary not posted: {error}[/]")
            raise typer.Exit(1) from error
        console.print("summary posted to the webhook")
    if result.empty:
        raise typer.Exit(NO_DATA_EXIT)


def sink(
    topic: Annotated[str, typer.Argument(
        help="rollups (gpusteward.rollups.v1 into the rollup store), queue "
             "(gpusteward.queue.v1 into the queue-event store), findings "
             "(gpusteward.findings.v1 into the findings store) or results "
             "(gpusteward.action-results.v1 into the action-result store).")],
    bootstrap: Bootstrap = None,
    directory: Annotated[Path | None, typer.Option(
        "--dir", callback=folder,
        help="Store folder (default: GPUSTEWARD_REPORT__ROLLUP_DIR, _QUEUE_DIR, "
             "_FINDINGS_DIR or _RESULTS_DIR).")] = None,
    loglevel: LogLevel = "info",
) -> None:
    """Run a sink: a topic into its Parquet store, until SIGTERM or Ctrl-C (then flush)."""
    from gpusteward.reports import policy as live_policy
    from gpusteward.reports import sink as sinks
    from gpusteward.reports.settings import ReportSettings
    from gpusteward.streams.policy_file import policy_from_env

    if topic not in SINKS:
        raise typer.BadParameter(f"unknown sink {topic!r}: {', '.join(SINKS)}",
                                 param_hint="TOPIC")
    configure_logging(loglevel)
    settings = kafka_settings(bootstrap)
    report = ReportSettings()
    if topic == "rollups":
        # Its idle GPU-seconds metric counts the minutes the idle rule and the report count.
        report = live_policy.aligned(report, policy_from_env())
    make = {"rollups": sinks.rollup_sink, "queue": sinks.queue_sink,
            "findings": sinks.findings_sink, "results": sinks.results_sink}[topic]
    running = make(settings, report, directory)
    # Health on GPUSTEWARD_HEALTH_PORT; SIGTERM flushes the buffer and commits before going.
    run_consumer(settings, running.run)
    typer.echo(f"{topic} sink: {running.rows_written} rows in {running.files_written} files "
               f"under {running.directory}, {running.duplicates} repeats skipped, "
               f"{running.dead_lettered} dead-lettered")
