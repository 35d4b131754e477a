"""``gpusteward worker``, made to die in the window between a finding and its state.

Run as a script by ``test_emit_order.py``. The node-state changelog write that
records an open XID episode (the state that says "this finding was reported") is
watched. When it is issued, the script checks that the finding is already on the
findings topic, and exits with ``WRITTEN_FIRST`` if it is not (the order that lost
findings). Otherwise it lets the changelog record land and then dies at once with
``KILLED_BETWEEN``: a SIGKILL between the two writes, at the one moment it matters.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Any

import msgspec
from faust.tables.base import Collection

from gpusteward import kafka, topics
from gpusteward.cli import main
from gpusteward.settings import Settings
from gpusteward.streams.node import NodeState

WRITTEN_FIRST = 3
KILLED_BETWEEN = 9

_decode = msgspec.msgpack.Decoder(NodeState).decode
_send_changelog = Collection.send_changelog


def _findings_on_topic() -> int:
    """The findings topic's record count, read on a thread (the hook runs inside the loop)."""
    settings = Settings()
    counted: list[int] = []
    reader = threading.Thread(target=lambda: counted.append(len(asyncio.run(
        kafka.read_all(settings, topics.FINDINGS.name(settings))))))
    reader.start()
    reader.join()
    return counted[0]


def _reports_xid(value: Any) -> bool:
    return isinstance(value, bytes) and any(
        dev.hw.xid.open for dev in _decode(value).devices.values())


def send_changelog(self: Any, partition: Any, key: Any, value: Any, *args: Any,
                   **kwargs: Any) -> Any:
    if self.name == "node-state" and _reports_xid(value):
        if _findings_on_topic() == 0:
            os._exit(WRITTEN_FIRST)
        landed = _send_changelog(self, partition, key, value, *args, **kwargs)
        landed.add_done_callback(lambda _: os._exit(KILLED_BETWEEN))
        return landed
    return _send_changelog(self, partition, key, value, *args, **kwargs)


if __name__ == "__main__":
    Collection.send_changelog = send_changelog  # type: ignore[method-assign]
    sys.argv = ["gpusteward", "worker", *sys.argv[1:]]
    main()
