"""The model card (README.md) of an export: hub metadata, how to load it, how it was made, and what
the bench measured (filled in by `tidar-convert bench`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tidar_convert.exports.marker import file_record, marker_files, record_file
from tidar_convert.exports.outputs import scratch_dir
from tidar_convert.models.loading import EMBEDDED_NAME
from tidar_convert.runtime.spec import TiDARSpec

log = logging.getLogger(__name__)


# Local folders whose hub origin is known (the embedded default is made from this model's GGUF).
KNOWN_BASES = {EMBEDDED_NAME: "HuggingFaceTB/SmolLM2-135M-Instruct"}
RESULTS_START = "<!-- tidar-results:start -->"
RESULTS_END = "<!-- tidar-results:end -->"
NOT_MEASURED = (
    "Not measured yet: `tidar-convert bench --model <this folder>` measures it and fills this in."
)


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


def model_card(name: str, config, card: dict | None = None) -> str:
    """README.md of an export, whose config holds its TiDAR spec (spec.TiDARSpec). card: optional
    facts; `base_model` (hub id; default: told from config.name_or_path), `recipe` (the YAML config
    it was trained with), anything else (steps, data, lora_r, ...) is listed as is."""
    card = dict(card or {})
    spec = TiDARSpec.from_config(config)
    base = base_model_id(card.pop("base_model", None)) or base_model_id(
        getattr(config, "name_or_path", None)
    )
    recipe = card.pop("recipe", None)
    meta = ["---"]
    if base:
        meta.append(f"base_model: {json.dumps(base)}")
    meta += [
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- tidar",
        "- custom_generate",
        "---",
    ]
    source = (
        f"[`{base}`](https://huggingface.co/{base})"
        if base
        else f"`{Path(str(getattr(config, 'name_or_path', '') or '?')).name}` (a local model)"
    )
    facts = [
        f"- draft length (tokens drafted per step): {spec.draft_length}",
        f"- alpha (AR loss weight, `L = (alpha * L_AR + L_Diff) / (1 + alpha)`): {spec.alpha}",
    ]
    facts += [
        f"- mask token id: {spec.mask_token_id}",
        f"- model type: `{getattr(config, 'model_type', '?')}`",
    ]
    facts += [f"- {key}: {value}" for key, value in card.items()]
    scoped_note = ""
    if spec.mask_scoped:
        adapter = spec.adapter
        scoped_note = (
            "\n\nThe weights are the base model's, unchanged: the drafts come from low-rank "
            "adapters that act on mask\n"
            f"slots only (`{adapter['file']}`, added by `custom_generate/adapter.py`), so the AR "
            "model,\nand everything it writes, is the base model's bit for bit."
        )
        if "ranks" in adapter:
            low, high = adapter["ranks"]
            scoped_note += (
                f" Each delta is stored at the rank that keeps {adapter['energy']:.1%} of its "
                f"squared norm (ranks {low} to {high})."
            )
        if "layers" in adapter:
            kept, adapted = adapter["layers"]
            scoped_note += (
                f" Of the {adapted} adapted layers, the {kept} whose delta moves their weight "
                "most are kept."
            )
    body = f"""
# {name}

