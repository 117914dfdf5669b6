"""TiDAR decoding: exactly AR greedy, exactly AR sampling in distribution, and generate()'s
contract."""

import copy
from collections import Counter

import pytest
import torch
from helpers import FAMILIES, ar, cycle_batch, tiny_config
from transformers import StoppingCriteria, StoppingCriteriaList

from tidar_convert.runtime.generate import CACHE_FIELD, Sampling, generate
from tidar_convert.runtime.session import reset, session_of
from tidar_convert.runtime.spec import TiDARSpec


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_greedy_equals_ar_untrained_head(untrained, family, k):
    """An untrained diffusion head only lowers acceptance; the output stays AR greedy."""
    model = untrained[family]
    TiDARSpec(k, model.config.mask_token_id).write(model.config)
    g = torch.Generator().manual_seed(k)
    for length in (1, 3, 9):
        ids = torch.randint(1, 300, (1, length), generator=g)
        expected = ar(model, ids, max_new_tokens=24, eos_token_id=None)
        assert torch.equal(
            generate(ids, model=model, max_new_tokens=24, eos_token_id=None), expected
        )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [2, 4, 6, 8])
def test_greedy_equals_ar_trained_head(trained, family, k):
    """With a head that drafts well, many drafts are accepted per step, and the output is
    still AR's."""
    model, _ = trained[family]
    for seed in range(4):
        ids = cycle_batch(1, 3 + seed, seed=seed)
        expected = ar(model, ids, max_new_tokens=40, eos_token_id=None)
        # plan "adaptive": acceptance is the head's alone (the default cost plan's steps also
        # read timings)
        assert torch.equal(
            generate(
                ids,
                model=model,
                max_new_tokens=40,
                eos_token_id=None,
                draft_length=k,
                plan="adaptive",
            ),
            expected,
        )
        assert model.tidar_stats["tokens_per_nfe"] > 1.5
        assert max(model.tidar_stats["accepted"]) >= min(k, 3)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_with_left_padding_equals_ar(trained, untrained, family):
    for model in (trained[family][0], untrained[family]):
        g = torch.Generator().manual_seed(0)
        ids = torch.cat(
            [cycle_batch(3, 8, seed=1)[:, :8], torch.randint(1, 300, (1, 8), generator=g)]
        )
        mask = torch.ones_like(ids)
        for row, pad in enumerate([3, 0, 5, 1]):
            ids[row, :pad], mask[row, :pad] = 0, 0
        expected = ar(
            model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None, pad_token_id=0
        )
        got = generate(
            ids,
            model=model,
            attention_mask=mask,
            max_new_tokens=30,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert torch.equal(got, expected)


def test_stops_exactly_at_eos_inside_an_accepted_draft(trained):
    model, _ = trained["llama"]
    ids = cycle_batch(1, 4, seed=3)
    full = generate(ids, model=model, max_new_tokens=30, eos_token_id=None)
    for eos in (full[0, 7].item(), [full[0, 9].item(), 999]):
        expected = ar(model, ids, max_new_tokens=30, eos_token_id=eos)
        got = generate(ids, model=model, max_new_tokens=30, eos_token_id=eos)
        assert torch.equal(got, expected)
        assert got.shape[1] < full.shape[1]
    # batch: one row stops early, the others go on, finished rows are padded as AR pads them
    ids = cycle_batch(3, 5, seed=4)
    eos = generate(ids[:1], model=model, max_new_tokens=10, eos_token_id=None)[0, 8].item()
    expected = ar(model, ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(
        generate(ids, model=model, max_new_tokens=20, eos_token_id=eos, pad_token_id=1), expected
    )


def test_max_new_tokens_exact_and_stopping_criteria(trained):
    model, _ = trained["qwen2"]
    ids = cycle_batch(1, 4, seed=5)
    for n in (1, 2, 5, 13):
        assert generate(ids, model=model, max_new_tokens=n, eos_token_id=None).shape[1] == 4 + n

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 11, dtype=torch.bool)

    crit = StoppingCriteriaList([StopAtLength()])
    expected = ar(model, ids, max_new_tokens=30, eos_token_id=None, stopping_criteria=crit)
    assert torch.equal(
        generate(ids, model=model, max_new_tokens=30, eos_token_id=None, stopping_criteria=crit),
        expected,
    )
    assert expected.shape[1] == 11


def test_streamer_generation_config_and_return_dict(trained):
    model, _ = trained["mistral"]
    ids = cycle_batch(1, 4, seed=6)

    class Collect:
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    gc = copy.deepcopy(model.generation_config)
    gc.max_new_tokens, gc.eos_token_id, gc.return_dict_in_generate = 12, None, True
    out = generate(ids, generation_config=gc, model=model, streamer=streamer)
    assert out.sequences.shape[1] == 16
    assert streamer.chunks[0] == ids[0].tolist() and streamer.ended
    assert sum(streamer.chunks[1:], []) == out.sequences[0, 4:].tolist()
    assert torch.equal(out.sequences, ar(model, ids, max_new_tokens=12, eos_token_id=None))
    assert (
        list(out.keys()) == ["sequences", CACHE_FIELD] and out[CACHE_FIELD].get_seq_length() >= 15
    )  # the cache, under the installed release's name


def test_text_streamer_prints_the_text(trained, capsys):
    from transformers import TextStreamer

    model, tok = trained["llama"]
    ids = cycle_batch(1, 4, seed=7)
    out = generate(
        ids,
        model=model,
        max_new_tokens=10,
        eos_token_id=None,
        streamer=TextStreamer(tok, skip_prompt=True),
    )
    assert capsys.readouterr().out.strip() == tok.decode(out[0, 4:]).strip()


def test_stats_and_ar_switch(trained):
    model, _ = trained["llama"]
    ids = cycle_batch(1, 4, seed=8)
    td = generate(ids, model=model, max_new_tokens=20, eos_token_id=None)
    stats = model.tidar_stats
    assert stats["new_tokens"] == 20 and stats["nfe"] == 1 + len(stats["accepted"])
    assert stats["tokens_per_nfe"] == pytest.approx(20 / stats["nfe"])
    plain = generate(
        ids, model=model, max_new_tokens=20, eos_token_id=None, tidar=False, do_sample=False
    )
    assert torch.equal(plain, td) and model.tidar_stats["nfe"] == 20


def test_beta_mixing_runs_and_is_opt_in(trained):
    model, _ = trained["llama"]
    ids = cycle_batch(1, 4, seed=9)
    out = generate(ids, model=model, max_new_tokens=12, eos_token_id=None, beta=0.5)
    assert out.shape[1] == 16
    with pytest.raises(ValueError, match="beta=1.5"):
        generate(ids, model=model, max_new_tokens=4, beta=1.5)


# ---- sampling: exact in distribution ------------------------------------------------------------


V, N_NEW, K = 5, 3, 3


@pytest.fixture(scope="module")
def small_vocab_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    cfg = tiny_config("llama", V + 1)
    cfg.pad_token_id = 0
    TiDARSpec(K, mask_token_id=V).write(cfg)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # sharper, varied distributions so a wrong acceptance rule shows
        model.lm_head.weight.mul_(6)
    return model


def exact_distribution(model, prompt, warp):
    """P(x1 x2 x3 | prompt) for all V**3 continuations, by enumeration of the AR model.
    warp(prefix ids (1, n), logits (1, V + 1)) -> next-token probabilities."""
    probs = {}

    def walk(prefix, p):
        if len(prefix) == prompt.shape[1] + N_NEW:
            probs[tuple(prefix[prompt.shape[1] :])] = p
            return
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix])).logits[0, -1, :V]
        full = torch.full((V + 1,), -float("inf"))
        full[:V] = (
            logits  # the mask token is never a sampled output in this test (AR would not either)
        )
        nxt = warp(torch.tensor([prefix]), full[None])[0]
        for t in range(V):
            if nxt[t] > 0:
                walk(prefix + [t], p * nxt[t].item())

    walk(prompt[0].tolist(), 1.0)
    return probs


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    from scipy.stats import chisquare

    keys = sorted(probs, key=probs.get, reverse=True)
    big = [k for k in keys if probs[k] * n >= 5]
    rest = [k for k in keys if probs[k] * n < 5]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in rest)]
    exp = [probs[k] * n for k in big] + [sum(probs[k] for k in rest) * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * n / sum(exp) for e in exp]  # float sums of probabilities are 1 only up to rounding
    assert sum(counts.values()) == n and not set(counts) - set(probs), (
        "sampled an impossible continuation"
    )
    return chisquare(obs, exp).pvalue


