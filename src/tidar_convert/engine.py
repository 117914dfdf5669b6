"""The TiDAR decoding engine: prefill, then steps of draft -> plan -> forward -> verify -> commit -> crop.

Shipped in every export's custom_generate/ folder (see export.shipped_code): imports nothing but
torch, transformers and its neighbours (layout, drafters, verify).

One step (docs/method.md §3), for a draft of m tokens (draft 0 = the last committed token):
  plan     which query slots the forward runs: the m drafts (causal), plus mask groups of k at
           chosen anchors; a group anchored at j sees drafts[0..j) and pre-drafts the step after
           j drafts are accepted (StepPlan, Planner)
  forward  the decoder body once; the vocabulary head once, on the rows the step may read: the m
           AR rows and the draft slots of its groups (never the groups' first slots)
  verify   the Verifier (verify.py) accepts j >= 1 drafts and picks the next token y
  commit   accepted drafts + y, one at a time through the stopping criteria
  crop     the KV cache keeps the j accepted drafts and drops every other slot of the step
  draft    the Drafter (drafters.py) proposes the next draft; with none, the next step drafts nothing
           and only runs y and a fresh group

Trees (greedy, batch 1): a step may also verify alternatives to the chain's tokens (the group's
next likeliest tokens at each offset, and the chain's own choices after them), one query slot each,
plus groups after them: the likeliest nodes of the group's tree (drafters.grow, Planner.tree,
StepPlan.branches). The AR's token at each node picks the child that holds it (walk); the step
commits the path and the token after it, and the cache keeps the path (keep_slots) where it is not
a prefix of the step.

Each phase runs under torch.profiler.record_function("tidar.<phase>") for a step breakdown.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from .drafters import Draft, DraftContext, fresh
from .layout import build_mask, decode_mask_mod, decode_position_ids, decode_step_mask
from .verify import mix, process

# False: the vocabulary head on every slot, as a plain model forward does. Only tests change it, to
# show the read-rows-only head gives the same tokens.
READ_ROWS_ONLY = True


# --------------------------------------------------------------------------------------------
# One forward: the decoder body on all slots, the vocabulary head on the rows read.
# --------------------------------------------------------------------------------------------


def cache_kwargs(model, cache) -> dict:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name goes in 5.40)."""
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


# Config fields through which a family's causal-LM head does more than `lm_head(hidden)`. Softcapping
# is applied here; for the others the engine runs the model's own forward (all rows through the head).
SOFTCAP = "final_logit_softcapping"
OTHER_HEAD_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def head_is_plain(model) -> bool:
    return READ_ROWS_ONLY and not any(getattr(model.config, f, None) not in (None, 1, 1.0) for f in OTHER_HEAD_TRANSFORMS)


class Output:
    """One forward's result; `rows(i, j)` are the logits of query slots i..j-1.

    The vocabulary head runs once, on the slots `read` that the step may read (its AR rows and the
    draft slots of its groups), not on every slot: at batch 1 the head's weight (V x hidden) is read
    from memory once per call whatever the row count, so one call on all candidate rows costs less
    than a call for the AR rows and another for the group the next draft reads (measured on this
    repo's CPU: two calls took 40 % of a step). A slot outside `read` is computed when asked."""

    def __init__(self, model, hidden=None, logits=None, read: list[int] | None = None):
        self.model, self.hidden, self.logits, self.head_rows = model, hidden, logits, 0
        self.cached = self.where = None
        if hidden is not None and read:
            self.where = torch.full((hidden.shape[1],), -1, dtype=torch.long, device=hidden.device)
            self.where[read] = torch.arange(len(read), device=hidden.device)  # slot -> row of `cached`
            self.cached = self.head(hidden[:, read])
            self.head_rows = len(read)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        if self.logits is not None:
            return self.logits[:, start:stop]
        if self.where is not None and bool((self.where[start:stop] >= 0).all()):
            return self.cached[:, self.where[start:stop]]
        self.head_rows += stop - start
        return self.head(self.hidden[:, start:stop])

    def rows_at(self, starts: torch.Tensor, n: int) -> torch.Tensor:
        """Slots starts[b] .. starts[b] + n - 1 of each row b (rows that read different groups)."""
        index = starts[:, None] + torch.arange(n, device=starts.device)
        if self.logits is not None:
            return self.logits.gather(1, index[..., None].expand(-1, -1, self.logits.shape[-1]))
        if self.where is not None and bool((self.where[index] >= 0).all()):
            return self.cached.gather(1, self.where[index][..., None].expand(-1, -1, self.cached.shape[-1]))
        self.head_rows += n
        return self.head(self.hidden.gather(1, index[..., None].expand(-1, -1, self.hidden.shape[-1])))

    def head(self, hidden):
        with record_function("tidar.lm_head"):
            logits = self.model.get_output_embeddings()(hidden)
            cap = getattr(self.model.config, SOFTCAP, None)
            return torch.tanh(logits / cap) * cap if cap else logits


