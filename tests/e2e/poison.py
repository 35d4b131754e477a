"""Malformed records for every input topic of the worker, and a publisher that sends them.

Shared by the poison test (a few of each, in ``make test``) and the chaos
experiment (thousands, ``make chaos``), which both run them beside the
``faulty-fleet`` scenario through a real worker
(:func:`run_beside_faulty_fleet`). Each variant is one way a producer, a
broker or an attacker can break a record; the worker must dead-letter every
one of them with a reason and go on with the valid traffic beside it.
Values are built from a valid record of the topic (so that exactly one thing
is wrong with each) and keyed like real traffic, so they land in the
partitions the worker is busy with.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from gpusteward import kafka, topics
from gpusteward.collectors.transport.publisher import KafkaPublisher
from gpusteward.sandbox.pipeline import WorkerProcess
from gpusteward.sandbox.simulator import scenario as scenarios
from gpusteward.sandbox.simulator.engine import GroundTruth, SimulatedCluster
from gpusteward.schema import Action, DeadLetter, Finding
from gpusteward.settings import Settings
from gpusteward.topics import worker_group

START = 1_763_683_200.0  # the faulty-fleet scenario's start
NODES = [f"h100-{i}" for i in range(1, 7)]
NON_UTF8_KEY = b"junk-\xff\xfe"


def _valid(topic: topics.TopicSpec, node: str) -> tuple[bytes, dict[str, object]]:
    """A valid record of ``topic`` as (key, JSON document), for a node of the fleet."""
    ts = START + 60.0
    if topic is topics.SAMPLES:
        return node.encode(), {"ts": ts, "node": node, "source": "poison", "devices": [
            {"uuid": "GPU-poison", "index": 0, "model": "NVIDIA H100 80GB HBM3",
             "util_pct": 50.0, "ecc_sbe_volatile": 0}]}
    if topic is topics.HW_EVENTS:
        return node.encode(), {"ts": ts, "node": node, "kind": "ecc_sbe", "uuid": "GPU-poison",
                               "count": 1}
    if topic is topics.ALLOCATIONS:
        return node.encode(), {"type": "node", "ts": ts, "node": node, "gpu_count": 4,
                               "gpu_product": "NVIDIA H100 80GB HBM3", "spot": False}
    if topic is topics.QUEUE:
        return b"training", {"ts": ts, "name": "poison", "namespace": "ns", "gpus": 1,
                             "cluster_queue": "training", "state": "pending"}
    assert topic is topics.NODE_SUMMARIES
    return node.encode(), {"ts": ts, "node": node, "gpu_model": "NVIDIA H100 80GB HBM3",
                           "gpus_total": 4, "gpus_free": 0}


# The one integer and one float field of each topic's template the numeric variants break.
_INT_FIELD = {"samples": ("devices", "ecc_sbe_volatile"), "hw-events": ("count",),
              "allocations": ("gpu_count",), "queue": ("gpus",),
              "node-summaries": ("gpus_total",)}
_FLOAT_FIELD = {"samples": ("devices", "util_pct"), "hw-events": ("ts",),
                "allocations": ("ts",), "queue": ("ts",), "node-summaries": ("ts",)}


def _set(doc: dict[str, object], path: tuple[str, ...], raw: str) -> bytes:
    """``doc`` as JSON with the field at ``path`` (through the first device) set to ``raw``."""
    marker = "__POISON__"
    target: dict[str, object] = doc
    for part in path[:-1]:
        target = target[part][0]  # type: ignore[index]
    target[path[-1]] = marker
    return json.dumps(doc).replace(f'"{marker}"', raw).encode()


Variant = Callable[[topics.TopicSpec, str, random.Random], tuple[bytes | None, bytes]]


def _truncated(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    value = json.dumps(doc).encode()
    return key, value[: rng.randrange(1, len(value) - 1)]


def _wrong_types(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    doc["ts"] = "yesterday"
    return key, json.dumps(doc).encode()


def _huge_int(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    return key, _set(doc, _INT_FIELD[topic.suffix.split(".")[0]], str(2**70))


def _nan(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    return key, _set(doc, _FLOAT_FIELD[topic.suffix.split(".")[0]], "NaN")


def _infinite(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    return key, _set(doc, _FLOAT_FIELD[topic.suffix.split(".")[0]], "1e999")


def _absurd_ts(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    doc["ts"] = 1e308
    return key, json.dumps(doc).encode()


def _empty(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    return _valid(topic, node)[0], b""


def _other_schema(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key = _valid(topic, node)[0]
    other = topics.QUEUE if topic is not topics.QUEUE else topics.SAMPLES
    return key, json.dumps(_valid(other, node)[1]).encode()


def _unknown_version(topic: topics.TopicSpec, node: str,
                     rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    doc["schema"] = 99
    return key, json.dumps(doc).encode()


def _deep(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    key, doc = _valid(topic, node)
    return key, _set(doc, ("extra",), "[" * 5000 + "]" * 5000)


def _non_utf8_key(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    return NON_UTF8_KEY, json.dumps(_valid(topic, node)[1]).encode()


def _garbage(topic: topics.TopicSpec, node: str, rng: random.Random) -> tuple[bytes, bytes]:
    # 1 MB less the record overhead: the producer's default request limit is 1 MiB.
    return _valid(topic, node)[0], rng.randbytes(1_000_000)


VARIANTS: dict[str, Variant] = {
    "truncated": _truncated, "wrong_types": _wrong_types, "huge_int": _huge_int,
    "nan": _nan, "infinite": _infinite, "absurd_ts": _absurd_ts, "empty": _empty,
    "other_schema": _other_schema, "unknown_version": _unknown_version, "deep": _deep,
    "non_utf8_key": _non_utf8_key, "garbage_1mb": _garbage,
}
INPUT_TOPICS = (topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS, topics.QUEUE,
                topics.NODE_SUMMARIES)


@dataclass
class PoisonSent:
    """What the poison publisher sent: per topic name, the count of bad records."""

    by_topic: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_topic.values())


async def publish_poison(settings: Settings, per_variant: int, *, spread_s: float,
                         garbage_per_topic: int | None = None, seed: int = 7) -> PoisonSent:
    """Send ``per_variant`` records of every variant to every input topic, spread over about
    ``spread_s`` seconds (interleaved with whatever else is being published).

    ``garbage_per_topic``: how many of the 1 MB records (default ``per_variant``); a short
    test sends fewer, since each costs a megabyte through the broker and the worker.
    """
    rng = random.Random(seed)
    garbage = per_variant if garbage_per_topic is None else garbage_per_topic
    plan = [(topic, name) for topic in INPUT_TOPICS for name in VARIANTS
            for _ in range(garbage if name == "garbage_1mb" else per_variant)]
    rng.shuffle(plan)
    sent: dict[str, int] = {}
    producer = kafka.producer(settings, max_request_size=1_100_000)
    await producer.start()
    try:
        # Chunks sent without waiting for each acknowledgement (one round trip per record
        # would take minutes for the chaos run), each chunk acknowledged before the pause.
        chunk = 50
        pause = spread_s * chunk / max(1, len(plan))
        for start in range(0, len(plan), chunk):
            pending = []
            for topic, name in plan[start:start + chunk]:
                key, value = VARIANTS[name](topic, rng.choice(NODES), rng)
                pending.append(await producer.send(topic.name(settings), value, key=key))
                sent[topic.name(settings)] = sent.get(topic.name(settings), 0) + 1
            await asyncio.gather(*pending)
            await asyncio.sleep(pause)
    finally:
        await producer.stop()
    return PoisonSent(sent)


@dataclass
class PoisonRun:
    """A faulty-fleet run with poison beside it: what was sent, what came out."""

    truth: GroundTruth
    sent: PoisonSent
    dead: list[DeadLetter]
    findings: list[Finding]
    actions: list[Action]
    catch_up_s: float
    """Seconds from the publishers' end until the worker's group had committed every input."""


async def _dead_letters(settings: Settings, expected: int, timeout_s: float = 20.0
                        ) -> list[DeadLetter]:
    """The dead-letter topic, read until it holds ``expected`` records or time is up (a dead
    letter is sent before its record's offset is committed, not necessarily acknowledged)."""
    decode = msgspec.json.Decoder(DeadLetter).decode
    deadline = time.monotonic() + timeout_s
    while True:
        dead = [decode(r.value) for r in await kafka.read_all(
            settings, topics.DEADLETTER.name(settings))]
        if len(dead) >= expected or time.monotonic() > deadline:
            return dead
        await asyncio.sleep(0.5)


async def run_beside_faulty_fleet(settings: Settings, log_dir: Path, per_variant: int, *,
                                  garbage_per_topic: int, spread_s: float,
                                  catch_up_timeout_s: float = 60.0) -> PoisonRun:
    """Publish the faulty-fleet scenario and the poison at once to a fresh worker."""
    await kafka.ensure_topics(settings)
    spec = scenarios.load("faulty-fleet").model_copy(update={"acceleration": 0.0})
    cluster = SimulatedCluster(spec)
    publisher = KafkaPublisher(settings)
    await publisher.start()
    worker = WorkerProcess(settings, log_dir / "worker.log")
    worker.start()
    try:
        # Poison starts first and is spread over the valid run.
        poison = asyncio.create_task(publish_poison(
            settings, per_variant, garbage_per_topic=garbage_per_topic, spread_s=spread_s))
        truth = await cluster.run(publisher)
        sent = await poison
        stopped = time.monotonic()
        names = [t.name(settings) for t in INPUT_TOPICS]
        await kafka.wait_consumed(settings, worker_group(settings), names,
                                  timeout_s=catch_up_timeout_s)
        catch_up_s = time.monotonic() - stopped
        assert worker.alive, "the worker died"
    finally:
        worker.stop()
        await publisher.stop()
    findings = msgspec.json.Decoder(Finding).decode
    actions = msgspec.json.Decoder(Action).decode
    return PoisonRun(
        truth, sent, await _dead_letters(settings, sent.total),
        [findings(r.value) for r in await kafka.read_all(settings, topics.FINDINGS.name(settings))],
        [actions(r.value) for r in await kafka.read_all(settings, topics.ACTIONS.name(settings))],
        catch_up_s,
    )
