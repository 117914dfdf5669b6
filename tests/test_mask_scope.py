"""lora_scope='masks': adapters on mask slots only, so the AR half is the base model bit for bit, in
training and in the export, while the drafts learn (lora.py, adapter.py)."""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import ar, cycle_batch, train_tiny

from tidar_convert import export, load
from tidar_convert.models.lora import add_lora
from tidar_convert.runtime import adapter, layout
from tidar_convert.runtime.adapter import ADAPTER_FILE, Gate
from tidar_convert.runtime.generate import generate
from tidar_convert.runtime.spec import TiDARSpec


def randomize_adapters(model, seed=0, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer):
    """Tiny random mixture-of-experts bases (family_matrix's configs): 4 experts, 2 a token."""
    from family_matrix import tiny_config
    from transformers import AutoModelForCausalLM

    out = {}
    for family in ("qwen3_moe", "mixtral"):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer))).save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[family] = path
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral"])
def test_clean_half_is_the_base_and_takes_no_gradient(tiny_dirs, moe_dirs, family):
    """For experts too: each mask slot is routed like a token, and no mask slot changes what a real
    token's router picks or computes (routing happens per token; the mask half sees the clean half,
    never the reverse)."""
    from tidar_convert.train.loss import hybrid_loss
    from tidar_convert.train.module import TiDARModule

    m = TiDARModule(
        model=str({**tiny_dirs, **moe_dirs}[family]), draft_length=4, lora_r=4, lora_scope="masks"
    )
    m.configure_model()
    randomize_adapters(m.model)
    ids = cycle_batch(2, 16, seed=1)
    S = ids.shape[1]
    kw = dict(
        input_ids=layout.train_inputs(ids, m.model.config.mask_token_id),
        position_ids=layout.train_position_ids(ids),
        attention_mask=layout.to_dense(layout.train_mask_mod(S, 4), 2, 2 * S, 2 * S),
    )
    logits = m.model(**kw).logits
    with torch.no_grad(), m.model.disable_adapter():
        base = m.model(**kw).logits
    assert torch.equal(logits[:, :S], base[:, :S])  # the AR half: the base model, bit for bit
    assert (logits[:, S:] - base[:, S:]).abs().max() > 1e-2  # the mask slots: adapted
    out = hybrid_loss(logits, *layout.train_labels(ids), alpha=1.0, draft_length=4)
    lora = [p for n, p in m.model.named_parameters() if p.requires_grad]
    # no embedding row trained
    assert lora and all("lora_" in n for n, p in m.model.named_parameters() if p.requires_grad)
    ar_grads = torch.autograd.grad(out["loss_ar"], lora, allow_unused=True, retain_graph=True)
    # no loss on the AR half can move it
    assert all(g is None or g.abs().max() == 0 for g in ar_grads)
    diff_grads = torch.autograd.grad(out["loss_diff"], lora, allow_unused=True)
    assert any(g is not None and g.abs().max() > 0 for g in diff_grads)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lora_scope="rows"), "lora_scope='rows': choose 'all'"),
        (
            dict(lora_scope="masks"),
            "lora_scope='masks' with lora_r=0: the mask-slot adapters are LoRA; set lora_r > 0",
        ),
        (
            dict(lora_scope="masks", lora_r=4, anchor_weight=0.5),
            "anchor_weight=0.5 with lora_scope='masks': the AR half is the base model exactly",
        ),
        (
            dict(lora_scope="masks", lora_r=4, teacher="base", distill_weight=1.0),
            "teacher='base' with lora_scope='masks'",
        ),
    ],
)
def test_bad_scope_settings_are_refused_by_name(tiny_dirs, kwargs, message):
    from tidar_convert.train.module import TiDARModule

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TiDARModule(model=str(tiny_dirs["qwen2"]), draft_length=4, **kwargs)


