"""The rendered overlays are valid Kubernetes and have the production shape.

Core objects are validated against the Kubernetes 1.37 OpenAPI schemas in
strict mode (unknown fields rejected), from the PyPI package
`kubernetes-validate`. Custom resources (KafkaTopic, KafkaUser, PodMonitor)
are not in those schemas; they are checked against the hand-written subsets
in schemas/, each naming the CRD version it follows.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from gpusteward.settings import Settings
from tests.deploy.conftest import REPO, Rendered
from tests.deploy.reads import read_by

pytestmark = pytest.mark.deploy

KUBERNETES_VERSION = "1.37.0"
CRD_SCHEMAS = Path(__file__).parent / "schemas"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod: dict[str, Any] = spec["template"]["spec"]
    return pod


def crd_schema(obj: dict[str, Any]) -> dict[str, Any] | None:
    group_version = obj["apiVersion"].replace("/", "-")
    path = CRD_SCHEMAS / f"{obj['kind'].lower()}.{group_version}.json"
    return json.loads(path.read_text()) if path.exists() else None


def validate(obj: dict[str, Any]) -> None:
    schema = crd_schema(obj)
    if schema is not None:
        jsonschema.Draft7Validator(schema).validate(obj)
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_object_validates(rendered):
    failures = []
    for obj in rendered:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as error:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.message[:300]}")
        except kubernetes_validate.SchemaNotFoundError as error:
            failures.append(f"no schema for {obj['kind']} {obj['apiVersion']}: {error.message}")
    assert not failures, "\n".join(failures)


def test_validation_rejects_a_misspelt_field(render):
    # A control: strict validation must fail on what kubectl apply would reject.
    deployment = copy.deepcopy(render("production").named("Deployment", "gpusteward-watcher"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    topic = copy.deepcopy(render("production").kind("KafkaTopic")[0])
    topic["spec"]["partition"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate(topic)


def test_namespaced_objects_name_their_namespace(rendered):
    # An object without one lands in whatever namespace kubectl's context has.
    missing = [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in rendered
        if o["kind"] not in CLUSTER_SCOPED and not o["metadata"].get("namespace")
    ]
    assert not missing


def test_what_deleting_the_namespaces_leaves_carries_the_part_of_label(rendered):
    # Deleting gpusteward's namespaces leaves the cluster-wide objects and those in other
    # namespaces (Strimzi's, gpu-operator's): a label selector must find them all, a
    # component's own included.
    ours = {o["metadata"]["name"] for o in rendered.kind("Namespace")}
    unlabelled = [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in rendered
        if (o["kind"] in CLUSTER_SCOPED or o["metadata"].get("namespace") not in ours)
        and (o["metadata"].get("labels") or {}).get("app.kubernetes.io/part-of") != "gpusteward"
    ]
    assert not unlabelled


def test_references_resolve(rendered):
    """Every ConfigMap, Secret-less volume, PVC and ServiceAccount a pod names is rendered
    in the pod's own namespace (the only one a pod reads them from)."""
    problems = []
    for workload in rendered.workloads():
        namespace = workload["metadata"]["namespace"]
        names = {(o["kind"], o["metadata"]["name"]) for o in rendered
                 if o["metadata"].get("namespace") == namespace}
        pod = rendered.pod_spec(workload)
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        account = pod.get("serviceAccountName")
        if account and ("ServiceAccount", account) not in names:
            problems.append(f"{where}: ServiceAccount {account}")
        claim_templates = workload["spec"].get("volumeClaimTemplates", [])
        templates = {t["metadata"]["name"] for t in claim_templates}
        for volume in pod.get("volumes", []):
            if "configMap" in volume and ("ConfigMap", volume["configMap"]["name"]) not in names:
                problems.append(f"{where}: ConfigMap {volume['configMap']['name']}")
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim and ("PersistentVolumeClaim", claim) not in names:
                problems.append(f"{where}: PVC {claim}")
        declared = {v["name"] for v in pod.get("volumes", [])} | templates
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef")
                if ref and ("ConfigMap", ref["name"]) not in names:
                    problems.append(f"{where}: envFrom ConfigMap {ref['name']}")
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in declared:
                    problems.append(f"{where}: mount of undeclared volume {mount['name']}")
    assert not problems, "\n".join(problems)


def _gpusteward_workloads(rendered):
    return [
        w for w in rendered.workloads()
        if w["metadata"]["labels"].get("app.kubernetes.io/name") == "gpusteward"
    ]


