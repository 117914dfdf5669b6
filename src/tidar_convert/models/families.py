"""Which models convert, told from their config alone (no weights): the mechanisms a config uses,
and a `Verdict` for `check(config)`.

TiDAR passes its own 4D attention mask and repeats positions for the mask half (docs/method.md §1,
§3), and crops the cache after every verification. So what decides whether a family converts is a
short list of mechanisms, not its name: attention kinds, positions, recurrent state. The family
matrix (tests/family_matrix.py, docs/families.md) runs every decoder-only entry of transformers'
causal-LM mapping through a conversion and exact greedy decoding, and `REFUSED` below holds only
what that matrix (or the cache's nature) rules out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Layer kinds that keep a recurrent state (linear attention, SSM, short convolutions): a rejected
# draft has already been folded into it, and it cannot be cropped back like a KV cache.
RECURRENT_LAYERS = {"linear_attention", "conv", "mamba", "recurrent", "hybrid", "hybrid_sliding"}
# Config fields that only a recurrent block has (SSM / linear attention / LRU / xLSTM).
RECURRENT_FIELDS = (
    "state_size",
    "ssm_state_size",
    "lru_width",
    "linear_conv_kernel_dim",
    "linear_attn_alpha_factor",
    "conv_kernel_size",
    "num_blocks",
)
RECURRENT_PREFIXES = ("mamba_", "ssm_")
# Sub-configs of models that are not one text decoder (vision, audio, seq2seq halves, byte
# patchers).
COMPOSITE = (
    "text_config",
    "vision_config",
    "audio_config",
    "vq_config",
    "text_encoder",
    "audio_encoder",
    "audio_encoder_config",
    "encoder_config",
    "decoder_config",
)
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
HEAD_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")

# Mechanisms refused, with why. Each was run anyway (tests/family_matrix.py --force) and failed:
# ALiBi in BLOOM's forward, the indexer's own cache, OpenAI GPT's fixed causal mask (a permute
# error). (MPT, ALiBi, decoded exactly when forced; it stays refused: its mask half cannot sit at
# the clean half's positions.) Recurrent layers convert (runtime/recurrent.py) where their mixer
# keeps its state through transformers' cache; a kind that keeps it elsewhere is refused here.
REFUSED = {
    "recurrent state outside the cache": (
        "its recurrent layers keep their state in structures of their own, not through "
        "transformers' cache interface (conv and recurrent states), which is where TiDAR starts "
        "each mask block from the state before it and keeps each row's state at its accepted "
        "length"
    ),
    "no position_ids": (
        "its positions do not come from position_ids (ALiBi, or none), so the mask half cannot "
        "repeat the clean half's positions"
    ),
    "no KV cache": (
        "its forward takes no cache (OpenAI GPT applies a fixed causal mask of its own): TiDAR "
        "verifies drafts against a KV cache it crops, and its mask half needs bidirectional blocks"
    ),
    "sparse indexed attention": (
        "its indexer keeps a key cache of its own, which TiDAR's cache does not hold or crop "
        "(forced past this check, DeepSeek-V3.2 and GLM-MoE-DSA fail in their first forward)"
    ),
}


@dataclass
class Verdict:
    model_type: str
    converts: bool
    mechanisms: list[str] = field(default_factory=list)
    reason: str = ""  # why not, naming the mechanism and the model_type; "" when it converts
    attn_implementation: str = "sdpa"  # what transformers should load it with on CPU
    decoder_only: bool = True  # False: out of scope (encoder, seq2seq, multimodal wrapper)


def _dict(config) -> dict:
    return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))


def _layer_kinds(d: dict) -> set[str]:
    kinds = set()
    for key in ("layer_types", "layers_block_type", "block_types"):
        kinds |= {str(x) for x in d.get(key) or []}
    return kinds


def model_class(config):
    """The causal-LM class transformers builds for this config, or None."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def attention_implementation(config, device_type: str = "cpu") -> str:
    """What to load this model with: FlexAttention on CUDA where its class has it, else SDPA where
    its class has it, else eager (Gemma 2, gpt-oss and a few more refuse SDPA)."""
    cls = model_class(config)
    if device_type == "cuda" and getattr(cls, "_supports_flex_attn", False):
        return "flex_attention"
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def out_of_scope(config) -> str | None:
    """Why this is not a decoder-only text LM (the reason names what it is), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    d, model_type, name = _dict(config), getattr(config, "model_type", "?"), named(config)
    composite = [
        k for k in COMPOSITE if k in d or k in (getattr(config, "sub_configs", None) or {})
    ]
    if composite:
        text = d.get("text_config") or {}
        fix = (
            f"; convert its text model (model_type={text['model_type']!r}) instead"
            if isinstance(text, dict) and text.get("model_type")
            else ""
        )
        return (
            f"{name} is not a decoder-only causal LM: "
            f"a composite model ({', '.join(composite)}){fix}"
        )
    if d.get("is_encoder_decoder") or any(
        k in d for k in ("encoder_layers", "num_encoder_layers", "decoder_layers")
    ):
        return (
            f"{name} is not a decoder-only causal LM: "
            "(the decoder half of) an encoder-decoder model"
        )
    if d.get("is_encoder") or ("is_decoder" in d and not _rotary(d)):
        return f"{name} is not a decoder-only causal LM: a bidirectional encoder with an LM head"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"{name} is not a decoder-only causal LM: "
            "transformers has no causal-LM class for it (AutoModelForCausalLM)"
        )
    return None


def named(config) -> str:
    """'GPT2LMHeadModel (model_type='gpt2')', or the model_type alone where the config names no
    class."""
    model_type = getattr(config, "model_type", "?")
    archs = ", ".join(getattr(config, "architectures", None) or [])
    return f"{archs} (model_type={model_type!r})" if archs else f"model_type={model_type!r}"


def _rotary(d: dict) -> bool:
    rope = d.get("rope_parameters")
    return bool(rope) or any(
        d.get(k)
        for k in ("rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "qk_rope_head_dim")
    )


def _takes_position_ids(config) -> bool:
    import inspect

    cls = model_class(config)
    return cls is not None and "position_ids" in inspect.signature(cls.forward).parameters


def _takes_cache(config) -> bool:
    import inspect

    cls = model_class(config)
    return cls is None or bool(
        {"cache", "past_key_values", "past", "mems", "state"}
        & set(inspect.signature(cls.forward).parameters)
    )


def mechanisms(config) -> list[str]:
    """What this config uses that matters to TiDAR, in words (the names REFUSED keys by)."""
    d = _dict(config)
    kinds = _layer_kinds(d)
    found = []
    recurrent = sorted(kinds & RECURRENT_LAYERS)
    fields = [k for k in d if k.startswith(RECURRENT_PREFIXES) or k in RECURRENT_FIELDS]
    if d.get("full_attn_idxs") is not None and len(d["full_attn_idxs"]) < (
        d.get("num_hidden_layers") or 0
    ):
        # LFM2 MoE names its conv layers so
        fields.append("short convolutions outside full_attn_idxs")
    if "attn_layer_period" in d or "attn_layer_indices" in d:
        fields.append("attention only every few layers")
    attention_free = False
    if recurrent or fields:
        found.append("recurrent layers")
        refused, attention_free = recurrent_facts(config)
        found += refused
    if kinds & {"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention"}:
        found.append("sparse indexed attention")
    window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
    if "sliding_attention" in kinds and "full_attention" in kinds:
        found.append("mixed sliding/full layers")
    elif window or "sliding_attention" in kinds:
        found.append("sliding window")
    if "chunked_attention" in kinds:
        found.append("chunked attention")
    if _rotary(d):
        rope = d.get("rope_parameters") or {}
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            found.append("rotary per layer type")
        partial = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or d.get(
            "partial_rotary_factor"
        )
        if (partial and partial < 1) or d.get("qk_rope_head_dim") or d.get("rotary_dim"):
            found.append("partial rotary")
        else:
            found.append("rotary")
        if d.get("no_rope_layers") or d.get("no_rope_layer_interval"):
            found.append("NoPE layers")
    elif any(
        k in d for k in ("max_position_embeddings", "n_positions", "max_positions")
    ) and _takes_position_ids(config):
        # learned or sinusoidal, looked up by position_ids: repeated as RoPE's are
        found.append("absolute positions")
    elif attention_free:
        # a state-space model: the state is its only notion of position, and a mask block starts
        # from the state before it
        found.append("no attention layers")
    else:
        found.append("no position_ids")
    if any((d.get(k) or 0) > 1 for k in EXPERT_FIELDS) or d.get("enable_moe_block"):
        found.append("mixture of experts")
    if d.get("kv_lora_rank"):
        found.append("latent KV (MLA)")
    if d.get("final_logit_softcapping") or d.get("attn_logit_softcapping"):
        found.append("logit softcapping")
    if any(d.get(k) not in (None, 1, 1.0) for k in HEAD_SCALES):
        found.append("scaled logits")
    if not _takes_cache(config):
        found.append("no KV cache")
    if attention_implementation(config) == "eager":
        found.append("eager attention (no SDPA)")
    return found


def recurrent_facts(config) -> tuple[list[str], bool]:
    """What a model's recurrent layers mean for TiDAR, read from the model built on the meta device
    (no memory, no weights): the refused mechanisms among them (state kept outside the cache), and
    whether the model has no attention layers at all."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from tidar_convert.runtime import recurrent

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception:
        return [], False  # not buildable: the conversion says so where it builds it
    found = recurrent.mixers(model)
    refused = []
    if not found or recurrent.outside_mixers(model):
        refused.append("recurrent state outside the cache")
    attention_free = bool(found) and not any(
        "Attention" in type(m).__name__ and not recurrent.is_mixer(m) for m in model.modules()
    )
    return refused, attention_free


