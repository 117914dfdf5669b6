"""What a new user tries that must end in one line naming the value or file and the fix.

One table for every probe case (issue 31): a row is a function that sets the case up and returns
either the CLI arguments to run (then `tidar-convert` must exit 2 with exactly one `error: ...`
line) or, wrapped in `api(...)`, a Python call that must raise one of the errors `cli.main` turns
into such a line. The next probe adds a row, not a file. Behaviour that is correct rather than
refused (a seed that reproduces, a checkpoint kept whole) is tested where that behaviour lives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tidar_convert.cli import main
from tidar_convert.outputs import DiskFull

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
# What cli.main turns into `error: ...` (exit 2): an API row must raise one of these.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, FloatingPointError, ConnectionError, DiskFull)


@dataclass
class Env:
    tmp: Path  # a fresh folder for this case
    model: Path  # a tiny llama base model folder, tokenizer included (read-only: copy it to change it)
    export: Path  # an export of that model (read-only: copy it to change it)


@dataclass
class api:
    """A row that calls Python instead of the CLI."""

    call: Callable[[Env], object]


def fit(env: Env, *extra: str) -> list[str]:
    """`fit` on the tiny recipe and model, run folder under env.tmp, no logger."""
    return ["fit", "--config", RECIPE, "--model.model", str(env.model), "--trainer.default_root_dir", str(env.tmp / "run"), "--trainer.logger", "false", *extra]


# --------------------------------------------------------------------------------------------
# fit: settings and data
# --------------------------------------------------------------------------------------------

FIT_CASES: list = []

# --------------------------------------------------------------------------------------------
# checkpoints, exports and other outputs
# --------------------------------------------------------------------------------------------

def copied_export(env: Env) -> Path:
    """A copy of env.export under env.tmp, to change."""
    import shutil

    return Path(shutil.copytree(env.export, env.tmp / "e"))


def export_over(env: Env, out: Path) -> list[str]:
    """`export --overwrite` into out; the checkpoint is never read (out is checked first)."""
    (env.tmp / "last.ckpt").write_bytes(b"not read: --out is refused before")
    return ["export", "--checkpoint", str(env.tmp / "last.ckpt"), "--out", str(out), "--overwrite"]


def edited_export(env: Env) -> list[str]:
    out = copied_export(env)
    (out / "README.md").write_text((out / "README.md").read_text() + "\nMy notes.\n")
    return export_over(env, out)


def export_listing_a_user_file(env: Env) -> list[str]:
    import json

    from tidar_convert.outputs import MARKER

    out = copied_export(env)
    (out / "notes.txt").write_text("mine")
    marker = json.loads((out / MARKER).read_text())
    marker["files"]["notes.txt"] = {"size": 4, "sha256": "0" * 64}
    (out / MARKER).write_text(json.dumps(marker))
    return export_over(env, out)


def export_with_old_marker(env: Env) -> list[str]:
    import json

    from tidar_convert.outputs import MARKER

    out = copied_export(env)
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "files": sorted(marker["files"])}))
    return export_over(env, out)


def export_onto_a_full_disk(env: Env):
    """export --overwrite where the weights do not fit: safetensors' own error, as it raises it on a full disk."""
    from unittest import mock

    from safetensors import SafetensorError

    from tidar_convert.export import export
    from tidar_convert.loading import load_base

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    model, tok = load_base(str(env.model))
    out = copied_export(env)
    with mock.patch("transformers.modeling_utils.safe_save_file", full):
        export(model, tok, out, block_size=4, alpha=1.0, overwrite=True)


def appended_corpus(env: Env) -> list[str]:
    import json

    from tidar_convert.distill import MADE_BY, record_corpus

    corpus = env.tmp / "greedy.jsonl"
    corpus.write_text(json.dumps({"text": "def f(): pass", "made_by": MADE_BY, "val_every": 50, "model": "m"}) + "\n")
    record_corpus(corpus)
    with corpus.open("a") as f:
        f.write(json.dumps({"text": "a row of mine", "made_by": MADE_BY, "val_every": 50, "model": "m"}) + "\n")
    return ["distill", "--model", str(env.model), "--out", str(corpus), "--overwrite"]


def validate(env: Env, *extra: str) -> list[str]:
    return ["validate", "--config", RECIPE, "--model.model", str(env.model), "--trainer.default_root_dir", str(env.tmp / "run"), "--trainer.logger", "false", *extra]


OUTPUT_CASES: list = [
    pytest.param(edited_export, r"holds an earlier export, but README\.md was changed after the export wrote it.*Nothing was written or deleted.*choose a new folder", id="export-overwrite-edited-card"),
    pytest.param(export_listing_a_user_file, r"but notes\.txt was changed after the export wrote it.*Nothing was written or deleted", id="export-overwrite-marker-lists-user-file"),
    pytest.param(export_with_old_marker, r"older tidar-convert, whose tidar_export\.json records no sizes or hashes.*delete it yourself, or choose a new folder", id="export-overwrite-old-marker"),
    pytest.param(api(export_onto_a_full_disk), r"^no space left in \S+ for the export e: it needs about [\d.]+ \w+ and the disk has [\d.]+ \w+ free \(e there is the earlier one, whole\)\. .*choose an --out on a disk with room", id="export-full-disk"),
    pytest.param(appended_corpus, r"--out '\S+greedy\.jsonl' was changed after `tidar-convert distill` wrote it.*nothing was written.*choose a new file name", id="distill-overwrite-appended-row"),
    pytest.param(lambda env: validate(env, "--ckpt_path", "last"), r"--ckpt_path last: no last checkpoint in \S+run/checkpoints\. Leave out --ckpt_path to validate the base model as it is, or pass a checkpoint file", id="validate-last-without-checkpoint"),
]

# --------------------------------------------------------------------------------------------
# generate: the Python API and the CLI
# --------------------------------------------------------------------------------------------

GENERATE_CASES: list = []

# --------------------------------------------------------------------------------------------

CASES = FIT_CASES + OUTPUT_CASES + GENERATE_CASES


@pytest.fixture(scope="module")
def probe_export(tiny_dirs, tmp_path_factory):
    from tidar_convert.export import export
    from tidar_convert.loading import load_base

    model, tok = load_base(str(tiny_dirs["llama"]))
    return export(model, tok, tmp_path_factory.mktemp("probe") / "tidar", block_size=4, alpha=1.0)


@pytest.mark.parametrize("run, pattern", CASES)
def test_probe_case_is_one_line_naming_value_and_fix(run, pattern, tiny_dirs, probe_export, tmp_path, capsys):
    env = Env(tmp=tmp_path, model=tiny_dirs["llama"], export=probe_export)
    if isinstance(run, api):
        with pytest.raises(USER_ERRORS) as info:
            run.call(env)
        message = str(info.value)
        assert "\n" not in message.strip(), message
    else:
        with pytest.raises(SystemExit) as exit_info:
            main(run(env))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        message = err.splitlines()[-1]
        assert message.startswith("error: ") and sum(line.startswith("error: ") for line in err.splitlines()) == 1, err
        assert "Traceback" not in err, err
    assert re.search(pattern, message), f"{message!r} does not match {pattern!r}"