@pytest.mark.parametrize("c_call", [True, False])
def test_gate_slice_and_rows_agree(c_call, monkeypatch):
    """The same deltas whether batch 1 in fp32 on CPU takes one C call (kernels.lora_add, where the
    kernel builds) or torch's in-place addmm."""
    if not c_call:
        monkeypatch.setattr(adapter, "lora_add", lambda *args: False)
    torch.manual_seed(0)
    x, out = torch.randn(2, 6, 5), torch.randn(2, 6, 3)
    A, B = torch.randn(2, 5), torch.randn(3, 2)

    def delta(v):
        return v @ A.T @ B.T

    Bt = B.T.contiguous()
    trailing, scattered = Gate(9), Gate(9)
    trailing.set(torch.tensor([[1, 2, 3, 9, 9, 9], [4, 5, 6, 9, 9, 9]]))
    scattered.set(torch.tensor([[1, 9, 3, 9, 9, 9], [4, 5, 6, 9, 9, 9]]))
    assert trailing.start == 3 and trailing.rows is None and scattered.rows is not None
    rows = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    expect = out + delta(x) * rows[..., None]
    # batch 2: torch's products
    torch.testing.assert_close(trailing.add(out.clone(), x, A, Bt), expect)
    one = Gate(9)  # batch 1: the C call, or the in-place addmm path
    one.set(torch.tensor([[1, 2, 3, 9, 9, 9]]))
    got = one.add(out[:1].clone(), x[:1], A, Bt)
    torch.testing.assert_close(got, expect[:1])
    assert torch.equal(got[:, :3], out[:1, :3])  # rows before the masks untouched, bit for bit
    torch.testing.assert_close(trailing.weights(out)[..., 0], rows.float())
    got = scattered.add(out.clone(), x, A, Bt)
    # the lone mask in row 0 adapted too
    torch.testing.assert_close(got[0, 1], expect[0, 1] + delta(x)[0, 1])
    none = Gate(9)
    none.set(torch.tensor([[1, 2, 3]]))
    assert not none.open and torch.equal(none.add(out.clone(), x, A, Bt), out)
    # A bf16 model with fp32 deltas (attach on CPU): the product runs in fp32 and lands in bf16.
    for gate, n in ((one, 1), (trailing, 2), (scattered, 2)):
        got = gate.add(out[:n].bfloat16(), x[:n].bfloat16(), A, Bt)
        want = out[:n].bfloat16() + (x[:n].bfloat16().float() @ A.T @ Bt).bfloat16() * gate.weights(
            out[:n]
        )
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


