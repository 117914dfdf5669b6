"""The decoding engine's parts: every drafter gives exactly AR's output, the step plan may skip any
group and stay exact, the vocabulary head reads only the rows used, and a new drafter is one class.

Sampling with every drafter is checked by the chi-square tests in test_decode.py."""

import random
from unittest.mock import patch

import pytest
import torch
from helpers import FAMILIES, ar, cycle_batch

from tidar_convert.runtime import drafters, engine, forward, tree
from tidar_convert.runtime.costs import StepCosts
from tidar_convert.runtime.drafters import DRAFTERS, Draft, DraftContext, LookupDrafter
from tidar_convert.runtime.generate import generate
from tidar_convert.runtime.plan import (
    Planner,
    StepPlan,
    accepted_length_chances,
    cut,
    reach_chances,
)
from tidar_convert.runtime.session import session_of


def padded_batch():
    """Two cycle rows (lookup and diffusion both draft well), one random row; left padding."""
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([cycle_batch(2, 12, seed=1), torch.randint(1, 300, (1, 12), generator=g)])
    mask = torch.ones_like(ids)
    for row, pad in enumerate([3, 0, 5]):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_every_k_equals_ar_greedy(trained, untrained, family):
    """Trained head (long acceptances) and untrained head (acceptance 1, groups unused), k = 2..8,
    a left-padded batch: each drafter's output is AR greedy's, token for token."""
    ids, mask = padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    for model in (trained[family][0], untrained[family]):
        expected = ar(model, ids, **kw)
        for name in DRAFTERS:
            for k in range(2, 9):
                got = generate(ids, model=model, draft_length=k, drafter=name, **kw)
                assert torch.equal(got, expected), (name, k)
    model = trained[family][0]
    # plan="adaptive": the cost plan's acceptance depends on step timings (its first call explores)
    generate(
        ids[:1],
        model=model,
        max_new_tokens=30,
        eos_token_id=None,
        drafter="diffusion",
        plan="adaptive",
    )
    assert (
        model.tidar_stats["tokens_per_nfe"] > 1.5
        and model.tidar_stats["draft_sources"]["diffusion"] > 0
    )


@pytest.mark.parametrize("drafter", ["lookup", "hybrid"])
def test_stops_exactly_at_eos_inside_an_accepted_lookup_draft(trained, drafter):
    model, _ = trained["llama"]
    ids = cycle_batch(1, 14, seed=3)  # two periods of the cycle: lookup matches from the first step
    # plan="full": the whole 10-token lookup draft (adaptive would trim the first one, made before
    # any lookup token was judged, to the proposals likely at its prior rate of 1/2)
    full = generate(
        ids, model=model, max_new_tokens=12, eos_token_id=None, drafter=drafter, plan="full"
    )
    # the 6th new token: inside the first step's lookup draft (new tokens 2..11)
    eos = full[0, 14 + 5].item()
    expected = ar(model, ids, max_new_tokens=12, eos_token_id=eos)
    got = generate(
        ids, model=model, max_new_tokens=12, eos_token_id=eos, drafter=drafter, plan="full"
    )
    assert torch.equal(got, expected) and got.shape[1] == 14 + 6
    stats = model.tidar_stats
    if drafter == "lookup":  # hybrid may draft with the (trained, confident) diffusion head first
        assert (
            stats["nfe"] == 2
            and stats["accepted"][0] >= 6
            and stats["draft_sources"]["lookup"] == 1
        )


def test_a_plan_without_a_group_at_the_accepted_length_stays_exact(trained, untrained, monkeypatch):
    """Groups only at the draft's full length: with an untrained head (acceptance 1) no step has a
    group where it lands, so the next draft comes from lookup or from nothing (a fresh group)."""
    monkeypatch.setattr(
        Planner,
        "plan",
        lambda self, draft, uses_groups, *rest, **kw: StepPlan(
            draft.tokens.shape[1], (draft.tokens.shape[1],), self.k
        ),
    )
    ids, mask = padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    for model in (untrained["qwen2"], trained["qwen2"][0]):
        expected = ar(model, ids, **kw)
        for name in ("diffusion", "hybrid"):
            assert torch.equal(generate(ids, model=model, drafter=name, **kw), expected), name
    generate(ids, model=untrained["qwen2"], drafter="diffusion", **kw)
    # steps that had no draft, and still exact
    assert untrained["qwen2"].tidar_stats["draft_sources"]["none"] > 0


