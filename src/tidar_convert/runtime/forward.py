"""One decoding forward: the decoder body on every query slot, the vocabulary head on the rows the
step may read (`Output`). Shipped in every export's custom_generate/ folder: imports nothing but
torch and transformers."""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from .adapter import mask_rows
from .layout import local_kinds
from .recurrent import Segments, layout
from .transfer import on_device

_OFF = contextlib.nullcontext()


def phase(name: str):
    """record_function(name) while a profiler runs (the bench's step breakdown), else nothing:
    entering a record_function creates a profiler event through the dispatcher even when no profiler
    listens, about 6 us, and a step enters ten."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _OFF


# False: the vocabulary head on every slot, as a plain model forward does. Only tests change it, to
# show the read-rows-only head gives the same tokens.
READ_ROWS_ONLY = True


@functools.lru_cache(maxsize=None)
def takes(cls, name: str) -> bool:
    """`cls.forward` has a parameter `name`: asked every step, and reading a signature costs more
    than some of a step's kernels."""
    return name in inspect.signature(cls.forward).parameters


def cache_kwargs(model, cache) -> dict:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name goes in 5.40)."""
    name = "cache" if takes(type(model), "cache") else "past_key_values"
    return {name: cache, "use_cache": True}


# Config fields through which a family's causal-LM head does more than `lm_head(hidden)`.
# Softcapping is applied here; for the others the engine runs the model's own forward (all rows
# through the head).
SOFTCAP = "final_logit_softcapping"
OTHER_HEAD_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def head_is_plain(model) -> bool:
    # A module named lm_head that is not the output embeddings is a prediction head before them
    # (ModernBERT-decoder: dense, activation, norm): only the model's own forward applies it.
    head = getattr(model, "lm_head", None)
    return (
        READ_ROWS_ONLY
        and (head is None or head is model.get_output_embeddings())
        and not any(
            getattr(model.config, f, None) not in (None, 1, 1.0) for f in OTHER_HEAD_TRANSFORMS
        )
    )


def slots_of(x: torch.Tensor, slots: list[int], index: torch.Tensor | None = None) -> torch.Tensor:
    """x[:, slots]: a view where the slots are a run (none included), else one index_select, by
    `index` (the slots on x's device) where given (indexing with the list itself parses it each
    call and runs torch's general index kernel, several times slower on a CPU for a step's few
    slots; and on a GPU, an index made from a list is a copy that waits for the device)."""
    first = slots[0] if slots else 0
    if slots == list(range(first, first + len(slots))):
        return x[:, first : first + len(slots)]
    return x.index_select(1, on_device(slots, x.device) if index is None else index)


class Output:
    """One forward's result; `rows(i, j)` are the logits of query slots i..j-1.

    The vocabulary head runs once, on the slots `read` that the step may read (its AR rows and the
    draft slots of its groups), not on every slot: at batch 1 the head's weight (V x hidden) is read
    from memory once per call whatever the row count, so one call on all candidate rows costs less
    than a call for the AR rows and another for the group the next draft reads (measured on CPU:
    bench/LOG.md, 2026-12-01, one vocabulary-head call). A slot outside `read` is computed when
    asked."""

    def __init__(
        self,
        model,
        hidden=None,
        logits=None,
        read: list[int] | None = None,
        index: torch.Tensor | None = None,
        parts: Parts | None = None,
    ):
        self.hidden, self.logits, self.head_rows = hidden, logits, 0
        self.lm_head, self.softcap = (
            (parts.head, parts.softcap)
            if parts is not None
            else (model.get_output_embeddings(), getattr(model.config, SOFTCAP, None))
        )
        self.cached, self._where = None, None
        self.row_of: dict[int, int] = {}  # slot -> its row of `cached`, known on the host
        if hidden is not None and read:
            self.row_of = {slot: row for row, slot in enumerate(read)}
            self.cached = self.head(slots_of(hidden, read, index))
            self.head_rows = len(read)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        if self.logits is not None:
            return self.logits[:, start:stop]
        first = self.row_of.get(start)
        # the read rows are in slot order, so a run of slots is a slice of `cached`: a view, and
        # no index sent to the device
        if first is not None and all(
            self.row_of.get(slot) == first + slot - start for slot in range(start, stop)
        ):
            return self.cached[:, first : first + stop - start]
        self.head_rows += stop - start
        return self.head(self.hidden[:, start:stop])

    @property
    def where(self) -> torch.Tensor | None:
        """(slots,) each slot's row of `cached`, -1 where not read (rows_at's lookup)."""
        if self._where is None and self.cached is not None:
            self._where = torch.full(
                (self.hidden.shape[1],), -1, dtype=torch.long, device=self.hidden.device
            )
            read = list(self.row_of)
            self._where[read] = torch.arange(len(read), device=self.hidden.device)
        return self._where

    def rows_at(
        self, starts: torch.Tensor, n: int, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Slots starts[b] .. starts[b] + n - 1 of each row b (rows that read different groups); a
        row with counts[b] < n gets its first slot again past those (filler, already computed)."""
        index = starts[:, None] + torch.arange(n, device=starts.device)
        if counts is not None:
            index = torch.where(
                torch.arange(n, device=starts.device) < counts[:, None], index, starts[:, None]
            )
        if self.logits is not None:
            return self.logits.gather(1, index[..., None].expand(-1, -1, self.logits.shape[-1]))
        where = self.where
        if where is not None and bool((where[index] >= 0).all()):
            return self.cached.gather(
                1, where[index][..., None].expand(-1, -1, self.cached.shape[-1])
            )
        self.head_rows += n
        return self.head(
            self.hidden.gather(1, index[..., None].expand(-1, -1, self.hidden.shape[-1]))
        )

    def head(self, hidden):
        with phase("tidar.lm_head"):
            logits = self.lm_head(hidden)
            cap = self.softcap
            return torch.tanh(logits / cap) * cap if cap else logits


