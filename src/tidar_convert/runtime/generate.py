"""TiDAR decoding as a drop-in `generate()`: draft, verify autoregressively, one pass a step.

Shipped in every export as `custom_generate/generate.py`, with its neighbours engine.py,
forward.py, plan.py, costs.py, drafters.py, verify.py, layout.py, adapter.py, kernels.py and
panel.py beside it (export.shipped_code), so
`AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).generate(...)` runs it without
tidar_convert installed. It imports nothing but torch, transformers and those files.

This file is the argument side: generate() arguments mean what they mean in transformers (the
config is merged, the logits processors and stopping criteria are built by transformers' own
GenerationMixin helpers, `prepare`); what cannot be verified exactly is refused by name. The loop
itself is engine.decode: a Drafter (drafters.py: diffusion, lookup, hybrid) proposes, a step plan
says which query slots one forward runs, a Verifier (verify.py: greedy, or sampling with draws
keyed by position) accepts.

After each call, `model.tidar_stats` holds nfe (forward passes), new_tokens, tokens_per_nfe,
accepted (drafts committed at each step), slots_per_step (mean query slots of a decoding forward),
lm_head_rows_per_step (mean vocabulary-head rows per batch row of a decoding forward) and
draft_sources (row-steps drafted by lookup, diffusion, or nothing), sibling_steps (steps that
committed a sibling of draft 1 instead of the chain), acceptance_by_offset (per draft source, the
chain's proposals judged, accepted and the plan's summed chance for them, by offset:
engine.DecodeState.judge); with per-row acceptance in a batch also tokens_per_nfe_per_row (each
row's new tokens over the forwards it was active in).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    StoppingCriteriaList,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

# Relative, so the same lines work in the package and in an export's custom_generate/ folder.
from .adapter import ensure as ensure_adapter
from .adapter import mask_rows

# Draft: for callers that build drafts by hand
from .drafters import Draft, make_drafter  # noqa: F401
from .engine import decode
from .kernels import cpu_kernels

# imported here so a missing layout.py is named as generate.py's import
from .layout import decode_mask_mod  # noqa: F401
from .plan import Planner
from .session import Session, session_of
from .slots import Slots, static_slots
from .spec import TiDARSpec, check_draft_length
from .verify import Greedy, Sampling, TopPOnSortedValues, draw_seed

# Under transformers' `cli` logger, so that `transformers serve --log-level info` shows it with its
# own lines (5.25 sets the level of `transformers.cli` only; earlier releases, of `transformers`: a
# child of both).
log = logging.get_logger("transformers.cli.tidar")


# --------------------------------------------------------------------------------------------
# Continuous batching: `transformers serve --continuous-batching`, `generate_batch` and
# `init_continuous_batching` run transformers' own paged loop on the model's forward and never call
# model.generate, so an export decodes plain AR there without a word. All three entry points go
# through ContinuousMixin.init_continuous_batching: it is wrapped once per process (the export
# carries no model class of its own to hook), and the wrapper speaks only for models whose generate
# is TiDAR's. It is wrapped when an export is loaded, never on import of the toolkit: transformers
# importing an export's copy of this file is that load; in the toolkit, tidar_convert.load calls it.
# --------------------------------------------------------------------------------------------

CONTINUOUS_BATCHING_WARNING = (
    "TiDAR decoding does not run under continuous batching: transformers' paged loop "
    "(init_continuous_batching, `transformers serve --continuous-batching`, generate_batch) "
    "decodes this TiDAR export as plain AR, one token per forward. Serve it without "
    "--continuous-batching (`transformers serve --trust-remote-code EXPORT`), or call "
    "model.generate, to decode with TiDAR."
)


def binds_tidar(model) -> bool:
    """Whether model.generate is a TiDAR generate() bound to this model: this file, in the package
    or an export of any version (both bindings are functools.partial(generate, model=model));
    tidar_convert.exports.folder.tidar_active asks this."""
    gen = model.__dict__.get("generate")
    fn = getattr(gen, "func", None)
    if (
        fn is None
        or getattr(fn, "__name__", None) != "generate"
        or gen.keywords.get("model") is not model
    ):
        return False
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    # exports written before 2026-12-06 name the draft length block_size
    return {"tidar", "beta"} <= params and bool({"draft_length", "block_size"} & params)


def warn_under_continuous_batching() -> None:
    try:
        from transformers.generation.continuous_batching import ContinuousMixin
    except ImportError:  # a transformers without continuous batching: nothing bypasses generate()
        return
    original = ContinuousMixin.init_continuous_batching
    # the package's decode.py and an export's both import this
    if getattr(original, "tidar_warns", False):
        return

    @functools.wraps(original)
    def init_continuous_batching(self, *args, **kwargs):
        if binds_tidar(self):
            log.warning_once(CONTINUOUS_BATCHING_WARNING)
        return original(self, *args, **kwargs)

    init_continuous_batching.tidar_warns = True
    ContinuousMixin.init_continuous_batching = init_continuous_batching


# an export's copy, imported by transformers as it loads the export
if not __name__.startswith("tidar_convert."):
    warn_under_continuous_batching()


# --------------------------------------------------------------------------------------------
# generate(): the drop-in entry point.
# --------------------------------------------------------------------------------------------


# GenerationConfig fields TiDAR decoding does not implement, refused by name when set to anything
# but None, transformers' global default, or one of the listed values. Every other field is honoured
# with transformers' semantics or changes nothing here; tests/test_generate_args.py walks every
# field.
REFUSED = {
    "num_beams": ((1,), "beam search"),
    "num_beam_groups": ((1,), "group beam search"),
    "diversity_penalty": ((0.0,), "group beam search"),
    "constraints": ((), "constrained beam search"),
    "force_words_ids": ((), "constrained beam search"),
    "penalty_alpha": ((0.0,), "contrastive search"),
    "dola_layers": ((), "DoLa decoding"),
    "guidance_scale": (
        (1, 1.0),
        "classifier-free guidance runs a second, unconditional model pass per token",
    ),
    "watermarking_config": ((), "watermarking processors keep per-call state"),
    "token_healing": ((False,), "token healing rewrites the prompt with a nested generate()"),
    "output_attentions": ((False,), "a TiDAR step attends over drafts and masks, not AR positions"),
    "output_hidden_states": ((False,), "a TiDAR step's hidden states are not AR positions"),
    "prompt_lookup_num_tokens": ((), "prompt lookup is another drafter"),
    "assistant_early_exit": ((), "self-speculative early exit is another drafter"),
    "use_mtp": ((False,), "multi-token prediction is another drafter"),
    "is_assistant": ((False,), "a TiDAR model is not run as an assistant"),
    "cache_implementation": (
        ("dynamic", "static"),
        "TiDAR crops its cache after every step: a dynamic or a static one (slots.py)",
    ),
}
# generate() arguments that are not GenerationConfig fields: refused when given (not None / False).
REFUSED_ARGS = {
    "assistant_model": "assisted decoding is another drafter",
    "assistant_tokenizer": "assisted decoding is another drafter",
    "negative_prompt_ids": "classifier-free guidance",
    "negative_prompt_attention_mask": "classifier-free guidance",
    "inputs_embeds": "TiDAR drafts token ids; pass input_ids",
    "synced_gpus": "multi-GPU synced generation",
    "custom_generate": "this already is a custom generate()",
}


def refuse(name, value, why):
    if not isinstance(value, (bool, int, float, str, list, tuple, dict)):
        value = f"<{type(value).__name__}>"
    raise ValueError(
        f"{name}={value!r} is not supported by TiDAR decoding ({why}); pass tidar=False for "
        "plain AR decoding (transformers' generate)."
    )


def check_refused(gc: GenerationConfig) -> None:
    defaults = GenerationConfig._get_default_generation_params()
    for name, (allowed, why) in REFUSED.items():
        value = getattr(gc, name, None)
        if value is not None and value != defaults.get(name) and value not in allowed:
            refuse(name, value, why)
    mode = gc.get_generation_mode()  # a catch-all, should transformers add a decoding mode
    if mode not in ("greedy_search", "sample"):
        refuse("generation mode", str(mode), "TiDAR verifies greedy or sampled drafts only")


@dataclass
class Run:
    """Everything one generate() call decides before the loop, as transformers' generate() decides
    it."""

    input_ids: torch.Tensor  # (B, P), repeated num_return_sequences times
    kv_valid: torch.Tensor  # (B, P) False at left padding
    # merged: arguments > generation_config > model.generation_config > defaults
    gc: GenerationConfig
    processors: LogitsProcessorList  # transformers' own, plus `logits_processor`
    # max_length, max_time, stop_strings, EOS, plus `stopping_criteria`
    criteria: StoppingCriteriaList
    pick: Greedy | Sampling
    k: int
    mask_id: int
    pad: int
    session: Session  # the model's: step costs, mask blocks and kernel choices kept across calls
    streamer: object = None
    slots: Slots | None = None  # cache_implementation="static": the step shapes (slots.py)

    @property
    def max_new(self) -> int:
        return self.gc.max_length - self.input_ids.shape[1]


# TiDAR's own generate() options and their defaults; each may also come from a generation config.
OPTIONS = {
    "tidar": True,
    "draft_length": None,  # the trained one
    "beta": 1.0,
    "drafter": "hybrid",
    "plan": "cost",
    "slot_budget": None,  # the planner's: max(k + k*k, 11 + k)
    "siblings": 3,
    "pack_weights": "auto",
}


def tidar_options(given: dict, *configs) -> dict:
    """Each of OPTIONS: the argument given, else the first of `configs` (generation configs, or
    None) with a field of that name, else its default. A value from JSON is checked here where the
    code below would misread it ("false" as true); ranges are checked where each is used."""
    out = {}
    for name, default in OPTIONS.items():
        value = given.get(name)
        for config in configs:
            if value is None:
                value = getattr(config, name, None)
        out[name] = default if value is None else value
    if not isinstance(out["tidar"], bool):
        raise ValueError(
            f"tidar={out['tidar']!r}: pass true or false (a JSON boolean in a generation config)."
        )
    for name in ("siblings", "slot_budget", "draft_length"):
        value = out[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}={value!r}: must be a whole number.")
    if isinstance(out["beta"], bool) or not isinstance(out["beta"], (int, float)):
        raise ValueError(f"beta={out['beta']!r}: must be a number in [0, 1] (1 = trust AR, exact).")
    return out


def prepare(model, input_ids, generation_config, draft_length, beta, kwargs) -> Run:
    """Merge and check the arguments, and build the logits processors and stopping criteria,
    through transformers' own GenerationMixin helpers so every field means what it means there."""
    for name, why in REFUSED_ARGS.items():
        value = kwargs.pop(name, None)
        if value is not None and value is not False:
            refuse(name, value, why)
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    stopping_criteria = kwargs.pop("stopping_criteria", None)
    logits_processor = kwargs.pop("logits_processor", None)
    prefix_allowed_tokens_fn = kwargs.pop("prefix_allowed_tokens_fn", None)
    tokenizer = kwargs.pop("tokenizer", None)
    generator = kwargs.pop("generator", None)
    kwargs.pop("trust_remote_code", None)
    # before transformers' own, vaguer check
    if kwargs.get("max_new_tokens") is not None and kwargs["max_new_tokens"] <= 0:
        raise ValueError(f"max_new_tokens={kwargs['max_new_tokens']}: must be >= 1.")
    # A given generation_config is completed by the model's, then by the global defaults
    # (max_length=20, temperature=1.0, ...); keyword arguments override both.
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    gc, unused = GenerationMixin._prepare_generation_config(model, generation_config, **kwargs)
    check_refused(gc)
    if unused:
        raise TypeError(f"TiDAR generate() got unsupported arguments: {', '.join(sorted(unused))}.")
    # as transformers: no prompt -> one BOS token
    if input_ids is None and gc.bos_token_id is not None:
        input_ids = torch.full((1, 1), gc.bos_token_id, dtype=torch.long, device=model.device)
    spec = TiDARSpec.from_config(model.config)
    if spec is None or spec.mask_token_id is None:
        raise ValueError(
            "this model's config holds no TiDAR fields (`tidar`, `mask_token_id`): it is not a "
            "TiDAR export. Convert it first (`make convert MODEL=...`), or pass tidar=False for "
            "plain AR decoding."
        )
    # 0 is refused, not taken for the default
    k = spec.draft_length if draft_length is None else check_draft_length(draft_length)
    mask_id = spec.mask_token_id
    check_inputs(model, gc, input_ids, attention_mask, k, mask_id, beta)
    # int32 ids (numpy, ONNX tokenizers) index the caches as int64 does
    input_ids = input_ids.long()

    prompt_ids, n = input_ids, gc.num_return_sequences or 1
    if n > 1:  # as transformers: each prompt repeated n times, the rows of one prompt adjacent
        input_ids = input_ids.repeat_interleave(n, 0)
        attention_mask = (
            attention_mask.repeat_interleave(n, 0) if attention_mask is not None else None
        )
    B, P = input_ids.shape
    device = input_ids.device
    padded = attention_mask is not None and not attention_mask.bool().all()
    GenerationMixin._prepare_special_tokens(
        model, gc, attention_mask is not None, device=device, batch_size=B
    )
    gc = GenerationMixin._prepare_generated_length(
        model, gc, has_default_max_length, has_default_min_length, "input_ids", P, input_ids
    )
    GenerationMixin._validate_generated_length(model, gc, P, has_default_max_length)
    check_length(model, P, gc.max_length - P, k)
    processors = GenerationMixin._get_logits_processor(
        model,
        generation_config=gc,
        input_ids_seq_length=P,
        encoder_input_ids=prompt_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor
        if logits_processor is not None
        else LogitsProcessorList(),
        device=device,
        model_kwargs={"attention_mask": attention_mask if padded else None},
    )
    criteria = GenerationMixin._get_stopping_criteria(
        model,
        gc,
        stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer,
    )
    return Run(
        input_ids=input_ids,
        kv_valid=attention_mask.bool()
        if attention_mask is not None
        else torch.ones_like(input_ids, dtype=torch.bool),
        gc=gc,
        processors=processors,
        criteria=criteria,
        pick=Sampling(draw_seed(generator)) if gc.do_sample else Greedy(),
        k=k,
        mask_id=mask_id,
        pad=gc._pad_token_tensor.item() if gc._pad_token_tensor is not None else 0,
        session=session_of(model),
        streamer=streamer,
    )


