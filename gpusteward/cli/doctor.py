"""``gpusteward doctor``: check an environment before the first run, and say what to fix.

A first install fails in ways the processes report late and far apart: the
worker waits for a broker at a wrong address, the watcher is refused a list
it has no RBAC for, a stock dcgm-exporter leaves the hardware counters off so
the hardware rules stay silent, the NVML collector finds no kubelet socket, a
policy typo stops the worker. Each check here is one small function that
returns a :class:`Check` (name, ok, what was found or what to fix), asking
the real thing the way the process will: the Kafka admin client and the
topic contract, SelfSubjectAccessReviews through the official Kubernetes
client (what ``kubectl auth can-i`` asks), dcgm-exporter's page through the
dcgm collector's own source and field coverage, the policy through the
worker's loader. The command prints one line per check and exits 1 when any
failed, so a script or an init container can gate on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

import typer

from gpusteward.cli.common import Bootstrap, kafka_settings
from gpusteward.settings import Settings


class Check(NamedTuple):
    """One check's verdict: ``detail`` says what was found, or on failure what to fix."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Permission:
    """One RBAC verb on one resource, as a SelfSubjectAccessReview asks it."""

    verb: str
    resource: str
    group: str = ""
    subresource: str | None = None

    def __str__(self) -> str:
        where = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{self.verb} {where}" + (f".{self.group}" if self.group else "")


def _perms(verbs: str, resource: str, group: str = "", subresource: str | None = None
           ) -> list[Permission]:
    return [Permission(v, resource, group, subresource) for v in verbs.split()]


KUEUE = "kueue.x-k8s.io"
NEEDS: dict[str, tuple[Permission, ...]] = {
    # deploy/base/rbac.yaml, ClusterRole gpusteward-watcher: it lists and watches.
    # The gang kinds are watched only where their CRDs are installed, but granted always.
    "watcher": (*_perms("get list watch", "pods"), *_perms("get list watch", "nodes"),
                *_perms("get list watch", "workloads", KUEUE),
                *_perms("get list watch", "localqueues", KUEUE),
                *_perms("get list watch", "podgroups", "scheduling.x-k8s.io"),
                *_perms("get list watch", "podgroups", "scheduling.volcano.sh"),
                *_perms("get list watch", "jobsets", "jobset.x-k8s.io"),
                *(p for kind in ("pytorchjobs", "mpijobs", "tfjobs")
                  for p in _perms("get list watch", kind, "kubeflow.org"))),
    # deploy/base/rbac.yaml gpusteward-remediation plus the remediation-execute component:
    # every verb of remediation/kubernetes.py (its module docstring lists them by action).
    "remediation": (*_perms("get list patch", "nodes"), *_perms("get list patch delete", "pods"),
                    *_perms("create", "pods", subresource="eviction"),
                    *_perms("create", "events"), *_perms("get patch", "workloads", KUEUE),
                    *_perms("get", "replicasets", "apps"),
                    *_perms("get patch", "deployments", "apps"),
                    *_perms("get patch", "statefulsets", "apps"),
                    *_perms("get patch", "notebooks", "kubeflow.org")),
}
"""The Kubernetes permissions each component needs; a test keeps them equal to deploy/'s
ClusterRoles."""

CHECKS = ("kafka", "kube", "dcgm", "kubelet", "policy")


async def check_kafka(settings: Settings, timeout_s: float) -> list[Check]:
    """The broker answers, and every topic of the contract exists."""
    from gpusteward import kafka, topics

    where = settings.kafka.bootstrap_servers
    try:
        await kafka.wait_for_broker(settings, timeout_s)
        present = set(await kafka.list_topics(settings))
    except (TimeoutError, OSError) as error:
        return [Check("kafka", False, f"no broker answers at {where} ({error}); set "
                      "--bootstrap or GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS to a reachable "
                      "broker, and check its listeners and any TLS/SASL settings")]
    reached = Check("kafka", True, f"broker at {where} answers")
    missing = sorted({spec.name(settings) for spec in topics.ALL} - present)
    if missing:
        return [reached, Check("kafka topics", False, f"missing {', '.join(missing)}: every "
                               "gpusteward process creates the topics it needs when it starts; "
                               "where the broker forbids that, create them as docs/topics.md "
                               "lists (partitions, compaction)")]
    return [reached, Check("kafka topics", True, f"all {len(topics.ALL)} topics of the "
                           "contract exist")]


