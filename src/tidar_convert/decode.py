"""TiDAR decoding as a drop-in `generate()`: draft in diffusion, verify autoregressively, one pass a step.

Shipped verbatim in every export as `custom_generate/generate.py` (with layout.py beside it), so
`AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).generate(...)` runs this loop
without tidar_convert installed. It imports nothing but torch, transformers and ./layout.

The loop (docs/method.md §3), with k = block size:
  prefill  prompt (causal) + one mask block -> first token y (AR) and the first draft (diffusion)
  step     k drafts + k groups of k masks, one forward
  verify   draft i is accepted while it is what the AR head says after drafts 0..i-1
           (greedy: equal to the argmax; sampling: rejection sampling, exact in distribution)
  commit   accepted drafts + one AR token y; the next draft is y + group j's diffusion guesses
  crop     the KV cache keeps the accepted drafts and drops every other slot of the step

generate() arguments mean what they mean in transformers: the config is merged and the logits
processors and stopping criteria are built by transformers' own GenerationMixin helpers (`prepare`).
Processors see each AR row and each draft slot with the prefix AR would have there (`process`,
`make_draft`), so verification stays exact; what cannot be verified this way is refused by name.

After each call, `model.tidar_stats` holds {"nfe", "new_tokens", "tokens_per_nfe", "accepted"}:
forward passes, new token positions, their ratio, and drafts accepted at each step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

# Relative, so the same line works in the package and in an export's custom_generate/ folder.
from .layout import build_mask, decode_mask_mod, decode_position_ids


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, k); tokens[:, 0] is already committed
    q: torch.Tensor | None  # (B, k - 1, V) proposal probabilities of tokens[:, 1:] (sampling only)


# --------------------------------------------------------------------------------------------
# The steps.
# --------------------------------------------------------------------------------------------


def forward(model, cache, tokens, positions, mask_mod, kv_len, logits_to_keep=0):
    mask = build_mask(mask_mod, tokens.shape[0], tokens.shape[1], kv_len, model.config._attn_implementation, tokens.device)
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, logits_to_keep=logits_to_keep, **cache_kwargs(model, cache))
    return out.logits


def cache_kwargs(model, cache) -> dict:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name goes in 5.40)."""
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def prefill(model, cache, prompt, kv_valid, k, mask_id):
    """Prompt + one mask block. Returns the AR logits for the first new token y (B, V) and the
    diffusion logits of the first draft's slots 1..k-1 (B, k - 1, V)."""
    B, P = prompt.shape
    n = kv_valid.sum(1)  # real prompt tokens per row (left padding)
    tokens = torch.cat([prompt, torch.full((B, k), mask_id, device=prompt.device)], 1)
    prompt_pos = (kv_valid.cumsum(1) - 1).clamp(min=0)
    positions = torch.cat([prompt_pos, decode_position_ids(n - P, P, k, 1, P)[:, P:]], 1)
    valid = torch.cat([kv_valid, torch.ones(B, k, dtype=torch.bool, device=prompt.device)], 1)
    # Only the last prompt token (-> y) and the mask block (-> the draft) need the vocabulary head.
    logits = forward(model, cache, tokens, positions, decode_mask_mod(0, P, k, P, valid), P + k, logits_to_keep=k + 1)
    cache.crop(-k)
    return logits[:, 0], logits[:, 2:]


def step(model, cache, draft: Draft, start, kv_valid, k, mask_id):
    """One forward over k drafts (at positions start..) and k groups of k masks."""
    B, C = draft.tokens.shape[0], cache.get_seq_length()
    masks = torch.full((B, k * k), mask_id, device=draft.tokens.device)
    tokens = torch.cat([draft.tokens, masks], 1)
    valid = torch.cat([kv_valid[:, :C], torch.ones(B, k + k * k, dtype=torch.bool, device=kv_valid.device)], 1)
    logits = forward(model, cache, tokens, decode_position_ids(start, k, k, k, 1), decode_mask_mod(C, k, k, 1, valid), C + k + k * k)
    return logits[:, :k], logits[:, k:].unflatten(1, (k, k))  # ar (B, k, V), diff (B, group, slot, V)


