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
    packer = Packer(seq_len)
    yield from packer.chunks(docs)
    if tail:
        yield from packer.tail()


class Packer:
    """`pack_marked` with its state in view: between two chunks, `state()` is the tokens not yet in
    a chunk, from which a new Packer (`leftover`) packs exactly as this one goes on to pack."""

    def __init__(self, seq_len: int, leftover: dict | None = None):
        self.seq_len = seq_len
        left = leftover or {"ids": [], "docs": [], "marks": []}
        self.ids, self.docs, self.marks = list(left["ids"]), list(left["docs"]), list(left["marks"])
        # doc ids only matter relative to a chunk's first token: the next one just has to be new
        self.doc = self.docs[-1] + 1 if self.docs else 0

    def state(self) -> dict:
        first = self.docs[0] if self.docs else 0
        return {
            "ids": list(self.ids),
            "docs": [d - first for d in self.docs],
            "marks": list(self.marks),
        }

    def chunks(
        self, docs: Iterable[tuple[list[int], bool]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        yield from self._full()  # a leftover may hold whole chunks (one long document)
        for tokens, mark in docs:
            self.ids.extend(tokens)
            self.docs.extend([self.doc] * len(tokens))
            self.marks.extend([mark] * len(tokens))
            self.doc += 1
            yield from self._full()

    def _full(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        n = self.seq_len
        while len(self.ids) >= n:
            chunk_docs = torch.tensor(self.docs[:n])
            chunk = (
                torch.tensor(self.ids[:n]),
                chunk_docs - chunk_docs[0],
                torch.tensor(self.marks[:n]),
            )
            # cut before yielding: a paused generator's state is then the tokens still to pack
            self.ids, self.docs, self.marks = self.ids[n:], self.docs[n:], self.marks[n:]
            yield chunk

    def tail(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.ids:
            chunk_docs = torch.tensor(self.docs)
            yield torch.tensor(self.ids), chunk_docs - chunk_docs[0], torch.tensor(self.marks)


def block_order(size: int, seed: int, block: int) -> list[int]:
    """The order the chunks of shuffle block `block` are served in: a permutation drawn from the
    seed and the block's number alone, so a resumed reader draws the same one for the block it
    resumes in."""
    order = list(range(size))
    random.Random(f"{seed}/{block}").shuffle(order)  # a str seed hashes the same in every process
    return order


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
