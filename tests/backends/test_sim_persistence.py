"""A simulated node with a state file outlives its process, as real GPUs outlive migd.

Covers: every kind of state survives a reload (checked through NVML as the daemon
sees it, not only through the file), the file is current after every mutation
(hypothesis drives random operation sequences), writes are atomic (a real SIGKILL
between the temporary write and the rename), mismatched or corrupt files are
refused without being overwritten, and dead processes are dropped on load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.backends.simulated import SIM_STATE_SCHEMA, SimCudaError, SimNode, simulated_backend
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.mig_ops import CI_PROFILE_SLICES
from migd.errors import ConfigError, StateStoreError

REPO = Path(__file__).resolve().parents[2]
WHERE = "backend.sim_state_file"


class HostTable:
    """A host process table the test controls: ``starts`` maps live PIDs to start times."""

    def __init__(self, starts: dict[int, float] | None = None, *, everyone: bool = False) -> None:
        self.starts = dict(starts or {})
        self.everyone = everyone  # every PID runs, started at 1000 + pid

    def _start(self, pid: int) -> float | None:
        if self.everyone:
            return 1000.0 + pid
        return self.starts.get(pid)

    def alive(self, pid: int, start_time: float | None = None) -> bool:
        started = self._start(pid)
        return started is not None and (start_time is None or started == start_time)

    def start_time(self, pid: int) -> float | None:
        return self._start(pid)

    def uid(self, pid: int) -> int | None:
        return os.getuid() if self._start(pid) is not None else None


EVERYONE = HostTable(everyone=True)


def spawn(procs: list[subprocess.Popen[bytes]]) -> int:
    proc = subprocess.Popen(["sleep", "60"])
    procs.append(proc)
    return proc.pid


def observed(node: SimNode) -> dict[str, Any]:
    """What NVML reports about the node, read through the real NvmlBackend."""
    backend, _ = simulated_backend(node)
    infos = backend.discover()
    seen: dict[str, Any] = {"gpus": []}
    for info in infos:
        gpu: dict[str, Any] = {
            "uuid": info.uuid,
            "mig": (info.mig_current, info.mig_pending),
            "memory_used_mib": backend.memory(info.index).used_mib,
        }
        if info.mig_current:
            gpu["instances"] = sorted(
                (m.gi_id, m.profile_id, m.start, m.ci_id, m.uuid)
                for m in backend.list_instances(info.index)
            )
            gpu["processes"] = sorted(
                (p.pid, p.used_mib, m.uuid)
                for m in backend.list_instances(info.index)
                if m.uuid
                for p in backend.processes(info.index, m.uuid)
            )
        else:
            gpu["processes"] = sorted(
                (p.pid, p.used_mib) for p in backend.processes(info.index, None)
            )
        seen["gpus"].append(gpu)
    backend.close()
    return seen


def processes_of(node: SimNode) -> set[tuple[Any, ...]]:
    return {
        (p.pid, p.gpu, p.device_uuid, p.used_mib, p.mps, p.mps_pinned_limit_mib)
        for i in range(node.gpu_count)
        for p in node.procs.processes_on(i)
    }


# -- round trip ---------------------------------------------------------------------------------


def test_every_kind_of_state_survives_a_reload(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "sim.json"
    description = "1xA100-40GB,1xA100-40GB,1xH100-80GB,1xV100-32GB"
    backend, node = simulated_backend(description, state_file=state)
    assert state.exists() and not node.loaded_from_file
    backend.discover()
    # GPU 0: full instances made the way migd makes them, a GI without a compute
    # instance, and a 3g GI split into three 1-slice compute instances.
    big = backend.create_instance(0, 9, 4)  # 3g.20gb@4
    small = backend.create_instance(0, 19, 0)  # 1g.5gb@0
    bare = node.mig.create_gpu_instance(0, 19, 1, 1)
    gone = backend.create_instance(0, 19, 2)
    backend.destroy_instance(0, gone.gi_id)  # its MIG UUID must never come back
    split_gi = node.mig.create_gpu_instance(1, 9, 0, 4)
    split_cis = [node.mig.create_compute_instance(split_gi.serial, 0) for _ in range(3)]
    # GPU 1 also: MIG disable pending a reset. GPU 2: fell off the bus. GPU 3: no MIG.
    node.set_mig_mode(1, True, False)
    node.lose_gpu(2)
    live_mig, live_mps, live_whole = spawn(sleepers), spawn(sleepers), spawn(sleepers)
    node.attach(live_mig, big.uuid or "")
    node.alloc(live_mig, 12_000)
    node.attach(live_mps, split_cis[1].uuid, mps_pinned_limit_mib=3000)
    node.alloc(live_mps, 2500)
    node.free(live_mps, 500)
    node.attach(live_whole, node.gpu(3).uuid)
    node.alloc(live_whole, 20_000)
    node.attach(os.getpid(), small.uuid or "", mps=True)  # MPS without a limit
    before_nvml = observed(node)
    before_snapshot = node.snapshot()

    _, reloaded = simulated_backend(description, state_file=state)

    assert reloaded.loaded_from_file and reloaded.pruned_on_load == []
    assert reloaded.snapshot() == before_snapshot
    # Through NVML, as the restarted daemon sees it (GPU 2 is lost: discovery skips it).
    assert observed(reloaded) == before_nvml
    for index in (0, 1):
        assert reloaded.instances(index) == node.instances(index)
    assert next(v for v in reloaded.instances(0) if v.gi_id == bare.gi_id).uuids == ()
    [split_view] = reloaded.instances(1)
    assert split_view.ci_ids == (0, 1, 2)
    assert (reloaded.gpu(1).mig_current, reloaded.gpu(1).mig_pending) == (True, False)
    assert reloaded.gpu(2).lost and not reloaded.gpu(0).lost
    assert processes_of(reloaded) == processes_of(node)
    # Id counters: the next MIG UUID is the one the old node would have made next,
    # and none handed out before (the destroyed instance's included).
    used = {u for i in (0, 1) for v in node.instances(i) for u in v.uuids} | {gone.uuid}
    fresh_old = node.mig.create_compute_instance(bare.serial, 0).uuid
    fresh_new = reloaded.mig.create_compute_instance(
        next(s for s, (_, gi) in reloaded.mig.gi_by_serial.items() if gi.gi_id == bare.gi_id), 0
    ).uuid
    assert fresh_new == fresh_old and fresh_new not in used


def test_the_file_wins_over_the_descriptions_initial_contents(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    toml = textwrap.dedent(
        """
        [[gpu]]
        model = "A100-40GB"
        instances = [["3g.20gb", 4]]
        processes = [{pid = 4242, device = "3g.20gb@4", used_mib = 100}]
        """
    )
    node = SimNode.from_description(toml, state_file=state, host_processes=EVERYONE)
    assert node.placements(0) == {(9, 4)}  # no file yet: the description's contents
    node.detach(4242)
    [view] = node.instances(0)
    node.mig.destroy_compute_instance(
        next(s for s, (_, _, ci) in node.mig.ci_by_serial.items() if ci.uuid == view.uuids[0])
    )
    node.mig.destroy_gpu_instance(next(iter(node.mig.gi_by_serial)))
    node.set_mig_mode(0, False)
    again = SimNode.from_description(toml, state_file=state, host_processes=EVERYONE)
    assert again.placements(0) == frozenset() and again.process(4242) is None
    assert again.gpu(0).mig_current is False


def test_the_state_files_directory_is_created(tmp_path: Path) -> None:
    state = tmp_path / "not" / "there" / "sim.json"
    node = SimNode.from_description("1xA100-40GB", state_file=state)
    node.mig.create_gpu_instance(0, 0, 0, 8)
    assert SimNode.from_description("1xA100-40GB", state_file=state).placements(0) == {(0, 0)}


def test_reset_writes_the_initial_state(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    node = SimNode.from_description("1xA100-40GB", state_file=state)

    def saved_gpus() -> tuple[Any, ...]:
        # Handle serials stay unique for the node's life, across reset(): not compared.
        data = json.loads(state.read_text())
        return data["gpus"], data["processes"], data["mig_uuid_rng"]

    initial = saved_gpus()
    gi = node.mig.create_gpu_instance(0, 0, 0, 8)
    node.mig.create_compute_instance(gi.serial, 4)
    node.lose_gpu(0)
    assert saved_gpus() != initial
    node.reset()
    assert saved_gpus() == initial
    assert SimNode.from_description("1xA100-40GB", state_file=state).placements(0) == frozenset()


# -- the file is current after every mutation ---------------------------------------------------

DESCRIPTION = "1xA100-40GB,1xA30-24GB,1xV100-32GB"
PIDS = st.integers(min_value=1, max_value=5)
OPERATIONS = st.sampled_from(
    [
        "create_gi",
        "create_gi",
        "create_ci",
        "destroy_ci",
        "destroy_gi",
        "attach",
        "attach",
        "alloc",
        "free",
        "detach",
        "mig_mode",
        "lose_gpu",
    ]
)


def apply_random_operation(node: SimNode, data: st.DataObject) -> str:
    """One random driver/CUDA operation; refusals are part of the state space."""
    op = data.draw(OPERATIONS)
    index = data.draw(st.integers(0, node.gpu_count - 1))
    gpu = node.gpu(index)
    gis = [gi for _, (_, gi) in sorted(node.mig.gi_by_serial.items())]
    cis = [ci for _, (_, _, ci) in sorted(node.mig.ci_by_serial.items())]
    try:
        if op == "create_gi" and gpu.geometry is not None:
            profile = data.draw(st.sampled_from(gpu.geometry.profiles))
            start = data.draw(st.sampled_from(profile.starts))
            node.mig.create_gpu_instance(index, profile.profile_id, start, profile.memory_slices)
        elif op == "create_ci" and gis:
            gi = data.draw(st.sampled_from(gis))
            ci_profile = data.draw(st.sampled_from(sorted(CI_PROFILE_SLICES)))
            node.mig.create_compute_instance(gi.serial, ci_profile)
        elif op == "destroy_ci" and cis:
            node.mig.destroy_compute_instance(data.draw(st.sampled_from(cis)).serial)
        elif op == "destroy_gi" and gis:
            node.mig.destroy_gpu_instance(data.draw(st.sampled_from(gis)).serial)
        elif op == "attach":
            devices = [g.uuid for g in node.gpus] + [ci.uuid for ci in cis]
            limit = data.draw(st.none() | st.integers(0, 8000))
            node.attach(data.draw(PIDS), data.draw(st.sampled_from(devices)), limit)
        elif op == "alloc":
            node.alloc(data.draw(PIDS), data.draw(st.integers(0, 9000)))
        elif op == "free":
            node.free(data.draw(PIDS), data.draw(st.integers(0, 3000)))
        elif op == "detach":
            node.detach(data.draw(PIDS))
        elif op == "mig_mode" and gpu.geometry is not None:
            node.set_mig_mode(index, data.draw(st.booleans()), data.draw(st.booleans()))
        elif op == "lose_gpu":
            node.lose_gpu(index)
    except (api.NVMLError, SimCudaError, ValueError):
        return f"{op} refused"
    return op


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_after_every_mutation_a_reload_equals_the_live_node(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as directory:
        state = Path(directory) / "sim.json"
        node = SimNode.from_description(DESCRIPTION, state_file=state, host_processes=EVERYONE)
        for _ in range(data.draw(st.integers(1, 25))):
            what = apply_random_operation(node, data)
            reloaded = SimNode.from_description(
                DESCRIPTION, state_file=state, host_processes=EVERYONE
            )
            assert reloaded.snapshot() == node.snapshot(), what
            for index in range(node.gpu_count):
                assert reloaded.instances(index) == node.instances(index), what
                assert reloaded.memory_mib(index) == node.memory_mib(index), what
            assert processes_of(reloaded) == processes_of(node), what
            assert [p.name for p in Path(directory).iterdir()] == ["sim.json"]


def test_concurrent_mutations_leave_a_file_equal_to_the_node(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    node = SimNode.from_description("2xA100-40GB", state_file=state, host_processes=EVERYONE)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            barrier.wait()
            gi = node.mig.create_gpu_instance(n % 2, 19, n // 2, 1)
            ci = node.mig.create_compute_instance(gi.serial, 0)
            node.attach(100 + n, ci.uuid)
            for _ in range(5):
                node.alloc(100 + n, 100)
            node.free(100 + n, 200)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    reloaded = SimNode.from_description("2xA100-40GB", state_file=state, host_processes=EVERYONE)
    assert reloaded.snapshot() == node.snapshot()
    assert (
        sorted(p.used_mib for p in reloaded.procs.processes_on(0) + reloaded.procs.processes_on(1))
        == [300] * 8
    )


# -- atomicity ------------------------------------------------------------------------------------

CRASH_BETWEEN_WRITE_AND_REPLACE = """
import os, signal, sys
from pathlib import Path
from migd.backends.simulated import SimNode

