"""Where a TiDAR step's time goes: a few generations under torch.profiler, split by the engine's phases.

The engine labels its phases with `torch.profiler.record_function("tidar.<phase>")` (draft, mask,
forward, lm_head, verify, commit, crop). Whatever `tidar.*` labels appear are reported with their
share of the generate() time, and "other" is the rest (time under no label), so the breakdown
means the same before and after an engine adds or renames phases. Labels nested inside another
`tidar.*` label are reported but not subtracted twice. On a GPU the shares are of host time: the
engine waits for the device when it verifies, so kernel time lands in the phase that waits.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .decoders import DECODERS, ForwardCounter
from .timing import synchronize

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
    """{"total_ms", "phases": {label: {"ms", "share", "within"}, ..., "other": {...}}} from `spans`:
    time under each `tidar.*` label, and the rest of the REGION time as "other". A label inside
    another one on the same thread names it in "within"; its time is not taken from "other" twice,
    so the shares of the labels with an empty "within", and other, add up to 1."""
    total = sum(end - start for name, start, end, _ in events if name == REGION)
    labelled, within, covered, outer = defaultdict(int), defaultdict(set), 0, {}
    for name, start, end, thread in sorted((e for e in events if e[0] != REGION), key=lambda e: (e[1], -e[2])):
        labelled[name] += end - start
        top = outer.get(thread)  # the last top-level label of this thread: (name, end)
        if top is not None and end <= top[1]:
            within[name].add(top[0])
        else:
            covered += end - start
            outer[thread] = (name, end)
    phases = {name: {"ms": ns / 1e6, "share": ns / total if total > 0 else 0.0, "within": sorted(within[name])} for name, ns in sorted(labelled.items())}
    other = max(0, total - covered)
    phases["other"] = {"ms": other / 1e6, "share": other / total if total > 0 else 0.0, "within": []}
    return {"total_ms": total / 1e6, "phases": phases}


def step_breakdown(model, tokenizer, prompts: list[dict], k: int | None, max_new_tokens: int = PROFILE_TOKENS, decoder: str = "tidar") -> dict:
    """Profile `decoder` (greedy, batch 1) on `prompts`, `max_new_tokens` each; keep it to a couple
    of short ones, as the profiler records every operator. Call it after a warm-up generation, so
    no one-time cost lands in a phase."""
    device = next(model.parameters()).device
    kwargs = DECODERS[decoder].generate_kwargs(k, 0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    new_tokens = forwards = 0
    with torch.no_grad(), profile(activities=activities) as prof:
        for prompt in prompts:
            ids = tokenizer(prompt["text"], return_tensors="pt").input_ids.to(device)
            with ForwardCounter(model) as count, record_function(REGION):
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs)
                synchronize(device)
            new_tokens += out.shape[1] - ids.shape[1]
            forwards += count.forwards
    shares = phase_shares(spans(prof))
    return {
        "decoder": decoder,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "new_tokens": new_tokens,
        "forwards": forwards,
        "ms_per_forward": shares["total_ms"] / forwards if forwards else None,
        **shares,
    }
