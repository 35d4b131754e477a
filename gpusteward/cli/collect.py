"""``gpusteward collect nvml|dcgm|prometheus``: run one collector until SIGTERM or Ctrl-C.

The one production command that may load the sandbox: ``collect nvml`` with
``fake_nvml`` set samples the simulated world's fake NVML instead of the driver.

Every command builds a :class:`CollectSettings` from the environment
(``GPUSTEWARD_COLLECT__*``) with the flags given on top, serves the
collector's own ``/metrics``, and publishes through a
:class:`KafkaPublisher` that buffers while Kafka is away. The collectors
themselves are imported only when their command runs, so ``gpusteward
--help`` stays fast and a missing optional part fails only its own command.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpusteward.cli.common import Bootstrap, LogLevel, configure_logging, folder, kafka_settings

if TYPE_CHECKING:
    from gpusteward.collectors.settings import CollectSettings
    from gpusteward.settings import Settings

log = logging.getLogger(__name__)

collect_app = typer.Typer(help="Collect GPU samples and publish them to Kafka.",
                          no_args_is_help=True)

Node = Annotated[str | None, typer.Option(
    "--node", help="Node name, the record key (default: $NODE_NAME, then the host name).")]
Interval = Annotated[float | None, typer.Option(
    "--interval", help="Seconds between samples (default: 10).")]
MetricsPort = Annotated[int | None, typer.Option(
    "--metrics-port", help="Port of this collector's /metrics, 0 for none (default: 9401).")]
BufferDir = Annotated[Path | None, typer.Option(
    "--buffer-dir", callback=folder,
    help="Directory of the on-disk buffer used while Kafka is away.")]
BufferMaxBytes = Annotated[int | None, typer.Option(
    "--buffer-max-bytes", help="Bytes the buffer may hold before dropping the oldest.")]

Runner = Callable[..., Awaitable[None]]


def _settings(**flags: Any) -> CollectSettings:
    from gpusteward.collectors.settings import CollectSettings

    return CollectSettings(**{name: value for name, value in flags.items() if value is not None})


async def _ensure_topics_eventually(settings: Settings, stop: asyncio.Event) -> None:
    """Create the sample topics once Kafka answers; a collector does not wait for it."""
    from gpusteward import kafka, topics

    delay = 1.0
    while not stop.is_set():
        try:
            await kafka.ensure_topics(settings, [topics.SAMPLES, topics.HW_EVENTS])
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # A refused login or certificate does not pass with time as an outage does: said
            # at every try, naming the setting, while the records wait in the buffer.
            refused = await kafka.refusal(settings)
            if refused is not None:
                log.error("%s; records are buffered until it is corrected and the "
                          "collector restarted", refused)
            else:
                log.debug("cannot create topics yet: %r", error)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, 60.0)


def run_collector(runner: Runner, collect: CollectSettings, settings: Settings) -> None:
    """Run ``runner(collect, publisher, stop, metrics)`` until SIGTERM/SIGINT, then drain."""
    from gpusteward.collectors.metrics import CollectorMetrics
    from gpusteward.collectors.transport.publisher import KafkaPublisher

    async def main() -> None:
        metrics = CollectorMetrics()
        server = (metrics.serve(collect.metrics_port, collect.metrics_addr)
                  if collect.metrics_port else None)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        publisher = KafkaPublisher(settings, collect=collect, metrics=metrics)
        await publisher.start()
        topics_task = asyncio.create_task(_ensure_topics_eventually(settings, stop))
        log.info("collecting for node %s every %ss; /metrics on :%s", collect.node_name,
                 collect.interval_s, collect.metrics_port or "-")
        try:
            await runner(collect, publisher, stop, metrics)
        finally:
            stop.set()
            topics_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await topics_task
            await publisher.stop()
            if server is not None:
                server.shutdown()

    asyncio.run(main())


@collect_app.command()
def dcgm(
    url: Annotated[str | None, typer.Option(
        "--url", help="dcgm-exporter /metrics URL (default: http://127.0.0.1:9400/metrics).")
    ] = None,
    node: Node = None, interval: Interval = None, metrics_port: MetricsPort = None,
    buffer_dir: BufferDir = None, buffer_max_bytes: BufferMaxBytes = None,
    bootstrap: Bootstrap = None, loglevel: LogLevel = "info",
) -> None:
    """Scrape this node's dcgm-exporter (no NVML access needed)."""
    from gpusteward.collectors.dcgm import run_dcgm_collector

    configure_logging(loglevel)
    collect = _settings(dcgm_url=url, node_name=node, interval_s=interval,
                        metrics_port=metrics_port, buffer_dir=buffer_dir,
                        buffer_max_bytes=buffer_max_bytes)
    run_collector(run_dcgm_collector, collect, kafka_settings(bootstrap))