def test_every_gpusteward_workload_exists(rendered):
    components = {
        w["metadata"]["labels"]["app.kubernetes.io/component"]: w["kind"]
        for w in _gpusteward_workloads(rendered)
    }
    expected = {
        "collector": "DaemonSet", "watcher": "Deployment", "worker": "StatefulSet",
        "alerts": "Deployment", "remediation": "Deployment", "report": "CronJob",
        "rollup-sink": "Deployment", "queue-sink": "Deployment",
        "findings-sink": "Deployment", "results-sink": "Deployment",
    }
    assert {k: components.get(k) for k in expected} == expected


def test_security_context_is_restricted(rendered):
    """Non-root, read-only root, no capabilities, RuntimeDefault seccomp, no escalation.

    One exception, by design: the NVML collector runs as uid 0 (with every
    capability dropped) to connect to the kubelet's root-owned socket.
    """
    problems = []
    for workload in _gpusteward_workloads(rendered):
        pod = rendered.pod_spec(workload)
        where = workload["metadata"]["name"]
        pod_security = pod.get("securityContext", {})
        if pod_security.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{where}: seccomp")
        nvml = workload["kind"] == "DaemonSet" and "nvml" in pod["containers"][0]["args"]
        if nvml:
            if pod_security.get("runAsUser") != 0:
                problems.append(f"{where}: the NVML collector is expected to run as uid 0")
        elif not (pod_security.get("runAsNonRoot") and pod_security.get("runAsUser", 0) > 0):
            problems.append(f"{where}: not non-root")
        for container in pod["containers"]:
            ctx = container.get("securityContext", {})
            if ctx.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation")
            if ctx.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: readOnlyRootFilesystem")
            if ctx.get("capabilities", {}).get("drop") != ["ALL"] or ctx["capabilities"].get("add"):
                problems.append(f"{where}: capabilities")
            if ctx.get("privileged"):
                problems.append(f"{where}: privileged")
            resources = container.get("resources", {})
            for part in ("requests", "limits"):
                if not {"cpu", "memory"} <= set(resources.get(part, {})):
                    problems.append(f"{where}: {part} for cpu and memory")
    assert not problems, "\n".join(problems)


def test_only_the_api_clients_mount_a_token(rendered):
    mounting = {
        w["metadata"]["labels"]["app.kubernetes.io/component"]
        for w in _gpusteward_workloads(rendered)
        if rendered.pod_spec(w).get("automountServiceAccountToken", True)
    }
    # The remediation executor calls the API only where it acts (the execute component).
    acting = {"remediation"} if rendered.variant.endswith("+execute") else set()
    assert mounting == {"watcher"} | acting


def test_nvml_collector_runs_on_gpu_nodes_with_the_pod_resources_socket(render):
    collector = render("production").component("collector")
    pod = pod_spec(collector)
    assert collector["kind"] == "DaemonSet"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {t["key"] for t in pod["tolerations"]} == {
        "nvidia.com/gpu", "gpusteward.io/gpu-reset-required", "gpusteward.io/unhealthy"}
    host = {v["hostPath"]["path"]: v for v in pod["volumes"] if "hostPath" in v}
    assert set(host) == {"/var/lib/kubelet/pod-resources", "/proc"}
    socket = host["/var/lib/kubelet/pod-resources"]
    container = pod["containers"][0]
    assert container["args"] == ["collect", "nvml"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == socket["name"]]
    assert mount["readOnly"] is True
    assert mount["mountPath"] == "/var/lib/kubelet/pod-resources"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUSTEWARD_COLLECT__METRICS_PORT"] == "9400"
    # The host's /proc, for per-process attribution: read-only where the collector reads it,
    # and nothing more (no host PID namespace, no capability: /proc/<pid>/cgroup is
    # world-readable).
    (proc,) = [m for m in container["volumeMounts"] if m["name"] == host["/proc"]["name"]]
    assert proc["readOnly"] is True
    assert env["GPUSTEWARD_COLLECT__NVML__PROC_ROOT"] == proc["mountPath"]
    assert not pod.get("hostPID") and not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9400}


