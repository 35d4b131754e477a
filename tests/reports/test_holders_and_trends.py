"""A simulated week of several teams: idle holders named, trends and the heatmap.

The week is built so the answers are known: who idled how long (one episode
crosses midnight), what the idle rule did to each (findings in the findings
store), when the busy team works, and what changed since the week before.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gpusteward.reports import activity, archive, build, compute, findings, render, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.schema import (
    RESTORE_KEY_PREFIX,
    ActionResult,
    Evidence,
    Finding,
    Outcome,
    PodRef,
    Rollup,
    Subject,
)

WEEK = compute.parse_week("2026-W47")
BEFORE = archive.previous_week(WEEK)
HOUR = 3600.0


def _held(start: float, pod: str, team: str, hours: float, util: float, gpu: int) -> list[Rollup]:
    return [Rollup(ts=start + m * 60, node="node-a", uuid=f"GPU-{gpu}", index=gpu,
                   model="NVIDIA H100 80GB HBM3", samples=4, util_mean=util, util_max=util,
                   mem_used_max=1 << 30, mem_total_bytes=80 << 30, namespace=team, pod=pod,
                   owner_kind="Notebook", owner_name=pod.rsplit("-", 1)[0], team=team)
            for m in range(round(hours * 60))]


def _week(start: float, idle_scale: float) -> list[Rollup]:
    """Team vision idles (the long episode crosses Monday midnight); nlp works 9-17 UTC."""
    rows = (_held(start + 20 * HOUR, "nb-alice-0", "vision", 10 * idle_scale, 0.0, 0)
            + _held(start + 2 * 86400, "nb-bob-0", "vision", 3, 1.0, 1)
            + _held(start + 3 * 86400, "nb-carol-0", "nlp", 1, 2.0, 2))
    for day in range(5):
        rows += _held(start + day * 86400 + 9 * HOUR, f"train-{day}-0", "nlp", 8, 60.0, 3)
    # The weekend: the training GPU free, so that no day lacks rollups and the data reaches
    # the week's last minute (the weeks compare).
    for at in (5 * 86400 + 12 * HOUR, 6 * 86400 + 12 * HOUR, 7 * 86400 - 60):
        rows.append(Rollup(ts=start + at, node="node-a", uuid="GPU-3",
                           index=3, model="NVIDIA H100 80GB HBM3", samples=4, util_mean=0.0,
                           util_max=0.0, mem_used_max=0, mem_total_bytes=80 << 30))
    return rows


def _idle_finding(pod: str, step: int, ts: float, reclaim: str) -> Finding:
    return Finding(id=f"idle-{pod}", fingerprint=f"fp-{pod}", kind="idle_holder",
                   severity="warning" if step > 1 else "info", state="firing",
                   subject=Subject(node="node-a", device="GPU-0",
                                   pod=PodRef(namespace="vision", name=pod)),
                   summary="idle", starts_at=ts - 1800, ts=ts,
                   evidence=Evidence(window_start=ts - 1800, window_end=ts,
                                     values={"ladder_step": float(step)}),
                   labels={"reclaim": reclaim, "owner": "Notebook/x"})


@pytest.fixture(scope="module")
def weeks(tmp_path_factory: pytest.TempPathFactory) -> tuple[build.Report, build.Report, Path]:
    root = tmp_path_factory.mktemp("weeks")
    rollups, found, kept = root / "rollups", root / "findings", root / "archive"
    store.write(rollups, store.frame(_week(BEFORE.start, 0.5) + _week(WEEK.start, 1.0)))
    steps = [_idle_finding("nb-alice-0", s, WEEK.start + 21 * HOUR + s * 600, "execute")
             for s in (1, 2, 3)] + [_idle_finding("nb-bob-0", 1, WEEK.start + 2 * 86400 + HOUR,
                                                  "execute")]
    store.write(found, findings.frame(steps), findings.SCHEMA)
    settings = ReportSettings()
    before = build.build(rollups, BEFORE, settings, findings_dir=found)
    render.write(before, archive.folder(kept, BEFORE))
    now = build.build(rollups, WEEK, settings, findings_dir=found,
                      previous=archive.previous(kept, WEEK))
    return before, now, kept


def test_idle_holders_named_in_order_with_what_the_rule_did(
        weeks: tuple[build.Report, build.Report, Path]) -> None:
    _, now, _ = weeks
    holders = now.data["idle_holders"]
    assert [(h["pod"], h["team"]) for h in holders] == [
        ("nb-alice-0", "vision"), ("nb-bob-0", "vision"), ("nb-carol-0", "nlp")]
    alice, bob, carol = holders
    assert alice["idle_gpu_hours"] == pytest.approx(10.0)
    # One episode though the store splits it at midnight.
    assert alice["longest_episode_h"] == pytest.approx(10.0)
    assert alice["owner"] == "Notebook/nb-alice"
    assert (alice["status"], bob["status"]) == ("reclaim ordered", "told")
    assert carol["status"].startswith("not told")
    assert bob["longest_episode_h"] == pytest.approx(3.0)


def test_a_pod_whose_owner_is_learned_late_is_one_holder(tmp_path: Path) -> None:
    """The kubelet names a pod before the watcher's allocation brings its owner and team:
    its first minutes carry none. It is still one holder, with one unbroken episode, under
    the owner and team known last."""
    rows = _held(WEEK.start, "nb-dan-0", "vision", 2, 0.0, 0)
    early = [Rollup(**{**{f: getattr(r, f) for f in r.__struct_fields__},
                       "owner_kind": None, "owner_name": None, "team": None})
             for r in rows[:50]]
    store.write(tmp_path, store.frame(early + rows[50:]))
    (holder,) = activity.fold(tmp_path, WEEK.start, WEEK.end, 5.0).holders.iter_rows(
        named=True)
    assert (holder["pod"], holder["owner_kind"], holder["owner_name"], holder["team"]) == (
        "nb-dan-0", "Notebook", "nb-dan", "vision")
    assert holder["idle_gpu_hours"] == pytest.approx(2.0)
    assert holder["longest_episode_h"] == pytest.approx(2.0)


def _result(pod: str, key: str, outcome: Outcome, ts: float, attempt: int = 1) -> ActionResult:
    return ActionResult(idempotency_key=key, verb="requeue",
                        target=Subject(pod=PodRef(namespace="vision", name=pod)),
                        outcome=outcome, detail=f"{outcome} {pod}",
                        actor="executor", ts=ts, attempt=attempt)


def test_reclaimed_only_when_the_executor_says_executed(
        weeks: tuple[build.Report, build.Report, Path]) -> None:
    """With the executor's results kept, the rule's order becomes what was done."""
    root = weeks[2].parent
    t = WEEK.start + 22 * HOUR
    results = root / "results-executed"
    # Alice's reclaim met a 503, then went through after the week's end (it is still
    # this week's reclaim); a requeue another rule asked for bob's pod is not the idle
    # rule's reclaim and changes nothing.
    store.write(results, findings.result_frame([
        _result("nb-alice-0", "idle-nb-alice-0/requeue", "retrying", t),
        _result("nb-alice-0", "idle-nb-alice-0/requeue", "executed", WEEK.end + 600,
                attempt=2),
        _result("nb-bob-0", "other-rule/requeue", "executed", t)]), findings.RESULT_SCHEMA)
    report = build.build(root / "rollups", WEEK, ReportSettings(),
                         findings_dir=root / "findings", results_dir=results)
    alice, bob, carol = report.data["idle_holders"]
    assert (alice["status"], alice["reclaim_outcome"]) == ("reclaimed", "executed")
    assert alice["reclaim_detail"] == "executed nb-alice-0"
    assert (bob["status"], bob["reclaim_outcome"]) == ("told", None)
    assert carol["status"].startswith("not told")
    (row,) = [r for r in render.markdown(report).splitlines() if "| nb-alice-0 |" in r]
    assert row.endswith("| reclaimed |")

    expected: list[tuple[Outcome, str]] = [
        ("refused", "reclaim refused by the executor"), ("failed", "reclaim failed"),
        ("dry_run", "reclaim asked (dry run)")]
    for outcome, status in expected:
        folder = root / f"results-{outcome}"
        store.write(folder, findings.result_frame([
            _result("nb-alice-0", "idle-nb-alice-0/requeue", outcome, t)]),
            findings.RESULT_SCHEMA)
        again = build.build(root / "rollups", WEEK, ReportSettings(),
                            findings_dir=root / "findings", results_dir=folder)
        assert again.data["idle_holders"][0]["status"] == status
    # Results kept, none for this reclaim: ordered, not claimed to be done.
    none = build.build(root / "rollups", WEEK, ReportSettings(),
                       findings_dir=root / "findings", results_dir=root / "results-none")
    assert none.data["idle_holders"][0]["status"] == "reclaim ordered, no executor result"


def _restore(owner: str, outcome: Outcome, ts: float, operator: str = "dana"
             ) -> ActionResult:
    """The audit record `gpusteward act --restore OWNER` leaves (remediation.executor)."""
    return ActionResult(idempotency_key=f"{RESTORE_KEY_PREFIX}{owner}/{round(ts * 1000)}",
                        verb="requeue", target=Subject(), outcome=outcome,
                        detail=f"restore {owner} by {operator}: {outcome}",
                        actor=f"{operator}/kubernetes", ts=ts)


def test_a_reclaim_an_operator_undid_shows_restored(
        weeks: tuple[build.Report, build.Report, Path]) -> None:
    """A reclaim undone with `act --restore` of the pod's owner says so, with the first
    restore after it; a restore of another owner, one that failed or one before the
    reclaim does not."""
    root = weeks[2].parent
    t = WEEK.start + 22 * HOUR
    reclaimed = _result("nb-alice-0", "idle-nb-alice-0/requeue", "executed", t)

    def holder(*restores: ActionResult) -> dict:
        folder = root / f"results-restore-{len(list(root.iterdir()))}"
        store.write(folder, findings.result_frame([reclaimed, *restores]),
                    findings.RESULT_SCHEMA)
        report = build.build(root / "rollups", WEEK, ReportSettings(),
                             findings_dir=root / "findings", results_dir=folder)
        return report.data["idle_holders"][0]

    # The first restore after the reclaim undid it (a later one, a later reclaim).
    alice = holder(_restore("Notebook/vision/nb-alice", "executed", t + 2 * HOUR, "frank"),
                   _restore("Notebook/vision/nb-alice", "executed", t + HOUR))
    assert alice["status"] == "reclaimed, then restored by dana"
    assert (alice["restored_by"], alice["restored_at"]) == ("dana", t + HOUR)
    for others in ([_restore("Notebook/vision/nb-bob", "executed", t + HOUR)],
                   [_restore("Notebook/vision/nb-alice", "failed", t + HOUR)],
                   [_restore("Notebook/vision/nb-alice", "executed", t - HOUR)]):
        alice = holder(*others)
        assert (alice["status"], alice["restored_by"]) == ("reclaimed", None)


def test_trends_show_the_injected_change(weeks: tuple[build.Report, build.Report, Path]
                                         ) -> None:
    before, now, _ = weeks
    assert now.data["trends"]["previous_week"] == BEFORE.label
    rows = {r["team"]: r for r in now.data["trends"]["teams"]}
    # Alice idled 5 h the week before and 10 h this week; nlp did not change.
    assert rows["vision"]["idle_gpu_hours_before"] == pytest.approx(8.0)
    assert rows["vision"]["idle_gpu_hours"] == pytest.approx(13.0)
    assert rows["nlp"]["allocated_gpu_hours"] == pytest.approx(
        rows["nlp"]["allocated_gpu_hours_before"])
    assert rows["vision"]["findings"] == 2 and rows["vision"]["findings_before"] == 0
    html = render.html(now)
    assert "13.0 ▲ +62%" in html and "Against last week (2026-W46)" in html
    assert before.data["trends"]["previous_week"] is None


def test_heatmap_shows_when_a_team_works(weeks: tuple[build.Report, build.Report, Path]
                                         ) -> None:
    _, now, _ = weeks
    cells = {(r["weekday"], r["hour"]): r for r in now.data["heatmap"] if r["team"] == "nlp"}
    # Monday to Friday 09-17 UTC at 60 %, nothing else but carol's idle hour on Thursday.
    assert {k for k, r in cells.items() if r["utilisation_pct"] > 50} == {
        (d, h) for d in range(1, 6) for h in range(9, 17)}
    assert cells[(4, 0)]["utilisation_pct"] == pytest.approx(2.0)
    assert cells[(1, 9)]["allocated_gpu_hours"] == pytest.approx(1.0)


def test_numbers_in_the_html_equal_the_json(weeks: tuple[build.Report, build.Report, Path]
                                            ) -> None:
    _, now, _ = weeks
    page = render.html(now)
    for holder in now.data["idle_holders"]:
        row = (f"<td>{holder['pod']}</td><td>{holder['owner']}</td><td>{holder['team']}</td>"
               f"<td>{holder['idle_gpu_hours']:,.1f}</td>"
               f"<td>{holder['longest_episode_h']:,.1f}</td>")
        assert row in page
    for team in now.data["actions"]:
        assert f"${team['saving_usd']:,.0f}/week" in page
        for action in team["actions"]:
            assert f"<td>{action['saving_usd']:,.1f}</td>" in page
    totals = now.data["totals"]
    assert f"<b>{totals['idle_gpu_hours']:,.1f}" in page


def test_holders_are_the_same_when_runs_are_compacted_after_every_slice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs are joined into episodes every few slices to bound memory: an episode that
    spans slices (and midnight) stays one, whenever the compaction happens."""
    rows = [*_held(WEEK.start + 20 * 3600, "nb-a", "vision", 10, 0.0, 0),  # across midnight
            *_held(WEEK.start + 86400 * 2, "nb-a", "vision", 3, 0.0, 0),
            *_held(WEEK.start + 3600, "nb-b", "nlp", 2, 50.0, 1),
            *_held(WEEK.start + 3 * 3600, "nb-b", "nlp", 1, 0.0, 1)]
    store.write(tmp_path, store.frame(rows))
    once = activity.fold(tmp_path, WEEK.start, WEEK.end, 5.0).holders
    monkeypatch.setattr(activity, "COMPACT_EVERY", 1)
    monkeypatch.setattr(store, "slices", _hourly(store.slices))
    often = activity.fold(tmp_path, WEEK.start, WEEK.end, 5.0).holders
    assert often.to_dicts() == once.to_dicts()
    a, b = once.to_dicts()
    assert (a["pod"], a["idle_gpu_hours"], a["longest_episode_h"]) == ("nb-a", 13.0, 10.0)
    assert (b["pod"], b["idle_gpu_hours"], b["longest_episode_h"]) == ("nb-b", 1.0, 1.0)


