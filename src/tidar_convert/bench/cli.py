"""`tidar-convert bench`: every decoder of the table on the same prompts and weights, then the slot
curve, the step breakdown, the quality guard and (optionally) perplexity; JSON, Markdown and
plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tidar_convert.bench.decoders import (
    DECODERS,
    SAMPLING,
    accepted_histogram,
    bench_prompt,
    decoder_names,
    runnable,
)
from tidar_convert.bench.machine import default_device, machine_info
from tidar_convert.bench.perplexity import compare_perplexity
from tidar_convert.bench.plots import plot_accepted, plot_slots, plot_tokens_per_s
from tidar_convert.bench.prompts import (
    CHAT_PROMPTS,
    HUMANEVAL_PROBLEMS,
    PROMPT_SETS,
    TEXT_PROMPTS,
    check_chat_template,
    default_limit,
    prompt_set,
)
from tidar_convert.bench.slots import (
    SLOT_CACHE_LEN,
    STEP_KS,
    decoder_steps,
    slot_latency,
    slot_sizes,
)
from tidar_convert.bench.steps import PROFILE_PROMPTS, PROFILE_TOKENS, step_breakdown
from tidar_convert.bench.summary import print_summary, summarize
from tidar_convert.runtime.spec import check_draft_length
from tidar_convert.train.progress import progress

DTYPES = ("float32", "bfloat16")


def check_bench_args(
    draft_length,
    max_new_tokens,
    limit,
    prompt_lookup_tokens,
    ppl_base,
    ppl_data,
    dtype="float32",
    humaneval_timeout=3.0,
    prompts="raw",
) -> None:
    if prompts not in PROMPT_SETS:
        raise ValueError(
            f"prompts={prompts!r}: use 'raw' (HumanEval and plain text, no chat template) or "
            "'chat' (instructions through the model's chat template)."
        )
    if draft_length is not None:
        check_draft_length(draft_length, "--draft-length")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1.")
    if limit is not None and limit < 1:
        raise ValueError(
            f"limit={limit}: must be >= 1 (or leave it out for every prompt: "
            f"{len(TEXT_PROMPTS) + HUMANEVAL_PROBLEMS} raw, {len(CHAT_PROMPTS)} chat)."
        )
    if prompt_lookup_tokens < 1:
        raise ValueError(
            f"prompt_lookup_tokens={prompt_lookup_tokens}: must be >= 1 (transformers' default is "
            "10; 4 suits short drafts)."
        )
    if (ppl_base is None) != (ppl_data is None):
        raise ValueError(
            "perplexity needs both --ppl_base (the base model) and --ppl_data (e.g. prose); pass "
            "both or neither."
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use float32 or bfloat16.")
    if humaneval_timeout <= 0:
        raise ValueError(f"humaneval_timeout={humaneval_timeout}: must be > 0 seconds.")


def bench_cmd(
    model: str,
    draft_length: int | None = None,
    max_new_tokens: int = 128,
    out_dir: str = "bench/results",
    name: str | None = None,
    limit: int | None = None,
    prompt_lookup_tokens: int = 4,
    ppl_base: str | None = None,
    ppl_data: str | None = None,
    dtype: str = "float32",
    base: str | None = None,
    quality: bool = True,
    humaneval_timeout: float = 3.0,
    prompts: str = "raw",
    sampling: bool = False,
    seed: int = 0,
    overwrite: bool = False,
    card: bool | None = None,
) -> str:
    """Benchmark a TiDAR export against AR and prompt-lookup decoding on the same weights.

    Batch 1, greedy, raw prompts (HumanEval + plain text) or chat instructions (--prompts chat);
    with --sampling every decoder also samples (temperature 0.7, top_p 0.9, seeded). Every decoder
    of the table (bench.decoders.DECODERS) runs, prompt by prompt, so machine noise hits them alike;
    TiDAR drafters this export's engine lacks are left out, with the reason. Writes
    <out_dir>/<name>.json (summary per decoder, rows, slot curve, step breakdown, machine),
    <name>.md (the README table) and PNG plots. With the base model (recorded in the export by
    `fit`, or `base`), it also times prompt lookup on the base weights and runs the
    generation-quality guard (quality.py) on the same outputs.

    Args:
        model: TiDAR export folder (from `make convert` or `tidar-convert export`).
        draft_length: TiDAR's k, drafts per mask group; default: the trained draft length.
        max_new_tokens: tokens generated per prompt and decoder.
        out_dir: folder for the JSON, the Markdown and the plots.
        name: file name stem; default: the model folder's name.
        limit: use only the first N prompts (code and text interleaved); default: all 169 on a GPU,
            the first CPU_DEFAULT_PROMPTS on a CPU (minutes, where all take many times longer).
        prompt_lookup_tokens: draft length of prompt-lookup decoding.
        ppl_base: base model (folder, hub id or .gguf) to compare perplexity against; needs
            ppl_data.
        ppl_data: perplexity data: prose (held-out English prose), stdlib, a file/folder or a hub
            dataset.
        dtype: weights for every decoder alike: float32 or bfloat16 (CPUs with AMX, and GPUs, run
            many query slots nearly as fast as one in bf16: the free slots TiDAR drafts in).
        base: the base model the export was converted from (folder, hub id, .gguf or "embedded");
            default: the one the export records (exports made by `fit`/`export` record it).
        quality: time prompt lookup on the base and run the quality guard (needs the base model).
        humaneval_timeout: seconds per HumanEval program of the guard's pass@1.
        prompts: the prompt set: raw (HumanEval prompts and plain text, as text to continue) or chat
            (24 instructions of 6 kinds, each one user message through the model's chat template, as
            `transformers serve` renders them; bench.prompts.CHAT_PROMPTS).
        sampling: also decode every prompt with every decoder sampled (temperature 0.7, top_p 0.9),
            right after its greedy runs: `summary_sampling` beside `summary`.
        seed: the sampling seed (mixed with each prompt's id; the same for every decoder).
        overwrite: replace an earlier record <out_dir>/<name>.json (refused before any work without
            it).
        card: write the results into the export's model card (README.md); default: only for a run
            over the default prompt set (a --limit run is a smoke run, not the model's figures).

    Returns:
        Path of the JSON written.
    """
    from transformers import AutoTokenizer

    from tidar_convert.exports.card import results_section, update_model_card
    from tidar_convert.exports.folder import check_export, load, require_tidar

    check_bench_args(
        draft_length,
        max_new_tokens,
        limit,
        prompt_lookup_tokens,
        ppl_base,
        ppl_data,
        dtype,
        humaneval_timeout,
        prompts,
    )
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model={model!r} is not a folder; pass a TiDAR export folder (the OUT of "
            "`make convert`)."
        )
    trained = check_export(path)
    if quality and base is None:
        base = trained.base_model
        if base is None:
            print(
                f"bench: {path} does not record its base model: no quality guard, no base prompt "
                "lookup (pass --base to get both)",
                file=sys.stderr,
            )
            quality = False
    k = draft_length or trained.draft_length
    name = name or path.resolve().name
    from tidar_convert.exports.outputs import check_record_target

    check_record_target(
        Path(out_dir) / f"{name}.json",
        overwrite,
        "pass --name with a new name for this run (make bench NAME=...)",
    )
    device = default_device()
    lm = load(path, dtype=getattr(torch, dtype)).to(device).eval()
    require_tidar(lm, path)  # never time transformers' AR generate and call it TiDAR
    tokenizer = AutoTokenizer.from_pretrained(path)
    if prompts == "chat":
        check_chat_template(tokenizer, str(path))
    base_pair = None
    if quality:
        from tidar_convert.models.loading import load_base

        # Held beside the export for the whole decoding phase: the base decoders run interleaved
        # with the others, prompt by prompt, so machine noise hits every decoder alike. It is freed
        # right after the guard, before the slot curve and perplexity.
        base_lm, base_tokenizer = load_base(base, dtype=getattr(torch, dtype))
        if prompts == "chat":
            check_chat_template(base_tokenizer, base)
        base_pair = (base_lm.to(device).eval(), base_tokenizer)
        del base_lm  # base_pair holds the only reference: dropping it frees the model
    set_name, prompts = (
        prompts,
        prompt_set(prompts, limit if limit is not None else default_limit(device)),
    )
    if limit is None and device.type != "cuda" and len(prompts) < len(prompt_set(set_name)):
        print(
            f"bench: {len(prompts)} of {len(prompt_set(set_name))} prompts (the CPU default; "
            f"--limit {len(prompt_set(set_name))} for all)",
            file=sys.stderr,
        )
    sampled = {**SAMPLING, "seed": seed} if sampling else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    decoders, skipped = runnable(decoder_names("export"), lm, tokenizer, k, prompt_lookup_tokens)
    for decoder, why in skipped.items():
        print(f"bench: {decoder} left out: {why}", file=sys.stderr)
    if base_pair is not None:
        decoders += decoder_names("base")
    # Warm-up (allocator, kernels, the one-time weight packing, lazy imports) so the first timed
    # prompt is not an outlier.
    bench_prompt(
        lm,
        tokenizer,
        prompts[0],
        min(max_new_tokens, 8),
        k,
        prompt_lookup_tokens,
        decoders,
        base_pair,
        sampled,
    )
    rows = []
    # with an ETA, on a terminal or in a log
    for prompt in progress(prompts, f"bench {name}", unit="prompt"):
        rows.append(
            bench_prompt(
                lm,
                tokenizer,
                prompt,
                max_new_tokens,
                k,
                prompt_lookup_tokens,
                decoders,
                base_pair,
                sampled,
            )
        )
    summary = summarize(rows)
    # Per kind of prompt: lookup drafts well on code (HumanEval bodies repeat the prompt's names)
    # and on chat answers that reuse a given text (rewrite, summarise, passage), rarely on prose or
    # new answers, where drafts must come from the diffusion head.
    kinds = sorted({r["kind"] for r in rows})
    by_kind = {kind: summarize([r for r in rows if r["kind"] == kind]) for kind in kinds}
    sampled_rows = [{**r["sampling"], "kind": r["kind"]} for r in rows] if sampled else None
    summary_sampling = summarize(sampled_rows) if sampled else None
    sampling_by_kind = (
        {kind: summarize([r for r in sampled_rows if r["kind"] == kind]) for kind in kinds}
        if sampled
        else None
    )
    guard = None
    if base_pair is not None:
        guard = quality_guard(
            prompts, rows, lm, tokenizer, base_pair, max_new_tokens, humaneval_timeout
        )
        guard = {"base_model": base, **guard}
        base_pair = None  # free its memory before the slot curve and perplexity
    breakdown = step_breakdown(
        lm, tokenizer, prompts[:PROFILE_PROMPTS], k, min(max_new_tokens, PROFILE_TOKENS)
    )
    points = slot_latency(lm, slot_sizes(device, k))
    # On a CPU also both products alone: what generate()'s default (kernels.packing_pays) chose
    # between.
    points_stock = (
        slot_latency(lm, slot_sizes(device, k), pack_weights=False)
        if device.type == "cpu"
        else None
    )
    points_packed = (
        slot_latency(lm, slot_sizes(device, k), pack_weights=True) if device.type == "cpu" else None
    )
    ms = {p["slots"]: p["ms"] for p in points}
    step_vs_ar = {str(kk): ms[kk + kk * kk] / ms[1] for kk in sorted(set(STEP_KS) | {k})}
    steps = decoder_steps(summary, points, points_stock)

    result = {
        "model": str(path.resolve()),
        "name": name,
        "draft_length": k,
        "trained_draft_length": trained.draft_length,
        "max_new_tokens": max_new_tokens,
        "prompt_lookup_tokens": prompt_lookup_tokens,
        "prompts": len(prompts),
        "prompt_set": set_name,
        "sampling": sampled,
        "machine": machine_info(device, lm),
        "decoders": {
            d: DECODERS[d].generate_kwargs(k, prompt_lookup_tokens)
            | {"weights": DECODERS[d].weights}
            for d in decoders
        },
        "skipped_decoders": skipped,
        "summary": summary,
        "summary_by_kind": by_kind,
        "summary_sampling": summary_sampling,
        "summary_sampling_by_kind": sampling_by_kind,
        "accepted_histogram": accepted_histogram(rows, k),
        "accepted_histogram_sampling": accepted_histogram(sampled_rows, k) if sampled else None,
        "slot_latency": {
            "cache_len": SLOT_CACHE_LEN,
            "tidar_step_slots": k + k * k,
            "tidar_step_vs_ar_step": step_vs_ar,
            "decoder_steps": steps,
            "points": points,
            "points_stock": points_stock,
            "points_packed": points_packed,
        },
        "step_breakdown": breakdown,
        "perplexity": None,
        "quality": guard,
        "rows": rows,
    }
    if ppl_base is not None:
        del lm  # free memory before loading two more models
        result["perplexity"] = compare_perplexity(ppl_base, str(path), ppl_data)

    title = f"{name} (k={k}, {len(prompts)} prompts, {max_new_tokens} new tokens, {device.type})"
    result["plots"] = {
        "tokens_per_s": str(plot_tokens_per_s(summary, out / f"{name}_tokens_per_s.png", title)),
        "accepted": str(
            plot_accepted(result["accepted_histogram"], out / f"{name}_accepted.png", title)
        ),
        "slots": str(
            plot_slots(
                points,
                out / f"{name}_slots.png",
                f"{name}: one forward after a {SLOT_CACHE_LEN}-token KV cache ({device.type})",
                full_step=k + k * k,
                steps=steps,
                stock=points_stock,
                packed=points_packed,
            )
        ),
    }
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=1))
    md_path = out / f"{name}.md"
    md_path.write_text(results_section(result) + "\n")
    print_summary(summary, result["perplexity"], skipped)
    print_kinds(by_kind)
    if sampled:
        print(
            f"  sampled (temperature {sampled['temperature']}, top_p {sampled['top_p']}, seed "
            f"{seed}):",
            file=sys.stderr,
        )
        print_summary(summary_sampling, None)
        print_kinds(sampling_by_kind)
    print_breakdown(breakdown)
    if guard is not None:
        from tidar_convert.bench.quality import print_verdict

        print_verdict(guard)
    for written in (json_path, md_path, *result["plots"].values()):
        print(f"wrote {written}", file=sys.stderr)
    if card is None:  # the whole prompt set, not a --limit subset of it
        card = limit is None or limit >= len(prompt_set(set_name))
    if card and update_model_card(path, result):  # the export's README.md shows what was measured
        print(f"updated {path / 'README.md'} (results section)", file=sys.stderr)
    elif not card:
        print(
            f"left {path / 'README.md'} as it was (a --limit run; --card true writes its figures "
            "there)",
            file=sys.stderr,
        )
    return str(json_path)


def print_kinds(by_kind: dict) -> None:
    for kind, part in by_kind.items():
        print(
            f"    {kind} prompts ({next(iter(part.values()))['prompts']}): "
            + ", ".join(
                f"{d} {s['tokens_per_s_vs_ar']:.2f}x AR"
                for d, s in part.items()
                if d != "ar" and "tokens_per_s_vs_ar" in s
            ),
            file=sys.stderr,
        )


def print_breakdown(breakdown: dict) -> None:
    phases = ", ".join(f"{label} {p['share']:.0%}" for label, p in breakdown["phases"].items())
    per, host = breakdown["ms_per_forward"], breakdown.get("host_ms_per_forward")
    reads = breakdown.get("host_reads_per_forward")
    print(
        f"    {breakdown['decoder']} step time ({breakdown['prompts']} prompts, "
        f"{'-' if per is None else f'{per:.1f}'} ms a forward, "
        f"{'-' if host is None else f'{host:.2f}'} ms of it host work, "
        f"{'-' if reads is None else f'{reads:.1f}'} host reads): {phases}",
        file=sys.stderr,
    )


def quality_guard(
    prompts: list[dict],
    rows: list[dict],
    model,
    tokenizer,
    base: tuple,
    max_new_tokens: int,
    timeout: float,
) -> dict:
    """quality.compare on the bench's own outputs: the export's AR row (greedy TiDAR writes the same
    tokens) against the base's prompt-lookup row (greedy lookup writes the base's greedy tokens),
    each cut at its EOS. The rows' texts go in the bench rows, the metrics and verdict in the
    result."""
    from tidar_convert.bench.quality import compare, cut_at_eos, eos_ids

    base_model, base_tokenizer = base
    mine = [cut_at_eos(r["ar"]["tokens"], eos_ids(model, tokenizer)) for r in rows]
    theirs = [
        cut_at_eos(r["base_prompt_lookup"]["tokens"], eos_ids(base_model, base_tokenizer))
        for r in rows
    ]
    report = compare(prompts, mine, theirs, tokenizer, base_tokenizer, timeout=timeout)
    for row, q in zip(rows, report.pop("rows")):
        row["quality"] = {side: q[side] for side in ("converted", "base")}
    if max_new_tokens < 128:
        report["note"] = (
            f"max_new_tokens={max_new_tokens}: the guard is meant for >= 128 new tokens per prompt"
        )
    return report
