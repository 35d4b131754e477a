"""The read-back of the watcher's own topics: the last record of each object, deletions
ending it, and the deletion events of the objects a first list no longer has.

``tests/e2e/test_watcher_restart.py`` runs it through the deployed watcher and worker.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiokafka import ConsumerRecord

from gpusteward import topics
from gpusteward.collectors.kubernetes import KubeWatchSettings, roster
from gpusteward.schema import NodeInventory, PodAllocation, PodRef, QueueEvent
from gpusteward.settings import Settings

encode = msgspec.json.encode


def _records(*pairs: tuple[bytes | None, object | None]) -> list[ConsumerRecord]:
    return [ConsumerRecord("t", 0, offset, 0, 0, key,
                           None if value is None else value if isinstance(value, bytes)
                           else encode(value), None, 0, 0, [])
            for offset, (key, value) in enumerate(pairs)]


def _pod(name: str, phase: str, ts: float = 1.0) -> PodAllocation:
    return PodAllocation(ts=ts, node="n1", pod=PodRef("team-a", name, uid=f"uid-{name}"),
                         phase=phase, gpus=2)  # type: ignore[arg-type]


def _queued(name: str, state: str, cluster_queue: str = "cq") -> QueueEvent:
    return QueueEvent(ts=1.0, name=name, namespace="team-a", cluster_queue=cluster_queue,
                      state=state, kind="workload", uid=f"uid-{name}")  # type: ignore[arg-type]


def test_the_last_record_of_each_object_counts_and_a_deletion_ends_it() -> None:
    read = roster.Roster(max_keys=100)
    read.fold_allocations(_records(
        (b"n1", NodeInventory(ts=1.0, node="n1", gpu_count=8)),
        (b"n1/pod/uid-a", _pod("a", "running")),
        (b"n1/pod/uid-b", _pod("b", "running")),
        (b"n1/pod/uid-b", _pod("b", "deleted")),
        (b"n1/pod/uid-c", _pod("c", "running")),
        (b"n1/pod/uid-c", None),  # a tombstone
        (b"n1/pod/uid-d", b"not json"),
        (b"n2", NodeInventory(ts=1.0, node="n2", gpu_count=4)),
        (b"n2", NodeInventory(ts=2.0, node="n2", gpu_count=4, deleted=True)),
        (b"n1/pod/uid-a", _pod("a", "finished", ts=3.0)),
    ))
    read.fold_queue(_records(
        (b"cq", _queued("w1", "pending")),
        (b"other", _queued("w1", "admitted", cluster_queue="other")),  # one workload
        (b"cq", _queued("w2", "pending")),
        (b"cq", _queued("w2", "deleted")),
        # Without the uid the reflectors key workloads by: never matched, never said gone.
        (b"cq", msgspec.structs.replace(_queued("w3", "pending"), uid=None)),
    ))
    assert len(read) == 3 and read.unreadable == 1 and read.records == 15
    assert read.resources() == {"pods", "nodes", "workloads"}

    def nothing_exists(entity: roster.Entity) -> bool:
        return False

    (gone_pod,) = read.gone("pods", nothing_exists, 10.0)
    assert gone_pod == msgspec.structs.replace(_pod("a", "finished"), ts=10.0, phase="deleted")
    (gone_node,) = read.gone("nodes", lambda entity: entity == ("nodes", "n2"), 10.0)
    assert gone_node == NodeInventory(ts=10.0, node="n1", gpu_count=8, deleted=True)
    (gone_workload,) = read.gone("workloads", nothing_exists, 10.0)
    assert isinstance(gone_workload, QueueEvent)
    assert (gone_workload.name, gone_workload.cluster_queue, gone_workload.state,
            gone_workload.reason) == ("w1", "other", "deleted", roster.FOUND_GONE)
    assert len(read) == 0  # each resource leaves the roster once compared


def test_an_object_still_present_is_not_reported_gone() -> None:
    read = roster.Roster(max_keys=100)
    read.fold_allocations(_records((b"n1/pod/uid-a", _pod("a", "running"))))
    assert read.gone("pods", lambda entity: entity == ("pods", "uid-a"), 10.0) == []


def test_more_objects_than_the_bound_stop_the_read() -> None:
    read = roster.Roster(max_keys=2)
    with pytest.raises(roster.TooManyKeys):
        read.fold_allocations(_records(*[(f"n1/pod/uid-{i}".encode(), _pod(str(i), "running"))
                                         for i in range(3)]))


def test_topics_that_do_not_exist_read_as_nothing_published(settings: Settings) -> None:
    assert topics.ALLOCATIONS.name(settings) not in asyncio.run(_topic_names(settings))
    read = asyncio.run(roster.read(settings, KubeWatchSettings(readback_timeout_s=20)))
    assert len(read) == 0 and read.records == 0


async def _topic_names(settings: Settings) -> list[str]:
    from gpusteward import kafka

    return await kafka.list_topics(settings)
