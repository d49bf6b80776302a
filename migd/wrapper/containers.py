"""What an Apptainer/Singularity job needs from the wrapper to use its partition.

HTCondor runs the ``USER_JOB_WRAPPER`` *outside* the container: the starter first
rewrites the job into ``apptainer -s exec ... -C <image> <job> <args>``
(``Singularity::setup`` in ``src/condor_starter.V6.1/singularity.cpp``), then puts the
wrapper in front of that command line (``os_proc.cpp``). So the wrapper leases, then
starts the container runtime, and the container runs with a clean environment (``-C``,
or ``--contain --ipc --cleanenv`` without PID namespaces): only ``APPTAINERENV_*`` /
``SINGULARITYENV_*`` variables reach the job (the runner sets a twin of each variable it
adds), and only bound directories are visible. An MPS share needs its pipe directory:
this adds it to ``APPTAINER_BIND`` / ``SINGULARITY_BIND``, which the runtime reads from
its own environment. The starter deletes those two from the job's environment before the
wrapper runs (and from 25.14 every ``APPTAINER_*`` not on its allowlist), so a site's own
binds come from ``SINGULARITY_BIND_EXPR`` as ``-B`` arguments and are kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePath

#: The programs HTCondor's SINGULARITY knob names (default /usr/bin/singularity; Debian's
#: apptainer package provides both names).
RUNTIMES = ("apptainer", "singularity")
#: The runtime's own bind list, read from its environment (not passed into the container).
BIND_VARS = ("APPTAINER_BIND", "SINGULARITY_BIND")


def container_runtime(command: Sequence[str]) -> str | None:
    """``apptainer`` / ``singularity`` when the job is a container the starter built."""
    if not command:
        return None
    name = PurePath(command[0]).name
    return name if name in RUNTIMES else None


def container_env(
    command: Sequence[str], env: Mapping[str, str], lease_env: Mapping[str, str]
) -> dict[str, str]:
    """Variables for the container runtime itself (not twinned into the container) so the
    job inside reaches its lease: the MPS pipe directory bound at the same path."""
    pipe = lease_env.get("CUDA_MPS_PIPE_DIRECTORY")
    if not pipe or container_runtime(command) is None:
        return {}
    out = {}
    for var in BIND_VARS:
        binds = [b for b in env.get(var, "").split(",") if b]
        if pipe not in binds:
            binds.append(pipe)
        out[var] = ",".join(binds)
    return out
