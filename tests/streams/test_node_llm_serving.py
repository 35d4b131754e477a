"""Healthy LLM serving through the node join, under the shipped policy: no finding.

vLLM reserves ``gpu_memory_utilization`` (0.9) of the GPU when it starts, KV cache included,
and holds it whatever the load; CUDA graphs add a few hundred MiB outside that share.
Traffic is bursty by day (most readings catch no kernel) and stops at night. Every finding
on such a pod would be noise sent to its owner; a training job living at the edge of its
memory, and a server that runs out of it, are still found.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gpusteward.schema import DeviceSample, Finding, NodeSample, PodAllocation, PodRef
from gpusteward.streams.node import NodeJoin, NodeState, RuleSettings
from gpusteward.streams.policy_file import load_policy

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
T0 = 1_000_000.0
STEP = 30.0
DAY_TICKS, NIGHT_TICKS = int(11 * 3600 / STEP), int(13 * 3600 / STEP)

GPUS = {  # uuid -> (model, memory in MiB, the server's CUDA-graph memory outside its share)
    "GPU-l4": ("NVIDIA L4", 23034, 400),
    "GPU-t4": ("Tesla T4", 15360, 300),
    "GPU-h100": ("NVIDIA H100 80GB HBM3", 81559, 500),
}


def server(uuid: str) -> PodRef:
    return PodRef(namespace="serving", name=f"vllm-{uuid.lower()}", uid=f"u-{uuid}")


def allocation(uuid: str, kind: str = "inference", owner: str = "Job",
               image: str = "vllm/vllm-openai:v0.6.3", grows: bool = False) -> PodAllocation:
    pod = server(uuid) if kind == "inference" else PodRef(namespace="ml", name=f"train-{uuid}",
                                                          uid=f"u-train-{uuid}")
    return PodAllocation(ts=T0 - 3600, node="n1", pod=pod, phase="running", gpus=1,
                         device_ids=[uuid], started_at=T0 - 3600, workload_kind=kind,
                         owner_kind="Deployment" if kind == "inference" else owner,
                         owner_name=pod.name, images=[image], memory_grows=grows)


def device(uuid: str, util: float, used_mib: float | None = None) -> DeviceSample:
    model, total_mib, graphs_mib = GPUS.get(uuid, ("NVIDIA H100 80GB HBM3", 81559, 0))
    used = used_mib if used_mib is not None else 0.9 * total_mib + graphs_mib
    return DeviceSample(uuid=uuid, index=0, model=model, util_pct=util, temp_c=62.0,
                        mem_used_bytes=int(used * MIB), mem_total_bytes=total_mib * MIB)


def run(extra: list[str], used_extra: float, days: int,
        owners: dict[str, str] | None = None, images: dict[str, str] | None = None,
        grows: frozenset[str] = frozenset()) -> Counter[tuple[str, str | None]]:
    join = NodeJoin(RuleSettings(policy=load_policy(REPO / "deploy" / "base" / "policy.yaml")))
    state = NodeState()
    kinds = {uuid: "inference" for uuid in GPUS} | {uuid: "batch" for uuid in extra}
    out = []
    for uuid, kind in kinds.items():
        out += join.on_allocation(state, allocation(
            uuid, kind, (owners or {}).get(uuid, "Job"),
            (images or {}).get(uuid, "nvcr.io/nvidia/pytorch:24.05-py3"), uuid in grows))
    bursts = [0.0, 0.0, 0.0, 35.0, 0.0, 8.0]
    utils = ([bursts[i % len(bursts)] for i in range(DAY_TICKS)] + [0.0] * NIGHT_TICKS) * days
    for i, util in enumerate(utils):
        devices = [device(uuid, util) for uuid in GPUS]
        devices += [device(uuid, 97.0, used_extra) for uuid in extra]
        out += join.on_sample(state, NodeSample(ts=T0 + i * STEP, node="n1", source="test",
                                                devices=devices))
    return Counter((o.kind, o.subject.device) for o in out
                   if isinstance(o, Finding) and o.state == "firing")


def test_vllm_servers_raise_nothing_day_or_night() -> None:
    assert run([], 0.0, days=3) == Counter()


def test_a_training_job_at_the_edge_of_its_memory_is_still_found() -> None:
    # 78 of 79.6 GiB for days: the high-memory rule still judges batch pods' devices.
    found = run(["GPU-train"], 78 * 1024, days=1)
    assert found == Counter({("gpu_memory_high", "GPU-train"): 1})


def test_tensorflow_and_jax_jobs_pools_are_not_judged_a_job_at_the_edge_is() -> None:
    # TensorFlow maps all of an H100 but its MinSystemMemory (1.5 GiB on compute capability
    # 8+); a JAXJob at XLA_PYTHON_CLIENT_MEM_FRACTION 0.95 reads as much. A Job (PyTorch's
    # caching allocator grows to what it needs) at that level is still told.
    owners = {"GPU-tf": "TFJob", "GPU-jax": "JAXJob", "GPU-job": "Job"}
    found = run(list(owners), 81559 - 1536, days=1, owners=owners)
    assert found == Counter({("gpu_memory_high", "GPU-job"): 1})


def test_tensorflow_and_jax_under_another_owner_are_known_by_their_images() -> None:
    # The same pools under a plain Job: the pod's image says what framework holds them. A
    # PyTorch image at that level is still told.
    images = {"GPU-tf": "tensorflow/tensorflow:2.17.0-gpu",
              "GPU-jax": "ghcr.io/nvidia/jax:maxtext-2024-11-01",
              "GPU-job": "nvcr.io/nvidia/pytorch:24.05-py3"}
    found = run(list(images), 81559 - 1536, days=1, images=images)
    assert found == Counter({("gpu_memory_high", "GPU-job"): 1})


def test_tensorflow_or_jax_told_to_grow_are_judged_as_any_job() -> None:
    # TF_FORCE_GPU_ALLOW_GROWTH=true or XLA_PYTHON_CLIENT_PREALLOCATE=false in the spec (the
    # watcher's memory_grows): no pool, the memory in use is the job's, and a job at the edge
    # of it is told, whatever its owner or image. Before, the exemption hid it.
    owners = {"GPU-tf": "TFJob", "GPU-jax": "Job"}
    images = {"GPU-tf": "tensorflow/tensorflow:2.17.0-gpu",
              "GPU-jax": "ghcr.io/nvidia/jax:maxtext-2024-11-01"}
    found = run(list(owners), 81559 - 1536, days=1, owners=owners, images=images,
                grows=frozenset(owners))
    assert found == Counter({("gpu_memory_high", "GPU-tf"): 1, ("gpu_memory_high", "GPU-jax"): 1})


def test_servers_that_reserve_what_the_weights_leave_are_known_by_their_images() -> None:
    """TensorRT-LLM's KV cache takes 0.9 of what its engine leaves: an 8B FP16 model on a
    24 GiB L4 leaves about 0.5 GiB free; TensorFlow Serving maps all of an H100 but 1.5 GiB.
    Both read a flat, low free memory at every sample, healthy, and their images exempt
    them from the low-free rule. A vLLM server with 0.2 GiB free, out of the share it
    reserves, is still found; so is a TensorRT-LLM image of one's own name."""
    join = NodeJoin(RuleSettings(policy=load_policy(REPO / "deploy" / "base" / "policy.yaml")))
    state = NodeState()
    servers = {  # uuid -> (model, memory MiB, used MiB, image)
        "GPU-trt": ("NVIDIA L4", 23034, 23034 - 512,
                    "nvcr.io/nvidia/tritonserver:24.08-trtllm-python-py3"),
        "GPU-tgi": ("NVIDIA L4", 23034, 23034 - 400,
                    "ghcr.io/huggingface/text-generation-inference:2.4.0"),
        "GPU-tfs": ("NVIDIA H100 80GB HBM3", 81559, 81559 - 1536, "tensorflow/serving:2.17.0-gpu"),
        "GPU-own": ("NVIDIA L4", 23034, 23034 - 512, "registry.example.com/llm/trt-8b:3"),
        "GPU-vllm": ("NVIDIA H100 80GB HBM3", 81559, 81559 - 200, "vllm/vllm-openai:v0.6.3"),
    }
    out = []
    for uuid, (_, _, _, image) in servers.items():
        out += join.on_allocation(state, allocation(uuid, image=image))
    for i in range(240):  # two hours at 30 s
        devices = [DeviceSample(uuid=uuid, index=0, model=model, util_pct=40.0, temp_c=62.0,
                                mem_used_bytes=used * MIB, mem_total_bytes=total * MIB)
                   for uuid, (model, total, used, _) in servers.items()]
        out += join.on_sample(state, NodeSample(ts=T0 + i * STEP, node="n1", source="test",
                                                devices=devices))
    found = Counter((o.kind, o.subject.device) for o in out
                    if isinstance(o, Finding) and o.state == "firing")
    assert found == Counter({("gpu_memory_low_free", "GPU-own"): 1,
                             ("gpu_memory_low_free", "GPU-vllm"): 1})
