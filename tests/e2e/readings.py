"""What the GPUs read, per device-minute, held by whom the simulator placed there.

The deployed report's numbers are checked against this, not against the
pipeline's own rollups: each minute the worker could close (a minute closes
one lateness after its end), the utilisation samples the fake GPUs gave and
the pod the simulator had on the device at those samples.
"""

from __future__ import annotations

from gpusteward.sandbox.simulator.engine import GroundTruth, PodRecord
from gpusteward.schema import NodeSample

ROLLUP_LATENESS_S = 60.0  # the worker's default
Minutes = dict[tuple[str, float], tuple[list[float], PodRecord | None]]
"""(device uuid, minute start) -> the minute's utilisation samples and its holder."""


def held_minutes(truth: GroundTruth, samples: list[NodeSample]) -> Minutes:
    """Every closed device-minute with its samples and the pod holding the device."""
    holders: dict[str, list[PodRecord]] = {}
    for pod in truth.pods:
        for uuid in pod.devices:
            holders.setdefault(uuid, []).append(pod)
    last: dict[str, float] = {}
    for sample in samples:
        last[sample.node] = max(last.get(sample.node, sample.ts), sample.ts)
    minutes: Minutes = {}
    for sample in samples:
        minute = sample.ts - sample.ts % 60
        if minute + 60 + ROLLUP_LATENESS_S > last[sample.node]:
            continue
        for device in sample.devices:
            utils, holder = minutes.get((device.uuid, minute), ([], None))
            assert device.util_pct is not None
            utils.append(device.util_pct)
            for pod in holders.get(device.uuid, []):
                if pod.started_at <= sample.ts and (pod.ended_at is None
                                                    or sample.ts < pod.ended_at):
                    holder = pod
            minutes[(device.uuid, minute)] = (utils, holder)
    return minutes
