"""cache_implementation="static" (runtime/slots.py): steps padded to slot buckets over a static KV
cache decode what the dynamic cache decodes, greedy, sampled, in trees and in padded batches; the
decoder's forward compiles to one graph a bucket, kept across calls; what it does not cover is
refused by name before any work."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ar, cycle_batch, tiny_config, tiny_tokenizer
from transformers import AutoModelForCausalLM, CompileConfig

from tidar_convert.runtime import slots as slots_module
from tidar_convert.runtime.generate import generate
from tidar_convert.runtime.layout import in_slots
from tidar_convert.runtime.session import reset, session_of
from tidar_convert.runtime.spec import TiDARSpec

STATIC = {"cache_implementation": "static"}


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    sizes = {q: slots_module.bucket(q) for q in (1, 7, 8, 9, 16, 17, 20, 96)}
    assert sizes == {1: 8, 7: 8, 8: 8, 9: 16, 16: 16, 17: 32, 20: 32, 96: 128}


def test_padding_slots_see_only_themselves_and_no_step_slot_sees_them():
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(2, 1, 5, 12, generator=g) > 0.5  # 7 cache entries, 5 step slots
    padded = in_slots(dense, 8, 32)
    assert padded.shape == (2, 1, 8, 32)
    assert torch.equal(padded[..., :5, :12], dense)
    assert not padded[..., :5, 12:].any()  # the padding and the stale entries past the step
    for q in range(5, 8):  # a padding slot at column 7 + q
        assert padded[..., q, :].sum().item() == 2 and padded[..., q, 7 + q].all()


def test_a_slot_layer_holds_what_a_dynamic_layer_holds():
    """Through random steps (a bucket written, its unkept slots cropped or a branch kept), the
    static layer's first entries are the dynamic layer's."""
    from transformers.cache_utils import DynamicLayer

    gen = torch.Generator().manual_seed(0)
    static, plain = slots_module.SlotLayer(256), DynamicLayer()
    for _ in range(40):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        new = torch.randn(2, 3, n, 4, generator=gen)
        start = plain.get_seq_length()
        static.update(new, -new)
        plain.update(new, -new)
        size = int(torch.randint(0, n + 1, (1,), generator=gen))
        keep = sorted(torch.randperm(n, generator=gen)[:size].tolist())
        if keep == list(range(size)):  # a prefix of the step: the rest cropped
            static.crop(-(n - size))
            plain.crop(-(n - size))
        else:  # a branch, moved into place
            static.keep(start, torch.tensor([start + s for s in keep], dtype=torch.long))
            index = torch.tensor([*range(start), *(start + s for s in keep)])
            plain.keys = plain.keys.index_select(-2, index)
            plain.values = plain.values.index_select(-2, index)
        length = plain.get_seq_length()
        assert int(static.get_seq_length()) == length
        assert torch.equal(static.keys[..., :length, :], plain.keys)
        assert torch.equal(static.values[..., :length, :], plain.values)


def padded_steps(monkeypatch) -> list:
    """(slots, bucket) of every static step from now on."""
    seen, pad = [], slots_module.Slots.pad

    def spy(self, slots, cache_len):
        seen.append((slots, pad(self, slots, cache_len)))
        return seen[-1][1]

    monkeypatch.setattr(slots_module.Slots, "pad", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_static_cache_decodes_what_the_dynamic_one_does(trained, untrained, family, monkeypatch):
    seen = padded_steps(monkeypatch)
    for model in (trained[family][0], untrained[family]):
        for seed in range(3):
            ids = cycle_batch(1, 3 + 2 * seed, seed=seed)
            expected = ar(model, ids, max_new_tokens=30, eos_token_id=None)
            for drafter in ("hybrid", "diffusion"):
                got = generate(
                    ids,
                    model=model,
                    max_new_tokens=30,
                    eos_token_id=None,
                    drafter=drafter,
                    **STATIC,
                )
                assert torch.equal(got, expected), (family, seed, drafter)
    assert any(b > s for s, b in seen)  # steps were padded
    assert len({b for _, b in seen}) >= 2  # and took more than one bucket


def test_a_tree_branch_is_kept_in_the_static_cache(trained):
    """The lookup tree of test_drafters' decoy prompt commits siblings: the branch is moved inside
    the static buffers (SlotLayer.keep), and the output is AR's."""
    model, _ = trained["llama"]
    ids = torch.tensor([[6, 7, 1, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6]])
    expected = ar(model, ids, max_new_tokens=24, eos_token_id=None)
    session_of(model).costs.clear()
    kw = dict(max_new_tokens=24, eos_token_id=None, drafter="lookup", plan="adaptive")
    got = generate(ids, model=model, slot_budget=40, **kw, **STATIC)
    assert torch.equal(got, expected)
    assert model.tidar_stats["sibling_steps"] > 0


