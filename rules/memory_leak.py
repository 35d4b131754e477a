"""A GPU-memory leak trend: memory growing steadily while the work does not.

Seed 002 asks to catch a server whose free memory falls steadily while its
utilisation does not grow: a leak, or allocator fragmentation, that ends in
an out-of-memory crash hours later. The rule keeps per-minute means
(``bucket_s``) of the holder's used memory and activity over ``window_s``
and fits a line to each: it fires when memory grows at least
``min_growth_bytes_per_h``, steadily (the fit explains at least
``min_fit`` of the variance: a sawtooth of batches is not a trend), while
activity rises by no more than ``max_activity_rise_pct`` over the window
(more work may rightly need more memory). The finding gives the growth rate
and the projected time until the device's free memory is gone at that rate.

A serving pod's memory is mostly its allocator's cache, and three of its moves
look like a trend over half an hour without being one (all three seen on the
real serving pods of the Alibaba GenAI trace): the cache is released and
filled again, so the growth must end above the highest per-minute mean the
window has left behind (``high_before``); it grows by whole blocks as larger
requests come, so no step between two points may carry more than
``max_step_share`` of the fitted growth; and the model loads as the pod
starts, so the first ``grace_s`` after the pod's start are not fitted. A
training job's allocator does the same after its start-up, by many small
steps: a warm-up after a long data load, a new phase with longer sequences, a
compile with dynamic shapes fill the cache over ten or twenty minutes at full
activity and stop. Fitted over half an hour that is a good line and a fast
leak, though it grew in one part of the window and has been flat since; a
leak grows all through it, so each third of the window must carry at least
``min_third_share`` of the growth (a steady leak gives each a third).

It runs per holder (``per_holder``): on a shared GPU each pod's own memory
is fitted (per-process attribution), so the leaking pod is the one named.
A share the collector knows only by its cgroup's pod uid is named by the
pod's allocation; when the trend is found before that allocation has been
read (a catch-up can read a node's samples far ahead of its allocations), the
rule waits for it up to one more window while the trend holds, then names the
uid.
The window must be covered by observations: a gap longer than
``max_gap_s`` starts over. An open episode closes once the trend has been
absent for ``clear_s``.
"""

from __future__ import annotations

import itertools

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.idle import activity_pct, rfc3339
from gpusteward.rules.memory import GIB, Episode, Out, free_bytes, pod_of, releaser
from gpusteward.rules.registry import DeviceRunner, own_settings
from gpusteward.schema import DeviceSample, Evidence, Finding, PodRef, Subject

KIND = "gpu_memory_leak"
STATE = "mem_leak"
"""Its per-device state: a field of the node join's device state."""
RUNBOOK = (
    "The pod's GPU memory has grown steadily while its work did not: a leak (tensors kept "
    "alive, a growing cache) or allocator fragmentation. It will run out of memory at the "
    "projected time; profile its allocations (torch.cuda.memory_snapshot) or restart it in a "
    "quiet moment.")


class LeakSettings(BaseModel):
    """Settings of the GPU-memory leak-trend rule."""

    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(
        1800, gt=0, description="Seconds of observations the trend is fitted over (30 min: "
        "long enough that a batch's or an eval's allocations average out).")
    bucket_s: float = Field(
        60, gt=0, description="Seconds per averaged point of the fit (one per minute keeps "
        "the state small whatever the sample rate).")
    min_growth_bytes_per_h: float = Field(
        GIB, gt=0, description="Growth of used memory (bytes per hour) below which there is "
        "no trend (1 GiB/h: slower than that takes a day to matter on an 80 GiB GPU).")
    min_fit: float = Field(
        0.8, ge=0, le=1, description="Least share of the memory's variance the line must "
        "explain (R²): steady growth, not a sawtooth of allocations and frees.")
    max_activity_rise_pct: float = Field(
        5.0, ge=0, description="Most the activity may rise over the window (percentage points "
        "of the fitted line) for the growth to count as a leak: more work may need more "
        "memory.")
    max_gap_s: float = Field(
        300, gt=0, description="A gap between samples longer than this (seconds) starts the "
        "window over: no observations means no evidence.")
    grace_s: float = Field(
        600, ge=0, description="Seconds after the pod starts whose samples are not fitted (10 "
        "min, as the idle rule's grace): loading the model grows memory once, and that is no "
        "leak.")
    max_step_share: float = Field(
        0.25, gt=0, le=1, description="Most of the window's fitted growth that one step between "
        "two points may carry: a leak grows by many small steps, an allocator's cache by a few "
        "large blocks as larger requests come (real serving pods: 10 GiB in a minute).")
    min_third_share: float = Field(
        0.15, ge=0, le=1 / 3, description="Least share of the window's growth each third of "
        "the window must carry: a leak grows all through it (a steady one gives each third a "
        "third), an allocator's warm-up or a new phase fills its cache in minutes and stops. "
        "0.15: a ramp shorter than half the window never counts, a leak by four or more "
        "even steps always does.")
    clear_s: float = Field(
        600, ge=0, description="Seconds without the trend that close an open episode.")
    notify: bool = Field(True, description="Notify the pod's owner when an episode opens.")


