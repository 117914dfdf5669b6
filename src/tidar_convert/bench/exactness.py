"""One product for every row, on an export and the bench's prompts (issue 35): into a JSON record,

- per prompt, whether every export decoder's greedy logits equal `generate(tidar=False)`'s bit for
  bit at every new position (transformers' prompt lookup included: it runs on the same kernels), and
  whether AR on PyTorch's stock product (`pack_weights=False`) wrote the same tokens (where not: a
  near-tie the stock product's rounding decided otherwise);
- `tidar=False` on the default product against `pack_weights=False`, interleaved per prompt, and the
  pass times behind the product choice (`kernels.product_timings`).

    tidar-convert bench-exactness --model out/smollm2-135m-cpu \\
        --out bench/results/exactness-fp32.json [--prompts raw|chat] [--limit 12] \\
        [--max-new-tokens 128] [--dtype bfloat16]
"""

from __future__ import annotations

import json
import time

import torch
from transformers import AutoTokenizer

from tidar_convert.bench.decoders import DECODERS
from tidar_convert.bench.machine import machine_info
from tidar_convert.bench.prompts import prompt_ids, prompt_set
from tidar_convert.exports.folder import load
from tidar_convert.runtime import kernels


def bench_exactness_cmd(
    model: str,
    out: str,
    prompts: str = "raw",
    limit: int = 12,
    max_new_tokens: int = 128,
    dtype: str = "float32",
) -> str:
    """Whether every export decoder's greedy logits equal AR's bit for bit, per prompt (issue 35).

    Also AR on generate()'s default product against PyTorch's stock one: the same tokens, and the
    time of each, interleaved per prompt.

    Args:
        model: TiDAR export folder (from `make convert` or `tidar-convert export`).
        out: the JSON record to write.
        prompts: the prompt set: raw or chat (bench.prompts.prompt_set).
        limit: the first N prompts of the set.
        max_new_tokens: tokens generated per prompt and decoder.
        dtype: the weights of every decoder alike: float32 or bfloat16.

    Returns:
        Path of the JSON written.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: use float32 or bfloat16.")
    if limit < 1 or max_new_tokens < 1:
        raise ValueError(f"limit={limit}, max_new_tokens={max_new_tokens}: each must be >= 1.")
    lm = load(model, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(model)
    kw = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    names = [
        n
        for n, d in DECODERS.items()
        if d.weights == "export" and n not in ("ar", "ar_stock", "ar_compiled")
    ]
    rows, seconds = [], {"auto": 0.0, "stock": 0.0}
    chosen = prompt_set(prompts, limit)
    # warm-up: the product choice, packing
    lm.generate(prompt_ids(tok, chosen[0]), tidar=False, max_new_tokens=8)
    for p in chosen:
        ids = prompt_ids(tok, p)
        timed = {}
        # interleaved: the machine's load falls on both
        for mode, pack in (("auto", "auto"), ("stock", False)):
            start = time.perf_counter()
            timed[mode] = lm.generate(ids, tidar=False, pack_weights=pack, **kw)
            seconds[mode] += time.perf_counter() - start
        ar = timed["auto"]
        row = {
            "id": p["id"],
            "new_tokens": ar.sequences.shape[1] - ids.shape[1],
            "stock_ar_same_tokens": torch.equal(timed["stock"].sequences, ar.sequences),
        }
        for name in names:
            got = lm.generate(ids, **DECODERS[name].generate_kwargs(4, 10), **kw)
            same = got.sequences.shape == ar.sequences.shape and torch.equal(
                got.sequences, ar.sequences
            )
            row[name] = same and all(
                torch.equal(a, b) for a, b in zip(got.logits, ar.logits, strict=True)
            )
        rows.append(row)
        print(p["id"], row, flush=True)
    result = {
        "export": model,
        "prompt_set": prompts,
        "dtype": dtype,
        "max_new_tokens": max_new_tokens,
        "machine": machine_info(torch.device("cpu"), lm),
        "product_timings": kernels.product_timings(lm),
        "ar_seconds": seconds,
        "ar_default_vs_stock": seconds["stock"] / seconds["auto"],
        "bit_identical_to_ar": {name: sum(r[name] for r in rows) for name in names},
        "stock_ar_same_tokens": sum(r["stock_ar_same_tokens"] for r in rows),
        "prompts": len(rows),
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    shown = (
        "product_timings",
        "ar_default_vs_stock",
        "bit_identical_to_ar",
        "stock_ar_same_tokens",
        "prompts",
    )
    print(json.dumps({k: result[k] for k in shown}, indent=1))
    return out
