"""Every GenerationConfig field, walked: honoured with transformers' semantics, refused by name, or
irrelevant to TiDAR decoding for a stated reason. No field may be silently ignored (issue 8,
item 4).

Honoured under greedy: the field changes transformers' own output (sequences or scores) on the test
prompts, and TiDAR gives the same sequences, scores and logits. Honoured under sampling: the field
changes the exact AR distribution, and TiDAR samples from it (chi-square, as in test_decode.py).
"""

import copy

import pytest
import torch
from helpers import cycle_batch, train_tiny
from test_decode import (
    N_NEW,
    SAMPLING_SETTINGS,
    chi_square_p,
    exact_distribution,
    sample_counts,
    small_vocab_model,  # noqa: F401  (a fixture)
)
from transformers import CompileConfig, GenerationConfig, StoppingCriteriaList, WatermarkingConfig

from tidar_convert.models.loading import load_base
from tidar_convert.runtime import generate as decode
from tidar_convert.runtime.generate import generate

EOS = 5  # a token of the training cycle (3..9), so EOS-dependent fields have something to act on
MODEL_EOS = 0  # tiny_config's eos_token_id

# Honoured, checked under greedy against transformers on two prompt sets (a left-padded batch, and a
# one-token prompt): {field: the generate() arguments that exercise it}.
GREEDY = {
    "max_length": dict(max_length=11),
    "max_new_tokens": dict(max_new_tokens=5),
    "min_length": dict(eos_token_id=EOS, min_length=16),
    "min_new_tokens": dict(eos_token_id=EOS, min_new_tokens=9),
    "eos_token_id": dict(eos_token_id=[EOS, 99]),
    "pad_token_id": dict(eos_token_id=EOS, pad_token_id=2),
    "repetition_penalty": dict(repetition_penalty=30.0),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=30.0),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[6], [8, 9]]),
    "sequence_bias": dict(sequence_bias={(7,): -50.0, (3, 4): -50.0}),
    "suppress_tokens": dict(suppress_tokens=[6, 7]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=list(range(3, 10))),
    "forced_bos_token_id": dict(forced_bos_token_id=2),  # acts on a one-token prompt
    "forced_eos_token_id": dict(forced_eos_token_id=2),
    # -inf -> finite
    "remove_invalid_values": dict(remove_invalid_values=True, sequence_bias={(6,): -float("inf")}),
    "exponential_decay_length_penalty": dict(
        eos_token_id=EOS, exponential_decay_length_penalty=(1, 3.0)
    ),
    "renormalize_logits": dict(renormalize_logits=True),
    "max_time": dict(max_time=1e-9),  # stops after the first token, in both
}

# Honoured, checked under sampling: test_decode.SAMPLING_SETTINGS and these (prefix-dependent
# processors included, so each draft slot must be processed with its own prefix for the test
# to pass).
MORE_SAMPLING = [
    dict(typical_p=0.8, epsilon_cutoff=0.05),
    dict(eta_cutoff=0.05, top_h=0.7, temperature=0.9),
    dict(repetition_penalty=3.0, no_repeat_ngram_size=2),
]

# Honoured, checked by the dedicated tests named.
OTHER = {
    "do_sample": "test_sampling_fields_keep_the_ar_distribution",
    "num_return_sequences": "test_num_return_sequences",
    "return_dict_in_generate": "test_output_switches",
    "output_scores": "test_output_switches (and every greedy comparison)",
    "output_logits": "test_output_switches (and every greedy comparison)",
    "stop_strings": "test_stop_strings_with_a_tokenizer",
    "bos_token_id": "test_no_prompt_starts_from_bos",
}

# Refused with a ValueError naming the field: {field: a value to try}.
REFUSED = {
    "num_beams": 2,
    "num_beam_groups": 2,
    "diversity_penalty": 0.5,
    "constraints": ["a constraint"],
    "force_words_ids": [[5]],
    "penalty_alpha": 0.6,
    "dola_layers": "high",
    "guidance_scale": 1.5,
    "watermarking_config": WatermarkingConfig(),
    "token_healing": True,
    "output_attentions": True,
    "output_hidden_states": True,
    "prompt_lookup_num_tokens": 3,
    "assistant_early_exit": 1,
    "use_mtp": True,
    "is_assistant": True,
    "cache_implementation": "offloaded",  # dynamic and static decode (test_slots.py)
}

