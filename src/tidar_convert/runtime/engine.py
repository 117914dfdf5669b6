"""The TiDAR decoding engine: prefill, then steps of draft -> plan -> forward -> verify -> commit
-> crop.

Shipped in every export's custom_generate/ folder (see exports.folder.shipped_code): imports nothing
but torch, transformers and its neighbours: forward.py (one forward), plan.py (the step plan),
costs.py (step costs), drafters.py, verify.py, tree.py, layout.py.

One step (docs/method.md §3), for a draft of m tokens (draft 0 = the last committed token):
  draft    the Drafter (drafters.py) proposes the next draft; with none, the step drafts nothing
           and only runs y and a fresh group
  plan     which query slots the forward runs: the m drafts (causal), plus mask groups of k at
           chosen anchors; a group anchored at j sees drafts[0..j) and pre-drafts the step after
           j drafts are accepted (plan.StepPlan, plan.Planner)
  forward  the decoder body once; the vocabulary head once, on the rows the step may read: the
           m AR rows and the draft slots of its groups (never the groups' first slots) (run_step)
  verify   the Verifier (verify.py) says how many drafts each row accepted; the commit policy
           says what each row keeps (accept_together: the fewest any row accepted, trees
           included; accept_each: each row its own, holes in the cache) and picks the next token y
  commit   the kept drafts + y, one at a time through the stopping criteria (commit)
  crop     the KV cache keeps the kept slots and drops every other slot of the step (crop)
  drop     a batch committing per row leaves out the rows that stopped (drop_finished): on a CPU
           a row costs its slots in every forward, and the batch runs until its slowest row stops

Trees (greedy, batch 1): a step may also verify siblings, other tokens beside the chain's, one
query slot each, plus groups after them (tree.py, plan.Planner.tree, StepPlan.sibling_parents).
The AR's token at each node picks the child that holds it (tree.walk); the step commits the path
and the token after it, and the cache keeps the path (tree.keep_slots) where it is not a prefix.

Each phase runs under torch.profiler.record_function("tidar.<phase>") while a profiler runs, for a
step breakdown (forward.phase).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .cache import growing_cache
from .drafters import Draft, DraftContext, Drafter, fresh
from .forward import Output, Parts, forward, model_parts, phase, slots_of
from .layout import (
    Local,
    build_mask,
    decode_mask_mod,
    decode_position_ids,
    decode_step_mask,
)
from .plan import Planner, StepPlan
from .recurrent import (
    Segments,
    crop_attention,
    keep_states,
    new_cache,
    recurrent_layers,
    select_rows,
)
from .transfer import on_device
from .tree import keep_slots, walk
from .verify import Greedy, argmax, at_rows, mix, prefix_free, process, top_chances


@dataclass
class DecodeState:
    seqs: torch.Tensor  # (B, L) committed tokens; the cache holds all but the last
    kv_valid: torch.Tensor  # (B, L) False at left padding
    active: torch.Tensor  # (B,) rows not yet stopped
    # (B, C) False at the cache's left padding and holes (rows that accepted less)
    cache_valid: torch.Tensor | None = None
    cache: DynamicCache = field(default_factory=growing_cache)
    nfe: int = 0
    new: torch.Tensor | None = None  # (B, max_new) each row's new tokens (pad after a row stops)
    n_new: torch.Tensor | None = None  # (B,) how many each row has
    # (B,) forwards while each row was active (per-row acceptance)
    row_nfe: torch.Tensor | None = None
    accepted: list = field(default_factory=list)  # drafts committed at each step
    slots: list = field(default_factory=list)  # query slots of each decoding forward
    # vocabulary-head rows (per batch row) of each decoding forward
    head_rows: list = field(default_factory=list)
    sources: Counter = field(default_factory=Counter)  # row-steps drafted by each source
    sibling_steps: int = 0  # steps that committed a sibling instead of the chain
    # source -> the chain's proposals judged by offset (judge)
    offsets: dict = field(default_factory=dict)
    # the last step's forward, until its vocabulary-head rows are all known
    last: Output | None = None
    # (B,) each working row's index in the caller's batch (drop_finished)
    rows: torch.Tensor | None = None
    # caller's row -> (its new tokens, their count, its forwards)
    dropped: dict = field(default_factory=dict)
    # `active` and `n_new` on the host, where the last commit knew them (None: read when asked)
    alive: list | None = None
    made: list | None = None
    written: int = 0  # slots the last forward wrote to the cache (a static cache's: its bucket)
    # each row's tokens the last commit appended, as host lists (None: not read by that commit)
    committed: list | None = None
    parts: Parts | None = None  # what a forward reads of the model, read once (forward.Parts)
    recurrent: bool | None = None  # the cache has recurrent layers (None: not looked yet)

    def alive_rows(self) -> list[bool]:
        if self.alive is None:
            self.alive = self.active.tolist()
        return self.alive

    def made_rows(self) -> list[int]:
        if self.made is None:
            self.made = self.n_new.tolist()
        return self.made

    def record(self, accepted: int, plan: StepPlan, draft: Draft, out: Output) -> None:
        self.finish()
        self.accepted.append(accepted)
        self.slots.append(plan.slots)
        self.sources.update(draft.sources)
        self.last = out

    def judge(self, draft: Draft, taken: list[int]) -> None:
        """Tallies, per draft source and offset i (the chain's i-th proposal), how often proposal i
        was judged (offered, and 1..i-1 accepted) and accepted, and the summed chance the plan read
        for it (draft.confidence, over the `rated` judged ones that had one): acceptance by offset,
        greedy or sampled, beside what the plan expected. taken: (B,) the drafts each row accepted
        (draft 0 counted), read once a step."""
        offered = draft.host("length")
        chances = None
        for b, alive in enumerate(self.alive_rows()):
            judged = min(taken[b], offered[b] - 1) if alive else 0
            if judged == 0:
                continue
            table = self.offsets.setdefault(
                draft.sources[b], {"judged": [], "accepted": [], "predicted": [], "rated": []}
            )
            for counts in table.values():
                counts.extend([0] * (judged - len(counts)))
            for i in range(judged):
                table["judged"][i] += 1
                table["accepted"][i] += i < taken[b] - 1
                if chances is None:
                    chances = draft.host("confidence")
                if chances is not None:
                    table["predicted"][i] += chances[b][i]
                    table["rated"][i] += 1

    def finish(self) -> None:
        """Counts the last step's head rows: known once the next draft has read its group, or
        not."""
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
            extra["tokens_per_nfe_per_row"] = (
                self.n_new.float() / self.row_nfe.clamp(min=1)
            ).tolist()
        return {
            **extra,
            "nfe": self.nfe,
            "new_tokens": n_new,
            "tokens_per_nfe": n_new / self.nfe,
            "accepted": self.accepted,
            "slots_per_step": sum(self.slots) / steps,
            "lm_head_rows_per_step": sum(self.head_rows) / steps,
            "draft_sources": {s: self.sources.get(s, 0) for s in ("lookup", "diffusion", "none")},
            "sibling_steps": self.sibling_steps,
            "acceptance_by_offset": self.offsets,
        }


def position_limit(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def prefill(
    model, run, state: DecodeState, k: int, mask_id: int, groups: bool
) -> tuple[torch.Tensor, callable]:
    """The prompt (causal), plus one mask group after it when the drafter uses groups (and its
    positions exist). Returns the AR logits of the first new token (B, V) and a function giving the
    group's draft logits (B, k - 1, V), or None."""
    prompt, valid = state.seqs, state.kv_valid
    B, P = prompt.shape
    n = valid.sum(1)  # real prompt tokens per row (left padding)
    limit = position_limit(model)
    g = k if groups and (limit is None or int(n.max()) + k <= limit) else 0
    with phase("tidar.mask"):
        tokens = torch.cat([prompt, torch.full((B, g), mask_id, device=prompt.device)], 1)
        positions = torch.cat(
            [
                (valid.cumsum(1) - 1).clamp(min=0),
                decode_position_ids(n - P, P, k, 1, P)[:, P : P + g],
            ],
            1,
        )
        all_valid = torch.cat([valid, torch.ones(B, g, dtype=torch.bool, device=prompt.device)], 1)
        kinds = state.parts.local  # sliding windows and chunks, by position
        local = None if kinds is None else Local(kinds, positions)
        mask = build_mask(
            decode_mask_mod(0, P, k, P, all_valid),
            B,
            P + g,
            P + g,
            state.parts.attn,
            prompt.device,
            local,
            slots=None if run.slots is None else (P + g, run.slots.capacity),
        )
    mixers = run.session.recurrent_mixers(model)
    # recurrent layers: the prompt from a fresh state, the group from the state after it
    segments = (
        Segments(P, (P,) if g else (), k, valid=None if bool(valid.all()) else valid)
        if mixers
        else None
    )
    read = [P - 1, *range(P + 1, P + g)]
    out = forward(
        model,
        state.cache,
        tokens,
        positions,
        mask,
        read,
        segments,
        mixers,
        groups_from=P,
        parts=state.parts,
    )
    state.nfe += 1
    with phase("tidar.crop"):
        if mixers:
            keep_states(state.cache, P, torch.full((B,), P, device=prompt.device))
            crop_attention(state.cache, g)
        elif g:
            state.cache.crop(-g)
    ar = out.rows(P - 1, P)[:, 0]
    return ar, (lambda: (out.rows(P + 1, P + k), None)) if g else no_group


def run_step(model, run, state: DecodeState, draft: Draft, plan: StepPlan) -> Output:
    """One forward over the plan's slots: the draft tokens, then the mask groups."""
    B, C = state.cache_valid.shape
    # a static cache's step: padded to its bucket (slots.py), the padding after the step's own
    written = plan.slots if run.slots is None else run.slots.pad(plan.slots, C)
    with phase("tidar.mask"):
        masks = torch.full((B, written - plan.causal), run.mask_id, device=draft.tokens.device)
        tokens = torch.cat([causal_tokens(draft, plan), masks], 1)
        positions = plan.positions(state.start)
        if written > plan.slots:  # padding at the step's last position: any in range will do
            positions = torch.cat([positions, positions[:, -1:].expand(B, written - plan.slots)], 1)
        # sliding windows and chunks; a cache column's position: the real tokens before it in its
        # row
        kinds = state.parts.local
        local = (
            None
            if kinds is None
            else Local(
                kinds,
                torch.cat([state.cache_valid.cumsum(1) - 1, positions], 1),
                q_offset=state.cache_valid.shape[1],
            )
        )
        mask = decode_step_mask(
            state.cache_valid,
            plan.causal,
            plan.k,
            plan.anchors,
            state.parts.attn,
            plan.parents(),
            local,
            kept=run.session.own_mask,
            slots=None if run.slots is None else (written, run.slots.capacity),
        )
    mixers = run.session.recurrent_mixers(model)
    # recurrent layers: the drafts continue the state, recording it after each; group g starts
    # from the state after its anchor
    segments = (
        Segments(plan.causal, tuple(plan.anchors), plan.k, record=True, parents=plan.parents())
        if mixers
        else None
    )
    call = None if run.slots is None else run.slots.call
    out = forward(
        model,
        state.cache,
        tokens,
        positions,
        mask,
        plan.read(),
        segments,
        mixers,
        call,
        groups_from=plan.causal,
        read_index=plan.read_index(tokens.device),
        parts=state.parts,
    )
    state.nfe += 1
    state.written = written
    return out


def causal_tokens(draft: Draft, plan: StepPlan) -> torch.Tensor:
    """The tokens of the step's causal slots: the chain, then the siblings the plan kept."""
    return (
        torch.cat([draft.tokens, draft.siblings[:, : plan.siblings]], 1)
        if plan.siblings
        else draft.tokens
    )


def decode(
    model, run, drafter: Drafter, planner: Planner, beta: float = 1.0, record=None
) -> DecodeState:
    """Prefill, then steps until every row stops. run: decode.Run (the merged arguments). record:
    None, or (scores, logits) lists that receive one (B, V) tensor per new token.

    The commit policy: a batch whose processors and stopping criteria look at each row alone
    commits per row (each row what it accepted: `accept_each`); otherwise every row commits the
    fewest drafts any row accepted (`accept_together`), which trees, beta < 1, streamers and
    recorded scores need."""
    per_row = rowwise(run, beta, record)
    pick, processors, k = run.pick, run.processors, run.k
    B, P = run.input_ids.shape
    device = run.input_ids.device
    # Per row, max_new_tokens is counted per row (a row's seqs length is not its own): the length
    # criterion goes.
    criteria = (
        StoppingCriteriaList([c for c in run.criteria if type(c).__name__ != "MaxLengthCriteria"])
        if per_row
        else run.criteria
    )
    stops = known_stops(run, criteria)
    state = DecodeState(run.input_ids, run.kv_valid, torch.ones(B, dtype=torch.bool, device=device))
    state.parts = model_parts(model)
    if run.slots is not None:
        state.cache = run.slots.cache
    elif run.session.recurrent_mixers(model):
        state.cache = new_cache(model.config)
    else:  # room in its store for every layer (where the config says how many)
        layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
        state.cache = growing_cache(layers or 8)
    state.new = torch.full((B, run.max_new), run.pad, dtype=run.input_ids.dtype, device=device)
    state.n_new = torch.zeros(B, dtype=torch.long, device=device)
    if per_row:
        state.row_nfe = torch.ones(B, dtype=torch.long, device=device)
        state.rows = torch.arange(B, device=device)
    ar0, group = prefill(model, run, state, k, run.mask_id, drafter.uses_groups)
    # greedy on the raw logits, where a read waits for the device: a step's tokens and the next
    # draft's candidates are computed ahead of the verdict (read_ahead); ids travel as float32
    ahead = (
        reads_wait(device)
        and isinstance(pick, Greedy)
        and not processors
        and beta == 1.0
        and ar0.shape[-1] < 2**24
    )
    # the candidates a diffusion draft takes at each slot: its token, and a tree's siblings
    choices = (1 + (planner.siblings if B == 1 else 0)) if drafter.uses_groups else 0
    state.cache_valid = run.kv_valid
    limit = position_limit(model)
    with phase("tidar.verify"):
        scores0 = process(processors, state.seqs, state.seqs[:, :0], ar0[:, None])[:, 0]
        pick.seek(0)  # sampling draws by position: the first new token is index 0
        y = pick.token(scores0)
    if record is not None:
        record[0].append(scores0)
        record[1].append(ar0.float())
    kept = Kept(y[:, None], torch.ones(B, dtype=torch.long, device=device), [], group)
    while True:
        with phase("tidar.commit"):
            scores = record[0] if record is not None and run.gc.output_scores else None
            commit(run, criteria, state, kept, scores, stops)
        if not any(state.alive_rows()):
            break
        # a returned cache keeps every row; a static cache keeps its shapes
        if (
            per_row
            and not all(state.alive_rows())
            and not run.gc.return_dict_in_generate
            and run.slots is None
        ):
            kept = drop_finished(state, kept, pick)
        pick.seek(state.made_rows())  # each row's own count: sampling draws by its position
        with phase("tidar.draft"):
            # y of the next step is one of them
            remaining = run.max_new - min(
                n for n, alive in zip(state.made_rows(), state.alive_rows()) if alive
            )
            # positions left after draft 0; no row's exceeds the cache's columns, so far from the
            # limit (room for the largest step) it binds nothing and is not read
            near = limit is not None and limit - 1 - state.cache_valid.shape[1] < planner.budget + k
            room = limit - 1 - int(state.start.max()) if near else None
            most = min(
                remaining - 1,
                planner.max_proposals(drafter.uses_groups),
                room if room is not None else remaining,
            )
            ctx = DraftContext(
                state.seqs,
                state.kv_valid,
                most,
                pick,
                processors,
                memo(kept.group),
                planner.siblings if B == 1 else 0,
                planner.budget - 1,
                state.committed,
                kept.choices,
            )
            draft, plan = planner.step(
                drafter.propose(ctx) or fresh(state.seqs[:, -1], ctx.y_host),
                drafter.uses_groups,
                room,
                per_row=per_row,
            )
        state.finish()
        started = time.perf_counter()
        out = run_step(model, run, state, draft, plan)
        if per_row:
            state.row_nfe += state.active.long()
        with phase("tidar.verify"):
            ar = out.rows(0, plan.n_drafts)
            # row i: after seqs ++ drafts 1..i
            scores = process(processors, state.seqs, draft.tokens[:, 1:], ar)
            accepted, best = pick.verify_tokens(scores, draft)
            # where `ahead`, what the next step reads comes in the verdict's read
            early = read_ahead(out, plan, choices) if ahead else None
            taken, best_host, sibling_host, tops = read_verdict(accepted, best, early)
            state.judge(draft, taken)
            accept = accept_each if per_row else accept_together
            step = Step(
                draft, plan, out, ar, scores, accepted, taken, best, best_host, sibling_host, tops
            )
            kept = accept(state, step, run, beta)
            # accept() waited for the device
            planner.timed(plan, time.perf_counter() - started, draft, kept.brought, kept.ends)
            drafter.observe(draft, taken, kept.brought)
        if record is not None:
            record[0].extend(kept.scores)
            record[1].extend(a.float() for a in kept.raw)
        with phase("tidar.crop"):
            crop(state, plan, kept)
        state.record(len(kept.slots), plan, draft, out)
    state.finish()
    if state.dropped:
        restore_rows(state)
    state.seqs = torch.cat([run.input_ids, state.new[:, : int(state.n_new.max())]], 1)
    return state


def drop_finished(state: DecodeState, kept: "Kept", pick) -> "Kept":
    """Leave the rows that stopped out of every later forward (per-row commits only): their new
    tokens are set aside by the caller's row index (restore_rows puts them back), and every working
    tensor, the cache, the next draft's group logits and the verifier's row keys (sampling draws by
    the caller's row) follow the rows that go on. The planner keeps pricing steps from the full
    batch's table: dearer than the smaller batch's, never unmeasured (a table per batch size left
    would price each of its shapes optimistically until tried; at batch 16 that exploration cost
    more than the dropped rows saved, bench/LOG.md)."""
    keep = state.active.nonzero()[:, 0]
    for i in (~state.active).nonzero()[:, 0].tolist():
        state.dropped[int(state.rows[i])] = (
            state.new[i],
            int(state.n_new[i]),
            int(state.row_nfe[i]),
        )
    for name in ("seqs", "kv_valid", "active", "cache_valid", "new", "n_new", "row_nfe", "rows"):
        setattr(state, name, getattr(state, name)[keep])
    select_rows(state.cache, keep)
    state.alive = state.made = state.committed = None
    pick.rows = state.rows.tolist()
    group = kept.group

    def kept_rows():
        logits, have = group()
        return logits[keep], None if have is None else have[keep]

    choices = kept.choices
    if choices is not None:
        rows = keep.tolist()
        choices = tuple([c[i] for i in rows] for c in choices)
    return Kept(
        kept.tokens[keep],
        kept.counts[keep],
        kept.slots,
        memo(kept_rows) if group is not no_group else no_group,
        choices=choices,
    )


def restore_rows(state: DecodeState) -> None:
    """The caller's batch again, in its order: the working rows and the rows drop_finished set
    aside."""
    B = len(state.dropped) + state.new.shape[0]
    width = state.new.shape[1]
    new = torch.empty(B, width, dtype=state.new.dtype, device=state.new.device)
    n_new = torch.empty(B, dtype=torch.long, device=state.new.device)
    row_nfe = torch.empty(B, dtype=torch.long, device=state.new.device)
    for i, row in enumerate(state.rows.tolist()):
        new[row], n_new[row], row_nfe[row] = state.new[i], state.n_new[i], state.row_nfe[i]
    for row, (tokens, count, nfe) in state.dropped.items():
        new[row], n_new[row], row_nfe[row] = tokens, count, nfe
    state.new, state.n_new, state.row_nfe = new, n_new, row_nfe


@dataclass
class Step:
    """One verified step, as the commit policies (accept_together, accept_each) read it."""

    draft: Draft
    plan: StepPlan
    out: Output  # the forward over the plan's slots
    ar: torch.Tensor  # (B, m, V) the raw logits of the m draft rows (AR's next-token rows)
    scores: torch.Tensor  # the same, processed: row i with the prefix seqs ++ drafts 1..i
    accepted: torch.Tensor  # (B,) drafts each row accepted, draft 0 (committed already) counted
    taken: list[int]  # the same, on the host
    # (B, m) AR's token at each draft row (the verifier's), and on the host
    best: torch.Tensor
    best_host: list
    # what the verdict's read also brought (read_ahead), host lists; None: not read. AR's token at
    # each sibling slot, and each row's likeliest tokens, with their chances, at every group draft
    # slot (plan.read() after the causal slots): the next draft's, whatever the verdict.
    sibling_host: list | None = None
    tops_host: tuple[list, list] | None = None

    def parts(self):
        return self.draft, self.plan, self.out, self.scores, self.ar, self.accepted

    def host_tokens(self, counts: list[int], after: list[int]) -> list | None:
        """Each row's committed tokens on the host, as the device's: its proposals 1..counts[b] - 1,
        then AR's token after `after[b]` drafts (the row's y)."""
        rows = zip(self.draft.host("tokens"), self.best_host, counts, after)
        return [r[1:c] + [b[a - 1]] for r, b, c, a in rows]

    def choices_at(self, reads: list, width: int, have: list | None) -> tuple | None:
        """The next draft's candidates from the verdict's read (DraftContext.choices): per row b
        that reads reads[b] = (the slot its proposals follow, how many) (StepPlan.group_read), the
        likeliest tokens and their chances at those slots, `width` of them (a row with fewer gets
        its first again, as Output.rows_at fills it), and `have`. None where the read did not bring
        them, or a row reads no group (its draft comes from the logits)."""
        if self.tops_host is None or any(r is None for r in reads):
            return None
        tokens, chances = self.tops_host
        rows = []
        for first, n in reads:
            row = [self.out.row_of[s] - self.plan.causal for s in range(first + 1, first + 1 + n)]
            rows.append(row + row[:1] * (width - n))
        return (
            [[tokens[b][i] for i in row] for b, row in enumerate(rows)],
            [[chances[b][i] for i in row] for b, row in enumerate(rows)],
            have,
        )


def reads_wait(device: torch.device) -> bool:
    """Whether reading a tensor's value waits for the device. Not on a CPU, where the values are
    in memory already: computing ahead what the next step reads (read_ahead) would only add work
    there (a top-k over every candidate group's rows; bench/LOG.md, 2026-12-07, "one read a
    step")."""
    return device.type != "cpu"


def read_ahead(out: Output, plan: StepPlan, choices: int) -> tuple:
    """What the next step reads from this forward's logits, computed before the verdict so that one
    read brings both (greedy on raw logits): AR's token at each sibling slot (B, s), None without
    siblings (tree.walk), and the `choices` likeliest tokens and their probabilities at every group
    draft slot (B, R, choices) each (drafters.first_choices). Every candidate group's, since which
    one the next draft reads depends on the verdict: a few rows of top-k more, where a read would
    wait for the device."""
    siblings = argmax(out.rows(plan.n_drafts, plan.causal)) if plan.siblings else None
    if not choices or out.cached is None or out.cached.shape[1] == plan.causal:
        return siblings, None, None
    tokens, chances = top_chances(out.cached[:, plan.causal :].float(), choices)
    return siblings, tokens, chances


def read_verdict(accepted, best, ahead=None) -> tuple:
    """The step's one read: the verdict (B,), AR's tokens at the draft rows and what read_ahead
    computed, if it ran. Returns host lists: (taken, best, siblings, tops), None for what was not
    computed. Token ids travel as float32 beside the chances (exact below 2**24; read_ahead is
    asked only for such vocabularies)."""
    siblings, top, chances = ahead if ahead is not None else (None, None, None)
    ints = [accepted[:, None], best] + ([siblings] if siblings is not None else [])
    ids = torch.cat(ints + ([top.flatten(1)] if top is not None else []), 1)
    if top is None:
        rows = ids.tolist()
    else:
        rows = [
            [int(v) for v in row[: ids.shape[1]]] + row[ids.shape[1] :]
            for row in torch.cat([ids.float(), chances.flatten(1)], 1).tolist()
        ]
    m, s = best.shape[1], siblings.shape[1] if siblings is not None else 0
    taken = [r[0] for r in rows]
    best_host = [r[1 : 1 + m] for r in rows]
    sibling_host = [r[1 + m : 1 + m + s] for r in rows] if siblings is not None else None
    tops = None
    if top is not None:
        R, c = top.shape[1], top.shape[2]
        at = 1 + m + s
        tops = (
            [[r[at + i * c : at + (i + 1) * c] for i in range(R)] for r in rows],
            [[r[at + R * c + i * c : at + R * c + (i + 1) * c] for i in range(R)] for r in rows],
        )
    return taken, best_host, sibling_host, tops


@dataclass
class Kept:
    """What a step keeps, by the commit policy (accept_together, accept_each)."""

    # (B, n) each row's new tokens: its accepted proposals, then the token after them
    tokens: torch.Tensor
    counts: torch.Tensor  # (B,) how many of them row b commits
    slots: list  # the step's slots the cache keeps, from draft 0 (a prefix, or a tree's path)
    group: Callable  # the next draft's group logits (DraftContext.group)
    # (B,) drafts each row's draft got committed (a tree: its path): what drafters and the plan
    # learn
    brought: list | torch.Tensor | None = None
    # (B,) the slot each row's next group is read after (StepPlan.group_start)
    ends: list | torch.Tensor | None = None
    # the processed scores of each committed position (recorded for output_scores)
    scores: tuple = ()
    raw: tuple = ()  # and the raw logits
    # each row's committed tokens on the host, counts[b] of them, where the step knew them (the
    # commit then reads nothing); None: read at the commit
    host: list | None = None
    # the next draft's candidates, as the verdict's read brought them (Step.choices_at); None:
    # the drafter reads the group's logits
    choices: tuple | None = None
    whole: bool = False  # every row keeps every one of `slots` (counts == len(slots)): no holes


def no_group():
    return None, None


def accept_together(state: DecodeState, step: Step, run, beta: float) -> Kept:
    """Every row commits the fewest drafts any active row accepted, so the rows share one cache
    length. A tree (batch 1) commits the path the AR's tokens take down it (walk)."""
    draft, plan, out, scores, ar, accepted = step.parts()
    pick, processors, k = run.pick, run.processors, plan.k
    B = accepted.shape[0]
    j = min(t for t, alive in zip(step.taken, state.alive_rows()) if alive)
    tokens = causal_tokens(draft, plan)
    host = None
    if plan.siblings:
        # the causal tokens as the host has them, and AR's tokens at them as the verdict read them
        # (the chain's; the siblings' where read ahead)
        values = draft.host("tokens")[0] + draft.host("siblings")[0][: plan.siblings]
        known = step.best_host[0] + (step.sibling_host[0] if step.sibling_host else [])
        path, scored, raw, last = walk(
            plan, tokens, out, state.seqs, processors, pick, scores, ar, values, known
        )
        y, j = pick.token(scored[-1]), len(path)
        host = [[values[s] for s in path[1:]] + [last]]
        brought, ends = [j] * B, [path[-1] + 1] * B
    else:
        path, scored, raw = list(range(j)), scores[:, :j].unbind(1), ar[:, :j].unbind(1)
        brought, ends = step.taken, [j] * B
        g = plan.group_start(j)
        if beta != 1.0 and g is not None:
            target = process(
                processors,
                state.seqs,
                draft.tokens[:, 1:j],
                mix(ar[:, j - 1], out.rows(g, g + 1)[:, 0], beta)[:, None],
            )[:, 0]
            y = pick.next_token(target, draft, accepted, j, exact=False)
        else:  # AR's token there, as the verdict computed and read it
            y = step.best[:, j - 1]
            host = step.host_tokens([j] * B, [j] * B)
    if plan.siblings:  # a tree's groups hang after its nodes: only the one at the path's end
        g = plan.group_start(path[-1] + 1)
        read = None if g is None else (g, k - 1)
    else:
        read = plan.group_read(j)
    group = (
        (lambda: (out.rows(read[0] + 1, read[0] + 1 + read[1]), None))
        if read is not None
        else no_group
    )
    new = torch.cat([slots_of(tokens, path[1:]), y[:, None]], 1)
    return Kept(
        new,
        torch.full((B,), j, dtype=torch.long, device=accepted.device),
        path,
        group,
        brought,
        ends,
        tuple(scored),
        tuple(raw),
        host,
        step.choices_at([read] * B, read[1], None) if read is not None else None,
        whole=True,
    )


def accept_each(state: DecodeState, step: Step, run, beta: float) -> Kept:
    """Each row commits what it accepted. The cache keeps the most drafts any row accepted; a row's
    drafts beyond its own count stay in the cache as holes (cache_valid False), which its later
    queries never attend to, and its positions count only what it committed. (Only where beta is
    1: rowwise.)"""
    draft, plan, out, _, _, accepted = step.parts()
    k = plan.k
    y = at_rows(step.best, accepted - 1)
    # finished rows commit nothing
    counts = torch.where(state.active, accepted, torch.ones_like(accepted))
    n = [t if alive else 1 for t, alive in zip(step.taken, state.alive_rows())]
    J = max(n)
    filler = torch.cat([draft.tokens[:, 1:], draft.tokens[:, :1]], 1)[:, :J]
    # row b: its accepted proposals, then y
    tokens = filler.scatter(1, (counts - 1)[:, None], y[:, None])
    reads = [plan.group_read(a) for a in n]
    # proposals per row
    proposals = [r[1] if r is not None else 0 for r in reads]
    have = on_device(proposals, accepted.device)
    # none: slot 0, an AR row (computed)
    at = on_device([r[0] if r is not None else -1 for r in reads], accepted.device)
    group = (lambda: (out.rows_at(at + 1, k - 1, have), have)) if any(proposals) else no_group
    # as `tokens`: a stopped row's one token is its y
    host = step.host_tokens(n, step.taken)
    choices = step.choices_at(reads, k - 1, proposals) if any(proposals) else None
    taken = step.taken  # `accepted` as the verdict read it
    return Kept(tokens, counts, list(range(J)), group, taken, taken, host=host, choices=choices)


def known_stops(run, criteria) -> tuple[frozenset, int | None] | None:
    """(EOS ids, max_length or None) where every stopping criterion is transformers' own EOS or
    max-length one and nothing streams: then a step's tokens are committed at once
    (commit_at_once) instead of one round of criteria per token. None otherwise. Exact types only:
    a subclass may stop on anything."""
    if run.streamer is not None or not all(
        type(c) in (EosTokenCriteria, MaxLengthCriteria) for c in criteria
    ):
        return None
    eos = frozenset(
        t
        for c in criteria
        if type(c) is EosTokenCriteria
        for t in torch.as_tensor(c.eos_token_id).reshape(-1).tolist()
    )
    lengths = [c.max_length for c in criteria if type(c) is MaxLengthCriteria]
    return eos, min(lengths) if lengths else None


def commit(run, criteria, state: DecodeState, kept: Kept, scores=None, stops=None) -> None:
    """Row b appends kept.tokens[b, :kept.counts[b]]: at once where `stops` (known_stops) says
    the criteria are EOS and max_length only, else one round at a time through the criteria."""
    if stops is not None:
        commit_at_once(run, state, kept, *stops)
    else:
        commit_by_round(run, criteria, state, kept, scores)


def commit_at_once(run, state: DecodeState, kept: Kept, eos: frozenset, max_length) -> None:
    """commit_by_round's result, from one read of the step's tokens: each row's tokens end at its
    first EOS, at max_new, and at the round where seqs reaches max_length (a round lengthens every
    row, so that round is the same for all). A row that commits c of the step's R rounds gets
    R - c pads on the left, as it would one round at a time."""
    seqs, B, L = state.seqs, state.seqs.shape[0], state.seqs.shape[1]
    n = kept.tokens.shape[1]
    if kept.host is not None:  # the step knew them: nothing to read
        host = [
            [*tokens, len(tokens), alive, done]
            for tokens, alive, done in zip(kept.host, state.alive_rows(), state.made_rows())
        ]
    else:
        host = torch.cat(
            [kept.tokens, kept.counts[:, None], state.active[:, None].long(), state.n_new[:, None]],
            1,
        ).tolist()
    rounds = n if max_length is None else max(0, min(n, max_length - L))
    takes, active = [], []
    for *tokens, count, alive, done in host:
        c = min(count, rounds, run.max_new - done) if alive else 0
        stop = next((i + 1 for i in range(c) if tokens[i] in eos), None)
        c = c if stop is None else stop
        takes.append(c)
        reached = max_length is not None and c and L + c >= max_length
        active.append(bool(alive) and stop is None and not reached and done + c < run.max_new)
    R = max(takes)
    if R:
        device = seqs.device
        c = on_device(takes, device)
        if B == 1:
            state.seqs = torch.cat([seqs, kept.tokens[:, :R]], 1)
            state.kv_valid = torch.cat(
                [state.kv_valid, torch.ones(1, R, dtype=torch.bool, device=device)], 1
            )
        else:  # row b: R - c_b pads, its sequence, its c_b tokens (a shift of the three blocks)
            shift = torch.arange(L + R, device=device) + c[:, None]
            pads = torch.full((B, R), run.pad, dtype=seqs.dtype, device=device)
            state.seqs = torch.cat([pads, seqs, kept.tokens[:, :R]], 1).gather(1, shift)
            yes = torch.ones(B, R, dtype=torch.bool, device=device)
            state.kv_valid = torch.cat([~yes, state.kv_valid, yes], 1).gather(1, shift)
        for b, (take, done) in enumerate(zip(takes, (row[-1] for row in host))):
            if take:
                state.new[b, done : done + take] = kept.tokens[b, :take]
        state.n_new = state.n_new + c
    state.active = on_device(active, state.active.device)
    state.alive, state.made = active, [row[-1] + c for row, c in zip(host, takes)]
    state.committed = [row[:take] for row, take in zip(host, takes)]


def commit_by_round(run, criteria, state: DecodeState, kept: Kept, scores=None) -> None:
    """Row b appends kept.tokens[b, :kept.counts[b]], one round at a time through the stopping
    criteria, so EOS, max_new_tokens and stopping criteria stop a row exactly where AR would.
    state.seqs stays right-aligned: a row that does not advance in a round (it committed fewer, or
    it stopped) gets a pad on the left, invalid in kv_valid, so criteria reading the last tokens see
    each row's own sequence. state.new collects each row's new tokens (a stopped row's stay `pad`,
    as in transformers). `scores` (the processed scores so far) go to the criteria when
    output_scores is on, as transformers passes them."""
    seqs, valid, active, n_new = state.seqs, state.kv_valid, state.active, state.n_new
    tokens, counts = kept.tokens, kept.counts
    B = seqs.shape[0]
    pad = torch.full((B, 1), run.pad, dtype=seqs.dtype, device=seqs.device)
    yes = torch.ones((B, 1), dtype=torch.bool, device=seqs.device)
    rows = torch.arange(B, device=seqs.device)
    for r in range(tokens.shape[1]):
        adv = active & (counts > r)
        if not adv.any():
            break
        token = tokens[:, r]
        seqs = torch.where(
            adv[:, None], torch.cat([seqs, token[:, None]], 1), torch.cat([pad, seqs], 1)
        )
        valid = torch.where(adv[:, None], torch.cat([valid, yes], 1), torch.cat([~yes, valid], 1))
        if run.streamer is not None:
            run.streamer.put(torch.where(adv, token, pad[:, 0]).cpu())
        state.new[rows[adv], n_new[adv]] = token[adv]
        n_new += adv.long()
        done = (
            criteria(seqs, tuple(scores[: int(n_new.max())]) if scores is not None else None).to(
                active.device
            )
            if len(criteria)
            else torch.zeros_like(active)
        )
        active = active & ~(done & adv) & (n_new < run.max_new)
    state.seqs, state.kv_valid, state.active = seqs, valid, active
    state.alive = state.made = state.committed = None


def crop(state: DecodeState, plan: StepPlan, kept: Kept) -> None:
    """The cache keeps the step's kept slots and drops every other; a row's holes are marked
    invalid."""
    slots = kept.slots
    prefix = slots == list(range(len(slots)))
    if state.recurrent is None:  # the cache's layers are made at the prefill and stay
        state.recurrent = bool(recurrent_layers(state.cache))
    recurrent = state.recurrent
    if recurrent:  # each row's recurrent state after the drafts it kept (a branch: its last slot)
        keep_states(state.cache, plan.causal, kept.counts, None if prefix else slots)
    if prefix and recurrent:  # the attention halves (a row's holes included, as below)
        crop_attention(state.cache, plan.slots - len(slots))
    elif prefix:  # a prefix of the step (of what it wrote: a static cache's padding too)
        state.cache.crop(-(state.written - len(slots)))
    else:  # a branch off the chain is not a prefix, so `crop` cannot keep it
        keep_slots(state.cache, state.cache_valid.shape[1], slots)
        state.sibling_steps += 1
    valid = state.cache_valid
    if kept.whole:
        state.cache_valid = torch.cat([valid, valid.new_ones(valid.shape[0], len(slots))], 1)
    else:
        hole = torch.arange(len(slots), device=kept.counts.device) >= kept.counts[:, None]
        state.cache_valid = torch.cat([valid, ~hole], 1)


def memo(fn):
    """fn, computed at most once (the group's vocabulary head runs only if a drafter asks)."""
    box = []

    def once():
        if not box:
            box.append(fn())
        return box[0]

    return once


# Stopping criteria that read each row's own last tokens (max_length is applied per row here). With
# anything else (a prefix- or length-dependent processor, a custom criterion), rows share one commit
# length; a prefix-free processor (verify.PREFIX_FREE) acts on each row alone.
ROWWISE_CRITERIA = {
    "MaxLengthCriteria",
    "EosTokenCriteria",
    "StopStringCriteria",
    "MaxTimeCriteria",
}


def rowwise(run, beta: float, record) -> bool:
    return (
        run.input_ids.shape[0] > 1
        and beta == 1.0
        and record is None
        and run.streamer is None
        and prefix_free(run.processors)
        and all(type(c).__name__ in ROWWISE_CRITERIA for c in run.criteria)
    )
