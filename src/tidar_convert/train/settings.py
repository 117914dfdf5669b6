"""Every numeric setting of a recipe, with the range where it means something, checked in one place.

`fit` and `validate` check the whole parsed config here before anything is instantiated (no model,
tokenizer or data is read yet); TiDARModule and TiDARData check their own group with the same table,
so the Python API refuses the same values with the same words. Rules that tie settings together
(an anchor needs LoRA, seq_len a multiple of draft_length) stay with the code they concern.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from tidar_convert.runtime.spec import check_draft_length


@dataclass(frozen=True)
class Range:
    """Where a number means something: lo / hi bounds (None = unbounded), open or closed; `none`
    allows null; `also` lists single values allowed outside the range (-1 = "no limit")."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    none: bool = False
    integer: bool = False
    also: tuple = ()
    why: str = ""

    def holds(self, value) -> bool:
        if value is None:
            return self.none
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True  # a type, not a range: the parser checks types
        if value in self.also:
            return True
        if not math.isfinite(value) or (self.integer and value != int(value)):
            return False
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return self.hi is None or not (value > self.hi or (self.hi_open and value == self.hi))

    def text(self) -> str:
        if self.lo is not None and self.hi is not None:
            span = (
                f"in {'(' if self.lo_open else '['}{self.lo:g}, "
                f"{self.hi:g}{')' if self.hi_open else ']'}"
            )
        elif self.lo is not None:
            span = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            span = f"{'<' if self.hi_open else '<='} {self.hi:g}"
        kind = "a whole number " if self.integer else "a finite number "
        extra = "".join(f", or {v}" for v in self.also) + (", or null" if self.none else "")
        return f"must be {kind}{span}{extra}"


def _int(lo, **kw) -> Range:
    return Range(lo=lo, integer=True, **kw)


def _share(**kw) -> Range:  # a fraction of something, both ends allowed
    return Range(lo=0, hi=1, **kw)


MODEL = {
    "alpha": Range(lo=0, why="the AR loss weight; the paper uses 1.0"),
    "warmup_ratio": Range(lo=0, hi=1, hi_open=True, why="the share of max_steps spent warming up"),
    "min_lr_ratio": _share(why="the cosine decay ends at lr x min_lr_ratio; the paper's is 0.3"),
    "lora_r": _int(0, why="0 = full fine-tune, > 0 = LoRA of that rank"),
    "lora_alpha": Range(lo=0, lo_open=True, why="LoRA scales its update by lora_alpha / lora_r"),
    "val_decode_prompts": _int(0, why="held-out prompts decoded at each validation; 0 = off"),
    "distill_weight": _share(why="0 = hard labels only, 1 = AR soft targets only"),
    "distill_temperature": Range(lo=0, lo_open=True, why="1 = the AR distribution as is"),
    "anchor_weight": _share(why="0 = the AR half learns the text"),
}
DATA = {
    "seq_len": _int(2, why="tokens per packed training chunk"),
    "batch_size": _int(1, why="chunks per step and device"),
    "val_every": _int(2, why="one document in this many goes to validation; 1 would send them all"),
    "val_batches": _int(
        1, why="batches per validation; --trainer.limit_val_batches 0 turns it off"
    ),
    "seed": _int(0, why="the order of the data"),
    "shuffle_buffer": _int(0, why="0 = in order"),
    "greedy_docs": _int(0, why="0 = no self-distilled documents"),
    "greedy_new_tokens": _int(1, why="the length of each greedy continuation"),
    "greedy_share": _share(none=True, why="null = an equal share with each source"),
    "num_workers": _int(0, why="0 = tokenize in the training process"),
}
TOP = {
    "global_batch_tokens": _int(1, none=True, why="the paper's recipes use 2097152"),
}
TRAINER = {
    "max_steps": _int(1, also=(-1,), why="-1 stops after --trainer.max_epochs"),
    "min_steps": _int(0, none=True),
    "max_epochs": _int(1, none=True, also=(-1,)),
    "min_epochs": _int(0, none=True),
    "accumulate_grad_batches": _int(1, none=True, why="null = derived from --global_batch_tokens"),
    "gradient_clip_val": Range(lo=0, none=True, why="null or 0 = no clipping"),
    "log_every_n_steps": _int(1, none=True),
    "num_nodes": _int(1),
    "check_val_every_n_epoch": _int(1, none=True),
    "num_sanity_val_steps": _int(0, none=True, also=(-1,)),
}
# val_check_interval and limit_*_batches: a whole number of batches (>= 0), or a share in [0, 1].
BATCHES = ("val_check_interval", "limit_train_batches", "limit_val_batches", "limit_test_batches")
OPTIMIZER = {
    "lr": Range(lo=0, lo_open=True, why="the learning rate; the paper's is 1e-5"),
    "weight_decay": Range(lo=0),
    "eps": Range(lo=0, lo_open=True),
    "momentum": Range(lo=0, hi=1, hi_open=True),
}
GROUPS = {"model": MODEL, "data": DATA, "trainer": TRAINER}
DRAFT_LENGTHS = ("draft_length", "val_decode_draft_length")  # model settings checked by the spec


