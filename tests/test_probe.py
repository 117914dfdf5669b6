"""What a new user tries that must end in one line naming the value or file and the fix.

One table for every probe case (issue 31): a row is a function that sets the case up and returns
either the CLI arguments to run (then `tidar-convert` must exit 2 with exactly one `error: ...`
line) or, wrapped in `api(...)`, a Python call that must raise one of the errors `cli.main` turns
into such a line. The next probe adds a row, not a file. Behaviour that is correct rather than
refused (a seed that reproduces, a checkpoint kept whole) is tested where that behaviour lives.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from tidar_convert.cli import main
from tidar_convert.exports.disk import DiskFull
from tidar_convert.runtime.spec import TiDARSpec
from tidar_convert.train.module import TiDARModule

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
# What cli.main turns into `error: ...` (exit 2): an API row must raise one of these.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    PermissionError,
    FloatingPointError,
    ConnectionError,
    DiskFull,
)


@dataclass
class Env:
    tmp: Path  # a fresh folder for this case
    model: (
        Path  # a tiny llama base model folder, tokenizer included (read-only: copy it to change it)
    )
    export: Path  # an export of that model (read-only: copy it to change it)


@dataclass
class api:
    """A row that calls Python instead of the CLI."""

    call: Callable[[Env], object]


def fit(env: Env, *extra: str) -> list[str]:
    """`fit` on the tiny recipe and model, run folder under env.tmp, no logger."""
    return [
        "fit",
        "--config",
        RECIPE,
        "--model.model",
        str(env.model),
        "--trainer.default_root_dir",
        str(env.tmp / "run"),
        "--trainer.logger",
        "false",
        *extra,
    ]


# --------------------------------------------------------------------------------------------
# fit: settings and data
# --------------------------------------------------------------------------------------------


def rows_file(env: Env, rows: list, name: str = "rows.jsonl") -> Path:
    path = env.tmp / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def code(i: int) -> str:
    return f"def function_{i}(x):\n    return x * {i}\n" * 8


def corpus(env: Env, model: str, rows: int = 3) -> Path:
    """A greedy corpus as `distill` writes its rows, split with tiny.yaml's val_every (20)."""
    return rows_file(
        env,
        [
            {"text": code(i), "made_by": "tidar-convert distill", "val_every": 20, "model": model}
            for i in range(rows)
        ],
        "greedy.jsonl",
    )


def model_copy(env: Env, drop: tuple[str, ...] = (), **config) -> Path:
    """A copy of the tiny base model with files left out and config.json fields changed."""
    out = env.tmp / "model"
    shutil.copytree(env.model, out, ignore=shutil.ignore_patterns(*drop))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config}))
    return out


def export_copy(env: Env, drop: tuple[str, ...] = ()) -> Path:
    out = env.tmp / "export"
    shutil.copytree(env.export, out, ignore=shutil.ignore_patterns(*drop))
    return out


_FULL_FT: dict = {}


def full_ft_checkpoint(env: Env) -> Path:
    """last.ckpt of a one-step full fine-tune (lora_r 0) of the tiny model, made once per
    session."""
    if env.model not in _FULL_FT:
        run = env.tmp / "full-ft"
        main(
            fit(
                env,
                "--trainer.max_steps",
                "1",
                "--trainer.default_root_dir",
                str(run),
                "--trainer.num_sanity_val_steps",
                "0",
            )
        )
        _FULL_FT[env.model] = run / "checkpoints" / "last.ckpt"
    return _FULL_FT[env.model]


def relative_model_checkpoint(env: Env) -> Path:
    """The full fine-tune's checkpoint as an older version wrote it: the base model path as given,
    relative."""
    saved = torch.load(full_ft_checkpoint(env), weights_only=False)
    saved["hyper_parameters"]["model"] = "./tiny-moved-away"
    torch.save(saved, env.tmp / "old.ckpt")
    return env.tmp / "old.ckpt"


def lora_module_resuming_full_ft(env: Env):
    module = TiDARModule(model=str(env.model), lora_r=8)
    # the same adapters: resumed
    module.on_load_checkpoint({"hyper_parameters": {"lora_r": 8, "lora_scope": "all"}})
    module.on_load_checkpoint({"hyper_parameters": {"lora_r": 0}})


