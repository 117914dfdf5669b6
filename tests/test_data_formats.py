"""Issue 48: CSV, TSV, Arrow and globbed files as data, and the shares of a file readers read."""

import json

import pytest

from tidar_convert.data import check_sources, iter_documents
from tidar_convert.data.formats import Share
from tidar_convert.data.sources import SourceReader

TEXTS = [f"document {i} " + "word " * (i % 7) for i in range(40)]


def write_all_formats(folder):
    """The same 40 documents as .jsonl, .json, .parquet, .csv, .tsv, an Arrow file (file format),
    and a folder `datasets.save_to_disk` wrote (Arrow stream format beside its metadata .json)."""
    import datasets
    import pyarrow as pa

    ds = datasets.Dataset.from_dict({"id": list(range(len(TEXTS))), "text": TEXTS})
    folder.mkdir(exist_ok=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (folder / "rows.json").write_text(json.dumps([{"text": t} for t in TEXTS]))
    ds.to_parquet(str(folder / "rows.parquet"), batch_size=7)  # several row groups
    ds.to_csv(str(folder / "rows.csv"), index=False)
    ds.to_csv(str(folder / "rows.tsv"), index=False, sep="\t")
    table = pa.table({"text": TEXTS})
    with pa.ipc.new_file(str(folder / "rows.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=9):
            w.write_batch(batch)
    ds.save_to_disk(str(folder / "saved"))
    return [
        "rows.jsonl",
        "rows.json",
        "rows.parquet",
        "rows.csv",
        "rows.tsv",
        "rows.arrow",
        "saved",
    ]


@pytest.fixture(scope="module")
def formats_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("formats")
    return folder, write_all_formats(folder)


def test_every_format_reads_the_same_documents_in_order(formats_dir):
    folder, names = formats_dir
    for name in names:
        check_sources([str(folder / name)])
        assert list(iter_documents(str(folder / name))) == TEXTS, name


def test_a_csv_keeps_quoted_line_ends_and_a_tsv_its_tabs(tmp_path):
    (tmp_path / "q.csv").write_text('id,text\n1,"two\nlines, and a comma"\n2,plain\n')
    (tmp_path / "q.tsv").write_text("id\ttext\tnote\n1\ta, b\tx\n")
    assert list(iter_documents(str(tmp_path / "q.csv"))) == ["two\nlines, and a comma", "plain"]
    assert list(iter_documents(str(tmp_path / "q.tsv"))) == ["a, b"]
    assert list(iter_documents(str(tmp_path / "q.tsv"), text_field="note")) == ["x"]


def test_a_table_without_the_text_column_is_refused_up_front_with_the_fix(formats_dir):
    folder, _ = formats_dir
    for name in ("rows.csv", "rows.arrow", "rows.tsv"):
        with pytest.raises(ValueError, match=r"no field 'body'.*--data.text_field text"):
            check_sources([str(folder / name)], text_field="body")


def test_a_glob_selects_files_as_one_source(tmp_path):
    (tmp_path / "shards").mkdir()
    for i in range(3):
        (tmp_path / "shards" / f"part-{i}.jsonl").write_text(json.dumps({"text": f"s{i}"}) + "\n")
    (tmp_path / "shards" / "notes.txt").write_text("not selected")
    pattern = str(tmp_path / "shards" / "part-*.jsonl")
    check_sources([pattern])
    assert list(iter_documents(pattern)) == ["s0", "s1", "s2"]
    assert list(iter_documents(str(tmp_path / "**" / "*.txt"))) == ["not selected"]
    with pytest.raises(FileNotFoundError, match="no file matches it"):
        check_sources([str(tmp_path / "shards" / "*.parquet")])


def test_shares_cover_every_row_once_in_every_format(formats_dir):
    folder, names = formats_dir
    for name in names:
        for readers in (1, 3, 4, 7):
            parts = [
                list(SourceReader(str(folder / name), share=Share(r, readers)))
                for r in range(readers)
            ]
            assert [d for p in parts for d in p] == TEXTS, (name, readers)
            assert max(map(len, parts)) - min(map(len, parts)) <= 40 // readers, (name, parts)
