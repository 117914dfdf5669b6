"""Self-distillation data: the base model's own greedy continuations of training-document
prefixes.

Under greedy verification a draft is accepted exactly when it equals the AR argmax, so the base
model's own greedy text is what the diffusion half should learn to draft. Three ways to get it:

  - `tidar-convert distill --model M --sources ... --out corpus.jsonl` writes a corpus as its own
    step (a progress bar, batched generation, the model in eval mode, the dtype of your choice);
  - `fit --data.greedy_docs N` makes one before training (cached by its settings), on rank 0 only:
    the other ranks wait at a barrier and read the same file, so every rank trains on identical
    greedy documents and the generation runs on one full (never sharded) copy of the base model;
  - `fit --data.greedy_corpus corpus.jsonl` trains on a corpus made earlier by `distill`.

Prompts are the first `prompt_tokens` tokens of *training* documents only
(`data.packing.is_validation` decides by a hash of each document's text). Every row records the
`val_every` it was split with, and `fit` refuses a corpus split with another one: a prompt could
then be a validation document.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tidar_convert.data.greedy import (
    DTYPES,
    MADE_BY,
    CorpusSpec,
    check_corpus,  # noqa: F401  (the reading side, kept importable from here)
    first_row,
)
from tidar_convert.data.stream import PackedDocuments
from tidar_convert.exports.marker import file_sha256
from tidar_convert.exports.outputs import atomic_file

# prompts generated together (equal lengths, no padding): more tokens/s than 32 a step on CPU
# (bench/LOG.md, "2026-12-01: self-distillation on the decoding kernels")
BATCH = 64


def training_prompts(
    tokenizer,
    sources: list[str],
    n_docs: int,
    prompt_tokens: int,
    val_every: int,
    text_field: str = "text",
    name: str | None = None,
    split: str = "train",
    seed: int = 0,
) -> list[list[int]]:
    """The first `prompt_tokens` tokens of the first `n_docs` training documents longer than
    that."""
    prompts = []
    docs = PackedDocuments(
        tokenizer, sources, prompt_tokens, "train", val_every, text_field, name, split, seed
    )
    for doc in docs.tokenized():  # the training part only: never a validation document
        if len(doc) > prompt_tokens:
            prompts.append(doc[:prompt_tokens])
            if len(prompts) == n_docs:
                return prompts
    raise ValueError(
        f"the training documents of {', '.join(sources)} give {len(prompts)} prompts of more "
        f"than {prompt_tokens} tokens, "
        f"fewer than the {n_docs} greedy documents asked for; lower the number "
        "(--n_docs, or --data.greedy_docs in fit) or add documents."
    )


@torch.no_grad()
def write_corpus(
    model,
    tokenizer,
    prompts: list[list[int]],
    out: str | Path,
    new_tokens: int,
    batch_size: int,
    meta: dict,
) -> Path:
    """Write one row per prompt, `{"text": prompt + greedy continuation, **meta}`, atomically, and
    its checksum beside it (`record_corpus`)."""
    from tidar_convert.runtime.kernels import cpu_kernels
    from tidar_convert.train.progress import progress

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout: the continuation is the one greedy decoding gives
    batches = range(0, len(prompts), batch_size)
    try:
        # Packed weights on CPU (nothing on a GPU), not generate()'s choice timed at 1 and 8 rows:
        # at 64 rows a step packing costs about the same as stock kernels on an AMX Xeon and far
        # less on a CPU without AMX, with batch 64 faster than 32 there too (bench/LOG.md,
        # "2026-12-01: self-distillation on the decoding kernels").
        with atomic_file(out) as tmp, tmp.open("w") as f, cpu_kernels(model, True):
            for i in progress(batches, "greedy continuations", total=len(batches), unit="batch"):
                # equal lengths: no padding
                ids = torch.tensor(prompts[i : i + batch_size], device=device)
                rows = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
                for row in rows:
                    f.write(
                        json.dumps(
                            {"text": tokenizer.decode(row, skip_special_tokens=True), **meta}
                        )
                        + "\n"
                    )
    finally:
        model.train(was_training)
    out = Path(out).expanduser().absolute()
    record_corpus(out)
    return out


def checksum_path(corpus: str | Path) -> Path:
    """`<corpus>.sha256`, in `sha256sum` format: what `distill --overwrite` checks the corpus
    against."""
    corpus = Path(corpus)
    return corpus.with_name(corpus.name + ".sha256")


def record_corpus(corpus: str | Path) -> Path:
    """Write the corpus's sha256 beside it (`sha256sum -c` reads it too), so that `--overwrite` can
    tell a corpus still as written from one someone added to or edited since."""
    with atomic_file(checksum_path(corpus)) as tmp:
        tmp.write_text(f"{file_sha256(corpus)}  {Path(corpus).name}\n")
    return checksum_path(corpus)


def corpus_as_written(corpus: str | Path) -> bool | None:
    """Whether the corpus still holds what `distill` wrote; None if its checksum file is missing
    or unreadable (written before checksums were kept, or removed): then it cannot be told."""
    try:
        recorded = checksum_path(corpus).read_text().split()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    return recorded == file_sha256(corpus)


def make_corpus(
    spec: CorpusSpec, out: str | Path, batch_size: int, device: str | torch.device
) -> Path:
    """Load the base model (its own full copy, in the spec's dtype on `device`), write the corpus,
    `batch_size` prompts at a time, free the model."""
    from tidar_convert.models.loading import absolute_model, load_base

    base, tokenizer = load_base(spec.model, dtype=getattr(torch, spec.dtype))
    base.to(device)
    prompts = training_prompts(
        tokenizer,
        list(spec.sources),
        spec.n_docs,
        spec.prompt_tokens,
        spec.val_every,
        spec.text_field,
        spec.name,
        spec.split,
        spec.seed,
    )
    meta = {
        "made_by": MADE_BY,
        "val_every": spec.val_every,
        "model": absolute_model(spec.model) or "default",
    }
    return write_corpus(base, tokenizer, prompts, out, spec.new_tokens, batch_size, meta)


def check_out(out: str, overwrite: bool) -> None:
    """Refuse, before any model loads, an --out that is not ours to write: only a new path, or (with
    overwrite) a corpus written by this command and unchanged since (its `.sha256` file says), may
    be written."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise ValueError(
            f"--out {out!r} is a folder; name a .jsonl file to write, "
            f"e.g. --out {Path(out) / 'greedy.jsonl'}."
        )
    if not path.exists():
        return
    if (first_row(path) or {}).get("made_by") != MADE_BY:
        raise ValueError(
            f"--out {out!r} exists and is not a corpus written by `tidar-convert distill`; "
            "nothing was written. Choose a new file name."
        )
    if not overwrite:
        raise ValueError(
            f"--out {out!r} holds an earlier corpus of `tidar-convert distill`; "
            "pass --overwrite to replace it, or choose a new file name."
        )
    same = corpus_as_written(path)
    if same is None:
        raise ValueError(
            f"--out {out!r} holds a corpus of `tidar-convert distill` without its checksum file "
            f"{checksum_path(path).name}, so whether "
            "rows were added or edited since it was written cannot be told; nothing was written. "
            "Check it and delete it yourself, or choose a new file name."
        )
    if not same:
        raise ValueError(
            f"--out {out!r} was changed after `tidar-convert distill` wrote it "
            f"(its sha256 differs from {checksum_path(path).name}); "
            "nothing was written. Move what you want to keep elsewhere, or choose a new file name; "
            "--overwrite only replaces a corpus as it was written."
        )