# Irrelevant: {field: (a value, why)}. The test checks that the value changes neither TiDAR's output
# nor transformers' own greedy output, so "irrelevant" is a fact, not a claim.
ASSISTED = (
    "read only by assisted decoding, which is refused (assistant_model, prompt_lookup_num_tokens)"
)
IRRELEVANT = {
    "use_cache": (
        False,
        "TiDAR always decodes with its own KV cache; the output is the same without one",
    ),
    "cache_config": (
        {"offloading": False},
        "options of transformers' own caches; TiDAR's dynamic and static caches take none",
    ),
    "max_cache_len": (64, "a static cache's length; TiDAR's static cache is sized by max_length"),
    "prefill_chunk_size": (3, "chunked prefill changes peak memory, not the output"),
    "compile_config": (
        CompileConfig(fullgraph=False),
        "torch.compile settings, read only with cache_implementation='static' (test_slots.py)",
    ),
    "disable_compile": (
        True,
        "torch.compile settings, read only with cache_implementation='static' (test_slots.py)",
    ),
    "continuous_batching_config": (
        None,
        "read only by generate_batch (continuous batching), never by generate",
    ),
    "early_stopping": (True, "beam search only; transformers ignores it without beams"),
    "length_penalty": (2.0, "beam search only; transformers ignores it without beams"),
    "low_memory": (True, "beam search only; transformers ignores it without beams"),
    "decoder_start_token_id": (3, "encoder-decoder models only"),
    "num_assistant_tokens": (5, ASSISTED),
    "num_assistant_tokens_schedule": ("heuristic", ASSISTED),
    "assistant_confidence_threshold": (0.2, ASSISTED),
    "assistant_lookbehind": (4, ASSISTED),
    "target_lookbehind": (4, ASSISTED),
    "max_matching_ngram_size": (3, ASSISTED),
    "assistant_ensemble_weight": (0.5, ASSISTED),
    "speculation_type": ("dflash", ASSISTED),
    "transformers_version": (None, "metadata: the version that wrote the config"),
    "_from_model_config": (None, "metadata: whether the config was derived from the model config"),
}


def sampled_fields():
    return {"do_sample"} | {f for s in SAMPLING_SETTINGS + MORE_SAMPLING for f in s}


def test_every_field_is_honoured_refused_or_irrelevant():
    fields = set(GenerationConfig().to_dict())
    groups = {
        "greedy": set(GREEDY),
        "other": set(OTHER),
        "refused": set(REFUSED),
        "irrelevant": set(IRRELEVANT),
    }
    sampling_only = sampled_fields() - set(GREEDY) - set(OTHER)
    covered = set().union(*groups.values()) | sampling_only
    assert not fields - covered, (
        f"GenerationConfig fields nobody checks: {sorted(fields - covered)}"
    )
    assert not covered - fields, f"not GenerationConfig fields: {sorted(covered - fields)}"
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not groups[a] & groups[b], (a, b, groups[a] & groups[b])
    assert set(REFUSED) == set(decode.REFUSED)  # the decoder refuses exactly these


# ---- honoured, greedy ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_dirs):
    """The llama family only, trained to draft the cycle well, so many drafts are accepted
    per step."""
    m, tok = load_base(str(tiny_dirs["llama"]))
    return train_tiny(m), tok


def prompt_sets():
    ids = cycle_batch(2, 6, seed=1)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 1, 0
    return [(ids, mask), (cycle_batch(1, 1, seed=2), None)]


def both_kw(mask, **kw):
    kw = dict(
        attention_mask=mask,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        **kw,
    )
    if "max_length" not in kw:
        kw.setdefault("max_new_tokens", 20)
    return kw


