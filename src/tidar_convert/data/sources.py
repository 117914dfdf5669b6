"""Documents from each kind of source: the stdlib, held-out prose, local files and folders, hub
datasets. `check_sources` checks a list of them before any work: names, paths, file formats and
one pass over the bytes of each local file (UTF-8, JSON lines, the text field), never a tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import reprlib
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from tidar_convert.data.packing import STDLIB_HELDOUT_EVERY, is_validation
from tidar_convert.data.prose import (
    PROSE_DOC_CHARS,
    prose_corpus,
)

log = logging.getLogger(__name__)

BUILTIN_SOURCES = ("stdlib", "stdlib-heldout", "prose-train", "prose-heldout", "prose-book")
TEXT_SUFFIXES = {
    ".txt": "text",
    ".md": "text",
    ".py": "text",
    ".rst": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
# Data formats not read here: a folder's such files are named in a warning (the user may expect
# them read), a single one is refused with how to convert it, a missing one is a path (no hub id).
OTHER_DATA_SUFFIXES = (".csv", ".tsv", ".arrow", ".gz", ".zst", ".xz", ".bz2", ".zip", ".tar")


def stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "lib2to3")
    return sorted(
        str(p)
        for p in root.rglob("*.py")
        if not any(part in skip for part in p.relative_to(root).parts)
    )


def _builder(path: Path) -> str | None:
    return TEXT_SUFFIXES.get(path.suffix.lower())  # NOTES.TXT is text as notes.txt is


def _other_format(path: Path) -> str | None:
    return next((s for s in OTHER_DATA_SUFFIXES if path.name.lower().endswith(s)), None)


def _files_by_builder(path: Path, source: str | None = None) -> dict[str, list[str]]:
    """{builder: files} of a file or a folder. In a folder, hidden files and folders (.git, .venv,
    .ipynb_checkpoints) are not data, as `datasets` skips them too; files of a data format not read
    here are named in a warning, once. A single file of another format is refused."""
    source = str(path) if source is None else source
    if not path.is_dir():
        if _builder(path) is None:
            raise ValueError(_unread_file(source, path))
        return {_builder(path): [str(path)]}
    groups: dict[str, list[str]] = {}
    other: Counter = Counter()
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(root) / n for n in names if not n.startswith(".")]
    for f in sorted(files):  # by path: the order reading has always had
        if _builder(f) and f.is_file():
            groups.setdefault(_builder(f), []).append(str(f))
        elif _other_format(f):
            other[_other_format(f)] += 1
    unread = ", ".join(f"{n} {suffix} file{'s' * (n > 1)}" for suffix, n in sorted(other.items()))
    if not groups:
        found = f" (it holds {unread}, of a format not read here)" if other else ""
        raise ValueError(
            f"data source {source!r} holds no file ending in "
            f"{', '.join(sorted(TEXT_SUFFIXES))}{found}; put the data in such files (.jsonl: one "
            "JSON object a line, the text in a field), or pass another data source."
        )
    if other and source not in _WARNED:
        _WARNED.add(source)
        log.warning(
            "Data source %r: skipping its %s, of a format not read here; convert them to .jsonl or "
            ".parquet (decompress them first), or remove them, to silence this.",
            source,
            unread,
        )
    return groups


def _unread_file(source: str, path: Path) -> str:
    kind = _other_format(path) or path.suffix.lower()
    if kind in (".csv", ".tsv"):
        fix = "convert it to .jsonl or .parquet (datasets.Dataset.from_csv(path).to_parquet(...))"
    elif kind in OTHER_DATA_SUFFIXES:
        fix = "decompress it (or convert it) to .jsonl, .parquet or .txt"
    else:
        fix = "if it is plain text, give it the suffix .txt"
    what = f"ends in {kind}" if kind else "has no suffix"
    return (
        f"data file {source!r} {what}, a format not read as data (read: "
        f"{', '.join(sorted(TEXT_SUFFIXES))}); {fix}, or pass another data source."
    )


def iter_documents(
    source: str,
    text_field: str = "text",
    name: str | None = None,
    split: str = "train",
    seed: int = 0,
) -> Iterator[str]:
    """Yield the text of each document of one source, in a fixed (seeded) order.

    A folder's text files are one document each; a single text file given as the source is cut
    into documents at blank lines (`split_text`): whole, it would be all training or all validation.
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
        # mix modules instead of reading the stdlib alphabetically
        random.Random(seed).shuffle(files)
        streams = [(_text_rows(files), "text", None)]
        if source == "stdlib-heldout":
            streams = [
                (
                    (
                        row
                        for row in streams[0][0]
                        if is_validation(row["text"], STDLIB_HELDOUT_EVERY)
                    ),
                    "text",
                    None,
                )
            ]
    elif Path(source).expanduser().exists():
        path = Path(source).expanduser()
        streams = []
        for builder, files in _files_by_builder(path, source).items():
            if builder == "text":
                rows = _text_rows(files)
                rows = (r for row in rows for r in split_text(row)) if path.is_file() else rows
                streams.append((rows, "text", None))
            else:
                streams.append((_rows(builder, files), text_field, (builder, files)))
    else:
        _check_source_name(source)
        _check_hub_dataset(source)
        streams = [
            (whole(load_dataset(source, name, split=split, streaming=True)), text_field, None)
        ]
    for stream, field, local in streams:
        for n, row in enumerate(stream, 1):
            text = row.get(field)
            if not isinstance(text, str):
                raise ValueError(_bad_rows(source, field, row, n, local))
            if text:
                yield text