class Greedy:
    """Accept a draft while it equals the argmax of the processed AR scores; the output is exactly AR greedy."""

    def token(self, scores):
        return scores.argmax(-1)

    def propose(self, scores):  # one draft slot: (token, proposal distribution or None)
        return scores.argmax(-1), None

    def verify(self, scores, draft: Draft):
        """Drafts accepted per row (>= 1: draft 0 is committed already). scores (B, k, V): processed AR."""
        match = scores[:, :-1].argmax(-1) == draft.tokens[:, 1:]
        return 1 + match.long().cumprod(1).sum(1)

    def next_token(self, target, draft, accepted, j, exact=True):
        return self.token(target)


class Sampling:
    """Rejection sampling against the diffusion proposal: the output is distributed as AR sampling."""

    def __init__(self, generator=None):
        self.generator = generator

    @staticmethod
    def probs(scores):
        scores = scores.float()
        dead = ~torch.isfinite(scores).any(-1, keepdim=True)  # a processor removed every token (only in a draft)
        return scores.masked_fill(dead, 0.0).softmax(-1)

    def sample(self, probs):
        shape = probs.shape
        return torch.multinomial(probs.reshape(-1, shape[-1]), 1, generator=self.generator).reshape(shape[:-1])

    def token(self, scores):
        return self.sample(self.probs(scores))

    def propose(self, scores):
        q = self.probs(scores)
        return self.sample(q), q

    def verify(self, scores, draft: Draft):
        p = self.probs(scores[:, :-1])  # p[:, i-1] is the AR distribution for draft i
        d = draft.tokens[:, 1:, None]
        ratio = p.gather(-1, d).squeeze(-1) / draft.q.gather(-1, d).squeeze(-1)
        u = torch.rand(ratio.shape, generator=self.generator, device=ratio.device)
        self._p = p
        return 1 + (u < ratio).long().cumprod(1).sum(1)

    def next_token(self, target, draft, accepted, j, exact=True):
        """The token at draft position j, drawn from `target` (the processed AR scores there). Rows that
        rejected draft j resample from norm(max(0, p - q)); rows that accepted it (the batch commits the
        fewest any row accepted) commit draft j itself: "draft if accepted, else residual" is what makes
        the token distributed as p. After all k drafts, a fresh sample from p (the bonus token).
        exact=False (beta < 1): `target` is not p, so a plain draw from it."""
        k = draft.tokens.shape[1]
        y = self.token(target)
        if j < k and exact:
            y = torch.where(accepted > j, draft.tokens[:, j], y)
            residual = (self._p[:, j - 1] - draft.q[:, j - 1]).clamp(min=0)
            rejected = (accepted == j) & (residual.sum(-1) > 0)
            if rejected.any():
                y = torch.where(rejected, self.sample(residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)), y)
        return y


def mix(ar_logits, diff_logits, beta):
    """beta = 1: trust AR (exact). beta < 1 mixes in the diffusion head's log-probs (faster, not exact)."""
    if beta == 1.0 or diff_logits is None:
        return ar_logits
    return beta * ar_logits.float().log_softmax(-1) + (1 - beta) * diff_logits.float().log_softmax(-1)


def process(processors, seqs, extra, logits):
    """Logits processors, row by row with each row's own prefix, as AR decoding would call them.

    logits (B, n, V): row i predicts the token after `seqs ++ extra[:, :i]`. Returns float32 scores.
    Prefix-dependent processors (no_repeat_ngram_size, min_new_tokens, repetition_penalty, ...) thus
    see exactly the sequence AR would have had at that position."""
    if not processors:
        return logits.float()
    rows = []
    for i in range(logits.shape[1]):
        scores = logits[:, i].to(torch.float32, copy=True)
        rows.append(processors(torch.cat([seqs, extra[:, :i]], 1), scores))
    return torch.stack(rows, 1)


