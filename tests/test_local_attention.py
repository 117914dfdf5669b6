"""Sliding windows and attention chunks (layout.Local): a 4D mask replaces a model's own windows, so
the layout applies them by position. Windows here are shorter than the training and decoded lengths,
so they bind: the clean half equals the plain model, FlexAttention equals the dense masks (training
and a decode step), and greedy TiDAR past the window equals AR, padded batch included."""

import pytest
import torch
from helpers import ar
from transformers import AutoConfig

from tidar_convert.models.loading import load_base, model_from_config
from tidar_convert.runtime import layout
from tidar_convert.runtime.forward import cache_kwargs
from tidar_convert.runtime.generate import generate
from tidar_convert.runtime.spec import TiDARSpec

S, K, V = 16, 4, 320
SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=V,
)
# (model_type, config fields, attention implementation): one window on every layer, mixed sliding
# and full layers (SDPA, and eager's additive masks), attention chunks, sinks with mixed windows.
LOCAL = {
    "mistral": (dict(sliding_window=5), "sdpa"),
    "gemma3_text": (
        dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
        "sdpa",
    ),
    "gemma2": (
        dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
        "eager",
    ),
    "llama4_text": (
        dict(attention_chunk_size=6, intermediate_size_mlp=128, no_rope_layers=[1, 0]),
        "sdpa",
    ),
    "gpt_oss": (
        dict(
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "eager",
    ),
}


def local_model(model_type, impl=None):
    fields, default_impl = LOCAL[model_type]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SIZES, **fields)
    return model_from_config(config, attn_implementation=impl or default_impl).eval()


def doubled(model, ids, impl):
    positions = layout.train_position_ids(ids)
    local = layout.Local.of(model.config, positions)
    mask = layout.build_mask(
        layout.train_mask_mod(S, K), ids.shape[0], 2 * S, 2 * S, impl, "cpu", local
    )
    with torch.no_grad():
        return model(
            input_ids=layout.train_inputs(ids, V - 1), position_ids=positions, attention_mask=mask
        ).logits


def test_local_kinds_from_the_config():
    assert layout.local_kinds(AutoConfig.for_model("llama")) is None
    # one mask
    assert list(layout.local_kinds(AutoConfig.for_model("mistral", sliding_window=5))) == [""]
    assert layout.local_kinds(AutoConfig.for_model("mistral", sliding_window=None)) is None
    assert (
        layout.local_kinds(
            AutoConfig.for_model("qwen2", sliding_window=5, use_sliding_window=False)
        )
        is None
    )
    mixed = layout.local_kinds(
        AutoConfig.for_model(
            "gemma3_text",
            sliding_window=5,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    assert set(mixed) == {"sliding_attention", "full_attention"} and mixed["full_attention"] is None
    q, k = torch.tensor([9, 9, 9]), torch.tensor([4, 5, 9])
    # q - k < window, as transformers' overlay
    assert mixed["sliding_attention"](q, k).tolist() == [False, True, True]
    with pytest.raises(
        ValueError, match="sets both sliding_window and attention_chunk_size without layer_types"
    ):
        layout.local_kinds(
            AutoConfig.for_model("mistral", sliding_window=5, attention_chunk_size=6)
        )
    chunked = layout.local_kinds(
        AutoConfig.for_model("llama4_text", attention_chunk_size=6, num_hidden_layers=2)
    )
    assert chunked[next(iter(chunked))](torch.tensor([7, 7]), torch.tensor([5, 6])).tolist() == [
        False,
        True,
    ]


@pytest.mark.parametrize("model_type", LOCAL)
def test_clean_half_equals_the_plain_model_past_the_window(model_type):
    """The model's own forward applies its windows; the doubled sequence's clean half must compute
    the same."""
    model = local_model(model_type)
    ids = torch.randint(1, V - 2, (2, S))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    torch.testing.assert_close(
        doubled(model, ids, model.config._attn_implementation)[:, :S], plain, atol=1e-5, rtol=1e-5
    )
    # and the window binds here: without it, the clean half differs
    positions = layout.train_position_ids(ids)
    unwindowed = layout.build_mask(
        layout.train_mask_mod(S, K), 2, 2 * S, 2 * S, model.config._attn_implementation, "cpu"
    )
    with torch.no_grad():
        wrong = model(
            input_ids=layout.train_inputs(ids, V - 1),
            position_ids=positions,
            attention_mask=unwindowed,
        ).logits[:, :S]
    assert (wrong - plain).abs().max() > 1e-3


# compiles FlexAttention with inductor (make test runs it; make test-fast skips it)
@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "llama4_text"])
def test_flex_attention_equals_the_dense_masks(model_type, monkeypatch):
    """FlexAttention (forward on CPU, compiled) with one BlockMask per layer kind against the dense
    masks: the training layout, then a decode step after a cache."""
    # Fresh compiles with static shapes: after other tests' FlexAttention compiles, torch 2.13
    # recompiles with dynamic shapes, and its CPU template then emitted C++ that does not build
    # (cur_kvSplitSize0, in CI's full run only).
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    dense_model = local_model(model_type, "sdpa")
    flex_model = local_model(model_type, "flex_attention")
    flex_model.load_state_dict(dense_model.state_dict())
    ids = torch.randint(1, V - 2, (2, S))
    torch.testing.assert_close(
        doubled(flex_model, ids, "flex_attention"),
        doubled(dense_model, ids, "sdpa"),
        atol=1e-4,
        rtol=1e-4,
    )

    from transformers import DynamicCache

    # a 12-token cache (left padding on row 0), 2 drafts and one mask group
    C, causal, anchors = (12, 2, (1,))
    valid = torch.ones(2, C, dtype=torch.bool)
    valid[0, :3] = False
    start = valid.sum(1)  # each row's next position
    positions = layout.decode_position_ids(start, causal, K, len(anchors), anchors)
    tokens = torch.cat([torch.randint(1, V - 2, (2, causal)), torch.full((2, K), V - 1)], 1)
    outs = []
    for model, impl in ((dense_model, "sdpa"), (flex_model, "flex_attention")):
        cache = DynamicCache()
        prefix_pos = (valid.cumsum(1) - 1).clamp(min=0)
        prefill = layout.Local.of(model.config, prefix_pos)
        with torch.no_grad():
            model(
                input_ids=ids[:, :C],
                position_ids=prefix_pos,
                attention_mask=layout.build_mask(
                    layout.decode_mask_mod(0, C, K, C, valid), 2, C, C, impl, "cpu", prefill
                ),
                **cache_kwargs(model, cache),
            )
            local = layout.Local.of(
                model.config, torch.cat([valid.cumsum(1) - 1, positions], 1), q_offset=C
            )
            mask = layout.decode_step_mask(valid, causal, K, anchors, impl, local=local)
            outs.append(
                model(
                    input_ids=tokens,
                    position_ids=positions,
                    attention_mask=mask,
                    **cache_kwargs(model, cache),
                ).logits
            )
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", LOCAL)
def test_greedy_tidar_past_the_window_is_ar(model_type, tmp_path, tokenizer):
    """Random weights (every token depends on the whole window), decoded well past it: one row and a
    left-padded batch of two, each drafter, equal to transformers' own generate (which applies its
    windows itself)."""
    base = local_model(model_type)
    base.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_base(str(tmp_path))
    model.eval()
    TiDARSpec(K, model.config.mask_token_id).write(model.config)
    # repeats: lookup drafts from the first step
    prompt = torch.tensor([[5, 9, 3, 5, 9, 3, 5, 9, 3, 7, 8, 2]])
    batch = torch.stack([prompt[0], torch.cat([torch.full((3,), 0), prompt[0, 3:]])])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    kw = dict(max_new_tokens=20, eos_token_id=None)
    for ids, attention in ((prompt, None), (batch, mask)):
        expected = ar(model, ids, attention_mask=attention, **kw)
        for drafter in ("hybrid", "lookup", "diffusion"):
            got = generate(
                ids, model=model, attention_mask=attention, drafter=drafter, do_sample=False, **kw
            )
            assert torch.equal(got, expected), (model_type, drafter, ids.shape[0])