def is_split_file(source: str) -> bool:
    """Whether the source is one text file, which `iter_documents` cuts into documents."""
    if not source.strip() or source in BUILTIN_SOURCES:
        return False
    path = Path(source).expanduser()
    return path.is_file() and _builder(path) == "text"


_BLANK_LINES = re.compile(r"\n(?:[ \t]*\n)+")
_LINE_END, _SPACE = re.compile(r"\n"), re.compile(r"\s")


def split_text(row: dict, doc_chars: int | None = None) -> Iterator[dict]:
    """The documents of one text file, of about doc_chars characters (PROSE_DOC_CHARS, as the prose
    corpus is cut): each ends at the first blank line after doc_chars, or, in a paragraph running
    past 4 x doc_chars, at a line end (else at a space; else there). Kept verbatim, unlike
    `prose_documents`, which joins wrapped lines: code and markdown keep every line and indent."""
    doc_chars = doc_chars or PROSE_DOC_CHARS
    text, start = row["text"], 0
    while start < len(text):
        end = nxt = len(text)
        if len(text) - start > doc_chars:
            lo, hi = start + doc_chars, start + 4 * doc_chars
            cuts = (r.search(text, lo, hi) for r in (_BLANK_LINES, _LINE_END, _SPACE))
            cut = next(filter(None, cuts), None)
            end, nxt = (cut.start(), cut.end()) if cut else (lo, lo)
        if text[start:end].strip():
            yield {"text": text[start:end]}
        start = nxt


def _looks_like_a_path(source: str) -> bool:
    """A hub dataset id is `name` or `owner/name`: anything with a data file suffix, a leading
    . / ~, more than one slash or a backslash is a local path."""
    suffixes = (*TEXT_SUFFIXES, *OTHER_DATA_SUFFIXES)
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or "\\" in source
        or source.lower().endswith(suffixes)
    )


def _check_source_name(source: str) -> None:
    """Refuse a source that names nothing: empty, a path that does not exist (never sent to the
    hub), or a name that cannot be a hub dataset id either."""
    if not source.strip():
        raise ValueError(
            f"data source {source!r} is empty (an unset shell variable?); name a file, a folder, "
            "a hub dataset or stdlib, e.g. --data.source data/train.jsonl."
        )
    if source != source.strip():  # no hub id has spaces; a path with them is missing as given
        raise ValueError(
            f"data source {source!r} has spaces around it, and no file or folder is named so; "
            f"write {source.strip()!r}."
        )
    if source == "prose":
        raise ValueError(
            "data source 'prose' is no source name: train on prose-train (public-domain books); "
            "prose-heldout and prose-book are their held-out text, for evaluation."
        )
    if _looks_like_a_path(source):
        raise FileNotFoundError(
            f"data source {source!r} is a path, and there is no such file or folder "
            f"({_looked_for(source)}); check the path."
        )
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        raise FileNotFoundError(
            f"data source {source!r} is neither a file or folder ({_looked_for(source)}) nor a hub "
            "dataset id like 'HuggingFaceFW/fineweb-edu'; check the path or the id."
        ) from None


