"""``gpusteward status``: the fleet now, read from the topics, as a table, live, or JSON.

The state comes from the contract's topics alone (no private database):
a reader assigned to every partition of the findings, actions,
action-results, node-summaries, allocations and queue topics reads them
from the start into :class:`gpusteward.status.StatusFold`; ``--watch``
keeps the reader and folds only what arrived since. The lag per consumer
group is the groups' committed offsets against the partition ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpusteward import kafka, topics
from gpusteward.cli.common import Bootstrap, kafka_settings
from gpusteward.schema import (
    Action,
    ActionResult,
    AllocationEvent,
    Finding,
    NodeSummary,
    QueueEvent,
)
from gpusteward.settings import Settings
from gpusteward.status import FleetStatus, StatusFold

PENDING_ROWS = 20
"""Pending workloads the table lists (soonest start first); --json has them all."""
QUIET_MS = 300
"""A read is complete when no record arrived for this long (as :func:`kafka.read_all`)."""


def sink_groups(settings: Settings) -> dict[str, list[topics.TopicSpec]]:
    """Each sink's consumer group and topic, taken from the sinks ``gpusteward sink`` runs
    (``reports/sink.py``'s factories), so the two never disagree."""
    from gpusteward.reports import sink as sinks
    from gpusteward.reports.settings import ReportSettings

    # The defaults, not the environment: the groups do not depend on the report settings,
    # and a bad GPUSTEWARD_REPORT__ variable is the sink's business, not the status's.
    report = ReportSettings.model_construct()
    built = [make(settings, report) for make in (sinks.rollup_sink, sinks.queue_sink,
                                                 sinks.findings_sink, sinks.results_sink)]
    return {sink.group_id: [sink.spec] for sink in built}


def consumer_groups(settings: Settings) -> dict[str, list[topics.TopicSpec]]:
    """The pipeline's consumer groups and the topics each reads (their defaults)."""
    prefix = settings.topic_prefix
    return {
        f"{prefix}-worker": [topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS,
                             topics.NODE_SUMMARIES, topics.QUEUE],
        f"{prefix}-alerts": [topics.FINDINGS],
        f"{prefix}-remediation": [topics.ACTIONS],
        **sink_groups(settings),
    }


class TopicFollower:
    """Every partition of the status topics, from the start, folded as records arrive."""

    def __init__(self, settings: Settings, fold: StatusFold) -> None:
        self.settings = settings
        self.fold = fold
        handlers: list[tuple[topics.TopicSpec, Any, Callable[[Any], None]]] = [
            (topics.FINDINGS, Finding, fold.finding),
            (topics.ACTIONS, Action, fold.action),
            (topics.ACTION_RESULTS, ActionResult, fold.result),
            (topics.NODE_SUMMARIES, NodeSummary, fold.summary),
            (topics.ALLOCATIONS, AllocationEvent, fold.allocation),
            (topics.QUEUE, QueueEvent, fold.queue),
        ]
        self.handlers = {
            spec.name(settings): (msgspec.json.Decoder(payload).decode, handle)
            for spec, payload, handle in handlers
        }
        self.undecodable = 0
        self._reader: Any = None

    async def start(self) -> None:
        self._reader = reader = kafka.consumer(self.settings, group_id=None)
        await reader.start()
        assigned = [tp for name in self.handlers
                    for tp in await kafka.topic_partitions(reader, name)]
        reader.assign(assigned)
        await reader.seek_to_beginning(*assigned)

    async def drain(self) -> int:
        """Fold every record that arrived since the last drain; returns how many."""
        count = 0
        while True:
            batch = await self._reader.getmany(timeout_ms=QUIET_MS)
            if not batch:
                return count
            for tp, messages in batch.items():
                decode, handle = self.handlers[tp.topic]
                for message in messages:
                    try:
                        handle(decode(message.value or b""))
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        self.undecodable += 1  # the dead-letter topic's business, not ours
                    count += 1

    async def stop(self) -> None:
        if self._reader is not None:
            await self._reader.stop()


async def lag_by_group(settings: Settings) -> dict[str, dict[str, int]]:
    groups = consumer_groups(settings)
    found = await asyncio.gather(*(
        kafka.group_lag(settings, group, [spec.name(settings) for spec in specs])
        for group, specs in groups.items()))
    return dict(zip(groups, found, strict=True))


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _eta(ts: float | None, now: float) -> Text:
    """An expected start relative to now: "in 25m", "overdue 5m", or "-" for none."""
    if ts is None:
        return Text("-", style="dim")
    if ts >= now:
        return Text(f"in {_age(ts - now)}")
    return Text(f"overdue {_age(now - ts)}", style="yellow")


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%m-%d %H:%M:%S")


SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
OUTCOME_STYLE = {"executed": "green", "dry_run": "cyan", "skipped": "dim", "refused": "yellow",
                 "failed": "bold red", "retrying": "magenta"}


def render(status: FleetStatus) -> Group:
    """The rich view of one snapshot."""
    parts: list[Any] = [Text(f"gpusteward status at {_clock(status.ts)} UTC", style="bold")]
    pools = Table(title="GPU pools", title_justify="left")
    for column in ("pool", "nodes", "GPUs", "allocated", "busy", "unhealthy", "cordoned"):
        pools.add_column(column, justify="left" if column == "pool" else "right")
    for p in status.pools:
        pools.add_row(p.pool, str(p.nodes), str(p.gpus), str(p.allocated), str(p.busy),
                      str(p.unhealthy_nodes), str(p.cordoned_nodes))
    teams = Table(title="Teams", title_justify="left")
    for column in ("team", "pods", "allocated", "busy", "idle"):
        teams.add_column(column, justify="left" if column == "team" else "right")
    for t in status.teams:
        teams.add_row(t.team, str(t.pods), str(t.allocated), str(t.busy),
                      Text(str(t.idle), style="yellow" if t.idle else ""))
    findings = Table(title=f"Open findings ({len(status.findings)})", title_justify="left")
    for column in ("severity", "kind", "subject", "age", "summary"):
        findings.add_column(column)
    for f in status.findings:
        findings.add_row(Text(f.severity, style=SEVERITY_STYLE.get(f.severity, "")), f.kind,
                         f.subject, _age(f.age_s), f.summary)
    actions = Table(title=f"Actions: {len(status.pending_actions)} pending, recent outcomes",
                    title_justify="left")
    for column in ("when", "verb", "target", "rule", "outcome", "detail"):
        actions.add_column(column)
    for a in status.pending_actions + status.recent_actions:
        outcome = a.outcome or "pending"
        actions.add_row(_clock(a.ts), a.verb + (" (dry run)" if a.dry_run else ""), a.target,
                        a.rule, Text(outcome, style=OUTCOME_STYLE.get(outcome, "bold")),
                        a.detail)
    breaker = status.breaker
    parts += [pools, teams, findings, actions, Text(
        f"remediation breaker: OPEN ({', '.join(breaker.circuits)}) since "
        f"{_clock(breaker.since or status.ts)}: {breaker.reason}"
        if breaker.open else "remediation breaker: closed",
        style="bold red" if breaker.open else "green")]
    if status.queues:
        queues = Table(title="Queues", title_justify="left")
        for column in ("cluster queue", "pending", "pending GPUs", "longest wait"):
            queues.add_column(column, justify="left" if column == "cluster queue" else "right")
        for q in status.queues:
            queues.add_row(q.cluster_queue, str(q.pending), str(q.pending_gpus),
                           _age(q.longest_wait_s))
        parts.append(queues)
    if status.pending:
        shown = status.pending[:PENDING_ROWS]
        more = f", the first {len(shown)}" if len(shown) < len(status.pending) else ""
        pending = Table(title=f"Pending workloads ({len(status.pending)}{more})",
                        title_justify="left")
        for column in ("workload", "cluster queue", "GPUs", "waited", "position", "start ETA",
                       "naive ETA"):
            pending.add_column(column, justify="left" if column in ("workload", "cluster queue")
                               else "right")
        for w in shown:
            pending.add_row(w.workload, w.cluster_queue, str(w.gpus), _age(w.waited_s),
                            "" if w.position is None else str(w.position),
                            _eta(w.eta_ts, status.ts), _eta(w.naive_eta_ts, status.ts))
        parts.append(pending)
    lag = Table(title="Consumer lag (records)", title_justify="left")
    for column in ("group", "topic", "lag"):
        lag.add_column(column, justify="right" if column == "lag" else "left")
    for group, per_topic in status.lag.items():
        for topic, records in per_topic.items():
            lag.add_row(group, topic, Text(str(records), style="yellow" if records else ""))
    parts.append(lag)
    return Group(*parts)


def _positive(seconds: float) -> float:
    if seconds <= 0:  # 0 or less would redraw in a tight loop
        raise typer.BadParameter(f"{seconds:g} is not a positive number of seconds")
    return seconds


def status(
    bootstrap: Bootstrap = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document, for scripts.")
                       ] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Keep reading and redraw.")] = False,
    interval: Annotated[float, typer.Option(
        callback=_positive, help="Seconds between redraws with --watch.")] = 5.0,
) -> None:
    """The fleet now: GPUs allocated vs busy, open findings, actions, breaker, queues, pending
    workloads with their start ETAs, lag."""
    settings = kafka_settings(bootstrap)

    async def main() -> None:
        await kafka.wait_for_broker(settings, timeout_s=10)
        follower = TopicFollower(settings, StatusFold())
        await follower.start()
        try:
            await follower.drain()
            snapshot = follower.fold.snapshot(time.time(), await lag_by_group(settings))
            if as_json and not watch:
                typer.echo(msgspec.json.encode(snapshot).decode())
                return
            if not watch:
                from rich.console import Console

                Console().print(render(snapshot))
                return
            await _watch(settings, follower, snapshot, interval, as_json)
        finally:
            await follower.stop()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except TimeoutError as error:  # no broker at --bootstrap: the message says where
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from error


async def _watch(settings: Settings, follower: TopicFollower, snapshot: FleetStatus,
                 interval: float, as_json: bool) -> None:
    from rich.live import Live

    if as_json:  # one document per line, for a script that follows
        while True:
            typer.echo(msgspec.json.encode(snapshot).decode())
            await asyncio.sleep(interval)
            await follower.drain()
            snapshot = follower.fold.snapshot(time.time(), await lag_by_group(settings))
    with Live(render(snapshot), auto_refresh=False) as live:
        while True:
            await asyncio.sleep(interval)
            await follower.drain()
            snapshot = follower.fold.snapshot(time.time(), await lag_by_group(settings))
            live.update(render(snapshot), refresh=True)
