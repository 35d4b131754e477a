"""Value types the rules' settings models share, checked when the policy is loaded.

A setting a rule only interprets at run time (a workload kind it compares pods against)
is checked by its type instead, so a bad value is a ``FILE:LINE: field`` error from
``gpusteward rules check`` and the worker's start rather than a rule that silently
matches nothing.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from gpusteward.schema import WORKLOAD_KINDS


def _known_workload_kind(name: str) -> str:
    if name not in WORKLOAD_KINDS:
        raise ValueError(f"unknown workload kind {name!r}; valid kinds: "
                         f"{', '.join(WORKLOAD_KINDS)}")
    return name


WorkloadKind = Annotated[str, AfterValidator(_known_workload_kind)]
"""A workload kind the watcher can give a pod (:data:`gpusteward.schema.WORKLOAD_KINDS`):
the label ``gpusteward.io/workload-kind`` takes no other value, so no custom kind can
reach a rule."""
