"""One HTCondor partitionable slot per GPU: the startd's slot layout for a node (pure).

With one partitionable slot for the whole node, ``VRAM`` is one pool and the startd gives a
new dynamic slot the *first free* GPU share ID, whichever GPU that is: two whole-GPU dynamic
slots can both hold shares of GPU 0 while GPU 1 idles, and claim reuse keeps the user's later
jobs there (docs/htcondor-notes.md (t)). With one partitionable slot per GPU, each holding
only that GPU's shares and that GPU's ``VRAM``, the startd can never carve more memory out
of a GPU than it has, so a whole-GPU job that cannot fit GPU 0 is matched to GPU 1's slot.

``migctl condor-slots`` prints :func:`render_slot_types` for
``include command : $(MIGD_BIN)/migctl condor-slots`` in ``10-migd-execute.config``;
``MIGD_SLOT_PER_GPU`` there chooses between this layout and one slot for the node.
How a slot type is given particular GPUs (HTCondor 23.x manual, "ep-policy-configuration",
resource constraints): ``GPUs = <count> : <expression>`` takes the IDs whose property ad
satisfies the expression; migd's inventory gives every share of a GPU the same
``DeviceUuid``, so ``DeviceUuid == "<uuid>"`` takes exactly that GPU's shares. The manual
asks for one resource per line when a constraint is used (``@=`` block), else the
constraint may be cut at a comma.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotGpu:
    """What one GPU's partitionable slot needs: the GPU's UUID and its ``VRAM`` (MiB)."""

    uuid: str
    vram_mib: int


def _device_uuid(uuid: str) -> str:
    # condor_gpu_discovery's DeviceUuid (and migd's inventory) has no "GPU-" prefix.
    return uuid[4:] if uuid.startswith("GPU-") else uuid


def render_slot_types(gpus: Sequence[SlotGpu], *, shares: int) -> str:
    """The slot types for both layouts; ``MIGD_SLOT_LAYOUT`` (1 or 0) picks one.

    Layout 1, slot type ``n`` (from 1, in the order given): GPU ``n``'s ``shares`` IDs, its
    ``VRAM``, and an equal percentage of every other resource (CPUs, memory, disk, swap,
    other custom resources; the startd rounds percentages down, so with three GPUs each
    slot gets 33% and 1% stays unassigned). Layout 0: slot type 1 is one partitionable
    slot with everything (what ``use FEATURE : PartitionableSlot`` gives) and the other
    types have no slots.

    The choice is a macro looked up when the startd reads ``SLOT_TYPE_<n>``, not an
    ``if`` evaluated while the file is read, so a ``MIGD_SLOT_PER_GPU`` set in any later
    config file still decides. No GPU: one partitionable slot with everything in both
    layouts, so the node still runs jobs without GPUs.
    """
    if shares < 1:
        raise ValueError(f"shares per GPU must be at least 1, got {shares}")
    lines = [
        "# Slot layout from migctl condor-slots (docs/htcondor-notes.md (t)):",
        "# MIGD_SLOT_LAYOUT 1 = one partitionable slot per GPU, 0 = one for the node",
    ]
    if not gpus:
        lines += [
            "# no GPU managed by migd: one partitionable slot for the node",
            "SLOT_TYPE_1 = 100%",
            "SLOT_TYPE_1_PARTITIONABLE = True",
            "NUM_SLOTS_TYPE_1 = 1",
        ]
        return "\n".join(lines) + "\n"
    share = 100 // len(gpus)
    for n, gpu in enumerate(gpus, start=1):
        if '"' in gpu.uuid or "\\" in gpu.uuid:
            raise ValueError(f"GPU UUID {gpu.uuid!r} cannot be written in a ClassAd string")
        lines += [
            f"MIGD_SLOT_TYPE_{n}_1 @=slot",
            f'  GPUs = {shares} : DeviceUuid == "{_device_uuid(gpu.uuid)}"',
            f"  VRAM = {max(0, int(gpu.vram_mib))}",
            f"  {share}%",
            "@slot",
        ]
        if n == 1:
            lines += ["MIGD_SLOT_TYPE_1_0 = 100%"]
        lines += [
            f"SLOT_TYPE_{n} = $(MIGD_SLOT_TYPE_{n}_$(MIGD_SLOT_LAYOUT))",
            f"SLOT_TYPE_{n}_PARTITIONABLE = True",
            f"NUM_SLOTS_TYPE_{n} = {1 if n == 1 else '$(MIGD_SLOT_LAYOUT)'}",
        ]
    return "\n".join(lines) + "\n"
