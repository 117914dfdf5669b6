"""The hybrid TiDAR loss: L = (alpha * L_AR + L_Diff) / (1 + alpha), optionally distilling the AR
head into the diffusion half, and anchoring the AR half to the frozen base model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tidar_convert.runtime.layout import IGNORE_INDEX

TEACHERS = ("self", "base")


def check_distill(distill_weight: float, distill_temperature: float, teacher: str = "self") -> None:
    """One-line errors for the distillation settings (docs/method.md §2)."""
    if not 0 <= distill_weight <= 1:
        raise ValueError(
            f"distill_weight={distill_weight}: must be in [0, 1] "
            "(0 = hard labels only, 1 = AR soft targets only)."
        )
    if not distill_temperature > 0:
        raise ValueError(
            f"distill_temperature={distill_temperature}: must be > 0 "
            "(1.0 = the AR distribution as is; near 0 = its argmax)."
        )
    if teacher not in TEACHERS:
        raise ValueError(
            f"teacher={teacher!r}: use 'self' (the model's own AR head) "
            "or 'base' (the frozen base model, LoRA only)."
        )


def check_anchor(anchor_weight: float) -> None:
    if not 0 <= anchor_weight <= 1:
        raise ValueError(
            f"anchor_weight={anchor_weight}: must be in [0, 1] "
            "(0 = the AR half learns the text, 1 = it keeps the base model's distribution)."
        )


def check_offset_weights(weights: Sequence[float] | None, draft_length: int) -> None:
    if weights is None:
        return
    if len(weights) != draft_length or min(weights) < 0 or not sum(weights) > 0:
        raise ValueError(
            f"diff_offset_weights={list(weights)}: give one weight >= 0 per position of a block "
            f"(draft_length={draft_length}: {draft_length} numbers), not all 0, "
            f"e.g. {[1.0] * draft_length} (uniform, the default)."
        )


def hybrid_loss(
    logits: torch.Tensor,
    ar_labels: torch.Tensor,
    diff_labels: torch.Tensor,
    alpha: float,
    draft_length: int,
    *,
    distill_weight: float = 0.0,
    distill_temperature: float = 1.0,
    teacher_logits: torch.Tensor | None = None,
    offset_weights: Sequence[float] | None = None,
    anchor_weight: float = 0.0,
    anchor_logits: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """logits: (B, 2S, V) over the doubled sequence; labels: (B, S) each (see layout.train_labels).

    Returns loss, loss_ar, loss_diff (each term a mean over its own positions), the diffusion
    top-1 accuracy by offset inside the block, `acc_diff_{i}` (against the text), and
    `agree_ar_{i}`, how often the diffusion argmax equals the AR head's argmax for the same token:
    under greedy verification a draft is accepted exactly when it does, so this is the acceptance
    proxy.

    Distillation (docs/method.md §2): mask slot `S + i` predicts `x_i`, and clean slot `i - 1`
    already gives the AR distribution for `x_i`. With `distill_weight = w > 0` the diffusion term
    becomes `(1 - w) * L_Diff + w * L_Distill`, where `L_Distill` is the mean over diffusion slots
    of `KL(softmax(teacher / T) || softmax(diff))`, the teacher being `teacher_logits` (B, S, V; the
    frozen base model's AR logits of the clean half) or, if None, this forward's own clean half. The
    teacher is detached: the AR half learns only from `L_AR`. A slot with no AR prediction for its
    token (the first of a chunk or of a document) keeps its hard label in `L_Distill`. `loss_diff`
    stays the hard cross-entropy, comparable across recipes; `loss_distill` is logged beside it.

    `offset_weights` (one per position in a block; None = uniform) weight the diffusion term by a
    slot's offset: it becomes sum_i w[i % k] * l_i / sum_i w[i % k] over the valid slots, so uniform
    weights of any scale give the plain mean. The logged `loss_diff` / `loss_distill` stay
    unweighted (comparable across recipes); only `loss`, the objective, carries the weights.

    Anchoring (`anchor_weight = a > 0`, with `anchor_logits`: the frozen base model's AR logits of
    the clean half, B x S x V): the AR term becomes `(1 - a) * L_AR + a * L_Anchor`, where
    `L_Anchor` is the mean over AR positions of `KL(softmax(base) || softmax(AR))`. The AR half is
    then pulled toward the base model's own distribution instead of (a = 1: rather than) the
    training text, so it keeps the base's quality while the diffusion half learns; `loss_ar` stays
    the hard cross-entropy, `loss_anchor` is logged beside it.

    An AR term with no target at all (every label ignored) is 0, not NaN: a chunk made only of text
    excluded from the AR loss trains the diffusion half alone.
    """
    if alpha < 0:
        raise ValueError(f"alpha={alpha}: the AR weight must be >= 0 (the paper uses 1.0).")
    check_distill(distill_weight, distill_temperature)
    check_offset_weights(offset_weights, draft_length)
    check_anchor(anchor_weight)
    if anchor_weight > 0 and anchor_logits is None:
        raise ValueError(
            f"anchor_weight={anchor_weight} needs the base model's AR logits (anchor_logits); "
            "the module computes them with LoRA (lora_r > 0)."
        )
    S = ar_labels.shape[1]
    ar_logits, diff_logits = logits[:, :S], logits[:, S:]
    ar_sum = F.cross_entropy(
        ar_logits.flatten(0, 1).float(),
        ar_labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    loss_ar = ar_sum / (ar_labels != IGNORE_INDEX).sum().clamp(min=1)
    hard = F.cross_entropy(
        diff_logits.flatten(0, 1).float(),
        diff_labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view_as(diff_labels)
    valid = diff_labels != IGNORE_INDEX
    offset = torch.arange(S, device=logits.device) % draft_length
    loss_diff = mean_over(hard, valid.float())
    # The objective's per-slot weights: the offset's weight on valid slots (plain validity when
    # uniform).
    slot_w = (
        valid.float()
        if offset_weights is None
        else torch.tensor(offset_weights, dtype=torch.float32, device=logits.device)[offset] * valid
    )
    # Mask slot i (i >= 1) guesses x_i, which clean slot i - 1 predicts too (its AR label is x_i),
    # unless a document starts at i: then that AR label is ignored and the slot has no AR teacher.
    has_teacher = torch.zeros_like(valid)
    has_teacher[:, 1:] = (ar_labels[:, :-1] != IGNORE_INDEX) & valid[:, 1:]
    term_diff, extra = (loss_diff if offset_weights is None else mean_over(hard, slot_w)), {}
    if distill_weight > 0:
        teacher = logits[:, : S - 1] if teacher_logits is None else teacher_logits[:, : S - 1]
        per_slot = distill_per_slot(
            diff_logits, diff_labels, teacher, has_teacher, distill_temperature
        )
        extra["loss_distill"] = mean_over(per_slot, valid.float())
        term_distill = (
            extra["loss_distill"] if offset_weights is None else mean_over(per_slot, slot_w)
        )
        term_diff = (1 - distill_weight) * term_diff + distill_weight * term_distill
    term_ar = loss_ar
    if anchor_weight > 0:
        has_target = (ar_labels != IGNORE_INDEX).float()
        logp = anchor_logits.detach().float().log_softmax(-1)
        kl = F.kl_div(
            ar_logits.float().log_softmax(-1), logp, reduction="none", log_target=True
        ).sum(-1)
        extra["loss_anchor"] = mean_over(kl, has_target)
        term_ar = (1 - anchor_weight) * loss_ar + anchor_weight * extra["loss_anchor"]
    out = {
        "loss": (alpha * term_ar + term_diff) / (1 + alpha),
        "loss_ar": loss_ar,
        "loss_diff": loss_diff,
        **extra,
    }
    with torch.no_grad():
        diff_pred = diff_logits.argmax(-1)
        correct = (diff_pred == diff_labels).float()
        agree = torch.zeros_like(correct)
        agree[:, 1:] = (diff_pred[:, 1:] == ar_logits[:, :-1].argmax(-1)).float()
        for i in range(draft_length):
            sel = valid[:, offset == i].float()
            out[f"acc_diff_{i}"] = (correct[:, offset == i] * sel).sum() / sel.sum().clamp(min=1)
        for i in range(draft_length):
            sel = has_teacher[:, offset == i].float()
            out[f"agree_ar_{i}"] = (agree[:, offset == i] * sel).sum() / sel.sum().clamp(min=1)
    return out


def mean_over(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(weights * per_slot) / sum(weights); 0 where no slot has weight."""
    return (per_slot * weights).sum() / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


def distill_loss(
    diff_logits: torch.Tensor,
    diff_labels: torch.Tensor,
    teacher: torch.Tensor,
    has_teacher: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Mean over valid diffusion slots of KL(softmax(teacher / T) || softmax(diff)); see
    `distill_per_slot`."""
    return mean_over(
        distill_per_slot(diff_logits, diff_labels, teacher, has_teacher, temperature),
        (diff_labels != IGNORE_INDEX).float(),
    )


def distill_per_slot(
    diff_logits: torch.Tensor,
    diff_labels: torch.Tensor,
    teacher: torch.Tensor,
    has_teacher: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """(B, S): KL(softmax(teacher / T) || softmax(diff)) per diffusion slot (0 on invalid slots).

    diff_logits (B, S, V); teacher (B, S-1, V) is the AR prediction for slots 1..S-1 (detached
    here); has_teacher (B, S) marks the slots it applies to. The other valid slots use their hard
    label.

    KL rather than cross-entropy: the two differ by the teacher's entropy, a constant for the
    student, so the gradients are the same; KL is 0 exactly when the diffusion head reproduces the
    teacher, so `loss_distill` reads the same at every temperature and along training (CE would
    carry the teacher's own, varying, entropy). Only the teacher is tempered: the student keeps
    T = 1, the distribution decoding drafts from, so T -> 0 gives plain CE on the AR argmax (greedy
    acceptance) and T = 1 matches the AR distribution itself (what sampling verification accepts
    against).
    """
    valid = diff_labels != IGNORE_INDEX
    logq = diff_logits.float().log_softmax(-1)
    hard = -logq.gather(-1, diff_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    # finite even as T -> 0 (logits are)
    logp = (teacher.detach().float() / temperature).log_softmax(-1)
    kl = F.kl_div(logq[:, 1:], logp, reduction="none", log_target=True).sum(-1)
    per_slot = hard.clone()
    per_slot[:, 1:] = torch.where(has_teacher[:, 1:], kl, hard[:, 1:])
    return per_slot * valid
