"""TiDAR in batches (issue 34): greedy tokens/s at batch 1, 4 and 16 against AR at the same batch
size, on the same prompts, the two interleaved batch by batch, into a JSON record.

Each batch size decodes the same prompts (the first `--limit` of the set), left-padded in batches of
that size, after one untimed batch of that size (TiDAR learns a step-cost table per batch size, once
per model and machine); every row's tokens are checked equal to AR's. Per batch size: tokens/s of
each (new tokens up to each row's EOS, over the wall time), TiDAR's tokens per forward per row
(`tidar_stats["tokens_per_nfe_per_row"]`, averaged), the row-steps each source drafted, and the
share of batch 1's gain over AR that the batch keeps: (T/NFE_b - 1) / (T/NFE_1 - 1).

    tidar-convert bench-batches --model out/smollm2-135m-cpu \\
        --out bench/results/batches-chat-fp32.json [--prompts chat] [--limit 16] \\
        [--sizes '[1, 4, 16]'] [--max-new-tokens 128]
"""

from __future__ import annotations

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


def bench_batches_cmd(
    model: str,
    out: str,
    prompts: str = "chat",
    limit: int = 16,
    sizes: list[int] | None = None,
    max_new_tokens: int = 128,
) -> str:
    """Greedy tokens/s of TiDAR against AR at each batch size, on the same prompts (issue 34).

    Args:
        model: TiDAR export folder (from `make convert` or `tidar-convert export`).
        out: the JSON record to write.
        prompts: the prompt set: chat or raw (bench.prompts.prompt_set).
        limit: the first N prompts of the set, decoded at every batch size.
        sizes: batch sizes (default [1, 4, 16]).
        max_new_tokens: tokens generated per row.

    Returns:
        Path of the JSON written.
    """
    if limit < 1 or max_new_tokens < 1:
        raise ValueError(f"limit={limit}, max_new_tokens={max_new_tokens}: each must be >= 1.")
    sizes = [1, 4, 16] if sizes is None else sizes
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes={sizes}: give batch sizes of 1 or more, e.g. [1, 4, 16].")
    lm = load(model).eval()
    tok = AutoTokenizer.from_pretrained(model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = lm.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = [prompt_ids(tok, p) for p in prompt_set(prompts, limit)]
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    # warm-up: the product choice, packing
    lm.generate(rows[0], tidar=False, max_new_tokens=8, pad_token_id=pad)
    lm.generate(rows[0], max_new_tokens=8, pad_token_id=pad)
    by_size = {}
    for size in sizes:
        # untimed: one batch of this size first, as a served model has run many (the step-cost table
        # for a batch size is learned once per model and machine, trying each step shape)
        ids, mask = left_pad(rows[:size], pad)
        lm.generate(ids, attention_mask=mask, **kw)
        seconds, tokens, per_row, sources, identical = (
            {"ar": 0.0, "tidar": 0.0},
            {"ar": 0, "tidar": 0},
            [],
            Counter(),
            0,
        )
        for start in range(0, len(rows), size):
            ids, mask = left_pad(rows[start : start + size], pad)
            got = {}
            for mode in ("ar", "tidar"):  # interleaved: the machine's load falls on both
                began = time.perf_counter()
                seqs = lm.generate(ids, attention_mask=mask, tidar=mode == "tidar", **kw)
                seconds[mode] += time.perf_counter() - began
                got[mode] = new_tokens(seqs, ids.shape[1], eos)
                tokens[mode] += sum(map(len, got[mode]))
            stats = lm.tidar_stats
            per_row += (
                stats.get("tokens_per_nfe_per_row") or [stats["tokens_per_nfe"]] * ids.shape[0]
            )
            sources.update(stats["draft_sources"])
            identical += sum(a == b for a, b in zip(got["ar"], got["tidar"]))
        tps = {mode: tokens[mode] / seconds[mode] for mode in seconds}
        by_size[str(size)] = {
            "rows": len(rows),
            "tokens_per_s": tps,
            "tidar_vs_ar": tps["tidar"] / tps["ar"],
            "tokens_per_nfe_per_row": sum(per_row) / len(per_row),
            "draft_sources": dict(sources),
            "identical_to_ar": identical,
        }
        print(size, by_size[str(size)], flush=True)
    one = by_size.get("1")
    for s in by_size.values():
        s["gain_kept"] = (
            (s["tokens_per_nfe_per_row"] - 1) / (one["tokens_per_nfe_per_row"] - 1)
            if one and one["tokens_per_nfe_per_row"] > 1
            else None
        )
    result = {
        "export": model,
        "prompt_set": prompts,
        "max_new_tokens": max_new_tokens,
        "machine": machine_info(torch.device("cpu"), lm),
        "sizes": by_size,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    shown = ("tidar_vs_ar", "tokens_per_nfe_per_row", "gain_kept", "identical_to_ar")
    print(json.dumps({size: {k: s[k] for k in shown} for size, s in by_size.items()}, indent=1))
    return out
