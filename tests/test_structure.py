"""The package's shape, as docs/development.md promises it: short lines, no import cycle, and
shipped files that import only each other (an export decodes with nothing but transformers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "src" / "tidar_convert"
MAX_LINE = 100  # [tool.ruff] line-length


def modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, at any depth of its code (function-local imports count),
    leaving out `if TYPE_CHECKING:` blocks (types only, never run)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(block)
    }
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_source_line_is_over_100_characters():
    """ruff's line length (pyproject.toml), held here too so that a plain `make test` catches what
    `ruff check` in CI would: long strings, comments and docstrings are wrapped, not exempted."""
    roots = [PACKAGE, ROOT / "tests", ROOT / "bench"]
    long = [
        f"{path.relative_to(ROOT)}:{i} ({len(line)})"
        for root in roots
        for path in sorted(root.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert not long, f"{len(long)} lines over {MAX_LINE} characters: {long[:20]}"


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert (
        "tidar_convert.runtime.engine" in graph["tidar_convert.runtime.generate"]
    )  # the graph does see relative imports
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]  # and would see one


def test_the_runtime_imports_nothing_else_of_the_toolkit():
    """runtime/ is what an export ships: any import of another toolkit module there breaks every
    export, and an absolute import of its own siblings would look for tidar_convert in the user's
    environment. So its modules import only each other, and only relatively."""
    known = modules()
    runtime = {name for name in known if name.startswith("tidar_convert.runtime")}
    assert "tidar_convert.runtime.generate" in runtime
    for name in sorted(runtime):
        outside = imports(name, known[name], known) - runtime
        assert not outside, (
            f"{name} is shipped in exports but imports {outside}, which exports do not have"
        )
        absolute = [
            n.module
            for n in ast.walk(ast.parse(known[name].read_text()))
            if isinstance(n, ast.ImportFrom)
            and not n.level
            and (n.module or "").startswith("tidar_convert")
        ]
        absolute += [
            a.name
            for n in ast.walk(ast.parse(known[name].read_text()))
            if isinstance(n, ast.Import)
            for a in n.names
            if a.name.startswith("tidar_convert")
        ]
        assert not absolute, (
            f"{name} imports {absolute} absolutely: use a relative import, as an export has no "
            "tidar_convert"
        )


def test_an_export_ships_the_runtime_folder_whole():
    from tidar_convert.exports.folder import generated_code, shipped_code

    folder = PACKAGE / "runtime"
    assert set(shipped_code()) == {f.name for f in folder.glob("*.py")}
    assert all(path.parent == folder for path in shipped_code().values())
    assert not set(generated_code()) & set(
        shipped_code()
    )  # generated files never shadow shipped ones


DOCS = [Path(__file__).parents[1] / p for p in ("README.md", "CHANGELOG.md")] + sorted(
    (Path(__file__).parents[1] / "docs").glob("*.md")
)


# Cited like code in the docs, but fields of the bench's JSON record, not attributes.
RECORD_FIELDS = {"machine.packed_linears", "machine.linear_product", "machine.product_timings"}
FILE_SUFFIXES = {"png", "json", "jsonl", "yaml", "md", "log", "py", "c", "ckpt"}


def defines(module, attr: str) -> bool:
    """`attr` is a name of `module`, of one of its classes, or a parameter of one of their __init__s
    (a recipe's `data.greedy_docs` is a TiDARData argument)."""
    import inspect

    if hasattr(module, attr):
        return True
    for cls in vars(module).values():
        if inspect.isclass(cls) and cls.__module__ == module.__name__:
            if hasattr(cls, attr) or attr in inspect.signature(cls.__init__).parameters:
                return True
    return False


def test_docs_name_only_what_exists():
    """Every `module.name` the docs cite (the package's own modules) exists, and every relative
    link points at a file: docs drift when code is renamed, and this is where it shows.
    CHANGELOG.md names old names on purpose, so only its links are checked."""
    import importlib
    import re

    by_last = {}
    for name in modules():
        by_last.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (doc.parent / target).exists():
                missing.append(f"{doc.name}: link {target}")
        if doc.name == "CHANGELOG.md":
            continue
        for module, attr in set(re.findall(r"`([a-z_]+)\.([A-Za-z_]+)[`(\[]", text)):
            if (
                module not in by_last
                or attr in FILE_SUFFIXES
                or f"{module}.{attr}" in RECORD_FIELDS
            ):
                continue
            if not any(
                f"{m}.{attr}" in by_last.get(attr, ()) or defines(importlib.import_module(m), attr)
                for m in by_last[module]
            ):
                missing.append(f"{doc.name}: {module}.{attr}")
    assert not missing, missing


IMPORT_ALL = """
import importlib, inspect, pkgutil, sys
import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.continuous_batching import ContinuousMixin

def snapshot():
    classes = [GenerationMixin, PreTrainedModel, ContinuousMixin, transformers.AutoModelForCausalLM]
    return {f"{c.__name__}.{k}": v for c in classes for k, v in vars(c).items()}

before = snapshot()
import tidar_convert
names = [m.name for m in pkgutil.walk_packages(tidar_convert.__path__, "tidar_convert.")]
for name in names:
    importlib.import_module(name)
after = snapshot()
changed = sorted(k for k in before.keys() | after.keys() if before.get(k) is not after.get(k))
print(len(names), changed)
sys.exit(1 if changed or len(names) < 40 else 0)
"""


@pytest.mark.subprocess
def test_importing_the_toolkit_leaves_transformers_classes_unchanged():
    """No import-time patching: every toolkit module imported, in a fresh process, and transformers'
    generation classes hold the same attributes as before (patches happen only when an export is
    loaded: runtime/generate.py)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