def generate(
    inputs=None,
    generation_config=None,
    *,
    model,
    tidar: bool | None = None,
    draft_length: int | None = None,
    beta: float | None = None,
    drafter: str | None = None,
    plan: str | None = None,
    slot_budget: int | None = None,
    siblings: int | None = None,
    pack_weights: bool | str | None = None,
    **kwargs,
):
    """TiDAR `generate()`. Same arguments as transformers' generate, plus TiDAR's own options below.
    Each one not passed (None) is read from a field of the same name in `generation_config`, else
    in the model's generation_config (generation_config.json), else it takes its default
    (OPTIONS). So an export's generation_config.json sets them for every caller, and a server that
    passes a request's generation config (`transformers serve`: the request's `generation_config`
    JSON) sets them per request (`tidar_options`).

    tidar: False runs plain AR decoding (transformers' own generate) on the same weights; default
        True.
    draft_length: tokens per mask group (diffusion drafts); defaults to the trained one
        (spec.TiDARSpec). Any value >= 2 keeps the output exact (only acceptance changes); the
        diffusion head is only trained for the trained one.
    beta: 1.0 (default) trusts AR and is exact; < 1 mixes diffusion logits into the committed token.
    drafter: where drafts come from: "hybrid" (default; per row, lookup where the text has a match,
        else diffusion; diffusion first once its drafts get accepted further), "diffusion" (TiDAR's
        mask groups), "lookup" (n-gram matches in the prompt and generated text, no mask groups).
        Every drafter is exact.
    plan: "cost" (default) runs, each step, the shape (proposals kept, mask groups) with the most
        expected tokens per second, from the drafts' confidence and the time each step shape has
        taken on this model and machine (measured as it decodes, kept across calls in the model's
        decoding session, `model.tidar_session`, until its `reset()`: session.py; faster where
        extra query slots cost, as on CPUs, but its T/NFE depends on timings);
        "adaptive" keeps the proposals and groups with a chance >= 1 / slot_budget (5 % at the
        default budget) of being used, whatever they cost (T/NFE reproducible); "full" a group at
        every length (the paper's k + k*k slots). Every plan gives the same output, sampled ones too
        (for one torch seed: see below). slot_budget: most query slots per step (default
        max(k + k*k, 11 + k): the paper's step, or a full lookup draft and one group). On a GPU,
        where a step of many slots costs about what one slot does (bench/RESULTS.md §6), a wide
        budget pays: plan="adaptive", slot_budget=96, siblings=7.
    siblings: up to this many alternatives to each drafted token (the diffusion group's next
        likeliest tokens at that offset; for a lookup draft, the continuations of the n-gram's other
        occurrences, as branches where they leave the chain, and the group's at its first proposal)
        verified in the same forward, one query slot each, as a tree: the plan keeps the nodes the
        step most likely reaches, and may pre-draft a group after any of them. Greedy, batch 1,
        beta = 1 only (elsewhere 0). Exact: the AR's token at each node picks the child holding it,
        and the step commits that path. Default 3; 0: chains only.
    pack_weights: on CPU, the linear layers' product, the same for every path (tidar=False and
        prompt lookup too). "auto" (default): the fastest of PyTorch's stock product and the packed
        ones (kernels.py: panels for a small C kernel built on first use, in fp32 and bf16; oneDNN's
        layout in bf16, or in fp32 without the kernel) on a pass through the model's layers at 1 and
        8 rows, timed once per model and dtype (longer for larger models: each pass reads every
        weight; kernels.packing_pays; its time on SmolLM2-135M: bench/LOG.md); packing keeps one
        more copy of each weight (kernels.release frees it). True: always packed; False: stock, and
        transformers' own attention path and top_p warper. Otherwise attention under a mask attends
        grouped key/value heads in place instead of copying the cache to every query head
        (kernels.grouped_attention); where every layer takes panels, one product for every row
        count, attention runs per query (kernels.sdpa_exact) and greedy TiDAR equals tidar=False
        bit for bit. What each linear layer took is then `model.tidar_products` ({"panels": 211},
        say), logged once at info when it changes. And top_p runs as verify.TopPOnSortedValues,
        the warper's scores bit for bit (sorted_top_p).

    do_sample: each row's token at its t-th new position is drawn from AR's distribution with noise
        keyed by (seed, row, t) (verify.Sampling), the seed drawn once per call from `generator=` (a
        torch.Generator) or torch's global generator: torch.manual_seed(s) before generate() gives
        the same tokens on every run, whatever plan, drafter or timings.

    cache_implementation: "dynamic" (default) or "static": as in transformers, a KV cache allocated
        once and written in place, so the forward keeps its shapes and compiles (on a GPU, CUDA
        graphs; transformers' compile_config and disable_compile apply, and it compiles where
        transformers' own generate would: a CUDA device, or compile_config._compile_all_devices).
        Each step is padded to a slot bucket, one compiled graph each (slots.py); the output is
        the dynamic cache's. Not for recurrent layers, sliding windows or flex_attention (refused
        by name).

    generation_config and keyword arguments are merged with the model's defaults as transformers
    does. Logits processors (transformers' own, built from the config, plus `logits_processor`)
    apply to each AR row with the prefix AR would have seen there, before verification, and to each
    draft slot with the prefix it would extend; stopping criteria (max_length, max_time,
    stop_strings with `tokenizer=`, EOS, `stopping_criteria`) are checked after every committed
    token. What does not fit the verify rule is refused by name (REFUSED, REFUSED_ARGS).
    """
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if "block_size" in kwargs:  # the draft length's name until 2026-12-06
        if draft_length is not None:
            raise ValueError("pass draft_length only (block_size is its old name).")
        warnings.warn(
            "generate(block_size=...) is renamed draft_length=...", FutureWarning, stacklevel=2
        )
        draft_length = kwargs.pop("block_size")
    given = dict(
        tidar=tidar,
        draft_length=draft_length,
        beta=beta,
        drafter=drafter,
        plan=plan,
        slot_budget=slot_budget,
        siblings=siblings,
        pack_weights=pack_weights,
    )
    options = tidar_options(given, generation_config, model.generation_config)
    tidar, draft_length, beta = options["tidar"], options["draft_length"], options["beta"]
    drafter, plan, slot_budget = options["drafter"], options["plan"], options["slot_budget"]
    siblings, pack_weights = options["siblings"], options["pack_weights"]
    if not tidar:
        with cpu_kernels(model, enabled=pack_weights):
            return ar_generate(
                model, input_ids, generation_config, kwargs, pack_weights is not False
            )
    chosen = make_drafter(drafter)
    ensure_adapter(model)  # an export trained with lora_scope='masks': its drafts' adapter, once
    run = prepare(model, input_ids, generation_config, draft_length, beta, kwargs)
    if pack_weights is not False:  # False: transformers' own paths, its top_p too
        run.processors = sorted_top_p(run.processors)
    gc = run.gc
    record = (
        ([], []) if gc.return_dict_in_generate and (gc.output_scores or gc.output_logits) else None
    )
    with torch.no_grad(), cpu_kernels(model, enabled=pack_weights) as packed:
        # what a step's price depends on
        setting = (
            packed,
            model.dtype,
            model.device.type,
            run.input_ids.shape[0],
            gc.cache_implementation == "static",
        )
        # where siblings are exact (walking a tree under sampling, or mixing in the diffusion
        # logits, is not built; a batch verifies chains)
        tree = isinstance(run.pick, Greedy) and beta == 1.0 and run.input_ids.shape[0] == 1
        # siblings < 0 goes through, for Planner to refuse by name
        planner = Planner(
            run.k,
            plan,
            slot_budget,
            costs=run.session.step_costs(setting),
            siblings=siblings if tree or siblings < 0 else 0,
        )
        run.slots = static_slots(model, run.session, gc, run.input_ids.shape[0], planner.budget)
        if run.streamer is not None:
            run.streamer.put(run.input_ids.cpu())
        state = decode(model, run, chosen, planner, beta, record)
    if run.streamer is not None:
        run.streamer.end()
    P = run.input_ids.shape[1]
    model.tidar_stats = stats = state.stats(P)
    # An operator serving the export (`transformers serve --log-level info`) sees that TiDAR ran.
    log.info(
        "TiDAR generate: %d new tokens in %d forward passes (%.2f tokens per forward; "
        "drafts by source %s)",
        stats["new_tokens"],
        stats["nfe"],
        stats["tokens_per_nfe"],
        stats["draft_sources"],
    )
    if gc.return_dict_in_generate:
        n_new = state.seqs.shape[1] - P
        return GenerateDecoderOnlyOutput(
            sequences=state.seqs,
            scores=tuple(record[0][:n_new]) if gc.output_scores else None,
            logits=tuple(record[1][:n_new]) if gc.output_logits else None,
            **{CACHE_FIELD: state.cache},
        )
    return state.seqs


