"""Linear layers on CPU with their weights packed once, so that extra query slots are nearly free.

TiDAR rests on one fact about decoding: a forward of a few query slots costs about what a forward of
one slot costs, because reading the weights dominates. PyTorch's stock CPU linear breaks that on
the CPUs measured: its MKL path runs 1 to 3 rows as matrix-vector products and 4 or more through a
GEMM that is slow on so few rows (figures by machine: bench/LOG.md).

Two packed products, each made from the weight once and kept:
- **panels** (fp32 and bf16): the weight in panels of 32 outputs by all inputs, streamed once per
  call by a small C kernel (panel.py, csrc/panel.c) that does every row's multiply-adds on each
  piece while it is in cache and prefetches the next. Each output is one dot product summed over the
  inputs in order, whatever the row count, so a row's result is the same bit for bit alone or among
  any number of rows; panels therefore take every row count: an AR step's one row, a TiDAR step's
  few, a prefill's many (16 at a time). Built with the machine's C compiler (`cc`, or $CC;
  -march=native, OpenMP) into $TIDAR_CACHE/kernels on first use, once per CPU and compiler (its
  cost: docs/kernels.md); where no compiler builds it, fp32 and bf16 take oneDNN's product (or the
  stock one), with a warning saying so. In bf16 the panels are bf16 and each output is summed in
  fp32 and rounded once, with the same property.
- **onednn** (bf16, and fp32 without the panel kernel): each weight reordered once into oneDNN's
  blocked layout (what torch.compile's CPU freezing does). On AMX it makes bf16 nearly flat in the
  row count; in fp32 it is flat but slower than panels.

Which product runs is measured, not assumed: `packing_pays(model)` times a pass through the model's
linear layers at 1 and 8 rows on the stock product and on each of the dtype's `candidates`, once per
model and dtype, and `cpu_kernels(model, "auto")` (every generate() path) takes the fastest, keeping
only its copies; the times are `product_timings(model)`, what each layer took `model.tidar_products`
(docs/kernels.md). One choice per model, so every decoder on a model runs the same kernels.

Exact by construction where every linear layer takes panels (fp32 or bf16): attention then runs the
same library's kernel (`sdpa_exact`), whose output for a query depends only on that query and the
keys it sees, in order. Norms, activations and rotary embeddings are computed row by row. So a row
is computed with the same bits whether it is an AR step's one query, a verify row among a TiDAR
step's drafts and mask slots, a tree's sibling, or a batch row with holes in its cache: TiDAR's
greedy output is AR's (`generate(tidar=False)` on the same kernels) bit for bit, not only where AR's
best token leads by more than the low-bit noise between products. Where the products differ (stock,
oneDNN, attention transformers computes itself: eager families, softcapping, sinks) the two agree to
that noise (its size in fp32 logits: docs/kernels.md; far more in bf16), and a near-tie can pick
another token.

`packed_linears(model)` swaps every eligible `nn.Linear.forward` for the packed one while it is
entered. A layer's packed weight is kept while the layer lives (one more copy of its weight) and
made again when the weight changes (another tensor, or an in-place update); a model where packing
does not pay keeps none. Training and anything that needs gradients run the stock product.

`grouped_attention(model)`: under a mask, attention on CPU attends grouped key/value heads in place
(`enable_gqa`) instead of transformers' repeat_kv copy of the whole cache every layer and step.

Shipped in every export's custom_generate/ folder: torch and the standard library only.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .panel import attention as panel_attention
from .panel import panel_library, panel_linear, panel_pack
from .session import KernelState, session_of

# transformers' logger, as decode.py's: `transformers serve --log-level info` shows it
log = logging.getLogger("transformers.cli.tidar")
DTYPES = (torch.float32, torch.bfloat16)
PRODUCTS = ("panels", "onednn", "stock")  # the products a linear layer can take, packed first
PACK_ROWS = 8  # oneDNN's hint of the rows a call will have: a decoding step's slots
CHOICE_ROWS = (1, 8)  # the rows of an AR step and of a typical TiDAR step, timed with equal weight
# What the kernels keep lives in the model's decoding session (session.KernelState), by layer:
#   packed:       layer -> {kind: (weight key, packed weight)}. Beside the layer, not on it: an
#                 opaque oneDNN tensor on a module would break deepcopy, pickling and state_dict.
#                 One kind, except while packing_pays times them.
#   chosen:       layer -> (dtype, the packed kind it takes in that dtype)
#   delta_panels: layer -> (its adapter's B, B's panels)
#   timing:       (the linear layers' dtype and count, packing pays, the timings that said so)
# A layer may carry a mask-slot adapter (adapter.attach): its down-projection A (r, in) and its
# up-projection transposed (r, out) as buffers, and the model's gate, whose `start` is the first
# mask row of a batch-1 forward (None: none, or not one trailing block), and whose `add` adds the
# delta to a product's mask rows. The adapter's forward hook (marked DELTA_HOOK) adds it on the
# stock product; packed_linears sets that hook aside and packed_forward adds it instead, within the
# panel pass where it can (a hook's Python call per layer adds up to a noticeable share of a
# forward).
LORA_A, LORA_BT, LORA_GATE, DELTA_HOOK = (
    "tidar_lora_A",
    "tidar_lora_Bt",
    "_tidar_lora_gate",
    "_tidar_delta_hook",
)


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


def can_pack() -> bool:
    """Some packed product is here: oneDNN's, or the panel kernel (built on this first call)."""
    return available() or panel_library() is not None


