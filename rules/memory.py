"""What the GPU-memory rules share: readings of a device's memory, and one episode machine.

Four rules watch framebuffer memory, one module each (``memory_low_free``,
``memory_high``, ``memory_leak``, ``memory_overcommit``). Three of them are
"a condition held for a whole window" rules, and they share
:func:`sustain`: a run starts at the first sample where the condition
holds, restarts after a gap longer than ``max_gap_s`` (no observations is
no evidence), and opens an episode (one firing finding, one notification
to the pod's owner) once it has lasted ``window_s``; the episode closes
(one resolved finding, same id) after ``clear_s`` without the condition,
so a device hovering at a threshold gives one episode, not one per crossing.

Memory findings name the pod that holds the device (on a device several
pods hold, the one with the most memory) and ask only for notifications:
running out of GPU memory is the owner's to fix, and nothing here evicts.
An episode is about its holders' use of the device, so when a holder lets the
device go (:func:`releaser`) the run ends and an open episode closes: the next
holder starts afresh, and one the rule leaves alone (a serving pod, for the
high-memory and overcommit rules) never inherits a finding that nothing would
close.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from gpusteward.rules.findings import action_for, finding_id, fingerprint, resolved
from gpusteward.rules.registry import ReleaseHook
from gpusteward.schema import Action, DeviceSample, Evidence, Finding, PodRef, Subject

Out = list[Finding | Action]
GIB = 1 << 30


class Episode(msgspec.Struct):
    id: str
    fingerprint: str
    since: float
    pod: PodRef | None = None


class SustainTrack(msgspec.Struct, omit_defaults=True):
    """A condition's current run on one device and its open episode."""

    last_ts: float | None = None
    since: float | None = None
    samples: int = 0
    peak: float = 0.0
    """The run's most extreme value of the rule's measure."""
    clear_since: float | None = None
    open: Episode | None = None


def judges_kind(settings: Any, workload_kind: str | None) -> bool:
    """The registry's ``watches`` of a rule whose settings leave devices of some holders'
    kinds alone (``exempt_kinds``: the high-memory and overcommit rules): whether a device
    held by a pod of ``workload_kind`` (None: no pod) is judged."""
    exempt: list[str] = settings.exempt_kinds
    return workload_kind is None or workload_kind not in exempt


UNWATCHED = "is of a workload kind the rule leaves alone now"
"""Why an episode closes when the policy leaves its holder's kind alone (``on_unwatched``)."""


def releaser(kind: str, why: str = "released the GPU") -> ReleaseHook:
    """The release hook of memory rule ``kind``: a holder let the device go (or, with
    ``why`` :data:`UNWATCHED`, is no longer judged), so the rule's state starts afresh (its
    run, its window's points) and an open episode closes."""

    def release(track: Any, node: str, uuid: str, ts: float) -> Out:
        episode: Episode | None = track.open
        blank = type(track)(last_ts=track.last_ts)  # samples already seen stay seen
        for name in track.__struct_fields__:
            setattr(track, name, getattr(blank, name))
        if episode is None:
            return []
        return [resolved(episode.id, episode.fingerprint, kind,
                         Subject(node=node, device=uuid, pod=episode.pod),
                         f"{uuid} on {node}: {_named(episode.pod)} {why}", episode.since,
                         max(ts, episode.since))]

    return release


def _named(pod: PodRef | None) -> str:
    return "its holder" if pod is None else f"{pod.namespace}/{pod.name}"


def clock_step(track: SustainTrack, step: float) -> None:
    """The node's clock went back ``step`` s: the run (and a clearing run) starts over on the
    new clock, as after a gap; an open episode goes on, its start moved back by the step."""
    track.last_ts = track.since = track.clear_since = None
    track.samples, track.peak = 0, 0.0
    if track.open is not None:
        track.open.since -= step


def exempt_image(patterns: Sequence[str], holder: object) -> str | None:
    """The first of the holder's GPU container images (``idle.Holder.images``) one of
    ``patterns`` matches (a rule's ``exempt_images``: shell globs on the whole image
    reference as the pod spec names it, ``*`` matching across ``/``, ``[:@]`` a tag or a
    digest), or None. Asked only of a sample whose condition holds; each set of patterns
    is compiled once and each set of images matched once."""
    images: tuple[str, ...] = getattr(holder, "images", ())
    if not images or not patterns:
        return None
    return _matched(tuple(patterns), images)