def out_of_range(flag: str, value, rule: Range) -> ValueError:
    why = f" ({rule.why})" if rule.why else ""
    return ValueError(f"{flag}={value!r}: {rule.text()}{why}.")


def check_group(group: str, values: Mapping[str, Any]) -> None:
    """Refuse the first value of `group` ('model', 'data', 'trainer') outside its range."""
    for name, rule in GROUPS[group].items():
        if name in values and not rule.holds(values[name]):
            raise out_of_range(f"--{group}.{name}", values[name], rule)
    if group == "model":  # the draft length has one check, the TiDAR spec's
        for name in DRAFT_LENGTHS:
            if values.get(name) is not None:
                check_draft_length(values[name], f"--model.{name}")
    if group == "model" and values.get("diff_offset_weights") is not None:
        weights = values["diff_offset_weights"]
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
            raise ValueError(
                f"--model.diff_offset_weights={list(weights)}: every weight must be a finite "
                "number >= 0, e.g. [1.0, 1.0, 1.0, 1.0] (uniform, the default)."
            )
    if group == "trainer":
        for name in BATCHES:
            _check_batches(name, values.get(name))


def _check_batches(name: str, value) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, int) and value >= 0:
        return
    if isinstance(value, float) and math.isfinite(value) and 0 <= value <= 1:
        return
    raise ValueError(
        f"--trainer.{name}={value!r}: must be a whole number of batches (>= 0) or a share of "
        "an epoch in [0.0, 1.0]."
    )


def check_optimizer(optimizer) -> None:
    """The optimizer's own numbers (lr, weight_decay, betas...), as a recipe gives them
    (class_path + init_args): a negative lr trains by gradient ascent without a word."""
    args = _init_args(optimizer)
    for name, rule in OPTIMIZER.items():
        value = args.get(name)
        if value is not None and not rule.holds(value):
            raise out_of_range(f"--model.optimizer.init_args.{name}", value, rule)
    betas = args.get("betas")
    if isinstance(betas, (list, tuple)) and not all(
        isinstance(b, (int, float)) and 0 <= b < 1 for b in betas
    ):
        raise ValueError(
            f"--model.optimizer.init_args.betas={list(betas)}: each must be in [0, 1) "
            "(AdamW's default: [0.9, 0.999])."
        )


def _init_args(optimizer) -> dict:
    if optimizer is None or callable(optimizer) and not hasattr(optimizer, "get"):
        return {}
    get = optimizer.get if hasattr(optimizer, "get") else dict(optimizer).get
    args = get("init_args") or {}
    return dict(args.items()) if hasattr(args, "items") else {}


def check_config(cfg) -> None:
    """The whole parsed config of fit / validate (a jsonargparse Namespace), before any
    instantiation."""
    for name, rule in TOP.items():
        if name in cfg and not rule.holds(cfg.get(name)):
            raise out_of_range(f"--{name}", cfg.get(name), rule)
    for group, table in GROUPS.items():
        section = cfg.get(group)
        if section is not None:
            keys = (*table, *BATCHES, *DRAFT_LENGTHS, "diff_offset_weights")
            check_group(group, {k: section.get(k) for k in keys if k in section})
    if cfg.get("model") is not None:
        check_optimizer(cfg.model.get("optimizer"))
