"""``migctl condor-slots``: one partitionable slot per GPU, each with exactly that GPU's shares.

The startd gives slot type ``n`` the GPU IDs whose property ad satisfies its constraint; the
tests evaluate each slot type's constraint against the property ads ``migctl gpu-inventory``
prints, so the two commands must agree on every node shape (GPUs x shares per GPU).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from migd.cli.condor_ad import render_condor_slots, render_inventory
from migd.core.condor_slots import SlotGpu, render_slot_types


def _gpu(i: int, mode: str = "mig", vram: int = 40448) -> dict[str, Any]:
    return {
        "uuid": f"GPU-{i:08x}-a9b5-4c1e-9d2f-{i:012x}",
        "mode": mode,
        "vram_mib": vram + i,
        "name": "NVIDIA A100-SXM4-40GB",
        "compute_capability": "8.0",
        "cuda_version": "12.4",
        "driver_version": "550.54.15",
    }


def parse_slot_types(text: str) -> dict[str, str]:
    """HTCondor's config reading, reduced to what condor-slots prints: ``NAME = value``
    lines and ``NAME @=tag ... @tag`` blocks; comments skipped."""
    out: dict[str, str] = {}
    lines = iter(text.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        block = re.fullmatch(r"(\w+) @=(\w+)", line)
        if block:
            body = []
            for inner in lines:
                if inner == f"@{block.group(2)}":
                    break
                body.append(inner.strip())
            else:
                raise AssertionError(f"block {block.group(1)} is not closed")
            out[block.group(1)] = "\n".join(body)
            continue
        name, eq, value = line.partition(" = ")
        assert eq, f"not a config line: {line!r}"
        out[name] = value
    return out


def lookup(conf: dict[str, str], name: str, layout: int) -> str:
    """A macro as the startd reads it: ``$(NAME)`` replaced innermost first (HTCondor
    expands nested references, e.g. ``$(A_$(B))``), ``MIGD_SLOT_LAYOUT`` from the knob."""
    macros = {**conf, "MIGD_SLOT_LAYOUT": str(layout)}
    value = macros.get(name, "")
    for _ in range(20):
        inner = re.search(r"\$\(([A-Za-z0-9_]+)\)", value)
        if not inner:
            return value
        value = value[: inner.start()] + macros.get(inner.group(1), "") + value[inner.end() :]
    raise AssertionError(f"{name} does not expand")


def inventory_devices(text: str) -> dict[str, str]:
    """share ID -> DeviceUuid, from gpu-inventory's nested property ads."""
    return {
        m.group(1): m.group(2)
        for m in re.finditer(r'\[ id="([^"]+)";.*?DeviceUuid="([^"]+)"', text)
    }


@pytest.mark.parametrize("n_gpus", range(1, 9))
@pytest.mark.parametrize("shares", [1, 2, 7, 48])
def test_each_slot_type_takes_exactly_its_gpus_shares_and_vram(n_gpus: int, shares: int) -> None:
    gpus = [_gpu(i) for i in range(n_gpus)]
    parsed = parse_slot_types(render_condor_slots(gpus, shares=shares))
    conf = {name: lookup(parsed, name, layout=1) for name in parsed}
    devices = inventory_devices(render_inventory(gpus, shares=shares))
    assert len(devices) == n_gpus * shares

    taken: set[str] = set()
    for n, gpu in enumerate(gpus, start=1):
        assert conf[f"SLOT_TYPE_{n}_PARTITIONABLE"] == "True"
        assert conf[f"NUM_SLOTS_TYPE_{n}"] == "1"
        items = conf[f"SLOT_TYPE_{n}"].splitlines()
        # one resource per line: the manual's advice where a constraint is used
        [gpus_line] = [x for x in items if x.startswith("GPUs = ")]
        count, _, constraint = gpus_line.removeprefix("GPUs = ").partition(" : ")
        wanted = re.fullmatch(r'DeviceUuid == "([^"]+)"', constraint)
        assert wanted, constraint
        mine = {i for i, dev in devices.items() if dev == wanted.group(1)}
        # the constraint matches as many IDs as the slot asks for, all of this GPU's
        assert int(count) == len(mine) == shares
        assert all(gpu["uuid"].endswith(dev) for dev in (devices[i] for i in mine))
        assert not mine & taken
        taken |= mine
        assert f"VRAM = {gpu['vram_mib']}" in items
        pct = [x for x in items if x.endswith("%")]
        assert pct == [f"{100 // n_gpus}%"]
    assert taken == set(devices)  # no share left to a slot type that does not exist
    assert f"SLOT_TYPE_{n_gpus + 1}" not in conf
    assert 100 // n_gpus * n_gpus <= 100


