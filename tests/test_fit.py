"""Training end to end through the CLI: loss goes down, the folder reloads, bad input is refused."""

import json
from pathlib import Path

import pytest
import torch
from helpers import FAMILIES
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidar_convert.cli import main
from tidar_convert.data import PackedDocuments
from tidar_convert.runtime import layout
from tidar_convert.train.loss import hybrid_loss

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Many small, similar Python functions: a 30-step run learns their shape."""
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "code.jsonl"
    ops = ["+", "-", "*", "//", "%"]
    with path.open("w") as f:
        for i in range(400):
            a, op = rng.randint(0, 99), rng.choice(ops)
            text = f"def f_{i}(x, y):\n    z = x {op} {a}\n    return z {op} y\n"
            f.write(json.dumps({"text": text}) + "\n")
    return path


def fit(tmp_path, model_dir, *extra, logger=False):
    args = [
        "fit",
        "--config",
        RECIPE,
        "--model.model",
        str(model_dir),
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path / "out"),
    ]
    if not logger:
        args += ["--trainer.logger", "false"]
    main(args + list(extra))
    return tmp_path / "out"


def held_out_loss(model, tokenizer, source, draft_length=4, seq_len=64):
    ds = PackedDocuments(tokenizer, [str(source)], seq_len, "val", 20, "text", None, "train", 0)
    batch = [x for _, x in zip(range(4), ds)]
    ids = torch.stack([b["input_ids"] for b in batch])
    docs = torch.stack([b["doc_ids"] for b in batch])
    mask = layout.to_dense(
        layout.train_mask_mod(seq_len, draft_length, docs), 4, 2 * seq_len, 2 * seq_len
    )
    with torch.no_grad():
        logits = model(
            input_ids=layout.train_inputs(ids, model.config.mask_token_id),
            position_ids=layout.train_position_ids(ids, docs),
            attention_mask=mask,
        ).logits
    return hybrid_loss(logits, *layout.train_labels(ids, docs), 1.0, draft_length)["loss"].item()


@pytest.mark.fit
@pytest.mark.parametrize("family", FAMILIES)
def test_short_fit_lowers_loss_and_writes_a_loadable_folder(
    tmp_path, tiny_dirs, corpus, family, monkeypatch
):
    from tidar_convert.models.loading import load_base

    monkeypatch.chdir(tmp_path)  # (were W&B to follow tiny.yaml's runs/tiny, it would land here)
    # one family goes through W&B (offline)
    out = fit(tmp_path, tiny_dirs[family], "--data.source", str(corpus), logger=family == "llama")
    base, tok = load_base(str(tiny_dirs[family]))
    model = AutoModelForCausalLM.from_pretrained(out)  # no remote code: the plain base architecture
    assert type(model).__name__ == type(base).__name__
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["model_type"] == family
        and cfg["tidar"]["draft_length"] == 4
        and cfg["tidar"]["alpha"] == 1.0
    )
    out_tok = AutoTokenizer.from_pretrained(out)
    assert cfg["mask_token_id"] == out_tok.mask_token_id == tok.mask_token_id
    assert (out / "model.safetensors").exists()
    before, after = (
        held_out_loss(base.eval(), tok, corpus),
        held_out_loss(model.eval(), out_tok, corpus),
    )
    assert after < before - 0.5, (before, after)
    if family == "llama":
        # the logs follow --trainer.default_root_dir, not the recipe's runs/tiny
        assert list((tmp_path / "run" / "wandb").glob("offline-run-*/*.wandb")), (
            "no offline W&B run written"
        )
        assert not (tmp_path / "runs").exists()


@pytest.mark.fit
def test_resume_from_last_checkpoint(tmp_path, tiny_dirs):
    fit(tmp_path, tiny_dirs["qwen2"], "--trainer.max_steps", "10")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 10
    fit(
        tmp_path,
        tiny_dirs["qwen2"],
        "--trainer.max_steps",
        "20",
        "--ckpt_path",
        "last",
        "--overwrite",
        "true",
    )  # tiny.yaml sets no dirpath: still found
    assert torch.load(last, weights_only=False)["global_step"] == 20


@pytest.mark.fit
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    tmp_path, tiny_dirs, monkeypatch, capsys
):
    import tidar_convert.train.module as module

    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = hybrid_loss(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 12:
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(module, "hybrid_loss", poisoned)
    with pytest.raises(SystemExit):
        fit(tmp_path, tiny_dirs["llama"], "--trainer.val_check_interval", "100")
    err = capsys.readouterr().err
    assert "non-finite loss" in err and "last.ckpt" in err
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 10
    assert all(
        torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point()
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.fit
@pytest.mark.parametrize(
    "extra,message",
    [
        (["--data.seq_len", "30"], "seq_len=30 is not a multiple of draft_length=4"),
        (["--model.draft_length", "1"], "draft_length=1"),
        (["--model.draft_length", "128"], "draft_length=128 is larger than seq_len=64"),
        (["--model.alpha", "-0.5"], "alpha=-0.5"),
    ],
)
def test_bad_training_settings_are_refused(tmp_path, tiny_dirs, extra, message, capsys):
    with pytest.raises(SystemExit):
        fit(tmp_path, tiny_dirs["llama"], *extra)
    assert message in capsys.readouterr().err


@pytest.mark.fit
def test_empty_or_too_short_data_is_refused(tmp_path, tiny_dirs, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        fit(tmp_path, tiny_dirs["llama"], "--data.source", str(empty))
    assert "holds no file ending in" in capsys.readouterr().err
    short = tmp_path / "short"
    short.mkdir()
    for i in range(3):
        (short / f"{i}.txt").write_text("tiny")
    with pytest.raises(SystemExit):
        fit(tmp_path, tiny_dirs["llama"], "--data.source", str(short))
    assert "fewer than seq_len=64 tokens" in capsys.readouterr().err


@pytest.mark.fit
def test_validation_logs_real_decoding_acceptance(tmp_path, tiny_dirs):
    from tidar_convert.train.fit import _lightning_cli

    cli = _lightning_cli(
        [
            "fit",
            "--config",
            RECIPE,
            "--model.model",
            str(tiny_dirs["llama"]),
            "--trainer.max_steps",
            "15",
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    metrics = cli.trainer.callback_metrics
    assert 1.0 <= metrics["val/tokens_per_nfe"].item() <= 4.0
    assert {
        "val/loss",
        "val/loss_ar",
        "val/loss_diff",
        "val/acc_diff_3",
        "train/acc_diff_0",
    } <= set(metrics)


# --------------------------------------------------------------------------------------------
# Nothing lost, nothing vague: preemption, resume, where files go, what the user sees.
# --------------------------------------------------------------------------------------------


def cli_process(tmp_path, model_dir, *extra):
    """`tidar-convert fit` as a user runs it: its own process, output to a pipe (not a terminal)."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "tidar_convert.cli",
        "fit",
        "--config",
        RECIPE,
        "--model.model",
        str(model_dir),
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        *extra,
    ]
    return subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.fit