def kube_client(kubeconfig: str | None, context: str | None = None) -> Any:
    """The official client, configured as the watcher and the remediation backend are."""
    from gpusteward.collectors.kubernetes.settings import KubeWatchSettings
    from gpusteward.collectors.kubernetes.watcher import api_client

    return api_client(KubeWatchSettings(kubeconfig=kubeconfig, context=context))


def check_kube_access(client: Any, timeout_s: float) -> Check:
    """The API server answers with these credentials."""
    from kubernetes import client as k8s

    try:
        # The raw answer: its gitVersion is all we say, and a server (or proxy) that leaves
        # out the other fields still answers.
        response: Any = k8s.VersionApi(client).get_code(_request_timeout=timeout_s,
                                                        _preload_content=False)
        version = json.loads(response.data).get("gitVersion", "?")
    except Exception as error:  # any failure here is the finding itself
        return Check("kubernetes", False, f"cannot reach the API server ({_cut(error)}); set "
                     "--kubeconfig (or run in the cluster with the component's service "
                     "account) and check the credentials")
    return Check("kubernetes", True, f"API server {version} answers")


def check_rbac(client: Any, component: str, timeout_s: float) -> Check:
    """Every permission ``component`` needs is allowed, by SelfSubjectAccessReview."""
    from kubernetes import client as k8s

    authz = k8s.AuthorizationV1Api(client)
    denied: list[Permission] = []
    for need in NEEDS[component]:
        review = k8s.V1SelfSubjectAccessReview(spec=k8s.V1SelfSubjectAccessReviewSpec(
            resource_attributes=k8s.V1ResourceAttributes(
                verb=need.verb, resource=need.resource, group=need.group,
                subresource=need.subresource)))
        try:
            answer = authz.create_self_subject_access_review(review, _request_timeout=timeout_s)
        except Exception as error:  # reported as the check's failure
            return Check(f"rbac {component}", False, f"cannot ask the API server about "
                         f"{need} ({_cut(error)})")
        if answer.status is None or not answer.status.allowed:
            denied.append(need)
    if denied:
        return Check(f"rbac {component}", False, f"denied: {', '.join(map(str, denied))}; "
                     f"grant them to the {component}'s service account (deploy/base/rbac.yaml"
                     + (", deploy/components/remediation-execute" if component == "remediation"
                        else "") + ")")
    return Check(f"rbac {component}", True, f"all {len(NEEDS[component])} verbs allowed")


async def check_dcgm(url: str, timeout_s: float) -> Check:
    """dcgm-exporter's page has every field family the rules read (its counters are on)."""
    import aiohttp

    from gpusteward.collectors import dcgm
    from gpusteward.collectors.source import SourceError

    quiet = logging.getLogger(dcgm.__name__)
    level, quiet.level = quiet.level, logging.ERROR  # the verdict below says it once
    try:
        async with aiohttp.ClientSession() as session:
            source = dcgm.DcgmSource(url, "doctor", session, timeout_s=timeout_s)
            await source.collect()
    except SourceError as error:
        return Check("dcgm-exporter", False, f"{_cut(error)}; check --dcgm-url and that "
                     "dcgm-exporter runs on this node")
    finally:
        quiet.level = level
    lacking = [f for f in dcgm.FIELD_FAMILIES if f.name in source.coverage.missing]
    if lacking:
        said = "; ".join(f"{f.name} ({', '.join(f.metrics)}) for {f.readers}" for f in lacking)
        return Check("dcgm-exporter", False, f"counters off: {said}. Enable them in "
                     "dcgm-exporter's counters file (deploy/components/dcgm-exporter/"
                     "dcgm-metrics.csv)")
    return Check("dcgm-exporter", True, f"all {len(dcgm.FIELD_FAMILIES)} field families "
                 "present")


