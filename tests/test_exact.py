"""Exact by construction (issue 35): on one product for every row (the panel kernel for every linear
layer, the same library's attention), a row is computed with the same bits in any step. So TiDAR's
verify rows are AR's logits bit for bit, and greedy TiDAR writes AR's tokens even where two tokens'
logits are closer than the noise between products (near-ties built here)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import cycle_batch

from tidar_convert.runtime import kernels, panel
from tidar_convert.runtime.generate import generate

pytestmark = pytest.mark.skipif(
    panel.panel_library() is None, reason="no C compiler with OpenMP: no kernel library"
)


def attend(q, k, v, mask=None, causal=False):
    return panel.attention(q, k, v, mask, causal, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 1, 128), (96, 1, 16)])
def test_attention_is_sdpas_and_each_query_the_same_in_any_step(heads, kv_heads, dim):
    """torch's values (to fp32 rounding); and a query's output bit for bit the same alone or among
    others, with masked keys appended or holes in the cache, and as a prefill's row or a decode
    step's query. 96 heads on one key/value head: more pairs than the kernel's vectors hold
    at once."""
    g = torch.Generator().manual_seed(0)
    B, Q, L = 2, 12, 70
    k, v = (
        torch.randn(B, kv_heads, L, dim, generator=g),
        torch.randn(B, kv_heads, L, dim, generator=g),
    )
    q = torch.randn(B, heads, Q, dim, generator=g)
    mask = torch.rand(B, 1, Q, L, generator=g) > 0.3
    mask[..., 0] = True
    full = attend(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    for i in (0, 5, Q - 1):  # alone
        assert torch.equal(
            attend(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1])[:, 0], full[:, i]
        )
    # keys nobody sees, appended or in the middle of the cache (a rejected draft's slot, a batch
    # row's hole)
    junk = torch.randn(B, kv_heads, 5, dim, generator=g)
    none = torch.zeros(B, 1, Q, 5, dtype=torch.bool)
    assert torch.equal(
        attend(q, torch.cat([k, junk], 2), torch.cat([v, junk], 2), torch.cat([mask, none], -1)),
        full,
    )
    holed = [torch.cat([t[:, :, :30], junk, t[:, :, 30:]], 2) for t in (k, v)]
    assert torch.equal(
        attend(q, *holed, torch.cat([mask[..., :30], none, mask[..., 30:]], -1)), full
    )
    # a per-head mask: each head's own row
    per_head = torch.rand(B, heads, Q, L, generator=g) > 0.5
    per_head[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=per_head, enable_gqa=True).transpose(
        1, 2
    )
    torch.testing.assert_close(attend(q, k, v, per_head), ref, rtol=1e-5, atol=1e-5)
    # causal (a prefill: torch's top-left is_causal), and its row i as a decode step's one query
    qp = torch.randn(B, heads, L, dim, generator=g)
    prefill = attend(qp, k, v, causal=True)
    torch.testing.assert_close(
        prefill,
        F.scaled_dot_product_attention(qp, k, v, is_causal=True, enable_gqa=True).transpose(1, 2),
        rtol=1e-5,
        atol=1e-5,
    )
    assert torch.equal(attend(qp[:, :, 40:41], k[:, :, :41], v[:, :, :41])[:, 0], prefill[:, 40])
    mask[1, 0, 3] = False  # a query that sees nothing (a padded row): zeros, not NaN
    assert not attend(q, k, v, mask)[1, 3].any()


def test_exact_attention_runs_only_what_it_computes(untrained, monkeypatch):
    """sdpa_exact takes fp32 or bf16 bool-masked attention on CPU; fp16, an additive mask,
    softcapping or sinks go to sdpa_gqa (transformers' values)."""
    calls = []
    monkeypatch.setattr(
        kernels, "panel_attention", lambda *a: calls.append("kernel") or torch.zeros(1)
    )
    monkeypatch.setattr(kernels, "sdpa_gqa", lambda *a, **kw: calls.append("sdpa") or (None, None))
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16)
    module = torch.nn.Module()
    # gradients on: training, which the kernel has no backward for
    kernels.sdpa_exact(module, q, k, k, None)
    torch.set_grad_enabled(False)
    kernels.sdpa_exact(module, q, k, k, torch.ones(1, 1, 3, 5, dtype=torch.bool))
    kernels.sdpa_exact(module, q, k, k, None)
    kernels.sdpa_exact(module, q.bfloat16(), k.bfloat16(), k.bfloat16(), None)
    kernels.sdpa_exact(module, q.half(), k.half(), k.half(), None)
    kernels.sdpa_exact(module, q, k, k, torch.zeros(1, 1, 3, 5))
    kernels.sdpa_exact(module, q, k, k, None, softcap=30.0)
    kernels.sdpa_exact(module, q, k, k, None, s_aux=torch.zeros(4))
    kernels.sdpa_exact(
        module, torch.randn(1, 4, 3, 12), torch.randn(1, 2, 5, 12), torch.randn(1, 2, 5, 12), None
    )  # head_dim 12
    torch.set_grad_enabled(True)
    assert calls == ["sdpa", "kernel", "kernel", "kernel", "sdpa", "sdpa", "sdpa", "sdpa", "sdpa"]
    model = untrained["llama"]
    with kernels.cpu_kernels(model, True):
        assert model.config._attn_implementation == kernels.EXACT_ATTENTION  # every layer on panels
    with kernels.cpu_kernels(model, "auto"):
        exact = set(kernels.linear_products(model, kernels.packing_pays(model))) == {"panels"}
        assert (model.config._attn_implementation == kernels.EXACT_ATTENTION) == exact
    assert model.config._attn_implementation == "sdpa"


