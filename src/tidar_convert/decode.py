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

After each call, `model.tidar_stats` holds {"nfe", "new_tokens", "tokens_per_nfe", "accepted"}:
forward passes, new token positions, their ratio, and drafts accepted at each step.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, GenerationMixin, LogitsProcessorList
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
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


def prefill(model, cache, prompt, kv_valid, k, mask_id, pick):
    """Prompt + one mask block. Returns the first new token y (B,) and the first draft."""
    B, P = prompt.shape
    n = kv_valid.sum(1)  # real prompt tokens per row (left padding)
    tokens = torch.cat([prompt, torch.full((B, k), mask_id, device=prompt.device)], 1)
    prompt_pos = (kv_valid.cumsum(1) - 1).clamp(min=0)
    positions = torch.cat([prompt_pos, decode_position_ids(n - P, P, k, 1, P)[:, P:]], 1)
    valid = torch.cat([kv_valid, torch.ones(B, k, dtype=torch.bool, device=prompt.device)], 1)
    # Only the last prompt token (-> y) and the mask block (-> the draft) need the vocabulary head.
    logits = forward(model, cache, tokens, positions, decode_mask_mod(0, P, k, P, valid), P + k, logits_to_keep=k + 1)
    cache.crop(-k)
    y = pick.token(logits[:, 0])
    return y, pick.draft(y, logits[:, 2:])


def step(model, cache, draft: Draft, start, kv_valid, k, mask_id):
    """One forward over k drafts (at positions start..) and k groups of k masks."""
    B, C = draft.tokens.shape[0], cache.get_seq_length()
    masks = torch.full((B, k * k), mask_id, device=draft.tokens.device)
    tokens = torch.cat([draft.tokens, masks], 1)
    valid = torch.cat([kv_valid[:, :C], torch.ones(B, k + k * k, dtype=torch.bool, device=kv_valid.device)], 1)
    logits = forward(model, cache, tokens, decode_position_ids(start, k, k, k, 1), decode_mask_mod(C, k, k, 1, valid), C + k + k * k)
    return logits[:, :k], logits[:, k:].unflatten(1, (k, k))  # ar (B, k, V), diff (B, group, slot, V)


class Greedy:
    """Accept a draft while it equals the AR argmax; the output is exactly AR greedy."""

    def __init__(self, beta: float = 1.0):
        self.beta = beta

    def token(self, ar_logits, diff_logits=None):
        return mix(ar_logits, diff_logits, self.beta).argmax(-1)

    def draft(self, y, diff_logits):  # diff_logits (B, k - 1, V): the group's slots 1..k-1
        return Draft(torch.cat([y[:, None], diff_logits.argmax(-1)], 1), None)

    def verify(self, ar, draft: Draft):
        """Drafts accepted per row (>= 1: draft 0 is committed already)."""
        match = ar[:, :-1].argmax(-1) == draft.tokens[:, 1:]
        return 1 + match.long().cumprod(1).sum(1)

    def next_token(self, ar, diff, draft, accepted, j):
        return self.token(ar[:, j - 1], diff[:, j - 1, 0])


