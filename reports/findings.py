"""The findings store: what the live rules found, kept by week for the report.

The rules publish findings on ``findings.v1`` (30 days' retention); the
weekly report needs them after that, next to the rollups, to say which idle
holders were told and which were reclaimed, and how many findings each team
and each rule had. ``gpusteward sink findings`` writes every finding record
(each ladder step of an episode is one record) into a Parquet store of the
same layout as the rollups (:mod:`gpusteward.reports.store`: a folder per
day, atomic files, at-least-once, repeats dropped by name); this module
flattens a finding into a row and reads the week back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl

from gpusteward.reports import store
from gpusteward.rules import idle
from gpusteward.schema import Finding

SCHEMA: dict[str, Any] = {
    "ts": pl.Float64, "id": pl.String, "fingerprint": pl.String, "kind": pl.String,
    "severity": pl.String, "state": pl.String, "node": pl.String, "device": pl.String,
    "namespace": pl.String, "pod": pl.String, "queue": pl.String, "owner": pl.String,
    "starts_at": pl.Float64, "ends_at": pl.Float64, "ladder_step": pl.Int8,
    "reclaim": pl.String, "summary": pl.String, "values": pl.String,
}
"""Column types of the findings store. ``ladder_step``: the idle rule's step (1 told,
2 warned, 3 reclaim asked); ``reclaim``: what that last step does (execute, dry_run, off,
refused); ``queue``: the queue the finding names (its label, else its subject's);
``values``: the evidence's numbers as a JSON object (what the waiting section reads:
start-ETA errors, GPUs a gang holds)."""


def frame(findings: Iterable[Finding]) -> pl.DataFrame:
    """Findings as rows of the findings store."""
    rows = []
    for f in findings:
        pod = f.subject.pod
        step = f.evidence.values.get("ladder_step") if f.evidence else None
        rows.append({
            "ts": f.ts, "id": f.id, "fingerprint": f.fingerprint, "kind": f.kind,
            "severity": f.severity, "state": f.state, "node": f.subject.node,
            "device": f.subject.device, "namespace": pod.namespace if pod else None,
            "pod": pod.name if pod else None,
            "queue": f.labels.get("queue") or f.subject.queue,
            "owner": f.labels.get("owner"), "starts_at": f.starts_at, "ends_at": f.ends_at,
            "ladder_step": None if step is None else int(step),
            "reclaim": f.labels.get("reclaim"), "summary": f.summary,
            "values": json.dumps(f.evidence.values) if f.evidence else None})
    return pl.DataFrame(rows, schema=SCHEMA)


def read(directory: Path | None, start: float, end: float) -> pl.DataFrame:
    """The findings published in [start, end), each (id, state, ts) once."""
    paths = store.files(directory, start, end) if directory and directory.is_dir() else []
    if not paths:
        return pl.DataFrame(schema=SCHEMA)
    return (pl.scan_parquet(paths, schema=SCHEMA)
            .filter((pl.col("ts") >= start) & (pl.col("ts") < end))
            .unique(subset=["id", "state", "ts"], keep="any").collect())


def idle_ladder(findings: pl.DataFrame) -> pl.DataFrame:
    """Per pod (namespace, pod): the idle rule's highest step this week and its reclaim mode."""
    return (findings.filter((pl.col("kind") == idle.KIND) & pl.col("pod").is_not_null())
            .group_by("namespace", "pod").agg(
                pl.col("ladder_step").max().alias("ladder_step"),
                pl.col("reclaim").sort_by("ts").last().alias("reclaim"),
                pl.col("id").n_unique().cast(pl.UInt32).alias("idle_findings")))


def episodes_by_kind(findings: pl.DataFrame) -> pl.DataFrame:
    """Per rule: the episodes (distinct ids) that fired this week, and how many resolved."""
    return (findings.group_by("kind").agg(
        pl.col("id").n_unique().cast(pl.UInt32).alias("episodes"),
        pl.col("id").filter(pl.col("state") == "resolved").n_unique().cast(pl.UInt32)
        .alias("resolved"))
        .sort(["episodes", "kind"], descending=[True, False]))


def per_team(findings: pl.DataFrame, teams: pl.DataFrame) -> dict[str, int]:
    """Finding episodes per team; ``teams`` maps namespace to team. Node-level findings
    (no pod) count under "fleet"."""
    named = findings.select("id", "namespace").unique().join(
        teams, on="namespace", how="left").with_columns(
        pl.when(pl.col("namespace").is_null()).then(pl.lit("fleet"))
        .otherwise(pl.coalesce("team", "namespace")).alias("team"))
    counts = named.group_by("team").agg(pl.col("id").n_unique().alias("n"))
    return {str(t): int(n) for t, n in counts.iter_rows()}
