"""MIG geometry: which sets of GPU instances a GPU model can hold at once.

The facts come from ``mig_profiles.yaml`` (shipped next to this module, a
copy of the project's research file). Its ``conventions`` block states the
rule implemented here: a multiset of GPU instances is creatable iff each
profile's count is within its ``max_instances``, the compute slices sum to
at most the model's total, at most one ``+me`` instance is present, and the
instances can be given start positions from their profile's ``starts`` so
that their memory ranges ``[start, start + size)`` do not overlap.

Everything is keyed on profile *names*: profile ids differ across models.
A layout is a mapping ``{profile name: count}`` for one GPU. The search for
a placement is a small backtracking over at most 8 memory slots, so checking
one layout costs microseconds and enumerating all of a model's layouts a few
milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gpusteward.errors import PermanentError

Layout = Mapping[str, int]
"""Instances on one GPU: profile name -> count. Zero counts are ignored."""

_NAME = re.compile(r"^(?P<g>\d+)g\.(?P<gb>\d+)gb(?P<suffix>.*)$")


class GeometryError(PermanentError, ValueError):
    """A profile file or a layout that does not make sense."""


@dataclass(frozen=True)
class Profile:
    """One GPU-instance profile of one GPU model."""

    name: str
    compute_slices: int
    memory_slices: int
    max_instances: int
    starts: tuple[int, ...]
    size: int
    memory_gib: float | None = None
    """Usable GiB as nvidia-smi reports it, when the research file knows it."""
    gi_profile_id: int | None = None
    """NVML's GPU-instance profile id (``nvidia-smi mig -lgip``), when the file knows it."""
    placement_verified: bool = True
    """Whether ``starts`` come from a capture of ``nvidia-smi mig -lgipp`` on the model; False:
    inferred (from the memory fractions of a sibling model), so advice built on it must say
    so. A profile the file does not mark verified is not."""

    @property
    def media(self) -> bool:
        """True for ``+me`` profiles (media engines); a GPU may hold one of them at most."""
        return self.name.endswith("+me")

    @property
    def base(self) -> bool:
        """True for plain ``<G>g.<GB>gb`` profiles (no ``+me``/``+gfx``/``-me`` variant)."""
        match = _NAME.match(self.name)
        return bool(match) and not match.group("suffix")  # type: ignore[union-attr]

    @property
    def nominal_gb(self) -> int:
        match = _NAME.match(self.name)
        if not match:
            raise GeometryError(f"profile name {self.name!r} does not read <G>g.<GB>gb")
        return int(match.group("gb"))

    @property
    def usable_bytes(self) -> int:
        """Memory a workload can use: nvidia-smi's figure, else 97.5 % of the nominal GB.

        97.5 % is the ratio nvidia-smi shows on the captured models (9.75 GiB for
        ``1g.10gb``), so a workload sized against the name still fits.
        """
        gib = self.memory_gib if self.memory_gib is not None else self.nominal_gb * 0.975
        return int(gib * (1 << 30))


@dataclass(frozen=True)
class Geometry:
    """The MIG geometry of one GPU model."""

    model: str
    total_memory_slices: int
    total_compute_slices: int
    profiles: tuple[Profile, ...]
    aliases: tuple[str, ...] = ()
    _by_name: dict[str, Profile] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({p.name: p for p in self.profiles})

    def profile(self, name: str) -> Profile:
        try:
            return self._by_name[name]
        except KeyError:
            valid = ", ".join(p.name for p in self.profiles)
            raise GeometryError(f"{self.model} has no MIG profile {name!r}; it has {valid}"
                                ) from None

    @property
    def full_profile(self) -> Profile | None:
        """The one-instance-per-GPU profile (``7g.80gb``): the same as a GPU with MIG off."""
        return next((p for p in self.base_profiles
                     if p.compute_slices == self.total_compute_slices
                     and p.memory_slices == self.total_memory_slices), None)

    @property
    def base_profiles(self) -> tuple[Profile, ...]:
        return tuple(p for p in self.profiles if p.base)

    def is_valid(self, layout: Layout) -> bool:
        """Whether ``layout`` can be created on one GPU of this model (see module doc)."""
        return self.placement(layout) is not None

    def placement(self, layout: Layout) -> list[tuple[str, int]] | None:
        """A start position for every instance of ``layout``, or None if there is none."""
        instances: list[Profile] = []
        compute = 0
        media = 0
        for name, count in layout.items():
            if count < 0:
                raise GeometryError(f"negative count {count} for {name}")
            if count == 0:
                continue
            profile = self.profile(name)
            if count > profile.max_instances:
                return None
            compute += profile.compute_slices * count
            media += count if profile.media else 0
            instances.extend([profile] * count)
        if compute > self.total_compute_slices or media > 1:
            return None
        # Largest first: big instances have the fewest starts, so dead ends show early.
        instances.sort(key=lambda p: (-p.size, len(p.starts), p.name))
        chosen: list[tuple[str, int]] = []

        def place(i: int, used: int) -> bool:
            if i == len(instances):
                return True
            profile = instances[i]
            # Identical instances take increasing starts: the same set in another order
            # is the same placement, and trying it again would be exponential waste.
            floor = chosen[-1][1] + 1 if i and instances[i - 1] is profile else -1
            for start in profile.starts:
                if start < floor:
                    continue
                mask = ((1 << profile.size) - 1) << start
                if start + profile.size > self.total_memory_slices or used & mask:
                    continue
                chosen.append((profile.name, start))
                if place(i + 1, used | mask):
                    return True
                chosen.pop()
            return False

        return list(chosen) if place(0, 0) else None

    def valid_layouts(self, profiles: Iterable[str] | None = None) -> list[dict[str, int]]:
        """Every non-empty valid layout over ``profiles`` (default: the base profiles)."""
        names = [p.name for p in self.base_profiles] if profiles is None else list(profiles)
        return [layout for layout in self._enumerate(names) if layout]

    def maximal_layouts(self, profiles: Iterable[str] | None = None) -> list[dict[str, int]]:
        """Valid layouts to which no instance of ``profiles`` can be added."""
        names = [p.name for p in self.base_profiles] if profiles is None else list(profiles)
        return [
            layout for layout in self.valid_layouts(names)
            if not any(self.is_valid(_plus(layout, name)) for name in names)
        ]

    def _enumerate(self, names: list[str]) -> Iterator[dict[str, int]]:
        def walk(i: int, layout: dict[str, int]) -> Iterator[dict[str, int]]:
            if i == len(names):
                yield {k: v for k, v in layout.items() if v}
                return
            for count in range(self.profile(names[i]).max_instances + 1):
                layout[names[i]] = count
                # Adding instances never makes an invalid layout valid, so stop counting up.
                if count and not self.is_valid(layout):
                    break
                yield from walk(i + 1, layout)
            layout[names[i]] = 0

        yield from walk(0, {})

    @cached_property
    def gpu_fraction(self) -> dict[str, float]:
        """Each profile's share of the GPU's compute, the unit GPU-hours are counted in."""
        return {p.name: p.compute_slices / self.total_compute_slices for p in self.profiles}


