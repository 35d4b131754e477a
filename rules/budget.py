"""Team GPU-hour budgets: a team burning through its week's budget, before it has.

A budget is GPU-hours per team per week (ISO weeks, Monday 00:00 UTC). What
a team holds comes from the node summaries (``held_by_team``: GPUs held on
the node by the team the node join's rollups name, the first of its team
labels the pod carries, else its namespace; a MIG device counts its share of
compute slices). Each node's summaries are integrated on their own (the time
between two summaries of a node, at the level of the first) into one-minute
slots, and the slots are judged once every node has reported past them (a
watermark), so the figure and the moment a threshold is crossed are exact
however the nodes' summaries interleave on the topic (after a catch-up, one
node's may run hours behind another's). It is GPU-hours *held*, idle or
not: what the budget is spent on. One limit: a pod holds from when the node
join reads its allocation event, and a worker catching up on a backlog can
read a node's samples some minutes ahead of the allocations (another topic);
the summaries of those minutes hold nothing for a job that started then.

Two findings, one per episode:

- ``team_budget`` at each threshold (``thresholds``, shares of the budget)
  the week's use crosses, dated within the slot where it crossed: info
  below 100 %, warning at or above; resolved when the week ends.
- ``team_budget_projected``: at the GPUs the team holds now, it will exceed
  its budget before the week ends. It says when it will cross, re-issued under
  the same id when that moves (the team starts or stops work, or a node's
  summaries reach the fleet agent after the others'); resolved when
  the projection falls back under the budget, the crossing happens (the
  threshold finding takes over) or the week ends. The rate is what is held
  now, not an average: a giant job that starts tonight burns from tonight,
  and an average over the quiet hours before it would put the crossing days
  too late (seed 002's "burned our entire compute budget").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import finding_id, fingerprint, moved_enough, resolved
from gpusteward.rules.fragmentation import FleetView
from gpusteward.rules.idle import rfc3339
from gpusteward.rules.registry import FleetRunner
from gpusteward.schema import Evidence, Finding, NodeSummary, Subject, summary_follows

KIND = "team_budget"
PROJECTED_KIND = "team_budget_projected"
WEEK_S = 7 * 86400.0
SLOT_S = 60.0
"""Length of the time slots use is gathered in before it is judged (one summary interval
of the node join's default)."""
MONDAY_EPOCH = 4 * 86400.0
"""1970-01-05T00:00Z, the first Monday after the Unix epoch (a Thursday)."""

RUNBOOK = (
    "The team has used this share of its weekly GPU-hour budget. Check what holds its GPUs "
    "(idle_holder findings, the weekly report's team section), stop what is not needed, or "
    "agree a larger budget."
)
PROJECTED_RUNBOOK = (
    "At the GPUs the team holds now, it will use up its weekly budget before the week ends. "
    "Look at its largest holders first; a job started on a budget that is nearly spent may "
    "be stopped half-way."
)


class BudgetSettings(BaseModel):
    """Settings of team GPU-hour budgets."""

    model_config = ConfigDict(extra="forbid")

    budgets_gpu_h: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="GPU-hours per team per week (ISO week, UTC), by team name; 0 or more (0: "
        "any use crosses every threshold). Empty: no budgets, the rule does nothing; teams "
        "not listed have none.",
    )
    thresholds: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [0.8, 1.0],
        description="Shares of the budget (> 0; 1.0 is the whole budget) at which a finding is "
        "raised as the week's use crosses them: 80 % leaves a day or two to act, 100 % is "
        "the budget spent.",
    )
    max_gap_s: float = Field(
        600, gt=0,
        description="Longest stretch (seconds) between two summaries of a node integrated "
        "at the level of the first; a longer gap (the node join was down) counts only this "
        "much, as no observation is no evidence of use. Ten of the node join's default "
        "summary intervals.",
    )
    watermark_lag_s: float = Field(
        3600, gt=0,
        description="A node whose last summary is this far (seconds) behind the newest one "
        "no longer holds back the judgement of thresholds, nor counts its GPUs in the "
        "projection (it left the fleet, or is catching up from far behind; its use is then "
        "counted when it arrives, undated). An hour covers a node join restarting and "
        "re-reading its backlog.",
    )
    reissue_after_s: float = Field(
        600, ge=0,
        description="The projection is re-published when its crossing moves by more than "
        "this (seconds) and by more than reissue_share of the time that was left to it.",
    )
    reissue_share: float = Field(
        0.1, ge=0,
        description="Share of the time left to the projected crossing it must move by too: "
        "a tenth is a burn rate about a tenth higher or lower, not a small job coming or "
        "going.",
    )


