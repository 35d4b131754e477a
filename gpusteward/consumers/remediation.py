"""Remediation: actions become changes to the cluster, carefully.

The executor reads the actions topic and, for each action, decides and
records one outcome on the audit topic (``action-results``):

- ``dry_run``: the executor is not in execute mode (the default), or the
  action asked only for a dry run; the audit says what would have happened;
- ``skipped``: the idempotency key was already executed (a redelivery), or
  the backend found the effect already in place (the node was cordoned);
- ``executed`` / ``failed``: the backend carried it out, or could not.

Idempotency survives restarts: on start the executor reads the audit topic
and remembers every key it has executed. Backends are pluggable; the first
is the fleet simulator, where a cordon stops new pods landing on the node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

from gpusteward import kafka, topics
from gpusteward.schema import Action, ActionResult, Outcome
from gpusteward.settings import Settings

if TYPE_CHECKING:
    from gpusteward.collectors.simulator.engine import SimulatedCluster

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Carries out verbs on a cluster.

    A backend implements a verb as an async method of the verb's name
    (``cordon``, ``notify_owner``, ...) that takes the action and returns
    (outcome, detail); a verb it lacks is refused.
    """

    name: str


class SimulatorBackend:
    """Acts on a :class:`~gpusteward.collectors.simulator.engine.SimulatedCluster`."""

    name = "simulator"

    def __init__(self, cluster: SimulatedCluster) -> None:
        self.cluster = cluster

    async def cordon(self, action: Action) -> tuple[Outcome, str]:
        node = action.target.node
        sim_node = self.cluster.nodes.get(node or "")
        if sim_node is None:
            return "failed", f"no node {node!r} in the simulated cluster"
        if sim_node.cordoned:
            return "skipped", f"{node} is already cordoned"
        self.cluster.request_cordon(sim_node.name, action.reason)
        return "executed", f"cordoned {node}: no new pods will be scheduled there"

    async def notify_owner(self, action: Action) -> tuple[Outcome, str]:
        pod = action.target.pod
        if pod is None:
            return "failed", "notify_owner needs a pod"
        self.cluster.notify(pod, action.reason)
        return "executed", f"notified the owner of {pod.namespace}/{pod.name}"


def describe(action: Action) -> str:
    """What an action would do, in words, for dry runs and reviews."""
    target = action.target
    where = target.node or (f"{target.pod.namespace}/{target.pod.name}" if target.pod else "?")
    verbs = {
        "cordon": f"cordon node {where} (spec.unschedulable=true)",
        "notify_owner": f"notify the owner of {where}",
    }
    return f"would {verbs.get(action.verb, f'{action.verb} {where}')} because: {action.reason}"


class Executor:
    """Consumes actions, decides, acts through a backend and audits every decision."""

    def __init__(self, settings: Settings, backend: Backend, *, execute: bool = False,
                 group_id: str | None = None, actor: str = "gpusteward-executor",
                 on_result: Callable[[Action, ActionResult], None] | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.execute = execute
        self.group_id = group_id or f"{settings.topic_prefix}-remediation"
        self.actor = f"{actor}/{backend.name}"
        self.on_result = on_result
        self.executed_keys: set[str] = set()
        self._decode = msgspec.json.Decoder(Action).decode
        self._encode = msgspec.json.Encoder().encode
        self._audit_topic = topics.ACTION_RESULTS.name(settings)

    async def load_history(self) -> None:
        """Remember every idempotency key the audit topic records as executed."""
        decode = msgspec.json.Decoder(ActionResult).decode
        for record in await kafka.read_all(self.settings, self._audit_topic):
            try:
                result = decode(record.value or b"")
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if result.outcome == "executed":
                self.executed_keys.add(result.idempotency_key)

    async def decide(self, action: Action) -> ActionResult:
        """The outcome for one action; carries it out when it should."""
        outcome: Outcome
        if action.idempotency_key in self.executed_keys:
            outcome, detail = "skipped", "already executed (redelivered action)"
        elif not self.execute or action.dry_run:
            outcome, detail = "dry_run", describe(action)
        else:
            handler = getattr(self.backend, action.verb, None)
            if handler is None:
                outcome, detail = "refused", f"backend {self.backend.name} cannot {action.verb}"
            else:
                try:
                    outcome, detail = await handler(action)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # a backend failure is audited, not fatal
                    outcome, detail = "failed", f"{type(error).__name__}: {str(error)[:300]}"
        if outcome == "executed":
            self.executed_keys.add(action.idempotency_key)
        return ActionResult(
            idempotency_key=action.idempotency_key, verb=action.verb, target=action.target,
            outcome=outcome, detail=detail, actor=self.actor, ts=time.time(),
        )

    async def run(self, stop: asyncio.Event) -> None:
        await self.load_history()
        consumer = kafka.consumer(self.settings, topics.ACTIONS.name(self.settings),
                                  group_id=self.group_id)
        producer = kafka.producer(self.settings)
        await producer.start()
        await consumer.start()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for messages in batch.values():
                    for message in messages:
                        await self._handle(producer, message.value)
                if batch:
                    # The audit records are on the broker before the offsets move on.
                    await producer.flush()
                    await consumer.commit()
        finally:
            await consumer.stop()
            await producer.stop()

    async def _handle(self, producer: object, raw: bytes | None) -> None:
        try:
            action = self._decode(raw or b"")
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("skipping undecodable action: %s", error)
            return
        result = await self.decide(action)
        log.info("%s %s: %s", result.outcome, action.idempotency_key, result.detail)
        await producer.send(  # type: ignore[attr-defined]
            self._audit_topic, self._encode(result), key=action.idempotency_key.encode()
        )
        if self.on_result:
            self.on_result(action, result)


class NoBackend:
    """No cluster connected: every verb is refused (useful with ``--dry-run`` reviews)."""

    name = "none"
