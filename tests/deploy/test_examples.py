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

from gpusteward.alerting.alertmanager import Target, parse_targets
from gpusteward.remediation.executor import RemediationSettings
from tests.deploy.conftest import DEPLOY, REPO, VARIANTS, Rendered, kustomize
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
    # Every replica of kube-prometheus-stack's Alertmanager, by its headless Service.
    assert parse_targets(url) == [
        Target("http://alertmanager-operated.monitoring.svc:9093", dns=True)]
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


DEPLOY_DOC = REPO / "docs" / "deploy.md"
UPGRADE = "Upgrading from a release"
# kubectl's names for the kinds the pages name as `kind/name`.
KINDS = {"deploy": "Deployment", "deployment": "Deployment", "statefulset": "StatefulSet",
         "daemonset": "DaemonSet", "serviceaccount": "ServiceAccount", "cronjob": "CronJob",
         "kafkauser": "KafkaUser", "kafkatopic": "KafkaTopic", "clusterrole": "ClusterRole",
         "clusterrolebinding": "ClusterRoleBinding", "secret": "Secret"}
TARGET = rf"(?:{'|'.join(KINDS)})/[\w.-]+(?![\w./-])"  # not deploy/overlays/...
COMMAND = re.compile(rf"kubectl (?:-n ([\w-]+) )?([a-z]+(?: [a-z]+)?) (?:-\w )*((?:{TARGET} ?)+)")
# What the release before the collector's own namespace and the dry run without a role
# (2026-11-26) had that no variant renders now: the upgrade steps must delete each.
PREVIOUS_RELEASE_ONLY = {
    ("DaemonSet", "gpusteward", "gpusteward-collector"),
    ("ServiceAccount", "gpusteward", "gpusteward-collector"),
    ("ClusterRole", None, "gpusteward-remediation"),
    ("ClusterRoleBinding", None, "gpusteward-remediation"),
}


def named_objects(text: str) -> list[tuple[str, str, str | None, str]]:
    """(verb, kind, namespace, name) for each `kind/name` a kubectl command names; a
    command's lines joined, as the pages wrap them."""
    found = []
    for namespace, verb, targets in COMMAND.findall(re.sub(r"\s+", " ", text)):
        for target in targets.split():
            kind, name = target.split("/", 1)
            found.append((verb, KINDS[kind], namespace or None, name))
    return found


def ids(rendered: Rendered) -> set[tuple[str, str | None, str]]:
    return {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in rendered}


def test_each_object_a_command_in_the_pages_names_is_where_the_manifests_put_it(render):
    """`kubectl -n gpusteward logs daemonset/gpusteward-collector` after the collector moved
    answers NotFound: every kind/name a page's command names (the upgrade's deletions
    aside) is rendered by some variant, in the namespace the command gives."""
    rendered = set().union(*(ids(render(variant)) for variant in VARIANTS))
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = [(page.name, verb, kind, namespace, name) for page in pages
             for verb, kind, namespace, name in named_objects(page.read_text())]
    assert any(kind == "DaemonSet" and namespace == "gpusteward-node"
               for _, _, kind, namespace, _ in named)
    for page, verb, kind, namespace, name in named:
        if verb == "delete":
            continue
        assert (kind, namespace, name) in rendered, f"{page}: kubectl {verb} {kind} {name} " \
            f"in {namespace}: no variant renders it there"


def test_the_upgrade_deletes_what_the_previous_release_left_and_gives_the_collector_its_secret(
        render):
    """`kubectl apply -k` deletes nothing: an old collector DaemonSet would publish beside
    the new one, and the old ClusterRoleBinding would let the dry run's account act."""
    text = DEPLOY_DOC.read_text()
    upgrade = text[text.index(UPGRADE):text.index("Uninstall:")]
    deleted = {(kind, namespace, name)
               for verb, kind, namespace, name in named_objects(upgrade) if verb == "delete"}
    assert deleted == PREVIOUS_RELEASE_ONLY
    for variant in VARIANTS:
        assert not PREVIOUS_RELEASE_ONLY & ids(render(variant)), variant
    block = re.search(r"```\n(.*?)```", upgrade, re.S)
    assert block, "docs/deploy.md: the upgrade's commands are not in a code block"
    steps = re.sub(r"\s+", " ", block.group(1))
    assert "kubectl -n gpusteward-node create secret generic gpusteward-kafka" in steps
    assert steps.index("create secret") < steps.index("kubectl apply -k")
    # The old binding goes only once the new role is applied: an executor that acts keeps
    # its permissions.
    assert steps.index("kubectl apply -k") < steps.index("delete clusterrolebinding")
