"""Issue 46's rows for the commands around fit: generate, check, bench, GGUF and base-model files,
full disks. Each refuses the bad value in one line with the fix, or does the right thing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_errors import cli_error, export_dir  # noqa: F401 (a fixture)

from tidar_convert.runtime.spec import TiDARSpec


@pytest.mark.parametrize(
    "flags,given",
    [
        (["--top-k", "5"], "--top-k 5"),
        (["--top-p", "0.9"], "--top-p 0.9"),
        (["--top-k", "5", "--top-p", "0.5"], "--top-k 5 --top-p 0.5"),
        (["--seed", "3"], "--seed 3"),
    ],
)
def test_sampling_settings_without_a_temperature_are_refused(
    export_dir,  # noqa: F811  (test_errors' fixture, imported)
    capsys,
    flags,
    given,
):
    line = cli_error(capsys, "generate", "--model", str(export_dir), "--prompt", "x", *flags)
    assert line.startswith(
        f"error: {given} applies only when sampling, and "
        "--temperature is 0 (greedy); pass --temperature > 0"
    )


def test_draft_length_with_mode_ar_is_refused(export_dir, capsys):  # noqa: F811
    line = cli_error(
        capsys,
        "generate",
        "--model",
        str(export_dir),
        "--prompt",
        "x",
        "--mode",
        "ar",
        "--draft-length",
        "3",
    )
    assert "--draft-length 3 with --mode ar: plain autoregressive decoding drafts nothing" in line


@pytest.mark.parametrize("dtype,modes", [(torch.int32, (True, False)), (torch.int16, (True,))])
def test_generate_takes_any_integer_ids(export_dir, dtype, modes):  # noqa: F811
    """int32 ids (numpy, ONNX tokenizers) as tidar=False takes them; TiDAR takes any integer ids."""
    from tidar_convert.exports.folder import load

    model = load(export_dir)
    ids = torch.tensor([[3, 7, 9, 11, 3, 7]])
    for tidar in modes:
        want = model.generate(ids, max_new_tokens=8, do_sample=False, tidar=tidar)
        got = model.generate(ids.to(dtype), max_new_tokens=8, do_sample=False, tidar=tidar)
        assert torch.equal(got.long(), want), (dtype, tidar)
    with pytest.raises(
        ValueError, match=r"input_ids are torch.float32: token ids must be integers"
    ):
        model.generate(ids.float(), max_new_tokens=2, do_sample=False)


def test_check_refuses_a_record_that_is_not_a_bench_record(tiny_dirs, tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"loss": 1.2}))
    line = cli_error(capsys, "check", "--model", str(tiny_dirs["llama"]), "--record", str(other))
    assert f"--record {str(other)!r} is not a bench record with speed figures" in line
    partial = tmp_path / "partial.json"  # speeds but no tokens per forward: was a KeyError
    partial.write_text(
        json.dumps(
            {
                "machine": {"parameters": 10},
                "summary": {"ar": {"tokens_per_s": 1}, "tidar": {"tokens_per_s": 2}},
            }
        )
    )
    assert "is not a bench record" in cli_error(
        capsys, "check", "--model", str(tiny_dirs["llama"]), "--record", str(partial)
    )
    assert f"--record {str(tmp_path)!r} is a folder" in cli_error(
        capsys, "check", "--model", str(tiny_dirs["llama"]), "--record", str(tmp_path)
    )
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert f"--record '{broken}' is not JSON" in cli_error(
        capsys, "check", "--model", str(tiny_dirs["llama"]), "--record", str(broken)
    )
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert "holds a JSON list, not a bench record" in cli_error(
        capsys, "check", "--model", str(tiny_dirs["llama"]), "--record", str(listed)
    )


def write_gguf(path: Path) -> int:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    for name in ("token_embd.weight", "output.weight"):
        w.add_tensor(name, np.ones((612, 49), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size


@pytest.mark.parametrize("keep", [0.3, 0.75, 0.999])
def test_a_truncated_gguf_is_named(tmp_path, capsys, keep):
    from tidar_convert.models.loading import check_gguf

    whole = tmp_path / "whole.gguf"
    size = write_gguf(whole)
    check_gguf(whole)  # a whole file passes
    cut = tmp_path / "model.gguf"
    cut.write_bytes(whole.read_bytes()[: int(size * keep)])
    with pytest.raises(
        ValueError,
        match=(
            rf"'{cut}' is truncated or corrupt \(cut short: {int(size * keep)} "
            r"bytes of the \d+ its tensors need\); download it again"
        ),
    ) as info:
        check_gguf(cut)
    needed = int(str(info.value).split("bytes of the ")[1].split()[0])
    assert size - 64 <= needed <= size  # the end of the last tensor (the file may pad past it)
    header = tmp_path / "header.gguf"
    header.write_bytes(whole.read_bytes()[:40])
    with pytest.raises(
        ValueError,
        match=rf"'{header}' is truncated or corrupt \(40 bytes; its header does not read",
    ):
        check_gguf(header)
    assert f"'{cut}' is truncated or corrupt" in cli_error(capsys, "check", "--model", str(cut))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_the_weights(tokenizer, tmp_path):
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from tidar_convert.models.loading import load_base, load_config_and_tokenizer

    def base(name, rows):
        path = tmp_path / name
        AutoModelForCausalLM.from_config(tiny_config("llama", rows)).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return str(path)

    n = len(tokenizer)
    small = base("small", n - 5)
    message = (
        rf"its config says vocab_size={n - 5}, and its tokenizer "
        rf"has {n} tokens: ids {n - 5}..{n - 1} have no embedding row"
    )
    for load in (load_config_and_tokenizer, load_base):
        with pytest.raises(ValueError, match=message):
            load(small)
    # more rows than tokens (Qwen pads its embedding): fine
    load_config_and_tokenizer(base("padded", n + 64))


@pytest.mark.parametrize("saved", [False, True])
def test_full_disk_advice_resumes_only_where_a_checkpoint_exists(tmp_path, saved):
    from tidar_convert.train.checkpoints import checkpoint_fix

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "epoch=0-step=10.ckpt").write_bytes(b"x")  # not what --ckpt_path last finds
    if saved:
        (folder / "last.ckpt").write_bytes(b"x")
    fix = checkpoint_fix(folder / "last.ckpt")
    assert ("--ckpt_path last" in fix) == saved
    assert saved or "no last checkpoint was saved yet, so it starts from step 0" in fix
    assert fix.count("free space") == 0  # disk_full's own sentence says how much to free


def test_the_full_disk_message_never_contradicts_itself(tmp_path):
    import shutil

    from tidar_convert.exports.disk import disk_full, size_text

    free = shutil.disk_usage(tmp_path).free
    more = str(disk_full(tmp_path / "x", free + (5 << 20), "the export", "choose another --out."))
    assert f"the disk has {size_text(free)}" in more and "Free 5.0 MiB or more there" in more
    less = str(disk_full(tmp_path / "x", 1 << 20, "the export", "choose another --out."))
    assert (
        "more than there was room for while writing it (a quota or another writer" in less
        and "Free space there" in less
    )


def test_a_smoke_bench_leaves_the_card_and_an_earlier_record_alone(tiny_dirs, tmp_path, capsys):
    from tidar_convert.bench import cli as bench
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    m, tok = load_base(str(tiny_dirs["llama"]))
    out = export(m, tok, tmp_path / "tiny", TiDARSpec(4))
    card = (out / "README.md").read_bytes()
    record = Path(
        bench.bench_cmd(
            str(out), max_new_tokens=4, limit=1, out_dir=str(tmp_path / "results"), quality=False
        )
    )
    assert (out / "README.md").read_bytes() == card
    assert "left" in capsys.readouterr().err
    before = record.read_bytes()
    with pytest.raises(
        ValueError,
        match=(
            rf"the record '{record}' exists; pass --name with a new "
            r"name for this run \(make bench NAME=...\), or --overwrite"
        ),
    ):
        bench.bench_cmd(
            str(out), max_new_tokens=4, limit=1, out_dir=str(tmp_path / "results"), quality=False
        )
    assert record.read_bytes() == before
    bench.bench_cmd(
        str(out),
        max_new_tokens=4,
        limit=1,
        out_dir=str(tmp_path / "results"),
        quality=False,
        overwrite=True,
        card=True,
    )
    assert (out / "README.md").read_bytes() != card
    os.remove(record)


def test_a_sweep_json_no_sweep_wrote_is_never_replaced(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text("my notes")
    (tmp_path / "spec.yaml").write_text("a: []\n")
    recipe = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
    line = cli_error(
        capsys,
        "sweep",
        "--spec",
        str(tmp_path / "spec.yaml"),
        "--recipe",
        recipe,
        "--out",
        str(out),
    )
    assert f"--out {out} holds a sweep.json that no sweep wrote" in line
    assert (out / "sweep.json").read_text() == "my notes" and sorted(os.listdir(out)) == [
        "sweep.json"
    ]


@pytest.mark.parametrize("command", ["quality", "bench-serve"])
def test_quality_and_serve_records_are_never_replaced_unasked(
    tmp_path,
    capsys,
    export_dir,  # noqa: F811 (the fixture imported from test_errors)
    command,
):
    record = tmp_path / "mine.json"
    record.write_text("an hour of measuring")
    line = cli_error(capsys, command, "--model", str(export_dir), "--out", str(record))
    assert (
        f"the record {str(record)!r} exists; pass --out "
        "with a new file, or --overwrite to replace it." in line
    )
    assert record.read_text() == "an hour of measuring"
