"""An export's TiDAR code runs only with trust_remote_code=True; without it the folder is the
plain AR model.

A copy of the export whose custom_generate/generate.py writes a sentinel file when it is imported
proves the shipped code never ran. Each load is a fresh interpreter, so nothing imported or bound
by an earlier test can hide what transformers does. The acceptance test for trust_remote_code=True
(TiDAR output equals AR, drafts accepted, tidar_convert not importable) is in test_export.py; here
the True case is only the positive control for the sentinel.

Also the silent fallback: when custom_generate fails to load, transformers keeps its own generate
without a word. tidar_convert.exports.folder finds that (tidar_active / fallback_reason /
require_tidar), load() warns about it, and the bench refuses to time AR as TiDAR.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from helpers import cycle_batch
from transformers import AutoModelForCausalLM

from tidar_convert import export, load
from tidar_convert.bench import cli as bench
from tidar_convert.exports.folder import (
    TiDARFallbackWarning,
    custom_generate_problem,
    fallback_reason,
    require_tidar,
    tidar_active,
)
from tidar_convert.runtime.spec import TiDARSpec


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    model, tok = trained["qwen3"]
    return export(model, tok, tmp_path_factory.mktemp("sec") / "tidar", TiDARSpec(4))


@pytest.fixture
def spiked(exported, tmp_path):
    """A copy of the export whose custom_generate/generate.py writes `sentinel` when imported."""
    folder = tmp_path / "spiked"
    shutil.copytree(exported, folder)
    sentinel = tmp_path / "custom_generate_ran"
    gen = folder / "custom_generate" / "generate.py"
    gen.write_text(
        gen.read_text()
        + f"\nimport pathlib as _pathlib\n_pathlib.Path({str(sentinel)!r}).write_text('ran')\n"
    )
    return folder, sentinel


def load_in_subprocess(folder: Path, tmp_path: Path, trust: str) -> dict:
    """from_pretrained(folder[, trust_remote_code=...]) in a fresh interpreter; then generate,
    then generate(custom_generate=folder) with the same trust setting (the path PR #46483
    closed)."""
    kwarg = "" if trust == "omitted" else f", trust_remote_code={trust}"
    script = textwrap.dedent(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM, GenerationMixin
        m = AutoModelForCausalLM.from_pretrained({str(folder)!r}{kwarg})
        ids = torch.tensor({cycle_batch(1, 5, seed=2).tolist()})
        out = m.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
        fn = getattr(m.generate, "func", m.generate)
        res = {{"generate": fn.__module__ + "." + fn.__qualname__,
               "tidar_stats": hasattr(m, "tidar_stats"),
               "new_tokens": out.shape[1] - ids.shape[1],
               "class": type(m).__module__ + "." + type(m).__name__}}
        if {trust!r} != "True":
            try:
                m.generate(ids, max_new_tokens=2, custom_generate={str(folder)!r}{kwarg})
                res["custom_generate_call"] = "returned"
            # transformers >= 5.12 refuses; before, the folder's code ran (and raised or not)
            except Exception as e:
                res["custom_generate_call"] = type(e).__name__ + ": " + str(e)[:160]
        print("RESULT " + json.dumps(res))
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # after the [y/N] prompt transformers prints (stdin is empty)
    return json.loads(res.stdout.rsplit("RESULT ", 1)[-1])


@pytest.mark.subprocess
@pytest.mark.parametrize("trust", ["omitted", "False"])
def test_without_trust_remote_code_the_shipped_code_never_runs(spiked, tmp_path, trust):
    folder, sentinel = spiked
    out = load_in_subprocess(folder, tmp_path, trust)
    assert not sentinel.exists(), f"custom_generate/generate.py ran with trust_remote_code {trust}"
    assert out["class"] == "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM"
    assert out["generate"] == "transformers.generation.utils.GenerationMixin.generate"  # plain AR
    assert not out["tidar_stats"] and out["new_tokens"] == 8
    # generate(custom_generate=<local folder>) ran the folder's code without trust_remote_code
    # before transformers 5.12.0 (PR #46483); the lower bound in pyproject.toml is there for
    # this line.
    assert out["custom_generate_call"].startswith("ValueError: The repository"), out[
        "custom_generate_call"
    ]
    assert "contains custom generation code" in out["custom_generate_call"]


@pytest.mark.subprocess
def test_with_trust_remote_code_the_shipped_code_runs(spiked, tmp_path):
    """Positive control: the same spiked copy, opted in. Without it the absent sentinel proves
    nothing."""
    folder, sentinel = spiked
    out = load_in_subprocess(folder, tmp_path, "True")
    assert sentinel.read_text() == "ran"
    assert out["generate"].endswith("custom_generate.generate.generate") and out["tidar_stats"]


# --------------------------------------------------------------------------------------------
# The silent fallback, and how tidar_convert reports it.
# --------------------------------------------------------------------------------------------


def broken_copy(exported: Path, tmp_path: Path, how: str) -> Path:
    folder = tmp_path / f"broken-{how}"
    shutil.copytree(exported, folder)
    gen = folder / "custom_generate" / "generate.py"
    if how == "no_layout":  # e.g. copied by hand without the file beside it
        (folder / "custom_generate" / "layout.py").unlink()
    elif how == "missing_package":
        gen.write_text(
            gen.read_text().replace(
                "import torch\n", "import torch\nimport tidar_no_such_package\n", 1
            )
        )
    elif how == "syntax":
        gen.write_text(gen.read_text() + "\ndef broken(:\n")
    elif how == "no_generate":
        gen.write_text(gen.read_text().replace("\ndef generate(", "\ndef generate_renamed("))
    elif how == "requirements":
        (folder / "custom_generate" / "requirements.txt").write_text("tidar-no-such-package>=1\n")
    return folder


def test_transformers_falls_back_to_ar_silently_and_it_is_detected(exported, tmp_path, capfd):
    """The failure transformers swallows: a file custom_generate/generate.py imports is missing. It
    loads with trust_remote_code=True, no error, no warning, and generate is AR; tidar_convert
    says why."""
    folder = broken_copy(exported, tmp_path, "no_layout")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    said = capfd.readouterr()
    assert "custom_generate" not in said.out + said.err and not caught, (
        "transformers reported the failure after all"
    )
    ids = cycle_batch(1, 5, seed=1)
    m.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert not hasattr(m, "tidar_stats")  # it ran transformers' AR generate
    assert not tidar_active(m)
    reason = fallback_reason(m)
    assert "custom_generate/layout.py is missing" in reason and str(folder) in reason
    with pytest.raises(
        RuntimeError,
        match=r"TiDAR decoding not active: transformers fell back to AR \(.*layout\.py is missing",
    ):
        require_tidar(m)


def test_tidar_active_on_every_binding(exported):
    assert tidar_active(load(exported))
    remote = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    assert tidar_active(remote) and fallback_reason(remote) is None
    plain = AutoModelForCausalLM.from_pretrained(exported)
    assert not tidar_active(plain)
    assert "loaded without trust_remote_code=True" in fallback_reason(plain)
    # a TiDAR generate bound to another model is not this model's TiDAR decoding
    plain.generate = remote.generate
    assert not tidar_active(plain)


@pytest.mark.parametrize(
    "how, message",
    [
        (
            "no_layout",
            "custom_generate/layout.py is missing (imported by custom_generate/generate.py)",
        ),
        ("missing_package", "generate.py imports tidar_no_such_package, not installed here"),
        ("syntax", "generate.py does not parse: SyntaxError"),
        ("no_generate", "generate.py defines no `generate` function"),
        ("requirements", "requirements.txt is not met"),
    ],
)
def test_load_warns_when_the_exports_own_code_would_not_load(exported, tmp_path, how, message):
    """load() itself works (it binds the package's decode) but names the file and the error, without
    running it."""
    folder = broken_copy(exported, tmp_path, how)
    assert message in custom_generate_problem(folder)
    with pytest.warns(TiDARFallbackWarning, match="silently decodes with plain AR") as record:
        m = load(folder)
    assert str(folder / "custom_generate") in str(record[0].message) and message in str(
        record[0].message
    )
    assert tidar_active(m)
    m.generate(cycle_batch(1, 5, seed=1), max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert "accepted" in m.tidar_stats


def test_load_is_quiet_on_a_good_export(exported, recwarn):
    assert custom_generate_problem(exported) is None
    load(exported)
    assert not [w for w in recwarn if issubclass(w.category, TiDARFallbackWarning)]


def test_bench_refuses_to_time_ar_as_tidar(exported, tmp_path, monkeypatch):
    """If the model the bench gets decodes with transformers' AR, it stops with the reason, writing
    nothing."""
    # the package's `export` attribute is the function
    export_mod = importlib.import_module("tidar_convert.exports.folder")

    folder = broken_copy(exported, tmp_path, "no_layout")
    monkeypatch.setattr(
        export_mod,
        "load",
        lambda path, **kw: AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw),
    )
    with pytest.raises(
        RuntimeError,
        match=r"TiDAR decoding not active: transformers fell back to AR \(.*layout\.py is missing",
    ):
        bench.bench_cmd(str(folder), max_new_tokens=4, limit=1, out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_transformers_lower_bound_has_both_fixes():
    """transformers 5.12.0 is the first release with the fixes for CVE-2026-4372 (5.3.0) and
    PR #46483 (5.12.0); pyproject.toml must not admit anything older, and what is installed must
    satisfy it."""
    import re

    import transformers
    from packaging.version import Version

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    (bound,) = re.findall(r'"transformers>=([0-9.]+),<6"', pyproject)
    assert Version(bound) >= Version("5.12.0")
    assert Version(transformers.__version__) >= Version(bound)
