"""``gpusteward doctor``: check an environment before the first run, and say what to fix.

A first install fails in ways the processes report late and far apart: the
worker waits for a broker at a wrong address, the watcher is refused a list
it has no RBAC for, a stock dcgm-exporter leaves the hardware counters off so
the hardware rules stay silent, the NVML collector finds no kubelet socket, the
collector DaemonSet's selector or tolerations leave GPU nodes out (the rules never see
them), a policy typo stops the worker. Each check here is one small function that
returns a :class:`Check` (name, ok, what was found or what to fix), asking
the real thing the way the process will: the Kafka admin client and the
topic contract, SubjectAccessReviews about each component's service account
through the official Kubernetes client (what ``kubectl auth can-i --as``
asks: the permissions of whoever runs doctor are not the component's),
dcgm-exporter's page through the dcgm collector's own source and field
coverage, the policy through the worker's loader. The command prints one
line per check and exits 1 when any failed, so a script or an init container
can gate on it.
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
from gpusteward.errors import ConfigError
from gpusteward.settings import Settings


class Check(NamedTuple):
    """One check's verdict: ``detail`` says what was found, or on failure what to fix."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Permission:
    """One RBAC verb on one resource, as an access review asks it."""

    verb: str
    resource: str
    group: str = ""
    subresource: str | None = None

    def __str__(self) -> str:
        where = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{self.verb} {where}" + (f".{self.group}" if self.group else "")


def _perms(verbs: str, resource: str, group: str = "", subresource: str | None = None
           ) -> tuple[Permission, ...]:
    return tuple(Permission(v, resource, group, subresource) for v in verbs.split())


@dataclass(frozen=True)
class Component:
    """Who a component runs as in deploy/, and what it needs of the Kubernetes API there."""

    service_account: str
    """The ServiceAccount its workload runs as (deploy/base/rbac.yaml)."""
    needs: tuple[Permission, ...]
    granted_in: str
    """The manifests that grant ``needs``: where to look when one is denied."""
    must_lack: tuple[Permission, ...] = ()
    """What its account must not be allowed: a grant here is a fault too."""
    must_lack_why: str = ""
    """Why, and what to do about such a grant."""


KUEUE = "kueue.x-k8s.io"
RBAC = "deploy/base/rbac.yaml"
EXECUTE_RBAC = "deploy/components/remediation-execute"
NAMESPACE = "gpusteward"
"""The namespace deploy/base puts the watcher and the executor in (every component but the
NVML collector, which calls no API and runs in ``gpusteward-node``)."""

# ClusterRole gpusteward-watcher: it lists and watches. The gang kinds are watched only
# where their CRDs are installed, and DRA's claims, templates and slices only where
# resource.k8s.io/v1 is served, but granted always.
WATCHER_NEEDS = (*_perms("get list watch", "pods"), *_perms("get list watch", "nodes"),
                 *_perms("get list watch", "workloads", KUEUE),
                 *_perms("get list watch", "localqueues", KUEUE),
                 *_perms("get list watch", "podgroups", "scheduling.x-k8s.io"),
                 *_perms("get list watch", "podgroups", "scheduling.volcano.sh"),
                 *_perms("get list watch", "jobsets", "jobset.x-k8s.io"),
                 *(p for kind in ("pytorchjobs", "mpijobs", "tfjobs")
                   for p in _perms("get list watch", kind, "kubeflow.org")),
                 *(p for kind in ("resourceclaims", "resourceclaimtemplates", "resourceslices")
                   for p in _perms("get list watch", kind, "resource.k8s.io")))
TRAINING_JOB_RESOURCES = ("pytorchjobs", "tfjobs", "mpijobs", "xgboostjobs", "paddlejobs",
                          "jaxjobs")
