"""Why recurrent layers are refused (families.REFUSED["recurrent layers"]), in two figures.

1. Leak: TiDAR trains on [clean half | mask half] in one forward, and its attention mask keeps each
   mask block from seeing clean tokens at or past its own positions. A recurrent layer (linear
   attention, SSM, short convolution) takes no attention mask: it scans the whole input in order, so
   the mask half starts from a state that has read the entire clean half. Measured: the largest
   change of the first mask block's logits when the *last* clean token changes (0 where the layout
   holds). Random tiny models of each family, the layout's own inputs and mask.
2. Rollback cost: at decode, a rejected draft is already folded into the recurrent state. The
   cheapest exact fix keeps a copy of the state from the step's start and re-runs the accepted
   tokens (a second forward per step). Measured on a SmolLM2-135M-sized Qwen3.5 text model (random
   weights, fp32, this CPU, best of 9 interleaved): AR's one-token step, TiDAR's step (1 + 2k
   tokens, k = 4), the state copy and the re-run of 3 accepted tokens; the break-even tokens per
   forward is (step + copy + re-run) / AR step, against step / AR step for a Llama of the same size.

    PYTHONPATH=tests tidar-convert bench-recurrent [--out bench/results/recurrent.json] \\
        [--repeats 9] [--dry-run]

The leak's tiny models are the tests' (tests/family_matrix.py), so it runs from a checkout, with
tests/ on PYTHONPATH.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

LEAK_FAMILIES = ("llama", "qwen3_5_text", "qwen3_next", "lfm2", "falcon_h1", "jamba")
SMOLLM2_SIZE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
)
# Qwen3.5's linear-attention heads at the same width as its attention heads (9 x 64 values, 3 x 64
# keys)
LINEAR_SIZE = dict(
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=3,
    linear_num_value_heads=9,
)


def leak(model_type: str, seq_len: int = 16, draft_length: int = 4) -> dict:
    from family_matrix import tiny_config

    from tidar_convert.models.families import attention_implementation, check
    from tidar_convert.runtime import layout

    torch.manual_seed(0)
    config = tiny_config(model_type, 320)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attention_implementation(config)
    ).eval()
    mask_id = 319
    ids = torch.randint(1, 300, (1, seq_len))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 300 + 1
    mask_mod = layout.train_mask_mod(seq_len, draft_length)
    dense = layout.to_dense(mask_mod, 1, 2 * seq_len, 2 * seq_len)
    out = {"model_type": model_type, "mechanisms": check(config).mechanisms}
    try:
        with torch.no_grad():
            first_block = [
                model(
                    input_ids=layout.train_inputs(x, mask_id),
                    position_ids=layout.train_position_ids(x),
                    attention_mask=layout.for_implementation(
                        dense, attention_implementation(config)
                    ),
                ).logits[0, seq_len : seq_len + draft_length]
                for x in (ids, changed)
            ]
        out["first_mask_block_change"] = float((first_block[0] - first_block[1]).abs().max())
    except Exception as e:  # the family's forward refuses the layout outright
        out["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return out


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def step_costs(
    model_type: str,
    repeats: int,
    prompt: int = 64,
    k: int = 4,
    accepted: int = 3,
    size: dict = SMOLLM2_SIZE,
) -> dict:
    """Seconds of an AR step, a TiDAR-shaped step (1 + 2k tokens) and, for recurrent layers, the
    state copy and the re-run of the accepted tokens, each from the same prefilled cache, on a model
    of `size`."""
    from tidar_convert.runtime.forward import cache_kwargs

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, **size, **(LINEAR_SIZE if model_type == "qwen3_5_text" else {})
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 1000, (1, prompt + 1 + 2 * k))
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        cache = out.get("cache", None) or out.get("past_key_values", None)

        def run(n):  # n tokens on a copy of the prefilled cache (the copy is not timed)
            c = copy.deepcopy(cache)
            return lambda: model(ids[:, prompt : prompt + n], **cache_kwargs(model, c))

        costs = {}
        for _ in range(repeats):  # interleaved: each measurement once per round, best over rounds
            for name, n in (
                ("ar_step", 1),
                ("tidar_step", 1 + 2 * k),
                ("rerun_accepted", accepted),
            ):
                costs[name] = min(costs.get(name, float("inf")), timed(run(n), 1))
            costs["state_copy"] = min(
                costs.get("state_copy", float("inf")), timed(lambda: copy.deepcopy(cache), 1)
            )
    recurrent = model_type != "llama"
    costs["break_even_tokens_per_forward"] = (
        costs["tidar_step"] + (costs["state_copy"] + costs["rerun_accepted"] if recurrent else 0.0)
    ) / costs["ar_step"]
    return {
        "model_type": model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": {k: v for k, v in costs.items() if k != "break_even_tokens_per_forward"},
        "break_even_tokens_per_forward": costs["break_even_tokens_per_forward"],
    }


def bench_recurrent_cmd(
    out: str = "bench/results/recurrent.json", repeats: int = 9, dry_run: bool = False
) -> str:
    """Why recurrent layers are refused: the training layout's leak, and rollback's break-even.

    Args:
        out: the JSON record to write.
        repeats: interleaved rounds of the step costs; each cost is the best of them.
        dry_run: the leak figures, and one round of the costs of a 4-layer model with a 1000-token
            vocabulary (one full-attention layer in Qwen3.5's 3:1 pattern): checks the script.

    Returns:
        Path of the JSON written.
    """
    if importlib.util.find_spec("family_matrix") is None:
        raise FileNotFoundError(
            "bench-recurrent builds the tests' tiny models (tests/family_matrix.py): run it from a "
            "checkout with tests/ on the path, e.g. PYTHONPATH=tests tidar-convert bench-recurrent."
        )
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1.")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    size = SMOLLM2_SIZE
    if dry_run:
        size = {**SMOLLM2_SIZE, "num_hidden_layers": 4, "vocab_size": 1000}
        repeats = 1
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "torch_threads": torch.get_num_threads(),
        "leak": [leak(t) for t in LEAK_FAMILIES],
    }
    for row in record["leak"]:
        print(json.dumps(row))
    record["step_costs"] = [step_costs(t, repeats, size=size) for t in ("llama", "qwen3_5_text")]
    for row in record["step_costs"]:
        print(json.dumps(row))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return out
