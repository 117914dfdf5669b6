"""Plain helpers the tests import (`from helpers import ...`): tiny models, data and reference
decoding. conftest.py keeps the fixtures built from them."""

from __future__ import annotations

from pathlib import Path

import torch

from tidar_convert.runtime.spec import TiDARSpec

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tidar_convert.data import stdlib_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [Path(f).read_text() for f in stdlib_files()[:20]]
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


def tiny_config(family: str, vocab_size: int):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=family in ("qwen2", "qwen3"),
        eos_token_id=0,
        bos_token_id=0,
    )
    if family == "mistral":
        common["sliding_window"] = None
    if family == "qwen3":
        common["head_dim"] = 16
    return AutoConfig.for_model(family, **common)


def cycle_batch(batch: int, seq_len: int, period: int = 7, offset: int = 3, seed=None):
    """Token streams repeating a fixed cycle from a random phase: learnable in seconds, so drafts
    get accepted."""
    from tidar_convert.bench.engine_check import cycles

    return cycles(
        batch,
        seq_len,
        period,
        offset,
        torch.Generator().manual_seed(seed) if seed is not None else None,
    )


def train_logits(model, ids, draft_length: int, embeds=None, mixers=None):
    """The training layout's logits (B, 2S, V) of clean tokens ids (B, S), as fit computes them:
    the TiDAR mask (sliding windows and chunks by position), and each mask block of a recurrent
    layer from the state before it (runtime/recurrent.py). embeds: the doubled sequence's input
    embeddings instead of its tokens."""
    from tidar_convert.runtime import layout, recurrent

    B, S = ids.shape
    positions = layout.train_position_ids(ids)
    mask = layout.build_mask(
        layout.train_mask_mod(S, draft_length),
        B,
        2 * S,
        2 * S,
        model.config._attn_implementation,
        "cpu",
        layout.Local.of(model.config, positions),
    )
    feed = (
        {"input_ids": layout.train_inputs(ids, model.config.mask_token_id)}
        if embeds is None
        else {"inputs_embeds": embeds}
    )
    segments = recurrent.Segments.training(S, draft_length)
    with recurrent.layout(model if mixers is None else mixers, segments):
        return model(**feed, position_ids=positions, attention_mask=mask, use_cache=False).logits


def train_tiny(model, steps: int = 150, draft_length: int = 4, seq_len: int = 32, lr: float = 3e-3):
    """A plain TiDAR training loop (no Lightning) on cycle data: layout + loss, nothing else."""
    from tidar_convert.runtime import layout, recurrent
    from tidar_convert.train.loss import hybrid_loss

    torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mixers = recurrent.mixers(model)
    for _ in range(steps):
        ids = cycle_batch(8, seq_len)
        logits = train_logits(model, ids, draft_length, mixers=mixers)
        loss = hybrid_loss(logits, *layout.train_labels(ids), alpha=1.0, draft_length=draft_length)[
            "loss"
        ]
        opt.zero_grad()
        loss.backward()
        opt.step()
    TiDARSpec(draft_length, model.config.mask_token_id).write(model.config)
    return model.eval()


def ar(model, ids, **kw):
    """Plain AR greedy decoding (transformers' own generate) on the same weights: the reference."""
    return model.generate(ids, do_sample=False, **kw)


# The oldest transformers an export is known to meet: a GPU lease's image (2026-12-04) had 5.17,
# without the cache classes of later releases (DummyLayer, the hybrid caches) the runtime imports.
OLD_TRANSFORMERS = ("transformers==5.17.0", "huggingface_hub==1.33.0")


def old_transformers() -> str:
    """A folder holding OLD_TRANSFORMERS unpacked (pip download from the registry, kept in the
    cache): put first on PYTHONPATH, it stands in for an older install."""
    import subprocess
    import sys
    import zipfile

    from tidar_convert.models.loading import cache_dir

    site = cache_dir() / "old-transformers" / "-".join(OLD_TRANSFORMERS).replace("==", "")
    if not (site / "transformers" / "__init__.py").exists():
        wheels = site.with_suffix(".wheels")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels)]
            + list(OLD_TRANSFORMERS),
            check=True,
            capture_output=True,
            timeout=600,
        )
        for wheel in wheels.glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(site)
    return str(site)