def test_gpus_migd_does_not_manage_get_no_slot_as_they_get_no_shares() -> None:
    gpus = [_gpu(0), _gpu(1, mode="off"), _gpu(2)]
    parsed = parse_slot_types(render_condor_slots(gpus, shares=7))
    conf = {name: lookup(parsed, name, layout=1) for name in parsed}
    devices = set(inventory_devices(render_inventory(gpus, shares=7)).values())
    constrained = {
        re.search(r'DeviceUuid == "([^"]+)"', conf[f"SLOT_TYPE_{n}"]).group(1)  # type: ignore[union-attr]
        for n in (1, 2)
    }
    assert constrained == devices
    assert "SLOT_TYPE_3" not in conf
    assert "50%" in conf["SLOT_TYPE_1"]


@pytest.mark.parametrize("n_gpus", range(1, 9))
def test_the_knob_off_gives_one_partitionable_slot_with_everything(n_gpus: int) -> None:
    parsed = parse_slot_types(render_condor_slots([_gpu(i) for i in range(n_gpus)], shares=7))
    slots = {
        n: (lookup(parsed, f"SLOT_TYPE_{n}", 0), lookup(parsed, f"NUM_SLOTS_TYPE_{n}", 0))
        for n in range(1, n_gpus + 1)
    }
    assert slots[1] == ("100%", "1")
    assert all(count == "0" for _, count in list(slots.values())[1:])
    assert lookup(parsed, "SLOT_TYPE_1_PARTITIONABLE", 0) == "True"


def test_the_shipped_config_lets_a_later_file_choose_the_layout() -> None:
    """No ``if``: HTCondor evaluates those while reading, so a knob set in
    /etc/condor/config.d (read after the drop-in) would come too late."""
    text = (
        Path(__file__).resolve().parents[2] / "condor_config/10-migd-execute.config"
    ).read_text()
    assert not re.search(r"^\s*if\b", text, re.M)
    assert "MIGD_SLOT_LAYOUT = $INT(MIGD_SLOT_PER_GPU)" in text
    assert "migctl condor-slots --shares $(MIGD_SHARES_PER_GPU)" in text
    assert "STARTD_CRON_MIGD_ARGS = condor-ad --watch $(MIGD_CONDOR_AD_SCOPE)" in text
    # one slot for the node: START keeps the node-wide size (every GPU's ad would merge
    # into a slot that holds shares of every GPU)
    assert "MIGD_PLACEABLE_MB_0 = MigdLargestPlaceableMB\n" in text
    assert "<= ($(MIGD_PLACEABLE_MB) ?: 0)" in text


@pytest.mark.parametrize("layout", [0, 1])
def test_a_node_without_gpus_keeps_one_partitionable_slot_with_everything(layout: int) -> None:
    parsed = parse_slot_types(render_slot_types([], shares=7))
    conf = {name: lookup(parsed, name, layout) for name in parsed}
    assert conf == {
        "SLOT_TYPE_1": "100%",
        "SLOT_TYPE_1_PARTITIONABLE": "True",
        "NUM_SLOTS_TYPE_1": "1",
    }


def test_nonsense_is_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        render_slot_types([SlotGpu("GPU-1", 10)], shares=0)
    with pytest.raises(ValueError, match="ClassAd string"):
        render_slot_types([SlotGpu('GPU-1"x', 10)], shares=1)