@collect_app.command()
def prometheus(
    url: Annotated[str | None, typer.Option(
        "--url", help="Prometheus base URL (default: http://127.0.0.1:9090).")] = None,
    only_node: Annotated[list[str] | None, typer.Option(
        "--only-node", help="Ask only for this node (repeatable) (default: every node).")
    ] = None,
    pod_labels: Annotated[str | None, typer.Option(
        "--pod-labels", help="auto, exported or plain (see docs/collectors.md).")] = None,
    node_label: Annotated[str | None, typer.Option(
        "--node-label", help="The label that holds the Kubernetes node name (default: node, "
                             "else Hostname; see docs/collectors.md).")] = None,
    interval: Interval = None, metrics_port: MetricsPort = None,
    buffer_dir: BufferDir = None, buffer_max_bytes: BufferMaxBytes = None,
    bootstrap: Bootstrap = None, loglevel: LogLevel = "info",
) -> None:
    """Read every node's DCGM series from a Prometheus that scrapes dcgm-exporter."""
    from gpusteward.collectors.prometheus import run_prometheus_collector

    configure_logging(loglevel)
    collect = _settings(prometheus_url=url, prometheus_nodes=only_node or None,
                        pod_labels=pod_labels, prometheus_node_label=node_label,
                        interval_s=interval,
                        metrics_port=metrics_port, buffer_dir=buffer_dir,
                        buffer_max_bytes=buffer_max_bytes)
    run_collector(run_prometheus_collector, collect, kafka_settings(bootstrap))


@collect_app.command()
def nvml(
    fake_nvml: Annotated[Path | None, typer.Option(
        "--fake-nvml", help="Sample this fake-NVML YAML description instead of the driver "
                            "(demos and tests).")] = None,
    node: Node = None, interval: Interval = None, metrics_port: MetricsPort = None,
    buffer_dir: BufferDir = None, buffer_max_bytes: BufferMaxBytes = None,
    bootstrap: Bootstrap = None, loglevel: LogLevel = "info",
) -> None:
    """Read this node's GPUs through NVML, with kubelet pod attribution.

    Its own settings come from GPUSTEWARD_COLLECT__NVML__* (the kubelet socket, the
    event wait); GPUSTEWARD_COLLECT__FAKE_NVML samples a YAML-described fake node.
    """
    try:
        from gpusteward.collectors.nvml import NvmlUnavailable, run_nvml_collector
    except ImportError as error:
        typer.echo(f"the NVML collector is not available in this build: {error}", err=True)
        raise typer.Exit(2) from error

    configure_logging(loglevel)
    collect = _settings(node_name=node, interval_s=interval, metrics_port=metrics_port,
                        buffer_dir=buffer_dir, buffer_max_bytes=buffer_max_bytes,
                        fake_nvml=None if fake_nvml is None else str(fake_nvml))
    runner: Runner = run_nvml_collector
    if collect.fake_nvml:  # the simulated world's GPUs (demo, tests): the sandbox's fake
        from gpusteward.sandbox.nvml_fake import FakeNvml

        runner = functools.partial(run_nvml_collector, nvml=FakeNvml.from_yaml(collect.fake_nvml))
    try:
        run_collector(runner, collect, kafka_settings(bootstrap))
    except NvmlUnavailable as error:  # no traceback: the one line says what is wrong
        typer.echo(f"gpusteward collect nvml: {error}", err=True)
        raise typer.Exit(1) from error
