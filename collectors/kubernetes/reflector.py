"""List+watch of one Kubernetes resource, with the semantics of client-go's reflector.

One :class:`Reflector` per resource runs in its own thread, because the
official ``kubernetes`` client is synchronous: a paged list, then a watch
from the list's resourceVersion with bookmarks; a broken stream resumes from
the last resourceVersion seen; 410 Gone (as an HTTP status or as an
``ERROR`` event) and every ``resync_period_s`` start a relist that is diffed
against what was already delivered, so deletions missed while disconnected
come out as deletions and unchanged objects come out not at all. It
remembers the resourceVersion delivered per object and never delivers the
same one twice. Errors back off exponentially, with jitter, up to a cap; so
does a watch that ends at once without an event. An answer with ``Retry-After``
(a 429 of API Priority and Fairness, a 5xx of an overloaded server; for a watch
also an ``ERROR`` event's ``retryAfterSeconds``) waits at least that long, capped
by ``retry_after_max_s``, as client-go's rest client does, and a LIST page
refused so is asked again with the same continue token rather than starting the
list over, which would ask a throttled server for every page again. It
reads raw JSON (``_preload_content=False``): the client's model classes cost
milliseconds per pod, which a 10,000-pod relist cannot afford.

The reflector knows nothing of GPUs: it hands :class:`Delta` lists to a
``deliver`` callback (the watcher's, which hops them onto the event loop).
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from gpusteward import edge
from gpusteward.collectors.kubernetes.settings import KubeWatchSettings
from gpusteward.collectors.metrics import WatcherMetrics
from gpusteward.errors import TemporaryError, cut, retry_after

log = logging.getLogger(__name__)

Obj = dict[str, Any]
"""A Kubernetes object as decoded JSON."""


@dataclass(frozen=True)
class Delta:
    """One change of one object, as the reflector delivers it."""

    resource: str
    type: Literal["ADDED", "MODIFIED", "DELETED"]
    key: str
    obj: Obj | None
    """The object; None for a deletion found by a relist (the object is gone)."""


class Gone(TemporaryError):
    """The resourceVersion is too old (410): relist."""


class WatchError(TemporaryError):
    """The server ended a watch with an error other than 410."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """The ``retryAfterSeconds`` of the ERROR event's Status; None when it gave none."""


THROTTLE_RETRIES = 10
"""Times one LIST page is asked again after answers with ``Retry-After`` before the error
is the relist's (which then backs off and starts over): client-go's rest client's
default, ``maxRetries`` 10."""


SHORT_WATCH_S = 1.0
"""A watch that ends sooner without a single event is an error and backs off, as
client-go's reflector treats such a "very short watch"."""

ListCall = Callable[..., Any]
"""A client ``list_*`` method (or a partial of one) that accepts list and watch arguments."""


@dataclass
class ReflectorStats:
    lists: int = 0
    watches: int = 0
    errors: int = 0
    gone: int = 0
    deltas: int = 0
    duplicates_skipped: int = 0
    malformed: int = 0
    """Objects or watch lines skipped as unreadable (no metadata, no name, no JSON)."""


def object_key(obj: Obj) -> str:
    """uid when present (a recreated pod is a different pod), else namespace/name."""
    meta = obj["metadata"]
    return meta.get("uid") or f"{meta.get('namespace', '')}/{meta['name']}"


def node_key(obj: Obj) -> str:
    """Nodes are keyed by name: the join and the topics know a node by its name only."""
    return str(obj["metadata"]["name"])


_decoder = msgspec.json.Decoder()


