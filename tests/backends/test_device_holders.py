"""A MIG destroy refused "in use" with no process listed names who holds the device files
(DCGM's nv-hostengine: NVIDIA/DCGM#276, go-nvml#146), from a made-up /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from migd.backends.holders import Holder, describe_holders, device_file_holders
from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import FakePynvml, SimNode
from migd.backends.simulated import nvml_api as api
from migd.errors import GpuBusy


def fake_proc(root: Path, pid: int, comm: str, targets: list[str]) -> None:
    fd = root / str(pid) / "fd"
    fd.mkdir(parents=True)
    (root / str(pid) / "comm").write_text(comm + "\n")
    for i, target in enumerate(targets):
        (fd / str(i)).symlink_to(target)


def test_the_processes_with_nvidia_device_files_open_are_found(tmp_path: Path) -> None:
    fake_proc(tmp_path, 4242, "nv-hostengine", ["/dev/nvidiactl", "/dev/null"])
    fake_proc(tmp_path, 4243, "bash", ["/dev/pts/0"])
    fake_proc(tmp_path, 4244, "nvidia-persiste", ["/dev/nvidia0"])
    fake_proc(tmp_path, 4245, "migd", ["/dev/nvidia0"])
    (tmp_path / "self").mkdir()  # not a pid
    holders = device_file_holders(tmp_path, exclude=frozenset({4245}))
    assert holders == [Holder(4242, "nv-hostengine"), Holder(4244, "nvidia-persiste")]
    text = describe_holders(holders)
    assert "nv-hostengine (pid 4242)" in text and "DCGM#276" in text
    assert "systemctl stop nvidia-dcgm" in text
    assert "another NVML client" in describe_holders([])


def test_a_destroy_refused_with_no_process_says_what_holds_the_instance() -> None:
    node = SimNode.from_description("1xA100-40GB")
    backend = NvmlBackend(
        FakePynvml(node),
        sleep=lambda _s: None,
        holders=lambda: [Holder(4242, "nv-hostengine")],
    )
    inst = backend.create_instance(0, 19, 0)
    node.fail_next("nvmlGpuInstanceDestroy", api.NVML_ERROR_IN_USE, times=10)
    with pytest.raises(GpuBusy) as info:
        backend.destroy_instance(0, inst.gi_id)
    assert "nv-hostengine (pid 4242)" in info.value.message
    assert "DCGM" in info.value.details["holders"] and info.value.details["pids"] == []
