"""Issue 46's data rows: every data source checked before the model loads, named by file (and line),
and a single large text file trained on instead of refused.

`check_sources` is what fit calls before any model is read (fit_checks.check_data); each case is
also checked through the CLI, where the refusal is one `error:` line and exit status 2, and through
`iter_documents`, the reading path of eval-ppl and distill.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from test_bad_inputs import fit_args
from test_errors import cli_error

from tidar_convert.cli import main
from tidar_convert.data import PROSE_DOC_CHARS, PackedDocuments, is_validation, iter_documents
from tidar_convert.data.checks import check_sources

# suffixes read as data, as messages say
READ = ".arrow, .csv, .json, .jsonl, .md, .parquet, .py, .rst, .tsv, .txt"


@pytest.fixture
def no_hub(monkeypatch):
    def asked(*a, **k):
        raise AssertionError("a local path was looked up on the hub")

    monkeypatch.setattr("tidar_convert.models.loading.hub_unreachable", asked)


def rows(n: int) -> list[str]:
    return [json.dumps({"text": f"def f_{i}(x):\n    return x + {i}\n" * 4}) for i in range(n)]


def fit_error(capsys, tmp_path, model, *extra) -> str:
    """The one-line refusal of a fit with these flags; the run folder must not have been made."""
    line = cli_error(capsys, *fit_args(tmp_path / "run", model, *extra))
    assert not (tmp_path / "run").exists()
    return line


def refusal(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# 1. An empty source (an unset shell variable) read the working directory.
# ---------------------------------------------------------------------------------------------


@pytest.mark.fit
@pytest.mark.parametrize("source", ["", "  ", ["stdlib", ""], ["stdlib", " \t"]])
def test_an_empty_source_is_refused_not_read_as_the_working_directory(
    tmp_path, tiny_dirs, capsys, monkeypatch, no_model_load, source
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not training data")
    value = source if isinstance(source, str) else source[1]
    message = (
        f"data source {value!r} is empty (an unset shell variable?); name a file, a folder, a hub "
        "dataset or stdlib, e.g. --data.source data/train.jsonl."
    )
    sources = [source] if isinstance(source, str) else source
    assert refusal(ValueError, check_sources, sources) == message
    assert refusal(ValueError, next, iter_documents(value)) == message
    flag = source if isinstance(source, str) else json.dumps(source)
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", flag)
    assert line == f"error: {message}"


def test_a_source_with_spaces_around_it_is_refused_with_the_name_it_means(no_hub):
    assert refusal(ValueError, check_sources, ["stdlib", " stdlib"]) == (
        "data source ' stdlib' has spaces around it, and no file or folder is named so; "
        "write 'stdlib'."
    )


# ---------------------------------------------------------------------------------------------
# 2. A local path that does not exist was looked up on the hub.
# ---------------------------------------------------------------------------------------------

MISSING = [
    "./nope.jsonl",
    "data/train.jsonl",
    "corpus.txt",
    "NOTES.MD",
    "table.csv",
    "rows.jsonl.gz",
    "/no/such/folder",
    "a/b/c",
    "~/nope",
    "../up/there",
]


@pytest.mark.fit
@pytest.mark.parametrize("source", MISSING)
def test_a_missing_path_is_refused_by_name_and_never_sent_to_the_hub(
    tmp_path, tiny_dirs, capsys, monkeypatch, no_hub, no_model_load, source
):
    monkeypatch.chdir(tmp_path)
    given = Path(source).expanduser()
    looked = os.path.abspath(given)
    where = "" if given.is_absolute() else f", relative to the current folder {str(tmp_path)!r}"
    parent = next(p for p in Path(looked).parents if p.exists())
    lacks = Path(looked).relative_to(parent).parts[0]
    message = (
        f"data source {source!r} is a path, and there is no such file or folder (looked for "
        f"{looked!r}{where}; {str(parent)!r} holds no {lacks!r}); check the path."
    )
    assert refusal(FileNotFoundError, check_sources, ["stdlib", source]) == message
    assert refusal(FileNotFoundError, next, iter_documents(source)) == message
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", source)
    assert line == f"error: {message}"


def test_a_name_that_is_neither_a_path_nor_a_hub_id_is_refused_without_the_hub(
    tmp_path, monkeypatch, no_hub
):
    monkeypatch.chdir(tmp_path)
    assert refusal(FileNotFoundError, check_sources, ["my data"]) == (
        f"data source 'my data' is neither a file or folder (looked for '{tmp_path}/my data', "
        f"relative to the current folder '{tmp_path}'; '{tmp_path}' holds no 'my data') nor a hub "
        "dataset id like 'HuggingFaceFW/fineweb-edu'; check the path or the id."
    )


def test_an_owner_name_id_the_hub_does_not_have_is_refused_before_any_work(tmp_path, monkeypatch):
    """One slash and no suffix may be a hub id: the hub is asked, once, before anything loads."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    asked = []

    def dataset_info(self, repo_id, **kw):
        asked.append(repo_id)
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(error, "404")
        raise error

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tidar_convert.models.loading.hub_unreachable", lambda *a, **k: None)
    monkeypatch.setattr(HfApi, "dataset_info", dataset_info)
    message = refusal(FileNotFoundError, check_sources, ["data/train"])
    assert asked == ["data/train"]
    assert message == (
        f"data source 'data/train' is not a local file or folder (looked for "
        f"'{tmp_path}/data/train', relative to the current folder '{tmp_path}'; '{tmp_path}' holds "
        "no 'data'), and the "
        "Hugging Face hub has no dataset of that id (or it is private: `hf auth login`); check the "
        "path or the id."
    )