class Reflector:
    """List+watch of one resource in a thread; delivers :class:`Delta` lists in order."""

    def __init__(self, resource: str, list_call: ListCall,
                 deliver: Callable[[list[Delta]], None], settings: KubeWatchSettings,
                 stop: threading.Event, *, key_of: Callable[[Obj], str] = object_key,
                 sleep: Callable[[float], bool] | None = None,
                 metrics: WatcherMetrics | None = None) -> None:
        self.resource = resource
        self._key_of = key_of
        self._list_call = list_call
        self._deliver = deliver
        self._settings = settings
        self._stop = stop
        self._sleep = sleep or stop.wait
        self.known: dict[str, str] = {}
        """key -> the resourceVersion last delivered."""
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self.stats = ReflectorStats()
        self._response: Any = None
        self._next_resync = 0.0
        self.refusals = edge.Refusals(log)
        metrics = metrics or WatcherMetrics()
        self._metrics = metrics
        self._watches = metrics.watches.labels(resource)
        self._heard = metrics.last_event.labels(resource)
        self._relist_reason = "first"
        """Why the next relist happens, for ``gpusteward_watch_lists_total``."""

    def run(self) -> None:
        delay = self._settings.backoff_initial_s
        while not self._stop.is_set():
            try:
                if self.resource_version is None or time.monotonic() >= self._next_resync:
                    self.relist()
                self.watch()
                delay = self._settings.backoff_initial_s
            except Gone:
                self.stats.gone += 1
                self._metrics.errors.labels(self.resource, "gone").inc()
                self._relist_reason = "gone"
                log.info("%s: resourceVersion %s expired, relisting", self.resource,
                         self.resource_version)
                self.resource_version = None
            except Exception as e:
                if self._stop.is_set():
                    return
                self.stats.errors += 1
                self._metrics.errors.labels(self.resource, error_reason(e)).inc()
                pause = max(delay * random.uniform(0.8, 1.2), self._asked_to_wait(e) or 0.0)
                log.warning("%s: %s; retrying in %.1f s", self.resource, brief_error(e), pause)
                self._sleep(pause)
                delay = min(delay * 2, self._settings.backoff_max_s)

    def _asked_to_wait(self, error: BaseException) -> float | None:
        """The seconds the server asked for before the next request (its ``Retry-After``
        on a 429 or 5xx, or a watch ERROR event's ``retryAfterSeconds``), capped by
        ``retry_after_max_s``; None when it asked for nothing."""
        if isinstance(error, WatchError):
            asked = error.retry_after_s
        else:
            asked = server_retry_after(error)
        if asked is None:
            return None
        return min(asked, self._settings.retry_after_max_s)

    def stop(self) -> None:
        """Unblock a watch read at once (the stop event must be set first)."""
        response = self._response
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def relist(self) -> None:
        """A full paged LIST diffed against what was delivered, one page at a time.

        Each page's changes are delivered as it arrives and only keys and resourceVersions
        are kept across pages: holding the whole list decoded first (about 25 KB per pod
        of 5 KB of JSON) took the watcher past its 1Gi limit at 20,000 pods. A relist cut
        short (a continue token gone, a dropped connection) starts over, diffed against
        what its first pages already delivered, so nothing is delivered twice.
        """
        settings = self._settings
        seen: dict[str, str] = {}
        token: str | None = None
        list_rv = ""
        while True:
            response = self._list_page(token)
            page = _decoder.decode(_body(response))
            meta = page.get("metadata") or {}
            list_rv = list_rv or meta.get("resourceVersion", "")
            token = meta.get("continue") or None
            deltas = self._changed(page.get("items") or [], seen)
            del page  # the page's objects live on only in its deltas, until published
            if token is None:
                break
            self._hand_over(deltas)
        self.stats.lists += 1
        self._metrics.lists.labels(self.resource, self._relist_reason).inc()
        self._relist_reason = "resync"
        self._heard.set_to_current_time()
        deltas += [Delta(self.resource, "DELETED", key, None)
                   for key in self.known.keys() - seen.keys()]
        self.known = seen
        self._next_resync = time.monotonic() + settings.resync_period_s
        self._hand_over(deltas)
        # After the last deltas are counted and delivered, so that an observer that sees
        # the new resourceVersion also sees them as outstanding.
        self.resource_version = list_rv
        self.synced.set()

    def _list_page(self, token: str | None) -> Any:
        """One LIST page; a page the server throttles (``Retry-After``) is asked again with
        the same token once the wait is over, up to :data:`THROTTLE_RETRIES` times."""
        settings = self._settings
        for attempt in range(THROTTLE_RETRIES + 1):
            try:
                return self._list_call(
                    limit=settings.page_size, _continue=token, _preload_content=False,
                    _request_timeout=(settings.request_timeout_s, settings.request_timeout_s))
            except Exception as e:
                if getattr(e, "status", None) == 410:
                    raise Gone() from e  # the continue token expired: start over
                wait = self._asked_to_wait(e)
                if wait is None or attempt == THROTTLE_RETRIES or self._stop.is_set():
                    raise
                self.stats.errors += 1
                self._metrics.errors.labels(self.resource, error_reason(e)).inc()
                log.info("%s: %s; asking for the page again in %.1f s", self.resource,
                         brief_error(e), wait)
                if self._sleep(wait):
                    raise  # stopping
        raise AssertionError("unreachable")

    def _changed(self, items: list[Obj], seen: dict[str, str]) -> list[Delta]:
        """The deltas of one list page against what was delivered; notes each object's
        resourceVersion in ``seen`` and, for those delivered, in ``known``."""
        deltas: list[Delta] = []
        for obj in items:
            try:
                key = self._key_of(obj)
                version = str(obj["metadata"].get("resourceVersion", ""))
            except (KeyError, TypeError, AttributeError) as e:
                self._malformed(e, obj)
                continue
            seen[key] = version
            previous = self.known.get(key)
            if previous == version:
                self.stats.duplicates_skipped += 1
                continue
            self.known[key] = version
            deltas.append(Delta(self.resource, "ADDED" if previous is None else "MODIFIED",
                                key, obj))
        return deltas

    def _hand_over(self, deltas: list[Delta]) -> None:
        # Counted before they are delivered: an observer never sees more published than
        # delivered.
        self.stats.deltas += len(deltas)
        self._deliver(deltas)

    def watch(self) -> None:
        """One watch request from the current resourceVersion, until it ends or resync is due."""
        settings = self._settings
        try:
            response = self._list_call(
                watch=True, resource_version=self.resource_version, allow_watch_bookmarks=True,
                timeout_seconds=settings.watch_timeout_s, _preload_content=False,
                _request_timeout=(settings.request_timeout_s,
                                  settings.watch_timeout_s + settings.request_timeout_s))
        except Exception as e:
            # Most servers say 410 in an ERROR event, some (and proxies) as the HTTP status.
            if getattr(e, "status", None) == 410:
                raise Gone() from e
            raise
        self._response = response
        self.stats.watches += 1
        self._watches.inc()
        opened, heard = time.monotonic(), False
        try:
            for line in _lines(response):
                if self._stop.is_set():
                    return
                heard = True
                self._heard.set_to_current_time()
                try:
                    event = _decoder.decode(line)
                    self._on_event(event["type"], event["object"])
                except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as e:
                    # Skipped, not retried: the same watch would send it again. The next
                    # relist (resync_period_s) brings the object's state back.
                    self._malformed(e, line)
                if time.monotonic() >= self._next_resync:
                    return
        finally:
            self._response = None
            response.release_conn()
        if not heard and time.monotonic() - opened < SHORT_WATCH_S and not self._stop.is_set():
            # Ended cleanly at once (a proxy cutting streams, a server going down): asking
            # again at once would be a hot loop against the API server; back off instead.
            raise WatchError("very short watch: it ended at once without an event")

    def _malformed(self, error: BaseException, what: object) -> None:
        """Count one unreadable object or line and log it (once per kind at warning level)."""
        self.stats.malformed += 1
        self.refusals.note(type(error).__name__, "%s: skipping a malformed object (%s): %.200r",
                           self.resource, cut(f"{type(error).__name__}: {error}"), what)

    def _on_event(self, kind: str, obj: Obj) -> None:
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            asked = (obj.get("details") or {}).get("retryAfterSeconds")
            raise WatchError(f"{obj.get('code')} {obj.get('reason')}: "
                             f"{str(obj.get('message'))[:200]}",
                             retry_after_s=float(asked) if isinstance(asked, int | float)
                             and asked >= 0 else None)
        version = obj["metadata"]["resourceVersion"]
        if kind == "BOOKMARK":
            self.resource_version = version
            return
        key = self._key_of(obj)
        if kind == "DELETED":
            if self.known.pop(key, None) is None:
                self.stats.duplicates_skipped += 1  # a relist already reported it gone
            else:
                self.stats.deltas += 1
                self._deliver([Delta(self.resource, "DELETED", key, obj)])
        elif self.known.get(key) == version:
            self.stats.duplicates_skipped += 1
        else:
            typ: Literal["ADDED", "MODIFIED"] = "ADDED" if key not in self.known else "MODIFIED"
            self.known[key] = version
            self.stats.deltas += 1
            self._deliver([Delta(self.resource, typ, key, obj)])
        self.resource_version = version


def _body(response: Any) -> bytes:
    data = response.data
    return data if isinstance(data, bytes) else bytes(data)


def _lines(response: Any) -> Iterator[bytes]:
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


def server_retry_after(error: BaseException) -> float | None:
    """The ``Retry-After`` seconds of a failed request's answer, where the server sent
    one with a 429 or a 5xx (client-go heeds it on those only), else None."""
    status = getattr(error, "status", None)
    if not isinstance(status, int) or not (status == 429 or 500 <= status <= 599):
        return None
    headers = getattr(error, "headers", None) or {}
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    return retry_after(value)


def error_reason(error: BaseException) -> str:
    """A failed request as a metric label: ``http_<status>`` for an API status, else the
    error's type (a few urllib3 and client types: a bounded set)."""
    status = getattr(error, "status", None)
    return f"http_{status}" if isinstance(status, int) else type(error).__name__


def brief_error(error: BaseException) -> str:
    """An error as one log-sized line: API bodies can be kilobytes long."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:300] + "..."
