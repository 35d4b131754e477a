"""The rollup store's cost at 10,000 GPUs: the sink's write rate, bytes per GPU-week, retention.

Rate: the first minutes of the synthetic 10,000-GPU week (``MINUTES`` x 10,000
rollups) are published to ``rollups.v1`` on the embedded broker; then one
:class:`~gpusteward.reports.sink.RollupSink` (what ``gpusteward sink rollups``
runs) starts with the default settings and drains them: decoding and checking
each record at the edge, skipping repeats, counting GPU-seconds, writing
Parquet and applying retention. The rate is rows written per second of wall
time and per second of this process's CPU, from the first record taken to the
last row written (the sink is stopped once it has taken every record, so it
writes the rest at once, as on shutdown, instead of after its 300 s flush
interval), against the fleet's own rate (10,000 rows a minute). The
broker runs in its own process; its CPU is not counted. A bare consumer's
read rate of the same topic shows how much of the wall time is the broker's,
and the sink's own steps on the same records, without a consumer, its CPU floor.

Size: the bytes of the files the sink wrote per row, times the 10,080 rows of
a GPU-week, and the disk the store needs at the default retention.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from figures import Figure

from gpusteward import kafka, topics
from gpusteward.broker import EmbeddedBroker
from gpusteward.reports import compute, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.reports.sink import rollup_sink
from gpusteward.sandbox import rollups as synthetic
from gpusteward.schema import Rollup
from gpusteward.settings import Settings

GPUS = 10_000
MINUTES = 15
FLEET = f"{GPUS:,} GPUs"


def _rollups() -> list[bytes]:
    """The week's first ``MINUTES`` minutes of rollups, encoded as the worker publishes them."""
    week = compute.parse_week("2026-W47")
    frame = synthetic.week_of_rollups(week.start, gpus=GPUS, workloads=GPUS // 2, teams=12,
                                      minutes=MINUTES, seed=1)
    encode = msgspec.json.Encoder().encode
    return [encode(msgspec.convert(row, Rollup)) for row in frame.iter_rows(named=True)]


async def _drain(settings: Settings, directory: Path) -> list[Figure]:
    records = _rollups()
    await kafka.ensure_topics(settings)
    producer = kafka.producer(settings)
    await producer.start()
    topic = topics.ROLLUPS.name(settings)
    for index, record in enumerate(records):
        await producer.send(topic, record, key=str(index // 8).encode())
    await producer.flush()
    await producer.stop()

    read_rate = await _read_rate(settings, topic, len(records))
    own = await asyncio.to_thread(_own_work, settings, records, directory.parent / "own")
    report = ReportSettings()
    sink = rollup_sink(settings, report, directory=directory)
    stop = asyncio.Event()
    task = asyncio.create_task(sink.run(stop))
    await _until(lambda: sink.rows_written + len(sink.buffer) > 0)
    began, cpu = time.perf_counter(), time.process_time()
    # Once every record is taken, stop: the sink writes what it still buffers and
    # commits, as on shutdown. Waiting instead for the last file to be written by
    # itself would time the flush interval (300 s), not the sink.
    await _until(lambda: sink.rows_written + len(sink.buffer) + sink.duplicates
                 >= len(records))
    stop.set()
    await asyncio.wait_for(task, 120)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    assert sink.rows_written == len(records), (sink.rows_written, sink.duplicates)
    size = await asyncio.to_thread(_bytes, directory)
    per_week = size / len(records) * 7 * 1440
    rows = len(records)
    real_time = GPUS / 60
    return [
        Figure(f"sink rollups, one process: rows written ({FLEET} x {MINUTES} min)", rows,
               "rows"),
        Figure(f"sink rollups, one process: write rate ({FLEET})", rows / seconds, "rows/s"),
        Figure(f"sink rollups, one process: write rate per CPU-second ({FLEET})", rows / cpu,
               "rows/s"),
        Figure(f"sink rollups, one process: CPU per row ({FLEET})", cpu / rows * 1e6, "µs"),
        Figure(f"sink rollups, one process: speed against real time ({FLEET})",
               rows / seconds / real_time, "x"),
        Figure(f"sink's own work per row: decode, repeats, frame, Parquet, GPU-time ({FLEET})",
               own * 1e6, "µs"),
        Figure(f"plain consumer read rate of the same topic, no sink ({FLEET})", read_rate,
               "rows/s"),
        Figure(f"sink-written store per GPU-week ({sink.files_written} files)", per_week / 1e3,
               "kB"),
        Figure(f"store on disk at {report.retention_days} days retention ({FLEET})",
               per_week * GPUS * report.retention_days / 7 / 1e9, "GB"),
    ]


async def _until(done: Callable[[], bool], timeout_s: float = 1800.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the sink did not get there")


def _own_work(settings: Settings, records: list[bytes], directory: Path) -> float:
    """Seconds per row of the sink's own steps on ``records``, without the consumer."""
    sink = rollup_sink(settings, ReportSettings(), directory=directory)
    began = time.process_time()
    rows = [sink._decode(record, b"n") for record in records]
    for row in rows:
        sink._take(row)
    store.write(directory, store.frame(sink.buffer))
    sink._count_gpu_time(sink.buffer)
    return (time.process_time() - began) / len(records)


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*.parquet"))


async def _read_rate(settings: Settings, topic: str, count: int) -> float:
    """Records per second a bare consumer fetches from the broker: the sink's ceiling here."""
    reader = kafka.consumer(settings, topic, group_id="bench-sink-reader")
    await reader.start()
    try:
        seen = 0
        while seen == 0:
            seen += sum(len(m) for m in (await reader.getmany(timeout_ms=200)).values())
        began = time.perf_counter()
        while seen < count:
            seen += sum(len(m) for m in (await reader.getmany(timeout_ms=200)).values())
        return (count - 1) / (time.perf_counter() - began)
    finally:
        await reader.stop()


def run() -> list[Figure]:
    folder = Path(tempfile.mkdtemp(prefix="bench-sink-"))
    with EmbeddedBroker(log_path=folder / "broker.log") as broker:
        settings = broker.settings().model_copy(update={"topic_prefix": "bench-sink"})
        figures = asyncio.run(_drain(settings, folder / "rollups"))
    assert store.files(folder / "rollups", 0, 2e9), "the sink wrote no file"
    return figures
