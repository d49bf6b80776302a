"""The configuration's guards (issue 23, section 2): what a file must be to be read at
all, and what a reload may not take away without naming it."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from migd.daemon.config import ACCESS_KEYS, load_config, read_toml, removals, validate_config
from migd.errors import ConfigError


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no settings at all"),
        (b"\n  \n# only a comment\n", "no settings at all"),
        (
            b'version = 1\n[policy]\nqueue = "fi\xfffo"\n',
            "not UTF-8: byte 0xff at offset 32 (line 3)",
        ),
        (b"version = 1\n[policy\n", "not valid TOML"),
    ],
)
def test_a_file_that_is_not_a_configuration_is_refused(
    tmp_path: Path, content: bytes, message: str
) -> None:
    file = tmp_path / "migd.toml"
    file.write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        read_toml(file)
    assert message in refused.value.message and str(file) in refused.value.message
    with pytest.raises(ConfigError):
        load_config(file, environ={})


def test_version_alone_means_every_default_on_purpose(tmp_path: Path) -> None:
    file = tmp_path / "migd.toml"
    file.write_text("version = 1\n")
    assert load_config(file, environ={}) == validate_config({})


# The values a running configuration may have set, and others to move to.
VALUES: dict[str, list[Any]] = {
    "lease_users": [["batch"], ["root", "condor"], []],
    "lease_groups": [["batch"], ["condor"], []],
    "admin_users": [["alice"], ["root"]],
    "admin_groups": [["wheel"], []],
    "hook_users": [["condorhook"], ["condor"]],
    "status_public": [False, True],
    "socket_group": ["batch", None],
}


@pytest.mark.parametrize("key", ACCESS_KEYS)
def test_every_access_key_may_change_when_named_never_by_falling_back(key: str) -> None:
    assert set(VALUES) == set(ACCESS_KEYS)
    default = getattr(validate_config({}).api, key)
    for before, after in itertools.product(VALUES[key], repeat=2):
        old = validate_config({"api": {key: before}})
        named = validate_config({"api": {key: after}})
        assert not [r for r in removals(old, named) if key in r]  # an edit says what it means
        dropped = validate_config({"version": 1})  # the file lost its [api] table
        taken = [r for r in removals(old, dropped) if f"api.{key} " in r]
        if key == "status_public":  # only private -> public takes something (privacy)
            expected = before is False
        elif key == "socket_group":  # the defaults make the socket public: no one loses
            expected = False
        else:
            expected = bool(set(before) - set(default))
        assert bool(taken) == expected, (key, before)


def test_a_dropped_socket_group_counts_only_while_the_socket_stays_private() -> None:
    private = {"status_public": False, "socket_group": "batch"}
    old = validate_config({"api": private})
    kept_private = validate_config({"api": {"status_public": False}})
    assert removals(old, kept_private) == [
        "api.socket_group is no longer set, so it would fall back to its default "
        '(null instead of "batch")'
    ]
    made_public = validate_config({"api": {"status_public": True}})
    assert removals(old, made_public) == []


def test_leasing_for_no_one_and_losing_every_gpu_table_are_removals() -> None:
    old = validate_config({"gpu": [{"match": "0", "mode": "mps"}]})
    assert removals(old, old) == []
    nobody = validate_config(
        {"api": {"lease_users": [], "lease_groups": []}, "gpu": [{"match": "1"}]}
    )
    assert removals(old, nobody) == [
        "api.lease_users and api.lease_groups are both empty: no one could lease"
    ]
    assert removals(old, validate_config({})) == ["none of the 1 [[gpu]] table(s) is left"]
    assert removals(nobody, nobody) == []  # already so: nothing is taken
