"""NVML collector test fixtures: the fake NVML from tests/data/nvml, a recording publisher,
a kubelet PodResources gRPC server on a unix socket, and ``gpusteward collect nvml`` run as
a process (on the fake or the real driver)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.broker import free_port
from gpusteward.collectors.podresources import api_pb2, api_pb2_grpc
from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent
from gpusteward.settings import Settings
from tests.conftest import metrics_page

from ..conftest import metric_value

DATA = Path(__file__).resolve().parents[2] / "data" / "nvml"


class RecordingPublisher:
    """A Publisher that keeps what it is given, and lets a test wait for it."""

    def __init__(self) -> None:
        self.samples: list[NodeSample] = []
        self.events: list[HwEvent] = []
        self._changed = asyncio.Condition()

    async def sample(self, sample: NodeSample) -> None:
        self.samples.append(sample)
        async with self._changed:
            self._changed.notify_all()

    async def hw_event(self, event: HwEvent) -> None:
        self.events.append(event)
        async with self._changed:
            self._changed.notify_all()

    async def allocation(self, event: AllocationEvent) -> None:
        raise AssertionError("the NVML collector publishes no allocations")

    async def queue(self, event: QueueEvent) -> None:
        raise AssertionError("the NVML collector publishes no queue events")

    async def flush(self) -> None:
        return None

    async def wait_for(self, predicate: Callable[[RecordingPublisher], bool],
                       timeout_s: float = 5.0) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout_s)

    def events_of(self, kind: str) -> list[HwEvent]:
        return [e for e in self.events if e.kind == kind]


@pytest.fixture
def nvml_data() -> Path:
    return DATA


@pytest.fixture
def fake_nvml() -> Callable[[str], FakeNvml]:
    """``fake_nvml("mig-node")``: a fresh fake NVML from tests/data/nvml/mig-node.yaml."""
    return lambda name: FakeNvml.from_yaml(DATA / f"{name}.yaml")


@pytest.fixture
def publisher() -> RecordingPublisher:
    return RecordingPublisher()


WHOLE = "GPU-11111111-2222-4333-8444-555555555555"
MIG_PARENT = "GPU-66666666-7777-4888-9999-aaaaaaaaaaaa"
MIG_1 = "MIG-aaaaaaaa-0000-4000-8000-000000000001"


def kubelet_pod(namespace: str, name: str, *containers: api_pb2.ContainerResources
                ) -> api_pb2.PodResources:
    return api_pb2.PodResources(namespace=namespace, name=name, containers=list(containers))


def container(name: str, resource: str, *device_ids: str) -> api_pb2.ContainerResources:
    return api_pb2.ContainerResources(name=name, devices=[
        api_pb2.ContainerDevices(resource_name=resource, device_ids=list(device_ids))])


# What a kubelet on the mixed node (tests/data/nvml/mixed-node.yaml) answers: a whole GPU
# to a training pod, MIG device 1 to a notebook under the mixed strategy, GPU instance 2
# of GPU 1 to an inference pod in GKE's notation, and a non-NVIDIA device to a third pod.
KUBELET_LIST = api_pb2.ListPodResourcesResponse(pod_resources=[
    kubelet_pod("ml", "train-0", container("trainer", "nvidia.com/gpu", WHOLE),
                api_pb2.ContainerResources(name="sidecar")),
    kubelet_pod("research", "notebook-7", container("jupyter", "nvidia.com/mig-3g.40gb", MIG_1)),
    kubelet_pod("serving", "llm-1", container("server", "nvidia.com/gpu", "nvidia1/gi2")),
    kubelet_pod("infra", "fpga-job", container("main", "example.com/fpga", "GPU-not-really")),
])


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResourcesLister, serving a fixed List answer."""

    def __init__(self, answer: api_pb2.ListPodResourcesResponse) -> None:
        self.answer = answer
        self.calls = 0
        self.fail: grpc.StatusCode | None = None

    async def List(self, request, context):  # the gRPC method name
        self.calls += 1
        if self.fail is not None:
            await context.abort(self.fail, "kubelet says no")
        return self.answer


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # A unix socket path must stay under ~107 bytes: pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="pr-"))
    yield directory / "kubelet.sock"
    shutil.rmtree(directory, ignore_errors=True)


async def serve_kubelet(kubelet: Kubelet, path: Path) -> grpc.aio.Server:
    server = grpc.aio.server()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


def tick_beside_kubelet(fake: FakeNvml, kubelet: Kubelet, path: Path,
                        publisher: RecordingPublisher, **options: Any) -> NodeSample:
    """One tick of the NVML collector on ``fake`` with ``kubelet`` answering on ``path``."""
    from gpusteward.collectors.attribution import PodResourcesClient
    from gpusteward.collectors.nvml import NvmlCollector

    async def scenario() -> NodeSample:
        server = await serve_kubelet(kubelet, path)
        collector = NvmlCollector(fake, "node-a", publisher,
                                  pod_resources=PodResourcesClient(str(path), timeout_s=2),
                                  **options)
        collector.open()
        try:
            return await collector.tick()
        finally:
            collector.close()
            assert collector.pod_resources is not None
            await collector.pod_resources.close()
            await server.stop(None)

    return asyncio.run(scenario())


def run_collect_nvml(settings: Settings, socket_path: Path, kubelet: Kubelet, node: str,
                     *source: str) -> tuple[list[NodeSample], str]:
    """Run ``gpusteward collect nvml`` (``source``: ``--fake-nvml PATH``, or nothing for the
    driver) with ``kubelet`` on ``socket_path`` until it has sent three samples, stop it with
    SIGTERM as the kubelet does, and return what reached Kafka and its last /metrics page."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "gpusteward"), "collect", "nvml", *source,
               "--node", node, "--interval", "0.2", "--metrics-port", str(port),
               "--bootstrap", settings.kafka.bootstrap_servers, "--loglevel", "warning"]
    # The NVML collector's own settings by the names the DaemonSet uses.
    env = {**os.environ, "GPUSTEWARD_TOPIC_PREFIX": settings.topic_prefix,
           "GPUSTEWARD_COLLECT__NVML__POD_RESOURCES_SOCKET": str(socket_path),
           "GPUSTEWARD_COLLECT__NVML__EVENT_WAIT_MS": "100",
           "GPUSTEWARD_COLLECT__METRICS_ADDR": "127.0.0.1"}
    sent = f'gpusteward_collect_records_sent_total{{topic="{topics.SAMPLES.suffix}"}}'

    async def scenario() -> tuple[list[NodeSample], str]:
        await kafka.ensure_topics(settings, [topics.SAMPLES, topics.HW_EVENTS])
        server = await serve_kubelet(kubelet, socket_path)
        process = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        try:
            # Kafka is read once the process has stopped: a live collector never lets
            # read_all's quiet period pass.
            deadline = time.monotonic() + 30
            metrics = ""
            while metric_value(metrics, sent) < 3:
                if process.returncode is not None or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
                metrics = await asyncio.to_thread(metrics_page, port)
            running = process.returncode is None
            if running:
                process.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(process.wait(), 20)
            output = (await process.stdout.read()).decode()  # type: ignore[union-attr]
            assert running and code == 0, output
            records = await kafka.read_all(settings, topics.SAMPLES.name(settings))
            return [msgspec.json.decode(r.value or b"", type=NodeSample)
                    for r in records], metrics
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await server.stop(None)

    return asyncio.run(scenario())
