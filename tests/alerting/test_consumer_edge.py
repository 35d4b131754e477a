"""The findings consumer skips and counts what is no valid finding, and goes on."""

from __future__ import annotations

import asyncio

import msgspec

from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.schema import Finding, Subject
from gpusteward.settings import Settings


def test_the_alerting_consumer_skips_what_is_no_finding_and_counts_it() -> None:
    delivered: list[Finding] = []
    consumer = FindingsConsumer(Settings(), [], on_finding=delivered.append)
    finding = Finding(id="f-1", fingerprint="f", kind="ecc_dbe", severity="critical",
                      state="firing", subject=Subject(node="n1"), summary="x",
                      starts_at=1_763_683_200.0, ts=1_763_683_200.0)
    valid = msgspec.json.encode(finding)

    async def main() -> None:
        for raw in (b"", b"{", valid.replace(b'"schema":1', b'"schema":99'),
                    b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}", valid):
            await consumer._handle(raw, b"f")

    asyncio.run(main())
    assert delivered == [finding]
    assert consumer.refusals.count == 4
