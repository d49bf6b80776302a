"""The built-in catalog against its research record (tests/data/mig-tables.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from migd.core import catalog
from migd.core.geometry import Geometry, NvmlProfileInfo, Variant
from migd.errors import UnknownModel, UnknownProfile

# The repository carries its own copy of the record (tests/data/README.md says where from).
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "mig-tables.json"
ISSUE_MODELS = [
    "A30-24GB",
    "A100-40GB",
    "A100-80GB",
    "H100-80GB",
    "H100-94GB",
    "H100-96GB",
    "H200-141GB",
    "GH200-144GB",
    "B200-180GB",
    "GB200-186GB",
]


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


def test_every_issue_model_is_built_in() -> None:
    models = catalog.builtin_models()
    for name in ISSUE_MODELS:
        assert name in models


@pytest.mark.parametrize("model", [*ISSUE_MODELS, "RTX-PRO-6000-96GB"])
def test_profiles_match_reference(reference: dict, model: str) -> None:
    ref = reference["gpus"][model]
    geo = catalog.geometry(model)
    assert geo.units == ref["placement_units_total"]
    assert geo.compute_slices == ref["compute_slices_total"]
    assert {p.profile_id for p in geo.profiles} == {p["id"] for p in ref["profiles"]}
    for rp in ref["profiles"]:
        p = geo.by_id(rp["id"])
        assert p.name == rp["name"]
        assert p.nvml_index == rp["nvml_profile_index"]
        assert p.compute_slices == rp["compute_slices"]
        assert p.memory_slices == rp["memory_slices"]
        assert p.max_instances == rp["max_instances"]
        assert p.variant.value == rp["variant"]
        assert [(s, p.memory_slices) for s in p.starts] == [
            (pl["start"], pl["size"]) for pl in rp["placements"]
        ]
        if rp["memory_mib"]:
            assert p.memory_mib == rp["memory_mib"] and not p.memory_inferred
        else:
            assert p.memory_inferred and p.memory_mib > 0
        if rp.get("default_placement_order_observed"):
            assert list(p.default_order) == rp["default_placement_order_observed"]
        assert sorted(p.default_order) == sorted(p.starts)
    ref_groups = {
        (frozenset(geo.profile(n).profile_id for n in g["profiles"]), g["max"])
        for g in ref.get("exclusive_groups", [])
    }
    assert {(g.profile_ids, g.max_instances) for g in geo.exclusive_groups} == ref_groups


def test_grid_size_is_per_model_not_eight() -> None:
    assert catalog.geometry("A30-24GB").units == 4
    assert catalog.geometry("RTX-PRO-6000-96GB").units == 12
    assert catalog.geometry("H100-80GB").units == 8


def test_media_profiles_share_one_ofa_everywhere() -> None:
    for geo in catalog.builtin_models().values():
        me = {p.profile_id for p in geo.profiles if p.variant is Variant.ME}
        if not me:
            continue
        capped = [g for g in geo.exclusive_groups if me <= g.profile_ids and g.max_instances == 1]
        budget = geo.engine_budget or {}
        assert capped or budget.get("ofa") == 1, geo.model


@pytest.mark.parametrize(
    ("model", "text", "expected"),
    [
        ("A100-40GB", "3g.20gb", "3g.20gb"),
        ("A100-40GB", "MIG 3g.20gb", "3g.20gb"),
        ("A100-40GB", " 1G.5GB ", "1g.5gb"),
        ("A100-40GB", "1g.5gb+me", "1g.5gb+me"),
        ("A100-40GB", "19", "1g.5gb"),
        ("A100-40GB", "id:15", "1g.10gb"),
        ("H100-80GB", "3g.39gb", "3g.40gb"),  # a driver that rounds 39.5 GiB down
        ("A100-80GB", "3g.39gb", "3g.40gb"),
        ("GB200-186GB", "1g.24gb", "1g.23gb"),  # earlier driver name (mig-parted #227)
        ("GB200-186GB", "1g.24gb+me", "1g.23gb+me"),
    ],
)
def test_name_variants_resolve(model: str, text: str, expected: str) -> None:
    assert catalog.geometry(model).profile(text).name == expected


def test_variants_do_not_cross_suffix_or_compute() -> None:
    geo = catalog.geometry("A100-40GB")
    assert geo.profile("1g.5gb").variant is Variant.BASE
    assert geo.profile("2g.10gb").compute_slices == 2
    assert geo.profile("1g.10gb").compute_slices == 1


def test_unknown_profile_lists_valid_names() -> None:
    with pytest.raises(UnknownProfile) as err:
        catalog.geometry("A100-40GB").profile("5g.30gb")
    assert "5g.30gb" in err.value.message
    for name in ("1g.5gb", "3g.20gb", "7g.40gb"):
        assert name in err.value.hint


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(UnknownModel) as err:
        catalog.geometry("V100-32GB")
    assert "A100-40GB" in err.value.hint


@pytest.mark.parametrize(
    ("pci", "name", "mib", "expected"),
    [
        (0x20B010DE, "", 0, "A100-40GB"),
        (0x20B0, "", 0, "A100-40GB"),
        (0x233010DE, "NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        (None, "NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        (None, "NVIDIA A100-PCIE-40GB", 40960, "A100-40GB"),
        (None, "NVIDIA H100 NVL", 95830, "H100-94GB"),
        (None, "NVIDIA H200", 143771, "H200-141GB"),
        (None, "NVIDIA GH200 480GB", 97871, "H100-96GB"),
        (None, "Tesla V100-SXM2-32GB", 32768, None),
    ],
)
def test_detect_model(pci: int | None, name: str, mib: int, expected: str | None) -> None:
    assert catalog.detect_model(pci, name, mib) == expected


def test_geometry_from_nvml_for_an_unknown_model() -> None:
    """An unknown GPU works from NVML data alone (here an A30-shaped part)."""
    infos = [
        NvmlProfileInfo(0, 14, 1, 4, 5949, "MIG 1g.6gb"),
        NvmlProfileInfo(7, 21, 1, 1, 5949, "MIG 1g.6gb+me"),
        NvmlProfileInfo(1, 5, 2, 2, 11971, "MIG 2g.12gb"),
        NvmlProfileInfo(8, 6, 2, 1, 11971, "MIG 2g.12gb+me"),
        NvmlProfileInfo(3, 0, 4, 1, 24003, "MIG 4g.24gb"),
    ]
    placements = {
        14: [(0, 1), (1, 1), (2, 1), (3, 1)],
        21: [(0, 1), (1, 1), (2, 1), (3, 1)],
        5: [(0, 2), (2, 2)],
        6: [(0, 2), (2, 2)],
        0: [(0, 4)],
    }
    geo = Geometry.from_nvml("Mystery-24GB", infos, placements)
    assert geo.units == 4 and geo.compute_slices == 4 and geo.memory_mib == 24003
    assert geo.profile("1g.6gb+me").variant is Variant.ME
    # no table to say so, so all media profiles share the single OFA
    assert [(g.profile_ids, g.max_instances) for g in geo.exclusive_groups] == [
        (frozenset({21, 6}), 1)
    ]


def test_geometry_from_nvml_keeps_builtin_knowledge() -> None:
    builtin = catalog.geometry("A100-40GB")
    infos = [
        NvmlProfileInfo(p.nvml_index, p.profile_id, p.compute_slices, p.max_instances, p.memory_mib)
        for p in builtin.profiles
        if p.profile_id != 15  # an older driver without 1g.10gb
    ]
    placements = {p.profile_id: [(s, p.memory_slices) for s in p.starts] for p in builtin.profiles}
    geo = Geometry.from_nvml("A100-40GB", infos, placements, builtin=builtin)
    assert geo.source == "nvml"
    assert [p.name for p in geo.profiles] == [
        p.name for p in builtin.profiles if p.profile_id != 15
    ]
    assert geo.profile("1g.5gb").default_order == (6, 4, 5, 0, 1, 2, 3)


@pytest.mark.parametrize(
    ("model", "text"),
    [
        ("A30-24GB", "1g.5gb"),  # A100's smallest is not A30's 1g.6gb
        ("A100-40GB", "1g.6gb"),
        ("A100-40GB", "1g.4gb"),
        ("H100-80GB", "1g.5gb"),
        ("A100-40GB", "3g.20gb+me"),  # no such variant: the suffix must match
    ],
)
def test_names_of_other_sizes_do_not_resolve(model: str, text: str) -> None:
    with pytest.raises(UnknownProfile):
        catalog.geometry(model).profile(text)


def nameless(geo: Geometry) -> tuple[list[NvmlProfileInfo], dict[int, list[tuple[int, int]]]]:
    """What a driver without profile names (v1 infos) reports for ``geo``."""
    infos = [
        NvmlProfileInfo(p.nvml_index, p.profile_id, p.compute_slices, p.max_instances, p.memory_mib)
        for p in geo.profiles
    ]
    return infos, {p.profile_id: [(s, p.memory_slices) for s in p.starts] for p in geo.profiles}


@pytest.mark.parametrize("model", catalog.model_names())
def test_synthesized_names_are_nvidias(model: str) -> None:
    """Named from the marketed size (the device total rounded up to GiB) times the
    share of memory slices, rounded to nearest, as NVIDIA names them."""
    geo = catalog.geometry(model)
    marketed_gb = int(model.rsplit("-", 1)[1].removesuffix("GB"))
    # devices report a little less than the marketed size (H100 80GB: 81559 MiB)
    built = Geometry.from_nvml("Unknown", *nameless(geo), memory_total_mib=marketed_gb * 1024 - 400)
    assert {p.profile_id: p.name for p in built.profiles} == {
        p.profile_id: p.name for p in geo.profiles
    }


@pytest.mark.parametrize("model", ["A30-24GB", "A100-40GB", "H100-80GB", "H100-94GB"])
def test_synthesized_names_without_the_device_total(model: str) -> None:
    """Without the device total the full profile's memory stands in (4864 MiB on an
    A100-40GB is 1g.5gb, not the 1g.4gb that rounding it down gives)."""
    geo = catalog.geometry(model)
    built = Geometry.from_nvml("Unknown", *nameless(geo))
    assert {p.profile_id: p.name for p in built.profiles} == {
        p.profile_id: p.name for p in geo.profiles
    }
