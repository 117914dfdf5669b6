"""What a decoding step costs, measured by its shape (`StepCosts`), and the decayed means the
planner and drafters learn from (`Mean`). Shipped in every export's custom_generate/ folder:
standard library only."""

from __future__ import annotations

import bisect
import itertools
import math


class Mean:
    """A mean over a prior worth `weight` observations, that forgets: each step (`tick`) weighs what
    was seen by `forget`, so with nothing new it drifts back to the prior. A plan that stops running
    groups because they looked poor sees no more group drafts; without forgetting it would never try
    again."""

    def __init__(self, prior: float, forget: float = 0.99, weight: float = 1.0):
        self.prior, self.forget, self.weight, self.total, self.count = (
            prior,
            forget,
            weight,
            0.0,
            0.0,
        )

    def add(self, x: float) -> None:
        self.total += x
        self.count += 1

    def tick(self) -> None:
        self.total *= self.forget
        self.count *= self.forget

    @property
    def value(self) -> float:
        return (self.prior * self.weight + self.total) / (self.weight + self.count)


class StepCosts:
    """Wall time of a decoding step by its shape: (query slots, whether it runs mask groups). Kept
    in the model's decoding session across generate() calls (session.Session.step_costs), so it is
    learned once per model and machine.

    Measured, not modelled, because the shape of the curve is the machine's and the kernels': on
    PyTorch's stock CPU product it was not even monotonic (4 slots cheaper than 3), on packed
    weights (kernels.py) it is flat for a few slots and then rises as compute sets the price,
    mask-slot adapters (lora_scope='masks') add their own cost, and on a GPU it is flat far beyond
    any step (the bench's slot curves: bench/LOG.md). A shape not yet measured twice is priced
    optimistically, so that each is tried and then known: as if time grew in proportion to slots
    from the measured shapes with more slots (the cheapest such line), or else at the dearest shape
    with fewer. Its first two times count by their minimum (one stall, say a garbage collection,
    must not price a shape out for good), then a moving average follows the cost as the context
    grows. A shape not run for `stale` steps is priced optimistically again and its next time counts
    by the minimum with the old one: a price that two stalls made too dear is retried, not kept for
    the model's lifetime."""

    def __init__(self, decay: float = 0.3, stale: int = 200):
        self.ms: dict[tuple[int, bool], float] = {}
        self.seen: dict[tuple[int, bool], int] = {}
        self.when: dict[tuple[int, bool], int] = {}  # step count at each shape's last time
        self.steps, self.decay, self.stale = 0, decay, stale
        # Proposals accepted when a step drafts from a mask group: what a group is worth, learned
        # with the costs and kept as long (a plan that rarely runs groups sees few, and a fresh
        # estimate every call would keep pricing them at the prior). And the chance a group computed
        # at the accepted length is drafted from, by the source of the draft of the step that
        # computed it.
        self.group_gain = Mean(1.0)
        self.group_use = {source: Mean(1.0) for source in SOURCES}
        self._table: tuple | None = None  # (steps, prices): `table`'s, until a time is added

    def add(self, slots: int, masked: bool, seconds: float) -> None:
        key, ms = (slots, masked), 1000 * seconds
        seen = 1 if self.is_stale(key) else self.seen.get(key, 0)
        self.steps += 1
        self.when[key] = self.steps
        self.ms[key] = (
            ms
            if seen == 0
            else min(self.ms[key], ms)
            if seen == 1
            else (1 - self.decay) * self.ms[key] + self.decay * ms
        )
        self.seen[key] = seen + 1

    def is_stale(self, key) -> bool:
        return key in self.when and self.steps - self.when[key] > self.stale

    def price(self, slots: int, masked: bool) -> float:
        return self.table(slots)[masked][slots]

    def table(self, most: int) -> tuple[list[float], list[float]]:
        """price(slots, masked) of every shape up to at least `most` slots, as [masked][slots]
        (slots 0 is unused): a plan's search reads a few dozen prices many times, and they change
        only when a time is added (the step count, and so staleness, moves with it)."""
        kept = self._table
        if kept is None or kept[0] != self.steps or len(kept[1][0]) <= most:
            shapes = ([], [])  # (slots, ms) of each kind, unmasked and masked, sorted by slots
            for (slots, masked), ms in self.ms.items():
                shapes[masked].append((slots, ms))
            shapes[0].sort()
            shapes[1].sort()
            prices = (self._prices(False, most, *shapes), self._prices(True, most, *shapes[::-1]))
            self._table = kept = (self.steps, prices)
        return kept[1]

    def _prices(self, masked: bool, most: int, own: list, other: list) -> list[float]:
        """[0.0, price(1, masked), ..., price(most, masked)]. A shape measured twice, and not
        stale, costs its time; another is guessed (no dearer than its one time, if it has one) from
        the other shapes of its kind (or, with none, of the other kind): as if time grew in
        proportion to slots from a larger shape, on the cheapest such line, else at the dearest
        smaller shape. In one pass, by suffix minima over the shapes sorted by slots: a table is
        made each step, and a guess per shape that scanned every shape cost more than the plan's
        search (bench/LOG.md, 2026-12-07, twelfth session). own, other: the (slots, ms) of the
        shapes of its kind and of the other kind, sorted."""
        own_slots, own_ms = [s for s, _ in own], [ms for _, ms in own]
        other_slots = [s for s, _ in other]
        own_line, other_line = _cheapest_lines(own), _cheapest_lines(other)
        dearest_below = list(itertools.accumulate(own_ms, max, initial=0.0))
        other_dearest = max([ms for _, ms in other], default=None)
        seen, when, known, oldest = self.seen, self.when, self.ms, self.steps - self.stale
        prices = [0.0]
        for slots in range(1, most + 1):
            key = (slots, masked)
            measured = key in known
            if measured and seen[key] >= 2 and when[key] >= oldest:  # not is_stale(key)
                prices.append(known[key])
                continue
            above = bisect.bisect_right(own_slots, slots)  # own shapes with more slots
            if len(own) > measured:  # its kind's other shapes
                line = own_line[above]
                guess = line * slots if line < math.inf else dearest_below[above - measured]
            elif other:
                line = other_line[bisect.bisect_left(other_slots, slots)]
                guess = line * slots if line < math.inf else other_dearest
            else:
                guess = 1.0  # nothing measured: every shape alike
            prices.append(min(known[key], guess) if measured else guess)
        return prices


def _cheapest_lines(shapes: list[tuple[int, float]]) -> list[float]:
    """[i]: the least ms per slot among shapes[i:] (inf past the end); shapes sorted by slots."""
    lines = [math.inf] * (len(shapes) + 1)
    for i in range(len(shapes) - 1, -1, -1):
        slots, ms = shapes[i]
        lines[i] = min(lines[i + 1], ms / slots)
    return lines


SOURCES = ("lookup", "diffusion", "none")


def source_key(source: str) -> str:
    return source if source in SOURCES else "none"
