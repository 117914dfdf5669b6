"""Families: mechanisms from the config (families.check), the attention implementation following the
model (eager where SDPA is refused), the family matrix (tests/family_matrix.py) and the tables
generated from it (docs/families.md, the README's "Supported models")."""

import json
import re
from pathlib import Path

import family_matrix
import pytest
import torch
from family_matrix import read_table, tiny_config
from helpers import tiny_config as helper_config
from transformers import AutoConfig

from tidar_convert import cli
from tidar_convert.models.families import check, require
from tidar_convert.models.loading import model_from_config
from tidar_convert.runtime import layout
from tidar_convert.runtime.forward import forward

README = Path(__file__).resolve().parent.parent / "README.md"
# What CI decodes: the families users convert in late 2026 and one of each mechanism (MoE, MLA,
# partial rotary, scaled logits, NoPE layers, chunked and mixed sliding layers, eager attention).
# The whole matrix is the slow test below, and `tests/family_matrix.py --write` regenerates the doc.
CI_ENTRIES = (
    "llama",
    "llama4_text",
    "gpt_oss",
    "gemma2",
    "gemma3_text",
    "gemma4_text",
    "deepseek_v3",
    "olmo3",
    "smollm3",
    "ministral",
    "glm4",
    "granite",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "cohere2",
    "gpt_neox",
    # recurrent layers, one of each kind: a gated delta net, Mamba 2 beside attention, short
    # convolutions, Mamba 1 (token by token where seeded)
    "qwen3_5_text",
    "nemotron_h",
    "lfm2",
    "jamba",
)


def models_by_implementation(tokenizer):
    torch.manual_seed(0)
    config = helper_config("llama", len(tokenizer) + 2)
    sdpa = model_from_config(config, attn_implementation="sdpa").eval()
    eager = model_from_config(config, attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    return sdpa, eager


def test_eager_equals_sdpa_on_the_training_mask(tokenizer):
    """The dense mask reaches eager attention in the form it adds to the scores: the same logits as
    SDPA's boolean mask, over both halves of the training layout."""
    sdpa, eager = models_by_implementation(tokenizer)
    ids = torch.randint(3, 300, (2, 16))
    mask_mod = layout.train_mask_mod(16, 4)
    with torch.no_grad():
        out = {
            impl: m(
                input_ids=layout.train_inputs(ids, 1),
                position_ids=layout.train_position_ids(ids),
                attention_mask=layout.build_mask(mask_mod, 2, 32, 32, impl, "cpu"),
            ).logits
            for impl, m in (("sdpa", sdpa), ("eager", eager))
        }
    torch.testing.assert_close(out["eager"], out["sdpa"], rtol=1e-5, atol=1e-5)
    assert layout.build_mask(mask_mod, 2, 32, 32, "eager", "cpu").dtype == torch.float32


def test_eager_equals_sdpa_on_a_decode_step(tokenizer):
    """A decode step after a left-padded cache (decode_step_mask and forward.forward, as the engine
    runs them): the same logits on every slot, causal and mask groups."""
    from transformers import DynamicCache

    sdpa, eager = models_by_implementation(tokenizer)
    prompt = torch.randint(3, 300, (2, 6))
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, :2] = False  # left padding
    step = torch.randint(3, 300, (2, 3))
    results = {}
    with torch.no_grad():
        for impl, m in (("sdpa", sdpa), ("eager", eager)):
            cache = DynamicCache()
            pos = (valid.cumsum(1) - 1).clamp(min=0)
            prefill = layout.for_implementation(
                layout.to_dense(layout.decode_mask_mod(0, 6, 4, 6, valid), 2, 6, 6), impl
            )
            forward(m, cache, prompt, pos, prefill)
            start = valid.sum(1)
            tokens = torch.cat([step, torch.full((2, 4), 1)], 1)
            positions = layout.decode_position_ids(start, 3, 4, 1, (2,))
            mask = layout.decode_step_mask(valid, 3, 4, (2,), impl)
            results[impl] = forward(m, cache, tokens, positions, mask, read=list(range(7))).rows(
                0, 7
            )
    torch.testing.assert_close(results["eager"], results["sdpa"], rtol=1e-5, atol=1e-5)