def export_full_ft(env: Env, **kw):
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    model, tok = load_base(str(env.model))
    export(model, tok, env.tmp / "out", TiDARSpec(4), **kw)


NO_GPU = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the refusal is of a GPU this machine lacks"
)
TEXT_AND_CONTENT = [{"text": code(i), "content": f"other {i}"} for i in range(12)]
HOLES = [
    {"id": i, **({} if i % 4 == 1 else {"text": None} if i % 4 == 2 else {"text": code(i)})}
    for i in range(12)
]

FIT_CASES: list = [
    # a greedy corpus is read and checked whenever it is given
    pytest.param(
        lambda env: fit(env, "--data.greedy_corpus", str(env.tmp / "nosuch.jsonl")),
        r"--data.greedy_corpus '.*nosuch.jsonl' does not exist; "
        r"make one with `tidar-convert distill",
        id="greedy-corpus-missing",
    ),
    pytest.param(
        lambda env: fit(env, "--data.greedy_corpus", str(corpus(env, str(env.model)))),
        r"with --data.greedy_docs 0: none of its 3 documents "
        r"would be trained on; set --data.greedy_docs",
        id="greedy-corpus-unused",
    ),
    pytest.param(
        lambda env: fit(
            env,
            "--data.greedy_corpus",
            str(corpus(env, "/elsewhere/other-model")),
            "--data.greedy_docs",
            "2",
        ),
        r"holds the greedy text of the base model '/elsewhere/other-model', "
        r"and this run trains '.*'.*pass --model.model /elsewhere/other-model, "
        r"or make one with `tidar-convert distill --model ",
        id="greedy-corpus-other-model",
    ),
    # the text field: as given, and every row has it
    pytest.param(
        lambda env: fit(
            env,
            "--data.source",
            str(rows_file(env, TEXT_AND_CONTENT)),
            "--data.text_field",
            "contnet",
        ),
        r"has no field 'contnet' holding the text in any of its 12 rows \(its "
        r"rows have: text, content\); set the one that does: --data.text_field text",
        id="text-field-misspelt",
    ),
    pytest.param(
        lambda env: fit(
            env, "--data.source", str(rows_file(env, TEXT_AND_CONTENT)), "--data.text_field", ""
        ),
        r"text_field='': name the field .* e.g. --data.text_field text",
        id="text-field-empty",
    ),
    pytest.param(
        lambda env: fit(env, "--data.source", str(rows_file(env, HOLES))),
        r"6 of its 12 rows have no text in field 'text' \(the first, row 2, has "
        r"null or no such field; its rows have: id, text\); give each row its text",
        id="rows-without-text",
    ),
    pytest.param(
        lambda env: fit(env, "--data.source", str(rows_file(env, [{"text": 12345}]))),
        r"1 of its 1 rows have no text in field 'text' "
        r"\(the first, row 1, has 12345 \(int\), not a string",
        id="row-text-not-a-string",
    ),
    pytest.param(
        lambda env: fit(env, "--data.source", str(rows_file(env, []))),
        r"data file '.*rows.jsonl' is empty: there are no rows to read",
        id="empty-jsonl-fit",
    ),
    pytest.param(
        lambda env: ["eval-ppl", "--model", str(env.model), "--data", str(rows_file(env, []))],
        r"data file '.*rows.jsonl' is empty",
        id="empty-jsonl-eval-ppl",
    ),
    # model settings
    pytest.param(
        lambda env: fit(env, "--model.lora_r", "-1"),
        r"--model.lora_r=-1: must be a whole number >= 0 \(0 = full fine-tune",
        id="lora-r-negative",
    ),
    pytest.param(
        lambda env: fit(
            env,
            "--model.model",
            str(model_copy(env, max_position_embeddings=256)),
            "--data.seq_len",
            "300",
        ),
        r"--data.seq_len 300 is longer than the base model's "
        r"256 positions .*; pass --data.seq_len 256 or less",
        id="seq-len-past-positions-fit",
    ),
    pytest.param(
        lambda env: [
            "eval-ppl",
            "--model",
            str(model_copy(env, max_position_embeddings=256)),
            "--data",
            "stdlib",
            "--seq_len",
            "1000",
        ],
        r"seq_len=1000 is longer than the model's 256 positions .*; pass --seq_len 256 or less",
        id="seq-len-past-positions-eval-ppl",
    ),
    pytest.param(
        lambda env: fit(env, "--trainer.accelerator", "gpu"),
        r"--trainer.accelerator gpu: no CUDA GPU is visible "
        r"on this machine.*pass --trainer.accelerator cpu",
        id="accelerator-gpu-on-cpu",
        marks=NO_GPU,
    ),
    pytest.param(
        lambda env: fit(env, "--model.lora_r", "8", "--ckpt_path", str(full_ft_checkpoint(env))),
        r"--ckpt_path .*last.ckpt \(.*\) was trained with other settings than this run "
        r"asks for: --model.lora_r 8 \(trained with 0\)\. A resumed run keeps the settings",
        id="resume-full-ft-with-lora",
    ),
    pytest.param(
        api(
            lambda env: TiDARModule(
                model=str(env.model), lora_r=16, lora_scope="masks"
            ).on_load_checkpoint({"hyper_parameters": {"lora_r": 8, "lora_scope": "all"}})
        ),
        r"trained with lora_r=8, lora_scope='all' and this run has lora_r=16, lora_scope='masks': "
        r"its weights do not fit; resume with --model.lora_r 8 --model.lora_scope all",
        id="resume-last-other-adapters",
    ),
    pytest.param(
        api(lora_module_resuming_full_ft),
        r"checkpoint was trained with lora_r=0 \(a full fine-tune\) and this run has "
        r"lora_r=8, lora_scope='all': its weights do not fit; resume with --model.lora_r 0",
        id="resume-last-full-ft-with-lora",
    ),
    # model folders
    pytest.param(
        lambda env: fit(env, "--model.model", str(model_copy(env, drop=("tokenizer*",)))),
        r"model folder '.*model' has no tokenizer that loads \(it "
        r"holds none of tokenizer.json.*\); save the tokenizer",
        id="model-without-tokenizer",
    ),
    pytest.param(
        lambda env: fit(env, "--model.model", str(model_copy(env, hidden_size=96))),
        r"the weights of '.*model' do not fit its config.json \(.* is \[\d+, 64\] in "
        r"model.safetensors, and config.json makes it \[\d+, 96\]\); restore the config.json",
        id="config-hidden-size-wrong",
    ),
    pytest.param(
        lambda env: fit(env, "--model.model", str(model_copy(env, num_attention_heads=5))),
        r"config.json' is not a config transformers accepts \(The hidden size "
        r"\(64\) is not a multiple of the number of attention heads \(5\).\); restore",
        id="config-heads-do-not-divide",
    ),
    # export, and loading what it wrote
    pytest.param(
        lambda env: [
            "export",
            "--checkpoint",
            str(env.model / "model.safetensors"),
            "--out",
            str(env.tmp / "out"),
        ],
        r"is a safetensors weights file, not a Lightning "
        r"checkpoint.*e.g. runs/.../checkpoints/last.ckpt",
        id="export-a-safetensors-file",
    ),
    pytest.param(
        lambda env: [
            "export",
            "--checkpoint",
            str(full_ft_checkpoint(env)),
            "--out",
            str(env.tmp / "out"),
            "--adapter_energy",
            "0.5",
        ],
        r"adapter_energy=0.5: checkpoint '.*last.ckpt' \(lora_r=0, lora_scope='all'\) "
        r"has no mask-slot adapter to compress.*leave out --adapter_energy",
        id="export-adapter-energy-full-ft",
    ),
    pytest.param(
        lambda env: [
            "export",
            "--checkpoint",
            str(full_ft_checkpoint(env)),
            "--out",
            str(env.tmp / "out"),
            "--adapter_layers",
            "0.5",
        ],
        r"adapter_layers=0.5: checkpoint .* has no mask-slot adapter",
        id="export-adapter-layers-full-ft",
    ),
    pytest.param(
        lambda env: [
            "export",
            "--checkpoint",
            str(relative_model_checkpoint(env)),
            "--out",
            str(env.tmp / "out"),
        ],
        r"checkpoint '.*old.ckpt' was trained from the base model './tiny-moved-away', "
        r"which is not there from here \(.*\); pass --model with that base model's folder",
        id="export-relative-model-path",
    ),
    pytest.param(
        api(lambda env: export_full_ft(env, adapter_energy=0.9)),
        r"adapter_energy=0.9: this model has no mask-slot adapter to compress",
        id="export-api-adapter-energy-no-adapter",
    ),
    pytest.param(
        lambda env: [
            "generate",
            "--model",
            str(export_copy(env, drop=("model.safetensors",))),
            "--prompt",
            "x",
        ],
        r"'.*export' has a config.json but no weights \(no "
        r"model.safetensors or pytorch_model.bin\); export it again",
        id="export-without-weights-generate",
    ),
    pytest.param(
        lambda env: [
            "eval-ppl",
            "--model",
            str(export_copy(env, drop=("model.safetensors",))),
            "--data",
            "stdlib",
        ],
        r"'.*export' has a config.json but no weights",
        id="export-without-weights-eval-ppl",
    ),
]

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

    from tidar_convert.exports.marker import MARKER

    out = copied_export(env)
    (out / "notes.txt").write_text("mine")
    marker = json.loads((out / MARKER).read_text())
    marker["files"]["notes.txt"] = {"size": 4, "sha256": "0" * 64}
    (out / MARKER).write_text(json.dumps(marker))
    return export_over(env, out)