"""The Kubeflow training jobs a gang reclaim suspends (remediation.kubernetes.TRAINING_JOBS)."""
# ClusterRole gpusteward-remediation-execute, which the remediation-execute component binds
# for `act --execute`: every verb of remediation/kubernetes.py (its module docstring lists
# them by action). The shipped dry run (`act --dry-run`, no backend) calls no API, and its
# account is granted nothing.
EXECUTE_NEEDS = (*_perms("patch", "nodes"), *_perms("create", "pods", subresource="eviction"),
                 *_perms("patch", "workloads", KUEUE),
                 *_perms("get list", "nodes"), *_perms("get list patch delete", "pods"),
                 *_perms("create", "events"), *_perms("get", "workloads", KUEUE),
                 *_perms("get", "replicasets", "apps"),
                 *_perms("get patch", "deployments", "apps"),
                 *_perms("get patch", "statefulsets", "apps"),
                 *_perms("get patch", "notebooks", "kubeflow.org"),
                 *_perms("get patch", "jobsets", "jobset.x-k8s.io"),
                 *_perms("get patch", "trainjobs", "trainer.kubeflow.org"),
                 *(p for kind in TRAINING_JOB_RESOURCES
                   for p in _perms("get patch", kind, "kubeflow.org")),
                 *_perms("get", "jobs", "batch"),
                 *_perms("list", "scaledobjects", "keda.sh"))
EXECUTE_WRITES = tuple(p for p in EXECUTE_NEEDS if p.verb not in ("get", "list", "watch"))
"""What lets the executor change the cluster: what a dry run's account must not hold."""

COMPONENTS: dict[str, Component] = {
    "watcher": Component("gpusteward-watcher", WATCHER_NEEDS, RBAC),
    "remediation": Component(
        "gpusteward-remediation", (), RBAC, must_lack=EXECUTE_WRITES,
        must_lack_why="a dry run calls no Kubernetes API, and an account that may change "
        "the cluster leaves the dry run to a flag; remove the binding that grants them, or, "
        f"if the executor acts ({EXECUTE_RBAC}), check --component remediation-execute"),
    "remediation-execute": Component("gpusteward-remediation", EXECUTE_NEEDS, EXECUTE_RBAC),
}
"""Whose RBAC ``--component`` can check: ``remediation`` is the shipped dry run, whose
account may change nothing, ``remediation-execute`` the same account once the
remediation-execute component lets it act. tests/deploy/test_rbac.py keeps each equal to
what the rendered manifests grant."""
DEFAULT_COMPONENTS = ("watcher", "remediation")

CHECKS = ("kafka", "kube", "collectors", "dcgm", "kubelet", "policy")


async def check_kafka(settings: Settings, timeout_s: float) -> list[Check]:
    """The broker answers, and every topic of the contract exists."""
    from gpusteward import kafka, topics

    where = settings.kafka.bootstrap_servers
    try:
        await kafka.wait_for_broker(settings, timeout_s)
        present = set(await kafka.list_topics(settings))
    except ConfigError as error:  # it answers, and refuses this client's TLS or SASL
        return [Check("kafka", False, str(error))]
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
                           "contract exist"), await check_segments(settings, present)]


KAFKA_SEGMENT_DEFAULTS = {"segment.ms": "604800000", "segment.bytes": "1073741824"}
"""Kafka's own defaults (7 days, 1 GiB), for a broker that does not say."""


async def check_segments(settings: Settings, present: set[str]) -> Check:
    """The compacted topics and the worker's changelogs start a new segment at least as
    often as ``topics.COMPACTED_SEGMENTS`` says: Kafka never compacts the active one, so
    a restarted worker replays all of it. Topics an earlier release created keep Kafka's
    defaults until changed."""
    from gpusteward import kafka, topics

    changelogs = f"{topics.worker_group(settings)}-"
    names = sorted({spec.name(settings) for spec in topics.ALL if spec.compacted}
                   | {name for name in present if name.startswith(changelogs)
                      and name.endswith("-changelog")})
    configs = await kafka.topic_configs(settings, names)
    wanted = topics.COMPACTED_SEGMENTS
    late = [name for name in names
            if any(int(configs.get(name, {}).get(key, KAFKA_SEGMENT_DEFAULTS[key]))
                   > int(limit) for key, limit in wanted.items())]
    if late:
        settings_text = ",".join(f"{key}={value}" for key, value in wanted.items())
        return Check("kafka segments", False, f"{', '.join(late)} keep a segment active "
                     "longer (Kafka's defaults: 7 days or 1 GiB), and Kafka never compacts "
                     "the active segment: a restarted worker replays all of it. Set "
                     f"{settings_text} on each (kafka-configs.sh --alter --entity-type "
                     f"topics --entity-name <topic> --add-config {settings_text}, or the "
                     "KafkaTopic objects)")
    return Check("kafka segments", True, f"the {len(names)} compacted topics and changelogs "
                 f"start a segment every {int(wanted['segment.ms']) // 60_000} min or "
                 f"{int(wanted['segment.bytes']) >> 20} MiB")


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


