import math

import pytest
import torch

from tidar_convert.train.loss import hybrid_loss


def test_loss_matches_hand_computation():
    # S = 2, V = 2, k = 2. Logits chosen so each cross-entropy is easy to write down.
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 3.0]]])
    ar_labels = torch.tensor([[1, -100]])  # clean 0 predicts x1 = 1; clean 1 has no next token
    diff_labels = torch.tensor([[0, 1]])
    out = hybrid_loss(logits, ar_labels, diff_labels, alpha=1.0, draft_length=2)
    l_ar = math.log(2)  # uniform over 2
    l_diff = (-(1 - math.log(math.e + 1)) - (3 - math.log(1 + math.e**3))) / 2
    assert out["loss_ar"].item() == pytest.approx(l_ar, rel=1e-6)
    assert out["loss_diff"].item() == pytest.approx(l_diff, rel=1e-6)
    assert out["loss"].item() == pytest.approx((l_ar + l_diff) / 2, rel=1e-6)
    assert out["acc_diff_0"].item() == 1.0 and out["acc_diff_1"].item() == 1.0
    for alpha in (0.0, 0.5, 3.0):
        o = hybrid_loss(logits, ar_labels, diff_labels, alpha=alpha, draft_length=2)
        assert o["loss"].item() == pytest.approx((alpha * l_ar + l_diff) / (1 + alpha), rel=1e-6)


def test_accuracy_by_offset():
    V = 5
    labels = torch.tensor([[1, 2, 3, 4]])
    logits = torch.zeros(1, 8, V)
    logits[0, 4 + 0, 1] = 5  # offset 0 right
    logits[0, 4 + 1, 0] = 5  # offset 1 wrong
    logits[0, 4 + 2, 3] = 5  # offset 0 right
    logits[0, 4 + 3, 4] = 5  # offset 1 right
    out = hybrid_loss(logits, labels, labels, alpha=1.0, draft_length=2)
    assert out["acc_diff_0"].item() == 1.0
    assert out["acc_diff_1"].item() == 0.5


def test_negative_alpha_refused():
    with pytest.raises(ValueError, match="alpha=-1"):
        hybrid_loss(
            torch.zeros(1, 4, 3),
            torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.long),
            -1,
            2,
        )


def test_offset_weights_match_hand_computation():
    # S = 4, V = 2, k = 2: diffusion slots 0..3 at offsets 0, 1, 0, 1; slot 3's label is ignored.
    logits = torch.zeros(1, 8, 2)
    logits[0, 4:, 0] = torch.tensor([1.0, 2.0, 0.0, 5.0])  # diffusion logits (x, 0) per slot
    ar_labels = torch.tensor([[0, 1, 0, -100]])
    diff_labels = torch.tensor([[0, 1, 1, -100]])
    ce = [math.log(1 + math.e) - 1, math.log(math.e**2 + 1), math.log(2)]  # slots 0, 1, 2
    w = [3.0, 0.5]
    out = hybrid_loss(logits, ar_labels, diff_labels, alpha=1.0, draft_length=2, offset_weights=w)
    weighted = (w[0] * ce[0] + w[1] * ce[1] + w[0] * ce[2]) / (w[0] + w[1] + w[0])
    l_ar = math.log(2)
    assert out["loss"].item() == pytest.approx((l_ar + weighted) / 2, rel=1e-6)
    # logged unweighted: comparable across recipes
    assert out["loss_diff"].item() == pytest.approx(sum(ce) / 3, rel=1e-6)
    uniform = hybrid_loss(logits, ar_labels, diff_labels, alpha=1.0, draft_length=2)
    for scale in (1.0, 7.0):  # uniform weights of any scale are the paper's plain mean
        same = hybrid_loss(
            logits, ar_labels, diff_labels, alpha=1.0, draft_length=2, offset_weights=[scale, scale]
        )
        assert same["loss"].item() == pytest.approx(uniform["loss"].item(), rel=1e-6)
    # with distillation, the weights apply to the soft term too: w = [1, 0] keeps offset 0 only
    soft = hybrid_loss(
        logits,
        ar_labels,
        diff_labels,
        alpha=0.0,
        draft_length=2,
        distill_weight=1.0,
        offset_weights=[1.0, 0.0],
    )
    # slot 0 has no AR teacher (hard label); slot 2's teacher is clean slot 1, uniform logits ->
    # KL(u || q)
    q2 = [0.5, 0.5]
    kl2 = sum(0.5 * math.log(0.5 / q) for q in q2)
    assert soft["loss"].item() == pytest.approx((ce[0] + kl2) / 2, rel=1e-6)