def _hourly(slices):
    """store.slices cut an hour at a time (many slices, many compactions)."""
    return lambda *args, **kwargs: slices(*args, **{**kwargs, "rows": 1})


def test_holders_equal_a_whole_week_computation_of_their_episodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hourly slices cut thousands of idle runs, whole episodes are summed as they are and
    the runs at the slices' edges joined: the holders are those of the week's idle minutes
    taken at once (an episode: one device and pod's idle minutes, none more than a minute
    and a half apart)."""
    from gpusteward.sandbox import rollups as synthetic

    rows = pl.concat([
        synthetic.week_of_rollups(WEEK.start, gpus=8, workloads=6, teams=2, seed=3),
        # Idle across two hourly slices' edges, ending inside a slice.
        store.frame(_held(WEEK.start + 10.5 * HOUR, "nb-x", "vision", 1.75, 0.0, 99))])
    store.write(tmp_path, rows)
    key = ["uuid", "namespace", "pod"]
    idle = (rows.filter(pl.col("pod").is_not_null()
                        & (pl.col("util_max").fill_null(0) < 30.0)).sort([*key, "ts"]))
    gap = ((pl.col("ts").diff() > 90) | pl.any_horizontal(
        [pl.col(k).ne_missing(pl.col(k).shift()) for k in key])).fill_null(True)
    episodes = idle.with_columns(gap.cum_sum().alias("episode")).group_by("episode").agg(
        pl.col("namespace", "pod", "uuid").first(),
        (pl.col("gpu_fraction").cast(pl.Float64) / 60).sum().alias("gpu_hours"),
        ((pl.col("ts").max() - pl.col("ts").min() + 60) / 3600).alias("hours"))
    expected = episodes.group_by("namespace", "pod").agg(
        pl.col("gpu_hours").sum().alias("idle_gpu_hours"),
        pl.col("hours").max().alias("longest_episode_h"),
        pl.col("uuid").n_unique().alias("devices")).sort("namespace", "pod")
    assert episodes.height > 1000 and (episodes["hours"] > 1).sum() > 20  # across slices
    monkeypatch.setattr(activity, "COMPACT_EVERY", 3)
    monkeypatch.setattr(store, "slices", _hourly(store.slices))
    holders = activity.fold(tmp_path, WEEK.start, WEEK.end, 30.0).holders
    got = holders.select(expected.columns).sort("namespace", "pod")
    assert got["pod"].to_list() == expected["pod"].to_list()
    assert got.row(by_predicate=pl.col("pod") == "nb-x", named=True)["longest_episode_h"] == 1.75
    assert got["devices"].to_list() == expected["devices"].to_list()
    assert got["longest_episode_h"].to_list() == pytest.approx(
        expected["longest_episode_h"].to_list(), rel=1e-12)
    assert got["idle_gpu_hours"].to_list() == pytest.approx(
        expected["idle_gpu_hours"].to_list(), rel=1e-9)


def test_finding_counts_compare_only_when_both_weeks_kept_them(
        weeks: tuple[build.Report, build.Report, Path], tmp_path: Path) -> None:
    """Last week's report read the findings store, this week's ran without one (the
    findings sink's folder not mounted): vision's finding episodes are not known this week,
    and must not read as 2 -> 0, a green 'better' arrow."""
    _, _, kept = weeks
    rollups, found, archived = kept.parent / "rollups", tmp_path / "findings", tmp_path / "kept"
    store.write(found, findings.frame([
        _idle_finding("nb-alice-0", 1, BEFORE.start + 21 * HOUR, "execute"),
        _idle_finding("nb-bob-0", 1, BEFORE.start + 2 * 86400 + HOUR, "execute")]),
        findings.SCHEMA)
    settings = ReportSettings()
    before = build.build(rollups, BEFORE, settings, findings_dir=found)
    assert before.data["findings"]["per_team"]["vision"] == 2  # the control
    render.write(before, archive.folder(archived, BEFORE))
    now = build.build(rollups, WEEK, settings, previous=archive.previous(archived, WEEK))
    assert now.data["findings"]["stored"] is False
    (vision,) = [r for r in now.data["trends"]["teams"] if r["team"] == "vision"]
    assert (vision["findings"], vision["findings_before"]) == (None, 2)
    for text in (render.markdown(now), render.html(now)):
        assert "▼ -100%" not in text
