"""``gpusteward act``, made to die right after it changed the cluster and before it audited it.

Run as a script by the executor experiment of ``test_chaos.py``. Every verb of the
Kubernetes backend is wrapped: after the ``GPUSTEWARD_CHAOS_DIE_AFTER``-th call that
returns, the process ends at once (``os._exit``, as a SIGKILL would: no flush, no commit),
so the last action's effect is in the cluster and its audit record is nowhere.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from gpusteward.cli import main
from gpusteward.remediation.kubernetes import KubernetesBackend

KILLED = 9
VERBS = ("notify_owner", "cordon", "taint", "drain", "requeue", "set_mig_config")


def _dying(verb: str, after: int, calls: list[int]) -> Any:
    carry_out = getattr(KubernetesBackend, verb)

    async def then_die(self: KubernetesBackend, action: Any) -> Any:
        outcome = await carry_out(self, action)
        calls.append(1)
        if len(calls) >= after:
            os._exit(KILLED)
        return outcome
    return then_die


if __name__ == "__main__":
    calls: list[int] = []
    after = int(os.environ["GPUSTEWARD_CHAOS_DIE_AFTER"])
    for verb in VERBS:
        setattr(KubernetesBackend, verb, _dying(verb, after, calls))
    sys.argv = ["gpusteward", "act", *sys.argv[1:]]
    main()