# transformers 5.24 renamed the output's `past_key_values` to `cache` (the old name warns); older
# releases know only the old.
CACHE_FIELD = (
    "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
)
ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def ar_generate(model, input_ids, generation_config, kwargs, top_p_sorted: bool = True):
    """tidar=False: transformers' own generate on the same weights, and with top_p_sorted its top_p
    as TiDAR's (sorted_top_p_in). Plain AR decoding runs one forward per new position, so that is
    its nfe; assisted decoding (prompt lookup, an assistant) makes fewer, which only a forward hook
    can count (the bench keeps its own): nfe is None there."""
    assisted = any(
        kwargs.get(n) is not None or getattr(generation_config, n, None) is not None
        for n in ASSISTED
    )
    # AR lays out no mask slots: the adapter's gate reads nothing
    with (
        mask_rows(model, None),
        sorted_top_p_in(model) if top_p_sorted else contextlib.nullcontext(),
    ):
        out = GenerationMixin.generate(model, input_ids, generation_config, **kwargs)
    seqs = out if isinstance(out, torch.Tensor) else out.sequences
    new = seqs.shape[1] - (input_ids.shape[1] if input_ids is not None else 0)
    nfe = None if assisted else new
    model.tidar_stats = {
        "nfe": nfe,
        "new_tokens": new,
        "tokens_per_nfe": new / nfe if nfe else None,
        "accepted": [],
    }
    return out


