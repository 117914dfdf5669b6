"""The decoding KV cache: transformers' DynamicLayer with its entries in buffers that have room to
grow (`GrowingLayer`). Shipped in every export's custom_generate/ folder: imports nothing but
torch and transformers.

A DynamicLayer concatenates its whole past with each step's entries into new tensors, every layer,
every forward: an allocation and a copy of the entire cache, O(context) a step, where a step only
adds a few slots (on a CPU, large allocations are fresh pages each time). A TiDAR step then drops
most of what it added (its mask groups, the drafts it rejected), which a DynamicLayer does by
slicing. Here an update writes the new entries after the kept ones, a crop moves a length, and a
tree's kept branch is moved into place inside the buffer (`keep`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys` and `values` are views of the filled part of two buffers.
    Assigning them (transformers' batch selection and reordering, offloading) replaces the
    buffers, so everything written for a DynamicLayer still works."""

    ROOM = 256  # entries a buffer holds beyond what it must when it grows: a regrowth every ROOM

    def __init__(self, **kwargs):
        self._keys = self._values = None
        self.length = 0
        super().__init__(**kwargs)

    @property
    def keys(self):
        return None if self._keys is None else self._keys.narrow(-2, 0, self.length)

    @keys.setter
    def keys(self, tensor):
        self._keys = tensor
        self.length = 0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2]

    @property
    def values(self):
        return None if self._values is None else self._values.narrow(-2, 0, self.length)

    @values.setter
    def values(self, tensor):
        self._values = tensor
        self.length = 0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self._keys = self._values = None
        self.length = 0
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._keys = write(self._keys, key_states, start, end, self.ROOM)
        self._values = write(self._values, value_states, start, end, self.ROOM)
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # DynamicLayer's rule
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove"
            )
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Keep the first `start` entries, then the entries at `index` (positions >= start, in
        order): a tree's branch, moved to follow the kept past."""
        if not self.is_initialized or self._keys is None:
            return
        for buffer in (self._keys, self._values):
            buffer[..., start : start + len(index), :] = buffer.index_select(-2, index)
        self.length = start + len(index)


def write(buffer, new: torch.Tensor, start: int, end: int, room: int) -> torch.Tensor:
    """`buffer` with `new` at entries start..end, grown (its first `start` entries copied) where it
    is too small or shaped for another batch."""
    if buffer is None or buffer.shape[-2] < end or buffer.shape[:-2] != new.shape[:-2]:
        grown = new.new_empty(*new.shape[:-2], end + room, new.shape[-1])
        if start:
            grown[..., :start, :] = buffer[..., :start, :]
        buffer = grown
    buffer[..., start:end, :] = new
    return buffer


def growing_cache() -> DynamicCache:
    """transformers' DynamicCache made of GrowingLayers (made as layers first update)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def grow_layers(cache: DynamicCache) -> DynamicCache:
    """The cache with each plain DynamicLayer (not a subclass: a sliding window's or a recurrent
    layer's own) replaced by a GrowingLayer, before any update."""
    cache.layers = [
        GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
