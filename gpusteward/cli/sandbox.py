"""The commands of the simulated world: ``demo``, ``simulate`` and ``replay``.

The only CLI module that imports the sandbox (the architecture test checks
it): production commands never load the simulator, the fakes or the traces.
Heavy imports happen inside the commands, so the CLI starts fast.

``replay --through-pipeline`` is the trace's end-to-end check: it starts an
embedded broker and the real stream worker, publishes the GenAI trace, reads
the idle findings back and compares them with
:func:`gpusteward.sandbox.traces.offline_idle_periods`, a polars
computation that shares no code with the worker.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer
from pydantic import ValidationError

from gpusteward.cli.common import Bootstrap, ensure_topics, kafka_settings

if TYPE_CHECKING:
    from gpusteward.sandbox.pipeline import WorkerProcess
    from gpusteward.sandbox.traces import GenAiOptions
    from gpusteward.schema import Finding
    from gpusteward.settings import Settings

DEFAULT_TRACES = Path("../shared/data/traces")


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
    from gpusteward.collectors.transport.publisher import KafkaPublisher
    from gpusteward.sandbox.simulator import scenario as scenarios
    from gpusteward.sandbox.simulator.engine import SimulatedCluster

    spec = scenarios.load(scenario)
    if acceleration is not None:  # checked as the scenario file's own value is
        try:
            spec = type(spec).model_validate({**spec.model_dump(), "acceleration": acceleration})
        except ValidationError as error:
            raise typer.BadParameter("; ".join(problem["msg"] for problem in error.errors()),
                                     param_hint="--acceleration") from error
    settings = kafka_settings(bootstrap)

    async def main() -> None:
        await ensure_topics(settings)
        publisher = KafkaPublisher(settings)
        await publisher.start()
        try:
            result = await SimulatedCluster(spec).run(publisher)
        finally:
            await publisher.stop()
        if truth:
            truth.write_bytes(msgspec.json.format(msgspec.json.encode(result)))

    asyncio.run(main())



def demo(
    duration: Annotated[float, typer.Option(
        "--duration", help="Wall seconds the scenario takes (0 = as fast as possible).")] = 60.0,
    scenario: Annotated[str, typer.Option(help="Built-in scenario or YAML file.")
                        ] = "eight-a100",
    seed: Annotated[int | None, typer.Option(help="Override the scenario's seed.")] = None,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Show the live view.")] = True,
) -> None:
    """Run the system as deploy/ declares it on an embedded broker and a simulated fleet."""
    from gpusteward.sandbox.demo import run_demo

    raise typer.Exit(run_demo(scenario, duration, live_view=live, seed=seed))



def replay(
    traces: Annotated[Path, typer.Option(help="Folder holding alibaba-genai-v2026/.")
                      ] = DEFAULT_TRACES,
    week: Annotated[str | None, typer.Option(
        help="Move the trace to start on this ISO week's Monday 00:00 UTC.")] = None,
    rollups: Annotated[Path | None, typer.Option(
        help="Write per-minute rollups into this store (default: the settings' rollup_dir).")
    ] = None,
    queue: Annotated[Path | None, typer.Option(
        help="Also write the openb trace's queue events (last 7 days, moved to --week, else to "
             "last week) into "
             "this store (default: the settings' queue_dir).")] = None,
    openb: Annotated[bool, typer.Option(
        "--openb/--no-openb", help="Replay the openb trace's queue events too.")] = True,
    publish: Annotated[bool, typer.Option(
        "--publish/--no-publish", help="Also publish samples and allocations to Kafka.")
    ] = False,
    bootstrap: Bootstrap = None,
    through_pipeline: Annotated[bool, typer.Option(
        "--through-pipeline", help="Instead: start an embedded broker and the stream worker, "
        "replay the trace through them and compare the idle periods found with an offline "
        "computation (exit status 1 when they differ).")] = False,
) -> None:
    """Replay the Alibaba GenAI trace: into the rollup store, and optionally onto Kafka."""
    from gpusteward.reports import aggregate, compute, store
    from gpusteward.reports.settings import ReportSettings
    from gpusteward.sandbox import traces as trace_io

    settings = ReportSettings()
    start = compute.parse_week(week).start if week else None
    options = trace_io.GenAiOptions(start=start)
    if through_pipeline:
        raise typer.Exit(_check_through_pipeline(traces, options))
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
        # The last whole week, as `report` defaults to: the current one would put events
        # ahead of the clock, which the worker refuses (GPUSTEWARD_MAX_EVENT_AHEAD_S).
        queue_start = (start if start is not None
                       else compute.week_of(time.time() - 7 * 86400).start)
        try:
            events = trace_io.openb_queue_events(traces, queue_start)
        except trace_io.TraceError as error:
            raise typer.BadParameter(str(error), param_hint="--traces") from error
        queue_dir = queue or settings.queue_dir
        store.write(queue_dir, store.queue_frame(events), store.QUEUE_SCHEMA)
        typer.echo(f"{len(events)} openb queue events under {queue_dir}")
    if publish:
        from gpusteward.collectors.transport.publisher import KafkaPublisher

        target = kafka_settings(bootstrap)

        async def send() -> int:
            await ensure_topics(target)
            publisher = KafkaPublisher(target)
            await publisher.start()
            try:
                for event in events:
                    await publisher.queue(event)
                return await trace_io.replay_genai(publisher, traces, options)
            finally:
                await publisher.stop()

        sent = asyncio.run(send())
        typer.echo(f"published {sent} node samples and {len(allocations)} allocations")


@dataclass
class PipelineReplay:
    """What the stream worker found when the trace went through it."""

    findings: list[Finding]
    samples: int
    seconds: float

    def idle_periods(self) -> dict[tuple[str, float], set[str]]:
        """(namespace/pod, starts_at) -> ids of the firing idle findings of that period.

        The idle rule may re-issue an open period's finding as it climbs its ladder (same
        id and start, higher severity), so periods are told apart by their start.
        """
        periods: dict[tuple[str, float], set[str]] = {}
        for finding in self.findings:
            pod = finding.subject.pod
            if finding.kind == "idle_holder" and finding.state == "firing" and pod:
                key = (f"{pod.namespace}/{pod.name}", finding.starts_at)
                periods.setdefault(key, set()).add(finding.id)
        return periods


@contextmanager
def _policy_env(path: Path) -> Iterator[None]:
    """GPUSTEWARD_POLICY_FILE set to ``path`` while the block runs: the worker child reads
    its policy from its environment, which it copies when it starts."""
    from gpusteward.streams.policy_file import POLICY_ENV

    before = os.environ.get(POLICY_ENV)
    os.environ[POLICY_ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(POLICY_ENV, None)
        else:
            os.environ[POLICY_ENV] = before


async def _consumed_while_alive(settings: Settings, worker: WorkerProcess, names: list[str],
                                timeout_s: float) -> None:
    """:func:`kafka.wait_consumed`, but a worker that died fails it at once."""
    from gpusteward import kafka
    from gpusteward.topics import worker_group

    waiting = asyncio.create_task(
        kafka.wait_consumed(settings, worker_group(settings), names, timeout_s=timeout_s))
    try:
        while not waiting.done():
            if not worker.alive:
                raise RuntimeError(f"the worker exited; see {worker.log_path}")
            await asyncio.wait({waiting}, timeout=1.0)
        waiting.result()
    finally:
        waiting.cancel()


async def replay_through_pipeline(settings: Settings, traces: Path, options: GenAiOptions,
                                  log_path: Path, timeout_s: float = 300.0) -> PipelineReplay:
    """Publish the GenAI trace to the broker of ``settings``, run the real worker on it under
    the trace's idle policy (:func:`traces.genai_idle_policy`) until it has consumed every
    record, and return the findings it wrote."""
    import msgspec

    from gpusteward import kafka, topics
    from gpusteward.collectors.transport.publisher import KafkaPublisher
    from gpusteward.sandbox import traces as trace_io
    from gpusteward.sandbox.pipeline import WorkerProcess
    from gpusteward.schema import Finding

    began = time.monotonic()
    await kafka.wait_for_broker(settings)
    await kafka.ensure_topics(settings)
    worker = WorkerProcess(settings, log_path)
    # The policy file lives next to the log, as long as the worker may read it.
    policy = log_path.with_name(log_path.stem + "-policy.yaml")
    policy.write_text(trace_io.genai_idle_policy(options))
    with _policy_env(policy):
        worker.start()
    try:
        publisher = KafkaPublisher(settings)
        await publisher.start()
        try:
            sent = await trace_io.replay_genai(publisher, traces, options)
        finally:
            await publisher.stop()
        names = [topics.SAMPLES.name(settings), topics.ALLOCATIONS.name(settings)]
        await _consumed_while_alive(settings, worker, names, timeout_s)
    finally:
        worker.stop()
    decode = msgspec.json.Decoder(Finding).decode
    findings = [decode(r.value)
                for r in await kafka.read_all(settings, topics.FINDINGS.name(settings))]
    return PipelineReplay(findings=findings, samples=sent, seconds=time.monotonic() - began)


def _check_through_pipeline(traces: Path, options: GenAiOptions) -> int:
    """The ``--through-pipeline`` mode: 0 when the worker and the offline computation agree."""
    from rich.console import Console
    from rich.table import Table

    from gpusteward.broker import EmbeddedBroker
    from gpusteward.sandbox import traces as trace_io

    console = Console()
    try:
        offline = trace_io.offline_idle_periods(traces, options)
    except trace_io.TraceError as error:
        raise typer.BadParameter(str(error), param_hint="--traces") from error
    expected = {(pod, start) for pod, start in offline.select("pod", "starts_at").iter_rows()}
    with tempfile.TemporaryDirectory(prefix="gpusteward-replay-") as folder, \
            EmbeddedBroker(log_path=Path(folder) / "broker.log") as broker:
        console.print("replaying the trace through an embedded broker and the stream worker "
                      f"(logs under {folder}) ...")
        try:
            run = asyncio.run(replay_through_pipeline(
                broker.settings(), traces, options, Path(folder) / "worker.log"))
        except (TimeoutError, RuntimeError) as error:
            console.print(f"[red]the worker did not keep up: {error}[/]")
            console.print((Path(folder) / "worker.log").read_text()[-4000:])
            return 2
    found = run.idle_periods()
    pods = offline["pod"].n_unique()
    table = Table(title=f"Idle periods (30+ min below 5 %) in {trace_io.GENAI}")
    for column in ("", "pipeline", "offline (polars)"):
        table.add_column(column, justify="right")
    table.add_row("idle periods", str(len(found)), str(len(expected)))
    table.add_row("pods with one", str(len({p for p, _ in found})), str(pods))
    table.add_row("same pod and start", str(len(set(found) & expected)), "")
    table.add_row("node samples replayed", str(run.samples), "")
    table.add_row("seconds", f"{run.seconds:.1f}", "")
    console.print(table)
    missing, extra = sorted(expected - set(found)), sorted(set(found) - expected)
    for label, rows in (("found offline only", missing), ("found by the pipeline only", extra)):
        for pod, start in rows:
            console.print(f"[red]{label}: {pod} from {start:.0f}[/]")
    split = {key: ids for key, ids in found.items() if len(ids) > 1}
    for key, ids in split.items():
        console.print(f"[red]{key[0]} from {key[1]:.0f} has {len(ids)} finding ids[/]")
    if missing or extra or split:
        return 1
    console.print("[green]the pipeline found exactly the offline idle periods[/]")
    return 0
