"""LLM servers in the simulated world, through the production collectors and the worker.

The ``llm-serving`` scenario runs vLLM servers as fleets run them: each reserves 0.9 of its
GPU (plus its CUDA graphs) when it starts and holds it whatever the load, on an L4, a T4
and an H100, and two share an H100 at 0.45 each, with bursty traffic. It runs in
:class:`~gpusteward.sandbox.world.World` (the fake NVML and kubelet on each node, the
production NVML collector, the watcher on the API double) and the stream worker runs as a
child process with the shipped policy.

What must hold: no memory finding, and no notice, names a healthy server (the shipped
policy once told each of them its GPU was nearly full, the L4 and T4 ones that they were
short of memory, and the two sharing an H100 that they over-committed it); the server that
has really run out and the training job living at the edge of its GPU's memory are found,
and only they. A TFJob and a JAXJob read as full as that job (TensorFlow's and JAX's memory
pools, reserved when they start) and are not told: their owner is the watcher's, from the
pod's controller, as in a cluster. Nor is TensorFlow under a plain Job, nor a Triton server
running TensorRT-LLM with 0.5 GiB free (its KV cache takes 0.9 of what the engine leaves):
the watcher reads their images from the pod spec.
"""

from __future__ import annotations

import asyncio

import pytest

from gpusteward.broker import EmbeddedBroker
from tests.e2e.world_run import WorldRun, run_in_world

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> WorldRun:
    return asyncio.run(run_in_world(broker, "llm-serving", tmp_path_factory.mktemp("llm")))


def test_the_collector_read_the_servers_reserved_memory(run: WorldRun) -> None:
    """The world is what the scenario says: vLLM's share read through NVML, over 90 % of
    each GPU, under 2 GiB free on the L4 and the T4, at every reading."""
    used: dict[str, list[float]] = {}
    for sample in run.samples:
        for device in sample.devices:
            if device.pod is not None and device.pod.name.startswith("vllm-"):
                total, mem = device.mem_total_bytes or 0, device.mem_used_bytes or 0
                used.setdefault(device.pod.name.split("-")[1], []).append(mem / total)
                if device.model in ("NVIDIA L4", "Tesla T4"):
                    assert total - mem < 2 << 30
    assert set(used) == {"l4", "t4", "h100", "pair"}
    assert all(min(shares) > 0.9 for shares in used.values())
    assert min(len(shares) for shares in used.values()) >= 30
    # The pair sharing an H100: each one's own memory, 91 % of it together.
    pair = [d for s in run.samples for d in s.devices if len(d.holders) == 2]
    assert len(pair) >= 30
    assert all(sum(h.mem_used_bytes or 0 for h in d.holders) / (d.mem_total_bytes or 1) > 0.9
               for d in pair)


def test_no_memory_finding_or_notice_names_a_healthy_server(run: WorldRun) -> None:
    memory = [f for f in run.findings if f.kind.startswith("gpu_memory_") and f.subject.pod]
    assert not [f for f in memory if f.subject.pod and f.subject.pod.name.startswith("vllm-")]
    assert not [a for a in run.actions
                if a.target.pod is not None and a.target.pod.name.startswith("vllm-")]


def test_the_starved_server_and_the_training_jobs_at_the_edge_are_found(run: WorldRun) -> None:
    """The server out of memory, the Job at the edge of it, and the TFJob whose pod spec
    turns TensorFlow's pool off (TF_FORCE_GPU_ALLOW_GROWTH=true, read by the watcher): its
    78 GiB are its own, so neither its owner nor its image exempts it."""
    firing = {(f.kind, f.subject.pod.name) for f in run.findings
              if f.state == "firing" and f.kind.startswith("gpu_memory_") and f.subject.pod}
    assert firing == {("gpu_memory_low_free", "starved-svc-d"),
                      ("gpu_memory_high", "train-svc-e"),
                      ("gpu_memory_high", "tf-grow-svc-b")}
    notified = {a.target.pod.name for a in run.actions
                if a.verb == "notify_owner" and a.target.pod is not None}
    assert notified == {"starved-svc-d", "train-svc-e", "tf-grow-svc-b"}


def test_tensorflow_and_jax_training_pools_raise_no_memory_finding(run: WorldRun) -> None:
    """The TFJob's and the JAXJob's GPUs read over 95 % used at every sample (the pools
    TensorFlow and JAX reserve), as the Job's at the edge does; only the Job is told (the
    test above), and nothing names the two."""
    pooled = {"tf-train-svc-c", "jax-train-svc-d"}
    shares = [(d.mem_used_bytes or 0) / (d.mem_total_bytes or 1) for s in run.samples
              for d in s.devices if d.pod is not None and d.pod.name in pooled]
    assert len(shares) >= 60 and min(shares) > 0.95
    assert not [f for f in run.findings
                if f.kind.startswith("gpu_memory_") and f.subject.pod
                and f.subject.pod.name in pooled]
    assert not [a for a in run.actions if a.target.pod is not None
                and a.target.pod.name in pooled]


def test_frameworks_known_by_their_images_raise_no_memory_finding(run: WorldRun) -> None:
    """TensorFlow under a plain Job (98 % used) and TensorRT-LLM under Triton on an L4 (0.5
    GiB free) read as the job at the edge and the starved server do at every sample; their
    images, which the watcher read from the pod specs, say whose pools they are, and
    nothing names them. Before 2026-11-27 the first was told its GPU was nearly full and
    the second that it was short of memory, for as long as they ran."""
    readings: dict[str, list[tuple[int, int]]] = {}
    for sample in run.samples:
        for d in sample.devices:
            if d.pod is not None and d.pod.name.startswith(("tf-job-", "trtllm-")):
                readings.setdefault(d.pod.name, []).append(
                    (d.mem_used_bytes or 0, d.mem_total_bytes or 1))
    assert len(readings) == 2 and min(len(r) for r in readings.values()) >= 30
    for name, reads in readings.items():
        if name.startswith("tf-job-"):
            assert min(used / total for used, total in reads) > 0.95
        else:
            assert max(total - used for used, total in reads) < 1 << 30
    assert not [f for f in run.findings if f.kind.startswith("gpu_memory_") and f.subject.pod
                and f.subject.pod.name in readings]
    assert not [a for a in run.actions if a.target.pod is not None
                and a.target.pod.name in readings]
