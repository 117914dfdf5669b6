"""Per-decoder totals of the bench rows, their ratios to the reference decoders, and the printed
lines."""

from __future__ import annotations

import statistics
import sys
from collections import Counter

from tidar_convert.bench.decoders import DECODERS

# Speed ratios: to AR on the export, to prompt lookup on the export, and to prompt lookup on the
# base (what a user gets without converting at all).
# Last, AR on PyTorch's stock CPU product (what transformers alone gives; ar runs generate()'s
# default, packed weights where kernels.packing_pays measures them faster).
REFERENCES = (
    ("ar", "tokens_per_s_vs_ar"),
    ("prompt_lookup", "tokens_per_s_vs_prompt_lookup"),
    ("base_prompt_lookup", "tokens_per_s_vs_base_prompt_lookup"),
    ("ar_stock", "tokens_per_s_vs_ar_stock"),
)
SHORT = {
    "ar": "AR",
    "prompt_lookup": "lookup",
    "base_prompt_lookup": "base lookup",
    "ar_stock": "stock AR",
}


def per_step(runs: list[dict], key: str) -> float | None:
    """A per-step figure over all prompts, each prompt weighted by its steps; None with no steps."""
    pairs = [(r[key], r["steps"]) for r in runs if r.get(key) is not None and r["steps"]]
    steps = sum(s for _, s in pairs)
    return sum(v * s for v, s in pairs) / steps if steps else None


def host_ms(runs: list[dict]) -> float | None:
    """Host milliseconds per forward over all prompts, each weighted by its forwards; None where a
    run was not timed (a compiled forward)."""
    if not runs or any(r.get("host_ms_per_step") is None for r in runs):
        return None
    return sum(r["host_ms_per_step"] * r["nfe"] for r in runs) / sum(r["nfe"] for r in runs)


def draft_sources(runs: list[dict]) -> dict | None:
    """The engine's draft sources summed over prompts: counts per source (a dict) or one name per
    draft (a list); None when the engine does not report them."""
    total, seen = Counter(), False
    for r in runs:
        sources = r.get("draft_sources")
        if isinstance(sources, dict):
            total.update(sources)
            seen = True
        elif isinstance(sources, (list, tuple)):
            total.update(map(str, sources))
            seen = True
    return dict(total) if seen else None


def acceptance_by_offset(runs: list[dict]) -> dict | None:
    """The engine's per-source tallies by offset summed over prompts, and their rates: `acceptance`
    (accepted / judged: the chance proposal i is accepted once 1..i-1 were) beside `expected` (the
    plan's mean chance for the same proposals, in place of their sum). None when the engine does not
    report them."""
    total = {}
    for r in runs:
        for source, table in (r.get("acceptance_by_offset") or {}).items():
            into = total.setdefault(source, {name: [] for name in table})
            for name, counts in table.items():
                into[name].extend([0] * (len(counts) - len(into[name])))
                for i, c in enumerate(counts):
                    into[name][i] += c
    for table in total.values():
        table["acceptance"] = [a / j for a, j in zip(table["accepted"], table["judged"])]
        table["expected"] = [
            p / n if n else None for p, n in zip(table.pop("predicted"), table["rated"])
        ]
    return total or None


def summarize(rows: list[dict]) -> dict:
    """Totals per decoder, in table order. tokens/s is total tokens over total seconds (long
    generations weigh more); tokens_per_nfe likewise; mean_tokens_per_nfe averages the per-prompt
    ratios."""
    summary = {}
    for decoder in [d for d in DECODERS if rows and d in rows[0]]:
        runs = [r[decoder] for r in rows]
        tokens, nfe, seconds = (
            sum(r[key] for r in runs) for key in ("new_tokens", "nfe", "seconds")
        )
        base = DECODERS[decoder].weights == "base"
        unmatched = any(r.get("identical_to_ar") is None for r in runs)
        summary[decoder] = {
            "prompts": len(runs),
            "new_tokens": tokens,
            "nfe": nfe,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "tokens_per_nfe": tokens / nfe if nfe else 0.0,
            "mean_tokens_per_nfe": statistics.fmean(r["tokens_per_nfe"] for r in runs)
            if runs
            else 0.0,
            "slots_per_step": per_step(runs, "slots_per_step"),
            "lm_head_rows_per_step": per_step(runs, "lm_head_rows_per_step"),
            "host_ms_per_step": host_ms(runs),
            # not the export's weights, or sampled (other draws of the same distribution): None
            "identical": None
            if base or unmatched
            else sum(bool(r["identical_to_ar"]) for r in runs),
            "all_identical": None if base or unmatched else all(r["identical_to_ar"] for r in runs),
        }
        if DECODERS[decoder].tidar:
            summary[decoder]["draft_sources"] = draft_sources(runs)
            summary[decoder]["sibling_steps"] = sum(r.get("sibling_steps") or 0 for r in runs)
            summary[decoder]["acceptance_by_offset"] = acceptance_by_offset(runs)
    for ref, key in REFERENCES:
        if ref in summary:
            speed = summary[ref]["tokens_per_s"]
            for s in summary.values():
                s[key] = s["tokens_per_s"] / speed if speed > 0 else 0.0
    return summary


def _num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_line(decoder: str, s: dict) -> str:
    vs = ", ".join(f"{s[key]:.2f}x {SHORT[ref]}" for ref, key in REFERENCES if key in s)
    if DECODERS[decoder].weights == "base":
        same = "base weights"
    else:
        same = (
            "sampled (not compared token for token)"
            if s["identical"] is None
            else f"identical to AR {s['identical']}/{s['prompts']}"
        )
    return (
        f"{decoder:>18}: {s['tokens_per_s']:8.1f} tok/s ({vs}), {s['tokens_per_nfe']:.2f} T/NFE, "
        f"{_num(s.get('slots_per_step'), '.1f')} slots and "
        f"{_num(s.get('lm_head_rows_per_step'), '.1f')} LM-head rows a step, "
        f"{_num(s.get('host_ms_per_step'))} host ms a forward, {same}"
    )


def offsets_line(table: dict, most: int = 8) -> str:
    """The first `most` offsets' acceptance, and what the plan expected, as `0.81 (0.77) ...`."""
    return (
        " ".join(
            f"{a:.2f} ({_num(e)})"
            for a, e in zip(table["acceptance"][:most], table["expected"][:most])
        )
        + ", plan's chance in ()"
    )


def print_summary(summary: dict, ppl: dict | None, skipped: dict[str, str] | None = None) -> None:
    for decoder, s in summary.items():
        print(summary_line(decoder, s), file=sys.stderr)
        for source, table in (s.get("acceptance_by_offset") or {}).items():
            print(f"{'':>20}{source} acceptance by offset {offsets_line(table)}", file=sys.stderr)
    for decoder, why in (skipped or {}).items():
        print(f"{decoder:>18}: not run: {why}", file=sys.stderr)
    if ppl:
        print(
            f"    perplexity: base {ppl['base']:.3f} -> converted {ppl['converted']:.3f} "
            f"({ppl['change_pct']:+.1f}%) on {ppl['data']}",
            file=sys.stderr,
        )
