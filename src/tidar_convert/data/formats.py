"""Rows of each local file format, read by share and from a position.

A reader (one rank x DataLoader worker) reads only its share of a file where the format allows it:
a byte range of a JSON lines file (a line belongs to the range holding its first byte), a range of
the rows of a parquet or Arrow file (only the row groups or record batches that hold them are
read). A CSV (quoted fields may hold line ends, so it cannot be cut by bytes) or a .json holding one
JSON document is parsed whole and the reader keeps its range of rows. Every row yields with the
position after it, from which `rows` starts again without reading what comes before (what a resume
stores; see stream.py).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from typing import NamedTuple

# builder of each suffix read as rows; text files (one document each) are sources.py's
ROW_SUFFIXES = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "tsv",
    ".arrow": "arrow",
}


class Share(NamedTuple):
    """Reader `index` of `count`: the part of the data one rank x worker reads."""

    index: int = 0
    count: int = 1

    def span(self, total: int) -> tuple[int, int]:
        """[start, end) of `total` units (bytes or rows) that are this reader's: contiguous ranges,
        of sizes within one of each other, that cover 0..total once."""
        return total * self.index // self.count, total * (self.index + 1) // self.count


WHOLE = Share()


def rows(
    builder: str,
    path: str,
    share: Share = WHOLE,
    start: int = 0,
    columns: list[str] | None = None,
) -> Iterator[tuple[dict, int]]:
    """(row, position after it) of this share of one file, from position `start` (0: its first
    row). `columns`: read only these where the format stores columns apart (parquet, Arrow); None
    reads every column."""
    if builder == "json":
        whole, _ = json_document(path)
        if whole is None:
            yield from _json_lines(path, share, start)
            return
        yield from _ranged(whole, share, start)
    elif builder == "parquet":
        yield from _parquet(path, share, start, columns)
    elif builder == "arrow":
        yield from _arrow(path, share, start, columns)
    elif builder in ("csv", "tsv"):
        yield from _ranged(_csv_rows(path, "\t" if builder == "tsv" else ","), share, start)
    else:
        raise ValueError(f"no reader of rows for {builder!r} ({path})")


def _ranged(all_rows, share: Share, start: int) -> Iterator[tuple[dict, int]]:
    """This share's range of rows of a format read whole; the position is the row index."""
    all_rows = list(all_rows)
    lo, hi = share.span(len(all_rows))
    for i in range(max(lo, start), hi):
        yield all_rows[i], i + 1


def json_document(path: str) -> tuple[list[dict] | None, json.JSONDecodeError | None]:
    """The rows of a .json holding one JSON document (a list of rows, or one row), as datasets reads
    one; (None, why) for JSON lines, or a document broken inside (why: the decoder's error where
    the file opens like one document, for a check to name if its lines do not parse either)."""
    if not path.lower().endswith(".json") or os.path.getsize(path) >= 1 << 30:
        return None, None
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if head not in (b"[", b"{"):
        return None, None
    try:
        with open(path, encoding="utf-8-sig") as f:
            doc = json.load(f)
    except ValueError as e:  # JSON lines in a .json, or bad bytes: read (and checked) by line
        return None, e if isinstance(e, json.JSONDecodeError) else None
    items = doc if isinstance(doc, list) else [doc]
    for i, row in enumerate(items, 1):
        if not isinstance(row, dict):
            raise ValueError(
                f"data file {path!r} item {i} is a JSON {type(row).__name__}, not an object; make "
                'each row an object ({"text": "..."}), or remove it.'
            )
    return items, None


def _json_lines(path: str, share: Share, start: int) -> Iterator[tuple[dict, int]]:
    """The lines that start in this share's byte range; the position is the byte offset of the next
    line."""
    lo, hi = share.span(os.path.getsize(path))
    with open(path, "rb") as f:
        if start > lo:
            f.seek(start)
        elif lo > 0:
            f.seek(lo - 1)
            f.readline()  # the line holding byte lo - 1 is the previous share's
        offset = f.tell()
        while offset < hi:
            raw = f.readline()
            if not raw:
                return
            line_at, offset = offset, offset + len(raw)
            if line_at == 0:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte order mark, as datasets skips it
            if not raw.strip():
                continue
            # (sources.py names the file and the line of a bad one, reading it from the start)
            try:
                row = json.loads(raw)
            except ValueError as e:  # UnicodeDecodeError included
                raise ValueError(f"the line at byte {line_at} is not JSON in UTF-8: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"the line at byte {line_at} is not a JSON object")
            yield row, offset


def _csv_rows(path: str, delimiter: str) -> Iterator[dict]:
    """Rows of a CSV or TSV with a header line; every value is a string (an empty cell is "")."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        for row in reader:
            row.pop(None, None)  # cells past the header's columns
            yield {k: ("" if v is None else v) for k, v in row.items()}


def _parquet(
    path: str, share: Share, start: int, columns: list[str] | None
) -> Iterator[tuple[dict, int]]:
    """This share's rows, reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = _present(columns, pf.schema_arrow.names)
    lo, hi = share.span(pf.metadata.num_rows)
    lo, first = max(lo, start), 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if first + n > lo and first < hi:
            table = pf.read_row_group(g, columns=columns)
            for i, row in enumerate(table.to_pylist()):
                if lo <= first + i < hi:
                    yield row, first + i + 1
        first += n


def _arrow(
    path: str, share: Share, start: int, columns: list[str] | None
) -> Iterator[tuple[dict, int]]:
    """This share's rows of an Arrow IPC file (the stream format `datasets` saves, or the file
    format), memory-mapped: the record batches before the range are passed over, not decoded."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        batches = pa.ipc.open_file(source)
        total = batches.num_record_batches
        schema, get = batches.schema, batches.get_batch
        counts = [get(i).num_rows for i in range(total)]
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        schema, held = reader.schema, list(reader)  # zero-copy views of the mapped file
        counts, get = [b.num_rows for b in held], held.__getitem__
    columns = _present(columns, schema.names)
    lo, hi = share.span(sum(counts))
    lo, first = max(lo, start), 0
    for i, n in enumerate(counts):
        if first + n > lo and first < hi:
            batch = get(i)
            batch = batch.select(columns) if columns is not None else batch
            for j, row in enumerate(batch.to_pylist()):
                if lo <= first + j < hi:
                    yield row, first + j + 1
        first += n


def _present(columns: list[str] | None, names: list[str]) -> list[str] | None:
    """The columns to read: all of them where one asked for is missing (the refusal lists the
    fields the rows do have)."""
    return columns if columns is not None and all(c in names for c in columns) else None


def arrow_columns(path: str) -> list[str]:
    """The column names of an Arrow IPC file, file or stream format."""
    import pyarrow as pa

    with pa.memory_map(path) as source:
        try:
            return pa.ipc.open_file(source).schema.names
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).schema.names


def csv_columns(path: str, builder: str) -> list[str]:
    """The header of a CSV or TSV file."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        return next(csv.reader(f, delimiter="\t" if builder == "tsv" else ","), [])
