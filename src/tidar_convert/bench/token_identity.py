"""Greedy tokens of every bench decoder that runs on an export, on the bench's 12 prompts, into a
JSON file: run it with two checkouts on PYTHONPATH and compare the files (bench/LOG.md, 2026-12-03:
the one decode loop).

    PYTHONPATH=<checkout>/src tidar-convert bench-token-identity --model EXPORT \\
        --out tokens.json [--max-new-tokens 16]
"""

from __future__ import annotations

import json


def bench_token_identity_cmd(model: str, out: str, max_new_tokens: int = 16) -> str:
    """Every export decoder's greedy tokens on the bench's 12 prompts, to compare two checkouts.

    Args:
        model: TiDAR export folder (from `make convert` or `tidar-convert export`).
        out: the JSON file to write: "<prompt id>/<decoder>" -> its new tokens.
        max_new_tokens: tokens generated per prompt and decoder.

    Returns:
        Path of the JSON written.
    """
    import torch
    from transformers import AutoTokenizer

    from tidar_convert.bench.decoders import DECODERS
    from tidar_convert.bench.prompts import bench_prompts
    from tidar_convert.exports.folder import load

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1.")
    lm = load(model).eval()
    tok = AutoTokenizer.from_pretrained(model)
    res = {}
    with torch.inference_mode():
        for p in bench_prompts(12):
            ids = tok(p["text"], return_tensors="pt").input_ids
            for name, d in DECODERS.items():
                if d.weights != "export":
                    continue
                kw = d.generate_kwargs(4, 10)
                got = lm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kw)
                res[f"{p['id']}/{name}"] = got[0, ids.shape[1] :].tolist()
    with open(out, "w") as f:
        json.dump(res, f)
    ar = {k.rsplit("/", 1)[0]: v for k, v in res.items() if k.endswith("/ar")}
    same = sum(v == ar[k.rsplit("/", 1)[0]] for k, v in res.items())
    print(len(res), "runs;", same, "equal to ar")
    return out
