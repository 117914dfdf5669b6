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

from collections import defaultdict

import torch
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
    return {
        "decoder": decoder,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "new_tokens": new_tokens,
        "forwards": forwards,
        "ms_per_forward": shares["total_ms"] / forwards if forwards else None,
        **shares,
    }