def test_dcgm_component_swaps_the_collector_for_a_restricted_scraper(render):
    rendered = render("production+dcgm+execute")
    collector = rendered.component("collector")
    pod = rendered.pod_spec(collector)
    container = pod["containers"][0]
    # The URL in the environment, where `collect dcgm` and `gpusteward doctor` both read it.
    assert container["args"] == ["collect", "dcgm"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "GPUSTEWARD_COLLECT__DCGM_URL" in read_by(container["args"])
    assert "GPUSTEWARD_COLLECT__DCGM_URL" in read_by(["doctor"])
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert "runtimeClassName" not in pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert not [e for e in container["env"] if e["name"].startswith("NVIDIA_")]
    service = rendered.named("Service", "gpusteward-dcgm-exporter-local")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert env["GPUSTEWARD_COLLECT__DCGM_URL"] == (
        f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:9400"
        "/metrics")


def test_remediation_is_dry_run_unless_the_component_is_added(render):
    for variant in ("dev", "production"):
        args = pod_spec(render(variant).component("remediation"))["containers"][0]["args"]
        assert args == ["act", "--dry-run"], variant
    args = pod_spec(
        render("production+dcgm+execute").component("remediation"))["containers"][0]["args"]
    assert args == ["act", "--execute", "--backend", "kubernetes"]


def test_worker_is_a_statefulset_with_a_data_volume(render):
    worker = render("production").component("worker")
    assert worker["kind"] == "StatefulSet"
    assert worker["spec"]["replicas"] == 3
    settings = Settings()
    assert worker["spec"]["replicas"] <= settings.kafka.node_partitions
    (template,) = worker["spec"]["volumeClaimTemplates"]
    container = pod_spec(worker)["containers"][0]
    datadir = container["args"][container["args"].index("--datadir") + 1]
    assert {"name": template["metadata"]["name"], "mountPath": datadir} in [
        {"name": m["name"], "mountPath": m["mountPath"]} for m in container["volumeMounts"]
    ]
    pdb = render("production").named("PodDisruptionBudget", "gpusteward-worker")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        worker["spec"]["selector"]["matchLabels"].items())


def test_long_running_consumers_are_probed_on_their_health_port(render):
    """The worker, watcher, alerts, remediation and the sinks serve /livez and /readyz on
    GPUSTEWARD_HEALTH_PORT (gpusteward.health); their probes must ask that port for them."""
    from gpusteward.health import LIVE_PATH, READY_PATH

    rendered = render("production")
    for component in ("worker", "watcher", "alerts", "remediation", *SINKS):
        container = pod_spec(rendered.component(component))["containers"][0]
        env = {e["name"]: e for e in container.get("env", [])}
        port = int(env["GPUSTEWARD_HEALTH_PORT"]["value"])
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in (("livenessProbe", LIVE_PATH), ("readinessProbe", READY_PATH)):
            check = container[probe]["httpGet"]
            assert check["path"] == path, (component, probe)
            assert named.get(check["port"], check["port"]) == port, (component, probe)
    worker = pod_spec(rendered.component("worker"))["containers"][0]
    instance = {e["name"]: e for e in worker["env"]}["GPUSTEWARD_KAFKA__GROUP_INSTANCE_ID"]
    assert instance["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_worker_has_minutes_to_start_before_liveness_counts(render):
    """A startup probe on /livez holds the liveness probe off until the process answers
    (imports, topic creation, the broker); the table recovery after it beats, so the
    budget need not cover a changelog replay (tests/streams/test_recovery_liveness.py)."""
    from gpusteward.health import LIVE_PATH

    worker = pod_spec(render("production").component("worker"))["containers"][0]
    startup = worker["startupProbe"]
    assert startup["httpGet"] == worker["livenessProbe"]["httpGet"]
    assert startup["httpGet"]["path"] == LIVE_PATH
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_report_cronjob_writes_to_a_volume(render):
    report = render("production").component("report")
    assert report["kind"] == "CronJob"
    container = pod_spec(report)["containers"][0]
    command = " ".join(container["command"])
    assert "gpusteward report --week" in command and "--out /reports" in command
    assert any(m["mountPath"] == "/reports" for m in container["volumeMounts"])
    env = {e["name"]: e for e in container["env"]}
    # Every week kept on the same volume; the webhook URL only from an optional Secret.
    assert env["GPUSTEWARD_REPORT__ARCHIVE_DIR"]["value"].startswith("/reports/")
    secret = env["GPUSTEWARD_REPORT__WEBHOOK_URL"]["valueFrom"]["secretKeyRef"]
    assert secret["optional"] is True and "value" not in env["GPUSTEWARD_REPORT__WEBHOOK_URL"]


QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _bytes(quantity: str) -> int:
    """A Kubernetes quantity of bytes ("6Gi", "5G", "64Mi", "1000") as a number."""
    for suffix in sorted(QUANTITY, key=len, reverse=True):
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * QUANTITY[suffix])
    return int(quantity)


