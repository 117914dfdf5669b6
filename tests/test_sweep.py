"""`tidar-convert sweep`: arms as fit subprocesses, learning curves in sweep.json/png, resuming,
bad input."""

import json
import math
from pathlib import Path

import pytest
import yaml

from tidar_convert.cli import main

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
SPEC = Path(__file__).parents[1] / "recipes" / "sweeps" / "smollm2-cpu-levers.yaml"


def sweep(tmp_path, model_dir, spec: dict | str, *extra):
    path = tmp_path / "spec.yaml"
    path.write_text(spec if isinstance(spec, str) else json.dumps(spec))  # JSON is YAML
    fit_args = json.dumps(
        [
            "--model.model",
            str(model_dir),
            "--data.val_batches",
            "1",
            "--model.val_decode_prompts",
            "1",
        ]
    )
    main(
        [
            "sweep",
            "--spec",
            str(path),
            "--recipe",
            RECIPE,
            "--out",
            str(tmp_path / "sweep"),
            "--max-steps",
            "2",
            "--val-check-interval",
            "1",
            "--fit-args",
            fit_args,
            *extra,
        ]
    )
    return tmp_path / "sweep"


@pytest.mark.subprocess
def test_sweep_end_to_end_a_failing_arm_does_not_stop_the_others_and_a_rerun_skips_finished_arms(
    tmp_path, tiny_dirs, capsys, monkeypatch
):
    arms = {
        "typo": ["--model.no_such_flag", "1"],
        "hard": [],
        "soft": ["--model.distill_weight", 0.5],
    }
    # one arm failed: reported, and the sweep says so in its exit status
    with pytest.raises(SystemExit) as e:
        sweep(tmp_path, tiny_dirs["llama"], arms)
    assert e.value.code == 1
    err = capsys.readouterr().err
    out = tmp_path / "sweep"
    assert "[1/3] typo: failed" in err and "unrecognized arguments: --model.no_such_flag" in err
    assert "[2/3] hard: starting" in err and "[3/3] soft: done" in err
    assert f"wrote {out / 'sweep.json'}" in err and f"wrote {out / 'sweep.png'}" in err
    result = json.loads((out / "sweep.json").read_text())
    by_arm = {a["arm"]: a for a in result["arms"]}
    assert by_arm["typo"]["status"] == "failed" and "no_such_flag" in by_arm["typo"]["error"]
    for name in ("hard", "soft"):
        arm = by_arm[name]
        assert arm["status"] == "done" and arm["steps"] == 2 and arm["wall_s"] > 0
        # tiny.yaml: batch 2 x seq_len 64, one device, no accumulation
        assert arm["tokens_per_step"] == 2 * 64
        curve = arm["curve"]
        assert [p["step"] for p in curve] == [1, 2]
        assert [p["tokens"] for p in curve] == [128, 256]
        assert all(
            math.isfinite(p["tokens_per_nfe"]) and 1.0 <= p["tokens_per_nfe"] <= 4.0 for p in curve
        )
        assert all(math.isfinite(p["loss_ar"]) and p["wall_s"] > 0 for p in curve)
        assert (out / "arms" / name / "config.yaml").is_file() and (
            out / "arms" / name / "fit.log"
        ).is_file()
    assert (
        "loss_distill" in by_arm["soft"]["curve"][0]
        and "loss_distill" not in by_arm["hard"]["curve"][0]
    )
    assert (out / "sweep.png").stat().st_size > 10_000

    # Again: the finished arms are skipped without starting a process, and their results are kept.
    import subprocess

    real_popen = subprocess.Popen

    def no_process(*args, **kwargs):
        raise AssertionError(f"a finished arm was run again: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    before = {n: (out / "arms" / n / "arm.json").read_text() for n in ("hard", "soft")}
    sweep(tmp_path, tiny_dirs["llama"], arms, "--arms", "[hard, soft]")
    err = capsys.readouterr().err
    assert (
        "[1/2] hard: done earlier" in err
        and "[2/2] soft: done earlier" in err
        and f"wrote {out / 'sweep.json'}" in err
    )
    assert {n: (out / "arms" / n / "arm.json").read_text() for n in ("hard", "soft")} == before
    result = json.loads((out / "sweep.json").read_text())
    assert [(a["arm"], a["status"], len(a["curve"])) for a in result["arms"]] == [
        ("typo", "failed", 0),
        ("hard", "done", 2),
        ("soft", "done", 2),
    ]

    # An arm cut short (as SIGTERM leaves it: status interrupted, last.ckpt kept) resumes from its
    # checkpoint.
    state = json.loads((out / "arms" / "hard" / "arm.json").read_text())
    (out / "arms" / "hard" / "arm.json").write_text(json.dumps({**state, "status": "interrupted"}))
    runs = []
    monkeypatch.setattr(
        subprocess, "Popen", lambda cmd, **kw: runs.append(cmd) or real_popen(cmd, **kw)
    )
    sweep(tmp_path, tiny_dirs["llama"], arms, "--arms", "[hard, soft]")
    assert "[1/2] hard: resuming from" in capsys.readouterr().err
    assert len(runs) == 1 and runs[0][-2:] == ["--ckpt_path", "last"]
    hard = json.loads((out / "sweep.json").read_text())["arms"][1]
    assert (
        hard["status"] == "done"
        and [p["step"] for p in hard["curve"]] == [1, 2]
        and hard["wall_s"] > state["wall_s"]
    )

    # A finished arm whose settings changed is refused, not silently reused or mixed.
    with pytest.raises(SystemExit):
        sweep(tmp_path, tiny_dirs["llama"], {**arms, "hard": ["--model.alpha", "2.0"]})
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "arm 'hard'" in err[0]
        and "other settings" in err[0]
        and "another --out" in err[0]
    )