def sample_counts(fn, n):
    counts = {}
    for i in range(n):
        torch.manual_seed(i)
        seq = tuple(fn()[0, -N_NEW:].tolist())
        counts[seq] = counts.get(seq, 0) + 1
    return counts


# Sampling settings checked here; tests/test_generate_args.py checks the other sampling fields.
SAMPLING_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4, top_p=0.9),
    dict(temperature=0.8, min_p=0.15),
]


@pytest.mark.slow  # statistical: thousands of samples (make test runs it; make test-fast skips it)
@pytest.mark.parametrize("settings", SAMPLING_SETTINGS)
def test_sampling_matches_ar_distribution(small_vocab_model, settings, monkeypatch):
    model = small_vocab_model
    prompt = torch.tensor([[1, 2]])
    gen_kw = dict(do_sample=True, max_new_tokens=N_NEW, eos_token_id=None, **settings)
    gc = copy.deepcopy(model.generation_config)
    gc.update(**gen_kw)
    # mask the mask token out of the AR head, as a converted model never emits it
    bias = torch.zeros(V + 1)
    bias[V] = -float("inf")
    monkeypatch.setattr(
        model.lm_head, "bias", torch.nn.Parameter(bias, requires_grad=False), raising=False
    )
    # transformers' own
    processors = model._get_logits_processor(gc, input_ids_seq_length=prompt.shape[1], device="cpu")
    probs = exact_distribution(
        model, prompt, lambda ids, logits: processors(ids, logits).softmax(-1)
    )
    n = 400  # the wrong rule below scores p ~ 1e-30 at this size; right ones ~ 0.2-0.7
    hf = sample_counts(lambda: model.generate(prompt, **gen_kw), n)
    gen_kw["drafter"] = (
        "diffusion"  # sampled drafts with their q; lookup's deterministic drafts: the test below
    )
    tidar = sample_counts(lambda: generate(prompt, model=model, **gen_kw), n)
    assert chi_square_p(hf, probs, n) > 1e-3  # the exact distribution is what HF samples
    assert chi_square_p(tidar, probs, n) > 1e-3

    # The test has teeth: accepting every proposal AR could draw (p(d) > 0), not only where it is
    # AR's own draw there, is detectably wrong.
    def wrong_verify(self, ar_logits, draft):
        p = self.probs(ar_logits[:, :-1])
        possible = p.gather(-1, draft.tokens[:, 1:, None]).squeeze(-1) > 0
        return 1 + possible.long().cumprod(1).sum(1), self.token(ar_logits)

    monkeypatch.setattr(Sampling, "verify_tokens", wrong_verify)
    gen_kw["plan"] = (
        "full"  # every draft verified: the cost plan may run plain AR steps where drafts do not pay
    )
    wrong = sample_counts(lambda: generate(prompt, model=model, **gen_kw), n)
    assert chi_square_p(wrong, probs, n) < 1e-3


def drawn_at_the_first_position(self, scores, draft, verify_tokens=Sampling.verify_tokens):
    """A wrong verifier for the tests' teeth: the right verdict, but the token at every draft row
    (the one committed after the accepted drafts) drawn with the draws of the step's first
    position instead of its own."""
    accepted, _ = verify_tokens(self, scores, draft)
    return accepted, torch.stack([self.token(scores[:, i]) for i in range(scores.shape[1])], 1)


