"""The rendered RBAC grants exactly what each component needs, nothing more.

Computed from the rendered Roles, ClusterRoles and their bindings, per
ServiceAccount, as (API group, resource, verb) triples: a wildcard, an extra
verb, a new binding or a grant to another account fails here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from gpusteward.cli.doctor import COMPONENTS, NAMESPACE, Permission
from gpusteward.collectors.kubernetes import KubeWatchSettings
from gpusteward.sandbox.kube_api import KubeApiServer
from tests.collectors.kubernetes.conftest import RunningWatcher

pytestmark = pytest.mark.deploy

WATCHER = "gpusteward-watcher"
REMEDIATION = "gpusteward-remediation"

EXPECTED: dict[str, set[tuple[str, str, str]]] = {
    # Reads what it publishes: pods, nodes, Kueue workloads and their LocalQueues, the
    # objects that state a gang's size, and DRA's ResourceClaims and ResourceSlices.
    WATCHER: {
        (group, resource, verb)
        for group, resource in (("", "pods"), ("", "nodes"), ("kueue.x-k8s.io", "workloads"),
                                ("kueue.x-k8s.io", "localqueues"),
                                ("scheduling.x-k8s.io", "podgroups"),
                                ("scheduling.volcano.sh", "podgroups"),
                                ("jobset.x-k8s.io", "jobsets"), ("kubeflow.org", "pytorchjobs"),
                                ("kubeflow.org", "mpijobs"), ("kubeflow.org", "tfjobs"),
                                ("resource.k8s.io", "resourceclaims"),
                                ("resource.k8s.io", "resourceclaimtemplates"),
                                ("resource.k8s.io", "resourceslices"))
        for verb in ("get", "list", "watch")
    },
    # The remediation account: nothing at all in the shipped dry run (`act --dry-run`
    # calls no API), so a dry run is enforced by RBAC, not only by its flag.
}


# What the remediation-execute component grants an executor that acts: cordon/taint,
# evict, deactivate/requeue; reads before writes, pods of a node to drain, GPU-node count
# for the breaker, owner notices, deleting a plain Job's pod to requeue it, and reclaiming
# an idle pod's GPUs through its owner (the owner chain read, Deployments/StatefulSets
# scaled, Notebooks stopped, KEDA ScaledObjects read so as not to fight one, JobSets and
# training jobs suspended; restored by `act --restore`).
EXECUTE: set[tuple[str, str, str]] = {
    ("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "patch"),
    ("", "pods/eviction", "create"),
    ("", "pods", "get"), ("", "pods", "list"), ("", "pods", "patch"), ("", "pods", "delete"),
    ("", "events", "create"),
    ("kueue.x-k8s.io", "workloads", "get"), ("kueue.x-k8s.io", "workloads", "patch"),
    ("apps", "replicasets", "get"),
    ("apps", "deployments", "get"), ("apps", "deployments", "patch"),
    ("apps", "statefulsets", "get"), ("apps", "statefulsets", "patch"),
    ("kubeflow.org", "notebooks", "get"), ("kubeflow.org", "notebooks", "patch"),
    # A whole idle gang suspended, and resumed.
    ("jobset.x-k8s.io", "jobsets", "get"), ("jobset.x-k8s.io", "jobsets", "patch"),
    ("trainer.kubeflow.org", "trainjobs", "get"), ("trainer.kubeflow.org", "trainjobs", "patch"),
    *{("kubeflow.org", jobs, verb)
      for jobs in ("pytorchjobs", "tfjobs", "mpijobs", "xgboostjobs", "paddlejobs", "jaxjobs")
      for verb in ("get", "patch")},
    ("keda.sh", "scaledobjects", "list"), ("batch", "jobs", "get"),
}


def test_rbac_grants_exactly_the_listed_verbs(rendered):
    expected = {account: set(triples) for account, triples in EXPECTED.items()}
    if rendered.variant.endswith("+execute"):
        expected[REMEDIATION] = EXECUTE
    assert rendered.grants() == expected


def test_the_dry_run_account_can_change_nothing(rendered):
    """Where the executor only dry-runs, its account holds no grant and its pod mounts no
    token: a pod started with --execute by mistake, or taken over, is refused by the API
    server. Only the remediation-execute component binds the role and mounts the token."""
    pod = rendered.pod_spec(rendered.component("remediation"))
    acts = rendered.variant.endswith("+execute")
    assert pod["automountServiceAccountToken"] is acts
    assert (REMEDIATION in rendered.grants()) is acts
    doctor = COMPONENTS["remediation"]
    assert not doctor.needs
    # What `doctor --component remediation` insists the dry run lacks is every write the
    # execute role grants.
    assert triples(doctor.must_lack) == {t for t in EXECUTE if t[2] not in ("get", "list")}


def triples(needs: tuple[Permission, ...]) -> set[tuple[str, str, str]]:
    return {(p.group, f"{p.resource}/{p.subresource}" if p.subresource else p.resource,
             p.verb) for p in needs}


def test_doctor_asks_about_exactly_what_the_manifests_grant(rendered):
    """`gpusteward doctor --component` asks about every permission the component's account
    is granted and no other: the dry run's in the shipped shape, the execute set where the
    remediation-execute component is added, each about the account the workload runs as."""
    granted = rendered.grants()
    remediation = "remediation-execute" if rendered.variant.endswith("+execute") else (
        "remediation")
    for workload, component in (("watcher", "watcher"), ("remediation", remediation)):
        doctor = COMPONENTS[component]
        runs = rendered.component(workload)
        assert runs["metadata"]["namespace"] == NAMESPACE
        assert rendered.pod_spec(runs)["serviceAccountName"] == doctor.service_account
        assert len(triples(doctor.needs)) == len(doctor.needs), f"{component}: asked twice"
        assert triples(doctor.needs) == granted.get(doctor.service_account, set()), component


def test_no_wildcards_and_no_unbound_roles(rendered):
    bound = {b["roleRef"]["name"] for b in rendered.kind("RoleBinding")
             + rendered.kind("ClusterRoleBinding")}
    for role in rendered.kind("Role") + rendered.kind("ClusterRole"):
        assert role["metadata"]["name"] in bound, f"unbound {role['metadata']['name']}"
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), rule


def test_bound_accounts_are_the_ones_the_workloads_run_as(rendered):
    accounts = {
        w["metadata"]["labels"]["app.kubernetes.io/component"]:
            rendered.pod_spec(w).get("serviceAccountName")
        for w in rendered.workloads()
        if w["metadata"]["labels"].get("app.kubernetes.io/name") == "gpusteward"
    }
    assert accounts["watcher"] == WATCHER
    assert accounts["remediation"] == REMEDIATION
    # Everyone else runs under an account with no grants at all.
    others = {a for c, a in accounts.items() if c not in ("watcher", "remediation")}
    assert others and not others & set(rendered.grants())
    assert None not in others


@pytest.fixture(scope="module")
def watcher_requests() -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every request the watcher sends to a cluster that serves
    everything it can watch (Kueue and every gang CRD)."""
    with KubeApiServer(bookmark_interval_s=0.05) as api, \
            tempfile.TemporaryDirectory() as tmp:
        kubeconfig = api.write_kubeconfig(Path(tmp) / "kubeconfig")
        watcher = RunningWatcher(api, kubeconfig, KubeWatchSettings(
            kubeconfig=str(kubeconfig))).start()
        watcher.stop()
        sent = set()
        for request in api.requests:
            parts = request.path.strip("/").split("/")
            if request.path in ("/api", "/apis") or (parts[0] == "apis" and len(parts) <= 3):
                continue  # discovery: granted to every authenticated user
            group, resource = ("", parts[2]) if parts[0] == "api" else (parts[1], parts[3])
            verb = "watch" if request.query.get("watch") else "list"
            sent.add((group, resource, verb))
    return sent


def test_the_watcher_is_granted_every_request_it_sends(rendered, watcher_requests):
    """Sent by the real watcher, not copied from its code: a resource it starts watching
    without a grant (a 403 retried forever in a cluster) fails here."""
    assert ("kueue.x-k8s.io", "localqueues", "watch") in watcher_requests
    assert ("kubeflow.org", "pytorchjobs", "list") in watcher_requests
    assert ("resource.k8s.io", "resourceclaims", "watch") in watcher_requests
    assert watcher_requests <= rendered.grants()[WATCHER]
