"""A GPU lease's one run: the embedded default converted on the device, then benched there.

    python -m tidar_convert.bench.lease --staged .lease/2 --out $OUT        # the second call
    python -m tidar_convert.bench.lease --staged .lease/1 --stage-only      # the first call
    python -m tidar_convert.bench.lease --dry-run [--staged DIR] [--out DIR]   # on a CPU

No jsonargparse (the image lacks it): the flags are lease_cmd's, read by plain_cli, and training is
the project's own pieces without LightningCLI: TiDARModule (recipe's model settings), TiDARData, the
hybrid loss and layout through `forward_tidar`, the export of `fit`. Sections, in order, each
written to OUT/<section>.json as it ends:

  stage       the halves the calls carried kept, joined, sha256 checked (lease_stage.py)
  corpus      the base's greedy documents, generated in large batches (train/distill.py)
  throughput  training tokens/s and MFU, TiDAR against AR, eager and compiled (per decoder layer)
  train       the conversion: the recipe's model settings, bf16 autocast, FlexAttention on CUDA,
              for a wall-clock budget, on the greedy documents, prose, the standard library and
              the installed transformers' source
  export      the trained module written as `fit --out` writes it
  bench       the export, bench and chat prompts, greedy and sampled, batch 1 and 8: per row
              T/NFE, tokens/s, host ms a step, and outputs identical to AR

A real run records a failing section and goes on (a section that needs a failed one says so); the
dry run raises. No section starts past the time budget, and training takes what the budget leaves
after keeping `after_train_s` for export and bench, so the call ends inside its limit.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tidar_convert.bench import lease_stage
from tidar_convert.bench.timing import median_seconds, synchronize

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "smollm2-135m-cpu-best.yaml"
# Export's rows first: "ar" is the reference every other row is compared with, so it runs first;
# the compiled rows last, since their first runs compile.
BENCH_ROWS = (
    "ar",
    "tidar",
    "tidar_diffusion",
    "tidar_diffusion_wide",
    "tidar_lookup",
    "prompt_lookup",
    "tidar_compiled",
    "ar_compiled",
)


@dataclass
class Plan:
    device: str
    budget_s: float  # the whole run, from its start
    train_s: float  # the conversion's wall clock, if the budget leaves it
    after_train_s: float  # kept for export and bench
    seq_len: int
    batch_size: int
    greedy_docs: int
    greedy_batch: int
    greedy_new_tokens: int
    greedy_share: float
    num_workers: int
    repeats: int  # timed steps per throughput row
    compile_backend: str  # inductor on a GPU; the dry run traces with dynamo only ("eager")
    prompts: int  # per prompt set at batch 1
    batch: int  # the larger batch size
    new_tokens: int
    raise_errors: bool
    log_every: int = 20


GPU_PLAN = Plan(
    "cuda",
    budget_s=540,
    train_s=300,
    # export, model load and the bench at 2 prompts a set: about 2.5 minutes (an estimate: no lease
    # has run it yet)
    after_train_s=150,
    seq_len=1024,
    batch_size=8,
    greedy_docs=4096,
    greedy_batch=1024,
    greedy_new_tokens=160,
    greedy_share=0.5,
    num_workers=8,
    repeats=3,
    compile_backend="inductor",
    prompts=2,
    batch=8,
    new_tokens=96,
    raise_errors=False,
)
DRY_PLAN = Plan(
    "cpu",
    budget_s=300,
    train_s=8,
    after_train_s=20,
    seq_len=64,
    batch_size=2,
    greedy_docs=8,
    greedy_batch=4,
    greedy_new_tokens=8,
    greedy_share=0.5,
    num_workers=0,
    repeats=1,
    compile_backend="eager",
    prompts=2,
    batch=2,
    new_tokens=8,
    raise_errors=True,
    log_every=2,
)


class Deadline:
    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


class Run:
    """The sections' results, each written to out/<name>.json when it ends."""

    def __init__(self, plan: Plan, out: Path, dry_run: bool):
        self.plan, self.out, self.dry_run = plan, out, dry_run
        self.deadline = Deadline(plan.budget_s)
        self.results: dict[str, dict] = {}
        out.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, result: dict) -> None:
        self.results[name] = result
        (self.out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    def section(self, name: str, fn, needs: tuple[str, ...] = ()) -> dict:
        """fn() into out/<name>.json with its seconds; a failure recorded (raised in the dry run),
        a section whose inputs failed or past the budget skipped, each saying why."""
        failed = [n for n in needs if "error" in self.results.get(n, {"error": "not run"})]
        if failed:
            result = {"skipped": f"needs {', '.join(failed)}, which did not finish"}
        elif self.deadline.left() <= 0:
            result = {"skipped": f"the time budget of {self.plan.budget_s:.0f} s was spent"}
        else:
            t0 = time.perf_counter()
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - recorded for the reader, the run goes on
                if self.plan.raise_errors:
                    raise
                # what the section wrote before it failed (the bench's finished prompts) stays
                result = {
                    **self.results.get(name, {}),
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
                print(f"[{name}] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            result["seconds"] = time.perf_counter() - t0
        self.write(name, result)
        print(f"[{name}] {summary_of(result)}", file=sys.stderr, flush=True)
        return result


def summary_of(result: dict) -> str:
    for key in ("skipped", "error"):
        if key in result:
            return f"{key}: {result[key]}"
    return f"done in {result['seconds']:.1f} s"


# --------------------------------------------------------------------------------------------
# The base model and its settings.
# --------------------------------------------------------------------------------------------


def recipe_settings() -> tuple[dict, dict]:
    """The recommended recipe's model and data sections (RESULTS.md §1): the device runs the CPU's
    recipe at the GPU's scale, nothing tuned for it."""
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text())
    return recipe["model"], recipe["data"]


def optimizer_factory(spec: dict):
    """A recipe's `optimizer:` (class_path, init_args) as the factory TiDARModule takes."""
    import importlib

    module, name = spec["class_path"].rsplit(".", 1)
    cls, kwargs = getattr(importlib.import_module(module), name), spec.get("init_args") or {}
    return lambda params: cls(params, **kwargs)


def tiny_base(folder: Path) -> str:
    """The dry run's base: a random two-layer Llama with a byte-level BPE tokenizer trained on the
    bench's prompts and a ChatML template (SmolLM2-Instruct's), saved as a model folder, so every
    section loads it as it loads the real base."""
    if (folder / "config.json").exists():
        return str(folder)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tidar_convert.bench.prompts import CHAT_PROMPTS, TEXT_PROMPTS

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = list(TEXT_PROMPTS) + [text for _, text in CHAT_PROMPTS]
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def sources() -> list[str]:
    """The recipe's sources, plus what else the image holds that a user would train on: the
    installed transformers' own source (Python with English docstrings)."""
    import transformers

    _, data = recipe_settings()
    return [*data["source"], str(Path(transformers.__file__).parent)]


def module_for(plan: Plan, base: str | None):
    """TiDARModule as `fit` builds it from the recipe (its model section), its model loaded."""
    from tidar_convert.train.module import TiDARModule

    settings, _ = recipe_settings()
    settings = {**settings, "model": base, "optimizer": optimizer_factory(settings["optimizer"])}
    module = TiDARModule(**settings)
    module.configure_model()
    module.model.to(plan.device)
    return module


def data_for(plan: Plan, module):
    """TiDARData with the recipe's split, the plan's scale and the lease's sources."""
    from tidar_convert.data import TiDARData

    _, data = recipe_settings()
    dm = TiDARData(
        source=sources(),
        seq_len=plan.seq_len,
        batch_size=plan.batch_size,
        val_every=data["val_every"],
        greedy_docs=plan.greedy_docs,
        greedy_new_tokens=plan.greedy_new_tokens,
        greedy_share=plan.greedy_share,
        greedy_dtype="bfloat16" if plan.device == "cuda" else "float32",
        num_workers=plan.num_workers,
    )
    dm.tokenizer, dm.base_model = module.tokenizer, module.hparams.model or "default"
    return dm


# --------------------------------------------------------------------------------------------
# Sections.
# --------------------------------------------------------------------------------------------


def corpus(plan: Plan, dm) -> dict:
    """The greedy documents `fit --data.greedy_docs` would make, at the plan's batch size, where
    the data module reads them."""
    from tidar_convert.data.greedy import CorpusSpec
    from tidar_convert.train.distill import make_corpus

    spec = CorpusSpec.of(dm)
    path = spec.path
    t0 = time.perf_counter()
    made = not path.is_file()
    if made:
        make_corpus(spec, path, plan.greedy_batch, plan.device)
    seconds = time.perf_counter() - t0
    new = dm.greedy_docs * dm.greedy_new_tokens
    return {
        "path": str(path),
        "made_here": made,
        "documents": dm.greedy_docs,
        "batch": plan.greedy_batch,
        "new_tokens_each": dm.greedy_new_tokens,
        "dtype": dm.greedy_dtype,
        "generated_tokens_per_s": new / seconds if made and seconds > 0 else None,
        "sources": dm.sources,
        "greedy_share": dm.greedy_share,
    }


def compile_layers(model, backend: str) -> int:
    """torch.compile each decoder layer (regional compilation: one graph the layers share, so the
    compile costs about one layer's, not the whole model's); the number compiled."""
    from tidar_convert.train.sharding import decoder_layer_class

    layer_class = decoder_layer_class(model)
    layers = [m for m in model.modules() if isinstance(m, layer_class)]
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def uncompile_layers(model) -> None:
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None


def dynamo_counts() -> dict:
    """What dynamo has traced so far: graphs and graph breaks (the same on a CPU as on a GPU, so the
    dry run sees them)."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def peak(device: torch.device) -> float | None:
    from tidar_convert.train.callbacks import peak_flops

    return peak_flops(device, "bf16-mixed")


def throughput(plan: Plan, base: str) -> dict:
    """Training tokens/s of a full fine-tune of the base, forward and backward (no optimizer step),
    bf16 autocast: AR (causal, S positions) against TiDAR (2S positions, the training mask, the
    hybrid loss), eager and with compiled decoder layers; MFU at 6N and 12N FLOPs a token (as
    bench.gpu counts them). Each row's first step is timed apart (first_step_s: its compile)."""
    from tidar_convert.bench.gpu import train_step_ar, train_step_tidar
    from tidar_convert.models.loading import load_base
    from tidar_convert.runtime import layout
    from tidar_convert.train.callbacks import matmul_params

    device = torch.device(plan.device)
    model, tokenizer = load_base(base)
    model.to(device).train()
    S, k, B = plan.seq_len, recipe_settings()[0]["draft_length"], plan.batch_size
    ids = torch.randint(0, model.config.vocab_size - 2, (B, S), device=device)
    impl = model.config._attn_implementation
    mask = layout.build_mask(layout.train_mask_mod(S, k), B, 2 * S, 2 * S, impl, device)
    steps = {
        "ar": lambda m: train_step_ar(m, ids),
        "tidar": lambda m: train_step_tidar(m, ids, mask, k, tokenizer.mask_token_id),
    }
    n, top = matmul_params(model), peak(device)
    out = {"seq_len": S, "batch": B, "draft_length": k, "attn_implementation": impl}
    out.update({"optimizer_step": False, "matmul_params": n, "peak_flops": top})
    for compiled in (False, True):
        subject = copy.deepcopy(model) if compiled else model
        if compiled:
            compile_layers(subject, plan.compile_backend)
        for name, fn in steps.items():
            per_token = (6 if name == "ar" else 12) * n
            row = f"{name}_{'compiled' if compiled else 'eager'}"
            try:
                out[row] = timed_rows(plan, fn, subject, B * S, per_token, top)
            except Exception as e:  # noqa: BLE001 - a compile error leaves the other rows
                if plan.raise_errors:
                    raise
                out[row] = {"error": f"{type(e).__name__}: {e}"}
        del subject
    for mode in ("eager", "compiled"):
        ar, tidar = out[f"ar_{mode}"], out[f"tidar_{mode}"]
        if "tokens_per_s" in ar and "tokens_per_s" in tidar:
            out[f"tidar_vs_ar_{mode}"] = tidar["tokens_per_s"] / ar["tokens_per_s"]
    out["dynamo"] = dynamo_counts()
    del model
    return out


def timed_rows(plan: Plan, fn, model, tokens: int, per_token: int, top: float | None) -> dict:
    """One throughput row: the first step (the compile, if any) timed alone, then the median."""
    device = torch.device(plan.device)

    def step():
        with torch.autocast(device.type, torch.bfloat16):
            fn(model)
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    synchronize(device)
    first = time.perf_counter() - t0
    seconds = median_seconds(step, device, plan.repeats, warmup=1)
    return {
        "first_step_s": first,
        "step_ms": 1000 * seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": tokens / seconds * per_token / top if top else None,
    }


def lr_factor(progress: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """transformers' cosine-with-min-lr curve (fit's schedule) at `progress` in [0, 1] of the run:
    here the share of the wall-clock budget spent, since a run bounded by time has no step count."""
    import math

    if progress < warmup_ratio:
        return progress / warmup_ratio
    p = min(1.0, (progress - warmup_ratio) / max(1e-9, 1 - warmup_ratio))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def batches(dm):
    """Training batches for ever: the loader again at each epoch's end."""
    while True:
        loader = dm.train_dataloader()
        for batch in loader:
            yield loader.count(batch)


def train(plan: Plan, module, dm, seconds: float) -> dict:
    """The conversion: `forward_tidar` (the recipe's loss, layout and masks) under bf16 autocast,
    AdamW on the schedule of `fit` by time, until `seconds` have passed. Its decoder layers are
    compiled where the module runs one forward (eager again if the first step fails to compile);
    with split halves (the recipe's lora_scope masks) they run eager (see below)."""
    from tidar_convert.train.callbacks import flops_per_token

    device = torch.device(plan.device)
    model = module.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = module.optimizer_factory(params)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    hp = module.hparams
    out = {"log": []}
    if module.split_halves:
        # The mask half reads the clean half's cache, indexed by each layer's layer_idx, which
        # dynamo specializes on: one graph per layer and grad mode (the dry run counts them), many
        # compiles for what is cheaper eager already (the clean half without autograd).
        out["compiled_layers"] = 0
        out["eager_because"] = "split halves: dynamo compiles one graph per decoder layer"
    else:
        out["compiled_layers"] = compile_layers(model, plan.compile_backend)
    out.update(
        {
            "seconds_budget": seconds,
            "seq_len": plan.seq_len,
            "batch": plan.batch_size,
            "attn_implementation": module.attn_implementation,
            "settings": {k: v for k, v in hp.items() if k != "optimizer"},
        }
    )
    flops, top = flops_per_token(module), peak(device)
    data = batches(dm)
    tokens = steps = 0
    started = time.perf_counter()
    window = (started, 0)
    while True:
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            break
        factor = lr_factor(elapsed / seconds, hp["warmup_ratio"], hp["min_lr_ratio"])
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * factor
        batch = {k: v.to(device) for k, v in next(data).items()}
        try:
            loss = step(module, optimizer, batch, device)
        except Exception as e:  # noqa: BLE001 - the run goes on eager
            if steps or plan.raise_errors or not out["compiled_layers"]:
                raise
            out["compile_error"] = f"{type(e).__name__}: {e}"
            uncompile_layers(model)
            out["compiled_layers"] = 0
            optimizer.zero_grad(set_to_none=True)
            loss = step(module, optimizer, batch, device)
        steps += 1
        tokens += batch["input_ids"].numel()
        if steps % plan.log_every == 0:
            synchronize(device)
            now = time.perf_counter()
            rate = (tokens - window[1]) / (now - window[0])
            out["log"].append(
                {
                    "step": steps,
                    "seconds": now - started,
                    "loss": loss,
                    "tokens_per_s": rate,
                    "mfu": rate * flops / top if top else None,
                }
            )
            window = (now, tokens)
    synchronize(device)
    spent = time.perf_counter() - started
    out.update({"steps": steps, "tokens": tokens, "seconds_trained": spent})
    out["tokens_per_s"] = tokens / spent if spent else None
    out["flops_per_token"] = flops
    out["mfu"] = out["tokens_per_s"] * flops / top if top and out["tokens_per_s"] else None
    out["dynamo"] = dynamo_counts()
    uncompile_layers(model)
    return out


def step(module, optimizer, batch: dict, device: torch.device) -> float:
    with torch.autocast(device.type, torch.bfloat16):
        out = module.forward_tidar(
            batch["input_ids"], batch.get("doc_ids"), batch.get("no_ar_target")
        )
    out["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(out["loss"].detach())


def export_section(module, steps: int, folder: Path) -> dict:
    """What `fit --out` writes at the end of a run, in the base's dtype."""
    from tidar_convert.exports.card import training_card
    from tidar_convert.exports.folder import export, export_dtype

    card = training_card(module.hparams, steps, folder.parent)
    path = export(
        module.unsharded_model(),
        module.tokenizer,
        folder,
        module.spec,
        overwrite=True,
        card=card,
        dtype=export_dtype(None, module.config),
    )
    files = {p.name: p.stat().st_size for p in Path(path).rglob("*") if p.is_file()}
    return {"path": str(path), "files": files, "bytes": sum(files.values())}


# --------------------------------------------------------------------------------------------
# The bench.
# --------------------------------------------------------------------------------------------


def bench(plan: Plan, folder: str, run: Run) -> dict:
    """Every row of BENCH_ROWS on the export, on the bench (raw) and chat prompts, greedy and
    sampled, at batch 1 (bench_prompt per prompt) and at plan.batch (one left-padded batch per
    set); rewritten after each prompt or batch, and stopped at the deadline."""
    from transformers import AutoTokenizer

    from tidar_convert.bench.decoders import DECODERS, SAMPLING
    from tidar_convert.exports.folder import load

    dtype = torch.bfloat16 if plan.device == "cuda" else torch.float32
    model = load(folder, dtype=dtype).to(plan.device).eval()
    if plan.compile_backend != "inductor":
        # The compiled rows compile where generate() auto-compiles (a GPU); the dry run has them
        # traced by dynamo on the CPU, so what would break the compile shows before a lease.
        from transformers import CompileConfig

        config = CompileConfig(backend=plan.compile_backend, mode=None)
        config._compile_all_devices = True
        model.generation_config.compile_config = config
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = tuple(name for name in BENCH_ROWS if name in DECODERS)
    out = {
        "dtype": str(dtype),
        "rows": list(rows),
        "missing_rows": [n for n in BENCH_ROWS if n not in DECODERS],
        "new_tokens": plan.new_tokens,
        "sampling": SAMPLING,
        "batch_1": {},
        f"batch_{plan.batch}": {},
    }
    sampling = {**SAMPLING, "seed": 0}
    before = dynamo_counts()
    for name in ("raw", "chat"):
        out["batch_1"][name] = one_by_one(plan, model, tokenizer, name, rows, sampling, run, out)
    for name in ("raw", "chat"):
        out[f"batch_{plan.batch}"][name] = batched(
            plan, model, tokenizer, name, rows, sampling, run
        )
        # the compiled rows' graphs (each TiDAR slot bucket one) and breaks
        out["dynamo"] = {k: v - before[k] for k, v in dynamo_counts().items()}
        run.write("bench", out)
    return out


def one_by_one(plan, model, tokenizer, name, rows, sampling, run, out) -> dict:
    from tidar_convert.bench.decoders import bench_prompt
    from tidar_convert.bench.prompts import prompt_set
    from tidar_convert.bench.summary import summarize

    prompts = prompt_set(name, plan.prompts)
    # untimed: compiles (ar_compiled), the engine's step costs learned, kernels chosen
    bench_prompt(model, tokenizer, prompts[0], 4, None, 4, rows)
    done = []
    result = {"prompts": [], "skipped": None}
    for prompt in prompts:
        if run.deadline.left() <= 0:
            result["skipped"] = f"{len(prompts) - len(done)} prompts: the time budget was spent"
            break
        done.append(
            bench_prompt(model, tokenizer, prompt, plan.new_tokens, None, 4, rows, None, sampling)
        )
        result.update(
            prompts=done,
            greedy=table(summarize(done)),
            sampled=table(summarize([r["sampling"] for r in done])),
        )
        out["batch_1"][name] = result
        run.write("bench", out)
    return result


def table(summary: dict) -> dict:
    """The issue's columns of each row."""
    keys = ("tokens_per_nfe", "tokens_per_s", "host_ms_per_step", "identical", "prompts")
    return {row: {k: s.get(k) for k in keys} for row, s in summary.items()}


def batched(plan, model, tokenizer, name, rows, sampling, run) -> dict:
    """One left-padded batch of plan.batch prompts, each row greedy then sampled: tokens up to each
    row's EOS, T/NFE per row, tokens/s of the batch, outputs identical to AR's row for row."""
    from tidar_convert.bench.batches import left_pad
    from tidar_convert.bench.decoders import DECODERS, run_decoder
    from tidar_convert.bench.prompts import prompt_ids, prompt_set

    if run.deadline.left() <= 0:
        return {"skipped": "the time budget was spent"}
    prompts = prompt_set(name, plan.batch)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    ids, mask = (t.to(device) for t in left_pad([prompt_ids(tokenizer, p) for p in prompts], pad))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    result = {"prompts": [p["id"] for p in prompts], "greedy": {}, "sampled": {}}
    for mode, how in (("greedy", None), ("sampled", sampling)):
        for row in rows:
            if run.deadline.left() <= 0:
                result[mode][row] = {"skipped": "the time budget was spent"}
                continue
            if DECODERS[row].lookup:
                result[mode][row] = {"skipped": "transformers' prompt lookup runs batch 1 only"}
                continue
            kwargs = dict(attention_mask=mask, sampling=how and {**how})
            if how:
                kwargs["sampling"].pop("seed")
                torch.manual_seed(how["seed"])
            run_decoder(model, ids, row, 4, pad, None, 4, **kwargs)  # untimed: compiles, costs
            got = run_decoder(model, ids, row, plan.new_tokens, pad, None, 4, **kwargs)
            texts = [cut(r, eos) for r in got["rows"]]
            made = sum(map(len, texts))
            result[mode][row] = {
                "tokens_per_nfe": made / len(texts) / got["nfe"] if got["nfe"] else None,
                "tokens_per_s": made / got["seconds"] if got["seconds"] else None,
                "host_ms_per_step": got.get("host_ms_per_step"),
                "nfe": got["nfe"],
                "rows": texts,
            }
        reference = result[mode].get("ar", {}).get("rows")
        for row in result[mode].values():
            if "rows" in row:
                same = sum(a == b for a, b in zip(row["rows"], reference or []))
                row["identical"] = same if mode == "greedy" and reference else None
    return result


def cut(tokens: list[int], eos: set[int]) -> list[int]:
    """A row's new tokens up to its first EOS (included): what follows is padding."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


# --------------------------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__}
    info["python"] = sys.version.split()[0]
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def lease(plan: Plan, out: Path, staged: Path | None, dry_run: bool, stage_only: bool) -> Run:
    run = Run(plan, out, dry_run)
    about = {"plan": {**asdict(plan), "dry_run": dry_run}, "machine": machine()}
    if staged is not None:
        lease_stage.use_data_wheels(staged)
        run.section("stage", lambda: {**about, **lease_stage.stage_section(staged, not stage_only)})
    else:
        run.write("stage", {**about, "skipped": "no --staged folder: the base is the cache's"})
    if stage_only:
        return run
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    work = out / "work" if dry_run else Path("/tmp/tidar-lease")
    base = tiny_base(work / "tiny-base") if dry_run else None
    held = {}

    def prepare():
        held["module"] = module_for(plan, base)
        held["dm"] = data_for(plan, held["module"])
        return corpus(plan, held["dm"])

    run.section("corpus", prepare, needs=("stage",) if staged else ())
    needs_base = ("stage",) if staged else ()
    run.section("throughput", lambda: throughput(plan, base or "default"), needs=needs_base)

    def conversion():
        seconds = min(plan.train_s, run.deadline.left() - plan.after_train_s)
        if seconds <= 0:
            raise RuntimeError(f"no time left to train ({run.deadline.left():.0f} s of the budget)")
        return train(plan, held["module"], held["dm"], seconds)

    trained = run.section("train", conversion, needs=("corpus",))
    folder = work / "export"
    run.section(
        "export", lambda: export_section(held["module"], trained["steps"], folder), ("train",)
    )
    held.clear()
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    run.section("bench", lambda: bench(plan, str(folder), run), needs=("export",))
    return run


def report(results: dict) -> None:
    """The figures to read first, last in the output (a device call returns its tail)."""
    for name, r in results.items():
        print(f"{name}: {summary_of(r) if 'seconds' in r or 'skipped' in r else 'written'}")
    t = results.get("throughput", {})
    for row in ("ar_eager", "tidar_eager", "ar_compiled", "tidar_compiled"):
        if row in t:
            mfu = t[row]["mfu"]
            print(
                f"  {row:>15}: {t[row]['tokens_per_s']:10.0f} tok/s"
                + ("" if mfu is None else f", MFU {mfu:.1%}")
            )
    tr = results.get("train", {})
    if "tokens" in tr:
        mfu = "" if tr["mfu"] is None else f", MFU {tr['mfu']:.1%}"
        print(
            f"  trained {tr['tokens']:,} tokens in {tr['steps']} steps, "
            f"{tr['tokens_per_s']:.0f} tok/s{mfu}"
        )
    for size, sets in (results.get("bench") or {}).items():
        if not size.startswith("batch_"):
            continue
        for name, result in sets.items():
            for mode in ("greedy", "sampled"):
                for row, s in (result.get(mode) or {}).items():
                    if "tokens_per_nfe" not in s:
                        continue
                    print(
                        f"  {size} {name:>4} {mode:>7} {row:>20}: "
                        f"T/NFE {fmt(s['tokens_per_nfe'])}, "
                        f"{fmt(s['tokens_per_s'], '.1f')} tok/s, host "
                        f"{fmt(s.get('host_ms_per_step'), '.1f')} ms/step, "
                        f"identical {s.get('identical')}"
                    )


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def lease_cmd(
    dry_run: bool = False,
    staged: str | None = None,
    out: str | None = None,
    stage_only: bool = False,
    budget_s: float | None = None,
    train_s: float | None = None,
) -> str:
    """A GPU lease's run: the embedded default converted and benched on the device.

    Args:
        dry_run: on the CPU, a tiny random base, seconds a section: checks the script.
        staged: the folder the call carried (.lease/1 or .lease/2, from `make lease-stage`).
        out: the folder the sections' JSON files go to (on the device: $OUT).
        stage_only: keep the carried half and stop (the first call).
        budget_s: no section starts past this many seconds (default: the plan's, 540 on a GPU).
        train_s: the conversion's training seconds at most (default: the plan's, 300 on a GPU).

    Returns:
        The folder written.
    """
    if not dry_run and not stage_only and not torch.cuda.is_available():
        raise ValueError("no CUDA device here; run on a GPU, or pass --dry-run to check on a CPU.")
    plan = copy.copy(DRY_PLAN if dry_run else GPU_PLAN)
    if budget_s is not None:
        plan.budget_s = budget_s
    if train_s is not None:
        plan.train_s = train_s
    folder = Path(out or ("bench/results/lease-dry-run" if dry_run else "bench/results/lease"))
    staged_path = Path(staged) if staged else None
    if staged_path is not None and not staged_path.is_dir():
        raise FileNotFoundError(
            f"--staged {staged!r} is not a folder; make it with make lease-stage."
        )
    run = lease(plan, folder, staged_path, dry_run, stage_only)
    report(run.results)
    print(f"wrote {folder}")
    return str(folder)


if __name__ == "__main__":
    from tidar_convert.bench.plain_cli import run as run_command

    run_command(lease_cmd, "python -m tidar_convert.bench.lease")
