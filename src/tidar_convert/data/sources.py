"""Documents from each kind of source: the stdlib, held-out prose, local files and folders, hub
datasets. `check_sources` checks a list of them before any work: names, paths, file formats and
one pass over the bytes of each local file (UTF-8, JSON lines, the text field), never a tokenizer.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
import reprlib
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from tidar_convert.data.formats import ROW_SUFFIXES, WHOLE, Share, json_document, rows
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
    **ROW_SUFFIXES,
}
# Data formats not read here: a folder's such files are named in a warning (the user may expect
# them read), a single one is refused with how to convert it, a missing one is a path (no hub id).
OTHER_DATA_SUFFIXES = (".gz", ".zst", ".xz", ".bz2", ".zip", ".tar")
# what `datasets.save_to_disk` writes beside its .arrow files: metadata, not rows
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


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
    """{builder: files} of a file, a folder or a glob pattern. In a folder, hidden files and folders
    (.git, .venv, .ipynb_checkpoints) are not data, as `datasets` skips them too, nor is the
    metadata `save_to_disk` writes beside its .arrow files; files of a data format not read here
    are named in a warning, once. A single file of another format is refused."""
    source = str(path) if source is None else source
    if is_glob(source):
        return _globbed(source)
    if not path.is_dir():
        if _builder(path) is None:
            raise ValueError(_unread_file(source, path))
        return {_builder(path): [str(path)]}
    groups: dict[str, list[str]] = {}
    other: Counter = Counter()
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(n.endswith(".arrow") for n in names):
            names = [n for n in names if n not in SAVED_DATASET_FILES]
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
            "Data source %r: skipping its %s, of a format not read here; decompress them, or "
            "remove them, to silence this.",
            source,
            unread,
        )
    return groups


def is_glob(source: str) -> bool:
    """Whether a source is a pattern of files (`data/*.jsonl`, `shards/**/*.parquet`): the files it
    matches are one source, as `data_files` selects files in `datasets`."""
    return any(c in source for c in "*?[") and not Path(source).expanduser().exists()


def _globbed(pattern: str) -> dict[str, list[str]]:
    """{builder: files} matched by a pattern (`**` crosses folders), sorted by path; refused when it
    matches no data file, or a file of a format not read."""
    root = Path(pattern).expanduser()
    anchor = Path(root.anchor) if root.is_absolute() else Path(".")
    relative = str(root.relative_to(anchor)) if root.is_absolute() else str(root)
    matched = sorted(p for p in anchor.glob(relative) if p.is_file())
    if not matched:
        raise FileNotFoundError(
            f"data source {pattern!r} is a pattern of files, and no file matches it (looked in "
            f"{os.path.abspath(anchor)!r}); check the pattern."
        )
    groups: dict[str, list[str]] = {}
    for f in matched:
        if _builder(f) is None:
            raise ValueError(_unread_file(f"{pattern} (matching {f})", f))
        groups.setdefault(_builder(f), []).append(str(f))
    return groups


def _unread_file(source: str, path: Path) -> str:
    kind = _other_format(path) or path.suffix.lower()
    if kind in OTHER_DATA_SUFFIXES:
        fix = "decompress it to .jsonl, .parquet, .csv or .txt"
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
    render: Callable[[list], str] | None = None,
) -> Iterator[str]:
    """Yield the text of each document of one source, in a fixed (seeded) order.

    A folder's text files are one document each; a single text file given as the source is cut
    into documents at blank lines (`split_text`): whole, it would be all training or all validation.
    Rows of json/parquet/csv/arrow/hub sources hold their text in `text_field`; a row without it
    (absent or null) or with a value that is not a string is refused, counted over the whole source
    where it is local: dropping it would train on less than the user gave, and a misspelt field on
    nothing. A field holding chat messages (a list of {"role", "content"}) is rendered by `render`
    (the tokenizer's chat template: `chat_renderer`). One-document-per-file sources have no fields:
    `text_field` does not apply to them.
    """
    yield from SourceReader(source, text_field, name, split, seed, render=render)


class SourceReader:
    """The documents of one source that one reader reads: its `share` (see formats.Share) of every
    file, from a `start` position; `position` is where the documents yielded so far end (None
    before the first), what a resume stores to start again there without reading what came before.

    How a share is cut: a folder of text files (and the stdlib) by file, a range of them; a single
    text file (cut into documents) and `max_docs` by document, a range of them; JSON lines, parquet
    and Arrow files each by its own byte or row range (formats.py); a hub dataset with
    `datasets.distributed.split_dataset_by_node` (by shard where its shards divide evenly between
    the readers, else every reader streams it and keeps one row in each `share.count`). Every
    document of the source is in exactly one reader's share.
    """

    def __init__(
        self,
        source: str,
        text_field: str = "text",
        name: str | None = None,
        split: str = "train",
        seed: int = 0,
        *,
        share: Share = WHOLE,
        start=None,
        render: Callable[[list], str] | None = None,
        max_docs: int | None = None,
        data_files: str | list[str] | None = None,
    ):
        self.source, self.field, self.name, self.split, self.seed = (
            source,
            text_field,
            name,
            split,
            seed,
        )
        self.share, self.start, self.render, self.max_docs = Share(*share), start, render, max_docs
        self.data_files = data_files
        self._position = start

    @property
    def position(self):
        pos = self._position
        return pos() if callable(pos) else pos  # a hub stream's state, taken only when asked for

    def __iter__(self) -> Iterator[str]:
        if self.max_docs is not None:
            yield from self._first(self.max_docs)
            return
        source = self.source
        if not source.strip():
            _check_source_name(source)  # '' is the working directory to Path: never read it as data
        if source in ("prose-train", "prose-heldout", "prose-book"):
            source = str(prose_corpus() / source.split("-")[1])
        if source in ("stdlib", "stdlib-heldout"):
            files = stdlib_files()
            # mix modules instead of reading the stdlib alphabetically
            random.Random(self.seed).shuffle(files)
            keep = None
            if source == "stdlib-heldout":
                keep = lambda text: is_validation(text, STDLIB_HELDOUT_EVERY)  # noqa: E731
            yield from self._local([("files", files)], keep)
        elif is_glob(source) or Path(source).expanduser().exists():
            path = Path(source).expanduser()
            parts = []
            for builder, files in _files_by_builder(path, source).items():
                if builder == "text":
                    parts.append(("split" if path.is_file() else "files", files))
                else:
                    if builder == "json":
                        _refuse_all_empty(files)
                    parts.append((builder, files))
            yield from self._local(parts)
        else:
            _check_source_name(source)
            _check_hub_dataset(source)
            yield from self._hub()

    def _local(self, parts: list[tuple[str, list[str]]], keep=None) -> Iterator[str]:
        """Documents of local files; the position is (part, file, offset in it): for parts of text
        files the offset counts files or documents, for rows it is the reader's (formats.rows)."""
        p0, f0, o0 = self.start or (0, 0, 0)
        for p, (kind, files) in enumerate(parts):
            if p < p0:
                continue
            if kind in ("files", "split"):
                start = o0 if p == p0 else 0
                for i, row in self._text_documents(kind, files, start):
                    self._position = (p, 0, i + 1)
                    if keep is None or keep(row["text"]):
                        yield row["text"]
                continue
            for f in range(f0 if p == p0 else 0, len(files)):
                begin = o0 if (p, f) == (p0, f0) else 0
                for n, (row, offset) in enumerate(
                    _named(kind, files[f], self.share, begin, [self.field]), 1
                ):
                    self._position = (p, f, offset)
                    text = self._text(row, n, (kind, files))
                    if text:
                        yield text

    def _text_documents(
        self, kind: str, files: list[str], start: int
    ) -> Iterator[tuple[int, dict]]:
        """(index, row) of this share of text documents, from index `start`: a range of the files
        (one document each), or of the documents one text file is cut into (the cuts need the whole
        text: every reader reads that file)."""
        if kind == "files":
            lo, hi = self.share.span(len(files))
            begin = max(lo, start)
            yield from _text_rows(files[begin:hi], whole=self.share.count == 1, first=begin)
            return
        docs = [d for _, row in _text_rows(files) for d in split_text(row)]
        lo, hi = self.share.span(len(docs))
        for i in range(max(lo, start), hi):
            yield i, docs[i]

    def _first(self, n: int) -> Iterator[str]:
        """This share of the source's first n documents (read whole: a greedy corpus)."""
        whole = SourceReader(
            self.source,
            self.field,
            self.name,
            self.split,
            self.seed,
            render=self.render,
            data_files=self.data_files,
        )
        docs = list(itertools.islice(whole, n))
        lo, hi = self.share.span(len(docs))
        for i in range(max(lo, self.start or 0), hi):
            self._position = i + 1
            yield docs[i]

    def _hub(self) -> Iterator[str]:
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        # data_files: only where given, so a loader that takes no such argument is never passed one
        files = {} if self.data_files is None else {"data_files": self.data_files}
        ds = load_dataset(self.source, self.name, split=self.split, streaming=True, **files)
        if self.share.count > 1:
            ds = split_dataset_by_node(ds, rank=self.share.index, world_size=self.share.count)
        if self.start is not None:
            ds.load_state_dict(self.start)
        self._position = ds.state_dict
        # one row at a time: the state then stands right after the row yielded, and .iter() does
        # not split the rows again between DataLoader workers as plain iteration would
        for n, batch in enumerate(ds.iter(batch_size=1), 1):
            text = self._text({k: v[0] for k, v in batch.items()}, n, None)
            if text:
                yield text

    def _text(self, row: dict, n: int, local: tuple[str, list[str]] | None) -> str:
        value = row.get(self.field)
        if isinstance(value, str):
            return value
        if is_chat(value):
            if self.render is None:
                raise ValueError(
                    f"data source {self.source!r}: field {self.field!r} holds chat messages, "
                    "which are rendered with a tokenizer's chat template, in training; read it "
                    "through TiDARData (or pass render=chat_renderer(tokenizer))."
                )
            return self.render(value)
        raise ValueError(_bad_rows(self.source, self.field, row, n, local))


def is_chat(value) -> bool:
    """Whether a field holds chat messages: a non-empty list of {"role": str, "content": str}."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
        )
    )


def chat_renderer(tokenizer) -> Callable[[list], str]:
    """A conversation as the text the model reads: the tokenizer's chat template, every turn (the
    text is then tokenized, packed and trained on like any document: docs/convert.md)."""

    def render(messages: list) -> str:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the data holds chat messages and the tokenizer has no chat template to render "
                "them with; use a model whose tokenizer has one (an instruct model's), or give "
                "the conversations as text in a field of their own (--data.text_field)."
            )
        return tokenizer.apply_chat_template(messages, tokenize=False)

    return render


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
    items, whole_error = json_document(path)  # why a .json opening like one document is not one
    if items is not None:
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
    chats = sum(is_chat(v) for v in values)  # rendered by the chat template: text
    strings = [v for v in values if isinstance(v, str)]
    return (
        len(rows),
        len(values) - len(strings) - chats,
        sum(v.strip() != "" for v in strings) + chats,
    )


def _bad_rows(
    source: str, field: str, row: dict, n: int, local: tuple[str, list[str]] | None
) -> str:
    """The one-line refusal of a source whose row `n` (1-based) has no string in `field`: how many
    rows are like it (local files are read again to count them), the fields rows do have, the
    fix."""
    keys, strings = (
        dict.fromkeys(row),
        dict.fromkeys(k for k, v in row.items() if isinstance(v, str) or is_chat(v)),
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
                strings.update(
                    dict.fromkeys(k for k, v in r.items() if isinstance(v, str) or is_chat(v))
                )
                if not isinstance(r.get(field), str) and not is_chat(r.get(field)):
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


def _text_rows(files: list[str], whole: bool = True, first: int = 0) -> Iterator[tuple[int, dict]]:
    """(index, row) of each text file (one document each), indices counted from `first`. A file
    that is not UTF-8 text is skipped with a warning naming it; a single such file, or a source
    with no readable one (`whole`: these are all its files, not a reader's share), is refused."""
    skipped = 0
    for i, f in enumerate(files, first):
        text, why = _decode(f)
        if why is None:
            yield i, {"text": text}
            continue
        if len(files) == 1 and whole:
            raise ValueError(
                f"data file {f!r} is {why}; convert it to UTF-8 text, or pass another data source."
            )
        skipped += 1
        if skipped == len(files) and whole:
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
    """Every row of json/parquet/csv/arrow files, every column (the checks and the refusals count
    and name them); a file that cannot be read is refused by name."""
    if builder == "json":
        _refuse_all_empty(files)
    for f in files:
        for row, _ in _named(builder, f, WHOLE, 0, None):
            yield row


def _refuse_all_empty(files: list[str]) -> None:
    """Refuse JSON files that are all empty: there is no row to read (an empty one among others
    holds no row to lose)."""
    empty = [f for f in files if _blank(f)]
    if len(empty) < len(files):
        return
    what = (
        f"data file {empty[0]!r} is empty"
        if len(empty) == 1
        else f"the {len(empty)} data files ({', '.join(map(repr, empty))}) are all empty"
    )
    raise ValueError(
        f"{what}: there are no rows to read; write one JSON object a line with the text "
        'in it ({"text": "..."}), or pass another data source.'
    )


def _named(
    builder: str, path: str, share: Share, start, columns: list[str] | None
) -> Iterator[tuple[dict, object]]:
    """formats.rows, with a file it cannot read named in one line (pyarrow's and the csv module's
    own errors name no file)."""
    try:
        yield from rows(builder, path, share, start, columns)
    except ValueError as e:
        if str(e).startswith("data file"):
            raise
        raise _unreadable(builder, path, e) from None
    except Exception as e:  # pyarrow's errors, a csv.Error, a file cut short
        raise _unreadable(builder, path, e) from None


def _unreadable(builder: str, path: str, error: Exception) -> ValueError:
    if builder == "json":
        _check_json_file(path)  # names the line that is not JSON
    why = _parquet_problem(path) if builder == "parquet" else _decode(path)[1]
    if builder in ("parquet", "arrow"):
        why = why or f"not a readable {builder} file ({' '.join(str(error).split())})"
    why = why or f"not readable as {builder} ({' '.join(str(error).split())})"
    fix = "write it again" if builder in ("parquet", "arrow") else "convert it to UTF-8"
    if builder in ("csv", "tsv") and _decode(path)[1] is None:
        fix = "fix its quoting"
    return ValueError(f"data file {path!r} is {why}; {fix}, or remove it from the data.")


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