def test_adaptive_plan_runs_fewer_slots_and_stays_exact(untrained):
    model = untrained["llama"]
    ids = torch.randint(1, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    expected = ar(model, ids, max_new_tokens=24, eos_token_id=None)
    slots = {}
    for plan in ("full", "adaptive"):
        assert torch.equal(
            generate(
                ids,
                model=model,
                max_new_tokens=24,
                eos_token_id=None,
                drafter="diffusion",
                plan=plan,
            ),
            expected,
        )
        slots[plan] = model.tidar_stats["slots_per_step"]
    assert slots["adaptive"] < 10 < slots["full"]  # untrained: only the group at length 1 is likely
    assert torch.equal(
        generate(ids, model=model, max_new_tokens=24, eos_token_id=None, slot_budget=6), expected
    )
    assert model.tidar_stats["slots_per_step"] <= 6 + 1e-9
    with pytest.raises(ValueError, match="slot_budget=3"):
        generate(ids, model=model, max_new_tokens=4, slot_budget=3)
    with pytest.raises(ValueError, match="plan='wide'"):
        generate(ids, model=model, max_new_tokens=4, plan="wide")


def test_trim_keeps_the_proposals_a_step_is_likely_to_reach():
    tokens = torch.arange(10).reshape(2, 5)
    conf = torch.tensor([[0.9, 0.5, 0.1, 0.9], [0.9, 0.9, 0.9, 0.9]])
    draft = Draft(tokens, confidence=conf, raw_confidence=conf / 2, sources=["diffusion"] * 2)
    planner = Planner(4, "adaptive", min_chance=0.05)
    # row 0 reaches 0.9, 0.45, 0.045: the batch commits at most 2 proposals there
    shared = planner.trim(draft)
    assert torch.equal(shared.tokens, tokens[:, :3]) and shared.length.tolist() == [3, 3]
    assert torch.equal(shared.confidence, conf[:, :2]) and torch.equal(
        shared.raw_confidence, conf[:, :2] / 2
    )
    assert planner.trim(draft, per_row=True) is draft  # row 1 reaches all four on its own
    # one proposal at least
    assert planner.trim(Draft(tokens, confidence=torch.full((2, 4), 0.01))).tokens.shape[1] == 2
    assert Planner(4, "full").trim(draft) is draft  # the paper's step drafts all of them


def test_a_drafts_host_copies_follow_its_tensors():
    """The plan reads a draft's numbers as Python lists, each read once or handed over by the
    drafter that built the tensor from it; a new tensor drops the old copy, and a cut cuts both."""
    draft = Draft(torch.tensor([[1, 2, 3]]), confidence=torch.tensor([[0.5, 0.25]]))
    assert draft.host("length") == [3] and draft.host("confidence") == [[0.5, 0.25]]
    draft.confidence = torch.tensor([[0.75, 0.5]])
    assert draft.host("confidence") == [[0.75, 0.5]] and draft.host("siblings") is None
    short = cut(draft.hold(tokens=[[1, 2, 3]]), 2)
    assert short.host("tokens") == [[1, 2]] and short.host("confidence") == [[0.75]]
    assert short.host("length") == [2] and short.length.tolist() == [2]
    # a cut reads nothing: it cuts the copies the draft holds, and only those
    unread = Draft(torch.tensor([[1, 2, 3]]), confidence=torch.tensor([[0.5, 0.25]]))
    assert unread.held("confidence") is None and unread.held("length") == [3]
    short = cut(unread, 2)
    assert short.held("confidence") is None and short.held("length") == [2]
    assert short.host("confidence") == [[0.5]]


def test_the_plans_host_arithmetic_is_the_tensor_arithmetic():
    """reach_chances and accepted_length_chances on Python floats give what the tensor formulas
    gave (a row's acceptance stops at its first miss and at its length), per row and shared."""
    g = torch.Generator().manual_seed(0)
    for B, m in [(1, 1), (1, 5), (3, 6), (4, 2)]:
        conf = torch.rand(B, m - 1, generator=g) * 1.2 - 0.1  # clamped to 0..1
        length = torch.randint(1, m + 1, (B,), generator=g)
        draft = Draft(torch.zeros(B, m, dtype=torch.long), length, conf)
        real = torch.arange(1, m) < length[:, None]
        c = (conf * real).clamp(0, 1)
        reach = torch.cat([torch.ones(B, 1), c.cumprod(1)], 1)
        assert torch.allclose(torch.tensor(reach_chances(draft)), reach)
        exact = reach - torch.cat([reach[:, 1:], torch.zeros(B, 1)], 1)
        shared = reach.prod(0)
        shared = shared - torch.cat([shared[1:], torch.zeros(1)])
        assert torch.allclose(torch.tensor(accepted_length_chances(draft, True)), exact.mean(0))
        assert torch.allclose(torch.tensor(accepted_length_chances(draft)), shared)


def costs(table: dict) -> StepCosts:
    """Step costs as if each shape had been measured twice at that time (twice: known, not
    guessed)."""
    c = StepCosts()
    for (slots, masked), ms in table.items():
        c.add(slots, masked, ms / 1000)
        c.add(slots, masked, ms / 1000)
    return c


def test_step_costs_price_unmeasured_shapes_optimistically():
    c = costs({(4, False): 100, (12, False): 120, (8, True): 200})
    assert c.price(4, False) == 100 and c.price(8, True) == 200
    # in proportion, from the cheapest line through a larger shape: 120 x 2 / 12
    assert c.price(2, False) == 20
    assert c.price(10, False) == 100  # 12 slots' 120 ms x 10 / 12 (4 slots' line is not above 10)
    assert c.price(20, False) == 120  # larger than any measured: the dearest smaller one
    assert c.price(4, True) == 100  # masked, smaller than 8: 200 x 4 / 8
    assert StepCosts().price(7, True) == 1.0  # nothing measured: every shape alike
    c.add(4, False, 0.2)  # a moving average follows the cost
    assert c.price(4, False) == pytest.approx(0.7 * 100 + 0.3 * 200)
    stall = StepCosts()
    stall.add(1, False, 0.06)
    stall.add(5, False, 0.5)  # a stall on the first try
    # once seen: no dearer than the guess from the others (1 slot: 60 ms)
    assert stall.price(5, False) == pytest.approx(60)
    stall.add(5, False, 0.1)
    assert stall.price(5, False) == pytest.approx(100)  # the first two count by their minimum
    stall.add(5, False, 0.5)
    assert stall.price(5, False) > 100
    stale = costs({(1, False): 60, (5, False): 500})  # two stalls: 5 slots priced out ...
    for _ in range(stale.stale + 1):
        stale.add(1, False, 0.06)
    # ... until not run for `stale` steps: guessed again (the dearest smaller shape)
    assert stale.price(5, False) == pytest.approx(60)
    stale.add(5, False, 0.1)
    assert stale.price(5, False) == pytest.approx(100)  # and its next time counts by the minimum


def test_step_costs_table_prices_each_shape_by_the_rule():
    """StepCosts.table computes every guess in one pass (suffix minima); here each shape's price
    by the rule read literally, over random measurements, repeats, stale shapes and both kinds."""

    def rule(c, slots, masked):
        key = (slots, masked)
        if c.seen.get(key, 0) >= 2 and not c.is_stale(key):
            return c.ms[key]
        same = {s: v for (s, m), v in c.ms.items() if m == masked and s != slots}
        same = same or {s: v for (s, m), v in c.ms.items() if (s, m) != key}
        larger = [v * slots / s for s, v in same.items() if s >= slots]
        guess = min(larger) if larger else max(same.values()) if same else 1.0
        return min(c.ms[key], guess) if key in c.ms else guess

    rng = random.Random(0)
    for trial in range(200):
        c = StepCosts(stale=rng.choice([3, 200]))
        for _ in range(rng.randrange(12)):
            c.add(rng.randrange(1, 14), rng.random() < 0.4, rng.uniform(0.01, 0.2))
        most = rng.randrange(1, 20)
        table = c.table(most)
        for slots in range(1, most + 1):
            for masked in (False, True):
                want = rule(c, slots, masked)
                assert table[masked][slots] == pytest.approx(want, rel=1e-12), (trial, slots)


def test_step_costs_table_is_price_until_a_time_is_added():
    """StepCosts.table: every shape's price, as the plan's search reads it, kept until the next time
    (which moves prices, and staleness with the step count)."""
    c = costs({(1, False): 60, (5, False): 500, (8, True): 200})

    def check(most):
        table = c.table(most)
        assert len(table[0]) > most and len(table[1]) > most
        for slots in range(1, most + 1):
            assert [table[0][slots], table[1][slots]] == [c.price(slots, m) for m in (False, True)]

    check(12)
    assert c.table(6) is c.table(12)  # a narrower search reads the same table
    c.add(3, False, 0.05)  # a new shape: the guesses beside it move
    check(12)
    for _ in range(c.stale + 1):  # 5 slots goes stale: guessed again
        c.add(1, False, 0.06)
    check(20)


def test_group_gain_forgets_back_to_its_prior():
    from tidar_convert.runtime.costs import Mean

    gain = Mean(1.0)
    for _ in range(20):
        gain.add(0.0)
    assert gain.value < 0.1
    for _ in range(500):  # steps without a group draft: nothing new is learned
        gain.tick()
    assert gain.value > 0.8


def test_cost_plan_takes_the_most_expected_tokens_per_second():
    tokens = torch.arange(5)[None]
    sure = Draft(tokens, confidence=torch.full((1, 4), 0.95), sources=["lookup"])
    doubtful = Draft(tokens, confidence=torch.full((1, 4), 0.2), sources=["lookup"])
    cpu = costs({(1, False): 60, (2, False): 110, (3, False): 130, (4, False): 95, (5, False): 97})
    flat = costs({(s, False): 60 for s in range(1, 6)})

    def take(costs, draft):
        return Planner(4, "cost", costs=costs).step(draft, uses_groups=False)[1].n_drafts

    assert take(flat, doubtful) == 5  # slots are free: verify everything
    # 1.25 expected tokens do not pay for 4 more slots: a plain AR step
    assert take(cpu, doubtful) == 1
    assert take(cpu, sure) == 5  # 4.4 do; and 2 or 3 slots are never worth more than 4
    masked = costs({(1, False): 60, (5, True): 70})
    draft, plan = Planner(4, "cost", costs=masked).step(Draft(tokens[:, :1]), uses_groups=True)
    # a group pays when its drafts are expected to (gain 1 a step)
    assert plan.anchors == (1,) and plan.slots == 5
    dear = costs({(1, False): 60, (5, True): 150})
    assert (
        Planner(4, "cost", costs=dear).step(Draft(tokens[:, :1]), uses_groups=True)[1].anchors == ()
    )
    planner = Planner(4, "cost", costs=masked)
    # a group draft: nothing accepted
    planner.timed(plan, 0.07, Draft(tokens, sources=["diffusion"]), torch.tensor([1]))
    # kept with the costs, across calls
    assert Planner(4, "cost", costs=masked).group_gain.value == pytest.approx(0.5)


def test_cost_plan_groups_the_shorter_of_equally_likely_lengths():
    """Groups go to the likeliest accepted lengths; among equally likely ones, the shorter first
    (the plan is a function of the chances, so two runs plan alike)."""
    # accepts exactly 1 or 2 drafts, each at 50 %; one group pays (6 slots cheap), two do not
    even = Draft(torch.tensor([[7, 8, 9]]), confidence=torch.tensor([[0.5, 0.0]]), sources=["x"])
    prices = {(s, False): 60 for s in range(1, 21)}
    prices |= {(s, True): 60 if s == 6 else 600 for s in range(1, 21)}
    draft, plan = Planner(4, "cost", costs=costs(prices)).step(even, uses_groups=True)
    assert (plan.n_drafts, plan.anchors) == (2, (1,))


def test_cost_plan_stops_paying_for_groups_the_next_draft_does_not_read():
    """A hybrid that keeps drafting by lookup after lookup steps never reads their groups: the plan
    learns that, per source, and drops groups there while keeping them after steps without
    a match."""
    masked = costs({(1, False): 60, (2, False): 62, (5, True): 70, (6, True): 72})
    planner = Planner(4, "cost", costs=masked)
    looked = Draft(torch.tensor([[7, 8]]), confidence=torch.tensor([[0.5]]), sources=["lookup"])
    alone = Draft(torch.tensor([[7]]), sources=["none"])
    assert planner.step(looked, uses_groups=True)[1].anchors  # unknown yet: groups are assumed read
    for _ in range(30):
        plan = StepPlan(2, (1, 2), 4)
        planner.timed(plan, 0.072, looked, torch.tensor([2]))  # a group at the accepted length ...
        # ... and the next draft is lookup's again
        planner.timed(StepPlan(2, (), 4), 0.062, looked, torch.tensor([2]))
    assert masked.group_use["lookup"].value < 0.1
    assert planner.step(looked, uses_groups=True)[1].anchors == ()
    # after a step without a match: still worth it
    assert planner.step(alone, uses_groups=True)[1].anchors == (1,)
    planner.timed(StepPlan(1, (1,), 4), 0.07, alone, torch.tensor([1]))
    planner.timed(
        StepPlan(4, (), 4),
        0.07,
        Draft(torch.arange(4)[None], sources=["diffusion"]),
        torch.tensor([2]),
    )
    use = masked.group_use["none"]
    # read once: counted as used
    assert use.count == pytest.approx(1.0) and use.total == pytest.approx(1.0)


def test_a_group_is_worth_what_its_drafts_bring_beyond_verifying_them():
    """A group's drafts are verified by the next step: where that step costs more than a plain AR
    step (as 2 to 4 slots do on this repo's CPU: bench/LOG.md, "the group's value"), proposals
    accepted must pay for it."""
    alone = Draft(torch.tensor([[7]]), sources=["none"])
    cpu = costs({(1, False): 60, (2, False): 100, (3, False): 120, (4, False): 95, (5, True): 70})
    flat = costs({(1, False): 60, (2, False): 60, (3, False): 60, (4, False): 60, (5, True): 70})
    for table in (cpu, flat):
        for _ in range(200):  # group drafts get half a proposal accepted
            table.group_gain.add(0.5)
    assert Planner(4, "cost", costs=cpu).verify_cost() == pytest.approx(35 / 60)
    # 0.5 < 0.58: not worth it
    assert Planner(4, "cost", costs=cpu).step(alone, uses_groups=True)[1].anchors == ()
    assert Planner(4, "cost", costs=flat).verify_cost() == 0
    # free to verify: worth 0.5
    assert Planner(4, "cost", costs=flat).step(alone, uses_groups=True)[1].anchors == (1,)


def test_cost_plan_is_exact_for_every_drafter(trained):
    """Greedy, shared commit and per-row acceptance: the cost plan's choices change the
    steps only."""
    model, _ = trained["qwen2"]
    ids, mask = padded_batch()
    kw = dict(max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    for name in DRAFTERS:
        assert torch.equal(
            generate(ids, model=model, attention_mask=mask, drafter=name, plan="cost", **kw),
            ar(model, ids, attention_mask=mask, **kw),
        ), name
        assert torch.equal(
            generate(ids[:1], model=model, drafter=name, plan="cost", **kw),
            ar(model, ids[:1], **kw),
        ), name


def test_lookup_chances_by_match_length_and_depth_learn_and_recover():
    """A proposal's chance reads the matched n-gram's length and its depth: from the priors, then
    what this call's text shows; one kind of match failing does not move another's; and a chance
    pushed low drifts back toward its prior while matches are found but not verified (else a plan
    that stopped verifying them would never try again)."""
    lookup = LookupDrafter()
    # longer matches are surer
    assert lookup.chance(1, 0) < lookup.chance(2, 0) < lookup.chance(3, 0) == lookup.chance(7, 0)
    # acceptance comes in runs
    assert lookup.chance(1, 0) < lookup.chance(1, 1) < lookup.chance(1, 9)
    seqs = torch.tensor([[5, 6, 7, 8, 9, 1, 7]])  # unigram match: 7 -> 8, 9, 1, 7
    ctx = DraftContext(seqs, torch.ones_like(seqs, dtype=torch.bool), 4, None, None)
    draft = lookup.propose(ctx)
    assert lookup.ngram == [1] and draft.tokens.tolist() == [[7, 8, 9, 1, 7]]
    assert draft.confidence[0].tolist() == pytest.approx([lookup.chance(1, d) for d in range(4)])
    bigram_before = lookup.chance(2, 0)
    for _ in range(20):  # verified up to 3 proposals, the first one rejected each time
        lookup.propose(ctx)
        lookup.observe(cut(draft, 4), torch.tensor([1]))
    assert lookup.chance(1, 0) < 0.1 and lookup.chance(2, 0) == bigram_before
    # never judged: the first miss ends the judging
    assert lookup.chance(1, 1) == pytest.approx(LookupDrafter.PRIORS[1][1])
    # all 3 accepted: depths 0, 1, 2 judged, accepted
    lookup.observe(cut(draft, 4), torch.tensor([4]))
    assert lookup.chance(1, 1) > LookupDrafter.PRIORS[1][1] and lookup.chance(
        1, 3
    ) == pytest.approx(LookupDrafter.PRIORS[1][3])
    low = lookup.chance(1, 0)
    for _ in range(150):  # matches found, never verified
        lookup.propose(ctx)
    assert low < 0.15 and lookup.chance(1, 0) > 0.2


def test_adaptive_draft_length_drafts_less_where_lookup_misses_and_stays_exact(untrained):
    """Random prompts, untrained model: lookup matches by chance and is rejected, so its running
    rate falls and adaptive drafts shrink (full keeps transformers' 10 tokens); outputs
    equal AR's."""
    model = untrained["llama"]
    # small vocabulary: many 2-gram hits
    ids = torch.randint(1, 40, (2, 24), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    expected = ar(model, ids, **kw)
    slots = {}
    for plan in ("full", "adaptive"):
        for rows in (ids, ids[:1]):  # shared commit and per-row acceptance
            assert torch.equal(
                generate(rows, model=model, drafter="lookup", plan=plan, **kw),
                expected[: rows.shape[0]],
            ), plan
        slots[plan] = model.tidar_stats["slots_per_step"]
    # lookup runs no groups: only trimming can lower it
    assert slots["adaptive"] < slots["full"], slots


def test_lm_head_on_read_rows_gives_the_tokens_of_full_logits(trained, monkeypatch):
    model, _ = trained["mistral"]
    ids, mask = padded_batch()
    kw = dict(
        attention_mask=mask, max_new_tokens=24, eos_token_id=None, pad_token_id=0, plan="full"
    )
    for name in DRAFTERS:
        read = generate(ids, model=model, drafter=name, **kw)
        rows, slots = (
            model.tidar_stats["lm_head_rows_per_step"],
            model.tidar_stats["slots_per_step"],
        )
        monkeypatch.setattr(forward, "READ_ROWS_ONLY", False)
        full = generate(ids, model=model, drafter=name, **kw)
        monkeypatch.setattr(forward, "READ_ROWS_ONLY", True)
        assert torch.equal(read, full), name
        assert model.tidar_stats["lm_head_rows_per_step"] == model.tidar_stats["slots_per_step"]
        if name != "lookup":  # lookup steps have no groups: every slot is an AR row, all read
            assert rows < slots, name
    # One vocabulary-head call a forward (its weight is read once, not again for the group
    # read later)
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        generate(ids, model=model, drafter="diffusion", **kw)
    finally:
        hook.remove()
    assert len(calls) == model.tidar_stats["nfe"]


def test_bad_drafter_is_refused_by_name(trained):
    model, _ = trained["llama"]
    with pytest.raises(
        ValueError, match=r"drafter='ngram': choose one of 'hybrid', 'diffusion', 'lookup'"
    ):
        generate(cycle_batch(1, 4, seed=0), model=model, max_new_tokens=4, drafter="ngram")


def test_hybrid_drafts_by_lookup_where_it_matches_until_diffusion_proves_better():
    """Lookup first where a row has a match (its runs pay more than its per-token rate says); once
    diffusion drafts have been accepted further on average, diffusion first. The choice reads past
    outcomes only."""
    hybrid = drafters.HybridDrafter()
    look = Draft(
        torch.tensor([[1, 7, 8], [1, 1, 1]]),
        length=torch.tensor([3, 1]),
        confidence=torch.full((2, 2), 0.5),
        sources=["lookup", "none"],
    )
    diff = Draft(
        torch.tensor([[1, 9, 9], [1, 9, 9]]),
        confidence=torch.full((2, 2), 0.5),
        sources=["diffusion", "diffusion"],
    )
    # the row without a match drafts by diffusion
    assert hybrid.choose(look, diff) == [True, False]
    # lookup fails a few times: one bad stretch must not hand every step to diffusion
    for _ in range(3):
        hybrid.observe(
            Draft(
                torch.tensor([[1, 7, 8]]), confidence=torch.full((1, 2), 0.5), sources=["lookup"]
            ),
            torch.tensor([1]),
        )
        hybrid.observe(
            Draft(
                torch.tensor([[1, 9, 9]]), confidence=torch.full((1, 2), 0.5), sources=["diffusion"]
            ),
            torch.tensor([1]),
        )
    assert hybrid.choose(look, diff) == [True, False]
    for _ in range(40):  # diffusion drafts accepted whole, lookup's not at all
        hybrid.observe(
            Draft(
                torch.tensor([[1, 9, 9]]), confidence=torch.full((1, 2), 0.5), sources=["diffusion"]
            ),
            torch.tensor([3]),
        )
        hybrid.observe(
            Draft(
                torch.tensor([[1, 7, 8]]), confidence=torch.full((1, 2), 0.5), sources=["lookup"]
            ),
            torch.tensor([1]),
        )
    assert hybrid.gain("diffusion") > 1.5 > 0.5 > hybrid.gain("lookup")
    assert hybrid.choose(look, diff) == [False, False]
    # lookup's chain misses, but the step commits 4 drafts down one of its branches
    for _ in range(100):
        hybrid.lookup.ngram = [1]  # as if its propose had matched a unigram
        hybrid.observe(
            Draft(
                torch.tensor([[1, 7, 8]]), confidence=torch.full((1, 2), 0.5), sources=["lookup"]
            ),
            torch.tensor([1]),
            torch.tensor([4]),
        )
    assert hybrid.gain("lookup") > hybrid.gain("diffusion") and hybrid.choose(look, diff) == [
        True,
        False,
    ]  # judged by what it brought
    # its chain's chances by the chain's own misses
    assert hybrid.lookup.chance(1, 0) < LookupDrafter().chance(1, 0)


def test_diffusion_chances_follow_the_acceptance_seen():
    """The plan reads the head's probability scaled by accepted over predicted so far (one of each
    to start), in the diffusion drafter itself: drafting by diffusion alone is calibrated too (its
    raw chance overstated sampled acceptance, bench/RESULTS.md §4), and hybrid drafts are scaled by
    the same drafter, counting only its own rows."""

    def draft(source="diffusion", confidence=(0.9, 0.8)):
        return Draft(
            torch.tensor([[1, 9, 9]]), confidence=torch.tensor([confidence]), sources=[source]
        )

    diffusion = drafters.DiffusionDrafter()
    # nothing seen yet
    assert torch.allclose(diffusion.calibrate(draft()).confidence, torch.tensor([[0.9, 0.8]]))
    # the first proposal judged and rejected each time: 9.0 predicted, none taken
    for _ in range(10):
        diffusion.observe(draft(), torch.tensor([1]))
    d = diffusion.calibrate(draft())
    assert torch.allclose(d.confidence, torch.tensor([[0.9, 0.8]]) / 10) and torch.equal(
        d.raw_confidence, torch.tensor([[0.9, 0.8]])
    )
    # then drafts of chance 0.5 accepted whole: 80 taken of 49 predicted, the chances capped at 1
    for _ in range(40):
        diffusion.observe(draft(confidence=(0.5, 0.5)), torch.tensor([3]))
    assert diffusion.calibrate(draft()).confidence.max() == 1.0
    hybrid = drafters.HybridDrafter()
    for _ in range(10):
        hybrid.observe(draft(), torch.tensor([1]))
        # lookup's rows do not move diffusion's scale
        hybrid.observe(draft("lookup"), torch.tensor([3]))
    assert torch.allclose(
        hybrid.diffusion.calibrate(draft()).confidence, torch.tensor([[0.9, 0.8]]) / 10
    )


def test_lookup_follows_transformers_prompt_lookup():
    """Longest n-gram first (max 2), its first occurrence, up to num_tokens; the n-gram itself
    excluded. The match's length comes with it (the proposals' chances read it)."""
    lk = LookupDrafter(num_tokens=3, max_ngram=2)
    t = torch.tensor

    def found(seq, limit):
        f = lk.match(t(seq), limit)
        return f[0].tolist(), f[1]

    assert found([5, 6, 7, 8, 9, 6, 7], 10) == ([8, 9, 6], 2)  # bigram (6, 7) at 1
    assert found([5, 6, 7, 8, 9, 1, 7], 10) == ([8, 9, 1], 1)  # no bigram: unigram 7 at 2
    assert found([1, 5, 1, 6, 1], 10) == ([5, 1, 6], 1)  # first occurrence
    # and where each occurrence's continuation starts (a tree's branches)
    assert lk.match(t([1, 5, 1, 6, 1]), 10)[2] == [1, 3]
    assert found([5, 6, 7, 8, 9, 6, 7], 1) == ([8], 2)  # capped
    assert lk.match(t([1, 2, 3]), 10) is None


def scan(seq: torch.Tensor, n: int) -> list[int]:
    """The lookup search before its index: every position of the text compared with the last n-gram
    (where the tokens after each earlier occurrence start)."""
    L = seq.shape[0]
    hits = (seq.unfold(0, n, 1)[: L - n] == seq[L - n :]).all(1).nonzero()
    return (hits[:, 0] + n).tolist()


def test_lookup_index_finds_what_a_scan_of_the_text_finds():
    """NGrams, grown in chunks of any size, gives every n the occurrences a scan of the text gives,
    first first, on texts of few and many token values."""
    g = torch.Generator().manual_seed(0)
    for trial in range(24):
        seq = torch.randint(0, (2, 3, 5, 40)[trial % 4], (50,), generator=g)
        text = drafters.NGrams(seq[:1].tolist(), 3)
        while len(text.tokens) < 50:
            L = min(50, len(text.tokens) + int(torch.randint(0, 4, (), generator=g)))
            text.extend(seq[len(text.tokens) : L].tolist())
            for n in range(1, min(3, L - 1) + 1):
                assert text.starts(n) == scan(seq[:L], n), (trial, L, n)


def commit(seqs, valid, tokens, counts, pad=0):
    """engine.commit's layout: row b appends tokens[b][:counts[b]], a column a round, and a row that
    does not advance in a round gets a pad on the left (invalid)."""
    for r in range(max(counts)):
        adv = torch.tensor([[c > r] for c in counts])
        column = torch.tensor([[t[r] if c > r else pad] for t, c in zip(tokens, counts)])
        seqs = torch.where(
            adv, torch.cat([seqs, column], 1), torch.cat([torch.full_like(column, pad), seqs], 1)
        )
        valid = torch.where(
            adv,
            torch.cat([valid, torch.ones_like(adv)], 1),
            torch.cat([torch.zeros_like(adv), valid], 1),
        )
    return seqs, valid


@pytest.mark.parametrize("batch", [1, 4])
def test_lookup_keeps_each_rows_text_through_commits_and_dropped_rows(batch):
    """The lookup drafter keeps each row's indexed text from call to call and reads only the columns
    a step committed. Through per-row commits (left pads), rows the engine drops and a text that
    does not follow on, its drafts are a fresh drafter's (which reads every row whole)."""
    g = torch.Generator().manual_seed(batch)
    rows = [torch.randint(1, 4, (int(n),), generator=g).tolist() for n in (7, 3, 5, 6)[:batch]]
    width = max(map(len, rows))
    seqs = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    lookup = LookupDrafter(num_tokens=4)

    def same(ctx):
        got, want = lookup.propose(ctx), LookupDrafter(num_tokens=4).propose(ctx)
        assert (got is None) == (want is None)
        if got is not None:
            for name in ("tokens", "length", "confidence"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
                # the host copy is what the tensor was made from
                assert torch.equal(torch.tensor(got.host(name)), getattr(want, name)), name
            assert got.sources == want.sources and lookup.ngram == [
                f[1] if f else 0 for f in (lookup.match(torch.tensor(r), 4) for r in rows)
            ]
        assert [t.tokens for t in lookup.rows] == rows

    committed = None  # the commit's host copy of what it appended (engine.commit_at_once)
    for step in range(24):
        same(DraftContext(seqs, valid, 4, None, None, committed=committed))
        counts = [int(torch.randint(1 if batch == 1 else 0, 4, (), generator=g)) for _ in rows]
        counts[0] = max(counts[0], 1)
        new = [torch.randint(1, 4, (c,), generator=g).tolist() for c in counts]
        seqs, valid = commit(seqs, valid, new, counts)
        rows = [r + t for r, t in zip(rows, new)]
        committed = new if step % 3 else None  # a commit one round at a time has none
        if batch > 1 and step in (9, 17):  # a row stops: the engine leaves it out
            keep = [b for b in range(len(rows)) if b != 1]
            seqs, valid, rows = seqs[keep], valid[keep], [rows[b] for b in keep]
            committed = None
    # a text whose column before the new ones is not a row's last token: read whole
    rows = [[9, 9, 8] * (seqs.shape[1] // 3 + 1) for _ in rows]
    same(
        DraftContext(
            torch.tensor(rows), torch.ones(len(rows), len(rows[0]), dtype=torch.bool), 4, None, None
        )
    )


def test_lookup_trees_hang_the_other_occurrences_where_they_leave_the_chain():
    """Bigram (5, 6) occurs at 1, 5 and 9 before the end. Chain: after the first, [2, 8, 5]. The
    latest, [3, 9, 5], leaves it at the first proposal (a branch under draft 0); the middle one,
    [3, 4, 5], walks down that branch through 3 and leaves it at 4 (a branch off a branch)."""
    seqs = torch.tensor([[1, 5, 6, 2, 8, 5, 6, 3, 4, 5, 6, 3, 9, 5, 6]])

    def ctx(siblings):
        return DraftContext(
            seqs, torch.ones_like(seqs, dtype=torch.bool), 3, None, None, siblings=siblings
        )

    lookup = LookupDrafter(num_tokens=3)
    draft = lookup.propose(ctx(3))
    assert draft.tokens.tolist() == [[6, 2, 8, 5]]
    assert draft.siblings.tolist() == [[3, 9, 5, 4, 5]] and draft.sibling_parents == (0, 4, 5, 4, 7)
    first, deeper = LookupDrafter.BRANCH_PRIORS[2][0][0], LookupDrafter.BRANCH_PRIORS[2][1][0]
    assert draft.sibling_confidence[0].tolist() == pytest.approx(
        [first, lookup.chance(2, 1), lookup.chance(2, 2), deeper, lookup.chance(2, 2)]
    )
    # one branch: the middle occurrence stops where it would branch
    assert lookup.propose(ctx(1)).siblings.tolist() == [[3, 9, 5]]
    lookup.SCAN = 1  # a frequent n-gram's thousands of occurrences: only the latest few are read
    assert lookup.propose(ctx(3)).siblings.tolist() == [[3, 9, 5]]
    del lookup.SCAN
    # no tree where the step verifies chains only (sampling, batches)
    assert lookup.propose(ctx(0)).siblings is None
    d, plan = Planner(4, "adaptive", slot_budget=40, siblings=3).step(draft, uses_groups=False)
    # every node kept, as a tree
    assert plan.parents() == (-1, 0, 1, 2, 0, 4, 5, 4, 7) and plan.anchors == ()

    # hybrid: the diffusion draft's alternatives to the first proposal join under draft 0, but for
    # tokens the lookup tree has there already (3, from the latest occurrence)
    from tidar_convert.runtime.tree import beside

    tree = beside(draft, [[3, 7]], [[0.2, 0.1]])
    assert tree.siblings.tolist() == [[3, 9, 5, 4, 5, 7]] and tree.sibling_parents == (
        0,
        4,
        5,
        4,
        7,
        0,
    )
    assert tree.sibling_confidence[0, -1].item() == pytest.approx(0.1)


def test_lookup_trees_commit_a_later_occurrence_where_the_first_misleads(trained):
    """The trained tiny model continues the cycle 3..9. The prompt first shows (6, 7) followed by a
    decoy (1, 2, 1, 2), then the cycle, and ends at 6: the first step's lookup chain (after the
    first occurrence of (6, y = 7)) is wrong, the latest occurrence right. The tree takes the
    branch, and the output is AR's."""
    model, _ = trained["llama"]
    ids = torch.tensor([[6, 7, 1, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6]])
    expected = ar(model, ids, max_new_tokens=24, eos_token_id=None)
    assert expected[0, 17:20].tolist() == [7, 8, 9]  # the model follows the cycle
    for name in ("lookup", "hybrid"):
        session_of(model).costs.clear()
        got = generate(
            ids,
            model=model,
            max_new_tokens=24,
            eos_token_id=None,
            drafter=name,
            plan="adaptive",
            slot_budget=40,
        )
        assert torch.equal(got, expected), name
        if name == "lookup":
            assert model.tidar_stats["sibling_steps"] > 0
    session_of(model).costs.clear()
    generate(
        ids,
        model=model,
        max_new_tokens=24,
        eos_token_id=None,
        drafter="lookup",
        plan="adaptive",
        slot_budget=40,
        siblings=0,
    )
    assert model.tidar_stats["sibling_steps"] == 0


def test_a_new_drafter_is_one_class(untrained, monkeypatch):
    """A deterministic drafter that always proposes "the last token, three more times": exact, no
    engine change, and the plan groups it like any other."""

    class Repeat(drafters.Drafter):
        name, uses_groups = "repeat", True

        def propose(self, ctx: DraftContext):
            return Draft(
                ctx.y[:, None].repeat(1, 4),
                confidence=torch.full((ctx.y.shape[0], 3), 0.5),
                sources=["lookup"] * ctx.y.shape[0],
            )

    monkeypatch.setitem(drafters.DRAFTERS, "repeat", Repeat)
    model = untrained["qwen3"]
    ids = torch.tensor([[7, 7, 7, 7, 9]])
    expected = ar(model, ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(
        generate(ids, model=model, max_new_tokens=16, eos_token_id=None, drafter="repeat"), expected
    )
    assert model.tidar_stats["draft_sources"]["lookup"] == len(model.tidar_stats["accepted"])

    class Bare:  # the protocol's names, but not its optional hook: refused by name, before any step
        name, uses_groups, propose = "bare", False, Repeat.propose

    monkeypatch.setitem(drafters.DRAFTERS, "bare", Bare)
    with pytest.raises(
        TypeError, match="drafter 'bare' \\(Bare\\) lacks observe: subclass drafters.Drafter"
    ):
        generate(ids, model=model, max_new_tokens=4, drafter="bare")


def test_a_prompt_near_the_position_limit_still_decodes(untrained):
    """Near max_position_embeddings (1024 here) the steps draft less and drop the groups that would
    not fit, down to plain AR steps, instead of refusing (issue 8, item 6)."""
    model = untrained["llama"]
    g = torch.Generator().manual_seed(3)
    for P, n in ((1012, 12), (1021, 3)):
        ids = torch.randint(1, 300, (1, P), generator=g)
        ids[0, -40:] = ids[0, :40]  # a repeat, so lookup drafts too
        expected = ar(model, ids, max_new_tokens=n, eos_token_id=None)
        for name in DRAFTERS:
            assert torch.equal(
                generate(
                    ids,
                    model=model,
                    max_new_tokens=n,
                    eos_token_id=None,
                    drafter=name,
                    draft_length=8,
                ),
                expected,
            ), (P, name)
    with pytest.raises(ValueError, match="lower max_new_tokens to 3"):
        generate(ids, model=model, max_new_tokens=4)


def test_batch_rows_keep_what_each_accepted(trained, monkeypatch):
    """Rows that accept different numbers of drafts each get their own AR output, and each keeps at
    least 80% of the gain over AR (T/NFE - 1) it gets alone (issue 8, item 5)."""
    from tidar_convert.runtime.verify import Greedy

    seen, verify = [], Greedy.verify_tokens

    def spy(self, scores, draft):
        out = verify(self, scores, draft)
        seen.append(out[0])
        return out

    monkeypatch.setattr(Greedy, "verify_tokens", spy)
    model, _ = trained["llama"]
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([cycle_batch(2, 10, seed=2), torch.randint(1, 300, (2, 10), generator=g)])
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    kw = dict(max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    for name in DRAFTERS:
        alone = []
        for b in range(4):
            real = ids[b : b + 1, mask[b].bool()]
            # acceptance, not timing, decides the steps
            generate(real, model=model, drafter=name, plan="adaptive", **kw)
            alone.append(model.tidar_stats["tokens_per_nfe"])
        before = len(seen)
        got = generate(ids, model=model, attention_mask=mask, drafter=name, plan="adaptive", **kw)
        assert torch.equal(got, ar(model, ids, attention_mask=mask, **kw)), name
        rows = model.tidar_stats["tokens_per_nfe_per_row"]
        for b in range(4):
            assert rows[b] - 1 >= 0.8 * (alone[b] - 1) - 1e-9, (name, b, rows, alone)
        # rows did accept different counts
        assert any(len(set(a.tolist())) > 1 for a in seen[before:]), name
        assert min(rows) > 2, rows


def test_rows_that_stop_leave_the_batch_and_the_rest_write_what_they_would(
    trained, untrained, monkeypatch
):
    """Per-row commits: a row that stopped (its EOS, here at another step for each row) leaves every
    later forward, so the batch shrinks as rows finish; greedy output is AR's, and sampled output
    is what the same seed gives with every row kept (a returned dict keeps them all), so dropping a
    row changes no other row's draws."""
    from tidar_convert.runtime import forward as fwd

    model, _ = trained["llama"]
    ids = cycle_batch(3, 10, seed=4)
    eos = int(ids[0, 3])  # in the cycle: each row reaches it at its own phase
    batches = []
    real = fwd.forward
    monkeypatch.setattr(
        "tidar_convert.runtime.engine.forward",
        lambda m, cache, tokens, *a, **k: (
            batches.append(tokens.shape[0]) or real(m, cache, tokens, *a, **k)
        ),
    )
    kw = dict(
        model=model,
        max_new_tokens=24,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    for name in DRAFTERS:
        batches.clear()
        got = generate(ids, drafter=name, **kw)
        assert torch.equal(got, ar(model, ids, **{k: v for k, v in kw.items() if k != "model"})), (
            name
        )
        assert batches[0] == 3 and batches[-1] < 3 and batches == sorted(batches, reverse=True), (
            name,
            batches,
        )
    # sampled, on an untrained model (flat distributions: each draw matters): row 0 stops first (EOS
    # is its first sampled token), so the rows after it move up in the working batch
    model = untrained["llama"]
    kw = dict(
        model=model,
        max_new_tokens=24,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
    )
    torch.manual_seed(0)
    kw["eos_token_id"] = int(generate(ids, eos_token_id=None, **kw)[0, ids.shape[1]])
    batches.clear()
    torch.manual_seed(0)
    sampled = generate(ids, **kw)
    assert batches[-1] < 3 and sampled[0, ids.shape[1]] == kw["eos_token_id"]
    torch.manual_seed(0)
    every_row = generate(ids, return_dict_in_generate=True, **kw).sequences
    assert torch.equal(sampled, every_row)


def test_a_row_without_a_group_at_its_length_reads_an_earlier_one():
    """Anchors at 1 and 3, k = 4: a row that committed 2 reads the group at 1 from its second slot
    (2 proposals), 4 and 5 the group at 3 (2, then 1); 6 is past every group."""
    plan = StepPlan(5, (1, 3), 4)
    g1, g3 = plan.group_start(1), plan.group_start(3)
    assert [plan.group_read(j) for j in range(1, 7)] == [
        (g1, 3),
        (g1 + 1, 2),
        (g3, 3),
        (g3 + 1, 2),
        (g3 + 2, 1),
        None,
    ]
    assert StepPlan(3, (), 4).group_read(2) is None


def test_rows_draft_from_an_earlier_group_in_a_batch(trained, monkeypatch):
    """Per-row acceptance leaves rows at lengths the plan put no group at (9 slots: a 4-token draft
    and one group); a row past an earlier group's anchor drafts from its later slots instead of
    nothing, and the batch still writes AR's tokens."""
    model, _ = trained["llama"]
    read, reads = StepPlan.group_read, []

    def counting(self, j):
        # an earlier group's slots
        reads.append(self.group_start(j) is None and read(self, j) is not None)
        return read(self, j)

    monkeypatch.setattr(StepPlan, "group_read", counting)
    # the cycle, broken: drafts partly accepted
    broken = torch.tensor([[3, 9, 4, 8, 5, 5, 6, 7, 3, 4, 9]])
    ids = torch.cat(
        [
            cycle_batch(1, 11, seed=2),
            broken,
            torch.randint(1, 300, (1, 11), generator=torch.Generator().manual_seed(5)),
            cycle_batch(1, 11, seed=7),
        ]
    )
    kw = dict(max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    got = generate(ids, model=model, drafter="diffusion", plan="adaptive", slot_budget=9, **kw)
    assert torch.equal(got, ar(model, ids, **kw))
    assert sum(reads) > 0 and "tokens_per_nfe_per_row" in model.tidar_stats


def test_rows_share_one_commit_length_when_a_processor_reads_the_prefix(trained):
    """repetition_penalty reads each row's prefix: rows then commit the fewest drafts any
    accepted."""
    model, _ = trained["llama"]
    ids = torch.cat(
        [
            cycle_batch(1, 10, seed=2),
            torch.randint(1, 300, (1, 10), generator=torch.Generator().manual_seed(5)),
        ]
    )
    kw = dict(max_new_tokens=16, eos_token_id=None, pad_token_id=0, repetition_penalty=1.3)
    assert torch.equal(generate(ids, model=model, **kw), ar(model, ids, **kw))
    assert "tokens_per_nfe_per_row" not in model.tidar_stats


def sibling_prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 300, (1, 9), generator=g) for _ in range(3)]


@pytest.mark.parametrize("family", FAMILIES)
def test_siblings_commit_the_ar_token_where_draft_1_missed(trained, untrained, family):
    """Alternatives to each proposal verified beside the chain (a tree): greedy output stays AR's
    token for token, with every drafter and plan, and a branch is taken at some steps, off the chain
    below depth 1 at some of them."""
    taken, deep = 0, 0
    walk = engine.walk

    def spy(plan, *args):
        nonlocal deep
        path, *rest = walk(plan, *args)
        deep += any(s >= plan.n_drafts and plan.parents()[s] != 0 for s in path)
        return (path, *rest)

    for model in (trained[family][0], untrained[family]):
        for ids in sibling_prompts():
            expected = ar(model, ids, max_new_tokens=24, eos_token_id=None)
            for name in ("diffusion", "hybrid"):
                for plan in ("adaptive", "cost"):
                    # Fresh step-cost tables: what groups are worth is learned with them and kept on
                    # the model across calls, so the adaptive plan's trees would follow the cost
                    # plan's timings. With them fresh, its trees are the same every run, and with 96
                    # slots (rarer nodes kept) they branch below depth 1 on every family; the cost
                    # plan's follow timings.
                    session_of(model).costs.clear()
                    with patch.object(engine, "walk", spy):
                        got = generate(
                            ids,
                            model=model,
                            max_new_tokens=24,
                            eos_token_id=None,
                            drafter=name,
                            plan=plan,
                            siblings=3,
                            slot_budget=96,
                        )
                    assert torch.equal(got, expected), (name, plan)
                    taken += model.tidar_stats["sibling_steps"]
    assert taken > 0 and deep > 0


def test_siblings_keep_the_scores_and_are_off_where_they_would_not_be_exact(trained):
    """With a sibling taken, output_scores and output_logits are AR's; sampling, beta < 1 and
    batches verify chains only (a sibling is exact under greedy verification of one row)."""
    model, _ = trained["qwen2"]
    kw = dict(
        max_new_tokens=24,
        eos_token_id=None,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    hits = 0
    for ids in sibling_prompts():
        hf = model.generate(ids, **kw)
        td = generate(ids, model=model, drafter="diffusion", plan="adaptive", siblings=3, **kw)
        hits += model.tidar_stats["sibling_steps"]
        assert torch.equal(td.sequences, hf.sequences)
        for a, b in zip(td.scores, hf.scores):
            assert torch.allclose(a, b, atol=1e-4)
        for a, b in zip(td.logits, hf.logits):
            assert torch.allclose(a, b, atol=1e-4)
    assert hits > 0
    for ids in sibling_prompts():  # prefix-dependent processors see the sibling's own prefix
        kw = dict(
            max_new_tokens=24, eos_token_id=None, repetition_penalty=1.3, no_repeat_ngram_size=3
        )
        assert torch.equal(
            generate(ids, model=model, drafter="diffusion", plan="adaptive", siblings=3, **kw),
            ar(model, ids, **kw),
        )
    ids = torch.cat(sibling_prompts()[:2])
    for extra in (dict(do_sample=True, top_k=5), dict(beta=0.5), dict()):
        batch = ids[:1] if extra else ids
        generate(
            batch,
            model=model,
            max_new_tokens=16,
            eos_token_id=None,
            drafter="diffusion",
            plan="adaptive",
            siblings=3,
            **extra,
        )
        assert model.tidar_stats["sibling_steps"] == 0, extra
    assert torch.equal(
        generate(ids, model=model, max_new_tokens=16, eos_token_id=None, siblings=3),
        ar(model, ids, max_new_tokens=16, eos_token_id=None),
    )
    with pytest.raises(ValueError, match="siblings=-1"):
        generate(ids[:1], model=model, max_new_tokens=4, siblings=-1)


def test_keep_slots_keeps_the_cache_and_a_branch_that_is_not_a_suffix():
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(2):
        x = torch.arange(7.0).view(1, 1, 7, 1) + 10 * layer
        cache.update(x, -x, layer)
    tree.keep_slots(cache, 3, [0, 2])  # 3 cached, then a step of 4 slots: keep slots 0 and 2
    assert cache.layers[1].keys.flatten().tolist() == [10, 11, 12, 13, 15]
    assert (
        cache.layers[0].values.flatten().tolist() == [0, -1, -2, -3, -5]
        and cache.get_seq_length() == 5
    )


def test_tree_plans_keep_the_likeliest_nodes_and_group_after_the_likely_ends():
    """Chain proposals reached with 0.3, 0.15, 0.075; siblings of draft 1: 9 (0.4), 8 (0.2), 7
    (0.01); under 9, token 6 (0.9 of 0.4 = 0.36)."""
    tokens = torch.arange(4)[None]
    draft = Draft(
        tokens,
        confidence=torch.tensor([[0.3, 0.5, 0.5]]),
        sources=["diffusion"],
        siblings=torch.tensor([[9, 8, 7, 6]]),
        sibling_confidence=torch.tensor([[0.4, 0.2, 0.01, 0.9]]),
        sibling_parents=(0, 0, 0, 4),
    )
    flat = costs({(s, m): 60 for s in range(1, 41) for m in (False, True)})
    dear = costs(
        {
            **{(s, False): 60 + 50 * s for s in range(1, 41)},
            **{(s, True): 60 + 50 * s for s in range(1, 41)},
        }
    )
    d, plan = Planner(4, "cost", slot_budget=40, costs=flat, siblings=3).step(
        draft, uses_groups=True
    )
    # slots are free: every node
    assert plan.n_drafts == 4 and plan.parents() == (-1, 0, 1, 2, 0, 0, 0, 4)
    assert d.siblings.tolist() == [[9, 8, 7, 6]] and d.sibling_parents == plan.sibling_parents
    assert len(plan.anchors) == 8  # and a group after each
    # budget 20, chances >= 5 %
    d, plan = Planner(4, "adaptive", siblings=3).step(draft, uses_groups=True)
    # 7 (1 %) left out; 6 now under slot 4
    assert plan.parents() == (-1, 0, 1, 2, 0, 0, 4) and d.siblings.tolist() == [[9, 8, 6]]
    # the likeliest end (6, 36 %) gets a group: anchor slot + 1
    assert plan.slots == 7 + 3 * 4 and 7 in plan.anchors
    assert plan.group_start(7) == 7 + plan.anchors.index(7) * 4
    # each node at its depth
    assert plan.positions(torch.tensor([10])).tolist()[0][:7] == [10, 11, 12, 13, 11, 11, 12]
    # no slot pays
    assert Planner(4, "cost", costs=dear, siblings=3).step(draft, uses_groups=True)[1].slots == 1
    # siblings=0: chains only
    assert Planner(4, "cost", costs=flat).step(draft, uses_groups=True)[1].siblings == 0
    batch = Draft(
        tokens.repeat(2, 1),
        confidence=torch.full((2, 3), 0.5),
        siblings=torch.tensor([[9], [8]]),
        sibling_confidence=torch.full((2, 1), 0.4),
    )
    assert Planner(4, "adaptive", siblings=3).step(batch, uses_groups=True)[1].siblings == 0


def test_grow_finds_the_likeliest_nodes_of_the_group_best_first():
    """Two offsets: the chain (5: 0.5, then 6: 0.8) and alternatives (7: 0.3, 8: 0.1; then 9: 0.1).
    Best first by reach: 5 (0.5), 5-6 (0.4), 7 (0.3), 7-6 (0.24), 8 (0.1)."""
    from tidar_convert.runtime.tree import grow

    draft = Draft(torch.tensor([[1, 5, 6]]), confidence=torch.tensor([[0.5, 0.8]]))
    grow(draft, [[[7, 8], [9, 10]]], [[[0.3, 0.1], [0.1, 0.05]]], most=5)
    # 6 under 7 (slot 3)
    assert draft.siblings.tolist() == [[7, 6, 8]] and draft.sibling_parents == (0, 3, 0)
    assert torch.allclose(draft.sibling_confidence, torch.tensor([[0.3, 0.8, 0.1]]))
    grow(draft, [[[7, 8], [9, 10]]], [[[0.3, 0.1], [0.1, 0.05]]], most=2)
    assert draft.siblings.shape == (1, 0)  # the two chain nodes are the likeliest


def test_development_example_drafter(trained, monkeypatch):
    """docs/development.md's worked example (a drafter in one class and one test) runs as written:
    its class goes into drafters' namespace and DRAFTERS, then its test runs."""
    import re
    from collections import Counter
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "development.md").read_text()
    cls, test = re.findall(r"```python\n(.*?)```", text[text.index("## Adding a drafter") :], re.S)[
        :2
    ]
    namespace = {**vars(drafters), "Counter": Counter}
    exec(cls.replace("DRAFTERS = {", "NEW = {"), namespace)
    monkeypatch.setattr(drafters, "DRAFTERS", namespace["NEW"])
    assert drafters.Drafter in namespace["SuccessorDrafter"].__mro__
    scope = {"torch": torch, "cycle_batch": cycle_batch, "ar": ar, "generate": generate}
    exec(test, scope)
    scope["test_successor_drafts_are_exact_and_accepted"](trained)