def _plus(layout: Layout, name: str) -> dict[str, int]:
    grown = dict(layout)
    grown[name] = grown.get(name, 0) + 1
    return grown


DEFAULT_PATH = "mig_profiles.yaml"


def load(path: str | Path | None = None) -> dict[str, Geometry]:
    """Every model's geometry from ``path`` (default: the copy shipped with gpusteward)."""
    if path is None:
        text = resources.files(__package__ or "gpusteward.rules.mig").joinpath(
            DEFAULT_PATH).read_text()
    else:
        text = Path(path).read_text()
    try:
        document = yaml.safe_load(text)
        return {name: _geometry(name, spec) for name, spec in document["gpu_models"].items()}
    except (KeyError, TypeError, yaml.YAMLError) as error:
        raise GeometryError(f"cannot read MIG profiles from {path or DEFAULT_PATH}: {error}"
                            ) from error


def _geometry(model: str, spec: dict[str, Any]) -> Geometry:
    profiles = tuple(
        Profile(
            name=p["name"], compute_slices=int(p["compute_slices"]),
            memory_slices=int(p["memory_slices"]), max_instances=int(p["max_instances"]),
            starts=tuple(int(s) for s in p["placement"]["starts"]),
            size=int(p["placement"]["size"]),
            memory_gib=p.get("memory_gib_nvidia_smi"), gi_profile_id=p.get("gi_profile_id"),
            placement_verified=p.get("placement_verified") is True,
        )
        for p in spec["profiles"]
    )
    return Geometry(model=model, total_memory_slices=int(spec["total_memory_slices"]),
                    total_compute_slices=int(spec["total_compute_slices"]),
                    profiles=profiles, aliases=tuple(spec.get("aliases", ())))


DRIVER_NAMES: dict[str, str] = {
    "NVIDIA H200": "H200-141GB",
    "NVIDIA H100 PCIe": "H100-80GB",
    "NVIDIA A100 80GB PCIe": "A100-80GB",
}
"""Product names the driver reports (``nvidia-smi``, NVML, GFD's ``nvidia.com/gpu.product``
with ``-`` for spaces) that no model key or alias of the research file spells: an H200
SXM is plain ``NVIDIA H200`` (captured on a real one, docs/collectors.md), the PCIe
H100 and the 80 GB PCIe A100 carry their form factor, not the SXM part number."""


def find(geometries: Mapping[str, Geometry], product: str) -> Geometry | None:
    """The geometry of a GPU as the driver or a node label names it, if it supports MIG.

    ``NVIDIA A100-SXM4-80GB``, ``NVIDIA-A100-SXM4-80GB`` and ``A100-80GB`` all find
    ``A100-80GB``: names are compared without the vendor prefix, spaces and dashes,
    against the model key, its aliases and :data:`DRIVER_NAMES`. A MIG device's name
    (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``) and a ``single``-strategy node's product label
    (``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb``) find their GPU's model.
    """
    wanted = _squash(product)
    for geometry in geometries.values():
        names = [geometry.model]
        names.extend(driver for driver, model in DRIVER_NAMES.items()
                     if model == geometry.model)
        for alias in geometry.aliases:
            # "H100-SXM5-80GB (NVIDIA H100 80GB HBM3)": both spellings name the model.
            names.extend(part.strip(" )") for part in alias.split(" ("))
        if any(_squash(n) == wanted for n in names):
            return geometry
    return None


_MIG_SUFFIX = re.compile(r"[\s\-_]MIG([\s\-_].*)?$", re.IGNORECASE)


def _squash(name: str) -> str:
    name = _MIG_SUFFIX.sub("", name.strip()).upper().removeprefix("NVIDIA")
    return re.sub(r"[\s\-_]", "", name)
