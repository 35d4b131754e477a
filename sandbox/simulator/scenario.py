"""Scenario files: the fleet, its workloads and the faults to inject, in YAML.

A scenario is data, not code: nodes (GPU model, count, MIG layout, spot),
users, workload groups (kind, GPUs, arrival, duration, a utilisation profile
made of phases) and faults. Ranges ``[lo, hi]`` are drawn once per workload
(durations) or per sample (utilisation) from the seeded generator, so one
seed always gives the same run.

A mistake in a file is reported as ``FILE:LINE: field: message``, as for the
policy file (:mod:`gpusteward.configfile`), and an unknown field is a mistake:
every model forbids extra keys, so a misspelt one is not silently ignored.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpusteward.configfile import (
    ConfigFileError,
    Issue,
    compose,
    duplicate_keys,
    issues_of,
    read_text,
)

Range = tuple[float, float]


class NodeGroup(BaseModel):
    """``count`` identical nodes named ``{prefix}-1`` ... ``{prefix}-{count}``."""

    model_config = ConfigDict(extra="forbid")

    prefix: str
    count: int = Field(ge=1)
    gpu_model: str = "NVIDIA A100-SXM4-80GB"
    gpus: int = Field(1, ge=1, le=16)
    mem_gib: float = 80.0
    mig_layout: list[str] = Field(
        default_factory=list,
        description="MIG profiles per GPU (e.g. [3g.40gb, 3g.40gb]); empty for whole GPUs.",
    )
    spot: bool = False
    replicas: int = Field(
        1, ge=1, le=64, description="Pods each GPU is advertised to (the device plugin's "
        "sharing replicas, GPU Operator label nvidia.com/gpu.replicas); 1: not shared.")
    sharing: Literal["time-slicing", "mps"] = Field(
        "time-slicing", description="How replicas share a GPU (label "
        "nvidia.com/gpu.sharing-strategy): time-slicing, or MPS, whose pods run as MPS "
        "clients of one server context.")
    allocation: Literal["device-plugin", "dra"] = Field(
        "device-plugin", description="How pods get the nodes' GPUs: the NVIDIA device "
        "plugin's extended resources (nvidia.com/gpu, nvidia.com/mig-*), or Dynamic Resource "
        "Allocation through NVIDIA's DRA driver (gpu.nvidia.com): ResourceSlices publish the "
        "GPUs and MIG devices, each pod gets them through a ResourceClaim, and the kubelet's "
        "PodResources names them as DRA devices, not device-plugin ones.")


class Phase(BaseModel):
    """A stretch of a workload's life with one activity level."""

    model_config = ConfigDict(extra="forbid")

    for_s: Range | None = Field(
        None, description="How long the phase lasts (seconds); None = until the pod ends."
    )
    util: Range = Field(description="Activity range in percent, drawn per sample.")


class WorkloadGroup(BaseModel):
    """``count`` workloads of one shape, handed to users round-robin."""

    model_config = ConfigDict(extra="forbid")

    group: str
    count: int = Field(1, ge=1)
    kind: Literal["notebook", "batch", "inference"] = "batch"
    gpus: int = Field(1, ge=1)
    mig: dict[str, int] = Field(
        default_factory=dict,
        description="MIG devices requested by profile (e.g. {1g.10gb: 1}); when set the "
        "workload asks for these instead of whole GPUs and runs on MIG nodes only.",
    )
    arrive_s: Range = (0.0, 0.0)
    duration_s: Range | None = Field(None, description="None = runs until the scenario ends.")
    mem_gib: Range = (10.0, 40.0)
    mem_growth_gib_per_h: float = Field(
        0.0, ge=0, description="GPU memory the pod adds every hour from its start, steadily "
        "(a leak: tensors kept alive, a growing cache); 0: its memory stays as drawn.")
    mem_jitter_gib: float = Field(
        0.0, ge=0, description="Each reading of its memory is off its trend by up to this "
        "(GiB, drawn per sample): a caching allocator's ups and downs.")
    node_group: str | None = Field(
        None, description="Prefix of the node group the workloads must run on (a "
        "nodeSelector); None: any node that fits.")
    phases: list[Phase] = Field(min_length=1)
    gpus_used: int | None = Field(
        None, ge=0, description="Of its whole GPUs, how many its code uses (the first placed): "
        "the others read 0 % and hold the CUDA context's memory only (a job that asks more "
        "GPUs than it runs on). None: all of them.")
    repeat: bool = Field(False, description="Cycle through the phases instead of ending idle.")
    gang: bool = Field(
        False, description="The group's workloads are one gang (the workers of one JobSet, "
        "named after the group, in one namespace): they only work together, but the "
        "simulator's scheduler places them one by one, as the default scheduler does.",
    )
    elastic_min: int | None = Field(
        None, ge=1, description="With gang: the gang is an elastic PyTorchJob named after the "
        "group (Kubeflow's elasticPolicy.minReplicas, torchrun --nnodes=<this>:<count>), "
        "which trains once this many of its workers run; None: a JobSet, which needs them "
        "all.")
    namespace: str | None = Field(
        None, description="Namespace of the group's workloads; None: one per user "
        "(ml-<user>). A gang without one lives in ml-<group>.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Pod labels (e.g. team, gpusteward.io/idle-exempt), "
        "as the watcher reports them.")
    image: str | None = Field(
        None, description="The image of the pod's GPU container (the world's pod spec, the "
        "simulator's allocations); None: a PyTorch image.")
    env: dict[str, str] = Field(
        default_factory=dict, description="The environment of the pod's GPU container (the "
        "world's pod spec; the simulator's allocations say memory_grows from it).")
    owner: Literal["Job", "TFJob", "JAXJob", "PyTorchJob"] = Field(
        "Job", description="The controller of a batch workload's pods that is not a gang: a "
        "Job, or one of Kubeflow's training jobs (which the framework it runs follows from).")


