"""Forward latency against query slots, and where each decoder's mean step sits on that curve.

A forward costs about the same for 1 or many new tokens until compute, not memory traffic,
dominates; TiDAR lives in that flat part, and this curve shows how far it reaches on a machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from tidar_convert.bench.decoders import DECODERS
from tidar_convert.bench.timing import median_seconds
from tidar_convert.runtime import layout
from tidar_convert.runtime.forward import cache_kwargs
from tidar_convert.runtime.kernels import cpu_kernels
from tidar_convert.train.progress import progress

CPU_SLOTS = (1, 2, 4, 8, 16, 32, 64)
GPU_SLOTS = CPU_SLOTS + (128, 256, 512)
SLOT_CACHE_LEN = 256
# the usual draft lengths, whose full TiDAR step (k + k*k slots) the curve includes
STEP_KS = (2, 4, 8)


def slot_sizes(device: torch.device, k: int) -> list[int]:
    sizes = GPU_SLOTS if device.type == "cuda" else CPU_SLOTS
    return sorted(set(sizes) | {kk + kk * kk for kk in (*STEP_KS, k)})


def slot_latency(
    model,
    slots: Iterable[int],
    cache_len: int = SLOT_CACHE_LEN,
    repeats: int = 7,
    pack_weights: bool | str = "auto",
) -> list[dict]:
    """Median latency of one forward of n new tokens after a KV cache of `cache_len` tokens, on the
    kernels generate() runs by default (pack_weights: kernels.cpu_kernels) or the stock ones.

    Same mask path as a decode step (layout.build_mask for the model's attention implementation).
    The cache is cropped back after every call, so each n sees exactly `cache_len` cached tokens.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    impl = model.config._attn_implementation
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    cache = DynamicCache()

    def inputs(start, n):
        """Random tokens at positions start.., causal after the cache; the mask is built here,
        outside the timed call, so the curve shows the forward alone (mask building is not per-slot
        work)."""
        tokens = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        mask = layout.build_mask(
            layout.decode_mask_mod(start, n, 1, 1), 1, n, start + n, impl, device
        )
        positions = torch.arange(start, start + n, device=device)[None]
        return {"input_ids": tokens, "position_ids": positions, "attention_mask": mask}

    with torch.no_grad(), cpu_kernels(model, enabled=pack_weights):
        model(**inputs(0, cache_len), **cache_kwargs(model, cache))
        steps = {}
        for n in slots:
            batch = inputs(cache_len, n)

            def step(batch=batch, n=n):
                model(**batch, **cache_kwargs(model, cache))
                cache.crop(-n)

            steps[n] = step
        for step in steps.values():  # one untimed sweep first: otherwise the first size measured
            step()  # also pays for warming caches and allocator, and the curve starts high
        points = [
            {"slots": n, "ms": 1000 * median_seconds(step, device, repeats, warmup=1)}
            for n, step in progress(list(steps.items()), "slot latency", unit="size")
        ]
    base = points[0]["ms"] if points else 0.0
    for p in points:
        p["vs_first"] = p["ms"] / base if base > 0 else 0.0
    return points


def latency_at(points: list[dict], slots: float) -> float:
    """The curve's latency at `slots`, linear between measured sizes on a log2 slot axis (as it is
    plotted); held at the end values outside the measured range."""
    xs = [math.log2(p["slots"]) for p in points]
    x = math.log2(max(slots, 1e-9))
    if x <= xs[0]:
        return points[0]["ms"]
    for (x0, p0), (x1, p1) in zip(zip(xs, points), zip(xs[1:], points[1:])):
        if x <= x1:
            return p0["ms"] + (p1["ms"] - p0["ms"]) * (x - x0) / (x1 - x0)
    return points[-1]["ms"]


def decoder_steps(summary: dict, points: list[dict], stock: list[dict] | None = None) -> dict:
    """Where each decoder's mean step sits on the curve of the kernels it runs (`points`:
    generate()'s default kernels; `stock`: PyTorch's stock product, for decoders with
    pack_weights=False): its mean query slots a step, the forward latency there, and that latency
    over one slot's on the same curve. Decoders with no steps are left out."""
    out = {}
    for decoder, s in summary.items():
        on_stock = stock is not None and decoder in DECODERS and not DECODERS[decoder].pack_weights
        curve = stock if on_stock else points
        slots = s.get("slots_per_step")
        if slots is None or not curve:
            continue
        ms, one = latency_at(curve, slots), latency_at(curve, 1)
        out[decoder] = {
            "slots_per_step": slots,
            "ms": ms,
            "vs_one_slot": ms / one if one > 0 else 0.0,
            "beyond_curve": slots > curve[-1]["slots"],
            "curve": "stock" if on_stock else "default",
        }
    return out
