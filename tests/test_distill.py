"""Distilling the diffusion half from the AR head (issue 9, item 1): the loss, its detachment, the
agreement metric, and training with a self or frozen-base teacher."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import cycle_batch, train_tiny

from tidar_convert.runtime import layout
from tidar_convert.train.loss import hybrid_loss


def test_distill_loss_matches_hand_computation():
    # S = 2, V = 2, k = 2. Clean slot 0 predicts x1 (so it is the teacher of mask slot 1); mask slot
    # 0 has no AR prediction for x0 and keeps its hard label.
    logits = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 3.0]]])
    ar_labels = torch.tensor([[1, -100]])
    diff_labels = torch.tensor([[0, 1]])
    T, w = 2.0, 0.25
    out = hybrid_loss(
        logits,
        ar_labels,
        diff_labels,
        alpha=1.0,
        draft_length=2,
        distill_weight=w,
        distill_temperature=T,
    )
    l_ar = math.log(1 + math.e)  # clean 0: logits (1, 0), label 1
    hard0 = -(1 - math.log(math.e + 1))  # mask 0: logits (1, 0), label 0
    hard1 = -(3 - math.log(1 + math.e**3))  # mask 1: logits (0, 3), label 1
    p = [math.exp(0.5) / (math.exp(0.5) + 1), 1 / (math.exp(0.5) + 1)]  # softmax((1, 0) / T)
    q = [1 / (1 + math.e**3), math.e**3 / (1 + math.e**3)]  # softmax((0, 3))
    kl1 = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))
    l_diff, l_distill = (hard0 + hard1) / 2, (hard0 + kl1) / 2
    assert out["loss_ar"].item() == pytest.approx(l_ar, rel=1e-6)
    # still the hard term, for comparison
    assert out["loss_diff"].item() == pytest.approx(l_diff, rel=1e-6)
    assert out["loss_distill"].item() == pytest.approx(l_distill, rel=1e-6)
    assert out["loss"].item() == pytest.approx(
        (l_ar + (1 - w) * l_diff + w * l_distill) / 2, rel=1e-6
    )
    # agreement: mask slot 1 argmax = 1, clean slot 0 argmax = 0; mask slot 0 has no AR counterpart.
    assert out["agree_ar_1"].item() == 0.0 and out["agree_ar_0"].item() == 0.0


def test_distill_weight_zero_is_todays_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 16, 7)
    ar, diff = layout.train_labels(torch.randint(0, 7, (2, 8)))
    a = hybrid_loss(logits, ar, diff, 1.0, 4)
    b = hybrid_loss(logits, ar, diff, 1.0, 4, distill_weight=0.0, distill_temperature=0.5)
    assert "loss_distill" not in a and torch.equal(a["loss"], b["loss"])
    assert a["loss"].item() == pytest.approx(
        (a["loss_ar"].item() + a["loss_diff"].item()) / 2, rel=1e-6
    )


def random_case(seed=0, B=3, S=12, V=11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    doc_ids = torch.zeros(B, S, dtype=torch.long)
    doc_ids[0, 5:] = 1  # a document boundary inside row 0 (slot 5 has no AR teacher)
    doc_ids[2, 3:], doc_ids[2, 9:] = 1, 2
    logits = torch.randn(2 * S * B, V, generator=g).view(B, 2 * S, V) * 3
    return ids, doc_ids, logits


def test_distill_at_temperature_to_zero_is_hard_ce_on_ar_argmax():
    ids, doc_ids, logits = random_case()
    S = ids.shape[1]
    ar, diff = layout.train_labels(ids, doc_ids)
    # Hard labels on the AR argmax: mask slot i takes argmax(clean slot i-1) wherever that slot
    # predicts x_i (same document); elsewhere (chunk and document starts) the true token.
    argmax_labels = diff.clone()
    teacher = torch.zeros_like(ids, dtype=torch.bool)
    teacher[:, 1:] = doc_ids[:, 1:] == doc_ids[:, :-1]
    argmax_labels[:, 1:] = torch.where(teacher[:, 1:], logits[:, : S - 1].argmax(-1), diff[:, 1:])
    soft = hybrid_loss(logits, ar, diff, 1.0, 4, distill_weight=1.0, distill_temperature=1e-4)
    hard = hybrid_loss(logits, ar, argmax_labels, 1.0, 4)
    assert soft["loss_distill"].item() == pytest.approx(hard["loss_diff"].item(), rel=1e-5)
    assert soft["loss"].item() == pytest.approx(hard["loss"].item(), rel=1e-5)
    direct = F.cross_entropy(logits[:, S:].flatten(0, 1), argmax_labels.flatten())
    assert soft["loss_distill"].item() == pytest.approx(direct.item(), rel=1e-5)


@pytest.mark.parametrize("given_teacher", [False, True])
def test_teacher_is_detached(given_teacher):
    """The distillation term sends no gradient into the AR half (nor into given teacher logits)."""
    ids, doc_ids, base = random_case(seed=1)
    S = ids.shape[1]
    logits = base.clone().requires_grad_()
    teacher = (
        torch.randn(ids.shape[0], S, base.shape[-1]).requires_grad_() if given_teacher else None
    )
    ar, diff = layout.train_labels(ids, doc_ids)
    # alpha = 0 and distill_weight = 1: the loss is the distillation term alone.
    out = hybrid_loss(
        logits,
        ar,
        diff,
        0.0,
        4,
        distill_weight=1.0,
        distill_temperature=1.0,
        teacher_logits=teacher,
    )
    assert out["loss"].item() == pytest.approx(out["loss_distill"].item())
    out["loss"].backward()
    assert torch.count_nonzero(logits.grad[:, :S]) == 0
    assert torch.count_nonzero(logits.grad[:, S:]) > 0
    if given_teacher:
        assert teacher.grad is None


def test_teacher_is_detached_in_a_tiny_model(tiny_dirs):
    """Through a real forward: the gradient of the distillation term reaches the AR half's logits
    as zero."""
    from tidar_convert.models.loading import load_base

    model, _ = load_base(str(tiny_dirs["llama"]))
    ids = cycle_batch(2, 16, seed=0)
    S = ids.shape[1]
    logits = model(
        input_ids=layout.train_inputs(ids, model.config.mask_token_id),
        position_ids=layout.train_position_ids(ids),
        attention_mask=layout.to_dense(layout.train_mask_mod(S, 4), 2, 2 * S, 2 * S),
    ).logits
    logits.retain_grad()
    hybrid_loss(
        logits, *layout.train_labels(ids), 0.0, 4, distill_weight=1.0, distill_temperature=2.0
    )["loss"].backward()
    assert (
        torch.count_nonzero(logits.grad[:, :S]) == 0 and torch.count_nonzero(logits.grad[:, S:]) > 0
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(distill_weight=1.5), "distill_weight=1.5: must be a finite number in [0, 1]"),
        (dict(distill_weight=-0.1), "distill_weight=-0.1"),
        (dict(distill_temperature=0.0), "distill_temperature=0.0: must be a finite number > 0"),
        (dict(teacher="ema"), "teacher='ema': use 'self'"),
        (
            dict(teacher="base", distill_weight=0.5),
            "teacher='base' with lora_r=0: the frozen-base teacher needs LoRA; set lora_r > 0",
        ),
        (dict(anchor_weight=1.2, lora_r=4), "anchor_weight=1.2: must be a finite number in [0, 1]"),
        (
            dict(anchor_weight=0.5),
            "anchor_weight=0.5 with lora_r=0: the base-model anchor needs LoRA",
        ),
        # issue 46: settings of the distillation term, silently ignored while it is off
        (
            dict(teacher="base", lora_r=4),
            "--model.teacher base with --model.distill_weight 0: "
            "they apply to the distillation term, which is off",
        ),
        (
            dict(distill_temperature=2.0),
            "--model.distill_temperature 2.0 with --model.distill_weight 0",
        ),
    ],
)
def test_bad_distill_settings_are_refused(kwargs, message):
    from tidar_convert.train.module import TiDARModule

    with pytest.raises(ValueError) as e:
        TiDARModule(model="/nonexistent", **kwargs)  # refused before anything loads
    assert message in str(e.value) and "\n" not in str(e.value)


def test_agree_ar_matches_a_direct_count(tiny_dirs):
    from tidar_convert.train.module import TiDARModule

    k = 4
    m = TiDARModule(model=str(tiny_dirs["llama"]), draft_length=k)
    m.configure_model()  # outside a Trainer the module builds its model when asked
    # so the diffusion head agrees often, not only by chance
    train_tiny(m.model, steps=40, draft_length=k)
    ids = cycle_batch(3, 32, seed=1)
    doc_ids = torch.zeros_like(ids)
    doc_ids[1, 13:] = 1
    doc_ids[2, 6:], doc_ids[2, 21:] = 1, 2
    S = ids.shape[1]
    with torch.no_grad():
        out = m.forward_tidar(ids, doc_ids)
        diff_pred = (
            m.model(
                input_ids=layout.train_inputs(ids, m.model.config.mask_token_id),
                position_ids=layout.train_position_ids(ids, doc_ids),
                attention_mask=layout.to_dense(
                    layout.train_mask_mod(S, k, doc_ids), 3, 2 * S, 2 * S
                ),
            )
            .logits[:, S:]
            .argmax(-1)
        )
        hits, counts = [0] * k, [0] * k
        for b in range(3):
            for d in doc_ids[b].unique():
                where = (doc_ids[b] == d).nonzero().flatten().tolist()
                # the document alone, plain causal
                ar_pred = m.model(input_ids=ids[b, where][None]).logits[0].argmax(-1)
                # slot i's token is predicted by the AR head at the slot before it
                for j, i in enumerate(where[1:]):
                    counts[i % k] += 1
                    hits[i % k] += int(diff_pred[b, i] == ar_pred[j])
    for o in range(k):
        assert out[f"agree_ar_{o}"].item() == pytest.approx(hits[o] / counts[o], abs=1e-6), (
            o,
            hits,
            counts,
        )
    assert max(hits[o] / counts[o] for o in range(k)) > 0.5, (hits, counts)


def test_base_teacher_is_the_base_model_with_adapters_off(tiny_dirs):
    from tidar_convert.models.loading import load_base
    from tidar_convert.train.module import TiDARModule

    m = TiDARModule(
        model=str(tiny_dirs["qwen2"]), draft_length=4, lora_r=4, teacher="base", distill_weight=0.5
    )
    m.configure_model()  # outside a Trainer the module builds its model when asked
    torch.manual_seed(0)
    with torch.no_grad():  # move the adapters away from zero: the student now differs from the base
        for name, p in m.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base, _ = load_base(str(tiny_dirs["qwen2"]))
    ids = cycle_batch(2, 16, seed=2)
    doc_ids = torch.zeros_like(ids)
    doc_ids[0, 7:] = 1
    teacher = m.base_ar_logits(ids, doc_ids)
    assert not teacher.requires_grad
    with torch.no_grad():
        for b in range(2):
            for d in doc_ids[b].unique():
                where = (doc_ids[b] == d).nonzero().flatten()
                expect = base(input_ids=ids[b, where][None]).logits[0]
                torch.testing.assert_close(teacher[b, where], expect, rtol=1e-4, atol=1e-4)
                student = m.model(input_ids=ids[b, where][None]).logits[0]
                # the adapters are back on after the teacher forward
                assert (student - expect).abs().max() > 1e-2
    m.model.train()
    out = m.forward_tidar(ids, doc_ids)
    out["loss"].backward()
    assert torch.isfinite(out["loss_distill"])
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in m.model.named_parameters()
        if "lora_" in n
    )


@pytest.mark.fit
@pytest.mark.parametrize(
    "extra",
    [
        ["--model.distill_weight", "0.5", "--model.distill_temperature", "2.0"],
        ["--model.distill_weight", "1.0", "--model.teacher", "base", "--model.lora_r", "4"],
        ["--model.distill_weight", "1.0", "--model.anchor_weight", "1.0", "--model.lora_r", "4"],
    ],
    ids=["self", "base-lora", "anchor-lora"],
)
def test_short_fit_with_distillation(tmp_path, tiny_dirs, extra):
    from test_fit import RECIPE

    from tidar_convert.train.fit import _lightning_cli

    args = [
        "fit",
        "--config",
        RECIPE,
        "--model.model",
        str(tiny_dirs["llama"]),
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "4",
    ]
    args += [
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--model.val_decode_prompts",
        "0",
        *extra,
    ]
    cli = _lightning_cli(args)
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 4
    for key in (
        "train/loss_distill",
        "train/agree_ar_0",
        "train/agree_ar_3",
        "val/loss_distill",
        "val/agree_ar_1",
        "val/acc_diff_1",
    ):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert 0 <= metrics["val/agree_ar_2"].item() <= 1
    assert ("train/loss_anchor" in metrics) == ("--model.anchor_weight" in extra)


def test_model_card_lists_distillation_only_when_used(tmp_path):
    from tidar_convert.train.fit import training_card

    hp = {"lora_r": 0, "distill_weight": 0.5, "distill_temperature": 2.0, "teacher": "self"}
    assert {
        "distill_weight": 0.5,
        "distill_temperature": 2.0,
        "teacher": "self",
    }.items() <= training_card(hp, 3, tmp_path).items()
    assert "distill_weight" not in training_card({**hp, "distill_weight": 0.0}, 3, tmp_path)
    assert (
        "anchor_weight" not in training_card(hp, 3, tmp_path)
        and training_card({**hp, "anchor_weight": 1.0}, 3, tmp_path)["anchor_weight"] == 1.0
    )


def test_anchor_pulls_the_ar_half_toward_the_base_distribution():
    """L_Anchor = mean over AR positions with a target of KL(softmax(base) || softmax(AR)), by hand;
    detached base; a = 0 is the paper's loss; the diffusion half gets no gradient from it."""
    torch.manual_seed(0)
    S, V = 6, 7
    logits = torch.randn(1, 2 * S, V, requires_grad=True)
    base = torch.randn(1, S, V, requires_grad=True)
    ids = torch.randint(0, V, (1, S))
    ar, diff = layout.train_labels(ids)
    plain = hybrid_loss(logits, ar, diff, 1.0, 2)
    assert "loss_anchor" not in plain
    with pytest.raises(ValueError, match="anchor_weight=0.5 needs the base model's AR logits"):
        hybrid_loss(logits, ar, diff, 1.0, 2, anchor_weight=0.5)
    assert hybrid_loss(logits, ar, diff, 1.0, 2, anchor_weight=0.0, anchor_logits=base)[
        "loss"
    ].item() == pytest.approx(plain["loss"].item())
    p, logq = base.detach().softmax(-1), logits[:, :S].detach().log_softmax(-1)
    kl = (p * (p.log() - logq)).sum(-1)[0]
    has = (ar[0] != -100).float()
    expect = float((kl * has).sum() / has.sum())
    out = hybrid_loss(logits, ar, diff, 1.0, 2, anchor_weight=0.25, anchor_logits=base)
    assert out["loss_anchor"].item() == pytest.approx(expect, rel=1e-5)
    # the logged CE is unchanged
    assert out["loss_ar"].item() == pytest.approx(plain["loss_ar"].item())
    assert out["loss"].item() == pytest.approx(
        (0.75 * plain["loss_ar"].item() + 0.25 * expect + plain["loss_diff"].item()) / 2, rel=1e-5
    )
    anchored = hybrid_loss(logits, ar, diff, 0.0 + 1.0, 2, anchor_weight=1.0, anchor_logits=base)
    (anchored["loss"] - anchored["loss_diff"] / 2).backward()  # the anchor's part alone
    assert (
        base.grad is None
        and torch.count_nonzero(logits.grad[:, S:]) == 0
        and torch.count_nonzero(logits.grad[:, :S]) > 0
    )
    with torch.no_grad():  # an AR half equal to the base has nothing to learn from the anchor
        same = logits.detach().clone()
        same[:, :S] = base.detach()
    assert hybrid_loss(same, ar, diff, 1.0, 2, anchor_weight=1.0, anchor_logits=base)[
        "loss_anchor"
    ].item() == pytest.approx(0.0, abs=1e-6)


def test_module_anchors_to_the_base_with_the_teacher_forward_shared(tiny_dirs, monkeypatch):
    from tidar_convert.train.module import TiDARModule

    m = TiDARModule(
        model=str(tiny_dirs["qwen2"]),
        draft_length=4,
        lora_r=4,
        anchor_weight=0.5,
        teacher="base",
        distill_weight=0.5,
    )
    m.configure_model()
    calls = []
    base_ar_logits = TiDARModule.base_ar_logits
    monkeypatch.setattr(
        TiDARModule, "base_ar_logits", lambda self, *a: calls.append(1) or base_ar_logits(self, *a)
    )
    ids = cycle_batch(2, 16, seed=2)
    out = m.forward_tidar(ids)
    assert len(calls) == 1  # one base forward serves the teacher and the anchor
    # fresh LoRA: the AR half is the base
    assert out["loss_anchor"].item() == pytest.approx(0.0, abs=1e-5)
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
