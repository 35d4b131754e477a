"""Dynamic Resource Allocation: which GPUs a pod holds through its ResourceClaims.

With DRA (``resource.k8s.io/v1``, GA in Kubernetes 1.34) a pod asks for
devices through ResourceClaims instead of an extended resource such as
``nvidia.com/gpu``. Three objects say what it holds:

- the pod names its claims: ``spec.resourceClaims[].resourceClaimName`` for a
  claim made beforehand, or ``resourceClaimTemplateName``, whose claim the
  resourceclaim controller creates and names in
  ``status.resourceClaimStatuses[].resourceClaimName``;
- the claim, once the scheduler allocated it, lists the devices in
  ``status.allocation.devices.results[]`` as (``driver``, ``pool``,
  ``device``) and the pods it is reserved for in ``status.reservedFor``;
- the driver's ResourceSlices publish each device of a pool by name with its
  attributes: NVIDIA's driver (``gpu.nvidia.com``) sets ``type`` (``gpu``,
  ``mig``, ``vfio``), ``uuid``, ``profile`` (a MIG device's, ``1g.10gb``) and
  ``productName``.

:class:`DraIndex` keeps the last two (for the drivers watched only) and
resolves a claim, for one pod, to the GPUs and MIG devices it holds, by GPU
or MIG uuid: what the worker's join matches samples with. It also counts what
each node's slices publish (whole GPUs, MIG devices by profile), which is a DRA
node's capacity: no device plugin advertises ``nvidia.com/gpu`` there. Pure,
like the translator that uses it.

What is left out, deliberately: a device allocated for admin access
(``adminAccess``: monitoring, not a hold). A claim shared by several pods counts
its devices with the first pod it is reserved for only, so a GPU is never
counted twice; the others are reported holding a share of it (no GPU of their
own), so the worker knows their owners when it judges them on the device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpusteward.collectors.kubernetes.reflector import Delta, Obj
from gpusteward.schema import MIG_RESOURCE_PREFIX

DRA_GROUP = "resource.k8s.io"
DRA_VERSION = "v1"
"""The GA version (Kubernetes 1.34). Clusters before it serve only v1beta1/v1beta2
(or nothing): the watcher then runs without claims and says so."""
DRA_RESOURCES = ("resourceslices", "resourceclaimtemplates", "resourceclaims")
"""In the order they are listed: a claim's devices are looked up in the slices; a waiting
pod's requests are read from its claims, or from the templates they are made from."""

DeviceKey = tuple[str, str, str]
"""(driver, pool, device name): how a claim's allocation names a device."""

GPU_TYPES = frozenset({"gpu", "vfio"})
"""NVIDIA driver device types that are a whole physical GPU (``vfio``: passed through
to a virtual machine)."""
MIG_TYPE = "mig"

GPU_CLASSES = frozenset({"gpu.nvidia.com", "vfio.gpu.nvidia.com"})
"""The DeviceClasses NVIDIA's DRA driver installs for whole GPUs: what a request naming one
asks for, before any device is allocated."""
MIG_CLASS = "mig.nvidia.com"
"""NVIDIA's DeviceClass of MIG devices; the profile is chosen by a CEL selector on the
``profile`` attribute (``device.attributes['gpu.nvidia.com'].profile == '3g.40gb'``)."""
_PROFILE_SELECTED = re.compile(r"""profile\W*==\s*["']([^"']+)["']""")


@dataclass(frozen=True, slots=True)
class DraDevice:
    """A device of a watched driver, as its ResourceSlice publishes it."""

    uuid: str | None
    type: str | None
    """The driver's ``type`` attribute: gpu, mig or vfio for NVIDIA's."""
    profile: str | None
    """A MIG device's profile (``3g.40gb``), None otherwise."""


@dataclass(frozen=True, slots=True)
class Held:
    """What one claim gives one pod."""

    gpus: int = 0
    mig: tuple[tuple[str, int], ...] = ()
    """(profile, count), sorted."""
    device_ids: tuple[str, ...] = ()
    """GPU and MIG uuids, in the allocation's order."""
    share: bool = False
    """A share of a claim whose devices count with another pod (the first it is reserved
    for): the pod holds no GPU of its own, but is one of the devices' holders."""