class LeakTrack(msgspec.Struct, omit_defaults=True):
    """Per-minute means over the window, the minute being filled, and the open episode."""

    last_ts: float | None = None
    points: list[tuple[float, float, float]] = []
    """(minute start, mean used bytes, mean activity percent), oldest first."""
    bucket_start: float | None = None
    bucket_n: int = 0
    bucket_used: float = 0.0
    bucket_activity: float = 0.0
    clear_since: float | None = None
    high_before: float | None = None
    """The highest per-minute mean that has left the window since the run began: memory
    that climbs back to it is the allocator refilling what it released, not a leak."""
    unnamed_since: float | None = None
    """Since when a trend has waited for its holder's name (a share known only by uid)."""
    open: Episode | None = None


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys over xs, and R² (1.0 for a constant series)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    if sxx == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    return slope, 1.0 if syy == 0 else (sxy * sxy) / (sxx * syy)


def _reset(track: LeakTrack, ts: float) -> None:
    track.points = []
    track.high_before = None
    track.bucket_start, track.bucket_n = ts, 0
    track.bucket_used = track.bucket_activity = 0.0


def observe(track: LeakTrack, node: str, sample: DeviceSample, ts: float,
            settings: LeakSettings, holder: object) -> Out:
    """The node join's sample hook (track, node, sample, ts, settings, holder)."""
    # Locals for what is read twice: this runs for every holder of every device sample.
    last_ts = track.last_ts
    if last_ts is not None and ts <= last_ts:
        return []
    holders = sample.holders
    own = holders[0].mem_used_bytes if len(holders) == 1 else None
    used = own if own is not None else sample.mem_used_bytes
    activity = activity_pct(sample)
    if used is None or activity is None:
        return []
    started_at = getattr(holder, "started_at", None)
    if started_at is not None and ts < started_at + settings.grace_s:
        return []  # the pod's start-up: its model loading is not evidence of a leak
    track.last_ts = ts
    bucket_start = track.bucket_start
    if bucket_start is None or (last_ts is not None and ts - last_ts > settings.max_gap_s):
        _reset(track, ts)
        bucket_start = ts
    out: Out = []
    if ts - bucket_start >= settings.bucket_s and track.bucket_n:
        points = track.points
        points.append((bucket_start, track.bucket_used / track.bucket_n,
                       track.bucket_activity / track.bucket_n))
        # Keep one point at or before the window's start, so the fit covers the whole window
        # whatever the spacing of the samples.
        start = ts - settings.window_s
        while len(points) > 1 and points[1][0] <= start:
            gone = points.pop(0)[1]
            if track.high_before is None or gone > track.high_before:
                track.high_before = gone
        track.bucket_start, track.bucket_n = ts, 0
        track.bucket_used = track.bucket_activity = 0.0
        out = _evaluate(track, node, sample, ts, settings, getattr(holder, "pod", None))
    track.bucket_n += 1
    track.bucket_used += used
    track.bucket_activity += activity
    return out


def _unnamed_uid(sample: DeviceSample) -> str | None:
    """The uid of a share's one holder when that is all that names it."""
    holders = sample.holders
    if len(holders) == 1 and holders[0].pod is None:
        return holders[0].pod_uid
    return None


