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

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
# What cli.main turns into `error: ...` (exit 2): an API row must raise one of these.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, FloatingPointError, ConnectionError)


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

OUTPUT_CASES: list = []

# --------------------------------------------------------------------------------------------
# generate: the Python API and the CLI
# --------------------------------------------------------------------------------------------

import torch  # noqa: E402  (kept in this section: its rows build tensors)

_LOADED: dict = {}


def tidar_lm(env: Env):
    """The export, loaded once per module (read-only: rows only call generate on it)."""
    from tidar_convert.export import load

    if str(env.export) not in _LOADED:
        _LOADED[str(env.export)] = load(env.export)
    return _LOADED[str(env.export)]


def cli_generate(env: Env, *extra: str) -> list[str]:
    return ["generate", "--model", str(env.export), "--prompt", "def f(x):", "--max_new_tokens", "4", *extra]


def lm_generate(ids, **kw):
    """A Python row: the export's generate() on `ids`, with kw."""
    return api(lambda env: tidar_lm(env).generate(ids, **{"max_new_tokens": 4, **kw}))


def long_prompt(extra: int):
    """A prompt `extra` tokens past the model's positions (1024 in the tiny models)."""

    def call(env: Env):
        lm = tidar_lm(env)
        limit = lm.config.max_position_embeddings
        return lm.generate(torch.full((1, limit + extra), 5), max_new_tokens=4)

    return api(call)


PROMPT = torch.tensor([[5, 6, 7, 8]])

GENERATE_CASES: list = [
    pytest.param(lambda env: cli_generate(env, "--block_size", "0"), r"block_size=0: .*use 2 or more", id="cli-block-size-0"),
    pytest.param(lm_generate(PROMPT, block_size=0), r"block_size=0: .*use 2 or more", id="api-block-size-0"),
    pytest.param(long_prompt(3), r"prompt \(1027 tokens\).*1024 positions; shorten the prompt to at most 1020 tokens \(1023 with max_new_tokens=1\)", id="prompt-past-the-context"),
    pytest.param(lm_generate(PROMPT, attention_mask=torch.zeros_like(PROMPT)), r"attention_mask row 0 attends to no token.*pass 1 at each real prompt token", id="mask-all-zeros"),
    pytest.param(lm_generate([[5, 6, 7, 8]]), r"input_ids is a list: pass a LongTensor of shape \(batch, length\), e\.g\. torch\.tensor\(\[ids\]\)", id="ids-as-list"),
    pytest.param(lm_generate(torch.tensor([5, 6, 7, 8])), r"input_ids has shape \(4,\): pass shape \(batch, length\), e\.g\. ids\[None\]", id="ids-1d"),
    pytest.param(lm_generate(PROMPT, attention_mask=[[1, 1, 1, 1]]), r"attention_mask is a list: pass a LongTensor", id="mask-as-list"),
]

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