def near_ties(model, tokens, eps: float = 1e-7):
    """Give each of `tokens` a twin: another vocabulary row equal to its row up to eps, so wherever
    AR picks one of them the other's logit is within rounding noise of it."""
    head = model.get_output_embeddings().weight
    used = set(tokens)
    free = [t for t in range(head.shape[0]) if t not in used][: len(tokens)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a, b in zip(tokens, free):
            head[b] = head[a] * (1 + eps * torch.randn(head.shape[1], generator=g))


@pytest.mark.parametrize(
    "family,dtype",
    [("llama", torch.float32), ("mistral", torch.float32), ("llama", torch.bfloat16)],
)
def test_tidar_verify_rows_are_ars_logits_bit_for_bit_even_at_near_ties(trained, family, dtype):
    """Every drafter, chains and trees: TiDAR's logits at each new position equal tidar=False's bit
    for bit, on the trained model (drafts accepted: verify rows several to a step) and again once
    each token it writes has a near-tied twin (AR then picks by the low bits, and drafts get
    rejected); a padded batch (per-row acceptance, holes in the cache) writes AR's tokens. On the
    stock product the logits are not equal (the test can fail). In bf16 on bf16 panels too (a
    near-tie there is one bf16 step, the noise between products many)."""
    model, _ = trained[family]
    if dtype != torch.float32:
        model = copy.deepcopy(model).to(dtype)
        assert kernels.candidates(dtype)[0] == "panels"
    head = model.get_output_embeddings().weight
    saved = head.detach().clone()
    ids = cycle_batch(1, 10, seed=3)
    kw = dict(
        model=model,
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    rows = cycle_batch(2, 12, seed=5)
    mask = torch.ones_like(rows)
    rows[1, :4], mask[1, :4] = 0, 0
    plain = dict(
        model=model,
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=mask,
        pack_weights=True,
    )
    try:
        # the untied pass's AR output (bound by its first iteration): the tied pass twins its tokens
        ar = None
        for tied in (False, True):
            if tied:
                near_ties(
                    model,
                    sorted(set(ar.sequences[0].tolist())),
                    1e-7 if dtype == torch.float32 else 4e-3,  # bf16: about one step
                )
            ar = generate(ids, tidar=False, pack_weights=True, **kw)
            for drafter in ("hybrid", "diffusion", "lookup"):
                for siblings in (0, 3):
                    out = generate(ids, drafter=drafter, siblings=siblings, pack_weights=True, **kw)
                    assert torch.equal(out.sequences, ar.sequences), (tied, drafter, siblings)
                    assert all(
                        torch.equal(a, b) for a, b in zip(out.logits, ar.logits, strict=True)
                    ), (tied, drafter, siblings)
                    stats = model.tidar_stats
                    # steps of several rows
                    assert stats["draft_sources"][drafter if drafter != "hybrid" else "lookup"] > 0
                    assert tied or drafter == "lookup" or stats["tokens_per_nfe"] > 1.5, (
                        drafter,
                        siblings,
                        stats,
                    )  # drafts accepted
            # per row, holes in the cache
            assert torch.equal(generate(rows, **plain), generate(rows, tidar=False, **plain))
        stock = generate(ids, pack_weights=False, **kw)
        assert not all(
            torch.equal(a, b)
            for a, b in zip(
                stock.logits, generate(ids, tidar=False, pack_weights=False, **kw).logits
            )
        )
    finally:
        with torch.no_grad():
            head.copy_(saved)