def make_draft(pick, processors, seqs, y, diff_slots):
    """The next draft: y, then one guess per diffusion slot (B, k - 1, V). Each slot is processed with
    the prefix it would have (seqs ++ the guesses before it), so e.g. suppressed tokens are never drafted."""
    tokens, qs = [y], []
    for i in range(diff_slots.shape[1]):
        scores = diff_slots[:, i].to(torch.float32, copy=True)
        if processors:
            scores = processors(torch.cat([seqs] + [t[:, None] for t in tokens[1:]], 1), scores)
        t, q = pick.propose(scores)
        tokens.append(t)
        qs.append(q)
    return Draft(torch.stack(tokens, 1), torch.stack(qs, 1) if qs and qs[0] is not None else None)


# --------------------------------------------------------------------------------------------
# generate(): the drop-in entry point.
# --------------------------------------------------------------------------------------------


# GenerationConfig fields TiDAR decoding does not implement, refused by name when set to anything but
# None, transformers' global default, or one of the listed values. Every other field is honoured with
# transformers' semantics or changes nothing here; tests/test_generate_args.py walks every field.
REFUSED = {
    "num_beams": ((1,), "beam search"),
    "num_beam_groups": ((1,), "group beam search"),
    "diversity_penalty": ((0.0,), "group beam search"),
    "constraints": ((), "constrained beam search"),
    "force_words_ids": ((), "constrained beam search"),
    "penalty_alpha": ((0.0,), "contrastive search"),
    "dola_layers": ((), "DoLa decoding"),
    "guidance_scale": ((1, 1.0), "classifier-free guidance runs a second, unconditional model pass per token"),
    "watermarking_config": ((), "watermarking processors keep per-call state"),
    "token_healing": ((False,), "token healing rewrites the prompt with a nested generate()"),
    "output_attentions": ((False,), "a TiDAR step attends over drafts and masks, not AR positions"),
    "output_hidden_states": ((False,), "a TiDAR step's hidden states are not AR positions"),
    "prompt_lookup_num_tokens": ((), "prompt lookup is another drafter"),
    "assistant_early_exit": ((), "self-speculative early exit is another drafter"),
    "use_mtp": ((False,), "multi-token prediction is another drafter"),
    "is_assistant": ((False,), "a TiDAR model is not run as an assistant"),
    "cache_implementation": (("dynamic",), "TiDAR crops a DynamicCache after every step"),
}
# generate() arguments that are not GenerationConfig fields: refused when given (not None / False).
REFUSED_ARGS = {
    "assistant_model": "assisted decoding is another drafter",
    "assistant_tokenizer": "assisted decoding is another drafter",
    "negative_prompt_ids": "classifier-free guidance",
    "negative_prompt_attention_mask": "classifier-free guidance",
    "inputs_embeds": "TiDAR drafts token ids; pass input_ids",
    "synced_gpus": "multi-GPU synced generation",
    "custom_generate": "this already is a custom generate()",
}


def refuse(name, value, why):
    if not isinstance(value, (bool, int, float, str, list, tuple, dict)):
        value = f"<{type(value).__name__}>"
    raise ValueError(f"{name}={value!r} is not supported by TiDAR decoding ({why}); pass tidar=False for plain AR decoding (transformers' generate).")


def check_refused(gc: GenerationConfig) -> None:
    defaults = GenerationConfig._get_default_generation_params()
    for name, (allowed, why) in REFUSED.items():
        value = getattr(gc, name, None)
        if value is not None and value != defaults.get(name) and value not in allowed:
            refuse(name, value, why)
    mode = gc.get_generation_mode()  # a catch-all, should transformers add a decoding mode
    if mode not in ("greedy_search", "sample"):
        refuse("generation mode", str(mode), "TiDAR verifies greedy or sampled drafts only")