@pytest.mark.fit
def test_a_hub_dataset_with_no_hub_is_refused_before_the_model_loads(
    tmp_path, tiny_dirs, capsys, monkeypatch, no_model_load
):
    why = "http://127.0.0.1:9: refused"
    monkeypatch.setattr("tidar_convert.models.loading.hub_unreachable", lambda *a, **k: why)
    hub_id = "tidar-test/no-such-data"
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", hub_id)
    assert line.startswith(
        f"error: data source {hub_id!r} is not a local file or folder, so it was taken as a "
        f"Hugging Face hub dataset, but the hub was not reachable ({why})"
    )


# ---------------------------------------------------------------------------------------------
# 3 and 4. A bad byte or a bad JSON line late in a .jsonl/.json: found only while streaming, and
# named "row 31" (0-based) of no file.
# ---------------------------------------------------------------------------------------------


@pytest.mark.fit
@pytest.mark.parametrize("where", ["file", "folder", "json-file"])
@pytest.mark.parametrize("bad", ["byte", "json"])
def test_a_bad_byte_or_json_line_late_in_a_jsonl_is_refused_up_front_by_file_and_line(
    tmp_path, tiny_dirs, capsys, no_model_load, where, bad
):
    folder = tmp_path / "data"
    folder.mkdir()
    good = rows(3000)  # many blocks of `datasets`: streaming yielded rows before the bad one
    path = folder / ("bad.json" if where == "json-file" else "bad.jsonl")
    if bad == "byte":
        head = ("\n".join(good[:2500]) + "\n").encode()
        path.write_bytes(head + b'{"text": "caf\xe9"}\n' + "\n".join(good[2500:]).encode())
        message = (
            f"data file '{path}' is not UTF-8 text (byte 0xe9 at offset {len(head) + 13}, "
            "line 2501); convert it to UTF-8, or remove it from the data."
        )
    else:
        path.write_text("\n".join(good[:31] + ['{"text": "unterminated'] + good[31:]) + "\n")
        message = (
            f"data file '{path}' line 32 is not valid JSON (Unterminated string starting at "
            'column 10); write one JSON object a line ({"text": "..."}), or remove that line.'
        )
    if where == "folder":
        (folder / "good.jsonl").write_text("\n".join(good) + "\n")
    source = str(folder if where == "folder" else path)
    assert refusal(ValueError, check_sources, [source]) == message
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", source)
    assert line == f"error: {message}"
    # the reading path (eval-ppl, distill) names it the same way
    assert refusal(ValueError, list, iter_documents(source)) == message


