"""The edge of every consumer: a record becomes a valid payload or a reason to refuse it.

The schema's bounds (:mod:`gpusteward.schema`) do most of the work while
msgspec decodes. What a type cannot say is checked here, around the decode:

- size: a record larger than any payload can be is refused unread;
- nesting depth: msgspec recurses into nested JSON (even into fields it
  skips) and stops at the interpreter's recursion limit with a
  RecursionError (5,000 or 100,000 brackets: refused, nothing crashes); a
  record the decoder refuses is measured, so that one nested too deep says
  so. The measure is not taken on records that decode: counting brackets
  cost about 3 µs of every 8-GPU sample's 11 µs at the edge (1-2 % of the
  worker's CPU per sample), and what a record nests in fields the schema
  does not have is skipped;
- the key: UTF-8, and the one the producer's partitioner would have used
  (a sample keyed by another node lands in that node's partition, where it
  would split the node's state between two workers);
- event time: not further ahead of the wall clock than any sane clock skew
  allows (a record from 2090 would drag every event-time clock with it); the
  stream worker's bound is a setting, 15 minutes by default.

:class:`Rejected` carries the reason; :func:`dead_letter` builds the record
the dead-letter topic keeps, cut to fit a broker's message limit.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from gpusteward.schema import SCHEMA_VERSION, DeadLetter

T = TypeVar("T")

DEADLETTER_MAX_BYTES = 256 * 1024
"""Raw key plus value kept in one dead letter. The value travels base64-encoded in
JSON (4/3 of its size), and Kafka's default message limit is 1 MiB: 256 KiB leaves
room for both and the error text."""

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_INNERMOST = re.compile(rb"\[\]|\{\}")


class Rejected(ValueError):
    """A record refused at the edge; the message is the reason a dead letter carries."""


@dataclass(frozen=True)
class Limits:
    """What the edge accepts beyond the schema's own bounds."""

    max_bytes: int = 512 * 1024
    """Bytes of one value: a 64-device MIG node's sample is about 30 KB."""
    max_depth: int = 64
    """Nesting of JSON arrays and objects a refusal names as the reason. The deepest
    payload (a sample's device's pod) nests 3 deep; msgspec's decoder gives up near
    1,000 (the interpreter's recursion limit)."""
    max_key_bytes: int = 1024
    max_future_s: float = 366 * 86400.0
    """How far an event time may run ahead of this process's clock. A simulation or a
    replay may run ahead of the wall clock by hours, never by a year. The stream worker,
    whose event-time clocks a record from the future would drag along, takes the tighter
    ``Settings.max_event_ahead_s``."""


