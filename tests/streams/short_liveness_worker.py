"""``gpusteward worker`` that counts itself wedged after ``STALE_AFTER_S`` without a beat.

Run as a script by ``test_recovery_liveness.py``: the shipped 30 s threshold would make
a test of a recovery longer than it take minutes; a short one shows the same thing with
a changelog that replays in seconds.
"""

from __future__ import annotations

import sys
from typing import Any

from gpusteward.cli import main
from gpusteward.streams import app as worker_app

STALE_AFTER_S = 2.0
"""Twice the heartbeat's interval (:func:`gpusteward.health.heartbeat`)."""

_create_app = worker_app.create_app


def create_app(*args: Any, **kwargs: Any) -> worker_app.WorkerApp:
    app = _create_app(*args, **kwargs)
    app.health.stale_after_s = STALE_AFTER_S
    return app


if __name__ == "__main__":
    worker_app.create_app = create_app
    sys.argv = ["gpusteward", "worker", *sys.argv[1:]]
    main()
