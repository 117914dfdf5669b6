"""The data checks that run before any model loads (`check_sources`): names, paths, file formats
and one pass over the bytes of each local file (UTF-8, JSON lines, the text field), never a
tokenizer. Reading a source (sources.py) refuses the same things with the same words."""

from __future__ import annotations

import os
from pathlib import Path

from tidar_convert.data.formats import arrow_columns, csv_columns
from tidar_convert.data.sources import (
    BUILTIN_SOURCES,
    _bad_rows,
    _blank,
    _check_hub_dataset,
    _check_json_file,
    _check_source_name,
    _decode,
    _files_by_builder,
    _looked_for,
    _parquet_problem,
    _rows,
    _skip_warning,
    is_chat,
    is_glob,
)


def check_sources(
    sources: list[str],
    text_field: str = "text",
    name: str | None = None,
    split: str = "train",
    hub: bool = True,
    data_files: str | list[str] | None = None,
) -> None:
    """Refuse, before any model loads, data that reading would refuse or misread later, each in one
    line naming the value or the file (and line) and the fix. Cheap checks only, reading bytes and
    never tokenizing: every source names something that exists (a path is never sent to the hub),
    every local file is of a format read here and UTF-8, every JSON line an object with a string
    `text_field`, the source holds some text, and hub-only settings (name, split) have a hub dataset
    to apply to. `hub`: also refuse a hub dataset id when the hub cannot be reached, or has no such
    dataset (a request or two)."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:
        raise ValueError("source=[]: name at least one data source, e.g. 'stdlib'.")
    hub_ids = []
    for source in sources:
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError(
                f"data source {source!r} is not a name or a path; give a string, e.g. "
                "'data/train.jsonl'."
            )
        source = os.fspath(source)
        if source in BUILTIN_SOURCES:
            continue
        path = Path(source).expanduser()
        if source.strip() and is_glob(source):
            _check_local(source, path, text_field)
        elif not source.strip() or not path.exists():
            _check_source_name(source)
            hub_ids.append(source)
        else:
            _check_local(source, path, text_field)
    rows = hub_ids or any(
        b != "text"
        for s in sources
        if os.fspath(s) not in BUILTIN_SOURCES
        and (is_glob(os.fspath(s)) or Path(os.fspath(s)).expanduser().exists())
        for b in _files_by_builder(Path(os.fspath(s)).expanduser(), os.fspath(s))
    )
    if text_field != "text" and not rows:
        raise ValueError(
            f"--data.text_field {text_field}: it names the field of json, parquet, csv, arrow and "
            "hub rows, "
            f"and no data source has rows ({', '.join(map(str, sources))}: "
            "one document per text file); leave it out."
        )
    if not hub_ids and data_files is not None:
        raise ValueError(
            f"--data.data_files {data_files!r}: it selects files of a hub dataset, and no data "
            f"source is one ({', '.join(map(str, sources))}); to select local files, give a "
            "pattern as the source, e.g. --data.source 'data/*.jsonl'."
        )
    if not hub_ids and (name is not None or split != "train"):
        given = " ".join(
            f"--data.{k} {v}"
            for k, v in (("name", name), ("split", split))
            if v not in (None, "train")
        )
        raise ValueError(
            f"{given}: these choose a configuration and split of a hub dataset, "
            "and no data source is one "
            f"({', '.join(map(str, sources))}); leave them out, or choose the file that holds that "
            "split."
        )
    if hub and hub_ids:
        _check_hub_dataset(hub_ids[0])
        for source in hub_ids:
            _check_hub_dataset_exists(source)


def _check_local(source: str, path: Path, field: str) -> None:
    """A local file or folder, refused up front as reading it would refuse it."""
    groups = _files_by_builder(path, source)
    texts, rows, tables = groups.get("text", []), groups.get("json", []), groups.get("parquet", [])
    bad = [(f, why) for f in texts for why in [_decode(f)[1]] if why]
    if len(texts) == 1 and bad:
        raise ValueError(
            f"data file {bad[0][0]!r} is {bad[0][1]}; convert it to UTF-8 text, or pass another "
            "data source."
        )
    if texts and len(bad) == len(texts):
        raise ValueError(
            f"data source {source!r}: none of its {len(texts)} text files is UTF-8 text (the last, "
            f"{bad[-1][0]!r}, is {bad[-1][1]}); convert them to UTF-8."
        )
    for f, why in bad:  # named now, before the model loads; reading skips them without a word more
        _skip_warning(f, why)
    skipped = {f for f, _ in bad}
    has_text = any(not _blank(f) for f in texts if f not in skipped)
    lacking = 0
    for f in rows:
        _, without, with_text = _check_json_file(f, field)
        lacking, has_text = lacking + without, has_text or with_text > 0
    if rows and all(_blank(f) for f in rows):
        next(_rows("json", rows))  # refused as reading refuses them: "... empty: there are no rows"
    if lacking:
        _refuse_rows(source, field, "json", rows)
    for f in tables:
        why = _parquet_problem(f)
        if why:
            raise ValueError(
                f"data file {f!r} is {why}; write it again, or remove it from the data."
            )
    if tables and not all(field in _parquet_columns(f) for f in tables):
        _refuse_rows(source, field, "parquet", tables)
    for builder in ("csv", "tsv", "arrow"):
        _check_columns(source, field, builder, groups.get(builder, []))
    tables = tables or [f for b in ("csv", "tsv", "arrow") for f in groups.get(b, [])]
    if not has_text and not tables:  # (table rows are read only in training)
        if not rows:
            what = "holds only empty text files"
            what = "is empty (nothing but whitespace)" if path.is_file() else what
        else:
            what = f"holds no text: the {field!r} of every row is empty"
            what += "" if path.is_file() else ", and every text file too"
        fix = "write the text in it" if path.is_file() else "put text in its files"
        raise ValueError(
            f"data {'file' if path.is_file() else 'source'} {source!r} {what}; there is nothing to "
            f"train on: {fix}, or pass another data source."
        )


def _refuse_rows(source: str, field: str, builder: str, files: list[str]) -> None:
    """Raise the refusal reading gives for rows without a string in `field` (see _bad_rows)."""
    for n, row in enumerate(_rows(builder, files), 1):
        if not isinstance(row.get(field), str) and not is_chat(row.get(field)):
            raise ValueError(_bad_rows(source, field, row, n, (builder, files)))


def _check_columns(source: str, field: str, builder: str, files: list[str]) -> None:
    """CSV, TSV and Arrow files: readable (UTF-8 for CSV), with a column named `field`."""
    for f in files:
        if builder != "arrow" and _decode(f)[1]:
            raise ValueError(
                f"data file {f!r} is {_decode(f)[1]}; convert it to UTF-8, or remove it from the "
                "data."
            )
        try:
            columns = arrow_columns(f) if builder == "arrow" else csv_columns(f, builder)
        except Exception as e:  # pyarrow's own error names no file
            raise ValueError(
                f"data file {f!r} is not a readable Arrow file ({' '.join(str(e).split())}); "
                "write it again, or remove it from the data."
            ) from None
        if field not in columns:
            _refuse_rows(source, field, builder, [f])
            raise ValueError(  # a file without rows: the header alone says it
                f"data file {f!r} has no column {field!r} (its columns: {', '.join(columns)}); "
                f"set the one that holds the text: --data.text_field NAME."
            )


def _parquet_columns(path: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path).names
    except Exception as e:  # a damaged footer: pyarrow's own error names no file
        raise ValueError(
            f"data file {path!r} is not a readable parquet file ({' '.join(str(e).split())}); "
            "write it again, or remove it from the data."
        ) from None


def _check_hub_dataset_exists(source: str) -> None:
    """A hub that answers and has no dataset of that id (a mistyped path with one slash, or a
    typo) is refused now, not once the model has loaded; a gated one is left to `datasets`."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(source, timeout=10)
    except GatedRepoError:
        return
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"data source {source!r} is not a local file or folder ({_looked_for(source)}), and "
            "the Hugging Face hub has no dataset of that id (or it is private: `hf auth login`); "
            "check the path or the id."
        ) from None
    except Exception:  # any other answer: `datasets` says what it says when it reads
        return