class Sampling:
    """Rejection sampling against the diffusion proposal: the output is distributed as AR sampling."""

    def __init__(self, warpers: LogitsProcessorList, generator=None, beta: float = 1.0):
        self.warpers, self.generator, self.beta = warpers, generator, beta

    def probs(self, logits):
        shape = logits.shape
        flat = self.warpers(None, logits.reshape(-1, shape[-1]).float())
        return flat.softmax(-1).reshape(shape)

    def sample(self, probs):
        shape = probs.shape
        return torch.multinomial(probs.reshape(-1, shape[-1]), 1, generator=self.generator).reshape(shape[:-1])

    def token(self, ar_logits, diff_logits=None):
        return self.sample(self.probs(mix(ar_logits, diff_logits, self.beta)))

    def draft(self, y, diff_logits):
        q = self.probs(diff_logits)
        return Draft(torch.cat([y[:, None], self.sample(q)], 1), q)

    def verify(self, ar, draft: Draft):
        p = self.probs(ar[:, :-1])  # p[:, i-1] is the AR distribution for draft i
        d = draft.tokens[:, 1:, None]
        ratio = p.gather(-1, d).squeeze(-1) / draft.q.gather(-1, d).squeeze(-1)
        u = torch.rand(ratio.shape, generator=self.generator, device=ratio.device)
        self._p = p
        return 1 + (u < ratio).long().cumprod(1).sum(1)

    def next_token(self, ar, diff, draft, accepted, j):
        """The token at draft position j. Rows that rejected draft j resample from norm(max(0, p - q));
        rows that accepted it (the batch commits the fewest any row accepted) commit draft j itself:
        "draft if accepted, else residual" is what makes the token distributed as p. After all k
        drafts, a fresh sample from p (the bonus token)."""
        k = draft.tokens.shape[1]
        y = self.token(ar[:, j - 1], diff[:, j - 1, 0])
        if j < k and self.beta == 1.0:
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
    return beta * ar_logits.log_softmax(-1) + (1 - beta) * diff_logits.log_softmax(-1)


# --------------------------------------------------------------------------------------------
# generate(): the drop-in entry point.
# --------------------------------------------------------------------------------------------


def generate(inputs=None, generation_config=None, *, model, tidar: bool = True, block_size: int | None = None, beta: float = 1.0, **kwargs):
    """TiDAR `generate()`. Same arguments as transformers' generate, plus:

    tidar: False runs plain AR decoding (transformers' own generate) on the same weights.
    block_size: drafts per step; defaults to the trained `config.block_size`. Any value >= 2 keeps the
        output exact (only acceptance changes); the diffusion head is only trained for the trained one.
    beta: 1.0 (default) trusts AR and is exact; < 1 mixes diffusion logits into the committed token.
    """
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not tidar:
        calls = []  # count forward passes: prompt lookup and friends make fewer than one per token
        hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
        try:
            out = GenerationMixin.generate(model, input_ids, generation_config, **kwargs)
        finally:
            hook.remove()
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        new = seqs.shape[1] - input_ids.shape[1]
        model.tidar_stats = {"nfe": len(calls), "new_tokens": new, "tokens_per_nfe": new / max(1, len(calls)), "accepted": []}
        return out
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    stopping_criteria = kwargs.pop("stopping_criteria", None)
    generator = kwargs.pop("generator", None)
    if kwargs.get("max_new_tokens") is not None and kwargs["max_new_tokens"] <= 0:  # before transformers' own, vaguer check
        raise ValueError(f"max_new_tokens={kwargs['max_new_tokens']}: must be >= 1.")
    gc = copy.deepcopy(generation_config or model.generation_config)
    unused = gc.update(**kwargs)
    unused.pop("use_cache", None)
    if unused:
        raise TypeError(f"TiDAR generate() got unsupported arguments: {', '.join(sorted(unused))}.")
    k = block_size or getattr(model.config, "block_size", None)
    mask_id = getattr(model.config, "mask_token_id", None)
    check_inputs(model, gc, input_ids, attention_mask, k, mask_id, beta)

    B, P = input_ids.shape
    device = input_ids.device
    kv_valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - P
    eos = torch.tensor(eos_ids(gc), device=device, dtype=torch.long)
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0].item() if len(eos) else 0)
    pick = Sampling(warpers(gc), generator, beta) if gc.do_sample else Greedy(beta)

    seqs, active, accepted_log = input_ids, torch.ones(B, dtype=torch.bool, device=device), []
    if streamer is not None:
        streamer.put(input_ids.cpu())
    cache = DynamicCache()
    with torch.no_grad():
        y, draft = prefill(model, cache, input_ids, kv_valid, k, mask_id, pick)
        nfe, new_tokens = 1, y[:, None]
        while True:
            seqs, active, kv_valid = commit(seqs, new_tokens, active, kv_valid, P, max_new, eos, pad, stopping_criteria, streamer)
            if not active.any():
                break
            start = kv_valid.sum(1) - 1  # position of draft 0 (= the last committed token)
            ar, diff = step(model, cache, draft, start, kv_valid, k, mask_id)
            nfe += 1
            accepted = pick.verify(ar, draft)
            j = int(accepted[active].min())  # rows share one cache length: commit the least
            y = pick.next_token(ar, diff, draft, accepted, j)
            new_tokens = torch.cat([draft.tokens[:, 1:j], y[:, None]], 1)
            cache.crop(-(k + k * k - j))  # keep the j accepted drafts, drop the rest
            draft = pick.draft(y, diff[:, j - 1, 1:])
            accepted_log.append(j)
    if streamer is not None:
        streamer.end()
    n_new = seqs.shape[1] - P
    model.tidar_stats = {"nfe": nfe, "new_tokens": n_new, "tokens_per_nfe": n_new / nfe, "accepted": accepted_log}
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=seqs, past_key_values=cache)
    return seqs


