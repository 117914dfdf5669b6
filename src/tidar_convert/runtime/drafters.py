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

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .costs import Mean
from .transfer import on_device
from .tree import beside, first_siblings, group_siblings, grow, top_choices
from .verify import prefix_free, process, process_one

# Draft fields the planner and drafters read as numbers (`Draft.host`).
HOSTED = ("tokens", "length", "confidence", "raw_confidence", "siblings", "sibling_confidence")


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
    # Python copies of the HOSTED fields (`host`): the plan's arithmetic is on a few dozen numbers,
    # where one torch op costs more than all of it in Python and each read of a device tensor waits
    # for the device. Not a field of `replace`: a copy must come from its own tensor.
    _host: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        B, m = self.tokens.shape
        if self.length is None:
            self.length = torch.full((B,), m, dtype=torch.long, device=self.tokens.device)
            self._host["length"] = [m] * B
        if not self.sources:
            self.sources = ["none" if m == 1 else "?"] * B

    def __setattr__(self, name, value):
        # a new tensor makes its copy stale
        if name in HOSTED and "_host" in self.__dict__:
            self._host.pop(name, None)
        object.__setattr__(self, name, value)

    def host(self, name: str) -> list | None:
        """A HOSTED field's values as Python lists (None where the field is): held by the drafter
        that built the tensor from them, or read once."""
        if name not in self._host:
            value = getattr(self, name)
            self._host[name] = None if value is None else value.tolist()
        return self._host[name]

    def held(self, name: str) -> list | None:
        """A HOSTED field's host copy where the draft has one, else None: never a read."""
        return self._host.get(name)

    def hold(self, **lists) -> Draft:
        """Keeps the Python lists HOSTED fields were built from (or equal), so `host` reads none."""
        self._host.update(lists)
        return self

    def replace(self, **changes) -> Draft:
        """dataclasses.replace, keeping the host copies of the fields it does not change."""
        new = dataclasses.replace(self, **changes)
        new._host.update({k: v for k, v in self._host.items() if k not in changes})
        return new

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
    # each row's tokens the last commit appended to seqs, as host lists, where the commit read them
    # (None: read them from seqs)
    committed: list | None = None
    # the group's candidates as the last verdict's read brought them (engine.read_ahead): per row,
    # each slot's likeliest tokens and their chances, host lists (B, n, c), and (B,) the proposals
    # each row's group holds; None: draft from `group`'s logits
    choices: tuple | None = None

    @property
    def y(self):
        return self.seqs[:, -1]

    @property
    def y_host(self) -> list | None:
        """y on the host, where the last commit gave every row a token (None: not known)."""
        if self.committed is None or not all(self.committed):
            return None
        return [tokens[-1] for tokens in self.committed]


