"""Shared fixtures: one embedded broker per test session, fresh topics per test, an API double.

Tests that need the broker ask for ``settings``: it points at the session's
broker with a topic prefix of the test's own, so no test sees another's data.
"""

from __future__ import annotations

import asyncio
import itertools
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError

from gpusteward import kafka
from gpusteward.broker import EmbeddedBroker
from gpusteward.rules import REGISTRY
from gpusteward.sandbox.kube_api import KubeApiServer
from gpusteward.settings import Settings

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
KUBE_FIXTURES = Path(__file__).resolve().parent / "data" / "kube"
_prefixes = itertools.count(1)


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Every test starts from the shipped rules: one that registers a rule loses it after."""
    with REGISTRY.preserved():
        yield


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedBroker(log_path=log) as running:
        yield running


@pytest.fixture
def settings(broker: EmbeddedBroker) -> Settings:
    """Settings on the session broker with this test's own topic prefix."""
    base = broker.settings()
    return base.model_copy(update={"topic_prefix": f"t{next(_prefixes)}"})


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present")
    return SHARED_DATA


@pytest.fixture
def kube_api() -> Iterator[KubeApiServer]:
    """An empty API-server double with fast bookmarks."""
    with KubeApiServer(bookmark_interval_s=0.05) as api:
        yield api


@pytest.fixture
def kube_api_loaded(kube_api: KubeApiServer) -> KubeApiServer:
    kube_api.load_dir(KUBE_FIXTURES)
    return kube_api


@pytest.fixture
def kubeconfig(kube_api: KubeApiServer, tmp_path: Path) -> Path:
    return kube_api.write_kubeconfig(tmp_path / "kubeconfig")


def metrics_page(port: int) -> str:
    """The /metrics page a process serves on loopback ``port``; "" while it serves none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            return str(answer.read().decode())
    except OSError:  # not serving yet
        return ""


@pytest.fixture
def broker_refuses_records(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Call it (with what the records are) to make every producer ``kafka.producer()`` builds
    from then on one whose records the broker never takes: each delivery fails with a
    KafkaTimeoutError, which aiokafka's ``flush()`` would not raise. ``monkeypatch.undo()``
    ends it."""
    real_producer = kafka.producer

    def refuse(what: str) -> None:
        def refusing_producer(settings: Settings, **overrides: object) -> Any:
            producer = real_producer(settings, **overrides)

            async def send(*_args: object, **_kwargs: object) -> asyncio.Future[None]:
                failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                failed.set_exception(KafkaTimeoutError(f"{what} was never taken"))
                return failed

            producer.send = send
            return producer

        monkeypatch.setattr(kafka, "producer", refusing_producer)

    return refuse
