"""AR perplexity: one plain causal pass per chunk of packed documents.

A TiDAR model must keep its base model's likelihood (docs/method.md §2); this is how to check it.
Documents are tokenized and packed as training packs them (`data.tokenize_document`, `data.pack`),
and models load as they are saved (`loading.load_pretrained`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from tidar_convert import data
from tidar_convert.bench.machine import default_device
from tidar_convert.models import loading
from tidar_convert.train.progress import Bar


def chunks(
    tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int
) -> Iterator[torch.Tensor]:
    """seq_len chunks of the packed documents (each followed by EOS), at most max_tokens tokens in
    all; the shorter last chunk is kept when it has something to predict (>= 2 tokens)."""
    left = max_tokens
    for ids, _ in data.pack(
        (data.tokenize_document(tokenizer, t) for t in texts), seq_len, tail=True
    ):
        ids = ids[:left]
        if len(ids) < 2:
            return
        yield ids
        left -= len(ids)


def perplexity(
    model,
    tokenizer,
    texts: Iterable[str],
    seq_len: int = 512,
    max_tokens: int = 20000,
    progress: bool = True,
) -> float:
    """AR perplexity, exp(mean NLL of next-token predictions), one plain causal pass per chunk.

    No TiDAR mask and no mask tokens: this is the likelihood the model gives as an AR model. Each
    chunk starts without context, so the first token of a chunk is never predicted.
    """
    if seq_len < 2:
        raise ValueError(
            f"seq_len={seq_len}: need at least 2 tokens per chunk (one to predict from, one to "
            "predict)."
        )
    if max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens}: need at least 2 tokens.")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and seq_len > positions:
        raise ValueError(
            f"seq_len={seq_len} is longer than the model's {positions} positions "
            "(max_position_embeddings in its config.json): tokens past them have positions it "
            f"never learned, and their perplexity measures that; pass --seq_len {positions} or "
            "less."
        )
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    with torch.no_grad():
        for chunk in Bar(
            chunks(tokenizer, texts, seq_len, max_tokens),
            total=math.ceil(max_tokens / seq_len),
            desc="perplexity",
            unit="chunk",
            disable=not progress,
        ):
            ids = chunk.to(device)[None]
            positions = torch.arange(ids.shape[1], device=device)[None]
            logits = (
                model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :-1].float()
            )
            nll += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    if count == 0:
        raise ValueError(
            f"the data holds fewer than 2 tokens; perplexity needs text (seq_len={seq_len})."
        )
    return math.exp(nll / count)


def load_for_ppl(model: str):
    """Any causal LM as it is: an export folder, a base folder, a hub id, a .gguf, or `default`.

    Not load_base: its added mask/pad rows would join the softmax and nudge the base model's
    perplexity. An export has its mask row already; that one is part of the converted model.
    """
    lm, tokenizer = loading.load_pretrained(loading.resolve(model), dtype=torch.float32)
    return lm.to(default_device()).eval(), tokenizer


def model_perplexity(model: str, source: str, seq_len: int = 512, max_tokens: int = 20000) -> float:
    lm, tokenizer = load_for_ppl(model)
    return perplexity(
        lm,
        tokenizer,
        data.iter_documents("prose-heldout" if source == "prose" else source),
        seq_len,
        max_tokens,
    )


def compare_perplexity(
    base: str, converted: str, source: str, seq_len: int = 512, max_tokens: int = 20000
) -> dict:
    base_ppl = model_perplexity(base, source, seq_len, max_tokens)
    conv_ppl = model_perplexity(converted, source, seq_len, max_tokens)
    return {
        "data": source,
        "seq_len": seq_len,
        "max_tokens": max_tokens,
        "base_model": base,
        "base": base_ppl,
        "converted": conv_ppl,
        "change_pct": 100 * (conv_ppl / base_ppl - 1),
    }


def eval_ppl_cmd(model: str, data: str, seq_len: int = 512, max_tokens: int = 20000) -> float:
    """AR perplexity of a model on a data source, one plain causal pass per seq_len chunk.

    Args:
        model: export folder, base model folder, hub id, .gguf file, or `default` (embedded
            SmolLM2).
        data: prose (held-out documents of the training books), prose-book (a whole book training
            never sees), stdlib-heldout (stdlib modules training holds out), prose-train, stdlib, a
            local file/folder (.txt/.md/.py one document per file in a folder, a single file cut at
            blank lines; .jsonl/.parquet one per row), or a hub dataset name.
        seq_len: tokens per chunk.
        max_tokens: stop after this many tokens.

    Returns:
        The perplexity (also printed).
    """
    from tidar_convert.data.checks import check_sources

    if seq_len < 2 or max_tokens < 1:
        raise ValueError(
            f"seq_len={seq_len}, max_tokens={max_tokens}: need seq_len >= 2 and max_tokens >= 1."
        )
    check_sources(["prose-heldout" if data == "prose" else data])  # before the model loads
    ppl = model_perplexity(model, data, seq_len, max_tokens)
    print(f"perplexity {ppl:.4f} ({model} on {data}, seq_len {seq_len}, up to {max_tokens} tokens)")
    return ppl
