"""Writing a converted model as a Hugging Face folder that decodes with TiDAR anywhere.

The folder keeps the base `model_type`, so without trust_remote_code it loads as the plain base
model (AR; any engine can serve it). With trust_remote_code, transformers finds
`custom_generate/generate.py` (decode.py, verbatim, with layout.py beside it) and uses it as
`model.generate`: TiDAR decoding with nothing but transformers installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from . import decode, layout

TIDAR_FIELDS = ("block_size", "mask_token_id", "alpha")


def shipped_code() -> dict[str, Path]:
    """Files an export ships, by their name inside custom_generate/ (single source: the package's own)."""
    return {"generate.py": Path(decode.__file__), "layout.py": Path(layout.__file__)}


def export(model, tokenizer, out: str | os.PathLike, block_size: int, alpha: float) -> Path:
    """Save weights (safetensors), tokenizer and config with the TiDAR fields, plus the decode code.

    LoRA adapters are merged first. Written to a temporary folder and renamed, so an interrupted
    export never leaves a half-written folder under `out`.
    """
    out = Path(out).expanduser().resolve()
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.config.block_size = block_size
    model.config.alpha = alpha
    model.config.mask_token_id = tokenizer.mask_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "custom_generate").mkdir()
        for name, src in shipped_code().items():
            shutil.copyfile(src, tmp / "custom_generate" / name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_export(path: str | os.PathLike) -> dict:
    """The TiDAR fields of an export's config.json; a clear error if the folder is not one."""
    import json

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a model folder. Pass the OUT folder of `make convert`.")
    from .loading import check_model_files

    check_model_files(path)  # config.json parses, safetensors are whole: else the file and the fix, by name
    cfg = json.loads(cfg_file.read_text())
    missing = [f for f in TIDAR_FIELDS if f not in cfg]
    if missing or not (path / "custom_generate" / "generate.py").exists():
        raise ValueError(
            f"{str(path)!r} is not a TiDAR export (missing {', '.join(missing) or 'custom_generate/generate.py'}); "
            "convert it first with `make convert MODEL=...` (a plain model decodes with AR only)."
        )
    return {f: cfg[f] for f in TIDAR_FIELDS}


def load(path: str | os.PathLike, **kwargs):
    """Load an export with TiDAR `generate()` bound, without remote code: the library's own decode.py."""
    import functools

    from transformers import AutoModelForCausalLM

    check_export(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.generate = functools.partial(decode.generate, model=model)
    return model
