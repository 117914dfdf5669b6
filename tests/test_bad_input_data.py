"""Issue 46's data rows: every data source checked before the model loads, named by file (and line),
and a single large text file trained on instead of refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tidar_convert.cli import main
from tidar_convert.data import iter_documents
from tidar_convert.data.sources import check_sources

from test_bad_inputs import fit_args, no_model_load  # noqa: F401 (a fixture)
from test_errors import cli_error


@pytest.fixture
def no_hub(monkeypatch):
    def asked(*a, **k):
        raise AssertionError("a local path was looked up on the hub")

    monkeypatch.setattr("tidar_convert.loading.hub_unreachable", asked)


@pytest.mark.parametrize("source", ["", "  ", ["stdlib", ""]])
def test_an_empty_source_is_refused_not_read_as_the_working_directory(tmp_path, tiny_dirs, capsys, monkeypatch, no_model_load, source):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not training data")
    message = "is empty (an unset shell variable?)"
    with pytest.raises(ValueError, match=r"data source '\s*' is empty"):
        check_sources([source] if isinstance(source, str) else source)
    if isinstance(source, str):
        with pytest.raises(ValueError, match=re.escape(message)):
            next(iter_documents(source))
    flag = source if isinstance(source, str) else json.dumps(source)
    assert message in cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], "--data.source", flag))


@pytest.mark.parametrize("source", ["./nope.jsonl", "data/train.jsonl", "corpus.txt", "/no/such/folder", "a/b/c", "~/nope"])
def test_a_missing_path_is_refused_by_name_and_never_sent_to_the_hub(tmp_path, tiny_dirs, capsys, no_hub, no_model_load, source):
    expected = f"data source {source!r} is a path, and there is no such file or folder"
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        check_sources([source])
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        next(iter_documents(source))
    assert expected in cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], "--data.source", source))


def rows(n: int) -> list[str]:
    return [json.dumps({"text": f"def f_{i}(x):\n    return x + {i}\n" * 4}) for i in range(n)]


@pytest.mark.fit
@pytest.mark.parametrize("where", ["file", "folder"])
@pytest.mark.parametrize("bad", ["byte", "json"])
def test_a_bad_byte_or_json_line_late_in_a_jsonl_is_refused_up_front_by_file_and_line(tmp_path, tiny_dirs, capsys, no_model_load, where, bad):
    folder = tmp_path / "data"
    folder.mkdir()
    good = rows(40)
    path = folder / "bad.jsonl"
    if bad == "byte":
        path.write_bytes(("\n".join(good[:35]) + "\n").encode() + b'{"text": "caf\xe9"}\n')
        message = "is not UTF-8 text (byte 0xe9 at offset"
    else:
        path.write_text("\n".join(good[:31] + ['{"text": "unterminated'] + good[31:]) + "\n")
        message = "line 32 is not valid JSON"
    if where == "folder":
        (folder / "good.jsonl").write_text("\n".join(good) + "\n")
    source = path if where == "file" else folder
    line = cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], "--data.source", str(source)))
    assert f"data file '{path}'" in line and message in line, line
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        list(iter_documents(str(source)))  # the streaming path names it too (eval-ppl, distill...)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("line,kind", [("[1, 2]", "list"), ('"text"', "str"), ("3", "int")])
def test_a_json_line_that_is_not_an_object_is_named(tmp_path, line, kind):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows(3) + [line]) + "\n")
    with pytest.raises(ValueError, match=rf"line 4 is a JSON {kind}, not an object"):
        check_sources([str(path)])


@pytest.mark.fit
def test_a_single_large_text_file_is_cut_into_documents_and_trains(tmp_path, tiny_dirs, capsys):
    """One 22 MB .txt was one document: it went to validation whole, and fit said 'fewer than seq_len
    tokens' after a minute of tokenizing. Cut at blank lines, it trains and validates."""
    book = tmp_path / "book.txt"
    paragraphs = [f"Paragraph {i}: the river ran past mill number {i} and on to the sea.\n  An indented line stays." for i in range(3000)]
    book.write_text("\n\n".join(paragraphs) + "\n")
    docs = list(iter_documents(str(book)))
    assert len(docs) > 40 and all(2000 < len(d) < 6000 for d in docs[:-1])
    assert "".join(docs).count("An indented line stays.") == 3000  # verbatim: nothing lost or joined
    from tidar_convert.data import is_validation

    val = sum(is_validation(d, 20) for d in docs)
    assert 0 < val < len(docs) // 4
    main(fit_args(tmp_path / "run", tiny_dirs["llama"], "--data.source", str(book), "--trainer.max_steps", "4"))
    assert "trained 4 steps" in capsys.readouterr().err


@pytest.mark.fit
def test_too_little_data_says_where_the_documents_went(tmp_path, tiny_dirs, capsys):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "too short"}) + "\n")
    line = cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], "--data.source", str(short)))
    # its one document went to training: validation has none
    assert "the validation data" in line and "fewer than seq_len=64 tokens for this reader: 0 documents (0 tokens) went to validation" in line
    assert "About one document in val_every=20 goes to validation" in line and "lower --data.seq_len" in line


@pytest.mark.parametrize("flags,given", [(["--data.split", "validation"], "--data.split validation"), (["--data.name", "en"], "--data.name en")])
def test_hub_only_settings_without_a_hub_dataset_are_refused(tmp_path, tiny_dirs, capsys, no_model_load, flags, given):
    line = cli_error(capsys, *fit_args(tmp_path / "run", tiny_dirs["llama"], *flags))
    assert line.startswith(f"error: {given}: these choose a configuration and split of a hub dataset")
