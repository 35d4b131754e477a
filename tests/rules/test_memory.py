"""The GPU-memory rules: low free memory, sustained high use, leak trend, over-commitment."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusteward.rules import memory_high, memory_leak, memory_low_free, memory_overcommit
from gpusteward.rules.idle import Holder
from gpusteward.rules.memory import SustainTrack
from gpusteward.schema import Action, DeviceHolder, DeviceSample, Finding, PodRef

GIB = 1 << 30
T0 = 1_000_000.0
SERVER = PodRef(namespace="serve", name="llm-0", uid="u-llm")
INFERENCE = Holder(SERVER, T0 - 3600, "inference")
TRAINING = Holder(PodRef(namespace="ml", name="train"), T0 - 3600, "batch")


def device(used_gib: float, *, util: float = 50.0, total_gib: float = 80.0,
           holders: list[DeviceHolder] | None = None) -> DeviceSample:
    return DeviceSample(uuid="GPU-1", index=0, model="H100", util_pct=util,
                        mem_used_bytes=int(used_gib * GIB), mem_total_bytes=int(total_gib * GIB),
                        holders=holders or [])


def findings(out: list) -> list[Finding]:
    return [o for o in out if isinstance(o, Finding)]


# --- low free memory ------------------------------------------------------------------

def _low_free(used: list[float], holder: Holder | None = INFERENCE, step: float = 10.0,
              total_gib: float = 80.0, **overrides) -> list:
    track = SustainTrack()
    cfg = memory_low_free.LowFreeMemorySettings(**overrides)
    out: list = []
    for i, gib in enumerate(used):
        out += memory_low_free.observe(track, "n1", device(gib, total_gib=total_gib),
                                       T0 + i * step, cfg, holder)
    return out


def test_low_free_fires_after_its_window_names_the_pod_and_notifies() -> None:
    out = _low_free([78.5] * 7)  # 1.5 GiB free for 60 s
    (finding,) = findings(out)
    assert finding.kind == "gpu_memory_low_free" and finding.subject.pod == SERVER
    assert finding.evidence and finding.evidence.values["min_free_bytes"] == 1.5 * GIB
    (action,) = [o for o in out if isinstance(o, Action)]
    assert action.verb == "notify_owner" and not action.dry_run


def test_low_free_needs_the_whole_window_and_a_serving_holder() -> None:
    assert findings(_low_free([78.5] * 6)) == []  # 50 s
    assert findings(_low_free([78.5] * 3 + [70.0] + [78.5] * 6)) == []  # broken run
    assert findings(_low_free([78.5] * 20, holder=TRAINING)) == []
    assert len(findings(_low_free([78.5] * 20, holder=TRAINING, workload_kinds=[]))) == 1


@pytest.mark.parametrize("total_gib", [22.5, 15.0, 9.625])  # L4, T4, a 1g.10gb MIG slice
def test_low_free_leaves_a_server_with_vllms_default_reserve_alone(total_gib: float) -> None:
    """vLLM holds 0.9 of the device from its start (plus its CUDA graphs): on a small GPU a
    tenth is below 2 GiB, by design; the floor there is 5 % of the device."""
    used = 0.9 * total_gib + 0.4
    assert findings(_low_free([used] * 60, total_gib=total_gib)) == []
    # A server that has really run out on such a GPU is still found.
    assert len(findings(_low_free([total_gib - 0.3] * 60, total_gib=total_gib))) == 1


def test_low_free_leaves_servers_whose_images_say_they_reserve_what_weights_leave() -> None:
    """TensorRT-LLM under Triton keeps 0.9 of what its engine leaves as KV cache: 0.7 GiB
    free on an 80 GiB H100, flat, healthy. Its image exempts it (tag or digest); an
    episode opened under a policy that did not closes as if the memory were free again;
    the same image judged with exempt_images emptied, or a server of another image, is
    found."""
    trt = "nvcr.io/nvidia/tritonserver:24.08-trtllm-python-py3"
    pinned = "ghcr.io/huggingface/text-generation-inference@sha256:" + "a" * 64
    for image in (trt, pinned, "docker.io/tensorflow/serving:2.17.0-gpu"):
        holder = msgspec.structs.replace(INFERENCE, images=("busybox:1", image))
        assert findings(_low_free([79.3] * 60, holder=holder)) == [], image
    server = msgspec.structs.replace(INFERENCE, images=(trt,))
    assert len(findings(_low_free([79.3] * 60, holder=server, exempt_images=[]))) == 1
    other = msgspec.structs.replace(INFERENCE, images=("vllm/vllm-openai:v0.6.3",))
    assert len(findings(_low_free([79.3] * 60, holder=other))) == 1
    track, cfg = SustainTrack(), memory_low_free.LowFreeMemorySettings(exempt_images=[])
    out: list = []
    for i in range(10):
        out += memory_low_free.observe(track, "n1", device(79.3), T0 + i * 10, cfg, server)
    cfg = memory_low_free.LowFreeMemorySettings()
    for i in range(10, 50):
        out += memory_low_free.observe(track, "n1", device(79.3), T0 + i * 10, cfg, server)
    assert [f.state for f in findings(out)] == ["firing", "resolved"]


def test_low_free_gives_one_episode_then_resolves_after_clear() -> None:
    out = _low_free([78.5] * 20 + [77.0] + [78.5] * 5 + [60.0] * 40)
    firing = [f for f in findings(out) if f.state == "firing"]
    resolved = [f for f in findings(out) if f.state == "resolved"]
    assert len(firing) == 1 and len(resolved) == 1 and resolved[0].id == firing[0].id


# --- sustained high use ------------------------------------------------------------------

def test_high_use_fires_after_five_minutes_above_ninety_percent() -> None:
    track, cfg = SustainTrack(), memory_high.HighMemorySettings()
    out: list = []
    for i in range(31):  # 300 s at 10 s
        out += memory_high.observe(track, "n1", device(74.0), T0 + i * 10, cfg, None)
    (finding,) = findings(out)
    assert round(finding.evidence.values["max_used_pct"], 1) == 92.5  # type: ignore[union-attr]
    assert finding.ts - finding.starts_at == 300


def test_high_use_leaves_llm_servers_alone_and_judges_training() -> None:
    """vLLM (0.9), TGI and TensorRT-LLM reserve their KV cache at start: above 90 % at every
    sample, healthy. Serving pods' devices are exempt by default; training's are judged."""
    def run(holder: Holder, **overrides: Any) -> list[Finding]:
        track, cfg = SustainTrack(), memory_high.HighMemorySettings(**overrides)
        out: list = []
        for i in range(120):  # 20 min at 10 s of vLLM's share plus its CUDA graphs
            out += memory_high.observe(track, "n1", device(0.9 * 79.6 + 0.5), T0 + i * 10,
                                       cfg, holder)
        return findings(out)

    assert run(INFERENCE) == []
    assert not memory_high.watches(memory_high.HighMemorySettings(), "inference")
    # TensorFlow or JAX under a plain Job: its image says whose pool it is.
    for image in ("tensorflow/tensorflow:2.17.0-gpu", "nvcr.io/nvidia/jax:24.04-py3"):
        assert run(msgspec.structs.replace(TRAINING, images=(image,))) == [], image
    assert len(run(msgspec.structs.replace(TRAINING, images=("nvcr.io/nvidia/pytorch:24.05",
                                                              )))) == 1
    assert len(run(TRAINING)) == 1
    assert len(run(INFERENCE, exempt_kinds=[])) == 1
    with pytest.raises(ValueError, match="unknown workload kind"):
        memory_high.HighMemorySettings(exempt_kinds=["serving"])


def _low_free_case(used: float) -> tuple[DeviceSample, bool]:
    return device(used), 80 - used < 2


def _high_case(used: float) -> tuple[DeviceSample, bool]:
    return device(used), 100 * used / 80 > 90


def _overcommit_case(used: float) -> tuple[DeviceSample, bool]:
    return _shared([used / 2, used / 2]), 100 * used / 80 > 90


WINDOWED: dict[str, tuple[Any, Any, Any, Holder | None]] = {
    "low_free": (memory_low_free.observe, memory_low_free.LowFreeMemorySettings(),
                 _low_free_case, INFERENCE),
    "high": (memory_high.observe, memory_high.HighMemorySettings(), _high_case, None),
    "overcommit": (memory_overcommit.observe, memory_overcommit.OvercommitSettings(),
                   _overcommit_case, None),
}


@pytest.mark.parametrize("rule", sorted(WINDOWED))
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(1, 150), st.sampled_from([40.0, 70.0, 74.0, 78.5])),
                      min_size=1, max_size=80))
def test_windowed_rules_fire_only_after_whole_windows_once_per_episode(rule, steps) -> None:
    """Whatever the readings and their spacing: each firing's evidence is an unbroken run of
    samples where the condition held, at least window_s long with no gap over max_gap_s, and
    firings alternate with resolutions (one finding per episode)."""
    observe, cfg, case, holder = WINDOWED[rule]
    track = SustainTrack()
    ts, seen, out = T0, [], []
    for gap, used in steps:
        ts += gap
        sample, holds = case(used)
        seen.append((ts, holds))
        out += [(ts, f) for f in findings(observe(track, "n1", sample, ts, cfg, holder))]
    states = [f.state for _, f in out]
    assert all(a != b for a, b in itertools.pairwise(states))
    assert not states or states[0] == "firing"
    for fired_at, finding in out:
        if finding.state != "firing":
            continue
        assert fired_at - finding.starts_at >= cfg.window_s
        window = [(t, held) for t, held in seen if finding.starts_at <= t <= fired_at]
        assert window and all(held for _, held in window)
        assert all(b - a <= cfg.max_gap_s for (a, _), (b, _) in itertools.pairwise(window))


# --- leak trend -----------------------------------------------------------------------------

def _leak(used_at, util_at, minutes: int, step: float = 15.0, holder: Holder = INFERENCE,
          **overrides) -> list:
    track, cfg = memory_leak.LeakTrack(), memory_leak.LeakSettings(**overrides)
    out: list = []
    for i in range(int(minutes * 60 / step)):
        ts = T0 + i * step
        out += memory_leak.observe(track, "n1", device(used_at(ts - T0), util=util_at(ts - T0)),
                                   ts, cfg, holder)
    return out


def test_a_steady_leak_is_found_with_its_projected_exhaustion_time() -> None:
    rate = 4 / 3600  # GiB per second: 4 GiB/h, from 20 GiB of 80
    out = _leak(lambda s: 20 + rate * s, lambda s: 40.0, minutes=45)
    firing = [f for f in findings(out) if f.state == "firing"]
    assert len(firing) == 1
    finding = firing[0]
    assert finding.subject.pod == SERVER
    ts = finding.ts
    truth_s = (80 - (20 + rate * (ts - T0))) / rate  # when free memory reaches 0 at this rate
    projected = finding.evidence.values["projected_exhaustion_s"]  # type: ignore[union-attr]
    assert abs(projected - truth_s) / truth_s < 0.10
    assert finding.ts - finding.starts_at >= 1800


def test_no_leak_on_flat_memory_sawtooth_or_growth_with_more_work() -> None:
    assert findings(_leak(lambda s: 30.0, lambda s: 40.0, minutes=60)) == []
    # Batches: allocate and free every 5 minutes.
    assert findings(_leak(lambda s: 20 + 10 * ((s % 300) / 300), lambda s: 40.0,
                          minutes=60)) == []
    # Memory grows because the work does (activity from 20 % to 80 %).
    assert findings(_leak(lambda s: 20 + s / 900, lambda s: 20 + s / 60, minutes=60)) == []


def test_no_leak_when_memory_refills_to_a_level_it_held_before() -> None:
    """A caching allocator releases memory and fills it again as requests come (the real
    serving pods of the Alibaba GenAI trace do it every few hours, 15 GiB back in half an
    hour): memory climbing back to its earlier high is no leak; climbing past it is."""
    def refill(top: float):
        def used(s: float) -> float:
            if s < 2400:
                return 30.0  # the cache, held for 40 min
            if s < 2700:
                return 15.0  # released
            return min(top, 15 + (s - 2700) * (top - 15) / 1800)  # filled again in 30 min
        return used
    assert findings(_leak(refill(30.0), lambda s: 40.0, minutes=90)) == []
    assert len([f for f in findings(_leak(refill(45.0), lambda s: 40.0, minutes=90))
                if f.state == "firing"]) == 1


def test_no_leak_when_memory_climbs_in_a_few_large_blocks() -> None:
    """An allocator's cache grows by whole blocks as larger requests come (a real serving pod
    of the GenAI trace: 16 -> 21 -> 24 -> 37 GiB in half an hour, then flat for hours); a
    leak grows by many small steps."""
    def staircase(s: float) -> float:
        return 16.0 + 5 * (s >= 600) + 4 * (s >= 1200) + 4 * (s >= 1500) + 9 * (s >= 2100)
    assert findings(_leak(staircase, lambda s: 40.0, minutes=60)) == []


def test_no_leak_when_a_training_cache_fills_in_minutes_and_stops() -> None:
    """A training job's caching allocator fills as training starts after a long data load,
    or as a new phase brings longer sequences: 40 GiB by small steps in ten or twelve
    minutes at full activity, then flat. A good line over half an hour, but it grew in one
    part of the window; a leak grows all through it."""
    training = Holder(PodRef(namespace="ml", name="train"), T0, "batch")
    for start_min, minutes in ((15, 10), (12, 12), (30, 10)):
        def warm_up(s: float, a: float = start_min * 60, d: float = minutes * 60) -> float:
            return 30 + 40 * min(1.0, max(0.0, (s - a) / d))
        out = _leak(warm_up, lambda s: 97.0, minutes=150, holder=training)
        assert findings(out) == [], (start_min, minutes)


def test_the_pods_start_up_is_not_fitted() -> None:
    """Loading the model grows memory once as the pod starts: the window is fitted from the
    end of the start-up grace on."""
    starting = Holder(SERVER, T0, "inference")
    grows = lambda s: 5 + s * 20 / 3600  # noqa: E731
    assert findings(_leak(grows, lambda s: 40.0, minutes=38, holder=starting)) == []
    (finding,) = findings(_leak(grows, lambda s: 40.0, minutes=45, holder=starting))
    assert finding.starts_at >= T0 + 600


def test_a_leak_needs_a_window_of_observations() -> None:
    assert findings(_leak(lambda s: 20 + s / 900, lambda s: 40.0, minutes=25)) == []


@settings(max_examples=30, deadline=None)
@given(level=st.floats(5, 70), jitter=st.lists(st.floats(-1.5, 1.5), min_size=200,
                                               max_size=200),
       step=st.floats(5, 60))
def test_no_leak_on_memory_that_only_wanders(level, jitter, step) -> None:
    """Memory that wanders around a level (allocations and frees, ±1.5 GiB) is no leak."""
    track, cfg = memory_leak.LeakTrack(), memory_leak.LeakSettings()
    out: list = []
    for i, noise in enumerate(jitter):
        out += memory_leak.observe(track, "n1", device(level + noise), T0 + i * step, cfg,
                                   INFERENCE)
    assert findings(out) == []


@settings(max_examples=30, deadline=None)
@given(rate_gib_h=st.floats(1.5, 20), step=st.floats(5, 50), start=st.floats(5, 30))
def test_a_steady_leak_gives_one_finding_after_its_window(rate_gib_h, step, start) -> None:
    track, cfg = memory_leak.LeakTrack(), memory_leak.LeakSettings()
    out: list = []
    i = 0
    while i * step < 3000:
        ts = T0 + i * step
        used = min(79.0, start + rate_gib_h * (ts - T0) / 3600)
        out += memory_leak.observe(track, "n1", device(used), ts, cfg, INFERENCE)
        i += 1
    firing = [f for f in findings(out) if f.state == "firing"]
    assert len(firing) == 1
    assert firing[0].ts - firing[0].starts_at >= cfg.window_s  # the whole window observed


def test_leak_state_rides_the_changelog() -> None:
    track, cfg = memory_leak.LeakTrack(), memory_leak.LeakSettings()
    for i in range(100):
        memory_leak.observe(track, "n1", device(20 + i / 60), T0 + i * 15, cfg, INFERENCE)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(track), type=memory_leak.LeakTrack)
    assert again == track


# --- over-committed shared GPUs --------------------------------------------------------------

def _shared(gibs: list[float]) -> DeviceSample:
    holders = [DeviceHolder(pod=PodRef(namespace="nb", name=f"nb-{i}"),
                            mem_used_bytes=int(g * GIB)) for i, g in enumerate(gibs)]
    return device(sum(gibs), holders=holders)


def test_overcommitted_shared_gpu_names_the_largest_holder() -> None:
    track, cfg = SustainTrack(), memory_overcommit.OvercommitSettings()
    out: list = []
    for i in range(13):  # 120 s
        out += memory_overcommit.observe(track, "n1", _shared([30, 45]), T0 + i * 10, cfg, None)
    (finding,) = findings(out)
    assert finding.subject.pod == PodRef(namespace="nb", name="nb-1")
    assert "nb/nb-0" in finding.summary and "nb/nb-1" in finding.summary


def test_llm_servers_sharing_a_gpu_at_their_reserved_shares_are_not_overcommitted() -> None:
    """Two vLLM servers at gpu_memory_utilization 0.45 on one GPU (vLLM's advice for sharing
    one) hold 91 % of it from their start and never ask for more."""
    def run(holder: Holder, **overrides: Any) -> list[Finding]:
        track, cfg = SustainTrack(), memory_overcommit.OvercommitSettings(**overrides)
        out: list = []
        for i in range(60):  # 10 min at 10 s
            out += memory_overcommit.observe(track, "n1", _shared([0.45 * 80 + 0.4] * 2),
                                             T0 + i * 10, cfg, holder)
        return findings(out)

    assert run(INFERENCE) == []
    assert not memory_overcommit.watches(memory_overcommit.OvercommitSettings(), "inference")
    assert len(run(Holder(PodRef(namespace="nb", name="nb-0"), T0, "notebook"))) == 1
    assert len(run(INFERENCE, exempt_kinds=[])) == 1


def test_a_full_gpu_with_one_holder_is_not_overcommitted() -> None:
    track, cfg = SustainTrack(), memory_overcommit.OvercommitSettings()
    out: list = []
    for i in range(40):
        out += memory_overcommit.observe(track, "n1", _shared([78]), T0 + i * 10, cfg, None)
    for i in range(40, 80):  # and none listed at all (an exclusive GPU)
        out += memory_overcommit.observe(track, "n1", device(79.0), T0 + i * 10, cfg, None)
    assert findings(out) == []


def test_a_leak_open_across_a_gap_is_neither_resolved_nor_found_again() -> None:
    """Samples stop for 10 min (more than max_gap_s) while the leak goes on: the window
    starts over, and until it is whole again nothing says the growth stopped, so the open
    episode goes on under its id. It used to be resolved clear_s after the gap and found
    again under a new id once the window refilled."""
    rate = 4 / 3600
    track, cfg = memory_leak.LeakTrack(), memory_leak.LeakSettings()
    out: list = []
    for i in range(int(150 * 60 / 15)):
        ts = T0 + i * 15
        if 40 * 60 <= ts - T0 < 50 * 60:
            continue  # the gap
        out += memory_leak.observe(track, "n1", device(20 + rate * (ts - T0), util=40.0), ts,
                                   cfg, INFERENCE)
    (firing,) = findings(out)
    assert firing.state == "firing" and firing.ts < T0 + 40 * 60
