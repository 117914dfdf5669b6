"""The decoders the bench compares, as one table, and one timed, counted greedy generation.

Every decoder is one `Decoder` entry in DECODERS: which weights it runs on (the export, or the base
model the export was converted from) and what it passes to `generate()`. A new decoder, a TiDAR
drafter mix included, is one more line there.

NFE, query slots and LM-head rows are counted the same way for every decoder, by hooks on the
model's decoder stack and its output embedding (`ForwardCounter`): every forward goes through both,
whoever drives it (transformers' generate, its prompt lookup, or TiDAR's engine).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import zlib
from collections import Counter
from dataclasses import dataclass

import torch

from tidar_convert.bench.prompts import prompt_ids
from tidar_convert.bench.timing import synchronize
from tidar_convert.runtime.kernels import cpu_kernels

# The sampling mode (`tidar-convert bench --sampling`): what chat users run (about 0.7 and 0.9),
# seeded.
SAMPLING = {"temperature": 0.7, "top_p": 0.9}


@dataclass(frozen=True)
class Decoder:
    """One row of the bench, as the generate() arguments it runs with.

    weights: "export" or "base". tidar: TiDAR decoding, else transformers' own generate.
    drafter: the TiDAR drafter (None: the engine's default). lookup: transformers' prompt lookup.
    draft_length: TiDAR's k for this decoder alone (None: the run's `--draft-length`).
    plan: TiDAR's step plan (None: the engine's default, 'cost').
    pack_weights: the CPU kernels of kernels.cpu_kernels ("auto": each linear layer on the packed
    product measured fastest for its dtype, panels or oneDNN's, and grouped key/value heads attended
    in place; the export's generate() runs them by default, the base's generate() does not): False
    runs PyTorch's stock product and transformers' own attention path, what transformers alone
    gives. siblings: TiDAR's alternatives to each drafted token verified beside the chain, a tree
    (None: the engine's default). slot_budget: TiDAR's most query slots a step (None: the engine's
    default, 20 at k = 4)."""

    weights: str = "export"
    tidar: bool = False
    drafter: str | None = None
    lookup: bool = False
    draft_length: int | None = None
    plan: str | None = None
    pack_weights: bool | str = "auto"
    siblings: int | None = None
    slot_budget: int | None = None
    # generate() with this cache: "static" is what transformers' generate() compiles on a GPU by
    # itself (torch.compile of the forward, CUDA graphs), AR at its fastest; TiDAR's the same, a
    # graph per slot bucket (runtime/slots.py); on a CPU the same code runs eager
    cache: str | None = None

    def compiled_on(self, device: torch.device) -> bool:
        """generate() compiles the forward (auto-compile: a static cache on CUDA)."""
        return self.cache == "static" and device.type == "cuda"

    def generate_kwargs(self, k: int | None, prompt_lookup_tokens: int) -> dict:
        kwargs = {}
        # the base runs transformers' own generate: no `tidar` argument
        if self.weights == "export":
            kwargs["tidar"] = self.tidar
        if self.tidar:
            kwargs["draft_length"] = self.draft_length or k
        if self.drafter is not None:
            kwargs["drafter"] = self.drafter
        if self.plan is not None:
            kwargs["plan"] = self.plan
        if self.siblings is not None:
            kwargs["siblings"] = self.siblings
        if self.slot_budget is not None:
            kwargs["slot_budget"] = self.slot_budget
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
        if self.weights == "export" and self.pack_weights != "auto":
            kwargs["pack_weights"] = self.pack_weights
        if self.cache is not None:
            kwargs["cache_implementation"] = self.cache
        return kwargs

    def kernels(self, model):
        """The CPU kernels the bench enters around a generation: the base's, which runs
        transformers' own generate (that enters none); none around an export's, whose generate()
        enters its own (an outer entry would report other products each call, and walk the model
        again to log them)."""
        if self.weights == "base":
            return cpu_kernels(model, enabled=self.pack_weights)
        return contextlib.nullcontext()


DECODERS = {
    # transformers' generate (tidar=False): the reference every other row is compared with
    "ar": Decoder(),
    # the same, on PyTorch's stock CPU product: plain transformers
    "ar_stock": Decoder(pack_weights=False),
    # AR at its fastest on a GPU: a static cache, which generate() compiles there (the GPU's
    # baseline, issue 44); eager with a static cache on a CPU
    "ar_compiled": Decoder(cache="static"),
    # transformers' n-gram drafts from the prompt, same weights
    "prompt_lookup": Decoder(lookup=True),
    # TiDAR's defaults: hybrid drafts (lookup where it matches, else diffusion), plan "cost", 3
    # siblings
    "tidar": Decoder(tidar=True),
    # the same over a static cache, steps padded to slot buckets: compiled on a GPU, a graph a
    # bucket (read against ar_compiled); eager on a CPU
    "tidar_compiled": Decoder(tidar=True, cache="static"),
    # the defaults without siblings (the default until 2026-12-02)
    "tidar_chain": Decoder(tidar=True, siblings=0),
    # the same drafts verified whenever likely, whatever a step costs
    "tidar_adaptive": Decoder(tidar=True, plan="adaptive"),
    # The diffusion drafter's own acceptance (issue 9's T/NFE): its drafts verified whenever likely,
    # whatever a step costs here (the cost plan may find plain AR steps cheaper, and measure
    # nothing). Chains only, as every record before siblings measured it; tidar_diffusion_tree with
    # siblings.
    "tidar_diffusion": Decoder(tidar=True, drafter="diffusion", plan="adaptive", siblings=0),
    "tidar_diffusion_tree": Decoder(tidar=True, drafter="diffusion", plan="adaptive", siblings=3),
    # The same tree at a GPU's width: ~90 query slots a step, about the price of one slot on a GPU
    # (bench/gpu.py's slot curve), many times that on a CPU. Its T/NFE is the GPU's speed-up to
    # expect.
    "tidar_diffusion_wide": Decoder(
        tidar=True, drafter="diffusion", plan="adaptive", siblings=7, slot_budget=96
    ),
    # transformers' prompt lookup, verified where it pays
    "tidar_lookup": Decoder(tidar=True, drafter="lookup", plan="cost"),
    # what a user gets without converting
    "base_prompt_lookup": Decoder(weights="base", lookup=True, pack_weights=False),
}


def decoder_names(weights: str) -> tuple[str, ...]:
    return tuple(name for name, d in DECODERS.items() if d.weights == weights)


class ForwardCounter:
    """Query slots of each forward of the decoder stack, the LM-head rows computed after it, and the
    time spent inside both (`model_seconds`).

    `with ForwardCounter(model) as count: model.generate(...)`; the first forward is the prefill
    (for prompt lookup it also carries the first draft), the ones after it are decoding steps.
    Head rows are summed over the batch (the bench decodes batch 1).

    Host work is the rest of a generation's time: what the decoding loop does between and around
    the model's forwards (drafts, plans, masks, verify, commit, cache crops, transformers' own
    logits processing). On CUDA each hook waits for the device, so a forward's kernels are counted
    in it and not in the host work that would otherwise wait for them. hooked=False leaves every
    hook out: a forward that torch.compile captures must not hold hooks that read clocks or
    synchronize.
    """

    def __init__(self, model, timed: bool = True, hooked: bool = True):
        self.model = model
        self.timed = timed and hooked
        self.hooked = hooked
        self.device = next(model.parameters()).device
        self.slots: list[int] = []
        self.head_rows: list[int] = []
        self.model_seconds = 0.0
        self._since = None

    def _forward(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        self.slots.append(int(x.shape[1]))
        self.head_rows.append(0)
        self._start()

    def _head(self, module, args, output):
        if self.head_rows:  # rows belong to the forward they read from: the last one started
            self.head_rows[-1] += output.numel() // output.shape[-1]
        self._stop()

    def _start(self, *_):
        if self.timed:
            synchronize(self.device)
            self._since = time.perf_counter()

    def _stop(self, *_):
        if self.timed and self._since is not None:
            synchronize(self.device)
            self.model_seconds += time.perf_counter() - self._since
            self._since = None

    def __enter__(self):
        self.hooks = []
        if not self.hooked:
            return self
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
        self.hooks = [
            decoder.register_forward_pre_hook(self._forward, with_kwargs=True),
            head.register_forward_hook(self._head),
        ]
        if self.timed:
            self.hooks += [
                decoder.register_forward_hook(self._stop),
                head.register_forward_pre_hook(self._start),
            ]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()

    def one_per_token(self, new_tokens: int, prompt_tokens: int) -> None:
        """The counts of plain AR decoding, for a run without hooks (a compiled forward): the
        prompt, then one slot and one head row for each new token after the first."""
        self.slots = [prompt_tokens] + [1] * max(0, new_tokens - 1)
        self.head_rows = [1] * len(self.slots)

    def host_ms_per_step(self, seconds: float) -> float | None:
        """Milliseconds a forward (prefill included) of a generation that took `seconds` spent
        outside the decoder stack and the vocabulary head; None untimed."""
        if not self.timed or not self.forwards:
            return None
        return 1000 * max(0.0, seconds - self.model_seconds) / self.forwards

    @property
    def forwards(self) -> int:
        return len(self.slots)

    @property
    def steps(self) -> int:
        return max(0, self.forwards - 1)

    def per_step(self, counts: list[int]) -> float | None:
        """Mean over the decoding steps (the prefill excluded); None when generation ended at the
        prefill."""
        return statistics.fmean(counts[1:]) if len(counts) > 1 else None


def run_decoder(
    model,
    input_ids,
    decoder: str,
    max_new_tokens: int,
    pad_token_id: int,
    k: int | None,
    prompt_lookup_tokens: int,
    sampling: dict | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict:
    """One generation, greedy or with `sampling` (generate() arguments, do_sample implied): new
    tokens, forwards, wall seconds, query slots and LM-head rows per step, and, for TiDAR, the
    engine's own stats (accepted drafts per step, and where the engine reports them, its LM-head
    rows and draft sources; None where it does not)."""
    spec = DECODERS[decoder]
    device = input_ids.device
    how = {"do_sample": True, **sampling} if sampling else {"do_sample": False}
    # hooks inside a compiled forward would be traced into it (and recompile it for every prompt)
    compiled = spec.compiled_on(device)
    with (
        torch.no_grad(),
        spec.kernels(model),
        ForwardCounter(model, hooked=not compiled) as count,
    ):
        synchronize(device)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            **how,
            **spec.generate_kwargs(k, prompt_lookup_tokens),
        )
        synchronize(device)
        seconds = time.perf_counter() - t0
    # a batch (left-padded, `attention_mask`) gives every row's, each as wide as the longest (rows
    # that ended are padded); the counts are row 0's
    rows = out[:, input_ids.shape[1] :].tolist()
    tokens = rows[0]
    if compiled:
        count.one_per_token(len(tokens), input_ids.shape[1])
    nfe = count.forwards
    row = {
        "new_tokens": len(tokens),
        "nfe": nfe,
        "tokens_per_nfe": len(tokens) / nfe if nfe else 0.0,
        "seconds": seconds,
        "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
        "steps": count.steps,
        "slots_per_step": count.per_step(count.slots),
        "lm_head_rows_per_step": count.per_step(count.head_rows),
        # milliseconds a forward spent outside the model (ForwardCounter); None where compiled
        "host_ms_per_step": count.host_ms_per_step(seconds),
        "tokens": tokens,
    }
    if len(rows) > 1:
        row["rows"] = rows
    if spec.tidar:
        stats = getattr(model, "tidar_stats", None) or {}
        row["accepted"] = list(stats.get("accepted", []))
        # The engine may run the head on hidden states without the output embedding's forward (and
        # so past the hook): its own count wins where it gives one.
        if stats.get("lm_head_rows_per_step") is not None:
            row["lm_head_rows_per_step"] = stats["lm_head_rows_per_step"]
        row["engine_slots_per_step"] = stats.get("slots_per_step")
        row["draft_sources"] = stats.get("draft_sources")
        row["sibling_steps"] = stats.get("sibling_steps")
        row["acceptance_by_offset"] = stats.get("acceptance_by_offset")
    return row


def bench_prompt(
    model,
    tokenizer,
    prompt: dict,
    max_new_tokens: int,
    k: int | None,
    prompt_lookup_tokens: int,
    decoders: tuple[str, ...],
    base=None,
    sampling: dict | None = None,
) -> dict:
    """Each of `decoders` on one prompt, export decoders first; identical_to_ar compares token for
    token with the export's AR output (None for base decoders: another model's text, which
    quality.py compares). base: (base model, its tokenizer), needed for any base decoder.

    sampling: also each decoder sampled (generate() arguments and a `seed`), under row["sampling"],
    right after its greedy runs so machine noise hits both modes alike. Every decoder draws from the
    same seed, mixed with the prompt's id; identical_to_ar is None there (TiDAR's keyed draws and
    transformers' multinomial ones are different samples of the same distribution: exactness is the
    statistical tests', tests/test_decode.py)."""
    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, prompt).to(device)
    row = {"id": prompt["id"], "kind": prompt["kind"], "prompt_tokens": ids.shape[1]}
    modes = [(row, None)]
    if sampling is not None:
        row["sampling"] = {}
        modes.append((row["sampling"], {key: v for key, v in sampling.items() if key != "seed"}))
    for into, how in modes:
        for decoder in decoders:
            if DECODERS[decoder].weights == "export":
                if how is not None:
                    torch.manual_seed(sample_seed(sampling["seed"], prompt["id"]))
                into[decoder] = run_decoder(
                    model,
                    ids,
                    decoder,
                    max_new_tokens,
                    tokenizer.pad_token_id,
                    k,
                    prompt_lookup_tokens,
                    how,
                )
                into[decoder]["identical_to_ar"] = (
                    into[decoder]["tokens"] == row["ar"]["tokens"]
                    if "ar" in row and how is None
                    else None
                )
        for decoder in decoders:
            if DECODERS[decoder].weights == "base":
                base_model, base_tokenizer = base
                base_ids = prompt_ids(base_tokenizer, prompt).to(device)
                if how is not None:
                    torch.manual_seed(sample_seed(sampling["seed"], prompt["id"]))
                into[decoder] = run_decoder(
                    base_model,
                    base_ids,
                    decoder,
                    max_new_tokens,
                    base_tokenizer.pad_token_id,
                    k,
                    prompt_lookup_tokens,
                    how,
                )
                into[decoder]["identical_to_ar"] = None
    return row