@pytest.mark.slow  # statistical: thousands of samples (make test runs it; make test-fast skips it)
@pytest.mark.parametrize("drafter", ["lookup", "hybrid"])
def test_sampling_with_deterministic_drafts_matches_ar_distribution(
    small_vocab_model, drafter, monkeypatch
):
    """Lookup drafts are deterministic: d is accepted where AR's draw there is d (chance p(d)).
    Every token occurs in the prompt, so lookup drafts at every step."""
    from tidar_convert.runtime import drafters

    model = small_vocab_model
    prompt = torch.tensor([[1, 2, 3, 4, 0, 2]])
    gen_kw = dict(
        do_sample=True,
        max_new_tokens=N_NEW,
        eos_token_id=None,
        temperature=0.9,
        drafter=drafter,
        plan="cost",  # any plan is exact; cost's choices read timings
    )
    # hybrid: a coin picks lookup or diffusion (the sharp diffusion head here would always win); any
    # choice that does not look at the AR samples keeps the output exact
    monkeypatch.setattr(
        drafters.HybridDrafter,
        "choose",
        lambda self, look, diff: (look.length > 1) & (torch.rand(look.tokens.shape[0]) < 0.5),
    )
    bias = torch.zeros(V + 1)
    bias[V] = -float("inf")
    monkeypatch.setattr(
        model.lm_head, "bias", torch.nn.Parameter(bias, requires_grad=False), raising=False
    )
    gc = copy.deepcopy(model.generation_config)
    gc.update(**{k: v for k, v in gen_kw.items() if k not in ("drafter", "plan")})
    processors = model._get_logits_processor(gc, input_ids_seq_length=prompt.shape[1], device="cpu")
    probs = exact_distribution(
        model, prompt, lambda ids, logits: processors(ids, logits).softmax(-1)
    )
    n, sources = 400, Counter()

    def run():
        out = generate(prompt, model=model, **gen_kw)
        sources.update({s: c for s, c in model.tidar_stats["draft_sources"].items()})
        return out

    assert chi_square_p(sample_counts(run, n), probs, n) > 1e-3
    # lookup drafts at least once per generation
    assert sources["lookup"] >= (n if drafter == "lookup" else n // 4), sources
    assert drafter == "lookup" or sources["diffusion"] >= n // 4, sources
    # same verify code as lookup; at this n the teeth bite only when every step is lookup
    if drafter == "hybrid":
        return
    # Teeth: the token after the accepted drafts drawn with the draws of the step's first position
    # (those that judged draft 1) instead of its own is detectably wrong.
    monkeypatch.setattr(Sampling, "verify_tokens", drawn_at_the_first_position)
    assert (
        chi_square_p(
            sample_counts(lambda: generate(prompt, model=model, **{**gen_kw, "plan": "full"}), n),
            probs,
            n,
        )
        < 1e-3
    )


@pytest.mark.slow  # statistical: thousands of samples (make test runs it; make test-fast skips it)
def test_sampling_with_per_row_acceptance_matches_ar_distribution(small_vocab_model, monkeypatch):
    """In a batch each row keeps what it accepted; its tokens must still follow AR sampling exactly.
    Row 0 is the test prompt; row 1 (another prompt) accepts differently."""
    from tidar_convert.runtime import drafters

    model = small_vocab_model
    prompt = torch.tensor([[1, 2, 3, 4, 0, 2], [4, 4, 3, 1, 1, 0]])
    gen_kw = dict(
        do_sample=True,
        max_new_tokens=N_NEW,
        eos_token_id=None,
        temperature=0.8,
        attention_mask=torch.ones_like(prompt),
    )
    monkeypatch.setattr(
        drafters.HybridDrafter,
        "choose",
        lambda self, look, diff: (look.length > 1) & (torch.rand(look.tokens.shape[0]) < 0.5),
    )  # hybrid: rows mix sources
    bias = torch.zeros(V + 1)
    bias[V] = -float("inf")
    monkeypatch.setattr(
        model.lm_head, "bias", torch.nn.Parameter(bias, requires_grad=False), raising=False
    )
    gc = copy.deepcopy(model.generation_config)
    gc.update(**gen_kw)
    processors = model._get_logits_processor(gc, input_ids_seq_length=prompt.shape[1], device="cpu")
    probs = exact_distribution(
        model, prompt[:1], lambda ids, logits: processors(ids, logits).softmax(-1)
    )
    n = 400
    for drafter in ("diffusion", "lookup", "hybrid"):
        run = lambda: generate(prompt, model=model, drafter=drafter, **gen_kw)[:1]  # noqa: E731
        assert chi_square_p(sample_counts(run, n), probs, n) > 1e-3, drafter
        assert "tokens_per_nfe_per_row" in model.tidar_stats  # it ran with per-row acceptance
    # Teeth: a row's next token drawn with the draws of its step's first position, not its own.
    monkeypatch.setattr(Sampling, "verify_tokens", drawn_at_the_first_position)
    assert (
        chi_square_p(
            sample_counts(
                lambda: generate(prompt, model=model, drafter="lookup", plan="full", **gen_kw)[:1],
                n,
            ),
            probs,
            n,
        )
        < 1e-3
    )


# ---- sampling: a seed repeats it, whatever the steps were ----------------------------------------


def ar_sample(model, ids, seed, max_new_tokens, **settings):
    """AR sampling, one forward per token over the whole sequence, each token drawn by
    verify.Sampling with `seed` at its own index: what TiDAR's sampled output must equal."""
    gc = copy.deepcopy(model.generation_config)
    gc.update(do_sample=True, **settings)
    processors = model._get_logits_processor(gc, input_ids_seq_length=ids.shape[1], device="cpu")
    pick, seq = Sampling(seed), ids
    for t in range(max_new_tokens):
        pick.seek(t)
        with torch.no_grad():
            logits = model(input_ids=seq).logits[:, -1].float()
        seq = torch.cat([seq, pick.token(processors(seq, logits))[:, None]], 1)
    return seq


def warpers(**settings):
    """transformers' sampling warpers for `settings`, built as its generate() builds them."""
    from transformers import GenerationConfig, GenerationMixin

    from tidar_convert.runtime.verify import PREFIX_FREE

    gc = GenerationConfig(do_sample=True, **settings)
    # _get_logits_processor reads no model state for these settings
    built = GenerationMixin._get_logits_processor(
        object.__new__(GenerationMixin), gc, input_ids_seq_length=4, device="cpu"
    )
    assert built and all(type(p).__name__ in PREFIX_FREE for p in built), built
    return built


class Counted(list):
    """A processor list that counts its calls."""

    calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        for p in self:
            scores = p(input_ids, scores)
        return scores


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=7),
        dict(min_p=0.05),
        dict(typical_p=0.8),
        dict(epsilon_cutoff=3e-3),
        dict(eta_cutoff=3e-3),
    ],
)
def test_prefix_free_warpers_take_a_steps_positions_in_one_call(settings):
    """Sampling's warpers read nothing but each row's scores: process() runs every position of a
    step through them in one call (one sort of the vocabulary for top_p), and each row comes out
    bit for bit as position by position. A processor that reads the prefix still gets each
    position's own."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from tidar_convert.runtime.verify import process, process_one

    g = torch.Generator().manual_seed(3)
    B, n, V = 2, 5, 512
    logits = torch.randn(B, n, V, generator=g) * 4
    seqs = torch.randint(0, V, (B, 7), generator=g)
    extra = torch.randint(0, V, (B, n - 1), generator=g)
    one_by_one = torch.stack(
        [
            process_one(warpers(**settings), torch.cat([seqs, extra[:, :i]], 1), logits[:, i])
            for i in range(n)
        ],
        1,
    )
    counted = Counted(warpers(**settings))
    got = process(counted, seqs, extra, logits)
    assert counted.calls == 1 and torch.equal(got, one_by_one)
    assert torch.isinf(got).any()  # the warpers did remove tokens
    # a slice of a wider forward's logits, as the engine passes them
    wide = torch.randn(B, n + 3, V, generator=g)
    assert torch.equal(
        process(warpers(**settings), seqs, extra, wide[:, 2 : 2 + n]),
        process(warpers(**settings), seqs, extra, wide[:, 2 : 2 + n].contiguous()),
    )
    assert torch.equal(logits, logits.clone())  # the caller's logits are not written to
    prefixed = Counted([RepetitionPenaltyLogitsProcessor(1.5), *warpers(**settings)])
    expected = torch.stack(
        [process_one(prefixed, torch.cat([seqs, extra[:, :i]], 1), logits[:, i]) for i in range(n)],
        1,
    )
    prefixed.calls = 0
    assert torch.equal(process(prefixed, seqs, extra, logits), expected) and prefixed.calls == n


def test_a_sampled_diffusion_draft_processes_its_slots_at_once_as_one_by_one():
    """make_draft with prefix-free warpers (sampling) draws each slot from its processed scores
    with that slot's keyed noise, all slots in one call: the same tokens and confidences as slot
    by slot."""
    from tidar_convert.runtime.drafters import make_draft
    from tidar_convert.runtime.verify import process_one

    g = torch.Generator().manual_seed(4)
    B, n, V = 2, 4, 300
    diff = torch.randn(B, n, V, generator=g) * 3
    seqs = torch.randint(0, V, (B, 6), generator=g)
    y = torch.tensor([5, 9])
    pick = Sampling(seed=21)
    pick.seek([3, 8])
    counted = Counted(warpers(temperature=0.8, top_p=0.9))
    draft, _ = make_draft(pick, counted, seqs, y, diff)
    assert counted.calls == 1
    tokens, conf = [y], []
    for i in range(n):
        scores = process_one(warpers(temperature=0.8, top_p=0.9), seqs, diff[:, i])
        tokens.append(pick.token(scores, i))
        conf.append(pick.confidence(scores))
    assert torch.equal(draft.tokens, torch.stack(tokens, 1))
    assert torch.equal(draft.confidence, torch.stack(conf, 1))


class RunsOf:
    """A processor that counts its runs."""

    def __init__(self, processor):
        self.__dict__.update(vars(processor))
        self.processor, self.runs = processor, 0

    def __call__(self, input_ids, scores):
        self.runs += 1
        return self.processor(input_ids, scores)


def test_top_p_on_sorted_values_gives_the_warpers_scores():
    """TopPOnSortedValues (generate's top_p: the vocabulary's values sorted by numpy) returns
    transformers' TopPLogitsWarper's scores bit for bit: random rows of every scale, rows of many
    equal scores (where the nucleus ends inside a run of them, which ones go is the warper's sort's
    to say, and the warper runs), -inf scores, a row of them, a NaN, top_p from 0 to 1,
    min_tokens_to_keep and another filter value."""
    from transformers import TopPLogitsWarper

    from tidar_convert.runtime.verify import TopPOnSortedValues

    g = torch.Generator().manual_seed(0)
    ran = Counter()
    for trial in range(240):
        V = (7, 64, 1000, 49152)[trial % 4]
        x = torch.randn(3, V, generator=g) * (0.1 + 8 * float(torch.rand(1, generator=g)))
        kind = trial // 4 % 6
        if kind == 1:
            x = x.round()  # many equal scores
        elif kind == 2:
            x[:, : V // 3] = -float("inf")
        elif kind == 3:
            x[1] = -float("inf")
        elif kind == 4:
            x[2, V // 2] = float("nan")
        top_p = (0.0, 0.3, 0.9, 0.95, 0.999, 1.0)[trial % 6]
        warper = TopPLogitsWarper(
            top_p,
            filter_value=(-float("inf"), -1e4)[trial % 2],
            min_tokens_to_keep=(1, 1, 3)[trial % 3],
        )
        ids = torch.zeros(3, 0, dtype=torch.long)
        want = warper(ids, x.clone())
        spy = RunsOf(warper)
        got = TopPOnSortedValues(spy)(ids, x.clone())
        ran["warper" if spy.runs else "sorted values"] += 1
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # the values' own path ran on most rows; the warper where it had to (equal scores, NaN, -inf)
    assert ran["sorted values"] > 120 and ran["warper"] >= 40, ran


def sorted_top_p_runs(monkeypatch) -> Counter:
    """A Counter whose "sorted values" counts TopPOnSortedValues' calls, from now on."""
    from tidar_convert.runtime.verify import TopPOnSortedValues

    runs, own = Counter(), TopPOnSortedValues.__call__

    def counted(self, input_ids, scores):
        runs["sorted values"] += 1
        return own(self, input_ids, scores)

    monkeypatch.setattr(TopPOnSortedValues, "__call__", counted)
    return runs


