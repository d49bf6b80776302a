#!/usr/bin/env python3
"""Calibrate the simulated GPU against a real one: create and destroy MIG instances. WRITES.

For one GPU that is **already in MIG mode, idle and empty** (no GPU instances, no
processes), it creates and destroys every GPU instance profile at every possible
placement, through migd's own :class:`~migd.backends.nvml.NvmlBackend`, and records as
JSON what the simulated GPU assumes (issue 13, docs/nvml.md):

* the GPU instance id the driver gives each placement, and the MIG device's memory
  total as NVML reports it (next to the profile's nominal size);
* create and destroy latencies, and how many extra looks the new MIG device handle
  took to appear;
* the NVML error of an overlapping placement, of one instance past a profile's
  limit, and of a second media-extension (``+me``) instance;
* the error of destroying an instance while a process runs on it (``--busy-command``:
  a CUDA program started with ``CUDA_VISIBLE_DEVICES=<MIG UUID>``, e.g. one that
  allocates memory and sleeps).

It never changes MIG mode, compute mode, clocks or any other GPU setting and never
resets a GPU; it refuses to run unless MIG mode is on (and not pending a change), the
GPU has no instances and no processes. Every instance it made is destroyed before it
exits: on success, on any error, and on SIGTERM, SIGINT or SIGHUP (``gpu_checks.sh`` runs
it under ``timeout``, which sends SIGTERM). A second signal during that clean-up is held
until the clean-up is done. One step that fails unexpectedly is recorded as an error and
the run goes on with the next step.

The record is written step by step: with ``-o FILE``, every finished step is appended to
``FILE.steps.jsonl`` (one JSON object a line, flushed and fsync-ed), so a run killed even
by SIGKILL leaves what it measured; ``FILE`` itself is written at the end, also after a
signal or an error, with ``status`` saying how the run ended (``complete``,
``interrupted by SIGTERM``, ``error: ...``) and ``left_on_gpu`` listing any instance it
could not destroy. Exit status: 0 complete, 2 error, 3 refused, 128+N after signal N.
Usage::

    sudo .venv/bin/python scripts/mig_calibrate.py --gpu 0 -o tests/data/gpu/h100-calibration.json
    .venv/bin/python scripts/mig_calibrate.py --simulate 1xA100-40GB   # dry run, no GPU

``tests/backends/test_gpu_recordings.py`` replays every record in ``tests/data/gpu/``
against the simulated GPU and fails where the simulator answers differently.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migd.backends.nvml import NvmlBackend, nvml_errors
from migd.errors import MigdError
from migd.ports import MigInstance

SCHEMA = "migd-mig-calibration/1"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Refused(RuntimeError):
    """The GPU is not in a state this script may touch."""


class Interrupted(BaseException):
    """A stop signal arrived. A BaseException, so that no step's ``except Exception`` takes
    it for a failed step and carries on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise :class:`Interrupted` in the main thread while inside;
    the previous handlers come back afterwards."""

    def handler(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """Stop signals wait (blocked, not lost) until the block ends: a clean-up must finish."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Steps:
    """Where each finished step goes at once: one JSON line, appended, flushed, fsync-ed.

    ``path`` None keeps nothing on disk (tests, stdout runs)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if path is not None:
            self._file = path.open("a", encoding="utf-8")

    def write(self, kind: str, entry: dict[str, Any]) -> None:
        line = {"step": kind, **entry}
        self.lines.append(line)
        if self._file is not None:
            with stop_signals_held():  # whole lines only: a signal waits for the write
                self._file.write(json.dumps(line, sort_keys=True) + "\n")
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _error(err: MigdError) -> dict[str, Any]:
    return {"error": type(err).__name__, "nvml_error": err.details.get("nvml_error")}


class Counter:
    """Stands in for ``time.sleep`` in the backend: counts (and does) its back-off waits."""

    def __init__(self, sleep: Callable[[float], None]) -> None:
        self.count = 0
        self._sleep = sleep

    def __call__(self, seconds: float) -> None:
        self.count += 1
        self._sleep(seconds)


class Calibration:
    """One run on one GPU. ``busy``: starts a process on a MIG device, returns a stopper."""

    def __init__(
        self,
        backend: NvmlBackend,
        gpu: int,
        sleeps: Counter,
        *,
        busy: Callable[[str], Callable[[], None]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.backend = backend
        self.gpu = gpu
        self.sleeps = sleeps
        self.busy = busy
        self.clock = clock
        self.made: list[int] = []  # GI ids this run created and has not destroyed

    # -- guard rails --------------------------------------------------------------------------

    def check_idle(self) -> dict[str, Any]:
        """The GPU's identity; :class:`Refused` unless MIG is on, settled, and it is empty."""
        infos = {i.index: i for i in self.backend.discover()}
        info = infos.get(self.gpu)
        if info is None:
            raise Refused(f"no GPU {self.gpu}")
        if info.mig_current is not True or info.mig_pending is not True:
            raise Refused(
                f"GPU {self.gpu}: MIG mode must already be on (current {info.mig_current}, "
                f"pending {info.mig_pending}); this script never changes it"
            )
        if self.backend.list_instances(self.gpu):
            raise Refused(f"GPU {self.gpu} has MIG instances; it must be empty")
        if self.backend.processes(self.gpu):
            raise Refused(f"GPU {self.gpu} has processes; it must be idle")
        return {
            "index": info.index,
            "uuid": info.uuid,
            "name": info.name,
            "model": info.model,
            "pci_device_id_hex": f"0x{info.pci_device_id:08X}",
            "memory_total_mib": info.memory_total_mib,
            "driver_version": info.driver_version,
            "cuda_version": info.cuda_version,
            "persistence_mode": info.persistence_mode,
            "compute_mode": info.compute_mode,
        }

    # -- primitives ---------------------------------------------------------------------------

    def starts(self, profile_id: int) -> list[int]:
        """NVML's possible placements of a profile (``nvidia-smi mig -lgipp``), by start."""
        return [start for start, _size in self.backend.possible_placements(self.gpu, profile_id)]

    def create(self, profile_id: int, start: int) -> tuple[MigInstance, float, int]:
        # Held signals: a signal in the middle would leave NVML's instance made but not in
        # self.made (never destroyed), or the backend's view of it half updated.
        with stop_signals_held():
            before, t0 = self.sleeps.count, self.clock()
            inst = self.backend.create_instance(self.gpu, profile_id, start)
            seconds = self.clock() - t0
            self.made.append(inst.gi_id)
        return inst, seconds, self.sleeps.count - before

    def destroy(self, gi_id: int) -> float:
        with stop_signals_held():  # as in create(): never half a destroy
            t0 = self.clock()
            self.backend.destroy_instance(self.gpu, gi_id)
            self.made.remove(gi_id)
            return self.clock() - t0

    def attempt(self, profile_id: int, start: int) -> dict[str, Any]:
        """Try a create that should fail; an unexpected success is undone and reported."""
        try:
            inst, _s, _r = self.create(profile_id, start)
        except MigdError as err:
            return {"profile_id": profile_id, "start": start, **_error(err)}
        self.destroy(inst.gi_id)
        return {"profile_id": profile_id, "start": start, "error": None, "nvml_error": None}

    def reclaim(self) -> list[int]:
        """Destroy every instance this run made and still holds; the ones that would not go.

        Stop signals are held meanwhile: an instance half-way through its destroy must not
        be left behind because a second SIGTERM came."""
        with stop_signals_held():
            for gi_id in list(reversed(self.made)):
                try:
                    self.destroy(gi_id)
                except Exception as err:  # every instance gets its try
                    print(f"mig_calibrate: could not destroy GI {gi_id}: {err}", file=sys.stderr)
            return list(self.made)

    @contextmanager
    def cleanup(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.reclaim()

    # -- the run ------------------------------------------------------------------------------

    def run(self, steps: Steps | None = None) -> dict[str, Any]:
        """Every step; the record, also when a signal ends the run early.

        Each step's result goes to ``steps`` as soon as it is known. A step that raises
        (any ``Exception``) is recorded with its error, the instances it left are
        destroyed, and the next step runs. A stop signal ends the run: the record says
        so in ``status``. Instances that could not be destroyed are in ``left_on_gpu``.

        Raises:
            Refused: before anything is touched.
        """
        steps = steps if steps is not None else Steps(None)
        gpu = self.check_idle()
        record: dict[str, Any] = {
            "schema": SCHEMA,
            "tool": "scripts/mig_calibrate.py",
            "recorded_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "gpu": gpu,
            "status": "running",
            "placements": [],
            "overlaps": [],
            "limits": [],
        }
        steps.write("gpu", {"gpu": gpu})
        try:
            with self.cleanup():
                geometry = self.backend.geometry(self.gpu)
                for profile in geometry.profiles:
                    for start in self.starts(profile.profile_id):
                        self._step(
                            steps,
                            "placement",
                            record["placements"].append,
                            self._placement,
                            profile.profile_id,
                            start,
                        )
                for profile in geometry.profiles:
                    self._step(
                        steps,
                        "overlap",
                        record["overlaps"].append,
                        self._overlap,
                        profile.profile_id,
                        geometry,
                    )
                for profile in geometry.profiles:
                    self._step(
                        steps, "limit", record["limits"].append, self._limit, profile.profile_id
                    )
                self._step(
                    steps,
                    "in_use",
                    lambda e: record.__setitem__("in_use", e),
                    self._in_use,
                    geometry,
                )
            record["status"] = "complete"
        except Interrupted as sig:
            record["status"] = f"interrupted by {sig}"
        except Exception as err:  # whatever it was, keep what was measured
            record["status"] = f"error: {type(err).__name__}: {err}"
        finally:
            # cleanup() has run: whatever is still listed would not go.
            record["left_on_gpu"] = list(self.made)
            steps.write("end", {"status": record["status"], "left_on_gpu": record["left_on_gpu"]})
        return record

    def _step(
        self,
        steps: Steps,
        kind: str,
        keep: Callable[[dict[str, Any]], None],
        measure: Callable[..., dict[str, Any]],
        *args: Any,
    ) -> dict[str, Any]:
        """One measurement; an unexpected error is its result, and what it made is undone."""
        try:
            entry = measure(*args)
        except Exception as err:  # one failed step must not lose the record
            entry = {
                "unexpected": f"{type(err).__name__}: {err}",
                "args": [a for a in args if isinstance(a, int)],
            }
            left = self.reclaim()
            if left:
                entry["left_on_gpu"] = left
        # Into the record first, then onto disk: whatever the steps file shows, the record
        # written at the end has too (a signal can come between the two).
        keep(entry)
        steps.write(kind, entry)
        return entry

    def _placement(self, profile_id: int, start: int) -> dict[str, Any]:
        entry: dict[str, Any] = {"profile_id": profile_id, "start": start}
        try:
            inst, created_s, retries = self.create(profile_id, start)
        except MigdError as err:
            return {**entry, **_error(err)}
        memory = self.backend.memory(self.gpu, inst.uuid) if inst.uuid else None
        entry.update(
            gi_id=inst.gi_id,
            size=inst.size,
            ci_ids=[c.ci_id for c in inst.compute_instances],
            memory_total_mib=inst.memory_total_mib,
            memory_used_mib=memory.used_mib if memory else None,
            create_s=round(created_s, 4),
            handle_retries=retries,
        )
        entry["destroy_s"] = round(self.destroy(inst.gi_id), 4)
        return entry

    def _overlap(self, profile_id: int, geometry: Any) -> dict[str, Any]:
        """``profile_id`` at its first placement, then the smallest profile inside it."""
        starts = self.starts(profile_id)
        smallest = min(geometry.profiles, key=lambda p: (p.memory_slices, p.compute_slices))
        inst, _s, _r = self.create(profile_id, starts[0])
        inside = [
            s for s in self.starts(smallest.profile_id) if inst.start <= s < inst.start + inst.size
        ]
        result = (
            self.attempt(smallest.profile_id, inside[0])
            if inside
            else {"profile_id": smallest.profile_id, "start": None, "error": "no start inside"}
        )
        self.destroy(inst.gi_id)
        return {"holder": {"profile_id": profile_id, "start": starts[0]}, "attempt": result}

    def _limit(self, profile_id: int) -> dict[str, Any]:
        """As many instances of the profile as it allows, then one more."""
        made: list[int] = []
        starts = self.starts(profile_id)
        refused: dict[str, Any] | None = None
        for start in starts:
            try:
                inst, _s, _r = self.create(profile_id, start)
            except MigdError as err:
                refused = {"start": start, **_error(err)}
                break
            made.append(inst.gi_id)
        for gi_id in made:
            self.destroy(gi_id)
        return {"profile_id": profile_id, "created": len(made), "refused": refused}

    def _in_use(self, geometry: Any) -> dict[str, Any]:
        if self.busy is None:
            return {"skipped": "no --busy-command"}
        smallest = min(geometry.profiles, key=lambda p: (p.memory_slices, p.compute_slices))
        start = self.starts(smallest.profile_id)[0]
        inst, _s, _r = self.create(smallest.profile_id, start)
        if inst.uuid is None:
            raise RuntimeError(f"GI {inst.gi_id} has no MIG device UUID to run a process on")
        stop = self.busy(inst.uuid)
        try:
            return {"profile_id": smallest.profile_id, **self._raw_ci_destroy(inst)}
        finally:
            stop()

    def _raw_ci_destroy(self, inst: MigInstance) -> dict[str, Any]:
        """``nvmlComputeInstanceDestroy`` straight to NVML (migd's backend would refuse
        first, seeing the process): what the driver answers for a busy MIG device."""
        nvml = self.backend.nvml
        try:
            with nvml_errors("destroy a busy compute instance", gpu=self.gpu):
                parent = nvml.nvmlDeviceGetHandleByIndex(self.gpu)
                gi = nvml.nvmlDeviceGetGpuInstanceById(parent, inst.gi_id)
                ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, inst.ci_id)
                nvml.nvmlComputeInstanceDestroy(ci)
        except MigdError as err:
            return _error(err)
        return {"error": None, "nvml_error": None}  # destroyed anyway: cleanup takes the GI


