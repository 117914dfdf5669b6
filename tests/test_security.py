"""An export's TiDAR code runs only with trust_remote_code=True; without it the folder is the plain AR model.

A copy of the export whose custom_generate/generate.py writes a sentinel file when it is imported
proves the shipped code never ran. Each load is a fresh interpreter, so nothing imported or bound
by an earlier test can hide what transformers does. The acceptance test for trust_remote_code=True
(TiDAR output equals AR, drafts accepted, tidar_convert not importable) is in test_export.py; here
the True case is only the positive control for the sentinel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tidar_convert import export

from conftest import cycle_batch


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    model, tok = trained["qwen3"]
    return export(model, tok, tmp_path_factory.mktemp("sec") / "tidar", block_size=4, alpha=1.0)


@pytest.fixture
def spiked(exported, tmp_path):
    """A copy of the export whose custom_generate/generate.py writes `sentinel` when imported."""
    folder = tmp_path / "spiked"
    shutil.copytree(exported, folder)
    sentinel = tmp_path / "custom_generate_ran"
    gen = folder / "custom_generate" / "generate.py"
    gen.write_text(gen.read_text() + f"\nimport pathlib as _pathlib\n_pathlib.Path({str(sentinel)!r}).write_text('ran')\n")
    return folder, sentinel


def load_in_subprocess(folder: Path, tmp_path: Path, trust: str) -> dict:
    """from_pretrained(folder[, trust_remote_code=...]) in a fresh interpreter; then generate,
    then generate(custom_generate=folder) with the same trust setting (the path PR #46483 closed)."""
    kwarg = "" if trust == "omitted" else f", trust_remote_code={trust}"
    script = textwrap.dedent(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM, GenerationMixin
        m = AutoModelForCausalLM.from_pretrained({str(folder)!r}{kwarg})
        ids = torch.tensor({cycle_batch(1, 5, seed=2).tolist()})
        out = m.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
        fn = getattr(m.generate, "func", m.generate)
        res = {{"generate": fn.__module__ + "." + fn.__qualname__, "tidar_stats": hasattr(m, "tidar_stats"),
               "new_tokens": out.shape[1] - ids.shape[1], "class": type(m).__module__ + "." + type(m).__name__}}
        if {trust!r} != "True":
            try:
                m.generate(ids, max_new_tokens=2, custom_generate={str(folder)!r}{kwarg})
                res["custom_generate_call"] = "returned"
            except Exception as e:  # transformers >= 5.12 refuses; before, the folder's code ran (and raised or not)
                res["custom_generate_call"] = type(e).__name__ + ": " + str(e)[:160]
        print("RESULT " + json.dumps(res))
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.rsplit("RESULT ", 1)[-1])  # after the [y/N] prompt transformers prints (stdin is empty)


@pytest.mark.parametrize("trust", ["omitted", "False"])
def test_without_trust_remote_code_the_shipped_code_never_runs(spiked, tmp_path, trust):
    folder, sentinel = spiked
    out = load_in_subprocess(folder, tmp_path, trust)
    assert not sentinel.exists(), f"custom_generate/generate.py ran with trust_remote_code {trust}"
    assert out["class"] == "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM"
    assert out["generate"] == "transformers.generation.utils.GenerationMixin.generate"  # plain AR
    assert not out["tidar_stats"] and out["new_tokens"] == 8
    # generate(custom_generate=<local folder>) ran the folder's code without trust_remote_code before
    # transformers 5.12.0 (PR #46483); the lower bound in pyproject.toml is there for this line.
    assert out["custom_generate_call"].startswith("ValueError: The repository"), out["custom_generate_call"]
    assert "contains custom generation code" in out["custom_generate_call"]


def test_with_trust_remote_code_the_shipped_code_runs(spiked, tmp_path):
    """Positive control: the same spiked copy, opted in. Without it the absent sentinel proves nothing."""
    folder, sentinel = spiked
    out = load_in_subprocess(folder, tmp_path, "True")
    assert sentinel.read_text() == "ran"
    assert out["generate"].endswith("custom_generate.generate.generate") and out["tidar_stats"]


def test_transformers_lower_bound_has_both_fixes():
    """transformers 5.12.0 is the first release with the fixes for CVE-2026-4372 (5.3.0) and PR #46483
    (5.12.0); pyproject.toml must not admit anything older, and what is installed must satisfy it."""
    import re

    import transformers
    from packaging.version import Version

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    (bound,) = re.findall(r'"transformers>=([0-9.]+),<6"', pyproject)
    assert Version(bound) >= Version("5.12.0")
    assert Version(transformers.__version__) >= Version(bound)
