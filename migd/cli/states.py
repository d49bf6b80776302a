"""``migctl states``: dump a model's whole partition state table (no daemon needed).

The JSON lists every valid state with its placements, whether it is full, its
reachability (the number of full states that contain it), the instances each
profile can still host across those full states, and its wasted slices, so
anyone can check the table against an independent enumeration.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from migd.core import catalog
from migd.core.states import StateSpace, describe, state_space


def state_table(space: StateSpace, *, full_only: bool = False) -> dict[str, Any]:
    geo = space.geometry
    states = []
    for key in sorted(space.keys(), key=lambda k: (k.bit_count(), k)):
        info = space.info(key)
        if full_only and not info.full:
            continue
        compute_waste, unit_waste = space.wasted_slices(key)
        states.append(
            {
                "key": str(key),
                "placements": [
                    {
                        "profile": a.profile.name,
                        "id": a.profile.profile_id,
                        "start": a.start,
                        "size": a.profile.memory_slices,
                    }
                    for a in sorted(space.placements(key), key=lambda a: a.start)
                ],
                "full": info.full,
                "reachability": info.reachability,
                "hostable": {
                    p.name: n for p, n in zip(space.profiles, info.hostable, strict=True) if n
                },
                "configuration_capability": space.configuration_capability(key),
                "wasted_slices": {"compute": compute_waste, "memory": unit_waste},
            }
        )
    return {
        "model": geo.model,
        "display_name": geo.display_name,
        "placement_units": geo.units,
        "compute_slices": geo.compute_slices,
        "profiles": [
            {
                "name": p.name,
                "id": p.profile_id,
                "nvml_index": p.nvml_index,
                "compute_slices": p.compute_slices,
                "memory_slices": p.memory_slices,
                "memory_mib": p.memory_mib,
                "memory_inferred": p.memory_inferred,
                "max_instances": p.max_instances,
                "starts": list(p.starts),
                "default_order": list(p.default_order),
            }
            for p in space.profiles
        ],
        "state_count": len(space),
        "full_count": len(space.full_states),
        "states": states,
    }


def run_states(args: argparse.Namespace) -> int:
    if args.list_models:
        for name, geo in catalog.builtin_models().items():
            print(f"{name:20s} {geo.units:2d} units  {geo.display_name}")
        return 0
    if not args.model:
        print("migctl states: --model is required (see --list-models)", file=sys.stderr)
        return 2
    try:
        space = state_space(catalog.geometry(args.model), args.profiles)
    except Exception as exc:  # UnknownModel / UnknownProfile carry their hint
        print(f"migctl states: {exc}", file=sys.stderr)
        return 2
    table = state_table(space, full_only=args.full_only)
    if args.json:
        json.dump(table, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(
        f"{table['model']}: {table['state_count']} states, {table['full_count']} full, "
        f"profiles {', '.join(p['name'] for p in table['profiles'])}"
    )
    print(f"{'REACH':>5} {'FULL':4} {'CC':>3}  STATE")
    for entry in table["states"]:
        key = int(entry["key"])
        print(
            f"{entry['reachability']:>5} {'yes' if entry['full'] else '':4} "
            f"{entry['configuration_capability']:>3}  {describe(space, key)}"
        )
    return 0