def sample_seed(seed: int, prompt_id: str) -> int:
    """One seed per prompt, the same for every decoder and every run of the bench."""
    return (seed * 1_000_003 + zlib.crc32(prompt_id.encode())) % 2**63


def runnable(
    decoders: tuple[str, ...], model, tokenizer, k: int | None, prompt_lookup_tokens: int
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The decoders this model's generate() can run, and why each other one cannot.

    A TiDAR drafter needs a decoding engine that has it: exports load this package's decode.py, and
    one from before drafters existed refuses `drafter=` with a TypeError naming it. Those rows are
    left out with the reason instead of failing the whole bench.
    """
    ids = tokenizer("def", return_tensors="pt").input_ids.to(next(model.parameters()).device)
    keep, skipped = [], {}
    for name in decoders:
        spec = DECODERS[name]
        if spec.weights == "export" and (
            spec.drafter is not None
            or not spec.pack_weights
            or spec.siblings is not None
            or (spec.tidar and spec.cache is not None)
        ):
            try:
                run_decoder(model, ids, name, 2, tokenizer.pad_token_id, k, prompt_lookup_tokens)
            except ValueError as e:  # an engine from before static caches refuses them by name
                if not (spec.tidar and "cache_implementation" in str(e)):
                    raise
                skipped[name] = (
                    f"this TiDAR engine has no cache_implementation={spec.cache!r} ({e})"
                )
                continue
            except TypeError as e:
                argument = next(
                    (a for a in ("drafter", "pack_weights", "siblings") if a in str(e)), None
                )
                if argument is None:
                    raise
                skipped[name] = f"this TiDAR engine has no {argument}= ({e})"
                continue
        keep.append(name)
    return tuple(keep), skipped


def accepted_histogram(rows: list[dict], k: int, decoder: str = "tidar") -> dict[str, int]:
    """Tokens committed per TiDAR step (1 + drafts accepted beyond the committed d[0]), over all
    prompts."""
    counts = Counter(j for r in rows for j in r[decoder].get("accepted", []))
    top = max([k, *counts])  # lookup drafts may be longer than k
    return {str(j): counts.get(j, 0) for j in range(1, top + 1)}
