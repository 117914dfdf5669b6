"""The install's shape (pyproject.toml): a light core that loads and decodes an export, extras for
the rest, and a command whose extra is missing naming the one to install."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tidar_convert.cli import EXTRAS

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """Import names of the core dependencies, and of each extra's own packages (an extra's
    reference to another extra, tidar-convert[train], is not its own)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())["project"]

    def names(requirements):
        out = set()
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
            if name != project["name"]:
                out.add(name.lower().replace("-", "_"))
        return out

    extras = {k: names(v) for k, v in project["optional-dependencies"].items()}
    return names(project["dependencies"]), extras


def test_every_package_of_an_extra_maps_to_its_extra():
    """cli.EXTRAS (the fix a light install is told) is the extras' packages, each to its own
    extra; the core needs none of them."""
    core, extras = declared()
    packaged = {
        package: extra
        for extra, packages in extras.items()
        if extra not in ("dev", "all")
        for package in packages
        if package != "transformers"  # serve's transformers[serving]: its extras, not a package
    }
    assert packaged == EXTRAS
    assert not core & set(EXTRAS)


@pytest.mark.subprocess
def test_an_install_without_extras_decodes_an_export(tiny_dirs, tmp_path):
    """`tidar-convert generate` on an export with every extra's packages hidden (as `pip install
    tidar-convert` leaves them): it loads and decodes. A command of an extra names its extra."""
    from tidar_convert import export
    from tidar_convert.models.loading import load_base
    from tidar_convert.runtime.spec import TiDARSpec

    model, tokenizer = load_base(str(tiny_dirs["llama"]))
    out = export(model, tokenizer, tmp_path / "tidar", TiDARSpec(4))
    hidden = ",".join(EXTRAS)

    def run(*args):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "tidar_convert.bench.without",
                hidden,
                "tidar_convert.cli",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )

    decoded = run("generate", "--model", str(out), "--prompt", "a b", "--max_new_tokens", "6")
    assert decoded.returncode == 0, decoded.stderr[-3000:]
    assert "6 tokens" in decoded.stdout + decoded.stderr

    refused = run("distill", "--help")
    assert refused.returncode == 2
    assert "pip install 'tidar-convert[train]'" in refused.stderr, refused.stderr[-2000:]
