"""End-to-end tests get a broker of their own per module.

The embedded broker is memory-only and keeps every topic and consumer group
of the session; after a few hundred tests its group coordination slows down
enough that a worker killed and restarted mid-run was once seen not to
resume one partition within the test's time. A fresh broker per module keeps
these timing-sensitive tests independent of what ran before them.
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
