"""What every command shares: Kafka settings from flags, topic creation, log set-up.

Kept apart from the command modules so that none of them imports another
(the report, collect and watch commands used to reach into the main CLI's
private helpers, and it into them).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Annotated

import typer

from gpusteward.settings import Settings

Bootstrap = Annotated[
    str | None,
    typer.Option("--bootstrap", envvar="GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS",
                 help="Kafka bootstrap servers (host:port,...)."),
]


def kafka_settings(bootstrap: str | None = None) -> Settings:
    """The settings from the environment, with ``--bootstrap`` winning when given."""
    settings = Settings()
    if bootstrap:
        kafka = settings.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        settings = settings.model_copy(update={"kafka": kafka})
    return settings


async def ensure_topics(settings: Settings) -> None:
    """Wait for the broker, then create any missing topic of the contract."""
    from gpusteward import kafka

    await kafka.wait_for_broker(settings)
    await kafka.ensure_topics(settings)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_consumer(settings: Settings, run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run a consumer with its health probe until SIGTERM or Ctrl-C, or until its topics
    vanish.

    Ready once its topics exist; live while its loop beats. SIGTERM (a pod being
    stopped) and Ctrl-C ask ``run`` to stop, so it finishes its batch (a sink flushes
    and commits) within the pod's grace period. A broker that comes back without the
    topics ends the process with an error, so its supervisor restarts it and the start
    creates them again.
    """
    from gpusteward import health, topics
    from gpusteward.kafka import list_topics

    async def main() -> str | None:
        state = health.Health()
        server = state.serve(settings.health_port) if settings.health_port else None
        beating = asyncio.create_task(health.heartbeat(state))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await ensure_topics(settings)
            state.set_ready(True, "topics exist")
            working = asyncio.ensure_future(run(stop))
            names = [spec.name(settings) for spec in topics.ALL]
            watching = asyncio.create_task(
                health.watch_topics(state, names, lambda: list_topics(settings)))
            await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
            if working.done():
                watching.cancel()
                await working
                return None
            stop.set()
            await asyncio.wait({working}, timeout=10.0)
            return watching.result()
        finally:
            beating.cancel()
            if server is not None:
                server.shutdown()

    try:
        failure = asyncio.run(main())
    except KeyboardInterrupt:
        return
    if failure is not None:
        typer.echo(f"error: {failure}; exiting so that the supervisor restarts this process",
                   err=True)
        raise typer.Exit(3)