def _looked_for(source: str) -> str:
    """Where a missing path was looked for: the absolute path, the folder a relative one was
    resolved from, and the deepest folder on the way that does exist."""
    given = Path(source).expanduser()
    path = Path(os.path.abspath(given))
    parent = next(p for p in path.parents if p.exists())
    base = "" if given.is_absolute() else f", relative to the current folder {os.getcwd()!r}"
    lacks = path.relative_to(parent).parts[0]
    return f"looked for {str(path)!r}{base}; {str(parent)!r} holds no {lacks!r}"


def _check_json_file(path: str, field: str | None = None) -> tuple[int, int, int]:
    """UTF-8, and one JSON object a line (a .json may also be one JSON document), named by line;
    (rows, rows without a string in `field`, rows with text in it). Read line by line: a corpus of
    many GB is checked in the memory of one line."""
    whole_error = None  # why a .json that opens like one JSON document is not one
    if path.lower().endswith(".json") and os.path.getsize(path) < 1 << 30:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
        if head in (b"[", b"{"):
            try:
                with open(path, encoding="utf-8-sig") as f:
                    doc = json.load(f)
            except ValueError as e:  # JSON lines in a .json, or bad bytes: checked line by line
                whole_error = e if isinstance(e, json.JSONDecodeError) else None
            else:  # as datasets reads one: a list of rows, or a single row
                items = doc if isinstance(doc, list) else [doc]
                for i, row in enumerate(items, 1):
                    if not isinstance(row, dict):
                        raise ValueError(
                            f"data file {path!r} item {i} is a JSON {type(row).__name__}, not an "
                            'object; make each row an object ({"text": "..."}), or remove it.'
                        )
                return _field_counts(items, field)
    offset, counts, first = 0, (0, 0, 0), True
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"data file {path!r} is not UTF-8 text "
                    f"(byte 0x{raw[e.start]:02x} at offset {offset + e.start}, "
                    f"line {n}); convert it to UTF-8, or remove it from the data."
                ) from None
            offset += len(raw)
            if n == 1:
                line = line.removeprefix("\ufeff")  # a byte order mark: datasets reads past it too
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # a string cut at the end: "unterminated"
            except json.JSONDecodeError as e:
                if first and whole_error is not None:  # one document (a list, say) broken inside
                    w = whole_error
                    raise ValueError(
                        f"data file {path!r} is not valid JSON ({w.msg.removesuffix(' at')} at "
                        f"line {w.lineno} column {w.colno}); write it again as one JSON list of "
                        "objects, or as one JSON object a line."
                    ) from None
                raise ValueError(
                    f"data file {path!r} line {n} is not valid JSON "
                    f"({e.msg.removesuffix(' at')} at column {e.colno}); write one JSON object a "
                    'line ({"text": "..."}), or remove that line.'
                ) from None
            first = False
            if not isinstance(row, dict):
                raise ValueError(
                    f"data file {path!r} line {n} is a JSON {type(row).__name__}, not an object; "
                    f'write one JSON object a line ({{"text": "..."}}), or remove that line.'
                )
            counts = tuple(a + b for a, b in zip(counts, _field_counts([row], field)))
    return counts


def _field_counts(rows: list, field: str | None) -> tuple[int, int, int]:
    """(rows, rows without a string in field, rows with some text in it); no field: all text."""
    if field is None:
        return len(rows), 0, len(rows)
    values = [row.get(field) for row in rows]
    strings = [v for v in values if isinstance(v, str)]
    return len(rows), len(values) - len(strings), sum(v.strip() != "" for v in strings)