@pytest.mark.parametrize("weights", [[1.0], [1.0, -1.0], [0.0, 0.0]])
def test_bad_offset_weights_are_refused(weights):
    from tidar_convert.train.module import TiDARModule

    with pytest.raises(ValueError) as e:
        # refused before anything loads
        TiDARModule(model="/nonexistent", draft_length=2, diff_offset_weights=weights)
    assert (
        f"diff_offset_weights={weights}: give one weight >= 0 per position of a block "
        "(draft_length=2" in str(e.value)
    )


def test_greedy_tokens_are_no_ar_targets_and_send_no_ar_gradient():
    """--data.greedy_ar_loss false: a token marked no_ar_target is never an AR label, so the AR loss
    sends no gradient through the clean slot that predicts it; the diffusion loss still trains
    on it."""
    from tidar_convert.runtime import layout

    torch.manual_seed(0)
    ids = torch.randint(0, 9, (2, 8))
    doc_ids = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
    marked = torch.zeros(2, 8, dtype=torch.bool)
    marked[0, 3:] = True  # row 0: a human document, then a greedy one
    ar, diff = layout.train_labels(ids, doc_ids, marked)
    plain, _ = layout.train_labels(ids, doc_ids)
    # slot 2 ends doc 0; 3..7 would predict greedy tokens
    assert ar[0].tolist() == [ids[0, 1].item(), ids[0, 2].item()] + [-100] * 6
    assert torch.equal(ar[1], plain[1]) and torch.equal(diff, ids)
    logits = torch.randn(2, 16, 9, requires_grad=True)
    out = hybrid_loss(logits, ar, diff, alpha=1.0, draft_length=4)
    out["loss_ar"].backward(retain_graph=True)
    assert (
        torch.count_nonzero(logits.grad[0, 2:8]) == 0
        and torch.count_nonzero(logits.grad[0, :2]) > 0
    )
    logits.grad = None
    out["loss_diff"].backward()
    # the greedy tokens still train the diffusion half
    assert torch.count_nonzero(logits.grad[0, 8 + 3 :]) > 0
    # a chunk of greedy text only: the AR term is 0 (no target), not NaN, and the loss is the
    # diffusion term's
    all_marked = torch.ones(2, 8, dtype=torch.bool)
    out = hybrid_loss(
        logits.detach(), *layout.train_labels(ids, None, all_marked), alpha=1.0, draft_length=4
    )
    assert out["loss_ar"].item() == 0.0 and out["loss"].item() == pytest.approx(
        out["loss_diff"].item() / 2
    )


def test_module_trains_greedy_tokens_in_the_diffusion_loss_only(tiny_dirs):
    from helpers import cycle_batch

    from tidar_convert.runtime import layout
    from tidar_convert.train.module import TiDARModule

    m = TiDARModule(model=str(tiny_dirs["llama"]), draft_length=4)
    m.configure_model()  # outside a Trainer the module builds its model when asked
    ids = cycle_batch(2, 16, seed=3)
    S = ids.shape[1]
    doc_ids = torch.zeros_like(ids)
    doc_ids[0, 9:] = 1
    marked = doc_ids.bool()  # row 0's second document is greedy text
    with torch.no_grad():
        full = m.forward_tidar(ids, doc_ids)
        skip = m.forward_tidar(ids, doc_ids, marked)
        logits = m.model(  # the same forward by hand: the AR loss over the unmarked targets alone
            input_ids=layout.train_inputs(ids, m.model.config.mask_token_id),
            position_ids=layout.train_position_ids(ids, doc_ids),
            attention_mask=layout.to_dense(layout.train_mask_mod(S, 4, doc_ids), 2, 2 * S, 2 * S),
        ).logits[:, :S]
    ar, _ = layout.train_labels(ids, doc_ids, marked)
    assert (ar[0, 8:] == -100).all() and (ar[1, :-1] != -100).all()
    expect = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), ar.flatten(), ignore_index=-100
    )
    assert skip["loss_ar"].item() == pytest.approx(expect.item(), rel=1e-4)
    assert skip["loss_ar"].item() != pytest.approx(full["loss_ar"].item(), rel=1e-4)
    assert skip["loss_diff"].item() == pytest.approx(full["loss_diff"].item(), rel=1e-6)
    # training_step reads the mark from the batch (as TiDARData delivers it): all greedy -> the
    # diffusion term alone
    with pytest.warns(UserWarning, match="self.log"), torch.no_grad():  # no Trainer attached here
        loss = m.training_step(
            {"input_ids": ids, "doc_ids": doc_ids, "no_ar_target": torch.ones_like(marked)}, 0
        )
    assert loss.item() == pytest.approx(full["loss_diff"].item() / 2, rel=1e-5)
