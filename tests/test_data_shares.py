"""Issue 48: each reader (rank x DataLoader worker) opens only its share of the data, a resume
seeks to its position instead of reading everything before it again, and chat `messages` are
rendered with the tokenizer's chat template."""

import copy
import json

import pytest
import torch

from tidar_convert.data import (
    PackedDocuments,
    ResumableLoader,
    check_sources,
    formats,
    iter_documents,
    stream,
)


def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    return tok


CHATS = [
    [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    for i in range(30)
]


def test_chat_messages_are_rendered_with_the_chat_template_and_trained_like_text(
    tokenizer, tmp_path
):
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    check_sources([str(rows)], text_field="messages")
    tok = chat_tokenizer(tokenizer)
    ds = PackedDocuments(tok, [str(rows)], 8, "train", 10**9, "messages", None, "train", 0)
    docs = list(ds.documents())
    assert docs == [tok.apply_chat_template(m, tokenize=False) for m in CHATS]
    assert docs[0] == "<|user|>question 0\n<|assistant|>answer 0\n"
    # every token of the rendered conversation is a target, as in plain text (no mask of turns)
    chunks = [c["input_ids"] for c in ds._chunks(0, 0)]
    expected = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [0]]
    assert torch.cat(chunks).tolist() == expected[: 8 * len(chunks)]
    # a parquet column of messages too
    import datasets

    datasets.Dataset.from_dict({"messages": CHATS}).to_parquet(str(tmp_path / "chat.parquet"))
    ds.sources = [str(tmp_path / "chat.parquet")]
    assert list(ds.documents()) == docs
    no_template = PackedDocuments(
        tokenizer, [str(rows)], 8, "train", 10**9, "messages", None, "train", 0
    )
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        next(no_template.documents())
    with pytest.raises(ValueError, match="holds chat messages.*render=chat_renderer"):
        next(iter_documents(str(rows), text_field="messages"))


# ----------------------------------------------------------------------------------------------
# Each reader opens its own share
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def counted_reads(monkeypatch):
    """{reader: bytes of JSON lines read}, counting every line formats.py reads from a file."""
    reads: dict = {}
    real_open = open

    class Counting:
        def __init__(self, f, key):
            self.f, self.key = f, key

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def readline(self):
            line = self.f.readline()
            reads[self.key] = reads.get(self.key, 0) + len(line)
            return line

    def counting_open(path, mode="r", *a, **k):
        return Counting(real_open(path, mode, *a, **k), reads.get("reader"))

    monkeypatch.setattr(formats, "open", counting_open, raising=False)
    return reads


def test_two_ranks_times_two_workers_each_read_a_quarter(
    tokenizer, tmp_path, monkeypatch, counted_reads
):
    """2 ranks x 2 DataLoader workers (the worker ids as torch gives them): each reader reads
    about a quarter of the file's bytes, and together they train on every training document once
    and validate on every validation document once."""
    rows = tmp_path / "docs.jsonl"
    docs = [f"doc {i:04d} " + "word " * (i % 13) for i in range(2000)]
    rows.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    size = rows.stat().st_size
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
    seen = {"train": [], "val": []}
    for part in seen:
        for rank in range(2):
            for worker in range(2):
                monkeypatch.setattr(stream, "shard", lambda w=worker: (w, 2))
                counted_reads["reader"] = (part, rank, worker)
                ds = PackedDocuments(part=part, rank=rank, world_size=2, **kw)
                seen[part] += list(ds.documents())
    assert sorted(seen["train"] + seen["val"]) == sorted(docs)
    assert len(set(seen["train"])) == len(seen["train"]) and not set(seen["train"]) & set(
        seen["val"]
    )
    per_reader = [n for k, n in counted_reads.items() if k != "reader"]
    assert len(per_reader) == 8
    for n in per_reader:  # a quarter, and a line at the boundary
        assert abs(n - size / 4) < 200, (n, size)


