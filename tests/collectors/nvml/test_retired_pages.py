"""Dynamic page retirement on pre-Ampere GPUs (T4, V100), from the fake NVML through the
NVML collector to the worker's node join: a pending retirement taints the node for a GPU
reset until the GPU reports none pending; a GPU with many retired pages is reported for
replacement. Ampere and newer GPUs remap rows instead and are not asked."""

from __future__ import annotations

import asyncio

import pynvml
import pytest

from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.schema import Action, Finding, NodeSample
from gpusteward.streams.node import NodeJoin, NodeState

L4 = "GPU-4c4c4c4c-0000-4000-8000-000000000001"
T4_PENDING = "GPU-77777777-0000-4000-8000-000000000002"
T4_WORN = "GPU-77777777-0000-4000-8000-000000000003"


async def ticks_with_faults(fake, publisher, steps: int) -> list[NodeSample]:
    """A tick, then one more after each scheduled fault step (a step without one is a
    plain tick)."""
    collector = NvmlCollector(fake, "node-t4", publisher, interval_s=60.0, event_wait_ms=50)
    collector.open()
    try:
        samples = [await collector.tick()]
        for _ in range(steps):
            fake.step()
            samples.append(await collector.tick())
        return samples
    finally:
        collector.close()


def test_t4_page_retirement_reaches_the_node_join(fake_nvml, publisher) -> None:
    fake = fake_nvml("turing-node")
    samples = asyncio.run(ticks_with_faults(fake, publisher, steps=2))
    first = {d.uuid: d for d in samples[0].devices}
    # The L4 remaps rows: its page-retirement readings are absent, never zero.
    assert first[L4].remapped_rows_correctable == 0
    assert (first[L4].retired_pages_sbe, first[L4].retired_pages_pending) == (None, None)
    t4 = first[T4_PENDING]
    assert t4.remapped_rows_correctable is None and t4.remap_pending is None
    assert (t4.retired_pages_sbe, t4.retired_pages_dbe, t4.retired_pages_pending) == (2, 0, False)
    assert samples[1].devices[1].retired_pages_pending is True

    join, state = NodeJoin(), NodeState()
    outputs = []
    for i, sample in enumerate(samples):
        sample.ts = 1_000_000.0 + 30 * i  # the collector stamps wall time; space the ticks
        outputs.append(join.on_sample(state, sample))
    findings = [[(o.kind, o.subject.device, o.state) for o in out if isinstance(o, Finding)]
                for out in outputs]
    # Tick 0: the worn T4 (57 + 3 = 60 retired pages) is reported for replacement.
    assert findings[0] == [("retired_pages", T4_WORN, "firing")]
    (worn,) = [o for o in outputs[0] if isinstance(o, Finding)]
    assert "replace" in worn.summary and worn.evidence is not None
    assert worn.evidence.values["retired_pages"] == 60
    assert not [o for o in outputs[0] if isinstance(o, Action)], "a report, not an action"
    # Tick 1: the pending retirement taints the node for a GPU reset.
    assert findings[1] == [("retired_pages_pending", T4_PENDING, "firing")]
    (taint,) = [o for o in outputs[1] if isinstance(o, Action)]
    assert taint.verb == "taint" and taint.target.node == "node-t4"
    assert taint.params["key"] == "gpusteward.io/gpu-reset-required"
    # Tick 2: the GPU was reset, nothing pending: the episode resolves under its id.
    assert findings[2] == [("retired_pages_pending", T4_PENDING, "resolved")]
    fired = next(o for o in outputs[1] if isinstance(o, Finding))
    resolved = next(o for o in outputs[2] if isinstance(o, Finding))
    assert resolved.id == fired.id


def test_ampere_and_newer_are_not_asked_and_answer_not_supported(fake_nvml, publisher) -> None:
    fake = fake_nvml("turing-node")
    asked: list[str] = []
    for name in ("nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus"):
        call = getattr(fake, name)

        def spy(handle, *args, _call=call, _name=name):
            asked.append(handle.gpu.uuid)
            return _call(handle, *args)
        setattr(fake, name, spy)
    asyncio.run(ticks_with_faults(fake, publisher, steps=0))
    assert set(asked) == {T4_PENDING, T4_WORN}, "the L4 remaps rows: no calls per tick"
    # Asked anyway (a MIG-enabled A100 with instances gives no remapped rows), NVML says
    # NotSupported, and the reading is absent.
    ampere = FakeNvml({"gpus": [{"uuid": "GPU-A", "name": "NVIDIA A100-SXM4-80GB",
                                 "mig": {"enabled": True, "devices": [
                                     {"uuid": "MIG-A1", "profile": "7g.80gb", "profile_id": 0,
                                      "gpu_instance_id": 0}]}}]})
    ampere.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        ampere.nvmlDeviceGetRetiredPagesPendingStatus(ampere.nvmlDeviceGetHandleByIndex(0))
    (sample,) = asyncio.run(ticks_with_faults(ampere, publisher, steps=0))
    gpu = next(d for d in sample.devices if d.kind == "gpu")
    assert (gpu.retired_pages_sbe, gpu.retired_pages_pending) == (None, None)