def forward(model, cache, tokens, positions, mask, read: list[int] | None = None) -> Output:
    """read: the slots whose logits the step may read, computed in one vocabulary-head call."""
    with record_function("tidar.forward"):
        if head_is_plain(model):
            body = model.get_decoder()  # final norm included: its last_hidden_state is what lm_head reads
            out = body(input_ids=tokens, position_ids=positions, attention_mask=mask, **cache_kwargs(body, cache))
            return Output(model, hidden=out.last_hidden_state, read=read)
        out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, **cache_kwargs(model, cache))
        result = Output(model, logits=out.logits)
        result.head_rows = tokens.shape[1]
        return result


# --------------------------------------------------------------------------------------------
# The step plan.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """Which query slots one forward runs: `n_drafts` causal drafts (a chain), then one causal slot per
    branch (greedy, batch 1: `branches[i]` is the parent slot of slot n_drafts + i, an earlier slot;
    each sees its ancestors and itself, a tree), then a group of `k` masks at each anchor. A group
    anchored at j sees causal slot j - 1 and its ancestors and predicts the k positions after them:
    on the chain, anchor j sees drafts[0..j)."""

    n_drafts: int
    anchors: tuple[int, ...]
    k: int
    branches: tuple[int, ...] = ()

    @property
    def siblings(self) -> int:
        return len(self.branches)

    @property
    def causal(self) -> int:
        return self.n_drafts + len(self.branches)

    @property
    def slots(self) -> int:
        return self.causal + len(self.anchors) * self.k

    def parents(self) -> tuple[int, ...] | None:
        """The tree over the causal slots (layout.decode_mask_mod), None for a plain chain."""
        if not self.branches:
            return None
        return (-1, *range(self.n_drafts - 1), *self.branches)

    def group_start(self, j: int) -> int | None:
        """Query index of the group anchored at j, None if the plan has none there."""
        return self.causal + self.anchors.index(j) * self.k if j in self.anchors else None

    def positions(self, start: torch.Tensor) -> torch.Tensor:
        return decode_position_ids(start, self.causal, self.k, len(self.anchors), self.anchors, self.parents())

    def read(self) -> list[int]:
        """Slots whose logits a step may read: the AR rows, and each group's draft slots (1..k-1)."""
        return list(range(self.causal)) + [self.causal + g * self.k + o for g in range(len(self.anchors)) for o in range(1, self.k)]