# ----------------------------------------------------------------------------------------------
# A resume seeks
# ----------------------------------------------------------------------------------------------


def test_a_resume_reads_no_document_consumed_before_it(tokenizer, tmp_path, monkeypatch):
    """A loader resumed late in an epoch reads as few source rows before its first batch as one
    resumed early (its shuffle block's), where reading everything before would grow with it."""
    rows = tmp_path / "docs.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"text": f"doc {i:04d} " + "word " * (i % 5)}) + "\n" for i in range(600)
        )
    )

    def loader():
        ds = PackedDocuments(
            tokenizer, [str(rows)], 8, "train", 10, "text", None, "train", 0, shuffle_buffer=4
        )
        return ResumableLoader(ds, batch_size=2)

    whole = loader()
    states, reference = [], []
    for batch in whole:
        batch = whole.count(batch)
        reference.append(batch["input_ids"])
        states.append(whole.state_dict())
    read = []
    real_rows = formats.rows

    def counting(*a, **k):
        for row in real_rows(*a, **k):
            read.append(1)
            yield row

    monkeypatch.setattr("tidar_convert.data.sources.rows", counting)
    firsts = {}
    for c in (2, len(states) // 2, len(states) - 3):
        resumed = loader()
        resumed.load_state_dict(states[c - 1])
        read.clear()
        first = next(iter(resumed))
        firsts[c] = len(read)
        assert torch.equal(resumed.count(first)["input_ids"], reference[c])
    assert max(firsts.values()) <= 20, firsts  # a block of 4 chunks of 8 tokens: a few documents


def test_a_position_of_another_rank_is_not_taken(tokenizer, tmp_path):
    """Each rank resumes from its own readers' positions; without them (a checkpoint whose ranks
    were not gathered), it reads its chunks again up to the count: slower, as exact."""
    rows = tmp_path / "docs.jsonl"
    rows.write_text("".join(json.dumps({"text": f"doc {i} " * 3}) + "\n" for i in range(300)))

    def loader(rank):
        ds = PackedDocuments(
            tokenizer, [str(rows)], 8, "train", 10, "text", None, "train", 0, rank, 2, 4
        )
        return ResumableLoader(ds, batch_size=2)

    for rank in range(2):
        whole = loader(rank)
        batches, states = [], []
        for batch in whole:
            batches.append(whole.count(batch)["input_ids"])
            states.append(whole.state_dict())
        state = states[6]
        assert len(state["positions"]) == 1  # one process: only its own rank's
        resumed = loader(rank)
        resumed.load_state_dict(state)
        got = [resumed.count(b)["input_ids"] for b in resumed]
        assert all(torch.equal(a, b) for a, b in zip(got, batches[7:], strict=True))


def test_a_hub_stream_is_split_by_shard_and_resumes_from_its_state(tmp_path, monkeypatch):
    """A hub dataset (here a local streamed one in its place): each reader streams its shards alone
    (split_dataset_by_node), and its position is the stream's state_dict, resumed without reading
    the rows before it."""
    import datasets

    from tidar_convert.data import sources
    from tidar_convert.data.formats import Share
    from tidar_convert.data.sources import SourceReader

    files = []
    for s in range(4):
        path = tmp_path / f"shard{s}.jsonl"
        path.write_text("".join(json.dumps({"text": f"s{s} row {i}"}) + "\n" for i in range(6)))
        files.append(str(path))
    opened, real = [], datasets.load_dataset

    def load_dataset(source, name=None, split="train", streaming=False, data_files=None):
        opened.append((source, data_files))
        return real("json", data_files=files, split=split, streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(sources, "_check_hub_dataset", lambda source: None)
    parts = [list(SourceReader("owner/data", share=Share(r, 2))) for r in range(2)]
    assert opened == [("owner/data", None)] * 2
    # by shard: reader 0 streams shards 0 and 2, reader 1 shards 1 and 3
    assert {d.split()[0] for d in parts[0]} == {"s0", "s2"}
    assert sorted(parts[0] + parts[1]) == sorted(
        f"s{s} row {i}" for s in range(4) for i in range(6)
    )
    reader = SourceReader("owner/data", share=Share(1, 2))
    docs = iter(reader)
    head = [next(docs) for _ in range(8)]
    resumed = list(SourceReader("owner/data", share=Share(1, 2), start=reader.position))
    assert head + resumed == parts[1]


def test_data_files_select_a_hub_datasets_files_and_nothing_else(tokenizer, tmp_path, monkeypatch):
    import datasets

    from tidar_convert.data import TiDARData, sources

    given = []

    def load_dataset(source, name=None, split="train", streaming=False, **kw):
        given.append(kw)
        return datasets.Dataset.from_dict({"text": ["a hub row"]}).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(sources, "_check_hub_dataset", lambda source: None)
    dm = TiDARData(source="owner/data", data_files="sample/10BT/*.parquet", val_every=10**9)
    dm.tokenizer = tokenizer
    assert list(dm._dataset("train").documents()) == ["a hub row"]
    assert given == [{"data_files": "sample/10BT/*.parquet"}]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "local"}) + "\n")
    with pytest.raises(ValueError, match="selects files of a hub dataset.*'data/\\*.jsonl'"):
        check_sources([str(rows)], data_files="x/*.parquet")
    with pytest.raises(ValueError, match="data_files.*with --data.greedy_docs 5"):
        TiDARData(source="owner/data", data_files="a.parquet", greedy_docs=5)


