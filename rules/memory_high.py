"""Sustained high GPU-memory use: a device that has been nearly full for minutes.

Seed 003 alerts on memory above 90 % for 5 minutes. Unlike low free memory
(serving devices, absolute headroom) this watches the used share of devices
whatever holds them, but serving pods (``exempt_kinds``): a job that lives at
the edge is one larger batch from an out-of-memory crash. An LLM server is
not: vLLM (``gpu_memory_utilization`` 0.9), TGI and TensorRT-LLM (90 % of the
memory left after the weights) reserve their KV cache when they start and
hold it whatever the load, so every one of them reads 90 % or more at every
sample, healthy; whether a server is short of memory is the low-free rule's
question. Nor is a TensorFlow or JAX training job (``exempt_owner_kinds``: pods of
Kubeflow's TFJob and JAXJob; ``exempt_images``: pods of their images under another
owner): both frameworks reserve their memory pool when the
first operation runs (TensorFlow nearly all of the GPU, JAX 75 % of it or
``XLA_PYTHON_CLIENT_MEM_FRACTION``) and allocate inside it, so the used memory NVML
reads is the pool's configured size, not the job's need, and says nothing of how near
an out-of-memory error it is. Unless its container's environment turns the pool off
(``TF_FORCE_GPU_ALLOW_GROWTH=true``, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: the
watcher's ``memory_grows``): then the memory in use is the job's, and it is judged.
Episodes follow :func:`gpusteward.rules.memory.sustain`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.memory import (
    UNWATCHED,
    Out,
    SustainTrack,
    clock_step,
    exempt_image,
    judges_kind,
    pod_of,
    releaser,
    sustain,
    used_pct,
)
from gpusteward.rules.registry import DeviceRunner, own_settings
from gpusteward.rules.values import WorkloadKind
from gpusteward.schema import DeviceSample

KIND = "gpu_memory_high"
STATE = "mem_high"
"""Its per-device state: a field of the node join's device state."""
RUNBOOK = (
    "The GPU's memory has stayed nearly full: one larger batch or sequence away from an "
    "out-of-memory error. Reduce the batch, enable activation checkpointing, or move to a "
    "device with more memory. If the framework reserves its pool when it starts (TensorFlow, "
    "JAX) in an image of your own, ask the platform team to add the image to the policy's "
    "gpu_memory_high.exempt_images.")


POOL_IMAGES = (
    "*tensorflow/tensorflow[:@]*",
    "nvcr.io/nvidia/tensorflow[:@]*",
    "nvcr.io/nvidia/jax[:@]*",
    "ghcr.io/nvidia/jax[:@]*",
)
"""Images of TensorFlow and JAX, which reserve their memory pool when they start: Docker
Hub's ``tensorflow/tensorflow`` (``*-gpu`` tags), NGC's TensorFlow and JAX containers and
the JAX toolbox's (``ghcr.io/nvidia/jax``)."""


class HighMemorySettings(BaseModel):
    """Settings of the sustained-high-memory rule."""

    model_config = ConfigDict(extra="forbid")

    threshold_pct: float = Field(
        90.0, gt=0, le=100,
        description="Used share of the device's framebuffer (percent) above which a sample "
        "counts (90 %, seed 003).")
    window_s: float = Field(
        300, gt=0, description="Seconds above the threshold, at every sample, before the rule "
        "fires (5 min, seed 003: a checkpoint's or an eval's peak does not count).")
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
        "servers (vLLM's gpu_memory_utilization 0.9, TGI, TensorRT-LLM) reserve their KV "
        "cache at start and read 90 % or more at every sample whatever the load; "
        "gpu_memory_low_free judges their headroom. Empty: every device.")
    exempt_owner_kinds: list[str] = Field(
        default_factory=lambda: ["TFJob", "JAXJob"],
        description="Top owner kinds of the holder whose devices the rule does not judge. "
        "Kubeflow's TFJob and JAXJob by default: TensorFlow maps nearly all of a GPU's memory "
        "when it starts and JAX preallocates 75 % of it (XLA_PYTHON_CLIENT_MEM_FRACTION), "
        "so their devices read the pool's configured size, not the job's need. A pod whose "
        "GPU container sets TF_FORCE_GPU_ALLOW_GROWTH=true or "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false in its spec has no pool and is judged all the "
        "same. Empty: the owner exempts none.")
    exempt_images: list[str] = Field(
        default_factory=lambda: list(POOL_IMAGES),
        description="Images of the holder's GPU containers whose devices the rule does not "
        "judge: shell globs on the whole reference as the pod spec names it (* matches "
        "across /; [:@] a tag or a digest). TensorFlow's and JAX's own and NVIDIA's images "
        "by default, for TensorFlow or JAX run under another owner than a TFJob or JAXJob "
        "(a Job, a JobSet, an MPIJob): their pool reads the same. An image built from them "
        "keeps its own name: add it. A pool turned off in the container's environment is "
        "judged (as for exempt_owner_kinds). Empty: images exempt none.")
    notify: bool = Field(True, description="Notify the pod's owner when an episode opens.")




watches = judges_kind
"""Devices of ``exempt_kinds`` holders are not judged (:func:`.memory.judges_kind`)."""


def observe(track: SustainTrack, node: str, sample: DeviceSample, ts: float,
            settings: HighMemorySettings, holder: object) -> Out:
    """The node join's sample hook (track, node, sample, ts, settings, holder)."""
    pct = used_pct(sample)
    threshold = settings.threshold_pct
    if pct is not None and pct <= threshold and track.open is None:
        # The fast path of almost every sample: no run, nothing open, nothing to build.
        if track.last_ts is None or ts > track.last_ts:
            track.last_ts, track.since, track.samples = ts, None, 0
        return []
    if not watches(settings, getattr(holder, "workload_kind", None)):
        return []  # the node join does not call it for these; a direct caller gets the same
    pooled = not getattr(holder, "memory_grows", False) and (
        getattr(holder, "owner_kind", None) in settings.exempt_owner_kinds
        or exempt_image(settings.exempt_images, holder) is not None)
    if pooled and track.open is None:
        return []  # a preallocating framework's pool (an episode opened before, under
        # another policy, is cleared below as if the memory had fallen)

    def describe(run: SustainTrack, now: float) -> tuple[str, dict[str, float]]:
        return (f"{sample.uuid} on {node} has used more than {threshold:g} % of its memory for "
                f"{(now - (run.since or now)) / 60:.0f} min (peak {run.peak:.1f} %)",
                {"max_used_pct": run.peak, "threshold_pct": threshold})

    return sustain(track, kind=KIND, node=node, sample=sample, ts=ts,
                   holds=None if pct is None else pct > threshold and not pooled,
                   value=pct or 0.0,
                   window_s=settings.window_s, clear_s=settings.clear_s,
                   max_gap_s=settings.max_gap_s, notify=settings.notify,
                   pod=pod_of(sample, getattr(holder, "pod", None)), higher_is_worse=True,
                   describe=describe, runbook=RUNBOOK)


RUNNER = DeviceRunner(state=STATE, state_type=SustainTrack, settings_from=own_settings(KIND),
                      on_sample=observe, on_release=releaser(KIND),
                      on_unwatched=releaser(KIND, UNWATCHED),
                      on_clock_step=clock_step, watches=watches)