def corpus_for_fit(trainer, spec: CorpusSpec, batch_size: int) -> Path:
    """The cached corpus for a training run, made once: rank 0 first, the other ranks after a
    barrier.

    Every rank must read the same file (the documents are dealt to ranks by their position in the
    stream), so only rank 0 generates; the cache must be on a filesystem all nodes see
    (TIDAR_CACHE), or made beforehand with `distill` and passed as --data.greedy_corpus.
    """
    path = spec.path
    world = trainer.world_size if trainer is not None else 1
    rank = trainer.global_rank if trainer is not None else 0
    failed = None
    if rank == 0 and not path.is_file():
        device = trainer.strategy.root_device if trainer is not None else "cpu"
        print(
            f"self-distillation: generating {spec.n_docs} greedy documents with "
            f"{spec.model if spec.model not in (None, 'default') else 'the default model'} "
            f"({spec.dtype}) "
            f"into {path}",
            file=sys.stderr,
            flush=True,
        )
        try:
            make_corpus(spec, path, batch_size, device)
        except Exception as e:
            # still reach the barrier: the other ranks would otherwise wait there until the timeout
            if world == 1:
                raise
            failed = e
    if world > 1:
        # rank 0 has written the file (or found it, or failed) past this point
        trainer.strategy.barrier("greedy_corpus")
        if failed is not None:
            raise failed
        if not path.is_file():
            raise FileNotFoundError(
                f"rank {rank}: the greedy corpus {path} is not here after rank 0's turn: "
                "either rank 0 failed to make it (its error says why), "
                "or it is on a filesystem this node does not see; point TIDAR_CACHE at one every "
                "node shares, or make the corpus once with `tidar-convert distill` and pass "
                "--data.greedy_corpus."
            )
        # One write: print() writes the text and its newline separately, and two ranks' lines on one
        # stderr then interleave as "...jsonlrank 1: ..." (seen in CI).
        sys.stderr.write(f"rank {rank}: greedy documents from {path}\n")
        sys.stderr.flush()
    return path