@pytest.mark.parametrize("line,kind", [("[1, 2]", "list"), ('"text"', "str"), ("3", "int")])
def test_a_json_line_that_is_not_an_object_is_named(tmp_path, line, kind):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows(3) + [line]) + "\n")
    assert refusal(ValueError, check_sources, [str(path)]) == (
        f"data file '{path}' line 4 is a JSON {kind}, not an object; write one JSON object a line "
        '({"text": "..."}), or remove that line.'
    )


def test_a_json_list_broken_inside_is_named_by_line_and_column(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b",,}\n]\n')
    assert refusal(ValueError, check_sources, [str(path)]) == (
        f"data file '{path}' is not valid JSON (Expecting property name enclosed in double quotes "
        "at line 3 column 16); write it again as one JSON list of objects, or as one JSON object a "
        "line."
    )


@pytest.mark.parametrize(
    "name,body",
    [
        ("bom.jsonl", '\ufeff{"text": "a"}\n{"text": "b"}\n'),
        ("crlf.jsonl", '{"text": "a"}\r\n\r\n{"text": "b"}\r\n'),
        ("array.json", '[{"text": "a"}, {"text": "b"}]'),
        ("lines.json", '{"text": "a"}\n{"text": "b"}\n'),
    ],
)
def test_json_that_datasets_reads_is_not_refused(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(body)
    check_sources([str(path)])
    assert list(iter_documents(str(path))) == ["a", "b"]


@pytest.mark.fit
def test_rows_without_the_text_field_are_refused_before_the_model_loads(
    tmp_path, tiny_dirs, capsys, no_model_load
):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "body": f"text {i}"}) for i in range(12)) + "\n")
    message = (
        f"data source '{path}' has no field 'text' holding the text in any of its 12 rows (its "
        "rows have: id, body); set the one that does: --data.text_field body "
        "(TiDARData(text_field='body') in Python)."
    )
    assert refusal(ValueError, check_sources, [str(path)]) == message
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", str(path))
    assert line == f"error: {message}"


def test_a_parquet_without_the_text_column_is_refused_up_front(tmp_path):
    import datasets

    path = tmp_path / "t.parquet"
    datasets.Dataset.from_dict({"body": ["p0", "p1"]}).to_parquet(str(path))
    assert refusal(ValueError, check_sources, [str(path)]) == (
        f"data source '{path}' has no field 'text' holding the text in any of its 2 rows (its rows "
        "have: body); set the one that does: --data.text_field body "
        "(TiDARData(text_field='body') in Python)."
    )
    check_sources([str(path)], text_field="body")


@pytest.mark.fit
def test_a_folder_of_text_files_none_of_them_utf8_is_refused_before_the_model_loads(
    tmp_path, tiny_dirs, capsys, no_model_load
):
    folder = tmp_path / "latin1"
    folder.mkdir()
    for i in range(2):
        (folder / f"{i}.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", str(folder)) == (
        f"error: data source '{folder}': none of its 2 text files is UTF-8 text (the last, "
        f"'{folder}/1.txt', is not UTF-8 text (byte 0xe9 at offset 3)); convert them to UTF-8."
    )


@pytest.mark.parametrize(
    "name,body,what",
    [
        ("blank.txt", " \n\n ", "is empty (nothing but whitespace)"),
        ("rows.jsonl", '{"text": ""}\n', "holds no text: the 'text' of every row is empty"),
    ],
)
def test_a_source_with_no_text_at_all_is_refused_up_front(tmp_path, name, body, what):
    path = tmp_path / name
    path.write_text(body)
    assert refusal(ValueError, check_sources, [str(path)]) == (
        f"data file '{path}' {what}; there is nothing to train on: write the text in it, or pass "
        "another data source."
    )


# ---------------------------------------------------------------------------------------------
# 5. A single 22 MB .txt was one document: it went to validation whole, and fit said "fewer than
# seq_len tokens" after a minute of tokenizing.
# ---------------------------------------------------------------------------------------------


def book_text(paragraphs: int) -> str:
    return (
        "\n\n".join(
            f"Paragraph {i}: the river ran past mill number {i} and on to the sea.\n"
            "    An indented line stays."
            for i in range(paragraphs)
        )
        + "\n"
    )


