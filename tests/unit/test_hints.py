"""Every hint points at something real: the files, directories and commands that the
``hint=`` texts in ``migd/`` name exist (issue 24 s4: a hint named ``migd.toml.example``,
which never existed)."""

from __future__ import annotations

import argparse
import ast
import os
import re
from functools import cache
from pathlib import Path

import pytest

from migd.cli.migctl import build_parser as migctl_parser
from migd.daemon.main import build_parser as migd_parser

REPO = Path(__file__).resolve().parents[2]

#: Where the packages put what a hint may name by its bare name or absolute path
#: (packaging/build.sh, systemd/migd.service); the test below checks these too.
INSTALLED = {
    "migd.toml": "/etc/migd/migd.toml",
}
#: Directories the unit creates (RuntimeDirectory=, StateDirectory=): a hint may name
#: anything under them.
UNIT_DIRS = ("/run/migd", "/var/lib/migd")

REPO_PATH = re.compile(r"\b((?:docs|scripts|condor_config|contrib|systemd|bench)/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w/.-])([\w-]+(?:\.[\w-]+)+)")
FILE_TYPES = ("md", "toml", "config", "conf", "json", "service", "example")
ABSOLUTE = re.compile(r"(?<![\w.])(/(?:etc|run|var|usr|opt)/[\w./-]*\w)")
COMMAND = re.compile(r"`(migctl|migd) ([^`]*)`")


def _texts(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)]
    if isinstance(node, ast.BinOp):
        return _texts(node.left) + _texts(node.right)
    if isinstance(node, ast.IfExp):
        return _texts(node.body) + _texts(node.orelse)
    return []


@cache
def hints() -> list[tuple[str, str]]:
    """``(file, text)`` of every ``hint=...`` argument and ``default_hint`` in migd/."""
    found = []
    for file in sorted((REPO / "migd").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            is_hint = isinstance(node, ast.keyword) and node.arg == "hint"
            is_default = isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "default_hint" for t in node.targets
            )
            if is_hint or is_default:
                assert isinstance(node, ast.keyword | ast.Assign)
                found += [(file.name, t) for t in _texts(node.value)]
    return found


def test_there_are_hints_to_check() -> None:
    texts = [t for _, t in hints()]
    assert len(texts) > 100
    assert any("docs/operations.md" in t for t in texts)  # the patterns find what they should
    assert any("`migctl status`" in t for t in texts)


def test_every_repository_file_a_hint_names_exists() -> None:
    missing = [
        (where, path)
        for where, text in hints()
        for path in REPO_PATH.findall(text)
        if not (REPO / path).exists()
    ]
    assert missing == []


def _repo_file_names() -> set[str]:
    names: set[str] = set()
    for _top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        names.update(files)
    return names


def bare_files(text: str) -> list[str]:
    """``migd.toml``, ``migd.toml.example``, ``10-migd-execute.config`` in ``text``."""
    return [name for name in DOTTED.findall(text) if name.rsplit(".", 1)[1] in FILE_TYPES]


def test_bare_file_names_are_found() -> None:
    assert bare_files("create it from migd.toml.example") == ["migd.toml.example"]
    assert bare_files("see [api] of migd.toml, e.g. api.lease_users") == ["migd.toml"]


def test_every_file_a_hint_names_by_its_name_exists_or_is_installed() -> None:
    in_repo = _repo_file_names()
    missing = [
        (where, name)
        for where, text in hints()
        for name in bare_files(text)
        if name not in in_repo and name not in INSTALLED
    ]
    assert missing == []
    build = (REPO / "packaging" / "build.sh").read_text()
    for installed in INSTALLED.values():
        assert f'"$root{installed}"' in build, installed


def test_every_absolute_path_a_hint_names_is_installed_or_made_by_the_unit() -> None:
    unit = (REPO / "systemd" / "migd.service").read_text()
    assert "RuntimeDirectory=migd" in unit and "StateDirectory=migd" in unit
    wrong = [
        (where, path)
        for where, text in hints()
        for path in ABSOLUTE.findall(text)
        if path not in INSTALLED.values()
        and not any(path == d or path.startswith(d + "/") for d in UNIT_DIRS)
    ]
    assert wrong == []


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("program", ["migctl", "migd"])
def test_every_command_a_hint_names_exists(program: str) -> None:
    commands = [
        args.split()
        for _, text in hints()
        for name, args in COMMAND.findall(text)
        if name == program
    ]
    assert commands, f"no hint names a {program} command: the pattern is wrong"
    for words in commands:
        parser = migctl_parser() if program == "migctl" else migd_parser()
        if program == "migctl":
            subs = _subcommands(parser)
            assert words[0] in subs, words
            parser = subs[words[0]]
        for word in words[1:] if program == "migctl" else words:
            if word.startswith("--"):
                assert word in _flags(parser), (program, words)
