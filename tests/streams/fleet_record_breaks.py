"""``gpusteward worker`` whose fleet agent breaks half-way through one queue event.

Run as a script by ``test_fleet_rollback.py``. ``FleetEvaluator.on_queue`` is wrapped:
on the workload named ``poison`` it applies the event (the fleet state changes) and then
raises, as a rule with a bug would part-way. The name of every workload it is given is
appended to the file named by ``FOLDED_LOG``, so the test sees which records were folded
again.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from gpusteward.cli import main
from gpusteward.streams.fleet import FleetEvaluator

POISON = "poison"
_on_queue = FleetEvaluator.on_queue


def on_queue(self: FleetEvaluator, state: Any, event: Any, *,
             queue_caught_up: bool = True) -> Any:
    with open(os.environ["FOLDED_LOG"], "a") as folded:
        folded.write(f"{event.name}\n")
    out = _on_queue(self, state, event, queue_caught_up=queue_caught_up)
    if event.name == POISON:
        raise RuntimeError("a fleet rule broke half-way")
    return out


if __name__ == "__main__":
    FleetEvaluator.on_queue = on_queue  # type: ignore[method-assign]
    sys.argv = ["gpusteward", "worker", *sys.argv[1:]]
    main()
