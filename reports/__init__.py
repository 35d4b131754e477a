"""The weekly right-sizing report: rollups in Parquet in, HTML, Markdown and JSON out.

:mod:`aggregate` folds samples into per-device per-minute rollups offline,
with the stream worker's fold (:mod:`gpusteward.rules.rollup`); :mod:`store`
writes and reads them as Parquet, one folder per day; :mod:`compute` defines
the report's numbers per row with polars and :mod:`weekly` folds the week into
them a few hours of rows at a time, so memory follows devices and workloads,
not rows; :mod:`recommend` sizes each workload (krr-style percentile plus
headroom) and derives the MIG demand; :mod:`build` assembles one week's report;
:mod:`render` and :mod:`charts` write it as HTML with inline SVG, Markdown and
JSON; :mod:`sink` writes the rollup and queue topics into the store. The
``report`` and ``sink`` commands live in :mod:`gpusteward.cli.report`.
"""
