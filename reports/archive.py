"""Every week's report kept in a folder named by ISO week; last week's read back.

``ARCHIVE/2026-W47/report.{html,md,json}`` and ``mig-parted.yaml``: a reader
finds any week by its name, and the next report compares with the JSON of the
week before it (:mod:`gpusteward.reports.trends`). Files are written as
:func:`gpusteward.reports.render.write` writes them (temporary name, then
rename), so a half-written week is never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpusteward.reports import compute


def folder(archive: Path, week: compute.Week) -> Path:
    return archive / week.label


def previous_week(week: compute.Week) -> compute.Week:
    return compute.week_of(week.start - 86400)


def previous(archive: Path | None, week: compute.Week) -> dict[str, Any] | None:
    """The JSON document of the week before ``week``, if it was kept."""
    if archive is None:
        return None
    path = folder(archive, previous_week(week)) / "report.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data
