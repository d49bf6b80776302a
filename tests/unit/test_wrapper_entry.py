"""The light wrapper entry: its "no GPU requested" parse agrees with the full path, and the
no-GPU path imports nothing heavy before it execs the job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from migd.backends.condor import read_ad
from migd.errors import JobAdError
from migd.wrapper.entry import NeedBindings, PlainAd, no_gpu_requested
from migd.wrapper.jobspec import spec_from_ads

REPO = Path(__file__).resolve().parents[2]
CPU_AD = 'GlobalJobId = "ap#13.0#1700000000"\nClusterId = 13\nProcId = 0\nRequestCpus = 1\n'
GPU_AD = "ClusterId = 12\nProcId = 0\nRequestGPUs = 1\nRequestVRAM = 4000\n"


@pytest.mark.parametrize(
    ("ad", "plainly_no_gpu"),
    [
        (CPU_AD, True),
        ("ClusterId = 13\nProcId = 0\n", True),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = 0\n", True),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = 0.0\n", True),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = -1\n", True),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = 00\n", False),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = 1\n", False),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = 0.5\n", False),
        ("ClusterId = 13\nProcId = 0\nRequestVRAM = 0\n", False),  # the full path refuses it
        ("ClusterId = 13\nProcId = 0\nRequestVRAM = 100\n", False),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = ifThenElse(true, 1, 0)\n", False),
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = undefined\n", False),
        ("ClusterId = 13\nProcId = 0\nrequestgpus = 1\n", False),  # names are case-insensitive
        ("ClusterId = 13\nProcId = 0\nRequestGPUs = 0\nRequestGPUs = 1\n", False),  # repeated
        ("ProcId = 0\n", False),  # no job id: the full path says so
        ('ClusterId = 13\nProcId = 0\nGlobalJobId = ""\n', True),  # as job_id_of: ClusterId.ProcId
        ('GlobalJobId = "a\\"b#1.0#2"\n', False),  # an escape: the real parser reads it
        ('GlobalJobId = "ap#1.0#2"\n', True),
        ("[ ClusterId = 13; ProcId = 0 ]", False),  # the new ClassAd syntax: not this parse
        ("", False),
    ],
)
def test_plain_ads(ad: str, plainly_no_gpu: bool) -> None:
    assert no_gpu_requested(ad) is plainly_no_gpu


NAMES = ["RequestGPUs", "RequestVRAM", "GlobalJobId", "ClusterId", "ProcId", "RequestCpus"]
VALUES = [
    "0",
    "1",
    "2",
    "-1",
    "0.0",
    "0.5",
    "1e3",
    "+0",
    "00",
    '"0"',
    '"ap#1.0#2"',
    '""',
    '" "',
    "undefined",
    "error",
    "true",
    "1 - 1",
    "ifThenElse(false, 1, 0)",
    "RequestCpus - 1",
    "TARGET.GPUs",
    "١",  # an Arabic-Indic digit: isdigit() says yes, ClassAds say no
]


@st.composite
def ad_texts(draw: st.DrawFn) -> str:
    """Mostly what a starter writes (a job id, a few plain attributes), with some lines
    the light parse must not be fooled by: expressions, other spellings, repeats."""
    ids = draw(
        st.sampled_from(
            [
                ["ClusterId = 13", "ProcId = 0"],
                ['GlobalJobId = "ap#13.0#1700000000"'],
                ['GlobalJobId = "ap#13.0#1700000000"', "ClusterId = 13", "ProcId = 0"],
                ["ProcId = 0"],
            ]
        )
    )
    name = st.sampled_from(NAMES).flatmap(
        lambda n: st.sampled_from([n, n, n, n.lower(), n.upper()])
    )
    extra = draw(
        st.lists(
            st.tuples(name, st.sampled_from(["=", " = ", "  =  "]), st.sampled_from(VALUES)),
            max_size=3,
        )
    )
    lines = ids + ["".join(parts) for parts in extra]
    return "".join(f"{line}\n" for line in draw(st.permutations(lines)))


def full_path_decision(ad: Path) -> bool | str:
    """What ``migd.wrapper.main`` decides: a GPU job or not, or why it refuses the ad."""
    try:
        return spec_from_ads(["/bin/true"], read_ad(ad), None).gpu_job
    except JobAdError as exc:
        return exc.message


def well_formed(text: str) -> bool:
    """The bindings read every line (they silently drop the rest of an ad after a value
    they cannot parse, e.g. ``RequestCpus = 08``)."""
    import classad2

    names = {line.partition("=")[0].strip().lower() for line in text.splitlines() if line}
    try:
        return {str(key).lower() for key in classad2.parseOne(text)} == names
    except Exception:
        return False


@settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ad_texts())
def test_the_light_parse_never_disagrees_with_the_full_path(tmp_path: Path, text: str) -> None:
    """Every ad the light parse waves through, the bindings-based path would exec too.

    The one difference is on ads HTCondor does not write: where a line unrelated to the
    decision is not ClassAd syntax, the bindings refused the ad or dropped what followed
    it, so the full path refused the job; the light parse reads only the lines it needs
    and runs a job that plainly asks for no GPU. Either way it is never a GPU job.
    """
    if not no_gpu_requested(text):
        return  # not sure: the full path decides, as before
    ad = tmp_path / "job.ad"
    ad.write_text(text)
    decision = full_path_decision(ad)
    if well_formed(text):
        assert decision is False, (text, decision)
    else:
        assert decision is not True, (text, decision)


def test_the_property_reaches_the_fast_path() -> None:
    """The generator makes ads the light parse waves through, with extra lines too, so
    the property above checks something."""
    found = find(
        ad_texts(),
        lambda text: no_gpu_requested(text) and "RequestGPUs" in text,
        settings=settings(database=None, max_examples=2000),
    )
    assert no_gpu_requested(found)


# -- what the no-GPU path imports ------------------------------------------------------------

ENTRY = "import sys; from migd.wrapper.entry import wrapper_main; sys.exit(wrapper_main())"


def imported(code: str, *args: str, ad: str | None = None) -> set[str]:
    """Modules ``python -X importtime -c code args`` imports (stderr, before any exec)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("_CONDOR_", "MIGD_"))}
    if ad is not None:
        env["_CONDOR_JOB_AD"] = ad
    env["MIGD_API_SOCKET"] = "/nonexistent/migd.sock"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
        env=env,
    )
    return {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "|" in line and "imported package" not in line
    }


