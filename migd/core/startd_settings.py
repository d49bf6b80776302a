"""Whether the startd really runs migd's settings: a check of its effective configuration.

migd's execute-node file (``condor_config/10-migd-execute.config``) sets single-valued
HTCondor knobs. A site file read after it (``/etc/condor/config.d``) that sets the same
knob wins silently: ``use FEATURE : GPUs`` replaces migd's GPU inventory with
``condor_gpu_discovery``'s, a plain ``START = True`` drops migd's start expression, another
``USER_JOB_WRAPPER`` or hook keyword means GPU jobs never ask migd for a partition. HTCondor
says nothing about it; this module says it, from the values the startd would use
(``condor_config_val -subsystem startd NAME``, read through :class:`migd.ports.StartdConfig`).

A site with its own job wrapper or JOB_EXIT hook keeps it by chaining (docs/operations.md,
"A site's own job wrapper or hook"): its wrapper ends with ``exec migd-wrapper "$@"``, its
hook runs ``migd-release-hook``, and ``[htcondor] site_job_wrapper`` /
``site_job_exit_hook`` in migd.toml name them, so this check accepts them.

Pure: the values come in as a mapping, the findings go out as data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: The knobs read first; the JOB_EXIT hook's knob depends on the keyword (:func:`hook_knob`).
KNOBS = (
    "USER_JOB_WRAPPER",
    "STARTER_JOB_HOOK_KEYWORD",
    "MACHINE_RESOURCE_INVENTORY_GPUs",
    "START",
    "NUM_SLOTS_TYPE_1",
    "SLOT_TYPE_1_PARTITIONABLE",
)

WRAPPER = "migd-wrapper"
RELEASE_HOOK = "migd-release-hook"
INVENTORY = "gpu-inventory"
#: An attribute only migd's start expression (MIGD_START) tests.
START_MARK = "MigdHealthy"
SHIPPED_FILE = "/usr/share/condor/config.d/10-migd-execute.config"


@dataclass(frozen=True)
class StartdFinding:
    """One knob whose effective value bypasses migd."""

    knob: str
    value: str | None
    problem: str
    fix: str

    def to_dict(self) -> dict[str, str | None]:
        return {"knob": self.knob, "value": self.value, "problem": self.problem, "fix": self.fix}

    @property
    def line(self) -> str:
        shown = "undefined" if self.value is None else repr(self.value)
        return f"{self.knob} = {shown}: {self.problem}"


def hook_knob(keyword: str) -> str:
    """The knob naming the JOB_EXIT hook of a ``STARTER_JOB_HOOK_KEYWORD``."""
    return f"{keyword.strip()}_HOOK_JOB_EXIT"


def _program(value: str | None) -> str:
    """The program a knob runs: its first word's last path component."""
    words = (value or "").split()
    return words[0].rsplit("/", 1)[-1] if words else ""


def _first_word(value: str | None) -> str:
    words = (value or "").split()
    return words[0] if words else ""


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("true", "1", "yes")


def check_startd(
    values: Mapping[str, str | None],
    *,
    site_job_wrapper: str | None = None,
    site_job_exit_hook: str | None = None,
) -> list[StartdFinding]:
    """The knobs in ``values`` (name -> effective value, None: undefined) that bypass migd.

    ``values`` holds :data:`KNOBS` and, where ``STARTER_JOB_HOOK_KEYWORD`` is set, its
    :func:`hook_knob`. ``site_job_wrapper`` / ``site_job_exit_hook``: the site's own
    programs that chain to migd's (accepted as the knob's value).
    """
    found: list[StartdFinding] = []
    where = f"migd's {SHIPPED_FILE} sets it; a file in /etc/condor/config.d overrides it"
    wrapper = values.get("USER_JOB_WRAPPER")
    if _program(wrapper) != WRAPPER and not (
        site_job_wrapper and _first_word(wrapper) == site_job_wrapper
    ):
        found.append(
            StartdFinding(
                "USER_JOB_WRAPPER",
                wrapper,
                "GPU jobs start without a migd partition (the job wrapper is not "
                f"{WRAPPER}, so no job asks migd for a lease)",
                f"{where}: remove the override, or chain a site wrapper (it ends with "
                f'`exec {WRAPPER} "$@"`) and name it in [htcondor] site_job_wrapper',
            )
        )
    keyword = (values.get("STARTER_JOB_HOOK_KEYWORD") or "").strip()
    hook = values.get(hook_knob(keyword)) if keyword else None
    if _program(hook) != RELEASE_HOOK and not (
        site_job_exit_hook and _first_word(hook) == site_job_exit_hook
    ):
        knob = hook_knob(keyword) if keyword else "STARTER_JOB_HOOK_KEYWORD"
        found.append(
            StartdFinding(
                knob,
                hook if keyword else values.get("STARTER_JOB_HOOK_KEYWORD"),
                f"a job's exit does not run {RELEASE_HOOK} (the second line of lease "
                "release: a partition whose wrapper was killed stays leased until migd's "
                "reaper finds it)",
                f"{where} (STARTER_JOB_HOOK_KEYWORD = MIGD): remove the override, or have the "
                f"site's JOB_EXIT hook run {RELEASE_HOOK} and name it in "
                "[htcondor] site_job_exit_hook",
            )
        )
    inventory = values.get("MACHINE_RESOURCE_INVENTORY_GPUs")
    if INVENTORY not in (inventory or ""):
        found.append(
            StartdFinding(
                "MACHINE_RESOURCE_INVENTORY_GPUs",
                inventory,
                "the startd does not take its GPUs from `migctl gpu-inventory` (e.g. "
                "`use FEATURE : GPUs`): HTCondor assigns whole GPUs or the MIG instances "
                "of the moment, which migd then re-partitions under running jobs",
                f"{where}: remove `use FEATURE : GPUs` or the site's "
                "MACHINE_RESOURCE_INVENTORY_GPUs",
            )
        )
    start = values.get("START")
    if START_MARK not in (start or ""):
        found.append(
            StartdFinding(
                "START",
                start,
                f"the start expression does not test {START_MARK}: GPU jobs start when "
                "migd is down or cannot place their memory, and fail in the wrapper",
                f"{where} as START = ($(START)) && ($(MIGD_START)): a site file must "
                "extend START the same way (START = $(START) && ...), not replace it",
            )
        )
    return found


def slot_layout(values: Mapping[str, str | None]) -> str:
    """The slot layout the startd would make (for the status, not a finding: one
    static slot per GPU is a documented layout)."""
    if _true(values.get("SLOT_TYPE_1_PARTITIONABLE")):
        return "partitionable"
    if values.get("NUM_SLOTS_TYPE_1") is not None:
        return "static slots (slot type 1)"
    return "static slots (one per CPU core: HTCondor's default)"


def read_knobs(lookup: Callable[[str], str | None]) -> dict[str, str | None]:
    """The knobs :func:`check_startd` needs, read one by one through ``lookup``."""
    values = {name: lookup(name) for name in KNOBS}
    keyword = (values.get("STARTER_JOB_HOOK_KEYWORD") or "").strip()
    if keyword:
        values[hook_knob(keyword)] = lookup(hook_knob(keyword))
    return values
