"""Drafters: where the tokens a TiDAR step verifies come from.

Shipped in every export's custom_generate/ folder (see exports.folder.shipped_code): imports
nothing but torch and its siblings costs.py, tree.py and verify.py.

A drafter proposes, after each step, the next draft: `tokens[:, 0]` is the token just committed,
`tokens[:, 1:length]` the proposals. Every draft is verified by the AR head in the next step's
single forward, whatever its source, so every drafter gives exactly the AR output (verify.py).

  diffusion  TiDAR's own: the mask group the last step computed at the accepted length.
  lookup     n-gram matches in the prompt and the generated text, as transformers'
             PromptLookupCandidateGenerator (same search, same defaults); may be longer than k.
  hybrid     per row, lookup where the text has a match, else diffusion; diffusion first once its
             drafts have been accepted further on average (the default).

Adding a drafter: a class that follows `Drafter` (subclass it for the no-op `observe`), and an
entry in DRAFTERS (docs/development.md has a worked example).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .costs import Mean
from .tree import beside, first_siblings, group_siblings, grow
from .verify import process_one


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, m); tokens[:, 0] is already committed
    # (B,) real tokens per row (rows may draft fewer; the rest is filler)
    length: torch.Tensor | None = None
    # (B, m - 1) estimated chance each proposal is accepted (the plan reads it)
    confidence: torch.Tensor | None = None
    sources: list = field(default_factory=list)  # per row: "lookup", "diffusion" or "none"
    # the drafter's own confidence, before any calibration
    raw_confidence: torch.Tensor | None = None
    # Branches off the chain (greedy, batch 1): a step may verify them beside it, one query slot
    # each, as a tree (plan.StepPlan.sibling_parents). Sibling i hangs under slot
    # sibling_parents[i]: 0..m-1 the chain (draft 0, the proposals), m + j an earlier sibling j;
    # None: all under draft 0 (alternatives to tokens[:, 1]). Best first.
    siblings: torch.Tensor | None = None  # (B, s)
    # (B, s) chance each is accepted where its parent is
    sibling_confidence: torch.Tensor | None = None
    sibling_parents: tuple[int, ...] | None = None

    def __post_init__(self):
        B, m = self.tokens.shape
        if self.length is None:
            self.length = torch.full((B,), m, dtype=torch.long, device=self.tokens.device)
        if not self.sources:
            self.sources = ["none" if m == 1 else "?"] * B

    def parents(self) -> tuple[int, ...]:
        """Each sibling's parent slot: sibling_parents, or draft 0 for every one where it is
        None."""
        if self.siblings is None:
            return ()
        return (
            self.sibling_parents
            if self.sibling_parents is not None
            else (0,) * self.siblings.shape[1]
        )


@dataclass
class DraftContext:
    """What a drafter may read after a step."""

    seqs: torch.Tensor  # (B, L) committed tokens, the last one (y) included
    kv_valid: torch.Tensor  # (B, L) False at left padding
    max_proposals: int  # proposals beyond this are never used (max_new_tokens)
    # the verifier: proposes a token from scores (verify.Greedy.token, verify.Sampling.token)
    pick: object
    processors: object  # logits processors; drafted slots are processed with their own prefix
    # Diffusion logits (B, n, V) of the group each row reads at its accepted length
    # (StepPlan.group_read: the group anchored there, or the later slots of one anchored before),
    # computed on first call, and (B,) the proposals each row's holds (0: none; None: all n); (None,
    # None) when no row has one.
    group: Callable[[], tuple] = lambda: (None, None)
    siblings: int = 0  # most alternatives to each proposal the step may verify (0: chains only)
    nodes: int = 0  # most tree nodes (proposals and siblings) the step may verify

    @property
    def y(self):
        return self.seqs[:, -1]


class Drafter(Protocol):
    """What the engine asks of a drafter. Subclass it to inherit the optional hook's no-op."""

    name: str
    uses_groups: bool  # whether the steps should compute mask groups for it (DraftContext.group)

    def propose(self, ctx: DraftContext) -> Draft | None:
        """The next draft after a step, or None to draft nothing (the step runs y and its
        groups)."""
        ...

    def observe(self, draft: Draft, accepted: torch.Tensor, committed: torch.Tensor) -> None:
        """Optional, after each step: (B,) the drafts each row's chain got accepted (what its
        confidence predicted), and the drafts its draft got committed (more, down a tree's
        branch)."""