def service_account_user(namespace: str, name: str) -> tuple[str, list[str]]:
    """The user name and groups the API server authenticates a ServiceAccount's token as."""
    return (f"system:serviceaccount:{namespace}:{name}",
            ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"])


def _attributes(need: Permission) -> Any:
    from kubernetes import client as k8s

    # No namespace: every namespace, which is what deploy/'s ClusterRoleBindings grant and
    # what the watcher lists.
    return k8s.V1ResourceAttributes(verb=need.verb, resource=need.resource, group=need.group,
                                    subresource=need.subresource)


def _subject_denied(authz: Any, user: str, groups: list[str], needs: Iterable[Permission],
                    timeout_s: float) -> list[Permission]:
    """What SubjectAccessReviews say ``user`` may not do, of ``needs``."""
    from kubernetes import client as k8s

    denied = []
    for need in needs:
        review = k8s.V1SubjectAccessReview(spec=k8s.V1SubjectAccessReviewSpec(
            user=user, groups=groups, resource_attributes=_attributes(need)))
        answer = authz.create_subject_access_review(review, _request_timeout=timeout_s)
        if answer.status is None or not answer.status.allowed:
            denied.append(need)
    return denied


def _self_denied(authz: Any, needs: Iterable[Permission], timeout_s: float
                 ) -> list[Permission]:
    """What SelfSubjectAccessReviews say the caller may not do, of ``needs``."""
    from kubernetes import client as k8s

    denied = []
    for need in needs:
        review = k8s.V1SelfSubjectAccessReview(spec=k8s.V1SelfSubjectAccessReviewSpec(
            resource_attributes=_attributes(need)))
        answer = authz.create_self_subject_access_review(review, _request_timeout=timeout_s)
        if answer.status is None or not answer.status.allowed:
            denied.append(need)
    return denied


def check_rbac(client: Any, component: str, timeout_s: float,
               namespace: str = NAMESPACE) -> Check:
    """Every permission ``component`` needs is allowed to its service account in
    ``namespace``, by SubjectAccessReview; where the caller may not ask about others (a
    403), to the caller, by SelfSubjectAccessReview, and the verdict says so."""
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException

    wanted = COMPONENTS[component]
    name = f"rbac {component}"
    user, groups = service_account_user(namespace, wanted.service_account)
    authz = k8s.AuthorizationV1Api(client)
    asked = wanted.needs + wanted.must_lack
    who, note = user, ""
    try:
        refused = _subject_denied(authz, user, groups, asked, timeout_s)
    except ApiException as error:
        if error.status != 403:
            return Check(name, False, f"cannot ask the API server about {user} "
                         f"({_cut(error)})")
        # Run in the component's own pod, whose account may not ask about others, the
        # caller is that account: its own permissions are then the ones that matter.
        who, note = "you", (f"you may not create subjectaccessreviews.authorization.k8s.io "
                            f"to ask about {user}, so this checked your own permissions "
                            "(SelfSubjectAccessReview), which are its only when run as it: ")
        try:
            refused = _self_denied(authz, asked, timeout_s)
        except Exception as error:  # reported as the check's failure
            return Check(name, False, f"{note}cannot ask the API server ({_cut(error)})")
    except Exception as error:  # reported as the check's failure
        return Check(name, False, f"cannot ask the API server about {user} ({_cut(error)})")
    denied = [p for p in wanted.needs if p in refused]
    excess = [p for p in wanted.must_lack if p not in refused]
    if denied:
        return Check(name, False, f"{note}denied to {who}: {', '.join(map(str, denied))}; "
                     f"grant them to {wanted.service_account} in {namespace} "
                     f"({wanted.granted_in})")
    if excess:
        return Check(name, False, f"{note}allowed to {who}, and must not be: "
                     f"{', '.join(map(str, excess))}; {wanted.must_lack_why}")
    said = [f"all {len(wanted.needs)} verbs allowed to {who}"] if wanted.needs else []
    if wanted.must_lack:
        said.append(f"none of the {len(wanted.must_lack)} verbs that change the cluster "
                    f"allowed to {who}")
    return Check(name, True, note + "; ".join(said))


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
                 f"present; {', '.join(dcgm.NVML_ONLY_RULES)} needs the NVML collector "
                 "(no DCGM field carries it)")


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


