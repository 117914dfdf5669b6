"""Static step shapes: `cache_implementation="static"` in TiDAR decoding. Shipped in every export's
custom_generate/ folder: imports nothing but torch and transformers.

What it means in transformers' generate, it means here: the KV cache is allocated once, at a fixed
length, and written in place, so the decoder's forward has the same shapes every step and can be
compiled, and on a GPU captured as a CUDA graph (transformers compiles it by itself where its
auto-compile would: a CUDA device, or `compile_config._compile_all_devices`; never with
`disable_compile`). A TiDAR step's query slots vary with its plan, so each step is padded to a slot
bucket (`bucket`: a power of two, from 8), and a bucket is one compiled graph. On a CPU the same
code runs eager, and so does a model whose vocabulary head is more than `lm_head` (forward.py:
the model's own forward runs there).

Padding slots sit after the step's own: no real query sees them, each sees only itself (no row of a
softmax is empty), and the crop drops them with the step's other unkept slots. Entries past the
step are stale or empty and masked out, so a step's tokens are the dynamic cache's: the tests hold
the two to the same output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache, StaticLayer

from .layout import local_kinds

SMALLEST = 8  # slots: a bucket below this saves nothing a GPU would notice
ROUND = 256  # the cache's length is a multiple of this, so prompts of near lengths share graphs


def bucket(slots: int) -> int:
    """The smallest bucket that holds `slots` query slots: a power of two, at least SMALLEST."""
    size = SMALLEST
    while size < slots:
        size *= 2
    return size


class SlotLayer(StaticLayer):
    """transformers' StaticLayer, cropped as a DynamicLayer is (its own crop: StaticLayer has none
    before transformers 5.25, and an export may meet 5.17), and keeping a tree's branch
    (tree.keep_slots): the kept slots moved in place after the cache's first `start` entries."""

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # DynamicLayer's rule
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove"
            )
        if self.is_initialized:  # the next update overwrites what is dropped
            self.cumulative_length.sub_(-tokens_to_remove)

    def keep(self, start: int, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        for buffer in (self.keys, self.values):
            buffer[..., start : start + len(index), :] = buffer.index_select(-2, index)
        self.cumulative_length.fill_(start + len(index))


@dataclass(frozen=True)
class Slots:
    """A decode's static shapes: a cache of `capacity` entries, steps padded to buckets. `call`:
    the decoder body's compiled call, or None (eager)."""

    capacity: int
    cache: Cache
    call: Callable | None = None

    def pad(self, slots: int, cache_len: int) -> int:
        size = bucket(slots)
        if cache_len + size > self.capacity:  # sized by `static_slots` from the longest step
            raise RuntimeError(
                f"a step of {slots} slots (bucket {size}) after {cache_len} cache entries "
                f"overflows the static cache's {self.capacity}: a bug in its sizing."
            )
        return size


def refuse_static(why: str) -> None:
    raise ValueError(
        f"cache_implementation='static' is not built for this model ({why}); decode it with the "
        "default dynamic cache (leave cache_implementation unset)."
    )


def static_slots(model, session, gc, batch: int, most_slots: int) -> Slots | None:
    """The decode's Slots when `gc.cache_implementation` is "static", else None. most_slots: the
    most query slots a step may run (the planner's budget). Refuses by name what it does not
    cover."""
    if gc.cache_implementation != "static":
        return None
    config = model.config
    if session.recurrent_mixers(model):
        refuse_static("recurrent layers keep a state, not entries a step can overwrite")
    if local_kinds(config) is not None:
        refuse_static("sliding windows or attention chunks")
    if config._attn_implementation == "flex_attention":
        refuse_static("flex_attention builds a block mask per cache length; load it with sdpa")
    # the most a step's cache may hold: every token but the last, then a step's largest bucket
    capacity = -(-(gc.max_length + bucket(most_slots)) // ROUND) * ROUND
    layers = config.get_text_config(decoder=True).num_hidden_layers
    cache = session.static_cache(
        (batch, capacity, model.dtype, str(model.device)),
        lambda: Cache(layers=[SlotLayer(capacity) for _ in range(layers)]),
    )
    for layer in cache.layers:  # a new call starts empty; stale entries are masked out
        if layer.is_initialized:
            layer.cumulative_length.zero_()
    return Slots(capacity, cache, compiled_body(model, session, gc))


def compiled_body(model, session, gc) -> Callable | None:
    """The decoder body's call compiled with gc.compile_config where transformers' generate would
    auto-compile, kept in the session; None (eager) elsewhere. One graph a bucket: shapes are
    static (dynamic=False unless the config says otherwise)."""
    from transformers.generation.configuration_utils import CompileConfig

    from .forward import decoder_body

    config = gc.compile_config or CompileConfig()
    devices = ("cuda", "xpu", "neuron", "tpu", "mps")
    if gc.disable_compile or not (model.device.type in devices or config._compile_all_devices):
        return None
    body = decoder_body(model)
    options = {
        "fullgraph": config.fullgraph,
        "dynamic": False if config.dynamic is None else config.dynamic,
        "backend": config.backend,
        "mode": config.mode,
        "options": config.options,
    }
    if options["mode"] is not None and options["options"] is not None:
        options["options"] = None  # torch.compile takes one of the two; the mode names the options
    if config.backend != "inductor":
        options["mode"] = None  # a mode is the inductor's
    key = (id(body), tuple((k, repr(v)) for k, v in options.items()))
    return session.compiled_call(key, lambda: torch.compile(body.__call__, **options))
