"""Verifiers: which drafts the AR head accepts, and the token committed after them.

Shipped in every export's custom_generate/ folder (see exports.folder.shipped_code): imports
nothing but torch, numpy (a dependency of transformers) and panel.py (the CPU kernel library's
argmax and top choices).

A draft is `tokens[:, 0]` (already committed) followed by proposals `tokens[:, 1:length]`. AR scores
row i is p(. | prefix, tokens[1..i]).

  Greedy    accept while the proposal is the argmax of p: the output is exactly AR greedy.
  Sampling  accept while the proposal is the token AR sampling draws there, by the Gumbel-max trick
            with noise keyed by (seed, row, position): the output is exactly AR sampling with that
            noise, so a seed repeats it whatever the steps were (Sampling).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from .panel import argmax as panel_argmax
from .panel import top_choices as panel_top_choices


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """scores.argmax(-1), each row's first index of its largest score (a NaN counts as the
    largest): on a CPU step the kernel library's (panel.argmax), else read through torch.max's
    reduction, vectorized where argmax's walks a row one score at a time (bench/LOG.md,
    2026-12-07, "vocabulary reductions")."""
    fast = panel_argmax(scores)
    return scores.max(-1).indices if fast is None else fast


def top_chances(scores: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's n likeliest tokens of scores (..., V), best first, and their probabilities
    (..., n) each: on a CPU step the kernel library's (panel.top_choices), else one topk, and the
    top scores are the top probabilities by their normalizer (no softmax written out)."""
    fast = panel_top_choices(scores, n)
    if fast is not None:
        return fast
    top = scores.topk(n, -1)
    return top.indices, (top.values - scores.logsumexp(-1, keepdim=True)).exp()


def real_slots(draft) -> torch.Tensor:
    """(B, m - 1) True where proposal i (draft token i + 1) exists; rows of a batch may draft
    fewer."""
    m = draft.tokens.shape[1]
    return torch.arange(1, m, device=draft.tokens.device) < draft.length[:, None]


def drafted(match: torch.Tensor, draft) -> torch.Tensor:
    """match (B, m - 1) where proposal i exists (real_slots), False past a row's length; match
    itself where the draft's host copy of its lengths says every row drafted all m - 1 (a batch of
    one always does): three ops a step fewer, and no read of the lengths."""
    m, lengths = draft.tokens.shape[1], draft.held("length")
    if lengths is not None and all(n == m for n in lengths):
        return match
    return match & real_slots(draft)


class Verifier(Protocol):
    """What the engine and the drafters ask of a verifier (`run.pick`). Scores are processed AR (or
    draft) scores, (B, V) or (B, n, V); a draft is verify.py's module docstring's."""

    # Each row's index in the caller's batch, set by the engine once it drops finished rows (None:
    # the rows are the caller's). Only sampling, whose draws are keyed by row, reads it.
    rows: list[int] | None = None

    def seek(self, committed) -> None:
        """After each commit: (B,) or an int, the new tokens each row has committed (the index of
        what its next AR row predicts). Optional: only sampling, whose draws are keyed by position,
        needs it."""

    def token(self, scores, offset=0) -> torch.Tensor:
        """The token AR decoding takes from scores, at new-token index seek + offset."""
        ...

    def confidence(self, scores) -> torch.Tensor:
        """How likely a drafted slot is to be accepted, from the drafter's own scores (for the
        plan)."""
        ...

    def token_and_confidence(self, scores) -> tuple[torch.Tensor, torch.Tensor]:
        """token(scores) and confidence(scores) together: a drafter asks for both."""
        return self.token(scores), self.confidence(scores)

    def verify_tokens(self, scores, draft) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) drafts accepted per row (>= 1: draft 0 is committed already), and (B, m) the token
        AR takes at each draft row: the token committed after any accepted length, so that one
        read gives the step's verdict and its tokens. scores (B, m, V)."""
        ...

    def verify(self, scores, draft) -> torch.Tensor:
        """verify_tokens' verdict alone."""
        return self.verify_tokens(scores, draft)[0]

    def next_token(self, target, draft, accepted, j: int, exact: bool = True) -> torch.Tensor:
        """(B,) the token after j accepted drafts, every row at the same j, from target (B, V)
        (beta < 1: the AR scores mixed with the draft's)."""
        ...


class Greedy(Verifier):
    """Accept a draft while it equals the argmax of the processed AR scores; the output is exactly
    AR greedy."""

    def token(self, scores, offset=0):
        return argmax(scores)

    def confidence(self, scores):
        return top_probability(scores)

    def token_and_confidence(self, scores):
        # the likeliest token and its probability as a tree's first choices (top_chances), so a
        # draft is the same from the logits as from what a verdict's read brought
        tokens, chances = top_chances(scores, 1)
        return tokens[..., 0], chances[..., 0]

    def verify_tokens(self, scores, draft):
        # AR's token at every row, the last included: the token after any accepted length
        best = argmax(scores)
        match = drafted(best[:, :-1] == draft.tokens[:, 1:], draft)
        return 1 + match.long().cumprod(1).sum(1), best

    def next_token(self, target, draft, accepted, j, exact=True):
        return self.token(target)