def test_report_spill_volume_holds_a_10000_gpu_week(rendered):
    """The report spills its percentile values (about 50 bytes a held device-minute) to
    GPUSTEWARD_REPORT__SPILL_DIR until it ends: the volume there must hold the week of the
    largest fleet the product is for, or the kubelet evicts the Monday report."""
    from gpusteward.reports.weekly import spill_bytes_for

    pod = pod_spec(rendered.component("report"))
    container = pod["containers"][0]
    folder = {e["name"]: e.get("value") for e in container["env"]}["GPUSTEWARD_REPORT__SPILL_DIR"]
    (mount,) = [m for m in container["volumeMounts"]
                if (folder.rstrip("/") + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    assert not mount.get("readOnly")
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    size = _bytes(volume["emptyDir"]["sizeLimit"])
    assert size >= spill_bytes_for(10_000), (size, spill_bytes_for(10_000))
    # Reserved on the node, so the pod is placed where it fits instead of evicted mid-run.
    requested = _bytes(container["resources"]["requests"]["ephemeral-storage"])
    assert requested >= size


def test_report_with_no_rollups_fails_the_job_without_retrying(render):
    """A week without rollups exits NO_DATA_EXIT after writing the report: a rerun finds no
    more, so the Job fails at once; other failures (a refused webhook) are tried again,
    a bounded number of times."""
    from gpusteward.cli.report import NO_DATA_EXIT

    job = render("production").component("report")["spec"]["jobTemplate"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    assert 0 < job["backoffLimit"] <= 3
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"] == {"containerName": "report", "operator": "In",
                                   "values": [NO_DATA_EXIT]}


def _env(rendered, workload, container: dict[str, Any] | None = None) -> dict[str, str]:
    """The environment a container of ``workload`` (the first unless given) sees from its
    ConfigMaps and values."""
    container = container or pod_spec(workload)["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(rendered.config_map(workload, source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def _store_paths(rendered, workload, container) -> tuple[str, dict[str, str]]:
    """The PVC that holds a container's rollup and queue stores, and the two folders."""
    env = _env(rendered, workload, container)
    folders = {"rollups": env["GPUSTEWARD_REPORT__ROLLUP_DIR"],
               "queue": env["GPUSTEWARD_REPORT__QUEUE_DIR"],
               "findings": env["GPUSTEWARD_REPORT__FINDINGS_DIR"],
               "results": env["GPUSTEWARD_REPORT__RESULTS_DIR"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod_spec(workload)["volumes"] if "persistentVolumeClaim" in v}
    (mount,) = [m for m in container["volumeMounts"]
                if all(f.startswith(m["mountPath"].rstrip("/") + "/") for f in folders.values())]
    return claims[mount["name"]], folders


def test_sinks_write_the_store_the_report_reads(rendered):
    """The rollup and queue sinks run as processes, on the volume the report CronJob reads."""
    report = rendered.component("report")
    (reader,) = pod_spec(report)["containers"]
    claim, folders = _store_paths(rendered, report, reader)
    (reading,) = [m for m in reader["volumeMounts"] if folders["rollups"].startswith(
        m["mountPath"] + "/")]
    assert reading.get("readOnly") is True
    sinks = {"rollup-sink": ["sink", "rollups"], "queue-sink": ["sink", "queue"],
             "findings-sink": ["sink", "findings"], "results-sink": ["sink", "results"]}
    for component, args in sinks.items():
        sink = rendered.component(component)
        (container,) = pod_spec(sink)["containers"]
        assert container["args"] == args
        assert _store_paths(rendered, sink, container) == (claim, folders)
        (mount,) = [m for m in container["volumeMounts"] if folders["rollups"].startswith(
            m["mountPath"] + "/")]
        assert not mount.get("readOnly")
        # One writer at a time per store.
        assert sink["spec"]["replicas"] == 1 and sink["spec"]["strategy"]["type"] == "Recreate"
    # ReadWriteOnce: the queue sink and the report run on the rollup sink's node.
    volume = rendered.named("PersistentVolumeClaim", claim)
    assert volume["spec"]["accessModes"] == ["ReadWriteOnce"]
    writer = rendered.component("rollup-sink")["spec"]["selector"]["matchLabels"]
    for other in (report, rendered.component("queue-sink"),
                  rendered.component("findings-sink"), rendered.component("results-sink")):
        (term,) = pod_spec(other)["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["labelSelector"]["matchLabels"].items() <= writer.items()
        assert term["topologyKey"] == "kubernetes.io/hostname"


def test_policy_configmap_is_mounted_where_the_setting_points(rendered):
    # The report reads queue SLOs and the idle threshold from the same policy, the rollup
    # sink the idle threshold of its GPU-seconds metric.
    for component in ("worker", "report", "rollup-sink"):
        workload = rendered.component(component)
        pod = rendered.pod_spec(workload)
        env = _env(rendered, workload)
        path = env["GPUSTEWARD_POLICY_FILE"]
        assert path == "/etc/gpusteward/policy.yaml"
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == path]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        policy_map = rendered.config_map(workload, volume["configMap"]["name"])
        # What the worker reads is the shipped file (tests/deploy/test_config_files.py
        # checks the copy in deploy/ loads and equals it).
        assert policy_map["data"][mount["subPath"]] == (REPO / "rules" / "policy.yaml").read_text()


def test_production_kafka_settings_load_as_sasl_scram_over_tls(render, monkeypatch):
    """The rendered environment, plus the Secret's values, is a valid Settings."""
    rendered = render("production")
    worker = rendered.component("worker")
    container = pod_spec(worker)["containers"][0]
    env = _env(rendered, worker)
    secret_refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {r["name"] for r in secret_refs.values()} == {"gpusteward-kafka"}
    assert {n: r["key"] for n, r in secret_refs.items()} == {
        "GPUSTEWARD_KAFKA__SASL_USERNAME": "username",
        "GPUSTEWARD_KAFKA__SASL_PASSWORD": "password",
    }
    (tls,) = [v for v in pod_spec(worker)["volumes"]
              if v.get("secret", {}).get("secretName") == "gpusteward-kafka"]
    (tls_mount,) = [m for m in container["volumeMounts"] if m["name"] == tls["name"]]
    assert env["GPUSTEWARD_KAFKA__SSL_CAFILE"] == f"{tls_mount['mountPath']}/ca.crt"

    for name in list(os.environ):
        if name.startswith("GPUSTEWARD_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GPUSTEWARD_KAFKA__SASL_USERNAME", "gpusteward")
    monkeypatch.setenv("GPUSTEWARD_KAFKA__SASL_PASSWORD", "from-the-secret")
    kafka = Settings().kafka
    assert kafka.security_protocol == "SASL_SSL"
    assert kafka.sasl_mechanism == "SCRAM-SHA-512"
    assert kafka.replication_factor == 3
    assert kafka.bootstrap_servers.endswith(":9093")
    assert kafka.fetch_max_wait_ms >= 100


SINKS = ("rollup-sink", "queue-sink", "findings-sink", "results-sink")


def test_every_kafka_client_pod_gets_the_same_security_settings(render):
    """Each container that connects to Kafka reads the same ConfigMap, the SASL user and
    password from the Secret, and finds the Secret's CA (and, for mutual TLS, the client
    certificate and key: optional keys) at the same paths: one that lacked any would connect
    in plaintext, or unauthenticated, while the others did not."""
    rendered = render("production")
    seen: dict[str, list[Any]] = {}
    for workload in _gpusteward_workloads(rendered):
        pod = pod_spec(workload)
        for container in pod["containers"]:
            env = _env(rendered, workload, container)
            if "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS" not in env:
                continue
            secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]
                       for e in container.get("env", [])
                       if "secretKeyRef" in e.get("valueFrom", {})}
            (volume,) = [v for v in pod["volumes"]
                         if v.get("secret", {}).get("secretName") == "gpusteward-kafka"]
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
            files = {f"{mount['mountPath']}/{item['path']}": item["key"]
                     for item in volume["secret"]["items"]}
            kafka = {k: v for k, v in env.items() if k.startswith("GPUSTEWARD_KAFKA__")}
            seen[f"{workload['metadata']['name']}/{container['name']}"] = [
                kafka, {n: r["key"] for n, r in secrets.items() if "KAFKA" in n},
                files, volume["secret"].get("optional")]
    assert len(seen) >= 9, seen  # collector, watcher, worker, alerts, remediation, 4 sinks
    assert len({json.dumps(value, sort_keys=True) for value in seen.values()}) == 1, seen
    common_env, common_secrets, common_files, optional = next(iter(seen.values()))
    assert common_secrets == {"GPUSTEWARD_KAFKA__SASL_USERNAME": "username",
                              "GPUSTEWARD_KAFKA__SASL_PASSWORD": "password"}
    cafile = common_env["GPUSTEWARD_KAFKA__SSL_CAFILE"]
    assert common_files[cafile] == "ca.crt"
    directory = cafile.rsplit("/", 1)[0]
    assert (common_files[f"{directory}/user.crt"], common_files[f"{directory}/user.key"]) == (
        "user.crt", "user.key")
    assert optional is True


def test_every_long_running_process_is_scraped(render):
    """Worker, alerting, remediation, the sinks and the watcher declare a `metrics` port
    that their settings serve on, the PodMonitor scrapes that port name, and the network
    policy lets Prometheus in."""
    rendered = render("production")
    port = 9464
    for component in ("worker", "alerts", "remediation", "watcher", *SINKS):
        pod = pod_spec(rendered.component(component))
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        health = int(env["GPUSTEWARD_HEALTH_PORT"])
        assert int(env["GPUSTEWARD_METRICS__PORT"]) == port
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
            "metrics": port, "health": health}
    (monitor,) = rendered.kind("PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    policy = rendered.named("NetworkPolicy", "gpusteward-metrics-scrape", "gpusteward")
    (expression,) = policy["spec"]["podSelector"]["matchExpressions"]
    assert {"worker", "alerts", "remediation", "watcher", *SINKS} <= set(
        expression["values"])
    assert {p["port"] for p in policy["spec"]["ingress"][0]["ports"]} >= {port}
    # The collector's 9400, in its own namespace, which the PodMonitor looks in too.
    collector = rendered.component("collector")
    namespace = collector["metadata"]["namespace"]
    (container,) = pod_spec(collector)["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9400}
    assert set(monitor["spec"]["namespaceSelector"]["matchNames"]) == {
        monitor["metadata"]["namespace"], namespace}
    policy = rendered.named("NetworkPolicy", "gpusteward-metrics-scrape", namespace)
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/component": "collector"}}
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [9400]
    (rule,) = rendered.kind("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == monitor["metadata"]["labels"]["release"]


# The Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards),
# the controls the manifests could break. `baseline` forbids the host's namespaces, ports
# and paths, privilege and added capabilities; `restricted` adds a non-root user, seccomp,
# no escalation, every capability dropped and only these volume types.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP",
                         "SETUID", "SYS_CHROOT"}
LEVELS = ("restricted", "baseline", "privileged")


def pod_security_violations(pod: dict[str, Any]) -> dict[str, list[str]]:
    """What keeps ``pod`` out of each Pod Security level: level -> violations (the
    restricted list includes the baseline one)."""
    baseline: list[str] = []
    extra: list[str] = []
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            baseline.append(host)
    volumes = pod.get("volumes") or []
    baseline += [f"hostPath volume {v['name']}" for v in volumes if "hostPath" in v]
    extra += [f"volume {v['name']} of a type restricted forbids" for v in volumes
              if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    pod_context = pod.get("securityContext") or {}
    containers = (pod.get("initContainers") or []) + pod["containers"]
    for container in containers:
        name, context = container["name"], container.get("securityContext") or {}
        if context.get("privileged"):
            baseline.append(f"{name}: privileged")
        added = set((context.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            baseline.append(f"{name}: adds {sorted(added - BASELINE_CAPABILITIES)}")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            baseline.append(f"{name}: hostPort")
        if added - {"NET_BIND_SERVICE"}:
            extra.append(f"{name}: adds capabilities")
        if "ALL" not in ((context.get("capabilities") or {}).get("drop") or []):
            extra.append(f"{name}: does not drop ALL capabilities")
        if context.get("allowPrivilegeEscalation") is not False:
            extra.append(f"{name}: allowPrivilegeEscalation")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot")):
            extra.append(f"{name}: runAsNonRoot")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            extra.append(f"{name}: runAsUser 0")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {})
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            extra.append(f"{name}: seccomp")
    return {"privileged": [], "baseline": baseline, "restricted": baseline + extra}


def test_pod_security_violations_names_what_each_level_forbids(render):
    """The checker itself, on the NVML collector: root and a hostPath keep it out of both."""
    collector = pod_spec(render("production").component("collector"))
    found = pod_security_violations(collector)
    assert "hostPath volume pod-resources" in found["baseline"]
    assert "collector: runAsUser 0" in found["restricted"]
    assert "collector: runAsUser 0" not in found["baseline"]
    assert found["privileged"] == []


NAMESPACE = "gpusteward"
NODE_NAMESPACE = "gpusteward-node"
"""The NVML collector's own namespace: the one namespace that may admit a privileged pod."""
ENFORCE = "pod-security.kubernetes.io/enforce"
AUDIT = "pod-security.kubernetes.io/audit"


def pod_security_problems(rendered) -> list[str]:
    """What is wrong with the Pod Security labels of the namespaces ``rendered`` creates:
    each must enforce the strictest level every pod in it meets and audit at restricted;
    gpusteward must enforce restricted; only the NVML collector may need more, and only in
    its own namespace, the one that may enforce `privileged` (`restricted` there too when
    the dcgm-exporter component replaces it). Every workload must be in one of them."""
    labels = {n["metadata"]["name"]: n["metadata"].get("labels") or {}
              for n in rendered.kind("Namespace")}
    problems = [f"{w['kind']}/{w['metadata']['name']} in {w['metadata'].get('namespace')}, "
                "a namespace these manifests do not label"
                for w in rendered.workloads() if w["metadata"].get("namespace") not in labels]
    nvml = "nvml" in pod_spec(rendered.component("collector"))["containers"][0]["args"]
    expected = {NAMESPACE: "restricted", NODE_NAMESPACE: "privileged" if nvml else "restricted"}
    enforced = {name: own.get(ENFORCE) for name, own in labels.items()}
    if enforced != expected:
        problems.append(f"enforced {enforced}, expected {expected}")
    for name, own in sorted(labels.items()):
        pods = {w["metadata"]["name"]: pod_security_violations(rendered.pod_spec(w))
                for w in rendered.workloads() if w["metadata"].get("namespace") == name}
        strictest = next(level for level in LEVELS
                         if not [v for found in pods.values() for v in found[level]])
        if own.get(ENFORCE) != strictest:
            why = {pod: found[strictest if strictest == "restricted" else "baseline"]
                   for pod, found in pods.items()}
            problems.append(f"{name} enforces {own.get(ENFORCE)}, its pods meet {strictest}: "
                            f"{why}")
        if own.get(AUDIT) != "restricted":
            problems.append(f"{name} audits at {own.get(AUDIT)}, not restricted")
        beyond = {pod for pod, found in pods.items() if found["restricted"]}
        allowed = {"gpusteward-collector"} if nvml and name == NODE_NAMESPACE else set()
        if beyond - allowed:
            problems.append(f"{name}: {sorted(beyond - allowed)} need more than restricted")
    return problems


def test_each_namespace_admits_its_pods_at_the_strictest_level_they_allow(rendered):
    """gpusteward enforces `restricted`, so nobody who may create pods there gets a
    privileged one; the NVML collector (root, the kubelet's socket by hostPath) runs in a
    namespace of its own that alone enforces `privileged`. A pod that meets no lower level
    fails here, not at admission."""
    assert pod_security_problems(rendered) == []


def test_the_collector_reads_the_kafka_settings_the_pipeline_reads(rendered):
    """The NVML collector's namespace has its own copy of the ConfigMap gpusteward-kafka
    (a pod reads ConfigMaps of its own namespace only): each overlay merges both, and the
    two must say the same, or the collector publishes to another broker, or not at all."""
    copies = {m["metadata"]["namespace"]: m["data"] for m in rendered.kind("ConfigMap")
              if m["metadata"]["name"].startswith("gpusteward-kafka-")}
    assert set(copies) == {NAMESPACE, NODE_NAMESPACE}
    assert copies[NODE_NAMESPACE] == copies[NAMESPACE]
    # The broker's address works from both namespaces: a bare service name would resolve
    # in the collector's namespace, where no broker runs.
    for server in copies[NAMESPACE]["GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS"].split(","):
        assert "." in server.rsplit(":", 1)[0], server
    collector = rendered.component("collector")
    assert collector["metadata"]["namespace"] == NODE_NAMESPACE
    assert rendered.named("ServiceAccount", "gpusteward-collector")["metadata"][
        "namespace"] == NODE_NAMESPACE


def test_a_namespace_that_admits_too_much_fails_the_check(render):
    """Controls: gpusteward back at `privileged`, the NVML collector moved back into
    gpusteward, a privileged pod planted beside the collector, and an unlabelled namespace."""
    rendered = render("production")

    def planted(change) -> list[str]:
        broken = Rendered("planted", copy.deepcopy(rendered.objects))
        change(broken)
        return pod_security_problems(broken)

    def namespace(broken, name):
        return broken.named("Namespace", name)["metadata"]

    def loosen(broken):
        namespace(broken, NAMESPACE)["labels"][ENFORCE] = "privileged"

    def move_the_collector(broken):
        broken.component("collector")["metadata"]["namespace"] = NAMESPACE

    def plant_a_privileged_pod(broken):
        pod = copy.deepcopy(broken.component("collector"))
        pod["metadata"]["name"] = "debug"
        pod["metadata"]["labels"] = {}
        pod_spec(pod)["containers"][0]["securityContext"]["privileged"] = True
        broken.objects.append(pod)

    def plant_elsewhere(broken):
        pod = copy.deepcopy(broken.component("watcher"))
        pod["metadata"]["namespace"] = "default"
        pod["metadata"]["labels"] = {}
        broken.objects.append(pod)

    assert any("enforced {'gpusteward': 'privileged'" in p for p in planted(loosen))
    assert any("gpusteward enforces restricted, its pods meet privileged" in p
               for p in planted(move_the_collector))
    assert any("gpusteward-node: ['debug'] need more than restricted" in p
               for p in planted(plant_a_privileged_pod))
    assert any("in default, a namespace these manifests do not label" in p
               for p in planted(plant_elsewhere))


CREDENTIALS = ("PASSWORD", "WEBHOOK_URL", "TOKEN", "SECRET")
"""Settings whose value is a credential (a webhook's URL is one)."""


def test_every_credential_comes_from_a_secret(rendered):
    """No credential setting is written into a manifest or a ConfigMap, where `kubectl get`
    shows it to whoever may read the namespace: each comes from a Secret. The alerting
    consumer's webhook and the report's are read from their optional Secrets."""
    literal = [
        f"{w['metadata']['name']}: {e['name']}"
        for w in rendered.workloads() for c in rendered.pod_spec(w)["containers"]
        for e in c.get("env") or []
        if any(word in e["name"] for word in CREDENTIALS) and "secretKeyRef" not in (
            e.get("valueFrom") or {})]
    literal += [f"ConfigMap {m['metadata']['name']}: {key}" for m in rendered.kind("ConfigMap")
                for key in m.get("data") or {} if any(word in key for word in CREDENTIALS)]
    assert not literal, literal
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]
           for component in ("alerts", "report")
           for c in rendered.pod_spec(rendered.component(component))["containers"]
           for e in c.get("env") or [] if "WEBHOOK_URL" in e["name"]}
    assert env == {
        "GPUSTEWARD_WEBHOOK_URL": {"name": "gpusteward-alerts", "key": "webhook-url",
                                   "optional": True},
        "GPUSTEWARD_REPORT__WEBHOOK_URL": {"name": "gpusteward-report", "key": "webhook-url",
                                           "optional": True}}
    assert "GPUSTEWARD_WEBHOOK_URL" in read_by(["alerts"])


def _tolerates(pod: dict[str, Any], key: str, effect: str) -> bool:
    """Whether one of the pod's tolerations matches the taint, as Kubernetes matches them."""
    return any(t.get("key") in (None, key) and t.get("effect") in (None, effect)
               and (t.get("operator") == "Exists" or t.get("key") == key)
               for t in pod.get("tolerations") or [])


def test_the_collector_tolerates_every_taint_remediation_sets(rendered):
    """A DaemonSet's new pod stays off a node with a NoSchedule taint it does not tolerate:
    after a rollout (an upgrade) or an eviction, a node gpusteward tainted for a GPU reset
    lost its collector, so nothing saw the reset that should end the finding and its taint."""
    from gpusteward.remediation.kubernetes import DEFAULT_TAINT_KEY
    from gpusteward.rules.xid import RESET_TAINT

    pod = pod_spec(rendered.component("collector"))
    for key in (RESET_TAINT["key"], DEFAULT_TAINT_KEY):
        for effect in ("NoSchedule", "NoExecute"):
            assert _tolerates(pod, key, effect), (rendered.variant, key, effect)
