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

Shipped in every export's custom_generate/ folder: imports nothing but torch.
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
