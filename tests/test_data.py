import json

import pytest
import torch

from tidar_convert.data import (
    PackedDocuments,
    TiDARData,
    is_validation,
    iter_documents,
    pack,
    split_prose,
)


def test_pack_numbers_documents_inside_each_chunk():
    chunks = list(pack(iter([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]), 4))
    assert [c[0].tolist() for c in chunks] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [c[1].tolist() for c in chunks] == [[0, 0, 0, 1], [0, 1, 1, 1]]


def test_local_sources(tmp_path):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("alpha document")
    (tmp_path / "txt" / "b.md").write_text("beta document")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"body": f"row {i}"}) for i in range(3)))
    assert sorted(iter_documents(str(tmp_path / "txt"))) == ["alpha document", "beta document"]
    assert list(iter_documents(str(rows), text_field="body")) == ["row 0", "row 1", "row 2"]
    with pytest.raises(ValueError, match="no field 'text'.*--data.text_field body"):
        list(iter_documents(str(rows)))
    import datasets

    datasets.Dataset.from_dict({"text": ["p0", "p1"]}).to_parquet(str(tmp_path / "t.parquet"))
    assert list(iter_documents(str(tmp_path / "t.parquet"))) == ["p0", "p1"]


def test_stdlib_is_the_offline_default():
    docs = iter_documents("stdlib")
    first = [next(docs) for _ in range(3)]
    assert all("def " in d or "import" in d for d in first)


def test_stdlib_heldout_is_what_training_at_val_every_50_never_reads():
    from tidar_convert.data import STDLIB_HELDOUT_EVERY, stdlib_files

    held = list(iter_documents("stdlib-heldout"))
    assert STDLIB_HELDOUT_EVERY == 50 and len(held) >= 10  # enough modules for a perplexity figure
    assert all(is_validation(d, 50) and is_validation(d, 25) and is_validation(d, 10) for d in held)
    assert len(held) < len(stdlib_files()) / 20  # a held-out share, not the stdlib


def test_train_and_validation_documents_are_disjoint(tokenizer, tmp_path):
    rows = tmp_path / "docs.jsonl"
    rows.write_text(
        "\n".join(json.dumps({"text": f"document number {i} " * 5}) for i in range(200))
    )
    kw = dict(
        tokenizer=tokenizer,
        sources=[str(rows)],
        seq_len=8,
        val_every=10,
        text_field="text",
        name=None,
        split="train",
        seed=0,
    )
    train = list(PackedDocuments(part="train", **kw).documents())
    val = list(PackedDocuments(part="val", **kw).documents())
    assert 8 <= len(val) <= 35 and len(train) + len(val) == 200 and not set(train) & set(val)
    assert all(is_validation(d, 10) for d in val) and not any(is_validation(d, 10) for d in train)
    # two ranks split the training documents between them
    r0 = list(PackedDocuments(part="train", rank=0, world_size=2, **kw).documents())
    r1 = list(PackedDocuments(part="train", rank=1, world_size=2, **kw).documents())
    assert sorted(r0 + r1) == sorted(train) and not set(r0) & set(r1)


def test_the_split_depends_on_the_document_not_on_its_position(tokenizer, tmp_path):
    """Adding a source (say self-distilled text) used to shift every position and move validation
    documents into training: now the same text is held out whatever comes before it."""
    docs, extra = tmp_path / "docs.jsonl", tmp_path / "extra.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"held out or not {i}"}) for i in range(300)))
    extra.write_text("\n".join(json.dumps({"text": f"another source {i} " * 3}) for i in range(77)))
    kw = dict(
        tokenizer=tokenizer,
        seq_len=8,
        val_every=10,
        text_field="text",
        name=None,
        split="train",
        seed=0,
    )
    val_alone = set(PackedDocuments(sources=[str(docs)], part="val", **kw).documents())
    train_mixed = set(
        PackedDocuments(sources=[str(extra), str(docs)], part="train", **kw).documents()
    )
    assert val_alone and not val_alone & train_mixed
    # a train-only source (greedy documents) never goes to validation
    val_mixed = list(
        PackedDocuments(
            sources=[str(docs), str(extra)], part="val", train_only=(1,), **kw
        ).documents()
    )
    assert set(val_mixed) == val_alone


def test_ranks_times_workers_see_each_document_exactly_once(tokenizer, tmp_path):
    """2 ranks x 2 DataLoader workers: every training document of the epoch once, none twice."""
    from torch.utils.data import DataLoader

    rows = tmp_path / "docs.jsonl"
    rows.write_text(
        "\n".join(json.dumps({"text": f"doc {i:03d} " + "word " * (i % 7)}) for i in range(120))
    )
    kw = dict(
        tokenizer=tokenizer,
        sources=[str(rows)],
        seq_len=4,
        val_every=10,
        text_field="text",
        name=None,
        split="train",
        seed=0,
    )
    expected = list(PackedDocuments(part="train", **kw).documents())

    class Docs(PackedDocuments):  # yield the documents themselves, through real worker processes
        def __iter__(self):
            yield from self.documents()

    seen = []
    for rank in range(2):
        loader = DataLoader(
            Docs(part="train", rank=rank, world_size=2, **kw), batch_size=None, num_workers=2
        )
        seen += list(loader)
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))


