"""Writing a converted model as a Hugging Face folder that decodes with TiDAR anywhere.

The folder keeps the base `model_type`, so without trust_remote_code it loads as the plain base
model (AR; any engine can serve it). With trust_remote_code, transformers finds
`custom_generate/generate.py` (decode.py, verbatim, with the engine's other files beside it) and
uses it as `model.generate`: TiDAR decoding with nothing but transformers installed.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

from . import adapter, costs, decode, drafters, engine, forward, kernels, layout, plan, verify
from .loading import EMBEDDED_NAME
from .outputs import atomic_dir, check_export_target, disk_full, file_record, marker_files, no_space, record_file, scratch_dir, tensor_bytes, write_marker

log = logging.getLogger(__name__)

TIDAR_FIELDS = ("block_size", "mask_token_id", "alpha")


def shipped_code() -> dict[str, Path]:
    """Files an export ships, by their name inside custom_generate/ (single source: the package's own).
    generate.py imports the others relatively, so they keep their package names."""
    return {"generate.py": Path(decode.__file__), **{Path(m.__file__).name: Path(m.__file__) for m in (engine, forward, plan, costs, drafters, verify, layout, adapter, kernels)}}


def export(model, tokenizer, out: str | os.PathLike, block_size: int, alpha: float, overwrite: bool = False, card: dict | None = None, adapter_energy: float | None = None, adapter_layers: float | None = None) -> Path:
    """Save weights (safetensors), tokenizer and config with the TiDAR fields, the decode code, a
    README.md model card and the tidar_export.json marker listing every file written, with its
    size and sha256.

    LoRA adapters are merged first; adapters on mask slots only (lora_scope='masks') are saved apart
    instead (adapter.ADAPTER_FILE), so the weights stay the base model's, each delta compressed to the
    rank that keeps `adapter_energy` of it (lora.compress; default lora.ADAPTER_ENERGY), for the
    `adapter_layers` share of layers it moves most (lora.strongest; default lora.ADAPTER_LAYERS).
    `out` must be new, empty, or (with overwrite) an earlier export, every file as it wrote it,
    and nothing else: anything else is refused before any work (outputs.check_export_target). The
    folder is written under a temporary name and swapped in whole (outputs.atomic_dir), so an
    interrupted export leaves the earlier one, never a half-written folder; a full disk is
    outputs.DiskFull, naming the folder and the space needed. `card`: facts for the
    model card (base_model, recipe, steps, data, ...; see `model_card`).
    """
    from .lora import ADAPTER_ENERGY, ADAPTER_LAYERS, check_adapter_options, check_energy, check_layers, is_mask_scoped, lora_layers, split_mask_adapter

    energy = ADAPTER_ENERGY if adapter_energy is None else adapter_energy
    layers = ADAPTER_LAYERS if adapter_layers is None else adapter_layers
    check_energy(energy)
    check_layers(layers)
    check_adapter_options(adapter_energy, adapter_layers, is_mask_scoped(model), "this model")
    out = check_export_target(out, overwrite)
    deltas, adapted = None, 0
    if is_mask_scoped(model):
        adapted = sum(1 for _ in lora_layers(model))  # before merge_and_unload removes them
        deltas = split_mask_adapter(model, energy, layers)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.config.block_size = block_size
    model.config.alpha = alpha
    model.config.mask_token_id = tokenizer.mask_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if deltas:
        ranks = [t.shape[0] for name, t in deltas.items() if name.endswith(".lora_A")]
        model.config.tidar_adapter = {"scope": "masks", "file": adapter.ADAPTER_FILE, "energy": energy, "ranks": [min(ranks), max(ranks)], "layers": [len(ranks), adapted]}
    if card and "base_model" in card:  # bench and quality compare against it by default
        model.config.tidar_base_model = base_source(card["base_model"])
    needed = tensor_bytes(model.state_dict()) + tensor_bytes(deltas or {})
    try:
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if deltas:
                from safetensors.torch import save_file

                save_file(deltas, tmp / adapter.ADAPTER_FILE)
            (tmp / "custom_generate").mkdir()
            for name, src in shipped_code().items():
                shutil.copyfile(src, tmp / "custom_generate" / name)
            (tmp / "README.md").write_text(model_card(out.name, model.config, block_size, alpha, card))
            write_marker(tmp)
            check_export_target(out, overwrite, cleanup=False)  # nothing new appeared at out while we were writing
    except Exception as e:
        if no_space(e):  # safetensors says so in its own error type, under a traceback: one line instead
            raise disk_full(out, needed, "the export", "choose an --out on a disk with room.") from e
        raise
    return out


# --------------------------------------------------------------------------------------------
# The model card (README.md): hub metadata, how to load it, how it was made, what it measured.
# --------------------------------------------------------------------------------------------

# Local folders whose hub origin is known (the embedded default is made from this model's GGUF).
KNOWN_BASES = {EMBEDDED_NAME: "HuggingFaceTB/SmolLM2-135M-Instruct"}
RESULTS_START = "<!-- tidar-results:start -->"
RESULTS_END = "<!-- tidar-results:end -->"
NOT_MEASURED = "Not measured yet: `tidar-convert bench --model <this folder>` measures it and fills this in."


def base_source(model: str | None) -> str:
    """The base model as `loading.resolve` takes it again later: "embedded" (the default model), an
    absolute path (so it still resolves from another working directory), or a hub id."""
    if model in (None, "", "default", "embedded"):
        return "embedded"
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def base_model_id(name_or_path: str | None) -> str | None:
    """The hub id of the base model, if one can be told from what it was loaded from."""
    if not name_or_path:
        return None
    name = str(name_or_path)
    if Path(name).name in KNOWN_BASES:
        return KNOWN_BASES[Path(name).name]
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return None  # a local folder or file: its hub origin is unknown
    return name


def model_card(name: str, config, block_size: int, alpha: float, card: dict | None = None) -> str:
    """README.md of an export. card: optional facts; `base_model` (hub id; default: told from
    config.name_or_path), `recipe` (the YAML config it was trained with), anything else (steps,
    data, lora_r, ...) is listed as is."""
    card = dict(card or {})
    base = base_model_id(card.pop("base_model", None)) or base_model_id(getattr(config, "name_or_path", None))
    recipe = card.pop("recipe", None)
    meta = ["---"]
    if base:
        meta.append(f"base_model: {json.dumps(base)}")
    meta += ["library_name: transformers", "pipeline_tag: text-generation", "tags:", "- tidar", "- custom_generate", "---"]
    source = f"[`{base}`](https://huggingface.co/{base})" if base else f"`{Path(str(getattr(config, 'name_or_path', '') or '?')).name}` (a local model)"
    facts = [f"- block size (tokens drafted per step): {block_size}", f"- alpha (AR loss weight, `L = (alpha * L_AR + L_Diff) / (1 + alpha)`): {alpha}"]
    facts += [f"- mask token id: {getattr(config, 'mask_token_id', None)}", f"- model type: `{getattr(config, 'model_type', '?')}`"]
    facts += [f"- {key}: {value}" for key, value in card.items()]
    scoped_note = ""
    if getattr(config, "tidar_adapter", None):
        scoped_note = (
            f"\n\nThe weights are the base model's, unchanged: the drafts come from low-rank adapters that act on mask\n"
            f"slots only (`{config.tidar_adapter['file']}`, added by `custom_generate/adapter.py`), so the AR model,\n"
            "and everything it writes, is the base model's bit for bit."
        )
        spec = config.tidar_adapter
        if "ranks" in spec:
            low, high = spec["ranks"]
            scoped_note += f" Each delta is stored at the rank that keeps {spec['energy']:.1%} of its squared norm (ranks {low} to {high})."
        if "layers" in spec:
            kept, adapted = spec["layers"]
            scoped_note += f" Of the {adapted} adapted layers, the {kept} whose delta moves their weight most are kept."
    body = f"""
# {name}

A [TiDAR](https://arxiv.org/abs/2511.08923) conversion of {source}, made with tidar-convert: each
forward pass drafts up to {block_size} tokens with diffusion (mask blocks) and verifies them
autoregressively in the same pass. Greedy output is the AR
model's, token for token; sampling follows the AR distribution exactly.{scoped_note}

## Usage

Plain autoregressive decoding, like the base model (no remote code; any engine can serve it):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model_id = "{name}"  # this folder, or the hub repo it was pushed to
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id)
```

TiDAR decoding: `custom_generate/generate.py` (shipped in this folder) becomes `model.generate`:

```python
model = AutoModelForCausalLM.from_pretrained(model_id, trust_remote_code=True)
inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
print(tokenizer.decode(out[0]), model.tidar_stats)  # tokens per forward pass in tidar_stats
```

With tidar-convert installed, `tidar_convert.load(model_id)` gives the same without remote code;
`model.generate(..., tidar=False)` decodes plain AR, `block_size=k` drafts k tokens per step.

## Training

Continual pretraining with the TiDAR hybrid loss:

{chr(10).join(facts)}
"""
    if recipe:
        body += f"\nRecipe:\n\n```yaml\n{str(recipe).rstrip()}\n```\n"
    body += f"\n## Results\n\n{RESULTS_START}\n{NOT_MEASURED}\n{RESULTS_END}\n"
    return "\n".join(meta) + "\n" + body


def results_section(metrics: dict) -> str:
    """Markdown for a `tidar-convert bench` result: T/NFE and tokens/s per decoder, perplexity."""
    lines = []
    machine = metrics.get("machine") or {}
    setting = ", ".join(
        s for s in (
            f"k={metrics['block_size']}" if "block_size" in metrics else "",
            f"{metrics['prompts']} prompts" if "prompts" in metrics else "",
            f"{metrics['max_new_tokens']} new tokens each" if "max_new_tokens" in metrics else "",
            "chat prompts through the chat template" if metrics.get("prompt_set") == "chat" else "",
            "greedy, batch 1",
            " ".join(str(machine[k]) for k in ("dtype", "device", "device_name") if machine.get(k)),
        ) if s
    )
    lines.append(f"Measured by `tidar-convert bench` ({setting}):")
    # Older bench results lack the per-step and lookup columns: "-" there.
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    sampling = metrics.get("sampling")
    tables = [(metrics.get("summary") or {}, None)]
    if metrics.get("summary_sampling"):
        tables.append((metrics["summary_sampling"], f"Sampled (temperature {sampling['temperature']}, top_p {sampling['top_p']}, seed {sampling['seed']}; the same prompts):"))
    for summary, heading in tables:
        if not summary:
            continue
        if heading:
            lines += ["", heading]
        lines += [
            "",
            "| decoder | tokens per forward (T/NFE) | query slots per step | LM-head rows per step | tokens/s | vs AR | vs prompt lookup | vs base prompt lookup | vs stock AR | identical to AR greedy |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for decoder, s in summary.items():
            same = ("(base model)" if heading is None else "(sampled)") if s["identical"] is None else f"{s['identical']}/{s['prompts']}"
            ratios = " | ".join(num(s.get(key), ".2f") + ("x" if s.get(key) is not None else "") for key in ("tokens_per_s_vs_ar", "tokens_per_s_vs_prompt_lookup", "tokens_per_s_vs_base_prompt_lookup", "tokens_per_s_vs_ar_stock"))
            lines.append(
                f"| {decoder} | {s['tokens_per_nfe']:.2f} | {num(s.get('slots_per_step'), '.1f')} | {num(s.get('lm_head_rows_per_step'), '.1f')} "
                f"| {s['tokens_per_s']:.1f} | {ratios} | {same} |"
            )
    guard = metrics.get("quality")
    if guard:
        c, b = guard["converted"], guard["base"]
        pass1 = "" if c["pass@1"] is None else f", HumanEval pass@1 {c['pass@1']:.1%} vs {b['pass@1']:.1%} ({guard['humaneval_problems']} problems)"
        verdict = "passes" if guard["passes"] else "FAILS (" + "; ".join(guard["reasons"]) + ")"
        lines += ["", f"Its own greedy text against the base model's, same prompts: distinct-2 {c['distinct2']:.3f} vs {b['distinct2']:.3f}, "
                  f"ending in a loop {c['loop_share']:.0%} vs {b['loop_share']:.0%}{pass1}. The quality guard {verdict}."]
    ppl = metrics.get("perplexity")
    if ppl:
        lines += ["", f"Perplexity on {ppl['data']} ({ppl.get('max_tokens', '?')} tokens, {ppl.get('seq_len', '?')}-token chunks): "
                  f"base {ppl['base']:.3f}, converted {ppl['converted']:.3f} ({ppl['change_pct']:+.1f}%)."]
    return "\n".join(lines)


def update_model_card(path: str | os.PathLike, metrics: dict) -> bool:
    """Rewrite the Results section of an export's README.md with a bench result (the dict `bench`
    writes: summary, perplexity, block_size, prompts, max_new_tokens, machine). Atomic; the marker
    records the new card's size and hash if the old one was as the export wrote it. False (and a
    warning) if path is not an export with a card, or cannot be written."""
    path = Path(path)
    readme = path / "README.md"
    listed = marker_files(path)
    try:
        text = readme.read_text()
    except OSError:
        listed = None
    if listed is None:
        log.warning("%s has no tidar-convert model card to update (exported by an older version?)", path)
        return False
    if "README.md" not in listed or RESULTS_START not in text or RESULTS_END not in text:
        log.warning("%s/README.md has no results section to update; left as it is", path)
        return False
    head, rest = text.split(RESULTS_START, 1)
    tail = rest.split(RESULTS_END, 1)[1]
    new = f"{head}{RESULTS_START}\n{results_section(metrics)}\n{RESULTS_END}{tail}"
    # The marker then records the new card, so the export stays replaceable; but a card the user
    # had edited stays recorded as changed, or a later --overwrite would take their edits with it.
    as_written = listed["README.md"] is not None and file_record(readme) == listed["README.md"]
    try:
        with scratch_dir(path) as tmp:  # `.<export>.tmp-*`: a leftover is cleaned like any other
            (tmp / "README.md").write_text(new)
            os.chmod(tmp / "README.md", readme.stat().st_mode & 0o777)
            os.replace(tmp / "README.md", readme)
        if as_written:
            record_file(path, "README.md")
    except OSError as e:
        log.warning("could not update the model card %s: %s", readme, e)
        return False
    return True


def check_export(path: str | os.PathLike) -> dict:
    """The TiDAR fields of an export's config.json; a clear error if the folder is not one."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a model folder. Pass the OUT folder of `make convert`.")
    from .loading import check_model_files

    check_model_files(path)  # config.json parses, safetensors are whole: else the file and the fix, by name
    cfg = json.loads(cfg_file.read_text())
    missing = [f for f in TIDAR_FIELDS if f not in cfg]
    spec = cfg.get("tidar_adapter")
    if spec and not (path / spec["file"]).exists():
        raise FileNotFoundError(f"{str(path)!r} lacks {spec['file']}, the adapter its drafts come from (config.json tidar_adapter); copy the whole export folder, or export again.")
    if missing or not (path / "custom_generate" / "generate.py").exists():
        raise ValueError(
            f"{str(path)!r} is not a TiDAR export (missing {', '.join(missing) or 'custom_generate/generate.py'}); "
            "convert it first with `make convert MODEL=...` (a plain model decodes with AR only)."
        )
    return {f: cfg[f] for f in TIDAR_FIELDS}


def load(path: str | os.PathLike, **kwargs):
    """Load an export with TiDAR `generate()` bound, without remote code: the library's own decode.py.

    Also checks, without running it, that the export's own custom_generate/ would load in this
    environment, and warns (TiDARFallbackWarning, naming the file and the error) if not: that is the
    code `from_pretrained(path, trust_remote_code=True)` uses, and transformers falls back to plain
    AR generate without a word when it fails to load.
    """
    import functools

    from .loading import load_model

    check_export(path)
    problem = custom_generate_problem(path)
    if problem:
        warnings.warn(
            f"{problem}. tidar_convert.load() is not affected (it binds this package's own decode), but "
            "AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True), and lm-eval or anything else "
            "built on it, cannot use this export's TiDAR code here: transformers then raises or, for a missing "
            "file, silently decodes with plain AR. Re-export with tidar-convert, or install what is missing.",
            TiDARFallbackWarning,
            stacklevel=2,
        )
    model = load_model(str(path), **kwargs)
    adapter.ensure(model)
    model.generate = functools.partial(decode.generate, model=model)
    require_tidar(model, path)
    return model


# --------------------------------------------------------------------------------------------
# Is TiDAR decoding what `model.generate` runs? transformers binds an export's
# custom_generate/generate.py only with trust_remote_code=True, and when that file fails to load
# with an OSError (a missing file beside it, such as layout.py, included) it keeps its own
# generate without a warning: the model then decodes with AR and nothing says so.
# --------------------------------------------------------------------------------------------


class TiDARFallbackWarning(UserWarning):
    """An export's custom_generate/ would not load here: transformers would decode it with plain AR."""


def tidar_active(model) -> bool:
    """Whether `model.generate` is TiDAR decoding: this package's decode.generate (tidar_convert.load)
    or an export's custom_generate/generate.py (trust_remote_code=True), bound to this model.
    False for transformers' own generate, which is what a silent fallback leaves."""
    gen = getattr(model, "generate", None)
    fn = getattr(gen, "func", None)  # both TiDAR bindings are functools.partial(generate, model=model)
    if fn is None or getattr(fn, "__name__", None) != "generate" or gen.keywords.get("model") is not model:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return {"tidar", "block_size", "beta"} <= set(params)


def custom_generate_problem(path: str | os.PathLike) -> str | None:
    """Why transformers could not load the export's custom_generate/generate.py in this environment,
    or None. Found without running the export's code: the files its relative imports need exist, it
    parses, it defines `generate`, the packages it imports are installed, and custom_generate/
    requirements.txt (if any) is met. These are the failures transformers either swallows (a missing
    file: it then decodes with AR) or raises at load time."""
    from transformers.dynamic_module_utils import check_python_requirements, get_imports, get_relative_imports

    folder = Path(path) / "custom_generate"
    todo, seen = [(folder / "generate.py", None)], set()
    while todo:
        file, importer = todo.pop(0)  # breadth first: a missing file is named with its first importer
        if file in seen:
            continue
        seen.add(file)
        if not file.is_file():
            needed = "" if importer is None else f" (imported by custom_generate/{importer.name})"
            return f"{file} is missing{needed}"
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
            packages = get_imports(file)
        except (SyntaxError, UnicodeDecodeError) as e:
            return f"{file} does not parse: {type(e).__name__}: {e}"
        if file.name == "generate.py" and not any(isinstance(n, ast.FunctionDef) and n.name == "generate" for n in tree.body):
            return f"{file} defines no `generate` function"
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        if missing:
            return f"{file} imports {', '.join(missing)}, not installed here"
        todo += [(folder / f"{name}.py", file) for name in sorted(get_relative_imports(file))]
    try:
        check_python_requirements(str(path), requirements_file="custom_generate/requirements.txt")
    except ImportError as e:
        return f"{folder / 'requirements.txt'} is not met: {e}"
    return None


def fallback_reason(model, path: str | os.PathLike | None = None) -> str | None:
    """None if `model.generate` is TiDAR decoding; otherwise why not, as precisely as can be told.
    path: the export it was loaded from (default: the model's name_or_path)."""
    if tidar_active(model):
        return None
    path = path if path is not None else getattr(model, "name_or_path", None)
    if not path:
        return "model.generate is transformers' own; the folder the model came from is unknown"
    path = Path(path)
    if not (path / "custom_generate" / "generate.py").is_file():
        return f"model.generate is transformers' own, and {str(path)!r} is not a TiDAR export (no custom_generate/generate.py)"
    problem = custom_generate_problem(path)
    if problem:
        return f"the export's custom_generate does not load here: {problem}"
    return (
        "model.generate is transformers' own: the export was loaded without trust_remote_code=True (or its "
        "custom_generate/generate.py raised an OSError on import, which transformers ignores); load it with "
        "trust_remote_code=True or with tidar_convert.load()"
    )


def require_tidar(model, path: str | os.PathLike | None = None) -> None:
    """Raise RuntimeError if `model.generate` is not TiDAR decoding, with the reason."""
    reason = fallback_reason(model, path)
    if reason:
        raise RuntimeError(f"TiDAR decoding not active: transformers fell back to AR ({reason}).")
