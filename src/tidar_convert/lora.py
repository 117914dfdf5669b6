"""LoRA for a conversion (PEFT), and its 'masks' scope: adapters that act on mask slots only.

lora_scope='all' (the paper's setting, one set of weights for both halves): PEFT's LoRA on every
linear layer, merged into the weights at export.

lora_scope='masks': the same PEFT LoRA, with its branch multiplied by the model's gate (adapter.py):
one on mask rows, zero on every real token's row. The clean half is then the base model exactly
(no gradient reaches it, no loss can move it), so the converted model writes what the base writes;
the diffusion half gets the adapters' whole capacity. At export the deltas are saved apart
(adapter.ADAPTER_FILE) and added back on mask rows by the shipped adapter.attach.
"""

from __future__ import annotations

import torch

from .adapter import ADAPTER_FILE, GATE_ATTR, install_gate

SCOPES = ("all", "masks")
ADAPTER = "default"  # PEFT's name for the one adapter


def check_scope(scope: str, lora_r: int) -> None:
    if scope not in SCOPES:
        raise ValueError(f"lora_scope={scope!r}: choose 'all' (adapters on every row, the paper) or 'masks' (mask slots only: the AR half stays the base model).")
    if scope == "masks" and lora_r <= 0:
        raise ValueError(f"lora_scope='masks' with lora_r={lora_r}: the mask-slot adapters are LoRA; set lora_r > 0 (e.g. 64).")


def add_lora(model, r: int, alpha: int, mask_token_id: int, scope: str = "all"):
    """PEFT LoRA of rank r on every linear layer. scope='all': the mask token's embedding row is trained
    too. scope='masks': the LoRA branch acts on mask rows only, and the embedding stays as it is: with
    tied embeddings its mask row is also the AR head's mask-token logit, which must stay the base's
    (the first layers' adapters see the mask embedding and can move it as far as a trained row would)."""
    from peft import LoraConfig, get_peft_model

    tokens = {"trainable_token_indices": {"embed_tokens": [mask_token_id]}} if scope == "all" else {}
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", **tokens))
    if scope == "masks":
        gate_to_masks(model, mask_token_id)
    return model


def lora_layers(model):
    """(name without PEFT's prefix, layer) of every LoRA-adapted layer."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_B") and isinstance(module.lora_B, torch.nn.ModuleDict) and ADAPTER in module.lora_B:
            yield name.removeprefix("base_model.model."), module


def gate_to_masks(model, mask_token_id: int) -> None:
    gate = install_gate(model, mask_token_id)
    for _, layer in lora_layers(model):
        layer.lora_B[ADAPTER].register_forward_hook(lambda module, args, out: out * gate.weights(out))


def is_mask_scoped(model) -> bool:
    return getattr(model, GATE_ATTR, None) is not None and any(True for _ in lora_layers(model))


def split_mask_adapter(model) -> dict[str, torch.Tensor]:
    """For export under scope 'masks': the deltas as adapter.attach reads them (scaling folded into B,
    float32), and the model's LoRA B zeroed so that merging leaves the base weights as they were
    (the mask token's trained embedding row still merges)."""
    tensors = {}
    with torch.no_grad():
        for name, layer in lora_layers(model):
            A, B = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            tensors[f"{name}.lora_A"] = A.detach().float().cpu().contiguous()
            tensors[f"{name}.lora_B"] = (B.detach().float() * layer.scaling[ADAPTER]).cpu().contiguous()
            B.zero_()
    return tensors


__all__ = ["ADAPTER_FILE", "SCOPES", "add_lora", "check_scope", "gate_to_masks", "is_mask_scoped", "split_mask_adapter"]