@dataclass
class Run:
    """Everything one generate() call decides before the loop, as transformers' generate() decides it."""

    input_ids: torch.Tensor  # (B, P), repeated num_return_sequences times
    kv_valid: torch.Tensor  # (B, P) False at left padding
    gc: GenerationConfig  # merged: arguments > generation_config > model.generation_config > defaults
    processors: LogitsProcessorList  # transformers' own, plus `logits_processor`
    criteria: StoppingCriteriaList  # max_length, max_time, stop_strings, EOS, plus `stopping_criteria`
    pick: Greedy | Sampling
    k: int
    mask_id: int
    pad: int
    streamer: object = None

    @property
    def max_new(self) -> int:
        return self.gc.max_length - self.input_ids.shape[1]


def prepare(model, input_ids, generation_config, block_size, beta, kwargs) -> Run:
    """Merge and check the arguments, and build the logits processors and stopping criteria, through
    transformers' own GenerationMixin helpers so every field means what it means there."""
    for name, why in REFUSED_ARGS.items():
        value = kwargs.pop(name, None)
        if value is not None and value is not False:
            refuse(name, value, why)
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    stopping_criteria = kwargs.pop("stopping_criteria", None)
    logits_processor = kwargs.pop("logits_processor", None)
    prefix_allowed_tokens_fn = kwargs.pop("prefix_allowed_tokens_fn", None)
    tokenizer = kwargs.pop("tokenizer", None)
    generator = kwargs.pop("generator", None)
    kwargs.pop("trust_remote_code", None)
    if kwargs.get("max_new_tokens") is not None and kwargs["max_new_tokens"] <= 0:  # before transformers' own, vaguer check
        raise ValueError(f"max_new_tokens={kwargs['max_new_tokens']}: must be >= 1.")
    # A given generation_config is completed by the model's, then by the global defaults
    # (max_length=20, temperature=1.0, ...); keyword arguments override both.
    has_default_max_length = kwargs.get("max_length") is None and (generation_config is None or generation_config.max_length is None) and model.generation_config.max_length is None
    has_default_min_length = kwargs.get("min_length") is None and (generation_config is None or generation_config.min_length is None) and model.generation_config.min_length is None
    gc, unused = GenerationMixin._prepare_generation_config(model, generation_config, **kwargs)
    check_refused(gc)
    if unused:
        raise TypeError(f"TiDAR generate() got unsupported arguments: {', '.join(sorted(unused))}.")
    if input_ids is None and gc.bos_token_id is not None:  # as transformers: no prompt -> one BOS token
        input_ids = torch.full((1, 1), gc.bos_token_id, dtype=torch.long, device=model.device)
    k = block_size or getattr(model.config, "block_size", None)
    mask_id = getattr(model.config, "mask_token_id", None)
    check_inputs(model, gc, input_ids, attention_mask, k, mask_id, beta)

    prompt_ids, n = input_ids, gc.num_return_sequences or 1
    if n > 1:  # as transformers: each prompt repeated n times, the rows of one prompt adjacent
        input_ids = input_ids.repeat_interleave(n, 0)
        attention_mask = attention_mask.repeat_interleave(n, 0) if attention_mask is not None else None
    B, P = input_ids.shape
    device = input_ids.device
    padded = attention_mask is not None and not attention_mask.bool().all()
    GenerationMixin._prepare_special_tokens(model, gc, attention_mask is not None, device=device, batch_size=B)
    gc = GenerationMixin._prepare_generated_length(model, gc, has_default_max_length, has_default_min_length, "input_ids", P, input_ids)
    GenerationMixin._validate_generated_length(model, gc, P, has_default_max_length)
    check_length(model, P, gc.max_length - P, k)
    processors = GenerationMixin._get_logits_processor(
        model,
        generation_config=gc,
        input_ids_seq_length=P,
        encoder_input_ids=prompt_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=device,
        model_kwargs={"attention_mask": attention_mask if padded else None},
    )
    criteria = GenerationMixin._get_stopping_criteria(model, gc, stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(), tokenizer=tokenizer)
    return Run(
        input_ids=input_ids,
        kv_valid=attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool),
        gc=gc,
        processors=processors,
        criteria=criteria,
        pick=Sampling(generator) if gc.do_sample else Greedy(),
        k=k,
        mask_id=mask_id,
        pad=gc._pad_token_tensor.item() if gc._pad_token_tensor is not None else 0,
        streamer=streamer,
    )


