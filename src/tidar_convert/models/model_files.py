"""A model folder's files checked before transformers reads them: a damaged JSON file, safetensors
cut short, missing shards, a config transformers refuses, weights that do not fit the config; each
refused in one line naming the file and the fix (transformers and safetensors would raise without
saying which file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# The files of a model folder that transformers parses as JSON.
MODEL_JSON_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
)


def check_model_files(folder: str | os.PathLike) -> None:
    """Refuse a model folder whose JSON files do not parse or whose safetensors are cut short,
    naming the file and the fix (transformers and safetensors would raise without saying which
    file)."""
    folder = Path(folder)
    fix = check_json_files(folder)
    for f in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(f)
        if problem:
            raise ValueError(f"{str(f)!r} is truncated or corrupt ({problem}); {fix}")
    if (folder / "config.json").is_file():
        missing = _missing_weights(folder)
        if missing:
            raise FileNotFoundError(f"{str(folder)!r} has a config.json but {missing}; {fix}")
        problem = config_problem(folder)
        if problem:
            raise ValueError(
                f"{str(folder / 'config.json')!r} is not a config transformers accepts "
                f"({problem}); restore the config.json saved with these weights, or {fix}"
            )


def check_json_files(folder: Path) -> str:
    """Refuse a model folder whose JSON files do not parse, naming the file; returns the fix the
    other checks give (export again, or download again)."""
    if (folder / "custom_generate" / "generate.py").exists():
        fix = (
            "export it again (`tidar-convert export --checkpoint CKPT --out DIR` or `make convert`)"
        )
    else:
        fix = "download or save the model again"
    for name in MODEL_JSON_FILES:
        f = folder / name
        if f.is_file():
            try:
                json.loads(f.read_bytes())
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(
                    f"{str(f)!r} is not valid JSON ({e}): the file is damaged; {fix}"
                ) from None
    return fix


def _missing_weights(folder: Path) -> str | None:
    """What is missing of a model folder's weights (transformers would raise an OSError naming no
    fix), or None."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            try:
                shards = sorted(
                    set(json.loads((folder / index).read_bytes())["weight_map"].values())
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                return f"its {index} lists no weight files"
            gone = [name for name in shards if not (folder / name).is_file()]
            return f"not {', '.join(gone)}, listed in its {index}" if gone else None
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
        return None
    return "no weights (no model.safetensors or pytorch_model.bin)"


def config_problem(folder: Path) -> str | None:
    """Why transformers refuses a folder's config.json (say, a hidden size that its heads do not
    divide), or None."""
    from huggingface_hub import errors

    # (how transformers 5 validates configs)
    strict = getattr(errors, "StrictDataclassError", ValueError)
    try:
        AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError, strict) as e:
        return " ".join(str(e.__cause__ or e).split())
    return None


def first_mismatch(source: str) -> str:
    """The first tensor whose shape in the weight files differs from the one config.json makes."""
    folder = Path(source)
    if not folder.is_dir():
        return "tensor shapes differ"
    with torch.device("meta"):
        expected = {
            k: list(v.shape)
            for k, v in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
            .state_dict()
            .items()
        }
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for key, t in header.items():
            if key in expected and t["shape"] != expected[key]:
                return (
                    f"{key} is {t['shape']} in {f.name}, and config.json makes it {expected[key]}"
                )
    return "tensor shapes differ"


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot load, from its header alone (None if it looks whole).

    Layout: an 8-byte little-endian header length, a JSON header of tensor byte ranges, the data.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors header"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"its header should be {n} bytes long but only {size - 8} follow"
        try:
            header = json.loads(f.read(n))
            end = max(
                (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a valid safetensors header"
    if size < 8 + n + end:
        return f"cut short: {size} bytes of the {8 + n + end} its header describes"
    if size > 8 + n + end:
        return f"{size} bytes where its header describes {8 + n + end}"
    return None


def weights_fingerprint(source: str) -> dict[str, str]:
    """{file name: sha256} of the weight files a model loads from (a folder's *.safetensors and
    *.bin, or a .gguf file): what a LoRA checkpoint, which keeps none of the frozen weights, records
    of the base that refills them. A file in the Hugging Face cache is a link to a blob named by
    its sha256, which is read from the name instead of hashing gigabytes. A hub id is looked up in
    that cache (loading the model put it there); {} where it is not found."""
    path = Path(source).expanduser()
    if not path.exists():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(source, local_files_only=True))
        except Exception:  # not a hub id, or not cached
            return {}
    files = (
        [path]
        if path.is_file()
        else sorted([*path.glob("*.safetensors"), *path.glob("*.bin")], key=lambda f: f.name)
    )
    return {f.name: _sha256(f.resolve()) for f in files}


_HASHES: dict[tuple, str] = {}


def _sha256(file: Path) -> str:
    import hashlib
    import re

    if re.fullmatch(r"[0-9a-f]{64}", file.name) and file.parent.name == "blobs":
        return file.name
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)  # hashed once a process, while unchanged
    if key not in _HASHES:
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]
