"""NVML collector sampling cost per GPU per tick, on the fake NVML.

Two nodes: eight whole H100s (NVLink, every reading supported) and eight
H100s each split into seven 1g.10gb MIG devices (GPM engine activity read
per MIG device); and a third node of eight H100s each time-sliced between four
pods, read with per-process attribution (compute processes, per-process
utilisation, and each PID's cgroup under a fake host /proc in a temporary
directory). The figures are the collector's own cost (Python, struct
handling, event bookkeeping) plus the fake's; on a real node each NVML call
adds the driver's time, so the NVML-calls-per-GPU figure says how that cost
scales. Besides wall time per GPU, the whole node's tick is given in process
CPU time, which other work on a shared machine inflates far less.

Where NVML answers (a GPU node), the same figures are also taken on the real
driver and its GPUs as they are, so the driver's own time per call shows.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
from figures import Figure

from gpusteward.collectors.nvml import NvmlCollector
from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent

GPUS = 8
PODS_PER_GPU = 4
TICKS = 200
ROUNDS = 5


class _Discard:
    async def sample(self, sample: NodeSample) -> None: ...
    async def hw_event(self, event: HwEvent) -> None: ...
    async def allocation(self, event: AllocationEvent) -> None: ...
    async def queue(self, event: QueueEvent) -> None: ...
    async def flush(self) -> None: ...


def _whole_node() -> dict[str, Any]:
    return {"gpus": [{
        "uuid": f"GPU-00000000-0000-4000-8000-{i:012d}", "name": "NVIDIA H100 80GB HBM3",
        "util_gpu": 50, "mem_used": "40 GiB", "nvlink": {"crc_flit": 1}, "gpm": True,
    } for i in range(GPUS)]}


def _mig_node() -> dict[str, Any]:
    return {"gpus": [{
        "uuid": f"GPU-00000000-0000-4000-8000-{i:012d}", "name": "NVIDIA H100 80GB HBM3",
        "nvlink": {"crc_flit": 1}, "gpm": True,
        "mig": {"enabled": True, "devices": [{
            "uuid": f"MIG-00000000-0000-4000-8000-{i:06d}{j:06d}", "profile": "1g.10gb",
            "profile_id": 19, "gpu_instance_id": 7 + j, "mem_total": "9.75 GiB",
            "engine_active": 10.0 * j,
        } for j in range(7)]},
    } for i in range(GPUS)]}


def _shared_node(proc_root: Path) -> dict[str, Any]:
    """Eight H100s, four pods each (one process per pod), and their cgroups under
    ``proc_root`` in the containerd/systemd/cgroup v2 form."""
    gpus = []
    for i in range(GPUS):
        processes = []
        for j in range(PODS_PER_GPU):
            pid = 10_000 + i * PODS_PER_GPU + j
            uid = f"00000000-0000-4000-8000-{i:06d}{j:06d}"
            (proc_root / str(pid)).mkdir(parents=True)
            (proc_root / str(pid) / "cgroup").write_text(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                f"{uid.replace('-', '_')}.slice/cri-containerd-{pid:064d}.scope\n")
            processes.append({"pid": pid, "mem_used": "10 GiB", "sm_util": 10 * j})
        gpus.append({"uuid": f"GPU-00000000-0000-4000-8000-{i:012d}",
                     "name": "NVIDIA H100 80GB HBM3", "util_gpu": 50, "mem_used": "40 GiB",
                     "nvlink": {"crc_flit": 1}, "processes": processes})
    return {"gpus": gpus}


class _CountedNvml:
    """The real pynvml module, counting the NVML calls made through it."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if not (callable(value) and name.startswith("nvml")):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return value(*args, **kwargs)
        return counted


def _measure(nvml: FakeNvml | _CountedNvml, proc_root: str | None = None
             ) -> tuple[float, float, float, float]:
    """(µs per GPU for the reading pass, NVML calls per GPU, µs per GPU for a whole tick,
    CPU µs per node for a whole tick)."""
    collector = NvmlCollector(nvml, "bench", _Discard(), proc_root=proc_root)
    collector.open()
    gpus = len(collector.reader.gpus)
    for _ in range(5):  # warm caches: MIG descriptions, GPM buffers
        collector.reader.read()
    calls_before = nvml.calls
    collector.reader.read()
    calls = nvml.calls - calls_before
    # Median of a few rounds: the machine is shared and single rounds swing by 2x.
    read_s = statistics.median(_timed(collector.reader.read) for _ in range(ROUNDS))

    async def ticks() -> tuple[float, float]:
        rounds, cpu = [], []
        for _ in range(ROUNDS):
            begin, begin_cpu = time.perf_counter(), time.process_time()
            for _ in range(TICKS):
                await collector.tick()
            rounds.append((time.perf_counter() - begin) / TICKS)
            cpu.append((time.process_time() - begin_cpu) / TICKS)
        return statistics.median(rounds), statistics.median(cpu)

    tick_s, tick_cpu_s = asyncio.run(ticks())
    collector.close()
    return read_s / gpus * 1e6, calls / gpus, tick_s / gpus * 1e6, tick_cpu_s * 1e6


def _timed(read: Callable[[], object]) -> float:
    begin = time.perf_counter()
    for _ in range(TICKS):
        read()
    return (time.perf_counter() - begin) / TICKS


def _real_driver() -> list[tuple[str, _CountedNvml, str | None]]:
    """The real driver, labelled with its GPUs, where NVML answers; else nothing."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = {pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(count)}
    finally:
        pynvml.nvmlShutdown()
    if not count:
        return []
    label = f"{count}x {', '.join(sorted(map(str, names)))}, real driver"
    return [(label, _CountedNvml(), None), (f"{label}, per-process", _CountedNvml(), "/proc")]


def run() -> list[Figure]:
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="bench-proc-") as proc:
        shared = _shared_node(Path(proc))
        nodes: list[tuple[str, FakeNvml | _CountedNvml, str | None]] = [
            ("8x H100", FakeNvml(_whole_node()), None),
            ("8x H100, 7 MIG each", FakeNvml(_mig_node()), None),
            (f"8x H100, {PODS_PER_GPU} pods each, per-process", FakeNvml(shared), proc),
            *_real_driver()]
        for label, nvml, proc_root in nodes:
            read_us, calls, tick_us, tick_cpu_us = _measure(nvml, proc_root)
            figures += [
                Figure(f"read, {label}", read_us, "µs per GPU per tick"),
                Figure(f"tick incl. publish, {label}", tick_us, "µs per GPU per tick"),
                Figure(f"tick CPU, {label}", tick_cpu_us, "CPU µs per node per tick"),
                Figure(f"NVML calls, {label}", calls, "calls per GPU per tick"),
            ]
    return figures