def test_mixed_sources_interleave(tokenizer, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"text": f"a{i}"}) for i in range(4)))
    b.write_text("\n".join(json.dumps({"text": f"b{i}"}) for i in range(4)))
    ds = PackedDocuments(tokenizer, [str(a), str(b)], 8, "train", 10**9, "text", None, "train", 0)
    assert list(ds.documents())[:5] == ["a0", "b0", "a1", "b1", "a2"]
    # equal shares of text, not of documents: one long document of c is worth many short ones of a
    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps({"text": "c" * 6}) + "\n" + json.dumps({"text": "C" * 6}))
    ds = PackedDocuments(tokenizer, [str(a), str(c)], 8, "train", 10**9, "text", None, "train", 0)
    assert list(ds.documents()) == ["a0", "cccccc", "a1", "a2", "a3", "CCCCCC"]


def test_datamodule_batches(tokenizer):
    dm = TiDARData(seq_len=32, batch_size=2, val_batches=1)
    dm.tokenizer = tokenizer
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 32) and batch["doc_ids"].shape == (2, 32)
    assert (batch["doc_ids"][:, 0] == 0).all() and (batch["doc_ids"].diff(dim=1) >= 0).all()
    assert len(list(dm.val_dataloader())) == 1


def test_bad_data_settings():
    with pytest.raises(ValueError, match="val_every=1"):
        TiDARData(val_every=1)
    with pytest.raises(ValueError, match="source=\\[\\]"):
        TiDARData(source=[])


def test_split_prose_by_document(tmp_path):
    book = "\n\n".join(
        f"Paragraph {i} of the story {{t}} goes on\nacross a wrapped line." for i in range(40)
    )
    text = "".join(
        f"The Project Gutenberg EBook of {t}\nLicence text here.\n"
        f"*** START OF THIS PROJECT GUTENBERG EBOOK {t.upper()} ***\n{book.format(t=t)}\n"
        f"*** END OF THIS PROJECT GUTENBERG EBOOK {t.upper()} ***\nMore licence text.\n"
        for t in ("First Book", "Second Book")
    )
    counts = split_prose(text, tmp_path, heldout_every=4, doc_chars=200, heldout_book="second-book")
    train, heldout, book = (
        {p.name: p.read_text() for p in (tmp_path / part).iterdir()}
        for part in ("train", "heldout", "book")
    )
    assert (
        counts == {"train": len(train), "heldout": len(heldout), "book": len(book)}
        and heldout
        and train
        and book
    )
    assert {n.split("-", 1)[1] for n in heldout} == {"first-book.txt", "second-book.txt"}
    # the held-out book: never in train
    assert {n.split("-", 1)[1] for n in train} == {"first-book.txt"}
    assert {n.split("-", 1)[1] for n in book} == {"second-book.txt"}
    # the whole book, its held-out share included
    assert {n for n in heldout if n.endswith("second-book.txt")} < set(book)
    train_paragraphs = {p for doc in train.values() for p in doc.split("\n\n")}
    for doc in list(heldout.values()) + list(book.values()):
        assert not set(doc.split("\n\n")) & train_paragraphs
    # the held-out share of each book is the same whichever book is whole in book/
    other = tmp_path / "other"
    split_prose(text, other, heldout_every=4, doc_chars=200, heldout_book="first-book")
    assert sorted(p.name for p in (other / "heldout").iterdir()) == sorted(heldout)
    everything = "".join(train.values()) + "".join(heldout.values())
    assert "icence" not in everything and "GUTENBERG" not in everything
    assert "goes on across a wrapped line." in everything  # hard wraps joined


def greedy_mix(tmp_path, tokenizer, **kw):
    """TiDARData over a human source and a corpus in `distill`'s row format, both plentiful."""
    from tidar_convert.train.distill import MADE_BY

    human, greedy = tmp_path / "human.jsonl", tmp_path / "greedy.jsonl"
    human.write_text(
        "\n".join(json.dumps({"text": f"human {i} " + "words " * (i % 5)}) for i in range(600))
    )
    greedy.write_text(
        "".join(
            json.dumps(
                {"text": f"greedy {i} " + "loop " * (i % 3), "made_by": MADE_BY, "val_every": 10}
            )
            + "\n"
            for i in range(600)
        )
    )
    dm = TiDARData(
        source=str(human),
        seq_len=8,
        val_every=10,
        greedy_corpus=str(greedy),
        shuffle_buffer=0,
        **kw,
    )
    dm.tokenizer = tokenizer
    return dm