class Drafter(Protocol):
    """What the engine asks of a drafter. Subclass it to inherit the optional hook's no-op."""

    name: str
    uses_groups: bool  # whether the steps should compute mask groups for it (DraftContext.group)

    def propose(self, ctx: DraftContext) -> Draft | None:
        """The next draft after a step, or None to draft nothing (the step runs y and its
        groups)."""
        ...

    def observe(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        """Optional, after each step: (B,) the drafts each row's chain got accepted (what its
        confidence predicted), and the drafts its draft got committed (more, down a tree's
        branch). Host lists where the engine has them (it reads a step's verdict once); a tensor
        otherwise (`as_list` takes either)."""


def fresh(y: torch.Tensor, y_host: list | None = None) -> Draft:
    """No proposals: the step verifies nothing and drafts for the next one (one AR row + mask
    groups). y_host: y on the host, if known."""
    draft = Draft(y[:, None], sources=["none"] * y.shape[0])
    return draft if y_host is None else draft.hold(tokens=[[t] for t in y_host])


def make_draft(pick, processors, seqs, y, diff_slots, siblings: int = 0, y_host=None):
    """A diffusion draft: y, then one guess per diffusion slot (B, n, V). Each slot is processed
    with the prefix it would have (seqs ++ the guesses before it), so e.g. suppressed tokens are
    never drafted. siblings > 0 (greedy): also each slot's next `siblings` likeliest tokens and
    their probabilities, host lists (B, n, siblings) (tree.group_siblings), else None; the
    draft's chain and those come from one topk of the same scores. y_host: y on the host, if
    known."""
    sources = ["diffusion"] * y.shape[0]
    if prefix_free(processors):  # no prefix to thread through: all slots at once
        scores = process(processors, seqs, seqs[:, :0], diff_slots)
        if siblings:
            return first_choices(y, scores, siblings, sources, y_host)
        tokens, confidence = pick.token_and_confidence(scores)
        return Draft(
            torch.cat([y[:, None], tokens], 1), confidence=confidence, sources=sources
        ), None
    tokens, conf, scored = [y], [], []
    for i in range(diff_slots.shape[1]):  # slot i's guess is in slot i + 1's prefix
        scores = process_one(
            processors, torch.cat([seqs] + [t[:, None] for t in tokens[1:]], 1), diff_slots[:, i]
        )
        tokens.append(pick.token(scores, i))  # slot i: the i-th position after y
        conf.append(pick.confidence(scores))
        scored.append(scores)
    confidence = torch.stack(conf, 1) if conf else None
    draft = Draft(torch.stack(tokens, 1), confidence=confidence, sources=sources)
    if not siblings or not scored:
        return draft, None
    chain = draft.host("tokens")
    alternatives = group_siblings(torch.stack(scored, 1), siblings, [row[1:] for row in chain])
    return draft, alternatives


def first_choices(
    y: torch.Tensor, scores, siblings: int, sources: list, y_host=None, top: tuple | None = None
):
    """Greedy: the draft of each slot's likeliest token and, from the same topk, the next
    `siblings` at each slot (make_draft): one pass over the vocabulary instead of a max and a topk,
    and one normalizer. top: that topk's tokens and chances as host lists (B, n, siblings + 1),
    where already read (then scores are not needed)."""
    tokens, chances = top if top is not None else top_choices(scores, siblings + 1)
    chain = [[t[0] for t in row] for row in tokens]
    conf = [[c[0] for c in row] for row in chances]
    draft = Draft(
        torch.cat([y[:, None], on_device(chain, y.device, y.dtype)], 1),
        confidence=on_device(conf, y.device),
        sources=sources,
    ).hold(confidence=conf)
    if y_host is not None:
        draft.hold(tokens=[[first, *rest] for first, rest in zip(y_host, chain)])
    return draft, (
        [[t[1:] for t in row] for row in tokens],
        [[c[1:] for c in row] for row in chances],
    )


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

    def observe(self, draft: Draft, accepted, committed=None) -> None:
        _, taken, predicted = observed(draft, accepted, "diffusion")
        self.taken += taken
        self.predicted += predicted

    def propose(self, ctx: DraftContext) -> Draft | None:
        if ctx.choices is not None:  # the verdict's read brought the group's candidates
            tokens, chances, have = ctx.choices
            n = min(len(tokens[0]), ctx.max_proposals)
            if n < 1:
                return None
            tree = ctx.siblings if len(tokens) == 1 else 0
            top = (
                [[slot[: tree + 1] for slot in row[:n]] for row in tokens],
                [[slot[: tree + 1] for slot in row[:n]] for row in chances],
            )
            sources = ["diffusion"] * len(tokens)
            draft, alternatives = first_choices(ctx.y, None, tree, sources, ctx.y_host, top)
            alternatives = alternatives if tree else None
        else:
            group, have = ctx.group()
            if group is None or ctx.max_proposals < 1:
                return None
            slots = group[:, : ctx.max_proposals]
            tree = ctx.siblings if slots.shape[0] == 1 and slots.shape[1] > 0 else 0
            draft, alternatives = make_draft(
                ctx.pick, ctx.processors, ctx.seqs, ctx.y, slots, tree, ctx.y_host
            )
        if alternatives is not None:
            grow(draft, *alternatives, ctx.nodes or draft.tokens.shape[1] - 1)
        # per row, the proposals its group gives (plan.StepPlan.group_read; 0: none)
        if have is not None:
            have = as_list(have)
            length = [min(n, 1 + h) for n, h in zip(draft.host("length"), have)]
            draft.length = on_device(length, draft.tokens.device, torch.long)
            draft.hold(length=length)
            draft.sources = [s if h else "none" for s, h in zip(draft.sources, have)]
        return self.calibrate(draft)

    def calibrate(self, draft: Draft) -> Draft:
        """The plan's chances: the head's (kept as raw_confidence) times accepted over predicted so
        far. Scaled on the host copies the plan reads, and the tensors made from them."""
        scale = (self.taken + 1) / (self.predicted + 1)
        raw = draft.host("confidence")
        draft.raw_confidence = draft.confidence
        draft.hold(raw_confidence=raw)
        for name in ("confidence", "sibling_confidence"):
            rows = draft.host(name)
            if rows is not None:
                scaled = [[min(c * scale, 1.0) for c in row] for row in rows]
                setattr(draft, name, on_device(scaled, draft.tokens.device))
                draft.hold(**{name: scaled})
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
        # each row's committed tokens, indexed (`texts`), and seqs' width when they were read
        self.rows: list[NGrams] = []
        self.width = 0

    @staticmethod
    def key(n: int, depth: int) -> tuple[int, int]:
        return min(n, 3), min(depth, 4)

    def chance(self, n: int, depth: int) -> float:
        """P(a proposal at this depth of an n-gram match is accepted | the ones before it were)."""
        key = self.key(n, depth)
        return (self.seen[key] if key in self.seen else self.prior(key)).value

    def prior(self, key: tuple[int, int]) -> Mean:
        return Mean(self.PRIORS[key[0]][key[1]], self.FORGET, self.PRIOR_WEIGHT)

    def observe(self, draft: Draft, accepted, committed=None) -> None:
        """Learns the chain's chances only: what a step verifies off the chain is not fed back."""
        accepted, lengths = as_list(accepted), draft.host("length")
        for b, source in enumerate(draft.sources):
            if source == "lookup" and b < len(self.ngram) and self.ngram[b]:
                taken = accepted[b] - 1
                # the accepted ones and the first miss
                for depth in range(min(taken + 1, lengths[b] - 1)):
                    key = self.key(self.ngram[b], depth)
                    self.seen.setdefault(key, self.prior(key)).add(float(depth < taken))

    def match(self, seq: torch.Tensor, limit: int) -> tuple[torch.Tensor, int, list[int]] | None:
        """The tokens after the matched n-gram's first earlier occurrence in seq (L,), n, and where
        every occurrence's continuation starts (`search` over a fresh index of seq)."""
        found = self.search(NGrams(seq.tolist(), self.max_ngram), limit)
        if found is None:
            return None
        tokens, n, starts = found
        return on_device(tokens, seq.device, seq.dtype), n, starts

    def search(self, text: NGrams, limit: int) -> tuple[list[int], int, list[int]] | None:
        """transformers' search on an indexed text: longest n-gram first, the tokens after its first
        earlier occurrence, up to num_tokens; with n and where every occurrence's continuation
        starts, first first."""
        for n in range(min(self.max_ngram, len(text.tokens) - 1), 0, -1):
            starts = text.starts(n)
            if starts:
                begin = starts[0]
                return text.tokens[begin : begin + min(self.num_tokens, limit)], n, starts
        return None

    def add_siblings(
        self, draft: Draft, seq: list[int], n: int, starts: list[int], limit: int, width: int
    ) -> Draft:
        """The draft (batch 1) with the other occurrences' continuations as its tree: the SCAN most
        recent, latest first, each walks down the tree while its tokens are there, and from its
        first new token on hangs as a branch, up to `width` branches. A continuation that only runs
        on past a leaf extends it (no branch). Its nodes' chances: BRANCH_PRIORS where it leaves,
        then `chance`. seq: the row's committed tokens."""
        chain = draft.host("tokens")[0]
        m = len(chain)
        child = {(d - 1, chain[d]): d for d in range(1, m)}  # (parent slot, token) -> slot
        kids = [1] * (m - 1) + [0]
        tokens, parents, chances = [], [], []
        for start in reversed(starts[1:][-self.SCAN :]):
            if not width:
                break
            slot, depth, off = 0, 0, False
            for t in seq[start : start + min(self.num_tokens, limit)]:
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
            draft.siblings = on_device([tokens], device, draft.tokens.dtype)
            draft.sibling_confidence = on_device([chances], device)
            draft.sibling_parents = tuple(parents)
            draft.hold(siblings=[tokens], sibling_confidence=[chances])
        return draft

    def texts(self, ctx: DraftContext) -> list[NGrams]:
        """Each row's committed tokens (its valid ones), indexed: kept from the last call and
        extended by the tokens committed since: the commit's own host copy (ctx.committed) where it
        follows on from the last call, else read from the device as the few columns that are new.
        Rebuilt from seqs where the rows are not the last call's (the first call, rows dropped by
        the engine's drop_finished, or a tail that does not follow on)."""
        seqs, valid = ctx.seqs, ctx.kv_valid
        B, W = seqs.shape
        new = W - self.width
        if len(self.rows) == B and new == 0:
            return self.rows
        got = ctx.committed
        if got is not None and len(self.rows) == len(got) == B and new == max(map(len, got)):
            for row, tokens in zip(self.rows, got):
                row.extend(tokens)
            self.width = W
            return self.rows
        if len(self.rows) == B and new > 0:
            # A commit appends each row's tokens on the right and pads a row that does not advance
            # on the left (engine.commit): a row's new tokens are its last columns, as many as its
            # valid tokens grew. The column before them must be the row's last known token. A batch
            # of one always advances.
            tail = seqs[:, -(new + 1) :]
            if B > 1:
                tail = torch.cat([valid.sum(1, keepdim=True), tail], 1)
            tail = tail.tolist()
            grew = [new] * B if B == 1 else [r[0] - len(t.tokens) for r, t in zip(tail, self.rows)]
            rows = [r[-(new + 1) :] for r in tail]
            if all(
                0 <= g <= new and t.tokens and r[new - g] == t.tokens[-1]
                for g, r, t in zip(grew, rows, self.rows)
            ):
                for g, r, t in zip(grew, rows, self.rows):
                    t.extend(r[len(r) - g :])
                self.width = W
                return self.rows
        self.rows = [
            NGrams([t for t, v in zip(row, ok) if v], self.max_ngram)
            for row, ok in zip(seqs.tolist(), valid.tolist())
        ]
        self.width = W
        return self.rows

    def propose(self, ctx: DraftContext) -> Draft | None:
        self.ngram = []
        if ctx.max_proposals < 1:
            return None
        texts = self.texts(ctx)
        found = [self.search(text, ctx.max_proposals) for text in texts]
        self.ngram = [f[1] if f is not None else 0 for f in found]
        if all(f is None for f in found):
            return None
        for seen in self.seen.values():
            seen.tick()
        B, m = len(found), 1 + max(len(f[0]) for f in found if f is not None)
        # y (each row's last token) fills a row beyond its length: never accepted
        tokens = [[t.tokens[-1]] * m for t in texts]
        length, confidence = [1] * B, [[0.0] * (m - 1) for _ in range(B)]
        for b, f in enumerate(found):
            if f is not None:
                tokens[b][1 : 1 + len(f[0])] = f[0]
                length[b] = 1 + len(f[0])
                confidence[b] = [self.chance(f[1], d) for d in range(m - 1)]
        sources = ["lookup" if f is not None else "none" for f in found]
        device = ctx.seqs.device
        draft = Draft(
            on_device(tokens, device, ctx.seqs.dtype),
            on_device(length, device, torch.long),
            on_device(confidence, device),
            sources,
        ).hold(tokens=tokens, length=length, confidence=confidence)
        if ctx.siblings and B == 1:
            self.add_siblings(
                draft, texts[0].tokens, found[0][1], found[0][2], ctx.max_proposals, ctx.siblings
            )
        return draft


class NGrams:
    """A token list and, for each n-gram (n = 1..max_n) in it, where its occurrences end, first
    first; kept as the list grows. The lookup search then reads one dict entry per n instead of
    comparing every position of the text each step."""

    def __init__(self, tokens: list[int], max_n: int):
        self.tokens: list[int] = []
        self.ends: list[dict[tuple, list[int]]] = [{} for _ in range(max_n + 1)]  # by n
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        t = self.tokens
        for token in tokens:
            t.append(token)
            L = len(t)
            for n in range(1, min(len(self.ends) - 1, L) + 1):
                self.ends[n].setdefault(tuple(t[L - n :]), []).append(L)

    def starts(self, n: int) -> list[int]:
        """Where the tokens after each earlier occurrence of the last n-gram start, first first
        (the n-gram itself excluded: its own end is the last)."""
        L = len(self.tokens)
        if n > L or n >= len(self.ends):
            return []
        return self.ends[n][tuple(self.tokens[L - n :])][:-1]


def as_list(x) -> list:
    """A (B,) tensor's values, or the list given."""
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


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

    def observe(self, draft: Draft, accepted, committed=None) -> None:
        """accepted: (B,) the chain's drafts each row accepted (what the chances predicted);
        committed: what the step committed, down a branch of the tree where it took one (what the
        draft brought). Tensors or lists."""
        accepted = as_list(accepted)
        self.lookup.observe(draft, accepted)
        self.diffusion.observe(draft, accepted)
        brought = accepted if committed is None else as_list(committed)
        for b, source in enumerate(draft.sources):
            if source in self.gains:
                self.gains[source].tick()
                self.gains[source].add(brought[b] - 1)

    def choose(self, look: Draft, diff: Draft) -> list[bool]:
        """Per row, True where the row drafts by lookup."""
        first = self.gain("lookup") >= self.gain("diffusion")
        return [first and n > 1 for n in look.host("length")]

    def propose(self, ctx: DraftContext) -> Draft | None:
        # diff's chances calibrated by its drafter
        look, diff = self.lookup.propose(ctx), self.diffusion.propose(ctx)
        if look is None or diff is None:
            return look or diff
        use_look = self.choose(look, diff)
        if all(use_look):
            # the diffusion draft's first choices, beside the lookup chain
            if diff.siblings is not None:
                look = beside(look, *first_siblings(look, diff))
            return look
        if not any(use_look):
            return diff
        return merge(use_look, look, diff)


def observed(draft: Draft, accepted, source: str) -> tuple[int, int, float]:
    """Over the rows drafted by `source`: proposals whose fate is known (the accepted ones and the
    first rejected one; later ones were never judged), how many were accepted, and their summed
    confidence."""
    proposed = taken = 0
    predicted = 0.0
    accepted, lengths = as_list(accepted), draft.host("length")
    conf = draft.host("raw_confidence" if draft.raw_confidence is not None else "confidence")
    for b, s in enumerate(draft.sources):
        if s == source:
            seen = min(accepted[b], lengths[b] - 1)
            proposed += seen
            taken += accepted[b] - 1
            if conf is not None:
                predicted += sum(conf[b][:seen])
    return proposed, taken, predicted


def merge(use_a: list[bool], a: Draft, b: Draft) -> Draft:
    """Row r of the result is a's where use_a[r], else b's; padded to the longer draft (with the
    row's first token, and chance 0)."""
    m = max(a.tokens.shape[1], b.tokens.shape[1])

    def padded(d: Draft, name: str, fill=None) -> list:
        width = m if name == "tokens" else m - 1
        return [
            row + [row[0] if fill is None else fill] * (width - len(row)) for row in d.host(name)
        ]

    def raw(d: Draft) -> str:
        return "raw_confidence" if d.raw_confidence is not None else "confidence"

    def pick(x: list, y: list) -> list:
        return [u if use else v for use, u, v in zip(use_a, x, y)]

    tokens = pick(padded(a, "tokens"), padded(b, "tokens"))
    length = pick(a.host("length"), b.host("length"))
    confidence = pick(padded(a, "confidence", 0.0), padded(b, "confidence", 0.0))
    raw_confidence = pick(padded(a, raw(a), 0.0), padded(b, raw(b), 0.0))
    device = a.tokens.device
    return Draft(
        on_device(tokens, device, a.tokens.dtype),
        on_device(length, device, torch.long),
        on_device(confidence, device),
        pick(a.sources, b.sources),
        raw_confidence=on_device(raw_confidence, device),
    ).hold(tokens=tokens, length=length, confidence=confidence, raw_confidence=raw_confidence)


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
