"""The agents' raw-bytes schema decodes a record as Faust's own ``raw`` schema does."""

from __future__ import annotations

import asyncio
from typing import Any

import faust
import pytest
from faust.types import TP, Message

from gpusteward.streams.outputs import RawSchema


@pytest.mark.parametrize(("key", "value"), [
    (b"node-1", b'{"ts": 1.0}'),
    (None, b"\x00\xffnot json"),
    (b"node-1", None),  # a tombstone: no value
    (b"", b""),
])
def test_raw_schema_decodes_as_faust_raw_schema(key: bytes | None, value: bytes | None):
    app = faust.App("raw-schema-test", store="memory://")
    message = Message(topic="t", partition=0, offset=7, timestamp=0.0, timestamp_type=0,
                      headers=[("h", b"1")], key=key, value=value, checksum=None,
                      tp=TP("t", 0))

    def decoded(schema: faust.Schema) -> Any:
        schema.update(key_type=bytes, value_type=bytes, key_serializer="raw",
                      value_serializer="raw")

        async def decode() -> Any:
            return await schema.compile(app)(message)

        return asyncio.run(decode())

    ours, faust_own = decoded(RawSchema()), decoded(faust.Schema())
    assert (ours.key, ours.value, ours.headers) == (faust_own.key, faust_own.value,
                                                    faust_own.headers)
    assert ours.message is message