def verdict_of(model_type, **kw):
    return check(AutoConfig.for_model(model_type, **kw))


def test_check_names_the_mechanism():
    assert verdict_of("llama").converts and verdict_of("llama").attn_implementation == "sdpa"
    gemma2 = verdict_of("gemma2")
    assert (
        gemma2.converts
        and gemma2.attn_implementation == "eager"
        and "logit softcapping" in gemma2.mechanisms
    )
    # recurrent layers convert where their mixer keeps its state through the cache
    # (runtime/recurrent.py): a gated delta net, short convolutions, Mamba 1 and 2 (no attention
    # at all: the state is its only position)
    for model_type in ("qwen3_5_text", "qwen3_next", "jamba", "falcon_h1", "zamba2"):
        verdict = verdict_of(model_type)
        assert verdict.converts and "recurrent layers" in verdict.mechanisms, model_type
    lfm2 = verdict_of("lfm2", num_hidden_layers=2, full_attn_idxs=[1])  # a short-convolution layer
    assert lfm2.converts and "recurrent layers" in lfm2.mechanisms
    mamba = verdict_of("mamba")
    assert mamba.converts and "no attention layers" in mamba.mechanisms
    # state in structures of its own: refused, naming the mechanism
    for model_type in ("minimax", "recurrent_gemma", "xlstm"):
        assert re.search(
            rf"model_type='{model_type}' has recurrent state outside the cache: .*"
            "through transformers' cache interface",
            verdict_of(model_type).reason,
        ), model_type
    # learned absolute positions, looked up by position_ids: repeated like RoPE's
    gpt2 = verdict_of("gpt2")
    assert gpt2.converts and "absolute positions" in gpt2.mechanisms
    assert "has no position_ids" in verdict_of("bloom").reason  # ALiBi
    # its forward takes no cache: a permute error if forced
    assert "has no KV cache" in verdict_of("openai-gpt").reason
    bart = verdict_of("bart")
    assert not bart.decoder_only and "not a decoder-only causal LM" in bart.reason
    wrapper = verdict_of("qwen3_5")
    # the fix: its text model
    assert not wrapper.decoder_only and "model_type='qwen3_5_text'" in wrapper.reason
    with pytest.raises(
        ValueError, match="^model_type='minimax' has recurrent state outside the cache"
    ):
        require(AutoConfig.for_model("minimax"))


def test_check_command_reads_only_the_config(tmp_path, capsys):
    """A folder with nothing but config.json: the verdict, the parameter count, memory per
    device."""
    AutoConfig.for_model(
        "qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
    ).save_pretrained(tmp_path / "ok")
    cli.main(["check", "--model", str(tmp_path / "ok"), "--devices", "2", "--json"])
    facts = json.loads(capsys.readouterr().out)
    assert facts["converts"] and facts["mechanisms"] == ["rotary"]
    assert 100_000 < facts["parameters"] < 300_000
    full = facts["memory_per_device_gib"][
        "full fine-tune, fp32 (weights, grads, AdamW's two moments)"
    ]
    assert full == round(facts["parameters"] * 16 / 2 / 2**30, 2)
    AutoConfig.for_model(
        "recurrent_gemma", hidden_size=64, num_hidden_layers=2, vocab_size=1000
    ).save_pretrained(tmp_path / "rnn")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--model", str(tmp_path / "rnn")])
    assert exit_.value.code == 1 and "has recurrent state outside the cache" in (
        capsys.readouterr().out
    )


