"""The simulated node on its own: descriptions, identities, ids, latency, faults, threads."""

from __future__ import annotations

import ctypes
import re
import threading
import uuid
from pathlib import Path

import pytest

from migd.backends.simulated import FakePynvml, SimNode
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.hardware import board, known_models
from migd.core import catalog
from migd.core.costs import CostModel
from migd.errors import ConfigError

UUID_RE = re.compile(
    r"^(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
)


def test_short_description_builds_identical_gpus() -> None:
    node = SimNode.from_description("8xA100-40GB")
    assert node.gpu_count == 8
    geo = catalog.geometry("A100-40GB")
    assert all(g.geometry is geo and g.mig_current for g in node.gpus)
    assert len({g.uuid for g in node.gpus}) == 8
    assert len({g.pci_bus_id for g in node.gpus}) == 8


def test_mixed_description_keeps_order_and_marks_non_mig_gpus() -> None:
    node = SimNode.from_description("2xA100-40GB, 1xH100-80GB ,1xV100-32GB")
    models = [g.spec.model for g in node.gpus]
    assert models == ["A100-40GB", "A100-40GB", "H100-80GB", None]
    v100 = node.gpu(3)
    assert v100.geometry is None and v100.mig_current is None and v100.mig_pending is None
    assert v100.spec.name == board("V100-32GB").name


def test_description_flags_set_mig_mode() -> None:
    node = SimNode.from_description("1xA100-40GB:mig=off,1xA100-40GB:mig=pending,A30")
    assert (node.gpu(0).mig_current, node.gpu(0).mig_pending) == (False, False)
    assert (node.gpu(1).mig_current, node.gpu(1).mig_pending) == (False, True)
    assert node.gpu(2).spec.model == "A30-24GB"  # bare model = one GPU, aliases resolve


