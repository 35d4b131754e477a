"""What the deployed processes published, read back decoded."""

from __future__ import annotations

from typing import Any

import msgspec

from gpusteward import kafka, topics
from gpusteward.settings import Settings


async def decoded(settings: Settings, spec: topics.TopicSpec, kind: Any) -> list[Any]:
    """Every record on ``spec``'s topic, decoded as ``kind`` (tombstones left out)."""
    decode = msgspec.json.Decoder(kind).decode
    return [decode(r.value) for r in await kafka.read_all(settings, spec.name(settings))
            if r.value is not None]


def live_states(records: list[Any], kind: Any) -> dict[str, Any]:
    """The per-node states a changelog holds: the last record of each key, a tombstone
    (None) removing it, as compaction and a restarted worker's recovery read it."""
    last: dict[str, bytes | None] = {}
    for record in records:
        last[record.key.decode()] = record.value
    return {node: msgspec.msgpack.decode(value, type=kind)
            for node, value in last.items() if value is not None}
