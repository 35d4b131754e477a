"""Readiness follows the broker: a process that cannot reach it for a while is not ready.

A broker frozen by SIGSTOP accepts connections and answers nothing; the process
stays up, beats and was ready, and did no work. Its probe must say so, and say
ready again once the broker answers.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpusteward import health, kafka, topics
from gpusteward.broker import EmbeddedBroker, free_port


def _probe(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{health.READY_PATH}",
                                    timeout=2.0) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def _until(condition: object, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s}s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


def test_readiness_goes_false_while_the_broker_is_frozen(tmp_path: Path) -> None:
    with EmbeddedBroker(log_path=tmp_path / "tansu.log") as broker:
        settings = broker.settings().model_copy(update={"topic_prefix": "health"})
        state = health.Health(broker_silence_s=2.0)
        port = free_port()
        server = state.serve(port, "127.0.0.1")

        async def run() -> None:
            await kafka.ensure_topics(settings)
            names = [topics.SAMPLES.name(settings)]
            beating = asyncio.create_task(health.heartbeat(state))
            watching = asyncio.create_task(health.watch_topics(
                state, names, lambda: kafka.list_topics(settings), interval_s=0.5))
            state.set_ready(True, "topics exist")
            try:
                await _until(lambda: state.broker_silent_s > 0, 10.0)
                assert _probe(port)[0] == 200
                broker.freeze()
                try:
                    silent_for = await _until(lambda: not state.ready, 10.0)
                    code, body = await asyncio.to_thread(_probe, port)
                    assert code == 503 and "no answer from the broker" in str(body["reason"])
                    assert body["live"] is True  # up and beating: not to be restarted
                finally:
                    broker.thaw()
                await _until(lambda: state.ready, 15.0)
                print(f"not ready {silent_for:.1f}s after the freeze (bound 2 s)")
            finally:
                watching.cancel()
                beating.cancel()

        try:
            asyncio.run(run())
        finally:
            server.shutdown()


def test_a_broker_never_reached_does_not_count_as_silent() -> None:
    """Only a process whose broker once answered is judged by it (the publishers' health
    follows their buffer instead)."""
    state = health.Health(broker_silence_s=0.05)
    state.set_ready(True)
    time.sleep(0.1)
    assert state.ready
    state.broker_answered()
    assert state.ready
    time.sleep(0.1)
    assert not state.ready
