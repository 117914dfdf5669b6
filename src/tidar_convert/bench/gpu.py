"""GPU latency and throughput of TiDAR on a Qwen2.5-1.5B-shaped model with random weights.

    tidar-convert bench-gpu [--dry-run] [--only engine,train] [--out bench/results/gpu.json]
    python -m tidar_convert.bench.gpu [--dry-run] ...   # the same, where jsonargparse is missing

Random weights are enough here: latency and throughput depend on shapes, not on what was learned,
and nothing has to be downloaded. Sections (each timed as a median over repeats, CUDA-synchronized):

  slots   one forward of n query slots (1, 2, 4, ... 256) after a 1k-token KV cache: how many
          extra token slots a decode step gets for free (the flat part of the curve).
  decode  a TiDAR decode step (k drafts + k*k masks, the decode mask of layout.py) against an AR
          step (1 slot) at k = 4, 8, 16; `step` includes building the mask as decode.py does each
          step, `forward` uses a prebuilt one. TiDAR beats AR in wall clock when its T/NFE exceeds
          `step_ratio`.
  train   forward + backward tokens/s (no optimizer step): TiDAR's doubled sequence with the
          training mask against plain causal AR on the same clean tokens; then the same TiDAR
          step under FSDP2 as the recipes train it (fully_shard per decoder layer, sharding.shard,
          a one-device mesh here: the sharding machinery's own cost), with MFU and peak memory.
  engine  generate() itself on the device, per attention implementation: a small Qwen2 trained on
          cycle streams with the training mask (on CUDA FlexAttention's BlockMask, forward and
          backward), then greedy TiDAR against transformers' AR on the same weights: identical
          tokens, T/NFE, tokens/s. Cycle streams make drafts easy, so its speed ratio bounds what
          the engine's per-step work lets through on this device; it is no conversion's figure.
          Then `tidar-convert generate --device` on the same weights from an export folder
          (`generate_cli`: the CLI's load, device placement and streaming).

The JSON is rewritten after every section, so a run cut short keeps what it measured.

On CUDA the model runs in bf16 with FlexAttention (BlockMask), with SDPA + dense masks alongside
for reference. `--dry-run` runs the same code on CPU with tiny shapes and SDPA + dense masks only
(FlexAttention has no CPU backward) in seconds, and writes the same JSON structure.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tidar_convert.bench.engine_check import engine_check
from tidar_convert.bench.machine import machine_info
from tidar_convert.bench.slots import slot_latency
from tidar_convert.bench.timing import median_seconds, synchronize
from tidar_convert.runtime import layout
from tidar_convert.runtime.forward import cache_kwargs
from tidar_convert.train.callbacks import matmul_params, peak_flops
from tidar_convert.train.loss import hybrid_loss

# Qwen2.5-1.5B's dimensions (its config.json), so the numbers transfer to the paper's 1.5B model.
QWEN25_15B = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
)
# The engine check's model: big enough that a GPU step is not all launch overhead, small enough to
# train in seconds.
ENGINE = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1536,
    vocab_size=512,
    max_position_embeddings=1024,
)


@dataclass
class Plan:
    dims: dict
    device: str
    dtype: torch.dtype
    impls: tuple[str, ...]  # attention implementations, the first one is used for training
    slots: tuple[int, ...]
    cache_len: int
    ks: tuple[int, ...] = (4, 8, 16)
    train_seq: int = 2048
    train_block: int = 16
    repeats: int = 10
    train_repeats: int = 3
    # a failing section is recorded in the JSON on a real run, raised in the dry run
    raise_errors: bool = False
    # no section starts after this many seconds (the run must end in < 10 min)
    budget_s: float = 420.0
    engine_dims: dict | None = None  # the engine check's model (None: the plan's own dims)
    engine_steps: int = 300  # its training steps on cycle streams
    engine_tokens: int = 64  # new tokens per prompt
    engine_prompts: int = 4


GPU_PLAN = Plan(
    QWEN25_15B,
    "cuda",
    torch.bfloat16,
    ("flex_attention", "sdpa"),
    tuple(2**i for i in range(9)),
    1024,
    engine_dims=ENGINE,
)
DRY_PLAN = Plan(
    TINY,
    "cpu",
    torch.float32,
    ("sdpa",),
    (1, 2, 4, 8, 16, 32),
    32,
    train_seq=64,
    repeats=2,
    train_repeats=1,
    raise_errors=True,
    engine_steps=60,
    engine_tokens=16,
    engine_prompts=2,
)


def build_model(plan: Plan):
    """Random-weight Qwen2 of the plan's shape, created directly on the device in the plan's
    dtype."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**plan.dims)
    torch.manual_seed(0)
    with torch.device(plan.device):
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=plan.impls[0], dtype=plan.dtype
        )
    return model.eval()