def generate(inputs=None, generation_config=None, *, model, tidar: bool = True, block_size: int | None = None, beta: float = 1.0, **kwargs):
    """TiDAR `generate()`. Same arguments as transformers' generate, plus:

    tidar: False runs plain AR decoding (transformers' own generate) on the same weights.
    block_size: drafts per step; defaults to the trained `config.block_size`. Any value >= 2 keeps the
        output exact (only acceptance changes); the diffusion head is only trained for the trained one.
    beta: 1.0 (default) trusts AR and is exact; < 1 mixes diffusion logits into the committed token.

    generation_config and keyword arguments are merged with the model's defaults as transformers does.
    Logits processors (transformers' own, built from the config, plus `logits_processor`) apply to
    each AR row with the prefix AR would have seen there, before verification, and to each draft slot
    with the prefix it would extend; stopping criteria (max_length, max_time, stop_strings with
    `tokenizer=`, EOS, `stopping_criteria`) are checked after every committed token. What does not
    fit the verify rule is refused by name (REFUSED, REFUSED_ARGS).
    """
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not tidar:
        return ar_generate(model, input_ids, generation_config, kwargs)
    run = prepare(model, input_ids, generation_config, block_size, beta, kwargs)
    gc, pick, processors, k = run.gc, run.pick, run.processors, run.k
    B, P = run.input_ids.shape
    record = gc.return_dict_in_generate and (gc.output_scores or gc.output_logits)
    out_scores, out_logits = [], []  # one (B, V) per new token: processed scores and raw AR logits

    seqs, kv_valid, active, accepted_log = run.input_ids, run.kv_valid, torch.ones(B, dtype=torch.bool, device=run.input_ids.device), []
    if run.streamer is not None:
        run.streamer.put(seqs.cpu())
    cache = DynamicCache()
    with torch.no_grad():
        ar0, diff_slots = prefill(model, cache, seqs, kv_valid, k, run.mask_id)
        scores0 = process(processors, seqs, seqs[:, :0], ar0[:, None])[:, 0]
        y = pick.token(scores0)
        if record:
            out_scores.append(scores0)
            out_logits.append(ar0.float())
        nfe, new_tokens = 1, y[:, None]
        while True:
            seqs, active, kv_valid = commit(run, seqs, new_tokens, active, kv_valid, out_scores if gc.output_scores and record else None)
            if not active.any():
                break
            draft = make_draft(pick, processors, seqs, y, diff_slots)
            start = kv_valid.sum(1) - 1  # position of draft 0 (= the last committed token)
            ar, diff = step(model, cache, draft, start, kv_valid, k, run.mask_id)
            nfe += 1
            scores = process(processors, seqs, draft.tokens[:, 1:], ar)  # row i: after seqs ++ drafts 1..i
            accepted = pick.verify(scores, draft)
            j = int(accepted[active].min())  # rows share one cache length: commit the least
            target = scores[:, j - 1]
            if beta != 1.0:
                target = process(processors, seqs, draft.tokens[:, 1:j], mix(ar[:, j - 1], diff[:, j - 1, 0], beta)[:, None])[:, 0]
            y = pick.next_token(target, draft, accepted, j, exact=beta == 1.0)
            new_tokens = torch.cat([draft.tokens[:, 1:j], y[:, None]], 1)
            if record:
                out_scores.extend(scores[:, :j].unbind(1))
                out_logits.extend(ar[:, :j].float().unbind(1))
            cache.crop(-(k + k * k - j))  # keep the j accepted drafts, drop the rest
            diff_slots = diff[:, j - 1, 1:]
            accepted_log.append(j)
    if run.streamer is not None:
        run.streamer.end()
    n_new = seqs.shape[1] - P
    model.tidar_stats = {"nfe": nfe, "new_tokens": n_new, "tokens_per_nfe": n_new / nfe, "accepted": accepted_log}
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=seqs,
            scores=tuple(out_scores[:n_new]) if gc.output_scores else None,
            logits=tuple(out_logits[:n_new]) if gc.output_logits else None,
            past_key_values=cache,
        )
    return seqs