@pytest.mark.fit
def test_a_single_large_text_file_is_cut_into_documents_and_trains(tmp_path, tiny_dirs, capsys):
    book = tmp_path / "book.txt"
    text = book_text(12000)  # 1.1 MB
    book.write_text(text)
    check_sources([str(book)])
    docs = list(iter_documents(str(book)))
    assert len(docs) > 100
    assert all(PROSE_DOC_CHARS <= len(d) < PROSE_DOC_CHARS + 200 for d in docs[:-1])
    assert "\n\n".join(docs) == text  # cut at blank lines, verbatim: nothing lost or re-indented
    val = [d for d in docs if is_validation(d, 20)]  # tiny.yaml's val_every
    assert 0 < len(val) < len(docs) // 5
    main(
        fit_args(
            tmp_path / "run",
            tiny_dirs["llama"],
            "--data.source",
            str(book),
            "--trainer.max_steps",
            "4",
        )
    )
    assert "trained 4 steps" in capsys.readouterr().err


def test_a_text_file_without_blank_lines_is_cut_at_line_ends(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text("".join(f"line {i} of a file with no paragraphs at all\n" for i in range(5000)))
    docs = list(iter_documents(str(path)))
    assert len(docs) > 20
    assert all(d.startswith("line ") and d.rstrip().endswith("at all") for d in docs)
    assert "\n".join(docs) == path.read_text()


def test_files_in_a_folder_stay_one_document_each(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text(book_text(2000))
    (folder / "b.md").write_text("short")
    assert list(iter_documents(str(folder))) == [book_text(2000), "short"]


def test_a_saved_position_of_a_single_text_file_is_not_resumed_on_another_cut(tokenizer, tmp_path):
    """The cut changes the documents, so a position saved before it would count other chunks."""
    book, folder = tmp_path / "book.txt", tmp_path / "docs"
    book.write_text(book_text(10))
    folder.mkdir()
    kw = dict(
        seq_len=8, part="train", val_every=20, text_field="text", name=None, split="train", seed=0
    )
    key = PackedDocuments(tokenizer, [str(folder), str(book)], **kw).stream_key()
    assert key[-1] == {"text files cut into documents": [1], "of": PROSE_DOC_CHARS}
    assert len(PackedDocuments(tokenizer, [str(folder)], **kw).stream_key()) == 12  # no cut


@pytest.mark.fit
def test_too_little_data_says_where_the_documents_went_and_what_to_do(tmp_path, tiny_dirs, capsys):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "too short"}) + "\n")
    assert not is_validation("too short", 20)  # its one document goes to training, none to val
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", str(short))
    assert line == (
        f"error: the validation data ({short}) holds fewer than seq_len=64 tokens: of its 1 "
        "document, 1 (9 characters) went to training and 0 (0 characters) to validation, which "
        "takes about one document in val_every=20, by a hash of its text; the validation documents "
        "make 0 tokens. A file in a folder is one document, a single text file is cut into "
        "documents at blank lines. Add documents, lower --data.val_every to hold out more of them, "
        "or lower --data.seq_len; or train without validation: --trainer.limit_val_batches 0."
    )


def test_too_little_training_data_counts_the_validation_documents(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    texts = [f"row {i}" for i in range(40)]
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    held = [t for t in texts if is_validation(t, 4)]
    trained = [t for t in texts if t not in held]
    kw = dict(seq_len=4096, val_every=4, text_field="text", name=None, split="train", seed=0)
    message = refusal(ValueError, list, PackedDocuments(tokenizer, [str(path)], part="train", **kw))
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in trained)
    assert message.startswith(
        f"the training data ({path}) holds fewer than seq_len=4096 tokens: of its 40 documents, "
        f"{len(trained)} ({sum(map(len, trained))} characters) went to training and {len(held)} "
        f"({sum(map(len, held))} characters) to validation, which takes about one document in "
        f"val_every=4, by a hash of its text; the training documents make {tokens} tokens."
    )
    assert message.endswith(" Add documents, or lower --data.seq_len.")


# ---------------------------------------------------------------------------------------------
# 6. More of the same kinds: formats silently skipped, or refused in words that do not say why.
# ---------------------------------------------------------------------------------------------


