"""The greedy-document side of the data: the settings checked, and the corpus file the DataModule reads."""

from __future__ import annotations


def check_greedy(greedy_docs: int, greedy_share: float | None, greedy_dtype: str) -> None:
    from ..distill import DTYPES

    if greedy_docs < 0:
        raise ValueError(f"greedy_docs={greedy_docs}: must be >= 0 (0 = no self-distilled documents).")
    if greedy_share is not None and not 0 <= greedy_share <= 1:
        raise ValueError(f"greedy_share={greedy_share}: must be in [0, 1] (the greedy documents' share of the training text), or null for an equal share.")
    if greedy_share and greedy_docs == 0:
        raise ValueError(f"greedy_share={greedy_share} with greedy_docs=0: there are no greedy documents to mix in; set --data.greedy_docs (e.g. 384).")
    if greedy_dtype not in DTYPES:
        raise ValueError(f"greedy_dtype={greedy_dtype!r}: use one of {', '.join(DTYPES)}.")

