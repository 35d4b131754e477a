"""The watcher against a real API server: DRA GPUs reported by their slices' uuids.

Marked ``cluster`` and skipped unless ``GPUSTEWARD_TEST_KUBECONFIG`` names a
kubeconfig (no cluster can run where the suite usually runs). It only reads:
list and watch, as the watcher's ClusterRole allows. What the double cannot
show is checked here: that the server's own ResourceClaim and ResourceSlice
JSON (``resource.k8s.io/v1``, NVIDIA's DRA driver ``gpu.nvidia.com``) reads as
the watcher expects. The expected holdings are computed independently, through
the client's typed models, and compared with what the watcher published (a pod
placed or ended between the two reads makes a difference: run it again).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest

from gpusteward.collectors.kubernetes import KubeWatcher, KubeWatchSettings, api_client
from gpusteward.schema import PodAllocation

from .conftest import RecordingPublisher

KUBECONFIG = os.environ.get("GPUSTEWARD_TEST_KUBECONFIG")
DRIVER = "gpu.nvidia.com"

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(KUBECONFIG is None, reason=(
        "needs a real Kubernetes cluster: set GPUSTEWARD_TEST_KUBECONFIG to a kubeconfig "
        "that may list and watch pods, nodes, resourceclaims, resourceclaimtemplates and "
        "resourceslices")),
]


def _watch_once(settings: KubeWatchSettings) -> tuple[KubeWatcher, RecordingPublisher]:
    """Run the watcher until its first lists are published, then stop it."""
    publisher = RecordingPublisher()
    watcher = KubeWatcher(api_client(settings), publisher, settings)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(watcher.run(stop))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not watcher.synced.is_set():
        assert not errors, errors
        assert time.monotonic() < deadline, "the watcher did not list the cluster in 2 min"
        time.sleep(0.1)
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
    assert not errors, errors
    return watcher, publisher


def _expected(client: Any) -> dict[tuple[str, str], set[str]]:
    """(namespace, pod) -> the GPU and MIG uuids its allocated gpu.nvidia.com claims give
    it, read through the typed models; pods whose devices no slice names are left out."""
    from kubernetes import client as k8s

    # Any: the models' fields are all Optional, and a real server fills the ones read here.
    resource: Any = k8s.ResourceV1Api(client)
    core: Any = k8s.CoreV1Api(client)
    uuids: dict[tuple[str, str], str] = {}
    for piece in resource.list_resource_slice().items:
        if piece.spec.driver != DRIVER:
            continue
        for device in piece.spec.devices or []:
            uuid = (device.attributes or {}).get("uuid")
            if uuid is not None and uuid.string:
                uuids[(piece.spec.pool.name, device.name)] = uuid.string
    claims = {(c.metadata.namespace, c.metadata.name): c
              for c in resource.list_resource_claim_for_all_namespaces().items}
    held: dict[tuple[str, str], set[str]] = {}
    for pod in core.list_pod_for_all_namespaces().items:
        if not pod.spec.node_name or not pod.spec.resource_claims:
            continue
        made = {s.name: s.resource_claim_name
                for s in (pod.status.resource_claim_statuses or [])}
        for entry in pod.spec.resource_claims:
            claim = claims.get((pod.metadata.namespace,
                                entry.resource_claim_name or made.get(entry.name)))
            status = claim.status if claim is not None else None
            if status is None or status.allocation is None or not status.reserved_for or \
                    status.reserved_for[0].uid != pod.metadata.uid:
                continue
            for result in status.allocation.devices.results or []:
                if result.driver == DRIVER and not result.admin_access and \
                        (result.pool, result.device) in uuids:
                    held.setdefault((pod.metadata.namespace, pod.metadata.name), set()).add(
                        uuids[(result.pool, result.device)])
    return held


def test_dra_gpus_are_reported_by_the_uuids_the_slices_publish() -> None:
    assert KUBECONFIG is not None
    settings = KubeWatchSettings(kubeconfig=KUBECONFIG, resources=["nodes", "pods", "claims"])
    watcher, publisher = _watch_once(settings)
    if not watcher.discover_dra():
        # A cluster before 1.34: watched without DRA, which is what must happen there.
        assert "resourceclaims" not in watcher.reflectors
        return
    assert {"resourceslices", "resourceclaims"} <= set(watcher.reflectors)
    reported: dict[tuple[str, str], set[str]] = {}
    for event in publisher.events:
        if isinstance(event, PodAllocation):
            reported[(event.pod.namespace, event.pod.name)] = set(event.device_ids)
    expected = _expected(watcher.client)
    assert {pod: reported.get(pod) for pod in expected} == expected


def test_doctor_counts_the_real_clusters_gpu_nodes_and_their_collectors() -> None:
    """``doctor``'s collectors check reads the server's own Node and Pod JSON: the GPU nodes
    it counts are those the client's typed models show advertising nvidia.com/gpu or MIG
    devices, or labelled by GPU Feature Discovery; every node it names is one of them."""
    from kubernetes import client as k8s

    from gpusteward.cli.doctor import check_collectors

    api = api_client(KubeWatchSettings(kubeconfig=KUBECONFIG))
    gpu_nodes: set[str] = set()
    for node in k8s.CoreV1Api(api).list_node().items:
        assert node.metadata is not None and node.metadata.name is not None
        capacity = (node.status.capacity if node.status is not None else None) or {}
        if any(k == "nvidia.com/gpu" or k.startswith("nvidia.com/mig-")
               for k, v in capacity.items() if v != "0") or (
                node.metadata.labels or {}).get("nvidia.com/gpu.present") == "true":
            gpu_nodes.add(node.metadata.name)
    check = check_collectors(api, 30)
    assert not check.detail.startswith("cannot list"), check.detail
    if not gpu_nodes:
        assert check.ok and check.detail.endswith("nothing to collect yet")
    elif check.ok:
        assert check.detail.endswith(f"each of the {len(gpu_nodes)} GPU nodes")
    elif not check.detail.startswith("no collector DaemonSet"):
        assert f" of {len(gpu_nodes)} GPU nodes run no ready collector" in check.detail
        named = {part.split(" (", 1)[0] for part in
                 check.detail.split(": ", 1)[1].rsplit(". Fix", 1)[0].split("; ")
                 if not part.startswith("and ")}
        assert named <= gpu_nodes, named - gpu_nodes
