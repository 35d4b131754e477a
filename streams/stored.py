"""How a large table value goes onto its changelog: in records a broker takes, and per
write only what changed.

The fleet agent keeps its state (the queue, every fleet rule's tracks) as one msgpack
value, written with every batch that holds a queue event. Most of it is per workload: at
9,000 running GPU pods it is 1.0-1.3 MB, and one admission rewrote all of it, a megabyte and
more on the changelog per queue event, all of which a recovery on a real Kafka reads
again until compaction removes it. Two layers keep the records small:

- **Chunks**: every map or list of at least :data:`LARGE` items in the value, found
  through its maps and Structs, is cut in its own order into chunks, each ending at an
  entry whose key (a map's) or item (a list's) hashes to a boundary. An entry added,
  changed or removed changes its own chunk, seldom a neighbour's; the other chunks keep
  their bytes. A chunk is stored under a key named by a hash of its bytes
  (``<key>/c/<hash>``), so a chunk that did not change is not written again. The head,
  under ``<key>``, is the value with those containers emptied and the names of their
  chunks, in order: joined (:func:`joined`), it gives back the value byte for byte, its
  maps in their order.
- **Parts** (:func:`in_parts`): a head still over the broker's limit (a record over
  ``message.max.bytes`` is refused, and the worker stopped) is written in parts of a new
  generation (``<key>/<generation>/<i>``), then a head naming them.

A checkpoint's writes come in an order that a recovery, which reads a prefix of the
one-partition changelog, always reads as the state before it or after it: new chunks
(named by their content, they replace nothing), then the head (its parts first), then
the deletions of the chunks and parts it no longer names.

A value without large containers that fits a record is written whole, as builds before
these layers wrote it. Their heads are msgpack arrays, which no earlier build reads as a
state (a map): it reports the value it cannot read rather than take it for an empty state.

The value is cut as the Struct it is, not decoded from its msgpack: at 9,000 running
pods decoding it alone took 12 ms a write. Reading it back goes through plain data (the
head and the chunks decoded, joined, encoded again), once per recovery or rebalance.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy

LARGE = 256
"""Items from which a map or list is cut into chunks: below it (a fleet state following a
few hundred workloads, tens of KB) the value is written whole, in the format builds before
2026-11-28 read."""
_BOUNDARY = 63
"""An item ends a chunk where the hash of its key (or of itself) has these bits clear: a
chunk of 64 items on average."""
_CHUNK_MAX = 512
"""Items after which a chunk ends in any case (items whose hashes have no boundary)."""
_DEPTH = 6
"""Maps nested deeper than this are not searched for large containers."""

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

Path = list[str | int]


class _Parts(msgspec.Struct, array_like=True, frozen=True):
    """The head of a value written in parts (:func:`in_parts`)."""

    generation: int
    count: int
    size: int

    def keys(self, key: bytes) -> list[bytes]:
        return [b"%s/%d/%d" % (key, self.generation, i) for i in range(self.count)]


class _Container(msgspec.Struct, array_like=True, frozen=True):
    """A large container of the value: where it is, and its chunks' names in order."""

    path: Path
    chunks: list[str]


class _Chunked(msgspec.Struct, array_like=True, frozen=True, tag="chunked"):
    """The head of a value written in chunks (:func:`in_chunks`)."""

    rest: bytes
    """The value, msgpack, its large containers emptied."""
    containers: list[_Container]


_decode_parts = msgspec.msgpack.Decoder(_Parts).decode
_decode_chunked = msgspec.msgpack.Decoder(_Chunked).decode


def in_chunks(key: bytes, value: Any, keys: Iterable[bytes], limit: int
              ) -> list[tuple[bytes, bytes | None]]:
    """The table writes, in order, that store ``value`` (a msgspec Struct or plain data,
    written as msgpack) under ``key`` in records of at most ``limit`` bytes, given the
    table's ``keys``: the chunks the table does not hold yet, the head (in parts when it is
    over ``limit``: :func:`in_parts`), then the deletion of every chunk and part of ``key``
    the head does not name."""
    prefix = _chunk_prefix(key)
    keys = list(keys)
    held = {k for k in keys if k.startswith(prefix)}
    writes: list[tuple[bytes, bytes | None]] = []
    named: set[bytes] = set()
    found: list[tuple[Path, dict[Any, Any] | list[Any]]] = []
    rest = _without_large(value, [], found)
    if not found:
        head = _encode(value)
    else:
        containers: list[_Container] = []
        for path, items in found:
            names: list[str] = []
            for data in _chunks(items, limit):
                name = hashlib.blake2b(data, digest_size=16).hexdigest()
                names.append(name)
                chunk_key = prefix + name.encode()
                if chunk_key not in named and chunk_key not in held:
                    writes.append((chunk_key, data))
                named.add(chunk_key)
            containers.append(_Container(path, names))
        head = _encode(_Chunked(_encode(rest), containers))
    writes += in_parts(key, head, [k for k in keys if not k.startswith(prefix)], limit)
    return writes + [(k, None) for k in sorted(held - named)]