COLLECTOR_NAMESPACE = "gpusteward-node"
"""The namespace of deploy/'s collector DaemonSet (``gpusteward-collector``)."""
COLLECTOR_SELECTOR = "app.kubernetes.io/name=gpusteward,app.kubernetes.io/component=collector"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
DAEMONSET_TOLERATED = ("node.kubernetes.io/",)
"""Taints the DaemonSet controller tolerates for every pod it makes (not ready,
unreachable, pressure, unschedulable)."""
SHOWN = 5
"""Nodes named in a failed collectors check; the rest are counted."""


def _items(list_call: Any, *args: Any, timeout_s: float, **query: str) -> list[Any]:
    """The items of a list call, from the API server's raw JSON: a list of 10,000 nodes is
    read without building the client's models of it."""
    response = list_call(*args, **query, _preload_content=False, _request_timeout=timeout_s)
    found: list[Any] = json.loads(response.data)["items"]
    return found


def gpu_count(node: dict[str, Any]) -> int:
    """GPUs and MIG devices the node advertises; 1 for a node GPU Feature Discovery says has
    GPUs but whose GPUs are not resources (DRA)."""
    capacity = node.get("status", {}).get("capacity") or {}
    advertised = sum(int(v) for k, v in capacity.items()
                     if k == "nvidia.com/gpu" or k.startswith("nvidia.com/mig-")
                     if str(v).isdigit())
    labels = node.get("metadata", {}).get("labels") or {}
    return advertised or int(labels.get(GPU_PRESENT_LABEL) == "true")


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for toleration in tolerations:
        key, effect = toleration.get("key"), toleration.get("effect")
        if key and key != taint.get("key"):
            continue
        if effect and effect != taint.get("effect"):
            continue
        if (toleration.get("operator") or "Equal") == "Exists" or (
                toleration.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _why_none(node: dict[str, Any], pod: dict[str, Any] | None,
              daemonsets: list[dict[str, Any]]) -> str:
    """Why ``node`` runs no ready collector: its pod's state, or what keeps each collector
    DaemonSet's pod off it (a fleet may run one per node pool, each selecting its own)."""
    if pod is not None:
        phase = pod.get("status", {}).get("phase", "?")
        waiting = [s["state"]["waiting"].get("reason", "waiting") for s in
                   pod.get("status", {}).get("containerStatuses") or []
                   if (s.get("state") or {}).get("waiting")]
        state = "/".join([phase, *waiting]) if waiting else (
            phase if phase != "Running" else "Running, not ready")
        return f"pod {pod['metadata']['name']} {state}"
    reasons = []
    for daemonset in daemonsets:
        template = daemonset.get("spec", {}).get("template", {}).get("spec", {})
        why = _kept_off(node, template, "the DaemonSet" if len(daemonsets) == 1 else
                        f"DaemonSet {daemonset.get('metadata', {}).get('name', '?')}")
        if why is None:
            return "no pod yet (a rollout under way, or node affinity)"
        reasons.append(why)
    return "; ".join(reasons)


def _kept_off(node: dict[str, Any], template: dict[str, Any], which: str) -> str | None:
    """What keeps the pod of a DaemonSet (``which``, in words; its pod spec ``template``) off
    ``node``: its nodeSelector, or a taint it does not tolerate. None when nothing does."""
    labels = node.get("metadata", {}).get("labels") or {}
    lacking = [f"{k}={v}" for k, v in (template.get("nodeSelector") or {}).items()
               if labels.get(k) != v]
    if lacking:
        return f"lacks the label {', '.join(lacking)} {which} selects"
    kept_off = [f"{t.get('key')}{'=' + t['value'] if t.get('value') else ''}:{t.get('effect')}"
                for t in node.get("spec", {}).get("taints") or []
                if t.get("effect") in ("NoSchedule", "NoExecute")
                and not str(t.get("key", "")).startswith(DAEMONSET_TOLERATED)
                and not _tolerates(template.get("tolerations") or [], t)]
    if kept_off:
        return f"taint {', '.join(kept_off)} not tolerated by {which}"
    return None


def check_collectors(client: Any, timeout_s: float,
                     namespace: str = COLLECTOR_NAMESPACE) -> Check:
    """Every node with GPUs runs a ready collector pod: a node without one sends no sample,
    and every rule is blind to its GPUs (the worker tells it, ``node_silent``, 10 min
    after it could; this says so at install, with why)."""
    from kubernetes import client as k8s

    core, apps = k8s.CoreV1Api(client), k8s.AppsV1Api(client)
    try:
        nodes = _items(core.list_node, timeout_s=timeout_s)
        pods = _items(core.list_namespaced_pod, namespace, timeout_s=timeout_s,
                      label_selector=COLLECTOR_SELECTOR)
        daemonsets = _items(apps.list_namespaced_daemon_set, namespace, timeout_s=timeout_s,
                            label_selector=COLLECTOR_SELECTOR)
    except Exception as error:  # reported as the check's failure
        return Check("collectors", False, f"cannot list nodes, and pods and daemonsets in "
                     f"{namespace} ({_cut(error)}); run doctor as someone who may, or "
                     "--skip collectors")
    gpu_nodes = [n for n in nodes if gpu_count(n) > 0]
    if not gpu_nodes:
        return Check("collectors", True, "no node advertises GPUs (nvidia.com/gpu, "
                     f"nvidia.com/mig-*, {GPU_PRESENT_LABEL}=true): nothing to collect yet")
    if not daemonsets:
        return Check("collectors", False, f"no collector DaemonSet in {namespace} (labels "
                     f"{COLLECTOR_SELECTOR}) for the {len(gpu_nodes)} GPU nodes: apply "
                     "deploy/ (docs/deploy.md); where samples come from the Prometheus "
                     "collector instead, --skip collectors")
    on: dict[str, dict[str, Any]] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if node and (node not in on or _ready(pod)):
            on[node] = pod
    missing = [(n, on.get(n["metadata"]["name"])) for n in gpu_nodes
               if not _ready(on.get(n["metadata"]["name"]))]
    if not missing:
        return Check("collectors", True, f"a collector is ready on each of the "
                     f"{len(gpu_nodes)} GPU nodes")
    named = [f"{n['metadata']['name']} ({_why_none(n, pod, daemonsets)})"
             for n, pod in missing[:SHOWN]]
    more = f"; and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    return Check("collectors", False, f"{len(missing)} of {len(gpu_nodes)} GPU nodes run no "
                 f"ready collector, so no rule sees their GPUs: {'; '.join(named)}{more}. Fix "
                 "the DaemonSet's nodeSelector or tolerations (a patch of "
                 "deploy/base/collector-nvml.yaml), or the pod (its logs)")


