"""One product for every row, on an export and the bench's prompts (issue 35): into a JSON record,

- per prompt, whether every export decoder's greedy logits equal `generate(tidar=False)`'s bit for
  bit at every new position (transformers' prompt lookup included: it runs on the same kernels), and
  whether AR on PyTorch's stock product (`pack_weights=False`) wrote the same tokens (where not: a
  near-tie the stock product's rounding decided otherwise);
- `tidar=False` on the default product against `pack_weights=False`, interleaved per prompt, and the
  pass times behind the product choice (`kernels.product_timings`).

    python bench/exactness.py out/smollm2-135m-cpu bench/results/exactness-fp32.json [--prompts raw|chat] [--limit 12] [--tokens 128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from tidar_convert.bench.decoders import DECODERS
from tidar_convert.bench.machine import machine_info
from tidar_convert.bench.prompts import prompt_ids, prompt_set
from tidar_convert.exports.folder import load
from tidar_convert.runtime import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("out")
    parser.add_argument("--prompts", default="raw")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    model = load(args.export, dtype=getattr(torch, args.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(args.export)
    kw = dict(
        max_new_tokens=args.tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    names = [
        n for n, d in DECODERS.items() if d.weights == "export" and n not in ("ar", "ar_stock")
    ]
    rows, seconds = [], {"auto": 0.0, "stock": 0.0}
    prompts = prompt_set(args.prompts, args.limit)
    model.generate(
        prompt_ids(tok, prompts[0]), tidar=False, max_new_tokens=8
    )  # warm-up: the product choice, packing
    for p in prompts:
        ids = prompt_ids(tok, p)
        timed = {}
        for mode, pack in (
            ("auto", "auto"),
            ("stock", False),
        ):  # interleaved: the machine's load falls on both
            start = time.perf_counter()
            timed[mode] = model.generate(ids, tidar=False, pack_weights=pack, **kw)
            seconds[mode] += time.perf_counter() - start
        ar = timed["auto"]
        row = {
            "id": p["id"],
            "new_tokens": ar.sequences.shape[1] - ids.shape[1],
            "stock_ar_same_tokens": torch.equal(timed["stock"].sequences, ar.sequences),
        }
        for name in names:
            out = model.generate(ids, **DECODERS[name].generate_kwargs(4, 10), **kw)
            same = out.sequences.shape == ar.sequences.shape and torch.equal(
                out.sequences, ar.sequences
            )
            row[name] = same and all(
                torch.equal(a, b) for a, b in zip(out.logits, ar.logits, strict=True)
            )
        rows.append(row)
        print(p["id"], row, flush=True)
    result = {
        "export": args.export,
        "prompt_set": args.prompts,
        "dtype": args.dtype,
        "max_new_tokens": args.tokens,
        "machine": machine_info(torch.device("cpu"), model),
        "product_timings": kernels.product_timings(model),
        "ar_seconds": seconds,
        "ar_default_vs_stock": seconds["stock"] / seconds["auto"],
        "bit_identical_to_ar": {name: sum(r[name] for r in rows) for name in names},
        "stock_ar_same_tokens": sum(r["stock_ar_same_tokens"] for r in rows),
        "prompts": len(rows),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "product_timings",
                    "ar_default_vs_stock",
                    "bit_identical_to_ar",
                    "stock_ar_same_tokens",
                    "prompts",
                )
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