def top_probability(scores: torch.Tensor) -> torch.Tensor:
    """softmax(scores).amax(-1), without a vocabulary's worth of probabilities written out."""
    return (scores.amax(-1) - scores.logsumexp(-1)).exp()


def at_rows(x, index):
    """x[b, index[b]] for each row b: (B, n, ...) -> (B, ...)."""
    return x[torch.arange(x.shape[0], device=x.device), index]


class Sampling(Verifier):
    """Sampling by the Gumbel-max trick with noise keyed by position, so a seed gives the same
    tokens whatever the steps were.

    The token a row commits at its t-th new position is argmax_v p(v) / E(v), E the row's own
    exponential draws for index t (one vocabulary's worth, from a generator seeded by (seed, row,
    t)): an exact sample of p. A draft slot for index t proposes argmax q(v) / E(v) with the same
    draws and is accepted where it equals the AR token there; it can only change how many tokens a
    step commits, never which. So the output is AR sampling with that noise, whatever the plan (its
    choices follow measured timings), the drafter or the batch's commit lengths (Daliri et al. 2024,
    "drafter-invariant speculative decoding"). Rejection sampling (accept with min(1, p/q), else the
    residual) accepts diffusion drafts more often where q and p differ, but its token at a position
    depends on the draft there, and whether a position is drafted at all follows the timings: no
    seed could repeat it. A deterministic draft (lookup) is accepted with chance p(d) either way.

    The engine calls `seek` after each commit with each row's count of new tokens: the index of what
    a row's first AR row (and a draft's first proposal) predicts; `offset` counts on from there."""

    def __init__(self, seed: int):
        self.seed = seed
        self.at = [0]  # each row's new-token index (one for all rows where the same)
        self._draws: dict[tuple[int, int], torch.Tensor] = {}

    def seek(self, committed) -> None:
        """committed: (B,) (a list; a tensor is read) or an int, the new tokens each row has
        committed."""
        at = committed.reshape(-1).tolist() if torch.is_tensor(committed) else committed
        self.at = at = [int(at)] if isinstance(at, int) else list(at)
        rows = self.rows or range(len(at))
        first = {row: at[i] for i, row in enumerate(rows)} if len(at) > 1 else None
        # a row's committed indices are never drawn again; a dropped row's draws go with it
        self._draws = {
            (b, t): e
            for (b, t), e in self._draws.items()
            if (t >= at[0] if first is None else b in first and t >= first[b])
        }

    def draws(self, b: int, t: int, V: int, device) -> torch.Tensor:
        """Row b's exponential draws (V,) for its new-token index t."""
        e = self._draws.get((b, t))
        if e is None:
            g = torch.Generator(device=device).manual_seed(stream_seed(self.seed, b, t))
            # u = 0 gives inf: that token never wins
            e = torch.rand(V, generator=g, device=device).log_().neg_()
            self._draws[(b, t)] = e
        return e

    @staticmethod
    def probs(scores):
        scores = scores.float()
        # a processor removed every token (only in a draft)
        dead = ~torch.isfinite(scores).any(-1, keepdim=True)
        return scores.masked_fill(dead, 0.0).softmax(-1)

    def token(self, scores, offset=0):
        """The sampled token of scores (B, V), or (B, n, V) for n consecutive indices, at new-token
        index seek + offset (offset: an int or (B,))."""
        one = scores.dim() == 2
        probs = self.probs(scores[:, None] if one else scores)
        B, n, V = probs.shape
        if n == 0:
            return probs.new_zeros((B, 0), dtype=torch.long)
        at = self.at * B if len(self.at) == 1 else self.at
        if torch.is_tensor(offset):
            offset = offset.reshape(-1).tolist()
        offsets = [offset] * B if isinstance(offset, int) else offset
        rows = self.rows or range(B)
        noise = torch.stack(
            [
                torch.stack([self.draws(rows[b], t + o + i, V, probs.device) for i in range(n)])
                for b, (t, o) in enumerate(zip(at, offsets))
            ]
        )
        y = argmax(probs / noise)
        return y[:, 0] if one else y

    def confidence(self, scores):
        return self.probs(scores).amax(-1)

    def verify_tokens(self, scores, draft):
        """Drafts accepted per row: while each proposal is the token AR sampling draws there. The
        token drawn at every row, the last included, is the token after any accepted length
        (next_token's draw there, with the same keyed noise)."""
        drawn = self.token(scores)
        match = drafted(drawn[:, :-1] == draft.tokens[:, 1:], draft)
        return 1 + match.long().cumprod(1).sum(1), drawn

    def next_token(self, target, draft, accepted, j, exact=True):
        """The token at draft position j, drawn from `target` (the processed AR scores there, or
        beta's mix: exact or not, the draw is the same rule). A row that accepted draft j draws it
        again (the batch commits the fewest drafts any row accepted)."""
        return self.token(target, j - 1)