@pytest.mark.parametrize(
    ("description", "fragment"),
    [
        ("2xB100-80GB", "unknown GPU model"),
        ("1xA100-40GB:mig=maybe", "unknown flag"),
        ("1xV100-32GB:mig=on", "has no MIG"),
        ("0xA100-40GB", "at least 1"),
        (" , ", "names no GPU"),
    ],
)
def test_bad_descriptions_say_what_is_wrong(description: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        SimNode.from_description(description)
    if "unknown GPU model" in fragment:
        assert "A100-40GB" in caught.value.hint and "V100-32GB" in caught.value.hint


TOML = """
seed = 11
driver_version = "550.54.15"
cuda_version = "12.4"
[[gpu]]
model = "A100-40GB"
instances = [["3g.20gb", 4], {profile = "1g.5gb", start = 0, gi_id = 9}]
processes = [{pid = 4242, device = "3g.20gb@4", used_mib = 1000, mps_pinned_limit_mib = 2048}]
[[gpu]]
model = "H100-80GB"
count = 2
mig = false
"""


def test_toml_description_sets_instances_processes_and_options(tmp_path: Path) -> None:
    for source in (TOML, tmp_path / "node.toml"):
        (tmp_path / "node.toml").write_text(TOML)
        node = SimNode.from_description(source)
        assert node.seed == 11 and node.driver_version == "550.54.15"
        assert node.cuda_version == 12040
        assert node.placements(0) == {(9, 4), (19, 0)}
        assert {v.gi_id for v in node.instances(0) if v.start == 0} == {9}
        proc = node.process(4242)
        assert proc is not None and proc.used_mib == 1000 and proc.mps
        assert proc.mps_pinned_limit_mib == 2048
        assert [g.mig_current for g in node.gpus[1:]] == [False, False]


def test_toml_with_an_impossible_layout_is_refused() -> None:
    text = '[[gpu]]\nmodel = "A100-40GB"\ninstances = [["3g.20gb", 0], ["4g.20gb", 0]]\n'
    with pytest.raises(ConfigError, match=r"not placeable.*INSUFFICIENT_RESOURCES"):
        SimNode.from_description(text)


def test_toml_describes_instances_made_by_hand() -> None:
    text = """
[[gpu]]
model = "A100-40GB"
instances = [
  {profile = "3g.20gb", start = 4, compute_instances = [
    {slices = 1, uuid = "MIG-00000000-0000-4000-8000-000000000001"}, {slices = 2}]},
  {profile = "2g.10gb", start = 0, compute_instances = []},
]
processes = [{pid = 7, device = "MIG-00000000-0000-4000-8000-000000000001"}]
"""
    node = SimNode.from_description(text)
    split, empty = sorted(node.instances(0), key=lambda v: -v.start)
    assert split.ci_ids == (0, 1) and split.uuids[0] == "MIG-00000000-0000-4000-8000-000000000001"
    assert empty.ci_ids == ()  # a GPU instance without a compute instance
    proc = node.process(7)
    assert proc is not None and proc.device_uuid == split.uuids[0]


@pytest.mark.parametrize(
    ("instances", "fragment"),
    [
        (
            '[{profile = "1g.5gb", start = 0, uuid = "MIG-1"}, '
            '{profile = "1g.5gb", start = 1, uuid = "MIG-1"}]',
            "MIG UUID MIG-1 is given twice",
        ),
        (
            '[{profile = "3g.20gb", start = 4, compute_instances = [{slices = 1, uuid = "MIG-2"},'
            ' {slices = 1, uuid = "MIG-2"}]}]',
            "MIG UUID MIG-2 is given twice",
        ),
        ('[{profile = "1g.5gb", start = 0, uuid = "GPU-3"}]', "not a MIG UUID"),
        (
            '[{profile = "3g.20gb", start = 4, compute_instances = [{slices = 2}, {slices = 2}]}]',
            "need more than its 3 compute slices",
        ),
        ('[{profile = "1g.5gb", start = 0, compute_instances = [{uuid = "MIG-4"}]}]', "slices"),
    ],
)
def test_toml_instances_that_cannot_exist_are_refused(instances: str, fragment: str) -> None:
    text = f'[[gpu]]\nmodel = "A100-40GB"\ninstances = {instances}\n'
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        SimNode.from_description(text)


def test_a_mig_uuid_given_on_two_gpus_is_refused() -> None:
    text = """
[[gpu]]
model = "A100-40GB"
instances = [{profile = "1g.5gb", start = 0, uuid = "MIG-5"}]
[[gpu]]
model = "A100-40GB"
instances = [{profile = "1g.5gb", start = 0, uuid = "MIG-5"}]
"""
    with pytest.raises(ConfigError, match="given twice"):
        SimNode.from_description(text)


def test_uuids_are_stable_per_seed_and_well_formed() -> None:
    first = SimNode.from_description("4xA100-40GB", seed=3)
    again = SimNode.from_description("4xA100-40GB", seed=3)
    other = SimNode.from_description("4xA100-40GB", seed=4)
    assert [g.uuid for g in first.gpus] == [g.uuid for g in again.gpus]
    assert {g.uuid for g in first.gpus}.isdisjoint(g.uuid for g in other.gpus)
    assert all(UUID_RE.match(g.uuid) for g in first.gpus)
    assert all(uuid.UUID(g.uuid[4:]).version == 4 for g in first.gpus)


def test_ids_follow_the_placement_and_mig_uuids_are_never_reused() -> None:
    node = SimNode.from_description("1xA100-40GB")
    a = node.mig.create_gpu_instance(0, 19, 0, 1)
    b = node.mig.create_gpu_instance(0, 19, 1, 1)
    assert (a.gi_id, b.gi_id) == (7, 8)  # 1g.5gb at start s: id 7 + s
    ci = node.mig.create_compute_instance(a.serial, 0)
    old_uuid = ci.uuid
    node.mig.destroy_compute_instance(ci.serial)
    node.mig.destroy_gpu_instance(a.serial)
    c = node.mig.create_gpu_instance(0, 19, 0, 1)
    assert c.gi_id == 7  # the same placement, the same id
    new_ci = node.mig.create_compute_instance(c.serial, 0)
    assert new_ci.ci_id == 0 and new_ci.uuid != old_uuid
    assert UUID_RE.match(new_ci.uuid)


def test_reset_restores_the_initial_node() -> None:
    node = SimNode.from_description(TOML)

    def snapshot(pid: int) -> tuple[object, ...] | None:
        proc = node.process(pid)
        return (
            None
            if proc is None
            else (proc.device_uuid, proc.used_mib, proc.mps, proc.mps_pinned_limit_mib)
        )

    before = (node.placements(0), node.instances(0), snapshot(4242))
    node.detach(4242)
    node.mig.create_gpu_instance(0, 14, 2, 2)
    node.lose_gpu(1)
    node.set_root(False)
    node.fail_next("nvmlDeviceGetCount", api.NVML_ERROR_UNKNOWN)
    node.reset()
    assert (node.placements(0), node.instances(0)) == before[:2]
    assert snapshot(4242) == before[2] is not None
    assert not node.gpu(1).lost and node.is_root
    node.check_call("nvmlDeviceGetCount")  # the injected fault is gone


def test_latency_follows_seed_003_table_scaled() -> None:
    waits: list[float] = []
    node = SimNode.from_description("1xH100-80GB", time_scale=0.5, sleep=waits.append)
    gi = node.mig.create_gpu_instance(0, 9, 4, 4)  # 3g
    node.mig.destroy_gpu_instance(gi.serial)
    costs = CostModel.for_model("H100-80GB")
    assert waits == [0.5 * costs.create_s(3), 0.5 * costs.destroy_s(3)]
    instant = SimNode.from_description("1xH100-80GB", sleep=waits.append)
    instant.mig.create_gpu_instance(0, 0, 0, 8)
    assert len(waits) == 2  # time_scale 0 (default): no waiting at all


def test_latency_table_comes_from_the_description() -> None:
    text = """
time_scale = 0.5
latency = {1 = [1.0, 2.0], 7 = [3.0, 4.0]}
[[gpu]]
model = "A100-40GB"
[[gpu]]
model = "A100-40GB"
latency = {7 = [10.0, 20.0]}
"""
    waits: list[float] = []
    node = SimNode.from_description(text, sleep=waits.append)
    small = node.mig.create_gpu_instance(0, 19, 0, 1)  # 1 slice
    node.mig.destroy_gpu_instance(small.serial)
    middle = node.mig.create_gpu_instance(0, 9, 4, 4)  # 3 slices: the next larger row (7)
    node.mig.destroy_gpu_instance(middle.serial)
    node.mig.create_gpu_instance(1, 19, 0, 1)  # GPU 1's own table: 1 slice -> the 7 row
    assert waits == [0.5, 1.0, 1.5, 2.0, 5.0]
    with pytest.raises(ConfigError, match="bad latency entry"):
        SimNode.from_description('latency = {1 = [-1, 0]}\n[[gpu]]\nmodel = "A100-40GB"\n')


def test_a_slow_create_holds_off_only_mig_changes_of_its_own_gpu() -> None:
    started, release = threading.Event(), threading.Event()

    def slow(seconds: float) -> None:  # stands in for the simulated NVML latency
        started.set()
        assert release.wait(10)

    node = SimNode.from_description("2xA100-40GB", time_scale=1.0, sleep=slow)
    nvml = FakePynvml(node)
    nvml.nvmlInit()
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    placement = nvml.c_nvmlGpuInstancePlacement_t(4, 4)
    creating = threading.Thread(
        target=nvml.nvmlDeviceCreateGpuInstanceWithPlacement,
        args=(device, 9, ctypes.byref(placement)),
    )
    creating.start()
    assert started.wait(10)
    # NVML reads of the same GPU answer at once, with the state before the create.
    count = ctypes.c_uint(99)
    array = (nvml.c_nvmlGpuInstance_t * 2)()
    reader = threading.Thread(
        target=nvml.nvmlDeviceGetGpuInstances, args=(device, 9, array, ctypes.byref(count))
    )
    reader.start()
    reader.join(5)
    assert not reader.is_alive() and count.value == 0
    # A second MIG change of the same GPU waits for the first, as the driver makes it.
    second = threading.Thread(target=node.mig.create_gpu_instance, args=(0, 19, 0, 1))
    second.start()
    second.join(0.2)
    assert second.is_alive() and node.placements(0) == frozenset()
    release.set()
    creating.join(10)
    second.join(10)
    assert node.placements(0) == {(9, 4), (19, 0)}


def test_injected_faults_fire_the_requested_number_of_times_and_gpu() -> None:
    node = SimNode.from_description("2xA100-40GB")
    node.fail_next("nvmlGpuInstanceDestroy", api.NVML_ERROR_IN_USE, times=2, gpu=1)
    node.check_call("nvmlGpuInstanceDestroy", 0)  # other GPU: unaffected
    for _ in range(2):
        with pytest.raises(api.NVMLError_InUse):
            node.check_call("nvmlGpuInstanceDestroy", 1)
    node.check_call("nvmlGpuInstanceDestroy", 1)


def test_placement_rules_of_the_simulator() -> None:
    node = SimNode.from_description("1xA100-40GB,1xA30-24GB")
    codes = []
    for profile_id, start, size in [(9, 2, 4), (9, 4, 2), (77, 0, 1)]:
        with pytest.raises(api.NVMLError) as caught:
            node.mig.create_gpu_instance(0, profile_id, start, size)
        codes.append(caught.value.value)
    assert codes == [api.NVML_ERROR_INVALID_ARGUMENT] * 3
    node.mig.create_gpu_instance(0, 9, 4, 4)
    with pytest.raises(api.NVMLError_InsufficientResources):  # overlap
        node.mig.create_gpu_instance(0, 14, 4, 2)
    node.mig.create_gpu_instance(0, 20, 0, 1)
    with pytest.raises(api.NVMLError_InsufficientResources):  # second +me
        node.mig.create_gpu_instance(0, 20, 1, 1)
    node.mig.create_gpu_instance(1, 21, 0, 1)  # A30 1g.6gb+me ...
    with pytest.raises(api.NVMLError_InsufficientResources):  # ... shares the OFA with 2g+me
        node.mig.create_gpu_instance(1, 6, 2, 2)


def test_concurrent_creates_never_double_book_a_slice() -> None:
    node = SimNode.from_description("1xA100-40GB")
    won: list[int] = []
    barrier = threading.Barrier(14)

    def worker(start: int) -> None:
        barrier.wait()
        try:
            node.mig.create_gpu_instance(0, 19, start, 1)
            won.append(start)
        except api.NVMLError_InsufficientResources:
            pass

    threads = [threading.Thread(target=worker, args=(s % 7,)) for s in range(14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == list(range(7))
    assert node.placements(0) == {(19, s) for s in range(7)}
    assert len({v.gi_id for v in node.instances(0)}) == 7


def test_every_model_of_the_catalog_and_the_non_mig_table_is_simulated() -> None:
    node = SimNode.from_description(",".join(f"1x{m}" for m in known_models()))
    for gpu in node.gpus:
        if gpu.geometry is not None:
            assert gpu.spec.memory_total_mib >= gpu.geometry.memory_mib
            assert catalog.detect_model(gpu.spec.pci_device_id) == gpu.spec.model


def test_unreadable_sources_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "other.json").write_text('{"schema": "something-else"}')
    for name, fragment in [
        ("bad.json", "as JSON"),
        ("list.json", "JSON object"),
        ("other.json", "not a migd-gpu-probe/1"),
        ("missing.toml", "cannot read"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            SimNode.from_description(tmp_path / name)
    with pytest.raises(ConfigError, match="as JSON"):
        SimNode.from_probe(tmp_path / "bad.json")