def export_with_old_marker(env: Env) -> list[str]:
    import json

    from tidar_convert.exports.marker import MARKER

    out = copied_export(env)
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "files": sorted(marker["files"])}))
    return export_over(env, out)


def export_onto_a_full_disk(env: Env):
    """export --overwrite where the weights do not fit: safetensors' own error, as it raises it on a
    full disk."""
    from unittest import mock

    from safetensors import SafetensorError

    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    model, tok = load_base(str(env.model))
    out = copied_export(env)
    with mock.patch("transformers.modeling_utils.safe_save_file", full):
        export(model, tok, out, TiDARSpec(4), overwrite=True)


def appended_corpus(env: Env) -> list[str]:
    import json

    from tidar_convert.train.distill import MADE_BY, record_corpus

    corpus = env.tmp / "greedy.jsonl"
    corpus.write_text(
        json.dumps({"text": "def f(): pass", "made_by": MADE_BY, "val_every": 50, "model": "m"})
        + "\n"
    )
    record_corpus(corpus)
    with corpus.open("a") as f:
        f.write(
            json.dumps({"text": "a row of mine", "made_by": MADE_BY, "val_every": 50, "model": "m"})
            + "\n"
        )
    return ["distill", "--model", str(env.model), "--out", str(corpus), "--overwrite"]


