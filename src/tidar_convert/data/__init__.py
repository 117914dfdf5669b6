"""Training data: documents from `datasets`, tokenized and packed into seq_len chunks with doc ids.

Sources (`TiDARData(source=...)`):
  - "stdlib" (default): the Python standard library's own .py files. Real code, on every machine,
    no network. "stdlib-heldout": only its modules that training holds out at the recipes'
    `val_every: 50` (or any divisor of 50), for perplexity on code never trained on.
  - "prose-train" / "prose-heldout" / "prose-book": public-domain English books (see
    `prose_corpus`): train on the first; the second holds one document in ten of each book, the
    third one whole book that training never sees (forgetting measured on text of another book).
  - a local folder of .txt / .md / .py / .rst files (one document per file; hidden files and
    folders such as .git or .venv are skipped), or a single such file, cut into documents of about
    PROSE_DOC_CHARS characters at blank lines, its text kept verbatim (`split_text`; whole, one file
    would go all to training or all to validation);
  - a local .jsonl / .json, .parquet, .csv / .tsv or .arrow file, a folder of them, or a pattern
    of files ("data/*.jsonl": one source) (one document per row, text in `text_field`; a field of
    chat messages is rendered with the tokenizer's chat template);
  - a hub dataset name, e.g. "HuggingFaceFW/fineweb-edu" (with `name`/`split`), streamed.
  Several sources mix by listing them: `source: [stdlib, data/prose.jsonl]` (documents interleave).
  A source that looks like a path (a leading . / ~, a data file suffix, more than one /) and does
  not exist is refused, never looked up on the hub; `check_sources` checks a list before any work.

Documents are streamed and tokenized on the fly, so a 20-step run reads 20 steps of data; each
rank x DataLoader worker reads only its own share of every source, and a resume seeks. One
document in about every `val_every` goes to validation, chosen by a hash of its text
(`is_validation`): never to training, whatever the mix or the number of ranks and workers.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from tidar_convert.data.checks import check_sources
from tidar_convert.data.greedy import CorpusSpec, check_corpus, check_greedy
from tidar_convert.data.packing import (
    STDLIB_HELDOUT_EVERY,
    is_validation,
    pack,
    pack_marked,
    tokenize_document,
)
from tidar_convert.data.prose import (
    PROSE_DOC_CHARS,
    PROSE_HELDOUT_BOOK,
    PROSE_HELDOUT_EVERY,
    PROSE_MEMBER,
    PROSE_PARTS,
    PROSE_WHEEL,
    gutenberg_books,
    prose_corpus,
    prose_documents,
    split_prose,
)
from tidar_convert.data.sources import (
    TEXT_SUFFIXES,
    iter_documents,
    split_text,
    stdlib_files,
)
from tidar_convert.data.stream import PackedDocuments, ResumableLoader, _Take, shard

__all__ = [
    "PROSE_DOC_CHARS",
    "PROSE_HELDOUT_BOOK",
    "PROSE_HELDOUT_EVERY",
    "PROSE_MEMBER",
    "PROSE_PARTS",
    "PROSE_WHEEL",
    "STDLIB_HELDOUT_EVERY",
    "TEXT_SUFFIXES",
    "PackedDocuments",
    "ResumableLoader",
    "TiDARData",
    "check_greedy",
    "gutenberg_books",
    "is_validation",
    "iter_documents",
    "pack",
    "pack_marked",
    "prose_corpus",
    "prose_documents",
    "shard",
    "split_prose",
    "stdlib_files",
    "tokenize_document",
    "check_sources",
    "split_text",
]


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
        data_files: str | list[str] | None = None,
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
            shuffle_buffer: training chunks drawn at random from a buffer of this many
                (0 = in order).
            greedy_docs: mix in this many documents made of a real prompt (32 tokens of a training
                document) and the base model's own greedy continuation (self-distillation; made
                once, by rank 0, and cached; see `tidar_convert.train.distill`). 0 = none.
            greedy_new_tokens: length of each greedy continuation.
            greedy_corpus: take the greedy documents (the first greedy_docs) from this file, written
                by `tidar-convert distill` with the same val_every, instead of generating them.
            greedy_share: the greedy documents' share of the training text, in [0, 1], while they
                last (the other sources share the rest equally); None = an equal share with each
                source. Raise greedy_docs to make them last the whole run.
            greedy_ar_loss: False = greedy tokens train the diffusion loss only, never as AR
                targets, so the AR half is not sharpened toward its own greedy loops.
            greedy_dtype: float32, bfloat16 or float16 weights for generating the greedy documents.
            num_workers: DataLoader workers (0 = tokenize in the training process).
            data_files: the files of a hub dataset source to read (a path in its repository, a
                pattern, or a list of them), as `datasets.load_dataset(data_files=...)` selects
                them; for local files give a pattern as the source ('data/*.jsonl').
        """
        super().__init__()
        # in every checkpoint (datamodule_hyper_parameters): a resumed run is refused other data
        # (resume.py)
        self.save_hyperparameters()
        from tidar_convert.train.settings import check_group

        check_group("data", {k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self.sources = [source] if isinstance(source, str) else list(source)
        if not self.sources:
            raise ValueError("source=[]: name at least one data source, e.g. 'stdlib'.")
        if not text_field:
            raise ValueError(
                f"text_field={text_field!r}: name the field of each json/parquet/hub row that "
                "holds its text (the default is text), e.g. --data.text_field text."
            )
        self.seq_len, self.batch_size, self.val_every, self.val_batches = (
            seq_len,
            batch_size,
            val_every,
            val_batches,
        )
        self.text_field, self.name, self.split, self.seed, self.num_workers = (
            text_field,
            name,
            split,
            seed,
            num_workers,
        )
        self.shuffle_buffer, self.greedy_docs, self.greedy_new_tokens = (
            shuffle_buffer,
            greedy_docs,
            greedy_new_tokens,
        )
        check_greedy(greedy_docs, greedy_share, greedy_dtype)
        self.data_files = data_files
        if data_files is not None and greedy_docs > 0 and not greedy_corpus:
            # the greedy corpus is keyed and drawn from the sources alone (train/distill.py)
            raise ValueError(
                f"--data.data_files {data_files!r} with --data.greedy_docs {greedy_docs}: the "
                "greedy documents would be generated from prompts of the whole dataset; make them "
                "with `tidar-convert distill` from the selected files and pass "
                "--data.greedy_corpus, or leave out --data.greedy_docs."
            )
        self.greedy_corpus, self.greedy_share, self.greedy_ar_loss, self.greedy_dtype = (
            greedy_corpus,
            greedy_share,
            greedy_ar_loss,
            greedy_dtype,
        )
        # the base model's name, set by the module: it writes the greedy documents
        self.base_model = None
        self.tokenizer = None  # set by the module (it owns the tokenizer with the mask token)
        # the corpus would never be read: refuse, after checking it
        if greedy_corpus and greedy_docs == 0:
            # a missing or foreign file is named first
            rows = check_corpus(greedy_corpus, val_every, 0)
            raise ValueError(
                f"--data.greedy_corpus {greedy_corpus!r} with --data.greedy_docs 0: none of its "
                f"{rows} documents would be trained on; "
                f"set --data.greedy_docs to how many to mix in (at most {rows}), "
                "or leave out --data.greedy_corpus."
            )

    def check_greedy_corpus(self) -> None:
        """Refuse a --data.greedy_corpus this run cannot train on (see greedy.check_corpus), once
        the base model is known: the module calls this in setup, before any weight is loaded."""
        if self.greedy_corpus and self.greedy_docs > 0:
            check_corpus(self.greedy_corpus, self.val_every, self.greedy_docs, self.base_model)

    def _dataset(self, part: str) -> PackedDocuments:
        if self.tokenizer is None:
            raise RuntimeError(
                "TiDARData.tokenizer is not set; the TiDARModule sets it in setup()."
            )
        rank, world = (
            (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        )
        buffer = self.shuffle_buffer if part == "train" else 0
        sources, greedy = self.sources, {}
        if part == "train" and self.greedy_docs > 0 and self.greedy_share != 0:
            g = len(sources)  # greedy text continues training prompts: it never goes to validation
            sources, greedy = (
                sources + [self._greedy_path()],
                {"train_only": (g,), "max_docs": {g: self.greedy_docs}},
            )
            if self.greedy_share is not None:
                greedy["weights"] = (*[(1 - self.greedy_share) / g] * g, self.greedy_share)
            if not self.greedy_ar_loss:
                greedy["no_ar"] = (g,)
        return PackedDocuments(
            self.tokenizer,
            sources,
            self.seq_len,
            part,
            self.val_every,
            self.text_field,
            self.name,
            self.split,
            self.seed,
            rank,
            world,
            buffer,
            **greedy,
            data_files=self.data_files,
        )

    def _greedy_path(self) -> str:
        """The greedy corpus to read: the given --data.greedy_corpus, or fit's cached one, which
        `distill.corpus_for_data` has made before training starts (this class never loads a
        model)."""
        if self.greedy_corpus:
            check_corpus(self.greedy_corpus, self.val_every, self.greedy_docs, self.base_model)
            return str(Path(self.greedy_corpus).expanduser().absolute())
        path = CorpusSpec.of(self).path
        if not path.is_file():
            raise FileNotFoundError(
                f"--data.greedy_docs {self.greedy_docs}: the greedy corpus {path} has not been "
                "made; `fit` makes it before training "
                "(tidar_convert.train.distill.corpus_for_data(trainer, datamodule)), "
                "or make one with `tidar-convert distill` and pass --data.greedy_corpus."
            )
        return str(path)

    def train_dataloader(self):
        self._train_loader = ResumableLoader(
            self._dataset("train"), batch_size=self.batch_size, num_workers=self.num_workers
        )
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