def ar_only(model, steps=120, lr=3e-3):
    """A base model that knows the cycle as an AR model, and nothing of mask slots."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        ids = cycle_batch(8, 32)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def scoped(tiny_dirs, tmp_path_factory):
    """(base, converted PEFT model, export folder, prompt): a converted model that learned drafts
    with adapters on mask slots only."""
    from tidar_convert.models.loading import load_base

    base, tok = load_base(str(tiny_dirs["qwen2"]))
    base = ar_only(base)
    TiDARSpec(4, base.config.mask_token_id).write(base.config)
    model = add_lora(
        copy.deepcopy(base), r=8, alpha=16, mask_token_id=tok.mask_token_id, scope="masks"
    )
    prompt = cycle_batch(1, 6, seed=3)
    with torch.no_grad():
        generate(
            prompt,
            model=model,
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=None,
            drafter="diffusion",
            plan="full",
        )
    before = model.tidar_stats["tokens_per_nfe"]
    train_tiny(model, steps=120, lr=1e-2)
    out = export(model, tok, tmp_path_factory.mktemp("scoped") / "tidar", TiDARSpec(4))
    return base, model, out, prompt, before


def test_a_half_precision_cpu_model_keeps_its_adapter_in_fp32(scoped):
    from transformers import AutoModelForCausalLM

    from tidar_convert.runtime.adapter import ensure

    _, _, out, prompt, _ = scoped
    lm = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ensure(lm)
    assert {m.tidar_lora_A.dtype for m in lm.modules() if hasattr(m, "tidar_lora_A")} == {
        torch.float32
    }
    with torch.no_grad():
        generate(
            prompt,
            model=lm,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            drafter="diffusion",
            plan="full",
        )
    assert lm.tidar_stats["tokens_per_nfe"] > 1.2  # the fp32 deltas still draft in a bf16 forward


def test_a_model_cast_to_bf16_after_its_adapter_is_attached_keeps_the_c_call(scoped, monkeypatch):
    """model.to(torch.bfloat16) after the adapter is attached casts its deltas too. The C call takes
    bf16 deltas (torch's bf16 products there made a SmolLM2-135M forward slower: bench/LOG.md, "the
    adapter's delta inside the panel pass"), and the drafts still work."""
    from transformers import AutoModelForCausalLM

    from tidar_convert.runtime import kernels
    from tidar_convert.runtime.adapter import ensure

    if kernels.panel_library() is None:
        pytest.skip("no C compiler with OpenMP: no C call")
    _, _, out, prompt, _ = scoped
    lm = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ensure(lm)
    lm.to(torch.bfloat16)
    assert {m.tidar_lora_A.dtype for m in lm.modules() if hasattr(m, "tidar_lora_A")} == {
        torch.bfloat16
    }
    taken, real = [], adapter.lora_add
    monkeypatch.setattr(adapter, "lora_add", lambda *args: taken.append(real(*args)) or taken[-1])
    with torch.no_grad():
        generate(
            prompt,
            model=lm,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            drafter="diffusion",
            plan="full",
        )
    assert taken and all(taken)
    assert lm.tidar_stats["tokens_per_nfe"] > 1.2


def test_drafts_learn_while_the_ar_model_stays_the_base(scoped):
    base, model, out, prompt, before = scoped
    lm = load(out).eval()
    assert hasattr(lm, "_tidar_gate")  # the adapter is attached on load
    with torch.no_grad():
        td = lm.generate(
            prompt,
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=None,
            drafter="diffusion",
            plan="full",
        )
    after = lm.tidar_stats["tokens_per_nfe"]
    assert torch.equal(td, ar(base, prompt, max_new_tokens=30, eos_token_id=None))
    assert after > max(1.5, before + 0.3), (before, after)  # the drafts learned
    ids = cycle_batch(2, 12, seed=5)
    with torch.no_grad():
        # plain forwards: the base
        assert torch.equal(lm(input_ids=ids).logits, base(input_ids=ids).logits)


def test_export_keeps_base_weights_and_ships_the_deltas(scoped):
    from safetensors.torch import load_file

    base, model, out, prompt, _ = scoped
    cfg = json.loads((out / "config.json").read_text())
    spec = cfg["tidar"]["adapter"]
    assert {k: spec[k] for k in ("scope", "file", "energy")} == {
        "scope": "masks",
        "file": ADAPTER_FILE,
        "energy": 0.99,
    }
    weights = load_file(out / "model.safetensors")
    for name, value in base.state_dict().items():
        if name in weights:
            assert torch.equal(weights[name], value), name
    deltas = load_file(out / ADAPTER_FILE)
    assert deltas and all(k.endswith((".lora_A", ".lora_B")) for k in deltas)
    ranks = [v.shape[0] for k, v in deltas.items() if k.endswith(".lora_A")]
    assert [min(ranks), max(ranks)] == spec["ranks"] and max(ranks) <= 8
    # "all-linear": every decoder linear
    adapted = sum(isinstance(m, torch.nn.Linear) for m in base.model.layers.modules())
    # lora.ADAPTER_LAYERS
    assert spec["layers"] == [len(ranks), adapted] and len(ranks) == round(0.75 * adapted)
    assert (out / "custom_generate" / "adapter.py").exists()
    card = (out / "README.md").read_text()
    assert (
        "act on mask\nslots only" in card
        and f"99.0% of its squared norm (ranks {spec['ranks'][0]} to {spec['ranks'][1]})" in card
    )
    assert (
        f"Of the {adapted} adapted layers, the {len(ranks)} "
        "whose delta moves their weight most are kept." in card
    )


def test_export_mask_rows_match_the_trained_model(tiny_dirs, tmp_path):
    """The shipped hook adds what PEFT's gated branch added in training, on the same rows."""
    from tidar_convert.models.loading import load_base

    base, tok = load_base(str(tiny_dirs["mistral"]))
    TiDARSpec(4, base.config.mask_token_id).write(base.config)
    model = add_lora(
        copy.deepcopy(base), r=4, alpha=8, mask_token_id=tok.mask_token_id, scope="masks"
    )
    randomize_adapters(model, seed=4)
    ids = cycle_batch(2, 8, seed=6)
    S = ids.shape[1]
    kw = dict(
        input_ids=layout.train_inputs(ids, tok.mask_token_id),
        position_ids=layout.train_position_ids(ids),
        attention_mask=layout.to_dense(layout.train_mask_mod(S, 4), 2, 2 * S, 2 * S),
    )
    with torch.no_grad():
        trained = model(**kw).logits
    lm = load(
        export(
            model,
            tok,
            tmp_path / "tidar",
            TiDARSpec(4),
            adapter_energy=1.0,
            adapter_layers=1.0,
        )
    ).eval()
    with torch.no_grad():
        shipped = lm(**kw).logits
        plain = base(**kw).logits
    assert torch.equal(shipped[:, :S], plain[:, :S])
    torch.testing.assert_close(shipped[:, S:], trained[:, S:], rtol=1e-4, atol=1e-4)
    assert (shipped[:, S:] - plain[:, S:]).abs().max() > 1e-2
    # On packed products (generate()'s CPU kernels) the packed forward adds the deltas, the hooks
    # set aside: batch 1 in the panel pass, batch 2 after the product. The AR half stays the base's,
    # bit for bit on the same kernels.
    from tidar_convert.runtime.kernels import DELTA_HOOK, packed_linears

    adapted = {m: list(m._forward_hooks) for m in lm.modules() if hasattr(m, "tidar_lora_A")}
    one = {k: v[:1] for k, v in kw.items()}
    with torch.no_grad(), packed_linears(lm), packed_linears(base):
        assert not any(
            getattr(h, DELTA_HOOK, False) for m in adapted for h in m._forward_hooks.values()
        )
        packed1, packed2 = lm(**one).logits, lm(**kw).logits
        base1 = base(**one).logits
    assert torch.equal(packed1[:, :S], base1[:, :S])
    torch.testing.assert_close(packed1, trained[:1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed2, trained, rtol=1e-4, atol=1e-4)
    assert {m: list(m._forward_hooks) for m in adapted} == adapted  # the hooks back, in their order


def test_compress_keeps_the_asked_share_of_each_delta():
    from tidar_convert.models.lora import compress

    g = torch.Generator().manual_seed(0)
    # A rank-3 delta in rank-8 factors: kept whole, in 3 dimensions, at any energy below 1.
    A = torch.randn(3, 20, generator=g).repeat(3, 1)[:8] * torch.randn(8, 1, generator=g)
    B = torch.randn(12, 8, generator=g)
    A3, B3 = compress(A, B, 0.999999)
    assert A3.shape == (3, 20) and B3.shape == (12, 3)
    torch.testing.assert_close(B3 @ A3, B @ A, rtol=1e-4, atol=1e-4)
    # A full-rank delta: the fewest singular values holding the share, and the error it leaves.
    A, B = torch.randn(8, 20, generator=g), torch.randn(12, 8, generator=g)
    s = torch.linalg.svdvals(B @ A)
    share = s.square().cumsum(0) / s.square().sum()
    for energy in (0.5, 0.9, 0.99):
        A_, B_ = compress(A, B, energy)
        r = A_.shape[0]
        assert r == int((share < energy).sum()) + 1 and B_.shape == (12, r)
        assert share[r - 1] >= energy and (r == 1 or share[r - 2] < energy)
        err = (B_ @ A_ - B @ A).square().sum() / (B @ A).square().sum()
        # Eckart-Young: the dropped values
        torch.testing.assert_close(err, 1 - share[r - 1], rtol=1e-3, atol=1e-5)
    assert compress(A, B, 1.0) == (A, B)
    # an untrained delta (B = 0) stores one zero rank
    A0, B0 = compress(A, torch.zeros_like(B), 0.99)
    assert A0.shape == (1, 20) and not (B0 @ A0).any()


def test_strongest_keeps_the_layers_whose_delta_moves_their_weight_most():
    from tidar_convert.models.lora import strongest

    weights = {
        "a": 10 * torch.eye(4),
        "b": torch.eye(4),
        "c": torch.eye(4),
        "d": 100 * torch.eye(4),
    }  # ||W||: 20, 2, 2, 200
    sizes = {"a": 4.0, "b": 0.3, "c": 1.0, "d": 20.0}  # ||B A||; against ||W||: 0.2, 0.15, 0.5, 0.1
    tensors = {}
    for n, s in sizes.items():
        tensors[f"{n}.lora_A"], tensors[f"{n}.lora_B"] = (
            torch.tensor([[1.0, 0, 0, 0]]),
            torch.tensor([[s], [0.0], [0.0], [0.0]]),
        )

    def kept(share):
        return sorted({k.rsplit(".", 1)[0] for k in strongest(tensors, weights, share)})

    assert kept(0.5) == ["a", "c"]  # d has the largest delta, but the smallest against its weight
    assert kept(0.75) == ["a", "b", "c"] and kept(1.0) == ["a", "b", "c", "d"]
    assert kept(0.01) == ["c"]  # at least one
    assert strongest(tensors, weights, 0.5)["a.lora_B"] is tensors["a.lora_B"]  # kept as they are


@pytest.mark.parametrize(
    "setting,value",
    [
        ("adapter_energy", 0.0),
        ("adapter_energy", 1.5),
        ("adapter_energy", -0.1),
        ("adapter_layers", 0.0),
        ("adapter_layers", 1.5),
    ],
)
def test_a_bad_adapter_setting_is_refused_before_anything_is_written(
    scoped, tmp_path, setting, value
):
    base, model, out, prompt, _ = scoped
    from tidar_convert.cli import export_cmd

    with pytest.raises(ValueError, match=rf"{setting}={value}.*\(0, 1\]"):
        export(model, None, tmp_path / "x", TiDARSpec(4), **{setting: value})
    with pytest.raises(ValueError, match=rf"{setting}={value}"):
        export_cmd("no-such.ckpt", str(tmp_path / "y"), **{setting: value})
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.subprocess
def test_scoped_export_runs_without_tidar_convert_installed(scoped):
    _, _, out, prompt, _ = scoped
    script = textwrap.dedent(
        f"""
        import sys, json, torch
        sys.modules["tidar_convert"] = None
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        ids = torch.tensor({prompt.tolist()})
        td = m.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                        drafter="diffusion",
                        plan="adaptive")  # T/NFE from token counts, not timings
        stats = dict(m.tidar_stats)
        plain = m.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, tidar=False)
        print(json.dumps({{"same": torch.equal(td, plain), "tpn": stats["tokens_per_nfe"],
                           "gate": hasattr(m, "_tidar_gate")}}))
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["same"] and got["gate"] and got["tpn"] > 1.5, got


def test_a_scoped_export_missing_its_adapter_is_named(scoped, tmp_path):
    import shutil

    from tidar_convert.exports.folder import check_export

    _, _, out, _, _ = scoped
    copy_dir = tmp_path / "copy"
    shutil.copytree(out, copy_dir)
    (copy_dir / ADAPTER_FILE).unlink()
    with pytest.raises(
        FileNotFoundError, match=f"lacks {ADAPTER_FILE}, the adapter its drafts come from"
    ):
        check_export(copy_dir)


@pytest.mark.fit
def test_fit_with_mask_scope_exports_the_base_weights_and_the_adapter(tmp_path, tiny_dirs):
    """Through the CLI: the flag reaches the module, training moves only the adapters, the export
    ships them apart and decodes exactly as the base."""
    from pathlib import Path

    from safetensors.torch import load_file

    from tidar_convert.cli import main

    recipe = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
    main(
        [
            "fit",
            "--config",
            recipe,
            "--model.model",
            str(tiny_dirs["qwen3"]),
            "--model.lora_r",
            "4",
            "--model.lora_scope",
            "masks",
            "--model.distill_weight",
            "1.0",
            "--trainer.max_steps",
            "3",
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    out = tmp_path / "out"
    assert any(
        v.abs().max() > 0 for k, v in load_file(out / ADAPTER_FILE).items() if k.endswith("lora_B")
    )  # trained
    assert_writes_as_the_base(out, tiny_dirs["qwen3"], cycle_batch(1, 6, seed=1), 12)


def assert_writes_as_the_base(out, base_dir, prompt, new_tokens):
    """The export's weights are the base's, and its TiDAR greedy output is the base's AR output."""
    from safetensors.torch import load_file

    from tidar_convert.models.loading import load_base

    base, _ = load_base(str(base_dir))
    weights = load_file(out / "model.safetensors")
    assert all(torch.equal(weights[n], v) for n, v in base.state_dict().items() if n in weights)
    lm = load(out).eval()
    with torch.no_grad():
        assert torch.equal(
            lm.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None),
            ar(base, prompt, max_new_tokens=new_tokens, eos_token_id=None),
        )


def test_split_halves_give_the_one_forward_loss_and_gradients(tiny_dirs, monkeypatch):
    """Under lora_scope='masks' the clean half runs without autograd and hands its cache to the mask
    half: the same loss and the same adapter gradients as one forward over both halves."""
    from tidar_convert.train.module import TiDARModule

    m = TiDARModule(
        model=str(tiny_dirs["qwen2"]),
        draft_length=4,
        lora_r=4,
        lora_scope="masks",
        distill_weight=0.5,
    )
    m.configure_model()
    randomize_adapters(m.model, seed=2)
    ids = cycle_batch(2, 16, seed=4)
    doc_ids = torch.zeros_like(ids)
    doc_ids[0, 9:] = 1  # a document boundary: its isolation must hold across the two forwards
    params = [p for p in m.model.parameters() if p.requires_grad]

    def run():
        out = m.forward_tidar(ids, doc_ids)
        return out, torch.autograd.grad(out["loss"], params)

    assert m.split_halves
    split, split_grads = run()
    monkeypatch.setattr(TiDARModule, "split_halves", property(lambda self: False))
    one, one_grads = run()
    for key in one:
        torch.testing.assert_close(split[key], one[key], rtol=1e-5, atol=1e-6)
    for a, b in zip(split_grads, one_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert sum(g.abs().sum() for g in split_grads) > 0


@pytest.mark.fit
def test_the_default_recipe_keeps_what_the_base_writes(tmp_path, tiny_dirs, monkeypatch):
    """`make convert`'s recipe, as shipped (but a tiny model, its stdlib data alone and a few
    steps): the export's weights are the base's and TiDAR decoding writes what the base writes. A
    default that trains the AR half (the full fine-tune it was until 2026-12) fails here."""
    from pathlib import Path

    from tidar_convert.cli import main

    recipe = str(Path(__file__).parents[1] / "recipes" / "smollm2-135m-cpu.yaml")
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the recipe's runs/ folder lands here
    main(
        [
            "fit",
            "--config",
            recipe,
            "--model.model",
            str(tiny_dirs["llama"]),
            "--data.source",
            "stdlib",
            "--data.greedy_docs",
            "8",
            "--data.greedy_new_tokens",
            "8",
            "--trainer.max_steps",
            "3",
            "--trainer.val_check_interval",
            "3",
            "--data.val_batches",
            "1",
            "--model.val_decode_prompts",
            "1",
            "--trainer.logger",
            "false",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert (tmp_path / "out" / ADAPTER_FILE).exists()
    assert_writes_as_the_base(tmp_path / "out", tiny_dirs["llama"], cycle_batch(2, 6, seed=3), 16)