def commit(seqs, new_tokens, active, kv_valid, prompt_len, max_new, eos, pad, stopping_criteria, streamer):
    """Append tokens one at a time so EOS, max_new_tokens and stopping criteria stop exactly where AR would."""
    for t in range(new_tokens.shape[1]):
        token = torch.where(active, new_tokens[:, t], torch.full_like(new_tokens[:, t], pad))
        seqs = torch.cat([seqs, token[:, None]], 1)
        kv_valid = torch.cat([kv_valid, torch.ones_like(kv_valid[:, :1])], 1)
        if streamer is not None:
            streamer.put(token.cpu())
        done = torch.isin(token, eos) if len(eos) else torch.zeros_like(active)
        if stopping_criteria:
            done = done | stopping_criteria(seqs, None).to(done.device)
        active = active & ~done
        if seqs.shape[1] - prompt_len >= max_new:
            active = torch.zeros_like(active)
        if not active.any():
            break
    return seqs, active, kv_valid


def eos_ids(gc: GenerationConfig) -> list[int]:
    eos = gc.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def warpers(gc: GenerationConfig) -> LogitsProcessorList:
    out = LogitsProcessorList()
    if gc.temperature is not None and gc.temperature != 1.0:
        out.append(TemperatureLogitsWarper(gc.temperature))
    if gc.top_k is not None and gc.top_k != 0:
        out.append(TopKLogitsWarper(gc.top_k))
    if gc.top_p is not None and gc.top_p < 1.0:
        out.append(TopPLogitsWarper(gc.top_p))
    return out


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
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - input_ids.shape[1]
    if max_new is None or max_new <= 0:
        raise ValueError(f"max_new_tokens={max_new}: must be >= 1.")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and input_ids.shape[1] + max_new + k > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new}) + block_size ({k}) exceeds the "
            f"model's {limit} positions; shorten the prompt or lower max_new_tokens."
        )
    window = getattr(model.config, "sliding_window", None) if getattr(model.config, "use_sliding_window", True) else None
    if window and input_ids.shape[1] + max_new + k > window:
        raise ValueError(f"prompt + max_new_tokens exceeds the sliding window ({window}), which TiDAR decoding does not implement.")
    if gc.do_sample and (gc.temperature is None or gc.temperature <= 0):
        raise ValueError(f"temperature={gc.temperature} with sampling: must be > 0 (or use do_sample=False for greedy).")
    if gc.num_beams not in (None, 1):
        raise ValueError(f"num_beams={gc.num_beams}: TiDAR decoding is not beam search; use num_beams=1 or tidar=False.")
    if gc.repetition_penalty not in (None, 1.0):
        raise ValueError("repetition_penalty is not supported by TiDAR decoding (it would change which drafts verify); use tidar=False.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: must be in [0, 1] (1 = trust AR, exact).")
    if attention_mask is None and input_ids.shape[0] > 1 and gc.pad_token_id is not None and (input_ids == gc.pad_token_id).any():
        raise ValueError("the batch contains pad tokens but no attention_mask was given; pass the tokenizer's attention_mask (left padding).")
    if attention_mask is not None and not attention_mask[:, -1].bool().all():
        raise ValueError("the attention_mask has right padding; TiDAR batches need left padding (tokenizer.padding_side = 'left').")