def sorted_top_p(processors: LogitsProcessorList) -> LogitsProcessorList:
    """processors, with transformers' TopPLogitsWarper (not a subclass) run as
    verify.TopPOnSortedValues: the same scores, with the vocabulary sorted faster on a CPU."""
    return LogitsProcessorList(
        TopPOnSortedValues(p) if type(p) is TopPLogitsWarper else p for p in processors
    )


@contextlib.contextmanager
def sorted_top_p_in(model):
    """Within it, transformers' own generate() on `model` (tidar=False, prompt lookup) builds its
    processors through sorted_top_p, as TiDAR's generate() does, so every decoder samples top_p on
    one implementation: an instance attribute over GenerationMixin's `_get_logits_processor`,
    removed on exit (an entry inside another leaves the outer one's)."""
    if "_get_logits_processor" in model.__dict__:
        yield
        return
    build = model._get_logits_processor
    model.__dict__["_get_logits_processor"] = lambda *args, **kwargs: sorted_top_p(
        build(*args, **kwargs)
    )
    try:
        yield
    finally:
        model.__dict__.pop("_get_logits_processor", None)


def check_length(model, P, max_new, k) -> None:
    """Only what AR itself could not do is refused: near the position limit a step drafts less and
    leaves out the mask groups that would not fit (plan.Planner), down to plain AR steps."""
    if max_new <= 0:
        raise ValueError(
            f"max_length={P + max_new} leaves no room after the {P}-token prompt; raise it or "
            "pass max_new_tokens."
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and P + max_new > limit:
        if P < limit:
            fix = f"shorten the prompt or lower max_new_tokens to {limit - P}"
        elif max_new < limit:  # no max_new_tokens fits: only a shorter prompt does
            fix = (
                f"shorten the prompt to at most {limit - max_new} tokens "
                f"({limit - 1} with max_new_tokens=1)"
            )
        else:
            fix = (
                f"lower max_new_tokens below {limit} and shorten the prompt to at most {limit} "
                "- max_new_tokens tokens"
            )
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({max_new}) exceeds the model's {limit} "
            f"positions; {fix}."
        )
    # Sliding windows and chunks are applied by the layout (layout.Local); GPT-Neo's local layers
    # apply theirs by index inside the model, where TiDAR's slots are not at their positions.
    window = getattr(model.config, "window_size", None)
    if window and P + max_new > window:
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({max_new}) exceeds {type(model).__name__}'s "
            f"local attention window ({window}), which its layers apply by index, not by position: "
            "TiDAR decoding cannot follow it past the window; shorten the prompt or lower "
            f"max_new_tokens to {max(window - P, 0)}."
        )