def test_generate_takes_top_p_on_sorted_values_with_the_warpers_tokens(
    small_vocab_model, monkeypatch
):
    """generate() swaps transformers' TopPLogitsWarper for TopPOnSortedValues (not with
    pack_weights=False), and a seeded sampled generation writes what it writes with the warper
    itself."""
    from tidar_convert.runtime.verify import TopPOnSortedValues

    prompt, runs = torch.tensor([[1, 2, 3]]), sorted_top_p_runs(monkeypatch)
    kw = dict(do_sample=True, temperature=0.7, top_p=0.8, max_new_tokens=12, eos_token_id=None)
    generate(prompt, model=small_vocab_model, pack_weights=False, **kw)  # transformers' own paths
    assert runs["sorted values"] == 0
    torch.manual_seed(3)
    swapped = generate(prompt, model=small_vocab_model, **kw)
    assert runs["sorted values"] >= 12
    monkeypatch.setattr(
        TopPOnSortedValues, "__call__", lambda self, ids, scores: self.warper(ids, scores)
    )
    torch.manual_seed(3)
    assert torch.equal(swapped, generate(prompt, model=small_vocab_model, **kw))


def test_ar_samples_top_p_on_sorted_values_too(small_vocab_model, monkeypatch):
    """tidar=False (transformers' own generate) samples top_p on TopPOnSortedValues as TiDAR does,
    writing what transformers' warper writes for the same seed; pack_weights=False keeps
    transformers' own; nothing is left on the model after either."""
    from transformers import GenerationMixin

    model, prompt, runs = (
        small_vocab_model,
        torch.tensor([[1, 2, 3]]),
        sorted_top_p_runs(monkeypatch),
    )
    kw = dict(do_sample=True, temperature=0.7, top_p=0.8, max_new_tokens=12, eos_token_id=None)
    kw |= dict(pad_token_id=0)
    torch.manual_seed(3)
    swapped = generate(prompt, model=model, tidar=False, **kw)
    assert runs["sorted values"] == 12 and "_get_logits_processor" not in model.__dict__
    torch.manual_seed(3)
    assert torch.equal(swapped, GenerationMixin.generate(model, prompt, **kw))
    generate(prompt, model=model, tidar=False, pack_weights=False, **kw)
    assert runs["sorted values"] == 12 and "_get_logits_processor" not in model.__dict__


def jittery_clock(seed):
    """A clock whose every step seems to take a random time: the cost plan prices step shapes from
    it, so each run chooses other shapes."""
    import random

    rng, now = random.Random(seed), [0.0]

    def perf_counter():
        now[0] += rng.uniform(0.001, 0.2)
        return now[0]

    return perf_counter


