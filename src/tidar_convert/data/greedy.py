"""The greedy-document side of the data: the settings checked, and the corpus file the DataModule
reads."""

from __future__ import annotations

import hashlib
import json
from dataclasses import astuple, dataclass
from pathlib import Path

from tidar_convert.models.loading import cache_dir, same_model

# in every row: what marks a file as a corpus this tool may replace
MADE_BY = "tidar-convert distill"
DTYPES = ("float32", "bfloat16", "float16")
PROMPT_TOKENS = 32  # tokens of a training document that start each of fit's greedy documents


def check_greedy(greedy_docs: int, greedy_share: float | None, greedy_dtype: str) -> None:
    if greedy_docs < 0:
        raise ValueError(
            f"greedy_docs={greedy_docs}: must be >= 0 (0 = no self-distilled documents)."
        )
    if greedy_share is not None and not 0 <= greedy_share <= 1:
        raise ValueError(
            f"greedy_share={greedy_share}: must be in [0, 1] (the greedy documents' share of the "
            "training text), or null for an equal share."
        )
    if greedy_share and greedy_docs == 0:
        raise ValueError(
            f"greedy_share={greedy_share} with greedy_docs=0: there are no greedy documents to mix "
            "in; set --data.greedy_docs (e.g. 384)."
        )
    if greedy_dtype not in DTYPES:
        raise ValueError(f"greedy_dtype={greedy_dtype!r}: use one of {', '.join(DTYPES)}.")


def first_row(path: str | Path) -> dict | None:
    """The first row of a jsonl file, or None if it has none that parses as a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            row = json.loads(f.readline())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return row if isinstance(row, dict) else None


def check_corpus(path: str, val_every: int, n_docs: int, model: str | None = None) -> int:
    """The number of rows of a corpus `fit` may train on (`--data.greedy_corpus`); refuses one that
    is missing, was not written by `distill`, was split with another val_every, is too short, or
    (given the run's base `model`; None = not known) was written by another base model, whose greedy
    text is not what this model's drafts are verified against."""
    fix = (
        f"make one with `tidar-convert distill --model {model or 'M'} --sources ... "
        f"--val_every {val_every} --out {path}`"
    )
    if not Path(path).is_file():
        raise FileNotFoundError(f"--data.greedy_corpus {path!r} does not exist; {fix}.")
    first = first_row(path)
    if first is None or first.get("made_by") != MADE_BY:
        raise ValueError(
            f"--data.greedy_corpus {path!r} was not written by `tidar-convert distill`, so nothing "
            f"says its prompts are training documents; {fix}."
        )
    if first.get("val_every") != val_every:
        raise ValueError(
            f"--data.greedy_corpus {path!r} took its prompts from a split with "
            f"val_every={first.get('val_every')}, and this run holds out "
            f"documents with val_every={val_every}: some prompts could be this run's validation "
            "documents. Pass --data.val_every "
            f"{first.get('val_every')}, or {fix}."
        )
    made_by = first.get("model")
    if model is not None and made_by is not None and not same_model(made_by, model):
        raise ValueError(
            f"--data.greedy_corpus {path!r} holds the greedy text of the base model {made_by!r}, "
            f"and this run trains {model!r}: "
            "its drafts would learn another model's text, which verification then rejects; "
            f"pass --model.model {made_by}, or {fix}."
        )
    with open(path, encoding="utf-8") as f:
        rows = sum(1 for line in f if line.strip())
    if rows < n_docs:
        raise ValueError(
            f"--data.greedy_corpus {path!r} holds {rows} documents and --data.greedy_docs asks "
            f"for {n_docs}; lower --data.greedy_docs to {rows}, or make a larger corpus."
        )
    return rows


@dataclass(frozen=True)
class CorpusSpec:
    """What a greedy corpus is made of: `n_docs` documents, each `prompt_tokens` of a training
    document (of `sources`, as `fit --data` reads them, never a validation one) and then
    `new_tokens` of `model`'s greedy continuation in `dtype`. `distill` writes one where asked;
    `fit` keeps one per spec in the cache (`path`)."""

    model: str | None
    sources: tuple[str, ...]
    n_docs: int
    val_every: int
    prompt_tokens: int
    new_tokens: int
    text_field: str
    name: str | None
    split: str
    seed: int
    dtype: str

    @classmethod
    def of(cls, dm) -> CorpusSpec:
        """The corpus `fit --data.greedy_docs` trains on, from the data module's settings."""
        return cls(
            dm.base_model,
            tuple(dm.sources),
            dm.greedy_docs,
            dm.val_every,
            PROMPT_TOKENS,
            dm.greedy_new_tokens,
            dm.text_field,
            dm.name,
            dm.split,
            dm.seed,
            dm.greedy_dtype,
        )

    @property
    def path(self) -> Path:
        """Where `fit` keeps this corpus: computed alike on every rank, without the model."""
        # every field in declaration order, as the first versions keyed it (a test pins the key)
        key = json.dumps([self.model or "default", list(self.sources), *astuple(self)[2:]])
        return cache_dir() / "greedy" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.jsonl"