FaultKind = Literal[
    "ecc_dbe", "xid", "sbe_burst", "pcie_replay", "nvlink_errors", "nvlink_crc_errors",
    "thermal", "thermal_target", "gpu_lost", "remap_failure", "spot_termination",
    "collector_down",
]


class Fault(BaseModel):
    """A fault injected into one GPU or node.

    ``ecc_dbe``, ``gpu_lost`` and ``remap_failure`` happen once at ``at_s`` (with the urgent
    event the NVML collector would send) and last to the end; ``xid`` sends ``count`` XID
    events ``every_s`` apart; ``sbe_burst``, ``pcie_replay``, ``nvlink_errors`` (replay +
    recovery) and ``nvlink_crc_errors`` add ``count`` to the device's counter at every sample
    for ``for_s``; ``thermal`` holds the
    GPU above its slowdown temperature, with the thermal clock-event bits, for ``for_s``;
    ``thermal_target`` holds it at its max operating temperature (87 °C, an H100 SXM's),
    its clocks trimmed by SW thermal slowdown (0x20) alone, for ``for_s``: no fault, a busy
    GPU in a warm rack keeping itself at its thermal target. ``collector_down``: from
    ``at_s`` the node's collector sends nothing, neither samples nor events (a hung
    driver takes NVML with it, or no collector runs there), while its kubelet and pods go
    on and the node takes work; for ``for_s`` if given, else to the end.
    """

    model_config = ConfigDict(extra="forbid")

    kind: FaultKind
    node: str
    gpu: int = 0
    at_s: float = Field(ge=0)
    taint: str = Field(
        "aws-node-termination-handler/spot-itn",
        description="spot_termination: the taint key put on the node at ``at_s``.",
    )
    reclaim_after_s: float = Field(
        120.0, ge=0,
        description="spot_termination: seconds from the taint until the node and its pods go "
        "(AWS gives two minutes).",
    )
    urgent_event: bool = Field(
        True, description="Also send the urgent hardware event, as NVML's event listener does; "
        "False leaves only the next sample to carry it.",
    )
    xid: int | None = Field(None, description="The XID number of an xid fault.")
    count: int = Field(1, ge=1, description="XID events to send, or counter increase per sample.")
    every_s: float = Field(60.0, gt=0, description="Seconds between repeated XID events.")
    for_s: float = Field(0.0, ge=0, description="How long a burst, thermal fault or "
                         "collector_down lasts (collector_down: 0 is to the end).")

    @model_validator(mode="after")
    def _xid_has_a_number(self) -> Fault:
        if self.kind == "xid" and self.xid is None:
            raise ValueError("an xid fault needs its xid number")
        return self


