"""The stream worker with the fleet agents registered, for the fleet e2e tests.

``gpusteward worker`` will run the fleet agents once ``create_app`` calls
:func:`gpusteward.streams.fleet.register_fleet_agent`; until then the tests
start this script, which does the same as the command plus that call.
Settings come from the environment (``GPUSTEWARD_*``), as for the command.
"""

from __future__ import annotations

import asyncio
import sys

from faust.worker import Worker

from gpusteward import kafka
from gpusteward.settings import Settings
from gpusteward.streams.app import create_app
from gpusteward.streams.fleet import register_fleet_agent


async def _ensure(settings: Settings) -> None:
    await kafka.wait_for_broker(settings)
    await kafka.ensure_topics(settings)


def main() -> None:
    settings = Settings()
    asyncio.run(_ensure(settings))
    app = create_app(settings, datadir=sys.argv[1])
    register_fleet_agent(app, settings)
    Worker(app, loglevel="warn", quiet=True, redirect_stdouts=False).execute_from_commandline()


if __name__ == "__main__":
    main()
