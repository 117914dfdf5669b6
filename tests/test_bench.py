"""bench.py and bench_gpu.py on tiny random models: fields, exactness checks, plots, perplexity."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import torch

from tidar_convert import bench, bench_gpu

PNG = b"\x89PNG"


@pytest.fixture(scope="module")
def tiny_export(tiny_dirs, tmp_path_factory):
    from tidar_convert.export import export
    from tidar_convert.loading import load_base

    m, tok = load_base(str(tiny_dirs["llama"]))
    # Untrained, so the export's weights equal its base's: the guard must find the same text.
    return export(m, tok, tmp_path_factory.mktemp("bench") / "tiny", block_size=4, alpha=1.0, card={"base_model": str(tiny_dirs["llama"])})


def test_prompts_mix_code_and_text():
    prompts = bench.bench_prompts(limit=6)
    assert [p["kind"] for p in prompts] == ["code", "text"] * 3
    assert prompts[0]["id"] == "HumanEval/0"
    assert len(bench.bench_prompts()) == 164 + len(bench.TEXT_PROMPTS)


def test_bench_json_and_plots(tiny_dirs, tiny_export, tmp_path, capsys):
    path = Path(bench.bench_cmd(str(tiny_export), max_new_tokens=8, limit=3, out_dir=str(tmp_path)))
    assert path == tmp_path / "tiny.json"
    err = capsys.readouterr().err
    assert f"wrote {path}" in err and f"wrote {tmp_path / 'tiny_slots.png'}" in err  # every file written is named
    r = json.loads(path.read_text())

    assert r["block_size"] == 4 and r["prompts"] == 3 and r["perplexity"] is None
    assert {"torch", "threads", "device"} <= set(r["machine"])
    for decoder in bench.DECODERS:
        s = r["summary"][decoder]
        for key in ("new_tokens", "nfe", "seconds", "tokens_per_s", "tokens_per_s_vs_ar", "tokens_per_nfe", "mean_tokens_per_nfe", "all_identical"):
            assert key in s, (decoder, key)
        assert s["all_identical"], f"{decoder} is not token-for-token AR greedy"
    assert r["summary"]["ar"]["tokens_per_s_vs_ar"] == 1.0
    # prompt lookup on the base model: what a user gets without converting, timed in the same run
    base = r["summary"]["base_prompt_lookup"]
    assert base["identical"] is None and base["tokens_per_s_vs_base_prompt_lookup"] == 1.0
    assert r["summary"]["tidar"]["tokens_per_s_vs_base_prompt_lookup"] > 0 and r["summary"]["tidar"]["tokens_per_s_vs_prompt_lookup"] > 0
    # the quality guard on the bench's own outputs; the export's weights are its base's, so same text
    q = r["quality"]
    assert q["base_model"] == str(tiny_dirs["llama"].resolve())
    assert q["passes"] and q["reasons"] == [] and q["distinct2_ratio"] == 1.0
    assert q["humaneval_problems"] == 2 and q["converted"]["pass@1"] == q["base"]["pass@1"]
    assert "note" in q  # 8 new tokens: below what the guard is meant for
    for row in r["rows"]:
        assert row["base_prompt_lookup"]["tokens"] == row["ar"]["tokens"]
        assert row["quality"]["converted"]["text"] == row["quality"]["base"]["text"]
    assert "base_prompt_lookup" in err and "quality: PASS" in err
    assert {row["kind"] for row in r["rows"]} == {"code", "text"}
    for row in r["rows"]:
        assert row["ar"]["nfe"] == row["ar"]["new_tokens"] == 8  # AR: one forward per token
        assert row["prompt_lookup"]["nfe"] <= 8 and row["tidar"]["nfe"] <= 8
        assert all(row[d]["identical_to_ar"] for d in bench.DECODERS)
    # one prefill per prompt, then one histogram entry per TiDAR step
    steps = sum(r["accepted_histogram"].values())
    assert steps == r["summary"]["tidar"]["nfe"] - r["prompts"]
    assert [p["slots"] for p in r["slot_latency"]["points"]] == sorted(set(bench.CPU_SLOTS) | {6, 20, 72})
    assert set(r["slot_latency"]["tidar_step_vs_ar_step"]) == {"2", "4", "8"}
    assert all(v > 0 for v in r["slot_latency"]["tidar_step_vs_ar_step"].values())
    assert set(r["plots"]) == {"tokens_per_s", "accepted", "slots"}
    for png in r["plots"].values():
        assert Path(png).read_bytes()[:4] == PNG
    card = (tiny_export / "README.md").read_text()  # the export's model card shows the measurement
    assert "| tidar |" in card and "k=4, 3 prompts" in card and "Not measured yet" not in card
    assert "| base_prompt_lookup |" in card and "The quality guard passes" in card


def test_export_records_its_base_and_bench_says_when_it_cannot(tiny_dirs, tiny_export, tmp_path, capsys):
    """fit/export record the base (an absolute path here) so bench finds it from any folder; an
    export that does not record one is benched without the guard, and the output says so."""
    from tidar_convert.export import base_source

    assert json.loads((tiny_export / "config.json").read_text())["tidar_base_model"] == str(tiny_dirs["llama"].resolve())
    assert base_source(None) == "embedded" and base_source("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"
    folder = shutil.copytree(tiny_export, tmp_path / "nobase")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["tidar_base_model"]
    (folder / "config.json").write_text(json.dumps(cfg))
    r = json.loads(Path(bench.bench_cmd(str(folder), max_new_tokens=4, limit=1, out_dir=str(tmp_path / "out"))).read_text())
    assert r["quality"] is None and "base_prompt_lookup" not in r["summary"]
    assert "does not record its base model" in capsys.readouterr().err
    # --base names it; quality=False skips the base entirely
    r = json.loads(Path(bench.bench_cmd(str(folder), max_new_tokens=4, limit=1, out_dir=str(tmp_path / "out"), base=str(tiny_dirs["llama"]))).read_text())
    assert r["quality"]["passes"] and "base_prompt_lookup" in r["summary"]
    r = json.loads(Path(bench.bench_cmd(str(tiny_export), max_new_tokens=4, limit=1, out_dir=str(tmp_path / "out"), quality=False)).read_text())
    assert r["quality"] is None and "base_prompt_lookup" not in r["summary"]


def test_bench_eos_at_once(tiny_export, tmp_path):
    """EOS as the very first token: every decoder stops after the prefill, nothing divides by zero."""
    from transformers import AutoTokenizer

    from tidar_convert.export import load

    folder = shutil.copytree(tiny_export, tmp_path / "eos")
    lm, tok = load(folder), AutoTokenizer.from_pretrained(folder)
    firsts = set()
    for p in bench.bench_prompts(limit=2):
        ids = tok(p["text"], return_tensors="pt").input_ids
        firsts.add(int(lm.generate(ids, max_new_tokens=1, do_sample=False, tidar=False, pad_token_id=tok.pad_token_id)[0, -1]))
    gen_file = folder / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = sorted(firsts)
    gen_file.write_text(json.dumps(gen))

    r = json.loads(Path(bench.bench_cmd(str(folder), max_new_tokens=8, limit=2, out_dir=str(tmp_path / "out"))).read_text())
    for decoder in bench.DECODERS:
        assert r["summary"][decoder]["new_tokens"] == 2 and r["summary"][decoder]["nfe"] == 2, decoder
        assert r["summary"][decoder]["all_identical"]
    assert sum(r["accepted_histogram"].values()) == 0
    assert all(Path(p).exists() for p in r["plots"].values())


def test_bench_rejects_bad_input(tiny_dirs, tiny_export):
    with pytest.raises(ValueError, match="k=1"):
        bench.bench_cmd(str(tiny_export), k=1)
    with pytest.raises(ValueError, match="ppl_data"):
        bench.bench_cmd(str(tiny_export), ppl_base=str(tiny_dirs["llama"]))
    with pytest.raises(ValueError, match="not a TiDAR export"):
        bench.bench_cmd(str(tiny_dirs["llama"]))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        bench.bench_cmd("/nonexistent/model")
    with pytest.raises(ValueError, match="humaneval_timeout=0"):
        bench.bench_cmd(str(tiny_export), humaneval_timeout=0)


def hand_perplexity(model, tokenizer, texts, seq_len, max_tokens):
    """exp(mean NLL), written out: pack with EOS, cut chunks, -log p(next) at every position."""
    ids = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ids = ids[:max_tokens]
    nll = []
    with torch.no_grad():
        for start in range(0, len(ids), seq_len):
            chunk = torch.tensor(ids[start : start + seq_len])
            if len(chunk) < 2:
                continue
            logp = model(chunk[None]).logits[0].float().log_softmax(-1)
            nll += [-logp[i, chunk[i + 1]] for i in range(len(chunk) - 1)]
    return math.exp(torch.stack(nll).mean().item())


def test_perplexity_is_exp_mean_nll(tiny_dirs, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog.", "import os\nprint(os.getcwd())\n"]
    n_tokens = sum(len(tokenizer(t, add_special_tokens=False).input_ids) + 1 for t in texts)
    max_tokens = n_tokens - 5  # cut inside the last document, and leave a short last chunk
    got = bench.perplexity(model, tokenizer, texts, seq_len=8, max_tokens=max_tokens, progress=False)
    assert got == pytest.approx(hand_perplexity(model, tokenizer, texts, 8, max_tokens), rel=1e-5)
    with pytest.raises(ValueError, match="seq_len=1"):
        bench.perplexity(model, tokenizer, texts, seq_len=1)


def test_eval_ppl_cmd_on_a_folder(tiny_dirs, tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    docs = ["Call the function twice and compare the results.\n", "The river rose through the night and the town slept.\n"]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    ppl = bench.eval_ppl_cmd(str(tiny_dirs["llama"]), str(tmp_path), seq_len=16, max_tokens=64)
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    assert ppl == pytest.approx(hand_perplexity(model, tokenizer, docs, 16, 64), rel=1e-4)
    assert "perplexity" in capsys.readouterr().out


def test_bench_gpu_dry_run(tmp_path):
    out = bench_gpu.main(["--dry-run", "--out", str(tmp_path / "gpu.json")])
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["machine"]["device"] == "cpu"
    assert [p["slots"] for p in r["slots"]["by_impl"]["sdpa"]] == list(bench_gpu.DRY_PLAN.slots)
    decode = r["decode"]["by_impl"]["sdpa"]
    assert [row["k"] for row in decode] == [4, 8, 16] and [row["slots"] for row in decode] == [20, 72, 272]
    assert all(row["tidar_step_ms"] > 0 and row["ar_step_ms"] > 0 for row in decode)
    assert r["train"]["ar"]["tokens_per_s"] > 0 and r["train"]["tidar"]["tokens_per_s"] > 0
    assert set(r) >= {"slots", "decode", "train", "conversion", "machine", "model", "seconds"}


def test_cpu_default_is_minutes_and_gpu_default_is_every_prompt():
    assert bench.default_limit(torch.device("cuda")) is None
    n = bench.default_limit(torch.device("cpu"))
    prompts = bench.bench_prompts(n)
    assert n == bench.CPU_DEFAULT_PROMPTS < len(bench.bench_prompts())
    assert {p["kind"] for p in prompts} == {"code", "text"}


def test_progress_lines_when_not_a_terminal(capsys):
    from tidar_convert.progress import duration, progress

    assert list(progress(range(3), "work", interval=0.0)) == [0, 1, 2]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("work: 1/3 (33%)") and "ETA" in lines[0]
    assert lines[-1].startswith("work: 3/3 (100%)") and "took" in lines[-1]
    assert (duration(7.2), duration(125), duration(3725)) == ("7s", "2m05s", "1h02m")