def fresh(y: torch.Tensor) -> Draft:
    """No proposals: the step verifies nothing and drafts for the next one (one AR row + mask
    groups)."""
    return Draft(y[:, None], sources=["none"] * y.shape[0])


def make_draft(pick, processors, seqs, y, diff_slots) -> Draft:
    """A diffusion draft: y, then one guess per diffusion slot (B, n, V). Each slot is processed
    with the prefix it would have (seqs ++ the guesses before it), so e.g. suppressed tokens are
    never drafted."""
    sources = ["diffusion"] * y.shape[0]
    if not processors:  # no prefix to thread through: all slots at once
        tokens, confidence = pick.token_and_confidence(diff_slots.float())
        return Draft(torch.cat([y[:, None], tokens], 1), confidence=confidence, sources=sources)
    tokens, conf = [y], []
    for i in range(diff_slots.shape[1]):  # slot i's guess is in slot i + 1's prefix
        scores = process_one(
            processors, torch.cat([seqs] + [t[:, None] for t in tokens[1:]], 1), diff_slots[:, i]
        )
        tokens.append(pick.token(scores, i))  # slot i: the i-th position after y
        conf.append(pick.confidence(scores))
    confidence = torch.stack(conf, 1) if conf else None
    return Draft(torch.stack(tokens, 1), confidence=confidence, sources=sources)


class DiffusionDrafter(Drafter):
    """TiDAR: the next draft is the mask group computed at the accepted length (None if the plan
    had none).

    Its confidence, what the plan reads, is the head's probability of each drafted token scaled by
    the acceptance this call has seen (accepted over summed raw confidence, from one of each): the
    head's own top probability overstates acceptance, and more so when sampling, where it is not the
    chance that AR's keyed draw lands on the drafted token (bench/RESULTS.md §4)."""

    name = "diffusion"
    uses_groups = True

    def __init__(self):
        # summed raw confidence of the judged proposals, and those accepted
        self.predicted = self.taken = 0.0

    def observe(
        self, draft: Draft, accepted: torch.Tensor, committed: torch.Tensor | None = None
    ) -> None:
        _, taken, predicted = observed(draft, accepted, "diffusion")
        self.taken += taken
        self.predicted += predicted

    def propose(self, ctx: DraftContext) -> Draft | None:
        group, have = ctx.group()
        if group is None or ctx.max_proposals < 1:
            return None
        draft = make_draft(ctx.pick, ctx.processors, ctx.seqs, ctx.y, group[:, : ctx.max_proposals])
        if ctx.siblings and draft.tokens.shape[0] == 1 and draft.tokens.shape[1] > 1:
            grow(
                draft,
                *group_siblings(ctx, group, draft.tokens[:, 1:], ctx.siblings),
                ctx.nodes or draft.tokens.shape[1] - 1,
            )
        # per row, the proposals its group gives (plan.StepPlan.group_read; 0: none)
        if have is not None:
            draft.length = torch.minimum(draft.length, 1 + have)
            draft.sources = [s if h else "none" for s, h in zip(draft.sources, have.tolist())]
        return self.calibrate(draft)

    def calibrate(self, draft: Draft) -> Draft:
        """The plan's chances: the head's (kept as raw_confidence) times accepted over predicted so
        far."""
        scale = (self.taken + 1) / (self.predicted + 1)
        draft.raw_confidence = draft.confidence
        if draft.confidence is not None:
            draft.confidence = (draft.confidence * scale).clamp(max=1.0)
        if draft.sibling_confidence is not None:
            draft.sibling_confidence = (draft.sibling_confidence * scale).clamp(max=1.0)
        return draft


