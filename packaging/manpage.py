"""Write a man page (roff, section 1 or 8) from one of migd's argparse parsers.

    python3 packaging/manpage.py migd|migctl|migd-run > NAME.SECTION

packaging/build.sh runs it at build time with the tree being packaged on sys.path, so each
page lists exactly the flags the packaged command accepts; the prose that does not live in
argparse (files, see also) is in PAGES below.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# command -> (module:function returning the parser, section, files, see also)
PAGES: dict[str, tuple[str, str, list[tuple[str, str]], str]] = {
    "migd": (
        "migd.daemon.main:build_parser",
        "8",
        [
            ("/etc/migd/migd.toml", "the configuration (defaults: migd --print-example-config)"),
            ("/var/lib/migd", "leases, instance records and history (SQLite)"),
            ("/run/migd/migd.sock", "the API socket that migd-wrapper, migd-run and migctl use"),
        ],
        "migctl(1), migd-run(1), systemctl(1); /usr/share/doc/migd/",
    ),
    "migctl": (
        "migd.cli.migctl:build_parser",
        "1",
        [("/run/migd/migd.sock", "migd's API socket (--socket, or $MIGD_API_SOCKET)")],
        "migd(8), migd-run(1); /usr/share/doc/migd/api.md",
    ),
    "migd-run": (
        "migd.wrapper.main:build_run_parser",
        "1",
        [("/run/migd/migd.sock", "migd's API socket (--socket, or $MIGD_API_SOCKET)")],
        "migd(8), migctl(1); /usr/share/doc/migd/wrapper.md",
    ),
}


def _roff(text: str) -> str:
    """Escape text for roff: backslashes, hyphens (a plain '-' may be typeset as a dash) and a
    leading control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def _options(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            flags = ", ".join(action.option_strings)
            if action.nargs != 0:
                flags += " " + (action.metavar or action.dest.upper())
        else:
            flags = action.metavar or action.dest
        out += [".TP", f"\\fB{_roff(str(flags))}\\fR"]
        notes = [(action.help or "").replace("%(default)s", str(action.default))]
        if action.choices and not isinstance(action.choices, dict):
            notes.append(f"one of: {', '.join(map(str, action.choices))}")
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            notes.append(f"default: {action.default}")
        out.append(_roff("; ".join(n for n in notes if n) or "."))
    return out


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {c.dest: c.help or "" for c in action._choices_actions}
        for name, sub in action.choices.items():
            usage = sub.format_usage().removeprefix("usage: ").strip()
            out += [".TP", f"\\fB{_roff(usage)}\\fR", _roff(helps.get(name, "") or ".")]
    return out


def render(command: str) -> str:
    target, section, files, see_also = PAGES[command]
    module, func = target.split(":")
    parser: argparse.ArgumentParser = getattr(importlib.import_module(module), func)()
    from migd import __version__

    lines = [
        f'.TH {_roff(command.upper())} {section} "" "migd {__version__}" "migd"',
        ".SH NAME",
        f"{_roff(command)} \\- {_roff(parser.description or command)}",
        ".SH SYNOPSIS",
        _roff(parser.format_usage().removeprefix("usage: ").strip()),
        ".SH OPTIONS",
        *_options(parser),
    ]
    subs = _subcommands(parser)
    if subs:
        lines += [".SH COMMANDS", *subs]
    lines.append(".SH FILES")
    for path, what in files:
        lines += [".TP", f"\\fI{_roff(path)}\\fR", _roff(what)]
    lines += [".SH SEE ALSO", _roff(see_also)]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in PAGES:
        print(f"usage: {sys.argv[0]} {'|'.join(PAGES)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.stdout.write(render(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
