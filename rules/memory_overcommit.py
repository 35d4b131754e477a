"""Over-committed shared GPUs: pods sharing a GPU whose memory together nearly fills it.

Time-slicing and MPS share a GPU's memory without isolation: each pod was
scheduled onto a replica as if it had the GPU, and nothing stops their
allocations from adding up past the framebuffer. Once they come near it,
the next allocation of any of them fails: an out-of-memory error waiting to
happen, for a pod that did nothing wrong. The rule fires when a device held
by at least two pods has its holders' memory (per-process attribution, or
the device's used memory where the source cannot split) above
``threshold_pct`` of its capacity for ``window_s``. The finding names every
holder and notifies the one using the most memory.

Devices held by serving pods are left alone (``exempt_kinds``): LLM servers
reserve their share when they start and never ask for more, so two vLLM
servers at vLLM's own advice for sharing a GPU (``gpu_memory_utilization``
0.45 to 0.5 each) fill 91 % or more of it at every sample, healthy. Whether a
server is short of memory is the low-free rule's question, which watches
shared serving devices too.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.memory import (
    GIB,
    UNWATCHED,
    Out,
    SustainTrack,
    clock_step,
    judges_kind,
    pod_of,
    releaser,
    sustain,
)
from gpusteward.rules.registry import DeviceRunner, own_settings
from gpusteward.rules.values import WorkloadKind
from gpusteward.schema import DeviceSample

KIND = "gpu_memory_overcommit"
STATE = "mem_overcommit"
"""Its per-device state: a field of the node join's device state."""
RUNBOOK = (
    "Pods sharing this GPU (time-slicing or MPS) together use nearly all its memory, with no "
    "isolation between them: cap each one's memory (e.g. PyTorch's "
    "torch.cuda.set_per_process_memory_fraction, TensorFlow's memory limit), lower the replicas "
    "per GPU, or move one pod elsewhere.")


class OvercommitSettings(BaseModel):
    """Settings of the over-committed-shared-GPU rule."""

    model_config = ConfigDict(extra="forbid")

    threshold_pct: float = Field(
        90.0, gt=0, le=100,
        description="The holders' memory as a share of the device's capacity (percent) above "
        "which a sample counts. 90 %: the allocators' caches and fragmentation eat the rest.")
    min_holders: int = Field(
        2, ge=2, description="Pods on the device for it to count as shared.")
    window_s: float = Field(
        120, gt=0, description="Seconds above the threshold before the rule fires (2 min: "
        "shorter than the high-memory rule's, since one tenant's peak is another's OOM).")
    clear_s: float = Field(
        300, ge=0, description="Seconds below the threshold that close an open episode.")
    max_gap_s: float = Field(
        150, gt=0, description="A gap between samples longer than this (seconds) restarts "
        "the run: no observations means no evidence. 150 s: one missed reading of a "
        "collector polling every 60 s is no gap.")
    exempt_kinds: list[WorkloadKind] = Field(
        default_factory=lambda: ["inference"],
        description="Workload kinds of the holder whose devices the rule does not judge "
        "(notebook, batch, inference; no other name is accepted). Inference by default: LLM "
        "servers sharing a GPU reserve their shares at start (two vLLM servers at "
        "gpu_memory_utilization 0.45 each read 91 %) and never ask for more; "
        "gpu_memory_low_free judges their headroom. Empty: every shared device.")
    notify: bool = Field(True, description="Notify the owner of the pod using the most memory.")


watches = judges_kind
"""Devices of ``exempt_kinds`` holders are not judged (:func:`.memory.judges_kind`)."""


def committed_bytes(sample: DeviceSample) -> int | None:
    """The holders' memory: their own where split, else the device's used memory."""
    own = [h.mem_used_bytes for h in sample.holders if h.mem_used_bytes is not None]
    if own and len(own) == len(sample.holders):
        return sum(own)
    return sample.mem_used_bytes


def observe(track: SustainTrack, node: str, sample: DeviceSample, ts: float,
            settings: OvercommitSettings, holder: object) -> Out:
    """The node join's sample hook (track, node, sample, ts, settings, holder)."""
    if len(sample.holders) < settings.min_holders:
        if track.since is None and track.open is None:
            return []  # not shared: the fast path of almost every device
        holds: bool | None = False  # no longer shared: the condition is gone
        pct = 0.0
    elif not watches(settings, getattr(holder, "workload_kind", None)):
        return []  # the node join does not call it for these; a direct caller gets the same
    else:
        committed = committed_bytes(sample)
        total = sample.mem_total_bytes
        holds, pct = None, 0.0
        if committed is not None and total:
            pct = 100.0 * committed / total
            holds = pct > settings.threshold_pct

    def describe(run: SustainTrack, now: float) -> tuple[str, dict[str, float]]:
        total = sample.mem_total_bytes
        names = ", ".join(f"{h.pod.namespace}/{h.pod.name}" if h.pod else f"uid {h.pod_uid}"
                          for h in sample.holders)
        return (f"{len(sample.holders)} pods share {sample.uuid} on {node} and together use "
                f"{run.peak:.0f} % of its {(total or 0) / GIB:.0f} GiB ({names})",
                {"max_committed_pct": run.peak, "threshold_pct": settings.threshold_pct,
                 "holders": float(len(sample.holders))})

    return sustain(track, kind=KIND, node=node, sample=sample, ts=ts, holds=holds, value=pct,
                   window_s=settings.window_s, clear_s=settings.clear_s,
                   max_gap_s=settings.max_gap_s, notify=settings.notify,
                   pod=pod_of(sample, None), higher_is_worse=True, describe=describe,
                   runbook=RUNBOOK)


RUNNER = DeviceRunner(state=STATE, state_type=SustainTrack, settings_from=own_settings(KIND),
                      on_sample=observe, on_release=releaser(KIND),
                      on_unwatched=releaser(KIND, UNWATCHED),
                      on_clock_step=clock_step, watches=watches)
