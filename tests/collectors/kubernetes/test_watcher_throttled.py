"""The watcher against a throttling API server: ``Retry-After`` on LIST pages and WATCH.

API Priority and Fairness answers 429 with ``Retry-After`` on a busy cluster; an
overloaded server or a proxy answers 5xx with one. client-go waits at least that
long before asking again, and asks for the same LIST page again rather than the
whole list. These tests hold the watcher to it against the API-server double,
through the official client, with the watcher's own back-off far shorter than
the server's ask (0.05 s against 1 s), so a retry on the watcher's own schedule
shows as a gap shorter than the server asked for.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any

import pytest

from gpusteward.collectors.kubernetes import KubeWatchSettings
from gpusteward.collectors.kubernetes.reflector import Reflector, node_key
from gpusteward.sandbox.kube_api import KubeApiServer, RecordedRequest
from gpusteward.sandbox.kube_objects import gpu_node

from .conftest import WatcherFactory, wait_until
from .test_watcher import _Response, brief

RETRY_AFTER_S = 1
THROTTLED = 4
"""Refusals in a row: more than urllib3's three in-request retries, which heeded
``Retry-After`` for a 429 before the reflector saw it (uncapped, deaf to a stop)."""


def gaps(requests: list[RecordedRequest]) -> list[float]:
    return [later.at - earlier.at for earlier, later in itertools.pairwise(requests)]


def test_a_throttled_list_page_is_asked_again_after_retry_after(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    for i in range(3):
        kube_api.create(gpu_node(f"n{i}"))
    # The second page of the first list (page size 1) is refused THROTTLED times.
    kube_api.fail("GET", THROTTLED, status=429, path="/api/v1/nodes$", query="continue=",
                  retry_after=RETRY_AFTER_S)
    watcher = start_watcher(resources=["nodes"], page_size=1)

    lists = [r for r in kube_api.requests if r.path == "/api/v1/nodes"
             and not r.query.get("watch")]
    refused = [r for r in lists if r.status == 429]
    assert len(refused) == THROTTLED
    retried = lists[lists.index(refused[0]):lists.index(refused[-1]) + 2]
    # Each ask waited at least what the server asked for (less the jitter of its clock).
    assert min(gaps(retried)) >= RETRY_AFTER_S * 0.9, gaps(retried)
    # The same page each time: the list was not started over from its first page.
    assert {r.query.get("continue") for r in retried} == {refused[0].query["continue"]}
    assert len(lists) == 3 + THROTTLED
    assert watcher.watcher.reflectors["nodes"].stats.lists == 1
    assert sorted(brief(e) for e in watcher.events) == [
        ("node", f"n{i}", False, None, False) for i in range(3)]


@pytest.mark.parametrize("status", [429, 503])
def test_a_throttled_watch_waits_retry_after_between_attempts(
        kube_api: KubeApiServer, start_watcher: WatcherFactory, status: int) -> None:
    kube_api.create(gpu_node("n1"))
    watcher = start_watcher(resources=["nodes"], backoff_initial_s=0.05, backoff_max_s=0.2)
    kube_api.fail("GET", THROTTLED, status=status, path="/api/v1/nodes$", query="watch=",
                  retry_after=RETRY_AFTER_S)
    kube_api.drop_watches()
    kube_api.patch("Node", "n1", {"spec": {"unschedulable": True}})

    assert [brief(e) for e in watcher.new_events(1, timeout=30)] == [
        ("node", "n1", True, None, False)]
    watches = [r for r in kube_api.requests if r.path == "/api/v1/nodes"
               and r.query.get("watch")]
    refused = [r for r in watches if r.status == status]
    assert len(refused) == THROTTLED
    retried = watches[watches.index(refused[0]):watches.index(refused[-1]) + 2]
    assert min(gaps(retried)) >= RETRY_AFTER_S * 0.9, gaps(retried)
    # Resumed from where it was: a throttled watch is no reason to relist.
    assert watcher.watcher.reflectors["nodes"].stats.lists == 1


def test_a_retry_after_beyond_the_cap_waits_the_cap(
        kube_api: KubeApiServer, start_watcher: WatcherFactory) -> None:
    """A server (or a proxy) asking for an hour does not leave the watcher blind for one."""
    kube_api.create(gpu_node("n1"))
    watcher = start_watcher(resources=["nodes"], retry_after_max_s=0.3)
    kube_api.fail("GET", 1, status=429, path="/api/v1/nodes$", query="watch=",
                  retry_after=3600)
    kube_api.drop_watches()
    asked = time.monotonic()
    kube_api.patch("Node", "n1", {"spec": {"unschedulable": True}})
    wait_until(lambda: len(watcher.events) > 1, 5, "the watch to resume after the cap")
    assert time.monotonic() - asked < 5
    assert [brief(e) for e in watcher.events[1:]] == [("node", "n1", True, None, False)]


def test_a_watch_error_event_asking_to_wait_is_waited_for() -> None:
    """A watch may also end with an ERROR event whose Status asks for a wait
    (``details.retryAfterSeconds``, as API Priority and Fairness writes it)."""
    page = json.dumps({"metadata": {"resourceVersion": "5"}, "items": []}).encode()
    error = json.dumps({"type": "ERROR", "object": {
        "kind": "Status", "code": 429, "reason": "TooManyRequests", "message": "throttled",
        "details": {"retryAfterSeconds": 2}}}).encode() + b"\n"
    stop = threading.Event()
    pauses: list[float] = []

    def list_call(**kwargs: Any) -> _Response:
        return _Response(error if kwargs.get("watch") else page)

    def sleep(seconds: float) -> bool:
        pauses.append(seconds)
        stop.set()
        return True

    settings = KubeWatchSettings(backoff_initial_s=0.05, backoff_max_s=0.2)
    Reflector("nodes", list_call, lambda deltas: None, settings, stop, key_of=node_key,
              sleep=sleep).run()
    assert pauses == [2.0]