def _ready(pod: dict[str, Any] | None) -> bool:
    if pod is None or pod.get("status", {}).get("phase") != "Running":
        return False
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


async def diagnose(settings: Settings, *, kubeconfig: str | None = None,
                   components: Iterable[str] = DEFAULT_COMPONENTS, namespace: str = NAMESPACE,
                   collector_namespace: str = COLLECTOR_NAMESPACE, dcgm_url: str | None = None,
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
            found.append(Check("kubernetes", False, _no_configuration(kubeconfig, error)))
        else:
            access = await asyncio.to_thread(check_kube_access, client, timeout_s)
            found.append(access)
            if access.ok:
                for component in components:
                    found.append(await asyncio.to_thread(check_rbac, client, component,
                                                         timeout_s, namespace))
                if "collectors" not in skipped:
                    found.append(await asyncio.to_thread(check_collectors, client, timeout_s,
                                                         collector_namespace))
    if "dcgm" not in skipped and dcgm_url:
        found.append(await check_dcgm(dcgm_url, timeout_s))
    if "kubelet" not in skipped and kubelet_socket:
        found.append(check_kubelet_socket(kubelet_socket))
    if "policy" not in skipped:
        found.append(check_policy(policy))
    return found


def _no_configuration(kubeconfig: str | None, error: BaseException) -> str:
    """What to fix when no client can be made: the file named, where one was."""
    if kubeconfig is None:
        return (f"no configuration ({_cut(error)}); set --kubeconfig (or "
                "GPUSTEWARD_KUBE__KUBECONFIG) or run in the cluster")
    # The client takes a file that is not there for an empty configuration ("No
    # configuration found"), which hides a mistyped path or a volume not mounted.
    found = _cut(error) if os.path.isfile(kubeconfig) else "no such file"
    return (f"cannot load the Kubernetes configuration from {kubeconfig} ({found}); "
            "correct --kubeconfig or GPUSTEWARD_KUBE__KUBECONFIG")


def _cut(error: BaseException, limit: int = 300) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def doctor(
    bootstrap: Bootstrap = None,
    kubeconfig: Annotated[str | None, typer.Option(
        envvar="GPUSTEWARD_KUBE__KUBECONFIG",
        help="Kubeconfig; none: in-cluster, else ~/.kube/config.")] = None,
    component: Annotated[list[str] | None, typer.Option(
        "--component", help="Whose RBAC to check, asked about its service account: "
        "watcher, remediation (the dry run: may change nothing), remediation-execute (with the "
        "remediation-execute component); repeat; default watcher and remediation.")] = None,
    namespace: Annotated[str, typer.Option(
        "--namespace", help="The namespace the components' service accounts are in.")
    ] = NAMESPACE,
    collector_namespace: Annotated[str, typer.Option(
        "--collector-namespace", help="The namespace of the collector DaemonSet.")
    ] = COLLECTOR_NAMESPACE,
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
    """Check Kafka and its topics, Kubernetes access and RBAC, a collector on every GPU node,
    dcgm-exporter's counters, the kubelet socket and the policy file; say what to fix, exit 1
    on any fault."""
    components = component or list(DEFAULT_COMPONENTS)
    unknown = sorted(set(components) - set(COMPONENTS)) + sorted(set(skip or ()) - set(CHECKS))
    if unknown:
        raise typer.BadParameter(f"unknown: {', '.join(unknown)} (components: "
                                 f"{', '.join(COMPONENTS)}; checks: {', '.join(CHECKS)})")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the verdict says it once
    checks = asyncio.run(diagnose(
        kafka_settings(bootstrap), kubeconfig=kubeconfig, components=components,
        namespace=namespace, collector_namespace=collector_namespace, dcgm_url=dcgm_url,
        kubelet_socket=kubelet_socket, policy=policy, skip=skip or (), timeout_s=timeout_s))
    for check in checks:
        typer.echo(f"{'ok  ' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    faults = [c.name for c in checks if not c.ok]
    if faults:
        typer.echo(f"{len(faults)} fault(s): {', '.join(faults)}", err=True)
        raise typer.Exit(1)