class TeamTrack(msgspec.Struct):
    week_start: float
    used_gpu_h: float = 0.0
    held: float = 0.0
    """GPUs held at the last evaluation."""
    crossed: dict[str, str] = {}
    """Threshold (as text) -> the id of its finding this week."""
    projected_id: str | None = None
    projected_since: float | None = None
    projected_crossing: float | None = None
    """When the open projection said the budget would be crossed."""


class NodeLevel(msgspec.Struct):
    """A node's last summary as the rule integrates it."""

    ts: float
    held: dict[str, float] = {}
    clock_steps: int = 0
    """The summary's ``clock_steps``: the node's clock it is on."""


class BudgetState(msgspec.Struct):
    teams: dict[str, TeamTrack] = {}
    nodes: dict[str, NodeLevel] = {}
    slots: dict[str, dict[float, float]] = {}
    """Per team, GPU-hours by slot start, for the slots not judged yet."""
    judged_until: float | None = None
    """The watermark: every node has reported up to here, so use before it is final."""


def mig_gpus(mig: dict[str, int]) -> float:
    """MIG devices as whole-GPU equivalents, from the compute slices in their profile name
    (``3g.40gb`` is 3 of a GPU's 7 slices)."""
    total = 0.0
    for profile, count in mig.items():
        slices = profile.partition("g.")[0]
        total += count * (int(slices) / 7 if slices.isdigit() else 1 / 7)
    return total


def week_start(ts: float) -> float:
    """The Monday 00:00 UTC that starts the week ``ts`` is in."""
    return MONDAY_EPOCH + (ts - MONDAY_EPOCH) // WEEK_S * WEEK_S


def _subject(team: str) -> Subject:
    """A team is no node, device, pod or queue: it is named by the finding's ``team`` label
    (and its fingerprint)."""
    return Subject()


def on_summary(state: BudgetState, summary: NodeSummary, settings: BudgetSettings
               ) -> Sequence[Finding]:
    """Spread the node's GPU-hours since its previous summary over the time slots they
    fall in; then judge the slots every node has reported past (the watermark)."""
    if not settings.budgets_gpu_h:
        return []
    last = state.nodes.get(summary.node)
    if last is not None and not summary_follows(summary, last.ts, last.clock_steps):
        return []  # a duplicate or a late summary of this node
    state.nodes[summary.node] = NodeLevel(ts=summary.ts, held=dict(summary.held_by_team),
                                          clock_steps=summary.clock_steps)
    out: list[Finding] = []
    # Across a clock step the time between the two summaries is unknown (as after a gap
    # longer than max_gap_s): the held GPUs are not spread over it.
    if last is not None and last.clock_steps == summary.clock_steps:
        start = max(last.ts, summary.ts - settings.max_gap_s)
        for team, gpus in last.held.items():
            if team in settings.budgets_gpu_h and gpus > 0:
                _spread(state, team, gpus, start, summary.ts, settings, out)
    return out + _judge(state, settings)


def _spread(state: BudgetState, team: str, gpus: float, start: float, end: float,
            settings: BudgetSettings, out: list[Finding]) -> None:
    """Add ``gpus`` held from ``start`` to ``end`` to the team's slots; what falls before
    the watermark (a node far behind) is added to its use at once, dated when it arrived."""
    if state.judged_until is not None and start < state.judged_until:
        late_end = min(end, state.judged_until)
        track = _team(state, team, late_end, late_end, out)
        budget = settings.budgets_gpu_h[team]
        if week_start(start) >= track.week_start:
            before, late_gpu_h = track.used_gpu_h, gpus * (late_end - start) / 3600
            track.used_gpu_h += late_gpu_h
            out += _thresholds(team, track, budget, before, late_end - SLOT_S, late_gpu_h,
                               settings)
        start = late_end
    slots = state.slots.setdefault(team, {})
    while start < end:
        slot = start // SLOT_S * SLOT_S
        upto = min(end, slot + SLOT_S)
        slots[slot] = slots.get(slot, 0.0) + gpus * (upto - start) / 3600
        start = upto


