"""The hybrid TiDAR loss: L = (alpha * L_AR + L_Diff) / (1 + alpha)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import IGNORE_INDEX


def hybrid_loss(logits: torch.Tensor, ar_labels: torch.Tensor, diff_labels: torch.Tensor, alpha: float, block_size: int) -> dict[str, torch.Tensor]:
    """logits: (B, 2S, V) over the doubled sequence; labels: (B, S) each (see layout.train_labels).

    Returns loss, loss_ar, loss_diff (each term a mean over its own positions) and the diffusion
    top-1 accuracy by offset inside the block, `acc_diff_{i}`: the cheap proxy for how deep drafts
    will be accepted.
    """
    if alpha < 0:
        raise ValueError(f"alpha={alpha}: the AR weight must be >= 0 (the paper uses 1.0).")
    S = ar_labels.shape[1]
    ar_logits, diff_logits = logits[:, :S], logits[:, S:]
    loss_ar = F.cross_entropy(ar_logits.flatten(0, 1).float(), ar_labels.flatten(), ignore_index=IGNORE_INDEX)
    loss_diff = F.cross_entropy(diff_logits.flatten(0, 1).float(), diff_labels.flatten(), ignore_index=IGNORE_INDEX)
    out = {"loss": (alpha * loss_ar + loss_diff) / (1 + alpha), "loss_ar": loss_ar, "loss_diff": loss_diff}
    with torch.no_grad():
        correct = (diff_logits.argmax(-1) == diff_labels).float()
        valid = (diff_labels != IGNORE_INDEX).float()
        offset = torch.arange(S, device=logits.device) % block_size
        for i in range(block_size):
            sel = valid[:, offset == i]
            out[f"acc_diff_{i}"] = (correct[:, offset == i] * sel).sum() / sel.sum().clamp(min=1)
    return out
