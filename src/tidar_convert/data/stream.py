"""The resumable sharded stream: packed chunks dealt to ranks and workers, and the loader that
remembers its position for checkpoints."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from tidar_convert.data.packing import is_validation, pack_marked, shuffled, tokenize_document
from tidar_convert.data.sources import PROSE_DOC_CHARS, is_split_file, iter_documents


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
    while all sources last; `max_docs` ({source: n}) reads only the first n documents of a source;
    the tokens of sources in `no_ar` are marked in each item's `no_ar_target` (bool per token): the
    AR loss does not train on them as targets (TiDARModule), only the diffusion loss does.
    """

    def __init__(
        self,
        tokenizer,
        sources: list[str],
        seq_len: int,
        part: str,
        val_every: int,
        text_field: str,
        name,
        split,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 0,
        train_only: tuple[int, ...] = (),
        weights: tuple[float, ...] | None = None,
        max_docs: dict[int, int] | None = None,
        no_ar: tuple[int, ...] = (),
    ):
        self.tokenizer, self.sources, self.seq_len, self.part = tokenizer, sources, seq_len, part
        self.val_every, self.text_field, self.name, self.split, self.seed = (
            val_every,
            text_field,
            name,
            split,
            seed,
        )
        self.rank, self.world_size, self.shuffle_buffer, self.train_only = (
            rank,
            world_size,
            shuffle_buffer,
            set(train_only),
        )
        if weights is not None and (
            len(weights) != len(sources) or min(weights) < 0 or not sum(weights) > 0
        ):
            raise ValueError(
                f"weights={list(weights)}: give one share >= 0 per source "
                f"({len(sources)}: {', '.join(sources)}), not all 0."
            )
        self.weights, self.max_docs, self.no_ar = weights, dict(max_docs or {}), set(no_ar)
        self.split_files = [j for j, s in enumerate(sources) if is_split_file(s)]
        # add "reader" (the reader index on this rank) to each item: ResumableLoader counts by it
        self.tag_reader = False
        # {"next": reader, "consumed": [chunks per reader]}: set by ResumableLoader for one iter()
        self.resume = None

    def stream_key(self) -> list:
        """The settings that decide which chunks come in which order: a saved position is only
        meaningful for a stream with the same key."""
        key = [
            list(self.sources),
            self.seq_len,
            self.part,
            self.val_every,
            self.text_field,
            self.name,
            self.split,
            self.seed,
            self.world_size,
            self.shuffle_buffer,
            sorted(self.train_only),
        ]
        # (absent when unused: older checkpoints still resume)
        if self.weights is not None or self.max_docs or self.no_ar:
            key += [
                self.weights and list(self.weights),
                sorted(self.max_docs.items()),
                sorted(self.no_ar),
            ]
        if self.split_files:  # cut into documents (split_text): a position saved before the cut, or
            # with other document sizes, counts other chunks
            key.append({"text files cut into documents": self.split_files, "of": PROSE_DOC_CHARS})
        return key

    def documents(self, worker: int | None = None) -> Iterator[str]:
        """This reader's documents of all sources, interleaved so each source gets an equal share
        of the text (by characters; or the share `weights` gives it): a list of sources is a mix
        from the first step, whatever the document sizes. `worker` is the reader this process plays
        on its rank (default: its DataLoader worker index; a resumed loader rotates it, see
        `ResumableLoader`)."""
        for _, doc in self.sourced_documents(worker):
            yield doc

    def sourced_documents(self, worker: int | None = None) -> Iterator[tuple[int, str]]:
        """(source index, text) of this reader's documents; see `documents`."""
        index, workers = shard()
        worker = index if worker is None else worker
        readers, me = self.world_size * workers, self.rank * workers + worker
        # train_only sources are self-distilled corpora: `distill` writes their text under "text",
        # whatever the data's field
        streams = {
            j: iter_documents(
                s,
                "text" if j in self.train_only else self.text_field,
                self.name,
                self.split,
                self.seed,
            )
            for j, s in enumerate(self.sources)
        }
        for j, n_max in self.max_docs.items():
            streams[j] = itertools.islice(streams[j], n_max)
        chars = dict.fromkeys(streams, 0)

        def turn(j):
            if self.weights is None:
                return (chars[j], j)
            # the source furthest below its share; a 0-share source only once the others have
            # run out
            if self.weights[j] > 0:
                return (0, chars[j] / self.weights[j], j)
            return (1, chars[j], j)

        n = 0  # documents of this part seen so far, by every reader alike
        # [documents, characters] of each part, for the message when a reader gets no chunk
        self.split_counts = {"train": [0, 0], "val": [0, 0]}
        while streams:
            j = min(streams, key=turn)
            doc = next(streams[j], None)
            if doc is None:
                del streams[j]
                continue
            is_val = j not in self.train_only and is_validation(doc, self.val_every)
            tally = self.split_counts["val" if is_val else "train"]
            tally[0], tally[1] = tally[0] + 1, tally[1] + len(doc)
            # Equal shares count the text the stream reads (the order older runs saw, so their saved
            # positions still hold); explicit shares count this part's text, so they are exact in
            # it.
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
        # DataLoader worker 0 plays the reader whose turn is next
        worker = (index + resume["next"]) % workers
        return self._chunks(worker, resume["consumed"][worker])

    def _chunks(self, worker: int, skip: int):
        """The chunks of reader `worker` (on this rank), after its first `skip` ones.

        Skipped chunks are read, tokenized, packed and shuffled like the others and then dropped,
        so the chunks that follow are exactly those an uninterrupted run gets next (the shuffle
        buffer's state included); the cost is re-reading what was consumed before the resume.
        """
        n, read = 0, {"docs": 0, "tokens": 0}

        def counted(docs):  # what this reader read, for the message below
            for tokens, marked in docs:
                read["docs"] += 1
                read["tokens"] += len(tokens)
                yield tokens, marked

        packed = pack_marked(counted(self.marked_tokens(worker)), self.seq_len)
        for input_ids, doc_ids, marked in shuffled(packed, self.shuffle_buffer, self.seed):
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
            raise ValueError(self._too_little(read["docs"], read["tokens"], worker))

    def _too_little(self, docs: int, tokens: int, worker: int) -> str:
        """Why this reader has no chunk: where the documents went, and what would give it one."""
        part = "validation" if self.part == "val" else "training"
        (train, train_chars), (val, val_chars) = self.split_counts.values()
        readers = self.world_size * shard()[1]
        made = f"the {part} documents make {_n(tokens, 'token')}"
        if readers > 1:
            made = (
                f"{readers} readers (ranks x DataLoader workers) share the {part} documents, one "
                f"in {readers} each, and this one (rank {self.rank}, worker {worker}) got "
                f"{_n(docs, 'document')} ({_n(tokens, 'token')})"
            )
        fixes = ["add documents", "lower --data.seq_len"]
        if self.part == "val":
            fixes.insert(1, "lower --data.val_every to hold out more of them")
        if readers > 1:
            fixes.append("use fewer --data.num_workers")
        fix = ", ".join(fixes[:-1]) + ", or " + fixes[-1]
        if self.part == "val":
            fix += "; or train without validation: --trainer.limit_val_batches 0"
        return (
            f"the {part} data ({', '.join(self.sources)}) holds fewer than seq_len={self.seq_len} "
            f"tokens: of its {_n(train + val, 'document')}, {train} ({train_chars:,} characters) "
            f"went to training and {val} ({val_chars:,} characters) to validation, which takes "
            f"about one document in val_every={self.val_every}, by a hash of its text; {made}. A "
            "file in a folder is one document, a single text file is cut into documents at blank "
            f"lines. {fix[0].upper() + fix[1:]}."
        )


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


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
    alike). `persistent_workers=True` is refused (a worker would keep the position for later
    epochs).
    """

    def __init__(self, dataset: PackedDocuments, **kwargs):
        if kwargs.get("persistent_workers"):
            # Persistent workers keep the dataset copy they were started with, resume position
            # included, and would skip the same chunks again at the start of every later epoch.
            raise ValueError(
                "ResumableLoader(persistent_workers=True) is not supported: the workers would "
                "keep the resumed position for every later epoch; leave persistent_workers off "
                "(each epoch starts its workers again)."
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
        return {
            "readers": self.readers,
            "consumed": list(self.consumed),
            "next": self.next_reader,
            "stream": self.dataset.stream_key(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["readers"] != self.readers:
            saved = state["readers"] if state["readers"] > 1 else 0
            raise ValueError(
                f"the checkpoint's data position was saved with --data.num_workers {saved} and "
                f"this run has {self.num_workers}: "
                "each worker reads its own share of the documents, so the position only holds "
                "for the same number; "
                f"resume with --data.num_workers {saved}."
            )
        if state["stream"] != self.dataset.stream_key():
            raise ValueError(
                "the checkpoint's data position was saved for other data settings "
                "(sources, seq_len, seed, shuffle_buffer, "
                f"val_every, text_field or number of devices: {state['stream']}, "
                f"now {self.dataset.stream_key()}); "
                "resume with the settings of the run that wrote it "
                "(its config.yaml in the run folder)."
            )
        self.consumed, self.next_reader = list(state["consumed"]), state["next"]
        self._resume = {"next": self.next_reader, "consumed": list(self.consumed)}
        # says why the first step of a resumed run is slow
        if sum(self.consumed) and self.dataset.rank == 0:
            print(
                f"resuming the training data after the {sum(self.consumed)} chunks already "
                "trained on in this epoch (read again, not trained on)",
                file=sys.stderr,
                flush=True,
            )

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