@pytest.mark.parametrize("rows", [1, 2])
def test_seeded_sampling_repeats_under_every_plan_and_drafter(trained, rows, monkeypatch):
    """torch.manual_seed before generate() gives the same tokens on every run, under every plan and
    drafter, one row or a batch (per-row acceptance), even while the cost plan's timings (here a
    jittery clock, new each run) change which steps run: they are AR sampling's tokens with the
    same draws. Another seed gives other tokens."""
    from types import SimpleNamespace

    from tidar_convert.runtime import engine
    from tidar_convert.runtime.drafters import DRAFTERS
    from tidar_convert.runtime.plan import PLANS
    from tidar_convert.runtime.verify import draw_seed

    model, _ = trained["llama"]
    ids = torch.cat([cycle_batch(1, 6, seed=1), torch.tensor([[40, 41, 3, 4, 40, 41]])])[:rows]
    # top_p: a warper that sorts the vocabulary, which the engine runs on a step's positions at once
    settings = dict(temperature=1.5, top_k=0, top_p=0.97)
    kw = dict(do_sample=True, max_new_tokens=30, eos_token_id=None, **settings)
    torch.manual_seed(11)
    expected = ar_sample(model, ids, draw_seed(), 30, **settings)
    steps, run = {}, 0
    for plan in PLANS:
        for drafter in DRAFTERS:
            for _ in range(3):
                run += 1
                monkeypatch.setattr(
                    engine, "time", SimpleNamespace(perf_counter=jittery_clock(run))
                )
                session_of(model).costs.clear()  # what the last run measured
                torch.manual_seed(11)
                assert torch.equal(
                    generate(ids, model=model, plan=plan, drafter=drafter, **kw), expected
                ), (plan, drafter)
                steps.setdefault((plan, drafter), set()).add(
                    (model.tidar_stats["slots_per_step"], tuple(model.tidar_stats["accepted"]))
                )
    # the clock did change the steps
    assert any(len(seen) > 1 for (plan, _), seen in steps.items() if plan == "cost"), steps
    torch.manual_seed(12)
    assert not torch.equal(generate(ids, model=model, **kw), expected)


@pytest.mark.parametrize("tidar", [False, True])
def test_seeded_sampling_repeats_on_a_fresh_model_too(trained, tidar):
    """The first generate() on a model times its packed product (kernels.packing_pays) before it
    decodes; that timing must not take from torch's global generator, or the first seeded call
    samples other tokens than the next ones. tidar=False is transformers' own sampling."""

    model, _ = trained["llama"]
    ids = cycle_batch(1, 6, seed=2)
    kw = dict(
        do_sample=True, max_new_tokens=20, eos_token_id=None, temperature=1.5, top_k=0, tidar=tidar
    )
    reset(model)  # as just loaded: the first call times, the next ones do not
    outs = []
    for _ in range(3):
        torch.manual_seed(5)
        outs.append(generate(ids, model=model, **kw))
    assert all(torch.equal(o, outs[0]) for o in outs)


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_inputs(trained, untrained):
    model, _ = trained["llama"]
    ids = cycle_batch(1, 4, seed=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(torch.zeros(1, 0, dtype=torch.long), model=model, max_new_tokens=4)
    for n in (0, -3):
        with pytest.raises(ValueError, match=f"max_new_tokens={n}"):
            generate(ids, model=model, max_new_tokens=n)
    with pytest.raises(ValueError, match="exceeds the model's 1024 positions"):
        generate(torch.ones(1, 1020, dtype=torch.long), model=model, max_new_tokens=10)
    with pytest.raises(ValueError, match="draft_length=1"):
        generate(ids, model=model, max_new_tokens=4, draft_length=1)
    with pytest.raises(ValueError, match="temperature"):
        generate(ids, model=model, max_new_tokens=4, do_sample=True, temperature=0.0)
    padded = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]])
    with pytest.raises(ValueError, match="no attention_mask"):
        generate(padded, model=model, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="right padding"):
        generate(
            padded,
            model=model,
            attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
            max_new_tokens=4,
        )
    plain = untrained["llama"]
    cfg = copy.deepcopy(plain.config)
    del cfg.mask_token_id
    plain.config, saved = cfg, plain.config
    try:
        with pytest.raises(ValueError, match="not a TiDAR export"):
            generate(ids, model=plain, max_new_tokens=4)
    finally:
        plain.config = saved


def test_sampling_is_exact_for_a_row_that_accepted_more_than_the_batch_commits():
    """Rows share one cache length, so a step commits the fewest drafts any row accepted (j). A row
    that accepted its draft j commits that very draft (its own draw at that position, so the same
    token a step of its own would commit), distributed as p. Row 0 always rejects; row 1 has
    p = (.5, .5) and drafts from q = (.9, .1) with the same draws."""
    from scipy.stats import binomtest

    from tidar_convert.runtime.generate import Draft

    n = 4000
    # (B, k=2, V): AR rows
    p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]]).log()
    q = torch.tensor([[0.0, 1.0], [0.9, 0.1]]).log()  # (B, V): the drafter's scores for draft 1
    ones = accepted_more = 0
    for seed in range(n):
        pick = Sampling(seed)
        pick.seek(0)
        draft = Draft(torch.stack([torch.zeros(2, dtype=torch.long), pick.token(q)], 1))
        accepted = pick.verify(p, draft)
        j = int(accepted.min())
        assert j == 1 and accepted[0] == 1
        y = pick.next_token(p[:, j - 1], draft, accepted, j)
        if accepted[1] > 1:
            accepted_more += 1
            assert y[1] == draft.tokens[1, 1]
        ones += int(y[1])
    assert accepted_more > n // 3
    assert binomtest(ones, n, 0.5).pvalue > 1e-3, ones / n


def test_acceptance_by_offset_tallies_each_rows_chain():
    """judge: offset i is judged where proposals 1..i-1 were accepted and i was offered; the plan's
    chance is summed over the judged proposals that had one."""
    from tidar_convert.runtime.drafters import Draft
    from tidar_convert.runtime.engine import DecodeState

    seqs = torch.zeros(3, 2, dtype=torch.long)
    state = DecodeState(
        seqs, torch.ones_like(seqs, dtype=torch.bool), torch.tensor([True, True, False])
    )
    draft = Draft(
        torch.zeros(3, 4, dtype=torch.long),
        length=torch.tensor([4, 3, 4]),
        sources=["lookup", "diffusion", "lookup"],
        confidence=torch.tensor([[0.9, 0.8, 0.7], [0.5, 0.25, 0.0], [1.0, 1.0, 1.0]]),
    )
    # lookup: 2 of 3 accepted; diffusion: none of 2; the last row has stopped
    state.judge(draft, [3, 1, 4])
    state.judge(
        Draft(
            torch.zeros(3, 3, dtype=torch.long),
            length=torch.tensor([3, 1, 3]),
            sources=["lookup", "none", "lookup"],
        ),
        [3, 1, 3],
    )
    assert state.offsets == {
        "lookup": {
            "judged": [2, 2, 1],
            "accepted": [2, 2, 0],
            "predicted": [pytest.approx(0.9), pytest.approx(0.8), pytest.approx(0.7)],
            "rated": [1, 1, 1],
        },
        "diffusion": {"judged": [1], "accepted": [0], "predicted": [0.5], "rated": [1]},
    }


