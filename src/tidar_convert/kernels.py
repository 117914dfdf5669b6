"""Linear layers on CPU with their weights packed once for oneDNN, where that makes extra query slots nearly free.

TiDAR rests on one fact about decoding: a forward of a few query slots costs about what a forward of
one slot costs, because reading the weights dominates. PyTorch's stock CPU linear breaks that on some
machines. On a 2-core Xeon without AMX, its MKL path runs 2 or 3 rows as 2 or 3 matrix-vector
products and 4 to 13 rows through a GEMM that repacks the weights on every call: one forward of
SmolLM2-135M in fp32 (a 256-token cache) takes 59 ms for 1 slot, 96 ms for 2 and 93 ms for 8. With
each weight reordered once into oneDNN's blocked layout (what torch.compile's CPU freezing does), it
takes 44, 49 and 54 ms (bench/results/masks-greedy-600-fp32-packed.json). On a 2-core Xeon with AMX
and AVX-512 the stock product wins where it matters most: 35, 38 and 60 ms against 45, 44 and 55
(bench/results/best-tree-600-fp32.json, `points_stock` and `points`), so AR ran 1.29x faster there
without packing.

So which product runs is measured, not assumed: `packing_pays(model)` times one pass through the
model's linear layers at 1 row (an AR step) and at 8 rows (a TiDAR step) with each, once per model and
dtype: 13 passes that each read every weight once (about 0.5 s for SmolLM2-135M, in proportion to
the weights' size for larger models), holding one more copy of the weights while it times.
`cpu_kernels(model, "auto")`, what generate() enters for every path (TiDAR, plain AR, prompt
lookup), packs only where that pass is faster. One product for every row count, so every decoder
on a model runs the same kernels.

Neither product makes a row's result independent of how many rows share the call on every machine:
packed, it is on the Xeon without AMX (measured bitwise for 1 to 13 rows) but not on the one with AMX
(a 1536-input layer gives other low bits for 1 row than for 2 or more), and stock it is not on
either. Attention with one query and with several differ in the low bits too. So greedy TiDAR equals
greedy AR where the AR's best token leads by more than that noise, about 1e-4 in fp32 logits on
SmolLM2-135M: on every bench prompt so far, and checked by the greedy identity tests.

`packed_linears(model)` swaps every eligible `nn.Linear.forward` for the packed one while it is
entered. A layer's packed weight is kept while the layer lives (one more copy of its weight) and made
again when the weight changes (another tensor, or an in-place update); a model where packing does not
pay keeps none. Training and anything that needs gradients run the stock product.

`grouped_attention(model)` does the same for attention: under a mask, transformers' SDPA path copies
each layer's grouped key/value heads to every query head first (repeat_kv: the whole cache, every
layer, every step), because CUDA's kernels need it; PyTorch's CPU kernel attends the groups in place
(`enable_gqa`), to the same values. Every TiDAR step and every prompt-lookup step has a mask and
several queries.

Shipped in every export's custom_generate/ folder: imports nothing but torch (transformers, for the
attention function, only when it is used).
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)
PACK_ROWS = 8  # oneDNN's hint of the rows a call will have: a decoding step's slots
# layer -> (key, packed weight). Beside the layer, not on it: an opaque oneDNN tensor on a module
# would break deepcopy, pickling and state_dict; it goes with the layer.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
CHOICE_ROWS = (1, 8)  # the rows of an AR step and of a typical TiDAR step, timed with equal weight
_PAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its linear layers' dtype and count, packing pays)


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


def pass_seconds(layers, rows: int, packed: bool) -> float:
    """One pass of `rows` random rows through each layer, one product at a time, as a forward runs them."""
    inputs = {(n, dtype): torch.randn(rows, n, dtype=dtype) for n, dtype in {(layer.in_features, layer.weight.dtype) for layer in layers}}
    start = time.perf_counter()
    for layer in layers:
        x = inputs[layer.in_features, layer.weight.dtype]
        w = packed_weight(layer) if packed else None
        if w is None:
            F.linear(x, layer.weight)
        else:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return time.perf_counter() - start


def packing_pays(model, repeats: int = 3) -> bool:
    """Whether the packed product beats PyTorch's stock one on this model's CPU linear layers and this
    machine: one pass through them at each of CHOICE_ROWS, the best of `repeats` runs of each product,
    interleaved so the machine's load falls on both. Timed once per model and dtype (again after a
    cast); a model where packing does not pay drops its packed copies. A sharded model (FSDP) is not
    timed: stock."""
    # Plain tensors only: a sharded weight (FSDP's DTensor) is whole only inside its forward.
    layers = [layer for layer in model.modules() if eligible(layer) and type(layer.weight.data) is torch.Tensor]
    if not layers or not available():
        return False
    key = (layers[0].weight.dtype, len(layers))
    cached = _PAYS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    best = {False: [float("inf")] * len(CHOICE_ROWS), True: [float("inf")] * len(CHOICE_ROWS)}
    with torch.no_grad():
        pass_seconds(layers, 1, True)  # packs every weight (or learns that oneDNN refuses it), untimed
        for _ in range(repeats):
            for i, rows in enumerate(CHOICE_ROWS):
                for packed in (False, True):
                    best[packed][i] = min(best[packed][i], pass_seconds(layers, rows, packed))
    pays = sum(best[True]) < sum(best[False])
    if not pays:
        release(model)
    _PAYS[model] = (key, pays)
    return pays


def resolve(model, enabled: bool | str) -> bool:
    """True/False as given; "auto": packing_pays(model)."""
    if enabled == "auto":
        return packing_pays(model)
    if not isinstance(enabled, bool):
        raise ValueError(f"pack_weights={enabled!r}: use True, False or 'auto' (pack where it is measured faster).")
    return enabled


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
def cpu_kernels(model, enabled: bool | str = "auto"):
    """The kernels every decoder on an export runs: in-place grouped attention, and packed linear
    layers where enabled (True, or "auto" where packing_pays). False: neither, PyTorch's and
    transformers' own paths."""
    with packed_linears(model, resolve(model, enabled)), grouped_attention(model, enabled is not False):
        yield
