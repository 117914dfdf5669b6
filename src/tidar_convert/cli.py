"""`tidar-convert fit | validate | export | generate | bench | eval-ppl`.

fit/validate are LightningCLI (every key of a recipe is a flag: --model.block_size 8,
--trainer.max_steps 20, --ckpt_path last); the others are typed functions whose signatures are
their flags.
"""

from __future__ import annotations

import json as jsonlib
import os
import sys
import time
from pathlib import Path


def _configure_wandb() -> None:
    """W&B stays offline unless the user has an account configured (key, netrc) or chose a mode."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return
    netrc = Path.home() / ".netrc"
    if netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return
    os.environ["WANDB_MODE"] = "offline"


def _lightning_cli(args: list[str] | None):
    from lightning.pytorch.cli import LightningCLI

    from .data import TiDARData
    from .export import export
    from .module import TiDARModule

    class TiDARCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_argument("--out", type=str | None, default=None, help="export the trained model to this folder after fit")

        def after_fit(self):
            out = self.config[self.subcommand].get("out")
            if out and self.trainer.is_global_zero:
                m = self.model
                path = export(m.model, m.tokenizer, out, m.block_size, m.alpha)
                print(f"exported TiDAR model to {path}")

    return TiDARCLI(TiDARModule, TiDARData, args=args, save_config_kwargs={"overwrite": True})


def export_cmd(checkpoint: str, out: str) -> str:
    """Export a Lightning checkpoint (e.g. runs/.../checkpoints/last.ckpt) as a TiDAR HF folder.

    Args:
        checkpoint: .ckpt written by `tidar-convert fit`.
        out: folder to write.
    """
    from .export import export
    from .module import TiDARModule

    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint!r} does not exist; `fit` writes them under <default_root_dir>/checkpoints/.")
    m = TiDARModule.load_from_checkpoint(checkpoint, map_location="cpu")
    return str(export(m.model, m.tokenizer, out, m.block_size, m.alpha))


def generate_cmd(
    model: str,
    prompt: str,
    max_new_tokens: int = 128,
    mode: str = "tidar",
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    no_chat_template: bool = False,
    block_size: int | None = None,
    dtype: str = "float32",
    json: bool = False,
) -> None:
    """Generate with an exported TiDAR model.

    Args:
        model: export folder (from `make convert` or `tidar-convert export`).
        prompt: the prompt text.
        max_new_tokens: tokens to generate (>= 1).
        mode: tidar (draft + verify) or ar (plain autoregressive, same weights).
        temperature: 0 = greedy; > 0 samples (exactly the AR distribution in tidar mode).
        top_p: nucleus sampling threshold (sampling only).
        top_k: top-k sampling (0 = off; sampling only).
        seed: random seed for sampling.
        no_chat_template: feed the prompt as raw text even if the tokenizer has a chat template.
        block_size: drafts per step (default: the trained block size).
        dtype: float32 or bfloat16 (bf16 is faster for TiDAR on GPUs and AMX CPUs).
        json: print one JSON object (text, new_tokens, nfe, tokens_per_nfe, seconds).
    """
    import torch
    from transformers import AutoTokenizer

    from .export import load

    if mode not in ("tidar", "ar"):
        raise ValueError(f"mode={mode!r}: use 'tidar' or 'ar'.")
    if not prompt:
        raise ValueError("the prompt is empty; pass --prompt 'some text'.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy).")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1] (1 = off), the share of probability mass sampled from.")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be >= 0 (0 = off).")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: use float32 or bfloat16.")
    lm = load(model, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(model)
    if tok.chat_template and not no_chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k} if temperature > 0 else {"do_sample": False}
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = lm.generate(ids, max_new_tokens=max_new_tokens, tidar=mode == "tidar", block_size=block_size, pad_token_id=tok.pad_token_id, **sampling)
    seconds = time.perf_counter() - t0
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    stats = lm.tidar_stats
    if json:
        print(jsonlib.dumps({"text": text, "new_tokens": stats["new_tokens"], "nfe": stats["nfe"], "tokens_per_nfe": stats["tokens_per_nfe"], "seconds": seconds}))
    else:
        print(text)
        print(f"\n[{mode}] {stats['new_tokens']} tokens, {stats['nfe']} forward passes, {stats['tokens_per_nfe']:.2f} tokens/NFE, {seconds:.2f} s", file=sys.stderr)



def _unix_flags(args: list[str], functions) -> list[str]:
    """Accept --max-new-tokens for --max_new_tokens, and a bare boolean flag (--json) for --json true."""
    import inspect

    bools = {f"--{n}" for fn in functions for n, p in inspect.signature(fn).parameters.items() if p.annotation in (bool, "bool")}
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" not in arg:
            arg = "--" + arg[2:].replace("-", "_")
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else "--"
        if arg in bools and following.startswith("--"):
            out.append("true")
    return out


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    _configure_wandb()
    try:
        if args and args[0] in ("fit", "validate"):
            _lightning_cli(argv)  # None: LightningCLI reads sys.argv itself
            return
        from jsonargparse import auto_cli

        from .bench import bench_cmd, eval_ppl_cmd

        commands = {"export": export_cmd, "generate": generate_cmd, "bench": bench_cmd, "eval-ppl": eval_ppl_cmd}
        auto_cli(commands, args=_unix_flags(args, commands.values()), as_positional=False)  # --model X, as the README says
    except (ValueError, FileNotFoundError, FloatingPointError, ConnectionError) as e:  # bad input, or no hub: the message says the fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
