"""The fake NVML against what the real driver gave: the samples the collector published from a
real H200 (tests/data/nvml/h200-real.jsonl, read on the GPU machine, docs/collectors.md "On a
real GPU") come out the same from the fake described with that GPU's readings, field for field:
the fields a Hopper GPU has and has not (no page retirement, no NVLink on that machine), the
units (mW to W, bytes) and the values."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.schema import Action, Finding, NodeSample, PodAllocation, PodRef, Rollup
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings
from gpusteward.streams.policy_file import load_policy

from .conftest import DATA

REPO = Path(__file__).resolve().parents[3]


def test_the_fake_h200_gives_the_samples_the_real_one_gave(fake_nvml, publisher):
    real = [msgspec.json.decode(line, type=NodeSample)
            for line in (DATA / "h200-real.jsonl").read_bytes().splitlines()]
    fake = fake_nvml("h200-real")
    collector = NvmlCollector(fake, "h200-real", publisher, interval_s=60, event_wait_ms=50)

    async def ticks() -> list[NodeSample]:
        collector.open()
        try:
            idle = await collector.tick()
            fake.step()
            return [idle, await collector.tick()]
        finally:
            collector.close()

    for made, read in zip(asyncio.run(ticks()), real, strict=True):
        assert msgspec.to_builtins(made.devices) == msgspec.to_builtins(read.devices)
        assert (made.node, made.source) == (read.node, read.source)


def test_a_real_busy_h200_at_its_power_cap_raises_nothing_under_the_shipped_policy():
    """The real busy sample (100 % busy, at its 700 W cap: clock reason SW power cap), held for
    an hour by a training pod, through the node join under the deployed policy: a healthy GPU
    doing its work, no finding and no minute counted as throttled."""
    busy = msgspec.json.decode((DATA / "h200-real.jsonl").read_bytes().splitlines()[1],
                               type=NodeSample)
    device = busy.devices[0]
    join = NodeJoin(RuleSettings(policy=load_policy(REPO / "deploy" / "base" / "policy.yaml")))
    state = NodeState()
    pod = PodRef(namespace="ml", name="train-0", uid="u-train-0")
    t0 = busy.ts
    out = join.on_allocation(state, PodAllocation(
        ts=t0 - 60, node=busy.node, pod=pod, phase="running", gpus=1, device_ids=[device.uuid],
        started_at=t0 - 60, workload_kind="batch", owner_kind="Job", owner_name="train"))
    for step in range(360):
        out += join.on_sample(state, msgspec.structs.replace(busy, ts=t0 + 10 * step))
    assert [o for o in out if isinstance(o, Finding | Action)] == []
    minutes = [o for o in out if isinstance(o, Rollup)]
    assert len(minutes) >= 55 and all(m.throttled_samples == 0 for m in minutes)