def validate(env: Env, *extra: str) -> list[str]:
    return [
        "validate",
        "--config",
        RECIPE,
        "--model.model",
        str(env.model),
        "--trainer.default_root_dir",
        str(env.tmp / "run"),
        "--trainer.logger",
        "false",
        *extra,
    ]


OUTPUT_CASES: list = [
    pytest.param(
        edited_export,
        r"holds an earlier export, but README\.md was changed after the "
        r"export wrote it.*Nothing was written or deleted.*choose a new folder",
        id="export-overwrite-edited-card",
    ),
    pytest.param(
        export_listing_a_user_file,
        r"but notes\.txt was changed after the export wrote it.*Nothing was written or deleted",
        id="export-overwrite-marker-lists-user-file",
    ),
    pytest.param(
        export_with_old_marker,
        r"older tidar-convert, whose tidar_export\.json records no "
        r"sizes or hashes.*delete it yourself, or choose a new folder",
        id="export-overwrite-old-marker",
    ),
    pytest.param(
        api(export_onto_a_full_disk),
        r"^no space left in \S+ for the export e: it needs about [\d.]+ \w+(, more than there "
        r"was room for while writing it \(.*shows free now\)| and the disk has [\d.]+ \w+ "
        r"free) \(e there is the earlier one, whole\)\. .*choose an --out on a disk with room",
        id="export-full-disk",
    ),
    pytest.param(
        appended_corpus,
        r"--out '\S+greedy\.jsonl' was changed after `tidar-convert distill` wrote it.*"
        r"nothing was written.*choose a new file name",
        id="distill-overwrite-appended-row",
    ),
    pytest.param(
        lambda env: validate(env, "--ckpt_path", "last"),
        r"--ckpt_path last: no last checkpoint in \S+run/checkpoints\. Leave out "
        r"--ckpt_path to validate the base model as it is, or pass a checkpoint file",
        id="validate-last-without-checkpoint",
    ),
]