# --------------------------------------------------------------------------------------------
# Decode step vs AR step.
# --------------------------------------------------------------------------------------------


def prefill_cache(model, cache_len: int, device):
    from transformers import DynamicCache

    cache = DynamicCache()
    tokens = torch.randint(0, model.config.vocab_size, (1, cache_len), device=device)
    mask = layout.build_mask(
        layout.decode_mask_mod(0, cache_len, 1, 1),
        1,
        cache_len,
        cache_len,
        model.config._attn_implementation,
        device,
    )
    with torch.no_grad():
        model(
            input_ids=tokens,
            position_ids=torch.arange(cache_len, device=device)[None],
            attention_mask=mask,
            **cache_kwargs(model, cache),
        )
    return cache


def step_timer(model, cache, tokens, positions, mask_mod, device, prebuilt: bool):
    """A callable running one decode forward after the cache, then cropping the cache back."""
    n, kv_len = tokens.shape[1], cache.get_seq_length() + tokens.shape[1]
    impl = model.config._attn_implementation
    fixed = layout.build_mask(mask_mod, 1, n, kv_len, impl, device) if prebuilt else None

    def run():
        mask = fixed if prebuilt else layout.build_mask(mask_mod, 1, n, kv_len, impl, device)
        with torch.no_grad():
            model(
                input_ids=tokens,
                position_ids=positions,
                attention_mask=mask,
                **cache_kwargs(model, cache),
            )
        cache.crop(-n)

    return run


def decode_steps(model, plan: Plan) -> list[dict]:
    device = torch.device(plan.device)
    cache = prefill_cache(model, plan.cache_len, device)
    C, vocab = plan.cache_len, model.config.vocab_size
    start = torch.tensor([C], device=device)
    rows = []
    for k in plan.ks:
        # TiDAR: k drafts (causal) then k groups of k masks, exactly as decode.step lays them out.
        tidar_tokens = torch.randint(0, vocab, (1, k + k * k), device=device)
        tidar_pos = layout.decode_position_ids(start, k, k, k, 1)
        tidar_mask = layout.decode_mask_mod(C, k, k, 1)
        ar_tokens = torch.randint(0, vocab, (1, 1), device=device)
        ar_pos = start[:, None]
        ar_mask = layout.decode_mask_mod(C, 1, 1, 1)
        row = {"k": k, "slots": k + k * k}
        for name, args in (
            ("tidar", (tidar_tokens, tidar_pos, tidar_mask)),
            ("ar", (ar_tokens, ar_pos, ar_mask)),
        ):
            for prebuilt, label in ((False, "step_ms"), (True, "forward_ms")):
                fn = step_timer(model, cache, *args, device, prebuilt)
                row[f"{name}_{label}"] = 1000 * median_seconds(fn, device, plan.repeats, warmup=2)
        row["step_ratio"] = row["tidar_step_ms"] / row["ar_step_ms"]
        row["forward_ratio"] = row["tidar_forward_ms"] / row["ar_forward_ms"]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Training throughput.
# --------------------------------------------------------------------------------------------


def train_step_ar(model, ids):
    """Plain causal LM step: no mask given, the model builds its own causal one."""
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()


def train_step_tidar(model, ids, mask, draft_length: int, mask_id: int):
    """TiDAR step: [x | M..M] with repeated positions and the training mask, hybrid loss
    (alpha 1)."""
    inputs = layout.train_inputs(ids, mask_id)
    positions = layout.train_position_ids(ids)
    ar_labels, diff_labels = layout.train_labels(ids)
    logits = model(
        input_ids=inputs, position_ids=positions, attention_mask=mask, use_cache=False
    ).logits
    hybrid_loss(logits, ar_labels, diff_labels, 1.0, draft_length)["loss"].backward()