def test_a_padded_batch_with_holes_and_sampling_match_the_dynamic_cache(trained):
    """Per-row acceptance leaves holes in the cache and, with a static cache, keeps stopped rows in
    the batch (its shapes stay); sampled tokens follow the seed whatever the cache."""
    model, _ = trained["qwen3"]
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([cycle_batch(3, 8, seed=1)[:, :8], torch.randint(1, 300, (1, 8), generator=g)])
    mask = torch.ones_like(ids)
    for row, pad in enumerate([3, 0, 5, 1]):
        ids[row, :pad], mask[row, :pad] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=30, pad_token_id=0)
    expected = ar(model, ids, eos_token_id=None, **kw)
    assert torch.equal(generate(ids, model=model, eos_token_id=None, **kw, **STATIC), expected)
    # rows that stop early (EOS on a token the cycle holds) stay in the static batch
    eos = int(expected[0, 10])
    assert torch.equal(
        generate(ids, model=model, eos_token_id=eos, **kw, **STATIC),
        ar(model, ids, eos_token_id=eos, **kw),
    )
    sampled = dict(do_sample=True, temperature=0.9, eos_token_id=None, **kw)
    torch.manual_seed(3)
    dynamic = generate(ids, model=model, **sampled)
    torch.manual_seed(3)
    assert torch.equal(generate(ids, model=model, **sampled, **STATIC), dynamic)


def test_the_forward_compiles_to_one_graph_a_bucket_kept_across_calls(trained, monkeypatch):
    """Compiled (transformers' compile_config; on a CPU only with _compile_all_devices), fullgraph:
    no graph breaks, and a graph for each bucket the steps take, none for a step of a bucket
    already compiled, nor on a later call of the same shapes. The output stays AR's."""
    model = copy.deepcopy(trained["llama"][0])  # its compiled call stays with the copy's session
    seen = padded_steps(monkeypatch)
    graphs = []

    def backend(gm, example_inputs):  # dynamo's graph, run as traced: counts the compiles
        graphs.append(gm)
        return gm.forward

    config = CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True
    kw = dict(max_new_tokens=30, eos_token_id=None, pack_weights=False, **STATIC)
    for seed in range(3):
        ids = cycle_batch(1, 3 + seed, seed=seed)
        got = generate(ids, model=model, compile_config=config, **kw)
        assert torch.equal(got, ar(model, ids, max_new_tokens=30, eos_token_id=None)), seed
    assert 1 <= len(graphs) == len({b for _, b in seen})
    before, seen[:] = len(graphs), []
    generate(cycle_batch(1, 4, seed=0), model=model, compile_config=config, **kw)
    assert len(graphs) == before and seen  # the same shapes: no new graph
    # disable_compile, as in transformers: eager
    generate(
        cycle_batch(1, 4, seed=0), model=model, compile_config=config, disable_compile=True, **kw
    )
    assert len(graphs) == before
    session = session_of(model)  # the cache and its compiled call, kept until reset
    assert session.static_caches and session.compiled
    reset(model)
    assert not session.static_caches and not session.compiled