class Planner:
    """Chooses how much of a draft a step verifies, and the anchors of its mask groups.

    cost      (default) the shape with the most expected tokens per measured second (`cheapest`,
              StepCosts): on a machine where extra slots cost, short or no drafts where they are
              unlikely to pay; where slots are free, everything likely. Which steps run depends on
              timings, so acceptance (T/NFE) varies from run to run; the tokens never do.
    full      a group at every acceptance length 1..m, as the paper's step (k + k*k slots for m = k).
    adaptive  groups only at the acceptance lengths likely to occur, from the draft's own confidence
              (diffusion: the draft head's probability; lookup: the chance by match length and depth): the most
              likely lengths first, each with chance >= min_chance (default 1 / slot budget: 5 % at
              the default 20 slots), within the slot budget.
    A length without a group is still decoded exactly: the next draft then comes from lookup or,
    with none, the next step drafts nothing and runs a fresh group.

    adaptive also sets the draft length (trim): proposals the step reaches with chance < min_chance
    are dropped before the forward. Any length >= 2 is exact; each dropped proposal is one query
    slot less through every layer, and one group anchor fewer. On this repo's CPU in fp32, past the
    first few slots one more costs 1/30 to 1/20 of an AR step (1 slot 60 ms, 4 slots 86 ms, 8 slots
    96 ms), so a proposal pays for its slot from a chance of about that much; on a GPU slots are
    nearly free, and a wide budget (say 96) with its lower min_chance keeps rarer nodes and groups."""

    def __init__(self, k: int, mode: str = "cost", slot_budget: int | None = None, min_chance: float | None = None, costs: "StepCosts | None" = None, siblings: int = 0):
        if mode not in PLANS:
            raise ValueError(f"plan={mode!r}: choose 'cost', 'adaptive' or 'full'.")
        if slot_budget is not None and slot_budget < 1 + k:
            raise ValueError(f"slot_budget={slot_budget}: a step needs at least 1 + block_size = {1 + k} query slots.")
        if siblings < 0:
            raise ValueError(f"siblings={siblings}: the alternatives to each drafted token a step may verify; use 0 (chains only) or more.")
        self.k, self.mode, self.siblings = k, mode, siblings
        self.costs = costs if costs is not None else StepCosts()
        self.group_gain = self.costs.group_gain
        self.offered: list | None = None  # per row of the last step: its draft's source where a group was computed at the length it accepted
        # Default: the paper's step (k + k*k), or room for a full lookup draft (10) + y + one group.
        self.budget = slot_budget if slot_budget is not None else max(k + k * k, 11 + k)
        # A slot's share of the budget: 5 % at the default 20 slots; a GPU's wide budget keeps rarer nodes.
        self.min_chance = min_chance if min_chance is not None else 1 / self.budget

    def step(self, draft: Draft, uses_groups: bool, room: int | None = None, per_row: bool = False) -> tuple[Draft, "StepPlan"]:
        """The draft as the step will verify it, and the step's plan."""
        if self.siblings and self.mode != "full" and not per_row and draft.siblings is not None and draft.tokens.shape[0] == 1 and draft.confidence is not None:
            return self.tree(draft, uses_groups, room)
        if self.mode == "cost" and (draft.confidence is not None or draft.tokens.shape[1] == 1):
            return self.cheapest(draft, uses_groups, room, per_row)
        draft = self.trim(draft, per_row)
        return draft, self.plan(draft, uses_groups, room, per_row)

    def cheapest(self, draft: Draft, uses_groups: bool, room: int | None, per_row: bool) -> tuple[Draft, "StepPlan"]:
        """plan='cost': of every (proposals kept, groups) within the budget, the step with the most
        expected tokens per measured second. Expected tokens: y, plus each kept proposal's chance of
        being accepted, plus for each group its length's chance times what a group is worth
        (`group_worth`). Groups go to the likeliest lengths first.
        Exact for any choice: which proposals are kept reads their confidence only."""
        k, m = self.k, draft.tokens.shape[1]
        worth = self.group_worth(draft)
        reach = reach_chances(draft)  # (B, m): P(row accepts >= j drafts), j = 1..m
        best = None
        for n in range(1, m + 1):  # drafts kept: draft 0 and n - 1 proposals
            r = reach[:, :n] if per_row else reach[:, :n].prod(0, keepdim=True)
            exact = r - torch.cat([r[:, 1:], r.new_zeros(r.shape[0], 1)], 1)  # P(accepts exactly j drafts), j = 1..n
            tokens, lengths = 1 + float(r[:, 1:].sum(1).mean()), exact.mean(0).tolist()
            fits = n if room is None else min(n, room - k + 1)
            order = sorted(range(max(fits, 0)), key=lambda i: -lengths[i]) if uses_groups else []
            most = min(len(order), max(0, (self.budget - n) // k))
            for g in range(most + 1):
                score = (tokens + worth * sum(lengths[i] for i in order[:g])) / self.costs.price(n + g * k, g > 0)
                if best is None or score > best[0]:
                    best = (score, n, tuple(sorted(i + 1 for i in order[:g])))
        _, n, anchors = best
        return cut(draft, n), StepPlan(n, anchors, k)

    def group_worth(self, draft: Draft) -> float:
        """What a group at the accepted length is worth, in tokens: the proposals a group draft gets
        accepted on average (`group_gain`, learned with the costs) less what verifying them will cost
        the next step (`verify_cost`), times the chance the next draft is taken from the group at all
        (`group_use`: a hybrid takes lookup drafts where they look better, and then the group was
        computed for nothing; learned per source of this step's draft, since lookup matches come in runs)."""
        use = self.costs.group_use
        share = sum(use[source_key(s)].value for s in draft.sources) / len(draft.sources)
        return share * max(0.0, self.group_gain.value - self.verify_cost())

    def tree(self, draft: Draft, uses_groups: bool, room: int | None) -> tuple[Draft, "StepPlan"]:
        """A step over the draft's tree (greedy, batch 1): the likeliest nodes (chain proposals and
        siblings, by the chance the step reaches them), then groups after the nodes where the step
        most likely ends, within the budget. plan='cost': the most expected tokens per measured
        second; 'adaptive': the most expected tokens, from nodes and ends with chance >= min_chance.
        Expected tokens: y, plus each node's reach, plus each group's end chance times what a group
        is worth. A parent is always reached at least as often as its child, so the likeliest nodes
        are a tree. Exact for any choice: which nodes are kept reads their chances only."""
        k, m, cost = self.k, draft.tokens.shape[1], self.mode == "cost"
        chances = draft.sibling_confidence[0].float().clamp(0, 1).tolist()
        parents = [-1, *range(m - 1), *draft.parents()]
        reach, depth = reach_chances(draft)[0].tolist() + [0.0] * len(chances), list(range(m)) + [0] * len(chances)
        for i, c in enumerate(chances):
            reach[m + i], depth[m + i] = reach[parents[m + i]] * c, depth[parents[m + i]] + 1
        order = sorted(range(1, len(reach)), key=lambda s: (-reach[s], depth[s], s))
        if not cost:
            order = [s for s in order if reach[s] >= self.min_chance]
        worth = self.group_worth(draft) if cost else self.group_gain.value
        deepest = None if room is None else room - k  # a group after a node at depth d uses offsets d + 1 .. d + k
        ends, tokens, best = {0: 1.0}, 1.0, None
        for t in range(min(len(order), self.budget - 1) + 1):  # the t likeliest nodes
            if t:
                s = order[t - 1]
                ends[s], tokens = reach[s], tokens + reach[s]
                ends[parents[s]] -= reach[s]
            where = sorted((s for s in ends if uses_groups and (deepest is None or depth[s] <= deepest)), key=lambda s: -ends[s])
            if not cost:
                where = where[:1] + [s for s in where[1:] if ends[s] >= self.min_chance]
            most = min(len(where), (self.budget - 1 - t) // k)
            for g in range(most + 1) if cost else (most,):
                value = tokens + worth * sum(max(0.0, ends[s]) for s in where[:g])
                score = value / self.costs.price(1 + t + g * k, g > 0) if cost else value
                if best is None or score > best[0]:
                    best = (score, t, where[:g])
        _, t, groups = best
        kept = set(order[:t])
        n = 1 + sum(1 for s in kept if s < m)  # chain nodes kept: a prefix of the chain
        off = sorted(s for s in kept if s >= m)  # siblings kept, parents first
        slot = {**{d: d for d in range(n)}, **{s: n + i for i, s in enumerate(off)}}
        branches = tuple(slot[parents[s]] for s in off)
        cut_draft = cut(draft, n)
        index = [s - m for s in off]
        cut_draft = replace(cut_draft, siblings=draft.siblings[:, index], sibling_confidence=draft.sibling_confidence[:, index], sibling_parents=branches)
        return cut_draft, StepPlan(n, tuple(sorted(slot[s] + 1 for s in groups)), k, branches)

    def verify_cost(self) -> float:
        """What verifying a group's draft costs the next step, in tokens: the time a step with
        proposals takes beyond a plain AR step's, over the AR step's (the tokens that time would have
        made). A group's proposals are worth only what they bring beyond it: on this repo's CPU a
        step of 2 to 4 slots costs 1.5x one of 1 slot, so a group must get more than half a proposal
        accepted to pay; where slots are free (a GPU) it costs nothing."""
        one = self.costs.price(1, False)
        verify = min(self.costs.price(n, False) for n in range(2, self.k + 1))
        return max(0.0, verify - one) / one

    def timed(self, plan: "StepPlan", seconds: float, draft: Draft, accepted: torch.Tensor, committed: torch.Tensor | None = None) -> None:
        """A step's time by its shape; the proposals accepted on rows drafted from a group; and whether
        the rows offered a group by the last step drafted from it. committed: (B,) the drafts each row
        commits, where the next draft reads its group (default: accepted)."""
        self.costs.add(plan.slots, plan.slots > plan.causal, seconds)
        self.group_gain.tick()
        for mean in self.costs.group_use.values():
            mean.tick()
        for b, source in enumerate(draft.sources):
            if source == "diffusion":
                self.group_gain.add(float(accepted[b]) - 1)
        if self.offered is not None and len(self.offered) == len(draft.sources):
            for was, source in zip(self.offered, draft.sources):
                if was is not None:
                    self.costs.group_use[was].add(float(source == "diffusion"))
        at = (accepted if committed is None else committed).tolist()
        self.offered = [source_key(s) if plan.group_start(int(j)) is not None else None for s, j in zip(draft.sources, at)]

    def max_proposals(self, uses_groups: bool) -> int:
        """Most proposals a draft may hold, leaving room for one group when the drafter uses them."""
        return self.budget - 1 - (self.k if uses_groups else 0)

    def trim(self, draft: Draft, per_row: bool = False) -> Draft:
        """The draft cut after its last proposal that the step reaches with chance >= min_chance
        (with a shared commit: every row reaches it; per row: some row does), at least one kept.
        Sampling stays exact for any cut: a draft decides how many tokens a step commits, never which
        (verify.Sampling)."""
        m = draft.tokens.shape[1]
        if self.mode == "full" or draft.confidence is None or m <= 2:
            return draft
        reach = reach_chances(draft)[:, 1:]  # (B, m - 1): P(the row accepts proposal i)
        reach = reach.max(0).values if per_row else reach.prod(0)
        keep = max(1, int((reach >= self.min_chance).sum()))  # reach only falls with i: a prefix
        return cut(draft, keep + 1)

    def plan(self, draft: Draft, uses_groups: bool, room: int | None = None, per_row: bool = False) -> StepPlan:
        """room: the largest position offset from draft 0 the model has (near max_position_embeddings
        a group that would not fit is left out; the last tokens are then drafted by lookup or none)."""
        m = draft.tokens.shape[1]
        fits = m if room is None else min(m, room - self.k + 1)  # a group at j uses offsets j .. j + k - 1
        if not uses_groups or fits < 1:
            return StepPlan(m, (), self.k)
        most = max(1, (self.budget - m) // self.k)
        if self.mode == "full" or draft.confidence is None or m == 1:
            return StepPlan(m, tuple(range(1, min(fits, most) + 1)), self.k)
        chance = accepted_length_chances(draft, per_row)[:fits]
        order = sorted(range(len(chance)), key=lambda i: -chance[i])
        picked = [order[0]] + [i for i in order[1:most] if chance[i] >= self.min_chance]
        return StepPlan(m, tuple(sorted(i + 1 for i in picked)), self.k)


PLANS = ("cost", "adaptive", "full")


def cut(draft: Draft, n: int) -> Draft:
    """The draft's first n tokens (draft 0 and n - 1 proposals)."""
    if n >= draft.tokens.shape[1]:
        return draft
    keep = lambda t: None if t is None else t[:, : n - 1]
    return replace(draft, tokens=draft.tokens[:, :n], length=draft.length.clamp(max=n),
                   confidence=keep(draft.confidence), raw_confidence=keep(draft.raw_confidence))


class Mean:
    """A mean over a prior worth one observation, that forgets: each step (`tick`) weighs what was seen
    by `forget`, so with nothing new it drifts back to the prior. A plan that stops running groups
    because they looked poor sees no more group drafts; without forgetting it would never try again."""

    def __init__(self, prior: float, forget: float = 0.99):
        self.prior, self.forget, self.total, self.count = prior, forget, 0.0, 0.0

    def add(self, x: float) -> None:
        self.total += x
        self.count += 1

    def tick(self) -> None:
        self.total *= self.forget
        self.count *= self.forget

    @property
    def value(self) -> float:
        return (self.prior + self.total) / (1 + self.count)


class StepCosts:
    """Wall time of a decoding step by its shape: (query slots, whether it runs mask groups). Kept on
    the model across generate() calls (`costs_of`), so it is learned once per model and machine.

    Measured, not modelled, because the shape of the curve is the machine's and the kernels': on this
    repo's 2-core CPU in fp32 with PyTorch's stock product a forward of 1 query slot took 68 ms, 2
    slots 110 ms, 3 slots 133 ms, but 4 to 6 slots 97 to 99 ms; with packed weights (kernels.py)
    1 to 5 slots cost about the same and 13 slots about 1.4x, since past ~8 rows the two cores'
    compute sets the price; mask-slot adapters (lora_scope='masks') add their own cost; on a GPU the
    curve is flat far beyond any step. A shape not yet measured twice is priced optimistically, so
    that each is tried and then known: as if time grew in proportion to slots from the measured shapes with more
    slots (the cheapest such line), or else at the dearest shape with fewer. Its first two times
    count by their minimum (one stall, say a garbage collection, must not price a shape out for good),
    then a moving average follows the cost as the context grows. A shape not run for `stale` steps is
    priced optimistically again and its next time counts by the minimum with the old one: a price
    that two stalls made too dear is retried, not kept for the model's lifetime."""

    def __init__(self, decay: float = 0.3, stale: int = 200):
        self.ms: dict[tuple[int, bool], float] = {}
        self.seen: dict[tuple[int, bool], int] = {}
        self.when: dict[tuple[int, bool], int] = {}  # step count at each shape's last time
        self.steps, self.decay, self.stale = 0, decay, stale
        # Proposals accepted when a step drafts from a mask group: what a group is worth, learned with
        # the costs and kept as long (a plan that rarely runs groups sees few, and a fresh estimate
        # every call would keep pricing them at the prior). And the chance a group computed at the
        # accepted length is drafted from, by the source of the draft of the step that computed it.
        self.group_gain = Mean(1.0)
        self.group_use = {source: Mean(1.0) for source in SOURCES}

    def add(self, slots: int, masked: bool, seconds: float) -> None:
        key, ms = (slots, masked), 1000 * seconds
        seen = 1 if self.is_stale(key) else self.seen.get(key, 0)
        self.steps += 1
        self.when[key] = self.steps
        self.ms[key] = ms if seen == 0 else min(self.ms[key], ms) if seen == 1 else (1 - self.decay) * self.ms[key] + self.decay * ms
        self.seen[key] = seen + 1

    def is_stale(self, key) -> bool:
        return key in self.when and self.steps - self.when[key] > self.stale

    def price(self, slots: int, masked: bool) -> float:
        key = (slots, masked)
        if self.seen.get(key, 0) >= 2 and not self.is_stale(key):
            return self.ms[key]
        guess = self.guess(slots, masked)
        return min(self.ms[key], guess) if key in self.ms else guess

    def guess(self, slots: int, masked: bool) -> float:
        """The optimistic price of a shape from the others."""
        same = {s: v for (s, m), v in self.ms.items() if m == masked and (s, m) != (slots, masked)}
        same = same or {s: v for (s, m), v in self.ms.items() if (s, m) != (slots, masked)}
        if not same:
            return 1.0
        larger = [v * slots / s for s, v in same.items() if s >= slots]
        return min(larger) if larger else max(same.values())


SOURCES = ("lookup", "diffusion", "none")


def source_key(source: str) -> str:
    return source if source in SOURCES else "none"


def costs_of(model, setting: tuple = ()) -> StepCosts:
    """The model's step-cost table for one setting (kernels, dtype, batch size...: whatever changes
    what a step shape costs), kept on the model across calls."""
    tables = model.__dict__.get("_tidar_step_costs")
    if tables is None:
        tables = {}
        object.__setattr__(model, "_tidar_step_costs", tables)
    return tables.setdefault(setting, StepCosts())


def accepted_length_chances(draft: Draft, per_row: bool = False) -> list[float]:
    """j = 1..m: with a shared commit, P(the batch commits j drafts) (the fewest any row accepted);
    per row, the expected share of rows that accept exactly j (each reads the group at its own j)."""
    reach = reach_chances(draft)
    if per_row:
        return (reach - torch.cat([reach[:, 1:], reach.new_zeros(reach.shape[0], 1)], 1)).mean(0).tolist()
    reach = reach.prod(0)
    return (reach - torch.cat([reach[1:], reach.new_zeros(1)])).tolist()


def reach_chances(draft: Draft) -> torch.Tensor:
    """(B, m): column j - 1 is P(the row accepts >= j drafts), draft 0 always; from draft.confidence,
    a row's acceptance stopping at its first miss and at its length."""
    m = draft.tokens.shape[1]
    if m == 1:
        return torch.ones(draft.tokens.shape[0], 1, device=draft.tokens.device)
    real = torch.arange(1, m, device=draft.tokens.device) < draft.length[:, None]
    c = (draft.confidence.float() * real).clamp(0, 1)
    return torch.cat([torch.ones_like(c[:, :1]), c.cumprod(1)], 1)


# --------------------------------------------------------------------------------------------
# The state, and the loop.
# --------------------------------------------------------------------------------------------


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
