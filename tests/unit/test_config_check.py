"""What a configuration means (migd/daemon/config_check.py) and the exit statuses a start
error gives (migd/daemon/exit_codes.py): issue 24, sections 2 and 4."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from migd.backends.accounts import SystemAccounts
from migd.backends.simulated import simulated_backend
from migd.backends.simulated.accounts import FakeAccounts
from migd.core.catalog import builtin_models
from migd.daemon import exit_codes
from migd.daemon.config import ApiSection, load_config, validate_config
from migd.daemon.config_check import check_accounts, check_catalog, check_gpus
from migd.daemon.service import Daemon, lock_instance
from migd.errors import (
    AlreadyRunning,
    ConfigError,
    DriverUnavailable,
    GpuBusy,
    MigdError,
    StateDiskError,
)


def _wheres(found: Any) -> list[str]:
    return [e.where for e in found.errors]


# -- profile names against the built-in catalog ---------------------------------------------


def test_an_unknown_profile_is_an_error_listing_the_valid_names() -> None:
    found = check_catalog(validate_config({"policy": {"profiles": "1g.5gb,9g.99gb"}}))
    [error] = found.errors
    assert error.where == "policy.profiles" and "'9g.99gb'" in error.message
    assert "1g.5gb" not in error.message  # only the unknown one is named as unknown
    assert "standard" in error.hint and "1g.5gb, " in error.hint and "7g.80gb" in error.hint


@pytest.mark.parametrize("spec", ["standard", "classic", "media", "all", " all "])
def test_the_named_sets_are_valid(spec: str) -> None:
    assert check_catalog(validate_config({"policy": {"profiles": spec}})).errors == []


def test_every_catalog_profile_name_and_id_is_valid() -> None:
    # Exhaustive over the catalog: nothing the tables name is refused.
    for model in builtin_models().values():
        for profile in model.profiles:
            for ref in (profile.name, str(profile.profile_id)):
                cfg = validate_config({"policy": {"profiles": ref, "demand_prior": {ref: 1.0}}})
                assert check_catalog(cfg).errors == [], (model.model, ref)


def test_each_setting_that_names_profiles_is_checked() -> None:
    cfg = validate_config(
        {
            "policy": {"profiles": "", "demand_prior": {"1g.5gb": 1.0, "5g.1gb": 2.0}},
            "gpu": [
                {"match": "0", "profiles": "2g.10gb,2g.11tb"},
                {"match": "1", "mps_profile": "0g.0gb"},
            ],
        }
    )
    assert sorted(_wheres(check_catalog(cfg))) == [
        "gpu[0].profiles",
        "gpu[1].mps_profile",
        "policy.demand_prior",
        "policy.profiles",
    ]


# -- users and groups against the host (a fake host: no test depends on the real one) -------


HOST = FakeAccounts(users={0: "root", 1000: "alice"}, groups={"root": 0, "batch": 100})


def test_unknown_users_and_groups_are_errors_with_a_hint() -> None:
    api = ApiSection(
        lease_users=["alice", "nosuchuser"],
        lease_groups=["batch", "nogroup"],
        admin_users=["root"],
        admin_groups=["wheel"],
        hook_users=["*"],
        socket_group="gpu",
    )
    found = check_accounts(api, HOST)
    assert _wheres(found) == [
        "api.lease_users",
        "api.lease_groups",
        "api.admin_groups",
        "api.socket_group",
    ]
    first = found.errors[0]
    assert "no user 'nosuchuser'" in first.message and "getent passwd nosuchuser" in first.hint
    assert "getent group nogroup" in found.errors[1].hint
    assert found.warnings == []


def test_the_default_condor_account_missing_is_a_warning_only() -> None:
    found = check_accounts(ApiSection(lease_users=["root", "condor"]), HOST)
    assert found.errors == []
    assert found.warnings == [
        "api.lease_users: no user 'condor' on this host (is HTCondor installed?)",
        "api.hook_users: no user 'condor' on this host (is HTCondor installed?)",
        "api.lease_groups: no group 'condor' on this host (is HTCondor installed?)",
    ]
    condor = FakeAccounts(users={0: "root", 64: "condor"}, groups={"condor": 64})
    assert check_accounts(ApiSection(), condor).warnings == []


# -- against the GPUs migd sees ------------------------------------------------------------


def _node(description: str) -> tuple[Any, Any]:
    backend, _ = simulated_backend(description, time_scale=0.0)
    return backend, backend.discover()


def test_a_gpu_match_that_matches_no_gpu_is_an_error_naming_the_gpus() -> None:
    backend, gpus = _node("2xA100-40GB")
    prefix = gpus[1].uuid[:12]
    cfg = validate_config(
        {
            "gpu": [
                {"match": "1"},
                {"match": prefix},
                {"match": "*"},
                {"match": "2"},
                {"match": "GPU-ffffffff"},
            ]
        }
    )
    found = check_gpus(cfg, gpus, backend.geometry)
    assert _wheres(found) == ["gpu[3].match", "gpu[4].match"]
    assert gpus[0].uuid in found.errors[0].message and "nvidia-smi -L" in found.errors[0].hint


def test_each_mig_gpu_is_checked_against_its_own_model() -> None:
    backend, gpus = _node("1xA100-40GB,1xH100-80GB")
    cfg = validate_config({"policy": {"profiles": "1g.5gb,3g.20gb"}})
    found = check_gpus(cfg, gpus, backend.geometry)
    assert [e.message for e in found.errors] == [
        "policy.profiles: GPU 1 (H100-80GB) has no MIG profile '1g.5gb'",
        "policy.profiles: GPU 1 (H100-80GB) has no MIG profile '3g.20gb'",
    ]
    assert "1g.10gb" in found.errors[0].hint and "[[gpu]]" in found.errors[0].hint
    # Per-GPU profiles fix it, and are what is checked for that GPU.
    fixed = validate_config(
        {
            "policy": {"profiles": "1g.5gb,3g.20gb"},
            "gpu": [{"match": "1", "profiles": "1g.10gb,3g.40gb", "mps_profile": "1g.10gb"}],
        }
    )
    assert check_gpus(fixed, gpus, backend.geometry).errors == []
    wrong = validate_config({"gpu": [{"match": "1", "mps_profile": "1g.5gb"}]})
    assert _wheres(check_gpus(wrong, gpus, backend.geometry)) == ["gpu[0].mps_profile"]


def test_gpus_without_mig_and_gpus_not_run_as_mig_are_not_checked() -> None:
    backend, gpus = _node("1xV100-32GB,1xA100-40GB")
    cfg = validate_config(
        {"policy": {"profiles": "1g.5gb"}, "gpu": [{"match": "1", "mode": "mps"}]}
    )
    assert check_gpus(cfg, gpus, backend.geometry).errors == []


def test_a_demand_prior_name_needs_a_gpu_that_has_it() -> None:
    backend, gpus = _node("1xA100-40GB")
    cfg = validate_config({"policy": {"demand_prior": {"1g.20gb": 1.0, "1g.5gb": 1.0}}})
    found = check_gpus(cfg, gpus, backend.geometry)
    assert [e.message for e in found.errors] == [
        "policy.demand_prior: no MIG GPU on this node has profile '1g.20gb'"
    ]


# -- --set keys and where a value came from -------------------------------------------------


def test_an_unknown_set_key_names_the_nearest_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides={"polcy.queue": "fifo"}, environ={})
    assert err.value.where == "--set polcy.queue" and "defaults" not in err.value.message
    assert err.value.hint.startswith("did you mean policy.queue?")
    for key in ("policy.queu", "nosuch.key", "policy.queue.x"):
        with pytest.raises(ConfigError, match="no such setting"):
            load_config(None, overrides={key: 1}, environ={})


def test_each_origin_is_named_for_a_bad_value(tmp_path: Path) -> None:
    file = tmp_path / "migd.toml"
    file.write_text("version = 1\n[policy]\nqueue = 'lifo'\n")
    with pytest.raises(ConfigError) as err:
        load_config(file, environ={})
    assert err.value.where == f"{file}: policy.queue"
    with pytest.raises(ConfigError) as err:
        load_config(None, environ={"MIGD_POLICY_QUEUE": "lifo"})
    assert err.value.where == "MIGD_POLICY_QUEUE (policy.queue)"
    with pytest.raises(ConfigError) as err:
        load_config(file, overrides={"policy.queue": "lifo", "policy.aging_s": 1}, environ={})
    assert err.value.where == "--set policy.queue"
    # A whole section set on the command line is the origin of the keys inside it.
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides={"policy": {"queue": "lifo"}}, environ={})
    assert err.value.where == "--set policy"


def test_the_missing_file_hint_names_a_real_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "nope.toml", environ={})
    assert "migd.toml.example" not in err.value.hint
    assert f"migd --print-example-config > {tmp_path / 'nope.toml'}" in err.value.hint


# -- exit statuses ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ConfigError("bad", where="x"), 2),
        (AlreadyRunning("another migd"), 2),
        (DriverUnavailable("no NVML"), 5),
        (StateDiskError("disk full"), 1),
        (GpuBusy("busy"), 1),
        (MigdError("other"), 1),
        (OSError("other"), 1),
    ],
)
def test_exit_status_of_each_kind_of_start_error(error: BaseException, status: int) -> None:
    assert exit_codes.exit_status(error) == status


class NoDriver:
    """A GPU backend on a node whose NVIDIA driver is not loaded."""

    def discover(self) -> list[Any]:
        raise DriverUnavailable("initialise NVML failed: NVML_ERROR_DRIVER_NOT_LOADED")

    def close(self) -> None:
        pass


def _daemon_config(tmp_path: Path, **extra: Any) -> Any:
    return validate_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run")},
            "backend": {"kind": "simulated"},
            "api": {"socket": str(tmp_path / "run" / "migd.sock")},
            "metrics": {"listen": ""},
            **extra,
        }
    )


class Procs:
    def alive(self, pid: int, start_time: float | None = None) -> bool:
        return True

    def start_time(self, pid: int) -> float | None:
        return 1.0

    def uid(self, pid: int) -> int | None:
        return 0

    def parent(self, pid: int) -> int | None:
        return None


def test_a_node_without_a_driver_ends_with_exit_5_and_releases_its_lock(tmp_path: Path) -> None:
    config = _daemon_config(tmp_path)
    daemon = Daemon(config, NoDriver(), Procs(), accounts=SystemAccounts())  # type: ignore[arg-type]
    assert asyncio.run(daemon.run()) == exit_codes.NO_DRIVER
    lock_instance(config).release()  # the failed start let go of both directories


def test_a_configuration_error_met_after_loading_ends_with_exit_2(tmp_path: Path) -> None:
    backend, _ = simulated_backend("1xA100-40GB", time_scale=0.0)
    config = _daemon_config(tmp_path, policy={"demand_prior": {"1g.20gb": 1.0}})
    daemon = Daemon(config, backend, Procs(), accounts=SystemAccounts())
    assert asyncio.run(daemon.run()) == exit_codes.CONFIG


def test_a_set_key_is_named_as_set_even_where_a_flag_exists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from migd.daemon.main import main

    assert main(["--set", "daemon.log_level=loud", "--check-config"]) == exit_codes.CONFIG
    err = capsys.readouterr().err
    assert "--set daemon.log_level: Input should be" in err and "--log-level" not in err
    assert main(["--log-level", "debug", "--set", "backend.kind=gpu", "--check-config"]) == 2
    assert "--set backend.kind: Input should be" in capsys.readouterr().err


def test_at_start_a_gpu_match_without_a_gpu_is_a_warning() -> None:
    backend, gpus = _node("1xA100-40GB")
    cfg = validate_config({"gpu": [{"match": "3"}]})
    found = check_gpus(cfg, gpus, backend.geometry, unmatched_is_error=False)
    assert found.errors == []
    assert found.warnings == [
        f"gpu[0].match: '3' matches no GPU on this node (GPUs: 0 (A100-40GB, {gpus[0].uuid}))"
    ]