def _evaluate(track: LeakTrack, node: str, sample: DeviceSample, ts: float,
              settings: LeakSettings, holder_pod: PodRef | None) -> Out:
    points = track.points
    covered = len(points) >= 3 and points[0][0] <= ts - settings.window_s
    trend = False
    growth = r2 = rise = 0.0
    # Cheap first: memory that did not grow from the window's first minute to its last has
    # no upward trend worth fitting (the case of almost every device, every minute).
    grew = covered and (points[-1][1] - points[0][1]) * 3600 / (
        points[-1][0] - points[0][0]) >= settings.min_growth_bytes_per_h / 2 and (
        track.high_before is None or points[-1][1] > track.high_before)
    if grew:
        xs = [p[0] - points[0][0] for p in points]
        used = [p[1] for p in points]
        growth, r2 = fit(xs, used)
        activity_slope, _ = fit(xs, [p[2] for p in points])
        rise = activity_slope * (xs[-1] - xs[0])
        step = max(b - a for a, b in itertools.pairwise(used))
        n = len(used)
        thirds = (used[n // 3] - used[0], used[2 * n // 3] - used[n // 3],
                  used[-1] - used[2 * n // 3])
        trend = (growth * 3600 >= settings.min_growth_bytes_per_h and r2 >= settings.min_fit
                 and rise <= settings.max_activity_rise_pct
                 and step <= settings.max_step_share * growth * (xs[-1] - xs[0])
                 and min(thirds) >= settings.min_third_share * (used[-1] - used[0]))
    if not trend:
        track.unnamed_since = None
        episode = track.open
        if episode is None or not covered:
            # A window not filled again since a gap or a clock step is no evidence that the
            # growth stopped: the open episode waits for a whole window to judge it by.
            return []
        if track.clear_since is None:
            track.clear_since = ts
        if ts - track.clear_since < settings.clear_s:
            return []
        track.open = track.clear_since = None
        return [resolved(episode.id, episode.fingerprint, KIND,
                         Subject(node=node, device=sample.uuid, pod=episode.pod),
                         f"{sample.uuid} on {node}: memory no longer growing", episode.since,
                         ts)]
    track.clear_since = None
    if track.open is not None:
        return []
    pod = pod_of(sample, holder_pod)
    uid = _unnamed_uid(sample) if pod is None else None
    if uid is not None:
        if track.unnamed_since is None:
            track.unnamed_since = ts
        if ts - track.unnamed_since < settings.window_s:
            return []  # the pod's allocation, which names it, may not be read yet
    track.unnamed_since = None
    free = free_bytes(sample) or 0
    exhaustion_s = free / growth
    start = points[0][0]
    who = (f"{pod.namespace}/{pod.name}" if pod is not None
           else f"pod uid {uid}" if uid is not None else sample.uuid)
    fp = fingerprint(KIND, node, sample.uuid, who)
    summary = (f"{who} on {node} ({sample.uuid}): memory growing {growth * 3600 / GIB:.2f} GiB/h "
               f"for {(ts - start) / 60:.0f} min while activity stays flat; "
               f"{free / GIB:.1f} GiB free runs out in {exhaustion_s / 3600:.1f} h "
               f"(about {rfc3339(ts + exhaustion_s)})")
    subject = Subject(node=node, device=sample.uuid, pod=pod)
    finding = Finding(
        id=finding_id(fp, start), fingerprint=fp, kind=KIND, severity="warning",
        state="firing", subject=subject, summary=summary, starts_at=start, ts=ts,
        evidence=Evidence(window_start=start, window_end=ts, samples=len(points), values={
            "growth_bytes_per_s": growth, "fit_r2": r2, "activity_rise_pct": rise,
            "free_bytes": float(free), "projected_exhaustion_s": exhaustion_s,
            "projected_exhaustion_at": ts + exhaustion_s}),
        runbook=RUNBOOK, labels={"model": sample.model})
    track.open = Episode(finding.id, fp, start, pod)
    out: Out = [finding]
    if settings.notify and pod is not None:
        out.append(action_for(finding, "notify_owner", subject, summary))
    return out


def clock_step(track: LeakTrack, step: float) -> None:
    """The node's clock went back ``step`` s: the window starts over on the new clock, as
    after a gap; an open episode goes on, its start moved back by the step, until a whole
    window on the new clock shows no trend."""
    _reset(track, 0.0)
    track.last_ts = track.bucket_start = None
    track.clear_since = track.unnamed_since = None
    if track.open is not None:
        track.open.since -= step


RUNNER = DeviceRunner(state=STATE, state_type=LeakTrack, settings_from=own_settings(KIND),
                      on_sample=observe, on_release=releaser(KIND),
                      on_clock_step=clock_step, per_holder=True)
