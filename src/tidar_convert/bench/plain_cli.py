"""A command's flags from its typed signature with argparse alone, for an entry that must run where
jsonargparse is not installed: `python -m tidar_convert.bench.gpu` on a GPU lease's image. The
same function is a `tidar-convert` command through jsonargparse's auto_cli, so its signature and
the "Args:" section of its docstring describe its flags in both places.

The types taken are those such a command uses: bool (`--flag`, or `--flag true|false`), int, float,
str, and each of them or None (`X | None`). Flags are spelt as `tidar-convert` accepts them:
`--dry-run` or `--dry_run`.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import typing

SCALARS = (bool, int, float, str)


def as_bool(text: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean: use true or false")


def scalar_type(hint) -> type:
    """int of `int` and of `int | None`; a TypeError for a type the plain parser does not take."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if len(args) == 1 else hint
    if kind not in SCALARS:
        raise TypeError(f"{hint} is not one of the types a plain command line takes: {SCALARS}")
    return kind


def arg_help(function) -> dict[str, str]:
    """Each parameter's text in the "Args:" section of the function's docstring, on one line."""
    doc = inspect.getdoc(function) or ""
    section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    section = re.split(r"\n\s*\n", section, maxsplit=1)[0]
    found = re.findall(r"^ {4}(\w+): (.*(?:\n {8}.*)*)", section, re.M)
    return {name: " ".join(text.split()) for name, text in found}


def parser_for(function, prog: str) -> argparse.ArgumentParser:
    summary = (inspect.getdoc(function) or "").split("\n\n", 1)[0]
    parser = argparse.ArgumentParser(prog=prog, description=summary)
    hints, texts = typing.get_type_hints(function), arg_help(function)
    for name, param in inspect.signature(function).parameters.items():
        kind = scalar_type(hints[name])
        flags = dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name}"])
        options = {"dest": name, "help": texts.get(name)}
        if param.default is inspect.Parameter.empty:
            options["required"] = True
        else:
            options["default"] = param.default
        if kind is bool:
            options.update(nargs="?", const=True, type=as_bool, metavar="true|false")
        else:
            options["type"] = kind
        parser.add_argument(*flags, **options)
    return parser


def run(function, prog: str, argv: list[str] | None = None):
    """Parse argv (default: sys.argv[1:]) into the function's parameters and call it. A ValueError
    or FileNotFoundError (bad input: its message says the fix) exits with status 2, as
    `tidar-convert` does."""
    parser = parser_for(function, prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return function(**vars(args))
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
