"""The resumable sharded stream: packed chunks dealt to ranks and workers, and the loader that
remembers its position for checkpoints."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from tidar_convert.data.formats import Share
from tidar_convert.data.packing import Packer, block_order, is_validation, tokenize_document
from tidar_convert.data.sources import PROSE_DOC_CHARS, SourceReader, chat_renderer, is_split_file


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
    `data_files` selects the files of hub dataset sources, as in `datasets.load_dataset`.
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
        data_files: str | list[str] | None = None,
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
        self.data_files = data_files
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
        # each reader reads its own share of every file (SourceReader) and serves shuffle blocks:
        # a position saved by the reader that dealt documents one by one names other chunks
        key.append({"readers": "shares", "shuffle": "blocks"})
        if self.data_files is not None:
            key.append({"data_files": self.data_files})
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

    def share(self, worker: int | None = None) -> Share:
        """This reader's share of every source: reader (rank x workers + worker) of
        (ranks x workers)."""
        index, workers = shard()
        worker = index if worker is None else worker
        return Share(self.rank * workers + worker, self.world_size * workers)

    def sourced_documents(
        self, worker: int | None = None, start: dict | None = None, probe: dict | None = None
    ) -> Iterator[tuple[int, str]]:
        """(source index, text) of this reader's documents, from `start` (a state `probe["state"]()`
        gave); see `documents`. Each reader opens only its own share of each source
        (SourceReader). `probe`: receives "state", the function that tells where the documents
        yielded so far end."""
        share, start = self.share(worker), start or {}
        render = chat_renderer(self.tokenizer) if self.tokenizer is not None else None
        positions = start.get("positions", {})
        # train_only sources are self-distilled corpora: `distill` writes their text under "text",
        # whatever the data's field
        readers = {
            j: SourceReader(
                s,
                "text" if j in self.train_only else self.text_field,
                self.name,
                self.split,
                self.seed,
                share=share,
                start=positions.get(j),
                render=render,
                max_docs=self.max_docs.get(j),
                data_files=None if j in self.train_only else self.data_files,
            )
            for j, s in enumerate(self.sources)
            if j not in start.get("done", ())
        }
        streams = {j: iter(r) for j, r in readers.items()}
        chars = dict(start.get("chars") or dict.fromkeys(range(len(self.sources)), 0))

        def turn(j):
            if self.weights is None:
                return (chars[j], j)
            # the source furthest below its share; a 0-share source only once the others have
            # run out
            if self.weights[j] > 0:
                return (0, chars[j] / self.weights[j], j)
            return (1, chars[j], j)

        def doc_state() -> dict:
            return {
                "positions": {j: r.position for j, r in readers.items() if j in streams},
                "chars": dict(chars),
                "done": sorted(set(range(len(self.sources))) - set(streams)),
            }

        if probe is not None:
            probe["state"] = doc_state
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
            # Equal shares count the text the reader reads; explicit shares count this part's text,
            # so they are exact in it.
            if self.weights is None or is_val == (self.part == "val"):
                chars[j] += len(doc)
            if is_val == (self.part == "val"):
                yield j, doc

    def tokenized(self, worker: int | None = None) -> Iterator[list[int]]:
        for tokens, _ in self.marked_tokens(worker):
            yield tokens

    def marked_tokens(
        self, worker: int | None = None, start: dict | None = None, probe: dict | None = None
    ) -> Iterator[tuple[list[int], bool]]:
        """(token ids with EOS, whether the document is of a `no_ar` source)."""
        for j, doc in self.sourced_documents(worker, start, probe):
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
        position = (resume.get("positions") or [None] * workers)[worker]
        if position is not None:
            return self._chunks(worker, 0, position)
        return self._chunks(worker, resume["consumed"][worker])

    def _chunks(self, worker: int, skip: int, start: dict | None = None):
        """The chunks of reader `worker` (on this rank), from position `start` (one an item of an
        earlier pass carried), after its first `skip` ones.

        Chunks are served in shuffle blocks of `shuffle_buffer` (block_order), and each item
        carries its position (with `tag_reader`): the state of the documents and the packer at the
        start of its block, and how many of the block's chunks have been served with it. Resuming
        from a position reads on from there: the block is packed again (at most shuffle_buffer
        chunks) and its served chunks dropped, whatever was consumed before. A resume without a
        position (`skip`) reads, tokenizes and packs everything before it again.
        """
        size = max(1, self.shuffle_buffer)
        start = start or {"docs": None, "leftover": None, "block": 0, "served": 0}
        packer = Packer(self.seq_len, start["leftover"])
        read = {"docs": 0, "tokens": 0}

        def counted(docs):  # what this reader read, for the message below
            for tokens, marked in docs:
                read["docs"] += 1
                read["tokens"] += len(tokens)
                yield tokens, marked

        probe: dict = {}
        packed = packer.chunks(counted(self.marked_tokens(worker, start["docs"], probe)))
        block, served, n = start["block"], start["served"], 0
        while True:
            # the state before the block's first chunk: what every item of the block carries
            at = {"leftover": packer.state(), "block": block}
            # (before the first document is read, where the pass started)
            docs = probe["state"]() if "state" in probe else start["docs"]
            chunks = list(itertools.islice(packed, size))
            if not chunks:
                break
            at["docs"] = docs
            order = block_order(len(chunks), self.seed, block) if self.shuffle_buffer else None
            for k in range(served, len(chunks)):
                input_ids, doc_ids, marked = chunks[order[k] if order else k]
                n += 1
                if n <= skip:
                    continue
                item = {"input_ids": input_ids, "doc_ids": doc_ids}
                if self.no_ar:
                    item["no_ar_target"] = marked
                if self.tag_reader:
                    item["reader"] = worker
                    item["position"] = {**at, "served": k + 1}
                yield item
            block, served = block + 1, 0
        if n == 0 and start["block"] == 0 and start["served"] == 0:
            raise ValueError(self._too_little(read["docs"], read["tokens"], worker))

    def _too_little(self, docs: int, tokens: int, worker: int) -> str:
        """Why this reader has no chunk: where the documents went, and what would give it one."""
        part = "validation" if self.part == "val" else "training"
        (train, train_chars), (val, val_chars) = self.split_counts.values()
        readers = self.world_size * shard()[1]
        made = f"the {part} documents make {_n(tokens, 'token')}"
        if readers > 1:
            made = (
                f"{readers} readers (ranks x DataLoader workers) share the data, each about "
                f"1/{readers} of every source, and this one (rank {self.rank}, worker {worker}) "
                f"got {_n(docs, 'document')} ({_n(tokens, 'token')})"
            )
        fixes = ["add documents", "lower --data.seq_len"]
        if self.part == "val":
            fixes.insert(1, "lower --data.val_every to hold out more of them")
        if readers > 1:
            fixes.append("use fewer --data.num_workers")
        fix = ", ".join(fixes[:-1]) + ", or " + fixes[-1]
        whose = "this reader's" if readers > 1 else "its"
        if self.part == "val":
            fix += "; or train without validation: --trainer.limit_val_batches 0"
        return (
            f"the {part} data ({', '.join(self.sources)}) holds fewer than seq_len={self.seq_len} "
            f"tokens: of {whose} {_n(train + val, 'document')}, {train} ({train_chars:,} "
            f"characters) went to training and {val} ({val_chars:,} characters) to validation, "
            f"which takes about one document in val_every={self.val_every}, by a hash of its "
            f"text; {made}. A file in a folder is one document, a single text file is cut into "
            f"documents at blank lines. {fix[0].upper() + fix[1:]}."
        )


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


class ResumableLoader(DataLoader):
    """The training DataLoader, with its position in the stream: Lightning stores `state_dict()` in
    every checkpoint and calls `load_state_dict()` when a run resumes (`--ckpt_path last`), so a
    killed run continues where it stopped: no chunk is seen twice and none is skipped.

    The position is, for each reader (DataLoader worker) of each rank, the position the last chunk
    training consumed carried (`PackedDocuments._chunks`: where its documents, packer and shuffle
    block stood), how many chunks of each reader were consumed in the current epoch, and which
    reader comes next. `count()` records a batch when training takes it
    (TiDARData.on_before_batch_transfer: batches the optimizer loop used, micro-batches under
    gradient accumulation, never the ones prefetched). With W workers, torch hands out batches from
    workers 0, 1, ..., W-1 in turn (dropping a worker whose stream has ended); each batch is tagged
    with its reader, so the positions stay exact also at the ragged end of an epoch and with partial
    last batches.

    On resume, the first iter() has worker w play reader (w + next) % W, so the turn order goes on
    where it stopped, and each reader seeks to its position: the time to the first step does not
    grow with the chunks consumed before. After the last batch of an epoch the position is the
    start of the next one; later epochs start fresh. With several ranks, `state_dict()` gathers
    every rank's positions (every rank saves a checkpoint together, as Lightning does).

    Limits: the position must be resumed with the same data settings, num_workers and number of
    devices (refused otherwise). `persistent_workers=True` is refused (a worker would keep the
    position for later epochs).
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
        kwargs.setdefault("collate_fn", _collate_positions)
        super().__init__(dataset, **kwargs)
        dataset.tag_reader = True
        self.readers = max(1, self.num_workers)
        self.end_epoch()
        self._resume = None

    def count(self, batch: dict) -> dict:
        """Record a batch training has taken; returns it without its "reader" and "position"."""
        batch = dict(batch)
        reader, position = batch.pop("reader"), batch.pop("position")
        r = int(reader[0])
        self.consumed[r] += len(reader)
        self.positions[r] = position
        self.next_reader = (r + 1) % self.readers
        return batch

    def end_epoch(self) -> None:
        """The last batch of the epoch was taken: the position is the start of the next epoch."""
        self.consumed, self.next_reader = [0] * self.readers, 0
        self.positions: list = [None] * self.readers

    def state_dict(self) -> dict:
        return {
            "readers": self.readers,
            "consumed": list(self.consumed),
            "next": self.next_reader,
            "stream": self.dataset.stream_key(),
            "positions": _every_rank(list(self.positions), self.dataset.world_size),
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
        if "positions" not in state:
            raise ValueError(
                "the checkpoint's data position was saved by a tidar-convert that dealt the "
                "documents to ranks and workers one by one, and this one reads each its own share "
                "of every file: its position names other chunks. Finish that run with the "
                "tidar-convert that started it, or start a new run from its export "
                "(`tidar-convert export --checkpoint CKPT --out DIR`, then --model.model DIR)."
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
        # a rank's own readers' positions; a checkpoint that holds only rank 0's (a process that
        # was not part of a process group saved it) resumes the others by reading again
        saved = state["positions"]
        rank = self.dataset.rank
        ok = len(saved) == self.dataset.world_size
        self.positions = list(saved[rank]) if ok else [None] * self.readers
        self._resume = {
            "next": self.next_reader,
            "consumed": list(self.consumed),
            "positions": list(self.positions),
        }
        if sum(self.consumed) and self.dataset.rank == 0:
            print(
                f"resuming the training data after the {sum(self.consumed)} chunks already "
                "trained on in this epoch (each reader seeks to where it stopped)",
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


def _collate_positions(items: list[dict]) -> dict:
    """torch's default collation, but for the items' positions: a batch (all of one reader, in
    order) carries the position of its last item, where its reader stands once it is consumed."""
    positions = [item.pop("position", None) for item in items]
    batch = default_collate(items)
    if positions[-1] is not None:
        batch["position"] = positions[-1]
    return batch


def _every_rank(positions: list, world_size: int) -> list:
    """[rank: its readers' positions]: gathered from every rank (a collective: every rank saves its
    checkpoint at the same step), so that each resumes from its own."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [positions]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, positions)
    return every


class _Take(IterableDataset):
    """The first n items: a fixed validation set, the same at every validation run."""

    def __init__(self, ds, n):
        self.ds, self.n = ds, n

    def __iter__(self):
        for i, item in enumerate(self.ds):
            if i >= self.n:
                return
            yield item
