"""The patches a user is told to apply render and do what they are said to do.

A commented example in an overlay or a snippet in docs/deploy.md is not rendered
by the other checks, so a renamed Deployment or variable would leave it broken
until someone pastes it on a cluster. Each is taken from the text the user reads,
applied as an overlay of ours, and rendered with the real kubectl.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gpusteward.remediation.executor import RemediationSettings
from tests.deploy.conftest import DEPLOY, REPO, Rendered, kustomize
from tests.deploy.reads import kubernetes_processes, unread
from tests.deploy.test_network_policies import may_send, pod_labels

pytestmark = pytest.mark.deploy

PRODUCTION = DEPLOY / "overlays" / "production"


def commented_patch(text: str, marker: str) -> list[dict[str, Any]]:
    """The commented-out `patches:` entry that follows the comment line holding ``marker``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("  # - "))
    block = []
    for line in lines[first:]:
        if not line.startswith("  # "):
            break
        block.append(line[len("  # "):])
    patches: list[dict[str, Any]] = yaml.safe_load("\n".join(block))
    return patches


def documented_patch(text: str, step: str) -> list[dict[str, Any]]:
    """The ```yaml block of the numbered step of docs/deploy.md that starts with ``step``."""
    after = text[text.index(step):]
    match = re.search(r"```yaml\n(.*?)```", after, re.S)
    assert match, f"docs/deploy.md: no ```yaml block after {step!r}"
    patches: list[dict[str, Any]] = yaml.safe_load(textwrap.dedent(match.group(1)))
    return patches


def render_with(kubectl: str, directory: Path, patches: list[dict[str, Any]],
                components: tuple[str, ...] = ()) -> Rendered:
    """Production with ``patches`` (and ``components``) on top, as a user's overlay."""
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(PRODUCTION, directory)],
        "components": [os.path.relpath(DEPLOY / c, directory) for c in components],
        "patches": patches,
    }))
    return Rendered("example", kustomize(kubectl, directory, "--load-restrictor",
                                         "LoadRestrictionsNone"))


def env_of(rendered: Rendered, component: str) -> dict[str, Any]:
    (container,) = rendered.pod_spec(rendered.component(component))["containers"]
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_commented_alertmanager_patch_points_the_alerts_pod_at_alertmanager(
        kubectl, tmp_path):
    patches = commented_patch((PRODUCTION / "kustomization.yaml").read_text(),
                              "Findings to Alertmanager")
    rendered = render_with(kubectl, tmp_path, patches)
    url = env_of(rendered, "alerts")["GPUSTEWARD_ALERTMANAGER_URL"]
    assert url == "http://alertmanager-operated.monitoring:9093"
    assert not unread(kubernetes_processes(rendered))
    # The NetworkPolicies let the alerting pod out to that port.
    port = urlsplit(url).port
    assert port is not None
    assert may_send(rendered, pod_labels(rendered, "alerts"), "203.0.113.7", port)
    assert "GPUSTEWARD_ALERTMANAGER_URL" not in env_of(
        render_with(kubectl, tmp_path, []), "alerts"), "the example must stay commented"


def test_the_documented_enabled_rules_patch_lets_the_executor_act_for_that_rule(
        kubectl, tmp_path, monkeypatch):
    text = (REPO / "docs" / "deploy.md").read_text()
    patches = documented_patch(text, "9. Remediation is dry-run")
    rendered = render_with(kubectl, tmp_path, patches, ("components/remediation-execute",))
    (container,) = rendered.pod_spec(rendered.component("remediation"))["containers"]
    assert container["args"][:2] == ["act", "--execute"]
    assert not unread(kubernetes_processes(rendered))
    value = env_of(rendered, "remediation")["GPUSTEWARD_REMEDIATION__ENABLED_RULES"]
    monkeypatch.setenv("GPUSTEWARD_REMEDIATION__ENABLED_RULES", value)
    settings = RemediationSettings()
    assert settings.enables("ecc_dbe")
    assert not settings.enables("idle_holder")
