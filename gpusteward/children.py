"""Child processes that never outlive their parent.

The embedded broker and the stream worker run in their own sessions, so a
Ctrl-C in the terminal reaches only the parent, which stops its clients
first and then the children. If the parent dies without that chance
(SIGKILL, a crash), Linux's parent-death signal stops them too, so nothing
is left running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for Popen: SIGTERM this child when its parent exits (Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_child(process: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """SIGTERM a child started in its own session; SIGKILL its group if it lingers."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