@dataclass(frozen=True, slots=True)
class Claim:
    """What the watcher keeps of a ResourceClaim."""

    allocated: bool
    results: tuple[DeviceKey, ...]
    """The allocated devices of the watched drivers, admin access left out."""
    consumers: tuple[tuple[str | None, str], ...]
    """(uid, name) of the pods it is reserved for, in the API's order."""
    asked: tuple[tuple[str, int], ...] = ()
    """What its device requests ask for (:func:`requested`), as (resource, count)."""


def attribute(device: Obj, name: str, driver: str) -> str | None:
    """A device attribute's value as text; a name without a domain is the driver's own,
    so ``uuid`` and ``gpu.nvidia.com/uuid`` are one attribute."""
    attributes = device.get("attributes") or {}
    value = attributes.get(name) or attributes.get(f"{driver}/{name}")
    if not isinstance(value, dict):
        return None
    for kind in ("string", "version", "int", "bool"):
        if value.get(kind) is not None:
            return str(value[kind])
    return None


def capacity_name(device: DraDevice) -> str | None:
    """The extended resource a device plugin would advertise the device as: a whole GPU as
    ``nvidia.com/gpu``, a MIG device as ``nvidia.com/mig-<profile>`` (a ``+`` written ``.``,
    as the device plugin writes it); None for another type."""
    if device.type in GPU_TYPES:
        return "nvidia.com/gpu"
    if device.type == MIG_TYPE and device.profile:
        return MIG_RESOURCE_PREFIX + device.profile.replace("+", ".")
    return None


def requested(devices: Obj | None) -> dict[str, int]:
    """What a claim's (or a template's) ``spec.devices`` asks for, named as the device plugin
    names it (``nvidia.com/gpu``, ``nvidia.com/mig-<profile>``): what a waiting pod needs,
    before the scheduler picked any device. A request of NVIDIA's GPU classes asks for
    ``count`` GPUs, one of its MIG class for ``count`` devices of the profile its selector
    names; ``allocationMode: All`` (every matching device of a node, at least one) counts
    one; of a prioritized list (``firstAvailable``) the first choice counts. Admin access,
    other classes and a MIG request naming no one profile ask for nothing this can tell."""
    asked: dict[str, int] = {}
    for request in (devices or {}).get("requests") or []:
        wanted: Obj = request.get("exactly") or next(iter(request.get("firstAvailable") or []),
                                                     {})
        if wanted.get("adminAccess"):
            continue
        count = 1 if wanted.get("allocationMode") == "All" else int(wanted.get("count", 1))
        device_class = wanted.get("deviceClassName")
        if device_class in GPU_CLASSES:
            resource = "nvidia.com/gpu"
        elif device_class == MIG_CLASS:
            profiles = {found for selector in wanted.get("selectors") or []
                        for found in _PROFILE_SELECTED.findall(
                            (selector.get("cel") or {}).get("expression", ""))}
            if len(profiles) != 1:
                continue
            resource = MIG_RESOURCE_PREFIX + profiles.pop().replace("+", ".")
        else:
            continue
        asked[resource] = asked.get(resource, 0) + count
    return asked


