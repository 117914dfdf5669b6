"""Issue 46's table: a second run loses nothing, no setting is silently changed, and a bad one is
refused before any work, in one line that names the value (or the file and line) and the fix.

Each row asserts the outcome: refused before the model loads (check_model, the first thing that
reads a model, is made to fail the test), or the right behaviour. Data rows are in
test_bad_input_data.py, the other commands' rows in test_bad_input_misc.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from test_errors import cli_error

from tidar_convert.cli import main

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny.yaml"


def fit_args(run: Path, model, *extra, recipe=RECIPE) -> list[str]:
    return [
        "fit",
        "--config",
        str(recipe),
        "--model.model",
        str(model),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.logger",
        "false",
        *extra,
    ]


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


# ---------------------------------------------------------------------------------------------
# Lost work: run folders are never clobbered.
# ---------------------------------------------------------------------------------------------


@pytest.mark.fit
@pytest.mark.parametrize("where", ["folder", "cwd"])
def test_a_config_yaml_fit_did_not_write_is_never_replaced(
    tmp_path, tiny_dirs, capsys, monkeypatch, no_model_load, where
):
    project = tmp_path / "userproj"
    project.mkdir()
    mine = "# my own notes\nmodel: {draft_length: 8}\n"
    (project / "config.yaml").write_text(mine)
    monkeypatch.chdir(project)
    root = project if where == "folder" else Path(".")
    line = cli_error(capsys, *fit_args(root, tiny_dirs["llama"]))
    assert f"'{root / 'config.yaml'}' was not written by tidar-convert fit" in line
    assert "pass another --trainer.default_root_dir" in line
    assert (project / "config.yaml").read_text() == mine and sorted(os.listdir(project)) == [
        "config.yaml"
    ]


@pytest.mark.fit
def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_and_new_or_replace_say_what_happens(
    tmp_path, tiny_dirs, capsys
):
    run = tmp_path / "run"
    main(fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "12"))
    last = run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    config = (run / "config.yaml").read_text()
    capsys.readouterr()

    line = cli_error(capsys, *fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "2"))
    assert (
        f"run folder '{run}' holds another run's checkpoints (1, the newest {last} at step 12)"
        in line
    )
    assert (
        "--ckpt_path last" in line
        and "--existing_run new" in line
        and "--existing_run replace" in line
    )
    assert last.read_bytes() == before and (run / "config.yaml").read_text() == config
    assert sorted(os.listdir(run / "checkpoints")) == ["last.ckpt"]

    main(fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "2", "--existing_run", "new"))
    err = capsys.readouterr().err
    moved = tmp_path / "run-v2"
    assert (
        f"this run goes to '{moved}'" in err
        and f"checkpoint: {moved / 'checkpoints' / 'last.ckpt'} (step 2)" in err
    )
    assert last.read_bytes() == before and step_of(moved / "checkpoints" / "last.ckpt") == 2
    assert (moved / "config.yaml").is_file() and (run / "config.yaml").read_text() == config

    main(fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "3", "--existing_run", "replace"))
    assert "removed the 1 checkpoint(s) and config of the earlier run" in capsys.readouterr().err
    assert step_of(last) == 3 and sorted(os.listdir(run / "checkpoints")) == ["last.ckpt"]


@pytest.mark.fit
def test_resume_takes_the_highest_step_and_the_final_message_names_the_file_that_holds_it(
    tmp_path, tiny_dirs, capsys
):
    """A run folder an older version left with last.ckpt (step 12) and a newer last-v1.ckpt
    (step 2)."""
    import shutil
    import time

    run = tmp_path / "run"
    main(fit_args(tmp_path / "short", tiny_dirs["llama"], "--trainer.max_steps", "2"))
    main(fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "12"))
    time.sleep(0.05)
    shutil.copy(
        tmp_path / "short" / "checkpoints" / "last.ckpt", run / "checkpoints" / "last-v1.ckpt"
    )
    capsys.readouterr()
    main(fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "17", "--ckpt_path", "last"))
    err = capsys.readouterr().err
    last = run / "checkpoints" / "last.ckpt"
    assert f"--ckpt_path last: resuming {last} (step 12)" in err
    # saved every 10: 17 only at the end
    assert "trained 17 steps" in err and f"checkpoint: {last} (step 17)" in err
    assert step_of(last) == 17 and step_of(run / "checkpoints" / "last-v1.ckpt") == 2


@pytest.mark.fit
def test_a_corrupted_last_ckpt_is_named_in_one_line(tmp_path, tiny_dirs, capsys):
    run = tmp_path / "run"
    main(fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "2"))
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:5000])
    line = cli_error(
        capsys,
        *fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "4", "--ckpt_path", "last"),
    )
    assert f"checkpoint '{last}' does not load" in line and "cut short or damaged" in line


# ---------------------------------------------------------------------------------------------
# Silently different: ranges, recipes, precision, resumed settings.
# ---------------------------------------------------------------------------------------------


@pytest.mark.fit
@pytest.mark.parametrize(
    "flag,value,message",
    [
        (
            "--model.min_lr_ratio",
            "-1",
            "--model.min_lr_ratio=-1.0: must be a finite number in [0, 1]",
        ),
        (
            "--model.min_lr_ratio",
            "5",
            "--model.min_lr_ratio=5.0: must be a finite number in [0, 1]",
        ),
        (
            "--model.alpha",
            "nan",
            "Parser key \"model.alpha\": Expected a <class 'float'>. Got value: nan",
        ),
        (
            "--model.alpha",
            "inf",
            "Parser key \"model.alpha\": Expected a <class 'float'>. Got value: inf",
        ),
        (
            "--model.warmup_ratio",
            "1",
            "--model.warmup_ratio=1.0: must be a finite number in [0, 1)",
        ),
        ("--model.lora_alpha", "0", "--model.lora_alpha=0: must be a finite number > 0"),
        (
            "--model.distill_temperature",
            "0",
            "--model.distill_temperature=0.0: must be a finite number > 0",
        ),
        (
            "--model.val_decode_prompts",
            "-1",
            "--model.val_decode_prompts=-1: must be a whole number >= 0",
        ),
        (
            "--model.optimizer.init_args.lr",
            "-0.001",
            "--model.optimizer.init_args.lr=-0.001: must be a finite number > 0",
        ),
        ("--model.optimizer.init_args.lr", "nan", 'Parser key "model.optimizer"'),
        (
            "--model.optimizer.init_args.weight_decay",
            "-1",
            "--model.optimizer.init_args.weight_decay=-1.0: must be",
        ),
        (
            "--model.optimizer.init_args.betas",
            "[1.0, 0.999]",
            "--model.optimizer.init_args.betas=[1.0, 0.999]: each must be in [0, 1)",
        ),
        ("--data.batch_size", "0", "--data.batch_size=0: must be a whole number >= 1"),
        ("--data.val_batches", "0", "--data.val_batches=0: must be a whole number >= 1"),
        ("--data.shuffle_buffer", "-2", "--data.shuffle_buffer=-2: must be a whole number >= 0"),
        ("--data.num_workers", "-1", "--data.num_workers=-1: must be a whole number >= 0"),
        (
            "--data.greedy_new_tokens",
            "0",
            "--data.greedy_new_tokens=0: must be a whole number >= 1",
        ),
        (
            "--trainer.gradient_clip_val",
            "-1",
            "--trainer.gradient_clip_val=-1: must be a finite number >= 0",
        ),
        (
            "--trainer.limit_val_batches",
            "1.5",
            "--trainer.limit_val_batches=1.5: must be a whole number of batches",
        ),
        (
            "--trainer.val_check_interval",
            "-3",
            "--trainer.val_check_interval=-3: must be a whole number of batches",
        ),
        (
            "--trainer.log_every_n_steps",
            "0",
            "--trainer.log_every_n_steps=0: must be a whole number >= 1",
        ),
        (
            "--global_batch_tokens",
            "-128",
            "--global_batch_tokens=-128: must be a whole number >= 1",
        ),
        (
            "--trainer.precision",
            "16-mixed",
            "--trainer.precision 16-mixed: float16 mixed precision does not run on a CPU",
        ),
    ],
)
def test_a_setting_out_of_range_is_refused_before_the_model_loads(
    tmp_path, tiny_dirs, capsys, no_model_load, flag, value, message
):
    line = cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], flag, value))
    assert line.startswith(f"error: {message}") and value in line, line
    assert not (tmp_path / "run").exists()


def test_the_python_api_refuses_the_same_values_with_the_same_words():
    from tidar_convert.data import TiDARData
    from tidar_convert.train.module import TiDARModule

    with pytest.raises(
        ValueError, match=r"--model.min_lr_ratio=-1: must be a finite number in \[0, 1\]"
    ):
        TiDARModule(min_lr_ratio=-1)
    with pytest.raises(ValueError, match=r"--data.batch_size=0: must be a whole number >= 1"):
        TiDARData(batch_size=0)


@pytest.mark.fit
def test_a_recipe_with_a_key_twice_or_a_tab_is_refused_by_file_and_line(
    tmp_path, tiny_dirs, capsys, no_model_load
):
    twice = tmp_path / "twice.yaml"
    twice.write_text(RECIPE.read_text().replace("  alpha: 1.0\n", "  alpha: 1.0\n  alpha: 3.0\n"))
    line = cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], recipe=twice))
    assert line.startswith(
        f"error: recipe '{twice}' line 6, column 3: key 'alpha' "
        "is given twice (first at line 5); keep one of them"
    )
    tab = tmp_path / "tab.yaml"
    tab.write_text(RECIPE.read_text().replace("  draft_length: 4\n", "\tdraft_length: 4\n"))
    line = cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], recipe=tab))
    assert (
        line.startswith(f"error: recipe '{tab}' line 4, column 1:")
        and "indent with spaces, not tabs" in line
    )
    assert "<unicode string>" not in line and not (tmp_path / "run").exists()


@pytest.mark.fit
def test_a_resume_refuses_what_changes_the_checkpoint_and_applies_what_may_change(
    tmp_path, tiny_dirs, capsys
):
    run = tmp_path / "run"
    main(fit_args(run, tiny_dirs["llama"], "--trainer.max_steps", "10"))
    last = run / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()
    capsys.readouterr()
    for flag, value, old in [
        ("--model.draft_length", "8", "4"),
        ("--data.val_every", "10", "20"),
        ("--model.lora_r", "8", "0"),
    ]:
        line = cli_error(
            capsys,
            *fit_args(
                run,
                tiny_dirs["llama"],
                "--ckpt_path",
                "last",
                "--trainer.max_steps",
                "12",
                flag,
                value,
            ),
        )
        assert (
            f"{flag} {int(value)!r} (trained with {int(old)!r})" in line and "set them back" in line
        ), line
        assert last.read_bytes() == saved
    main(
        fit_args(
            run,
            tiny_dirs["llama"],
            "--ckpt_path",
            "last",
            "--trainer.max_steps",
            "12",
            "--model.optimizer.init_args.lr",
            "0.01",
        )
    )
    err = capsys.readouterr().err
    assert (
        "with changed settings, applied from its step on: "
        "--model.optimizer.init_args.lr 0.003 -> 0.01" in err
    )
    resumed = torch.load(last, map_location="cpu", weights_only=False)
    assert resumed["global_step"] == 12
    (group,) = resumed["optimizer_states"][0]["param_groups"]
    assert group["initial_lr"] == 0.01 and resumed["lr_schedulers"][0]["base_lrs"] == [0.01]
    assert resumed["hyper_parameters"]["optimizer"]["init_args"]["lr"] == 0.01


# ---------------------------------------------------------------------------------------------
# Tracebacks and misleading messages.
# ---------------------------------------------------------------------------------------------


@pytest.mark.fit
def test_a_recipe_without_an_optimizer_trains_with_the_documented_adamw(
    tmp_path, tiny_dirs, capsys
):
    recipe = tmp_path / "no-optimizer.yaml"
    text = RECIPE.read_text()
    start = text.index("  optimizer:")
    recipe.write_text(text[:start] + text[text.index("  warmup_ratio") :])
    main(fit_args(tmp_path / "run", tiny_dirs["llama"], "--trainer.max_steps", "2", recipe=recipe))
    ckpt = torch.load(
        tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
    )
    (group,) = ckpt["optimizer_states"][0]["param_groups"]
    assert group["initial_lr"] == 1e-5 and group["weight_decay"] == 0.0


@pytest.mark.fit
@pytest.mark.parametrize("inside", [False, True])
def test_out_as_the_run_folder_is_refused_before_training(
    tmp_path, tiny_dirs, capsys, no_model_load, inside
):
    run = tmp_path / "run"
    out = tmp_path if inside else run  # an export folder holding the run folder is replaced with it
    line = cli_error(capsys, *fit_args(run, tiny_dirs["llama"], "--out", str(out)))
    assert f"--out {str(out)!r} {'holds' if inside else 'is'} the run folder" in line
    assert not run.exists()


# ---------------------------------------------------------------------------------------------
# What confuses a newcomer.
# ---------------------------------------------------------------------------------------------


@pytest.mark.fit
@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--model.draft_lenght", "8"], "did you mean --model.draft_length?"),
        # no abbreviations taken silently
        (["--trainer.max_step", "3"], "did you mean --trainer.max_steps?"),
        (["--data.seq_len", "abc"], "data.seq_len"),
        (
            ["--model.optimizer.init_args.lrr", "0.1"],
            "did you mean init_args.lr (an argument of torch.optim.AdamW)?",
        ),
        # LightningCLI's own optimizer and scheduler flags: configure_optimizers would override them
        (["--optimizer", "AdamW"], "the optimizer is --model.optimizer"),
        (["--optimizer.lr", "0.1"], "the optimizer is --model.optimizer"),
        (["--lr_scheduler", "StepLR"], "set by --model.warmup_ratio and --model.min_lr_ratio"),
        # a recipe written before the rename
        (["--model.block_size", "8"], "--model.block_size is now --model.draft_length"),
        # what is missing comes last in jsonargparse's message, after a long list of types
        (
            ["--trainer.logger", '[{"class_path": "lightning.pytorch.loggers.CSVLogger"}]'],
            "required: save_dir",
        ),
        (
            ["--trainer.logger", '[{"class_path": "lightning.pytorch.loggers.CSVLogger"}]'],
            "`init_args: {save_dir: .}` writes into the run folder",
        ),
    ],
)
def test_an_argument_error_is_one_line_with_the_nearest_key(
    tmp_path, tiny_dirs, capsys, no_model_load, extra, expected
):
    with pytest.raises(SystemExit) as info:
        main(fit_args(tmp_path / "run", tiny_dirs["llama"], *extra))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert "usage:" not in err[0]


@pytest.mark.fit
def test_a_fit_that_fails_before_its_first_step_leaves_no_run_folder(tmp_path, tiny_dirs, capsys):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "too short"}) + "\n")
    with pytest.raises(SystemExit):
        main(fit_args(tmp_path / "run", tiny_dirs["llama"], "--data.source", str(short)))
    assert not (tmp_path / "run").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    with pytest.raises(SystemExit):
        main(fit_args(existing, tiny_dirs["llama"], "--data.source", str(short)))
    assert existing.is_dir()  # a folder that was there before is the user's: left where it is


def test_shipped_recipes_put_every_output_under_their_run_folder():
    """A recipe's logs and checkpoints follow --trainer.default_root_dir (run_folder.place_outputs):
    none may name a folder of its own ("." is the run folder)."""
    for recipe in (Path(__file__).parents[1] / "recipes").glob("*.yaml"):
        text = re.sub(r"save_dir: \.[},\s]", "", recipe.read_text())
        assert "save_dir:" not in text and "dirpath:" not in text, recipe.name


@pytest.mark.fit
@pytest.mark.parametrize(
    "case,extra,message",
    [
        (
            "root is a file",
            ["--trainer.default_root_dir", "{tmp}/notes.txt"],
            "--trainer.default_root_dir '{tmp}/notes.txt' is a file, not a folder",
        ),
        (
            "overwrite without out",
            ["--overwrite", "true"],
            "--overwrite replaces an earlier export at --out, and no --out is given",
        ),
        (
            "new and resume",
            ["--existing_run", "new", "--ckpt_path", "last"],
            "--existing_run new with --ckpt_path last: a resumed run continues in its own folder",
        ),
        ("bad existing_run", ["--existing_run", "keep"], 'Parser key "existing_run"'),
        (
            "ckpt_path a plain folder",
            ["--ckpt_path", "{tmp}"],
            "checkpoint '{tmp}' is a folder but not a sharded checkpoint",
        ),
        (
            "missing recipe",
            ["--config", "{tmp}/nope.yaml"],
            "--config '{tmp}/nope.yaml': no such file",
        ),
    ],
)
def test_contradictory_or_impossible_run_settings_are_refused_up_front(
    tmp_path, tiny_dirs, capsys, no_model_load, case, extra, message
):
    (tmp_path / "notes.txt").write_text("mine")
    extra = [x.format(tmp=tmp_path) for x in extra]
    line = cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], *extra))
    assert line.startswith(f"error: {message.format(tmp=tmp_path)}"), line
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "run").exists()