class LookupDrafter(Drafter):
    """Prompt lookup: the tokens that followed the latest n-gram's earlier occurrence
    (n = max_ngram..1).

    The search is transformers' PromptLookupCandidateGenerator.get_candidates (first occurrence,
    longest n-gram first, up to num_tokens). One difference: a draft may contain EOS, since an
    accepted EOS ends the row exactly where AR would (commit stops there) and saves a step.

    Its confidence, what the plan reads to choose how much of a draft to verify, is the chance each
    proposal is accepted where the ones before it were, by the length n of the n-gram that matched
    and the proposal's depth: acceptance comes in runs, and a longer match is surer. A single rate
    for every proposal (what this drafter had before) cannot tell a surely wasted step from a likely
    long one. The priors (PRIORS, worth PRIOR_WEIGHT judged proposals each) are the chances measured
    on SmolLM2-135M's greedy AR text of bench-style prompts with the search above; each call learns
    its own text's from there. The measured chances, and what they bought over one rate:
    bench/LOG.md, 2026-12-02, "lookup chances by match length and depth".

    Where the step may verify a tree (greedy, batch 1: ctx.siblings), the n-gram's other occurrences
    add their continuations beside the chain, most recent first: each leaves the chain (or an
    earlier branch) where its tokens first differ, and hangs there as a branch of its own tokens
    (`add_siblings`). Replayed on greedy text (10-token drafts, every node verified), T/NFE rose
    with each branch, up to three, over the chain alone, both on the quality set's prompts the bench
    does not use and on the bench's own (bench/results/lookup-tree-offline.json; bench/RESULTS.md
    §3; bench/LOG.md, 2026-12-03, "lookup drafts as trees")."""

    name = "lookup"
    uses_groups = False

    # P(proposal accepted | the ones before it were), by n-gram length (1, 2, 3+) and
    # depth (0..3, 4+).
    PRIORS = {
        1: (0.25, 0.5, 0.7, 0.7, 0.85),
        2: (0.7, 0.8, 0.8, 0.9, 0.9),
        3: (0.85, 0.9, 0.8, 0.9, 0.9),
    }
    PRIOR_WEIGHT = 10.0
    # P(a branch's first token is accepted | its parent was reached), by n-gram length (1, 2+),
    # where it leaves the chain (at the first proposal, further down) and whether it is the first
    # branch at that node or a later one. Measured by the replay above on the 28 prompts (each share
    # and the proposals it was judged on: bench/results/lookup-tree-offline.json,
    # branch_first_token_accepted_28_other_prompts), except later unigram branches further down,
    # floored at 5 % here; a branch's later tokens then go as the chain's (`chance`; their measured
    # shares: the same record). Fixed: what a step verifies off the chain is not fed back (observe
    # learns the chain's chances only).
    BRANCH_PRIORS = {1: ((0.16, 0.09), (0.24, 0.05)), 2: ((0.30, 0.25), (0.49, 0.25))}
    # Most recent occurrences a tree reads: a frequent n-gram in a long prompt occurs thousands of
    # times, and each is a walk in Python (what hundreds of them cost a step: bench/LOG.md,
    # 2026-12-03, "lookup drafts as trees").
    SCAN = 64
    # Each new match weighs what was seen before by this much, so a stretch of text where the plan
    # stops verifying some kind of match (its chances fell) drifts back toward the prior until some
    # are verified again; else one bad stretch would stop those matches for the rest of the call.
    FORGET = 0.98

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2):
        self.num_tokens, self.max_ngram = num_tokens, max_ngram
        # (n, depth) -> decayed share of proposals accepted
        self.seen: dict[tuple[int, int], Mean] = {}
        # per row of the last proposal: the matched n-gram's length (0: none)
        self.ngram: list[int] = []

    @staticmethod
    def key(n: int, depth: int) -> tuple[int, int]:
        return min(n, 3), min(depth, 4)

    def chance(self, n: int, depth: int) -> float:
        """P(a proposal at this depth of an n-gram match is accepted | the ones before it were)."""
        key = self.key(n, depth)
        return (self.seen[key] if key in self.seen else self.prior(key)).value

    def prior(self, key: tuple[int, int]) -> Mean:
        return Mean(self.PRIORS[key[0]][key[1]], self.FORGET, self.PRIOR_WEIGHT)

    def observe(
        self, draft: Draft, accepted: torch.Tensor, committed: torch.Tensor | None = None
    ) -> None:
        """Learns the chain's chances only: what a step verifies off the chain is not fed back."""
        for b, source in enumerate(draft.sources):
            if source == "lookup" and b < len(self.ngram) and self.ngram[b]:
                taken = int(accepted[b]) - 1
                # the accepted ones and the first miss
                for depth in range(min(taken + 1, int(draft.length[b]) - 1)):
                    key = self.key(self.ngram[b], depth)
                    self.seen.setdefault(key, self.prior(key)).add(float(depth < taken))

    def match(self, seq: torch.Tensor, limit: int) -> tuple[torch.Tensor, int, list[int]] | None:
        """The tokens after the matched n-gram's first earlier occurrence, n, and where every
        occurrence's continuation starts (`occurrences`)."""
        for n in range(min(self.max_ngram, seq.shape[0] - 1), 0, -1):
            starts = occurrences(seq, n)
            if starts:
                return seq[starts[0] : starts[0] + min(self.num_tokens, limit)], n, starts
        return None

    def add_siblings(
        self, draft: Draft, seq: torch.Tensor, n: int, starts: list[int], limit: int, width: int
    ) -> Draft:
        """The draft (batch 1) with the other occurrences' continuations as its tree: the SCAN most
        recent, latest first, each walks down the tree while its tokens are there, and from its
        first new token on hangs as a branch, up to `width` branches. A continuation that only runs
        on past a leaf extends it (no branch). Its nodes' chances: BRANCH_PRIORS where it leaves,
        then `chance`."""
        chain = draft.tokens[0].tolist()
        m = len(chain)
        child = {(d - 1, chain[d]): d for d in range(1, m)}  # (parent slot, token) -> slot
        kids = [1] * (m - 1) + [0]
        tokens, parents, chances = [], [], []
        for start in reversed(starts[1:][-self.SCAN :]):
            if not width:
                break
            slot, depth, off = 0, 0, False
            for t in seq[start : start + min(self.num_tokens, limit)].tolist():
                if (slot, t) in child:
                    slot, depth = child[(slot, t)], depth + 1
                    continue
                if off or not kids[slot]:  # on down its own branch, or past a leaf
                    c = self.chance(n, depth)
                else:  # leaves the tree here: a branch (at most one per continuation)
                    c, off, width = (
                        self.BRANCH_PRIORS[min(n, 2)][depth > 0][min(kids[slot] - 1, 1)],
                        True,
                        width - 1,
                    )
                child[(slot, t)] = m + len(tokens)
                kids[slot] += 1
                kids.append(0)
                tokens.append(t)
                parents.append(slot)
                chances.append(c)
                slot, depth = m + len(tokens) - 1, depth + 1
        if tokens:
            device = draft.tokens.device
            draft.siblings = torch.tensor([tokens], dtype=draft.tokens.dtype, device=device)
            draft.sibling_confidence = torch.tensor([chances], device=device)
            draft.sibling_parents = tuple(parents)
        return draft

    def propose(self, ctx: DraftContext) -> Draft | None:
        self.ngram = []
        if ctx.max_proposals < 1:
            return None
        found = [
            self.match(ctx.seqs[b][ctx.kv_valid[b]], ctx.max_proposals)
            for b in range(ctx.seqs.shape[0])
        ]
        self.ngram = [f[1] if f is not None else 0 for f in found]
        if all(f is None for f in found):
            return None
        for seen in self.seen.values():
            seen.tick()
        B, m = len(found), 1 + max(f[0].shape[0] for f in found if f is not None)
        tokens = ctx.y[:, None].repeat(1, m)  # filler beyond a row's length is never accepted
        length = torch.ones(B, dtype=torch.long, device=tokens.device)
        confidence = torch.zeros(B, m - 1)
        for b, f in enumerate(found):
            if f is not None:
                tokens[b, 1 : 1 + f[0].shape[0]] = f[0]
                length[b] = 1 + f[0].shape[0]
                confidence[b] = torch.tensor([self.chance(f[1], d) for d in range(m - 1)])
        sources = ["lookup" if f is not None else "none" for f in found]
        draft = Draft(tokens, length, confidence.to(tokens.device), sources)
        if ctx.siblings and B == 1:
            self.add_siblings(
                draft,
                ctx.seqs[0][ctx.kv_valid[0]],
                found[0][1],
                found[0][2],
                ctx.max_proposals,
                ctx.siblings,
            )
        return draft