# --------------------------------------------------------------------------------------------
# generate: the Python API and the CLI
# --------------------------------------------------------------------------------------------

import torch  # noqa: E402  (kept in this section: its rows build tensors)

_LOADED: dict = {}


def tidar_lm(env: Env):
    """The export, loaded once per module (read-only: rows only call generate on it)."""
    from tidar_convert.exports.folder import load

    if str(env.export) not in _LOADED:
        _LOADED[str(env.export)] = load(env.export)
    return _LOADED[str(env.export)]


def cli_generate(env: Env, *extra: str) -> list[str]:
    return [
        "generate",
        "--model",
        str(env.export),
        "--prompt",
        "def f(x):",
        "--max_new_tokens",
        "4",
        *extra,
    ]


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
    pytest.param(
        lambda env: cli_generate(env, "--draft_length", "0"),
        r"--draft-length=0: .*use 2 or more",
        id="cli-draft-length-0",
    ),
    pytest.param(
        lm_generate(PROMPT, draft_length=0),
        r"draft_length=0: .*use 2 or more",
        id="api-draft-length-0",
    ),
    pytest.param(
        long_prompt(3),
        r"prompt \(1027 tokens\).*1024 positions; shorten the prompt "
        r"to at most 1020 tokens \(1023 with max_new_tokens=1\)",
        id="prompt-past-the-context",
    ),
    pytest.param(
        lm_generate(PROMPT, attention_mask=torch.zeros_like(PROMPT)),
        r"attention_mask row 0 attends to no token.*pass 1 at each real prompt token",
        id="mask-all-zeros",
    ),
    pytest.param(
        lm_generate([[5, 6, 7, 8]]),
        r"input_ids is a list: pass a LongTensor of shape "
        r"\(batch, length\), e\.g\. torch\.tensor\(\[ids\]\)",
        id="ids-as-list",
    ),
    pytest.param(
        lm_generate(torch.tensor([5, 6, 7, 8])),
        r"input_ids has shape \(4,\): pass shape \(batch, length\), e\.g\. ids\[None\]",
        id="ids-1d",
    ),
    pytest.param(
        lm_generate(PROMPT, attention_mask=[[1, 1, 1, 1]]),
        r"attention_mask is a list: pass a LongTensor",
        id="mask-as-list",
    ),
]

# --------------------------------------------------------------------------------------------

# FIT_CASES go through LightningCLI (`tidar-convert fit`), some past loading the model: `make
# test-fast` leaves them out
CASES = (
    [pytest.param(*c.values, marks=[*c.marks, pytest.mark.fit], id=c.id) for c in FIT_CASES]
    + OUTPUT_CASES
    + GENERATE_CASES
)


@pytest.fixture(scope="module")
def probe_export(tiny_dirs, tmp_path_factory):
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    model, tok = load_base(str(tiny_dirs["llama"]))
    return export(model, tok, tmp_path_factory.mktemp("probe") / "tidar", TiDARSpec(4))


@pytest.mark.parametrize("run, pattern", CASES)
def test_probe_case_is_one_line_naming_value_and_fix(
    run, pattern, tiny_dirs, probe_export, tmp_path, capsys
):
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
        assert (
            message.startswith("error: ")
            and sum(line.startswith("error: ") for line in err.splitlines()) == 1
        ), err
        assert "Traceback" not in err, err
    assert re.search(pattern, message), f"{message!r} does not match {pattern!r}"
