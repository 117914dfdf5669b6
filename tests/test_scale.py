"""Paper-scale runs: the global batch in tokens and the accumulation derived from it, every recipe's
arithmetic, and throughput / memory reaching the loggers."""

import csv
from pathlib import Path

import pytest
import yaml

from tidar_convert.cli import main
from tidar_convert.train.fit import (
    TiDARCLI,
    _lightning_cli,
    accumulation,
    device_count,
    global_batch_line,
)

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
TINY = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")


def test_accumulation_reaches_the_global_batch():
    # the paper's 2M tokens: 8 GPUs x 4 x 4096 x 16, and 4 nodes x 8 GPUs x 2 x 4096 x 8
    assert accumulation(2**21, 4, 4096, 8, 1, None) == 16
    assert accumulation(2**21, 2, 4096, 8, 4, None) == 8
    assert accumulation(2**21, 2, 4096, 8, 4, 8) == 8  # stated and agreeing
    assert accumulation(2**21, 512, 4096, 1, 1, None) == 1
    assert accumulation(None, 4, 4096, 8, 1, None) == 1  # no global batch: what the run was given
    assert accumulation(None, 4, 4096, 8, 1, 3) == 3


def test_global_batch_line():
    assert global_batch_line(4, 4096, 8, 1, 16) == (
        "global batch 2097152 tokens = micro-batch 4 x "
        "seq_len 4096 x devices 8 x nodes 1 x accumulation 16"
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (
            (2**21, 3, 4096, 8, 1, None),
            "--global_batch_tokens 2097152 is not a whole number of micro-steps "
            "of micro-batch 3 x seq_len 4096 x devices 8 x nodes 1 = 98304 tokens",
        ),
        # one micro-step is already twice the batch
        ((2**19, 4, 4096, 8, 8, None), "set --global_batch_tokens to a multiple of 1048576"),
        (
            (2**21, 4, 4096, 8, 1, 8),
            "--trainer.accumulate_grad_batches 8 gives 1048576 tokens per step",
        ),
    ],
)
def test_unreachable_global_batch_is_refused(args, message):
    with pytest.raises(ValueError) as e:
        accumulation(*args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_device_count():
    assert [device_count(d) for d in (8, "8", [0, 1], "0,1,3", "auto", -1, 0)] == [
        8,
        8,
        2,
        3,
        None,
        None,
        None,
    ]


@pytest.mark.fit
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_parses_and_reaches_its_global_batch(recipe, capsys, monkeypatch):
    # parsed as `fit` parses it, required arguments checked (--print_config skips that check: a
    # logger without its required save_dir passed it while `make convert` failed, jsonargparse 4.53)
    class Parsed(Exception):
        pass

    def parsed(self):
        raise Parsed

    monkeypatch.setattr(TiDARCLI, "before_instantiate_classes", parsed)
    with pytest.raises(Parsed):
        main(["fit", "--config", str(recipe)])
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert e.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    t, d = cfg["trainer"], cfg["data"]
    shape = (d["batch_size"], d["seq_len"], device_count(t["devices"]) or 1, t["num_nodes"])
    a = accumulation(cfg["global_batch_tokens"], *shape, t["accumulate_grad_batches"])
    if cfg["global_batch_tokens"] is not None:
        assert (
            d["batch_size"] * d["seq_len"] * shape[2] * shape[3] * a == cfg["global_batch_tokens"]
        )
    # the paper's: 2M tokens of seq 4096, cosine 1e-5 -> 3e-6
    if recipe.stem.startswith(("qwen2.5-1.5b", "qwen3-8b")):
        assert cfg["global_batch_tokens"] == 2**21 and d["seq_len"] == 4096
        assert (
            cfg["model"]["optimizer"]["init_args"]["lr"] == 1e-5
            and cfg["model"]["min_lr_ratio"] == 0.3
        )
        assert cfg["model"]["warmup_ratio"] == 0.01 and t["precision"].startswith("bf16")
        assert t["val_check_interval"] == 500 * a  # counts micro-batches: every 500 optimizer steps
    blocks = {"qwen2.5-1.5b": 4, "qwen2.5-1.5b-k8": 8, "qwen2.5-1.5b-k16": 16, "qwen3-8b": 16}
    if recipe.stem in blocks:
        assert cfg["model"]["draft_length"] == blocks[recipe.stem]


@pytest.mark.fit
def test_fit_derives_accumulation_prints_it_and_records_it(tmp_path, tiny_dirs, capsys):
    cli = _lightning_cli(
        [
            "fit",
            "--config",
            TINY,
            "--model.model",
            str(tiny_dirs["llama"]),
            "--trainer.max_steps",
            "2",
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--global_batch_tokens",
            "384",
        ]
    )
    assert cli.trainer.accumulate_grad_batches == 3 and cli.trainer.global_step == 2
    assert (
        "global batch 384 tokens = micro-batch 2 x "
        "seq_len 64 x devices 1 x nodes 1 x accumulation 3" in capsys.readouterr().err
    )
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (
        saved["global_batch_tokens"] == 384 and saved["trainer"]["accumulate_grad_batches"] is None
    )  # derived again on a rerun


@pytest.mark.fit
@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--global_batch_tokens", "1000"],
            "error: --global_batch_tokens 1000 is not a whole number of micro-steps",
        ),
        (
            ["--global_batch_tokens", "384", "--trainer.accumulate_grad_batches", "2"],
            "error: --trainer.accumulate_grad_batches 2 gives 256 tokens",
        ),
        (
            ["--global_batch_tokens", "0"],
            "error: --global_batch_tokens=0: must be a whole number >= 1",
        ),
    ],
)
def test_fit_refuses_an_unreachable_global_batch_before_loading_the_model(
    tmp_path, extra, message, capsys
):
    # the model folder does not exist: refused before anything loads
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--config",
                TINY,
                "--model.model",
                str(tmp_path / "no-model"),
                "--trainer.logger",
                "false",
                "--trainer.default_root_dir",
                str(tmp_path),
                *extra,
            ]
        )
    assert message in capsys.readouterr().err


