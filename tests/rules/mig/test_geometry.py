"""MIG geometry against the research file and against a brute-force placement search."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from gpusteward.rules.mig import geometry
from gpusteward.rules.mig.geometry import Geometry, GeometryError

GEOMETRIES = geometry.load()
EIGHT_SLOT = [m for m, g in GEOMETRIES.items() if g.total_memory_slices == 8]


def brute_force_valid(geo: Geometry, layout: dict[str, int]) -> bool:
    """The conventions' validity rule, checked by trying every start of every instance."""
    instances = [geo.profile(n) for n, c in layout.items() for _ in range(c)]
    if any(c > geo.profile(n).max_instances for n, c in layout.items()):
        return False
    if sum(p.compute_slices for p in instances) > geo.total_compute_slices:
        return False
    if sum(1 for p in instances if p.name.endswith("+me")) > 1:
        return False
    for starts in itertools.product(*(p.starts for p in instances)):
        slots = [0] * geo.total_memory_slices
        ok = True
        for profile, start in zip(instances, starts, strict=True):
            for slot in range(start, start + profile.size):
                if slot >= geo.total_memory_slices or slots[slot]:
                    ok = False
                    break
                slots[slot] = 1
            if not ok:
                break
        if ok:
            return True
    return False


def brute_force_layouts(geo: Geometry, names: list[str]) -> set[tuple[tuple[str, int], ...]]:
    ranges = [range(geo.profile(n).max_instances + 1) for n in names]
    found = set()
    for counts in itertools.product(*ranges):
        layout = {n: c for n, c in zip(names, counts, strict=True) if c}
        if layout and sum(geo.profile(n).compute_slices * c for n, c in layout.items()) <= \
                geo.total_compute_slices and brute_force_valid(geo, layout):
            found.add(tuple(sorted(layout.items())))
    return found


RESEARCH = Path(__file__).resolve().parents[2] / "data" / "research"


def test_shipped_copy_equals_the_shared_research_file() -> None:
    shipped = Path(geometry.__file__).with_name("mig_profiles.yaml").read_text()
    assert shipped.startswith("# Copy of gpusteward's shared research file")
    # tests/data/research holds a copy of the shared file, so a clean clone checks it too.
    assert yaml.safe_load(shipped) == yaml.safe_load((RESEARCH / "mig_profiles.yaml")
                                                     .read_text())


@pytest.mark.parametrize("model", EIGHT_SLOT)
def test_eight_slot_models_give_the_counts_the_conventions_state(model: str) -> None:
    # conventions.derived_counts: base profiles 1g, 1g-double-mem, 2g, 3g, 4g, 7g
    # give 77 non-empty valid multisets, 28 maximal.
    geo = GEOMETRIES[model]
    assert len(geo.base_profiles) == 6
    assert len(geo.valid_layouts()) == 77
    assert len(geo.maximal_layouts()) == 28


def test_a30_gives_nine_valid_and_four_maximal() -> None:
    geo = GEOMETRIES["A30-24GB"]
    assert len(geo.valid_layouts()) == 9
    assert sorted(map(sorted, (d.items() for d in geo.maximal_layouts()))) == sorted([
        [("1g.6gb", 4)], [("2g.12gb", 2)], [("1g.6gb", 2), ("2g.12gb", 1)], [("4g.24gb", 1)],
    ])


@pytest.mark.parametrize("model", ["A100-80GB", "A30-24GB", "A100-SXM4-40GB"])
def test_enumeration_equals_brute_force_including_media_profiles(model: str) -> None:
    geo = GEOMETRIES[model]
    names = [p.name for p in geo.profiles if p.base or p.media]
    enumerated = {tuple(sorted(d.items())) for d in geo.valid_layouts(names)}
    assert enumerated == brute_force_layouts(geo, names)


def test_placement_rule_examples() -> None:
    geo = GEOMETRIES["H100-80GB"]
    assert geo.is_valid({"4g.40gb": 1, "3g.40gb": 1})
    # Two 3g instances take all eight memory slots: no room for a 1g despite 7 compute.
    assert not geo.is_valid({"3g.40gb": 2, "1g.10gb": 1})
    # 1g.20gb starts only at even slots: three of them and a 3g.40gb at 4 collide.
    assert not geo.is_valid({"1g.20gb": 3, "3g.40gb": 1})
    assert geo.is_valid({"1g.20gb": 2, "3g.40gb": 1})
    assert not geo.is_valid({"1g.10gb+me": 2})
    assert geo.placement({"7g.80gb": 1}) == [("7g.80gb", 0)]
    with pytest.raises(GeometryError, match=r"has no MIG profile '5g\.50gb'"):
        geo.is_valid({"5g.50gb": 1})


def test_find_matches_driver_and_label_spellings() -> None:
    assert geometry.find(GEOMETRIES, "NVIDIA A100-SXM4-80GB") is GEOMETRIES["A100-80GB"]
    assert geometry.find(GEOMETRIES, "NVIDIA H100 80GB HBM3") is GEOMETRIES["H100-80GB"]
    assert geometry.find(GEOMETRIES, "H100-SXM5-80GB") is GEOMETRIES["H100-80GB"]
    assert geometry.find(GEOMETRIES, "A30") is GEOMETRIES["A30-24GB"]
    assert geometry.find(GEOMETRIES, "Tesla T4") is None


@pytest.mark.parametrize(("product", "model"), [
    ("NVIDIA H200", "H200-141GB"),            # the driver's name of an H200 SXM
    ("NVIDIA-H200", "H200-141GB"),            # GFD's label of it
    ("NVIDIA H200 NVL", "H200-141GB"),
    ("NVIDIA H100 PCIe", "H100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-SXM4-40GB"),
    ("NVIDIA-H100-NVL", "H100-NVL-94GB"),
    ("NVIDIA B200", "B200-180GB"),
    ("NVIDIA A30", "A30-24GB"),
    # A single-strategy node's product label and a MIG device's NVML name.
    ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-SXM4-40GB"),
    ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gbme", "H100-80GB"),
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "A100-80GB"),
    ("NVIDIA GH200 480GB", None),             # no placement table in the research file
])
def test_find_every_targeted_model_by_its_real_names(product: str, model: str | None) -> None:
    found = geometry.find(GEOMETRIES, product)
    assert (found.model if found else None) == model