def _two_ranks(rank: int, port: int, path: str, out: str) -> None:
    """One of two gloo processes: consume 5 batches, save (a collective), resume from the saved
    state; write what it saw."""
    import torch.distributed as dist
    from helpers import tiny_tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tokenizer = tiny_tokenizer()

    def loader():
        ds = PackedDocuments(
            tokenizer, [path], 8, "train", 10, "text", None, "train", 0, rank, 2, 4
        )
        return ResumableLoader(ds, batch_size=2)

    whole = loader()
    batches = [whole.count(b)["input_ids"] for b in whole]
    whole = loader()
    for _, b in zip(range(5), whole):
        whole.count(b)
    state = whole.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [resumed.count(b)["input_ids"] for b in resumed]
    torch.save({"state": state, "rest": rest, "batches": batches}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.subprocess
def test_every_rank_resumes_from_its_own_position(tmp_path):
    """2 gloo processes: the checkpoint's position holds both ranks' positions (gathered when it is
    saved), and each rank resumes from its own, exactly where it stopped."""
    import socket

    import torch.multiprocessing as mp

    rows = tmp_path / "docs.jsonl"
    rows.write_text("".join(json.dumps({"text": f"doc {i} " * 3}) + "\n" for i in range(300)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(rows), str(tmp_path)), nprocs=2)
    seen = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, got in enumerate(seen):
        positions = got["state"]["positions"]
        assert len(positions) == 2 and positions[rank][0] is not None
        assert positions == seen[1 - rank]["state"]["positions"]  # the same checkpoint on both
        assert all(torch.equal(a, b) for a, b in zip(got["rest"], got["batches"][5:], strict=True))
    assert not torch.equal(seen[0]["batches"][0], seen[1]["batches"][0])  # their own shares


def test_a_reader_without_a_chunk_says_it_read_its_share(tokenizer, tmp_path, monkeypatch):
    rows = tmp_path / "few.jsonl"
    rows.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(3)))
    monkeypatch.setattr(stream, "shard", lambda: (1, 2))
    ds = PackedDocuments(tokenizer, [str(rows)], 64, "train", 10**9, "text", None, "train", 0)
    with pytest.raises(ValueError) as e:
        list(ds._chunks(1, 0))
    assert "of this reader's 1 document, 1 (2 characters) went to training" in str(e.value)
    assert "each about 1/2 of every source, and this one (rank 0, worker 1) got 1 document" in str(
        e.value
    )