def test_acceptance_by_offset_adds_up_to_what_was_committed(trained):
    """Batch 1, chains: every accepted proposal is one the step committed, and a step judges offset
    1 whenever it verified a proposal."""
    model, _ = trained["llama"]
    for drafter in ("diffusion", "lookup", "hybrid"):
        generate(
            cycle_batch(1, 4, seed=3),
            model=model,
            max_new_tokens=30,
            eos_token_id=None,
            drafter=drafter,
            siblings=0,
        )
        stats = model.tidar_stats
        tables = stats["acceptance_by_offset"]
        assert tables and set(tables) <= {"lookup", "diffusion"}, drafter
        assert sum(sum(t["accepted"]) for t in tables.values()) == sum(
            a - 1 for a in stats["accepted"]
        ), drafter
        assert all(
            t["judged"][i] >= t["accepted"][i] >= t["judged"][i + 1]
            for t in tables.values()
            for i in range(len(t["judged"]) - 1)
        )


@pytest.mark.parametrize("batch", [1, 3])
def test_commit_at_once_equals_commit_by_round(batch):
    """The one-read commit (EOS and max_length only) leaves every field as the round-by-round one
    does, on random steps: EOS inside and at the end of a row's tokens, rows that stopped, rows
    at max_new, and max_length reached inside the step."""
    from types import SimpleNamespace

    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    from tidar_convert.runtime.engine import DecodeState, Kept, commit, known_stops

    gen = torch.Generator().manual_seed(0)
    eos, pad, max_new = [3, 5], 0, 9
    checked = 0
    for case in range(300):
        L, n = (
            int(torch.randint(2, 6, (1,), generator=gen)),
            int(torch.randint(1, 5, (1,), generator=gen)),
        )
        lengths = [None, L + int(torch.randint(1, 5, (1,), generator=gen))]
        criteria = StoppingCriteriaList([EosTokenCriteria(eos)])
        if lengths[case % 2] is not None:
            criteria.append(MaxLengthCriteria(lengths[case % 2]))
        run = SimpleNamespace(pad=pad, max_new=max_new, streamer=None)
        stops = known_stops(run, criteria)
        assert stops is not None

        def fresh():
            state = DecodeState(
                torch.randint(6, 20, (batch, L), generator=gen),
                torch.rand(batch, L, generator=gen) > 0.2,
                torch.rand(batch, generator=gen) > 0.2,
            )
            state.n_new = torch.randint(0, max_new - 1, (batch,), generator=gen)
            state.new = torch.randint(6, 20, (batch, max_new + n), generator=gen)
            tokens = torch.randint(2, 8, (batch, n), generator=gen)  # EOS often
            counts = torch.randint(1, n + 1, (batch,), generator=gen)
            return state, Kept(tokens, counts, [], None)

        state, kept = fresh()
        other, known = copy.deepcopy(state), copy.deepcopy(state)
        commit(run, criteria, state, kept, stops=stops)
        commit(run, criteria, other, kept)
        # the tokens known on the host (a greedy step's verdict read them): nothing read
        rows = [t[:c] for t, c in zip(kept.tokens.tolist(), kept.counts.tolist())]
        commit(
            run, criteria, known, Kept(kept.tokens, kept.counts, [], None, host=rows), stops=stops
        )
        for name in ("seqs", "kv_valid", "active", "n_new", "new"):
            assert torch.equal(getattr(state, name), getattr(other, name)), (case, name)
            assert torch.equal(getattr(known, name), getattr(other, name)), (case, name)
        assert state.committed == known.committed
        checked += int(other.seqs.shape[1] > L)
    assert checked > 100  # most cases committed something


