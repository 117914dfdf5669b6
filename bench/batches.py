"""TiDAR in batches (issue 34): greedy tokens/s at batch 1, 4 and 16 against AR at the same batch size,
on the same prompts, the two interleaved batch by batch, into a JSON record.

Each batch size decodes the same prompts (the first `--prompts-n` of the set), left-padded in
batches of that size, after one untimed batch of that size (TiDAR learns a step-cost table per batch
size, once per model and machine); every row's tokens are checked equal to AR's. Per batch size: tokens/s of each
(new tokens up to each row's EOS, over the wall time), TiDAR's tokens per forward per row
(`tidar_stats["tokens_per_nfe_per_row"]`, averaged), the row-steps each source drafted, and the share
of batch 1's gain over AR that the batch keeps: (T/NFE_b - 1) / (T/NFE_1 - 1).

    python bench/batches.py out/smollm2-135m-cpu bench/results/batches-chat-fp32.json [--prompts chat] [--prompts-n 16] [--sizes 1 4 16] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from transformers import AutoTokenizer

from tidar_convert.bench.machine import machine_info
from tidar_convert.bench.prompts import prompt_ids, prompt_set
from tidar_convert.exports.folder import load


def left_pad(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[-1] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[-1] :], mask[i, width - r.shape[-1] :] = r[0], 1
    return ids, mask


def new_tokens(seqs: torch.Tensor, width: int, eos: set[int]) -> list[list[int]]:
    out = []
    for row in seqs[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:cut])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("out")
    parser.add_argument("--prompts", default="chat")
    parser.add_argument("--prompts-n", type=int, default=16)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model = load(args.export).eval()
    tok = AutoTokenizer.from_pretrained(args.export)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    prompts = [prompt_ids(tok, p) for p in prompt_set(args.prompts, args.prompts_n)]
    kw = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=pad)
    model.generate(
        prompts[0], tidar=False, max_new_tokens=8, pad_token_id=pad
    )  # warm-up: the product choice, packing
    model.generate(prompts[0], max_new_tokens=8, pad_token_id=pad)
    sizes = {}
    for size in args.sizes:
        # untimed: one batch of this size first, as a served model has run many (the step-cost table
        # for a batch size is learned once per model and machine, trying each step shape)
        ids, mask = left_pad(prompts[:size], pad)
        model.generate(ids, attention_mask=mask, **kw)
        seconds, tokens, per_row, sources, identical = (
            {"ar": 0.0, "tidar": 0.0},
            {"ar": 0, "tidar": 0},
            [],
            Counter(),
            0,
        )
        for start in range(0, len(prompts), size):
            ids, mask = left_pad(prompts[start : start + size], pad)
            got = {}
            for mode in ("ar", "tidar"):  # interleaved: the machine's load falls on both
                began = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, tidar=mode == "tidar", **kw)
                seconds[mode] += time.perf_counter() - began
                got[mode] = new_tokens(out, ids.shape[1], eos)
                tokens[mode] += sum(map(len, got[mode]))
            stats = model.tidar_stats
            per_row += (
                stats.get("tokens_per_nfe_per_row") or [stats["tokens_per_nfe"]] * ids.shape[0]
            )
            sources.update(stats["draft_sources"])
            identical += sum(a == b for a, b in zip(got["ar"], got["tidar"]))
        tps = {mode: tokens[mode] / seconds[mode] for mode in seconds}
        sizes[str(size)] = {
            "rows": len(prompts),
            "tokens_per_s": tps,
            "tidar_vs_ar": tps["tidar"] / tps["ar"],
            "tokens_per_nfe_per_row": sum(per_row) / len(per_row),
            "draft_sources": dict(sources),
            "identical_to_ar": identical,
        }
        print(size, sizes[str(size)], flush=True)
    one = sizes.get("1")
    for size, s in sizes.items():
        s["gain_kept"] = (
            (s["tokens_per_nfe_per_row"] - 1) / (one["tokens_per_nfe_per_row"] - 1)
            if one and one["tokens_per_nfe_per_row"] > 1
            else None
        )
    result = {
        "export": args.export,
        "prompt_set": args.prompts,
        "max_new_tokens": args.tokens,
        "machine": machine_info(torch.device("cpu"), model),
        "sizes": sizes,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {
                size: {
                    k: s[k]
                    for k in (
                        "tidar_vs_ar",
                        "tokens_per_nfe_per_row",
                        "gain_kept",
                        "identical_to_ar",
                    )
                }
                for size, s in sizes.items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
