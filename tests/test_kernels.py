"""Packed CPU linear layers (kernels.py): the same products as PyTorch's, rows independent of how
many share a call, weights repacked when they change, stock product wherever gradients are needed,
packed by default only where timed faster, and generate() decoding the same tokens with them on
every path."""

from __future__ import annotations

import copy

import pytest
import torch

from tidar_convert.runtime import kernels, panel
from tidar_convert.runtime.generate import generate
from tidar_convert.runtime.session import KernelState, session_of

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="this torch build has no oneDNN packed linear"
)


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
    ((kind, _),) = (packed for _, packed in session_of(layer).kernels.packed[layer].values())
    # bf16 too: panels are the default where the kernel builds
    assert kind == ("panels" if panel.panel_library() else "onednn")
    torch.testing.assert_close(
        packed, stock, **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {})
    )
    if dtype == torch.bfloat16 and kind == "onednn":
        # oneDNN's bf16 product on AMX gives 1 row other low bits than 2 or more (the module's
        # docstring)
        return
    for j, part in enumerate(rows, start=1):
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
    assert layer not in session_of(layer).kernels.packed


def test_a_weight_onednn_refuses_keeps_the_stock_product(monkeypatch):
    def refuse(*args):
        raise RuntimeError("no packed layout for this CPU")

    monkeypatch.setattr(kernels, "_reorder", refuse)
    # no panel kernel here: fp32 goes to oneDNN, which refuses
    monkeypatch.setattr(panel, "_PANEL_LIB", [None])
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
    assert layer.weight.grad is not None and torch.allclose(
        layer.weight.grad, x.sum(0).expand(8, -1)
    )


def test_only_cpu_float_layers_are_packed():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).half(), torch.nn.Embedding(4, 8)
    )
    with kernels.packed_linears(model) as layers:
        assert layers == [model[0]]
    with kernels.packed_linears(model, enabled=False) as layers:
        assert layers == [] and not swapped(model)
    with torch.no_grad(), kernels.packed_linears(model):
        model[0](torch.randn(2, 8))
    assert model[0] in session_of(model).kernels.packed
    model[0].half()  # no longer packable: the next entry drops its packed copy
    with kernels.packed_linears(model) as layers:
        assert layers == [] and model[0] not in session_of(model).kernels.packed


@pytest.mark.parametrize("tidar", [True, False])
def test_generate_gives_the_same_tokens_packed_or_not_and_restores_the_layers(untrained, tidar):
    model = untrained["qwen2"]
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(model=model, max_new_tokens=20, eos_token_id=None, pad_token_id=0, tidar=tidar)
    stock = generate(ids, pack_weights=False, **kw)
    # the default: whichever product was timed faster here
    assert torch.equal(generate(ids, **kw), stock)
    kw["pack_weights"] = True
    assert torch.equal(generate(ids, **kw), stock)
    assert not swapped(model)

    def fail(input_ids, scores, **kwargs):
        assert swapped(model)  # while decoding, the packed forwards run
        raise KeyboardInterrupt

    # an interrupted generate() still puts the stock forwards back
    with pytest.raises(KeyboardInterrupt):
        generate(ids, stopping_criteria=[fail], **kw)
    assert not swapped(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_attention_attends_in_place_to_the_same_values(untrained, family, monkeypatch):
    """A TiDAR step (two drafts and a mask group after a cache) under grouped_attention: the values
    of transformers' sdpa path, which copies the key/value heads to every query head, reached
    through SDPA's enable_gqa instead; the model's attention setting is back afterwards, even on
    an error."""
    from transformers import DynamicCache

    from tidar_convert.runtime.forward import cache_kwargs
    from tidar_convert.runtime.layout import decode_step_mask
    from tidar_convert.runtime.plan import StepPlan

    model = untrained[family]
    assert (
        model.config._attn_implementation == "sdpa"
        and model.config.num_key_value_heads < model.config.num_attention_heads
    )
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    plan = StepPlan(2, (1,), 4)
    step = torch.cat([ids[:, -2:], torch.full((1, 4), model.config.mask_token_id)], 1)

    def run():
        cache = DynamicCache()
        # the prompt: no mask, grouped either way
        model.model(input_ids=ids, **cache_kwargs(model.model, cache))
        grouped.clear()
        mask = decode_step_mask(
            torch.ones(1, 12, dtype=torch.bool),
            plan.n_drafts,
            plan.k,
            plan.anchors,
            model.config._attn_implementation,
        )
        return model.model(
            input_ids=step,
            position_ids=plan.positions(torch.tensor([12])),
            attention_mask=mask,
            **cache_kwargs(model.model, cache),
        ).last_hidden_state

    grouped = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: grouped.append(bool(k.get("enable_gqa"))) or sdpa(*a, **k),
    )
    with torch.no_grad():
        stock = run()
        # the step: transformers copies the heads under a mask
        assert grouped == [False] * model.config.num_hidden_layers
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


