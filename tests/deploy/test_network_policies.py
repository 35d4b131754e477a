"""What the rendered NetworkPolicies let each component reach.

The base denies all traffic and opens what each component needs. A port left
closed does not show until the process tries it on a cluster (the weekly
report's webhook post failed its Job every week), so these tests evaluate the
policies the way the API server's network plugin does: a pod that some Egress
policy selects may send only what one of those policies' rules allows.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from tests.deploy.conftest import Rendered
from tests.deploy.test_manifests import SINKS

pytestmark = pytest.mark.deploy

HTTPS = 443
ALERTMANAGER = 9093
WEBHOOK_HOST = "203.0.113.7"  # outside the cluster (TEST-NET-3): where a webhook lives


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector matches ``labels`` (an empty selector matches every pod)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get(
            "values", [])
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True


def _peer_reaches(peer: dict[str, Any], host: str) -> bool:
    """Whether a `to` peer covers an address outside the cluster: only an ipBlock can."""
    block = peer.get("ipBlock")
    if block is None:  # a namespace or pod selector names pods, not outside hosts
        return False
    address = ipaddress.ip_address(host)
    return address in ipaddress.ip_network(block["cidr"]) and not any(
        address in ipaddress.ip_network(cidr) for cidr in block.get("except", []))


def _port_matches(entry: dict[str, Any], port: int) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in entry:  # every port of the protocol
        return True
    first = entry["port"]  # a named port is a container's, never a webhook's
    return isinstance(first, int) and first <= port <= entry.get("endPort", first)


def may_send(rendered: Rendered, pod: tuple[str | None, dict[str, str]], host: str,
             port: int) -> bool:
    """Whether a pod (its namespace, its labels) may open TCP ``port`` on ``host`` (outside
    the cluster) under the rendered NetworkPolicies of its namespace."""
    namespace, labels = pod
    policies = [p for p in rendered.kind("NetworkPolicy")
                if p["metadata"].get("namespace") == namespace
                and "Egress" in p["spec"].get("policyTypes", [])
                and selects(p["spec"]["podSelector"], labels)]
    if not policies:
        return True  # no Egress policy selects the pod: nothing is denied
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            peers = rule.get("to") or []
            ports = rule.get("ports") or []
            if (not peers or any(_peer_reaches(p, host) for p in peers)) and (
                    not ports or any(_port_matches(e, port) for e in ports)):
                return True
    return False


def pod_labels(rendered: Rendered, component: str) -> tuple[str, dict[str, str]]:
    """The namespace and the labels of ``component``'s pods."""
    workload = rendered.component(component)
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    labels: dict[str, str] = spec["template"]["metadata"]["labels"]
    return workload["metadata"]["namespace"], labels


def test_the_report_and_alerting_reach_their_https_webhooks(rendered):
    """The report's summary (Secret gpusteward-report) and the alerting consumer's
    GPUSTEWARD_WEBHOOK_URL go to an HTTPS host outside the cluster; the alerting
    consumer's GPUSTEWARD_ALERTMANAGER_URL to Alertmanager's 9093."""
    for component in ("report", "alerts"):
        assert may_send(rendered, pod_labels(rendered, component), WEBHOOK_HOST, HTTPS), (
            f"{rendered.variant}: {component} may not reach {WEBHOOK_HOST}:{HTTPS}")
    # Alertmanager's API port, wherever the cluster runs it.
    assert may_send(rendered, pod_labels(rendered, "alerts"), WEBHOOK_HOST, ALERTMANAGER)


def test_components_without_a_webhook_stay_shut_off_from_https(rendered):
    """The control: the evaluation above can say no, and the worker and the sinks, which
    talk only to Kafka, get no way out on 443."""
    for component in ("worker", *SINKS):
        assert not may_send(rendered, pod_labels(rendered, component), WEBHOOK_HOST, HTTPS), (
            f"{rendered.variant}: {component} may reach {WEBHOOK_HOST}:{HTTPS}")


def test_the_evaluation_follows_the_policy_rules():
    """The evaluator on its own: default deny, a port rule, a peer limit, no policy."""
    def policy(selector: dict[str, Any], *egress: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "NetworkPolicy", "metadata": {"name": "p"},
                "spec": {"podSelector": selector, "policyTypes": ["Egress"],
                         "egress": list(egress)}}

    deny = policy({})
    https = policy({"matchLabels": {"c": "a"}}, {"ports": [{"protocol": "TCP", "port": 443}]})
    in_cluster = policy({"matchLabels": {"c": "b"}}, {
        "to": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 443}]})
    rendered = Rendered("unit", [deny, https, in_cluster])
    assert may_send(rendered, (None, {"c": "a"}), WEBHOOK_HOST, HTTPS)
    assert not may_send(rendered, (None, {"c": "a"}), WEBHOOK_HOST, 80)
    assert not may_send(rendered, (None, {"c": "b"}), WEBHOOK_HOST, HTTPS)
    assert not may_send(rendered, (None, {"c": "z"}), WEBHOOK_HOST, HTTPS)
    assert may_send(Rendered("unit", [https]), (None, {"c": "z"}), WEBHOOK_HOST, HTTPS)
    # A policy applies in its own namespace only.
    assert may_send(rendered, ("elsewhere", {"c": "b"}), WEBHOOK_HOST, HTTPS)


def test_the_collector_gets_dns_and_kafka_in_its_own_namespace(rendered):
    """The NVML collector runs in a namespace of its own: the same default deny there, and
    the same DNS and Kafka egress as in gpusteward (so a patch narrowing Kafka's egress by
    the policy's name, as the production overlay's, narrows both), and nothing else."""
    namespace, labels = pod_labels(rendered, "collector")
    assert namespace != "gpusteward"
    assert not may_send(rendered, (namespace, labels), WEBHOOK_HOST, HTTPS)
    deny = rendered.named("NetworkPolicy", "gpusteward-default-deny", namespace)["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    own = rendered.named("NetworkPolicy", "gpusteward-dns-and-kafka", namespace)["spec"]
    pipeline = rendered.named("NetworkPolicy", "gpusteward-dns-and-kafka", "gpusteward")["spec"]
    assert selects(own["podSelector"], labels)
    assert own["egress"][:len(pipeline["egress"])] == pipeline["egress"]