def nesting_depth_exceeds(raw: bytes, limit: int) -> bool:
    """True when JSON ``raw`` nests arrays/objects deeper than ``limit``, without recursion.

    Cheap for the common case: a document with no more than ``limit`` brackets in all
    cannot nest deeper. Otherwise the document is cut to its skeleton (escapes, then
    everything but quotes and brackets, then strings removed) and innermost pairs are
    peeled, one level per pass, each pass a C-speed regex over the short skeleton.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    if b"\\" in raw:
        raw = _ESCAPE.sub(b"", raw)
    # With escapes gone, quotes pair up: every second piece between them is a string.
    skeleton = b"".join(raw.translate(None, _NOT_STRUCTURE).split(b'"')[::2])
    for _ in range(limit):
        skeleton, peeled = _INNERMOST.subn(b"", skeleton)
        if not peeled:
            return False
    return _INNERMOST.search(skeleton) is not None


class Edge(Generic[T]):
    """Decodes one payload type from a topic's records, refusing what it cannot trust.

    ``key_of``: the key the producer gives a payload; when set, a record whose key
    differs is refused. None accepts any UTF-8 key (or none).
    """

    def __init__(self, payload: Any, key_of: Callable[[T], str] | None = None,
                 limits: Limits | None = None, clock: Callable[[], float] = time.time) -> None:
        self._decode: Callable[[bytes], T] = msgspec.json.Decoder(payload).decode
        self._key_of = key_of
        self.limits = limits or Limits()
        self._clock = clock

    def __call__(self, value: bytes | None, key: bytes | None = None) -> T:
        """The payload of a record with ``value`` and ``key``; :class:`Rejected` if refused."""
        limits = self.limits
        if not value:
            raise Rejected("empty value")
        if len(value) > limits.max_bytes:
            raise Rejected(f"value of {len(value)} bytes exceeds {limits.max_bytes}")
        key_text = self._key(key)
        try:
            record = self._decode(value)
        except (msgspec.DecodeError, RecursionError) as error:  # ValidationError included
            if nesting_depth_exceeds(value, limits.max_depth):
                raise Rejected(f"JSON nests deeper than {limits.max_depth} levels") from error
            if not isinstance(error, msgspec.ValidationError):
                raise Rejected(f"malformed: {error}") from error
            reason = str(error)
            if reason.endswith("`$.schema`"):
                reason = f"unknown schema version (this build reads {SCHEMA_VERSION}): {reason}"
            raise Rejected(f"invalid: {reason}") from error
        ts: float = getattr(record, "ts", 0.0)
        ahead = ts - self._clock()
        if ahead > limits.max_future_s:
            raise Rejected(f"event time {ts:.0f} is {ahead:.0f} s ahead of the clock (more "
                           f"than {limits.max_future_s:.0f} s): the producer's clock is "
                           "skewed or jumped")
        if self._key_of is not None and key_text != self._key_of(record):
            raise Rejected(f"key {key_text!r} is not the payload's {self._key_of(record)!r}")
        return record

    def _key(self, key: bytes | None) -> str | None:
        if key is None:
            return None
        if len(key) > self.limits.max_key_bytes:
            raise Rejected(f"key of {len(key)} bytes exceeds {self.limits.max_key_bytes}")
        try:
            return key.decode()
        except UnicodeDecodeError as error:
            raise Rejected(f"key is not UTF-8: {error}") from error


def reason(error: BaseException, where: str = "") -> str:
    """One line for a dead letter and a log: the refusal, or the exception and its text."""
    text = str(error) if isinstance(error, Rejected) else f"{type(error).__name__}: {error}"
    text = f"{where}: {text}" if where else text
    return text if len(text) <= 2000 else text[:2000] + "... (cut)"


def dead_letter(topic: str, partition: int, offset: int, key: bytes | None,
                value: bytes | None, error: str, *,
                max_bytes: int = DEADLETTER_MAX_BYTES) -> DeadLetter:
    """The dead letter of one record, its bytes kept whole when they fit in ``max_bytes``.

    A larger record keeps its first bytes and says so (``truncated``, ``value_bytes``):
    a dead letter the broker refuses would be the one record silently lost.
    """
    key = key[:1024] if key is not None and len(key) > 1024 else key
    room = max_bytes - len(key or b"")
    size = len(value) if value is not None else None
    truncated = value is not None and len(value) > room
    if truncated:
        assert value is not None
        value = value[:room]
        error = f"{error} [value cut to {room} of {size} bytes]"
    return DeadLetter(source_topic=topic, partition=partition, offset=offset, error=error,
                      ts=time.time(), key=key, value=value, value_bytes=size,
                      truncated=truncated)


class Refusals:
    """Counts refused records and logs the first of each kind as a warning, later ones at
    debug level: a flood of bad records must not become a flood of log lines too."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.count = 0
        self.by_kind: dict[str, int] = {}

    def note(self, kind: str, message: str, *args: object) -> None:
        """Count one refusal of ``kind`` (a short, bounded name) and log ``message % args``."""
        self.count += 1
        seen = self.by_kind.get(kind, 0)
        self.by_kind[kind] = seen + 1
        self.logger.log(logging.DEBUG if seen else logging.WARNING, message, *args)


def kind_of(error: BaseException) -> str:
    """A short name of a failure for counting: the refusal's first word, else the type."""
    if isinstance(error, Rejected):
        return str(error).split(None, 1)[0].rstrip(":") if str(error) else "rejected"
    return type(error).__name__


def conforming(record: T) -> T:
    """``record`` (built in code, where msgspec checks no bounds) if it decodes as its own
    type would from the wire; :class:`Rejected` otherwise. For producers that translate
    foreign objects: what they publish must be what every consumer accepts."""
    try:
        msgspec.convert(msgspec.to_builtins(record), type(record))
    except msgspec.ValidationError as error:
        raise Rejected(f"invalid: {error}") from error
    return record