def _judge(state: BudgetState, settings: BudgetSettings) -> list[Finding]:
    """Add every slot before the watermark to its team's use, oldest first, and raise the
    thresholds crossed, dated within the slot where the use crossed them."""
    newest = max(level.ts for level in state.nodes.values())
    watermark = min(level.ts for level in state.nodes.values()
                    if level.ts >= newest - settings.watermark_lag_s)
    out: list[Finding] = []
    for team, slots in state.slots.items():
        budget = settings.budgets_gpu_h.get(team)
        for slot in sorted(k for k in slots if k + SLOT_S <= watermark):
            gpu_h = slots.pop(slot)
            if budget is None:
                continue
            track = _team(state, team, slot, slot, out)
            before = track.used_gpu_h
            track.used_gpu_h += gpu_h
            out += _thresholds(team, track, budget, before, slot, gpu_h, settings)
    state.judged_until = max(state.judged_until or watermark, watermark // SLOT_S * SLOT_S)
    return out


def _team(state: BudgetState, team: str, since: float, now: float,
          out: list[Finding]) -> TeamTrack:
    """The team's track, rolled over to the week of ``now`` (closing the last week's)."""
    track = state.teams.get(team)
    if track is None:
        track = state.teams[team] = TeamTrack(week_start=week_start(since))
    if week_start(now) > track.week_start:
        out += _close_week(team, track, week_start(now))
        track.week_start, track.used_gpu_h = week_start(now), 0.0
    return track


def evaluate(state: BudgetState, fleet: FleetView, now: float, settings: BudgetSettings
             ) -> Sequence[Finding]:
    """Roll weeks over and project each team's week from what it holds now."""
    out: list[Finding] = []
    for team, track in state.teams.items():
        if team not in settings.budgets_gpu_h and (track.crossed or track.projected_id):
            # The policy (the worker restarted with another) sets the team no budget any
            # more: nothing judges its week again, so its findings would fire for ever.
            out += _close_week(team, track, now, f"team {team}: no weekly budget set any more")
    if not settings.budgets_gpu_h:
        return out
    held: dict[str, float] = {}
    # Measured on the summaries' own clock, as the watermark is: the fleet's follows the
    # queue, which a node join catching up trails by its backlog.
    newest = max((level.ts for level in state.nodes.values()), default=now)
    for node, level in list(state.nodes.items()):
        if level.ts < newest - settings.watermark_lag_s:
            del state.nodes[node]  # left the fleet long ago
            continue
        # What holds GPUs now: each node's last level, however far its summaries trail
        # the newest, as the thresholds' watermark waits for them. Partitions are read
        # unevenly (a worker catching up, or the fleet replayed fast): a node behind is
        # not a node that let go, and counting it as holding nothing would resolve the
        # projection and raise it again under a new id.
        for team, gpus in level.held.items():
            held[team] = held.get(team, 0.0) + gpus
    for team, budget in settings.budgets_gpu_h.items():
        track = _team(state, team, now, now, out)
        track.held = held.get(team, 0.0)
        out += _projection(team, track, budget, now, state.judged_until, settings)
    return out


def _labels(team: str) -> dict[str, str]:
    return {"team": team}


def _thresholds(team: str, track: TeamTrack, budget: float, before: float, slot: float,
                slot_gpu_h: float, settings: BudgetSettings) -> list[Finding]:
    """The thresholds the use crossed in ``slot`` (from ``before``), each dated where the
    use reached it within the slot (at a constant rate over the slot)."""
    out: list[Finding] = []
    share = track.used_gpu_h / budget if budget > 0 else float("inf")
    for threshold in sorted(settings.thresholds):
        name = f"{threshold:g}"
        if share < threshold or name in track.crossed:
            continue
        reached = threshold * budget - before
        now = slot + (SLOT_S * min(1.0, max(0.0, reached / slot_gpu_h)) if slot_gpu_h > 0
                      else SLOT_S)
        fp = fingerprint(KIND, team, name)
        fid = track.crossed[name] = finding_id(fp, track.week_start)
        out.append(Finding(
            id=fid, fingerprint=fp, kind=KIND,
            severity="warning" if threshold >= 1 else "info", state="firing",
            subject=_subject(team),
            summary=f"team {team} has used {track.used_gpu_h:.0f} of its {budget:g} GPU-hour "
            f"weekly budget ({share:.0%}, threshold {threshold:.0%})",
            starts_at=track.week_start, ts=now,
            evidence=Evidence(window_start=track.week_start, window_end=now,
                              values={"used_gpu_h": track.used_gpu_h, "budget_gpu_h": budget,
                                      "share": share, "threshold": threshold,
                                      "gpus_held": track.held}),
            runbook=RUNBOOK, labels=_labels(team),
        ))
    return out


def _projection(team: str, track: TeamTrack, budget: float, now: float,
                judged_until: float | None, settings: BudgetSettings) -> list[Finding]:
    """Project the week at the GPUs held now, from the use judged so far: that use runs to
    the watermark, so the rate runs from there (not from ``now``, which would put the
    crossing later by however far the slowest node's summaries trail)."""
    rate = track.held
    week_end = track.week_start + WEEK_S
    base = now if judged_until is None else max(track.week_start, min(now, judged_until))
    projected = track.used_gpu_h + rate * (week_end - base) / 3600
    ahead = track.used_gpu_h < budget < projected and rate > 0
    fp = fingerprint(PROJECTED_KIND, team)
    if ahead:
        crossing = base + (budget - track.used_gpu_h) / rate * 3600
        if track.projected_id is None or track.projected_since is None:
            track.projected_id, track.projected_since = finding_id(fp, now), now
        elif track.projected_crossing is not None and not moved_enough(
                track.projected_crossing, crossing, now, settings.reissue_after_s,
                settings.reissue_share):
            return []
        track.projected_crossing = crossing
        return [Finding(
            id=track.projected_id, fingerprint=fp, kind=PROJECTED_KIND, severity="warning",
            state="firing", subject=_subject(team),
            summary=f"team {team} burns {rate:.1f} GPUs and will exceed its {budget:g} "
            f"GPU-hour weekly budget at {rfc3339(crossing)}, "
            f"{(week_end - crossing) / 3600:.0f} h before the week ends "
            f"({track.used_gpu_h:.0f} used, {projected:.0f} projected)",
            starts_at=track.projected_since, ts=now,
            evidence=Evidence(window_start=track.week_start, window_end=now,
                              values={"used_gpu_h": track.used_gpu_h, "budget_gpu_h": budget,
                                      "burn_gpus": rate, "projected_gpu_h": projected,
                                      "crossing_ts": crossing}),
            runbook=PROJECTED_RUNBOOK, labels=_labels(team),
        )]
    if not ahead and track.projected_id is not None and track.projected_since is not None:
        closing = resolved(track.projected_id, fp, PROJECTED_KIND, _subject(team),
                           f"team {team}: " + ("budget crossed" if track.used_gpu_h >= budget
                                               else "projection back within budget"),
                           track.projected_since, now)
        closing.labels = _labels(team)
        track.projected_id = track.projected_since = track.projected_crossing = None
        return [closing]
    return []


def _close_week(team: str, track: TeamTrack, now: float, why: str | None = None
                ) -> list[Finding]:
    """Resolve the team's open findings at ``now``: a new budget week, or ``why``."""
    why = why or f"team {team}: a new budget week"
    out = []
    for name, fid in track.crossed.items():
        closing = resolved(fid, fingerprint(KIND, team, name), KIND, _subject(team),
                           why, track.week_start, now)
        closing.labels = _labels(team)
        out.append(closing)
    track.crossed = {}
    if track.projected_id is not None and track.projected_since is not None:
        closing = resolved(track.projected_id, fingerprint(PROJECTED_KIND, team),
                           PROJECTED_KIND, _subject(team), why, track.projected_since, now)
        closing.labels = _labels(team)
        out.append(closing)
        track.projected_id = track.projected_since = track.projected_crossing = None
    return out


RUNNERS = (FleetRunner("budget", BudgetState, evaluate, on_summary=on_summary),)