def check_kubelet_socket(path: str) -> Check:
    """The kubelet's PodResources socket is mounted where the NVML collector looks."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        return Check("kubelet socket", False, f"{path}: {error.strerror}; mount the host's "
                     "/var/lib/kubelet/pod-resources into the collector (hostPath) or set "
                     "GPUSTEWARD_COLLECT__NVML__POD_RESOURCES_SOCKET")
    if not stat.S_ISSOCK(mode):
        return Check("kubelet socket", False, f"{path} is not a socket; mount the kubelet's "
                     "pod-resources directory, not a copy of it")
    return Check("kubelet socket", True, f"{path} is a socket")


def check_policy(path: str | None) -> Check:
    """The rule policy the worker will load parses and validates."""
    from gpusteward.rules.policy import PolicyError
    from gpusteward.streams.policy_file import load_policy

    try:
        load_policy(path)
    except PolicyError as error:
        return Check("policy", False, f"{_cut(error, 600)}; fix the file (gpusteward rules "
                     "check FILE says the same)")
    return Check("policy", True, f"{path} loads" if path else "no file named: the defaults")


async def diagnose(settings: Settings, *, kubeconfig: str | None = None,
                   components: Iterable[str] = tuple(NEEDS), dcgm_url: str | None = None,
                   kubelet_socket: str | None = None, policy: str | None = None,
                   skip: Iterable[str] = (), timeout_s: float = 5.0) -> list[Check]:
    """Every check not skipped, in the order a first run meets them."""
    skipped = set(skip)
    found: list[Check] = []
    if "kafka" not in skipped:
        found += await check_kafka(settings, timeout_s)
    if "kube" not in skipped:
        try:
            client = kube_client(kubeconfig)
        except Exception as error:  # no configuration is a finding too
            found.append(Check("kubernetes", False, f"no configuration ({_cut(error)}); set "
                               "--kubeconfig or run in the cluster"))
        else:
            access = await asyncio.to_thread(check_kube_access, client, timeout_s)
            found.append(access)
            if access.ok:
                for component in components:
                    found.append(await asyncio.to_thread(check_rbac, client, component,
                                                         timeout_s))
    if "dcgm" not in skipped and dcgm_url:
        found.append(await check_dcgm(dcgm_url, timeout_s))
    if "kubelet" not in skipped and kubelet_socket:
        found.append(check_kubelet_socket(kubelet_socket))
    if "policy" not in skipped:
        found.append(check_policy(policy))
    return found


def _cut(error: BaseException, limit: int = 300) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def doctor(
    bootstrap: Bootstrap = None,
    kubeconfig: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_KUBE__KUBECONFIG",
        help="Kubeconfig; none: in-cluster, else ~/.kube/config.")] = None,
    component: Annotated[list[str] | None, typer.Option(
        "--component", help="Whose RBAC to check: watcher, remediation (repeat; default "
        "both).")] = None,
    dcgm_url: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_COLLECT__DCGM_URL",
        help="dcgm-exporter's /metrics to check for the counters the rules need.")] = None,
    kubelet_socket: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_COLLECT__NVML__POD_RESOURCES_SOCKET",
        help="The kubelet PodResources socket to look for (the NVML collector's).")] = None,
    policy: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_POLICY_FILE", help="The rule policy file to load.")] = None,
    skip: Annotated[list[str] | None, typer.Option(
        "--skip", help=f"A check to leave out ({', '.join(CHECKS)}; repeat).")] = None,
    timeout_s: Annotated[float, typer.Option(
        "--timeout", help="Seconds each remote check may take.")] = 5.0,
) -> None:
    """Check Kafka and its topics, Kubernetes access and RBAC, dcgm-exporter's counters, the
    kubelet socket and the policy file; say what to fix, exit 1 on any fault."""
    components = component or list(NEEDS)
    unknown = sorted(set(components) - set(NEEDS)) + sorted(set(skip or ()) - set(CHECKS))
    if unknown:
        raise typer.BadParameter(f"unknown: {', '.join(unknown)} (components: "
                                 f"{', '.join(NEEDS)}; checks: {', '.join(CHECKS)})")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the verdict says it once
    checks = asyncio.run(diagnose(
        kafka_settings(bootstrap), kubeconfig=kubeconfig, components=components,
        dcgm_url=dcgm_url, kubelet_socket=kubelet_socket, policy=policy, skip=skip or (),
        timeout_s=timeout_s))
    for check in checks:
        typer.echo(f"{'ok  ' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    faults = [c.name for c in checks if not c.ok]
    if faults:
        typer.echo(f"{len(faults)} fault(s): {', '.join(faults)}", err=True)
        raise typer.Exit(1)