def _bad_rows(
    source: str, field: str, row: dict, n: int, local: tuple[str, list[str]] | None
) -> str:
    """The one-line refusal of a source whose row `n` (1-based) has no string in `field`: how many
    rows are like it (local files are read again to count them), the fields rows do have, the
    fix."""
    keys, strings = (
        dict.fromkeys(row),
        dict.fromkeys(k for k, v in row.items() if isinstance(v, str)),
    )
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
                        where, value = (
                            f"row {i}" + (f" of {f}" if len(files) > 1 else ""),
                            r.get(field),
                        )
                    bad += 1
                    null += r.get(field) is None
        counts = (bad, total, null)
    others = [k for k in strings if k != field]
    hint = "text" if "text" in others else (others[0] if len(others) == 1 else None)
    fix = (
        f"--data.text_field {hint} (TiDARData(text_field={hint!r}) in Python)"
        if hint
        else "--data.text_field NAME (TiDARData(text_field=NAME) in Python)"
    )
    have = ", ".join(keys)
    if counts is not None and counts[0] == counts[1] == counts[2]:  # no row has it: the wrong field
        return (
            f"data source {source!r} has no field {field!r} holding the text in any of its "
            f"{counts[1]} rows (its rows have: {have}); set the one that does: {fix}."
        )
    what = (
        "null or no such field"
        if value is None
        else f"{reprlib.repr(value)} ({type(value).__name__}), not a string"
    )
    share = f"{counts[0]} of its {counts[1]} rows have" if counts is not None else "a row has"
    other = f", or set the field that holds it: {fix}" if hint else ""
    return (
        f"data source {source!r}: {share} no text in field {field!r} "
        f"(the first, {where}, has {what}; its rows have: {have}); "
        f"give each row its text as a string in {field!r} (or remove those rows){other}."
    )


def whole(stream, batch: int = 256) -> Iterator[dict]:
    """Every row of a `datasets` stream, also inside a DataLoader worker. Iterated plainly, a stream
    in a worker yields only that worker's file shards (none at all when it has fewer shards than
    there are workers); PackedDocuments splits the documents between readers itself."""
    for rows in stream.iter(batch_size=batch):
        for i in range(len(next(iter(rows.values()), []))):
            yield {k: v[i] for k, v in rows.items()}


# data files already reported as skipped: once per file, not per epoch or split
_WARNED: set[str] = set()


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
            raise ValueError(
                f"data file {f!r} is {why}; convert it to UTF-8 text, or pass another data source."
            )
        skipped += 1
        if skipped == len(files):
            raise ValueError(
                f"none of the {len(files)} text files of the data source is UTF-8 text "
                f"(the last, {f!r}, is {why}); convert them to UTF-8."
            )
        _skip_warning(f, why)


def _skip_warning(path: str, why: str) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        log.warning(
            "Skipping data file %r: it is %s. Convert it to UTF-8 text, or remove it, to silence "
            "this.",
            path,
            why,
        )


def _rows(builder: str, files: list[str]) -> Iterator[dict]:
    """Rows of json/parquet files; a file that cannot be decoded is refused by name (a bad file
    would otherwise end the stream in a pyarrow error naming no file)."""
    from datasets import load_dataset

    # datasets cannot read an empty one ("generator raised StopIteration"); it holds no row to lose
    if builder == "json":
        empty = [f for f in files if _blank(f)]
        files = [f for f in files if f not in empty]
        if not files:
            what = (
                f"data file {empty[0]!r} is empty"
                if len(empty) == 1
                else f"the {len(empty)} data files ({', '.join(map(repr, empty))}) are all empty"
            )
            raise ValueError(
                f"{what}: there are no rows to read; write one JSON object a line with the text "
                'in it ({"text": "..."}), or pass another data source.'
            )
    try:
        yield from whole(load_dataset(builder, data_files=files, split="train", streaming=True))
    except Exception as e:
        for f in files:
            if builder == "json":
                _check_json_file(f)  # names the file and the line datasets could not read
            why = _parquet_problem(f) if builder == "parquet" else _decode(f)[1]
            if why:
                raise ValueError(
                    f"data file {f!r} is {why}; "
                    f"{'write it again' if builder == 'parquet' else 'convert it to UTF-8'}, "
                    "or remove it from the data."
                ) from e
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
    return (
        None
        if head == tail == b"PAR1"
        else "not a parquet file (no PAR1 marks at its start and end)"
    )


def _check_hub_dataset(source: str) -> None:
    """A name that is no local path is a hub dataset: refuse at once when the hub cannot be
    reached."""
    from tidar_convert.models.loading import HubUnreachableError, hub_unreachable

    why = hub_unreachable()
    if why:
        raise HubUnreachableError(
            f"data source {source!r} is not a local file or folder, so it was taken as a "
            f"Hugging Face hub dataset, but the hub was not reachable ({why}); download the data "
            "where the hub is reachable and pass a local file or folder "
            "(.txt/.md/.py one document per file, .jsonl/.parquet one per row), "
            "e.g. --data.source data/train.jsonl."
        )