def corpus_for_data(trainer, dm) -> Path | None:
    """Make the greedy corpus a TiDARData will read in this fit, before it reads any (the module
    calls this in setup, before its own weights load): the DataModule only reads a ready file, never
    a model. None when the run trains on no generated greedy documents (none asked for, a share of
    0, or a --data.greedy_corpus made by `distill`)."""
    if dm.greedy_docs == 0 or dm.greedy_share == 0 or dm.greedy_corpus:
        return None
    return corpus_for_fit(trainer, CorpusSpec.of(dm), BATCH)


def distill_cmd(
    out: str,
    model: str | None = None,
    sources: str | list[str] = "stdlib",
    n_docs: int = 384,
    prompt_tokens: int = 32,
    new_tokens: int = 224,
    batch_size: int = BATCH,
    val_every: int = 50,
    text_field: str = "text",
    name: str | None = None,
    split: str = "train",
    seed: int = 0,
    dtype: str = "float32",
    device: str = "auto",
    overwrite: bool = False,
) -> str:
    """Write self-distillation documents: real prompts, then the base model's own greedy
    continuation.

    Train on them with `fit --data.greedy_corpus OUT --data.greedy_docs N`, with the same
    --data.val_every (so no prompt is a validation document of the run).

    Args:
        out: the .jsonl file to write (new, or an earlier corpus of this command with --overwrite).
        model: base checkpoint: hub id, local folder or .gguf file; None = embedded
            SmolLM2-135M-Instruct.
        sources: data sources the prompts come from, as `fit --data.source` takes them.
        n_docs: documents to write.
        prompt_tokens: tokens of a training document that start each one.
        new_tokens: greedy tokens generated after the prompt.
        batch_size: prompts generated together.
        val_every: the training run's --data.val_every: prompts come from its training documents
            only.
        text_field: column holding the text in json/parquet/hub sources.
        name: hub dataset configuration name.
        split: hub dataset split.
        seed: the training run's --data.seed (it orders the stdlib files, so it decides which
            documents come first).
        dtype: float32, bfloat16 or float16 weights for generation.
        device: auto (cuda if available), cpu, cuda, cuda:1, ...
        overwrite: replace an earlier corpus of this command at `out`, if unchanged since (never
            any other file).
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise ValueError("--sources []: name at least one data source, e.g. stdlib.")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}.")
    for flag, value, least in (
        ("n_docs", n_docs, 1),
        ("prompt_tokens", prompt_tokens, 1),
        ("new_tokens", new_tokens, 1),
        ("batch_size", batch_size, 1),
        ("val_every", val_every, 2),
    ):
        if value < least:
            raise ValueError(f"--{flag} {value}: must be >= {least}.")
    check_out(out, overwrite)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = CorpusSpec(
        model,
        tuple(sources),
        n_docs,
        val_every,
        prompt_tokens,
        new_tokens,
        text_field,
        name,
        split,
        seed,
        dtype,
    )
    path = make_corpus(spec, out, batch_size, device)
    print(f"wrote {n_docs} greedy documents to {path}", file=sys.stderr)
    return str(path)