A [TiDAR](https://arxiv.org/abs/2511.08923) conversion of {source}, made with tidar-convert: each
forward pass drafts up to {spec.draft_length} tokens with diffusion (mask blocks) and verifies them
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
`model.generate(..., tidar=False)` decodes plain AR, `draft_length=k` drafts k tokens per step.

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
        s
        for s in (
            f"k={metrics['draft_length']}" if "draft_length" in metrics else "",
            f"{metrics['prompts']} prompts" if "prompts" in metrics else "",
            f"{metrics['max_new_tokens']} new tokens each" if "max_new_tokens" in metrics else "",
            "chat prompts through the chat template" if metrics.get("prompt_set") == "chat" else "",
            "greedy, batch 1",
            " ".join(str(machine[k]) for k in ("dtype", "device", "device_name") if machine.get(k)),
        )
        if s
    )
    lines.append(f"Measured by `tidar-convert bench` ({setting}):")

    # Older bench results lack the per-step and lookup columns: "-" there.
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    sampling = metrics.get("sampling")
    tables = [(metrics.get("summary") or {}, None)]
    if metrics.get("summary_sampling"):
        tables.append(
            (
                metrics["summary_sampling"],
                f"Sampled (temperature {sampling['temperature']}, top_p {sampling['top_p']}, "
                f"seed {sampling['seed']}; the same prompts):",
            )
        )
    for summary, heading in tables:
        if not summary:
            continue
        if heading:
            lines += ["", heading]
        lines += [
            "",
            "| decoder | tokens per forward (T/NFE) | query slots per step | LM-head rows per step "
            "| tokens/s | vs AR | vs prompt lookup | vs base prompt lookup | vs stock AR "
            "| identical to AR greedy |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for decoder, s in summary.items():
            same = (
                ("(base model)" if heading is None else "(sampled)")
                if s["identical"] is None
                else f"{s['identical']}/{s['prompts']}"
            )
            ratios = " | ".join(
                num(s.get(key), ".2f") + ("x" if s.get(key) is not None else "")
                for key in (
                    "tokens_per_s_vs_ar",
                    "tokens_per_s_vs_prompt_lookup",
                    "tokens_per_s_vs_base_prompt_lookup",
                    "tokens_per_s_vs_ar_stock",
                )
            )
            lines.append(
                f"| {decoder} | {s['tokens_per_nfe']:.2f} | {num(s.get('slots_per_step'), '.1f')} "
                f"| {num(s.get('lm_head_rows_per_step'), '.1f')} "
                f"| {s['tokens_per_s']:.1f} | {ratios} | {same} |"
            )
    guard = metrics.get("quality")
    if guard:
        c, b = guard["converted"], guard["base"]
        pass1 = (
            ""
            if c["pass@1"] is None
            else (
                f", HumanEval pass@1 {c['pass@1']:.1%} vs {b['pass@1']:.1%} "
                f"({guard['humaneval_problems']} problems)"
            )
        )
        verdict = "passes" if guard["passes"] else "FAILS (" + "; ".join(guard["reasons"]) + ")"
        lines += [
            "",
            "Its own greedy text against the base model's, same prompts: distinct-2 "
            f"{c['distinct2']:.3f} vs {b['distinct2']:.3f}, "
            f"ending in a loop {c['loop_share']:.0%} vs {b['loop_share']:.0%}{pass1}. "
            f"The quality guard {verdict}.",
        ]
    ppl = metrics.get("perplexity")
    if ppl:
        lines += [
            "",
            f"Perplexity on {ppl['data']} ({ppl.get('max_tokens', '?')} tokens, "
            f"{ppl.get('seq_len', '?')}-token chunks): "
            f"base {ppl['base']:.3f}, converted {ppl['converted']:.3f} "
            f"({ppl['change_pct']:+.1f}%).",
        ]
    return "\n".join(lines)


def update_model_card(path: str | os.PathLike, metrics: dict) -> bool:
    """Rewrite the Results section of an export's README.md with a bench result (the dict `bench`
    writes: summary, perplexity, draft_length, prompts, max_new_tokens, machine). Atomic; the marker
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
        log.warning(
            "%s has no tidar-convert model card to update (exported by an older version?)", path
        )
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


def training_card(hparams, steps: int | None, run_dir: Path) -> dict:
    """What an export's model card says about its training: base model, steps, LoRA and schedule
    settings, and the full config (`fit` saves it as <run folder>/config.yaml). Here, not in
    train/fit.py, so that what exports a trained module without LightningCLI (bench.lease, where
    jsonargparse is missing) has it."""
    card = {
        k: hparams[k]
        for k in ("lora_r", "lora_alpha", "warmup_ratio", "min_lr_ratio")
        if k in hparams
    }
    if hparams.get("distill_weight", 0) > 0:
        card.update(
            {
                k: hparams[k]
                for k in ("distill_weight", "distill_temperature", "teacher")
                if k in hparams
            }
        )
    if hparams.get("anchor_weight", 0) > 0:
        card["anchor_weight"] = hparams["anchor_weight"]
    card["base_model"] = hparams.get("model")
    card["steps"] = steps
    if (run_dir / "config.yaml").is_file():
        card["recipe"] = (run_dir / "config.yaml").read_text()
    return card