def stream_seed(seed: int, row: int, index: int) -> int:
    """A generator seed for (seed, row, index): splitmix64 over the three, so nearby keys share
    nothing."""
    h = 0
    for x in (seed, row, index):
        h = (h ^ x) & MASK64
        h = (h + 0x9E3779B97F4A7C15) & MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
        h ^= h >> 31
    return h >> 1  # 63 bits: what every device's manual_seed takes


MASK64 = (1 << 64) - 1


def draw_seed(generator=None) -> int:
    """The base seed of one generate() call, from `generator` or torch's default one:
    torch.manual_seed before generate() repeats the call, and successive calls differ."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (), generator=generator, device=device))


def mix(ar_logits, diff_logits, beta):
    """beta = 1: trust AR (exact). beta < 1 mixes in the diffusion head's log-probs (faster, not
    exact)."""
    if beta == 1.0 or diff_logits is None:
        return ar_logits
    return beta * ar_logits.float().log_softmax(-1) + (1 - beta) * diff_logits.float().log_softmax(
        -1
    )


class TopPOnSortedValues:
    """transformers' TopPLogitsWarper, its scores bit for bit, with each row sorted by value alone
    (numpy's vectorized sort) instead of torch's CPU sort of values and indices: sampling with top_p
    runs the warper on every AR row and every group row a drafter reads, and that sort was the
    largest part of a sampled step's host work (bench/LOG.md, 2026-12-08, "top_p"). What it removes
    follows from the sorted values (their softmax and cumsum by torch, as the warper's): a row's r
    smallest scores, that is every score up to the r-th smallest, unless the (r + 1)-th equals it.
    There, off the CPU, for any dtype but fp32, and with a NaN, a +inf or a row of -inf, the warper
    itself runs (which of equal scores it removes follows its sort's order)."""

    def __init__(self, warper):
        self.warper = warper

    def __call__(self, input_ids, scores):
        w = self.warper
        if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2:
            return w(input_ids, scores)
        values = torch.from_numpy(np.sort(scores.detach().numpy(), axis=-1))
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)  # the warper's, on the same values
        removed = cumulative <= (1 - w.top_p)
        removed[..., -w.min_tokens_to_keep :] = 0
        # a prefix of each sorted row (cumulative never falls): its length and last value
        r = removed.sum(-1, keepdim=True)
        last = values.gather(1, (r - 1).clamp(min=0))
        after = values.gather(1, r.clamp(max=values.shape[1] - 1))
        if bool(
            # a NaN or +inf sorts last, and a row of -inf ends in one: the softmax is NaN
            not values[:, -1].isfinite().all()
            or (removed[:, 1:] > removed[:, :-1]).any()  # not a prefix after all
            or ((r > 0) & (r < values.shape[1]) & (after == last)).any()
        ):
            return w(input_ids, scores)
        return scores.masked_fill((scores <= last) & (r > 0), w.filter_value)


# transformers' warpers that read a row's scores and nothing else: not its prefix (input_ids), not
# the other rows of the batch
PREFIX_FREE = {
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TopPOnSortedValues",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
}


def prefix_free(processors) -> bool:
    """Whether every processor is one of PREFIX_FREE (true of none at all)."""
    return all(type(p).__name__ in PREFIX_FREE for p in processors)


def process(processors, seqs, extra, logits):
    """Logits processors, row by row with each row's own prefix, as AR decoding would call them.

    logits (B, n, V): row i predicts the token after `seqs ++ extra[:, :i]`. Returns float32 scores.
    Prefix-dependent processors (no_repeat_ngram_size, min_new_tokens, repetition_penalty, ...) thus
    see exactly the sequence AR would have had at that position. Prefix-free ones (sampling's
    temperature, top_p, ...) take every position in one call: each row comes out as it would alone,
    and top_p's sort over the vocabulary runs once for the step instead of once a position."""
    B, n, V = logits.shape
    if not processors or n == 0:
        return logits.float()
    if prefix_free(processors):
        # they never read input_ids; a (B * n, 0) one keeps the call's shapes consistent. The
        # copy is theirs to change in place.
        flat = logits.to(torch.float32, copy=True).reshape(B * n, V)
        return processors(seqs[:, :0].repeat(n, 1), flat).reshape(B, n, V)
    return torch.stack(
        [
            process_one(processors, torch.cat([seqs, extra[:, :i]], 1), logits[:, i])
            for i in range(logits.shape[1])
        ],
        1,
    )


def process_one(processors, prefix, logits):
    """The processed float32 scores (B, V) of one position's logits after `prefix` (B, L); the
    processors act in place, so on a copy."""
    return processors(prefix, logits.to(torch.float32, copy=True))