def ar_generate(model, input_ids, generation_config, kwargs):
    """tidar=False: transformers' own generate on the same weights, with forward passes counted."""
    calls = []  # prompt lookup and friends make fewer than one per token
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = GenerationMixin.generate(model, input_ids, generation_config, **kwargs)
    finally:
        hook.remove()
    seqs = out if isinstance(out, torch.Tensor) else out.sequences
    new = seqs.shape[1] - (input_ids.shape[1] if input_ids is not None else 0)
    model.tidar_stats = {"nfe": len(calls), "new_tokens": new, "tokens_per_nfe": new / max(1, len(calls)), "accepted": []}
    return out


def commit(run: Run, seqs, new_tokens, active, kv_valid, scores=None):
    """Append tokens one at a time so EOS, max_length and stopping criteria stop exactly where AR would.
    A finished row gets `pad`, as in transformers. `scores` (the processed scores so far) go to the
    stopping criteria when output_scores is on, as transformers passes them."""
    P = run.input_ids.shape[1]
    for t in range(new_tokens.shape[1]):
        token = torch.where(active, new_tokens[:, t], torch.full_like(new_tokens[:, t], run.pad))
        seqs = torch.cat([seqs, token[:, None]], 1)
        kv_valid = torch.cat([kv_valid, torch.ones_like(kv_valid[:, :1])], 1)
        if run.streamer is not None:
            run.streamer.put(token.cpu())
        done = run.criteria(seqs, tuple(scores[: seqs.shape[1] - P]) if scores is not None else None).to(active.device)
        active = active & ~done
        if seqs.shape[1] - P >= run.max_new:
            active = torch.zeros_like(active)
        if not active.any():
            break
    return seqs, active, kv_valid


def check_length(model, P, max_new, k) -> None:
    if max_new <= 0:
        raise ValueError(f"max_length={P + max_new} leaves no room after the {P}-token prompt; raise it or pass max_new_tokens.")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and P + max_new + k > limit:
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({max_new}) + block_size ({k}) exceeds the "
            f"model's {limit} positions; shorten the prompt or lower max_new_tokens."
        )
    window = getattr(model.config, "sliding_window", None) if getattr(model.config, "use_sliding_window", True) else None
    if window and P + max_new + k > window:
        raise ValueError(f"prompt + max_new_tokens exceeds the sliding window ({window}), which TiDAR decoding does not implement.")


def check_inputs(model, gc, input_ids, attention_mask, k, mask_id, beta) -> None:
    if mask_id is None or k is None:
        raise ValueError(
            "this model has no `mask_token_id`/`block_size` in its config: it is not a TiDAR export. "
            "Convert it first (`make convert MODEL=...`), or pass tidar=False for plain AR decoding."
        )
    if k < 2:
        raise ValueError(f"block_size={k}: TiDAR drafts at least 2 tokens per step; use 2 or more (trained: {model.config.block_size}).")
    if input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: TiDAR generate() needs input_ids of shape (batch, length >= 1).")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: must be in [0, 1] (1 = trust AR, exact).")
    if attention_mask is None and input_ids.shape[0] > 1 and gc.pad_token_id is not None and (input_ids == gc.pad_token_id).any():
        raise ValueError("the batch contains pad tokens but no attention_mask was given; pass the tokenizer's attention_mask (left padding).")
    if attention_mask is not None and not attention_mask[:, -1].bool().all():
        raise ValueError("the attention_mask has right padding; TiDAR batches need left padding (tokenizer.padding_side = 'left').")
