"""TiDARSpec: what makes a model a TiDAR model, validated once, written to and read from its config
in this one place.

`draft_length` is the paper's k: the tokens of one mask block in training, and so the drafts one
mask group proposes per decoding step. (Not the context length, which nanoGPT, LitGPT and gpt-fast
call block_size: that name is gone from this toolkit, and old exports that wrote it still load.)

In config.json an export holds `mask_token_id` beside the other special-token ids, and everything
else under one key:

    "tidar": {"draft_length": 4, "alpha": 1.0, "adapter": {...}, "base_model": "HuggingFaceTB/..."}

Exports written before 2026-12-06 hold `block_size`, `alpha`, `tidar_adapter` and
`tidar_base_model` at the top level instead; `from_config` reads both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

KEY = "tidar"
# The fields of the first format, top-level in config.json: (old name, field).
LEGACY = (
    ("block_size", "draft_length"),
    ("alpha", "alpha"),
    ("tidar_adapter", "adapter"),
    ("tidar_base_model", "base_model"),
)


def check_draft_length(value, flag: str = "draft_length") -> int:
    """The one check of a draft length; `flag` is the name the caller's user typed."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(
            f"{flag}={value!r}: TiDAR drafts at least 2 tokens per step (one mask block of "
            "draft_length tokens); use 2 or more, a whole number (the paper uses 4, 8 or 16)."
        )
    return value


@dataclass(frozen=True)
class TiDARSpec:
    """draft_length: k, mask tokens per block (training) and drafts per mask group (decoding).
    mask_token_id: the token the mask slots hold. alpha: the AR loss weight the model was trained
    with, L = (alpha * L_AR + L_Diff) / (1 + alpha) (recorded; decoding does not use it).
    adapter: the mask-slot adapter an export keeps apart (lora_scope='masks': its file, energy,
    ranks, layers), None where the weights hold everything. base_model: where the base came from
    (a hub id or path), which bench and quality compare against."""

    draft_length: int
    mask_token_id: int | None = None
    alpha: float = 1.0
    adapter: dict | None = None
    base_model: str | None = None

    def __post_init__(self):
        check_draft_length(self.draft_length)
        mask = self.mask_token_id
        if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int) or mask < 0):
            raise ValueError(f"mask_token_id={mask!r}: must be a token id (an integer >= 0).")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise ValueError(f"alpha={self.alpha!r}: must be a number >= 0 (the paper uses 1.0).")
        if not math.isfinite(self.alpha) or self.alpha < 0:
            raise ValueError(f"alpha={self.alpha!r}: must be a finite number >= 0 (paper: 1.0).")
        if self.adapter is not None and "file" not in self.adapter:
            raise ValueError(f"adapter={self.adapter!r}: names no file.")

    @property
    def mask_scoped(self) -> bool:
        """Whether the drafts come from an adapter on mask slots, kept apart from the weights."""
        return self.adapter is not None

    def write(self, config) -> None:
        """Set these fields on a transformers config (saved with it as config.json)."""
        config.mask_token_id = self.mask_token_id
        fields = {k: v for k, v in asdict(self).items() if k != "mask_token_id" and v is not None}
        setattr(config, KEY, fields)

    @classmethod
    def from_config(cls, config) -> TiDARSpec | None:
        """The spec a config holds (a transformers config or config.json's dict), in either format;
        None where it holds none (not a TiDAR model)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        fields = get(KEY)
        if fields is None:
            # the first format wrote all three; a base config may hold a block_size of its own
            if any(get(old) is None for old in ("block_size", "alpha", "mask_token_id")):
                return None
            fields = {new: get(old) for old, new in LEGACY if get(old) is not None}
        unknown = set(fields) - {f for f in cls.__dataclass_fields__ if f != "mask_token_id"}
        if unknown:
            raise ValueError(
                f"config.json's {KEY!r} holds {sorted(unknown)}, which this version of "
                "tidar-convert does not know: the export is newer; upgrade tidar-convert, or load "
                "the export with its own code (trust_remote_code=True)."
            )
        return cls(mask_token_id=get("mask_token_id"), **fields)
