"""The weekly right-sizing report: rollups in Parquet in, HTML, Markdown and JSON out.

:mod:`store` writes and reads the per-device per-minute rollups (Parquet,
one folder per day); :mod:`compute` turns a week of them into the report's
numbers with polars; :mod:`recommend` sizes each workload (krr-style
percentile plus headroom); :mod:`render` writes the three formats with
inline SVG charts; :mod:`commands` holds the ``report`` and ``replay`` CLI
commands.
"""