def test_a_job_without_a_gpu_imports_nothing_heavy(tmp_path: Path) -> None:
    ad = tmp_path / "job.ad"
    ad.write_text(CPU_AD)
    baseline = imported("import sys")
    added = imported(ENTRY, "/bin/true", ad=str(ad)) - baseline
    # Only the entry module and its packages (both empty), and the built-in _signal.
    assert added <= {"migd", "migd.wrapper", "migd.wrapper.entry", "_signal"}, sorted(added)
    assert "migd.wrapper.entry" in added  # it did run through the entry


def test_a_gpu_job_takes_the_full_path(tmp_path: Path) -> None:
    """The import check can fail: a GPU job loads the full wrapper (and no daemon is there)."""
    ad = tmp_path / "job.ad"
    ad.write_text(GPU_AD)
    added = imported(ENTRY, "/bin/true", ad=str(ad)) - imported("import sys")
    assert {"migd.wrapper.main", "migd.wrapper.runner", "migd.client"} <= added


def test_the_console_scripts_use_the_light_entry() -> None:
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["migd-wrapper"] == "migd.wrapper.entry:wrapper_main"
    assert scripts["migd-run"] == "migd.wrapper.entry:run_main"


# -- a GPU job's ads, read without the bindings ---------------------------------------------

JOB_NAMES = [
    "RequestGPUs",
    "RequestVRAM",
    "GPUsMinMemory",
    "MigdMode",
    "MigdMinCompute",
    "MigdMaxRestarts",
    "MigdEarlyRestart",
    "MigdHorizon",
    "MigdGrowthFactor",
    "MigdWaitSeconds",
    "WantIOProxy",
    "MigdOomExits",
    "MigdOomExit",
    "MigdStartFailures",
    "MigdGpuLosses",
    "RequestCpus",
]
JOB_VALUES = [
    "4096",
    "0",
    "1",
    "-1",
    "2.5",
    "1.0",
    '"mps"',
    '"MIG"',
    '"turbo"',
    "true",
    "false",
    '"true"',
    '"4096"',
    "undefined",
    "RequestCpus * 1024",
    '"a\\"b"',
    "1e3",
    "007",
    "99999999999999999999",
]
MACHINE_VALUES = {
    "Name": ['"slot1_3@node"', '""', 'strcat("a", "b")'],
    "AssignedGPUs": ['"GPU-s03-61342749"', '"GPU-61342749_s3, GPU-aaaa"', '""', "undefined"],
    "MigdPinToAssignedGPU": ["true", "false", '"no"', "1"],
}


