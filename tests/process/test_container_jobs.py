"""Apptainer/Singularity jobs: the command line HTCondor's starter builds, through the wrapper.

No container runtime runs on this host: Debian trixie has no apptainer package, and sid's
1.4.5 installs in the trixie chroot but cannot run in this sandbox (as the job's user
"Failed to create user namespace: not allowed to create user namespace", as root "Failed
to set mount propagation: Invalid argument"). So ``apptainer`` here is a stand-in that
does what the real one does with the arguments the starter gives it: with ``-C``
(``--cleanenv``) only ``APPTAINERENV_*`` variables reach the job, and only bound
directories (``-B`` plus ``APPTAINER_BIND`` from its own environment) are visible. The
argument list is the one
``Singularity::setup`` in HTCondor's ``src/condor_starter.V6.1/singularity.cpp`` builds
(23.9-25.13: ``--nv`` whenever the slot has AssignedGPUs), and the starter's environment
already holds ``APPTAINERENV_`` copies of the job's variables (``convertEnv``), including
the parent GPU it names in ``CUDA_VISIBLE_DEVICES`` from 24.0.14. What remains unverified
without a GPU and the runtime: that ``--nv`` exposes the MIG device, and that an MPS client
in the container's own IPC namespace (``-C`` implies ``--ipc``) reaches the server through
the bound pipe directory (docs/wrapper.md, "Job shapes").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.process.conftest import DaemonProcess
from tests.process.test_wrapper_process import AD, wrapper

FAKE_APPTAINER = r"""#!{python}
import json, os, sys
args = sys.argv[1:]
binds, flags, i = [], [], 0
while args[i] in ("-s", "-q", "-d"):
    i += 1
assert args[i] in ("exec", "run"), args
i += 1
with_value = {{"-B", "--bind", "-W", "--workdir", "--pwd", "-S", "--scratch"}}
while args[i].startswith("-"):
    if args[i] in with_value:
        if args[i] in ("-B", "--bind"):
            binds += args[i + 1].split(",")
        i += 2
    else:
        flags.append(args[i])
        i += 1
image, job = args[i], args[i + 1:]
for var in ("APPTAINER_BIND", "SINGULARITY_BIND"):
    binds += [b for b in os.environ.get(var, "").split(",") if b]
clean = "-C" in flags or "--cleanenv" in flags
inside = {{k[len("APPTAINERENV_"):]: v for k, v in os.environ.items()
          if k.startswith("APPTAINERENV_")}}
if not clean:
    inside = {{**os.environ, **inside}}
record = {{"image": image, "job": job, "flags": flags, "binds": binds, "env": inside,
          "outer_bind": os.environ.get("APPTAINER_BIND")}}
with open({out!r}, "w") as f:
    json.dump(record, f)
os.execve(job[0], job, {{**inside, "PATH": "/usr/bin:/bin"}})
"""


def fake_apptainer(tmp_path: Path) -> tuple[Path, Path]:
    bindir = tmp_path / "cbin"
    bindir.mkdir()
    out = tmp_path / "container.json"
    exe = bindir / "apptainer"
    exe.write_text(FAKE_APPTAINER.format(python=sys.executable, out=str(out)))
    exe.chmod(0o755)
    return exe, out


def starter_command(apptainer: Path, scratch: Path, job: list[str]) -> list[str]:
    """``Singularity::setup``'s argv for a SIF job whose iwd is the scratch directory, on a
    GPU slot, with PID namespaces (``-C``) and no SINGULARITY_BIND_EXPR."""
    return [
        str(apptainer), "-s", "exec",
        "-W", str(scratch),
        "--pwd", str(scratch),
        "-B", str(scratch),
        "--nv",
        "--no-home",
        "-C",
        "/cvmfs/images/cuda.sif",
        *job,
    ]  # fmt: skip


#: What the starter put in the wrapper's environment: its copies of the job's variables,
#: among them the whole parent GPU (24.0.14+), which the wrapper must replace.
STARTER_ENV = {
    "APPTAINERENV_CUDA_VISIBLE_DEVICES": "GPU-parent-as-the-starter-names-it",
    "APPTAINERENV_NVIDIA_VISIBLE_DEVICES": "GPU-parent-as-the-starter-names-it",
    "APPTAINERENV_HOME_IS_GONE": "1",
}


def run_container_job(daemon: DaemonProcess, tmp_path: Path, ad: str) -> dict[str, Any]:
    apptainer, out = fake_apptainer(tmp_path)
    job = ["/bin/sh", "-c", "exit 0"]
    scratch = tmp_path / "scratch"
    result, error_file = wrapper(
        daemon, tmp_path, ad, *starter_command(apptainer, scratch, job), env=STARTER_ENV
    )
    assert result.returncode == 0, result.stderr
    assert not error_file.exists()
    record: dict[str, Any] = json.loads(out.read_text())
    return record


def test_an_mps_job_in_apptainer_sees_its_share_and_its_pipe_directory(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    record = run_container_job(daemon, tmp_path, AD.format(vram=2000) + 'MigdMode = "mps"\n')
    inside = record["env"]
    pipe = inside["CUDA_MPS_PIPE_DIRECTORY"]
    # the directory the MPS variables name is bound into the container, at the same path
    assert pipe in record["binds"] and Path(pipe).is_dir(), record
    assert Path(pipe).is_relative_to(daemon.root / "run")
    assert int(inside["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split("=")[-1].rstrip("MG")) > 0
    # the lease's GPU, not the whole parent the starter named
    status = daemon.client().status()
    assert inside["CUDA_VISIBLE_DEVICES"] == status["gpus"][0]["uuid"]
    assert inside["MIGD_LEASE_ID"]
    # the bind list is for the runtime: nothing of it inside, and the starter's -B kept
    assert "APPTAINER_BIND" not in inside and "SINGULARITY_BIND" not in inside
    assert str(tmp_path / "scratch") in record["binds"]
    assert "--nv" in record["flags"] and "-C" in record["flags"]


def test_a_mig_job_in_apptainer_gets_its_instance_and_no_extra_bind(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    record = run_container_job(daemon, tmp_path, AD.format(vram=4000))
    inside = record["env"]
    assert inside["CUDA_VISIBLE_DEVICES"].startswith("MIG-"), inside
    assert "CUDA_MPS_PIPE_DIRECTORY" not in inside
    assert record["outer_bind"] is None
    assert record["binds"] == [str(tmp_path / "scratch")]