@pytest.mark.fit
@pytest.mark.parametrize(
    "name,what,fix",
    [
        (
            "rows.jsonl.gz",
            "ends in .gz",
            "decompress it to .jsonl, .parquet, .csv or .txt",
        ),
        ("README", "has no suffix", "if it is plain text, give it the suffix .txt"),
    ],
)
def test_a_single_file_of_a_format_not_read_is_refused_with_how_to_convert_it(
    tmp_path, tiny_dirs, capsys, no_model_load, name, what, fix
):
    path = tmp_path / name
    path.write_text("a,b\n1,2\n")
    message = (
        f"data file '{path}' {what}, a format not read as data (read: {READ}); {fix}, or pass "
        "another data source."
    )
    assert refusal(ValueError, check_sources, [str(path)]) == message
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], "--data.source", str(path))
    assert line == f"error: {message}"


def test_a_folder_skips_hidden_folders_reads_upper_case_suffixes_and_names_other_formats(
    tmp_path, caplog
):
    folder = tmp_path / "project"
    (folder / ".venv" / "lib").mkdir(parents=True)
    (folder / ".venv" / "lib" / "site.py").write_text("installed package, not data")
    (folder / ".notes.txt").write_text("hidden")
    (folder / "NOTES.TXT").write_text("upper-case suffix")
    (folder / "a.py").write_text("x = 1")
    (folder / "t1.csv.zst").write_text("a,b")
    (folder / "t2.csv.zst").write_text("a,b")
    with caplog.at_level(logging.WARNING):
        check_sources([str(folder)])
        assert list(iter_documents(str(folder))) == ["upper-case suffix", "x = 1"]
    warned = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert warned == [  # once, though the folder was read twice
        f"Data source '{folder}': skipping its 2 .zst files, of a format not read here; "
        "decompress them, or remove them, to silence this."
    ]


def test_a_folder_with_data_of_another_format_only_says_so(tmp_path):
    (tmp_path / "t.csv.gz").write_text("a,b")
    assert refusal(ValueError, check_sources, [str(tmp_path)]) == (
        f"data source '{tmp_path}' holds no file ending in {READ} (it holds 1 .gz file, of a "
        "format not read here); put the data in such files (.jsonl: one JSON object a line, the "
        "text in a field), or pass another data source."
    )


def test_prose_is_refused_as_a_training_source_name(no_hub):
    assert refusal(ValueError, check_sources, ["prose"]) == (
        "data source 'prose' is no source name: train on prose-train (public-domain books); "
        "prose-heldout and prose-book are their held-out text, for evaluation."
    )


@pytest.mark.fit
@pytest.mark.parametrize(
    "flags,given",
    [
        (["--data.split", "validation"], "--data.split validation"),
        (["--data.name", "en"], "--data.name en"),
    ],
)
def test_hub_only_settings_without_a_hub_dataset_are_refused(
    tmp_path, tiny_dirs, capsys, no_model_load, flags, given
):
    line = fit_error(capsys, tmp_path, tiny_dirs["llama"], *flags)
    assert line == (
        f"error: {given}: these choose a configuration and split of a hub dataset, and no data "
        "source is one (stdlib); leave them out, or choose the file that holds that split."
    )


def test_eval_ppl_checks_its_data_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the bad data was refused")

    monkeypatch.setattr("tidar_convert.bench.perplexity.model_perplexity", loaded)
    line = cli_error(
        capsys, "eval-ppl", "--model", "default", "--data", str(tmp_path / "nope.jsonl")
    )
    assert "is a path, and there is no such file or folder" in line


def test_a_text_field_without_any_source_of_rows_is_refused(
    tmp_path, tiny_dirs, capsys, no_model_load
):
    line = cli_error(
        capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], "--data.text_field", "body")
    )
    assert line.startswith(
        "error: --data.text_field body: it names the field of json, parquet, csv, arrow and hub "
        "rows"
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "def f():\n    return 1\n" * 30}) + "\n")
    check_sources(["stdlib", str(rows)], text_field="body")  # a mix with rows: it applies