def both(m, ids, mask, **kw):
    """transformers' output and TiDAR's, each with scores and logits."""
    kw = both_kw(mask, **kw)
    return m.generate(ids, **kw), generate(ids, model=m, **kw)


def live_rows(out, prompt_len, eos):
    """(T, B) bool: row b was still generating at new token t (transformers' scores for finished
    rows come from pad tokens and mean nothing)."""
    new = out.sequences[:, prompt_len:]
    done = torch.isin(new, torch.tensor(eos))
    return torch.cat([torch.zeros_like(done[:, :1]), done[:, :-1]], 1).cumsum(1).eq(0).T


def assert_same(hf, td, prompt_len, eos):
    assert torch.equal(td.sequences, hf.sequences), (td.sequences, hf.sequences)
    live = live_rows(hf, prompt_len, eos)
    for name in ("scores", "logits"):
        a, b = getattr(hf, name), getattr(td, name)
        assert len(a) == len(b), name
        for t in range(len(a)):
            torch.testing.assert_close(
                b[t][live[t]], a[t][live[t]], atol=1e-4, rtol=1e-4, msg=f"{name}[{t}]"
            )


def differs(a, b, prompt_len, eos):
    if not torch.equal(a.sequences, b.sequences):
        return True
    live = live_rows(a, prompt_len, eos)
    return any(
        not torch.allclose(x[live[t]], y[live[t]], atol=1e-4, equal_nan=True)
        for t, (x, y) in enumerate(zip(a.scores, b.scores))
    )


@pytest.mark.parametrize("field", sorted(GREEDY))
def test_greedy_field_is_honoured(model, field):
    m, _ = model
    kw = GREEDY[field]
    eos = kw.get("eos_token_id", MODEL_EOS)
    eos = eos if isinstance(eos, list) else [eos]
    changed, accepted = False, [1]
    for ids, mask in prompt_sets():
        hf, td = both(m, ids, mask, **kw)
        accepted += m.tidar_stats["accepted"]
        assert_same(hf, td, ids.shape[1], eos)
        base = m.generate(
            ids, **{**both_kw(mask), **{key: v for key, v in kw.items() if key != field}}
        )
        changed = changed or differs(hf, base, ids.shape[1], eos)
    assert changed, (
        f"{field}={kw[field]} changes nothing in transformers "
        "on these prompts: the check has no teeth"
    )
    if field != "max_time":
        assert max(accepted) >= 2, "no draft was ever accepted: exactness under acceptance untested"


def test_processors_also_apply_on_a_left_padded_batch_with_several_at_once(model):
    m, _ = model
    kw = dict(
        repetition_penalty=30.0,
        no_repeat_ngram_size=3,
        suppress_tokens=[6],
        min_new_tokens=4,
        eos_token_id=EOS,
        pad_token_id=2,
    )
    ids, mask = prompt_sets()[0]
    hf, td = both(m, ids, mask, **kw)
    assert_same(hf, td, ids.shape[1], [EOS])


