"""A GPU's thermal slowdown is judged against the slowdown temperature the GPU itself reports
(NVML), not a per-model table that guesses by name: from the fake NVML through the NVML
collector to the worker's node join, over the thermal rule's five-minute window."""

from __future__ import annotations

import asyncio

from gpusteward.schema import Finding
from gpusteward.streams.node import NodeJoin, NodeState
from tests.collectors.nvml.test_retired_pages import ticks_with_faults

L40S = "GPU-40540540-0000-4000-8000-000000000001"
A100 = "GPU-a100a100-0000-4000-8000-000000000002"


def test_a_gpu_is_judged_hot_against_its_own_slowdown_temperature(fake_nvml, publisher) -> None:
    samples = asyncio.run(ticks_with_faults(fake_nvml("hot-boards"), publisher, steps=11))
    read = {d.uuid: d.slowdown_temp_c for d in samples[0].devices}
    assert read == {L40S: 94.0, A100: 85.0}

    join, state = NodeJoin(), NodeState()
    fired: list[tuple[str, str | None]] = []
    for i, sample in enumerate(samples):  # 30 s apart: 5.5 min in all
        sample.ts = 1_000_000.0 + 30 * i
        fired += [(o.kind, o.subject.device) for o in join.on_sample(state, sample)
                  if isinstance(o, Finding)]
    # The L40S at 91 °C is 3 °C under its own limit: no slowdown (the table's L4 entry said
    # 90 °C). The A100 at 87 °C is over its board's 85 °C: slowing down (the table said 89).
    assert fired == [("thermal_slowdown", A100)]