@pytest.mark.parametrize(
    "spec,message",
    [
        (None, "does not exist; pass --spec a YAML file"),
        ("", "holds no arms; write one `name: [--flag, value, ...]` per arm"),
        ("{}", "holds no arms"),
        ("[a, b]", "is a list, not a mapping of arm name -> list of flags"),
        (
            "soft: --model.distill_weight 1.0\n",
            "arm 'soft' in {spec} is a str ('--model.distill_weight 1.0'), not "
            "a list of flags; write it as soft: [--model.distill_weight, 1.0]",
        ),
        (
            "a: [--model.alpha, {x: 1}]\n",
            "item {'x': 1} is a dict; each item is one command-line word",
        ),
        ("'a/b': []\n", "arm name 'a/b'"),
        (
            "a: [--trainer.default_root_dir, x]\n",
            "sets --trainer.default_root_dir: the sweep sets it for every arm",
        ),
        ("a: [--out=x]\n", "sets --out"),
        ("a: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_specs_are_refused_in_one_line_naming_the_value_and_the_fix(
    tmp_path, capsys, spec, message
):
    path = tmp_path / "spec.yaml"
    if spec is not None:
        path.write_text(spec)
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--spec", str(path), "--recipe", RECIPE, "--out", str(tmp_path / "sweep")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert message.replace("{spec}", str(path)) in err[0] and (
        str(path) in err[0] or "arm name" in err[0]
    )
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--recipe", "nope.yaml"], "recipe 'nope.yaml' does not exist; pass --recipe"),
        (["--max-steps", "0"], "--max_steps 0: must be >= 1"),
        (["--arms", "[soft]"], "--arms soft: not in"),
        (["--fit-args", "[--ckpt_path, last]"], "--fit_args sets --ckpt_path"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys, extra, message):
    path = tmp_path / "spec.yaml"
    path.write_text("hard: []\n")
    with pytest.raises(SystemExit):
        main(
            [
                "sweep",
                "--spec",
                str(path),
                "--recipe",
                RECIPE,
                "--out",
                str(tmp_path / "sweep"),
                *extra,
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "sweep").exists()


def test_a_folder_that_is_not_a_sweep_is_refused(tmp_path, capsys):
    (tmp_path / "spec.yaml").write_text("hard: []\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(
            ["sweep", "--spec", str(tmp_path / "spec.yaml"), "--recipe", RECIPE, "--out", str(mine)]
        )
    assert "not an earlier sweep" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_curve_merges_resumed_attempts_and_counts_every_token(tmp_path):
    """A resumed arm has one csv/version_N per attempt: the latest wins per step. Tokens per step
    come from the arm's saved config: batch x seq_len x accumulation x devices x nodes."""
    from tidar_convert.bench.sweep_curves import read_curve, tokens_per_step

    arm = tmp_path / "arm"
    for version, rows in (
        (0, ["0,1,9.0,", "0,3,2.0,1.5"]),
        (1, ["0,3,1.0,1.25", "0,5,0.5,1.75", "0,7,nan,"]),
    ):
        d = arm / "csv" / f"version_{version}"
        d.mkdir(parents=True)
        (d / "metrics.csv").write_text(
            "epoch,step,val/loss,val/tokens_per_nfe\n" + "\n".join(rows) + "\n"
        )
    assert read_curve(arm) == {
        2: {"loss": 9.0},
        4: {"loss": 1.0, "tokens_per_nfe": 1.25},
        6: {"loss": 0.5, "tokens_per_nfe": 1.75},
        8: {"loss": None},
    }
    (arm / "config.yaml").write_text(
        "model: {draft_length: 8, val_decode_draft_length: 4}\n"
        "data: {batch_size: 2, seq_len: 256}\n"
        "trainer: {accumulate_grad_batches: 4, devices: [0, 1], num_nodes: 2, max_steps: 100}\n"
    )
    n, used = tokens_per_step(arm / "config.yaml")
    assert (
        n == 2 * 256 * 4 * 2 * 2 and used["draft_length"] == 8 and used["decode_draft_length"] == 4
    )


def test_an_attempts_clock_comes_from_its_metrics_not_its_log(tmp_path):
    """Validation times and trained steps are read from the CSV rows callbacks.RunClock logs (a
    validation at steps done s is logged at step s - 1), so a changed progress line cannot
    break them."""
    from tidar_convert.bench.sweep_curves import read_clock

    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,time/steps_done,time/val_s,val/loss\n"
        "0,0,,,2.0\n0,0,,3.5,\n0,1,,7.25,\n0,1,2,,\n"
    )
    assert read_clock(path) == ({1: 3.5, 2: 7.25}, 2)
    # killed before training ended: no steps_done
    path.write_text("epoch,step,time/val_s\n0,4,11.0\n")
    assert read_clock(path) == ({5: 11.0}, None)


def test_dry_run_prints_each_arms_command_and_writes_nothing(tmp_path, capsys):
    import shlex

    (tmp_path / "spec.yaml").write_text(
        "hard: []\nk8: [--model.draft_length, 8, --model.val_decode_draft_length, 4]\n"
    )
    main(
        [
            "sweep",
            "--spec",
            str(tmp_path / "spec.yaml"),
            "--recipe",
            RECIPE,
            "--out",
            str(tmp_path / "sweep"),
            "--max-steps",
            "7",
            "--dry-run",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    k8 = shlex.split(lines[1])
    assert (
        k8[k8.index("--trainer.max_steps") + 1] == "7"
        and k8[k8.index("--model.draft_length") + 1] == "8"
    )
    assert k8[k8.index("--trainer.default_root_dir") + 1] == str(
        (tmp_path / "sweep" / "arms" / "k8").resolve()
    )
    assert not (tmp_path / "sweep").exists()


def test_the_smollm2_lever_spec_is_valid():
    from tidar_convert.bench.sweep import load_spec

    arms = load_spec(str(SPEC))
    assert {"lora", "soft", "greedy-0", "full-ft", "block-8"} <= set(arms)
    # compared at the same decode k
    assert arms["block-8"][arms["block-8"].index("--model.val_decode_draft_length") + 1] == "4"
    assert {
        "greedy-2of3",
        "greedy-all",
        "greedy-diff-only",
        "offset-front",
        "offset-drafts-only",
    } <= set(arms)
    recipe = yaml.safe_load((SPEC.parents[1] / "smollm2-135m-cpu-lora.yaml").read_text())
    train_tokens = (
        recipe["trainer"]["max_steps"] * recipe["data"]["seq_len"] * recipe["data"]["batch_size"]
    )
    for name, flags in arms.items():
        value = dict(zip(flags[::2], flags[1::2]))
        # enough greedy documents (32 prompt + new tokens each) for the share all run long
        if "--data.greedy_share" in value:
            per_doc = 32 + recipe["data"]["greedy_new_tokens"]
            assert (
                int(value["--data.greedy_docs"]) * per_doc
                >= float(value["--data.greedy_share"]) * train_tokens
            ), name
        if "--model.diff_offset_weights" in value:  # one weight per offset of the recipe's block
            assert (
                len(yaml.safe_load(value["--model.diff_offset_weights"]))
                == recipe["model"]["draft_length"]
            ), name


def test_val_decode_draft_length_decodes_at_that_k(tiny_dirs):
    import torch

    from tidar_convert.train.module import TiDARModule

    m = TiDARModule(model=str(tiny_dirs["llama"]), draft_length=8, val_decode_draft_length=2)
    m.configure_model()  # outside a Trainer the module builds its model when asked
    assert (
        1.0
        <= m.decode_tokens_per_nfe(torch.randint(3, 300, (1, 40)), prompt_len=8, new_tokens=8)
        <= 2.0
    )
    assert max(m.model.tidar_stats["accepted"]) <= 2
    with pytest.raises(ValueError, match="val_decode_draft_length=1"):
        TiDARModule(model=str(tiny_dirs["llama"]), val_decode_draft_length=1)
