"""The GPU bench's engine check: `generate()` itself on the device (python -m
tidar_convert.bench.gpu, section `engine`). A small Qwen2 trained on cycle streams with the training
layout and loss, then greedy TiDAR against transformers' AR on the same weights. Cycle streams make
drafts easy, so the speed ratio bounds what the engine's per-step host work lets through on the
device; it is no conversion's figure."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tidar_convert.bench.timing import median_seconds
from tidar_convert.runtime import layout
from tidar_convert.runtime.spec import TiDARSpec
from tidar_convert.train.loss import hybrid_loss

if TYPE_CHECKING:
    from tidar_convert.bench.gpu import Plan


def cycles(batch: int, length: int, period: int = 7, offset: int = 3, generator=None):
    """Streams repeating one cycle from random phases (the tests' cycle_batch too): learnt in
    seconds."""
    phase = torch.randint(0, period, (batch, 1), generator=generator)
    return offset + (phase + torch.arange(length)) % period


def engine_model(
    plan: Plan, impl: str, dtype: torch.dtype, draft_length: int = 4, seq_len: int = 128
):
    """A Qwen2 of plan.engine_dims trained with the TiDAR layout and loss on cycle streams (fp32
    weights; bf16: under autocast, as bf16-mixed trains, then cast for decoding). seq_len 128: on
    an H200, torch 2.11's FlexAttention backward found no kernel for 2 x 32 positions (fp32 or
    bf16), shorter than its 128-position block."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    device, dims = torch.device(plan.device), plan.engine_dims or plan.dims
    config = Qwen2Config(**dims, mask_token_id=dims["vocab_size"] - 1)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=impl, dtype=torch.float32
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = layout.build_mask(
        layout.train_mask_mod(seq_len, draft_length), 8, 2 * seq_len, 2 * seq_len, impl, device
    )
    model.train()
    for _ in range(plan.engine_steps):
        ids = cycles(8, seq_len).to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(
                input_ids=layout.train_inputs(ids, config.mask_token_id),
                position_ids=layout.train_position_ids(ids),
                attention_mask=mask,
                use_cache=False,
            ).logits
        loss = hybrid_loss(logits, *layout.train_labels(ids), alpha=1.0, draft_length=draft_length)
        opt.zero_grad(set_to_none=True)
        loss["loss"].backward()
        opt.step()
    TiDARSpec(draft_length, model.config.mask_token_id).write(model.config)
    return model.to(dtype).eval(), {
        k: v.item() for k, v in loss.items() if torch.is_tensor(v) and v.numel() == 1
    }


def engine_check(plan: Plan, impl: str) -> dict:
    """TiDAR's generate() against transformers' greedy AR on the same trained weights, per prompt
    (each timed after one untimed run of both): identical tokens, T/NFE, tokens/s. fp32, except
    FlexAttention on CUDA: bf16, as bf16-mixed trains there (on an H200 with torch 2.11, an fp32 run
    did not finish in the time the section had: bench/LOG.md, 2026-12-04)."""
    from tidar_convert.runtime.generate import generate

    device = torch.device(plan.device)
    dtype = torch.bfloat16 if impl == "flex_attention" and device.type == "cuda" else torch.float32
    model, loss = engine_model(plan, impl, dtype)
    prompts = cycles(plan.engine_prompts, 12, generator=torch.Generator().manual_seed(1)).to(device)
    n = plan.engine_tokens
    out = {
        "attn_implementation": impl,
        "dtype": str(dtype),
        "dims": plan.engine_dims or plan.dims,
        "train_steps": plan.engine_steps,
        "final_loss": loss,
        "new_tokens": n,
        "prompts": [],
    }
    for ids in prompts[:, None]:

        def ar():
            return model.generate(
                ids,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )

        def tidar():
            return generate(ids, model=model, max_new_tokens=n, eos_token_id=None, pad_token_id=0)

        ar_s, tidar_s = median_seconds(ar, device, 3), median_seconds(tidar, device, 3)
        stats = dict(model.tidar_stats)
        out["prompts"].append(
            {
                "identical": bool(torch.equal(ar(), tidar())),
                "tokens_per_nfe": stats["tokens_per_nfe"],
                "ar_s": ar_s,
                "tidar_s": tidar_s,
                "tidar_vs_ar": ar_s / tidar_s,
            }
        )
    rows = out["prompts"]
    out["identical"] = f"{sum(r['identical'] for r in rows)}/{len(rows)}"
    out["tokens_per_nfe"] = sum(r["tokens_per_nfe"] for r in rows) / len(rows)
    out["tidar_vs_ar"] = sum(r["ar_s"] for r in rows) / sum(r["tidar_s"] for r in rows)
    try:
        out["generate_cli"] = generate_cli_check(model, plan.device, prompts[0], n)
    except Exception as e:  # noqa: BLE001 - the engine's figures above stand without it
        if plan.raise_errors:
            raise
        out["generate_cli"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def generate_cli_check(model, device: str, ids: torch.Tensor, new_tokens: int) -> dict:
    """`tidar-convert generate --device DEVICE` as a user runs it (cli.generate_cmd): the model
    exported with a byte-level tokenizer without merges (id i is the i-th character of its
    alphabet, so a prompt of ids reads back as those ids), loaded from the folder onto the device,
    decoded in tidar and ar modes, printed at the end and streamed. Whether the four texts are
    one, and TiDAR's tokens per forward."""
    import contextlib
    import io
    import json
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tidar_convert.cli import generate_cmd
    from tidar_convert.exports.folder import export

    V = model.config.vocab_size
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {f"<|unused{i}|>": i for i in range(len(vocab), V)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token=f"<|unused{V - 2}|>", mask_token=f"<|unused{V - 1}|>"
    )
    prompt = tokenizer.decode(ids.tolist())
    dtype = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
    with tempfile.TemporaryDirectory() as folder:
        export(model, tokenizer, f"{folder}/tidar", TiDARSpec.from_config(model.config))

        def run(mode: str, json_out: bool) -> str:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
                generate_cmd(
                    f"{folder}/tidar",
                    prompt,
                    max_new_tokens=new_tokens,
                    mode=mode,
                    dtype=dtype,
                    device=device,
                    no_chat_template=True,
                    json=json_out,
                )
            return printed.getvalue()

        tidar, ar = json.loads(run("tidar", True)), json.loads(run("ar", True))
        streamed = [run(mode, False).strip() for mode in ("tidar", "ar")]
    return {
        "device": tidar["device"],  # where generate_cmd put the weights
        "identical": tidar["text"].strip() == ar["text"].strip() == streamed[0] == streamed[1],
        "new_tokens": tidar["new_tokens"],
        "tokens_per_nfe": tidar["tokens_per_nfe"],
    }
