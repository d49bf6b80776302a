#!/usr/bin/env python3
"""Regenerate migd/core/data/mig_catalog.json from tests/data/mig-tables.json.

The input is the repository's copy of the research record (see tests/data/README.md for
where it came from), so a fresh clone regenerates the catalog with nothing beside it.

The reference file is the research record (sources, verbatim/inferred status).
The catalog is what migd ships: the same placement tables, plus the values the
reference leaves open, each filled by a stated rule and flagged as inferred:

* memory of a profile with no published size: the model's per-slice memory
  taken from its largest published profile, times the profile's slices
  (H100-96GB has none published: H100-94GB's sizes scaled by 96/94);
* driver default placement order: observed on A100/H100; the other 8-slice
  models share that geometry, so they get the same order, flagged inferred;
  A30 and RTX PRO have none observed and use ascending starts.

tests/unit/test_catalog.py checks the catalog against the reference again.
Usage: python scripts/gen_catalog.py [REFERENCE_JSON] [OUT_JSON]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REF = ROOT / "tests" / "data" / "mig-tables.json"
DEFAULT_OUT = ROOT / "migd" / "core" / "data" / "mig_catalog.json"

FAMILY_ORDER = {  # A100/H100 observed (reference 'default-order'), keyed by (units, starts)
    (1, (0, 1, 2, 3, 4, 5, 6)): [6, 4, 5, 0, 1, 2, 3],
    (2, (0, 2, 4, 6)): [6, 4, 0, 2],
    (2, (0, 2, 4)): [4, 0, 2],
    (4, (0, 4)): [4, 0],
    (4, (0,)): [0],
    (8, (0,)): [0],
}

# Names earlier drivers used for the same profile (reference driver_notes).
EXTRA_ALIASES = {
    "GB200-186GB": {"1g.23gb": ["1g.24gb"], "1g.23gb+me": ["1g.24gb+me"]},
}


def _memory_fill(model: str, profiles: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    known = [p for p in profiles if p.get("memory_mib")]
    if known:
        largest = max(known, key=lambda p: p["memory_slices"])
        per_slice = largest["memory_mib"] / largest["memory_slices"]
        basis = f"inferred: {largest['name']} per-slice size x slices"
    else:
        sibling = {p["id"]: p for p in ref["gpus"]["H100-94GB"]["profiles"]}
        per_slice = 0.0
        basis = "inferred: H100-94GB size x 96/94"
    for p in profiles:
        if p.get("memory_mib"):
            p["memory_source"] = str(p.get("memory_mib_source") or "published")
            continue
        if known:
            p["memory_mib"] = int(per_slice * p["memory_slices"])
        else:
            p["memory_mib"] = int(sibling[p["id"]]["memory_mib"] * 96 / 94)
        p["memory_source"] = basis
        p["memory_inferred"] = True
    del model


def build(ref: dict[str, Any]) -> dict[str, Any]:
    models = []
    for key, gpu in ref["gpus"].items():
        profiles = [dict(p) for p in gpu["profiles"]]
        _memory_fill(key, profiles, ref)
        out_profiles = []
        for p in profiles:
            starts = [pl["start"] for pl in p["placements"]]
            sizes = {pl["size"] for pl in p["placements"]}
            assert sizes == {p["memory_slices"]}, (key, p["name"], sizes)
            order = p.get("default_placement_order_observed")
            if order:
                order_source = "observed"
            else:
                order = FAMILY_ORDER.get((p["memory_slices"], tuple(starts)))
                if order and gpu["placement_units_total"] == 8:
                    order_source = "inferred: same 8-slice geometry as A100/H100"
                else:
                    order = sorted(starts)
                    order_source = "assumed: ascending starts"
            assert sorted(order) == sorted(starts), (key, p["name"])
            aliases = EXTRA_ALIASES.get(key, {}).get(p["name"], [])
            out_profiles.append(
                {
                    "id": p["id"],
                    "name": p["name"],
                    "aliases": aliases,
                    "nvml_index": p["nvml_profile_index"],
                    "nvml_const": p["nvml_profile_const"],
                    "variant": p["variant"],
                    "compute_slices": p["compute_slices"],
                    "memory_slices": p["memory_slices"],
                    "memory_mib": p["memory_mib"],
                    "memory_source": p["memory_source"],
                    "memory_inferred": bool(p.get("memory_inferred", False)),
                    "max_instances": p["max_instances"],
                    "starts": starts,
                    "default_order": order,
                    "default_order_source": order_source,
                    "sm_count": p.get("sm_count"),
                    "engines": p.get("engines"),
                    "min_driver": p.get("min_driver"),
                    "one_compute_double_memory": p["one_compute_double_memory"],
                }
            )
        full = max(out_profiles, key=lambda q: (q["memory_slices"], q["compute_slices"]))
        name_to_id = {q["name"]: q["id"] for q in out_profiles}
        models.append(
            {
                "model": key,
                "display_name": gpu["display_name"],
                "pci_device_ids": [int(x.split()[0], 16) for x in gpu["pci_device_ids"]],
                "placement_units": gpu["placement_units_total"],
                "compute_slices": gpu["compute_slices_total"],
                "memory_mib": full["memory_mib"],
                "placement_status": gpu["placement_status"],
                "sources": gpu["sources"],
                "exclusive_groups": [
                    {
                        "profiles": [name_to_id[n] for n in g["profiles"]],
                        "max": g["max"],
                        "reason": g["reason"],
                    }
                    for g in gpu.get("exclusive_groups", [])
                ],
                "engine_budget": gpu.get("engine_budget"),
                "profiles": out_profiles,
            }
        )
    return {
        "generated_from": "tests/data/mig-tables.json",
        "generator": "scripts/gen_catalog.py",
        "sources": ref["sources"],
        "models": models,
    }


def main(argv: list[str]) -> int:
    ref_path = Path(argv[1]) if len(argv) > 1 else DEFAULT_REF
    out_path = Path(argv[2]) if len(argv) > 2 else DEFAULT_OUT
    catalog = build(json.loads(ref_path.read_text()))
    out_path.write_text(json.dumps(catalog, indent=1, sort_keys=False) + "\n")
    print(f"wrote {out_path} ({len(catalog['models'])} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