def check(config) -> Verdict:
    """Whether TiDAR converts this model, from its config alone; the reason names the mechanism."""
    model_type = getattr(config, "model_type", "?")
    why = out_of_scope(config)
    if why:
        why += "; TiDAR converts decoder-only causal LMs (see docs/families.md)."
        return Verdict(
            model_type, False, [], why, attention_implementation(config), decoder_only=False
        )
    found = mechanisms(config)
    for mechanism in found:
        if mechanism in REFUSED:
            reason = (
                f"{named(config)} has {mechanism}: {REFUSED[mechanism]}; "
                "TiDAR cannot convert it (see docs/families.md for the families that convert)."
            )
            return Verdict(model_type, False, found, reason, attention_implementation(config))
    return Verdict(model_type, True, found, "", attention_implementation(config))


def require(config) -> Verdict:
    """check(config), raising ValueError with its reason where the model does not convert."""
    verdict = check(config)
    if not verdict.converts:
        raise ValueError(verdict.reason)
    return verdict


# Bytes per parameter a conversion holds on its devices, by how it trains (activations not
# included: they scale with the micro-batch and seq_len, and gradient checkpointing cuts them).
TRAIN_BYTES = {
    "full fine-tune, fp32 (weights, grads, AdamW's two moments)": 16,
    "full fine-tune, bf16-true (weights and grads bf16, AdamW moments fp32)": 12,
    "LoRA (frozen fp32 weights; the adapters are a few % more)": 4,
    "LoRA, bf16-true (frozen bf16 weights)": 2,
}


