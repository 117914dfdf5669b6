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

from tidar_convert.runtime.adapter import ADAPTER_FILE, GATE_ATTR, install_gate

SCOPES = ("all", "masks")
ADAPTER = "default"  # PEFT's name for the one adapter


def check_scope(scope: str, lora_r: int) -> None:
    if scope not in SCOPES:
        raise ValueError(
            f"lora_scope={scope!r}: choose 'all' (adapters on every row, the paper) "
            "or 'masks' (mask slots only: the AR half stays the base model)."
        )
    if scope == "masks" and lora_r <= 0:
        raise ValueError(
            f"lora_scope='masks' with lora_r={lora_r}: the mask-slot adapters are LoRA; "
            "set lora_r > 0 (e.g. 64)."
        )


def add_lora(model, r: int, alpha: int, mask_token_id: int, scope: str = "all"):
    """PEFT LoRA of rank r on every linear layer. scope='all': the mask token's embedding row is
    trained too. scope='masks': the LoRA branch acts on mask rows only, and the embedding stays as
    it is: with tied embeddings its mask row is also the AR head's mask-token logit, which must stay
    the base's (the first layers' adapters see the mask embedding and can move it as far as a
    trained row would)."""
    from peft import LoraConfig, get_peft_model

    tokens = (
        {"trainable_token_indices": {"embed_tokens": [mask_token_id]}} if scope == "all" else {}
    )
    targets = in_order_linears(model) if scope == "masks" and out_of_order(model) else "all-linear"
    model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **tokens)
    )
    if scope == "masks":
        gate_to_masks(model, mask_token_id)
    return model


def out_of_order(model) -> list[str]:
    """Every module inside a mixture of experts: its router, experts and shared experts run on the
    tokens flattened to (B * T, H) or gathered per expert, not as (B, T, H). The mask-slot gate
    picks rows by their place in (B, T), so under lora_scope='masks' these get no adapter: on them
    it would move real tokens' routes and expert outputs, and the AR half would no longer be the
    base's."""
    # the mixture blocks
    roots = [
        name
        for name, module in model.named_modules()
        if name and isinstance(getattr(module, "experts", None), torch.nn.Module)
    ]
    return [
        name
        for name, _ in model.named_modules()
        if any(name == r or name.startswith(r + ".") for r in roots)
    ]


def in_order_linears(model) -> list[str]:
    """What "all-linear" adapts, less the mixtures of experts (out_of_order). PEFT's "all-linear"
    also wraps a mixture's fused experts and its router, whatever exclude_modules says: a list does
    not."""
    from transformers.pytorch_utils import Conv1D

    skip, head = set(out_of_order(model)), model.get_output_embeddings()
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, (torch.nn.Linear, Conv1D)) and name not in skip and m is not head
    ]


def lora_layers(model):
    """(name without PEFT's prefix, layer) of every LoRA-adapted layer."""
    for name, module in model.named_modules():
        if (
            hasattr(module, "lora_B")
            and isinstance(module.lora_B, torch.nn.ModuleDict)
            and ADAPTER in module.lora_B
        ):
            yield name.removeprefix("base_model.model."), module


def gate_to_masks(model, mask_token_id: int) -> None:
    gate = install_gate(model, mask_token_id)
    for _, layer in lora_layers(model):
        layer.lora_B[ADAPTER].register_forward_hook(
            lambda module, args, out: out * gate.weights(out)
        )


def is_mask_scoped(model) -> bool:
    return getattr(model, GATE_ATTR, None) is not None and any(True for _ in lora_layers(model))


# Share of each delta's squared norm (B @ A) an export keeps. The trained deltas are nearly low-rank
# (a small share of the singular values holds nearly all of each layer type's norm), and at decode
# the adapter is read from memory on every forward with mask groups: at the trained rank it is a
# noticeable share of the decoder's bytes and of a step's time on a CPU. 0.99 keeps a fraction of
# the parameters, and the diffusion drafts' T/NFE on the bench prompts barely moved (the
# measurements: bench/LOG.md, 2026-12-01, "Compressed adapters").
ADAPTER_ENERGY = 0.99


# Share of the adapted layers an export keeps, the ones whose delta moves their weight most
# (||B A|| / ||W||, Frobenius). Each adapted layer costs a decoding step with mask rows about the
# same whatever its rank: small products between the big ones. Dropping the weakest quarter left
# the diffusion drafts' T/NFE on the bench prompts where it was, in fp32 and bf16; dropping more
# lowered it (the measurements: bench/LOG.md, 2026-12-02, "the strongest 75 % of adapter layers").
ADAPTER_LAYERS = 0.75


def check_energy(energy: float) -> None:
    if not 0 < energy <= 1:
        raise ValueError(
            f"adapter_energy={energy}: must be in (0, 1], the share of each adapter delta's "
            "squared norm the export keeps (1.0 = the trained rank, 0.99 the default)."
        )


def check_layers(share: float) -> None:
    if not 0 < share <= 1:
        raise ValueError(
            f"adapter_layers={share}: must be in (0, 1], the share of adapted layers the export "
            f"keeps, strongest first (1.0 = all, {ADAPTER_LAYERS} the default)."
        )


