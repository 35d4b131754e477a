"""The ``gpusteward report`` and ``gpusteward replay`` commands.

Heavy imports (polars, scipy) happen inside the commands, so the CLI starts
fast for every other command.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_TRACES = Path("../shared/data/traces")


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
) -> None:
    """Write the weekly right-sizing report from the Parquet rollup store."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gpusteward.report import build, compute, render
    from gpusteward.report.settings import ReportSettings

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

        def step(name: str) -> None:
            progress.update(task, advance=1, description=f"report {chosen.label}: {name}")

        queue_dir = queue or settings.queue_dir
        result = build.build(directory, chosen, settings,
                             queue=queue_dir if queue_dir.is_dir() else None, step=step)
    for path in render.write(result, out):
        typer.echo(str(path))
    totals = result.data["totals"]
    if not totals["device_minutes"]:
        console.print(f"[yellow]no rollups for {chosen.label} in {directory}[/]")


def replay(
    traces: Annotated[Path, typer.Option(help="Folder holding alibaba-genai-v2026/.")
                      ] = DEFAULT_TRACES,
    week: Annotated[str | None, typer.Option(
        help="Move the trace to start on this ISO week's Monday 00:00 UTC.")] = None,
    rollups: Annotated[Path | None, typer.Option(
        help="Write per-minute rollups into this store (default: the settings' rollup_dir).")
    ] = None,
    queue: Annotated[Path | None, typer.Option(
        help="Also write the openb trace's queue events (last 7 days, moved to --week) into "
             "this store (default: the settings' queue_dir).")] = None,
    openb: Annotated[bool, typer.Option(
        "--openb/--no-openb", help="Replay the openb trace's queue events too.")] = True,
    publish: Annotated[bool, typer.Option(
        "--publish/--no-publish", help="Also publish samples and allocations to Kafka.")
    ] = False,
    bootstrap: Annotated[str | None, typer.Option(
        "--bootstrap", envvar="GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS")] = None,
) -> None:
    """Replay the Alibaba GenAI trace: into the rollup store, and optionally onto Kafka."""
    from gpusteward.collectors import traces as trace_io
    from gpusteward.report import aggregate, compute, store
    from gpusteward.report.settings import ReportSettings

    settings = ReportSettings()
    start = compute.parse_week(week).start if week else None
    options = trace_io.GenAiOptions(start=start)
    try:
        allocations, samples = trace_io.genai_records(traces, options)
    except trace_io.TraceError as error:
        raise typer.BadParameter(str(error), param_hint="--traces") from error
    directory = rollups or settings.rollup_dir
    fold = aggregate.MinuteRollups(lateness_s=settings.lateness_s,
                                   team_labels=settings.team_labels)
    for allocation in allocations:
        fold.allocation(allocation)
    out = []
    for sample in samples:
        out.extend(fold.sample(sample))
    out.extend(fold.flush())
    written = store.write(directory, store.frame(out))
    typer.echo(f"{len(out)} rollups of {len(allocations)} pods into {len(written)} file(s) "
               f"under {directory}")
    events = []
    if openb:
        queue_start = start if start is not None else compute.week_of(time.time()).start
        try:
            events = trace_io.openb_queue_events(traces, queue_start)
        except trace_io.TraceError as error:
            raise typer.BadParameter(str(error), param_hint="--traces") from error
        queue_dir = queue or settings.queue_dir
        store.write(queue_dir, store.queue_frame(events), store.QUEUE_SCHEMA)
        typer.echo(f"{len(events)} openb queue events under {queue_dir}")
    if publish:
        from gpusteward.cli import _ensure, _settings
        from gpusteward.collectors.publisher import KafkaPublisher

        kafka_settings = _settings(bootstrap)

        async def send() -> int:
            await _ensure(kafka_settings)
            publisher = KafkaPublisher(kafka_settings)
            await publisher.start()
            try:
                for event in events:
                    await publisher.queue(event)
                return await trace_io.replay_genai(publisher, traces, options)
            finally:
                await publisher.stop()

        sent = asyncio.run(send())
        typer.echo(f"published {sent} node samples and {len(allocations)} allocations")