@functools.lru_cache(maxsize=1024)
def _matched(patterns: tuple[str, ...], images: tuple[str, ...]) -> str | None:
    regex = _compiled(patterns)
    return next((image for image in images if regex.match(image)), None)


@functools.lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(fnmatch.translate(pattern) for pattern in patterns))


def free_bytes(sample: DeviceSample) -> int | None:
    """Free framebuffer memory of the device; None when not reported."""
    if sample.mem_used_bytes is None or sample.mem_total_bytes is None:
        return None
    return max(0, sample.mem_total_bytes - sample.mem_used_bytes)


def used_pct(sample: DeviceSample) -> float | None:
    if sample.mem_used_bytes is None or not sample.mem_total_bytes:
        return None
    return 100.0 * sample.mem_used_bytes / sample.mem_total_bytes


def pod_of(sample: DeviceSample, holder_pod: PodRef | None) -> PodRef | None:
    """The pod a memory finding names: the device's holder, or on a shared device the
    holder using the most memory."""
    if holder_pod is not None:
        return holder_pod
    named = [h for h in sample.holders if h.pod is not None]
    if named:
        return max(named, key=lambda h: h.mem_used_bytes or 0).pod
    return sample.pod


def sustain(track: SustainTrack, *, kind: str, node: str, sample: DeviceSample, ts: float,
            holds: bool | None, value: float, window_s: float, clear_s: float,
            max_gap_s: float, pod: PodRef | None, notify: bool, higher_is_worse: bool,
            describe: Callable[[SustainTrack, float], tuple[str, dict[str, float]]],
            severity: str = "warning", runbook: str = "") -> Out:
    """Fold one reading of a windowed condition; the episode's findings and notices.

    ``holds`` None means no reading (nothing changes); ``value`` is the rule's measure,
    whose worst over the run is kept as ``peak`` (the highest, or with ``higher_is_worse``
    false the lowest). ``describe(track, ts)`` gives the summary and evidence values.
    """
    if holds is None or (track.last_ts is not None and ts <= track.last_ts):
        return []
    if not holds and track.open is None:  # the common case, kept cheap: every sample of
        track.last_ts, track.since, track.samples = ts, None, 0  # every device runs it
        return []
    gap = track.last_ts is not None and ts - track.last_ts > max_gap_s
    track.last_ts = ts
    if not holds:
        track.since, track.samples = None, 0
        episode = track.open
        if episode is None:
            return []
        if track.clear_since is None or gap:
            track.clear_since = ts
        if ts - track.clear_since < clear_s:
            return []
        track.open = track.clear_since = None
        return [resolved(episode.id, episode.fingerprint, kind,
                         Subject(node=node, device=sample.uuid, pod=episode.pod),
                         f"{sample.uuid} on {node}: memory condition cleared", episode.since,
                         ts)]
    track.clear_since = None
    if track.since is None or gap:
        track.since, track.samples, track.peak = ts, 0, value
    track.samples += 1
    track.peak = max(track.peak, value) if higher_is_worse else min(track.peak, value)
    if track.open is not None or ts - track.since < window_s:
        return []
    fp = fingerprint(kind, node, sample.uuid)
    subject = Subject(node=node, device=sample.uuid, pod=pod)
    summary, values = describe(track, ts)
    finding = Finding(
        id=finding_id(fp, track.since), fingerprint=fp, kind=kind,
        severity=severity,  # type: ignore[arg-type]
        state="firing", subject=subject, summary=summary, starts_at=track.since, ts=ts,
        evidence=Evidence(window_start=track.since, window_end=ts, samples=track.samples,
                          values=values),
        runbook=runbook, labels={"model": sample.model})
    track.open = Episode(finding.id, fp, track.since, pod)
    out: Out = [finding]
    if notify and pod is not None:
        out.append(action_for(finding, "notify_owner", subject, summary))
    return out
