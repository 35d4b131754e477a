"""Fixtures of the remediation tests: a Kubernetes API double for the backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusteward.remediation.kubernetes import KubeSettings
from tests.remediation.kube_double import KubeDouble


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeDouble]:
    """A fresh Kubernetes API double for one test."""
    with KubeDouble(tmp_path) as double:
        yield double


@pytest.fixture
def kube_settings(kube: KubeDouble) -> KubeSettings:
    """Backend settings on the double, with short waits so PDB retries take milliseconds."""
    return KubeSettings(kubeconfig=str(kube.kubeconfig), eviction_backoff_s=0.01,
                        eviction_backoff_max_s=0.05, drain_timeout_s=0.5, requeue_timeout_s=2)
