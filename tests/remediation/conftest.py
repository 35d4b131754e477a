"""Fixtures of the remediation tests: the API-server double with Kueue's controller."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.remediation.kubernetes import KubeSettings
from gpusteward.sandbox.kube_api import KUEUE_GROUP, KubeApiServer, kueue_deactivation


@pytest.fixture
def kube(kube_api: KubeApiServer) -> KubeApiServer:
    """A fresh API double, with Kueue evicting the workloads the backend deactivates."""
    kube_api.add_controller("Workload", kueue_deactivation, group=KUEUE_GROUP)
    return kube_api


@pytest.fixture
def kube_settings(kube: KubeApiServer, kubeconfig: Path) -> KubeSettings:
    """Backend settings on the double, with short waits so PDB retries take milliseconds."""
    return KubeSettings(kubeconfig=str(kubeconfig), eviction_backoff_s=0.01,
                        eviction_backoff_max_s=0.05, drain_timeout_s=0.5, requeue_timeout_s=2,
                        request_timeout_s=5)
