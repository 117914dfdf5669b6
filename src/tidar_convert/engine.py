"""The TiDAR decoding engine: prefill, then steps of draft -> plan -> forward -> verify -> commit -> crop.

Shipped in every export's custom_generate/ folder (see export.shipped_code): imports nothing but
torch, transformers and its neighbours: forward.py (one forward), plan.py (the step plan),
costs.py (step costs), drafters.py, verify.py, layout.py.

One step (docs/method.md §3), for a draft of m tokens (draft 0 = the last committed token):
  plan     which query slots the forward runs: the m drafts (causal), plus mask groups of k at
           chosen anchors; a group anchored at j sees drafts[0..j) and pre-drafts the step after
           j drafts are accepted (plan.StepPlan, plan.Planner)
  forward  the decoder body once; the vocabulary head once, on the rows the step may read: the m
           AR rows and the draft slots of its groups (never the groups' first slots)
  verify   the Verifier (verify.py) accepts j >= 1 drafts and picks the next token y
  commit   accepted drafts + y, one at a time through the stopping criteria
  crop     the KV cache keeps the j accepted drafts and drops every other slot of the step
  draft    the Drafter (drafters.py) proposes the next draft; with none, the next step drafts nothing
           and only runs y and a fresh group

Trees (greedy, batch 1): a step may also verify alternatives to the chain's tokens (the group's
next likeliest tokens at each offset, and the chain's own choices after them), one query slot each,
plus groups after them: the likeliest nodes of the group's tree (drafters.grow, plan.Planner.tree,
StepPlan.branches). The AR's token at each node picks the child that holds it (walk); the step
commits the path and the token after it, and the cache keeps the path (keep_slots) where it is not
a prefix of the step.

Each phase runs under torch.profiler.record_function("tidar.<phase>") for a step breakdown.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from .drafters import Draft, DraftContext, fresh
from .forward import Output, forward
from .layout import build_mask, decode_mask_mod, decode_position_ids, decode_step_mask
from .plan import Planner, StepPlan
from .verify import mix, process


@dataclass
class DecodeState:
    seqs: torch.Tensor  # (B, L) committed tokens; the cache holds all but the last
    kv_valid: torch.Tensor  # (B, L) False at left padding
    active: torch.Tensor  # (B,) rows not yet stopped
    cache_valid: torch.Tensor | None = None  # (B, C) False at the cache's left padding and holes (rows that accepted less)
    cache: DynamicCache = field(default_factory=DynamicCache)
    nfe: int = 0
    row_nfe: torch.Tensor | None = None  # (B,) forwards while each row was active (per-row acceptance)
    accepted: list = field(default_factory=list)  # drafts committed at each step
    slots: list = field(default_factory=list)  # query slots of each decoding forward
    head_rows: list = field(default_factory=list)  # vocabulary-head rows (per batch row) of each decoding forward
    sources: Counter = field(default_factory=Counter)  # row-steps drafted by each source
    sibling_steps: int = 0  # steps that committed a sibling instead of the chain
    last: Output | None = None  # the last step's forward, until its vocabulary-head rows are all known

    def record(self, accepted: int, plan: StepPlan, draft: Draft, out: Output) -> None:
        self.finish()
        self.accepted.append(accepted)
        self.slots.append(plan.slots)
        self.sources.update(draft.sources)
        self.last = out

    def finish(self) -> None:
        """Counts the last step's head rows: known once the next draft has read its group, or not."""
        if self.last is not None:
            self.head_rows.append(self.last.head_rows)
            self.last = None

    @property
    def start(self) -> torch.Tensor:
        """(B,) position of the last committed token, where the next draft starts: the cache holds
        every committed token but that one."""
        return self.cache_valid.sum(1)

    def stats(self, prompt_len: int) -> dict:
        n_new = self.seqs.shape[1] - prompt_len
        steps = max(1, len(self.slots))
        extra = {}
        if self.row_nfe is not None:
            extra["tokens_per_nfe_per_row"] = (self.row_new.float() / self.row_nfe.clamp(min=1)).tolist()
        return {**extra,
            "nfe": self.nfe,
            "new_tokens": n_new,
            "tokens_per_nfe": n_new / self.nfe,
            "accepted": self.accepted,
            "slots_per_step": sum(self.slots) / steps,
            "lm_head_rows_per_step": sum(self.head_rows) / steps,
            "draft_sources": {s: self.sources.get(s, 0) for s in ("lookup", "diffusion", "none")},
            "sibling_steps": self.sibling_steps,
        }