def test_the_lightning_module_trains_within_the_windows(tmp_path, tokenizer, monkeypatch):
    """TiDARModule's forwards (one over both halves, and the split halves of lora_scope='masks')
    apply the windows: the same loss either way, and its AR loss is the plain model's own
    next-token loss."""
    from helpers import cycle_batch

    from tidar_convert.train.module import TiDARModule

    local_model("gemma3_text").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    m = TiDARModule(model=str(tmp_path), draft_length=K, lora_r=4, lora_scope="masks")
    m.configure_model()
    ids = cycle_batch(2, S, seed=3)
    # not a cycle: tokens past the window matter
    ids[:, ::3] = torch.randint(1, V - 2, ids[:, ::3].shape)
    with torch.no_grad(), m.model.disable_adapter():
        plain = m.model(input_ids=ids).logits
        own = torch.nn.functional.cross_entropy(
            plain[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
        )
        assert m.split_halves
        split = m.forward_tidar(ids)
        monkeypatch.setattr(TiDARModule, "split_halves", property(lambda self: False))
        one = m.forward_tidar(ids)
    torch.testing.assert_close(split["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one["loss_ar"], own, rtol=1e-5, atol=1e-6)


def test_gpt_neo_s_index_window_is_refused_past_it(tmp_path, tokenizer):
    """GPT-Neo's local layers window by token index inside the model, which TiDAR's slots do not
    follow: decoding stops at the window with the lengths that fit."""
    config = AutoConfig.for_model(
        "gpt_neo",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=12,
        vocab_size=V,
    )
    model_from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_base(str(tmp_path))
    model.eval()
    TiDARSpec(K, model.config.mask_token_id).write(model.config)
    ids = torch.tensor([[5, 9, 3, 5, 9, 3]])
    assert (
        generate(ids, model=model, max_new_tokens=6, do_sample=False, eos_token_id=None).shape[1]
        == 12
    )
    with pytest.raises(
        ValueError,
        match=(
            r"prompt \(6 tokens\) \+ max_new_tokens \(7\) exceeds GPTNeoForCausalLM's "
            r"local attention window \(12\).*lower max_new_tokens to 6"
        ),
    ):
        generate(ids, model=model, max_new_tokens=7, do_sample=False, eos_token_id=None)
