import math

import pytest
import torch

from tidar_convert.loss import hybrid_loss


def test_loss_matches_hand_computation():
    # S = 2, V = 2, k = 2. Logits chosen so each cross-entropy is easy to write down.
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 3.0]]])
    ar_labels = torch.tensor([[1, -100]])  # clean 0 predicts x1 = 1; clean 1 has no next token
    diff_labels = torch.tensor([[0, 1]])
    out = hybrid_loss(logits, ar_labels, diff_labels, alpha=1.0, block_size=2)
    l_ar = math.log(2)  # uniform over 2
    l_diff = (-(1 - math.log(math.e + 1)) - (3 - math.log(1 + math.e**3))) / 2
    assert out["loss_ar"].item() == pytest.approx(l_ar, rel=1e-6)
    assert out["loss_diff"].item() == pytest.approx(l_diff, rel=1e-6)
    assert out["loss"].item() == pytest.approx((l_ar + l_diff) / 2, rel=1e-6)
    assert out["acc_diff_0"].item() == 1.0 and out["acc_diff_1"].item() == 1.0
    for alpha in (0.0, 0.5, 3.0):
        o = hybrid_loss(logits, ar_labels, diff_labels, alpha=alpha, block_size=2)
        assert o["loss"].item() == pytest.approx((alpha * l_ar + l_diff) / (1 + alpha), rel=1e-6)


def test_accuracy_by_offset():
    V = 5
    labels = torch.tensor([[1, 2, 3, 4]])
    logits = torch.zeros(1, 8, V)
    logits[0, 4 + 0, 1] = 5  # offset 0 right
    logits[0, 4 + 1, 0] = 5  # offset 1 wrong
    logits[0, 4 + 2, 3] = 5  # offset 0 right
    logits[0, 4 + 3, 4] = 5  # offset 1 right
    out = hybrid_loss(logits, labels, labels, alpha=1.0, block_size=2)
    assert out["acc_diff_0"].item() == 1.0
    assert out["acc_diff_1"].item() == 0.5


def test_negative_alpha_refused():
    with pytest.raises(ValueError, match="alpha=-1"):
        hybrid_loss(torch.zeros(1, 4, 3), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), -1, 2)
