"""Documents into training chunks: tokenized, packed with doc ids, shuffled, and split by content
hash."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator

import torch


def tokenize_document(tokenizer, doc: str) -> list[int]:
    """A document's tokens (no special tokens), followed by EOS: what `pack` concatenates."""
    eos = tokenizer.eos_token_id
    return tokenizer(doc, add_special_tokens=False)["input_ids"] + (
        [eos] if eos is not None else []
    )


def pack(
    token_docs: Iterable[list[int]], seq_len: int, tail: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate tokenized documents and cut seq_len chunks: (input_ids, doc_ids).

    doc_ids number the documents inside a chunk from 0; a document cut at a chunk end continues
    as document 0 of the next chunk. tail: also yield the shorter last chunk (training drops it,
    as a batch needs equal lengths; an evaluation keeps it, so every token counts).
    """
    for input_ids, doc_ids, _ in pack_marked(
        ((tokens, False) for tokens in token_docs), seq_len, tail
    ):
        yield input_ids, doc_ids


def pack_marked(
    docs: Iterable[tuple[list[int], bool]], seq_len: int, tail: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`pack` of (tokens, mark) documents: (input_ids, doc_ids, marked), marked a bool per token
    (its document's mark: say, self-distilled text)."""
    ids: list[int] = []
    docs_: list[int] = []
    marks: list[bool] = []
    doc = 0
    for tokens, mark in docs:
        ids.extend(tokens)
        docs_.extend([doc] * len(tokens))
        marks.extend([mark] * len(tokens))
        doc += 1
        while len(ids) >= seq_len:
            chunk_docs = torch.tensor(docs_[:seq_len])
            yield (
                torch.tensor(ids[:seq_len]),
                chunk_docs - chunk_docs[0],
                torch.tensor(marks[:seq_len]),
            )
            ids, docs_, marks = ids[seq_len:], docs_[seq_len:], marks[seq_len:]
    if tail and ids:
        chunk_docs = torch.tensor(docs_)
        yield torch.tensor(ids), chunk_docs - chunk_docs[0], torch.tensor(marks)


def shuffled(items, buffer: int, seed: int):
    """Yield items from a random buffer: one long file would otherwise fill hundreds of steps in a
    row."""
    rng = random.Random(seed)
    pool = []
    for item in items:
        pool.append(item)
        if len(pool) > buffer:
            yield pool.pop(rng.randrange(len(pool)))
    rng.shuffle(pool)
    yield from pool


# "stdlib-heldout" is the validation part at this val_every: a document held out at 50 is held out
# at every divisor of 50 too (hash % 50 == 0 implies hash % d == 0), so no recipe with such a
# val_every trains on it.
STDLIB_HELDOUT_EVERY = 50


def is_validation(text: str, val_every: int) -> bool:
    """A document is held out by its own content (a stable hash), never by its position in a stream:
    the same text is on the same side whatever the source order, the mix, or the process reading
    it."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % val_every == 0