def test_custom_logits_processor_and_prefix_allowed_tokens_fn(model):
    from transformers import LogitsProcessor, LogitsProcessorList

    # depends on the prefix: drafts must be processed with theirs
    class NoTokenAfterItself(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.scatter(1, input_ids[:, -1:], -float("inf"))

    m, _ = model
    ids, mask = prompt_sets()[0]
    hf, td = both(
        m,
        ids,
        mask,
        logits_processor=LogitsProcessorList([NoTokenAfterItself()]),
        prefix_allowed_tokens_fn=lambda b, s: [3, 4, 5, 6, 8] if len(s) % 2 else list(range(3, 10)),
    )
    assert_same(hf, td, ids.shape[1], [MODEL_EOS])


# ---- honoured, sampling --------------------------------------------------------------------------


@pytest.mark.slow  # statistical: thousands of samples (make test runs it; make test-fast skips it)
@pytest.mark.parametrize("settings", MORE_SAMPLING)
def test_sampling_fields_keep_the_ar_distribution(
    small_vocab_model,  # noqa: F811  (test_decode's fixture, imported)
    settings,
    monkeypatch,
):
    m = small_vocab_model
    V = m.config.vocab_size - 1
    prompt = torch.tensor([[1, 2]])
    gen_kw = dict(do_sample=True, max_new_tokens=N_NEW, **{"eos_token_id": None, **settings})
    bias = torch.zeros(V + 1)
    bias[V] = -float("inf")  # the mask token is never an AR output, as in a converted model
    monkeypatch.setattr(
        m.lm_head, "bias", torch.nn.Parameter(bias, requires_grad=False), raising=False
    )

    def processors(kw):
        gc, _ = m._prepare_generation_config(None, **kw)
        m._prepare_special_tokens(gc, False, device="cpu", batch_size=1)
        gc = m._prepare_generated_length(gc, False, True, "input_ids", prompt.shape[1], prompt)
        return m._get_logits_processor(
            gc, input_ids_seq_length=prompt.shape[1], encoder_input_ids=prompt, device="cpu"
        )

    procs = processors(gen_kw)
    probs = exact_distribution(m, prompt, lambda ids, logits: procs(ids, logits).softmax(-1))
    plain = processors(dict(do_sample=True, max_new_tokens=N_NEW, eos_token_id=None))
    base = exact_distribution(m, prompt, lambda ids, logits: plain(ids, logits).softmax(-1))
    tv = sum(abs(probs.get(s, 0) - base.get(s, 0)) for s in set(probs) | set(base)) / 2
    assert tv > 0.05, (
        f"{settings} hardly changes the distribution (TV {tv:.3f}): the check has no teeth"
    )
    n = 400
    hf = sample_counts(lambda: m.generate(prompt, **gen_kw), n)
    tidar = sample_counts(lambda: generate(prompt, model=m, **gen_kw), n)
    assert chi_square_p(hf, probs, n) > 1e-3  # the exact distribution is what transformers samples
    assert chi_square_p(tidar, probs, n) > 1e-3


# ---- honoured, dedicated -------------------------------------------------------------------------


def test_num_return_sequences(model):
    m, _ = model
    ids = cycle_batch(2, 5, seed=3)
    torch.manual_seed(0)
    out = generate(
        ids, model=m, do_sample=True, num_return_sequences=3, max_new_tokens=6, temperature=3.0
    )
    assert out.shape == (6, 11)
    # as transformers: a prompt's rows adjacent
    assert torch.equal(out[:, :5], ids.repeat_interleave(3, 0))
    assert len({tuple(r) for r in out[:3, 5:].tolist()}) > 1  # independent samples
    # transformers' own refusal, under greedy
    with pytest.raises(ValueError, match="num_return_sequences"):
        generate(ids, model=m, num_return_sequences=2, max_new_tokens=4)


def test_output_switches(model):
    m, _ = model
    ids = cycle_batch(1, 5, seed=4)
    for kw in (
        dict(),
        dict(return_dict_in_generate=True),
        dict(return_dict_in_generate=True, output_scores=True),
        dict(return_dict_in_generate=True, output_logits=True),
    ):
        hf = m.generate(ids, max_new_tokens=8, do_sample=False, **kw)
        td = generate(ids, model=m, max_new_tokens=8, do_sample=False, **kw)
        assert type(td) is type(hf)
        if isinstance(hf, torch.Tensor):
            assert torch.equal(td, hf)
            continue
        for name in ("scores", "logits"):
            assert (getattr(td, name) is None) == (getattr(hf, name) is None), (kw, name)
            if getattr(hf, name) is not None:
                torch.testing.assert_close(
                    torch.stack(getattr(td, name)),
                    torch.stack(getattr(hf, name)),
                    atol=1e-4,
                    rtol=1e-4,
                )


def test_stop_strings_with_a_tokenizer(model):
    m, tok = model
    ids = cycle_batch(1, 5, seed=5)
    full = generate(ids, model=m, max_new_tokens=30, eos_token_id=None)
    stop = tok.decode(full[0, 12:14])
    expected = m.generate(
        ids, max_new_tokens=30, eos_token_id=None, stop_strings=stop, tokenizer=tok, do_sample=False
    )
    got = generate(
        ids, model=m, max_new_tokens=30, eos_token_id=None, stop_strings=stop, tokenizer=tok
    )
    assert torch.equal(got, expected) and got.shape[1] < full.shape[1]
    with pytest.raises(ValueError, match="tokenizer"):  # transformers' own message
        generate(ids, model=m, max_new_tokens=30, stop_strings=stop)


def test_no_prompt_starts_from_bos(model):
    m, _ = model
    expected = m.generate(max_new_tokens=6, bos_token_id=4, do_sample=False, eos_token_id=None)
    assert torch.equal(
        generate(model=m, max_new_tokens=6, bos_token_id=4, eos_token_id=None), expected
    )


def test_transformers_defaults(model):
    """No length: transformers' default max_length (20 new tokens). do_sample without a temperature:
    1.0. A generation_config passed in is completed by the model's own (its EOS included)."""
    m, _ = model
    ids = cycle_batch(1, 5, seed=6)
    assert torch.equal(
        generate(ids, model=m, eos_token_id=None),
        m.generate(ids, eos_token_id=None, do_sample=False),
    )
    assert generate(input_ids=ids, model=m, eos_token_id=None).shape[1] == 25
    assert generate(ids, model=m, do_sample=True, max_new_tokens=4).shape[1] <= 9
    saved = copy.deepcopy(m.generation_config)
    try:
        m.generation_config.eos_token_id = EOS
        gc = GenerationConfig(max_new_tokens=20)
        expected = m.generate(ids, generation_config=gc)
        got = generate(ids, generation_config=gc, model=m)
        assert torch.equal(got, expected) and got[0, -1].item() == EOS and got.shape[1] < 25
    finally:
        m.generation_config = saved


def test_custom_stopping_criteria_merge(model):
    from transformers import StoppingCriteria

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    m, _ = model
    ids = cycle_batch(1, 5, seed=7)
    crit = StoppingCriteriaList([Never()])
    expected = m.generate(
        ids, max_new_tokens=10, eos_token_id=EOS, stopping_criteria=crit, do_sample=False
    )
    assert torch.equal(
        generate(ids, model=m, max_new_tokens=10, eos_token_id=EOS, stopping_criteria=crit),
        expected,
    )


# ---- refused -------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_by_name(model, field):
    m, _ = model
    with pytest.raises(ValueError, match=field) as err:
        generate(cycle_batch(1, 4, seed=0), model=m, max_new_tokens=4, **{field: REFUSED[field]})
    assert "\n" not in str(err.value).strip()


@pytest.mark.parametrize("name", sorted(decode.REFUSED_ARGS))
def test_refused_arguments_by_name(model, name):
    m, _ = model
    value = {"assistant_model": m, "synced_gpus": True, "custom_generate": "x"}.get(
        name, torch.ones(1, 4, dtype=torch.long)
    )
    with pytest.raises(ValueError, match=name):
        generate(cycle_batch(1, 4, seed=0), model=m, max_new_tokens=4, **{name: value})


def test_unknown_argument_is_a_type_error(model):
    m, _ = model
    with pytest.raises(TypeError, match="temprature"):
        generate(cycle_batch(1, 4, seed=0), model=m, max_new_tokens=4, temprature=0.5)


# ---- irrelevant ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", sorted(IRRELEVANT))
def test_irrelevant_field_changes_nothing(model, field):
    m, _ = model
    value, why = IRRELEVANT[field]
    assert why
    ids = cycle_batch(1, 5, seed=8)
    kw = dict(max_new_tokens=12, eos_token_id=None, do_sample=False)
    base = m.generate(ids, **kw)
    with_value = {field: value} if value is not None else {}
    assert torch.equal(generate(ids, model=m, **kw, **with_value), base)
    assert torch.equal(m.generate(ids, **kw, **with_value), base)  # transformers ignores it too