def pod_claims(pod: Obj) -> list[str]:
    """``namespace/name`` of the claims a pod's spec names, as far as they are named: a
    claim from a template is named once the resourceclaim controller made it (and not at
    all when no claim was needed)."""
    meta, spec = pod["metadata"], pod.get("spec") or {}
    namespace = meta.get("namespace", "")
    made = {status.get("name"): status.get("resourceClaimName")
            for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    names = []
    for claim in spec.get("resourceClaims") or []:
        name = claim.get("resourceClaimName") or made.get(claim.get("name"))
        if name:
            names.append(f"{namespace}/{name}")
    return names


@dataclass
class DraIndex:
    """The watched drivers' devices and the claims, and what a claim gives a pod."""

    drivers: frozenset[str]
    devices: dict[DeviceKey, DraDevice] = field(default_factory=dict)
    slices: dict[str, list[DeviceKey]] = field(default_factory=dict)
    """A slice's object key -> the devices it published (a pool may span slices)."""
    claims: dict[str, Claim] = field(default_factory=dict)
    """``namespace/name`` -> the claim."""
    claim_names: dict[str, str] = field(default_factory=dict)
    """A claim's object key -> its ``namespace/name`` (a relist reports deletions by key)."""
    templates: dict[str, dict[str, int]] = field(default_factory=dict)
    """``namespace/name`` of a ResourceClaimTemplate -> what its claims ask for."""
    template_names: dict[str, str] = field(default_factory=dict)
    """A template's object key -> its ``namespace/name``."""
    slice_nodes: dict[str, str] = field(default_factory=dict)
    """A node-local slice's object key -> its node."""
    node_slices: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    """Node -> its slices' keys -> the devices each publishes, counted as a device plugin
    would advertise them (``nvidia.com/gpu``, ``nvidia.com/mig-<profile>``)."""

    def on_slice(self, delta: Delta) -> set[str]:
        """Keep a slice's change; the nodes whose published devices it changed."""
        for key in self.slices.pop(delta.key, ()):
            self.devices.pop(key, None)
        touched: set[str] = set()
        before = self.slice_nodes.pop(delta.key, None)
        if before is not None:
            touched.add(before)
            of_node = self.node_slices[before]
            del of_node[delta.key]
            if not of_node:
                del self.node_slices[before]
        if delta.type == "DELETED" or delta.obj is None:
            return touched
        spec = delta.obj.get("spec") or {}
        driver = spec.get("driver", "")
        if driver not in self.drivers:
            return touched
        pool = (spec.get("pool") or {}).get("name", "")
        published = []
        counts: dict[str, int] = {}
        for device in spec.get("devices") or []:
            key = (driver, pool, str(device["name"]))
            found = self.devices[key] = DraDevice(
                uuid=attribute(device, "uuid", driver), type=attribute(device, "type", driver),
                profile=attribute(device, "profile", driver))
            published.append(key)
            # A partitionable device (KEP-4815: a GPU and the MIG devices that may be carved
            # from it, all drawing on shared counters) is a possibility, not capacity.
            if not device.get("consumesCounters"):
                resource = capacity_name(found)
                if resource is not None:
                    counts[resource] = counts.get(resource, 0) + 1
        self.slices[delta.key] = published
        node = spec.get("nodeName")
        if node:
            self.slice_nodes[delta.key] = node
            self.node_slices.setdefault(node, {})[delta.key] = counts
            touched.add(node)
        return touched

    def node_capacity(self, node: str) -> dict[str, int]:
        """What the watched drivers' slices of ``node`` publish, counted by resource name;
        empty when they publish nothing there. Whole GPUs are counted even when there are
        none (every GPU partitioned), as the device plugin's mixed strategy advertises
        ``nvidia.com/gpu: 0``: a partitioned GPU is no free GPU."""
        slices = self.node_slices.get(node)
        if not slices:
            return {}
        total: dict[str, int] = {"nvidia.com/gpu": 0}
        for counts in slices.values():
            for resource, count in counts.items():
                total[resource] = total.get(resource, 0) + count
        return total

    def on_claim(self, delta: Delta) -> str | None:
        """Keep a claim's change; its ``namespace/name``, None for one never seen."""
        if delta.type == "DELETED" or delta.obj is None:
            name = self.claim_names.pop(delta.key, None)
            if name is not None:
                self.claims.pop(name, None)
            return name
        meta, status = delta.obj["metadata"], delta.obj.get("status") or {}
        name = f"{meta.get('namespace', '')}/{meta['name']}"
        self.claim_names[delta.key] = name
        allocation = status.get("allocation")
        results = ((allocation or {}).get("devices") or {}).get("results") or []
        self.claims[name] = Claim(
            allocated=allocation is not None,
            asked=tuple(requested((delta.obj.get("spec") or {}).get("devices")).items()),
            results=tuple((r["driver"], r.get("pool", ""), r["device"]) for r in results
                          if r.get("driver") in self.drivers and not r.get("adminAccess")),
            consumers=tuple((c.get("uid"), c.get("name", ""))
                            for c in status.get("reservedFor") or []
                            if c.get("resource") == "pods" and not c.get("apiGroup")))
        return name

    def on_template(self, delta: Delta) -> None:
        """Keep a ResourceClaimTemplate's change: what the claims made from it ask for."""
        if delta.type == "DELETED" or delta.obj is None:
            name = self.template_names.pop(delta.key, None)
            if name is not None:
                self.templates.pop(name, None)
            return
        meta = delta.obj["metadata"]
        name = self.template_names[delta.key] = f"{meta.get('namespace', '')}/{meta['name']}"
        claim_spec = (delta.obj.get("spec") or {}).get("spec") or {}
        self.templates[name] = requested(claim_spec.get("devices"))

    def asked(self, namespace: str, spec: Obj, status: Obj | None = None
              ) -> dict[str, int] | None:
        """What the claims a pod spec (a pod's, or a workload's pod template) names ask for,
        added up: a claim's own requests where it is seen (named in the spec, or made from
        a template and named in the pod's ``status``), else its template's. None while a
        claim or template named is not seen."""
        made = {entry.get("name"): entry.get("resourceClaimName")
                for entry in (status or {}).get("resourceClaimStatuses") or []}
        total: dict[str, int] = {}
        for entry in spec.get("resourceClaims") or []:
            name = entry.get("resourceClaimName") or made.get(entry.get("name"))
            claim = self.claims.get(f"{namespace}/{name}") if name else None
            if claim is not None:
                asked = dict(claim.asked)
            elif entry.get("resourceClaimName"):
                return None
            else:
                template = self.templates.get(
                    f"{namespace}/{entry.get('resourceClaimTemplateName')}")
                if template is None:
                    return None
                asked = template
            for resource, count in asked.items():
                total[resource] = total.get(resource, 0) + count
        return total

    def resolve(self, claim_name: str, uid: str | None, pod: str) -> tuple[Held | None,
                                                                              str | None]:
        """What claim ``namespace/name`` gives the pod (``uid``, name ``pod``), with the
        reason it cannot tell where it cannot.

        (held, None): resolved for good (a claim reserved for a pod keeps its allocation
        until the pod is done). (None, None): not yet: the claim is not seen, not allocated
        or not reserved for the pod. (None, reason): allocated to the pod, but a device is
        not in any slice or says no uuid or no type this index knows. (Held(share=True),
        None): a claim shared with other pods, whose devices count with the first of them.
        """
        claim = self.claims.get(claim_name)
        if claim is None or not claim.allocated:
            return None, None
        mine = [i for i, (their_uid, name) in enumerate(claim.consumers)
                if (their_uid == uid if uid and their_uid else name == pod)]
        if not mine:
            return None, None
        if mine[0] > 0:
            return Held(share=bool(claim.results)), None
        gpus, ids = 0, []
        mig: dict[str, int] = {}
        for key in claim.results:
            device = self.devices.get(key)
            where = f"claim {claim_name}: device {key[0]} {key[1]}/{key[2]}"
            if device is None:
                return None, f"{where} is in no ResourceSlice"
            if device.uuid is None:
                return None, f"{where} has no uuid attribute"
            if device.type == MIG_TYPE and device.profile:
                mig[device.profile] = mig.get(device.profile, 0) + 1
            elif device.type in GPU_TYPES:
                gpus += 1
            else:
                return None, f"{where} is of type {device.type!r}, neither a GPU nor MIG"
            ids.append(device.uuid)
        return Held(gpus, tuple(sorted(mig.items())), tuple(ids)), None
