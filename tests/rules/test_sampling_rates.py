"""The windowed per-device rules at the rates real collectors deliver, under the shipped policy.

dcgm-exporter and Prometheus give a reading every 15 to 60 s, not every second: a rule whose
``max_gap_s`` or sample minimum assumed a faster rate would count every reading as a gap and
never fire, and one whose window held a single reading would fire on a spike. Each rule here
runs through the node join on a steady condition at 15, 30 and 60 s, and must fire when its
window is first covered; one bad reading among good ones must never fire.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpusteward.schema import DeviceHolder, DeviceSample, Finding, NodeSample, PodAllocation, PodRef
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings
from gpusteward.streams.policy_file import load_policy

REPO = Path(__file__).resolve().parents[2]
POLICY = load_policy(REPO / "deploy" / "base" / "policy.yaml")
GIB = 1 << 30
T0 = 1_000_000.0
POD = PodRef(namespace="ml", name="p")
OTHER = PodRef(namespace="ml", name="q")
RATES = (15.0, 30.0, 60.0)


def dev(**fields: Any) -> DeviceSample:
    base: dict[str, Any] = {
        "uuid": "GPU-1", "index": 0, "model": "NVIDIA H100 80GB HBM3", "util_pct": 50.0,
        "mem_used_bytes": 20 * GIB, "mem_total_bytes": 80 * GIB, "temp_c": 60.0,
        "clock_event_reasons": 0, "pcie_replay": 0, "nvlink_errors": 0, "ecc_sbe_volatile": 0,
        "pod": POD}
    base.update(fields)
    return DeviceSample(**base)


def first_firing(reading: Callable[[float], DeviceSample], step: float, until_s: float,
                 workload_kind: str = "notebook") -> dict[str, float]:
    """Seconds from the first reading to each kind's first firing finding."""
    join, state = NodeJoin(RuleSettings(policy=POLICY)), NodeState()
    join.on_allocation(state, PodAllocation(
        ts=T0 - 7200, node="n1", pod=POD, phase="running", gpus=1, device_ids=["GPU-1"],
        started_at=T0 - 7200, workload_kind=workload_kind))
    first: dict[str, float] = {}
    i = 0
    while i * step <= until_s:
        sample = NodeSample(ts=T0 + i * step, node="n1", source="dcgm",
                            devices=[reading(i * step)])
        for out in join.on_sample(state, sample):
            if isinstance(out, Finding) and out.state == "firing":
                first.setdefault(out.kind, i * step)
        i += 1
    return first


SHARED = [DeviceHolder(pod=POD, mem_used_bytes=40 * GIB),
          DeviceHolder(pod=OTHER, mem_used_bytes=36 * GIB)]
CASES: dict[str, tuple[Callable[[float], DeviceSample], str, float, str]] = {
    # name: (reading at second s, kind, when it must fire, holder's workload kind)
    "idle": (lambda s: dev(util_pct=0.0), "idle_holder", 1800, "notebook"),
    "thermal by temperature": (lambda s: dev(temp_c=92.0), "thermal_slowdown", 300, "notebook"),
    "thermal by reason, no temperature": (
        lambda s: dev(temp_c=None, clock_event_reasons=0x40), "thermal_slowdown", 300,
        "notebook"),
    "high memory": (lambda s: dev(mem_used_bytes=75 * GIB), "gpu_memory_high", 300,
                    "notebook"),
    "low free memory": (lambda s: dev(mem_used_bytes=79 * GIB), "gpu_memory_low_free", 60,
                        "inference"),
    "overcommit": (lambda s: dev(mem_used_bytes=76 * GIB, holders=SHARED,
                                 attribution="process"), "gpu_memory_overcommit", 120,
                   "notebook"),
    "leak": (lambda s: dev(mem_used_bytes=int((10 + 6 * s / 3600) * GIB)), "gpu_memory_leak",
             1800, "inference"),
}