@pytest.mark.fit
def test_fit_logs_throughput_and_memory_to_csv_and_wandb(tmp_path, tiny_dirs, monkeypatch):
    from tidar_convert.models.loading import load_base

    monkeypatch.setenv("WANDB_MODE", "offline")
    loggers = tmp_path / "loggers.yaml"
    loggers.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "logger": [
                        {
                            "class_path": "lightning.pytorch.loggers.CSVLogger",
                            "init_args": {"save_dir": str(tmp_path), "name": "csv"},
                        },
                        {
                            "class_path": "lightning.pytorch.loggers.WandbLogger",
                            "init_args": {
                                "save_dir": str(tmp_path),
                                "project": "tidar-convert-tests",
                            },
                        },
                    ]
                }
            }
        )
    )
    main(
        [
            "fit",
            "--config",
            TINY,
            "--config",
            str(loggers),
            "--model.model",
            str(tiny_dirs["llama"]),
            "--trainer.max_steps",
            "6",
            "--trainer.log_every_n_steps",
            "2",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--global_batch_tokens",
            "256",
        ]
    )
    rows = list(csv.DictReader(next((tmp_path / "csv").glob("version_*/metrics.csv")).open()))
    perf = [r for r in rows if r.get("perf/tokens_per_sec")]
    losses = [r["step"] for r in rows if r.get("train/loss")]
    # with the loss, every log_every_n_steps optimizer steps
    assert [r["step"] for r in perf] == losses == ["1", "3", "5"]
    base, _ = load_base(str(tiny_dirs["llama"]))  # with the mask token's rows, as trained
    # untied: the lookup does no matmul
    n = sum(p.numel() for p in base.parameters()) - base.get_input_embeddings().weight.numel()
    for r in perf:
        tok_s, rss = float(r["perf/tokens_per_sec_per_device"]), float(r["perf/peak_rss_gib/rank0"])
        assert 0 < tok_s < 1e7 and float(r["perf/tokens_per_sec"]) == tok_s  # one device
        assert 0.1 < rss < 64
        # 12N FLOPs per training token: 6N per position, and the forward runs 2 positions per token
        assert float(r["perf/tflops_per_device"]) * 1e12 / tok_s == pytest.approx(12 * n, rel=1e-6)
        assert not r.get("perf/mfu_per_device")  # no known peak FLOP/s for a CPU
    assert list((tmp_path / "wandb").glob("offline-run-*/*.wandb")), "no offline W&B run written"


@pytest.mark.fit
@pytest.mark.subprocess
def test_two_nodes_under_torchrun_reach_the_global_batch_and_log_each_rank(tmp_path, tiny_dirs):
    """What docs/scale.md's torchrun command does, with 2 one-process "nodes" on this machine
    (gloo)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loggers = tmp_path / "loggers.yaml"
    loggers.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "logger": [
                        {
                            "class_path": "lightning.pytorch.loggers.CSVLogger",
                            "init_args": {"save_dir": str(tmp_path), "name": "csv"},
                        }
                    ]
                }
            }
        )
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
        ),
        "WANDB_MODE": "offline",
    }
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "tidar_convert.cli",
                "fit",
                "--config",
                TINY,
                "--config",
                str(loggers),
                "--model.model",
                str(tiny_dirs["qwen3"]),
                "--trainer.devices",
                "1",
                "--trainer.num_nodes",
                "2",
                "--trainer.strategy",
                "ddp",
                "--trainer.max_steps",
                "2",
                "--trainer.log_every_n_steps",
                "1",
                "--trainer.num_sanity_val_steps",
                "0",
                "--global_batch_tokens",
                "512",
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
            ],
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        for rank in (0, 1)
    ]
    errs = [p.communicate(timeout=600)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], errs
    line = (
        "global batch 512 tokens = micro-batch 2 x "
        "seq_len 64 x devices 1 x nodes 2 x accumulation 2"
    )
    assert errs[0].count(line) == 1 and line not in errs[1]  # said once, by rank 0
    rows = [
        r
        for r in csv.DictReader(next((tmp_path / "csv").glob("version_*/metrics.csv")).open())
        if r.get("perf/tokens_per_sec")
    ]
    assert [r["step"] for r in rows] == ["0", "1"]
    for r in rows:
        assert (
            float(r["perf/peak_rss_gib/rank0"]) > 0.1 and float(r["perf/peak_rss_gib/rank1"]) > 0.1
        )
        assert float(r["perf/tokens_per_sec"]) == pytest.approx(
            2 * float(r["perf/tokens_per_sec_per_device"])
        )


def test_flops_inputs(tiny_dirs, monkeypatch):
    import torch

    from tidar_convert.models.loading import load_base
    from tidar_convert.train.callbacks import matmul_params, peak_flops

    # untied: the input embedding is a lookup; tied: it is also the output layer
    for family in ("llama", "qwen2"):
        model, _ = load_base(str(tiny_dirs[family]))
        total, embed = (
            sum(p.numel() for p in model.parameters()),
            model.get_input_embeddings().weight.numel(),
        )
        assert matmul_params(model) == (
            total if model.config.tie_word_embeddings else total - embed
        )
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None  # no MFU without a known peak
    for name, flops in (
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(torch.device("cuda", 0), "bf16-mixed") == flops, name  # dense bf16
