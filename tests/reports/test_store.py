"""The Parquet store: day folders, atomic files, retention, de-duplication."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from gpusteward.reports import store
from gpusteward.schema import Rollup

MIDNIGHT = 1_763_337_600.0  # 2025-11-17 00:00 UTC


def rollup(ts: float, uuid: str = "GPU-1", util: float = 10.0) -> Rollup:
    return Rollup(ts=ts, node="n1", uuid=uuid, model="m", samples=1, util_mean=util)


def test_rows_land_in_their_day_folder_with_no_temporary_left(tmp_path: Path) -> None:
    rows = [rollup(MIDNIGHT - 60), rollup(MIDNIGHT), rollup(MIDNIGHT + 60, "GPU-2")]
    written = store.write(tmp_path, store.frame(rows))
    assert sorted(p.parent.name for p in written) == ["day=2025-11-16", "day=2025-11-17"]
    assert not [p for p in tmp_path.rglob(".*")]
    back = pl.read_parquet(written).sort("ts")
    assert back["ts"].to_list() == [MIDNIGHT - 60, MIDNIGHT, MIDNIGHT + 60]
    assert back.schema == pl.Schema(store.STORED)


def test_scan_ignores_partial_files_and_drops_redelivered_rows(tmp_path: Path) -> None:
    store.write(tmp_path, store.frame([rollup(MIDNIGHT), rollup(MIDNIGHT + 60)]))
    store.write(tmp_path, store.frame([rollup(MIDNIGHT + 60), rollup(MIDNIGHT + 120)]))
    # A writer that died mid-file leaves only a dot-named temporary behind.
    (tmp_path / "day=2025-11-17" / ".part-x.parquet.tmp").write_bytes(b"PAR1 half a file")
    frame = store.scan(tmp_path, MIDNIGHT, MIDNIGHT + 86400).collect().sort("ts")
    assert frame["ts"].to_list() == [MIDNIGHT, MIDNIGHT + 60, MIDNIGHT + 120]
    narrow = store.scan(tmp_path, MIDNIGHT + 60, MIDNIGHT + 120, ["util_mean"]).collect()
    assert narrow.columns == ["ts", "uuid", "util_mean"] and narrow.height == 1


def test_retention_removes_whole_old_days(tmp_path: Path) -> None:
    for day in range(5):
        store.write(tmp_path, store.frame([rollup(MIDNIGHT + day * 86400)]))
    (tmp_path / "notes").mkdir()
    removed = store.apply_retention(tmp_path, keep_days=2, now=MIDNIGHT + 4 * 86400 + 5)
    assert [p.name for p in removed] == ["day=2025-11-17", "day=2025-11-18", "day=2025-11-19"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day=2025-11-20", "day=2025-11-21",
                                                         "notes"]


def test_empty_store_scans_to_an_empty_frame(tmp_path: Path) -> None:
    assert store.scan(tmp_path, MIDNIGHT, MIDNIGHT + 60).collect().height == 0
    assert store.write(tmp_path, store.frame([])) == []


def test_a_store_written_before_rows_named_a_node_s_clock_reads_as_its_first_clock(
        tmp_path: Path) -> None:
    """Files without the ``clock`` column (written before it was added) are read, their
    rows on clock 0: a redelivered copy written since is still dropped, a minute named
    again on a node's new clock is kept, by the report's reader as by :func:`store.scan`."""
    before = {c: t for c, t in store.STORED.items() if c != "clock"}
    store.write(tmp_path, store.frame([rollup(MIDNIGHT), rollup(MIDNIGHT + 60)]), before)
    again = Rollup(ts=MIDNIGHT + 60, node="n1", uuid="GPU-1", model="m", samples=1,
                   util_mean=90.0, clock=1)
    store.write(tmp_path, store.frame([rollup(MIDNIGHT + 60), again]))
    frame = store.scan(tmp_path, MIDNIGHT, MIDNIGHT + 86400).collect().sort("ts", "clock")
    assert frame.select("ts", "clock", "util_mean").rows() == [
        (MIDNIGHT, 0, 10.0), (MIDNIGHT + 60, 0, 10.0), (MIDNIGHT + 60, 1, 90.0)]
    (day,) = store.slices(tmp_path, MIDNIGHT, MIDNIGHT + 86400, ["util_mean", "clock"])
    assert sorted(day.select("ts", "clock").rows()) == [
        (MIDNIGHT, 0), (MIDNIGHT + 60, 0), (MIDNIGHT + 60, 1)]