def test_check_scales_decode_speed_from_a_bench_record(tmp_path, capsys):
    """tokens/s of a record's model, scaled by parameter count to the checked one (decode at batch 1
    reads every weight once a forward); the record named; a missing record named with its fix."""
    AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ).save_pretrained(tmp_path / "m")
    cli.main(["check", "--model", str(tmp_path / "m"), "--json"])
    n = json.loads(capsys.readouterr().out)["parameters"]
    record = {
        "machine": {
            "parameters": 2 * n,
            "device": "cpu",
            "device_name": "x86_64",
            "dtype": "torch.float32",
            "threads": 2,
        },
        "summary": {
            "ar": {"tokens_per_s": 10.0, "tokens_per_nfe": 1.0},
            "tidar": {"tokens_per_s": 18.0, "tokens_per_nfe": 2.2},
        },
    }
    (tmp_path / "r.json").write_text(json.dumps(record))
    cli.main(
        ["check", "--model", str(tmp_path / "m"), "--json", "--record", str(tmp_path / "r.json")]
    )
    speed = json.loads(capsys.readouterr().out)["expected_speed"]
    assert (
        speed["tokens_per_s"] == {"ar": 20.0, "tidar": 36.0}
        and speed["tidar_tokens_per_forward"] == 2.2
    )  # half the parameters: twice the speed
    cli.main(["check", "--model", str(tmp_path / "m"), "--record", str(tmp_path / "r.json")])
    assert "ar 20 tokens/s, tidar 36 tokens/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["check", "--model", str(tmp_path / "m"), "--record", "nope.json"])
    assert "--record 'nope.json' does not exist" in "".join(capsys.readouterr())


def test_fit_refuses_a_sequence_past_gpt_neo_s_window(tmp_path):
    """GPT-Neo's local layers window by index: a training sequence longer than the window is
    refused, naming the fix."""
    from tidar_convert.train.fit import check_model

    AutoConfig.for_model(
        "gpt_neo", num_layers=2, attention_types=[[["global", "local"], 1]], window_size=128
    ).save_pretrained(tmp_path)
    check_model(str(tmp_path), 128)
    with pytest.raises(
        ValueError,
        match=(
            r"--data.seq_len 256 is longer than gpt_neo's local "
            r"attention window \(128\).*--data.seq_len 128 or less"
        ),
    ):
        check_model(str(tmp_path), 256)


