"""Trees: siblings verified beside a draft's chain (greedy, batch 1; generate(siblings=...)).

Shipped in every export's custom_generate/ folder (see exports.folder.shipped_code): imports
nothing but torch and the runtime's own modules (cache, slots, forward, verify).

A sibling is an off-chain node: another token at a drafted offset, hung under a chain slot or an
earlier sibling (Draft.siblings, Draft.sibling_parents). Drafting side: the diffusion group's next
likeliest tokens (group_siblings, grow), the diffusion draft's first choices beside a lookup chain
(first_siblings, beside); the lookup drafter adds other occurrences' continuations itself
(LookupDrafter.add_siblings). Verifying side: the AR's token at each node picks the child that
holds it (walk), and the cache keeps that path (keep_slots).
"""

from __future__ import annotations

import functools
import heapq
from typing import TYPE_CHECKING

import torch

from .cache import GrowingLayer
from .forward import slots_of
from .slots import SlotLayer
from .transfer import on_device
from .verify import process, top_chances

if TYPE_CHECKING:  # types only: drafters.py imports this module
    from .drafters import Draft
    from .forward import Output
    from .plan import StepPlan


def top_choices(scores: torch.Tensor, n: int) -> tuple[list, list]:
    """top_chances as host lists (..., n)."""
    tokens, chances = top_chances(scores, n)
    return tokens.tolist(), chances.tolist()


def group_siblings(scores: torch.Tensor, n: int, chain: list) -> tuple[list, list]:
    """The group's next n likeliest tokens at each drafted offset, other than the chain's (B, D)
    there, and their probabilities: host lists (B, D, n) each. scores: the processed scores
    (B, D, V) the chain was picked from (make_draft: slot i with the chain's prefix). At offset 1
    the AR token, where it is not the group's first choice, is often among its next few: the case
    for siblings (figures: bench/RESULTS.md §3, results/wide-draft-offline.json; docs/method.md
    §3, Trees)."""
    tokens, chances = top_choices(scores, n + 1)
    return without(tokens, chances, chain, n)


def grow(
    draft: Draft, alt_tokens: list, alt_chances: list, most: int, floor: float = 1e-3
) -> Draft:
    """The draft's tree (batch 1): the chain's proposals and, at every node, the alternatives at the
    next offset (host lists (1, D, s), best first), best first by the chance the step reaches them
    (the product of the chances along the path; a group's offsets are drafted in parallel, so a
    branch's later tokens are the same offsets' choices as the chain's), until `most` nodes (chain
    nodes count). The nodes off the chain become draft.siblings, in the order found (a parent
    before its children)."""
    m = draft.tokens.shape[1]
    conf = [min(max(c, 0.0), 1.0) for c in draft.host("confidence")[0][: m - 1]]
    chain, alts = draft.host("tokens")[0][1:], alt_tokens[0]
    chances = [[min(max(c, 0.0), 1.0) for c in row] for row in alt_chances[0]]
    tokens, parents, conditional = [], [], []
    heap, count, found = [], 0, 0

    def push(reach, depth, slot, on_chain):  # the children of a node at `depth` in slot `slot`
        nonlocal count
        if depth >= m - 1:
            return
        options = [(chain[depth], conf[depth], on_chain)] + [
            (t, c, False) for t, c in zip(alts[depth], chances[depth])
        ]
        for token, c, chained in options:
            if reach * c >= floor:
                count += 1
                heapq.heappush(heap, (-reach * c, depth + 1, count, slot, token, c, chained))

    push(1.0, 0, 0, True)
    while heap and found < most:
        neg, depth, _, parent, token, c, chained = heapq.heappop(heap)
        found += 1
        if chained:
            slot = depth  # the chain's own proposal
        else:
            slot = m + len(tokens)
            tokens.append(token)
            parents.append(parent)
            conditional.append(c)
        push(-neg, depth, slot, chained)
    device = draft.tokens.device
    draft.siblings = on_device([tokens], device, draft.tokens.dtype).view(1, -1)
    draft.sibling_confidence = on_device([conditional], device).view(1, -1)
    draft.sibling_parents = tuple(parents)
    return draft.hold(siblings=[tokens], sibling_confidence=[conditional])