def linear_layers(model) -> list:
    """The model's nn.Linear layers, in one walk of its modules: generate() enters cpu_kernels every
    call, and each of its parts walking the model again cost more than a short generation's
    host work."""
    return [module for module in model.modules() if isinstance(module, torch.nn.Linear)]


def eligible(layer) -> bool:
    w = getattr(layer, "weight", None)
    return (
        isinstance(layer, torch.nn.Linear)
        and w is not None
        and w.ndim == 2
        and w.device.type == "cpu"
        and w.dtype in DTYPES
    )


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The packed products a CPU layer of this dtype can take here, the default first: panels where
    the kernel builds (fp32 and bf16), oneDNN's for bf16, and for fp32 without the kernel."""
    kinds = ("panels",) if panel_library() is not None and dtype in DTYPES else ()
    if available() and (dtype == torch.bfloat16 or not kinds):
        kinds += ("onednn",)
    return kinds


def _pack(weight: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "panels" and panel_library() is not None:
        return panel_pack(weight)
    if kind == "onednn" and available():
        return _reorder(weight)
    raise RuntimeError(f"no {kind} product on this machine")


def _weight_key(w: torch.Tensor) -> tuple:
    """What a packed copy was made from: another tensor, an in-place update or a cast makes it
    stale."""
    return (w.data_ptr(), w._version, w.dtype, tuple(w.shape))


def chosen_kind(state: KernelState, layer) -> str | None:
    """The packed product the layer takes: what packing_pays chose for it in its dtype, else the
    dtype's default, kept (it is asked on every product of every step)."""
    dtype = layer.weight.dtype
    chosen = state.chosen.get(layer)
    if chosen is None or chosen[0] != dtype:
        chosen = state.chosen[layer] = (dtype, next(iter(candidates(dtype)), None))
    return chosen[1]


def packed_weight(
    state: KernelState, layer, kind: str | None = None
) -> tuple[str, torch.Tensor] | None:
    """The layer's weight packed for `kind` (default: chosen_kind), as ("panels" or "onednn", the
    packed tensor); None where there is no packed product or this machine's oneDNN refuses the
    weight (the layer then keeps the stock product)."""
    w = layer.weight
    kind = kind or chosen_kind(state, layer)
    if kind is None:
        return None
    key = _weight_key(w)
    kept = state.packed.setdefault(layer, {})
    cached = kept.get(kind)
    if cached is None or cached[0] != key:
        try:
            packed = (kind, _pack(w.detach(), kind))
        except RuntimeError:
            packed = None
        cached = kept[kind] = (key, packed)
    return cached[1]


def delta_panels(state: KernelState, layer) -> torch.Tensor:
    """The panels of the layer's adapter up-projection B (from its LORA_BT buffer), kept like its
    weight's."""
    bt = layer._buffers[LORA_BT]
    key = (bt.data_ptr(), bt._version)
    cached = state.delta_panels.get(layer)
    if cached is None or cached[0] != key:
        cached = state.delta_panels[layer] = (key, panel_pack(bt.t()))
    return cached[1]


def packed_product(
    state: KernelState, layer, x: torch.Tensor, bias: torch.Tensor | None, kind: str | None = None
) -> torch.Tensor:
    """The layer's packed product on x (the stock one where its weight has none). Panels take every
    row count, an AR step's one row and a prefill's many too: one product, so a row's result never
    depends on the rows beside it."""
    packed = packed_weight(state, layer, kind)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    kind, w = packed
    if kind == "panels":
        return panel_linear(x, w, layer.out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(
        x, w, None if bias is None else bias.detach(), "none", [], ""
    )


def packed_forward(state: KernelState, layer):
    """The layer's forward on its packed product. With a mask-slot adapter (LORA_GATE), the forward
    adds the delta itself (packed_linears sets the adapter's hook aside): in the panel pass for an
    fp32 batch-1 step's trailing mask rows, else (bf16 rows, other products, batches) with the
    gate's own `add` after the product."""
    gate = layer.__dict__.get(LORA_GATE)

    def product(x):
        w = layer.weight
        if (
            x.dtype != w.dtype
            or x.device != w.device
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            # the packed products have no backward and one dtype
            return F.linear(x, w, layer.bias)
        return packed_product(state, layer, x, layer.bias)

    if gate is None:
        product._tidar_packed = True
        return product

    def forward(x):
        if (
            gate.start is not None
            and x.ndim == 3
            and x.shape[0] == 1
            and x.dtype == torch.float32
            and not torch.is_grad_enabled()
        ):
            packed = packed_weight(state, layer)
            if packed is not None and packed[0] == "panels":
                return panel_linear(
                    x,
                    packed[1],
                    layer.out_features,
                    layer.bias,
                    (layer._buffers[LORA_A], delta_panels(state, layer), gate.start),
                )
        y = product(x)
        return gate.add(y, x, layer._buffers[LORA_A], layer._buffers[LORA_BT]) if gate.open else y

    forward._tidar_packed = True
    return forward


def pass_seconds(state: KernelState, layers, rows: int, product: str) -> float:
    """One pass of `rows` random rows through each layer on `product` ("stock" or a packed kind),
    one layer at a time, as a forward runs them."""
    # not torch's global one: a seeded generate() after this timing must sample as one without
    g = torch.Generator().manual_seed(0)
    inputs = {
        (n, dtype): torch.randn(rows, n, dtype=dtype, generator=g)
        for n, dtype in {(layer.in_features, layer.weight.dtype) for layer in layers}
    }
    start = time.perf_counter()
    for layer in layers:
        x = inputs[layer.in_features, layer.weight.dtype]
        if product == "stock":
            F.linear(x, layer.weight)
        else:
            packed_product(state, layer, x, None, product)
    return time.perf_counter() - start


def packing_pays(model, repeats: int = 3, layers: list | None = None) -> bool:
    """Whether a packed product beats PyTorch's stock one on this model's CPU linear layers and this
    machine, and which: one pass through them at each of CHOICE_ROWS on the stock product and on
    each of the dtype's `candidates`, the best of `repeats` runs of each, interleaved so the
    machine's load falls on all. The fastest (summed over the row counts) is the layers' product
    from then on; the others' packed copies are dropped. Timed once per model and dtype (again after
    a cast). A sharded model (FSDP) is not timed: stock. layers: linear_layers(model), where the
    caller has them."""
    # Plain tensors only: a sharded weight (FSDP's DTensor, a parameter by isinstance but not by
    # type) is whole only inside its forward.
    layers = [
        layer
        for layer in (linear_layers(model) if layers is None else layers)
        if eligible(layer) and type(layer.weight) in (torch.nn.Parameter, torch.Tensor)
    ]
    kinds = candidates(layers[0].weight.dtype) if layers else ()
    if not kinds:
        return False
    state = session_of(model).kernels
    key = (layers[0].weight.dtype, len(layers))
    cached = state.timing
    if cached is not None and cached[0] == key:
        return cached[1]
    products = ("stock", *kinds)
    best = {product: [float("inf")] * len(CHOICE_ROWS) for product in products}
    with torch.no_grad():
        for kind in kinds:
            # packs every weight (or learns that oneDNN refuses it), untimed
            pass_seconds(state, layers, 1, kind)
        for _ in range(repeats):
            for i, rows in enumerate(CHOICE_ROWS):
                for product in products:
                    seconds = pass_seconds(state, layers, rows, product)
                    best[product][i] = min(best[product][i], seconds)
    # a tie keeps the earlier: stock, then the default
    fastest = min(products, key=lambda product: sum(best[product]))
    for layer in layers:
        kept = state.packed.get(layer, {})
        for kind in [k for k in kept if k != fastest]:
            del kept[kind]
        if fastest != "stock":
            state.chosen[layer] = (layer.weight.dtype, fastest)
    pays = fastest != "stock"
    timings = {
        str(rows): {f"{product}_ms": 1e3 * best[product][i] for product in products}
        for i, rows in enumerate(CHOICE_ROWS)
    }
    state.timing = (key, pays, timings)
    return pays


def product_timings(model) -> dict | None:
    """What packing_pays compared on this model: {rows: {"stock_ms", "panels_ms", "onednn_ms"}} (the
    products it timed) for a pass through its linear layers at each of CHOICE_ROWS, best of its
    repeats; None before it timed them."""
    cached = session_of(model).kernels.timing
    return None if cached is None else cached[2]


def linear_product(model) -> str:
    """What generate()'s default runs on the model's CPU linear layers: "stock", or the packed kinds
    ("panels", "onednn", or both joined by "+")."""
    if not packing_pays(model):
        return "stock"
    state = session_of(model).kernels
    kinds = {
        packed[0]
        for layer in model.modules()
        if eligible(layer) and (packed := packed_weight(state, layer)) is not None
    }
    return "+".join(sorted(kinds)) or "stock"


def linear_products(model, packed: bool, layers: list | None = None) -> dict[str, int]:
    """How many of the model's linear layers take each product on a decoding step's rows, with
    packing on (`packed`) or off: {"panels": n, "onednn": n, "stock": n}, kinds no layer takes left
    out. A layer oneDNN refused, on a GPU or of another dtype counts as stock; one not packed yet
    (weights are packed at their first product) as what it will be packed as."""
    counts = dict.fromkeys(PRODUCTS, 0)
    state = session_of(model).kernels
    for layer in linear_layers(model) if layers is None else layers:
        counts[product_kind(state, layer) if packed and eligible(layer) else "stock"] += 1
    return {kind: n for kind, n in counts.items() if n}


def product_kind(state: KernelState, layer) -> str:
    """The product an eligible layer takes when packed: its packed weight's kind, without packing
    it."""
    kind = chosen_kind(state, layer)
    if kind == "panels":  # panels take every weight of their dtypes: no copy to look at
        return kind
    cached = state.packed.get(layer, {}).get(kind)
    if cached is not None and cached[0] == _weight_key(layer.weight):
        return "stock" if cached[1] is None else cached[1][0]
    return kind or "stock"


def report_products(model, products: dict[str, int]) -> dict[str, int]:
    """Set `model.tidar_products` to `products` (linear_products), and log it in one line when it
    changes: on a model's first generate(), and after a cast or a move that changes its products."""
    if getattr(model, "tidar_products", None) != products:
        weight = next(
            (layer.weight for layer in model.modules() if isinstance(layer, torch.nn.Linear)), None
        )
        where = (
            ""
            if weight is None
            else f" ({str(weight.dtype).removeprefix('torch.')} on {weight.device.type})"
        )
        log.info(
            "TiDAR linear products%s: %s",
            where,
            ", ".join(f"{n} layers {kind}" for kind, n in products.items()) or "no linear layers",
        )
    model.tidar_products = products
    return products


def resolve(model, enabled: bool | str, layers: list | None = None) -> bool:
    """True/False as given; "auto": packing_pays(model)."""
    if enabled == "auto":
        return packing_pays(model, layers=layers)
    if not isinstance(enabled, bool):
        raise ValueError(
            f"pack_weights={enabled!r}: use True, False or 'auto' "
            "(pack where it is measured faster)."
        )
    return enabled


@contextmanager
def packed_linears(model, enabled: bool = True, layers: list | None = None):
    """Within it, the model's CPU linear layers (fp32 or bf16) run their packed product. Nested
    or concurrent entries leave layers another entry swapped to it; what this one swapped it
    restores. layers: linear_layers(model), where the caller has them."""
    swapped, aside = [], {}
    if enabled and can_pack():
        state = session_of(model).kernels
        for layer in linear_layers(model) if layers is None else layers:
            if not eligible(layer):
                # moved to a GPU or another dtype: its CPU copies are dead weight
                state.packed.pop(layer, None)
                state.delta_panels.pop(layer, None)
            elif not getattr(layer.__dict__.get("forward"), "_tidar_packed", False):
                # an instance attribute, as `layer.forward = ...` makes it, without
                # Module.__setattr__'s lookups in the layer's parameters, buffers and children
                layer.__dict__["forward"] = packed_forward(state, layer)
                swapped.append(layer)
                # the packed forward adds the adapter's delta: its hook waits outside
                if LORA_GATE in layer.__dict__:
                    aside[layer] = {
                        key: hook
                        for key, hook in layer._forward_hooks.items()
                        if getattr(hook, DELTA_HOOK, False)
                    }
                    for key in aside[layer]:
                        del layer._forward_hooks[key]
    try:
        yield swapped
    finally:
        for layer in swapped:
            layer.__dict__.pop("forward", None)
        # back in registration order (a hook's key is its handle's rising id)
        for layer, hooks in aside.items():
            merged = sorted({**layer._forward_hooks, **hooks}.items())
            layer._forward_hooks.clear()
            layer._forward_hooks.update(merged)


def release(model) -> None:
    """Drop the packed copies kept for the model's layers (they are made again when next needed);
    the choice of product stays (session.reset forgets that too)."""
    state = session_of(model).kernels
    state.packed.clear()
    state.delta_panels.clear()


# --------------------------------------------------------------------------------------------
# Attention over grouped key/value heads without copying them.
# --------------------------------------------------------------------------------------------

GQA_ATTENTION = "tidar_sdpa_gqa"
EXACT_ATTENTION = "tidar_sdpa_exact"


def sdpa_gqa(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' `sdpa` attention function, except that on CPU, under a mask, with several
    queries and grouped key/value heads, the groups are attended in place. Anything else (no mask,
    one query, a position bias, softcapping, another device) goes to transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = key.shape[1] != query.shape[1]
    if (
        attention_mask is None
        or not grouped
        or query.shape[2] == 1
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


# What the C kernel does not compute: these go to sdpa_gqa (a position bias, softcapping, attention
# sinks, weights asked for).
NOT_EXACT = ("position_bias", "softcap", "s_aux", "sinks")


def exact_applies(query, key, value, attention_mask, dropout) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype
        and query.dtype in DTYPES
        and dropout == 0
        and query.shape[-1] % 16 == 0
        and value.shape[-1] == query.shape[-1]
        and query.shape[1] % key.shape[1] == 0
        and (attention_mask is None or attention_mask.dtype == torch.bool)
        and not torch.is_grad_enabled()
    )


def sdpa_exact(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """sdpa_gqa on the kernel library's attention (panel.attention): each query's output is a
    function of its query and the keys it sees alone, bit for bit, however many queries share the
    step and wherever in the cache its keys sit. With panels for every linear layer, a decoding
    step's row is then computed as an AR step computes it: TiDAR's verify rows equal AR's logits
    exactly. fp32 or bf16 (widened, exactly, and each output rounded once) on CPU, masks of bools
    (sdpa's); anything else goes to sdpa_gqa."""
    if (
        not exact_applies(query, key, value, attention_mask, dropout)
        or any(kwargs.get(name) is not None for name in NOT_EXACT)
        or kwargs.get("output_attentions")
    ):
        return sdpa_gqa(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # transformers' sdpa rule: causal for several queries without a mask (top-left, keys cropped to
    # the queries)
    causal = (
        query.shape[2] > 1
        and attention_mask is None
        and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dtype = query.dtype
    if dtype != torch.float32:
        query, key, value = query.float(), key.float(), value.float()
    return panel_attention(query, key, value, attention_mask, bool(causal), float(scale)).to(
        dtype
    ), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, function in ((GQA_ATTENTION, sdpa_gqa), (EXACT_ATTENTION, sdpa_exact)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)  # transformers' own masks stay sdpa's


@contextmanager
def grouped_attention(model, enabled: bool = True, exact: bool = False):
    """Within it, a CPU model on transformers' `sdpa` attention runs `sdpa_gqa` instead, or with
    `exact` `sdpa_exact`; restored on exit."""
    config = model.config
    parameter = next(model.parameters(), None)
    if (
        not enabled
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or parameter is None
        or parameter.device.type != "cpu"
    ):
        yield
        return
    _register()
    config._attn_implementation = (
        EXACT_ATTENTION if exact and panel_library() is not None else GQA_ATTENTION
    )
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@contextmanager
def cpu_kernels(model, enabled: bool | str = "auto"):
    """The kernels every decoder on an export runs: in-place grouped attention, and packed linear
    layers where enabled (True, or "auto" where packing_pays). False: neither, PyTorch's and
    transformers' own paths."""
    layers = linear_layers(model)
    packed = resolve(model, enabled, layers)
    products = linear_products(model, packed and can_pack(), layers)
    # One product for every row: panels on every linear layer, and attention that is the same per
    # query, so a row computes the same bits in any step (exactness by construction:
    # docs/kernels.md).
    exact = set(products) == {"panels"}
    with (
        packed_linears(model, packed, layers),
        grouped_attention(model, enabled is not False, exact=exact),
    ):
        report_products(model, products)
        yield packed
