"""``gpusteward watch``: the Kubernetes watcher as a process.

Kept out of ``gpusteward/cli.py`` so the watcher's options live next to the
watcher; ``cli.py`` registers this command in one line. Settings come from
``GPUSTEWARD_KUBE__*`` environment variables (e.g.
``GPUSTEWARD_KUBE__RESYNC_PERIOD_S=300``) and flags override them. Publishing to
Kafka, it serves its metrics (:class:`~gpusteward.collectors.metrics.WatcherMetrics`)
on ``GPUSTEWARD_METRICS__PORT`` like the pipeline processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
from typing import Annotated, Any

import msgspec
import typer
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpusteward.cli.common import Bootstrap, LogLevel, configure_logging, kafka_settings
from gpusteward.collectors.kubernetes import KubeWatchSettings
from gpusteward.schema import AllocationEvent, HwEvent, NodeSample, QueueEvent


class KubeWatchEnvSettings(BaseSettings, KubeWatchSettings):
    """:class:`KubeWatchSettings` read from ``GPUSTEWARD_KUBE__*`` variables."""

    model_config = SettingsConfigDict(env_prefix="GPUSTEWARD_KUBE__", extra="ignore")


class StdoutPublisher:
    """Writes every event as one JSON line, for trying the watcher without Kafka."""

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder()

    def _write(self, topic: str, key: str, value: msgspec.Struct) -> None:
        sys.stdout.write(f"{topic}\t{key}\t{self._encoder.encode(value).decode()}\n")

    async def sample(self, sample: NodeSample) -> None:
        self._write("samples", sample.node, sample)

    async def hw_event(self, event: HwEvent) -> None:
        self._write("hw-events", event.node, event)

    async def allocation(self, event: AllocationEvent) -> None:
        self._write("allocations", event.node, event)

    async def queue(self, event: QueueEvent) -> None:
        self._write("queue", event.cluster_queue, event)

    async def flush(self) -> None:
        sys.stdout.flush()


def watch(
    kubeconfig: Annotated[str | None, typer.Option(
        help="Kubeconfig file (default: in-cluster when in a pod, else ~/.kube/config).")
    ] = None,
    context: Annotated[str | None, typer.Option(help="Kubeconfig context.")] = None,
    resync: Annotated[float | None, typer.Option(
        help="Seconds between full relists diffed against what was published.")] = None,
    resources: Annotated[str | None, typer.Option(
        help="Comma-separated subset of nodes,pods,workloads,gangs.")] = None,
    bootstrap: Bootstrap = None,
    stdout: Annotated[bool, typer.Option(
        "--stdout", help="Print events as JSON lines instead of publishing to Kafka.")] = False,
    loglevel: LogLevel = "info",
) -> None:
    """Watch pods, nodes and Kueue workloads; publish allocation, inventory and queue events."""
    configure_logging(loglevel)
    overrides: dict[str, Any] = {}
    if kubeconfig is not None:
        overrides["kubeconfig"] = kubeconfig
    if context is not None:
        overrides["context"] = context
    if resync is not None:
        overrides["resync_period_s"] = resync
    if resources is not None:
        overrides["resources"] = [r.strip() for r in resources.split(",") if r.strip()]
    from_env = KubeWatchEnvSettings()  # a bad variable: the entry point names it in one line
    try:
        settings = KubeWatchSettings.model_validate({**from_env.model_dump(), **overrides})
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    asyncio.run(_main(settings, bootstrap, stdout))


async def _main(kube: KubeWatchSettings, bootstrap: str | None, stdout: bool) -> None:
    from gpusteward.collectors.kubernetes import KubeWatcher, api_client, roster

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    from kubernetes.config import ConfigException

    try:
        client = api_client(kube)
    except (ConfigException, OSError) as e:
        raise typer.BadParameter(f"cannot load the Kubernetes configuration: {e}") from e
    if stdout:
        await KubeWatcher(client, StdoutPublisher(), kube).run(stop)
        return
    from gpusteward import health, kafka, metrics
    from gpusteward.collectors.metrics import WatcherMetrics
    from gpusteward.collectors.transport.publisher import KafkaPublisher

    settings = kafka_settings(bootstrap)
    await kafka.wait_for_broker(settings)
    await kafka.ensure_topics(settings)
    # One registry: the publisher's delivery counters beside the watcher's own.
    watcher_metrics = WatcherMetrics()
    publisher = KafkaPublisher(settings, metrics=watcher_metrics)
    await publisher.start()
    state = health.Health()
    server = state.serve(settings.health_port) if settings.health_port else None
    port = settings.metrics.port
    metrics_server = (metrics.serve(watcher_metrics.registry, port, settings.metrics.addr)
                      if port else None)
    beating = asyncio.create_task(health.heartbeat(state, ready=lambda: publisher.healthy))
    try:
        # What it (or the watcher before it) published, read back to report the objects
        # deleted while no watcher ran.
        await KubeWatcher(client, publisher, kube, metrics=watcher_metrics,
                          read_back=functools.partial(roster.read, settings, kube)).run(stop)
    finally:
        beating.cancel()
        if server is not None:
            server.shutdown()
        if metrics_server is not None:
            metrics_server.stop()
        await publisher.stop()
