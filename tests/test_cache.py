"""The decoding KV cache (runtime/cache.py): a GrowingLayer holds what a DynamicLayer holds through
any run of updates, crops, kept branches and batch selections, without copying its past on an
update; the kernel library's attention reads its filled part where it lies."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from tidar_convert.runtime import panel
from tidar_convert.runtime.cache import GrowingLayer, growing_cache
from tidar_convert.runtime.tree import keep_slots


def test_a_growing_layer_holds_what_a_dynamic_layer_holds():
    gen = torch.Generator().manual_seed(0)
    grown, plain = GrowingLayer(), DynamicLayer()
    GrowingLayer.ROOM = 5  # regrow often (restored below)
    try:
        for step in range(60):
            new = torch.randn(2, 3, int(torch.randint(1, 9, (1,), generator=gen)), 4, generator=gen)
            a, b = grown.update(new, -new), plain.update(new, -new)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            kind = step % 4
            drop = int(torch.randint(0, new.shape[2] + 1, (1,), generator=gen))
            if kind == 1 and drop:  # a step's rejected slots
                grown.crop(-drop)
                plain.crop(-drop)
            elif kind == 2:  # a tree's branch: some of the step's slots, in order
                start = plain.get_seq_length() - new.shape[2]
                keep = sorted(torch.randperm(new.shape[2], generator=gen)[:drop].tolist())
                index = torch.tensor([*range(start), *(start + s for s in keep)])
                plain.keys, plain.values = (
                    plain.keys.index_select(-2, index),
                    plain.values.index_select(-2, index),
                )
                grown.keep(start, torch.tensor([start + s for s in keep], dtype=torch.long))
            elif kind == 3 and step % 8 == 3:  # a batch row dropped, then back to two
                rows = torch.tensor([1, 1])
                grown.batch_select_indices(rows)
                plain.batch_select_indices(rows)
            assert grown.get_seq_length() == plain.get_seq_length()
            assert torch.equal(grown.keys, plain.keys) and torch.equal(grown.values, plain.values)
    finally:
        GrowingLayer.ROOM = 256


def test_an_update_writes_into_the_buffer_without_copying_the_past():
    layer = GrowingLayer()
    layer.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
    buffer = layer._keys
    keys, _ = layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert layer._keys is buffer and keys.data_ptr() == buffer.data_ptr()
    layer.crop(-2)
    assert layer.get_seq_length() == 11 and layer._keys is buffer


def test_keep_slots_keeps_a_branch_in_growing_and_plain_layers_alike():
    cache, reference = growing_cache(), growing_cache()
    reference.layer_class_to_replicate = DynamicLayer
    for c in (cache, reference):
        torch.manual_seed(0)
        for layer in range(3):
            c.update(torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4), layer)
        keep_slots(c, 7, [0, 2, 4])
    assert [type(layer) for layer in cache.layers] == [GrowingLayer] * 3
    for a, b in zip(cache.layers, reference.layers):
        assert a.get_seq_length() == b.get_seq_length() == 10
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.skipif(panel.panel_library() is None, reason="no C compiler with OpenMP")
@pytest.mark.parametrize("batch,heads", [(1, 1), (1, 3), (2, 3), (2, 1)])
def test_the_kernels_attention_reads_a_buffers_filled_part_where_it_lies(batch, heads):
    torch.manual_seed(0)
    buffer = torch.randn(2, batch, heads, 40, 16)  # keys and values, 40 entries of room
    keys, values = buffer[0].narrow(-2, 0, 25), buffer[1].narrow(-2, 0, 25)
    assert panel.rows_apart(keys)[0] is keys  # read where it lies: no copy
    query = torch.randn(batch, heads * 2, 5, 16)
    mask = torch.rand(batch, 1, 5, 25) > 0.3
    mask[..., -5:] = True
    out = panel.attention(query, keys, values, mask, False, 0.25)
    expected = panel.attention(query, keys.contiguous(), values.contiguous(), mask, False, 0.25)
    assert torch.equal(out, expected)


def test_a_caches_layers_share_one_store_and_keep_a_branch_in_one_move(monkeypatch):
    """growing_cache: its layers' buffers are views of one Store (made with room for 2 layers here,
    so it doubles as they join), and keep_slots moves every member's branch in one index_select,
    with what a DynamicLayer cache holds after any run of updates, crops and kept branches; a layer
    of another shape keeps its own buffers, and a layer assigned a tensor (a batch selection)
    leaves the store."""
    gen = torch.Generator().manual_seed(0)
    cache, reference = growing_cache(2), growing_cache()
    reference.layer_class_to_replicate = DynamicLayer
    monkeypatch.setattr(GrowingLayer, "ROOM", 5)  # regrow often
    heads = [2, 2, 1, 2, 2]  # layer 2's shape differs: its own buffers
    selects = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(
        torch.Tensor, "index_select", lambda t, *a: selects.append(t.dim()) or real(t, *a)
    )
    for step in range(40):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        for c in (cache, reference):
            for layer, h in enumerate(heads):
                g = torch.Generator().manual_seed(step * 10 + layer)
                new = torch.randn(2, h, n, 4, generator=g)
                c.update(new, -new, layer)
        drop = int(torch.randint(0, n + 1, (1,), generator=gen))
        if step % 3 == 1 and drop:
            cache.crop(-drop)
            reference.crop(-drop)
        elif step % 3 == 2:
            start = reference.get_seq_length() - n
            keep = sorted(torch.randperm(n, generator=gen)[:drop].tolist())
            selects.clear()
            keep_slots(cache, start, keep)
            # the store's members at once (a 6-d buffer), layer 2 alone: 2 of its buffers
            assert selects == [6, 4, 4]
            keep_slots(reference, start, keep)
        for a, b in zip(cache.layers, reference.layers):
            assert a.get_seq_length() == b.get_seq_length()
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    store = cache.layers[0].store
    assert [layer.slot for layer in cache.layers] == [0, 1, None, 2, 3]
    assert len(store.members) == 4 and cache.layers[2].store is None
    assert cache.layers[3].keys.untyped_storage().data_ptr() == store.buffer.data_ptr()
    cache.batch_select_indices(torch.tensor([1]))  # transformers assigns each layer's tensors
    reference.batch_select_indices(torch.tensor([1]))
    assert all(layer.store is None for layer in cache.layers) and not any(store.members)
    for c in (cache, reference):
        for layer, h in enumerate(heads):
            c.update(torch.ones(1, h, 3, 4), torch.ones(1, h, 3, 4), layer)
    for a, b in zip(cache.layers, reference.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_layer_whose_values_are_narrower_than_its_keys_keeps_its_own_buffers():
    """Multi-head latent attention (DeepSeek-V3) caches keys wider than values: such a layer stays
    out of the store, beside layers in it, and keeps a branch as a DynamicLayer does."""
    cache, reference = growing_cache(), growing_cache()
    reference.layer_class_to_replicate = DynamicLayer
    for c in (cache, reference):
        torch.manual_seed(0)
        for layer in range(3):
            keys = torch.randn(1, 2, 12, 4)
            values = torch.randn(1, 2, 12, 2) if layer == 1 else -keys
            c.update(keys, values, layer)
        keep_slots(c, 7, [0, 2, 4])
    assert [layer.slot for layer in cache.layers] == [0, None, 1]
    for a, b in zip(cache.layers, reference.layers):
        assert a.get_seq_length() == b.get_seq_length() == 10
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