def train_throughput(model, plan: Plan) -> dict:
    device = torch.device(plan.device)
    S, k = plan.train_seq, plan.train_block
    layout.check_train_shape(S, k)
    ids = torch.randint(0, model.config.vocab_size - 1, (1, S), device=device)
    mask_id = model.config.vocab_size - 1
    mask = layout.build_mask(
        layout.train_mask_mod(S, k), 1, 2 * S, 2 * S, model.config._attn_implementation, device
    )
    model.train()
    out = {
        "seq_len": S,
        "draft_length": k,
        "attn_implementation": model.config._attn_implementation,
        "optimizer_step": False,
    }
    try:
        for name, fn in (
            ("ar", lambda: train_step_ar(model, ids)),
            ("tidar", lambda: train_step_tidar(model, ids, mask, k, mask_id)),
        ):

            def step(fn=fn):
                fn()
                model.zero_grad(set_to_none=True)

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = median_seconds(
                step, device, plan.train_repeats, warmup=2 if device.type == "cuda" else 1
            )
            out[name] = {"step_ms": 1000 * seconds, "tokens_per_s": S / seconds}
            if device.type == "cuda":
                out[name]["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    out["tidar_vs_ar"] = out["tidar"]["tokens_per_s"] / out["ar"]["tokens_per_s"]
    out["tidar_fsdp"] = fsdp_train_step(
        model, plan, lambda m: train_step_tidar(m, ids, mask, k, mask_id)
    )
    out["tidar_fsdp_vs_tidar"] = out["tidar_fsdp"]["tokens_per_s"] / out["tidar"]["tokens_per_s"]
    peak = peak_flops(device, "bf16" if plan.dtype == torch.bfloat16 else "32")
    n = matmul_params(model)
    # TiDAR runs 2S positions per S tokens
    for name, per_token in (("ar", 6 * n), ("tidar", 12 * n), ("tidar_fsdp", 12 * n)):
        out[name]["tflops"] = out[name]["tokens_per_s"] * per_token / 1e12
        out[name]["mfu"] = out[name]["tokens_per_s"] * per_token / peak if peak else None
    return out


def fsdp_train_step(model, plan: Plan, step_fn) -> dict:
    """step_fn on a copy of the model sharded as `fit` shards it under ModelParallelStrategy, in a
    one-process group (NCCL on CUDA, gloo on CPU) that is closed again afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tidar_convert.train.sharding import shard

    device = torch.device(plan.device)
    own_group = not dist.is_initialized()
    if own_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    try:
        sharded = shard(copy.deepcopy(model), init_device_mesh(device.type, (1,)))
        sharded.train()

        def step(module=sharded):
            step_fn(module)
            module.zero_grad(set_to_none=True)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = median_seconds(
            step, device, plan.train_repeats, warmup=2 if device.type == "cuda" else 1
        )
        out = {
            "step_ms": 1000 * seconds,
            "tokens_per_s": plan.train_seq / seconds,
            "mesh": [1],
            "unit": "decoder layer",
        }
        # the unsharded model of the other rows is still resident beside the copy
        if device.type == "cuda":
            out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            out["peak_memory_note"] = (
                "includes the unsharded model the ar/tidar rows use, still resident"
            )
        # the sharded copy goes before the process group it lives on is closed
        del step, sharded
        return out
    finally:
        if own_group:
            dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------------------------


SECTIONS = ("slots", "decode", "train", "engine")


def section(result: dict, key: str, plan: Plan, fn, started: float):
    """Run one measurement into result[key]. On a real run a failure is recorded, not fatal, so one
    broken section (e.g. a FlexAttention compile error) still leaves the others' numbers; and a
    section that would start past the time budget is skipped, so the script ends in time."""
    if fn is None:  # not asked for (--only)
        return
    if time.perf_counter() - started > plan.budget_s:
        result[key] = {"skipped": f"time budget of {plan.budget_s:.0f} s spent"}
        return
    t0 = time.perf_counter()
    try:
        result[key] = fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON for the reader
        if plan.raise_errors:
            raise
        result[key] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{key}] failed: {type(e).__name__}: {e}", file=sys.stderr)
    result.setdefault("section_seconds", {})[key] = time.perf_counter() - t0
    print(f"[{key}] done in {result['section_seconds'][key]:.1f} s", file=sys.stderr)


def run(
    plan: Plan, dry_run: bool, save=lambda result: None, only: tuple[str, ...] = SECTIONS
) -> dict:
    """The primary attention implementation first (slots, decode, train), then the engine check on
    the reference one (the engine's path in an export), then the reference numbers and the engine
    under the primary, so a tight time budget drops those first. save(result) after each section;
    `only` names the sections to run."""
    started = time.perf_counter()
    # Every new mask_mod closure (another k, another cache length) recompiles flex_attention; past
    # the default limit of 8 it would fall back to the unfused eager kernel and distort the timings.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    device = torch.device(plan.device)
    model = build_model(plan)
    result = {
        "dry_run": dry_run,
        "machine": machine_info(device, model),
        "model": {
            "shape": "Qwen2.5-1.5B" if plan.dims is QWEN25_15B else "tiny",
            "dims": plan.dims,
            "dtype": str(plan.dtype),
            "weights": "random",
        },
        "plan": {
            k: v for k, v in asdict(plan).items() if k not in ("dims", "dtype", "raise_errors")
        },
        "slots": {"cache_len": plan.cache_len, "by_impl": {}},
        "decode": {"cache_len": plan.cache_len, "by_impl": {}},
    }
    result["engine"] = {"by_impl": {}}
    result["conversion"] = {
        "skipped": (
            "a real conversion needs base weights from the hub; run `make convert` separately"
        )
    }
    result["sections"] = list(only)
    engine_order = plan.impls[1:] + plan.impls[:1]

    def asked(name, fn):
        return fn if name in only else None

    for i, impl in enumerate(plan.impls):
        model.set_attn_implementation(impl)
        section(
            result["slots"]["by_impl"],
            impl,
            plan,
            asked("slots", lambda: slot_latency(model, plan.slots, plan.cache_len, plan.repeats)),
            started,
        )
        save(result)
        section(
            result["decode"]["by_impl"],
            impl,
            plan,
            asked("decode", lambda: decode_steps(model, plan)),
            started,
        )
        save(result)
        if i == 0:
            section(
                result,
                "train",
                plan,
                asked("train", lambda: train_throughput(model, plan)),
                started,
            )
            save(result)
            section(
                result["engine"]["by_impl"],
                engine_order[0],
                plan,
                asked("engine", lambda: engine_check(plan, engine_order[0])),
                started,
            )
            save(result)
    for impl in engine_order[1:]:
        section(
            result["engine"]["by_impl"],
            impl,
            plan,
            asked("engine", lambda: engine_check(plan, impl)),
            started,
        )
        save(result)
    synchronize(device)
    result["seconds"] = time.perf_counter() - started
    return result


def print_report(result: dict) -> None:
    for impl, rows in result["decode"]["by_impl"].items():
        if isinstance(rows, dict):
            continue
        for r in rows:
            print(
                f"decode {impl:>14} k={r['k']:>2} ({r['slots']:>3} slots): TiDAR step "
                f"{r['tidar_step_ms']:.2f} ms, AR step {r['ar_step_ms']:.2f} ms, ratio "
                f"{r['step_ratio']:.2f} (forward only {r['forward_ratio']:.2f})"
            )
    train = result.get("train", {})
    if "tidar" in train:
        print(
            f"train {train['attn_implementation']}: AR {train['ar']['tokens_per_s']:.0f} tok/s, "
            f"TiDAR {train['tidar']['tokens_per_s']:.0f} tok/s ({train['tidar_vs_ar']:.2f}x)"
        )
        fsdp = train["tidar_fsdp"]
        mfu = "" if fsdp["mfu"] is None else f", MFU {fsdp['mfu']:.1%}"
        print(
            f"train TiDAR under FSDP2 (1 device): {fsdp['tokens_per_s']:.0f} tok/s "
            f"({train['tidar_fsdp_vs_tidar']:.2f}x unsharded){mfu}"
        )
    for impl, e in result.get("engine", {}).get("by_impl", {}).items():
        if "identical" in e:
            print(
                f"engine {impl:>14}: TiDAR tokens identical to AR {e['identical']}, T/NFE "
                f"{e['tokens_per_nfe']:.2f}, {e['tidar_vs_ar']:.2f}x AR (cycle streams)"
            )
    print(f"total {result['seconds']:.1f} s")


def bench_gpu_cmd(
    dry_run: bool = False, only: str = ",".join(SECTIONS), out: str | None = None
) -> str:
    """GPU latency and throughput of TiDAR on a Qwen2.5-1.5B-shaped model with random weights.

    The sections slots, decode, train and engine (this module's docstring, bench/README.md), on a
    CUDA device in bf16; the JSON is rewritten after every section.

    Args:
        dry_run: run on the CPU with tiny shapes and SDPA + dense masks: checks the script in
            seconds, without a GPU.
        only: the sections to run, comma-separated, of slots, decode, train, engine (default: all).
        out: JSON to write; default bench/results/gpu.json, or bench/results/gpu_dry_run.json with
            --dry-run.

    Returns:
        Path of the JSON written.
    """
    if not dry_run and not torch.cuda.is_available():
        raise ValueError(
            "no CUDA device here; run on a GPU machine, or pass --dry-run to check the script on "
            "CPU."
        )
    sections = tuple(name.strip() for name in only.split(",") if name.strip())
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown or not sections:
        raise ValueError(f"--only {only!r}: the sections are {', '.join(SECTIONS)}")
    path = Path(out or ("bench/results/gpu_dry_run.json" if dry_run else "bench/results/gpu.json"))
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        path.write_text(json.dumps(result, indent=1, default=str))

    result = run(DRY_PLAN if dry_run else GPU_PLAN, dry_run, save, sections)
    save(result)
    print_report(result)
    print(f"wrote {path}")
    return str(path)


if __name__ == "__main__":
    # Not through `tidar-convert`: a GPU lease's image has no jsonargparse (bench.without
    # rehearses that on a CPU). The flags are the same, read from bench_gpu_cmd's signature.
    from tidar_convert.bench.plain_cli import run as run_command

    run_command(bench_gpu_cmd, "python -m tidar_convert.bench.gpu")