def occurrences(seq: torch.Tensor, n: int) -> list[int]:
    """Where the tokens after each earlier occurrence of seq's last n-gram start, first first."""
    L = seq.shape[0]
    # the n-gram itself excluded
    hits = (seq.unfold(0, n, 1)[: L - n] == seq[L - n :]).all(1).nonzero()
    return (hits[:, 0] + n).tolist()


class HybridDrafter(Drafter):
    """Per row, the lookup draft where the text has a match, else the diffusion draft; diffusion
    first instead once, in this call, its drafts have been accepted further on average than
    lookup's.

    Lookup drafts are judged by what they have brought, not by a per-token rate: their acceptance
    comes in runs. On the bench's prompts most lookup drafts failed at their first token but a fair
    share were accepted whole, so a lookup draft brought several times the proposals the diffusion
    draft of the same step did. The choice this replaces compared expected lengths (a per-token
    lookup rate from the last few matches against the draft head's probabilities) and went to
    diffusion after a few failed matches, for a lower T/NFE than lookup first (the figures:
    bench/LOG.md, 2026-12-01, "lookup-first hybrid"). A mean of a few lookup drafts swings as much,
    so lookup's starts from 2 proposals, about what was measured there, worth 5 drafts, and both
    means remember about 100 drafts. Where the draft head is better than lookup (a longer
    conversion), its mean overtakes lookup's and diffusion drafts come first.

    The choice reads past outcomes only, never the current drafts' tokens: sampling stays exact."""

    name = "hybrid"
    uses_groups = True
    FORGET = 0.99  # per judged draft of a source
    # (mean proposals accepted, worth in drafts)
    PRIORS = {"lookup": (2.0, 5.0), "diffusion": (1.0, 1.0)}

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2):
        self.lookup, self.diffusion = LookupDrafter(num_tokens, max_ngram), DiffusionDrafter()
        # Decayed proposals accepted per draft, by source.
        self.gains = {
            source: Mean(mean, self.FORGET, worth) for source, (mean, worth) in self.PRIORS.items()
        }

    def gain(self, source: str) -> float:
        """Mean proposals accepted per draft of this source so far, from its prior."""
        return self.gains[source].value

    def observe(
        self, draft: Draft, accepted: torch.Tensor, committed: torch.Tensor | None = None
    ) -> None:
        """accepted: (B,) the chain's drafts each row accepted (what the chances predicted);
        committed: what the step committed, down a branch of the tree where it took one (what the
        draft brought)."""
        self.lookup.observe(draft, accepted)
        self.diffusion.observe(draft, accepted)
        brought = accepted if committed is None else committed
        for b, source in enumerate(draft.sources):
            if source in self.gains:
                self.gains[source].tick()
                self.gains[source].add(int(brought[b]) - 1)

    def choose(self, look: Draft, diff: Draft) -> torch.Tensor:
        """(B,) True where the row drafts by lookup."""
        return (look.length > 1) & (self.gain("lookup") >= self.gain("diffusion"))

    def propose(self, ctx: DraftContext) -> Draft | None:
        # diff's chances calibrated by its drafter
        look, diff = self.lookup.propose(ctx), self.diffusion.propose(ctx)
        if look is None or diff is None:
            return look or diff
        use_look = self.choose(look, diff)
        if use_look.all():
            # the diffusion draft's first choices, beside the lookup chain
            if diff.siblings is not None:
                look = beside(look, *first_siblings(look, diff))
            return look
        if not use_look.any():
            return diff
        return merge(use_look, look, diff)