def test_what_a_static_cache_does_not_cover_is_refused_by_name(untrained):
    model = untrained["mistral"]
    ids = torch.tensor([[5, 6, 7]])
    config = model.config
    window = config.sliding_window, getattr(config, "use_sliding_window", True)
    config.sliding_window, config.use_sliding_window = 4, True
    try:
        with pytest.raises(
            ValueError, match=r"static.*sliding windows.*leave cache_implementation"
        ):
            generate(ids, model=model, max_new_tokens=4, **STATIC)
    finally:
        config.sliding_window, config.use_sliding_window = window
    attn = config._attn_implementation
    config._attn_implementation = "flex_attention"
    try:
        with pytest.raises(ValueError, match=r"static.*flex_attention.*sdpa"):
            generate(ids, model=model, max_new_tokens=4, **STATIC)
    finally:
        config._attn_implementation = attn
    with pytest.raises(ValueError, match=r"cache_implementation='offloaded'.*dynamic or a static"):
        generate(ids, model=model, max_new_tokens=4, cache_implementation="offloaded")
    torch.manual_seed(0)
    recurrent = AutoModelForCausalLM.from_config(
        tiny_config("qwen3_5_text", len(tiny_tokenizer()))
    ).eval()
    TiDARSpec(4, mask_token_id=3).write(recurrent.config)
    with pytest.raises(ValueError, match=r"static.*recurrent layers"):
        generate(ids, model=recurrent, max_new_tokens=4, **STATIC)


def with_mask_adapter(model, seed: int = 0):
    """A copy of `model` with random mask-slot deltas on its attention projections (adapter.attach,
    as a scoped export loads them)."""
    from tidar_convert.runtime.adapter import attach

    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, layer in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            tensors[f"{name}.lora_A"] = 0.2 * torch.randn(4, layer.in_features, generator=g)
            tensors[f"{name}.lora_B"] = 0.2 * torch.randn(layer.out_features, 4, generator=g)
    attach(model, tensors, model.config.mask_token_id)
    return model


def test_a_mask_slot_adapter_compiles_whole_and_its_gate_reads_nothing(trained, monkeypatch):
    """Decoding tells the gate where its mask rows are (adapter.mask_rows), so the gate never reads
    the ids: TiDAR's steps and plain AR compile without a graph break (fullgraph), and the output
    is AR's, a mask token in the prompt included (text in both)."""
    from tidar_convert.runtime.adapter import Gate

    model = with_mask_adapter(trained["llama"][0])
    mask_id = model.config.mask_token_id
    prompts = (cycle_batch(1, 5, seed=0), torch.tensor([[5, 6, mask_id, 7, 8]]))
    # the reference: transformers' own generate, not told (its gate reads the ids)
    references = [ar(model, ids, max_new_tokens=20, eos_token_id=None) for ids in prompts]
    set_ids = Gate.set

    def told_only(gate, input_ids):
        assert gate.told is not None, "the gate read a decoding forward's ids"
        set_ids(gate, input_ids)

    monkeypatch.setattr(Gate, "set", told_only)
    config = CompileConfig(backend=lambda gm, inputs, **kw: gm.forward, fullgraph=True)
    config._compile_all_devices = True
    for ids, expected in zip(prompts, references):
        for kw in ({}, {**STATIC, "compile_config": config, "pack_weights": False}):
            got = generate(ids, model=model, max_new_tokens=20, eos_token_id=None, **kw)
            assert torch.equal(got, expected), kw
        compiled_ar = generate(
            ids,
            model=model,
            tidar=False,
            max_new_tokens=20,
            eos_token_id=None,
            pack_weights=False,
            **STATIC,
            compile_config=config,
        )
        assert torch.equal(compiled_ar, expected)