def fake_timings(monkeypatch, table: dict) -> list:
    """pass_seconds from a table of milliseconds by product and rows; returns the log of (rows,
    product) timed."""
    timed = []

    def seconds(state, layers, rows, product):
        timed.append((rows, product))
        return table[product][rows] / 1000

    monkeypatch.setattr(kernels, "pass_seconds", seconds)
    return timed


@pytest.mark.parametrize(
    "packed_ms,pays",
    [
        # an AMX Xeon in fp32: stock wins the AR step by more than it loses the TiDAR step
        ({1: 45, 8: 55}, False),
        # a Xeon without AMX, where the stock product of 2 to 13 rows is slow
        ({1: 44, 8: 54}, True),
    ],
)
def test_auto_packs_only_where_a_pass_is_timed_faster(monkeypatch, packed_ms, pays):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    model.config = type("Config", (), {"_attn_implementation": "eager"})()
    # fp32 has one packed product: panels, or oneDNN's without the kernel
    kind = kernels.candidates(torch.float32)[0]
    timed = fake_timings(
        monkeypatch, {"panels": packed_ms, "onednn": packed_ms, "stock": {1: 35, 8: 64}}
    )
    with torch.no_grad():
        with kernels.cpu_kernels(model, True):  # forced: packed whatever the timing
            assert len(swapped(model)) == 2
            model(torch.randn(2, 16))
        assert not timed and all(layer in session_of(model).kernels.packed for layer in model)
        with kernels.cpu_kernels(model):  # the default: "auto"
            assert bool(swapped(model)) == pays
            model(torch.randn(2, 16))
        # both products, both row counts
        assert sorted(set(timed)) == [(1, kind), (1, "stock"), (8, kind), (8, "stock")]
        # one untimed pass packs, then three of each
        assert timed[0] == (1, kind) and len(timed) == 1 + 3 * 4
        # what the choice compared, as the bench records it
        timings = kernels.product_timings(model)
        assert timings == {
            str(r): {
                "stock_ms": pytest.approx({1: 35, 8: 64}[r]),
                f"{kind}_ms": pytest.approx(packed_ms[r]),
            }
            for r in (1, 8)
        }
        # A model where packing does not pay keeps no packed copy (it would be one more copy of
        # every weight).
        assert all(bool(session_of(model).kernels.packed.get(layer)) == pays for layer in model)
        # timed once per model
        with kernels.cpu_kernels(model, "auto"), kernels.cpu_kernels(model, "auto"):
            pass
        assert len(timed) == 13
        with kernels.cpu_kernels(model, False):
            assert not swapped(model)
        model.to(torch.bfloat16)  # another dtype: timed again, every bf16 product
        kernels.packing_pays(model)
        assert len(timed) == 13 + len(kernels.candidates(torch.bfloat16)) + 3 * 2 * (
            1 + len(kernels.candidates(torch.bfloat16))
        )


@pytest.mark.skipif(
    len(kernels.candidates(torch.bfloat16)) < 2, reason="bf16 has one packed product here"
)
@pytest.mark.parametrize("winner", ["panels", "onednn", "stock"])
def test_bf16_takes_the_fastest_of_panels_onednn_and_stock_and_keeps_only_its_copies(
    monkeypatch, winner
):
    """bf16 has two packed products (panels, exact for every row count; oneDNN's, which AMX makes
    fast on many rows): the pass decides, per model, and the loser's copies are dropped."""
    table = {"panels": {1: 30, 8: 40}, "onednn": {1: 40, 8: 35}, "stock": {1: 45, 8: 70}}
    table[winner] = {1: 20, 8: 30}
    fake_timings(monkeypatch, table)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)).bfloat16()
    model.config = type("Config", (), {"_attn_implementation": "eager"})()
    with torch.no_grad():
        assert kernels.packing_pays(model) == (winner != "stock")
        assert kernels.linear_product(model) == winner
        if winner != "stock":
            assert kernels.linear_products(model, True) == {winner: 2}
        assert all(
            set(session_of(model).kernels.packed.get(layer, {})) == ({winner} - {"stock"})
            for layer in model
        )
        assert set(kernels.product_timings(model)["8"]) == {"stock_ms", "panels_ms", "onednn_ms"}
        with kernels.cpu_kernels(model):
            y = model(torch.randn(3, 16).bfloat16())
    assert y.dtype == torch.bfloat16


