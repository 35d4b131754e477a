"""The ordered queue of records waiting for the broker: in memory, or on disk in sqlite.

Every record a publisher accepts goes through a spool and leaves it only
when the broker has acknowledged it, so the spool is the one place that
decides what survives an outage. Both kinds are bounded in bytes and drop
the oldest records first when full: for a fleet monitor the newest reading
is the valuable one.

:class:`DiskSpool` keeps records in one sqlite3 file (standard library, one
transaction per append, WAL journal): records survive a broker outage of
hours and a collector restart, and come out in the order they went in.
:class:`MemorySpool` is for processes that need neither (the simulator).
"""

from __future__ import annotations

import sqlite3
from collections import Counter, deque
from pathlib import Path
from typing import NamedTuple, Protocol


class Record(NamedTuple):
    """One record waiting for delivery; ``seq`` grows by one per append."""

    seq: int
    topic: str
    key: bytes
    value: bytes

    @property
    def size(self) -> int:
        return len(self.key) + len(self.value)


class Spool(Protocol):
    """A bounded FIFO of records with acknowledgement by sequence number."""

    max_bytes: int

    @property
    def records(self) -> int: ...

    @property
    def size_bytes(self) -> int: ...

    def append(self, topic: str, key: bytes, value: bytes) -> tuple[int, list[Record]]:
        """Add a record at the tail; return its seq and the records dropped to make room."""
        ...

    def peek(self, limit: int) -> list[Record]:
        """Up to ``limit`` records from the head, oldest first, without removing them."""
        ...

    def ack(self, upto_seq: int) -> None:
        """Remove every record with ``seq <= upto_seq``."""
        ...

    def topics_after(self, seq: int) -> Counter[str]:
        """How many records with a seq above ``seq`` each topic has."""
        ...

    def last_seq(self) -> int | None:
        """The seq of the newest record held, None when empty."""
        ...

    def close(self) -> None: ...


class MemorySpool:
    """A :class:`Spool` in a deque: fast, lost when the process ends."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._queue: deque[Record] = deque()
        self._bytes = 0
        self._next_seq = 1

    @property
    def records(self) -> int:
        return len(self._queue)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def append(self, topic: str, key: bytes, value: bytes) -> tuple[int, list[Record]]:
        record = Record(self._next_seq, topic, key, value)
        self._next_seq += 1
        dropped: list[Record] = []
        while self._queue and self._bytes + record.size > self.max_bytes:
            oldest = self._queue.popleft()
            self._bytes -= oldest.size
            dropped.append(oldest)
        self._queue.append(record)
        self._bytes += record.size
        return record.seq, dropped

    def peek(self, limit: int) -> list[Record]:
        return [self._queue[i] for i in range(min(limit, len(self._queue)))]

    def ack(self, upto_seq: int) -> None:
        while self._queue and self._queue[0].seq <= upto_seq:
            self._bytes -= self._queue.popleft().size

    def topics_after(self, seq: int) -> Counter[str]:
        return Counter(record.topic for record in self._queue if record.seq > seq)

    def last_seq(self) -> int | None:
        return self._queue[-1].seq if self._queue else None

    def close(self) -> None:
        self._queue.clear()
        self._bytes = 0


class DiskSpool:
    """A :class:`Spool` in ``directory/spool.sqlite3``; what it holds survives a restart."""

    FILENAME = "spool.sqlite3"

    def __init__(self, directory: Path, max_bytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / self.FILENAME
        self.max_bytes = max_bytes
        # autocommit (isolation_level=None): each statement is its own transaction, and
        # synchronous=NORMAL under WAL keeps an append to about a file write, no fsync.
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS records (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
            "topic TEXT NOT NULL, key BLOB NOT NULL, value BLOB NOT NULL, size INTEGER NOT NULL)"
        )
        count, total = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM records").fetchone()
        self._records = int(count)
        self._bytes = int(total)

    @property
    def records(self) -> int:
        return self._records

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def append(self, topic: str, key: bytes, value: bytes) -> tuple[int, list[Record]]:
        size = len(key) + len(value)
        dropped: list[Record] = []
        if self._records and self._bytes + size > self.max_bytes:
            freed = 0
            for row in self._db.execute(
                    "SELECT seq, topic, key, value FROM records ORDER BY seq"):
                if self._bytes - freed + size <= self.max_bytes:
                    break
                record = Record(row[0], row[1], bytes(row[2]), bytes(row[3]))
                dropped.append(record)
                freed += record.size
            if dropped:
                self._db.execute("DELETE FROM records WHERE seq <= ?", (dropped[-1].seq,))
                self._records -= len(dropped)
                self._bytes -= freed
        cursor = self._db.execute(
            "INSERT INTO records (topic, key, value, size) VALUES (?, ?, ?, ?)",
            (topic, key, value, size))
        self._records += 1
        self._bytes += size
        return int(cursor.lastrowid or 0), dropped

    def peek(self, limit: int) -> list[Record]:
        rows = self._db.execute(
            "SELECT seq, topic, key, value FROM records ORDER BY seq LIMIT ?", (limit,))
        return [Record(seq, topic, bytes(key), bytes(value)) for seq, topic, key, value in rows]

    def ack(self, upto_seq: int) -> None:
        count, total = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM records WHERE seq <= ?",
            (upto_seq,)).fetchone()
        self._db.execute("DELETE FROM records WHERE seq <= ?", (upto_seq,))
        self._records -= int(count)
        self._bytes -= int(total)

    def topics_after(self, seq: int) -> Counter[str]:
        rows = self._db.execute(
            "SELECT topic, COUNT(*) FROM records WHERE seq > ? GROUP BY topic", (seq,))
        return Counter({topic: int(count) for topic, count in rows})

    def last_seq(self) -> int | None:
        (seq,) = self._db.execute("SELECT MAX(seq) FROM records").fetchone()
        return None if seq is None else int(seq)

    def close(self) -> None:
        self._db.close()
