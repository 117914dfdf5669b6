"""The command line as a user types it: generate (text and --json), export, and its errors."""

import json
import re
import shutil

import pytest
import torch
from helpers import cycle_batch

from tidar_convert import export
from tidar_convert.cli import main
from tidar_convert.runtime.spec import TiDARSpec


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    model, tok = trained["llama"]
    return export(model, tok, tmp_path_factory.mktemp("cli") / "tidar", TiDARSpec(4))


def run_json(capsys, *args):
    main(["generate", *args, "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# its export fixture converts a model (make test runs it; make test-fast skips it)
@pytest.mark.slow
def test_generate_json_same_text_in_tidar_and_ar_mode(exported, trained, capsys):
    _, tok = trained["llama"]
    prompt = tok.decode(cycle_batch(1, 6, seed=1)[0])
    common = [
        "--model",
        str(exported),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "24",
        "--no-chat-template",
    ]
    td = run_json(capsys, *common, "--mode", "tidar")
    ar = run_json(capsys, *common, "--mode", "ar")
    assert td["text"] == ar["text"] and td["new_tokens"] == ar["new_tokens"] > 0
    assert set(td) == {"text", "new_tokens", "nfe", "tokens_per_nfe", "seconds", "device"}
    assert td["device"] == "cpu"
    assert td["nfe"] < ar["nfe"] and td["tokens_per_nfe"] > 1.5
    runs = [
        ("tidar", "--top-p"),
        ("tidar", "--top_p"),
        ("tidar", "--top-p"),
        ("ar", "--top-p"),
        ("ar", "--top_p"),
    ]
    sampled = [
        run_json(
            capsys, *common, "--temperature", "0.8", top_p, "0.9", "--seed", "3", "--mode", mode
        )["text"]
        for mode, top_p in runs
    ]
    # seeded: the same text every run, under the default (cost) plan too
    assert len(set(sampled[:3])) == 1 and len(set(sampled[3:])) == 1
    stock = run_json(capsys, *common, "--mode", "tidar", "--pack-weights", "false")
    assert stock["text"] == td["text"]  # PyTorch's stock product: the same greedy tokens


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def chat_export(trained, tmp_path_factory):
    model, tok = trained["llama"]
    tok.chat_template = CHAT_TEMPLATE  # the tiny tokenizer has none
    try:
        return export(model, tok, tmp_path_factory.mktemp("cli-chat") / "tidar", TiDARSpec(4))
    finally:
        tok.chat_template = None


def test_generate_chat_renders_the_prompt_as_the_server_does(chat_export, capsys):
    """--chat: one user message through the chat template with the assistant's turn opened, the ids
    `transformers serve` decodes for /v1/chat/completions: the text equals plain AR's on the
    template applied by hand, in both modes, and differs from the raw prompt's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "def f(x):\n    return x"
    tok = AutoTokenizer.from_pretrained(chat_export)
    model = AutoModelForCausalLM.from_pretrained(chat_export)  # no remote code: transformers' AR
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    assert tok.decode(ids[0]).endswith("assistant:")
    with torch.no_grad():
        expected = tok.decode(
            model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :],
            skip_special_tokens=True,
        )
    common = ["--model", str(chat_export), "--prompt", prompt, "--max-new-tokens", "16"]
    assert run_json(capsys, *common, "--chat", "--mode", "ar")["text"] == expected
    assert run_json(capsys, *common, "--chat")["text"] == expected  # TiDAR: the same greedy text
    # the default applies the template where there is one
    assert run_json(capsys, *common)["text"] == expected
    assert run_json(capsys, *common, "--no-chat-template")["text"] != expected


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--chat"], "has no chat template.*drop --chat"),
        (["--chat", "--no-chat-template"], "contradict each other"),
    ],
)
def test_generate_chat_refusals(exported, capsys, flags, message):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(exported), "--prompt", "x", *flags])
    assert re.search(message, capsys.readouterr().err)


def test_generate_plain_text_output(exported, capsys):
    main(["generate", "--model", str(exported), "--prompt", "def f(x):", "--max_new_tokens", "5"])
    captured = capsys.readouterr()
    assert "tokens/NFE" in captured.err and captured.out.strip()


@pytest.mark.fit
def test_export_from_checkpoint(tmp_path, tiny_dirs, capsys):
    from pathlib import Path

    recipe = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
    run = tmp_path / "run"
    main(
        [
            "fit",
            "--config",
            recipe,
            "--model.model",
            str(tiny_dirs["llama"]),
            "--trainer.max_steps",
            "10",
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(run),
        ]
    )
    main(
        [
            "export",
            "--checkpoint",
            str(run / "checkpoints" / "last.ckpt"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert f"exported TiDAR model to {tmp_path / 'out'}" in capsys.readouterr().err
    card = (tmp_path / "out" / "README.md").read_text()
    assert "steps: 10" in card and "max_steps: 10" in card  # the step count and the recipe it ran
    with pytest.raises(SystemExit):  # an earlier export is replaced only on request
        main(
            [
                "export",
                "--checkpoint",
                str(run / "checkpoints" / "last.ckpt"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert "pass --overwrite" in capsys.readouterr().err
    main(
        [
            "export",
            "--checkpoint",
            str(run / "checkpoints" / "last.ckpt"),
            "--out",
            str(tmp_path / "out"),
            "--overwrite",
        ]
    )
    from tidar_convert import load

    m = load(tmp_path / "out")
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(
        m.generate(ids, max_new_tokens=6, do_sample=False),
        m.generate(ids, max_new_tokens=6, do_sample=False, tidar=False),
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "x", "--max_new_tokens", "0"], "max_new_tokens=0"),
        (["--prompt", "x", "--mode", "fast"], "mode='fast'"),
        (["--prompt", "x", "--draft-length", "1"], "--draft-length=1"),
    ],
)
def test_generate_errors(exported, capsys, args, message):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(exported), *args])
    assert message in capsys.readouterr().err


def test_generate_refuses_a_plain_model(tiny_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_dirs["llama"]), "--prompt", "x"])
    assert "not a TiDAR export" in capsys.readouterr().err


def test_export_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "o")])
    assert "does not exist" in capsys.readouterr().err


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "usage: tidar-convert {fit,validate,check,export,merge,generate,bench,bench-serve,"
        "bench-batches,bench-exactness,bench-gpu,bench-recurrent,bench-token-identity,eval-ppl,"
        "quality,sweep,distill} ..."
    )
    assert "`tidar-convert fit --help` lists them" in out
    # each command's summary, from its docstring
    assert "Generate with an exported TiDAR model." in out


@pytest.mark.subprocess
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_the_installed_distributions(flag, capsys):
    from importlib.metadata import version
    from pathlib import Path

    import tidar_convert

    with pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tidar-convert {version('tidar-convert')}"
    assert tidar_convert.__version__ == version("tidar-convert")
    # the package says it is typed (PEP 561), and the wheel ships the marker (pyproject.toml)
    assert (Path(tidar_convert.__file__).parent / "py.typed").is_file()


def test_the_top_level_help_imports_no_torch():
    """`tidar-convert --help` answers at once: the commands' modules (torch, transformers,
    Lightning) are imported only when a command runs."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom tidar_convert.cli import main\ntry:\n    main(['--help'])\n"
        "except SystemExit:\n    pass\nprint(sorted(m for m in ('torch', "
        "'transformers', 'lightning', 'jsonargparse') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", (
        done.stdout + done.stderr
    )


@pytest.mark.fit
def test_a_checkpoint_records_its_base_model_absolute(tmp_path, tiny_dirs, monkeypatch, capsys):
    """fit from the model's parent folder with `./name`: the checkpoint records the folder absolute,
    so a resume there with the same spelling is the same model, and export runs from any folder;
    --model replaces what a checkpoint records."""
    from pathlib import Path

    recipe = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
    folder, run = tiny_dirs["llama"], tmp_path / "run"
    monkeypatch.chdir(folder.parent)
    args = [
        "fit",
        "--config",
        recipe,
        "--model.model",
        f"./{folder.name}",
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(run),
        "--model.val_decode_prompts",
        "0",
        "--trainer.num_sanity_val_steps",
        "0",
    ]
    main([*args, "--trainer.max_steps", "1"])
    ckpt = run / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["hyper_parameters"]["model"] == str(folder)
    # the same model, spelt as at first: resumed
    main([*args, "--trainer.max_steps", "2", "--ckpt_path", str(ckpt)])
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2
    monkeypatch.chdir(tmp_path)
    main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tidar"]["base_model"] == str(
        folder
    )
    copy = tmp_path / "base"
    shutil.copytree(folder, copy)
    main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out2"), "--model", "base"])
    assert json.loads((tmp_path / "out2" / "config.json").read_text())["tidar"][
        "base_model"
    ] == str(copy)


