"""How long one dcgm-exporter page takes to become a NodeSample, and what the buffer costs.

Figures: the shared fixture page (one node, two H100s, one of them as two
MIG instances: 3 devices, 61 series), a synthetic 8-GPU page made from the
fixture's whole-GPU series, and the on-disk buffer's cost per record
(append + acknowledge, sqlite in a temporary directory).
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from figures import Figure

from gpusteward.collectors import dcgm
from gpusteward.collectors.transport.spool import DiskSpool

PAGE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "dcgm_exporter_metrics.txt"


def _median_ms(work: Callable[[], object], repeat: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def eight_gpu_page(page: str) -> str:
    """Eight whole GPUs: the fixture's GPU 0 series repeated with new indices and UUIDs."""
    out: list[str] = []
    for line in page.splitlines():
        if line.startswith("#") or 'gpu="0"' not in line:
            if line.startswith("# HELP") or line.startswith("# TYPE"):
                out.append(line)
            continue
        for index in range(8):
            out.append(re.sub(r'GPU-3f2a9c4e-8b71-4d2e-9a65-1c7e0b5d2f1\d',
                              f"GPU-3f2a9c4e-8b71-4d2e-9a65-1c7e0b5d2f{index:02d}",
                              line.replace('gpu="0"', f'gpu="{index}"')))
    return "\n".join(out) + "\n"


def _to_sample(text: str) -> object:
    return dcgm.node_samples(dcgm.parse_page(text), 0.0, "dcgm", node="bench")["bench"]


def run() -> list[Figure]:
    page = PAGE.read_text()
    eight = eight_gpu_page(page)
    assert len(_to_sample(eight).devices) == 8  # type: ignore[attr-defined]
    figures = [
        Figure("fixture page (3 devices, 61 series) -> NodeSample", _median_ms(
            lambda: _to_sample(page), 200), "ms"),
        Figure("  of which prometheus_client text parsing", _median_ms(
            lambda: dcgm.parse_page(page), 200), "ms"),
        Figure("8-GPU page (200 series) -> NodeSample", _median_ms(
            lambda: _to_sample(eight), 100), "ms"),
    ]
    with tempfile.TemporaryDirectory() as directory:
        spool = DiskSpool(Path(directory), max_bytes=1 << 30)
        value = b"x" * 3500  # about one 8-GPU NodeSample as JSON
        count = 2000
        started = time.perf_counter()
        for _ in range(count):
            seq, _dropped = spool.append("samples", b"node", value)
            spool.ack(seq)
        figures.append(Figure("disk buffer append + ack, 3.5 kB record",
                              (time.perf_counter() - started) / count * 1e6, "us"))
        spool.close()
    return figures
