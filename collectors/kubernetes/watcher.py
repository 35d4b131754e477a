"""The process-level Kubernetes watcher: reflectors in threads, translation on asyncio.

:class:`KubeWatcher` starts one :class:`Reflector` per watched resource
(Dynamic Resource Allocation's ResourceSlices and ResourceClaims first, then
nodes, then pods, then Kueue's LocalQueues and Workloads, because a node's
GPUs may be its slices' devices, pods need their node's MIG strategy and
their claims, and workloads their LocalQueue's ClusterQueue, then the objects
that state a gang's size), hops their deltas
onto the event loop, runs them through the :class:`Translator` and hands the
events to a :class:`~gpusteward.collectors.transport.Publisher`. It is the
one module of the collectors that calls the ``kubernetes`` client
(read-only).

Kueue, the gang objects and DRA are optional: a cluster without their CRD
(for DRA, without ``resource.k8s.io/v1``: Kubernetes before 1.34) is watched
without them (one log line), and they are looked for again at every resync,
so installing the CRD or upgrading the cluster later needs no restart. A gang resource's
reflector is named ``plural.group`` (two groups serve ``podgroups``).

Given a ``read_back`` (:func:`.roster.read`, on Kafka), it reads back at start, beside its
first lists, what it or the watcher before it last published of each pod, workload and
node, and once a resource's first list is published it publishes the deletion of each
object read back that the list does not have (deleted while no watcher ran). A read-back
that fails is logged and counted, and the watcher carries on without it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gpusteward import edge
from gpusteward.collectors.kubernetes.dra import DRA_GROUP, DRA_VERSION
from gpusteward.collectors.kubernetes.reflector import (
    Delta,
    ListCall,
    Reflector,
    brief_error,
    node_key,
    object_key,
)
from gpusteward.collectors.kubernetes.roster import Entity, Roster, entity_of
from gpusteward.collectors.kubernetes.settings import KubeWatchSettings
from gpusteward.collectors.kubernetes.translate import (
    KUEUE_GROUP,
    Emitted,
    Translator,
)
from gpusteward.collectors.metrics import WatcherMetrics
from gpusteward.collectors.transport.publisher import Publisher
from gpusteward.schema import NodeInventory, PodAllocation, QueueEvent

log = logging.getLogger(__name__)

GANG_SOURCES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("podgroups", "scheduling.x-k8s.io", ("v1alpha1",)),
    ("podgroups", "scheduling.volcano.sh", ("v1beta1",)),
    ("jobsets", "jobset.x-k8s.io", ("v1alpha2", "v1alpha1")),
    ("pytorchjobs", "kubeflow.org", ("v1",)),
    ("mpijobs", "kubeflow.org", ("v2beta1", "v1")),
    ("tfjobs", "kubeflow.org", ("v1",)),
)
"""(plural, group, versions in order of preference) of the objects that state a gang's
size: the coscheduling plugin's and Volcano's PodGroups (``minMember``), JobSets and the
Kubeflow training jobs (replica counts). Each is watched where its CRD is served."""


READ_BACK = ("pods", "workloads", "nodes")
"""The resources whose objects deleted while no watcher ran are found by the read-back, in
the order their deletions are published (a node's pods before the node)."""


POOL_SIZE = 32
"""HTTP connections kept to the API server: each reflector holds one through its watch
(up to 13: nodes, pods, Kueue's two, six gang kinds, DRA's three), and the client's default
(five per CPU) is 10 on a two-CPU node, where the surplus were dropped, with a warning,
at every watch's end."""


def api_client(settings: KubeWatchSettings) -> Any:
    """A ``kubernetes`` ApiClient from a kubeconfig or the in-cluster service account.

    Its urllib3 pool retries a refused or dropped connection as by default, but not an
    answer with ``Retry-After``: urllib3 would sleep whatever the server asks, three times,
    inside the request, uncapped and deaf to a stop, and unseen by the watcher's metrics.
    The reflector heeds it instead (:mod:`.reflector`).
    """
    import os

    from kubernetes import client, config
    from urllib3.util.retry import Retry

    configuration = client.Configuration()
    configuration.retries = Retry(Retry.DEFAULT.total, respect_retry_after_header=False)
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize,
                                                POOL_SIZE)
    if settings.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return config.new_client_from_config(config_file=settings.kubeconfig,
                                         context=settings.context,
                                         client_configuration=configuration)


