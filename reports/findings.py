"""The findings store: what the live rules found, kept by week for the report.

The rules publish findings on ``findings.v1`` (30 days' retention); the
weekly report needs them after that, next to the rollups, to say which idle
holders were told and which were reclaimed, and how many findings each team
and each rule had. ``gpusteward sink findings`` writes every finding record
(each ladder step of an episode is one record) into a Parquet store of the
same layout as the rollups (:mod:`gpusteward.reports.store`: a folder per
day, atomic files, at-least-once, repeats dropped by name); this module
flattens a finding into a row and reads the week back.

A reclaim the idle rule asks for is only an order: the executor may carry it
out, refuse it (a guard, a bare pod) or fail. ``gpusteward sink results``
keeps the executor's audit records (``action-results.v1``) in a store of the
same layout, so the report says "reclaimed" only for the reclaims the
executor says it executed (:func:`idle_reclaims`), and "restored" for those an
operator undid since (:func:`restores`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl

from gpusteward.reports import store
from gpusteward.rules import idle
from gpusteward.schema import RESTORE_KEY_PREFIX, ActionResult, Finding

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


RESULT_SCHEMA: dict[str, Any] = {
    "ts": pl.Float64, "idempotency_key": pl.String, "verb": pl.String, "outcome": pl.String,
    "node": pl.String, "device": pl.String, "namespace": pl.String, "pod": pl.String,
    "detail": pl.String, "actor": pl.String, "error": pl.String, "attempt": pl.Int32,
}
"""Column types of the action-result store: the executor's audit records, target flattened."""


def result_frame(results: Iterable[ActionResult]) -> pl.DataFrame:
    """The executor's audit records as rows of the action-result store."""
    rows = []
    for r in results:
        pod = r.target.pod
        rows.append({
            "ts": r.ts, "idempotency_key": r.idempotency_key, "verb": r.verb,
            "outcome": r.outcome, "node": r.target.node, "device": r.target.device,
            "namespace": pod.namespace if pod else None, "pod": pod.name if pod else None,
            "detail": r.detail, "actor": r.actor, "error": r.error, "attempt": r.attempt})
    return pl.DataFrame(rows, schema=RESULT_SCHEMA)


def read(directory: Path | None, start: float, end: float) -> pl.DataFrame:
    """The findings published in [start, end), each (id, state, ts) once."""
    return _read(directory, start, end, SCHEMA, ["id", "state", "ts"])


RESULTS_AFTER_S = 400 * 86400.0
"""How long after a week its reclaims' results are looked for: longer than the audit
topic's retention (365 days), so any result kept counts."""


def read_results(directory: Path | None, start: float) -> pl.DataFrame:
    """The executor's audit records from ``start`` on, each (key, outcome, attempt, ts) once.

    Not cut at the week's end: a record is stamped when the executor decided, which
    can be after the week whose finding ordered it (a reclaim ordered on Sunday night
    and carried out on Monday, an executor down for a day); the records are matched
    to the week's findings by key (:func:`idle_reclaims`).
    """
    return _read(directory, start, start + RESULTS_AFTER_S, RESULT_SCHEMA,
                 ["idempotency_key", "outcome", "attempt", "ts"])


def _read(directory: Path | None, start: float, end: float, schema: dict[str, Any],
          name: list[str]) -> pl.DataFrame:
    paths = store.files(directory, start, end) if directory and directory.is_dir() else []
    if not paths:
        return pl.DataFrame(schema=schema)
    return (pl.scan_parquet(paths, schema=schema)
            .filter((pl.col("ts") >= start) & (pl.col("ts") < end))
            .unique(subset=name, keep="any").collect())


def idle_ladder(findings: pl.DataFrame) -> pl.DataFrame:
    """Per pod (namespace, pod): the idle rule's highest step this week and its reclaim mode."""
    return (findings.filter((pl.col("kind") == idle.KIND) & pl.col("pod").is_not_null())
            .group_by("namespace", "pod").agg(
                pl.col("ladder_step").max().alias("ladder_step"),
                pl.col("reclaim").sort_by("ts").last().alias("reclaim"),
                pl.col("id").n_unique().cast(pl.UInt32).alias("idle_findings")))


def idle_reclaims(findings: pl.DataFrame, results: pl.DataFrame) -> pl.DataFrame:
    """Per pod (namespace, pod): what the executor did with the idle rule's reclaims.

    The rule's reclaim action is keyed ``<finding id>/requeue``
    (:func:`gpusteward.rules.findings.action_for`), so the audit records of the pod's
    idle episodes are found by key, not by a verb other rules use too. ``outcome``:
    ``executed`` when any of them was carried out, else the latest final decision
    (``refused``, ``failed``, ``dry_run``, ``skipped``); attempts being retried are not
    decisions. ``detail``: that decision's reason; ``decided_at``: its time.
    """
    keys = (findings.filter((pl.col("kind") == idle.KIND) & pl.col("pod").is_not_null())
            .select("namespace", "pod", (pl.col("id") + "/requeue").alias("idempotency_key"))
            .unique())
    decided = results.filter(pl.col("outcome") != "retrying").select(
        "idempotency_key", "ts", "outcome", "detail").join(keys, on="idempotency_key")
    return decided.group_by("namespace", "pod").agg(
        pl.when((pl.col("outcome") == "executed").any()).then(pl.lit("executed"))
        .otherwise(pl.col("outcome").sort_by("ts").last()).alias("outcome"),
        pl.col("detail").sort_by(pl.col("outcome") == "executed", "ts").last().alias("detail"),
        pl.col("ts").sort_by(pl.col("outcome") == "executed", "ts").last().alias("decided_at"))


def restores(results: pl.DataFrame) -> pl.DataFrame:
    """The restores an operator carried out (``gpusteward act --restore``): the owner
    restored (``KIND/NAMESPACE/NAME``), when (``restored_at``) and by whom (``restored_by``).

    A restore's audit record names its owner only in its key (the subject of an action has
    no field for a Notebook or a Deployment): ``restore/KIND/NAMESPACE/NAME/<ms>``.
    """
    done = results.filter(pl.col("idempotency_key").str.starts_with(RESTORE_KEY_PREFIX)
                          & (pl.col("outcome") == "executed"))
    return done.select(
        pl.col("idempotency_key").str.strip_prefix(RESTORE_KEY_PREFIX)
        .str.replace(r"/\d+$", "").alias("owner"),
        pl.col("ts").alias("restored_at"),
        # The actor is ``OPERATOR/BACKEND``: the operator is all before the last slash.
        pl.col("actor").str.replace(r"/[^/]*$", "").alias("restored_by"),
    )


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