node = SimNode.from_description("1xA100-40GB", state_file=Path(sys.argv[1]))
first = node.mig.create_gpu_instance(0, 19, 0, 1)
node.mig.create_compute_instance(first.serial, 0)

def die(src, dst, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # the temporary file is written and synced

os.replace = die
node.mig.create_gpu_instance(0, 19, 1, 1)
print("not reached")
"""


def test_a_kill_between_temp_write_and_replace_leaves_the_old_state(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_BETWEEN_WRITE_AND_REPLACE, str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert "not reached" not in crashed.stdout
    [temp] = [p for p in tmp_path.iterdir() if p != state]
    # The new state reached the temporary file only; the state file kept the old one.
    new = json.loads(temp.read_text())
    assert [i["start"] for i in new["gpus"][0]["instances"]] == [0, 1]
    old = json.loads(state.read_text())
    assert [i["start"] for i in old["gpus"][0]["instances"]] == [0]
    node = SimNode.from_description("1xA100-40GB", state_file=state)
    assert node.loaded_from_file and node.placements(0) == {(19, 0)}
    assert len(node.instances(0)[0].uuids) == 1
    assert list(tmp_path.iterdir()) == [state]  # the stray temporary file is cleaned up


def test_the_temp_file_is_synced_before_it_replaces_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "sim.json"
    node = SimNode.from_description("1xA100-40GB", state_file=state)
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        calls.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    node.mig.create_gpu_instance(0, 0, 0, 8)
    kinds = [kind for kind, _ in calls]
    assert kinds[:2] == ["fsync", "replace"], calls
    temp = calls[0][1]
    assert Path(temp).parent == tmp_path and Path(temp).name.startswith(".sim.json.")
    assert calls[1][1] == f"{temp} -> {state}"
    assert kinds[2:] == ["fsync"]  # then the directory, so the rename itself is durable
    assert calls[2][1] == str(tmp_path)


def test_a_failed_write_is_an_error_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "sim.json"
    node = SimNode.from_description("1xA100-40GB", state_file=state)
    node.mig.create_gpu_instance(0, 19, 0, 1)
    before = state.read_bytes()

    def full(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(StateStoreError, match="No space left") as caught:
        node.mig.create_gpu_instance(0, 19, 1, 1)
    assert "free space" in caught.value.hint
    monkeypatch.undo()
    assert state.read_bytes() == before
    assert list(tmp_path.iterdir()) == [state]
    assert SimNode.from_description("1xA100-40GB", state_file=state).placements(0) == {(19, 0)}


# -- refused files ------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A state file with an instance and a process, written for 2xA100-40GB."""
    state = tmp_path / "sim.json"
    backend, node = simulated_backend("2xA100-40GB", state_file=state, host_processes=EVERYONE)
    backend.discover()
    inst = backend.create_instance(1, 14, 0)  # 2g.10gb@0
    node.attach(7, inst.uuid or "")
    node.alloc(7, 1000)
    backend.close()
    return state


@pytest.mark.parametrize(
    ("description", "options", "fragment"),
    [
        ("3xA100-40GB", {}, "the file has 2 GPU(s), the description 3"),
        ("1xA100-40GB", {}, "the file has 2 GPU(s), the description 1"),
        ("1xA100-40GB,1xH100-80GB", {}, "GPU 1 is A100-40GB"),
        ("1xA100-40GB,1xV100-32GB", {}, "in the description"),
        ("2xA100-40GB", {"seed": 9}, "GPU 0 is A100-40GB (GPU-"),
    ],
)
def test_a_file_of_other_gpus_is_refused_and_left_alone(
    saved: Path, description: str, options: dict[str, Any], fragment: str
) -> None:
    before = saved.read_bytes()
    with pytest.raises(ConfigError) as caught:
        SimNode.from_description(description, state_file=saved, **options)
    error = caught.value
    assert error.where == WHERE
    assert "other GPUs than the description" in error.message
    assert fragment in error.message
    assert "delete" in error.hint and str(saved) in error.hint
    assert saved.read_bytes() == before  # never silently overwritten


def _edit(data: dict[str, Any], change: str) -> None:
    gpu1 = data["gpus"][1]
    if change == "overlapping instances":
        gpu1["instances"].append({**gpu1["instances"][0], "gi_id": 5, "cis": []})
    elif change == "unknown profile":
        gpu1["instances"][0]["profile_id"] = 99
    elif change == "illegal start":
        gpu1["instances"][0]["start"] = 1
    elif change == "MIG UUID twice":
        twin = {"gi_id": 2, "profile_id": 14, "start": 2, "cis": gpu1["instances"][0]["cis"]}
        gpu1["instances"].append(twin)
    elif change == "process on a missing instance":
        data["processes"][0]["gi_id"] = 4
    elif change == "process on a GPU that is not there":
        data["processes"][0]["gpu"] = -1
    elif change == "more memory than the instance":
        data["processes"][0]["used_mib"] = 50_000
    elif change == "instances with MIG off":
        gpu1["mig_current"] = False
    elif change == "boolean for a number":
        gpu1["instances"][0]["gi_id"] = True
    elif change == "missing key":
        del data["next_serial"]
    elif change == "bad id counter state":
        data["mig_uuid_rng"] = [3, [1, 2, 3], None]
    elif change == "other schema":
        data["schema"] = "migd-sim-state/99"


@pytest.mark.parametrize(
    "change",
    [
        "overlapping instances",
        "unknown profile",
        "illegal start",
        "MIG UUID twice",
        "process on a missing instance",
        "process on a GPU that is not there",
        "more memory than the instance",
        "instances with MIG off",
        "boolean for a number",
        "missing key",
        "bad id counter state",
        "other schema",
    ],
)
def test_an_inconsistent_file_is_refused_with_what_to_do(saved: Path, change: str) -> None:
    data = json.loads(saved.read_text())
    assert data["schema"] == SIM_STATE_SCHEMA
    _edit(data, change)
    saved.write_text(json.dumps(data))
    before = saved.read_bytes()
    with pytest.raises(ConfigError) as caught:
        SimNode.from_description("2xA100-40GB", state_file=saved, host_processes=EVERYONE)
    error = caught.value
    assert error.where == WHERE
    assert "not a usable simulated-GPU state file" in error.message
    assert f"delete {saved}" in error.hint
    assert saved.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"\x00\xff garbage", "not JSON"),
        (None, "not JSON"),  # the first half of a real state file
    ],
)
def test_a_corrupt_file_is_refused_with_what_to_do(
    saved: Path, content: bytes | None, fragment: str
) -> None:
    real = saved.read_bytes()
    saved.write_bytes(real[: len(real) // 2] if content is None else content)
    with pytest.raises(ConfigError, match=fragment) as caught:
        SimNode.from_description("2xA100-40GB", state_file=saved)
    assert caught.value.where == WHERE
    assert f"delete {saved}" in caught.value.hint


def test_deleting_the_file_as_the_hint_says_starts_empty(saved: Path) -> None:
    saved.write_text("{")
    with pytest.raises(ConfigError):
        SimNode.from_description("2xA100-40GB", state_file=saved)
    saved.unlink()
    node = SimNode.from_description("2xA100-40GB", state_file=saved)
    assert not node.loaded_from_file and node.placements(1) == frozenset()
    assert json.loads(saved.read_text())["schema"] == SIM_STATE_SCHEMA


# -- processes across a reload --------------------------------------------------------------------


def test_processes_whose_pid_died_are_dropped_on_load(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "sim.json"
    backend, node = simulated_backend("1xA100-40GB", state_file=state)
    backend.discover()
    inst = backend.create_instance(0, 9, 0)  # 3g.20gb@0
    uuid = inst.uuid or ""
    survivor, victim = spawn(sleepers), spawn(sleepers)
    fictional = 4_000_000  # above Linux's pid_max: no host process has it
    for pid, mib in ((survivor, 1000), (victim, 2000), (fictional, 4000)):
        node.attach(pid, uuid)
        node.alloc(pid, mib)
    backend.close()
    sleepers[1].kill()
    sleepers[1].wait()

    reloaded = SimNode.from_description("1xA100-40GB", state_file=state)

    assert sorted(p.pid for p in reloaded.pruned_on_load) == sorted([victim, fictional])
    assert [p.pid for p in reloaded.procs.processes_on(0)] == [survivor]
    gi_serial = next(iter(reloaded.mig.gi_by_serial))
    assert reloaded.memory_mib(0, gi_serial)[1] == 1000  # the dead ones' memory is freed
    # The file no longer lists them: the next load has nothing to drop.
    again = SimNode.from_description("1xA100-40GB", state_file=state)
    assert again.pruned_on_load == [] and [p.pid for p in again.procs.processes_on(0)] == [survivor]
    # The instance itself stays (a process exiting never destroys an instance).
    assert again.instances(0)[0].uuids == (uuid,)


def test_a_reused_pid_does_not_keep_a_dead_processs_context(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    before = HostTable({321: 50.0, 654: 60.0})
    node = SimNode.from_description("1xV100-32GB", state_file=state, host_processes=before)
    node.attach(321, node.gpu(0).uuid)
    node.attach(654, node.gpu(0).uuid)
    after = HostTable({321: 75.0, 654: 60.0})  # 321 exited; a new process got its PID
    reloaded = SimNode.from_description("1xV100-32GB", state_file=state, host_processes=after)
    assert [p.pid for p in reloaded.pruned_on_load] == [321]
    assert [p.pid for p in reloaded.procs.processes_on(0)] == [654]


def test_without_a_state_file_nothing_is_written_or_pruned(tmp_path: Path) -> None:
    node = SimNode.from_description("1xV100-32GB", host_processes=HostTable())
    node.attach(4_000_000, node.gpu(0).uuid)
    node.alloc(4_000_000, 10)
    assert node.state_file is None and node.process(4_000_000) is not None
    assert node.process(4_000_000).host_start_s is None  # type: ignore[union-attr]
    assert list(tmp_path.iterdir()) == []