def check_inputs(model, gc, input_ids, attention_mask, k, mask_id, beta) -> None:
    for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{name} is a {type(value).__name__}: pass a LongTensor of shape (batch, length), "
                "e.g. torch.tensor([ids])."
            )
    if input_ids is not None and input_ids.ndim != 2:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}: pass shape (batch, length), "
            "e.g. ids[None] for one prompt."
        )
    if input_ids is not None and (
        input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool
    ):
        raise ValueError(
            f"input_ids are {input_ids.dtype}: token ids must be integers; pass input_ids.long()."
        )
    if input_ids is None or input_ids.shape[1] == 0:
        raise ValueError(
            "the prompt is empty: TiDAR generate() needs input_ids of shape (batch, length >= 1)."
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: must be in [0, 1] (1 = trust AR, exact).")
    if (
        attention_mask is None
        and input_ids.shape[0] > 1
        and gc.pad_token_id is not None
        and (input_ids == gc.pad_token_id).any()
    ):
        raise ValueError(
            "the batch contains pad tokens but no attention_mask was given; pass the tokenizer's "
            "attention_mask (left padding)."
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids "
            f"{tuple(input_ids.shape)}; pass the mask the tokenizer returned with these ids."
        )
    empty = (
        [] if attention_mask is None else (~attention_mask.bool().any(1)).nonzero()[:, 0].tolist()
    )
    if empty:
        raise ValueError(
            f"attention_mask row {empty[0]} attends to no token (all zeros); pass 1 at each real "
            "prompt token (the tokenizer's attention_mask), or no attention_mask for unpadded "
            "prompts."
        )
    if attention_mask is not None and not attention_mask[:, -1].bool().all():
        raise ValueError(
            "the attention_mask has right padding; TiDAR batches need left padding "
            "(tokenizer.padding_side = 'left')."
        )
