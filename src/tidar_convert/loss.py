"""The hybrid TiDAR loss: L = (alpha * L_AR + L_Diff) / (1 + alpha), optionally distilling the AR head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import IGNORE_INDEX

TEACHERS = ("self", "base")


def check_distill(distill_weight: float, distill_temperature: float, teacher: str = "self") -> None:
    """One-line errors for the distillation settings (docs/method.md §2)."""
    if not 0 <= distill_weight <= 1:
        raise ValueError(f"distill_weight={distill_weight}: must be in [0, 1] (0 = hard labels only, 1 = AR soft targets only).")
    if not distill_temperature > 0:
        raise ValueError(f"distill_temperature={distill_temperature}: must be > 0 (1.0 = the AR distribution as is; near 0 = its argmax).")
    if teacher not in TEACHERS:
        raise ValueError(f"teacher={teacher!r}: use 'self' (the model's own AR head) or 'base' (the frozen base model, LoRA only).")


def hybrid_loss(
    logits: torch.Tensor,
    ar_labels: torch.Tensor,
    diff_labels: torch.Tensor,
    alpha: float,
    block_size: int,
    distill_weight: float = 0.0,
    distill_temperature: float = 1.0,
    teacher_logits: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """logits: (B, 2S, V) over the doubled sequence; labels: (B, S) each (see layout.train_labels).

    Returns loss, loss_ar, loss_diff (each term a mean over its own positions), the diffusion
    top-1 accuracy by offset inside the block, `acc_diff_{i}` (against the text), and `agree_ar_{i}`,
    how often the diffusion argmax equals the AR head's argmax for the same token: under greedy
    verification a draft is accepted exactly when it does, so this is the acceptance proxy.

    Distillation (docs/method.md §2): mask slot `S + i` predicts `x_i`, and clean slot `i - 1` already
    gives the AR distribution for `x_i`. With `distill_weight = w > 0` the diffusion term becomes
    `(1 - w) * L_Diff + w * L_Distill`, where `L_Distill` is the mean over diffusion slots of
    `KL(softmax(teacher / T) || softmax(diff))`, the teacher being `teacher_logits` (B, S, V; the
    frozen base model's AR logits of the clean half) or, if None, this forward's own clean half. The
    teacher is detached: the AR half learns only from `L_AR`. A slot with no AR prediction for its
    token (the first of a chunk or of a document) keeps its hard label in `L_Distill`. `loss_diff`
    stays the hard cross-entropy, comparable across recipes; `loss_distill` is logged beside it.
    """
    if alpha < 0:
        raise ValueError(f"alpha={alpha}: the AR weight must be >= 0 (the paper uses 1.0).")
    check_distill(distill_weight, distill_temperature)
    S = ar_labels.shape[1]
    ar_logits, diff_logits = logits[:, :S], logits[:, S:]
    loss_ar = F.cross_entropy(ar_logits.flatten(0, 1).float(), ar_labels.flatten(), ignore_index=IGNORE_INDEX)
    loss_diff = F.cross_entropy(diff_logits.flatten(0, 1).float(), diff_labels.flatten(), ignore_index=IGNORE_INDEX)
    valid = diff_labels != IGNORE_INDEX
    # Mask slot i (i >= 1) guesses x_i, which clean slot i - 1 predicts too (its AR label is x_i), unless
    # a document starts at i: then that AR label is ignored and the slot has no AR teacher.
    has_teacher = torch.zeros_like(valid)
    has_teacher[:, 1:] = (ar_labels[:, :-1] != IGNORE_INDEX) & valid[:, 1:]
    term_diff, extra = loss_diff, {}
    if distill_weight > 0:
        teacher = logits[:, : S - 1] if teacher_logits is None else teacher_logits[:, : S - 1]
        extra["loss_distill"] = distill_loss(diff_logits, diff_labels, teacher, has_teacher, distill_temperature)
        term_diff = (1 - distill_weight) * loss_diff + distill_weight * extra["loss_distill"]
    out = {"loss": (alpha * loss_ar + term_diff) / (1 + alpha), "loss_ar": loss_ar, "loss_diff": loss_diff, **extra}
    with torch.no_grad():
        diff_pred = diff_logits.argmax(-1)
        correct = (diff_pred == diff_labels).float()
        agree = torch.zeros_like(correct)
        agree[:, 1:] = (diff_pred[:, 1:] == ar_logits[:, :-1].argmax(-1)).float()
        offset = torch.arange(S, device=logits.device) % block_size
        for i in range(block_size):
            sel = valid[:, offset == i].float()
            out[f"acc_diff_{i}"] = (correct[:, offset == i] * sel).sum() / sel.sum().clamp(min=1)
        for i in range(block_size):
            sel = has_teacher[:, offset == i].float()
            out[f"agree_ar_{i}"] = (agree[:, offset == i] * sel).sum() / sel.sum().clamp(min=1)
    return out


def distill_loss(diff_logits: torch.Tensor, diff_labels: torch.Tensor, teacher: torch.Tensor, has_teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over valid diffusion slots of KL(softmax(teacher / T) || softmax(diff)).

    diff_logits (B, S, V); teacher (B, S-1, V) is the AR prediction for slots 1..S-1 (detached here);
    has_teacher (B, S) marks the slots it applies to. The other valid slots use their hard label.

    KL rather than cross-entropy: the two differ by the teacher's entropy, a constant for the
    student, so the gradients are the same; KL is 0 exactly when the diffusion head reproduces the
    teacher, so `loss_distill` reads the same at every temperature and along training (CE would carry
    the teacher's own, varying, entropy). Only the teacher is tempered: the student keeps T = 1, the
    distribution decoding drafts from, so T -> 0 gives plain CE on the AR argmax (greedy acceptance)
    and T = 1 matches the AR distribution itself (what sampling verification accepts against).
    """
    valid = diff_labels != IGNORE_INDEX
    logq = diff_logits.float().log_softmax(-1)
    hard = -logq.gather(-1, diff_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = (teacher.detach().float() / temperature).log_softmax(-1)  # finite even as T -> 0 (logits are)
    kl = F.kl_div(logq[:, 1:], logp, reduction="none", log_target=True).sum(-1)
    per_slot = hard.clone()
    per_slot[:, 1:] = torch.where(has_teacher[:, 1:], kl, hard[:, 1:])
    return (per_slot * valid).sum() / valid.sum().clamp(min=1)
