"""What the watcher (or the watcher before it) last said exists, read back at start.

A relist diffs against what *this process* delivered, so a watcher that starts
afresh (a new pod of its Deployment, a restart after a crash) never saw the pods,
workloads and nodes deleted while no watcher ran, and never says they are gone: the
worker kept such a pod's allocation live for ever (its GPUs counted used, an idle
episode open, a reclaim asked of a pod that is gone) and the fleet agent kept such a
workload waiting (its queue SLO breach, ETA and gang episodes open).

So at start the watcher reads back its own topics, up to the end offsets it finds
then (:func:`gpusteward.kafka.read_to_end`): the allocations topic (compacted, keyed
per pod and per node) and the queue topic (keyed by cluster queue, so folded per
workload or pending pod), keeping the last record of each object; a deletion event
(or a null tombstone) ends it. Once the first full list of a resource is published,
:meth:`Roster.gone` gives, for each object read back that the list does not have and
this process has not published, the deletion event a watched DELETE would have
produced: the object's last event with ``phase="deleted"`` (a pod's allocation),
``deleted=True`` (a node) or ``state="deleted"`` (a queue event, whose ``reason`` says
it was found gone at start), stamped with the time it was found gone.

The read keeps one record's value per live object (its raw bytes, decoded in full only
for the few found gone) and decodes each record as a slim struct: at 20,000 pods it
costs tens of MB for a few seconds (docs/collectors.md). It is bounded by
``readback_timeout_s`` and ``readback_max_keys``; a read-back that fails or exceeds
them is logged and counted, and the watcher carries on without it.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from aiokafka import ConsumerRecord

from gpusteward import kafka, topics
from gpusteward.collectors.kubernetes.settings import KubeWatchSettings
from gpusteward.schema import AllocationEvent, NodeInventory, PodAllocation, PodRef, QueueEvent
from gpusteward.settings import Settings

FOUND_GONE = "DeletedWhileNoWatcherRan"
"""The ``reason`` of a queue event the watcher publishes for a workload or pod it found
gone at start."""

Entity = tuple[str, str]
"""(reflector name, reflector key): ``("pods", uid)``, ``("nodes", name)``,
``("workloads", uid)``; the key is ``namespace/name`` where there is no uid, as the
reflectors key objects."""


class _PodEnd(msgspec.Struct, tag="pod"):
    node: str
    pod: PodRef
    phase: str


class _NodeEnd(msgspec.Struct, tag="node"):
    node: str
    deleted: bool = False


class _QueueEnd(msgspec.Struct):
    name: str
    namespace: str
    state: str
    kind: str | None = None
    uid: str | None = None


_read_allocation = msgspec.json.Decoder(_PodEnd | _NodeEnd).decode
_read_queued = msgspec.json.Decoder(_QueueEnd).decode
_allocation = msgspec.json.Decoder(AllocationEvent).decode
_queued = msgspec.json.Decoder(QueueEvent).decode


def _pod_entity(pod: PodRef) -> Entity:
    return "pods", pod.uid or f"{pod.namespace}/{pod.name}"


def _queue_entity(kind: str | None, uid: str | None, namespace: str, name: str
                  ) -> Entity | None:
    resource = {"pod": "pods", "workload": "workloads"}.get(kind or "")
    return None if resource is None else (resource, uid or f"{namespace}/{name}")


def entity_of(event: PodAllocation | NodeInventory | QueueEvent) -> Entity | None:
    """The object an event the watcher publishes is about; None for a queue event of
    unknown kind."""
    if isinstance(event, NodeInventory):
        return "nodes", event.node
    if isinstance(event, PodAllocation):
        return _pod_entity(event.pod)
    return _queue_entity(event.kind, event.uid, event.namespace, event.name)


class TooManyKeys(Exception):
    """More live objects read back than ``readback_max_keys``."""


class Roster:
    """The last record of each object on the watcher's topics, folded one batch at a time."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.allocations: dict[bytes, tuple[Entity, bytes]] = {}
        """Record key -> (the object, its last record's value)."""
        self.queued: dict[Entity, bytes] = {}
        """The object -> the value of its last queue event."""
        self.records = 0
        self.unreadable = 0
        """Records skipped as not decodable (another writer's, a future schema)."""

    def __len__(self) -> int:
        return len(self.allocations) + len(self.queued)

    def fold_allocations(self, records: list[ConsumerRecord]) -> None:
        for record in records:
            self.records += 1
            key = record.key
            if key is None:
                continue
            if record.value is None:  # a tombstone ends the key
                self.allocations.pop(key, None)
                continue
            try:
                event = _read_allocation(record.value)
            except msgspec.DecodeError:
                self.unreadable += 1
                continue
            if isinstance(event, _NodeEnd):
                ended, entity = event.deleted, ("nodes", event.node)
            else:
                ended, entity = event.phase == "deleted", _pod_entity(event.pod)
            if ended:
                self.allocations.pop(key, None)
            else:
                self.allocations[key] = (entity, record.value)
        self._bounded()

    def fold_queue(self, records: list[ConsumerRecord]) -> None:
        for record in records:
            self.records += 1
            if record.value is None:
                continue
            try:
                event = _read_queued(record.value)
            except msgspec.DecodeError:
                self.unreadable += 1
                continue
            if event.uid is None:
                # Written before queue events carried the uid the reflectors key objects
                # by: it could not be matched with the list, and a false deletion would end
                # a wait that goes on. Left alone, as before the read-back.
                continue
            entity = _queue_entity(event.kind, event.uid, event.namespace, event.name)
            if entity is None:
                continue
            if event.state == "deleted":
                self.queued.pop(entity, None)
            else:
                self.queued[entity] = record.value
        self._bounded()

    def _bounded(self) -> None:
        if len(self) > self.max_keys:
            raise TooManyKeys(f"more than {self.max_keys} live objects read back "
                              "(readback_max_keys)")

    def resources(self) -> set[str]:
        """The resources with objects read back and not reconciled yet."""
        return {entity[0] for entity, _ in self.allocations.values()} | {
            entity[0] for entity in self.queued}

    def gone(self, resource: str, exists: Callable[[Entity], bool], ts: float
             ) -> list[PodAllocation | NodeInventory | QueueEvent]:
        """The deletion events of the objects of ``resource`` read back that do not
        ``exist``, queue events first (as a watched pod's deletion is sent), stamped
        ``ts``; every object of ``resource`` leaves the roster."""
        out: list[PodAllocation | NodeInventory | QueueEvent] = []
        for entity, value in list(self.queued.items()):
            if entity[0] != resource:
                continue
            del self.queued[entity]
            if not exists(entity):
                out.append(msgspec.structs.replace(_queued(value), ts=ts, state="deleted",
                                                   reason=FOUND_GONE))
        for key, (entity, value) in list(self.allocations.items()):
            if entity[0] != resource:
                continue
            del self.allocations[key]
            if not exists(entity):
                event = _allocation(value)
                out.append(msgspec.structs.replace(event, ts=ts, deleted=True)
                           if isinstance(event, NodeInventory)
                           else msgspec.structs.replace(event, ts=ts, phase="deleted"))
        return out


async def read(settings: Settings, kube: KubeWatchSettings) -> Roster:
    """The roster as the watcher's topics hold it now; raises TimeoutError past
    ``readback_timeout_s`` and :class:`TooManyKeys` past ``readback_max_keys``."""
    roster = Roster(kube.readback_max_keys)
    allocations = topics.ALLOCATIONS.name(settings)

    def fold(records: list[ConsumerRecord]) -> None:
        if records[0].topic == allocations:
            roster.fold_allocations(records)
        else:
            roster.fold_queue(records)

    await kafka.read_to_end(settings, (allocations, topics.QUEUE.name(settings)), fold,
                            kube.readback_timeout_s)
    return roster