@pytest.mark.parametrize(
    "batch, drafter, siblings",
    [
        (1, "diffusion", 0),
        (1, "diffusion", 3),
        (1, "hybrid", 3),
        (1, "lookup", 0),
        (3, "hybrid", 0),
    ],
)
def test_a_greedy_step_reads_the_device_once(trained, batch, drafter, siblings, monkeypatch):
    """Greedy on raw logits, where a read waits for the device, a step's verdict, AR's token at
    each of its causal slots (a tree's siblings too) and the next diffusion draft's candidates at
    every group come back in one read (engine.read_verdict): on a GPU the step waits for the device
    once. What else the decoding code reads, it reads once a call (the prompt's checks, the
    prefill's draft), whatever the length. On a CPU (reads do not wait) the next draft reads its
    own group's candidates after the verdict, and nothing else changes."""
    from tidar_convert.bench.steps import HostReads
    from tidar_convert.runtime import engine

    assert not engine.reads_wait(torch.device("cpu")) and engine.reads_wait(torch.device("cuda"))
    monkeypatch.setattr(engine, "reads_wait", lambda device: True)  # as on a GPU

    model, _ = trained["llama"]
    # a prompt the cycle does not continue: drafts miss, and a tree's steps take siblings. A
    # batch's rows are the same, so that they stop together (a row that stops is read once).
    ids = torch.randint(1, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    ids = ids.repeat(batch, 1)
    walk, off_chain = engine.walk, []

    def spy(plan, *args):
        path, *rest = walk(plan, *args)
        off_chain.append(any(s >= plan.n_drafts for s in path))
        return (path, *rest)

    def reads(n):
        kw = dict(max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        # siblings=0 said outright: the default lets the cost plan's timings choose trees
        tree = dict(plan="adaptive", slot_budget=96) if siblings else {}
        with HostReads() as counted, pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine, "walk", spy)
            out = generate(ids, model=model, drafter=drafter, siblings=siblings, **tree, **kw)
        assert torch.equal(out, ar(model, ids, **kw))
        return counted.at, model.tidar_stats["nfe"]

    (short, _), (long, nfe) = reads(6), reads(40)
    steps = nfe - 1  # the prefill is a forward, not a step
    assert long.pop("engine.read_verdict") == steps > 5, long
    short.pop("engine.read_verdict")
    assert long == short
    assert any(off_chain) == bool(siblings)
    monkeypatch.setattr(engine, "reads_wait", lambda device: False)  # as on a CPU
    on_cpu, cpu_nfe = reads(40)
    assert on_cpu.pop("engine.read_verdict") == cpu_nfe - 1
    assert (on_cpu == long) == (drafter == "lookup" and not siblings)


def test_a_rows_candidates_from_the_read_are_the_top_choices_of_the_logits_it_reads():
    """For every accepted length of every row, Step.choices_at gives each row the top choices of
    the logits Output.rows_at gives it: its group's, the later slots of a group anchored before
    (fewer, then the first again as filler), or None where some row's length has no group."""
    import itertools
    from types import SimpleNamespace

    from tidar_convert.runtime.engine import Step, read_ahead, read_verdict
    from tidar_convert.runtime.forward import Output
    from tidar_convert.runtime.plan import StepPlan
    from tidar_convert.runtime.tree import top_choices

    torch.manual_seed(0)
    B, H, V, k, n = 3, 8, 50, 4, 2
    head = torch.nn.Linear(H, V, bias=False)
    model = SimpleNamespace(get_output_embeddings=lambda: head, config=SimpleNamespace())
    plan = StepPlan(n_drafts=6, anchors=(1, 3, 6), k=k)
    out = Output(model, torch.randn(B, plan.slots, H), read=plan.read())
    accepted, best = torch.tensor([1, 2, 3]), torch.zeros(B, plan.n_drafts, dtype=torch.long)
    taken, best_host, _, tops = read_verdict(accepted, best, read_ahead(out, plan, n))
    step = Step(None, plan, out, None, None, accepted, taken, best, best_host, None, tops)
    seen = Counter()
    for lengths in itertools.product(range(1, plan.n_drafts + 1), repeat=B):
        reads = [plan.group_read(j) for j in lengths]
        have = [0 if r is None else r[1] for r in reads]
        got = step.choices_at(reads, k - 1, have)
        if None in reads:
            assert got is None
            continue
        logits = out.rows_at(torch.tensor([r[0] + 1 for r in reads]), k - 1, torch.tensor(have))
        assert (got[0], got[1]) == top_choices(logits.float(), n) and got[2] == have
        seen.update(have)
    assert seen[k - 1] and seen[k - 2]  # whole groups and shorter ones, with filler


@pytest.mark.parametrize("batch, siblings", [(1, 0), (1, 3), (3, 0)])
def test_the_candidates_a_verdict_brings_are_the_groups_top_choices(
    trained, batch, siblings, monkeypatch
):
    """The next diffusion draft built from the candidates the verdict's read brought (for every
    group, before the verdict said which) is the draft built from the group's logits: the same
    tokens, chances, lengths, sources and tree, each row reading its own group (a batch commits
    per row) with the filler rows_at gives a row whose group holds fewer."""
    import dataclasses

    from tidar_convert.runtime import engine
    from tidar_convert.runtime.drafters import DiffusionDrafter

    monkeypatch.setattr(engine, "reads_wait", lambda device: True)  # as on a GPU
    model, _ = trained["llama"]
    real, compared = DiffusionDrafter.propose, []
    fields = ("tokens", "length", "confidence", "siblings", "sibling_confidence")

    def both(self, ctx):
        if ctx.choices is not None:
            state = (self.taken, self.predicted)
            from_logits = real(self, dataclasses.replace(ctx, choices=None))
            self.taken, self.predicted = state
            got = real(self, ctx)
            assert (got is None) == (from_logits is None)
            if got is not None:
                for name in fields:
                    a, b = getattr(got, name), getattr(from_logits, name)
                    assert (a is None and b is None) or torch.equal(a, b), name
                    assert got.host(name) == from_logits.host(name), name
                assert got.sources == from_logits.sources
                assert got.sibling_parents == from_logits.sibling_parents
                compared.append(got.tokens.shape[1])
            return got
        return real(self, ctx)

    ids = cycle_batch(batch, 6, seed=4)
    kw = dict(max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DiffusionDrafter, "propose", both)
        for plan in ("adaptive", "cost", "full"):
            got = generate(
                ids, model=model, drafter="diffusion", plan=plan, siblings=siblings, **kw
            )
            assert torch.equal(got, ar(model, ids, **kw))
    assert len(compared) > 10 and max(compared) > 2


def test_commit_one_round_at_a_time_for_other_criteria_and_streamers():
    from types import SimpleNamespace

    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    from tidar_convert.runtime.engine import known_stops

    class Custom(EosTokenCriteria):  # a subclass may stop on anything
        pass

    run = SimpleNamespace(streamer=None)
    assert known_stops(run, StoppingCriteriaList([EosTokenCriteria(2), MaxLengthCriteria(9)])) == (
        frozenset({2}),
        9,
    )
    assert known_stops(run, StoppingCriteriaList([Custom(2)])) is None
    assert known_stops(SimpleNamespace(streamer=object()), StoppingCriteriaList([])) is None


@pytest.mark.parametrize("batch, sampled", [(1, False), (3, False), (1, True), (3, True)])
def test_the_host_copies_a_step_commits_from_are_the_device_tokens(
    trained, batch, sampled, monkeypatch
):
    """A step's commit reads nothing: its tokens come from the verdict's one read and the draft's
    host copies, greedy or sampled. Those copies must be the tokens the device holds, for every
    drafter, tree or chain, batch or not (a wrong copy would stop a row at a wrong EOS and feed the
    lookup index wrong text while the output stayed exact)."""
    from tidar_convert.runtime import engine

    model, _ = trained["qwen2"]
    real, checked = engine.commit_at_once, []

    def check(run, state, kept, eos, max_length):
        if kept.host is not None:
            counts = kept.counts.tolist()
            assert [len(h) for h in kept.host] == counts
            assert kept.host == [t[:c] for t, c in zip(kept.tokens.tolist(), counts)]
            checked.append(len(kept.host))
        return real(run, state, kept, eos, max_length)

    monkeypatch.setattr(engine, "commit_at_once", check)
    ids = cycle_batch(batch, 6, seed=batch)
    free = ar(model, ids, max_new_tokens=30, eos_token_id=None)
    # no EOS, then one that stops the rows at different steps (stopped rows stay in a step)
    for eos in (None, int(free[0, 6 + 9])):
        kw = dict(max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
        if sampled:  # a seed gives the same tokens whatever the drafter
            kw.update(do_sample=True, temperature=1.2, top_p=0.95)
        expected = None if sampled else ar(model, ids, **kw)
        for drafter in ("hybrid", "diffusion", "lookup"):
            torch.manual_seed(3)
            got = generate(ids, model=model, drafter=drafter, **kw)
            expected = got if expected is None else expected
            assert torch.equal(got, expected), drafter
    assert len(checked) > 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 8192), (2, 3, 49152), (5, 50261), (4, 128)])