def in_parts(key: bytes, value: bytes, keys: Iterable[bytes], limit: int
             ) -> list[tuple[bytes, bytes | None]]:
    """The table writes, in order, that store ``value`` under ``key`` in records of at most
    ``limit`` bytes: ``value`` itself when it fits; else its parts under keys of a new
    generation (``key/<generation>/<i>``), then under ``key`` the head naming them. Then
    the deletion of every part of ``keys`` (the table's) that the head does not name.

    The head comes after its parts on the one-partition changelog, and a recovery reads a
    prefix of it: the head it ends with names parts it has read, and the parts of the head
    before stay until the new head is written."""
    prefix = key + b"/"
    old = [k for k in keys if k.startswith(prefix)]
    writes: list[tuple[bytes, bytes | None]] = []
    if len(value) <= limit:
        writes.append((key, value))
    else:
        generation = 1 + max((_generation(k) for k in old), default=0)
        head = _Parts(generation, -(-len(value) // limit), len(value))
        parts = head.keys(key)
        writes += [(k, value[i * limit:(i + 1) * limit]) for i, k in enumerate(parts)]
        writes.append((key, _encode(head)))
        old = [k for k in old if k not in parts]
    return writes + [(k, None) for k in old]


def joined(key: bytes, stored: bytes | None, get: Callable[[bytes], bytes | None]
           ) -> bytes | None:
    """The value stored under ``key`` (:func:`in_chunks`, :func:`in_parts`): ``stored``
    itself, or the value its head names the parts and chunks of (``get`` reads one).
    msgspec.DecodeError when one is missing."""
    if stored is None:
        return None
    value = _from_parts(key, stored, get)
    try:
        head = _decode_chunked(value)
    except ValueError:  # msgspec.DecodeError, or bytes that are not UTF-8 where text is
        return value  # whole (or not a state at all: its decoding says so)
    try:
        return _join_chunks(key, head, get)
    except msgspec.DecodeError:
        raise
    except ValueError as error:
        raise msgspec.DecodeError(f"written in chunks, one unreadable: {error}") from error


def _join_chunks(key: bytes, head: _Chunked, get: Callable[[bytes], bytes | None]) -> bytes:
    tree = _decode(head.rest)
    prefix = _chunk_prefix(key)
    wanted: set[str] = set()
    missing: set[str] = set()
    for container in head.containers:
        chunks = [get(prefix + name.encode()) for name in container.chunks]
        wanted.update(container.chunks)
        missing.update(n for n, c in zip(container.chunks, chunks, strict=True) if c is None)
        parent = _at(tree, container.path[:-1])
        if parent is None or container.path[-1] not in parent:
            raise msgspec.DecodeError(f"written in chunks, its head names a container at "
                                      f"{container.path} that its value lacks")
        parent[container.path[-1]] = _joined_chunks(
            [_decode(c) for c in chunks if c is not None], parent[container.path[-1]])
    if missing:
        raise msgspec.DecodeError(f"written in {len(wanted)} chunks, {len(missing)} of them "
                                  "missing")
    return _encode(tree)


def _from_parts(key: bytes, stored: bytes, get: Callable[[bytes], bytes | None]) -> bytes:
    try:
        head = _decode_parts(stored)
    except ValueError:
        return stored
    parts = [get(k) for k in head.keys(key)]
    value = b"".join(p for p in parts if p is not None)
    if len(value) != head.size:
        missing = sum(p is None for p in parts)
        raise msgspec.DecodeError(
            f"written in {head.count} parts (generation {head.generation}, {head.size} bytes), "
            f"{missing} of them missing, {len(value)} bytes found")
    return value


def _generation(key: bytes) -> int:
    try:
        return int(key.split(b"/")[1])
    except (IndexError, ValueError):
        return 0


def _chunk_prefix(key: bytes) -> bytes:
    return key + b"/c/"


def _without_large(value: Any, path: Path,
                   found: list[tuple[Path, dict[Any, Any] | list[Any]]]) -> Any:
    """``value`` with its large containers emptied (copied where they are: the caller's
    state is not changed), each noted in ``found`` with its path in the value's msgpack
    form. The search goes through maps and through Structs written as maps with every
    field (not ``array_like``, not ``omit_defaults``)."""
    if isinstance(value, msgspec.Struct):
        config = value.__struct_config__
        if config.array_like or config.omit_defaults or len(path) > _DEPTH:
            return value
        fields = zip(value.__struct_fields__, value.__struct_encode_fields__, strict=True)
        changed = {name: emptied for name, encoded in fields
                   if (emptied := _emptied(getattr(value, name), [*path, encoded], found))
                   is not None}
        return msgspec.structs.replace(value, **changed) if changed else value
    if isinstance(value, dict) and len(path) <= _DEPTH:
        entries: dict[Any, Any] = {
            k: emptied for k, item in value.items()
            if isinstance(k, (str, int)) and not isinstance(k, bool)
            and (emptied := _emptied(item, [*path, k], found)) is not None}
        return {**value, **entries} if entries else value
    return value


def _emptied(item: Any, path: Path,
             found: list[tuple[Path, dict[Any, Any] | list[Any]]]) -> Any:
    """What ``item``, at ``path``, is written as in the head; None: itself."""
    if isinstance(item, (dict, list)) and len(item) >= LARGE:
        found.append((path, item))
        return {} if isinstance(item, dict) else []
    if isinstance(item, (dict, msgspec.Struct)):
        rest = _without_large(item, path, found)
        return None if rest is item else rest
    return None


def _at(tree: Any, path: Path) -> dict[Any, Any] | None:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree if isinstance(tree, dict) else None


def _chunks(items: dict[Any, Any] | list[Any], limit: int) -> list[bytes]:
    """``items`` in chunks (msgpack), each at most ``limit`` bytes where an item fits: the
    items, in order, cut after each whose mark (:func:`_marks`) has the boundary bits clear,
    and after :data:`_CHUNK_MAX` items in any case."""
    keys = list(items)
    values = list(items.values()) if isinstance(items, dict) else keys
    # Where the marks say, found in C, and no tuple per item (zip reuses its one): with a
    # Python loop over the items, CRC-32 marks and a tuple each, a checkpoint at 9,000
    # running pods took 27 ms of CPU; this way about 11.
    boundaries = numpy.flatnonzero(_marks(keys) & _BOUNDARY == 0) + 1
    out: list[bytes] = []
    start = 0
    for end in [*boundaries.tolist(), len(keys)]:
        while start < end:
            stop = min(end, start + _CHUNK_MAX)
            piece = (dict(zip(keys[start:stop], values[start:stop], strict=True))
                     if isinstance(items, dict) else keys[start:stop])
            out += _within(piece, limit)
            start = stop
    return out


def _marks(keys: list[Any]) -> numpy.ndarray[Any, numpy.dtype[numpy.int64]]:
    """A number per map key or list item that depends on it alone: its hash, or for an
    unhashable item (a list, a map, a Struct not frozen) the CRC-32 of its encoding. Text is
    hashed with a salt of the process's, so another process cuts a map keyed by text
    elsewhere: a restarted worker's first checkpoint writes every chunk once more."""
    try:
        return numpy.fromiter(map(hash, keys), numpy.int64, len(keys))
    except TypeError:
        return numpy.fromiter((zlib.crc32(_encode(k)) for k in keys), numpy.int64, len(keys))


def _within(piece: dict[Any, Any] | list[Any], limit: int) -> list[bytes]:
    """``piece`` encoded, in halves until each fits ``limit`` (or is one item)."""
    data = _encode(piece)
    if len(data) <= limit or len(piece) < 2:
        return [data]
    half = len(piece) // 2
    if isinstance(piece, dict):
        entries = list(piece.items())
        return _within(dict(entries[:half]), limit) + _within(dict(entries[half:]), limit)
    return _within(piece[:half], limit) + _within(piece[half:], limit)


def _joined_chunks(chunks: list[Any], empty: Any) -> Any:
    if any(type(chunk) is not type(empty) for chunk in chunks):
        raise msgspec.DecodeError("written in chunks, a chunk is not of its container's kind")
    if isinstance(empty, dict):
        whole: dict[Any, Any] = {}
        for chunk in chunks:
            whole.update(chunk)
        return whole
    return [item for chunk in chunks for item in chunk]
