"""Recipes and flags as a person reads their errors: a YAML file checked before LightningCLI reads
it (a duplicate key or a tab names the file and line), and an argument error in one line with the
nearest valid key ("did you mean"), instead of 85 lines of usage."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningArgumentParser

from tidar_convert.train.resume import RENAMED


def config_files(args: list[str]) -> list[str]:
    """The files given to --config / -c on a command line."""
    files = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            files.append(args[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error says it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (first at line {first.line + 1}); "
                    "keep one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def check_recipe(path: str) -> None:
    """Refuse a recipe that is missing, not YAML, or has a key twice, naming the file and line."""
    file = Path(path).expanduser()
    if not file.is_file():
        what = "a folder" if file.is_dir() else "no such file"
        raise FileNotFoundError(f"--config {path!r}: {what}; pass a recipe file (see recipes/).")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"recipe '{path}' is not UTF-8 text (byte at offset {e.start}); save it as UTF-8."
        ) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(x) for x in (e.context, e.problem) if x)
        fix = "indent with spaces, not tabs" if "\t" in _line(text, mark) else "fix that line"
        raise ValueError(f"recipe '{path}'{where}: {problem}; {fix}.") from None
    if data is not None and not isinstance(data, dict):
        raise ValueError(
            f"recipe '{path}' holds a {type(data).__name__}, not a mapping of settings "
            "(model:, data:, trainer: ...); see recipes/tiny.yaml."
        )


def _line(text: str, mark) -> str:
    if mark is None:
        return ""
    lines = text.splitlines()
    return lines[mark.line] if mark.line < len(lines) else ""


class TiDARParser(LightningArgumentParser):
    """LightningCLI's parser, with one-line errors that suggest the key meant; no abbreviations
    (argparse would take --trainer.max_step for --trainer.max_steps without a word)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
        hint = suggestion(line, known_keys(parser))
        command = parser.prog.replace(" [options]", "").split()[-1]  # fit or validate
        if command == "tidar-convert":  # an error of the main parser, after the subcommand's
            command = next((a for a in sys.argv[1:] if a in ("fit", "validate")), "fit")
        if "are required: save_dir" in line:
            hint += " (a logger's `init_args: {save_dir: .}` writes into the run folder)"
        sys.stderr.write(
            f"error: {shorten(line)}{hint} (`tidar-convert {command} --help` lists every key)\n"
        )
        sys.exit(2)


def shorten(line: str, most: int = 600) -> str:
    """At most `most` characters, its end kept: jsonargparse says what is wrong last, after a list
    of the types a value could have been ("...: the following arguments are required: save_dir")."""
    if len(line) <= most:
        return line
    return f"{line[: most // 3]} ... {line[-(most - most // 3) :]}"


def known_keys(parser) -> list[str]:
    keys = []
    for action in parser._actions:
        keys += [s for s in action.option_strings if s.startswith("--")]
        for sub in getattr(action, "choices", None) or {}:
            child = action.choices[sub] if isinstance(action.choices, dict) else None
            if isinstance(child, LightningArgumentParser):
                keys += known_keys(child)
    return keys


# LightningCLI's optimizer and scheduler keys: TiDARModule's configure_optimizers builds both from
# its own settings, so these are refused with the keys that do the same.
INSTEAD = {
    "optimizer": "the optimizer is --model.optimizer (recipe: model: optimizer: with class_path "
    "and init_args, e.g. class_path: torch.optim.AdamW, init_args: {lr: 1e-5})",
    "lr_scheduler": "the schedule is linear warmup then cosine decay, set by --model.warmup_ratio "
    "and --model.min_lr_ratio",
}


def suggestion(message: str, keys: list[str]) -> str:
    """'; did you mean --model.draft_length?' for the first unknown name in an argparse or
    jsonargparse message that is close to a known one ('' where none is)."""
    for pattern in (
        r"unrecognized arguments: (--[\w.-]+)",
        r"accept option '([\w.-]+)'",
        r'Key "([\w.-]+)"',
    ):
        m = re.search(pattern, message)
        if m:
            name = "--" + m.group(1).lstrip("-")
            group, _, key = name.rpartition(".")
            top = name.removeprefix("--").split(".")[0]
            if top in INSTEAD:  # LightningCLI's own keys, which TiDARModule replaces
                return f"; {INSTEAD[top]}"
            if key in RENAMED:  # a recipe or a command written before the rename
                return f"; {name} is now {group}.{RENAMED[key]} (renamed 2026-12-06)"
            close = difflib.get_close_matches(name, keys, n=1, cutoff=0.75)
            return f"; did you mean {close[0]}?" if close else ""
    m = re.search(r"Option '(\w+)' is not accepted.*class_path='([\w.]+)'", message)
    if m:
        names = _init_args(m.group(2))
        close = difflib.get_close_matches(m.group(1), names, n=1, cutoff=0.6)
        if close:
            return f"; did you mean init_args.{close[0]} (an argument of {m.group(2)})?"
        if names:
            return f"; {m.group(2)} takes {', '.join(names)}"
    return ""


def _init_args(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "params")]
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
