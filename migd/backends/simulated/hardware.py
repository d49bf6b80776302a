"""What a simulated GPU looks like from NVML: names, PCI IDs, memory, compute capability.

MIG geometry (profiles, placements, caps) is *not* here: it comes from the
built-in catalog (:mod:`migd.core.catalog`) or from a recorded probe. This table
only adds the identity facts NVML reports besides the geometry, so that
``detect_model`` and discovery see something that looks like the real board.
The values are representative (names as ``nvidia-smi -L`` prints them, PCI IDs
from the catalog or the public PCI ID list); total memory of MIG models is the
nominal size in GiB, not a measured ``nvmlDeviceGetMemoryInfo`` value, except for
the models in :data:`MEASURED`, whose total and idle use a probe of a real board
recorded (``tests/data/gpu/*-probe.json``, replayed by
``tests/backends/test_gpu_recordings.py``).

An idle GPU is not at 0 MiB used: the driver reserves a little on each device.
``nvidia-smi`` shows 3 MiB used on an idle A100-SXM4-40GB (facebookresearch/vissl
issue 422) and 13 MiB on an idle MIG device of an A100-80GB (XuehaiPan/nvitop pull
request 8). No per-model measurements are published, so every model uses these two
figures until a probe (``scripts/gpu_probe.py``) records its own; a node
description may set them per GPU (``idle_used_mib``, ``mig_idle_used_mib``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from migd.core import catalog
from migd.core.geometry import Geometry
from migd.errors import ConfigError, UnknownModel


@dataclass(frozen=True, slots=True)
class BoardFacts:
    """NVML identity of one GPU model as the simulator presents it."""

    model: str | None  # catalog key of a MIG model, else None
    name: str  # nvmlDeviceGetName
    pci_device_id: int  # nvmlPciInfo_t.pciDeviceId (device << 16 | 0x10DE)
    memory_total_mib: int
    compute_capability: tuple[int, int]
    geometry: Geometry | None  # None: the GPU has no MIG
    idle_used_mib: int = 0  # used on the idle whole GPU (MIG off)
    mig_idle_used_mib: int = 0  # used on each idle GPU instance


_MIG_NAMES: dict[str, str] = {
    "A30-24GB": "NVIDIA A30",
    "A100-40GB": "NVIDIA A100-SXM4-40GB",
    "A100-80GB": "NVIDIA A100-SXM4-80GB",
    "H100-80GB": "NVIDIA H100 80GB HBM3",
    "H100-94GB": "NVIDIA H100 NVL",
    "H100-96GB": "NVIDIA GH200 96GB HBM3",
    "H200-141GB": "NVIDIA H200",
    "GH200-144GB": "NVIDIA GH200 144G HBM3e",
    "B200-180GB": "NVIDIA B200",
    "GB200-186GB": "NVIDIA GB200",
    "RTX-PRO-6000-96GB": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
}


def _compute_capability(model: str) -> tuple[int, int]:
    if model.startswith(("A30", "A100")):
        return (8, 0)
    if model.startswith(("H100", "H200", "GH200")):
        return (9, 0)
    if model.startswith(("B200", "GB200")):
        return (10, 0)
    return (12, 0)  # RTX PRO 6000 Blackwell


# GPUs without MIG, for mixed nodes ("1xV100-32GB"): name, PCI ID, MiB, compute capability.
_NON_MIG: dict[str, tuple[str, int, int, tuple[int, int]]] = {
    "V100-16GB": ("Tesla V100-SXM2-16GB", 0x1DB110DE, 16384, (7, 0)),
    "V100-32GB": ("Tesla V100-SXM2-32GB", 0x1DB510DE, 32768, (7, 0)),
    "T4-16GB": ("Tesla T4", 0x1EB810DE, 15360, (7, 5)),
    "A10-24GB": ("NVIDIA A10", 0x223610DE, 23028, (8, 6)),
    "L4-24GB": ("NVIDIA L4", 0x27B810DE, 23034, (8, 9)),
    "L40S-48GB": ("NVIDIA L40S", 0x26B910DE, 46068, (8, 9)),
}

_GB_RE = re.compile(r"-(\d+)GB$", re.IGNORECASE)

# What nvidia-smi shows used on an idle device (see the module docstring for sources).
IDLE_USED_MIB = 3
MIG_IDLE_USED_MIB = 13

#: Measured on real boards (MIG off, no process): model -> (nvmlDeviceGetMemoryInfo
#: total, used on the idle GPU), in MiB. H200: tests/data/gpu/h200-141gb-probe.json
#: (driver 580.159.04, persistence mode on, 2026-11-26); the nominal 141 GiB would be
#: 144384 MiB, and the idle GPU is at 616 MiB, not a few MiB. H100 80GB HBM3:
#: tests/data/gpu/h100-80gb-probe.json (same driver, 2026-11-28): 81559 MiB, not the
#: nominal 81920, and 480 MiB used idle.
MEASURED: dict[str, tuple[int, int]] = {
    "H200-141GB": (143771, 616),
    "H100-80GB": (81559, 480),
}


def known_models() -> list[str]:
    """Every model a description may name: the MIG catalog plus the non-MIG table."""
    return [*catalog.model_names(), *_NON_MIG]


def board(model: str) -> BoardFacts:
    """The simulated identity of ``model`` (catalog key, catalog alias, or non-MIG key).

    Raises:
        ConfigError: the model is neither in the catalog nor in the non-MIG table.
    """
    folded = {k.lower(): k for k in _NON_MIG}
    key = folded.get(model.strip().lower())
    if key is not None:
        name, pci, mib, cc = _NON_MIG[key]
        return BoardFacts(None, name, pci, mib, cc, None, IDLE_USED_MIB, 0)
    try:
        geo = catalog.geometry(model)
    except UnknownModel:
        raise ConfigError(
            f"unknown GPU model {model!r}",
            where="description",
            hint="known models: " + ", ".join(known_models()),
        ) from None
    match = _GB_RE.search(geo.model)
    nominal_mib = int(match.group(1)) * 1024 if match else geo.memory_mib
    total_mib, idle_mib = MEASURED.get(geo.model, (max(nominal_mib, geo.memory_mib), IDLE_USED_MIB))
    return BoardFacts(
        model=geo.model,
        name=_MIG_NAMES.get(geo.model, f"NVIDIA {geo.model}"),
        pci_device_id=geo.pci_device_ids[0] if geo.pci_device_ids else 0x000010DE,
        memory_total_mib=total_mib,
        compute_capability=_compute_capability(geo.model),
        geometry=geo,
        idle_used_mib=idle_mib,
        mig_idle_used_mib=MIG_IDLE_USED_MIB,
    )
