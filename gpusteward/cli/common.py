"""What every command shares: Kafka settings from flags, topic creation, log set-up.

Kept apart from the command modules so that none of them imports another
(the report, collect and watch commands used to reach into the main CLI's
private helpers, and it into them).
"""

from __future__ import annotations

import logging
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