def without(tokens: list, chances: list, taken: list, n: int) -> tuple[list, list]:
    """The first n of `tokens` (..., n + 1) other than `taken` (...), in their order, with their
    chances: host lists, nested alike."""
    if tokens and isinstance(tokens[0], list):
        pairs = [without(t, c, x, n) for t, c, x in zip(tokens, chances, taken)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    keep = [i for i, t in enumerate(tokens) if t != taken][:n]
    return [tokens[i] for i in keep], [chances[i] for i in keep]


def first_siblings(look: Draft, diff: Draft) -> tuple[list, list]:
    """The diffusion draft's choices for the first proposal (its own, then its alternatives there)
    other than the lookup draft's, as alternatives to the lookup chain's first proposal: as many as
    diff has alternatives there. Host lists (1, s)."""
    first = [i for i, p in enumerate(diff.parents()) if p == 0]
    siblings, chances = diff.host("siblings")[0], diff.host("sibling_confidence")[0]
    tokens = [diff.host("tokens")[0][1]] + [siblings[i] for i in first]
    conf = [diff.host("confidence")[0][0]] + [chances[i] for i in first]
    return without([tokens], [conf], [look.host("tokens")[0][1]], len(first))


def beside(draft: Draft, tokens: list, chances: list) -> Draft:
    """The draft (batch 1) with `tokens` (1, s) (host lists, with their `chances`) added under
    draft 0, those it has there already left out."""
    have = (
        set()
        if draft.siblings is None
        else {t for t, p in zip(draft.host("siblings")[0], draft.parents()) if p == 0}
    )
    keep = [i for i, t in enumerate(tokens[0]) if t not in have]
    if not keep:
        return draft
    added, odds = [tokens[0][i] for i in keep], [chances[0][i] for i in keep]
    if draft.siblings is None:
        old, old_odds, parents = [], [], None
    else:
        old, old_odds = draft.host("siblings")[0], draft.host("sibling_confidence")[0]
        parents = (*draft.parents(), *(0,) * len(keep))
    device = draft.tokens.device
    draft.siblings = on_device([old + added], device, draft.tokens.dtype)
    draft.sibling_confidence = on_device([old_odds + odds], device)
    draft.sibling_parents = parents
    return draft.hold(siblings=[old + added], sibling_confidence=[old_odds + odds])


def walk(
    plan: StepPlan,
    tokens: torch.Tensor,
    out: Output,
    seqs,
    processors,
    pick,
    chain_scores,
    chain_ar,
    values: list[int] | None = None,
    known: list[int] | None = None,
):
    """Greedy verification of a tree (batch 1): from draft 0, the AR's token at each node picks the
    child that holds it, until none does. Returns the path (slots from draft 0), and the processed
    scores and raw logits of each node on it, which AR would have produced for the same tokens: each
    node's row is processed with its own path as prefix. tokens: the causal slots' (causal_tokens),
    `values` the same on the host (None: read). chain_scores, chain_ar: the chain's rows, already
    processed with the chain as prefix (the path's nodes while it stays on the chain), and
    `known` AR's token at the causal slots as the verdict read them: the chain's, and each
    sibling's where the scores are the raw logits (a slot past its end: read here). Also returns
    the token after the path (on the host)."""
    if values is None:
        values = tokens[0].tolist()
    kids: dict[int, list[int]] = {}
    for child, parent in enumerate(plan.parents()[1:], 1):
        kids.setdefault(parent, []).append(child)
    path, scored, raw = [0], [], []
    while True:
        s = path[-1]
        if s == len(path) - 1 and s < plan.n_drafts:  # still on the chain
            scores, ar = chain_scores[:, s], chain_ar[:, s]
        else:
            ar = out.rows(s, s + 1)[:, 0]
            scores = process(
                processors,
                torch.cat([seqs, slots_of(tokens, path[1:])], 1),
                seqs[:, :0],
                ar[:, None],
            )[:, 0]
        scored.append(scores)
        raw.append(ar)
        y = known[s] if known is not None and s < len(known) else int(pick.token(scores)[0])
        nxt = [c for c in kids.get(s, ()) if values[c] == y]
        if not nxt:
            return path, scored, raw, y
        path.append(nxt[0])


def keep_slots(cache, cache_len: int, slots: list[int]) -> None:
    """Keep the cache's first cache_len entries and, of the step's slots after them, `slots`: a
    branch of a tree is not a suffix of the step, so `crop` cannot keep it."""
    kept = [cache_len + s for s in slots]

    @functools.cache
    def index(device, whole: bool = False):  # the branch (whole: the past too), once per device
        return on_device([*range(cache_len), *kept] if whole else kept, device, torch.long)

    moved = set()  # the stores that moved their members' branches at once
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer) and layer.slot is not None:  # a store's member
            if id(layer.store) not in moved:
                moved.add(id(layer.store))
                for alone in layer.store.keep(cache_len, index(layer.store.buffer.device)):
                    alone.keep(cache_len, index(alone.device))
        elif isinstance(layer, (GrowingLayer, SlotLayer)):  # moved inside its buffers
            layer.keep(cache_len, index(layer.device))
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            i = index(layer.keys.device, whole=True)
            layer.keys, layer.values = (
                layer.keys.index_select(-2, i),
                layer.values.index_select(-2, i),
            )
