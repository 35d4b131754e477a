"""End-to-end tests get a broker of their own per module.

The embedded broker is memory-only and keeps every topic and consumer group
of the session; a fresh broker per module keeps these timing-sensitive tests
independent of what ran before them. (A worker restarted mid-run that did not
resume one partition, once blamed on a slow broker, was the worker's own
seek race at a rebalance's end: fixed in streams/app.py, guarded by
tests/streams/test_rebalance_seek.py.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpusteward.broker import EmbeddedBroker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("e2e-broker") / "tansu.log"
    with EmbeddedBroker(log_path=log) as running:
        yield running