# --------------------------------------------------------------------------------------------
# Issue 48: W&B online or offline is W&B's own login check, for the server it is set to (a
# self-hosted one too), never a search of ~/.netrc for api.wandb.ai; WANDB_MODE wins.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """A HOME, working folder and environment with no W&B account in them."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
                 "WANDB_CONFIG_DIR", "NETRC"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    import wandb

    wandb.teardown()  # the next test's W&B reads its own environment


def mode_chosen():
    import os

    from tidar_convert.cli import _configure_wandb

    _configure_wandb()
    return os.environ.get("WANDB_MODE")


def test_wandb_logs_online_with_a_netrc_entry_for_its_self_hosted_server(wandb_home, monkeypatch):
    netrc = wandb_home / ".netrc"
    netrc.write_text(f"machine wandb.example.com\n  login user\n  password {'a' * 40}\n")
    netrc.chmod(0o600)
    assert mode_chosen() == "offline"  # an entry for another server than W&B's is no login
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert mode_chosen() is None  # left to W&B: online


def test_wandb_is_offline_without_an_account_and_online_with_a_key(wandb_home, monkeypatch):
    assert mode_chosen() == "offline"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    assert mode_chosen() is None


@pytest.mark.parametrize("mode", ["online", "disabled", "offline"])
def test_the_users_wandb_mode_wins(wandb_home, monkeypatch, mode):
    monkeypatch.setenv("WANDB_MODE", mode)
    assert mode_chosen() == mode