@st.composite
def gpu_ads(draw: st.DrawFn) -> tuple[str, str | None]:
    ids = draw(
        st.sampled_from(
            [['GlobalJobId = "ap#7.0#1700000000"'], ["ClusterId = 7", "ProcId = 0"], []]
        )
    )
    name = st.sampled_from(JOB_NAMES).flatmap(lambda n: st.sampled_from([n, n, n, n.lower()]))
    attrs = draw(st.lists(st.tuples(name, st.sampled_from(JOB_VALUES)), max_size=6))
    job = ids + [f"{n} = {v}" for n, v in attrs]
    machine = draw(
        st.none()
        | st.lists(
            st.sampled_from(list(MACHINE_VALUES)).flatmap(
                lambda n: st.tuples(st.just(n), st.sampled_from(MACHINE_VALUES[n]))
            ),
            max_size=3,
        ).map(lambda pairs: "".join(f"{n} = {v}\n" for n, v in pairs) + "Cpus = 1\n")
    )
    return "".join(f"{line}\n" for line in draw(st.permutations(job))) + "Cpus = 1\n", machine


def decision(read: Any, job: Any, machine: Any) -> object:
    try:
        return spec_from_ads(["/bin/true"], read(job), None if machine is None else read(machine))
    except JobAdError as exc:
        return exc.message


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(gpu_ads())
def test_ads_read_without_the_bindings_give_the_same_job(
    tmp_path: Path, ads: tuple[str, str | None]
) -> None:
    """Where the plain reading answers, the job (or the refusal) is the bindings' one."""
    job_text, machine_text = ads
    if not well_formed(job_text) or not (machine_text is None or well_formed(machine_text)):
        return  # HTCondor writes well-formed ads; the bindings drop lines after a bad one
    try:
        plain = decision(PlainAd, job_text, machine_text)
    except NeedBindings:
        return
    (tmp_path / "job.ad").write_text(job_text)
    (tmp_path / "machine.ad").write_text(machine_text or "")
    machine_path = None if machine_text is None else tmp_path / "machine.ad"
    assert plain == decision(read_ad, tmp_path / "job.ad", machine_path), ads


def test_the_plain_reading_answers_for_usual_gpu_ads() -> None:
    """The property above is not vacuous: a usual GPU job's ads need no bindings."""
    job = PlainAd(GPU_AD + 'MigdMode = "mps"\nWantIOProxy = true\nRequirements = (Cpus > 0)\n')
    machine = PlainAd('Name = "slot1_3@node"\nAssignedGPUs = "GPU-s03-61342749"\nStart = true\n')
    spec = spec_from_ads(["/bin/true"], job, machine)
    assert (spec.memory_mib, spec.mode, spec.want_chirp, spec.gpus) == (
        4000,
        "mps",
        True,
        ("GPU-61342749",),
    )
    with pytest.raises(NeedBindings):
        spec_from_ads(["/bin/true"], PlainAd(GPU_AD + 'MigdMode = toLower("MPS")\n'), None)
