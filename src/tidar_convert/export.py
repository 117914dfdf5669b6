"""Writing a converted model as a Hugging Face folder that decodes with TiDAR anywhere.

The folder keeps the base `model_type`, so without trust_remote_code it loads as the plain base
model (AR; any engine can serve it). With trust_remote_code, transformers finds
`custom_generate/generate.py` (decode.py, verbatim, with layout.py beside it) and uses it as
`model.generate`: TiDAR decoding with nothing but transformers installed.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import shutil
import tempfile
import warnings
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
    cfg = json.loads(cfg_file.read_text())
    missing = [f for f in TIDAR_FIELDS if f not in cfg]
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

    from transformers import AutoModelForCausalLM

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
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
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
    todo, seen = [folder / "generate.py"], set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        if not file.is_file():
            needed = "" if file.name == "generate.py" else " (imported by custom_generate/generate.py)"
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
        todo += [folder / f"{name}.py" for name in get_relative_imports(file)]
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
