"""``gpusteward worker``, made to die in the window between a finding and its state.

Run as a script by ``test_emit_order.py``. The changelog writes that record a
finding as reported are watched: a node state with an open XID episode (the node
join) and a fleet state with an open queue-wait breach (the fleet agent). When one
is issued, the script checks that the finding is already on the findings topic, and
exits with ``WRITTEN_FIRST`` if it is not (the order that lost findings). Otherwise
it lets the changelog record land and then dies at once with ``KILLED_BETWEEN``: a
SIGKILL between the two writes, at the one moment it matters.

The fleet agent's state is three tables: the fleet state, the latest summary per
node and the MIG workloads. A node summary written while no finding was on the
topic, as new as the summary the reporting fleet state is at, is the summary that
fired the finding written ahead of it: ``SUMMARIES_AHEAD`` (a worker killed there
re-processed the fleet against summaries from its future).
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
from gpusteward.schema import NodeSummary
from gpusteward.settings import Settings
from gpusteward.streams.fleet import FleetState
from gpusteward.streams.node import NodeState

WRITTEN_FIRST = 3
SUMMARIES_AHEAD = 4
KILLED_BETWEEN = 9

_node_state = msgspec.msgpack.Decoder(NodeState).decode
_fleet_state = msgspec.msgpack.Decoder(FleetState).decode
_summary = msgspec.json.Decoder(NodeSummary).decode
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


_summaries_ahead: list[float] = []
"""Times of the node summaries written to the fleet's table while no finding was on the topic."""
_finding_delivered = False


def _note_summary(value: Any) -> None:
    """Remember a summary written before any finding was delivered (the topic is read only
    until the first one is there)."""
    global _finding_delivered
    if not isinstance(value, bytes) or _finding_delivered:
        return
    if _findings_on_topic() > 0:
        _finding_delivered = True
    else:
        _summaries_ahead.append(_summary(value).ts)


def _ahead_of(value: bytes) -> bool:
    """Whether the summary the fleet state ``value`` is at was written before its finding."""
    clock = _fleet_state(value).summary_clock
    return clock is not None and any(ts >= clock for ts in _summaries_ahead)


def _reports_xid(value: Any) -> bool:
    return isinstance(value, bytes) and any(
        dev.hw.xid.open for dev in _node_state(value).devices.values())


def _reports_wait_breach(value: Any) -> bool:
    return isinstance(value, bytes) and any(
        waiting.open_id is not None for waiting in _fleet_state(value).queue.waiting.values())


_REPORTS = {"node-state": _reports_xid, "fleet-state": _reports_wait_breach}
"""Per table, whether a state value records a finding as reported."""


def send_changelog(self: Any, partition: Any, key: Any, value: Any, *args: Any,
                   **kwargs: Any) -> Any:
    if self.name == "fleet-nodes":
        _note_summary(value)
    reports = _REPORTS.get(self.name)
    if reports is not None and reports(value):
        if _findings_on_topic() == 0:
            os._exit(WRITTEN_FIRST)
        if self.name == "fleet-state" and _ahead_of(value):
            os._exit(SUMMARIES_AHEAD)
        landed = _send_changelog(self, partition, key, value, *args, **kwargs)
        landed.add_done_callback(lambda _: os._exit(KILLED_BETWEEN))
        return landed
    return _send_changelog(self, partition, key, value, *args, **kwargs)


if __name__ == "__main__":
    Collection.send_changelog = send_changelog  # type: ignore[method-assign]
    sys.argv = ["gpusteward", "worker", *sys.argv[1:]]
    main()
