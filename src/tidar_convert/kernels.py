"""Linear layers on CPU with their weights packed once for oneDNN, so extra query slots are nearly free.

TiDAR rests on one fact about decoding: a forward of a few query slots costs about what a forward of
one slot costs, because reading the weights dominates. PyTorch's stock CPU linear breaks that. Its
MKL path runs 2 or 3 rows as 2 or 3 matrix-vector products and 4 to 13 rows through a GEMM that
repacks the weights on every call. On SmolLM2-135M in fp32 (2 cores, a 256-token cache), one forward
takes 59 ms for 1 slot, 96 ms for 2 and 93 ms for 8. With each weight reordered once into oneDNN's
blocked layout (what torch.compile's CPU freezing does), it takes 44, 49 and 54 ms: the regime the
paper assumes, and a faster AR step too (bench/results/masks-greedy-600-fp32-packed.json,
slot_latency `points_stock` and `points`).

The packed product is also row-invariant: a row's result does not depend on how many rows share the
call (measured bitwise for 1 to 13 rows), so the rows TiDAR verifies compute what AR computes there.

`packed_linears(model)` swaps every eligible `nn.Linear.forward` for the packed one while it is
entered; `generate()` enters it for every path (TiDAR, plain AR, prompt lookup), so every decoder on a
model uses the same kernels. A layer's packed weight is kept while the layer lives (one more copy of its
weight) and made again when the weight changes (another tensor, or an in-place update). Training and
anything that needs gradients run the stock product.

`grouped_attention(model)` does the same for attention: under a mask, transformers' SDPA path copies
each layer's grouped key/value heads to every query head first (repeat_kv: the whole cache, every
layer, every step), because CUDA's kernels need it; PyTorch's CPU kernel attends the groups in place
(`enable_gqa`), to the same bits. Every TiDAR step and every prompt-lookup step has a mask and
several queries.

Shipped in every export's custom_generate/ folder: imports nothing but torch (transformers, for the
attention function, only when it is used).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)
PACK_ROWS = 8  # oneDNN's hint of the rows a call will have: a decoding step's slots
# layer -> (key, packed weight). Beside the layer, not on it: an opaque oneDNN tensor on a module
# would break deepcopy, pickling and state_dict; it goes with the layer.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def available() -> bool:
    """oneDNN's packed linear ops are in this torch build."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight
        torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    return True


def eligible(layer) -> bool:
    w = getattr(layer, "weight", None)
    return isinstance(layer, torch.nn.Linear) and w is not None and w.ndim == 2 and w.device.type == "cpu" and w.dtype in DTYPES


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def packed_weight(layer) -> torch.Tensor | None:
    """The layer's weight packed for oneDNN, or None where this machine's oneDNN refuses it (the
    layer then keeps the stock product)."""
    w = layer.weight
    key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
    cached = _PACKED.get(layer)
    if cached is None or cached[0] != key:
        try:
            packed = _reorder(w.detach())
        except RuntimeError:
            packed = None
        cached = _PACKED[layer] = (key, packed)
    return cached[1]


def packed_forward(layer):
    def forward(x):
        w = layer.weight
        if x.dtype != w.dtype or x.device != w.device or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return F.linear(x, w, layer.bias)  # the packed op has no backward and one dtype
        packed = packed_weight(layer)
        if packed is None:
            return F.linear(x, w, layer.bias)
        bias = layer.bias.detach() if layer.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    forward._tidar_packed = True
    return forward


@contextmanager
def packed_linears(model, enabled: bool = True):
    """Within it, the model's CPU linear layers (fp32 or bf16) run oneDNN's packed product. Nested
    or concurrent entries leave layers another entry swapped to it; what this one swapped it restores."""
    swapped = []
    if enabled and available():
        for layer in model.modules():
            if not eligible(layer):
                _PACKED.pop(layer, None)  # moved to a GPU or another dtype: its CPU copy is dead weight
            elif not getattr(layer.__dict__.get("forward"), "_tidar_packed", False):
                layer.forward = packed_forward(layer)
                swapped.append(layer)
    try:
        yield swapped
    finally:
        for layer in swapped:
            del layer.forward


def release(model) -> None:
    """Drop the packed copies kept on the model's layers (they are made again when next needed)."""
    for layer in model.modules():
        _PACKED.pop(layer, None)


# --------------------------------------------------------------------------------------------
# Attention over grouped key/value heads without copying them.
# --------------------------------------------------------------------------------------------

GQA_ATTENTION = "tidar_sdpa_gqa"


def sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa` attention function, except that on CPU, under a mask, with several
    queries and grouped key/value heads, the groups are attended in place. Anything else (no mask,
    one query, a position bias, softcapping, another device) goes to transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = key.shape[1] != query.shape[1]
    if attention_mask is None or not grouped or query.shape[2] == 1 or query.device.type != "cpu" or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, sdpa_gqa)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # transformers' own masks stay sdpa's


@contextmanager
def grouped_attention(model, enabled: bool = True):
    """Within it, a CPU model on transformers' `sdpa` attention runs `sdpa_gqa` instead; restored on exit."""
    config = model.config
    parameter = next(model.parameters(), None)
    if not enabled or getattr(config, "_attn_implementation", None) != "sdpa" or parameter is None or parameter.device.type != "cpu":
        yield
        return
    _register()
    config._attn_implementation = GQA_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@contextmanager
def cpu_kernels(model, enabled: bool = True):
    """Packed linear layers and in-place grouped attention: the kernels every decoder on an export runs."""
    with packed_linears(model, enabled), grouped_attention(model, enabled):
        yield