def test_a_timed_pass_runs_each_layer_on_the_product_it_names():
    torch.manual_seed(0)
    state = KernelState()
    # each input made in its layer's dtype
    layers = [torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 32).bfloat16()]
    with torch.no_grad():
        assert kernels.pass_seconds(state, layers, 8, "stock") > 0
        assert not any(layer in state.packed for layer in layers)  # stock: nothing packed
        for kind in kernels.candidates(torch.bfloat16):
            kernels.pass_seconds(state, layers[2:], 8, kind)
            assert state.packed[layers[2]][kind][1][0] == kind  # really packed as named
        kind = kernels.candidates(torch.float32)[0]
        kernels.pass_seconds(state, layers[:2], 8, kind)
        assert [set(state.packed[layer]) for layer in layers[:2]] == [{kind}, {kind}]
        # really packed (a weight oneDNN refuses would be None: stock)
        assert state.packed[layers[0]][kind][1] is not None


def test_pack_weights_must_be_a_bool_or_auto(untrained):
    ids = torch.randint(3, 300, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"pack_weights='yes'.*True, False or 'auto'"):
        generate(ids, model=untrained["qwen2"], max_new_tokens=4, pack_weights="yes")


def test_generate_reports_the_product_each_linear_layer_took(untrained):
    """model.tidar_products: how many linear layers take each product, set by generate() on every
    path, and logged in one line (transformers' logger, at info) when it changes."""
    import logging

    model = copy.deepcopy(untrained["llama"])  # its own log history
    n = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    seen, handler, log = [], logging.Handler(), logging.getLogger("transformers.cli.tidar")
    handler.emit = lambda record: seen.append(record.getMessage())
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        ids, kw = torch.tensor([[5, 6, 7]]), dict(model=model, max_new_tokens=3, eos_token_id=None)
        generate(ids, pack_weights=False, **kw)
        assert model.tidar_products == {"stock": n}
        generate(ids, pack_weights=False, **kw)  # the same products: not logged again
        generate(ids, pack_weights=True, tidar=False, **kw)
        packed = "panels" if panel.panel_library() else "onednn"
        assert model.tidar_products == {packed: n}
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        kernels.release(model)
    assert [s for s in seen if s.startswith("TiDAR linear products")] == [
        f"TiDAR linear products (float32 on cpu): {n} layers stock",
        f"TiDAR linear products (float32 on cpu): {n} layers {packed}",
    ]


def test_a_sharded_weight_is_not_timed(monkeypatch, tmp_path):
    """FSDP2's weights are DTensor parameters (isinstance Parameter, but not by type), whole only
    inside their forward: packing_pays leaves them out, and a model of only those is not timed."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    timed = fake_timings(monkeypatch, {p: {1: 1, 8: 1} for p in kernels.PRODUCTS})
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            layer.weight = torch.nn.Parameter(
                distribute_tensor(layer.weight.data, mesh, [Replicate()])
            )
        assert isinstance(model[0].weight, torch.nn.Parameter)
        assert not kernels.packing_pays(model) and not timed
        model[1].weight = torch.nn.Parameter(torch.randn(16, 32))  # a plain one is timed
        kernels.packing_pays(model)
        assert timed
    finally:
        dist.destroy_process_group()


def test_cpu_kernels_walks_the_model_once_a_call(monkeypatch):
    """generate() enters cpu_kernels every call: its parts (the timing's cache check, the product
    counts, the swap) share one list of the linear layers instead of each walking the model."""
    fake_timings(
        monkeypatch, {p: {1: 1, 8: 2} if p != "stock" else {1: 5, 8: 5} for p in kernels.PRODUCTS}
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    model.config = type("Config", (), {"_attn_implementation": "eager"})()
    with kernels.cpu_kernels(model):  # timed, packed
        pass
    walks = []
    modules = model.modules
    monkeypatch.setattr(model, "modules", lambda: walks.append(1) or modules())
    with kernels.cpu_kernels(model) as packed:
        assert packed and len(walks) == 1
        assert all(getattr(layer.forward, "_tidar_packed", False) for layer in model)
    assert len(walks) == 1 and not swapped(model)
