"""Low free GPU memory on serving devices: the next request's allocation may fail.

Seed 002 alerts on ``DCGM_FI_DEV_FB_FREE < 2000`` (MB) on serving nodes: an
inference server whose KV cache or batch grows needs headroom, and running
out means failed requests, not a slow job. The rule fires when the device's
free framebuffer memory stays below its floor for ``window_s`` on a device
held by a pod of one of ``workload_kinds`` (inference by default; training
jobs fill memory on purpose). The floor is ``floor_bytes`` or ``floor_pct``
of the device's memory, whichever is lower: LLM servers reserve their KV
cache at start (vLLM's ``gpu_memory_utilization`` 0.9 leaves a tenth of the
device free and holds the rest whatever the load), and a tenth of a 24 GiB
L4, a 16 GiB T4 or a 10 GiB MIG slice is below 2 GiB: a fixed 2 GiB floor
called every healthy server on them short of memory. Servers whose reserve is a share
of what the weights leave, or all of it (TensorRT-LLM, TGI, TensorFlow Serving), read a
low, flat free memory for their life, healthy: they are known by the images of their GPU
containers (``exempt_images``) and not judged. Episodes follow
:func:`gpusteward.rules.memory.sustain`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gpusteward.rules.memory import (
    GIB,
    UNWATCHED,
    Out,
    SustainTrack,
    clock_step,
    exempt_image,
    free_bytes,
    pod_of,
    releaser,
    sustain,
)
from gpusteward.rules.registry import DeviceRunner, own_settings
from gpusteward.rules.values import WorkloadKind
from gpusteward.schema import DeviceSample

KIND = "gpu_memory_low_free"
STATE = "mem_low_free"
"""Its per-device state: a field of the node join's device state."""
RUNBOOK = (
    "The serving pod's GPU is nearly out of free memory: lower the server's memory fraction "
    "or KV-cache size, the batch or the context length, or give it a larger GPU. If the "
    "server reserves what its weights leave when it starts (TensorRT-LLM, TGI, TensorFlow "
    "Serving) in an image of your own, ask the platform team to add the image to the "
    "policy's gpu_memory_low_free.exempt_images.")


RESERVING_IMAGES = (
    "nvcr.io/nvidia/tritonserver[:@]*trtllm*",
    "nvcr.io/nvidia/tensorrt-llm/*",
    "ghcr.io/huggingface/text-generation-inference[:@]*",
    "*tensorflow/serving[:@]*",
)
"""Images of servers whose free memory is what their reserve leaves: Triton's TensorRT-LLM
images (``<release>-trtllm-python-py3``), TensorRT-LLM's release containers, Hugging Face
TGI and TensorFlow Serving (``*-gpu`` tags)."""


class LowFreeMemorySettings(BaseModel):
    """Settings of the low-free-memory rule (serving devices)."""

    model_config = ConfigDict(extra="forbid")

    floor_bytes: int = Field(
        2 * GIB, ge=0,
        description="Free framebuffer memory (bytes) below which a sample counts. 2 GiB: seed "
        "002's DCGM_FI_DEV_FB_FREE < 2000 MB, about one more batch of a 7B model's KV cache.")
    floor_pct: float = Field(
        5.0, gt=0, le=100,
        description="Free memory below which a sample counts, as a share of the device's "
        "memory (percent), where that is lower than floor_bytes. 5 %: half of what vLLM's "
        "default gpu_memory_utilization (0.9) leaves free, which is less than 2 GiB on a 24 "
        "GiB L4, a 16 GiB T4 or a MIG slice; on an 80 GiB GPU floor_bytes applies.")
    window_s: float = Field(
        60, gt=0, description="Seconds free memory must stay below the floor, at every "
        "sample, before the rule fires (1 min: an allocator's transient peak does not count).")
    clear_s: float = Field(
        300, ge=0, description="Seconds above the floor that close an open episode (5 min: a "
        "server hovering at the floor gives one episode).")
    max_gap_s: float = Field(
        150, gt=0, description="A gap between samples longer than this (seconds) restarts "
        "the run: no observations means no evidence. 150 s: one missed reading of a "
        "collector polling every 60 s is no gap.")
    workload_kinds: list[WorkloadKind] = Field(
        default_factory=lambda: ["inference"],
        description="Workload kinds of the holder the rule watches (notebook, batch, "
        "inference; no other name is accepted). Empty: every device, held or not. Inference "
        "by default: training fills memory on purpose, a server needs headroom for the next "
        "request.")
    exempt_images: list[str] = Field(
        default_factory=lambda: list(RESERVING_IMAGES),
        description="Images of the holder's GPU containers whose devices the rule does not "
        "judge: shell globs on the whole reference as the pod spec names it (* matches "
        "across /; [:@] a tag or a digest). Servers that reserve a share of what the "
        "weights leave, or all of it, by default: TensorRT-LLM (its own and Triton's trtllm "
        "images), Hugging Face TGI, TensorFlow Serving; their free memory is the reserve's "
        "remainder, low and flat at every sample, healthy. An image built from them keeps "
        "its own name: add it. Empty: images exempt none.")
    notify: bool = Field(True, description="Notify the pod's owner when an episode opens.")



def watches(settings: LowFreeMemorySettings, workload_kind: str | None) -> bool:
    """Whether a device held by a pod of ``workload_kind`` (None: no pod) is watched."""
    return not settings.workload_kinds or workload_kind in settings.workload_kinds


def observe(track: SustainTrack, node: str, sample: DeviceSample, ts: float,
            settings: LowFreeMemorySettings, holder: object) -> Out:
    """The node join's sample hook (track, node, sample, ts, settings, holder)."""
    if not watches(settings, getattr(holder, "workload_kind", None)):
        return []
    free = free_bytes(sample)
    floor = settings.floor_bytes
    if free is not None and free < floor and sample.mem_total_bytes is not None:
        # Only below floor_bytes can the device's share be the lower floor: the fast path
        # of a device with room to spare costs nothing more.
        floor = min(floor, int(sample.mem_total_bytes * settings.floor_pct / 100))
    if free is not None and free >= floor and track.open is None:  # the fast path
        if track.last_ts is None or ts > track.last_ts:
            track.last_ts, track.since, track.samples = ts, None, 0
        return []
    reserving = exempt_image(settings.exempt_images, holder) is not None
    if reserving and track.open is None:
        return []  # its reserve's remainder (an episode opened under another policy clears)

    def describe(run: SustainTrack, now: float) -> tuple[str, dict[str, float]]:
        return (f"{sample.uuid} on {node} has had less than {floor / GIB:g} GiB free for "
                f"{(now - (run.since or now)) / 60:.0f} min (lowest {run.peak / GIB:.2f} GiB)",
                {"min_free_bytes": run.peak, "floor_bytes": float(floor)})

    return sustain(track, kind=KIND, node=node, sample=sample, ts=ts,
                   holds=None if free is None else free < floor and not reserving,
                   value=float(free or 0),
                   window_s=settings.window_s, clear_s=settings.clear_s,
                   max_gap_s=settings.max_gap_s, notify=settings.notify,
                   pod=pod_of(sample, getattr(holder, "pod", None)), higher_is_worse=False,
                   describe=describe, runbook=RUNBOOK)


RUNNER = DeviceRunner(state=STATE, state_type=SustainTrack, settings_from=own_settings(KIND),
                      on_sample=observe, on_release=releaser(KIND),
                      on_unwatched=releaser(KIND, UNWATCHED),
                      on_clock_step=clock_step, watches=watches)
