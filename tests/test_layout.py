"""The TiDAR layout: one mask_mod, two evaluations that agree, and no information leaks."""

import random

import pytest
import torch
from helpers import FAMILIES
from torch.nn.attention.flex_attention import create_mask

from tidar_convert.models.loading import load_base, model_from_config
from tidar_convert.runtime import layout

S, K = 16, 4


def doubled_forward(model, ids, doc_ids=None, attn="sdpa"):
    mask_mod = layout.train_mask_mod(S, K, doc_ids)
    mask = layout.build_mask(mask_mod, ids.shape[0], 2 * S, 2 * S, attn, "cpu")
    with torch.no_grad():
        return model(
            input_ids=layout.train_inputs(ids, model.config.mask_token_id),
            position_ids=layout.train_position_ids(ids, doc_ids),
            attention_mask=mask,
        ).logits


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {f: load_base(str(tiny_dirs[f]))[0].eval() for f in FAMILIES}


def test_mask_small_example_by_hand():
    # S = 4, k = 2: clean causal; masked block 0 sees no clean token, block 1 sees x0, x1.
    m = layout.to_dense(layout.train_mask_mod(4, 2), 1, 8, 8)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 1],
            [1, 1, 0, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(m, expected)


def test_dense_equals_flex_create_mask():
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    train = layout.train_mask_mod(S, K, doc_ids)
    assert torch.equal(
        layout.to_dense(train, 2, 2 * S, 2 * S),
        create_mask(train, 2, None, 2 * S, 2 * S, device="cpu"),
    )
    valid = torch.ones(2, 10 + 3 + 9, dtype=torch.bool)
    valid[0, :4] = False
    step = layout.decode_mask_mod(10, 3, 3, 1, valid)
    assert torch.equal(
        layout.to_dense(step, 2, 12, 22), create_mask(step, 2, None, 12, 22, device="cpu")
    )


# compiles FlexAttention with inductor (make test runs it; make test-fast skips it)
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_block_mask_and_dense_mask_give_same_logits(models, family):
    model = models[family]
    flex = model_from_config(model.config, attn_implementation="flex_attention").eval()
    flex.load_state_dict(model.state_dict())
    ids = torch.randint(0, 300, (2, S))
    doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    dense = doubled_forward(model, ids, doc_ids, "sdpa")
    block = doubled_forward(flex, ids, doc_ids, "flex_attention")
    torch.testing.assert_close(dense, block, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_clean_half_equals_plain_causal_model(models, family):
    model = models[family]
    ids = torch.randint(0, 300, (2, S))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    torch.testing.assert_close(doubled_forward(model, ids)[:, :S], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_block_sees_only_the_clean_prefix_before_it(models, family):
    model = models[family]
    ids = torch.randint(0, 300, (1, S))
    base = doubled_forward(model, ids)
    block = 2  # masked slots S + 8 .. S + 11 see clean tokens 0..7
    start = block * K
    blk = slice(S + start, S + start + K)
    for changed_pos in (start, start + 2, S - 1):  # at or after the block start: invisible
        other = ids.clone()
        other[0, changed_pos] = (other[0, changed_pos] + 1) % 300
        torch.testing.assert_close(
            doubled_forward(model, other)[:, blk], base[:, blk], atol=1e-5, rtol=1e-5
        )
    earlier = ids.clone()
    earlier[0, start - 1] = (earlier[0, start - 1] + 1) % 300
    assert not torch.allclose(doubled_forward(model, earlier)[:, blk], base[:, blk], atol=1e-4)
    # and it does not see the other masked blocks: their content is fixed (all M) so check via mask
    m = layout.to_dense(layout.train_mask_mod(S, K), 1, 2 * S, 2 * S)[0, 0]
    assert not m[S + start, S : S + start].any() and not m[S + start, S + start + K :].any()


def test_packed_documents_do_not_see_each_other(models):
    model = models["llama"]
    ids = torch.randint(0, 300, (1, S))
    doc_ids = torch.tensor([[0] * 6 + [1] * 10])
    base = doubled_forward(model, ids, doc_ids)
    other = ids.clone()
    other[0, :6] = (other[0, :6] + 7) % 300  # rewrite all of document 0
    changed = doubled_forward(model, other, doc_ids)
    doc1_clean = slice(6, S)
    doc1_masked = [S + i for i in range(6, S)]
    torch.testing.assert_close(changed[:, doc1_clean], base[:, doc1_clean], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(changed[:, doc1_masked], base[:, doc1_masked], atol=1e-5, rtol=1e-5)
    # document 1 alone, from position 0, gives the same clean logits: packing is invisible
    with torch.no_grad():
        alone = model(input_ids=ids[:, 6:]).logits
    torch.testing.assert_close(base[:, doc1_clean], alone, atol=1e-5, rtol=1e-5)


def test_positions_and_labels():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert layout.train_position_ids(ids).tolist() == [[0, 1, 2, 3, 4, 5] * 2]
    assert layout.train_position_ids(ids, doc_ids).tolist() == [[0, 1, 2, 0, 1, 2] * 2]
    ar, diff = layout.train_labels(ids, doc_ids)
    assert ar.tolist() == [[11, 12, -100, 14, 15, -100]]
    assert diff.tolist() == [[10, 11, 12, 13, 14, 15]]
    assert layout.train_inputs(ids, 99).tolist() == [[10, 11, 12, 13, 14, 15] + [99] * 6]


def test_decode_positions():
    # prefill of 3 prompt tokens + a block of 2 masks; step of 2 drafts + 2 groups of 2
    assert layout.decode_position_ids(torch.tensor([0]), 3, 2, 1, 3).tolist() == [[0, 1, 2, 3, 4]]
    assert layout.decode_position_ids(torch.tensor([5]), 2, 2, 2, 1).tolist() == [
        [5, 6, 6, 7, 7, 8]
    ]


def test_a_step_s_own_block_and_positions_are_the_mask_mod_s_on_random_plans():
    """The host builds a step's own (Q, Q) block (own_rows) and its positions without the mask_mod;
    on random trees, chains and anchors both are what the
    mask_mod and the tree's depths give."""
    rng = random.Random(0)
    for _ in range(300):
        T, k = rng.randrange(1, 9), rng.randrange(2, 5)
        parents = None if rng.random() < 0.3 else (-1, *(rng.randrange(i) for i in range(1, T)))
        anchors = tuple(sorted(rng.sample(range(1, T + 1), rng.randrange(0, min(T, 3) + 1))))
        Q = T + len(anchors) * k
        mod = layout.decode_mask_mod(0, T, k, anchors, parents=parents)
        own = torch.tensor(layout.own_rows(T, k, anchors, parents), dtype=torch.bool)
        assert torch.equal(own, layout.to_dense(mod, 1, Q, Q)[0, 0]), (T, k, anchors, parents)
        depth = torch.arange(T) if parents is None else layout.tree_ancestors(parents).sum(1) - 1
        groups = [int(depth[a - 1]) + 1 if parents else a for a in anchors]
        want = depth.tolist() + [g + i for g in groups for i in range(k)]
        start = rng.randrange(50)
        got = layout.decode_position_ids(
            torch.tensor([start]), T, k, len(anchors), anchors, parents
        )
        assert got.tolist() == [[start + p for p in want]], (T, k, anchors, parents)


def test_decode_step_mask_is_the_mask_mod_with_anchors():
    """The reusable dense step mask (cache validity + a cached per-plan block) equals
    decode_mask_mod, for groups at any anchors; consecutive anchors are the int form."""
    cache_valid = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for T, k, anchors in ((3, 2, (1, 2, 3)), (4, 3, (2,)), (5, 2, ()), (6, 2, (1, 4, 6))):
        Q = T + len(anchors) * k
        valid = torch.cat([cache_valid, torch.ones(2, Q, dtype=torch.bool)], 1)
        expected = layout.to_dense(layout.decode_mask_mod(6, T, k, anchors, valid), 2, Q, 6 + Q)
        assert torch.equal(layout.decode_step_mask(cache_valid, T, k, anchors, "sdpa"), expected), (
            T,
            k,
            anchors,
        )
        # the anchored mask_mod also runs under FlexAttention's vmap (its BlockMask path)
        if anchors:
            from torch.nn.attention.flex_attention import create_mask

            flex = create_mask(
                layout.decode_mask_mod(6, T, k, anchors, valid), 2, 1, Q, 6 + Q, device="cpu"
            )
            assert torch.equal(flex, expected), (T, k, anchors)
    valid = torch.ones(1, 6 + 3 + 6, dtype=torch.bool)
    as_int = layout.to_dense(layout.decode_mask_mod(6, 3, 2, 1, valid), 1, 9, 15)
    assert torch.equal(
        as_int, layout.to_dense(layout.decode_mask_mod(6, 3, 2, (1, 2, 3), valid), 1, 9, 15)
    )
    # a group anchored at j sees drafts 0..j-1 only, and sits at the positions after them
    m = layout.to_dense(layout.decode_mask_mod(0, 4, 2, (3,)), 1, 6, 6)[0, 0]
    assert m[4].tolist() == [True, True, True, False, True, True]
    assert layout.decode_position_ids(torch.tensor([5]), 3, 2, 2, (1, 3)).tolist() == [
        [5, 6, 7, 6, 7, 8, 9]
    ]


@pytest.mark.parametrize(
    "seq_len,block,msg",
    [(10, 4, "not a multiple"), (8, 1, "at least 2"), (4, 8, "larger than seq_len")],
)
def test_bad_shapes_are_refused(seq_len, block, msg):
    with pytest.raises(ValueError, match=msg):
        layout.check_train_shape(seq_len, block)


def test_tree_mask_sees_each_branch_and_its_ancestors_only():
    """A draft with alternatives to draft 1 (siblings): each causal token sees its ancestors and
    itself, a group after a sibling sees draft 0 and that sibling, and sits after it; a chain given
    as parents is the plain mask. Dense, cached and FlexAttention forms agree."""
    from torch.nn.attention.flex_attention import create_mask

    parents = (-1, 0, 1, 0, 0)  # draft 0, drafts 1-2 (chain), siblings of draft 1 at slots 3 and 4
    anchors, k = (1, 2, 5), 2  # groups after draft 0, after draft 1, after sibling 4
    m = layout.to_dense(layout.decode_mask_mod(0, 5, k, anchors, parents=parents), 1, 11, 11)[
        0, 0
    ].int()
    assert m[:5, :5].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ]
    # the group after sibling 4
    assert m[9, :5].tolist() == [1, 0, 0, 0, 1] and m[9, 5:].tolist() == [0, 0, 0, 0, 1, 1]
    assert m[7, :5].tolist() == [1, 1, 0, 0, 0]  # the group after draft 1: not its siblings
    pos = layout.decode_position_ids(torch.tensor([10]), 5, k, 3, anchors, parents)
    assert pos.tolist() == [[10, 11, 12, 11, 11, 11, 12, 12, 13, 12, 13]]
    chain = (-1, 0, 1, 2)
    for a in ((1, 3), (2,), ()):
        Q = 4 + len(a) * k
        assert torch.equal(
            layout.to_dense(layout.decode_mask_mod(3, 4, k, a, parents=chain), 1, Q, 3 + Q),
            layout.to_dense(layout.decode_mask_mod(3, 4, k, a), 1, Q, 3 + Q),
        )
        assert torch.equal(
            layout.decode_position_ids(torch.tensor([4]), 4, k, len(a), a, chain),
            layout.decode_position_ids(torch.tensor([4]), 4, k, len(a), a),
        )
    cache_valid = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.cat([cache_valid, torch.ones(2, 11, dtype=torch.bool)], 1)
    expected = layout.to_dense(layout.decode_mask_mod(3, 5, k, anchors, valid, parents), 2, 11, 14)
    assert torch.equal(
        layout.decode_step_mask(cache_valid, 5, k, anchors, "sdpa", parents), expected
    )
    assert torch.equal(
        create_mask(
            layout.decode_mask_mod(3, 5, k, anchors, valid, parents), 2, 1, 11, 14, device="cpu"
        ),
        expected,
    )


def test_decode_mask_mod_reads_only_tables_already_on_its_device():
    """A compiled FlexAttention kernel cannot move a tensor the mask_mod captured (on CUDA, inductor
    refused the anchors' device move inside the kernel: bench/results/gpu.json's first engine
    check), so the anchors and the tree's ancestors are put on the mask's device when it
    is built."""
    parents, anchors = (-1, 0, 1, 0, 0), (1, 2, 5)
    valid = torch.ones(2, 3 + 11, dtype=torch.bool)
    traced = torch.fx.symbolic_trace(layout.decode_mask_mod(3, 5, 2, anchors, valid, parents))
    moves = [
        n for n in traced.graph.nodes if n.op == "call_method" and n.target in ("to", "cuda", "cpu")
    ]
    assert not moves, moves
    # the device follows kv_valid
    on_meta = layout.decode_mask_mod(3, 5, 2, anchors, valid.to("meta"), parents)
    assert layout.to_dense(on_meta, 2, 11, 14, device="meta").device.type == "meta"
    assert torch.equal(
        layout.to_dense(traced, 2, 11, 14),
        layout.to_dense(layout.decode_mask_mod(3, 5, 2, anchors, valid, parents), 2, 11, 14),
    )  # what was traced is the mask
