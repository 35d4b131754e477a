"""One error hierarchy for gpusteward: permanent or temporary, and by how long.

A caller that meets an error has one question: is it worth trying again, and
when? So every error gpusteward raises of its own descends from
:class:`GpustewardError` and from exactly one of two branches (as kopf does):

- :class:`PermanentError`: trying again changes nothing (a policy file with a
  bad field, an object that does not exist, a patch the server rejects);
- :class:`TemporaryError`: the same call may succeed later, after
  :attr:`TemporaryError.delay` seconds (a 503, a 429 with ``Retry-After``, a
  timeout, a refused connection).

Configuration errors (policy files, scenario files, settings, command-line
values) are :class:`ConfigError`, a permanent error whose message is the
``FILE:LINE: field`` text the user reads.

Kubernetes API statuses map to :class:`ApiError` subclasses by
:func:`api_error`, which the one module that writes to the API
(``remediation/kubernetes.py``) calls on the client's exception; it lives here
and not there so that the mapping is plain data, testable without a client.
Response bodies can be long (a whole object echoed back in a 422); they are
cut by :func:`cut` before they reach a message, so a log line stays a line.

Existing exception classes keep their names and their old bases (a
``PolicyError`` is still a ``ValueError``), so ``except`` clauses written
against them keep working.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

MAX_DETAIL = 300
"""Characters of a server's message or body kept in an error's text: enough for a
Kubernetes Status message, short enough for one log line."""

DEFAULT_RETRY_DELAY_S = 1.0
"""Seconds before a retry when the error does not say (kopf waits 60 s for its
handlers; an API call is cheaper to try again, and the executor backs off from here)."""


def cut(text: str | bytes | None, limit: int = MAX_DETAIL) -> str:
    """``text`` shortened to ``limit`` characters, saying how much was cut."""
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = " ".join(text.split())  # a body's newlines would split the log line
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def shown_url(url: str, keep_path: bool = False) -> str:
    """``url`` as a log line or an error may show it: scheme, host and port (and its path
    with ``keep_path``), never ``user:password@``, a query or a fragment.

    A webhook's path and query are its credential (Slack's ``/services/T…/B…/<secret>``, a
    ``?token=``); "/…" says something was left out.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # not a URL at all: nothing of it is safe to show
        return "<unreadable URL>"
    if not parts.scheme or not parts.hostname:
        return "<unreadable URL>"
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    where = f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")
    if keep_path:
        where += parts.path.rstrip("/")
    hidden = (not keep_path and parts.path.strip("/")) or parts.query or parts.fragment
    return where + ("/…" if hidden else "")


def without_url(text: str, url: str, keep_path: bool = False) -> str:
    """``text`` (an error's message) with ``url`` in it replaced by :func:`shown_url`."""
    return text.replace(url, shown_url(url, keep_path)) if url else text


class GpustewardError(Exception):
    """The root of every error gpusteward raises of its own."""


class PermanentError(GpustewardError):
    """Trying again will not help: the input, the object or the request is wrong."""


class TemporaryError(GpustewardError):
    """The same call may succeed later; try again after :attr:`delay` seconds."""

    def __init__(self, message: str = "", *, delay: float = DEFAULT_RETRY_DELAY_S) -> None:
        super().__init__(message)
        self.delay = delay
        """Seconds to wait before trying again: the server's ``Retry-After`` when it gave
        one, else :data:`DEFAULT_RETRY_DELAY_S`. A lower bound: a caller may back off longer."""


class ConfigError(PermanentError):
    """A configuration (policy file, scenario, settings, a command-line value) that cannot
    be used; the message locates the problem (``FILE:LINE: field``)."""


# -- the Kubernetes API --------------------------------------------------------------------


class ApiError(GpustewardError):
    """The Kubernetes API answered with an error status, or did not answer.

    ``status`` is the HTTP status (0 when there was no answer), ``reason`` the
    Status object's reason (``NotFound``, ``Conflict``, ...) and ``message`` its
    message, cut to :data:`MAX_DETAIL` characters.
    """

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class ApiPermanentError(ApiError, PermanentError):
    """An API status that will not change on retry (400, 401, 403, 405, 415, ...)."""


class NotFound(ApiPermanentError):
    """404: the object (or the API group) does not exist."""


class Conflict(ApiPermanentError):
    """409: a stale resourceVersion or an object that already exists."""


class Invalid(ApiPermanentError):
    """422: the server rejected the object or patch as invalid."""


class ApiTemporaryError(ApiError, TemporaryError):
    """An API status or failure that may clear: retry after ``delay`` seconds."""

    def __init__(self, status: int, reason: str, message: str, *,
                 delay: float = DEFAULT_RETRY_DELAY_S) -> None:
        super().__init__(status, reason, message)
        self.delay = delay


class TooManyRequests(ApiTemporaryError):
    """429: the server's flow control (or a PodDisruptionBudget on an eviction) said not now."""


class ServerError(ApiTemporaryError):
    """5xx: the API server or something behind it failed."""


class ApiTimeout(ApiTemporaryError):
    """The request did not complete within its timeout (no status)."""


class ApiUnreachable(ApiTemporaryError):
    """The connection was refused, reset or could not be made (no status)."""


_PERMANENT_BY_STATUS: dict[int, type[ApiPermanentError]] = {
    404: NotFound, 409: Conflict, 422: Invalid}


def retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def status_message(body: str | bytes | None, fallback: str) -> tuple[str, str]:
    """(reason, message) of a Kubernetes ``Status`` body, cut; ``fallback`` when it is not one."""
    try:
        status = json.loads(body or "")
    except (TypeError, ValueError):
        return fallback, cut(body) or fallback
    if not isinstance(status, dict):
        return fallback, cut(body)
    return (str(status.get("reason") or fallback),
            cut(str(status.get("message") or fallback)))


def api_error(status: int, body: str | bytes | None = None, *, reason: str = "",
              retry_after_header: str | None = None) -> ApiError:
    """The error for an HTTP ``status`` from the API server.

    404, 409 and 422 are permanent (:class:`NotFound`, :class:`Conflict`,
    :class:`Invalid`); 429 and every 5xx are temporary, with the server's
    ``Retry-After`` as the delay when it sent one; any other status is a
    permanent :class:`ApiPermanentError`.
    """
    why, message = status_message(body, reason or "Failure")
    if status in _PERMANENT_BY_STATUS:
        return _PERMANENT_BY_STATUS[status](status, why, message)
    if status == 429 or status >= 500:
        delay = retry_after(retry_after_header)
        kind: type[ApiTemporaryError] = TooManyRequests if status == 429 else ServerError
        return kind(status, why, message,
                    delay=DEFAULT_RETRY_DELAY_S if delay is None else delay)
    return ApiPermanentError(status, why, message)