@pytest.mark.parametrize("step", RATES)
@pytest.mark.parametrize("name", CASES)
def test_a_windowed_rule_fires_when_its_window_is_covered(name: str, step: float) -> None:
    reading, kind, window_s, workload_kind = CASES[name]
    found = first_firing(reading, step, window_s + 600, workload_kind)
    # The first reading at or after the window: never sooner, never one gap after another.
    assert found.get(kind) == -(-window_s // step) * step


@pytest.mark.parametrize("step", RATES)
@pytest.mark.parametrize(("name", "kind", "counter", "per_reading"), [
    ("pcie", "pcie_replay", "pcie_replay", 30),  # 100 per 5 min
    ("nvlink", "nvlink_errors", "nvlink_errors", 4),  # 10 per 5 min
    ("nvlink crc", "nvlink_crc_errors", "nvlink_crc_errors", 7500),  # 30000 per 5 min
])
def test_a_counter_burst_fires_at_any_rate(name: str, kind: str, counter: str,
                                           per_reading: int, step: float) -> None:
    """A burst that crosses the threshold within the window is found however the readings
    are spaced: by the first reading whose increase since the burst began reaches it."""
    found = first_firing(lambda s: dev(**{counter: int(s / step) * per_reading}), step, 900)
    threshold = {"pcie_replay": 100, "nvlink_errors": 10, "nvlink_crc_errors": 30000}[kind]
    assert found.get(kind) == -(-threshold // per_reading) * step


@pytest.mark.parametrize("step", RATES)
@pytest.mark.parametrize(("bad", "workload_kind"), [
    (dev(temp_c=95.0, clock_event_reasons=0x40), "notebook"),
    (dev(mem_used_bytes=79 * GIB), "inference"),
    (dev(util_pct=0.0), "notebook"),
])
def test_one_bad_reading_never_fires(bad: DeviceSample, workload_kind: str,
                                     step: float) -> None:
    assert first_firing(lambda s: bad if s == 10 * step else dev(), step, 3600,
                        workload_kind) == {}


@pytest.mark.parametrize("step", RATES)
def test_readings_the_collector_does_not_give_raise_nothing(step: float) -> None:
    """A MIG device under NVML (no utilisation, no engine activity) and a GPU whose exporter
    gives no temperature, clock reasons or counters: no finding, no error."""
    mig = DeviceSample(uuid="MIG-1", index=0, model="NVIDIA A100-SXM4-80GB", kind="mig",
                       parent_uuid="GPU-1", mig_profile="3g.40gb", mem_used_bytes=GIB,
                       mem_total_bytes=40 * GIB, pod=POD)
    bare = dev(util_pct=None, temp_c=None, clock_event_reasons=None, pcie_replay=None,
               nvlink_errors=None, ecc_sbe_volatile=None, mem_used_bytes=None)
    assert first_firing(lambda s: mig, step, 3 * 3600) == {}
    assert first_firing(lambda s: bare, step, 3 * 3600, "inference") == {}


@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][2] < 1800])
def test_one_missed_reading_of_a_60_s_collector_is_no_gap(name: str) -> None:
    """A collector polling every 60 s misses a reading now and then (a query that timed out):
    the next one comes 120 s and its own latency after the last. That is no gap; the run goes
    on and the rule fires at the first reading past its window, not a window later."""
    reading, kind, window_s, workload_kind = CASES[name]
    join, state = NodeJoin(RuleSettings(policy=POLICY)), NodeState()
    join.on_allocation(state, PodAllocation(
        ts=T0 - 7200, node="n1", pod=POD, phase="running", gpus=1, device_ids=["GPU-1"],
        started_at=T0 - 7200, workload_kind=workload_kind))
    times = [0.0, 60.0] + [182.0 + i * 60 for i in range(12)]  # the reading at 120 s missed
    fired = [s for s in times for out in join.on_sample(state, NodeSample(
        ts=T0 + s, node="n1", source="prometheus", devices=[reading(s)]))
        if isinstance(out, Finding) and out.state == "firing" and out.kind == kind]
    assert fired[:1] == [min(s for s in times if s >= window_s)]
