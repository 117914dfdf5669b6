"""What recurrent layers cost under TiDAR (runtime/recurrent.py), in three figures.

1. Leak: TiDAR trains on [clean half | mask half] in one forward, and each mask block must not read
   clean tokens at or past its own positions. A recurrent layer takes no attention mask; the layout
   reaches it as segments (each block starts from the clean half's state before it). Measured: the
   largest change of the first mask block's logits when the clean tokens after it change, with the
   segments (0 where the layout holds, up to the rounding of a mixture of experts, whose batches
   change with the other tokens) and without them (the mixer scanning [clean | mask] as one
   sequence, the leak that kept these families refused until 2026-12); and the gradient of that
   block's logits reaching those clean tokens (exactly 0 where the layout holds). Tiny random
   models of each kind of recurrent layer, the layout's own inputs and mask.
2. State capture: at decode the verify forward records the state after each draft, each mask
   group starts from the state at its anchor, and the commit keeps each row's state at its
   accepted length (nothing is re-run). Measured on a SmolLM2-135M-sized Qwen3.5 text model
   (random weights, fp32, this CPU, best of `repeats` interleaved rounds): a TiDAR step (k drafts
   and a group of k after each, k = 4) with the capture and the commit, the same forward without
   them (every slot scanned as one continuation: leaky, the floor), and AR's one-token step. The
   break-even tokens per forward is step / AR step, against the same for a Llama of the same size.
3. Tokens per forward: a tiny Qwen3.5 and a tiny Qwen3 of the same size, trained alike (the tests'
   `train_tiny` on cycle data), decoded on the same prompts: T/NFE side by side.

    PYTHONPATH=tests tidar-convert bench-recurrent [--out bench/results/recurrent.json] \\
        [--repeats 15] [--dry-run]

The tiny models are the tests' (tests/family_matrix.py, tests/helpers.py), so it runs from a
checkout, with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# one of each kind of recurrent layer (and Llama, whose attention the mask already restricts)
LEAK_FAMILIES = (
    "llama",
    "qwen3_5_text",
    "qwen3_next",
    "kimi_linear",
    "lfm2",
    "nemotron_h",
    "falcon_h1",
    "jamba",
    "zamba",
)
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
    from tidar_convert.runtime import layout, recurrent

    torch.manual_seed(0)
    config = tiny_config(model_type, 320)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attention_implementation(config)
    ).eval()
    mask_id = 319
    ids = torch.randint(1, 300, (1, seq_len))
    changed = ids.clone()
    changed[0, draft_length:] = (ids[0, draft_length:] + 1) % 300 + 1  # the first block's future
    mask_mod = layout.train_mask_mod(seq_len, draft_length)
    dense = layout.to_dense(mask_mod, 1, 2 * seq_len, 2 * seq_len)
    out = {"model_type": model_type, "mechanisms": check(config).mechanisms}
    for name, segments in (
        ("first_mask_block_change", recurrent.Segments.training(seq_len, draft_length)),
        ("without_segments", None),
    ):
        with torch.no_grad(), recurrent.layout(model, segments):
            first_block = [
                model(
                    input_ids=layout.train_inputs(x, mask_id),
                    position_ids=layout.train_position_ids(x),
                    attention_mask=layout.for_implementation(
                        dense, attention_implementation(config)
                    ),
                    use_cache=False,
                ).logits[0, seq_len : seq_len + draft_length]
                for x in (ids, changed)
            ]
        out[name] = float((first_block[0] - first_block[1]).abs().max())
    # the same, read from the gradient (no rounding of experts' batches in it): how much of the
    # first block's logits reaches the clean tokens after it
    embeds = model.get_input_embeddings()(layout.train_inputs(ids, mask_id)).detach()
    embeds.requires_grad_()
    with recurrent.layout(model, recurrent.Segments.training(seq_len, draft_length)):
        logits = model(
            inputs_embeds=embeds,
            position_ids=layout.train_position_ids(ids),
            attention_mask=layout.for_implementation(dense, attention_implementation(config)),
            use_cache=False,
        ).logits
    logits[0, seq_len : seq_len + draft_length].sum().backward()
    out["gradient_from_its_future"] = float(embeds.grad[0, draft_length:seq_len].abs().sum())
    return out


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def step_rows(
    model_type: str, prompt: int = 64, k: int = 4, accepted: int = 3, size: dict = SMOLLM2_SIZE
) -> tuple[dict, dict]:
    """A model of `size` with a prefilled cache, and the steps to time on it: AR's one-token step
    and a TiDAR step (k drafts, a group of k anchored after each); for recurrent layers also the
    same forward without the segments (no capture, no commit: the floor the capture is measured
    against). Each row makes a fresh copy of the cache (not timed) and returns the step to time."""
    from transformers import DynamicCache

    from tidar_convert.runtime import layout, recurrent
    from tidar_convert.runtime.forward import forward

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, **size, **(LINEAR_SIZE if model_type == "qwen3_5_text" else {})
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    impl = model.config._attn_implementation
    mixers = recurrent.mixers(model)
    ids = torch.randint(1, 1000, (1, prompt + k))
    anchors = tuple(range(1, k + 1))
    slots = torch.cat([ids[:, prompt:], torch.full((1, k * k), 999)], 1)
    positions = layout.decode_position_ids(torch.tensor([prompt]), k, k, k, anchors)
    mask = layout.decode_step_mask(torch.ones(1, prompt, dtype=torch.bool), k, k, anchors, impl)
    with torch.no_grad():
        cache = recurrent.new_cache(model.config) if mixers else DynamicCache()
        prefill = layout.build_mask(
            layout.decode_mask_mod(0, prompt, k, prompt), 1, prompt, prompt, impl, "cpu"
        )
        segments = recurrent.Segments(prompt) if mixers else None
        forward(model, cache, ids[:, :prompt], torch.arange(prompt)[None], prefill, None,
                segments, mixers)  # fmt: skip
        if mixers:
            recurrent.keep_states(cache, prompt, torch.tensor([prompt]))

    def ar():
        c = copy.deepcopy(cache)
        one = layout.decode_step_mask(torch.ones(1, prompt, dtype=torch.bool), 1, k, (), impl)
        return lambda: forward(model, c, slots[:, :1], positions[:, :1], one, [0])

    def step(capture: bool):
        c = copy.deepcopy(cache)
        segments = recurrent.Segments(k, anchors, k, record=True) if capture else None

        def run():
            forward(model, c, slots, positions, mask, list(range(slots.shape[1])), segments,
                    mixers if capture else None)  # fmt: skip
            if capture:
                recurrent.keep_states(c, k, torch.tensor([accepted]))

        return run

    rows = {"ar_step": ar, "tidar_step": lambda: step(True)}
    if mixers:
        rows["tidar_step_without_capture"] = lambda: step(False)
    info = {"model_type": model_type, "parameters": sum(p.numel() for p in model.parameters())}
    return info, rows


def step_costs(model_types: tuple, repeats: int, size: dict = SMOLLM2_SIZE) -> list[dict]:
    """Seconds of each model's steps (step_rows), best of `repeats` rounds; every round times
    every step of every model once, so a drift of this machine's speed moves all of them alike
    and the ratios between models stay comparable."""
    models = [step_rows(t, size=size) for t in model_types]
    costs = [{} for _ in models]
    with torch.no_grad():
        for _ in range(repeats):
            for (_, rows), seconds in zip(models, costs):
                for name, make in rows.items():
                    seconds[name] = min(seconds.get(name, float("inf")), timed(make(), 1))
    out = []
    for (info, _), seconds in zip(models, costs):
        row = {**info, "seconds": seconds}
        row["break_even_tokens_per_forward"] = seconds["tidar_step"] / seconds["ar_step"]
        if "tidar_step_without_capture" in seconds:
            row["capture_overhead"] = (
                seconds["tidar_step"] / seconds["tidar_step_without_capture"] - 1
            )
        out.append(row)
    return out


def tokens_per_forward(
    model_types=("qwen3", "qwen3_5_text"), steps: int = 150, draft_length: int = 8
) -> list[dict]:
    """T/NFE of tiny models of each type trained alike (tests/helpers.train_tiny), decoded with
    TiDAR (the default drafter, the adaptive plan: no step timings in the figure) on the same
    prompts, 64 new tokens each."""
    import tempfile

    from family_matrix import prompts, tiny_config
    from helpers import tiny_tokenizer, train_tiny

    from tidar_convert.models.families import parameter_count
    from tidar_convert.models.loading import load_base
    from tidar_convert.runtime.generate import generate

    tokenizer = tiny_tokenizer()
    rows = []
    for model_type in model_types:
        torch.manual_seed(0)
        config = tiny_config(model_type, len(tokenizer))
        with tempfile.TemporaryDirectory() as tmp:  # as fit loads a base: its mask token added
            AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            model, tok = load_base(tmp)
        model = train_tiny(model, steps=steps, draft_length=draft_length, seq_len=32)
        nfe = new = 0
        with torch.no_grad():
            for ids, mask in prompts(tok.pad_token_id):
                generate(ids, model=model, attention_mask=mask, max_new_tokens=64,
                         eos_token_id=None, draft_length=draft_length,
                         plan="adaptive")  # fmt: skip
                nfe += model.tidar_stats["nfe"]
                new += model.tidar_stats["new_tokens"] * ids.shape[0]
        rows.append(
            {
                "model_type": model_type,
                "parameters": parameter_count(config),
                "train_steps": steps,
                "draft_length": draft_length,
                "tokens_per_nfe": new / nfe,
            }
        )
    return rows


def bench_recurrent_cmd(
    out: str = "bench/results/recurrent.json", repeats: int = 15, dry_run: bool = False
) -> str:
    """What recurrent layers cost under TiDAR: the layout's leak (0), the state capture's share of
    a step and the break-even against Llama's, and the T/NFE of a tiny Qwen3.5 beside a Qwen3.

    Args:
        out: the JSON record to write.
        repeats: rounds of the step costs (each round times every step of both models once);
            each cost is the best of them.
        dry_run: the leak figures, one round of the costs of a 4-layer model with a 1000-token
            vocabulary (one full-attention layer in Qwen3.5's 3:1 pattern), and 10 training steps
            of the tiny models: checks the script.

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
    size, steps = SMOLLM2_SIZE, 150
    if dry_run:
        size = {**SMOLLM2_SIZE, "num_hidden_layers": 4, "vocab_size": 1000}
        repeats, steps = 1, 10
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "torch_threads": torch.get_num_threads(),
        "leak": [leak(t) for t in LEAK_FAMILIES],
    }
    for row in record["leak"]:
        print(json.dumps(row))
    record["step_costs"] = step_costs(("llama", "qwen3_5_text"), repeats, size=size)
    for row in record["step_costs"]:
        print(json.dumps(row))
    record["tokens_per_forward"] = tokens_per_forward(steps=steps)
    for row in record["tokens_per_forward"]:
        print(json.dumps(row))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return out