class KubeWatcher:
    """Runs the reflectors and publishes what the translator makes of their deltas."""

    def __init__(self, client: Any, publisher: Publisher,
                 settings: KubeWatchSettings | None = None,
                 clock: Callable[[], float] = time.time,
                 metrics: WatcherMetrics | None = None,
                 read_back: Callable[[], Awaitable[Roster]] | None = None) -> None:
        self.client = client
        self.publisher = publisher
        self.settings = settings or KubeWatchSettings()
        self.clock = clock
        self.refusals = edge.Refusals(log)
        """Deltas skipped as untranslatable, by resource and kind of fault."""
        self.translator = Translator(self.settings)
        self.reflectors: dict[str, Reflector] = {}
        self.synced = asyncio.Event()
        """Set once every started reflector's first list has been published."""
        self.published = 0
        """Events handed to the publisher."""
        self.processed = 0
        """Deltas translated (and their events published)."""
        self.metrics = metrics or WatcherMetrics()
        """Served by the process; give the publisher the same object so that its delivery
        counters share the registry."""
        self._published_as = {kind: self.metrics.events_published.labels(kind)
                              for kind in ("pod_allocation", "node_inventory", "queue")}
        # Read at scrape time, on the server's thread: two int reads, no lock needed.
        self.metrics.backlog.set_function(self._backlog)
        self.kueue_version: str | None = None
        self.gang_versions: dict[str, str] = {}
        """``plural.group`` -> the version watched, for the gang resources served."""
        self._unserved_logged: set[str] = set()
        self._stop = threading.Event()
        self._room = threading.Condition()
        """Guards ``_outstanding``; notified as published deltas make room."""
        self._outstanding = 0
        """Deltas handed over by the reflectors and not yet published."""
        self._threads: list[threading.Thread] = []
        self._consumer: asyncio.Task[None]
        self.read_back = read_back
        """Reads back what the watcher's topics hold (:func:`.roster.read`); None: no
        read-back (publishing to stdout, or tests of the watch alone)."""
        self._reading: asyncio.Task[Roster | None] | None = None
        self._unreconciled: set[str] = set()
        """Resources whose objects read back are not yet compared with their first list."""
        self._published_entities: set[Entity] = set()
        """Objects of an unreconciled resource this process has published: present, or
        deleted under its watch, whatever their first list says."""
        self.found_gone = 0
        """Objects read back that the first lists did not have, reported gone."""

    def _list_calls(self) -> dict[str, ListCall]:
        from kubernetes import client

        core = client.CoreV1Api(self.client)
        calls: dict[str, ListCall] = {}
        if "nodes" in self.settings.resources:
            calls["nodes"] = core.list_node
        if "pods" in self.settings.resources:
            calls["pods"] = core.list_pod_for_all_namespaces
        return calls

    def discover_kueue(self) -> str | None:
        """The preferred Kueue API version the server serves, or None without Kueue."""
        from kubernetes import client

        groups = client.ApisApi(self.client).get_api_versions(
            _request_timeout=self.settings.request_timeout_s)
        served = {v.version for g in groups.groups or [] if g.name == KUEUE_GROUP
                  for v in g.versions or []}
        return next((v for v in self.settings.kueue_versions if v in served), None)

    def _kueue_calls(self, version: str) -> dict[str, ListCall]:
        from kubernetes import client

        custom = client.CustomObjectsApi(self.client)

        def lister(plural: str) -> ListCall:
            def call(**kwargs: Any) -> Any:
                return custom.list_cluster_custom_object(KUEUE_GROUP, version, plural, **kwargs)
            return call

        return {"localqueues": lister("localqueues"), "workloads": lister("workloads")}

    def discover_dra(self) -> bool:
        """Whether the server serves Dynamic Resource Allocation's GA version."""
        from kubernetes import client

        groups = client.ApisApi(self.client).get_api_versions(
            _request_timeout=self.settings.request_timeout_s)
        return any(v.version == DRA_VERSION for g in groups.groups or [] if g.name == DRA_GROUP
                   for v in g.versions or [])

    def _dra_calls(self) -> dict[str, ListCall]:
        from kubernetes import client

        api = client.ResourceV1Api(self.client)
        return {"resourceslices": api.list_resource_slice,
                "resourceclaimtemplates": api.list_resource_claim_template_for_all_namespaces,
                "resourceclaims": api.list_resource_claim_for_all_namespaces}

    def discover_gangs(self) -> dict[str, tuple[str, str, str]]:
        """The gang resources served and not watched yet: ``plural.group`` -> (group,
        version, plural). A group/version the server does not know answers 404."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        custom = client.CustomObjectsApi(self.client)
        served: dict[tuple[str, str], set[str]] = {}

        def resources(group: str, version: str) -> set[str]:
            if (group, version) not in served:
                try:
                    listed = custom.get_api_resources(
                        group, version, _request_timeout=self.settings.request_timeout_s)
                    served[(group, version)] = {r.name for r in listed.resources or []}
                except ApiException as e:
                    if e.status != 404:
                        raise
                    served[(group, version)] = set()
            return served[(group, version)]

        found: dict[str, tuple[str, str, str]] = {}
        for plural, group, versions in GANG_SOURCES:
            name = f"{plural}.{group}"
            if name in self.gang_versions:
                continue
            version = next((v for v in versions if plural in resources(group, v)), None)
            if version is not None:
                found[name] = (group, version, plural)
            elif name not in self._unserved_logged:
                self._unserved_logged.add(name)
                log.info("%s is not served (no CRD); watching without it", name)
        return found

    async def run(self, stop: asyncio.Event) -> None:
        """Watch and publish until ``stop`` is set; a publisher error ends it (and is raised).

        A watcher runs once: make a new one to watch again.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[Delta]] = asyncio.Queue()

        def deliver(deltas: list[Delta]) -> None:
            # On a reflector's thread: wait while two pages' worth of deltas are not
            # published yet, so that a relist, delivered page by page, holds a few pages
            # of decoded objects at a time rather than the whole list (the reflector
            # decodes pages faster than the loop translates them).
            if not deltas:
                return
            with self._room:
                while (self._outstanding >= 2 * self.settings.page_size
                       and not self._stop.is_set()):
                    self._room.wait(0.1)
                self._outstanding += len(deltas)
            loop.call_soon_threadsafe(queue.put_nowait, deltas)

        def start(name: str, call: ListCall) -> Reflector:
            reflector = Reflector(name, call, deliver, self.settings, self._stop,
                                  key_of=node_key if name == "nodes" else object_key,
                                  metrics=self.metrics)
            self.reflectors[name] = reflector
            thread = threading.Thread(target=reflector.run, name=f"reflector-{name}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
            return reflector

        consumer = self._consumer = asyncio.create_task(self._consume(queue))
        if self.read_back is not None:
            self._unreconciled = set(READ_BACK)
            self._reading = asyncio.create_task(self._read_roster(self.read_back))
        try:
            # Order matters for the first pass: nodes need their DRA slices' devices, pods
            # their node's MIG strategy and their claims, workloads their LocalQueue's
            # ClusterQueue.
            if "claims" in self.settings.resources:
                await self._start_dra(start, queue, stop)
            for name, call in self._list_calls().items():
                reflector = start(name, call)
                await self._await_synced(reflector, queue, stop)
            if "workloads" in self.settings.resources:
                await self._start_kueue(start, queue, stop)
            if "gangs" in self.settings.resources:
                await self._start_gangs(start, queue, stop)
            await self._drain(queue)
            await self._reconcile()
            self.synced.set()
            kueue_check = loop.time() + self.settings.resync_period_s
            stopped = asyncio.ensure_future(stop.wait())
            try:
                while not stop.is_set():
                    await asyncio.wait({consumer, stopped}, timeout=1.0,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if consumer.done():
                        consumer.result()  # the publisher failed: raise its error
                    if loop.time() >= kueue_check:
                        # Optional resources whose CRD may have been installed since.
                        kueue_check = loop.time() + self.settings.resync_period_s
                        if "workloads" in self.settings.resources and \
                                self.kueue_version is None:
                            await self._start_kueue(start, queue, stop)
                        if "gangs" in self.settings.resources and \
                                len(self.gang_versions) < len(GANG_SOURCES):
                            await self._start_gangs(start, queue, stop)
                        if "claims" in self.settings.resources and \
                                not self.translator.dra_watched:
                            await self._start_dra(start, queue, stop)
                        if self._unreconciled:  # Kueue's first list, now served
                            await self._reconcile()
            finally:
                stopped.cancel()
        finally:
            if self._reading is not None:
                self._reading.cancel()
                await asyncio.gather(self._reading, return_exceptions=True)
            self._stop.set()
            for reflector in self.reflectors.values():
                reflector.stop()
            for thread in self._threads:
                await asyncio.to_thread(thread.join, 5.0)
            failed = consumer.done()  # it only ends by itself when the publisher raised
            if not failed:
                await self._drain(queue)
            consumer.cancel()
            # The consumer's own CancelledError is expected; a cancellation of run() itself
            # still propagates out of gather.
            await asyncio.gather(consumer, return_exceptions=True)
            if not failed:
                await self.publisher.flush()

    async def _read_roster(self, read_back: Callable[[], Awaitable[Roster]]
                           ) -> Roster | None:
        """The roster, or None (logged and counted) when it cannot be read."""
        started = time.monotonic()
        try:
            roster = await read_back()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._unreconciled.clear()
            self._published_entities.clear()
            self.metrics.readback_failures.labels(type(e).__name__).inc()
            what = (f"not done within readback_timeout_s ({self.settings.readback_timeout_s:g} "
                    "s)" if isinstance(e, TimeoutError) else brief_error(e))
            log.warning("reading back what the watcher published failed (%s): carrying on "
                        "without it, so pods, workloads and nodes deleted while no watcher "
                        "ran are not reported gone", what)
            return None
        seconds = time.monotonic() - started
        self.metrics.readback_seconds.set(seconds)
        self.metrics.readback_objects.set(len(roster))
        log.info("read back %d live objects (%d records, %d unreadable) in %.1f s",
                 len(roster), roster.records, roster.unreadable, seconds)
        return roster

    async def _reconcile(self) -> None:
        """Publish the deletion of each object read back that the first list of its
        resource (published by now) does not have; resources not listed yet (Kueue not
        served) wait for their first list."""
        if not self._unreconciled or self._reading is None:
            return
        roster = await self._reading  # bounded by readback_timeout_s
        if roster is None:
            return
        now = self.clock()
        published = self._published_entities
        for resource in READ_BACK:
            reflector = self.reflectors.get(resource)
            if resource not in self._unreconciled or reflector is None or \
                    not reflector.synced.is_set():
                continue
            known = reflector.known  # the reflector's thread writes it: look keys up only

            def exists(entity: Entity, known: dict[str, str] = known) -> bool:
                return entity in published or entity[1] in known

            gone = roster.gone(resource, exists, now)
            self._unreconciled.discard(resource)
            for event in gone:
                await self._send(event)
            if gone:
                named = sorted({entity[1] for event in gone
                                if (entity := entity_of(event)) is not None})
                self.found_gone += len(named)
                self.metrics.found_gone.labels(resource).inc(len(named))
                log.info("%s: %d deleted while no watcher ran, reported gone: %s%s",
                         resource, len(named), ", ".join(named[:5]),
                         ", ..." if len(named) > 5 else "")
                await self.publisher.flush()
        # Only the objects of resources still unreconciled (Kueue's, not served yet) matter.
        self._published_entities = {e for e in published if e[0] in self._unreconciled}

    async def _start_kueue(self, start: Callable[[str, ListCall], Reflector],
                           queue: asyncio.Queue[list[Delta]], stop: asyncio.Event) -> None:
        try:
            version = await asyncio.to_thread(self.discover_kueue)
        except Exception as e:
            log.warning("Kueue discovery failed (%s); retrying at the next resync", brief_error(e))
            return
        if version is None:
            log.info("Kueue is not served; watching without workloads")
            return
        self.kueue_version = version
        for name, call in self._kueue_calls(version).items():
            reflector = start(name, call)
            await self._await_synced(reflector, queue, stop)

    async def _start_dra(self, start: Callable[[str, ListCall], Reflector],
                         queue: asyncio.Queue[list[Delta]], stop: asyncio.Event) -> None:
        try:
            served = await asyncio.to_thread(self.discover_dra)
        except Exception as e:
            log.warning("DRA discovery failed (%s); retrying at the next resync",
                        brief_error(e))
            return
        if not served:
            if DRA_GROUP not in self._unserved_logged:
                self._unserved_logged.add(DRA_GROUP)
                log.info("%s/%s is not served (Kubernetes before 1.34): watching without "
                         "ResourceClaims, so GPUs pods get through DRA are not reported",
                         DRA_GROUP, DRA_VERSION)
            return
        # Before the claims' first list is translated: a waiting pod is completed by it.
        self.translator.dra_watched = True
        for name, call in self._dra_calls().items():
            await self._await_synced(start(name, call), queue, stop)

    async def _start_gangs(self, start: Callable[[str, ListCall], Reflector],
                           queue: asyncio.Queue[list[Delta]], stop: asyncio.Event) -> None:
        from kubernetes import client

        try:
            found = await asyncio.to_thread(self.discover_gangs)
        except Exception as e:
            log.warning("gang resource discovery failed (%s); retrying at the next resync",
                        brief_error(e))
            return
        custom = client.CustomObjectsApi(self.client)
        for name, (group, version, plural) in found.items():
            def call(*, _g: str = group, _v: str = version, _p: str = plural,
                     **kwargs: Any) -> Any:
                return custom.list_cluster_custom_object(_g, _v, _p, **kwargs)

            self.gang_versions[name] = version
            await self._await_synced(start(name, call), queue, stop)

    async def _await_synced(self, reflector: Reflector, queue: asyncio.Queue[list[Delta]],
                            stop: asyncio.Event) -> None:
        # The first list may take long (or retry forever while the API is down): wait in
        # short slices so a stop request is honoured.
        while not stop.is_set():
            if await asyncio.to_thread(reflector.synced.wait, 0.2):
                break
        await self._drain(queue)

    async def _drain(self, queue: asyncio.Queue[list[Delta]]) -> None:
        """Wait until every delta delivered so far is published (raise if publishing failed)."""
        joined = asyncio.ensure_future(queue.join())
        await asyncio.wait({joined, self._consumer}, return_when=asyncio.FIRST_COMPLETED)
        if not joined.done():
            joined.cancel()
            self._consumer.result()

    async def _consume(self, queue: asyncio.Queue[list[Delta]]) -> None:
        while True:
            # A helper per batch, so that no local keeps the last batch (up to a whole
            # relist of decoded objects) alive while waiting for the next one.
            await self._publish(await queue.get(), queue)

    def _translated(self, delta: Delta) -> list[Emitted]:
        """The events of one delta, or none when its object cannot be read or translates
        into something out of the schema's bounds (counted, logged once per kind): one
        odd object must not stop the watcher, nor make the worker refuse its record."""
        try:
            events = self.translator.apply(delta, self.clock())
            self._note_unresolved()
            return [edge.conforming(event) for event in events]
        except Exception as error:  # an object the translator cannot read is that object's
            self.refusals.note(f"{delta.resource} {edge.kind_of(error)}",
                               "skipping %s %s %s: %s", delta.resource, delta.type, delta.key,
                               edge.reason(error))
            return []

    def _note_unresolved(self) -> None:
        """Say once per pod that a DRA claim of it cannot be resolved to GPUs: such a pod
        may hold GPUs that no event reports (docs/collectors.md, "Dynamic Resource
        Allocation")."""
        unresolved = self.translator.dra_unresolved
        for namespace, pod, reasons in unresolved:
            self.metrics.dra_pods.labels(namespace).inc()
            log.warning("pod %s/%s gets devices through Dynamic Resource Allocation that the "
                        "watcher cannot resolve to GPUs, so they may go unreported: %s",
                        namespace, pod, "; ".join(reasons))
        unresolved.clear()

    def _backlog(self) -> float:
        """Deltas delivered by the reflectors and not yet through :meth:`_publish`."""
        delivered = sum(r.stats.deltas for r in list(self.reflectors.values()))
        return float(max(0, delivered - self.processed))

    async def _send(self, event: PodAllocation | NodeInventory | QueueEvent) -> None:
        if isinstance(event, QueueEvent):
            await self.publisher.queue(event)
            kind = "queue"
        else:
            await self.publisher.allocation(event)
            kind = "node_inventory" if isinstance(event, NodeInventory) else "pod_allocation"
        self._published_as[kind].inc()
        self.published += 1
        if self._unreconciled:
            entity = entity_of(event)
            if entity is not None and entity[0] in self._unreconciled:
                self._published_entities.add(entity)

    async def _publish(self, deltas: list[Delta], queue: asyncio.Queue[list[Delta]]) -> None:
        try:
            for delta in deltas:
                for event in self._translated(delta):
                    await self._send(event)
                self.processed += 1
            if queue.empty():
                await self.publisher.flush()
        finally:
            with self._room:
                self._outstanding -= len(deltas)
                self._room.notify_all()
            queue.task_done()
