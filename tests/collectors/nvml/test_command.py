"""``gpusteward collect nvml`` as the DaemonSet runs it: a real process, a kubelet, Kafka.

The command once handed its ``CollectSettings`` to a runner that wanted other
settings and crashed at start; only running the real command catches that.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.schema import PodRef
from gpusteward.settings import Settings

from ..conftest import metric_value
from .conftest import KUBELET_LIST, MIG_1, MIG_PARENT, WHOLE, Kubelet, run_collect_nvml


@pytest.mark.e2e
def test_collect_nvml_process_publishes_pod_attributed_samples(
        settings: Settings, nvml_data: Path, socket_path: Path) -> None:
    collected = 'gpusteward_collect_samples_total{source="nvml"}'
    kubelet = Kubelet(KUBELET_LIST)
    samples, metrics = run_collect_nvml(settings, socket_path, kubelet, "gpu-node-03",
                                        "--fake-nvml", str(nvml_data / "mixed-node.yaml"))
    assert len(samples) >= 3
    assert metric_value(metrics, collected) >= 3  # the shared collector metric names
    assert {(s.node, s.source) for s in samples} == {("gpu-node-03", "nvml")}
    assert kubelet.calls >= 1
    last = samples[-1]
    assert len(last.devices) == 4
    pods = {d.uuid: d.pod for d in last.devices}
    assert pods[WHOLE] == PodRef(namespace="ml", name="train-0", container="trainer")
    assert pods[MIG_PARENT] is None
    assert pods[MIG_1] == PodRef(namespace="research", name="notebook-7", container="jupyter")