def parameter_count(config) -> int:
    """Parameters of the model this config builds, counted on the meta device (no memory, no
    weights)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def describe(config, devices: int = 1) -> dict:
    """What `tidar-convert check` says: the verdict, the parameter count and the memory per device
    of each way to train (sharded over `devices` with FSDP2, as fit's ModelParallelStrategy
    does)."""
    verdict = check(config)
    out = {
        "model_type": verdict.model_type,
        "converts": verdict.converts,
        "mechanisms": verdict.mechanisms,
        "reason": verdict.reason,
        "attn_implementation": verdict.attn_implementation,
    }
    if verdict.decoder_only:
        try:
            n = parameter_count(config)
        except Exception as e:
            # a config transformers accepts but cannot build: say so, the verdict stands
            out["parameters_error"] = f"{type(e).__name__}: {e}"
            return out
        out["parameters"] = n
        out["memory_per_device_gib"] = {
            what: round(n * b / devices / 2**30, 2) for what, b in TRAIN_BYTES.items()
        }
    return out


def speed_from_record(parameters: int, record: dict, name: str = "") -> dict | None:
    """Decode speed to expect for a model of `parameters`, from a bench record (`tidar-convert
    bench` JSON) of another model on the machine that measured it: batch-1 decoding reads every
    weight once per forward, so tokens/s scale with the inverse of the parameter count; tokens per
    forward carry over only for a conversion trained as the record's was. None when the record lacks
    the figures."""
    measured, summary = (record.get("machine") or {}).get("parameters"), record.get("summary") or {}
    rows = {
        row: summary[row]
        for row in ("ar", "tidar", "prompt_lookup")
        if "tokens_per_s" in (summary.get(row) or {})
    }
    if (
        not measured
        or "ar" not in rows
        or "tidar" not in rows
        or "tokens_per_nfe" not in rows["tidar"]
    ):
        return None
    scale = measured / parameters
    return {
        "record": name,
        "measured_parameters": measured,
        "machine": {
            k: record["machine"].get(k) for k in ("device", "device_name", "dtype", "threads")
        },
        "tokens_per_s": {row: round(r["tokens_per_s"] * scale, 2) for row, r in rows.items()},
        "tidar_tokens_per_forward": round(rows["tidar"]["tokens_per_nfe"], 2),
    }