def decoder_body(model):
    """The decoder without the head, final norm included: its last_hidden_state is what lm_head
    reads. The base model first: get_decoder() returns the causal LM itself for Llama 4 (whose
    output has no last_hidden_state), and ModernBERT-decoder's LM head (a Linear named
    `decoder`)."""
    for get in (lambda: model.base_model, model.get_decoder, lambda: getattr(model, "model", None)):
        body = get()
        if body is not None and body is not model and takes(type(body), "input_ids"):
            return body
    return model.get_decoder()


@dataclass(frozen=True)
class Parts:
    """What a decoding forward reads of the model, read once a generate() call (`model_parts`):
    in transformers 5.25 a config attribute costs about 3 us and get_output_embeddings() about 10,
    and a step asked for a dozen."""

    body: object | None  # the decoder body where the head is plain (head_is_plain), else None
    head: object  # the output embeddings
    softcap: float | None
    attn: str | None  # config._attn_implementation: the mask's format
    local: dict | None  # layout.local_kinds(config): sliding windows and chunks


def model_parts(model) -> Parts:
    """The model's Parts as they are now (in cpu_kernels, its attention is the kernels' own)."""
    config = model.config
    return Parts(
        decoder_body(model) if head_is_plain(model) else None,
        model.get_output_embeddings(),
        getattr(config, SOFTCAP, None),
        getattr(config, "_attn_implementation", None),
        local_kinds(config),
    )


def forward(
    model,
    cache,
    tokens,
    positions,
    mask,
    read: list[int] | None = None,
    segments: Segments | None = None,
    mixers: list | None = None,
    call=None,
    groups_from: int | None = None,
    read_index: torch.Tensor | None = None,
    parts: Parts | None = None,
) -> Output:
    """read: the slots whose logits the step may read, computed in one vocabulary-head call
    (read_index: the same on the device, or None).
    segments: how the model's recurrent `mixers` run the slots (recurrent.py); None without any.
    call: the decoder body's compiled call (slots.compiled_body), or None. groups_from: the first
    slot of the mask groups (every slot from there on is a mask slot, in every row), or None:
    what a mask-slot adapter's gate is told (adapter.mask_rows). parts: the model's Parts (read
    here where not given)."""
    parts = parts or model_parts(model)
    rows = groups_from
    if call is not None and groups_from is not None:  # as a tensor: one graph for every value
        slots = torch.arange(tokens.shape[1], device=tokens.device)
        rows = (slots >= groups_from).expand(tokens.shape[0], -1)
    with phase("tidar.forward"), layout(mixers or [], segments), mask_rows(model, rows):
        if parts.body is not None:
            if call is not None:  # a CUDA graph's outputs live until its next replay: a new step
                torch.compiler.cudagraph_mark_step_begin()
            out = (call or parts.body)(
                input_ids=tokens,
                position_ids=positions,
                attention_mask=mask,
                **cache_kwargs(parts.body, cache),
            )
            return Output(model, out.last_hidden_state, read=read, index=read_index, parts=parts)
        out = model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=mask,
            **cache_kwargs(model, cache),
        )
        result = Output(model, logits=out.logits, parts=parts)
        result.head_rows = tokens.shape[1]
        return result