def check_adapter_options(
    adapter_energy: float | None, adapter_layers: float | None, mask_scoped: bool, what: str
) -> None:
    """Refuse adapter_energy / adapter_layers for a model with no mask-slot adapter to compress:
    they would be ignored (`what`: the model's training, as the user knows it)."""
    given = [
        f"adapter_{name}={value}"
        for name, value in (("energy", adapter_energy), ("layers", adapter_layers))
        if value is not None
    ]
    if given and not mask_scoped:
        raise ValueError(
            f"{' and '.join(given)}: {what} has no mask-slot adapter to compress "
            "(only lora_scope='masks' keeps one apart; "
            "any other LoRA is merged into the weights, and a full fine-tune has none); "
            "leave out --adapter_energy and --adapter_layers."
        )


def strongest(
    tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], share: float
) -> dict[str, torch.Tensor]:
    """The deltas (attach's '<layer>.lora_A' / '.lora_B') of the `share` of layers, at least one,
    whose delta is largest against their weight: ||B A|| / ||W||."""
    check_layers(share)
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    strength = {
        n: float(
            torch.linalg.norm(tensors[f"{n}.lora_B"] @ tensors[f"{n}.lora_A"])
            / torch.linalg.norm(weights[n].float())
        )
        for n in names
    }
    keep = set(sorted(names, key=lambda n: -strength[n])[: max(1, round(share * len(names)))])
    return {key: t for key, t in tensors.items() if key.rsplit(".", 1)[0] in keep}


def compress(A: torch.Tensor, B: torch.Tensor, energy: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (A', B') of the best low-rank approximation of B @ A (truncated SVD) with the fewest
    singular values that hold `energy` of its squared norm; energy 1.0 returns A, B as they are."""
    if energy >= 1:
        return A, B
    qa, ra = torch.linalg.qr(A.T)  # B @ A = qb (rb @ ra.T) qa.T: the SVD of an r x r core
    qb, rb = torch.linalg.qr(B)
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    power = s.square()
    total = float(power.sum())
    rank = 1 if total == 0 else min(len(s), int((power.cumsum(0) < energy * total).sum()) + 1)
    return (vh[:rank] @ qa.T).contiguous(), (qb @ u[:, :rank] * s[:rank]).contiguous()


def split_mask_adapter(
    model, energy: float = ADAPTER_ENERGY, layers: float = ADAPTER_LAYERS
) -> dict[str, torch.Tensor]:
    """For export under scope 'masks': the deltas as adapter.attach reads them (scaling folded into
    B, float32, compressed to `energy`) of the `layers` share of layers they move most
    (`strongest`), and the model's LoRA B zeroed so that merging leaves the base weights as they
    were (the mask token's trained embedding row still merges)."""
    check_energy(energy)
    check_layers(layers)
    tensors, weights = {}, {}
    with torch.no_grad():
        for name, layer in lora_layers(model):
            A, B = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            A_, B_ = compress(
                A.detach().float().cpu(), B.detach().float().cpu() * layer.scaling[ADAPTER], energy
            )
            tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"] = A_.contiguous(), B_.contiguous()
            weights[name] = layer.get_base_layer().weight.detach().cpu()
            B.zero_()
    return strongest(tensors, weights, layers)


# The folder PEFT's own save_pretrained writes, inside an export of a LoRA run (lora_scope='all'):
# PeftModel.from_pretrained(base, "<export>/adapter") takes it.
PEFT_FOLDER = "adapter"


def token_rows(model, tokenizer) -> dict[str, list[int]]:
    """The embedding rows a PEFT adapter of a conversion must carry, by module name (PEFT's
    trainable_token_indices): the mask and pad tokens'. load_base adds them (mean-resized, the mask
    row then trained under lora_scope='all'); a base resized by its user has other values there.
    An untied head's rows too: they were added the same way."""
    rows = sorted({tokenizer.mask_token_id, tokenizer.pad_token_id} - {None})
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    out = {names[id(model.get_input_embeddings())]: rows}
    head = model.get_output_embeddings()
    if head is not None and not getattr(model.config, "tie_word_embeddings", False):
        out[names[id(head)]] = rows
    return out


def peft_adapter(model, tokenizer, base: str):
    """(LoraConfig, LoRA tensors) of a PEFT model trained under lora_scope='all', as PEFT saves
    them, read before merging. Its config names `base` and the token rows (token_rows) instead of
    the mask row alone; the rows' values come after merging (`adapter_token_rows`)."""
    import copy

    from peft import get_peft_model_state_dict

    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = base
    config.inference_mode = True
    inner = model.get_base_model()
    config.trainable_token_indices = token_rows(inner, tokenizer)
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return config, {k: v for k, v in state.items() if "token_adapter" not in k}


def adapter_token_rows(merged, rows: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The merged model's values of the token rows, under PEFT's names for them."""
    modules = {n.rsplit(".", 1)[-1]: n for n, _ in merged.named_modules() if n}
    out = {}
    for short, ids in rows.items():
        name = modules[short]
        weight = merged.get_submodule(name).weight.detach()
        out[f"base_model.model.{name}.token_adapter.trainable_tokens_delta"] = weight[ids].clone()
    return out


__all__ = [
    "PEFT_FOLDER",
    "ADAPTER_ENERGY",
    "ADAPTER_FILE",
    "ADAPTER_LAYERS",
    "SCOPES",
    "add_lora",
    "check_adapter_options",
    "check_energy",
    "check_layers",
    "check_scope",
    "compress",
    "adapter_token_rows",
    "gate_to_masks",
    "is_mask_scoped",
    "peft_adapter",
    "split_mask_adapter",
    "strongest",
    "token_rows",
]