@pytest.mark.parametrize("share", [0.0, 1 / 3, 2 / 3, 1.0])
def test_greedy_share_is_the_realised_share_of_the_text(tokenizer, tmp_path, share):
    dm = greedy_mix(tmp_path, tokenizer, greedy_docs=300, greedy_share=share)
    docs = list(dm._dataset("train").documents())
    n_greedy = sum(d.startswith("greedy") for d in docs)
    assert n_greedy == (0 if share == 0 else 300)  # greedy_docs caps the greedy documents read
    if share in (0, 1):
        first = docs[:300]
        # all greedy first, or none at all
        assert all(d.startswith("greedy") == (share == 1) for d in first)
        return
    last = max(i for i, d in enumerate(docs) if d.startswith("greedy"))
    mixed = docs[: last + 1]  # while the greedy documents last
    realised = sum(len(d) for d in mixed if d.startswith("greedy")) / sum(len(d) for d in mixed)
    assert realised == pytest.approx(share, abs=0.02)


def test_greedy_share_bad_values_are_refused():
    with pytest.raises(ValueError, match=r"greedy_share=1.5: must be a finite number in \[0, 1\]"):
        TiDARData(greedy_docs=10, greedy_share=1.5)
    with pytest.raises(
        ValueError,
        match="greedy_share=0.5 with greedy_docs=0: there are no greedy documents to mix in",
    ):
        TiDARData(greedy_share=0.5)
    with pytest.raises(ValueError, match="greedy_dtype='int8': use one of float32"):
        TiDARData(greedy_dtype="int8")


@pytest.mark.parametrize("ar_loss", [True, False])
def test_greedy_ar_loss_false_marks_exactly_the_greedy_tokens(tokenizer, tmp_path, ar_loss):
    dm = greedy_mix(tmp_path, tokenizer, greedy_docs=50, greedy_ar_loss=ar_loss)
    items = list(dm._dataset("train")._chunks(0, 0))
    if ar_loss:
        assert all("no_ar_target" not in item for item in items)
        return
    # The stream in order (no shuffle buffer): each token marked exactly when its document is
    # greedy text.
    expected = []
    for doc in dm._dataset("train").documents():
        expected += [doc.startswith("greedy")] * (
            len(tokenizer(doc, add_special_tokens=False)["input_ids"]) + 1  # + EOS
        )
    marks = torch.cat([item["no_ar_target"] for item in items]).tolist()
    assert marks == expected[: len(marks)] and any(marks) and not all(marks)
    # validation: no greedy text
    assert all("no_ar_target" not in item for item in dm._dataset("val")._chunks(0, 0))


def test_text_field_applies_to_rows_only_and_a_greedy_corpus_is_read_as_text(tokenizer, tmp_path):
    """--data.text_field names the field of json rows; one-document files (stdlib) have none, and a
    `distill` corpus keeps its text under "text" whatever the data's field is."""
    from tidar_convert.train.distill import MADE_BY

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"text": f"title {i}", "content": f"body {i} " * 4}) + "\n"
            for i in range(30)
        )
    )
    assert list(iter_documents(str(rows), text_field="content")) == [
        f"body {i} " * 4 for i in range(30)
    ]  # as given, not "text"
    assert next(iter_documents("stdlib", text_field="content"))  # a file is its own text
    greedy = tmp_path / "greedy.jsonl"
    greedy.write_text(
        "".join(
            json.dumps(
                {"text": f"greedy {i} " * 4, "made_by": MADE_BY, "val_every": 10, "model": "m"}
            )
            + "\n"
            for i in range(5)
        )
    )
    dm = TiDARData(
        source=str(rows),
        seq_len=8,
        val_every=10,
        text_field="content",
        greedy_corpus=str(greedy),
        greedy_docs=5,
        shuffle_buffer=0,
    )
    dm.tokenizer = tokenizer
    train = list(dm._dataset("train").documents())
    assert sum(d.startswith("greedy") for d in train) == 5 and not any(
        d.startswith("title") for d in train
    )


def test_rows_without_text_are_counted_in_every_file_of_a_folder(tmp_path):
    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5))
    )
    (folder / "b.jsonl").write_text(
        "".join(json.dumps({"text": None if i % 2 else f"doc {i}"}) + "\n" for i in range(4))
    )
    (folder / "c.jsonl").write_text("")  # an empty file among others holds no row to lose
    with pytest.raises(
        ValueError,
        match=(
            r"2 of its 9 rows have no text in field 'text' \(the first, "
            rf"row 2 of {folder}/b.jsonl, has null or no such field"
        ),
    ):
        list(iter_documents(str(folder)))


def test_the_data_package_never_imports_distill():
    """The data <-> distill cycle stays gone: distill generates from the data, never the other way
    round, at module level or inside a function."""
    import ast
    from pathlib import Path

    import tidar_convert.data as data

    for path in Path(data.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names if not node.module]
                assert not any("distill" in n for n in names), (
                    f"{path.name}:{node.lineno} imports distill"
                )
            elif isinstance(node, ast.Import):
                assert not any("distill" in a.name for a in node.names), (
                    f"{path.name}:{node.lineno} imports distill"
                )
