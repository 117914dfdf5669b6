"""Where a TiDAR step's time goes: a few generations under torch.profiler, split by the engine's
phases.

The engine labels its phases with `torch.profiler.record_function("tidar.<phase>")` (draft, mask,
forward, lm_head, verify, commit, crop). Whatever `tidar.*` labels appear are reported with their
share of the generate() time, and "other" is the rest (time under no label), so the breakdown
means the same before and after an engine adds or renames phases. A label nested inside another
`tidar.*` label is reported under its path ("tidar.verify > tidar.lm_head") and not subtracted
twice. On a GPU the shares are of host time: the engine waits for the device when it verifies, so
kernel time lands in the phase that waits.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function

from tidar_convert.bench.decoders import DECODERS, ForwardCounter
from tidar_convert.bench.prompts import prompt_ids
from tidar_convert.bench.timing import synchronize

PHASE_PREFIX = "tidar."
REGION = "bench.generate"  # one per profiled generate() call: the total the shares are of
PROFILE_PROMPTS = 2
PROFILE_TOKENS = 32


def spans(prof) -> list[tuple[str, int, int, int]]:
    """(name, start ns, end ns, thread) of the REGION and `tidar.*` events of a finished profile.

    Read from the raw kineto results: `prof.events()` first builds a tree of every operator
    recorded, seconds for a few hundred forwards, where only a handful of labels are needed.
    """
    out = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == REGION or name.startswith(PHASE_PREFIX):
            out.append((name, e.start_ns(), e.start_ns() + e.duration_ns(), e.start_thread_id()))
    return out


def phase_shares(events: list[tuple[str, int, int, int]]) -> dict:
    """{"total_ms", "phases": {label: {"ms", "share"}, ..., "other": {...}}} from `spans`: time
    under each `tidar.*` label, and the rest of the REGION time as "other". A label met inside
    another one (on the same thread) is keyed by its path, "tidar.verify > tidar.lm_head", apart
    from where it runs on its own: the shares of the keys without " > ", and other, add up to 1."""
    total = sum(end - start for name, start, end, _ in events if name == REGION)
    labelled, covered, open_labels = defaultdict(int), 0, defaultdict(list)
    for name, start, end, thread in sorted(
        (e for e in events if e[0] != REGION), key=lambda e: (e[1], -e[2])
    ):
        # (label, end) of the labels still open at `start`, outermost first
        stack = open_labels[thread]
        while stack and stack[-1][1] <= start:
            stack.pop()
        labelled[" > ".join([label for label, _ in stack] + [name])] += end - start
        if not stack:
            covered += end - start
        stack.append((name, end))
    phases = dict(sorted(labelled.items()))
    phases["other"] = max(0, total - covered)
    return {
        "total_ms": total / 1e6,
        "phases": {
            name: {"ms": ns / 1e6, "share": ns / total if total > 0 else 0.0}
            for name, ns in phases.items()
        },
    }


def step_breakdown(
    model,
    tokenizer,
    prompts: list[dict],
    k: int | None,
    max_new_tokens: int = PROFILE_TOKENS,
    decoder: str = "tidar",
) -> dict:
    """Profile `decoder` (greedy, batch 1) on `prompts`, `max_new_tokens` each; keep it to a couple
    of short ones, as the profiler records every operator. Call it after a warm-up generation, so
    no one-time cost lands in a phase."""
    device = next(model.parameters()).device
    kwargs = DECODERS[decoder].generate_kwargs(k, 0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    new_tokens = forwards = 0
    with torch.no_grad(), profile(activities=activities) as prof:
        for prompt in prompts:
            ids = prompt_ids(tokenizer, prompt).to(device)
            with ForwardCounter(model) as count, record_function(REGION):
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    **kwargs,
                )
                synchronize(device)
            new_tokens += out.shape[1] - ids.shape[1]
            forwards += count.forwards
    shares = phase_shares(spans(prof))
    model_ms = sum(shares["phases"].get(label, {"ms": 0.0})["ms"] for label in MODEL_PHASES)
    reads = host_reads(model, tokenizer, prompts, kwargs, max_new_tokens)
    return {
        "decoder": decoder,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "new_tokens": new_tokens,
        "forwards": forwards,
        "ms_per_forward": shares["total_ms"] / forwards if forwards else None,
        # under the profiler: everything outside the forward and vocabulary-head ranges
        "host_ms_per_forward": (shares["total_ms"] - model_ms) / forwards if forwards else None,
        # tensor values the host read, each a wait for the device on a GPU (HostReads)
        "host_reads_per_forward": reads["reads"] / reads["forwards"] if reads["forwards"] else None,
        "host_reads_at": reads["at"],
        **shares,
    }


# The model's own ranges: the rest of a step is host work (the vocabulary head run outside a
# forward, for a group's rows read later, is the model's too).
MODEL_PHASES = ("tidar.forward", "tidar.lm_head")

# What reads a tensor's values into Python: on a GPU each waits for the device to finish.
READS = (
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__float__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
)


class HostReads(TorchFunctionMode):
    """Counts the host's reads of tensor values (READS) while active, by the engine function that
    made them (`at`: "module.function" -> count). Reads inside the model (transformers' forward)
    are left out: the step's own are what a lean step removes."""

    # the decoding code: this package's, or an export's copy of its runtime
    CODE = ("custom_generate", "tidar_convert")

    def __init__(self, code: tuple[str, ...] = CODE):
        super().__init__()
        self.code, self.reads, self.at = code, 0, defaultdict(int)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            caller = sys._getframe(1)  # past torch's own dispatch frames
            while caller is not None and f"{os.sep}torch{os.sep}" in caller.f_code.co_filename:
                caller = caller.f_back
            name = caller.f_code.co_filename if caller is not None else ""
            if any(part in name for part in self.code):
                self.reads += 1
                self.at[f"{Path(name).stem}.{caller.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))


def host_reads(model, tokenizer, prompts: list[dict], kwargs: dict, max_new_tokens: int) -> dict:
    """Reads of tensor values by the decoding loop (HostReads), over greedy generations of
    `prompts`, and the forwards they took."""
    device = next(model.parameters()).device
    reads, forwards = HostReads(), 0
    with torch.no_grad():
        for prompt in prompts:
            ids = prompt_ids(tokenizer, prompt).to(device)
            with ForwardCounter(model, timed=False) as count, reads:
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    **kwargs,
                )
            forwards += count.forwards
    top = sorted(reads.at.items(), key=lambda item: -item[1])
    return {"reads": reads.reads, "forwards": forwards, "at": dict(top)}