class Scenario(BaseModel):
    """A whole simulated fleet story."""

    model_config = ConfigDict(extra="forbid")

    name: str
    seed: int = 1
    start_ts: float = Field(
        1_763_683_200.0, description="Event time of t=0 (Unix seconds); fixed for reproducibility."
    )
    duration_s: float = Field(gt=0)
    sample_interval_s: float = Field(30.0, gt=0)
    acceleration: float = Field(
        360.0, ge=0, description="Simulated seconds per wall second; 0 runs as fast as possible."
    )
    cluster_queue: str = "default"
    attribution: Literal["uid", "kubelet"] = Field(
        "uid", description="How samples name the pod holding a device. kubelet: as the "
        "kubelet's PodResources API (and so the NVML collector) does, by namespace/name with "
        "no uid, while pod allocations carry no device ids, as the watcher's do: the join "
        "must match them by name. uid: both sides carry the uid and the device ids.")
    nodes: list[NodeGroup] = Field(min_length=1)
    users: list[str] = Field(min_length=1)
    workloads: list[WorkloadGroup] = Field(default_factory=list)
    faults: list[Fault] = Field(default_factory=list)

    @model_validator(mode="after")
    def _faults_name_real_nodes(self) -> Scenario:
        names = {f"{g.prefix}-{i}" for g in self.nodes for i in range(1, g.count + 1)}
        for fault in self.faults:
            if fault.node not in names:
                raise ValueError(f"fault on unknown node {fault.node!r}")
        prefixes = {g.prefix for g in self.nodes}
        for workload in self.workloads:
            if workload.node_group is not None and workload.node_group not in prefixes:
                raise ValueError(f"workload group {workload.group!r} asks for unknown node "
                                 f"group {workload.node_group!r}")
            candidates = self._candidates(workload)
            shared = [g for g in candidates if g.allocation == "dra" and g.replicas > 1]
            if shared and (len(candidates) > 1 or shared[0].count * shared[0].gpus > 1):
                raise ValueError(f"workload group {workload.group!r}: a DRA node group whose "
                                 "GPU is shared (replicas) is one node of one GPU, its pods' "
                                 "one claim, and the group's only node group")
            kinds = {g.allocation for g in candidates}
            if len(kinds) > 1:
                raise ValueError(f"workload group {workload.group!r} may run on device-plugin "
                                 "and DRA nodes alike, and its pod must ask one way: give it "
                                 "a node_group")
        return self

    def _candidates(self, workload: WorkloadGroup) -> list[NodeGroup]:
        """The node groups a workload may run on: its node_group, MIG nodes for MIG."""
        return [g for g in self.nodes if workload.node_group in (None, g.prefix)
                and bool(g.mig_layout) == bool(workload.mig)]

    def shared_dra_group(self, workload: WorkloadGroup) -> str | None:
        """The node group whose one GPU the workload's pods share through one ResourceClaim
        (a DRA node group with replicas: NVIDIA's DRA driver time-slices a GPU among the
        pods of one claim, made beforehand); None for pods with claims of their own."""
        candidates = self._candidates(workload)
        if len(candidates) == 1 and candidates[0].allocation == "dra" and \
                candidates[0].replicas > 1:
            return candidates[0].prefix
        return None

    def asks_through_dra(self, workload: WorkloadGroup) -> bool:
        """Whether the workload's pods get their GPUs through DRA claims."""
        candidates = self._candidates(workload)
        return bool(candidates) and all(g.allocation == "dra" for g in candidates)


class ScenarioError(ConfigFileError):
    """A scenario (or fake-NVML) file that cannot be used; ``issues`` locates every problem
    found as ``FILE:LINE: field: message``."""


def builtin_names() -> list[str]:
    folder = resources.files(__package__).joinpath("scenarios")
    names = (p.name for p in folder.iterdir())
    return sorted(n.removesuffix(".yaml") for n in names if n.endswith(".yaml"))


def load(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a scenario file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        text, origin = read_text(path, ScenarioError), str(path)
    else:
        resource = resources.files(__package__).joinpath("scenarios", f"{name_or_path}.yaml")
        if not resource.is_file():
            raise ScenarioError(name_or_path, [Issue(
                None, "", f"neither a file nor a built-in scenario; built-in ones: "
                f"{', '.join(builtin_names())}")])
        text, origin = resource.read_text(), f"built-in scenario {name_or_path}"
    return parse(text, origin)


def parse(text: str, origin: str = "<scenario>") -> Scenario:
    """A scenario from YAML text; :class:`ScenarioError` lists every problem with its line."""
    root, data = compose(text, origin, ScenarioError)
    if data is None:
        required = [name for name, info in Scenario.model_fields.items() if info.is_required()]
        raise ScenarioError(origin, [Issue(1, "", f"empty: a scenario needs at least "
                                                  f"{', '.join(required)}")])
    issues = duplicate_keys(root)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as error:
        raise ScenarioError(origin, issues + issues_of(error, root)) from error
    if issues:
        raise ScenarioError(origin, issues)
    return scenario
