"""Verifiers: which drafts the AR head accepts, and the token committed after them.

Shipped in every export's custom_generate/ folder (see export.shipped_code): imports nothing but torch.

A draft is `tokens[:, 0]` (already committed) followed by proposals `tokens[:, 1:length]`, each with a
proposal distribution q (diffusion drafts) or none (deterministic drafts, e.g. lookup: q is then the
one-hot of the drafted token). AR scores row i is p(. | prefix, tokens[1..i]).

  Greedy    accept while the proposal is the argmax of p: the output is exactly AR greedy.
  Sampling  accept proposal d with probability min(1, p(d) / q(d)); on a rejection sample from
            norm(max(0, p - q)) (for a deterministic draft: p with d removed, renormalised). The
            committed tokens are then distributed exactly as AR sampling (Leviathan et al. 2023).
"""

from __future__ import annotations

import torch


def real_slots(draft) -> torch.Tensor:
    """(B, m - 1) True where proposal i (draft token i + 1) exists; rows of a batch may draft fewer."""
    m = draft.tokens.shape[1]
    return torch.arange(1, m, device=draft.tokens.device) < draft.length[:, None]


class Greedy:
    """Accept a draft while it equals the argmax of the processed AR scores; the output is exactly AR greedy."""

    def token(self, scores):
        return scores.argmax(-1)

    def propose(self, scores):  # one draft slot: (token, proposal distribution or None)
        return scores.argmax(-1), None

    def confidence(self, scores):
        """How likely a drafted slot is to be accepted, from the drafter's own scores (for the plan)."""
        return scores.softmax(-1).amax(-1)

    def verify(self, scores, draft):
        """Drafts accepted per row (>= 1: draft 0 is committed already). scores (B, m, V): processed AR."""
        match = (scores[:, :-1].argmax(-1) == draft.tokens[:, 1:]) & real_slots(draft)
        return 1 + match.long().cumprod(1).sum(1)

    def next_token(self, target, draft, accepted, j, exact=True):
        return self.token(target)

    def next_token_rows(self, scores, draft, accepted):
        """Each row's own next token, after its own accepted drafts (rows commit what they accepted)."""
        return self.token(at_rows(scores, accepted - 1))


def at_rows(x, index):
    """x[b, index[b]] for each row b: (B, n, ...) -> (B, ...)."""
    return x[torch.arange(x.shape[0], device=x.device), index]


class Sampling:
    """Rejection sampling against the proposal: the output is distributed as AR sampling."""

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

    def confidence(self, scores):
        return self.probs(scores).amax(-1)

    def verify(self, scores, draft):
        p = self.probs(scores[:, :-1])  # p[:, i-1] is the AR distribution for draft i
        d = draft.tokens[:, 1:, None]
        p_d = p.gather(-1, d).squeeze(-1)
        q_d = draft.q.gather(-1, d).squeeze(-1) if draft.q is not None else torch.ones_like(p_d)
        u = torch.rand(p_d.shape, generator=self.generator, device=p_d.device)
        self._p = p
        ok = (u * q_d < p_d) & real_slots(draft)  # u < p/q, without dividing by a q of 0
        return 1 + ok.long().cumprod(1).sum(1)

    def residual(self, draft, j):
        """norm(max(0, p - q)) at draft position j, (B, V) unnormalised. A deterministic proposal has
        q = one-hot(d): the residual is p without d. Where position j holds no proposal (a row that
        drafted fewer), q = 0 and the residual is p itself."""
        p = self._p[:, j - 1]
        if draft.q is not None:
            residual = (p - draft.q[:, j - 1]).clamp(min=0)
        else:
            residual = p.scatter(-1, draft.tokens[:, j, None], 0.0)
        real = j < draft.length
        return torch.where(real[:, None], residual, p)

    def next_token(self, target, draft, accepted, j, exact=True):
        """The token at draft position j, drawn from `target` (the processed AR scores there). Rows that
        rejected draft j resample from the residual; rows that accepted it (the batch commits the fewest
        any row accepted) commit draft j itself: "draft if accepted, else residual" is what makes the
        token distributed as p. After all drafts, a fresh sample from p (the bonus token).
        exact=False (beta < 1): `target` is not p, so a plain draw from it."""
        m = draft.tokens.shape[1]
        y = self.token(target)
        if j < m and exact:
            y = torch.where(accepted > j, draft.tokens[:, j], y)
            residual = self.residual(draft, j)
            rejected = (accepted == j) & (residual.sum(-1) > 0)
            if rejected.any():
                y = torch.where(rejected, self.sample(residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)), y)
        return y


    def next_token_rows(self, scores, draft, accepted):
        """Each row's own next token: the residual at its first rejected proposal, else (all
        accepted, or no proposal there) a fresh sample from p after its accepted drafts."""
        m = draft.tokens.shape[1]
        y = self.token(at_rows(scores, accepted - 1))
        rejected = accepted < draft.length
        if m == 1 or not rejected.any():
            return y
        at = (accepted - 1).clamp(max=m - 2)  # the rejected proposal's index among proposals
        p = at_rows(self._p, at)
        d = at_rows(draft.tokens[:, 1:], at)
        if draft.q is not None:
            residual = (p - at_rows(draft.q, at)).clamp(min=0)
        else:
            residual = p.scatter(-1, d[:, None], 0.0)
        rejected = rejected & (residual.sum(-1) > 0)
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
