"""Packed CPU linear layers (kernels.py): the same products as PyTorch's, rows independent of how many
share a call, weights repacked when they change, stock product wherever gradients are needed, packed
by default only where timed faster, and generate() decoding the same tokens with them on every path."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tidar_convert import kernels
from tidar_convert.decode import generate

pytestmark = pytest.mark.skipif(not kernels.available(), reason="this torch build has no oneDNN packed linear")


def swapped(model) -> list:
    return [m for m in model.modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_stock_and_is_row_invariant(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 200).to(dtype)
    x = torch.randn(1, 13, 96, dtype=dtype)
    with torch.no_grad():
        stock = layer(x)
        with kernels.packed_linears(layer) as layers:
            assert layers == [layer]
            packed = layer(x)
            # Each row's result is the same whether 1 or 13 rows share the call: bit for bit.
            rows = [layer(x[:, :j]) for j in range(1, 14)]
    kind = kernels._PACKED[layer][1][0]
    assert kind == ("panels" if dtype == torch.float32 and kernels.panel_library() else "onednn")
    torch.testing.assert_close(packed, stock, **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}))
    if dtype == torch.bfloat16:
        return  # oneDNN's bf16 product on AMX gives 1 row other low bits than 2 or more (the module's docstring)
    for j, part in enumerate(rows, start=1):
        if j > 1 or kind == "onednn":  # one row on panels is the stock product
            assert torch.equal(part, packed[:, :j]), j
    assert not swapped(layer)  # the stock forward is back


def test_a_changed_weight_is_packed_again():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 48, bias=False)
    x = torch.randn(2, 3, 32)
    with torch.no_grad(), kernels.packed_linears(layer):
        before = layer(x)
        layer.weight.mul_(2)  # in place: same storage, new version
        torch.testing.assert_close(layer(x), 2 * before)
        layer.weight = torch.nn.Parameter(torch.randn(48, 32))  # another tensor
        torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    copy.deepcopy(layer)  # the packed copy is not on the layer: it copies and pickles as before
    kernels.release(layer)
    assert layer not in kernels._PACKED


def test_a_weight_onednn_refuses_keeps_the_stock_product(monkeypatch):
    def refuse(*args):
        raise RuntimeError("no packed layout for this CPU")

    monkeypatch.setattr(kernels, "_reorder", refuse)
    monkeypatch.setattr(kernels, "_PANEL_LIB", [None])  # no panel kernel here: fp32 goes to oneDNN, which refuses
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with torch.no_grad(), kernels.packed_linears(layer):
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_gradients_take_the_stock_product():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with kernels.packed_linears(layer):
        layer(x).sum().backward()
    assert layer.weight.grad is not None and torch.allclose(layer.weight.grad, x.sum(0).expand(8, -1))


def test_only_cpu_float_layers_are_packed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).half(), torch.nn.Embedding(4, 8))
    with kernels.packed_linears(model) as layers:
        assert layers == [model[0]]
    with kernels.packed_linears(model, enabled=False) as layers:
        assert layers == [] and not swapped(model)
    with torch.no_grad(), kernels.packed_linears(model):
        model[0](torch.randn(2, 8))
    assert model[0] in kernels._PACKED
    model[0].half()  # no longer packable: the next entry drops its packed copy
    with kernels.packed_linears(model) as layers:
        assert layers == [] and model[0] not in kernels._PACKED


@pytest.mark.parametrize("tidar", [True, False])
def test_generate_gives_the_same_tokens_packed_or_not_and_restores_the_layers(untrained, tidar):
    model = untrained["qwen2"]
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(model=model, max_new_tokens=20, eos_token_id=None, pad_token_id=0, tidar=tidar)
    stock = generate(ids, pack_weights=False, **kw)
    assert torch.equal(generate(ids, **kw), stock)  # the default: whichever product was timed faster here
    kw["pack_weights"] = True
    assert torch.equal(generate(ids, **kw), stock)
    assert not swapped(model)
    def fail(input_ids, scores, **kwargs):
        assert swapped(model)  # while decoding, the packed forwards run
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # an interrupted generate() still puts the stock forwards back
        generate(ids, stopping_criteria=[fail], **kw)
    assert not swapped(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_attention_attends_in_place_to_the_same_values(untrained, family, monkeypatch):
    """A TiDAR step (two drafts and a mask group after a cache) under grouped_attention: the values of
    transformers' sdpa path, which copies the key/value heads to every query head, reached through
    SDPA's enable_gqa instead; the model's attention setting is back afterwards, even on an error."""
    from transformers import DynamicCache

    from tidar_convert.forward import cache_kwargs
    from tidar_convert.plan import StepPlan
    from tidar_convert.layout import decode_step_mask

    model = untrained[family]
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    plan = StepPlan(2, (1,), 4)
    step = torch.cat([ids[:, -2:], torch.full((1, 4), model.config.mask_token_id)], 1)

    def run():
        cache = DynamicCache()
        model.model(input_ids=ids, **cache_kwargs(model.model, cache))  # the prompt: no mask, grouped either way
        grouped.clear()
        mask = decode_step_mask(torch.ones(1, 12, dtype=torch.bool), plan.n_drafts, plan.k, plan.anchors, model.config._attn_implementation)
        return model.model(input_ids=step, position_ids=plan.positions(torch.tensor([12])), attention_mask=mask, **cache_kwargs(model.model, cache)).last_hidden_state

    grouped = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: grouped.append(bool(k.get("enable_gqa"))) or sdpa(*a, **k))
    with torch.no_grad():
        stock = run()
        assert grouped == [False] * model.config.num_hidden_layers  # the step: transformers copies the heads under a mask
        with kernels.grouped_attention(model):
            assert model.config._attn_implementation == kernels.GQA_ATTENTION
            in_place = run()
        assert grouped == [True] * model.config.num_hidden_layers
    torch.testing.assert_close(in_place, stock, rtol=1e-6, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyboardInterrupt), kernels.grouped_attention(model):
        raise KeyboardInterrupt
    assert model.config._attn_implementation == "sdpa"
    with kernels.grouped_attention(model, enabled=False):
        assert model.config._attn_implementation == "sdpa"


def fake_timings(monkeypatch, packed_ms: dict, stock_ms: dict) -> list:
    """pass_seconds from a table of milliseconds by rows; returns the log of (rows, packed) timed."""
    timed = []

    def seconds(layers, rows, packed):
        timed.append((rows, packed))
        return (packed_ms if packed else stock_ms)[rows] / 1000

    monkeypatch.setattr(kernels, "pass_seconds", seconds)
    return timed


@pytest.mark.parametrize("packed_ms,pays", [
    ({1: 45, 8: 55}, False),  # an AMX Xeon in fp32: stock wins the AR step by more than it loses the TiDAR step
    ({1: 44, 8: 54}, True),  # a Xeon without AMX, where the stock product of 2 to 13 rows is slow
])
def test_auto_packs_only_where_a_pass_is_timed_faster(monkeypatch, packed_ms, pays):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    model.config = type("Config", (), {"_attn_implementation": "eager"})()
    timed = fake_timings(monkeypatch, packed_ms, {1: 35, 8: 64})
    with torch.no_grad():
        with kernels.cpu_kernels(model, True):  # forced: packed whatever the timing
            assert len(swapped(model)) == 2
            model(torch.randn(2, 16))  # 2 rows: on panels 1 row is the stock product
        assert not timed and all(layer in kernels._PACKED for layer in model)
        with kernels.cpu_kernels(model):  # the default: "auto"
            assert bool(swapped(model)) == pays
            model(torch.randn(2, 16))  # 2 rows: on panels 1 row is the stock product
        assert sorted(set(timed)) == [(1, False), (1, True), (8, False), (8, True)]  # both products, both row counts
        assert timed[0] == (1, True) and len(timed) == 1 + 3 * 4  # one untimed pass packs, then three of each
        # A model where packing does not pay keeps no packed copy (it would be one more copy of every weight).
        assert all((layer in kernels._PACKED) == pays for layer in model)
        with kernels.cpu_kernels(model, "auto"), kernels.cpu_kernels(model, "auto"):  # timed once per model
            pass
        assert len(timed) == 13
        with kernels.cpu_kernels(model, False):
            assert not swapped(model)
        model.to(torch.bfloat16)  # another dtype: timed again
        kernels.packing_pays(model)
        assert len(timed) == 26


def test_a_timed_pass_runs_each_layer_on_the_product_it_names():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 32).bfloat16()]  # each input made in its layer's dtype
    with torch.no_grad():
        assert kernels.pass_seconds(layers, 8, packed=False) > 0
        assert not any(layer in kernels._PACKED for layer in layers)  # stock: nothing packed
        kernels.pass_seconds(layers, 8, packed=True)
        assert [layer in kernels._PACKED for layer in layers] == [True, True, True]
        assert kernels._PACKED[layers[0]][1] is not None  # really packed (a weight oneDNN refuses would be None: stock)
    for layer in layers:
        kernels.release(layer)


def test_pack_weights_must_be_a_bool_or_auto(untrained):
    ids = torch.randint(3, 300, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"pack_weights='yes'.*True, False or 'auto'"):
        generate(ids, model=untrained["qwen2"], max_new_tokens=4, pack_weights="yes")


needs_panels = pytest.mark.skipif(kernels.panel_library() is None, reason="no C compiler with OpenMP: no panel kernel")


@needs_panels
@pytest.mark.parametrize("out_features,in_features", [(200, 96), (32, 8), (33, 7), (1, 5), (70, 1536)])
def test_panel_product_matches_stock_and_each_row_is_the_same_among_2_or_64(out_features, in_features):
    """Every row count a step can have, from 2 to PANEL_ROWS: the stock product's values, and each
    row's result bit for bit the same whatever the count. One row (an AR step) and a prefill's many
    rows: the stock product itself."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, out_features)
    x = torch.randn(kernels.PANEL_ROWS + 3, in_features)
    with torch.no_grad(), kernels.packed_linears(layer):
        full = layer(x[: kernels.PANEL_ROWS])
        for rows in (2, 3, 7, 8, 9, 16, 17):
            together = layer(x[:rows])
            assert torch.equal(together, full[:rows]), rows
            torch.testing.assert_close(together, F.linear(x[:rows], layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(layer(x[5:6]), F.linear(x[5:6], layer.weight, layer.bias))  # one row: stock
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # prefill-sized: the stock GEMM
        assert layer(x[None, :5]).shape == (1, 5, out_features)  # leading dimensions kept
        assert layer(x[::2][:4]).shape == (4, out_features)  # a strided input is made contiguous first
        torch.testing.assert_close(layer(x[::2][:4]), F.linear(x[::2][:4], layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert kernels._PACKED[layer][1][0] == "panels"


@needs_panels
def test_panels_hold_the_weight_by_32_outputs_zero_padded():
    w = torch.arange(35 * 3, dtype=torch.float32).view(35, 3)
    p = kernels.panel_pack(w)
    assert p.shape == (2, 3, 32)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 2], w[34])
    assert not p[1, :, 3:].any()
    with pytest.raises(ValueError, match="fp32 input of 3 features"):
        kernels.panel_linear(torch.randn(2, 4), p, 35)


def test_without_a_compiler_fp32_takes_onednn_and_says_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_PANEL_LIB", [])
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match=r"could not be built.*Install a C compiler with OpenMP"):
        assert kernels.panel_library() is None
    assert kernels.panel_library() is None  # decided once: no second warning, no second attempt
    layer = torch.nn.Linear(16, 8)
    with torch.no_grad(), kernels.packed_linears(layer):
        assert layer(torch.randn(3, 16)).shape == (3, 8)
    assert kernels._PACKED[layer][1][0] == "onednn"
    assert not list(tmp_path.rglob("*.so"))


def test_an_unwritable_cache_is_named_with_its_fix_not_blamed_on_the_compiler(untrained, monkeypatch, tmp_path):
    """TIDAR_CACHE where no folder can be made (a file, so even root cannot write there), then an fp32
    generate: the warning names the kernel folder and TIDAR_CACHE, and decoding still runs."""
    import re

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(kernels, "_PANEL_LIB", [])
    monkeypatch.setenv("TIDAR_PANEL_KERNEL", "1")
    monkeypatch.setenv("TIDAR_CACHE", str(blocker))
    monkeypatch.setenv("CC", "cc")  # any compiler name: the folder is refused before it runs
    folder = re.escape(str(blocker / "kernels"))
    with pytest.warns(UserWarning, match=rf"cache folder {folder} is not writable .*Set TIDAR_CACHE to a writable folder") as seen:
        out = generate(torch.tensor([[5, 6, 7]]), model=untrained["llama"], max_new_tokens=3, eos_token_id=None, pack_weights=True)
    assert out.shape == (1, 6)
    assert not any("C compiler" in str(w.message) for w in seen)


@needs_panels
def test_the_kernel_is_built_once_per_cpu_and_compiler_then_loaded_from_the_cache(monkeypatch, tmp_path):
    import subprocess

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path))
    monkeypatch.setenv("TIDAR_PANEL_KERNEL", "1")
    monkeypatch.setattr(kernels, "_PANEL_LIB", [])
    lib = kernels.panel_library()
    built = list((tmp_path / "kernels").iterdir())
    assert lib is not None and len(built) == 1 and built[0].suffix == ".so"  # no temporary folder left behind

    def no_compiler(*args, **kwargs):
        raise subprocess.SubprocessError("built again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    monkeypatch.setattr(kernels, "_PANEL_LIB", [])
    assert kernels.panel_library() is not None
    monkeypatch.setattr(kernels, "_cpu_signature", lambda: "another CPU")  # another machine sharing the cache: its own build
    monkeypatch.setattr(kernels, "_PANEL_LIB", [])
    with pytest.warns(UserWarning, match="built again"):
        assert kernels.panel_library() is None


def test_the_panel_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(kernels, "_PANEL_LIB", [])
    monkeypatch.setenv("TIDAR_PANEL_KERNEL", "0")
    assert kernels.panel_library() is None


@needs_panels
@pytest.mark.parametrize("rows,start,in_features,out_features,rank", [(10, 6, 576, 1536, 5), (5, 0, 35, 17, 2), (40, 20, 64, 40, 8), (33, 31, 16, 70, 1)])
def test_panel_linear_adds_an_adapters_delta_in_the_same_pass(rows, start, in_features, out_features, rank):
    """An adapter's B packed beside W: rows start.. get x @ A.T @ B.T added, the rows before are the
    plain product bit for bit (the extra terms are zeros), with and without a bias."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(1, rows, in_features), torch.randn(out_features, in_features), torch.randn(out_features)
    A, B = torch.randn(rank, in_features), torch.randn(out_features, rank)
    panels, delta = kernels.panel_pack(w), kernels.panel_pack(B)
    for b in (None, bias):
        plain = kernels.panel_linear(x, panels, out_features, b)
        got = kernels.panel_linear(x, panels, out_features, b, (A, delta, start))
        assert torch.equal(got[:, :start], plain[:, :start])
        want = F.linear(x, w, b) + x @ A.T @ B.T
        torch.testing.assert_close(got[:, start:], want[:, start:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="adapter's A"):
        kernels.panel_linear(x, panels, out_features, None, (A[:, :-1].contiguous(), delta, start))


@needs_panels
def test_lora_add_takes_many_rows_in_blocks():
    torch.manual_seed(0)
    x, out = torch.randn(1, 80, 32), torch.randn(1, 80, 24)
    A, B = torch.randn(64, 32), torch.randn(24, 64)  # 78 rows x rank 64: more scores than one block holds
    got = out.clone()
    assert kernels.lora_add(got, x, 2, A, B.T.contiguous())
    torch.testing.assert_close(got[:, 2:], out[:, 2:] + x[:, 2:] @ A.T @ B.T, rtol=1e-4, atol=1e-4)


@needs_panels
@pytest.mark.parametrize("in_features,out_features,rank", [(576, 1536, 3), (35, 17, 2), (16, 16, 1), (64, 40, 8)])
def test_lora_add_is_the_low_rank_delta_on_the_rows_from_start(in_features, out_features, rank):
    torch.manual_seed(0)
    x, out = torch.randn(1, 7, in_features), torch.randn(1, 7, out_features)
    A, B = torch.randn(rank, in_features), torch.randn(out_features, rank)
    got = out.clone()
    assert kernels.lora_add(got, x, 4, A, B.T.contiguous())
    assert torch.equal(got[:, :4], out[:, :4])
    torch.testing.assert_close(got[:, 4:], out[:, 4:] + x[:, 4:] @ A.T @ B.T, rtol=1e-5, atol=1e-4)
    # bf16 rows with the fp32 adapter (a bf16 model's, adapter.attach): the delta in fp32, each output
    # rounded once, so within one bf16 rounding of torch's fp32 result.
    got16, out16, x16 = out.bfloat16(), out.bfloat16(), x.bfloat16()
    assert kernels.lora_add(got16, x16, 4, A, B.T.contiguous())
    assert torch.equal(got16[:, :4], out16[:, :4])
    torch.testing.assert_close(got16[:, 4:].float(), (out16[:, 4:].float() + x16[:, 4:].float() @ A.T @ B.T).bfloat16().float(), rtol=1e-2, atol=1e-2)
    # bf16 rows with bf16 deltas (a model cast to bf16 after its adapter was attached): the weights
    # widened exactly, the same fp32 sums, so bit for bit the call with them widened to fp32 first.
    A16, Bt16 = A.bfloat16(), B.T.contiguous().bfloat16()
    got16w, got16f = out16.clone(), out16.clone()
    assert kernels.lora_add(got16w, x16, 4, A16, Bt16)
    assert kernels.lora_add(got16f, x16, 4, A16.float(), Bt16.float())
    assert torch.equal(got16w, got16f)
    assert torch.equal(got16w[:, :4], out16[:, :4])
    torch.testing.assert_close(got16w[:, 4:].float(), (out16[:, 4:].float() + x16[:, 4:].float() @ A16.float().T @ Bt16.float()).bfloat16().float(), rtol=1e-2, atol=1e-2)
    # What it does not take, it leaves to the caller: bf16 deltas on fp32 rows, mixed dtypes, batches, strided views.
    assert not kernels.lora_add(out.clone(), x, 4, A16, Bt16)
    assert not kernels.lora_add(out16.clone(), x16, 4, A16, B.T.contiguous())
    assert not kernels.lora_add(out.bfloat16(), x, 4, A, B.T.contiguous())
    assert not kernels.lora_add(torch.cat([out, out]), torch.cat([x, x]), 4, A, B.T.contiguous())
    assert not kernels.lora_add(out.transpose(1, 2).contiguous().transpose(1, 2), x, 4, A, B.T.contiguous())
