"""The MIG layout advice as a rule: its kind and settings, kept apart from the solver.

The fleet agent runs the advice (:mod:`.observed` and :mod:`.layout`, which
pull in numpy and scipy); the registry and the policy need only its name
and settings, so they live here and importing the registry stays cheap.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

KIND = "mig_layout_advice"


class MigAdviceSettings(BaseModel):
    """Settings of the fleet agent's periodic MIG layout advice."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(
        6 * 3600.0, gt=0,
        description="Event-time seconds between two advices (intervals aligned on the epoch). "
        "A relabel drains a node's MIG pods, so nobody acts on advice more often than a few "
        "times a day; the search costs up to seconds on a large fleet, paid once an interval.")
    window_s: float = Field(
        7 * 86400.0, gt=0,
        description="Trailing event-time window of queue demand the advice weighs, as the "
        "weekly report does: a workload's weight is the part of it spent pending or admitted.")