@pytest.mark.subprocess
def test_fit_output_is_quiet_and_informative_and_config_stays_in_the_run_folder(
    tmp_path, tiny_dirs
):
    # the user's own file in the working directory
    (tmp_path / "config.yaml").write_text("mine: true\n")
    proc = cli_process(
        tmp_path, tiny_dirs["llama"], "--trainer.max_steps", "3", "--out", str(tmp_path / "out")
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "config.yaml").read_text() == "mine: true\n"
    assert "max_steps: 3" in (tmp_path / "run" / "config.yaml").read_text()
    lines = (out + err).splitlines()
    assert any(
        line.startswith("train step 1/3 (33%), loss ") and "tok/s" in line and "ETA" in line
        for line in lines
    ), lines
    assert any(line.startswith("train step 3/3 (100%)") for line in lines), lines
    assert f"exported TiDAR model to {tmp_path / 'out'}" in err
    assert "checkpoint: " in err and "W&B run: " in err
    for noise in (
        "wandb: WARNING",
        "Tip:",
        "GPU available",
        "Loading weights",
        "Seed set",
        "Deprecat",
        "Epoch 0",
    ):
        assert noise not in out + err, noise
    assert len(lines) <= 8, lines


@pytest.mark.fit
@pytest.mark.subprocess
def test_sigterm_saves_a_checkpoint_exits_nonzero_and_resumes(tmp_path, tiny_dirs):
    """What SLURM/Kubernetes send before killing a job: save, exit 143, and --ckpt_path last
    continues."""
    import signal

    proc = cli_process(
        tmp_path, tiny_dirs["qwen2"], "--trainer.max_steps", "5000", "--trainer.logger", "false"
    )
    for line in proc.stderr:  # wait until training is really running
        if line.startswith("train step 1/"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert "received SIGTERM: saved" in err and str(last) in err
    step = torch.load(last, weights_only=False)["global_step"]
    assert 1 <= step < 5000
    fit(tmp_path, tiny_dirs["qwen2"], "--trainer.max_steps", str(step + 2), "--ckpt_path", "last")
    assert torch.load(last, weights_only=False)["global_step"] == step + 2


@pytest.mark.fit
def test_resume_last_without_a_checkpoint_is_an_error(tmp_path, tiny_dirs, capsys):
    with pytest.raises(SystemExit):
        fit(tmp_path, tiny_dirs["llama"], "--ckpt_path", "last")
    err = capsys.readouterr().err
    assert (
        "--ckpt_path last: no last checkpoint in" in err
        and str(tmp_path / "run" / "checkpoints") in err
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.fit
@pytest.mark.parametrize("steps", ["0", "-5"])
def test_max_steps_that_train_nothing_are_refused(tmp_path, tiny_dirs, capsys, steps):
    with pytest.raises(SystemExit):
        fit(tmp_path, tiny_dirs["llama"], "--trainer.max_steps", steps)
    assert f"--trainer.max_steps {steps}: trains nothing" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


@pytest.mark.fit
def test_fit_out_is_checked_before_training(tmp_path, tiny_dirs, capsys):
    """A bad --out fails in seconds, not after the whole run, and is never deleted."""
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("years of work")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for out, extra in ((thesis, []), (thesis, ["--overwrite", "true"]), (a_file, [])):
        with pytest.raises(SystemExit):
            main(
                [
                    "fit",
                    "--config",
                    RECIPE,
                    "--model.model",
                    str(tiny_dirs["llama"]),
                    "--trainer.logger",
                    "false",
                    "--trainer.default_root_dir",
                    str(tmp_path / "run"),
                    "--out",
                    str(out),
                    *extra,
                ]
            )
        assert str(out) in capsys.readouterr().err
        assert not (tmp_path / "run").exists(), "training started before --out was checked"
    assert (thesis / "thesis.tex").read_text() == "years of work" and a_file.read_text() == "mine"


@pytest.mark.fit
@pytest.mark.subprocess
def test_make_convert_runs_the_fit_command_it_prints(tmp_path, tiny_dirs):
    """`make convert` is the README's first command: its fit line parses, trains, exports, and run
    again replaces its own export (a bare `--overwrite` the parser refused once broke it)."""
    import shlex
    import subprocess

    root = Path(__file__).parents[1]
    out = tmp_path / "out"
    make = [
        "make",
        "-n",
        "-C",
        str(root),
        "convert",
        f"RECIPE={RECIPE}",
        f"MODEL={tiny_dirs['llama']}",
        "MAX_STEPS=2",
        f"OUT={out}",
    ]
    printed = subprocess.run(make, capture_output=True, text=True, check=True).stdout.replace(
        "\\\n", " "
    )
    (line,) = [line for line in printed.splitlines() if "tidar-convert fit" in line]
    args = shlex.split(line, comments=True)
    args = args[args.index("fit") :] + [
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--trainer.logger",
        "false",
    ]
    assert "--overwrite" in args
    for steps in ("2", "3"):
        main([*args, "--trainer.max_steps", steps])
        assert f"steps: {steps}" in (out / "README.md").read_text()


@pytest.mark.fit
def test_fit_replaces_an_earlier_export_only_with_overwrite(tmp_path, tiny_dirs, capsys):
    out = fit(tmp_path, tiny_dirs["llama"], "--trainer.max_steps", "2")
    card = (out / "README.md").read_text()
    assert "steps: 2" in card and "max_steps: 2" in card  # the training facts and the full config
    with pytest.raises(SystemExit):
        fit(tmp_path, tiny_dirs["llama"], "--trainer.max_steps", "3")
    assert "--overwrite" in capsys.readouterr().err
    fit(
        tmp_path,
        tiny_dirs["llama"],
        "--trainer.max_steps",
        "3",
        "--overwrite",
        "true",
        "--existing_run",
        "replace",
    )
    assert "steps: 3" in (out / "README.md").read_text()


@pytest.mark.fit
def test_bf16_on_a_cpu_without_native_bf16_is_flagged(tmp_path, tiny_dirs, capsys, monkeypatch):
    """bf16 emulated on a CPU without AMX/AVX512-BF16 trains many times slower: say so, with
    the fix."""
    from tidar_convert.train import checks as fit_checks

    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert fit_checks.cpu_has_native_bf16(str(info)) is False
    info.write_text("flags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert fit_checks.cpu_has_native_bf16(str(info)) is True
    # not Linux: no claim either way
    assert fit_checks.cpu_has_native_bf16(str(tmp_path / "missing")) is None

    monkeypatch.setattr(fit_checks, "cpu_has_native_bf16", lambda: False)
    fit(
        tmp_path,
        tiny_dirs["llama"],
        "--trainer.max_steps",
        "1",
        "--trainer.precision",
        "bf16-mixed",
        "--trainer.accelerator",
        "cpu",
    )
    assert (
        "warning: --trainer.precision bf16-mixed on a CPU without native bf16"
        in capsys.readouterr().err
    )
    monkeypatch.setattr(fit_checks, "cpu_has_native_bf16", lambda: True)
    fit(
        tmp_path / "again",
        tiny_dirs["llama"],
        "--trainer.max_steps",
        "1",
        "--trainer.precision",
        "bf16-mixed",
        "--trainer.accelerator",
        "cpu",
    )
    assert "without native bf16" not in capsys.readouterr().err


@pytest.mark.fit
def test_each_fit_in_one_process_gets_its_own_wandb_run(tmp_path, tiny_dirs, monkeypatch):
    """Lightning leaves the W&B run open after fit; the next WandbLogger in the same process (a
    notebook, a test, a sweep) would log into it, in the first run's folder. fit closes it."""
    import wandb
    import yaml

    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("first", "second"):
        loggers = tmp_path / f"{name}.yaml"
        logger = {
            "class_path": "lightning.pytorch.loggers.WandbLogger",
            "init_args": {"save_dir": str(tmp_path / name), "project": "tidar-convert-tests"},
        }
        loggers.write_text(yaml.safe_dump({"trainer": {"logger": [logger]}}))
        main(
            [
                "fit",
                "--config",
                RECIPE,
                "--config",
                str(loggers),
                "--model.model",
                str(tiny_dirs["llama"]),
                "--trainer.max_steps",
                "2",
                "--trainer.default_root_dir",
                str(tmp_path / name / "run"),
            ]
        )
        assert list((tmp_path / name / "wandb").glob("offline-run-*/*.wandb")), (
            f"the {name} fit has no W&B run of its own"
        )
        assert wandb.run is None


@pytest.mark.fit
def test_the_loggers_get_the_whole_resolved_config(tmp_path, tiny_dirs, monkeypatch):
    """Issue 48: the loggers got only the model's and the data's arguments; they get the config
    LightningCLI resolved, under `config`, nested as config.yaml has it
    (SaveConfigCallback.save_config)."""
    import yaml

    from tidar_convert.train import fit

    monkeypatch.setenv("WANDB_MODE", "offline")
    held = {}  # what the W&B run holds as its config when fit closes it

    def finish(close=fit._finish_wandb):
        import wandb

        held.update(wandb.run.config.as_dict())
        close()

    monkeypatch.setattr(fit, "_finish_wandb", finish)
    loggers = tmp_path / "loggers.yaml"
    loggers.write_text(
        yaml.safe_dump({"trainer": {"logger": [
            {"class_path": "lightning.pytorch.loggers.CSVLogger",
             "init_args": {"save_dir": str(tmp_path / "csv")}},
            {"class_path": "lightning.pytorch.loggers.WandbLogger",
             "init_args": {"save_dir": str(tmp_path), "project": "tidar-convert-tests"}},
        ]}})
    )  # fmt: skip
    main([
        "fit", "--config", RECIPE, "--config", str(loggers), "--model.model",
        str(tiny_dirs["llama"]), "--trainer.max_steps", "2", "--data.seq_len", "32",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ])  # fmt: skip
    (hparams,) = (tmp_path / "csv").rglob("hparams.yaml")
    for logged in (yaml.safe_load(hparams.read_text())["config"], held["config"]):
        assert logged["model"]["optimizer"]["init_args"]["lr"] == 3.0e-3
        assert logged["model"]["min_lr_ratio"] == 1.0 and logged["data"]["seq_len"] == 32
        assert logged["trainer"]["max_steps"] == 2 and logged["seed_everything"] == 0
        assert logged["trainer"]["precision"] == "32-true"