def observed(draft: Draft, accepted: torch.Tensor, source: str) -> tuple[int, int, float]:
    """Over the rows drafted by `source`: proposals whose fate is known (the accepted ones and the
    first rejected one; later ones were never judged), how many were accepted, and their summed
    confidence."""
    proposed = taken = 0
    predicted = 0.0
    for b, s in enumerate(draft.sources):
        if s == source:
            seen = min(int(accepted[b]), int(draft.length[b]) - 1)
            proposed += seen
            taken += int(accepted[b]) - 1
            conf = draft.raw_confidence if draft.raw_confidence is not None else draft.confidence
            if conf is not None:
                predicted += float(conf[b, :seen].sum())
    return proposed, taken, predicted


def merge(use_a: torch.Tensor, a: Draft, b: Draft) -> Draft:
    """Row b of the result is a's where use_a[b], else b's; padded to the longer draft."""
    m = max(a.tokens.shape[1], b.tokens.shape[1])

    def pad(d: Draft):
        extra = m - d.tokens.shape[1]
        tokens = torch.cat([d.tokens, d.tokens[:, :1].repeat(1, extra)], 1)
        conf = torch.cat([d.confidence, d.confidence.new_zeros(d.confidence.shape[0], extra)], 1)
        return tokens, conf

    (ta, ca), (tb, cb) = pad(a), pad(b)
    pick = use_a[:, None]
    sources = [sa if u else sb for u, sa, sb in zip(use_a.tolist(), a.sources, b.sources)]
    return Draft(
        torch.where(pick, ta, tb),
        torch.where(use_a, a.length, b.length),
        torch.where(pick, ca, cb),
        sources,
        raw_confidence=_raw(a, b, use_a, m),
    )


def _raw(a: Draft, b: Draft, use_a: torch.Tensor, m: int):
    """The merged draft's uncalibrated confidence (what `observed` compares acceptance with)."""

    def padded(d):
        c = d.raw_confidence if d.raw_confidence is not None else d.confidence
        return torch.cat([c, c.new_zeros(c.shape[0], m - c.shape[1])], 1)

    return torch.where(use_a[:, None], padded(a), padded(b))


DRAFTERS = {"hybrid": HybridDrafter, "diffusion": DiffusionDrafter, "lookup": LookupDrafter}


def make_drafter(name: str):
    if name not in DRAFTERS:
        raise ValueError(
            f"drafter={name!r}: choose one of {', '.join(repr(n) for n in DRAFTERS)} "
            "(default 'hybrid')."
        )
    drafter = DRAFTERS[name]()
    missing = [m for m in ("name", "uses_groups", "propose", "observe") if not hasattr(drafter, m)]
    if missing:
        raise TypeError(
            f"drafter {name!r} ({type(drafter).__name__}) lacks {', '.join(missing)}: "
            "subclass drafters.Drafter, which declares them (observe: a no-op)."
        )
    return drafter