def test_argmax_is_torchs_with_ties_and_non_finite_scores(shape, dtype):
    from tidar_convert.runtime.verify import argmax

    for seed in range(3):
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)
        V = shape[-1]
        rows = x.view(-1, V)
        top = rows.argmax(-1)
        rows[0, (int(top[0]) + V // 2) % V] = rows[0, top[0]]  # the maximum twice, far apart
        rows[1, (int(top[1]) + V - 1) % V] = rows[1, top[1]]  # and just before it
        rows[2] = float("-inf")  # every token removed
        rows[3, [7, V - 3]] = float("nan")
        if rows.shape[0] > 4:
            rows[4, [V - 1, 5]] = float("inf")
        assert torch.equal(argmax(x), x.argmax(-1))
        assert torch.equal(argmax(x[..., ::2, :]), x[..., ::2, :].argmax(-1))  # not contiguous


def test_slots_of_is_indexing_by_the_list():
    from tidar_convert.runtime.forward import slots_of

    x = torch.randn(2, 9, 5)
    for slots in ([], [0], [3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 2], [5, 3], [1, 1]):
        assert torch.equal(slots_of(x, slots), x[:, slots])
        # by the index made beforehand (plan.read_index)
        assert torch.equal(slots_of(x, slots, torch.tensor(slots, dtype=torch.long)), x[:, slots])
    # a run is a view: nothing copied
    assert slots_of(x, [2, 3, 4]).data_ptr() == x[:, 2].data_ptr()


@pytest.mark.parametrize("batch, siblings", [(1, 0), (1, 3), (3, 0)])
def test_a_steps_head_rows_are_gathered_by_an_index_made_once_per_plan(trained, batch, siblings):
    """The rows a step's vocabulary head reads (plan.read(): the AR rows, then each group's draft
    slots, not a run) are gathered by an index on the device made once per plan shape
    (plan.read_index), never from the list during a step: on a GPU a copy of a list to the device
    waits for the decoder body queued before it."""
    from tidar_convert.runtime import forward as forward_module
    from tidar_convert.runtime.plan import read_index

    model, _ = trained["llama"]
    ids = torch.randint(1, 300, (1, 9), generator=torch.Generator().manual_seed(1)).repeat(batch, 1)
    real, gathered = forward_module.slots_of, []

    def spy(x, slots, index=None):
        if slots != list(range(slots[0], slots[0] + len(slots))):
            gathered.append((slots, index))
        return real(x, slots, index)

    kw = dict(max_new_tokens=40, eos_token_id=None, pad_token_id=0, drafter="diffusion")
    tree = dict(plan="adaptive", slot_budget=96) if siblings else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forward_module, "slots_of", spy)
        out = generate(ids, model=model, siblings=siblings, **tree, **kw)
    assert torch.equal(out, ar(model, ids, eos_token_id=None, pad_token_id=0, max_new_tokens=40))
    # the prefill's read (the prompt's last row, its group) goes by the list, once a call; each
    # step's with groups is not a run (a step without any reads a view)
    assert gathered[0][1] is None and len(gathered) > 5
    for slots, index in gathered[1:]:
        assert index is not None and index.tolist() == slots
    # made once per plan shape (each kept alive by `gathered`, so ids are not reused)
    made = {id(index) for _, index in gathered[1:]}
    assert len(made) < len(gathered) - 1 and read_index.cache_info().hits > 0


def test_step_phases_are_recorded_under_a_profiler_and_cost_nothing_without_one(
    trained, monkeypatch
):
    """Every phase of a step (forward.phase) shows in a profiler's events, the step breakdown's
    ranges; with no profiler running, a step enters no record_function (each would cost a
    dispatcher call)."""
    from torch.profiler import profile

    from tidar_convert.runtime import forward

    model, _ = trained["llama"]
    ids = cycle_batch(1, 5, seed=0)
    entered = []
    real = forward.record_function

    def counted(name):
        entered.append(name)
        return real(name)

    monkeypatch.setattr(forward, "record_function", counted)
    plain = generate(ids, model=model, max_new_tokens=24, eos_token_id=None)
    assert entered == []
    with profile() as prof:
        profiled = generate(ids, model=model, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(profiled, plain)
    phases = {"mask", "forward", "lm_head", "verify", "commit", "draft", "crop"}
    assert {f"tidar.{p}" for p in phases} <= set(entered)
    assert {f"tidar.{p}" for p in phases} <= {e.name for e in prof.events()}


def test_the_model_s_parts_are_read_once_a_call(trained, monkeypatch):
    """forward.Parts: the decoder body, the head, and the config fields a step's forward and mask
    need are read once a generate() call, not each step (in transformers 5 each lookup costs
    microseconds, and a step asked for a dozen); the tokens are the same."""
    from tidar_convert.runtime import engine, forward

    model, _ = trained["llama"]
    ids = cycle_batch(1, 5, seed=0)
    plain = generate(ids, model=model, max_new_tokens=24, eos_token_id=None)
    calls = []
    read = forward.model_parts
    monkeypatch.setattr(engine, "model_parts", lambda m: calls.append(1) or read(m))
    heads = []
    monkeypatch.setattr(
        forward, "head_is_plain", lambda m, real=forward.head_is_plain: heads.append(1) or real(m)
    )
    again = generate(ids, model=model, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(again, plain)
    assert model.tidar_stats["nfe"] > 3 and calls == [1] and heads == [1]


def test_a_step_puts_host_values_on_the_device_through_one_helper(trained, monkeypatch):
    """Every tensor the runtime makes from Python values goes through transfer.on_device, which
    copies to a GPU without waiting for it (torch.tensor(..., device=cuda) copies from pageable
    memory, a sync with the device each): a tree step, lookup drafts, a batch committing per row and
    a batch committing together make none with torch.tensor(device=...)."""
    import sys

    model, _ = trained["llama"]
    made = []
    real = torch.tensor

    def tensor(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if "runtime" in caller and kwargs.get("device") is not None:
            made.append((caller, sys._getframe(1).f_lineno))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    one, two = cycle_batch(1, 6, seed=0), cycle_batch(2, 6, seed=1)
    for ids, kwargs in (
        (one, {}),  # a tree: siblings, plans, branches kept
        (one, {"drafter": "lookup"}),
        (two, {}),  # rows commit what each accepted
        (two, {"output_scores": True, "return_dict_in_generate": True}),  # rows commit together
    ):
        generate(ids, model=model, max_new_tokens=24, eos_token_id=None, **kwargs)
    assert made == []


def test_on_device_is_torch_tensor_on_any_device():
    from tidar_convert.runtime.transfer import on_device

    for values, dtype in (([[1, 2], [3, 4]], None), ([0.5, 0.25], None), ([], torch.long)):
        expected = torch.tensor(values, dtype=dtype)
        got = on_device(values, torch.device("cpu"), dtype)
        assert torch.equal(got, expected) and got.dtype == expected.dtype
        meta = on_device(values, torch.device("meta"), dtype)
        assert meta.device.type == "meta" and meta.shape == expected.shape
        if torch.cuda.is_available():
            cuda = on_device(values, torch.device("cuda"), dtype)
            assert torch.equal(cuda.cpu(), expected) and cuda.dtype == expected.dtype


def test_drafted_masks_proposals_past_a_rows_length_unless_every_row_drafted_all():
    """verify.drafted: a proposal past its row's length never matches; where the draft's host copy
    says every row drafted all of them, the match is returned as it is (no mask built); lengths
    only on the device are not read (masked the same way)."""
    from tidar_convert.runtime.drafters import Draft
    from tidar_convert.runtime.verify import drafted

    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    match = torch.ones(2, 3, dtype=torch.bool)
    full = Draft(tokens)  # every row all 4: the host copy is held
    assert drafted(match, full) is match
    short = Draft(tokens, length=torch.tensor([4, 2]))
    assert short.held("length") is None
    expected = torch.tensor([[True, True, True], [True, False, False]])
    assert torch.equal(drafted(match, short), expected)
    assert short.held("length") is None  # not read to decide
    held = Draft(tokens, length=torch.tensor([4, 2])).hold(length=[4, 2])
    assert torch.equal(drafted(match, held), expected)
