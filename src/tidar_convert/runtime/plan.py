"""The step plan: which query slots one decoding forward runs (`StepPlan`), and how it is chosen
(`Planner`: cost, adaptive, full). Shipped in every export's custom_generate/ folder: imports
nothing but torch and its neighbours (drafters, layout, costs)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod

import torch

from .costs import StepCosts, source_key
from .drafters import Draft, as_list
from .layout import decode_position_ids
from .transfer import on_device


@dataclass(frozen=True)
class StepPlan:
    """Which query slots one forward runs: `n_drafts` causal drafts (a chain), then one causal slot
    per sibling (greedy, batch 1: `sibling_parents[i]` is the parent slot of slot n_drafts + i, an
    earlier slot; each sees its ancestors and itself, a tree), then a group of `k` masks at each
    anchor. A group anchored at j sees causal slot j - 1 and its ancestors and predicts the k
    positions after them: on the chain, anchor j sees drafts[0..j)."""

    n_drafts: int
    anchors: tuple[int, ...]
    k: int
    sibling_parents: tuple[int, ...] = ()

    @property
    def siblings(self) -> int:
        return len(self.sibling_parents)

    @property
    def causal(self) -> int:
        return self.n_drafts + len(self.sibling_parents)

    @property
    def slots(self) -> int:
        return self.causal + len(self.anchors) * self.k

    def parents(self) -> tuple[int, ...] | None:
        """The tree over the causal slots (layout.decode_mask_mod), None for a plain chain."""
        if not self.sibling_parents:
            return None
        return (-1, *range(self.n_drafts - 1), *self.sibling_parents)

    def group_start(self, j: int) -> int | None:
        """Query index of the group anchored at j, None if the plan has none there."""
        return self.causal + self.anchors.index(j) * self.k if j in self.anchors else None

    def group_read(self, j: int) -> tuple[int, int] | None:
        """Where a row that committed j drafts reads its next draft: (the query index its proposals
        follow, how many there are). The group anchored at j gives k - 1; else the nearest group
        anchored before j whose slots reach past j gives its later ones (fewer, drafted from a
        shorter prefix: still exact, every draft is verified). None where no group reaches."""
        g = self.group_start(j)
        if g is not None:
            return g, self.k - 1
        before = [a for a in self.anchors if a < j and j - a <= self.k - 2]
        if not before:
            return None
        a = max(before)
        return self.group_start(a) + j - a, self.k - 1 - (j - a)

    def positions(self, start: torch.Tensor) -> torch.Tensor:
        """(B, slots) each slot's position, after each row's `start` (B,)."""
        return start[:, None] + position_offsets(self, start.device)

    def read(self) -> list[int]:
        """Slots whose logits a step may read: the AR rows, and each group's draft slots
        (1..k-1)."""
        return list(range(self.causal)) + [
            self.causal + g * self.k + o for g in range(len(self.anchors)) for o in range(1, self.k)
        ]

    def read_index(self, device: torch.device) -> torch.Tensor:
        """read() on the device (forward.slots_of's index)."""
        return read_index(self, device)


@functools.lru_cache(maxsize=1024)
def read_index(plan: StepPlan, device: torch.device) -> torch.Tensor:
    """(rows,) plan.read() on the device, made once per plan shape: an index made from the list each
    step is a copy to the device, and on a GPU that copy waits for the forward queued before it
    (the head's rows are gathered right after the decoder body)."""
    return on_device(plan.read(), device)


@functools.lru_cache(maxsize=1024)
def position_offsets(plan: StepPlan, device: torch.device) -> torch.Tensor:
    """(slots,) the plan's positions after a start of 0: a plan's shape repeats from step to step,
    so its positions are built once (on the device), not with a dozen small kernels each step."""
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return decode_position_ids(
        zero, plan.causal, plan.k, len(plan.anchors), plan.anchors, plan.parents()
    )[0]


class Planner:
    """Chooses how much of a draft a step verifies, and the anchors of its mask groups.

    cost      (default) the shape with the most expected tokens per measured second (`cheapest`,
              StepCosts): on a machine where extra slots cost, short or no drafts where they are
              unlikely to pay; where slots are free, everything likely. Which steps run depends on
              timings, so acceptance (T/NFE) varies from run to run; the tokens never do.
    full      a group at every acceptance length 1..m, as the paper's step (k + k*k slots for
              m = k).
    adaptive  groups only at the acceptance lengths likely to occur, from the draft's own
              confidence (diffusion: the draft head's probability; lookup: the chance by match
              length and depth): the most likely lengths first, each with chance >= min_chance
              (default 1 / slot budget: 5 % at the default 20 slots), within the slot budget.
    A length without a group is still decoded exactly: the next draft then comes from lookup or,
    with none, the next step drafts nothing and runs a fresh group.

    adaptive also sets the draft length (trim): proposals the step reaches with chance < min_chance
    are dropped before the forward. Any length >= 2 is exact; each dropped proposal is one query
    slot less through every layer, and one group anchor fewer. A proposal pays for its slot from a
    chance of about what one more slot costs against an AR step (a few percent on a CPU's packed
    products: the bench's slot curve); on a GPU slots are nearly free, and a wide budget (say 96)
    with its lower min_chance keeps rarer nodes and groups."""

    def __init__(
        self,
        k: int,
        mode: str = "cost",
        slot_budget: int | None = None,
        min_chance: float | None = None,
        costs: "StepCosts | None" = None,
        siblings: int = 0,
    ):
        if mode not in PLANS:
            raise ValueError(f"plan={mode!r}: choose 'cost', 'adaptive' or 'full'.")
        if slot_budget is not None and slot_budget < 1 + k:
            raise ValueError(
                f"slot_budget={slot_budget}: "
                f"a step needs at least 1 + draft_length = {1 + k} query slots."
            )
        if siblings < 0:
            raise ValueError(
                f"siblings={siblings}: the alternatives to each drafted token a step may verify; "
                "use 0 (chains only) or more."
            )
        self.k, self.mode, self.siblings = k, mode, siblings
        self.costs = costs if costs is not None else StepCosts()
        self.group_gain = self.costs.group_gain
        # per row of the last step: its draft's source where a group was computed at the length it
        # accepted
        self.offered: list | None = None
        # Default: the paper's step (k + k*k), or room for a full lookup draft (10) + y + one group.
        self.budget = slot_budget if slot_budget is not None else max(k + k * k, 11 + k)
        # A slot's share of the budget: 5 % at the default 20 slots; a GPU's wide budget keeps rarer
        # nodes.
        self.min_chance = min_chance if min_chance is not None else 1 / self.budget

    def step(
        self, draft: Draft, uses_groups: bool, room: int | None = None, per_row: bool = False
    ) -> tuple[Draft, "StepPlan"]:
        """The draft as the step will verify it, and the step's plan."""
        if (
            self.siblings
            and self.mode != "full"
            and not per_row
            and draft.siblings is not None
            and draft.tokens.shape[0] == 1
            and draft.confidence is not None
        ):
            return self.tree(draft, uses_groups, room)
        if self.mode == "cost" and (draft.confidence is not None or draft.tokens.shape[1] == 1):
            return self.cheapest(draft, uses_groups, room, per_row)
        draft = self.trim(draft, per_row)
        return draft, self.plan(draft, uses_groups, room, per_row)

    def cheapest(
        self, draft: Draft, uses_groups: bool, room: int | None, per_row: bool
    ) -> tuple[Draft, "StepPlan"]:
        """plan='cost': of every (proposals kept, groups) within the budget, the step with the most
        expected tokens per measured second. Expected tokens: y, plus each kept proposal's chance of
        being accepted, plus for each group its length's chance times what a group is worth
        (`group_worth`). Groups go to the likeliest lengths first.
        Exact for any choice: which proposals are kept reads their confidence only."""
        k, m = self.k, draft.tokens.shape[1]
        plain, masked = self.costs.table(max(self.budget, m))
        worth = self.group_worth(draft, (plain, masked))
        at = batch_reach(draft, per_row)
        best = None
        for n in range(1, m + 1):  # drafts kept: draft 0 and n - 1 proposals
            # P(accepts exactly j drafts), j = 1..n, and the proposals accepted
            lengths = [at[j] - at[j + 1] for j in range(n - 1)] + [at[n - 1]]
            tokens = 1 + sum(at[1:n])
            score = tokens / plain[n]
            if best is None or score > best[0]:
                best = (score, n, 0, ())
            most = max(0, (self.budget - n) // k) if uses_groups else 0
            fits = n if room is None else min(n, room - k + 1)
            if not most or fits <= 0:
                continue
            # the likeliest lengths first, the shorter first among equals (a stable sort)
            order = sorted(range(fits), key=lengths.__getitem__, reverse=True)
            ended = 0.0  # the chance the step ends at a length of the first g groups
            for g in range(1, min(len(order), most) + 1):
                ended += lengths[order[g - 1]]
                score = (tokens + worth * ended) / masked[n + g * k]
                if score > best[0]:
                    best = (score, n, g, order)
        _, n, g, order = best
        return cut(draft, n), StepPlan(n, tuple(sorted(i + 1 for i in order[:g])), k)

    def group_worth(self, draft: Draft, prices=None) -> float:
        """What a group at the accepted length is worth, in tokens: the proposals a group draft gets
        accepted on average (`group_gain`, learned with the costs) less what verifying them will
        cost the next step (`verify_cost`), times the chance the next draft is taken from the group
        at all (`group_use`: a hybrid takes lookup drafts where they look better, and then the group
        was computed for nothing; learned per source of this step's draft, since lookup matches come
        in runs)."""
        use = self.costs.group_use
        share = sum(use[source_key(s)].value for s in draft.sources) / len(draft.sources)
        return share * max(0.0, self.group_gain.value - self.verify_cost(prices))

    def tree(self, draft: Draft, uses_groups: bool, room: int | None) -> tuple[Draft, "StepPlan"]:
        """A step over the draft's tree (greedy, batch 1): the likeliest nodes (chain proposals and
        siblings, by the chance the step reaches them), then groups after the nodes where the step
        most likely ends, within the budget. plan='cost': the most expected tokens per measured
        second; 'adaptive': the most expected tokens, from nodes and ends with chance >= min_chance.
        Expected tokens: y, plus each node's reach, plus each group's end chance times what a group
        is worth. A parent is always reached at least as often as its child, so the likeliest nodes
        are a tree. Exact for any choice: which nodes are kept reads their chances only."""
        k, m, cost = self.k, draft.tokens.shape[1], self.mode == "cost"
        chances = [min(max(c, 0.0), 1.0) for c in draft.host("sibling_confidence")[0]]
        parents = [-1, *range(m - 1), *draft.parents()]
        reach, depth = (
            reach_chances(draft)[0] + [0.0] * len(chances),
            list(range(m)) + [0] * len(chances),
        )
        for i, c in enumerate(chances):
            reach[m + i], depth[m + i] = reach[parents[m + i]] * c, depth[parents[m + i]] + 1
        order = sorted(range(1, len(reach)), key=lambda s: (-reach[s], depth[s], s))
        if not cost:
            order = [s for s in order if reach[s] >= self.min_chance]
        prices = self.costs.table(self.budget) if cost else None
        worth = self.group_worth(draft, prices) if cost else self.group_gain.value
        # a group after a node at depth d uses offsets d + 1 .. d + k
        deepest = None if room is None else room - k
        ends, tokens, best = {0: 1.0}, 1.0, None
        for t in range(min(len(order), self.budget - 1) + 1):  # the t likeliest nodes
            if t:
                s = order[t - 1]
                ends[s], tokens = reach[s], tokens + reach[s]
                ends[parents[s]] -= reach[s]
            # groups go after the nodes where the step likeliest ends (the earlier among equals:
            # a stable sort), where their slots fit
            most = (self.budget - 1 - t) // k if uses_groups else 0
            where = []
            if most:
                where = list(ends) if deepest is None else [s for s in ends if depth[s] <= deepest]
                where.sort(key=ends.__getitem__, reverse=True)
                if not cost:
                    where = where[:1] + [s for s in where[1:] if ends[s] >= self.min_chance]
                most = min(len(where), most)
            if cost:
                score = tokens / prices[0][1 + t]
                if best is None or score > best[0]:
                    best = (score, t, 0, where)
                ended = 0.0  # the chance the step ends at a node of the first g groups
                for g in range(1, most + 1):
                    ended += max(0.0, ends[where[g - 1]])
                    score = (tokens + worth * ended) / prices[1][1 + t + g * k]
                    if score > best[0]:
                        best = (score, t, g, where)
            else:
                value = tokens + worth * sum(max(0.0, ends[s]) for s in where[:most])
                if best is None or value > best[0]:
                    best = (value, t, most, where)
        _, t, g, where = best
        groups = where[:g]
        kept = set(order[:t])
        n = 1 + sum(1 for s in kept if s < m)  # chain nodes kept: a prefix of the chain
        off = sorted(s for s in kept if s >= m)  # siblings kept, parents first
        slot = {**{d: d for d in range(n)}, **{s: n + i for i, s in enumerate(off)}}
        sibling_parents = tuple(slot[parents[s]] for s in off)
        index = [s - m for s in off]
        siblings, odds = draft.host("siblings")[0], draft.host("sibling_confidence")[0]
        kept_siblings, kept_odds = [siblings[i] for i in index], [odds[i] for i in index]
        device = draft.tokens.device
        cut_draft = cut(
            draft,
            n,
            siblings=on_device([kept_siblings], device, draft.siblings.dtype),
            sibling_confidence=on_device([kept_odds], device, draft.sibling_confidence.dtype),
            sibling_parents=sibling_parents,
        )
        cut_draft.hold(siblings=[kept_siblings], sibling_confidence=[kept_odds])
        return cut_draft, StepPlan(
            n, tuple(sorted(slot[s] + 1 for s in groups)), k, sibling_parents
        )

    def verify_cost(self, prices=None) -> float:
        """What verifying a group's draft costs the next step, in tokens: the time a step with
        proposals takes beyond a plain AR step's, over the AR step's (the tokens that time would
        have made). A group's proposals are worth only what they bring beyond it: were a step of 2
        to 4 slots to cost 1.5x one of 1 slot, a group would need more than half a proposal accepted
        to pay; where slots are free (a GPU) it costs nothing."""
        unmasked = (prices or self.costs.table(self.k))[0]  # prices: StepCosts.table's
        one = unmasked[1]
        verify = min(unmasked[2 : self.k + 1])
        return max(0.0, verify - one) / one

    def timed(
        self,
        plan: "StepPlan",
        seconds: float,
        draft: Draft,
        accepted: torch.Tensor,
        committed: torch.Tensor | None = None,
    ) -> None:
        """A step's time by its shape; the proposals accepted on rows drafted from a group; and
        whether the rows offered a group by the last step drafted from it. committed: (B,) the
        drafts each row commits, where the next draft reads its group (default: accepted)."""
        self.costs.add(plan.slots, plan.slots > plan.causal, seconds)
        self.group_gain.tick()
        for mean in self.costs.group_use.values():
            mean.tick()
        accepted = as_list(accepted)
        for b, source in enumerate(draft.sources):
            if source == "diffusion":
                self.group_gain.add(float(accepted[b]) - 1)
        if self.offered is not None and len(self.offered) == len(draft.sources):
            for was, source in zip(self.offered, draft.sources):
                if was is not None:
                    self.costs.group_use[was].add(float(source == "diffusion"))
        at = accepted if committed is None else as_list(committed)
        # a tree reads only the group at its path's end
        offers = plan.group_start if plan.siblings else plan.group_read
        self.offered = [
            source_key(s) if offers(int(j)) is not None else None for s, j in zip(draft.sources, at)
        ]

    def max_proposals(self, uses_groups: bool) -> int:
        """Most proposals a draft may hold, leaving room for one group when the drafter uses
        them."""
        return self.budget - 1 - (self.k if uses_groups else 0)

    def trim(self, draft: Draft, per_row: bool = False) -> Draft:
        """The draft cut after its last proposal that the step reaches with chance >= min_chance
        (with a shared commit: every row reaches it; per row: some row does), at least one kept.
        Sampling stays exact for any cut: a draft decides how many tokens a step commits, never
        which (verify.Sampling)."""
        m = draft.tokens.shape[1]
        if self.mode == "full" or draft.confidence is None or m <= 2:
            return draft
        # P(the row accepts proposal i), i = 1..m - 1, over the rows
        columns = list(zip(*reach_chances(draft)))[1:]
        reach = [max(c) for c in columns] if per_row else [prod(c) for c in columns]
        keep = max(1, sum(r >= self.min_chance for r in reach))  # reach only falls with i: a prefix
        return cut(draft, keep + 1)

    def plan(
        self, draft: Draft, uses_groups: bool, room: int | None = None, per_row: bool = False
    ) -> StepPlan:
        """room: the largest position offset from draft 0 the model has (near
        max_position_embeddings a group that would not fit is left out; the last tokens are then
        drafted by lookup or none)."""
        m = draft.tokens.shape[1]
        # a group at j uses offsets j .. j + k - 1
        fits = m if room is None else min(m, room - self.k + 1)
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


def cut(draft: Draft, n: int, **changes) -> Draft:
    """The draft's first n tokens (draft 0 and n - 1 proposals), with `changes` to other fields
    (Draft.replace's)."""
    if n >= draft.tokens.shape[1]:
        return draft.replace(**changes) if changes else draft

    def keep(t):
        return None if t is None else t[:, : n - 1]

    short = draft.replace(
        tokens=draft.tokens[:, :n],
        length=draft.length.clamp(max=n),
        confidence=keep(draft.confidence),
        raw_confidence=keep(draft.raw_confidence),
        **changes,
    )
    # the host copies the draft has, cut alike
    for name, width in (("tokens", n), ("confidence", n - 1), ("raw_confidence", n - 1)):
        if draft.held(name) is not None:
            short.hold(**{name: [row[:width] for row in draft.held(name)]})
    if draft.held("length") is not None:
        short.hold(length=[min(x, n) for x in draft.held("length")])
    return short


def accepted_length_chances(draft: Draft, per_row: bool = False) -> list[float]:
    """j = 1..m: with a shared commit, P(the batch commits j drafts) (the fewest any row accepted);
    per row, the expected share of rows that accept exactly j (each reads the group at its own
    j)."""
    at = batch_reach(draft, per_row)
    return [a - b for a, b in zip(at, at[1:] + [0.0])]


def batch_reach(draft: Draft, per_row: bool) -> list[float]:
    """j = 1..m: the batch's chance of reaching j drafts (reach_chances over the rows). Per row,
    the rows' mean (each row reads its group at its own length); with a shared commit, the
    product (the batch reaches j where every row does)."""
    columns = list(zip(*reach_chances(draft)))
    return [sum(c) / len(c) for c in columns] if per_row else [prod(c) for c in columns]


def reach_chances(draft: Draft) -> list[list[float]]:
    """Per row, P(the row accepts >= j drafts) for j = 1..m, draft 0 always: from draft.confidence,
    a row's acceptance stopping at its first miss and at its length. Host lists: the plan's
    arithmetic on a few dozen numbers."""
    m = draft.tokens.shape[1]
    if m == 1:
        return [[1.0] for _ in range(draft.tokens.shape[0])]
    rows = []
    for length, conf in zip(draft.host("length"), draft.host("confidence")):
        reach, p = [1.0], 1.0
        for i in range(m - 1):
            p *= min(max(conf[i], 0.0), 1.0) if i + 1 < length else 0.0
            reach.append(p)
        rows.append(reach)
    return rows
