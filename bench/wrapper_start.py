"""Benchmark what the job wrapper adds to every job's start: a job without a GPU against a
bare exec, and a GPU job (lease, run ``/bin/true``, release) against a simulated daemon.

    .venv/bin/python bench/wrapper_start.py [--runs 40] [--tree NAME=DIR ...] [--out FILE]

``--bin NAME=DIR`` times the commands an installed package put in DIR instead (``/usr/bin``
of the .deb, ``/opt/migd/bin`` of the older venv package), as HTCondor runs them.
Each ``--tree`` is a source tree of migd (default: this one, as ``now``); ``git archive
<commit> | tar -x -C DIR`` gives an older one to compare. Each tree gets a throwaway
virtual environment that sees the tree and this venv's dependencies through a plain
``.pth`` path (no editable-install finder, which costs more than the light entry does), and
console scripts written from the tree's own ``[project.scripts]`` with pip's template: the
commands HTCondor would run from a package. The runs of every tree and of the baselines are
interleaved, round after round, so the load of a shared machine falls on all of them alike.

Measured per start: wall (``time.perf_counter``, spawn to reap) and CPU (user + system of
the wrapper and whatever it started, from ``os.wait4``). Medians and 90th percentiles.

- ``bare exec``: ``/bin/true`` itself; ``python -c pass``: the interpreter's own start (the
  floor of any Python wrapper, in the same venv);
- ``CPU job``: ``migd-wrapper /bin/true`` with ``$_CONDOR_JOB_AD`` a job ad without GPUs;
- ``GPU job, migd-wrapper``: the same with a GPU job ad (``RequestGPUs = 1``,
  ``RequestVRAM = 4096``): read the ads, lease 4 GiB, run ``/bin/true``, release;
- ``GPU job, migd-run``: ``migd-run --gpu-memory 4G -- /bin/true``.

The daemon is this tree's, on a simulated 8 x A100-40GB node with no simulated NVML
latency (``bench_daemon.BenchDaemon``), so a GPU job's time is the wrapper's and the
lease's own.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_daemon import BenchDaemon  # noqa: E402

CPU_AD = 'GlobalJobId = "ap#13.0#1700000000"\nClusterId = 13\nProcId = 0\nRequestCpus = 1\n'
GPU_AD = (
    'GlobalJobId = "ap#{n}.0#1700000000"\nClusterId = {n}\nProcId = 0\nRequestCpus = 1\n'
    "RequestGPUs = 1\nRequestVRAM = 4096\n"
)
MACHINE_AD = 'Name = "slot1_1@bench"\n'
# pip's console-script template (what a package installs as /usr/bin/migd-wrapper).
SCRIPT = """#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from {module} import {func}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({func}())
"""


def make_env(tree: Path, where: Path) -> Path:
    """A venv that imports migd from ``tree``; returns its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]  # this venv's: pydantic, htcondor, ...
    Path(purelib, "migd-bench.pth").write_text(f"{tree}\n{deps}\n")
    scripts = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("migd-wrapper", "migd-run"):
        module, func = scripts[name].split(":")
        path = where / "bin" / name
        path.write_text(SCRIPT.format(python=python, module=module, func=func))
        path.chmod(0o755)
    # Byte-compile once, as a package does, so no run pays for it.
    subprocess.run(
        [python, "-m", "compileall", "-q", str(tree / "migd")], check=True, capture_output=True
    )
    return where / "bin"


def start(command: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one run (CPU: the process and its reaped children)."""
    with log.open("wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}: {log.read_text()}")
    return wall, usage.ru_utime + usage.ru_stime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--tree", action="append", default=None, help="NAME=DIR")
    parser.add_argument(
        "--bin",
        action="append",
        default=None,
        help="NAME=DIR: the commands an installed package put in DIR (e.g. now=/usr/bin)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    installed = [b.split("=", 1) for b in (args.bin or [])]
    trees = [t.split("=", 1) for t in (args.tree or ([] if installed else [f"now={ROOT}"]))]
    work = Path(tempfile.mkdtemp(prefix="migd-wrapper-bench-"))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("_CONDOR_", "MIGD_"))}
    (work / "cpu.ad").write_text(CPU_AD)
    (work / "machine.ad").write_text(MACHINE_AD)
    results: dict[str, list[tuple[float, float]]] = {}
    try:
        bins = {name: make_env(Path(d).resolve(), work / f"venv-{name}") for name, d in trees}
        bins.update({name: Path(d) for name, d in installed})
        with BenchDaemon() as daemon:
            cpu_env = {**base_env, "_CONDOR_JOB_AD": str(work / "cpu.ad")}
            gpu_env = {
                **base_env,
                "_CONDOR_MACHINE_AD": str(work / "machine.ad"),
                "MIGD_API_SOCKET": daemon.socket,
            }
            first = next(iter(bins.values()))
            python = first / "python" if (first / "python").exists() else Path(sys.executable)
            cases: list[tuple[str, list[str], dict[str, str] | None]] = [
                ("bare exec: /bin/true", ["/bin/true"], base_env),
                (
                    f"python -c pass ({python})",
                    [str(python), "-c", "pass"],
                    base_env,
                ),
            ]
            for name, bin_dir in bins.items():
                cases += [
                    (
                        f"{name}: CPU job, migd-wrapper",
                        [str(bin_dir / "migd-wrapper"), "/bin/true"],
                        cpu_env,
                    ),
                    (
                        f"{name}: GPU job, migd-wrapper",
                        [str(bin_dir / "migd-wrapper"), "/bin/true"],
                        None,
                    ),
                    (
                        f"{name}: GPU job, migd-run",
                        [str(bin_dir / "migd-run"), "--gpu-memory", "4G", "--", "/bin/true"],
                        {**base_env, "MIGD_API_SOCKET": daemon.socket},
                    ),
                ]
            for n in range(args.runs + 1):
                for label, command, case_env in cases:
                    env = case_env
                    if env is None:  # a fresh job ad: every GPU job has its own id
                        ad = work / "gpu.ad"
                        ad.write_text(GPU_AD.format(n=1000 + n))
                        env = {**gpu_env, "_CONDOR_JOB_AD": str(ad)}
                    sample = start(command, env, work / "stderr.log")
                    if n:  # the first round warms the page cache and the daemon
                        results.setdefault(label, []).append(sample)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        "# Wrapper start",
        "",
        f"`.venv/bin/python bench/wrapper_start.py --runs {args.runs}"
        + "".join(f" --tree {n}={d}" for n, d in (trees if args.tree else []))
        + "".join(f" --bin {n}={d}" for n, d in installed)
        + "`",
        f"on {os.cpu_count()} cores (load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}), Python {platform.python_version()}, "
        f"{args.runs} runs of each, interleaved; simulated 8 x A100-40GB daemon.",
        "",
        "| start | wall p50 (ms) | wall p90 (ms) | CPU p50 (ms) | CPU p90 (ms) |",
        "|---|---|---|---|---|",
    ]
    for label, samples in results.items():
        walls = [w * 1000 for w, _ in samples]
        cpus = [c * 1000 for _, c in samples]
        lines.append(
            f"| {label} | {statistics.median(walls):.1f} | {pct(walls, 0.9):.1f} "
            f"| {statistics.median(cpus):.1f} | {pct(cpus, 0.9):.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