def test_fit_refuses_before_any_work(tmp_path):
    """fit's first check reads the config only: a refused model is refused with no weights
    present."""
    from tidar_convert.train.fit import check_model

    AutoConfig.for_model("minimax", num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type='minimax' has recurrent state outside"):
        check_model(str(tmp_path))


# Sampled as well (family_matrix.sample_check): one of each mechanism that could make a draft slot
# change what a real token computes (experts, softcapping with eager attention, latent KV, sinks
# with mixed windows, NoPE with chunked attention).
SAMPLED = (
    "llama",
    "qwen3_moe",
    "gemma2",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
    "gemma3_text",
    "qwen3_5_text",
    "nemotron_h",
)


# llama in the quick half (make test-fast); every other entry with make test
@pytest.mark.parametrize(
    "model_type",
    [t if t == "llama" else pytest.param(t, marks=pytest.mark.slow) for t in CI_ENTRIES],
)
def test_family_converts_exactly(model_type, tokenizer):
    """Conversion, export and greedy TiDAR from the export equal to AR at k = 2 and 4, one row and a
    left-padded batch of two, drafts both accepted and rejected; as docs/families.md records.
    SAMPLED entries: sampled TiDAR equal to an independent sampled AR loop, drafts accepted and
    rejected."""
    result = family_matrix.run(model_type, tokenizer, sampling=model_type in SAMPLED)
    assert result.outcome == "exact", result.detail
    assert result.accepted > 0 and result.rejected > 0
    assert read_table().get(model_type) == "exact"
    assert (model_type in SAMPLED) == result.sampled.startswith("exact"), result.sampled


def test_the_sampling_check_has_teeth(tokenizer, monkeypatch):
    """A verifier that accepts every sampled draft (not only where AR's own draw agrees) fails
    the check."""
    from tidar_convert.runtime.verify import Sampling, real_slots

    monkeypatch.setattr(
        Sampling,
        "verify_tokens",
        lambda self, scores, draft: (
            1 + (real_slots(draft)[:, : scores.shape[1] - 1]).long().cumprod(1).sum(1),
            self.token(scores),
        ),
    )
    result = family_matrix.run("llama", tokenizer, sampling=True)
    assert result.outcome == "fails" and "sampled TiDAR != sampled AR" in result.detail, result


def same_transformers_as_the_doc() -> bool:
    """Whether the installed transformers is the release docs/families.md was generated from. Its
    mapping grows with every release (CI installs the newest), so the doc is compared entry for
    entry only on that release; on any other the promise below still holds for every entry
    installed."""
    import transformers

    return transformers.__version__ == family_matrix.documented_version()


@pytest.mark.slow
def test_every_family_converts_exactly_or_is_refused(tokenizer):
    """Every entry of the installed transformers' causal-LM mapping converts exactly (drafts both
    accepted and rejected), or check refuses it before any work, or it is not a decoder-only text
    LM; never a failure. On the doc's transformers release, each comes out as
    docs/families.md says."""
    documented, same = read_table(), same_transformers_as_the_doc()
    broken = {}
    for model_type in family_matrix.entries():
        result = family_matrix.run(model_type, tokenizer)
        if result.outcome not in ("exact", "refused", "out of scope"):
            broken[model_type] = f"{result.outcome}: {result.detail}"
        elif same and result.outcome != documented.get(model_type):
            broken[model_type] = (
                f"{result.outcome}, documented {documented.get(model_type)}: {result.detail}"
            )
    assert not broken, broken


def test_documented_refusals_are_what_check_says():
    """docs/families.md against families.check on the same tiny configs (config only): whatever the
    doc calls refused or out of scope, check refuses; whatever it calls exact, check passes."""
    documented, installed = read_table(), set(family_matrix.entries())
    if same_transformers_as_the_doc():
        assert set(documented) == installed, (
            "docs/families.md is stale: regenerate it (tests/family_matrix.py --write)"
        )
    for model_type, outcome in documented.items():
        if model_type not in installed:
            continue  # an entry of the doc's release that this one dropped
        try:
            verdict = check(tiny_config(model_type, 400))
        except Exception:
            continue  # a config that cannot be built from defaults: listed out of scope
        if outcome == "exact":
            assert verdict.converts, model_type
        elif outcome in ("refused", "out of scope"):
            assert not verdict.converts and verdict.decoder_only == (outcome == "refused"), (
                model_type
            )


def recurrent_exact(path=None) -> list[str]:
    """The families docs/families.md marks exact whose mechanisms include recurrent layers."""
    from family_matrix import DOC

    out = []
    for line in (path or DOC).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1] == "exact" and "recurrent layers" in cells[2]:
            out.append(cells[0])
    return out


def test_readme_supported_models_agrees_with_the_matrix():
    """The README's "Supported models" section quotes the matrix's counts and names only exact
    families."""
    text = README.read_text()
    section = text.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    documented = read_table()
    exact = sorted(t for t, o in documented.items() if o == "exact")
    counts = re.search(
        r"(\d+) families convert exactly, (\d+) are refused .*?, (\d+) are out of scope",
        section,
        re.S,
    )
    assert counts, "the README's Supported models section lost its counts line"
    assert [int(c) for c in counts.groups()] == [
        len(exact),
        sum(o == "refused" for o in documented.values()),
        sum(o == "out of scope" for o in documented.values()),
    ]
    for row in (
        line
        for line in section.splitlines()
        if line.startswith("| exact") or line.startswith("| refused")
    ):
        named = re.findall(r"`([a-z0-9_\-]+)`", row)
        want = "exact" if row.startswith("| exact") else "refused"
        assert named and all(documented.get(n) == want for n in named), (
            want,
            [n for n in named if documented.get(n) != want],
        )
        if row.startswith("| exact, with recurrent layers"):  # every one of them, not a sample
            assert set(named) == set(recurrent_exact()), set(recurrent_exact()) ^ set(named)
