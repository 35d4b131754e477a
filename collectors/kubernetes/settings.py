"""What the Kubernetes watcher watches and how it talks to the API server.

A model of its own so that the reflector (timeouts, paging, back-off), the
translator (queue and workload-kind defaults) and the CLI (which reads it
from ``GPUSTEWARD_KUBE__*``) share one definition without importing each
other.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

ResourceName = Literal["pods", "nodes", "workloads", "gangs", "claims"]


class KubeWatchSettings(BaseModel):
    """What the watcher watches and how it talks to the API server."""

    kubeconfig: str | None = Field(
        None, description="Kubeconfig file. None: in-cluster config when running in a pod "
        "(KUBERNETES_SERVICE_HOST set), else the default kubeconfig (~/.kube/config).")
    context: str | None = Field(None, description="Kubeconfig context; None: the current one.")
    resources: list[ResourceName] = Field(
        ["nodes", "pods", "workloads", "gangs", "claims"],
        description="Which resources to watch. Workloads are watched only where Kueue serves "
        "them; the watcher runs without Kueue and picks it up when it appears. Gangs are the "
        "objects that state a gang's size (coscheduling and Volcano PodGroups, JobSets, "
        "PyTorchJobs, MPIJobs, TFJobs), each watched where its CRD is served. Claims are "
        "Dynamic Resource Allocation's ResourceClaims and ResourceSlices (resource.k8s.io/v1, "
        "Kubernetes 1.34 and later), which say what GPUs a pod holds through DRA; watched "
        "where that version is served, looked for again at each resync.")
    dra_drivers: list[str] = Field(
        ["gpu.nvidia.com"], description="DRA drivers whose allocated devices are GPUs or MIG "
        "devices to report (NVIDIA's DRA driver is gpu.nvidia.com); other drivers' devices "
        "(NICs, other accelerators, NVIDIA's ComputeDomains) are ignored.")
    resync_period_s: float = Field(
        600.0, gt=0, description="Seconds between two full relists diffed against what was "
        "delivered. A relist costs one paged LIST; 10 min bounds how long a lost update "
        "(a bug anywhere on the path) can stay wrong.")
    watch_timeout_s: int = Field(
        300, ge=1, description="Server-side timeoutSeconds of one watch request. The watch "
        "is renewed from the last resourceVersion, so this only bounds a silent stall.")
    request_timeout_s: float = Field(
        30.0, gt=0, description="Connect and read timeout of LIST requests, seconds; a watch's "
        "read timeout is watch_timeout_s plus this.")
    page_size: int = Field(
        500, ge=1, description="Items per LIST page; 500 is client-go's default.")
    backoff_initial_s: float = Field(0.5, gt=0, description="First retry delay after an error.")
    backoff_max_s: float = Field(
        30.0, gt=0, description="Retry delay cap; delays double per consecutive failure.")
    retry_after_max_s: float = Field(
        60.0, gt=0, description="Longest wait a server's Retry-After (a 429 of API Priority "
        "and Fairness, a 5xx) imposes before the next request, seconds. The reflector waits "
        "at least what the server asks, up to this: the apiserver asks for 1 s or a few, "
        "and a proxy asking for an hour must not leave the watcher blind for an hour.")
    readback_timeout_s: float = Field(
        30.0, gt=0, description="Longest the read-back of the watcher's own topics at start "
        "may take, seconds. It runs beside the first lists and delays only the deletions it "
        "finds: 26,250 objects (46,250 records) read back in 0.9 s on the embedded broker. "
        "Past it the watcher carries on without the read-back, and objects deleted while no "
        "watcher ran stay live downstream (gpusteward_watch_readback_failures_total).")
    readback_max_keys: int = Field(
        200_000, ge=1, description="Most live objects (pods, nodes, workloads) the read-back "
        "keeps, about 1 KB each (their last record): 200 MB at most beside the first list's "
        "150 MiB, in the watcher's 1Gi. 10,000 GPUs are tens of thousands; past it the "
        "watcher carries on without the read-back.")
    kueue_versions: list[str] = Field(
        ["v1beta2", "v1beta1"], description="Kueue API versions in order of preference; the "
        "first one the server serves is used.")
    default_cluster_queue: str = Field(
        "default", description="Queue key of a pending pod that names no Kueue queue.")
    workload_kind_label: str = Field(
        "gpusteward.io/workload-kind", description="Pod label that states the workload kind "
        "(notebook, batch, inference) and overrides the owner-based rule.")