def host_busy(command: str) -> Callable[[str], Callable[[], None]]:
    """Start ``command`` on a MIG device; wait until NVML should see its context."""

    def start(mig_uuid: str) -> Callable[[], None]:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": mig_uuid}
        proc = subprocess.Popen(shlex.split(command), env=env)
        time.sleep(5.0)  # CUDA init; the command should hold its context much longer

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        return stop

    return start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpu", type=int, default=0, help="the GPU to calibrate (default 0)")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        help="write the JSON here (default stdout); each step also goes to OUTPUT.steps.jsonl",
    )
    parser.add_argument(
        "--busy-command",
        help="a CUDA program to run on a MIG device to record IN_USE (it is terminated)",
    )
    parser.add_argument(
        "--simulate",
        metavar="DESCRIPTION",
        help='dry run on a simulated node instead, e.g. "1xH100-80GB" (no GPU touched)',
    )
    parser.add_argument(
        "--sim-state",
        type=Path,
        help="with --simulate: keep the simulated GPU in this file (so a test can look at it "
        "after the script is gone)",
    )
    parser.add_argument(
        "--sim-time-scale",
        type=float,
        default=0.0,
        help="with --simulate: creates and destroys take the simulated GPU's latencies times "
        "this (0: none); a test's window to send a signal mid-run",
    )
    args = parser.parse_args(argv)
    sleeps = Counter(time.sleep)
    busy: Callable[[str], Callable[[], None]] | None = None
    if args.simulate:
        from migd.backends.simulated import FakePynvml, SimNode

        node = SimNode.from_description(
            args.simulate, state_file=args.sim_state, time_scale=args.sim_time_scale
        )
        backend = NvmlBackend(FakePynvml(node), sleep=sleeps)
        busy = simulated_busy(node, pid=4_000_001)
    else:
        try:
            import pynvml
        except ImportError:
            print(
                "mig_calibrate: the NVML bindings (nvidia-ml-py) are not installed", file=sys.stderr
            )
            return 2
        backend = NvmlBackend(pynvml, sleep=sleeps)
        if args.busy_command:
            busy = host_busy(args.busy_command)
    steps = Steps(args.output.with_name(args.output.name + ".steps.jsonl") if args.output else None)
    try:
        with stop_signals_raise():
            record = Calibration(backend, args.gpu, sleeps, busy=busy).run(steps)
    except Interrupted as sig:  # before the run began (nothing was made)
        print(f"mig_calibrate: stopped by {sig} before it began", file=sys.stderr)
        return 128 + sig.signum
    except Refused as err:
        print(f"mig_calibrate: refusing: {err}", file=sys.stderr)
        return 3
    except MigdError as err:
        print(f"mig_calibrate: {err}", file=sys.stderr)
        return 2
    finally:
        steps.close()
        backend.close()
    record["synthetic"] = args.simulate is not None
    record["simulated"] = args.simulate
    text = json.dumps(record, indent=2) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    status = record["status"]
    if record["left_on_gpu"]:
        print(
            f"mig_calibrate: GPU instances {record['left_on_gpu']} could not be destroyed: "
            f"destroy them with nvidia-smi mig -dci/-dgi -i {args.gpu}",
            file=sys.stderr,
        )
    if status == "complete":
        return 0
    print(f"mig_calibrate: {status}; what was measured is in the record", file=sys.stderr)
    for sig in STOP_SIGNALS:
        if status == f"interrupted by {sig.name}":
            return 128 + int(sig)
    return 2


def simulated_busy(node: Any, pid: int) -> Callable[[str], Callable[[], None]]:
    """The simulated counterpart of :func:`host_busy`: a process with a context."""

    def start(mig_uuid: str) -> Callable[[], None]:
        node.attach(pid, mig_uuid)
        node.alloc(pid, 256)
        return lambda: node.detach(pid)

    return start


if __name__ == "__main__":
    raise SystemExit(main())
