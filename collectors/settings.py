"""Settings of the ``gpusteward collect`` processes (NVML, dcgm-exporter, Prometheus).

A separate model from :class:`gpusteward.settings.Settings` (which holds the
Kafka connection): the collectors run as a DaemonSet with their own knobs,
read from the environment with the ``GPUSTEWARD_COLLECT__`` prefix
(``GPUSTEWARD_COLLECT__INTERVAL_S=5``); command-line flags override them.
What only the NVML collector needs is nested under ``nvml``
(``GPUSTEWARD_COLLECT__NVML__EVENT_WAIT_MS=500``); the node name, the
interval and the publishing settings are shared by every source.
"""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpusteward.collectors.attribution import DEFAULT_SOCKET, NVIDIA_DRA_DRIVER
from gpusteward.settings import Folder

Compression = Literal["auto", "lz4", "gzip", "zstd", "snappy", "none"]


def default_node_name() -> str:
    """``NODE_NAME`` (set from the downward API in the DaemonSet), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


class NvmlSettings(BaseModel):
    """What only the NVML collector needs: its event wait and the kubelet's PodResources."""

    event_wait_ms: int = Field(
        1000, ge=10, le=60_000,
        description="Longest one nvmlEventSetWait blocks, ms; bounds how long stopping takes.")
    pod_resources_socket: str | None = Field(
        DEFAULT_SOCKET, description="The kubelet PodResources socket; None (or empty): no pod "
                                    "attribution (outside Kubernetes).")
    pod_resources_timeout_s: float = Field(5.0, gt=0, description="Timeout of one List call, s.")
    pod_resources_refresh_s: float = Field(
        5.0, gt=0, description="Seconds between List calls: a new pod goes unattributed at most "
                               "this long. dcgm-exporter lists on every scrape.")
    pod_resources_max_age_s: float = Field(
        30.0, gt=0, description="While List fails, the last answer is used this long, then "
                                "samples go out unattributed, not credited to a pod maybe gone.")
    proc_root: str | None = Field(
        "/host/proc", description="Where the host's /proc is mounted (read-only) in the "
        "collector: NVML names processes by host PID, and /proc/<pid>/cgroup names each one's "
        "pod, so a GPU shared by several pods (time-slicing, MPS) is split between them. "
        "None (or empty): no per-process attribution, devices go to pods by PodResources "
        "alone. A path that does not exist attributes nothing by process.")
    extra_gpu_resources: list[str] = Field(
        [], description="Resource names counted besides nvidia.com/gpu and nvidia.com/mig-*.")
    dra_drivers: list[str] = Field(
        [NVIDIA_DRA_DRIVER], description="DRA drivers whose devices, in the kubelet's "
        "dynamic_resources, are GPUs or MIG devices named as NVIDIA's DRA driver "
        "(gpu.nvidia.com) names them; other drivers' devices are ignored. Empty: DRA "
        "devices attribute nothing (the watcher's claims still do).")


class CollectSettings(BaseSettings):
    """What a collector reads, how often, and how it publishes."""

    model_config = SettingsConfigDict(env_prefix="GPUSTEWARD_COLLECT__",
                                      env_nested_delimiter="__", extra="ignore")

    node_name: str = Field(
        default_factory=default_node_name,
        description=(
            "Kubernetes node name, the key of every record; it must match the node name the "
            "allocation watcher sees. Defaults to $NODE_NAME; without it the dcgm source uses "
            "dcgm-exporter's Hostname label, the others the host name."
        ),
    )
    interval_s: float = Field(
        10.0, gt=0, le=3600,
        description=(
            "Seconds between two samples. 10 s matches dcgm-exporter's default collection "
            "interval (30 s in older releases); sampling faster only repeats its values."
        ),
    )
    nvml: NvmlSettings = Field(default_factory=NvmlSettings,
                               description="The NVML collector's own settings.")
    fake_nvml: str | None = Field(
        None, description="Path of a fake-NVML YAML description (tests/data/nvml/*.yaml) to "
                          "sample instead of the driver: for demos and tests. None: real NVML.")
    dcgm_url: str = Field(
        "http://127.0.0.1:9400/metrics",
        description="dcgm-exporter's /metrics; 9400 is its default port (hostPort on the node).",
    )
    scrape_timeout_s: float = Field(
        5.0, gt=0, description="Longest wait for one dcgm-exporter or Prometheus answer, seconds."
    )
    prometheus_url: str = Field(
        "http://127.0.0.1:9090",
        description=(
            "Base URL of the Prometheus that scrapes dcgm-exporter: one server, one pinned "
            "replica, a deduplicating querier (Thanos Query, Mimir; recommended for an HA "
            "pair) or the Service in front of an HA pair. Each node's readings are published "
            "once per scrape, in scrape order, whichever replica answers (docs/collectors.md)."
        ),
    )
    prometheus_nodes: list[str] = Field(
        default_factory=list,
        description=(
            "Kubernetes nodes the Prometheus source asks for (by the node label, see "
            "prometheus_node_label); empty means every node Prometheus knows, for one central "
            "collector per cluster."
        ),
    )
    prometheus_node_label: str | None = Field(
        None, min_length=1,
        description=(
            "The series label that holds the Kubernetes node name, which the samples are keyed "
            "by and the watcher's allocations join on: set when a scrape relabels "
            "__meta_kubernetes_pod_node_name into a label other than 'node' (some "
            "ServiceMonitors write it into 'instance'). None: 'node' where a series has it, else "
            "dcgm-exporter's Hostname, which names the node only when the exporter has "
            "NODE_NAME or host networking (a Hostname that is the exporter pod's name is "
            "refused)."
        ),
    )
    pod_labels: Literal["auto", "exported", "plain"] = Field(
        "auto",
        description=(
            "Which pod labels the Prometheus source trusts. 'exported': only exported_pod/... "
            "(ServiceMonitor with honorLabels: false); 'plain': pod/... as dcgm-exporter wrote "
            "them (honorLabels: true); 'auto': exported_* when present, else pod/... unless "
            "it names the exporter's own pod."
        ),
    )
    metrics_port: int = Field(
        9401, ge=0, le=65535,
        description=(
            "Port of the collector's own /metrics (0: do not serve). Not 9400, which is "
            "dcgm-exporter's on the same node."
        ),
    )
    metrics_addr: str = Field("0.0.0.0", description="Address the collector's /metrics binds.")
    buffer_dir: Folder | None = Field(
        None,
        description=(
            "Directory of the on-disk queue that holds records while Kafka is unreachable "
            "(and across restarts). None keeps them in memory only: lost on restart."
        ),
    )
    buffer_max_bytes: int = Field(
        256 * 1024 * 1024, ge=1024,
        description=(
            "Most bytes of records held while Kafka is unreachable; beyond it the oldest are "
            "dropped (counted and logged). 256 MiB hold about 21 h of an 8-GPU node at 1 Hz."
        ),
    )
    compression: Compression = Field(
        "auto",
        description="Kafka batch compression; 'auto' is lz4 when cramjam is installed, else gzip.",
    )
    batch_max_records: int = Field(
        500, ge=1, description="Most records sent in one delivery attempt (one flight)."
    )
    delivery_timeout_s: float = Field(
        5.0, gt=0,
        description=(
            "Longest wait for the broker to acknowledge a flight before it counts as failed and "
            "stays queued; short, so a hung broker is noticed within a few ticks."
        ),
    )
    retry_backoff_max_s: float = Field(
        5.0, gt=0,
        description=(
            "Cap of the exponential back-off between delivery attempts, seconds. Low so delivery "
            "resumes within seconds of the broker's return."
        ),
    )