def position_limit(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def prefill(model, state: DecodeState, k: int, mask_id: int, groups: bool) -> tuple[torch.Tensor, callable]:
    """The prompt (causal), plus one mask group after it when the drafter uses groups (and its
    positions exist). Returns the AR logits of the first new token (B, V) and a function giving the
    group's draft logits (B, k - 1, V), or None."""
    prompt, valid = state.seqs, state.kv_valid
    B, P = prompt.shape
    n = valid.sum(1)  # real prompt tokens per row (left padding)
    limit = position_limit(model)
    g = k if groups and (limit is None or int(n.max()) + k <= limit) else 0
    with record_function("tidar.mask"):
        tokens = torch.cat([prompt, torch.full((B, g), mask_id, device=prompt.device)], 1)
        positions = torch.cat([(valid.cumsum(1) - 1).clamp(min=0), decode_position_ids(n - P, P, k, 1, P)[:, P : P + g]], 1)
        all_valid = torch.cat([valid, torch.ones(B, g, dtype=torch.bool, device=prompt.device)], 1)
        mask = build_mask(decode_mask_mod(0, P, k, P, all_valid), B, P + g, P + g, model.config._attn_implementation, prompt.device)
    out = forward(model, state.cache, tokens, positions, mask, read=[P - 1, *range(P + 1, P + g)])
    state.nfe += 1
    if g:
        with record_function("tidar.crop"):
            state.cache.crop(-g)
    ar = out.rows(P - 1, P)[:, 0]
    return ar, (lambda: (out.rows(P + 1, P + k), None)) if g else (lambda: (None, None))


def run_step(model, state: DecodeState, draft: Draft, plan: StepPlan, mask_id: int) -> Output:
    """One forward over the plan's slots: the draft tokens, then the mask groups."""
    B = draft.tokens.shape[0]
    with record_function("tidar.mask"):
        masks = torch.full((B, plan.slots - plan.causal), mask_id, device=draft.tokens.device)
        tokens = torch.cat([causal_tokens(draft, plan), masks], 1)
        mask = decode_step_mask(state.cache_valid, plan.causal, plan.k, plan.anchors, model.config._attn_implementation, plan.parents())
        positions = plan.positions(state.start)
    out = forward(model, state.cache, tokens, positions, mask, read=plan.read())
    state.nfe += 1
    return out


def causal_tokens(draft: Draft, plan: StepPlan) -> torch.Tensor:
    """The tokens of the step's causal slots: the chain, then the branches the plan kept."""
    return torch.cat([draft.tokens, draft.siblings[:, : len(plan.branches)]], 1) if plan.branches else draft.tokens


def commit(run, state: DecodeState, new_tokens, scores=None) -> None:
    """Append tokens one at a time so EOS, max_length and stopping criteria stop exactly where AR would.
    A finished row gets `pad`, as in transformers. `scores` (the processed scores so far) go to the
    stopping criteria when output_scores is on, as transformers passes them."""
    P = run.input_ids.shape[1]
    seqs, kv_valid, active = state.seqs, state.kv_valid, state.active
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
    state.seqs, state.kv_valid, state.active = seqs, kv_valid, active


def decode(model, run, drafter, planner: Planner, beta: float = 1.0, record=None) -> DecodeState:
    """Prefill and steps until every row stops. run: decode.Run (the merged arguments). record: None,
    or (scores, logits) lists that receive one (B, V) tensor per new token.

    A batch whose processors and stopping criteria look at each row alone decodes with per-row
    acceptance (decode_rows); otherwise each step commits the fewest drafts any row accepted."""
    if rowwise(run, beta, record):
        return decode_rows(model, run, drafter, planner)
    pick, processors, k = run.pick, run.processors, run.k
    B, P = run.input_ids.shape
    state = DecodeState(run.input_ids, run.kv_valid, torch.ones(B, dtype=torch.bool, device=run.input_ids.device))
    ar0, group = prefill(model, state, k, run.mask_id, drafter.uses_groups)
    limit = position_limit(model)
    with record_function("tidar.verify"):
        scores0 = process(processors, state.seqs, state.seqs[:, :0], ar0[:, None])[:, 0]
        pick.seek(0)  # sampling draws by position: the first new token is index 0
        y = pick.token(scores0)
    if record is not None:
        record[0].append(scores0)
        record[1].append(ar0.float())
    new_tokens = y[:, None]
    while True:
        with record_function("tidar.commit"):
            commit(run, state, new_tokens, record[0] if record is not None and run.gc.output_scores else None)
        if not state.active.any():
            break
        pick.seek(state.seqs.shape[1] - P)
        state.cache_valid = state.kv_valid[:, :-1]
        with record_function("tidar.draft"):
            remaining = run.max_new - (state.seqs.shape[1] - P)  # y of the next step is one of them
            room = None if limit is None else limit - 1 - int(state.start.max())  # positions left after draft 0
            most = min(remaining - 1, planner.max_proposals(drafter.uses_groups), room if room is not None else remaining)
            ctx = DraftContext(state.seqs, state.kv_valid, most, pick, processors, memo(group), planner.siblings if B == 1 else 0, planner.budget - 1)
            draft, plan = planner.step(drafter.propose(ctx) or fresh(state.seqs[:, -1]), drafter.uses_groups, room)
        state.finish()
        started = time.perf_counter()
        out = run_step(model, state, draft, plan, run.mask_id)
        m = plan.n_drafts
        with record_function("tidar.verify"):
            ar = out.rows(0, m)
            scores = process(processors, state.seqs, draft.tokens[:, 1:], ar)  # row i: after seqs ++ drafts 1..i
            accepted = pick.verify(scores, draft)
            j = int(accepted[state.active].min())  # rows share one cache length: commit the least
            tokens = causal_tokens(draft, plan)
            if plan.branches:  # a tree: follow the AR's tokens down it, off the chain where they lead
                path, scored, raw = walk(plan, tokens, out, state.seqs, processors, pick, scores, ar)
                y, j = pick.token(scored[-1]), len(path)
                planner.timed(plan, time.perf_counter() - started, draft, torch.full_like(accepted, j), torch.full_like(accepted, path[-1] + 1))
                g = plan.group_start(path[-1] + 1)
            else:
                planner.timed(plan, time.perf_counter() - started, draft, accepted, torch.full_like(accepted, j))  # int() above waited for the device
                g = plan.group_start(j)
                target = scores[:, j - 1]
                if beta != 1.0 and g is not None:
                    target = process(processors, state.seqs, draft.tokens[:, 1:j], mix(ar[:, j - 1], out.rows(g, g + 1)[:, 0], beta)[:, None])[:, 0]
                y = pick.next_token(target, draft, accepted, j, exact=beta == 1.0)
                path, scored, raw = list(range(j)), scores[:, :j].unbind(1), ar[:, :j].unbind(1)
            if hasattr(drafter, "observe"):
                # the chain's acceptance (what its confidence predicted), and what a tree's path committed
                drafter.observe(draft, accepted, torch.full_like(accepted, j) if plan.branches else accepted)
        if record is not None:
            record[0].extend(scored)
            record[1].extend(a.float() for a in raw)
        with record_function("tidar.crop"):
            if path[-1] == j - 1:  # the chain's first j slots: a prefix of the step
                state.cache.crop(-(plan.slots - j))
            else:  # a branch off the chain is not a prefix, so `crop` cannot keep it
                keep_slots(state.cache, state.cache_valid.shape[1], path)
                state.sibling_steps += 1
        new_tokens = torch.cat([tokens[:, path[1:]], y[:, None]], 1)
        group = (lambda out=out, g=g: (out.rows(g + 1, g + k), None)) if g is not None else (lambda: (None, None))
        state.record(j, plan, draft, out)
    state.finish()
    return state


def walk(plan: StepPlan, tokens: torch.Tensor, out: Output, seqs, processors, pick, chain_scores, chain_ar):
    """Greedy verification of a tree (batch 1): from draft 0, the AR's token at each node picks the
    child that holds it, until none does. Returns the path (slots from draft 0), and the processed
    scores and raw logits of each node on it, which AR would have produced for the same tokens: each
    node's row is processed with its own path as prefix. tokens: the causal slots' (causal_tokens).
    chain_scores, chain_ar: the chain's rows, already processed with the chain as prefix (the path's
    nodes while it stays on the chain)."""
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
            scores = process(processors, torch.cat([seqs, tokens[:, path[1:]]], 1), seqs[:, :0], ar[:, None])[:, 0]
        scored.append(scores)
        raw.append(ar)
        y = int(pick.token(scores)[0])
        nxt = [c for c in kids.get(s, ()) if values[c] == y]
        if not nxt:
            return path, scored, raw
        path.append(nxt[0])


def keep_slots(cache, cache_len: int, slots: list[int]) -> None:
    """Keep the cache's first cache_len entries and, of the step's slots after them, `slots`: a branch
    of a tree is not a suffix of the step, so `crop` cannot keep it."""
    index = torch.tensor([*range(cache_len), *(cache_len + s for s in slots)])
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            i = index.to(layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(-2, i), layer.values.index_select(-2, i)


def memo(fn):
    """fn, computed at most once (the group's vocabulary head runs only if a drafter asks)."""
    box = []

    def once():
        if not box:
            box.append(fn())
        return box[0]

    return once


# --------------------------------------------------------------------------------------------
# Per-row acceptance: each row of a batch keeps what it accepted (issue 8, item 5).
# --------------------------------------------------------------------------------------------

# Processors that act on each row's scores alone, whatever its prefix or batch index; and stopping
# criteria that read each row's own last tokens (max_length is applied per row here). With anything
# else (a prefix- or length-dependent processor, a custom criterion), rows share one commit length.
ROWWISE_PROCESSORS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper"}
ROWWISE_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria", "StopStringCriteria", "MaxTimeCriteria"}


def rowwise(run, beta: float, record) -> bool:
    return (
        run.input_ids.shape[0] > 1
        and beta == 1.0
        and record is None
        and run.streamer is None
        and all(type(p).__name__ in ROWWISE_PROCESSORS for p in run.processors)
        and all(type(c).__name__ in ROWWISE_CRITERIA for c in run.criteria)
    )


def commit_rows(run, criteria, state: DecodeState, tokens, counts, new, n_new) -> None:
    """Row b appends tokens[b, :counts[b]], one round at a time through the stopping criteria.
    state.seqs stays right-aligned (each row's last token in the last column; rows that did not
    advance in a round get a pad on the left, invalid in kv_valid), so criteria reading the last
    tokens see each row's own sequence. `new` (B, max_new) collects each row's new tokens."""
    seqs, valid, active = state.seqs, state.kv_valid, state.active
    B = seqs.shape[0]
    pad = torch.full((B, 1), run.pad, dtype=seqs.dtype, device=seqs.device)
    yes = torch.ones((B, 1), dtype=torch.bool, device=seqs.device)
    rows = torch.arange(B, device=seqs.device)
    for r in range(tokens.shape[1]):
        adv = active & (counts > r)
        if not adv.any():
            break
        token = tokens[:, r]
        seqs = torch.where(adv[:, None], torch.cat([seqs, token[:, None]], 1), torch.cat([pad, seqs], 1))
        valid = torch.where(adv[:, None], torch.cat([valid, yes], 1), torch.cat([~yes, valid], 1))
        new[rows[adv], n_new[adv]] = token[adv]
        n_new += adv.long()
        done = criteria(seqs, None).to(active.device) if len(criteria) else torch.zeros_like(active)
        active = active & ~(done & adv) & (n_new < run.max_new)
    state.seqs, state.kv_valid, state.active = seqs, valid, active


def decode_rows(model, run, drafter, planner: Planner) -> DecodeState:
    """The loop with per-row acceptance. The cache keeps, each step, the most drafts any row accepted;
    a row's drafts beyond its own accepted count stay in the cache as holes (cache_valid False),
    which its later queries never attend to, and its positions count only what it committed."""
    from transformers import StoppingCriteriaList

    pick, processors, k = run.pick, run.processors, run.k
    B, P = run.input_ids.shape
    device = run.input_ids.device
    criteria = StoppingCriteriaList([c for c in run.criteria if type(c).__name__ != "MaxLengthCriteria"])
    state = DecodeState(run.input_ids, run.kv_valid, torch.ones(B, dtype=torch.bool, device=device))
    state.row_nfe = torch.ones(B, dtype=torch.long, device=device)
    new = torch.full((B, run.max_new), run.pad, dtype=run.input_ids.dtype, device=device)
    n_new = torch.zeros(B, dtype=torch.long, device=device)
    ar0, group = prefill(model, state, k, run.mask_id, drafter.uses_groups)
    state.cache_valid = run.kv_valid
    limit = position_limit(model)
    with record_function("tidar.verify"):
        pick.seek(0)
        y = pick.token(process(processors, state.seqs, state.seqs[:, :0], ar0[:, None])[:, 0])
    tokens, counts = y[:, None], torch.ones(B, dtype=torch.long, device=device)
    while True:
        with record_function("tidar.commit"):
            commit_rows(run, criteria, state, tokens, counts, new, n_new)
        if not state.active.any():
            break
        pick.seek(n_new)  # each row's own count: sampling draws by each row's position
        with record_function("tidar.draft"):
            remaining = run.max_new - int(n_new[state.active].min())
            room = None if limit is None else limit - 1 - int(state.start.max())
            most = min(remaining - 1, planner.max_proposals(drafter.uses_groups), room if room is not None else remaining)
            ctx = DraftContext(state.seqs, state.kv_valid, most, pick, processors, memo(group))
            draft, plan = planner.step(drafter.propose(ctx) or fresh(state.seqs[:, -1]), drafter.uses_groups, room, per_row=True)
        state.finish()
        started = time.perf_counter()
        out = run_step(model, state, draft, plan, run.mask_id)
        state.row_nfe += state.active.long()
        m = plan.n_drafts
        with record_function("tidar.verify"):
            scores = process(processors, state.seqs, draft.tokens[:, 1:], out.rows(0, m))
            accepted = pick.verify(scores, draft)
            planner.timed(plan, time.perf_counter() - started, draft, accepted.cpu())  # .cpu() waits for the device
            y = pick.next_token_rows(scores, draft, accepted)
            if hasattr(drafter, "observe"):
                drafter.observe(draft, accepted)
        accepted = torch.where(state.active, accepted, torch.ones_like(accepted))  # finished rows commit nothing
        J = int(accepted.max())
        with record_function("tidar.crop"):
            state.cache.crop(-(plan.slots - J))  # the most any row accepted; the rest of each row: holes
            state.cache_valid = torch.cat([state.cache_valid, torch.arange(J, device=device) < accepted[:, None]], 1)
        # Row b commits its accepted proposals, then its y.
        filler = torch.cat([draft.tokens[:, 1:], draft.tokens[:, :1]], 1)[:, :J]
        tokens, counts = filler.scatter(1, (accepted - 1)[:, None], y[:, None]), accepted
        starts = [plan.group_start(a) for a in accepted.tolist()]
        have = torch.tensor([s is not None for s in starts], device=device)
        at = torch.tensor([s if s is not None else 0 for s in starts], device=device)
        group = (lambda out=out, at=at, have=have: (out.rows_at(at + 1, k - 1), have)) if have.any() else (lambda: (None, None))
        state.record(J, plan, draft, out)
    state.finish()
    state.seqs = torch.cat([run.input_ids, new[:, : int(n_new.max())]], 1)
    state.row_new = n_new
    return state
