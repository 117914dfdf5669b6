"""The decoding KV cache: transformers' DynamicLayer with its entries in buffers that have room to
grow (`GrowingLayer`). Shipped in every export's custom_generate/ folder: imports nothing but
torch and transformers.

A DynamicLayer concatenates its whole past with each step's entries into new tensors, every layer,
every forward: an allocation and a copy of the entire cache, O(context) a step, where a step only
adds a few slots (on a CPU, large allocations are fresh pages each time). A TiDAR step then drops
most of what it added (its mask groups, the drafts it rejected), which a DynamicLayer does by
slicing. Here an update writes the new entries after the kept ones, a crop moves a length, and a
tree's kept branch is moved into place inside the buffer (`keep`).

The layers of one cache keep their buffers in one `Store` where their shapes agree (every layer of
a plain decoder): a kept branch is then moved for every layer at once, one index_select and one
copy, where layer by layer it was two per buffer (120 kernels a branch on a 30-layer model; on a
GPU each a launch).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys` and `values` are views of the filled part of two buffers.
    Assigning them (transformers' batch selection and reordering, offloading) replaces the
    buffers, so everything written for a DynamicLayer still works."""

    ROOM = 256  # entries a buffer holds beyond what it must when it grows: a regrowth every ROOM

    def __init__(self, store: "Store | None" = None, **kwargs):
        self._keys = self._values = None
        self.length = 0
        self.slot = None
        super().__init__(**kwargs)  # assigns keys and values: after it, or the layer leaves
        # the cache's shared buffers, and this layer's place in them once it joined (None: its own)
        self.store = store

    @property
    def keys(self):
        return None if self._keys is None else self._keys.narrow(-2, 0, self.length)

    @keys.setter
    def keys(self, tensor):  # transformers' own assignments (batch selection, offloading, reset)
        self.leave()
        self._keys = tensor
        self.length = 0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2]

    @property
    def values(self):
        return None if self._values is None else self._values.narrow(-2, 0, self.length)

    @values.setter
    def values(self, tensor):
        self.leave()
        self._values = tensor
        self.length = 0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2]

    def leave(self) -> None:
        """From now on its own buffers (an assigned tensor replaces the store's view)."""
        if self.slot is not None:
            self.store.members[self.slot] = None
            self.slot = None
        self.store = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self._keys = self._values = None
        self.length = 0
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self.store is not None:
            self.store.make_room(self, key_states, value_states, end)
        if self.slot is not None:  # the store's views, with room
            self._keys[..., start:end, :] = key_states
            self._values[..., start:end, :] = value_states
        else:
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


class Store:
    """One buffer (keys and values, layers, B, heads, entries, dim) for the GrowingLayers of a
    cache, each layer's keys and values a view of it (`members[slot]`), made at the first update and
    grown for all at once. A layer whose shape, dtype or device differs from the first's, whose
    values are not shaped as its keys, or that is assigned a tensor, keeps its own buffers."""

    def __init__(self, layers: int = 8):
        self.buffer: torch.Tensor | None = None
        self.members: list = [None] * layers

    def make_room(self, layer: GrowingLayer, keys: torch.Tensor, values: torch.Tensor, end: int):
        """Before `layer` writes `keys` and `values` up to entry `end`: it joins (first update) and
        the buffer has the entries; a layer that cannot join leaves."""
        if layer.slot is None and not self.join(layer, keys, values, end):
            layer.leave()
            return
        if self.buffer.shape[-2] < end:
            self.resize(end + GrowingLayer.ROOM, len(self.members))

    def join(self, layer: GrowingLayer, keys: torch.Tensor, values: torch.Tensor, end: int) -> bool:
        # it wrote before it joined (its entries are its own), or its values are not shaped as its
        # keys (multi-head latent attention: keys wider than values)
        if layer._keys is not None or (values.shape, values.dtype) != (keys.shape, keys.dtype):
            return False
        if self.buffer is None:
            self.buffer = keys.new_empty(
                2, len(self.members), *keys.shape[:-2], end + GrowingLayer.ROOM, keys.shape[-1]
            )
        elif self.buffer.shape[2:-2] != keys.shape[:-2] or (
            (self.buffer.shape[-1], self.buffer.dtype, self.buffer.device)
            != (keys.shape[-1], keys.dtype, keys.device)
        ):
            return False
        if None not in self.members:  # more layers than made room for
            self.resize(self.buffer.shape[-2], 2 * len(self.members))
        layer.slot = self.members.index(None)
        self.members[layer.slot] = layer
        self.point(layer)
        return True

    def point(self, layer: GrowingLayer) -> None:
        layer._keys, layer._values = self.buffer[0, layer.slot], self.buffer[1, layer.slot]

    def resize(self, entries: int, layers: int) -> None:
        old = self.buffer
        self.buffer = old.new_empty(2, layers, *old.shape[2:-2], entries, old.shape[-1])
        self.buffer[:, : old.shape[1], ..., : old.shape[-2], :] = old
        self.members += [None] * (layers - len(self.members))
        for layer in self.members:
            if layer is not None:
                self.point(layer)

    def keep(self, start: int, index: torch.Tensor) -> list:
        """Every member keeps its first `start` entries, then those at `index`, in one move where
        they all hold the same entries (they do while decoding); returns the members it did not
        move (their entries differ), for the caller to move one by one."""
        members = [layer for layer in self.members if layer is not None]
        if len({layer.length for layer in members}) != 1:
            return members
        self.buffer[..., start : start + len(index), :] = self.buffer.index_select(-2, index)
        for layer in members:
            layer.length = start + len(index)
        return []


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


def growing_cache(layers: int = 8) -> DynamicCache:
    """transformers' DynamicCache made of GrowingLayers (made as layers first update), in one Store
    (room for `layers`, doubled when more join)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(GrowingLayer, Store(layers))
    return cache


def grow_layers(cache: DynamicCache) -> DynamicCache:
    """The cache with each plain DynamicLayer (not a subclass: a sliding window's or a recurrent
    layer's own) replaced by a GrowingLayer, before any update."""
    cache.layers = [
        GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
